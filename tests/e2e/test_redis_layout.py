"""The state in Redis is Redisson's RRateLimiter (4.x): what `redis-cli` and a Java service see."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest

from harness import decode_permit, epoch_ms, limiter_key, plugin_config, retry_after_range, rule

ALICE = "erl:per-user:alice"


def test_state_is_the_redisson_layout(stack):
    # A 1 minute window: both requests fall in it however slow the machine (none releases the other's permit).
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m")))
    redis = stack.redis.client

    before_ms = epoch_ms()
    assert [envoy.send(headers={"x-user-id": "alice"}).status for _ in range(2)] == [200, 200]
    after_ms = epoch_ms()

    assert redis.hgetall(ALICE) == {
        b"rate": b"5",
        b"interval": b"60000",
        b"type": b"0",
        b"keepAliveTime": b"3600000",  # keep_alive defaults to 1h (longer than the interval)
    }
    assert redis.get(limiter_key(ALICE, "value")) == b"3"

    members = redis.zrange(limiter_key(ALICE, "permits"), 0, -1, withscores=True)
    permits = [decode_permit(member, score) for member, score in members]
    assert [permit.permits for permit in permits] == [1, 1]
    assert permits[0].random != permits[1].random
    for permit in permits:
        assert before_ms - 1000 <= permit.score_ms <= after_ms + 1000, "scores are epoch ms of the acquire"

    for key in (ALICE, limiter_key(ALICE, "value"), limiter_key(ALICE, "permits")):
        assert 0 < redis.pttl(key) <= 3_600_000, f"{key} expires after keepAliveTime"
    assert sorted(redis.keys("*")) == sorted(
        k.encode() for k in (ALICE, limiter_key(ALICE, "value"), limiter_key(ALICE, "permits")))


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("alice", "erl:per-user:alice"),
        ("user@example.com", "erl:per-user:user@example.com"),
        ("a{b} c", "erl:per-user:~YXtifSBj"),
        ("x" * 129, "erl:per-user:~" + b64url(b"x" * 129)),
        ("y" * 300, "erl:per-user:#" + b64url(hashlib.sha256(b"y" * 300).digest())),
    ],
    ids=["verbatim", "verbatim-email", "braces-and-space", "129-bytes", "300-bytes"],
)
def test_key_values_become_limiter_names(stack, value, expected):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m")))

    assert envoy.send(headers={"x-user-id": value}).status == 200
    redis = stack.redis.client
    assert redis.type(expected) == b"hash", sorted(redis.keys("*"))
    assert redis.get(limiter_key(expected, "value")) == b"4"


def test_a_limiter_created_by_a_java_service_is_obeyed_and_not_overwritten(stack):
    redis = stack.redis.client
    carol = "erl:per-user:carol"
    config = {b"rate": b"1", b"interval": b"60000", b"type": b"0", b"keepAliveTime": b"0"}
    redis.hset(carol, mapping=config)  # as redissonClient.getRateLimiter(...).trySetRate(OVERALL, 1, 1 min)
    envoy = stack.envoy(plugin_config(rule(rate=10, interval="1m")))

    assert envoy.send(headers={"x-user-id": "carol"}).status == 200
    sent_ms = epoch_ms()
    rejected = envoy.send(headers={"x-user-id": "carol"})
    answered_ms = epoch_ms()
    assert rejected.status == 429
    oldest_ms = redis.zrange(limiter_key(carol, "permits"), 0, 0, withscores=True)[0][1]
    assert int(rejected.headers["retry-after"]) in retry_after_range(60_000, oldest_ms, sent_ms, answered_ms)

    assert redis.hgetall(carol) == config
    assert redis.pttl(carol) == -1, "keepAliveTime 0: the limiter never expires"


UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def per_client_ids(redis, name: str) -> dict[str, set[str]]:
    """{suffix: {client ids}} of the PER_CLIENT keys `{N}:value:<id>` and `{N}:permits:<id>`."""
    pattern = re.compile(re.escape(limiter_key(name, "")) + f"(value|permits):({UUID})$")
    found: dict[str, set[str]] = {"value": set(), "permits": set()}
    for key in redis.keys("*"):
        match = pattern.match(key.decode())
        if match:
            found[match.group(1)].add(match.group(2))
    return found


def test_per_client_limiters_use_redisson_per_client_keys(stack):
    envoy = stack.envoy(plugin_config(rule("per-client", rate=5, interval="1m", type="per_client")))
    name = "erl:per-client:alice"

    assert [envoy.send(headers={"x-user-id": "alice"}).status for _ in range(4)] == [200] * 4

    redis = stack.redis.client
    assert redis.hget(name, "type") == b"1"
    ids = per_client_ids(redis, name)
    assert len(ids["value"]) == 1, f"one window per gateway process (both workers), got {ids}"
    assert ids["permits"] == ids["value"]
    (client_id,) = ids["value"]
    assert redis.get(limiter_key(name, "value") + ":" + client_id) == b"1"
    assert not redis.exists(limiter_key(name, "value")), "no OVERALL state for a PER_CLIENT limiter"


def test_per_client_windows_are_per_gateway(stack):
    config = plugin_config(rule("per-client", rate=1, interval="1m", type="per_client"))
    first, second = stack.envoy(config), stack.envoy(config)

    assert [first.send(headers={"x-user-id": "alice"}).status for _ in range(2)] == [200, 429]
    assert [second.send(headers={"x-user-id": "alice"}).status for _ in range(2)] == [200, 429]
    assert len(per_client_ids(stack.redis.client, "erl:per-client:alice")["value"]) == 2
