"""A host that misbehaves must not leave a request paused: both builds in the host emulator, whose faults
(tests/host README, "Faults") take away what each path depends on, on a real Redis.

- a call the host accepted and never answers (its reply dropped),
- a reply that carries a token nobody waits for (misrouted),
- a refused switch to the request's context when its decision is ready.

Each request must end within `redis.timeout` plus the filter's deadline guard (10 ms grace, 10 ms ticks),
in the failure mode, counted; a refused switch is counted and the decision delivered a tick later.
"""

from __future__ import annotations

import pytest

from harness import HarnessError, config_for, delta, rule, timed_send

TIMEOUT_MS = 200
# The guard ends a call 10 ms after the timeout, at the next 10 ms tick; the rest is the emulator, Redis and
# the test on a busy 2-core CI machine (measured here: the guard ends such requests 215-235 ms after they
# were sent).
BOUND_S = TIMEOUT_MS / 1000 + 0.5
ALWAYS = 2**32 - 1

# The fault that drops every reply of a build's Redis calls: the stock build reaches Redis through webdis
# (HTTP calls), the Higress build through the host's Redis client.
DROP_REPLIES = {"envoy": "drop_http_call_responses", "higress": "drop_redis_replies"}


@pytest.fixture(scope="module")
def gateways(processes):
    """Both builds, failing open and closed, compiled once for the module (all at once), then shared; each
    test uses its own key values. A request the emulator cannot get answered counts as paused after 1 s."""
    started = {}
    try:
        for build in DROP_REPLIES:
            for mode in ("allow", "deny"):
                plugin = config_for(build, rule(rate=5, interval="1m"), timeout=TIMEOUT_MS, failure_mode=mode)
                started[build, mode] = processes.emulator(plugin, build=build, vms=1, keep=True, wait_ready=False,
                                                          pause_deadline_ms=1000)
        for gw in started.values():
            gw.wait_ready()
            # A readiness request may leave a call on its way (docs/reliability.md, "Late replies"): let the
            # filter give it up now, not inside a test's counted window.
            gw.run_for(2 * TIMEOUT_MS + 50)
        yield started
    finally:
        for gw in started.values():
            gw.stop()


@pytest.fixture(params=sorted(DROP_REPLIES), ids=lambda build: f"{build}-build")
def build(request) -> str:
    return request.param


@pytest.fixture
def gateway(gateways, stack):
    """`gateway(build, failure_mode)`: the module's emulator, with no fault in force."""
    def pick(build: str, failure_mode: str):
        gw = gateways[build, failure_mode]
        gw.set_faults()
        return gw
    return pick


@pytest.mark.parametrize("failure_mode, status, counter", [("allow", 200, "failure_allowed"),
                                                            ("deny", 503, "failure_denied")])
def test_a_call_never_answered_ends_in_the_failure_mode_within_the_timeout(gateway, build, failure_mode, status,
                                                                           counter):
    gw = gateway(build, failure_mode)
    gw.set_faults(**{DROP_REPLIES[build]: True})
    before = gw.metrics()

    response, took = timed_send(gw, f"dropped-{failure_mode}")

    assert response.status == status
    assert took < BOUND_S, f"waited {took:.3f} s"
    assert gw.last_outcome()["kind"] in ("continued", "local_reply")
    assert delta(before, gw.metrics()) == {counter: 1, "redis_calls": 1, "redis_errors": 1,
                                           "rule.per-user.failures": 1}
    assert "no answer to a Redis call within redis.timeout" in gw.log_text()  # (logged once per cause)
    gw.set_faults()
    assert gw.send(headers={"x-user-id": f"after-{failure_mode}"}).status == 200, "back to normal with the host"


def test_a_reply_with_an_unknown_token_is_dropped_and_the_request_ends_at_its_deadline(gateway, build):
    gw = gateway(build, "deny")
    gw.set_faults(misroute_tokens=True)
    before = gw.metrics()

    response, took = timed_send(gw, "misrouted")

    assert response.status == 503, "fail closed: the real reply never reached the request"
    assert took < BOUND_S
    # Its call, on its way when the request stopped waiting, is given up one timeout later, never answered
    # (docs/reliability.md, "Late replies"); the emulator's clock runs only when told.
    gw.run_for(TIMEOUT_MS + 50)
    counted = delta(before, gw.metrics())
    assert counted.pop("late_unanswered", 0) >= 1, counted
    assert counted == {"failure_denied": 1, "redis_calls": 1, "redis_errors": 1, "rule.per-user.failures": 1}
    assert "a reply for unknown call" not in gw.log_text(), "logged at debug level only"


def test_a_refused_switch_is_counted_and_the_decision_delivered_on_the_next_tick(gateway, build):
    gw = gateway(build, "deny")
    gw.set_faults(refuse_effective_context=1)
    before = gw.metrics()

    response, took = timed_send(gw, "switched")

    assert response.status == 200, "the real decision (allowed), not the failure mode"
    assert took < BOUND_S
    assert delta(before, gw.metrics()) == {"allowed": 1, "redis_calls": 1, "host_errors": 1,
                                           "rule.per-user.allowed": 1}
    assert "the host refused proxy_set_effective_context" in gw.log_text()


def test_a_host_that_always_refuses_the_switch_cannot_be_answered_but_the_vm_keeps_working(gateway, build):
    gw = gateway(build, "allow")
    gw.set_faults(refuse_effective_context=ALWAYS)
    with pytest.raises(HarnessError, match="paused"):
        gw.send(headers={"x-user-id": "refused"})  # nothing can reach a context the host refuses to switch to
    assert gw.metrics()["host_errors"] >= 10, "the decision was offered again on every tick, and counted"
    gw.set_faults()
    # The host ended that stream (its pause deadline): the filter forgot it. Requests after the fault are
    # decided normally: the VM did not trap and the guard keeps no stale state (alice's permit counted).
    assert [gw.send(headers={"x-user-id": "refused"}).status for _ in range(5)] == [200] * 4 + [429]
    assert "vm_failed" not in gw.outcome_kinds()
