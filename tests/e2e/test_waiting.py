"""Waiting for permits (`max_wait` on a rule; docs/configuration.md, "Waiting for permits") in real Envoy:
a request over the rate waits for its permits, asking Redis again after the delay each rejection answers
(Redisson's `tryAcquire(permits, timeout)` loop), instead of getting a 429 at once; past `max_wait` it
gets the usual refusal."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness import Monitor, limiter_key, plugin_config, rule, user

ALICE = "erl:per-user:alice"


def test_requests_over_the_rate_wait_for_their_permits_up_to_max_wait(stack):
    """A rate of 5 per second with `max_wait` 1.5 s, and 12 requests at once through one Envoy (2 workers):
    5 go through at once; the 7 others wait, ask again when the first permits leave the window (about 1 s
    later), and 5 of them go through then; the last 2 would need another second, past 1.5 s: they get 429
    then. No request waits past `max_wait` (+ a margin for a loaded machine), and no sliding second of
    Redis's own permit scores holds more than 5."""
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1s", max_wait="1500ms")), concurrency=2)

    together = threading.Barrier(12)

    def timed() -> tuple[int, float]:
        together.wait(10.0)  # all 12 leave together: each one's time is from the same start
        started = time.monotonic()
        response = envoy.send(headers=user("alice"))
        return response.status, time.monotonic() - started

    permits = limiter_key(ALICE, "permits")
    scores: list[float] = []  # every permit taken, by the ZADD Redis ran (MONITOR: the window drops old ones)

    def record(args: list[str]) -> None:
        # (The batch script's out-of-memory probe is a `ZADD ... XX 0 ''` that adds nothing.)
        if args[0].lower() == "zadd" and args[1:2] == [permits] and args[2] != "XX":
            scores.append(float(args[2]))

    with Monitor(stack.redis, record), ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(lambda _: timed(), range(12)))
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200] * 10 + [429] * 2, answers
    waited = sorted(seconds for status, seconds in answers if status == 200)
    assert all(seconds < 0.5 for seconds in waited[:5]), f"the first 5 at once: {answers}"
    assert all(0.9 < seconds < 1.5 for seconds in waited[5:]), f"5 more once the window slid: {answers}"
    refused = [seconds for status, seconds in answers if status == 429]
    assert all(seconds < 1.5 + 0.3 for seconds in refused), f"refused by max_wait, not later: {answers}"
    assert len(scores) == 10, scores
    window = 1000
    worst = max(sum(1 for other in scores if start <= other < start + window) for start in scores)
    assert worst <= 5, f"a sliding window of {window} ms held {worst} permits: {scores}"
    metrics = envoy.metrics()
    counts = [metrics.get(name, 0) for name in ("waited_admitted", "waited_rejected", "wait_queue_full")]
    assert counts == [5, 2, 0], metrics
    assert (metrics.get("allowed"), metrics.get("rejected")) == (10, 2), metrics
