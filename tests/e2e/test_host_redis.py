"""The Higress build (`dist/edge-rate-limiter-higress.wasm`, transport "host": Redis through the host's
`proxy_redis_init` / `proxy_redis_call`) in the project's proxy-wasm host emulator, against the real
redis-server of the stack: failures, the password and the database. What this build does as the stock build
in real Envoy does is tested once for both (conftest `start_gateway`): the burst and sliding window, keys
and weights in test_limits.py, the Redisson layout and a limiter created beforehand in
test_redis_layout.py, round trips in test_round_trips.py.

Stock Envoy cannot load this build, so the emulator (`wasm-host serve`, tests/host) is its gateway here.
Compiling the module takes seconds in a debug `wasm-host`, so the module starts two gateways once and every
test uses them, each with its own key values (the filter caches limiter configurations per VM):

- `open_gw`: fails open; cluster `redis`; rule `per-user` (`x-user-id`, 3 per minute);
- `closed_gw`: fails closed; Higress naming (`service_name` `redis.static`, port 6379: cluster
  `outbound|6379||redis.static`), database 2, password `s3cret` (Redis has none until a test sets one;
  until then the host's AUTH fails harmlessly); rule `per-user`, 3 per minute.

Every window is a minute, so the requests of a test fall in one window however slow the machine. After
every test, no request may have ended any other way than continued or answered (no `paused`: a request the
filter never resumed, no reset, no failed VM).
"""

from __future__ import annotations

import contextlib
import time

import pytest

from harness import delta, host_plugin_config, limiter_key, rule, timed_send, user, wait_until
from timing import LATENCY_MARGIN_S as MARGIN_S

TIMEOUT_MS = 300
TIMEOUT_S = TIMEOUT_MS / 1000
# Redis hangs (CLIENT PAUSE) far longer than TIMEOUT_S + MARGIN_S, so a request that waited for Redis rather
# than for the timeout fails the bound; the pause is lifted at the end of the test.
PAUSE_MS = 10_000
PASSWORD = "s3cret"

OPEN_CONFIG = host_plugin_config(rule(rate=3, interval="1m"), timeout=f"{TIMEOUT_MS}ms")
CLOSED_CONFIG = host_plugin_config(
    rule(rate=3, interval="1m"),
    timeout=TIMEOUT_MS,
    failure_mode="deny",
    redis={"service_name": "redis.static", "service_port": 6379, "database": 2, "password": PASSWORD},
)


@pytest.fixture(scope="module")
def gateways(processes):
    # Both compile at once (one CPU each), then the first request of each waits for its own.
    open_gw = processes.emulator(OPEN_CONFIG, build="higress", keep=True, wait_ready=False)
    closed_gw = processes.emulator(CLOSED_CONFIG, build="higress", keep=True, wait_ready=False)
    try:
        open_gw.wait_ready()
        closed_gw.wait_ready()
        yield open_gw, closed_gw
    finally:
        open_gw.stop()
        closed_gw.stop()


@pytest.fixture
def open_gw(gateways, stack):
    return gateways[0]


@pytest.fixture
def closed_gw(gateways, stack):
    return gateways[1]


@pytest.fixture(autouse=True)
def every_request_answered(gateways, request):
    seen = [len(gateway.outcomes) for gateway in gateways]
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for gateway in gateways:
            print(f"--- {gateway.name} log (excerpt) ---\n{gateway.log_excerpt()}")
    for gateway, first in zip(gateways, seen):
        kinds = {outcome["kind"] for outcome in gateway.outcomes[first:]}
        assert kinds <= {"continued", "local_reply"}, f"{gateway.name}: {kinds}"


def test_redis_down_fails_open_or_closed_at_once_and_limiting_resumes(stack, open_gw, closed_gw):
    open_before, closed_before = open_gw.metrics(), closed_gw.metrics()
    stack.redis.stop()

    for _ in range(3):
        response, elapsed = timed_send(open_gw, "gus")
        assert (response.status, response.body) == (200, "upstream ok\n")
        assert elapsed < TIMEOUT_S + MARGIN_S
        response, elapsed = timed_send(closed_gw, "gus")
        assert response.status == 503
        assert elapsed < TIMEOUT_S + MARGIN_S
    assert delta(open_before, open_gw.metrics()) == {"failure_allowed": 3, "redis_calls": 3, "redis_errors": 3,
                                                     "rule.per-user.failures": 3}
    assert delta(closed_before, closed_gw.metrics()) == {"failure_denied": 3, "redis_calls": 3, "redis_errors": 3,
                                                         "rule.per-user.failures": 3}

    # Redis comes back, empty and without the scripts: both gateways limit again.
    stack.redis.start()
    assert [timed_send(open_gw, "hal")[0].status for _ in range(4)] == [200, 200, 200, 429]
    assert [timed_send(closed_gw, "hal")[0].status for _ in range(4)] == [200, 200, 200, 429]


