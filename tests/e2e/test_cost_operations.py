"""Token budgets (a rule's `cost`, docs/configuration.md "Costs known after the response") through what an
operator does to a running gateway: configuration pushes. Real stock Envoy with the stock build, webdis, a
real redis-server and `llm_upstream.LlmUpstream` answering as OpenAI does.

What a user would notice if it broke:

- after a configuration push (LDS) replaced a configuration that held leases, the requests of the new
  configuration keep their whole reservation: nothing is settled to the tokens their responses reported
  (the new filter's tick had been set on the old root context, which went away when the old listener
  drained: "a filter owns its tick").
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import harness as h
from test_cost import LlmGateway, llm_server, members  # noqa: F401 - llm_server is a fixture
from test_leases import hot_rule
from test_leases import members as lease_members

RESERVE = 1000
USAGE = 30  # what LlmGateway.ask's answers report by default: 10 input + 20 output tokens
SETTLE_S = 1.0  # a settle call goes out from the root context's next tick (10 ms); 1 s is generous
DRAIN_S = 1  # Envoy's --drain-time-s: how long an old listener's filter chains drain after a push


def budget(rate: int, reserve: Any = RESERVE) -> dict:
    """The token budget: per API key (`x-api-key`), `rate` tokens a minute, each request reserving
    `reserve` and settled to the OpenAI usage of its response."""
    return h.rule("tokens", limit_by={"header": "x-api-key"}, rate=rate, interval="1m",
                  cost={"reserve": reserve, "settle": {"usage": "openai"}})


def settled_within(stack: h.Stack, name: str, permits: int, seconds: float) -> float | None:
    """The seconds until limiter `name` holds one member, settled (`-s`) to `permits`; None if it does not
    within `seconds`."""
    started = time.monotonic()
    while True:
        if [(m.random[:2], m.permits) for m in members(stack, name)] == [(b"-s", permits)]:
            return time.monotonic() - started
        if time.monotonic() - started >= seconds:
            return None
        time.sleep(0.01)


def holding(stack: h.Stack, name: str) -> str:
    """What limiter `name` holds, for a failure message: each member's mark and permits."""
    return ", ".join(f"{m.random[:2].decode(errors='replace')} {m.permits}" for m in members(stack, name)) or "none"


# --- Settles after configuration pushes ---------------------------------------------------------------------


@pytest.fixture
def draining_envoy_bin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Envoys of this test run with `--drain-time-s 1`. harness.Envoy takes no extra command-line arguments,
    so its binary is wrapped for the test: a script that execs Envoy with the harness's arguments and this
    one (exec: the harness still stops Envoy itself, by its PID)."""
    wrapper = tmp_path / "envoy"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(h.ENVOY_BIN)} "$@" --drain-time-s {DRAIN_S}\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(h, "ENVOY_BIN", str(wrapper))
    yield


def test_reservations_settle_after_configuration_pushes_replaced_one_that_held_leases(
        stack, llm_server, draining_envoy_bin):
    """Envoy (2 workers, --drain-time-s 1) with a lease rule and a token budget: requests on every worker
    (each VM takes a lease), then three pushes in a row (the budget's rate changed each time), then the old
    filter chains drain and their root contexts are deleted, handing their leases to the newest
    configuration. Every request made after that, on either worker, is settled to the 30 tokens its
    response reported within 1 s of the response's end. (Before "a filter owns its tick", none was: the
    newest filter had set the tick of the old root it adopted from, which was being deleted, and its settle
    calls waited for a tick that never came.)"""
    configs = [h.plugin_config(hot_rule(1000, "1m", 8, "30s"), budget(100_000 + 10_000 * n)) for n in range(4)]
    envoy = stack.envoy(configs[0], reloadable=True, upstream_port=llm_server.port)
    gateway = LlmGateway("envoy", envoy, stack)

    before = gateway.on_every_vm({"x-api-key": "before"})
    assert {r.status for r in before} == {200}, before
    served = len(before)
    h.wait_until(lambda: [(m.random[:2], m.permits) for m in members(stack, "erl:tokens:before")]
                 == [(b"-s", USAGE)] * served, SETTLE_S, "the first configuration to settle its requests")
    leased = sum(p.permits for p in lease_members(stack.redis.client))
    assert leased > served, f"every worker holds a lease with permits to spare: {leased} for {served} requests"

    pushed = time.monotonic()
    for config in configs[1:]:
        envoy.reconfigure(config)
    # The old filter chains drain for DRAIN_S, then their root contexts are deleted and the newest
    # configuration settles the leases they held: each lease member keeps only the permits used.
    h.wait_until(lambda: sum(p.permits for p in lease_members(stack.redis.client)) == served, DRAIN_S + 5,
                 f"the old configurations' leases to be settled ({served} permits used)")
    print(f"\n3 pushes; the old leases were settled {time.monotonic() - pushed:.1f} s after the first")

    outcomes: list[tuple[str, int, float | None]] = []
    start = envoy.worker_connections()
    while min(now - then for now, then in zip(envoy.worker_connections(), start)) < 3 and len(outcomes) < 40:
        key = f"after-{len(outcomes)}"
        connections = envoy.worker_connections()
        assert gateway.ask({"x-api-key": key}).status == 200
        worker = max(range(envoy.concurrency), key=lambda w: envoy.worker_connections()[w] - connections[w])
        outcomes.append((key, worker, settled_within(stack, f"erl:tokens:{key}", USAGE, SETTLE_S)))
    late = [f"{key} (worker {worker}): {holding(stack, f'erl:tokens:{key}')}"
            for key, worker, took in outcomes if took is None]
    assert not late, (f"{len(late)} of {len(outcomes)} requests after the pushes not settled to {USAGE} within "
                      f"{SETTLE_S} s of their response: " + "; ".join(late) + f"; metrics {envoy.metrics()}")
    print(f"{len(outcomes)} requests after the pushes, each settled within "
          f"{max(took for _, _, took in outcomes if took is not None) * 1000:.0f} ms of its response")
