"""What a client of the gateway sees: bursts, 429s, the sliding window, keys, weights, several rules."""

from __future__ import annotations

import pytest

from harness import clock_guard, limiter_key, plugin_config, retry_after_range, rule, user
from timing import permit_scores

ALICE = "erl:per-user:alice"


# The sliding window in real Envoy (the stock build, Redis through webdis) and in the emulator with the
# Higress build (Redis through the host), as before: the stock build is checked in real Envoy. Real Envoy
# cannot have its clock moved: the test sleeps through a 4 s window. The emulator gets a 1 minute window and
# its clock is moved instead: nothing sleeps, and the real time between two steps (milliseconds, seconds on
# a loaded machine) is far from any window boundary.
WINDOWS_MS = {"envoy": 4000, "emulator-higress": 60_000}


@pytest.mark.parametrize("gateway_kind", list(WINDOWS_MS))
def test_burst_passes_then_429_with_retry_after_and_the_window_slides(stack, start_gateway, gateway_kind):
    """A burst of 3 passes, the 4th is rejected with Retry-After from Redisson's delay, and the window
    slides: each permit leaves it one interval after it was taken (not all at once at a window reset).

    Waits are for a boundary, from the permits' scores read from Redis (in real Envoy a sleep: a lower bound
    a loaded machine cannot make too short). What must happen *before* a boundary has at least half a
    window of margin: 2 s of real time in Envoy, 30 s in the emulator (its clock moves only when told). It
    is checked before the statuses, so that a machine too slow for it says so."""
    window = WINDOWS_MS[gateway_kind]
    gateway = start_gateway(rule(rate=3, interval=window))
    clock, redis = gateway.clock, stack.redis.client
    hits_before = gateway.upstream_hits()

    first = gateway.send(headers=user("alice"))
    assert (first.status, first.body) == (200, "upstream ok\n")
    [first_ms] = permit_scores(redis, ALICE)

    # Half a window later two more requests spend the burst, and a fourth is rejected.
    clock.wait_until_ms(first_ms + window / 2)
    burst = [gateway.send(headers=user("alice")) for _ in range(2)]
    sent_ms = clock.now_ms()
    rejected = gateway.send(headers=user("alice"))
    answered_ms = clock.now_ms()
    assert answered_ms < first_ms + window, "too slow: the first permit left the window before the 4th request"
    assert [r.status for r in burst] == [200, 200]
    assert all(r.body == "upstream ok\n" for r in burst)
    assert rejected.status == 429
    assert rejected.body == "rate limit exceeded\n"
    assert rejected.headers["content-type"].startswith("text/plain")
    assert rejected.headers["x-envoy-ratelimited"] == "true"
    # Redisson's delay, 3 + interval - (ms since the oldest permit), rounded up: about half a window, as
    # counted from the first permit (a delay counted from the newest would say a whole window).
    assert int(rejected.headers["retry-after"]) in retry_after_range(window, first_ms, sent_ms, answered_ms)
    assert gateway.upstream_hits() - hits_before == 3, "a rejected request must not reach the upstream"
    later_ms = permit_scores(redis, ALICE)[1]  # the two permits taken half a window after the first

    # One interval after the first permit only it has left the window: exactly one more request passes (a
    # fixed window restarting there would let three through), and the two later permits still count.
    # (The gateway frees a permit its clock guard after the window passed it: docs/redisson.md, "Clocks".)
    clock.wait_until_ms(first_ms + window + clock_guard(window) + 1)
    statuses = [gateway.send(headers=user("alice")).status for _ in range(2)]
    assert clock.now_ms() < later_ms + window, "too slow to tell a sliding window from a fixed one"
    assert statuses == [200, 429]

    # Once every permit has left the window, a full burst passes again.
    clock.wait_until_ms(max(permit_scores(redis, ALICE)) + window + clock_guard(window) + 1)
    assert [gateway.send(headers=user("alice")).status for _ in range(4)] == [200, 200, 200, 429]
    assert gateway.upstream_hits() - hits_before == 3 + 1 + 3


# In real Envoy and in the Higress build in the emulator (as before; the stock build is checked in Envoy).
@pytest.mark.parametrize("gateway_kind", ["envoy", "emulator-higress"])
def test_each_key_value_has_its_own_limit_and_requests_without_one_are_not_limited(stack, start_gateway):
    gateway = start_gateway(rule(rate=3, interval="1m"))

    assert [gateway.send(headers=user("alice")).status for _ in range(4)] == [200, 200, 200, 429]
    assert [gateway.send(headers=user("bob")).status for _ in range(4)] == [200, 200, 200, 429]
    # on_missing defaults to "skip": the rule does not apply without the header.
    assert [gateway.send().status for _ in range(4)] == [200] * 4


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


# In real Envoy and in the Higress build in the emulator (as before; the stock build is checked in Envoy).
@pytest.mark.parametrize("gateway_kind", ["envoy", "emulator-higress"])
def test_weighted_requests_take_several_permits(stack, start_gateway):
    gateway = start_gateway(rule(rate=5, interval="1m", permits=2))

    assert [gateway.send(headers=user("alice")).status for _ in range(3)] == [200, 200, 429]
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
    # A 1 minute window: the three requests fall in one window however slow the machine.
    envoy = stack.envoy(plugin_config(rule(rate=2, interval="1m")))

    responses = [envoy.send(headers=user("alice")) for _ in range(3)]
    assert [r.status for r in responses] == [200, 200, 429]
    for response in responses:
        assert response.headers["ratelimit-policy"] == '"per-user";q=2;w=60'
    remaining = [response.headers["ratelimit"].split(";")[:2] for response in responses]
    assert remaining == [['"per-user"', "r=1"], ['"per-user"', "r=0"], ['"per-user"', "r=0"]]
    for response in responses:
        reset = response.headers["ratelimit"].split(";")[2]
        # At most the window, and the clock guard's 20 ms rounded up on a refusal (docs/redisson.md, "Clocks").
        assert reset.startswith("t=") and 0 <= int(reset[2:]) <= 61


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
