"""The gateway and a Redisson client enforce one limiter: the filter in real Envoy, and beside it the
independent Redisson-compatible client of `redisson_client.py` (written from Redisson's documented layout
and scripts, sharing no code with the filter's) acquiring from the same Redis keys.
"""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

from harness import (
    decode_permit,
    epoch_ms,
    erl_admin,
    limiter_key,
    plugin_config,
    retry_after_range,
    rule,
    wait_until,
)
from redisson_client import OVERALL, RateLimiter
from timing import RealClock, permit_scores

ALICE = "erl:per-user:alice"
HEADERS = {"x-user-id": "alice"}


def remaining(response) -> int:
    """`r` of the draft `RateLimit` header: `"per-user";r=4;t=60`."""
    match = re.search(r";r=(\d+)", response.headers["ratelimit"])
    assert match, response.headers
    return int(match.group(1))


def java_service(stack, name: str = ALICE, **try_set_rate) -> RateLimiter:
    """A Redisson client instance (its own UUID and clock) on the stack's Redis; with `rate` and
    `interval_ms`, it first calls trySetRate as a Java service does at startup (an existing limiter wins)."""
    client = RateLimiter(stack.redis.client, name)
    if try_set_rate:
        client.try_set_rate(try_set_rate.pop("rate_type", OVERALL), **try_set_rate)
    return client


def admin_available(stack, name: str = ALICE) -> int:
    result = erl_admin(stack.redis, "show", name, "--json")
    assert result.code == 0, result.stderr
    return result.json()["state"]["available"]


def test_interleaved_acquires_share_one_window(stack):
    # A 1 minute window: the attempts fall in one window however slow the machine.
    envoy = stack.envoy(plugin_config(rule(rate=6, interval="1m")))
    client = java_service(stack, rate=6, interval_ms=60_000)

    decisions = []
    for _ in range(6):
        decisions.append(("filter", envoy.send(headers=HEADERS).status == 200))
        decisions.append(("client", client.try_acquire().acquired))

    granted = [side for side, ok in decisions if ok]
    assert len(granted) == 6
    assert granted == ["filter", "client"] * 3, "the first six attempts pass, whoever makes them"
    assert stack.redis.client.zcard(limiter_key(ALICE, "permits")) == 6
    assert stack.redis.client.get(limiter_key(ALICE, "value")) == b"0"


def test_concurrent_acquires_from_both_sides_never_exceed_the_rate(stack):
    rate = 20
    # A 1 minute window: all 60 attempts fall in one window however slow the machine.
    envoy = stack.envoy(plugin_config(rule(rate=rate, interval="1m")))
    client = java_service(stack, rate=rate, interval_ms=60_000)

    def through_envoy(_: int) -> tuple[str, bool]:
        return "filter", envoy.send(headers=HEADERS).status == 200

    def as_java_service(_: int) -> tuple[str, bool]:
        return "client", client.try_acquire().acquired

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(through_envoy if i % 2 else as_java_service, i) for i in range(60)]
        results = [future.result(timeout=30) for future in futures]

    granted = [side for side, ok in results if ok]
    split = {side: granted.count(side) for side in ("filter", "client")}
    assert len(granted) == rate, f"granted {split} of 30 attempts each"
    assert stack.redis.client.zcard(limiter_key(ALICE, "permits")) == rate
    assert stack.redis.client.get(limiter_key(ALICE, "value")) == b"0"


def test_available_permits_agree_on_every_side(stack):
    envoy = stack.envoy(plugin_config(rule(rate=10, interval="1m")))
    client = java_service(stack)

    assert [remaining(envoy.send(headers=HEADERS)) for _ in range(3)] == [9, 8, 7]
    assert client.try_acquire().acquired and client.try_acquire().acquired
    assert client.available_permits() == 5
    assert admin_available(stack) == 5

    last = envoy.send(headers=HEADERS)
    assert last.status == 200
    assert remaining(last) == 4
    assert client.available_permits() == 4
    assert admin_available(stack) == 4


