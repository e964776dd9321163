"""The state in Redis is Redisson's RRateLimiter (4.x): what `redis-cli` and a Java service see."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest

from harness import decode_permit, epoch_ms, limiter_key, plugin_config, retry_after_range, rule

ALICE = "erl:per-user:alice"
GLOBEX = "erl:weighted:globex"


def keys_of(name: str) -> list[str]:
    """The three keys of an OVERALL limiter: its configuration hash, `{name}:value`, `{name}:permits`."""
    return [name, limiter_key(name, "value"), limiter_key(name, "permits")]


# In real Envoy and in the Higress build in the emulator (as before; the stock build is checked in Envoy).
@pytest.mark.parametrize("gateway_kind", ["envoy", "emulator-higress"])
def test_state_is_the_redisson_layout(stack, start_gateway):
    # A 1 minute window: the requests fall in it however slow the machine (none releases another's permit).
    gateway = start_gateway(rule(rate=5, interval="1m"),
                            rule("weighted", limit_by={"header": "x-tenant-id"}, rate=5, interval="1m", permits=2))
    redis = stack.redis.client

    before_ms = epoch_ms()
    assert [gateway.send(headers={"x-user-id": "alice"}).status for _ in range(2)] == [200, 200]
    assert gateway.send(headers={"x-tenant-id": "globex"}).status == 200
    after_ms = epoch_ms()

    # Each limiter: its value (permits free) and the permits of each of its members.
    for name, value, permits in ((ALICE, b"3", [1, 1]), (GLOBEX, b"3", [2])):
        assert redis.hgetall(name) == {
            b"rate": b"5",
            b"interval": b"60000",
            b"type": b"0",
            b"keepAliveTime": b"3600000",  # keep_alive defaults to 1h (longer than the interval)
        }
        assert redis.get(limiter_key(name, "value")) == value

        members = redis.zrange(limiter_key(name, "permits"), 0, -1, withscores=True)
        decoded = [decode_permit(member, score) for member, score in members]  # 21 bytes, the first one 16
        assert [permit.permits for permit in decoded] == permits
        assert len({permit.random for permit in decoded}) == len(decoded), "each member its own random bytes"
        for permit in decoded:
            assert before_ms - 1000 <= permit.score_ms <= after_ms + 1000, "scores are epoch ms of the acquire"

        for key in keys_of(name):
            assert 0 < redis.pttl(key) <= 3_600_000, f"{key} expires after keepAliveTime"
    assert sorted(redis.keys("*")) == sorted(key.encode() for key in keys_of(ALICE) + keys_of(GLOBEX))


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


# In real Envoy and in the Higress build in the emulator (as before; the stock build is checked in Envoy).
@pytest.mark.parametrize("gateway_kind", ["envoy", "emulator-higress"])
def test_a_limiter_created_by_a_java_service_is_obeyed_and_not_overwritten(stack, start_gateway):
    redis = stack.redis.client
    carol = "erl:per-user:carol"
    config = {b"rate": b"1", b"interval": b"60000", b"type": b"0", b"keepAliveTime": b"0"}
    redis.hset(carol, mapping=config)  # as redissonClient.getRateLimiter(...).trySetRate(OVERALL, 1, 1 min)
    gateway = start_gateway(rule(rate=10, interval="1m"))

    assert gateway.send(headers={"x-user-id": "carol"}).status == 200
    sent_ms = epoch_ms()
    rejected = gateway.send(headers={"x-user-id": "carol"})
    answered_ms = epoch_ms()
    assert rejected.status == 429
    oldest_ms = redis.zrange(limiter_key(carol, "permits"), 0, 0, withscores=True)[0][1]
    assert int(rejected.headers["retry-after"]) in retry_after_range(60_000, oldest_ms, sent_ms, answered_ms)

    assert redis.hgetall(carol) == config, "the limiter in Redis is not overwritten"
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
