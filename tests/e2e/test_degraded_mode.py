"""The degraded mode, `failure_mode: "local"`: while Redis fails, each gateway process enforces the rules
itself at `rate / gateways` per window (docs/configuration.md, "Degraded mode"), and asks Redis again with one probe
per VM per `probe_interval`.

Two real Envoys (2 workers each) run with Redis stopped: every sliding window of their admitted requests
holds at most the rate, together and `rate / 2` each, and they admit close to the rate; the dead Redis sees
probes, not every request; when Redis is back, Redis decides again within the probe interval. The Higress
build in the emulator shares its windows across its VMs the same way.
"""

from __future__ import annotations

import time

from harness import hammer, host_plugin_config, plugin_config, rule, wait_until, worst_window

RATE = 40
INTERVAL_MS = 1_000
RULE = rule("per-user", rate=RATE, interval="1s")
DEGRADED = {"failure_mode": "local", "local_fallback": {"gateways": 2, "probe_interval": "200ms"}}
ALICE = {"x-user-id": "alice"}


def admitted(results: list[tuple[float, float, int]]) -> list[tuple[float, float]]:
    return [(start, end) for start, end, status in results if status == 200]


def test_two_gateways_hold_the_rate_together_while_redis_is_down_and_return_to_redis(stack):
    envoys = [stack.envoy(plugin_config(RULE, timeout="200ms", **DEGRADED)) for _ in range(2)]
    stack.redis.stop()
    # Two clients per gateway, so both workers of each see requests.
    sends = [lambda e=e: e.send(headers=ALICE).status for e in envoys for _ in range(2)]
    seconds = 4.0
    results = hammer(sends, seconds)
    per_gateway = [admitted(results[0] + results[1]), admitted(results[2] + results[3])]
    together = per_gateway[0] + per_gateway[1]
    statuses = {status for run in results for _, _, status in run}
    assert statuses == {200, 429}, statuses
    # Never more than the rate in any sliding window: rate / 2 per gateway (each gateway compared on its own:
    # a list comparison would be lexicographic and pass whenever the first gateway is below the bound).
    worst_each = [worst_window(spans, INTERVAL_MS) for spans in per_gateway]
    assert all(worst <= RATE // 2 for worst in worst_each), worst_each
    assert worst_window(together, INTERVAL_MS) <= RATE
    # And close to it: the buckets refuse at most about one bucket's worth (1/30 of the window) per window.
    assert len(together) >= 0.8 * RATE * seconds, len(together)
    print(f"degraded mode, 2 gateways, Redis down {seconds:.0f} s: admitted {len(together) / seconds:.1f}/s of "
          f"rate {RATE}/s; worst sliding window {worst_window(together, INTERVAL_MS)} (each gateway "
          f"{[worst_window(spans, INTERVAL_MS) for spans in per_gateway]}); {sum(len(r) for r in results)} requests")
    metrics = [envoy.metrics() for envoy in envoys]
    requests = sum(len(run) for run in results)
    decided = sum(m["fallback_allowed"] + m["fallback_rejected"] + m["failure_allowed"] + m["failure_denied"]
                  + m["allowed"] + m["rejected"] for m in metrics)
    assert decided == requests
    assert sum(m["fallback_allowed"] for m in metrics) == len(together)
    # The dead Redis is asked by probes only: one per VM per 200 ms (4 VMs), not by every request.
    calls = sum(m["redis_calls"] for m in metrics)
    assert calls <= 4 * (seconds * 1000 / 200 + 2), (calls, requests)
    print(f"Redis calls (probes) during the outage: {calls} for {requests} requests")

    stack.redis.start()
    before = [envoy.metrics()["allowed"] + envoy.metrics()["rejected"] for envoy in envoys]
    healthy_at = time.monotonic()

    def redis_decides() -> bool:
        for envoy in envoys:
            envoy.send(headers={"x-user-id": "bob"})
        return all(e.metrics()["allowed"] + e.metrics()["rejected"] > b for e, b in zip(envoys, before))

    wait_until(redis_decides, 5.0, "Redis to decide again in both gateways", interval=0.02)
    assert time.monotonic() - healthy_at < 1.0


def test_the_vms_of_a_higress_gateway_share_its_local_windows(stack):
    """(The stock build's VMs share them in the two-Envoy test above.)"""
    gateway = stack.emulator(host_plugin_config(rule("per-user", rate=10, interval="1m"), timeout="200ms",
                                                **DEGRADED), vms=2)
    stack.redis.stop()
    statuses = [gateway.send(headers=ALICE).status for _ in range(8)]
    assert statuses == [200] * 5 + [429] * 3, "10 / 2 gateways, whichever VM answers"
    rejection = gateway.send(headers=ALICE)
    # Until the oldest counted bucket leaves the window: at most the interval plus two buckets (2 s each).
    assert rejection.status == 429 and 0 < int(rejection.headers["retry-after"]) <= 64
    metrics = gateway.metrics()
    assert (metrics["fallback_allowed"], metrics["fallback_rejected"]) == (5, 4)
    assert "deciding locally" in gateway.log_text()
