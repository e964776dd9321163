"""One Redis round trip per request, counted by Redis itself and by the filter's metrics (Envoy's stats, the
emulator's counters)."""

from __future__ import annotations

import pytest

from harness import METRIC_PREFIX, plugin_config, rule

COUNTERS = ("allowed", "rejected", "local_rejected", "failure_allowed", "failure_denied", "redis_calls", "redis_errors",
            "host_errors", "leases", "lease_settlements", "lease_permits_lost", "compensations", "fallback_allowed",
            "fallback_rejected", "exempt", "batches", "batched_calls", "settlements", "settled_without_usage",
            "settled_unanswered", "settlements_lost", "late_given_back", "late_unanswered", "waited_admitted",
            "waited_rejected", "wait_queue_full", "rule.per-user.allowed", "rule.per-user.rejected", "rule.per-user.local_rejected",
            "rule.per-user.shadow_rejected", "rule.per-user.failures")


def warm_up_every_vm(gateway, headers: dict[str, str]) -> int:
    """Requests until every VM (Envoy: worker) has served one, all allowed; returns how many were sent."""
    statuses = [response.status for response in gateway.on_every_vm(headers, most=40)]
    assert statuses == [200] * len(statuses)
    return len(statuses)


def test_metrics_are_envoy_stats_with_the_wasmcustom_prefix(stack):
    envoy = stack.envoy(plugin_config(rule()))

    stats = envoy.stats()
    assert {name for name in stats if name.startswith(METRIC_PREFIX)} == {METRIC_PREFIX + c for c in COUNTERS}
    assert all(stats[METRIC_PREFIX + counter] == 0 for counter in COUNTERS)


# In real Envoy and in the Higress build in the emulator (as before; the stock build is checked in Envoy).
@pytest.mark.parametrize("gateway_kind", ["envoy", "emulator-higress"])
def test_one_redis_round_trip_per_request_once_the_limiter_exists(stack, start_gateway):
    """Once each VM has served alice (its first acquire after a Redis restart may need an EVAL after the
    EVALSHA), each request is one script run by Redis, until Redis rejects one."""
    gateway = start_gateway(rule(rate=30, interval="1m"))
    alice = {"x-user-id": "alice"}
    warm = warm_up_every_vm(gateway, alice)

    scripts_before, metrics_before, sent = stack.redis.script_calls(), gateway.metrics(), gateway.sent()
    statuses = [gateway.send(headers=alice).status for _ in range(30 - warm + 3)]
    scripts_after, metrics_after = stack.redis.script_calls(), gateway.metrics()

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
        "batches": 0,  # one request at a time: nothing waits, nothing is batched
        "batched_calls": 0,
        "settlements": 0,  # no rule with `cost`
        "settled_without_usage": 0,
        "settled_unanswered": 0,
        "settlements_lost": 0,
        "late_given_back": 0,  # every request waited for its reply
        "late_unanswered": 0,
        "waited_admitted": 0,  # no rule with `max_wait`
        "waited_rejected": 0,
        "wait_queue_full": 0,
        "rule.per-user.allowed": 30 - warm,
        "rule.per-user.rejected": 3,
        "rule.per-user.local_rejected": 2,
        "rule.per-user.shadow_rejected": 0,
        "rule.per-user.failures": 0,
    }
    assert scripts_after - scripts_before == len(statuses) - 2, "Redis ran one script per request it saw"
    if gateway.emulated:  # the emulator also counts each request's calls: none for the two blocked
        assert gateway.round_trips_since(sent) == [1] * (len(statuses) - 2) + [0, 0]


# Real Envoy only (as before; not written for the emulator).
@pytest.mark.parametrize("gateway_kind", ["envoy"])
def test_a_new_limiter_is_created_and_decided_in_one_round_trip(stack, start_gateway):
    # The warm-up may take up to 40 requests of one user before every worker has served one: a rate above that.
    gateway = start_gateway(rule(rate=50, interval="1m"))
    warm_up_every_vm(gateway, {"x-user-id": "warm-up"})  # the script is cached in Redis now

    before = stack.redis.script_calls()
    assert gateway.send(headers={"x-user-id": "newcomer"}).status == 200
    assert stack.redis.script_calls() - before == 1
    assert stack.redis.client.hget("erl:per-user:newcomer", "rate") == b"50"
