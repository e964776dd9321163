"""What a client of the gateway sees: bursts, 429s, the sliding window, keys, weights, several rules."""

from __future__ import annotations

import time

from harness import (
    epoch_ms,
    limiter_key,
    plugin_config,
    retry_after_range,
    rule,
    sleep_until,
)


def user(name: str) -> dict[str, str]:
    return {"x-user-id": name}


def test_burst_passes_then_429_with_retry_after_until_the_window_slides(stack):
    envoy = stack.envoy(plugin_config(rule(rate=3, interval="2s")))
    hits_before = stack.upstream.hits
    started = time.monotonic()

    burst = [envoy.send(headers=user("alice")) for _ in range(3)]
    assert [r.status for r in burst] == [200, 200, 200]
    assert all(r.body == "upstream ok\n" for r in burst)

    sent_ms = epoch_ms()
    rejected = envoy.send(headers=user("alice"))
    answered_ms = epoch_ms()
    assert rejected.status == 429
    assert rejected.body == "rate limit exceeded\n"
    assert rejected.headers["content-type"].startswith("text/plain")
    assert rejected.headers["x-envoy-ratelimited"] == "true"
    oldest_ms = stack.redis.client.zrange(limiter_key("erl:per-user:alice", "permits"), 0, 0,
                                          withscores=True)[0][1]
    # Redisson's delay, 3 + 2000 - (ms since the first permit), rounded up: 2 s unless the whole burst took
    # under 3 ms.
    assert int(rejected.headers["retry-after"]) in retry_after_range(2000, oldest_ms, sent_ms, answered_ms)
    assert stack.upstream.hits - hits_before == 3, "a rejected request must not reach the upstream"

    # The three permits slide out of the window 2 s after they were taken: a full burst passes again.
    sleep_until(started + 2.2)
    again = [envoy.send(headers=user("alice")).status for _ in range(4)]
    assert again == [200, 200, 200, 429]


def test_window_slides_instead_of_resetting(stack):
    envoy = stack.envoy(plugin_config(rule(rate=2, interval="3s")))
    start = time.monotonic()

    assert envoy.send(headers=user("alice")).status == 200
    first_permit_taken_by = time.monotonic()
    sleep_until(start + 1.5)
    assert envoy.send(headers=user("alice")).status == 200
    sleep_until(start + 1.6)
    assert envoy.send(headers=user("alice")).status == 429

    # 3 s after the first permit it leaves the window; the one taken at 1.5 s is still in it, so exactly one
    # request passes (a fixed window would have reset and let two through).
    sleep_until(first_permit_taken_by + 3.1)
    assert envoy.send(headers=user("alice")).status == 200
    assert envoy.send(headers=user("alice")).status == 429
    assert time.monotonic() - start < 4.4, "the test ran too slowly to tell a sliding window from a fixed one"


def test_each_key_value_has_its_own_limit_and_requests_without_one_are_not_limited(stack):
    envoy = stack.envoy(plugin_config(rule(rate=1, interval="1m")))

    assert envoy.send(headers=user("alice")).status == 200
    assert envoy.send(headers=user("alice")).status == 429
    assert envoy.send(headers=user("bob")).status == 200
    assert envoy.send(headers=user("bob")).status == 429
    # on_missing defaults to "skip": the rule does not apply without the header.
    assert [envoy.send().status for _ in range(3)] == [200, 200, 200]


def test_on_missing_deny_rejects_requests_without_a_key_value(stack):
    envoy = stack.envoy(plugin_config(rule(rate=1, interval="1m", on_missing="deny")))

    missing = envoy.send()
    assert missing.status == 429
    assert missing.body == "rate limit exceeded\n"
    assert envoy.send(headers=user("alice")).status == 200


def test_on_missing_share_puts_requests_without_a_key_value_in_one_limiter(stack):
    envoy = stack.envoy(plugin_config(rule(rate=1, interval="1m", on_missing="share")))

    assert [envoy.send().status for _ in range(2)] == [200, 429]
    assert envoy.send(headers=user("alice")).status == 200


def test_weighted_requests_take_several_permits(stack):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m", permits=2)))

    assert [envoy.send(headers=user("alice")).status for _ in range(3)] == [200, 200, 429]
    # 5 - 2 - 2: one permit left, too few for a request that takes two.
    assert stack.redis.client.get(limiter_key("erl:per-user:alice", "value")) == b"1"


def test_a_request_passes_only_if_every_rule_allows_it(stack):
    envoy = stack.envoy(plugin_config(
        rule("per-user", rate=5, interval="1m"),
        rule("everyone", limit_by="global", rate=2, interval="1m"),
    ))

    assert envoy.send(headers=user("alice")).status == 200
    assert envoy.send(headers=user("bob")).status == 200
    rejected = envoy.send(headers=user("carol"))
    assert rejected.status == 429
    assert '"everyone"' in rejected.headers["ratelimit"]
    assert stack.redis.client.hget("erl:everyone", "rate") == b"2"


def test_gateways_sharing_redis_enforce_one_overall_limit(stack):
    config = plugin_config(rule(rate=2, interval="1m"))
    first, second = stack.envoy(config), stack.envoy(config)

    assert first.send(headers=user("alice")).status == 200
    assert second.send(headers=user("alice")).status == 200
    assert first.send(headers=user("alice")).status == 429
    assert second.send(headers=user("alice")).status == 429


def test_draft_rate_limit_headers_on_allowed_and_rejected_responses(stack):
    envoy = stack.envoy(plugin_config(rule(rate=2, interval="2s")))

    responses = [envoy.send(headers=user("alice")) for _ in range(3)]
    assert [r.status for r in responses] == [200, 200, 429]
    for response in responses:
        assert response.headers["ratelimit-policy"] == '"per-user";q=2;w=2'
    remaining = [response.headers["ratelimit"].split(";")[:2] for response in responses]
    assert remaining == [['"per-user"', "r=1"], ['"per-user"', "r=0"], ['"per-user"', "r=0"]]
    for response in responses:
        reset = response.headers["ratelimit"].split(";")[2]
        assert reset.startswith("t=") and 0 <= int(reset[2:]) <= 2


def test_legacy_rate_limit_headers_and_none(stack):
    legacy = stack.envoy(plugin_config(rule(rate=2, interval="1m"), rate_limit_headers="legacy"))
    quiet = stack.envoy(plugin_config(rule("other", rate=2, interval="1m"), rate_limit_headers="none"))

    allowed = legacy.send(headers=user("alice"))
    assert allowed.status == 200
    assert allowed.headers["x-ratelimit-limit"] == "2"
    assert allowed.headers["x-ratelimit-remaining"] == "1"
    assert int(allowed.headers["x-ratelimit-reset"]) in range(0, 61)
    assert "ratelimit" not in allowed.headers

    plain = quiet.send(headers=user("alice"))
    assert plain.status == 200
    assert not [name for name in plain.headers if "ratelimit" in name]
