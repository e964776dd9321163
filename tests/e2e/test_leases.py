"""Permit leases for hot limiters (docs/configuration.md, "Leases"): a VM takes up to `max_permits` permits in
one acquire, as one Redisson member scored at the lease's expiry, and serves the limiter's requests from them without a
Redis call until `max_age` has passed; the next acquire settles it (the member keeps the permits used, scored
at the last use; the rest go back to the limiter).

The promise checked here: never over-admit. Every sliding window of one interval over the real times of the
requests admitted, by several gateways and VMs at once, holds at most the rate; Redisson clients sharing the
limiter see ordinary members; and what leases hold back from others is returned.
"""

from __future__ import annotations

import pytest

from harness import (config_for, decode_permit, epoch_ms, hammer, limiter_key, plugin_config, round_trips, rule,
                     worst_window)
from redisson_client import RateLimiter
from timing import EmulatorClock

HOT = "erl:hot"


def hot_rule(rate: int, interval: str, max_permits: int, max_age: str, **fields) -> dict:
    return rule("hot", limit_by="global", rate=rate, interval=interval,
                lease={"max_permits": max_permits, "max_age": max_age}, **fields)


def members(redis) -> list:
    """The permit members of the hot limiter: (random, permits, score)."""
    return sorted((decode_permit(member, score) for member, score in
                   redis.zrange(limiter_key(HOT, "permits"), 0, -1, withscores=True)), key=lambda p: p.score_ms)


@pytest.mark.parametrize("build", ["envoy", "higress"])
def test_a_lease_serves_a_vms_requests_without_redis_and_is_settled_by_the_next_one(stack, build):
    gateway = stack.emulator(config_for(build, hot_rule(100, "1m", 8, "30s")), build=build, vms=1)
    clock = EmulatorClock(gateway)
    statuses = []
    calls = []
    for _ in range(8):
        statuses.append(gateway.send().status)
        calls.append(round_trips(gateway.last_outcome()))
    assert statuses == [200] * 8
    # (The first acquire may be sent twice: a new Redis has not cached the script: NOSCRIPT, then EVAL.)
    assert calls[0] in (1, 2) and calls[1:] == [0] * 7, "one acquire took 8 permits; 7 were served from them"
    [lease] = members(stack.redis.client)
    assert lease.permits == 8
    assert stack.redis.client.get(limiter_key(HOT, "value")) == b"92"
    # The member is scored at the lease's expiry: 30 s after the acquire.
    assert 29_000 <= lease.score_ms - epoch_ms() <= 30_500, lease

    sent = clock.now_ms()
    assert gateway.send().status == 200
    assert round_trips(gateway.last_outcome()) == 1, "used up: a new lease, and the old one settled"
    old, new = members(stack.redis.client)
    assert old.random == lease.random and old.permits == 8, "all 8 were used: the member keeps them"
    assert old.score_ms <= sent + 50, "scored at its last use, not at its expiry"
    assert new.permits == 8 and new.score_ms >= lease.score_ms
    assert gateway.metrics()["leases"] == 2


def test_unused_lease_permits_go_back_and_the_next_lease_asks_for_what_was_used(stack):
    gateway = stack.emulator(plugin_config(hot_rule(100, "1m", 8, "2s")), vms=1)
    clock = EmulatorClock(gateway)
    assert [gateway.send().status for _ in range(3)] == [200] * 3
    assert stack.redis.client.get(limiter_key(HOT, "value")) == b"92", "8 leased, 3 used"
    clock.wait_until_ms(clock.now_ms() + 2_100)  # the lease expired with 5 unused
    assert gateway.send().status == 200
    old, new = members(stack.redis.client)
    assert old.permits == 3, "the old member keeps the 3 permits used"
    assert new.permits == 3, "this VM served 3 in a lease's age: its next lease asks for 3"
    assert stack.redis.client.get(limiter_key(HOT, "value")) == b"94", "100 - 3 used - 3 of the new lease"


def test_redisson_clients_on_the_same_limiter_see_the_lease_as_permits_taken(stack):
    gateway = stack.emulator(plugin_config(hot_rule(10, "1m", 4, "30s")), vms=1)
    assert gateway.send().status == 200  # a lease of 4 permits
    java = RateLimiter(stack.redis.client, HOT)
    assert java.available_permits() == 6
    assert [java.try_acquire().acquired for _ in range(7)] == [True] * 6 + [False]
    assert [gateway.send().status for _ in range(3)] == [200] * 3, "the lease's 3 other permits, without Redis"
    assert [round_trips(outcome) for outcome in gateway.outcomes[-3:]] == [0] * 3
    assert gateway.send().status == 429, "nothing left anywhere: the window holds the rate"
    assert sum(p.permits for p in members(stack.redis.client)) == 10


def saturate(senders: list, seconds: float) -> list[tuple[float, float, int]]:
    """Sends requests from every sender at once (one thread each) for `seconds`: (start, end, status) of
    each, times in epoch ms."""
    return [result for results in hammer(senders, seconds) for result in results]


def check_windows(results: list[tuple[float, float, int]], rate: int, interval_ms: int) -> tuple[int, int]:
    admitted = [(start, end) for start, end, status in results if status == 200]
    assert {status for _, _, status in results} <= {200, 429}
    worst = worst_window(admitted, interval_ms)
    assert worst <= rate, f"{worst} admitted requests within one {interval_ms} ms window, rate {rate}"
    return len(admitted), worst


# Per gateway: the rate, the lease's `max_permits`, the clients sending to each gateway process, and how
# saturated the run must be (requests sent > this x requests admitted). An emulator answers one request at a
# time: one client per emulator, its VMs in turn.
LOADS = {"envoy": (30, 8, 3, 2), "emulator-envoy": (20, 6, 1, 4), "emulator-higress": (20, 6, 1, 4)}


def test_every_window_of_real_admissions_by_two_gateways_of_two_vms_holds_at_most_the_rate(stack, start_gateway,
                                                                                           gateway_kind):
    """2 gateway processes x 2 VMs, saturated, a lease long against the interval (300 ms of 1 s): if a lease's
    member were scored at its acquire, its later uses would fall outside the window Redis counts, and the
    windows would hold up to rate + leased permits."""
    rate, max_permits, clients, saturated = LOADS[gateway_kind]
    interval_ms = 1_000
    gateways = [start_gateway(hot_rule(rate, "1s", max_permits, "300ms")) for _ in range(2)]
    senders = [lambda g=g: g.send().status for g in gateways for _ in range(clients)]
    results = saturate(senders, 3.5)
    admitted, worst = check_windows(results, rate, interval_ms)
    assert len(results) > saturated * admitted, "saturated: most requests rejected"
    assert worst >= rate // 2, "and the windows do fill"
    assert sum(g.metrics()["leases"] for g in gateways) > 0
