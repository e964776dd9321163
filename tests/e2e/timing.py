"""Time in the end-to-end tests: the gateway's clock, and the margins of what must run in real time.

A test that waits for a window to slide asks its gateway's clock to get there:

- `EmulatorClock`: the filter in the host emulator (harness `Emulator`) stamps permits with its wall clock
  (rules with the default `clock: "gateway"`), which `Emulator.advance_clock()` moves ahead. Nothing sleeps,
  so the test does not depend on how fast the machine is; give such a gateway long windows (a minute) and
  nothing it does in real time between two steps can cross a window boundary. Redis TTLs stay real time:
  keep `keep_alive` at its default (1 h) or longer than the test.
- `RealClock`: real Envoy, whose clock cannot be moved; the test sleeps. A sleep is only ever a lower bound
  (a loaded machine makes it longer, never shorter), so a test that waits *for* a window boundary this way
  is safe; what can fail on a slow machine is an upper bound (steps that must happen *before* a boundary),
  and each such test states its margin.

Both read the same machine clock the gateways use, so a permit's score read from Redis is comparable with
`now_ms()`.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

from harness import Emulator, epoch_ms, limiter_key

# Latency bounds (e.g. `elapsed < TIMEOUT_S + LATENCY_MARGIN_S`): what a request may take beyond the Redis
# timeout on a loaded 2-CPU CI machine: the gateway (Envoy, or a debug wasm-host), webdis, Redis, the test
# client and process start-up. Measured: 1-50 ms with two busy CPU hogs beside the tests; 1.5 s is 30x that,
# and TIMEOUT_S + 1.5 s stays well below the Redis pauses the tests use (5 s and more), so a request that
# waited for Redis to come back rather than for the timeout still fails the bound.
LATENCY_MARGIN_S = 1.5


class GatewayClock(Protocol):
    """The wall clock a gateway's filter stamps permits with."""

    virtual: bool

    def now_ms(self) -> float:
        """The gateway's wall clock, epoch ms."""
        ...

    def wait_until_ms(self, when_ms: float) -> None:
        """Returns once the gateway's clock has reached `when_ms` (at once if it has)."""
        ...


class RealClock:
    """Real Envoy's clock: the machine's; waiting is sleeping."""

    virtual = False

    def now_ms(self) -> float:
        return epoch_ms()

    def wait_until_ms(self, when_ms: float) -> None:
        while (remaining_ms := when_ms - epoch_ms()) > 0:
            time.sleep(remaining_ms / 1000.0)


class EmulatorClock:
    """The emulator's guest wall clock: the machine's plus the emulator's offset; waiting moves it."""

    virtual = True

    def __init__(self, emulator: Emulator):
        self.emulator = emulator
        self.offset_ms = emulator.advance_clock(0)  # an offset earlier tests left stays

    def now_ms(self) -> float:
        return epoch_ms() + self.offset_ms

    def wait_until_ms(self, when_ms: float) -> None:
        ahead = math.ceil(when_ms - self.now_ms())
        if ahead > 0:
            self.offset_ms = self.emulator.advance_clock(ahead)


def permit_scores(redis, name: str) -> list[float]:
    """The scores (epoch ms of the acquires, by the acquiring gateway's clock) of the limiter `name`'s
    overall permits, oldest first."""
    return [score for _, score in redis.zrange(limiter_key(name, "permits"), 0, -1, withscores=True)]