def test_a_rate_the_client_sets_is_obeyed_by_the_filter_from_its_next_request(stack):
    # 1 minute windows: the requests fall in one window however slow the machine. No local block: the
    # client's updateRate below must reach the filter's next request (test_local_block.py bounds the delay).
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m", local_block_max=0)))
    client = java_service(stack)
    assert [envoy.send(headers=HEADERS).status for _ in range(2)] == [200, 200]

    client.set_rate(OVERALL, 1, 60_000)  # reset to 1 per minute
    allowed = envoy.send(headers=HEADERS)
    assert allowed.status == 200
    assert allowed.headers["ratelimit-policy"] == '"per-user";q=1;w=60'
    assert remaining(allowed) == 0
    assert envoy.send(headers=HEADERS).status == 429

    assert client.update_rate(OVERALL, 3, 60_000)  # keeping state: 1 of 3 taken
    assert [envoy.send(headers=HEADERS).status for _ in range(3)] == [200, 200, 429]
    assert client.try_acquire().acquired is False
    assert client.config() == {"rate": 3, "interval": 60_000, "type": 0, "keepAliveTime": 0}


def test_members_the_client_writes_are_read_by_the_filter(stack):
    interval_ms = 60_000
    left_ms = 3500  # the client's member leaves the window this long after the test wrote it
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m")))
    # A Java service took 3 permits (one member) 56.5 s ago, by its clock then. Envoy's clock cannot be
    # moved, so the member is dated back instead of the test sleeping most of a minute.
    written_ms = int(epoch_ms()) - (interval_ms - left_ms)
    earlier = RateLimiter(stack.redis.client, ALICE, now_ms=lambda: written_ms)
    earlier.try_set_rate(OVERALL, rate=5, interval_ms=interval_ms)
    assert earlier.try_acquire(3).acquired

    [(member, oldest_ms)] = stack.redis.client.zrange(limiter_key(ALICE, "permits"), 0, -1, withscores=True)
    assert len(member) == 21
    assert decode_permit(member, oldest_ms).permits == 3
    assert oldest_ms == written_ms

    assert [envoy.send(headers=HEADERS).status for _ in range(2)] == [200, 200]
    sent_ms = epoch_ms()
    rejected = envoy.send(headers=HEADERS)
    answered_ms = epoch_ms()
    client = java_service(stack)  # another Java service, on this machine's clock
    client_sent_ms = epoch_ms()
    refused = client.try_acquire()
    client_answered_ms = epoch_ms()
    # Real time: the four decisions above must come before the member leaves the window, 3.5 s after it
    # was written (they take milliseconds).
    assert client_answered_ms < oldest_ms + interval_ms, "too slow: the client's member left the window"
    assert rejected.status == 429
    # Redisson's delay from the client's member, the oldest: about 3.5 s left, so Retry-After 4 (a delay
    # counted from the filter's own permits would say 60).
    assert int(rejected.headers["retry-after"]) in retry_after_range(interval_ms, oldest_ms, sent_ms, answered_ms)
    assert refused.acquired is False
    # The Java side's own delay, a moment later, agrees: the filter's Retry-After is that delay plus the time
    # between the two decisions (1 ms either way for clocks read in whole ms), rounded up.
    earliest, latest = client_sent_ms - answered_ms - 1, client_answered_ms - sent_ms + 1
    agreeing = range(math.ceil((refused.delay_ms + earliest) / 1000), math.ceil((refused.delay_ms + latest) / 1000) + 1)
    assert int(rejected.headers["retry-after"]) in agreeing

    # The client's member leaves the window, the filter's two permits are still in it (for a minute): the
    # filter releases exactly the 3 permits the member carries.
    RealClock().wait_until_ms(oldest_ms + interval_ms + 1)
    after = envoy.send(headers=HEADERS)
    assert after.status == 200
    assert remaining(after) == 5 - 2 - 1
    members = stack.redis.client.zrange(limiter_key(ALICE, "permits"), 0, -1)
    assert [len(m) for m in members] == [21, 21, 21]


def test_per_client_windows_are_separate_for_the_gateway_and_the_client(stack):
    envoy = stack.envoy(plugin_config(rule(rate=2, interval="1m", type="per_client")))
    client = java_service(stack)

    assert [envoy.send(headers=HEADERS).status for _ in range(3)] == [200, 200, 429]
    assert [client.try_acquire().acquired for _ in range(3)] == [True, True, False]
    client_value = f"{limiter_key(ALICE, 'value')}:{client.client_id}"
    assert stack.redis.client.get(client_value) == b"0"
    assert not stack.redis.client.exists(limiter_key(ALICE, "value")), "per-client: no overall window"


