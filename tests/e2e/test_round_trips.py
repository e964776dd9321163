"""One Redis round trip per request, counted by Redis itself and by the filter's Envoy metrics."""

from __future__ import annotations

from harness import METRIC_PREFIX, HarnessError, plugin_config, rule

COUNTERS = ("allowed", "rejected", "local_rejected", "failure_allowed", "failure_denied", "redis_calls", "redis_errors",
            "host_errors", "leases", "lease_settlements", "lease_permits_lost", "compensations", "fallback_allowed",
            "fallback_rejected", "exempt",
            "rule.per-user.allowed", "rule.per-user.rejected", "rule.per-user.local_rejected",
            "rule.per-user.shadow_rejected", "rule.per-user.failures")


def warm_up_every_worker(envoy, headers: dict[str, str], limit: int = 40) -> int:
    """Sends requests (fresh connections) until each worker, one wasm VM each, has served one; returns how
    many were sent."""
    for sent in range(1, limit + 1):
        assert envoy.send(headers=headers).status == 200
        if min(envoy.worker_connections()) > 0:
            return sent
    raise HarnessError(f"{limit} connections did not reach every worker: {envoy.worker_connections()}")


def test_metrics_are_envoy_stats_with_the_wasmcustom_prefix(stack):
    envoy = stack.envoy(plugin_config(rule()))

    stats = envoy.stats()
    assert {name for name in stats if name.startswith(METRIC_PREFIX)} == {METRIC_PREFIX + c for c in COUNTERS}
    assert all(stats[METRIC_PREFIX + counter] == 0 for counter in COUNTERS)


def test_one_redis_round_trip_per_request_once_the_limiter_exists(stack):
    envoy = stack.envoy(plugin_config(rule(rate=30, interval="1m")))
    alice = {"x-user-id": "alice"}
    warm = warm_up_every_worker(envoy, alice)

    scripts_before, metrics_before = stack.redis.script_calls(), envoy.metrics()
    statuses = [envoy.send(headers=alice).status for _ in range(30 - warm + 3)]
    scripts_after, metrics_after = stack.redis.script_calls(), envoy.metrics()

    assert statuses == [200] * (30 - warm) + [429] * 3
    delta = {name: metrics_after[name] - metrics_before[name] for name in COUNTERS}
    # Redis rejects the first request past the rate; the local block, shared by every worker, the next two.
    assert delta == {
        "allowed": 30 - warm,
        "rejected": 3,
        "local_rejected": 2,
        "failure_allowed": 0,
        "failure_denied": 0,
        "redis_calls": len(statuses) - 2,
        "redis_errors": 0,
        "host_errors": 0,
        "leases": 0,
        "lease_settlements": 0,
        "lease_permits_lost": 0,
        "compensations": 0,
        "fallback_allowed": 0,
        "fallback_rejected": 0,
        "exempt": 0,
        "rule.per-user.allowed": 30 - warm,
        "rule.per-user.rejected": 3,
        "rule.per-user.local_rejected": 2,
        "rule.per-user.shadow_rejected": 0,
        "rule.per-user.failures": 0,
    }
    assert scripts_after - scripts_before == len(statuses) - 2, "Redis ran one script per request it saw"


def test_a_new_limiter_is_created_and_decided_in_one_round_trip(stack):
    # The warm-up may take up to 40 requests of one user before every worker has served one: a rate above that.
    envoy = stack.envoy(plugin_config(rule(rate=50, interval="1m")))
    warm_up_every_worker(envoy, {"x-user-id": "warm-up"})  # the script is cached in Redis now

    before = stack.redis.script_calls()
    assert envoy.send(headers={"x-user-id": "newcomer"}).status == 200
    assert stack.redis.script_calls() - before == 1
    assert stack.redis.client.hget("erl:per-user:newcomer", "rate") == b"50"