def test_hung_redis_fails_open_or_closed_after_the_timeout(stack, open_gw, closed_gw):
    for gateway in (open_gw, closed_gw):  # a connection to Redis before it hangs
        assert gateway.send(headers=user("ian")).status == 200
    stack.redis.pause(PAUSE_MS)
    try:
        response, elapsed = timed_send(open_gw, "ian")
        assert (response.status, response.body) == (200, "upstream ok\n")
        assert TIMEOUT_S - 0.05 <= elapsed < TIMEOUT_S + MARGIN_S, "waited for the Redis timeout, no longer"
        response, elapsed = timed_send(closed_gw, "ian")
        assert response.status == 503
        assert TIMEOUT_S - 0.05 <= elapsed < TIMEOUT_S + MARGIN_S

        # Requests in flight together on both VMs: the timeout fails every pending call, none stays paused
        # (the emulator would report one left paused after its 5 s pause deadline).
        started = time.monotonic()
        batch = closed_gw.send_batch([{"headers": user(f"jan-{i}"), "vm": i % 2} for i in range(4)])
        assert [r.status for r in batch] == [503] * 4
        assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
    finally:
        stack.redis.unpause()
    assert open_gw.send(headers=user("ian")).status == 200
    assert closed_gw.send(headers=user("ian")).status == 200


@contextlib.contextmanager
def redis_password(stack, password: str):
    """Redis requires `password` from now on, and every connection but the harness's must log in again."""
    stack.redis.require_password(password)
    try:
        stack.redis.kill_clients()
        yield
    finally:
        stack.redis.require_password(None)


def test_wrong_password_applies_the_failure_mode_and_the_filter_recovers_once_it_is_right(stack, open_gw,
                                                                                          closed_gw):
    assert closed_gw.send(headers=user("kim")).status == 200
    before = closed_gw.metrics()
    with redis_password(stack, "rotated"):
        # The host logs in with `s3cret` on its new connection; Redis refuses the filter's command
        # (redis-server 7 answers a long unauthenticated command with a protocol error, not NOAUTH, and
        # closes the connection).
        for _ in range(2):
            response, elapsed = timed_send(closed_gw, "kim")
            assert response.status == 503
            # Answered in milliseconds; the bound only says it was not left waiting (MARGIN_S is larger than
            # the timeout, so it cannot tell the refusal from a timeout).
            assert elapsed < TIMEOUT_S + MARGIN_S, "answered, not left waiting"
        response, _ = timed_send(open_gw, "kim")
        assert (response.status, response.body) == (200, "upstream ok\n")
        assert delta(before, closed_gw.metrics()) == {"failure_denied": 2, "redis_calls": 2, "redis_errors": 2,
                                                      "rule.per-user.failures": 2}

        # The operator gives Redis the password the gateway has: the next connection logs in.
        stack.redis.require_password(PASSWORD)
        wait_until(lambda: closed_gw.send(headers=user("kim")).status == 200, 15.0, "the filter to recover")
        assert [closed_gw.send(headers=user("kim")).status for _ in range(2)] == [200, 429]
        # The gateway without a password still cannot get in, and keeps failing open.
        assert open_gw.send(headers=user("kim")).status == 200
        assert open_gw.metrics()["failure_allowed"] > 0
    assert "Redis answers again" in closed_gw.log_text()


def test_database_selection_puts_the_keys_in_database_2(stack, closed_gw):
    assert [closed_gw.send(headers=user("lee")).status for _ in range(4)] == [200, 200, 200, 429]

    db2 = stack.redis.db(2)
    try:
        assert db2.hgetall("erl:per-user:lee")[b"rate"] == b"3"
        assert db2.get(limiter_key("erl:per-user:lee", "value")) == b"0"
        assert db2.zcard(limiter_key("erl:per-user:lee", "permits")) == 3
    finally:
        db2.close()
    assert stack.redis.client.keys("*") == [], "nothing in database 0"

