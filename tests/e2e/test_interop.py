"""The gateway and a Redisson client enforce one limiter: the filter in real Envoy, and beside it the
independent Redisson-compatible client of `redisson_client.py` (written from Redisson's documented layout
and scripts, sharing no code with the filter's) acquiring from the same Redis keys.
"""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (
    decode_permit,
    epoch_ms,
    erl_admin,
    limiter_key,
    plugin_config,
    retry_after_range,
    rule,
    sleep_until,
)
from redisson_client import OVERALL, RateLimiter

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
    envoy = stack.envoy(plugin_config(rule(rate=6, interval="3s")))
    client = java_service(stack, rate=6, interval_ms=3000)
    started = time.monotonic()

    decisions = []
    for _ in range(6):
        decisions.append(("filter", envoy.send(headers=HEADERS).status == 200))
        decisions.append(("client", client.try_acquire().acquired))
    assert time.monotonic() - started < 2.5, "the attempts must fall in one window"

    granted = [side for side, ok in decisions if ok]
    assert len(granted) == 6
    assert granted == ["filter", "client"] * 3, "the first six attempts pass, whoever makes them"
    assert stack.redis.client.zcard(limiter_key(ALICE, "permits")) == 6
    assert stack.redis.client.get(limiter_key(ALICE, "value")) == b"0"


def test_concurrent_acquires_from_both_sides_never_exceed_the_rate(stack):
    rate = 20
    envoy = stack.envoy(plugin_config(rule(rate=rate, interval="3s")))
    client = java_service(stack, rate=rate, interval_ms=3000)

    def through_envoy(_: int) -> tuple[str, bool]:
        return "filter", envoy.send(headers=HEADERS).status == 200

    def as_java_service(_: int) -> tuple[str, bool]:
        return "client", client.try_acquire().acquired

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(through_envoy if i % 2 else as_java_service, i) for i in range(60)]
        results = [future.result(timeout=30) for future in futures]
    assert time.monotonic() - started < 2.5, "all 60 attempts must fall in one 3 s window"

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
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="3s")))
    client = java_service(stack)
    assert [envoy.send(headers=HEADERS).status for _ in range(2)] == [200, 200]

    client.set_rate(OVERALL, 1, 3000)  # reset to 1 per 3 s
    allowed = envoy.send(headers=HEADERS)
    assert allowed.status == 200
    assert allowed.headers["ratelimit-policy"] == '"per-user";q=1;w=3'
    assert remaining(allowed) == 0
    assert envoy.send(headers=HEADERS).status == 429

    assert client.update_rate(OVERALL, 3, 3000)  # keeping state: 1 of 3 taken
    assert [envoy.send(headers=HEADERS).status for _ in range(3)] == [200, 200, 429]
    assert client.try_acquire().acquired is False
    assert client.config() == {"rate": 3, "interval": 3000, "type": 0, "keepAliveTime": 0}


def test_members_the_client_writes_are_read_by_the_filter(stack):
    interval_ms = 3000
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="3s")))
    client = java_service(stack, rate=5, interval_ms=interval_ms)
    started = time.monotonic()
    assert client.try_acquire(3).acquired  # one member carrying 3 permits

    [(member, oldest_ms)] = stack.redis.client.zrange(limiter_key(ALICE, "permits"), 0, -1, withscores=True)
    assert len(member) == 21
    assert decode_permit(member, oldest_ms).permits == 3

    sleep_until(started + 1.5)
    assert [envoy.send(headers=HEADERS).status for _ in range(2)] == [200, 200]
    sent_ms = epoch_ms()
    rejected = envoy.send(headers=HEADERS)
    answered_ms = epoch_ms()
    assert rejected.status == 429
    # Redisson's delay from the client's member, the oldest: about 1.5 s left, so Retry-After 2 (a delay
    # counted from the filter's own permits would say 3).
    assert int(rejected.headers["retry-after"]) in retry_after_range(interval_ms, oldest_ms, sent_ms, answered_ms)
    refused = client.try_acquire()
    assert refused.acquired is False
    assert math.ceil(refused.delay_ms / 1000) == int(rejected.headers["retry-after"])

    # The client's member leaves the window, the filter's two permits are still in it: the filter releases
    # exactly the 3 permits the member carries.
    sleep_until(started + interval_ms / 1000 + 0.2)
    assert time.monotonic() - started < 4.3, "the filter's permits must still be in the window"
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
    envoy = stack.envoy(plugin_config(rule(rate=2, interval="1s", keep_alive="1s")), concurrency=1)
    redis = stack.redis.client
    started = time.monotonic()
    assert envoy.send(headers=HEADERS).status == 200
    sleep_until(started + 0.5)
    assert envoy.send(headers=HEADERS).status == 200
    sleep_until(started + 1.1)
    # A Java service asks how many permits are left: the first permit is released (value SET to 1).
    assert java_service(stack).available_permits() == 1
    sleep_until(started + 1.8)  # keepAliveTime (1 s after the last acquire) has passed
    if redis.keys("*") != [limiter_key(ALICE, "value").encode()]:
        pytest.skip(f"timing: expected only the value key to survive, found {redis.keys('*')}")

    assert [envoy.send(headers=HEADERS).status for _ in range(2)] == [200, 200]
