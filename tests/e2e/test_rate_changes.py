"""Rate changes in production (rate_source), and where acquire times come from (clock)."""

from __future__ import annotations

import time

from harness import limiter_key, plugin_config, rule
from redisson_client import OVERALL, RateLimiter

DAVE = "erl:per-user:dave"
HEADERS = {"x-user-id": "dave"}


def java_service_at_rate_1(stack) -> RateLimiter:
    """A Java service created the limiter with rate 1 per minute and took its one permit."""
    client = RateLimiter(stack.redis.client, DAVE)
    assert client.try_set_rate(OVERALL, 1, 60_000)
    assert client.try_acquire(1).acquired
    return client


def wait_for_log(envoy, text: str, timeout_s: float = 3.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = envoy.log_text()
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in Envoy's log")


def test_by_default_redis_wins_and_the_difference_is_logged_once(stack):
    java_service_at_rate_1(stack)
    envoy = stack.envoy(plugin_config(rule(rate=3, interval="1m")), concurrency=1)

    assert [envoy.send(headers=HEADERS).status for _ in range(3)] == [429, 429, 429]
    assert stack.redis.client.hget(DAVE, "rate") == b"1", "the limiter in Redis is not overwritten"
    log = wait_for_log(envoy, "differs from the configuration; obeying Redis")
    assert log.count("differs from the configuration; obeying Redis") == 1, "once per limiter, not per request"


def test_config_wins_once_keeping_consumed_permits_then_an_operator_change_stands(stack):
    client = java_service_at_rate_1(stack)
    # No local block: the operator's change below must reach the next request (test_local_block.py).
    config = plugin_config(rule(rate=3, interval="1m", rate_source="config", local_block_max=0))
    envoy = stack.envoy(config, concurrency=1)

    # The configured rate 3 is applied with updateRate keeping state: the Java service's permit stays
    # consumed, so 2 pass (not 3: no burst at the change).
    assert [envoy.send(headers=HEADERS).status for _ in range(3)] == [200, 200, 429]
    assert stack.redis.client.hget(DAVE, "rate") == b"3"
    wait_for_log(envoy, "applied rate 3 per 60000 ms")

    # An operator lowers it again: applied once per configuration, so the filter does not fight back.
    client.set_rate(OVERALL, 1, 60_000)
    assert [envoy.send(headers=HEADERS).status for _ in range(2)] == [200, 429]
    assert stack.redis.client.hget(DAVE, "rate") == b"1"


def test_an_operator_change_stands_after_eviction_restart_and_on_another_gateway(stack):
    # cache_size 1: every other user evicts dave's entry from the per-VM cache. Before the fix the `applied`
    # mark went with the entry and the rule's rate was written over the operator's on dave's next request.
    config = plugin_config(rule(rate=3, interval="1m", rate_source="config"), cache_size=1)
    envoy = stack.envoy(config, concurrency=1)
    client = RateLimiter(stack.redis.client, DAVE)
    assert envoy.send(headers=HEADERS).status == 200
    assert stack.redis.client.hget(DAVE, "rate") == b"3", "the filter created it with the rule's rate"
    assert stack.redis.client.hget(DAVE, "erlRuleConfig") == b"3:60000:0:3600000", "and recorded what it wrote"

    client.set_rate(OVERALL, 10, 60_000)  # an operator raises it (Redisson setRate: a reset)
    for user in ("erin", "frank", "grace"):
        assert envoy.send(headers={"x-user-id": user}).status == 200
    assert [envoy.send(headers=HEADERS).status for _ in range(4)] == [200] * 4
    assert stack.redis.client.hget(DAVE, "rate") == b"10", "evicted from the cache, the operator's rate stands"

    # A restart (a new Envoy, empty caches) and a second gateway process see the same record in Redis.
    envoy.stop()
    second = stack.envoy(config, concurrency=2)
    assert [second.send(headers=HEADERS).status for _ in range(2)] == [200, 200]
    assert stack.redis.client.hget(DAVE, "rate") == b"10"

    # A new rule config replaces a config the rule itself wrote (erin still holds the rule's 3/min).
    third = stack.envoy(plugin_config(rule(rate=5, interval="1m", rate_source="config")), concurrency=1)
    assert third.send(headers={"x-user-id": "erin"}).status == 200
    assert stack.redis.client.hget("erl:per-user:erin", "rate") == b"5"
    assert stack.redis.client.hget(DAVE, "rate") == b"10", "but not the operator's"
    assert third.send(headers=HEADERS).status == 200
    assert stack.redis.client.hget(DAVE, "rate") == b"10"


def acquire_time_argument(stack, envoy) -> bytes:
    """The acquire time the filter sends to the script for one request (ARGV[1]: the 9th word of
    `EVALSHA sha 5 key*5 now ...`), read from Redis's slow log with every command logged."""
    redis = stack.redis.client
    redis.config_set("slowlog-log-slower-than", 0)
    redis.slowlog_reset()
    assert envoy.send(headers=HEADERS).status == 200
    (entry,) = [e for e in redis.slowlog_get(128) if e["command"].startswith(b"EVALSHA")]
    return entry["command"].split(b" ")[8]


def test_gateway_clock_sends_the_gateway_time(stack):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m")))
    assert abs(int(acquire_time_argument(stack, envoy)) - time.time() * 1000) < 5_000


def test_redis_clock_lets_the_script_read_redis_time(stack):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m"), clock="redis"))
    redis = stack.redis.client
    before_s, before_us = redis.time()
    assert acquire_time_argument(stack, envoy) == b"", "no time sent: the script reads TIME"
    after_s, after_us = redis.time()

    ((_, score),) = redis.zrange(limiter_key(DAVE, "permits"), 0, -1, withscores=True)
    assert before_s * 1000 + before_us // 1000 <= score <= after_s * 1000 + after_us // 1000 + 1
