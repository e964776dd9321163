"""The harness's `Emulator` client itself, against a real `wasm-host serve` with the Higress build on the
stack's redis-server: answers are matched to their calls by id (a late answer to a call the client gave up
on is never taken as the next call's), and the host's faults and clock controls work end to end.
"""

from __future__ import annotations

import time

import pytest

from harness import HarnessError, host_plugin_config, rule

PAUSE_DEADLINE_MS = 3000


def test_a_late_answer_is_not_taken_as_the_next_calls(stack):
    gateway = stack.emulator(host_plugin_config(rule(rate=100, interval="1m"), timeout="2s"), build="higress",
                             pause_deadline_ms=PAUSE_DEADLINE_MS)
    assert gateway.set_faults(drop_redis_replies=True)["drop_redis_replies"] is True
    # The filter never hears from Redis: the request ends only when the filter's own 2-s timeout lets it
    # through (or, failing that, at the host's 3-s pause deadline), long after this client gave up.
    started = time.monotonic()
    with pytest.raises(HarnessError, match="did not answer"):
        gateway.send(headers={"x-user-id": "alice"}, timeout=0.3)
    assert time.monotonic() - started < 2.0

    # The next calls get their own answers (before ids, the first took the late "paused" line).
    faults = gateway.set_faults()
    assert faults == {"refuse_effective_context": 0, "drop_redis_replies": False,
                      "drop_http_call_responses": False, "misroute_tokens": False}
    response = gateway.send(headers={"x-user-id": "bob"})
    assert response.status == 200, response
    assert gateway.last_outcome()["kind"] == "continued"
    assert [late.get("kind") in ("continued", "paused") for late in gateway.late_answers] == [True]
    assert gateway.metrics()["allowed"] == 1


def test_the_filter_sees_the_advanced_clock(stack):
    gateway = stack.emulator(host_plugin_config(rule(rate=1, interval="1m")), build="higress")
    alice = {"x-user-id": "alice"}
    assert gateway.send(headers=alice).status == 200
    assert gateway.send(headers=alice).status == 429
    # The filter stamps acquires with the gateway's clock: a minute later (for it) the window has moved.
    assert gateway.advance_clock(61_000) == 61_000
    assert gateway.send(headers=alice).status == 200
    assert gateway.send(headers=alice).status == 429
    assert gateway.advance_clock(500) == 61_500