def test_a_rate_raised_again_after_one_below_the_permits_of_a_request_is_obeyed(stack):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m", permits=2)), concurrency=1)
    client = java_service(stack)
    assert envoy.send(headers=HEADERS).status == 200

    client.set_rate(OVERALL, 1, 60000)  # a request takes 2 permits: no wait can grant it
    refused = envoy.send(headers=HEADERS)
    assert refused.status == 429
    assert "retry-after" not in refused.headers, "waiting cannot help: no Retry-After"
    assert refused.headers["ratelimit-policy"] == '"per-user";q=1;w=60'

    client.set_rate(OVERALL, 5, 60000)
    assert envoy.send(headers=HEADERS).status == 200


def test_a_limiter_recreated_after_it_expired_starts_with_its_full_rate(stack):
    # Redis expires an idle limiter in real time (no gateway clock moves a TTL): keepAlive 2 s. The window
    # is judged by the Java service's clock instead of by sleeping through it.
    interval_ms = 1000
    envoy = stack.envoy(plugin_config(rule(rate=2, interval="1s", keep_alive="2s")), concurrency=1)
    redis = stack.redis.client
    assert envoy.send(headers=HEADERS).status == 200
    [first_ms] = permit_scores(redis, ALICE)
    RealClock().wait_until_ms(first_ms + 50)  # the second permit with a later score
    second_sent = time.monotonic()
    assert envoy.send(headers=HEADERS).status == 200
    second_ms = permit_scores(redis, ALICE)[1]

    # A Java service whose clock reads a moment when the first permit has left the window and the second
    # has not asks how many permits are left: the first permit is released, the value SET to 1 (Redisson's
    # plain SET: the key loses its TTL).
    java = RateLimiter(redis, ALICE, now_ms=lambda: int((first_ms + second_ms) / 2) + interval_ms)
    assert java.available_permits() == 1
    # Real time: that had to come before the limiter expired, keepAlive (2 s) after the last acquire; it
    # takes milliseconds.
    assert time.monotonic() - second_sent < 2.0, "too slow: the limiter may have expired before availablePermits"
    assert redis.get(limiter_key(ALICE, "value")) == b"1"

    # keepAliveTime after the last acquire, Redis expires the hash and the permits; the value key, which
    # lost its TTL, stays.
    wait_until(lambda: not redis.exists(ALICE, limiter_key(ALICE, "permits")), 15.0, "the limiter to expire")
    assert redis.keys("*") == [limiter_key(ALICE, "value").encode()]

    # The filter re-creates the limiter and starts it clean: both permits, not the stale value's one.
    assert [envoy.send(headers=HEADERS).status for _ in range(2)] == [200, 200]


def test_a_gateways_lease_is_permits_taken_for_a_redisson_client_and_the_window_holds_the_rate(stack):
    """A lease (docs/configuration.md, "Leases") is one ordinary member to Redisson: a Java service on the
    same limiter sees the leased permits as taken, and the two together never exceed the rate."""
    envoy = stack.envoy(plugin_config(rule("hot", limit_by="global", rate=20, interval="1m",
                                           lease={"max_permits": 8, "max_age": "30s"})), concurrency=1)
    assert envoy.send().status == 200
    java = RateLimiter(stack.redis.client, "erl:hot")
    assert java.available_permits() == 12, "8 leased by the gateway's VM"
    taken = [java.try_acquire().acquired for _ in range(14)]
    assert taken == [True] * 12 + [False] * 2
    scripts = stack.redis.script_calls()
    assert [envoy.send().status for _ in range(7)] == [200] * 7, "the lease's other 7 permits"
    assert stack.redis.script_calls() == scripts, "served without Redis"
    assert envoy.send().status == 429
    members = stack.redis.client.zrange(limiter_key("erl:hot", "permits"), 0, -1, withscores=True)
    assert sum(decode_permit(member, score).permits for member, score in members) == 20
