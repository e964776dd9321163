"""When Redis is down or hangs: fail open or closed, within the configured timeout, and recover."""

from __future__ import annotations

from harness import plugin_config, rule, timed_send, wait_until
from timing import LATENCY_MARGIN_S as MARGIN_S

TIMEOUT_MS = 300
TIMEOUT_S = TIMEOUT_MS / 1000
# Redis hangs (CLIENT PAUSE) far longer than TIMEOUT_S + MARGIN_S, so a request that waited for Redis rather
# than for the timeout fails the bound; the pause is lifted at the end of the test.
PAUSE_MS = 10_000


def gateways(stack):
    """One Envoy failing open (the default) and one failing closed, both with a 300 ms Redis timeout."""
    limit = rule(rate=1, interval="1m")
    fail_open = stack.envoy(plugin_config(limit, timeout=f"{TIMEOUT_MS}ms"))
    fail_closed = stack.envoy(plugin_config(limit, timeout=TIMEOUT_MS, failure_mode="deny"))
    return fail_open, fail_closed


def test_redis_down_fails_open_or_closed_quickly_and_limiting_resumes(stack):
    fail_open, fail_closed = gateways(stack)
    stack.redis.stop()

    for _ in range(3):
        response, elapsed = timed_send(fail_open)
        assert (response.status, response.body) == (200, "upstream ok\n")
        assert elapsed < TIMEOUT_S + MARGIN_S
        response, elapsed = timed_send(fail_closed)
        assert response.status == 503
        assert elapsed < TIMEOUT_S + MARGIN_S
    assert fail_open.metrics()["failure_allowed"] == 3
    assert fail_closed.metrics()["failure_denied"] == 3
    assert fail_closed.metrics()["redis_errors"] >= 3

    # Redis comes back (empty): both gateways limit again, rate 1 per minute. webdis reconnects each of its
    # connections to Redis when it next uses it, so a request may still fail (503 closed, 200 open) until
    # every connection has: wait for the limit itself, not for one good answer.
    stack.redis.start()
    wait_until(lambda: timed_send(fail_closed, "bob")[0].status == 200, 10.0, "the fail-closed gateway to allow")
    wait_until(lambda: timed_send(fail_closed, "bob")[0].status == 429, 10.0, "the fail-closed gateway to limit")
    wait_until(lambda: timed_send(fail_open, "bob")[0].status == 429, 10.0, "the fail-open gateway to limit")


def test_hung_redis_fails_open_or_closed_after_the_timeout(stack):
    fail_open, fail_closed = gateways(stack)
    stack.redis.pause(PAUSE_MS)
    try:
        response, elapsed = timed_send(fail_open)
        assert (response.status, response.body) == (200, "upstream ok\n")
        assert TIMEOUT_S - 0.05 <= elapsed < TIMEOUT_S + MARGIN_S, "waited for the Redis timeout, no longer"

        response, elapsed = timed_send(fail_closed)
        assert response.status == 503
        assert TIMEOUT_S - 0.05 <= elapsed < TIMEOUT_S + MARGIN_S
    finally:
        stack.redis.unpause()
    assert fail_open.metrics()["failure_allowed"] == 1
    assert fail_closed.metrics()["failure_denied"] == 1


def test_failure_status_is_configurable(stack):
    envoy = stack.envoy(plugin_config(rule(), failure_mode="deny", failure_status=500))
    stack.redis.stop()
    assert envoy.send(headers={"x-user-id": "alice"}).status == 500


def test_a_permit_redis_took_after_the_client_left_goes_back_at_once(stack):
    """The bridge holds alice's acquire 400 ms (Redis runs it then); her client leaves after 100 ms, so
    Envoy ends the stream and the filter stops waiting. When Redis's reply comes, the permit it took goes
    back at once (GIVE_BACK): no member stays in the window, the limiter's value is the rate again, and
    `late_given_back` counts it (docs/reliability.md, "Late replies")."""
    import harness as h
    from slowbridge import SlowBridge, webdis_form

    name = "erl:per-user:alice"
    bridge = SlowBridge(stack.webdis.port, match=webdis_form(name), delay_ms=400).start()
    try:
        envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m"), timeout="2s"), webdis_port=bridge.port)
        assert envoy.send(headers={"x-user-id": "bob"}).status == 200, "Redis knows the script now"
        try:
            h.http_request(envoy.port, "/", {"x-user-id": "alice"}, timeout=0.1)
            raise AssertionError("the request should have outlived its client's 100 ms")
        except OSError:
            pass
        wait_until(lambda: envoy.metrics().get("late_given_back") == 1, 5.0, "the late permit given back")
        members = h.limiter_key(name, "permits")
        wait_until(lambda: stack.redis.client.zcard(members) == 0, 5.0, "no member left in the window")
    finally:
        bridge.stop()
    assert int(stack.redis.client.get(h.limiter_key(name, "value"))) == 5
    assert envoy.metrics().get("late_unanswered", 0) == 0
