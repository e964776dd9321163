"""The emulator is faithful to Envoy for this filter: the stock build (`dist/edge-rate-limiter-envoy.wasm`,
Redis through webdis) plays one scripted scenario in real Envoy 1.40 and then in the project's proxy-wasm
host emulator (`wasm-host serve`, tests/host), each time from an empty Redis (FLUSHALL) holding the same
pre-existing limiters, and both runs must answer alike.

Compared per request: status, body, and the headers the filter controls (`retry-after`, `ratelimit`,
`ratelimit-policy`, `x-ratelimit-*`, `x-envoy-ratelimited`, `content-type`); after the run: the state in
Redis (every limiter hash, every value key, and per permits set its size and the permits of its members,
not their random bytes or exact scores) and the filter's counters. A difference is a bug in the emulator
until shown otherwise.

Whole seconds (`Retry-After`, `t=`) are compared exactly: with 1 minute windows, 5 ms between requests
(more than Redisson's 3 ms slack) and each run taking under a second, both round the same way. Real Envoy's
clock cannot be moved, and its run takes 0.6-0.8 s (about 40 ms per request the upstream answers, even on an
idle machine), so a run the machine made slower than RUN_BUDGET_S is played again from an empty Redis (up to
ATTEMPTS times) rather than compared; the emulator's takes about 0.3 s. The steps after Redis hung (a timeout
each run waits out differently) are compared without their whole seconds.

The scenario includes the local block: alice's rejection blocks her limiter in the gateway, so her next
requests are rejected without Redis (even while Redis is down); the per-ip rule turns its block off.
"""

from __future__ import annotations

import re
import time
from typing import Any, NamedTuple

import pytest

from harness import decode_permit, http_request, plugin_config, rule, wait_until

CONFIG = plugin_config(
    rule(rate=3, interval="1m"),
    rule("weighted", limit_by={"header": "x-tenant-id"}, rate=5, interval="1m", permits=2),
    rule("per-key", limit_by={"query": "api_key"}, rate=40, interval="1m", on_missing="deny"),
    # No local block for per-ip: once fay exhausts it, the requests while Redis is in trouble still reach
    # the failure mode.
    rule("per-ip", limit_by="client_ip", rate=20, interval="1m", local_block_max=0),
    timeout="500ms",
    rate_limit_headers="both",
    failure_mode="allow",
)

# Limiters that exist before the gateway sees a request, as a Java service (trySetRate) left them.
PRE_EXISTING = {
    # carol: Redis says 1 per minute, the rule 3: Redis wins.
    "erl:per-user:carol": {b"rate": b"1", b"interval": b"60000", b"type": b"0", b"keepAliveTime": b"0"},
    # tiny: 1 per minute, fewer than the 2 permits a weighted request takes: rejected without Retry-After.
    "erl:weighted:tiny": {b"rate": b"1", b"interval": b"60000", b"type": b"0", b"keepAliveTime": b"0"},
}

GAP_S = 0.025  # between requests: more than the 23 ms a refusal's delay adds to the window (Redisson's 3 ms, the clock guard's 20)
# Whole seconds round alike while every limiter's oldest permit is younger than 1 s at each of its requests
# (t=60 below an age of 1000 ms, Retry-After 60 below 1003 ms); the per-ip limiter spans the whole scenario,
# so a run must take under 1 s, with 20 ms to spare for clocks read in whole ms.
RUN_BUDGET_S = 0.98
ATTEMPTS = 5
# Redis hangs far longer than the 500 ms timeout (the pause is lifted as soon as the step is answered).
PAUSE_MS = 10_000
FILTER_HEADERS = ("retry-after", "ratelimit", "ratelimit-policy", "x-envoy-ratelimited", "x-ratelimited-by",
                  "content-type")
COUNTERS = ("allowed", "rejected", "local_rejected", "failure_allowed", "failure_denied", "redis_errors")


class Step(NamedTuple):
    label: str
    path: str
    headers: dict[str, str]


def step(label: str, user: str | None = None, tenant: str | None = None, key: str | None = "k1") -> Step:
    headers = {}
    if user is not None:
        headers["x-user-id"] = user
    if tenant is not None:
        headers["x-tenant-id"] = tenant
    return Step(label, "/" if key is None else f"/?api_key={key}", headers)


SCENARIO = [
    *[step(f"alice {n} of a burst past the rate 3", user="alice") for n in range(1, 5)],
    *[step(f"bob {n}: his own limiter", user="bob") for n in range(1, 3)],
    *[step(f"carol {n}: pre-existing limiter at rate 1", user="carol") for n in range(1, 3)],
    *[step(f"tenant acme {n}: 2 permits of 5", tenant="acme") for n in range(1, 4)],
    step("tenant tiny: 2 permits, its limiter's rate is 1", tenant="tiny"),
    step("no api_key: on_missing deny", user="dave", key=None),
    step("alice again with tenant globex: per-user's local block rejects", user="alice", tenant="globex"),
    step("no user, no tenant, another api_key", key="k2"),
    step("a user id that is not a verbatim name", user="a{b} c"),
    # Ten: only requests every rule admits take per-ip's permits (all-or-nothing), 16 so far.
    *[step(f"eve's colleague {n}: towards the per-ip rate 20", user=f"eve{n}", key="k3") for n in range(1, 11)],
    step("fay: only the per-ip limiter is exhausted", user="fay", key="k2"),
]
WHEN_REDIS_HANGS = [step("gus, Redis paused past the timeout: fail open", user="gus", key="k5")]
WHEN_REDIS_IS_DOWN = [
    step("alice, Redis stopped: still blocked locally", user="alice"),
    step("zoe, Redis stopped: fail open", user="zoe", key="k4"),
]
INVALID = plugin_config(rule(rate=3, interval="1m"), rule("per-ip", limit_by="client_ip", rate=0, interval="1m"))


class Observed(NamedTuple):
    label: str
    status: int
    body: str
    headers: dict[str, str]


class Run(NamedTuple):
    responses: list[Observed]
    redis: dict[str, Any]
    metrics: dict[str, int]


def observe(gateway, steps: list[Step], exact_seconds: bool = True) -> list[Observed]:
    """Each step's response. `exact_seconds=False`: whole seconds (`Retry-After`, `t=`, `x-ratelimit-reset`)
    become `*`, for steps after Redis hung, whose timing the runs do not share."""
    observed = []
    for item in steps:
        response = gateway.send(item.path, headers=item.headers)
        headers = {name: value for name, value in response.headers.items()
                   if name in FILTER_HEADERS or name.startswith("x-ratelimit-")}
        if not exact_seconds:
            headers = {name: "*" if name in ("retry-after", "x-ratelimit-reset") else re.sub(r"t=\d+", "t=*", value)
                       for name, value in headers.items()}
        observed.append(Observed(item.label, response.status, response.body, headers))
        time.sleep(GAP_S)
    return observed


def redis_state(redis) -> dict[str, Any]:
    """Every key: hashes and strings whole; permits sets as their size and members' permits (sorted);
    whether the key expires."""
    state: dict[str, Any] = {}
    for key in sorted(redis.keys("*")):
        kind = redis.type(key).decode()
        if kind == "hash":
            value: Any = redis.hgetall(key)
        elif kind == "string":
            value = redis.get(key)
        elif kind == "zset":
            members = redis.zrange(key, 0, -1, withscores=True)
            value = (len(members), sorted(decode_permit(member, score).permits for member, score in members))
        else:
            value = kind
        state[key.decode()] = (kind, value, "expires" if redis.pttl(key) > 0 else "persists")
    return state


def fresh_redis(stack) -> None:
    """Redis running and empty but for the pre-existing limiters, webdis connected to it."""
    stack.redis.start()
    stack.webdis.start()
    wait_until(lambda: http_request(stack.webdis.port, "/PING", timeout=1.0).status == 200, 10.0,
               "webdis to reach Redis")
    stack.redis.client.flushall()
    for name, config in PRE_EXISTING.items():
        stack.redis.client.hset(name, mapping=config)


def play(stack, gateway) -> Run:
    """The scenario on `gateway` from an empty Redis; the counters are what this run added to them."""
    took = []
    for _ in range(ATTEMPTS):
        before = gateway.metrics()
        fresh_redis(stack)
        started = time.monotonic()
        responses = observe(gateway, SCENARIO)
        took.append(time.monotonic() - started)
        if took[-1] < RUN_BUDGET_S:
            break
    else:
        raise AssertionError(f"too slow: the scenario took {', '.join(f'{t:.2f}' for t in took)} s, over "
                             f"{RUN_BUDGET_S} s: whole seconds in the headers could round differently")
    state = redis_state(stack.redis.client)
    stack.redis.pause(PAUSE_MS)
    try:
        responses += observe(gateway, WHEN_REDIS_HANGS, exact_seconds=False)
    finally:
        stack.redis.unpause()
    stack.redis.stop()
    try:
        responses += observe(gateway, WHEN_REDIS_IS_DOWN, exact_seconds=False)
    finally:
        stack.redis.start()
    metrics = gateway.metrics()
    return Run(responses, state, {name: metrics.get(name, 0) - before.get(name, 0) for name in COUNTERS})


@pytest.fixture(scope="module")
def emulators(processes):
    """The scenario's emulator and one with an invalid configuration, started together: they compile the
    module (seconds with a debug wasm-host) while Envoy plays the scenario."""
    started = (processes.emulator(CONFIG, build="envoy", keep=True, wait_ready=False),
               processes.emulator(INVALID, build="envoy", keep=True, wait_ready=False))
    try:
        yield started
    finally:
        for emulator in started:
            emulator.stop()


@pytest.fixture(scope="module")
def runs(processes, emulators) -> dict[str, Run]:
    emulator = emulators[0]
    try:
        envoy = processes.envoy(CONFIG)
        try:
            in_envoy = play(processes, envoy)
        finally:
            processes.stop_envoys()
        emulator.wait_ready()
        in_emulator = play(processes, emulator)
        kinds = emulator.outcome_kinds()
    finally:
        emulator.stop()
    assert set(kinds) <= {"continued", "local_reply"}, kinds
    return {"envoy": in_envoy, "emulator": in_emulator}


def differences(envoy: list[Observed], emulator: list[Observed]) -> str:
    lines = []
    for in_envoy, in_emulator in zip(envoy, emulator):
        if in_envoy != in_emulator:
            lines.append(f"{in_envoy.label}:\n  envoy:    {in_envoy[1:]}\n  emulator: {in_emulator[1:]}")
    return "\n".join(lines)


def test_every_response_is_the_same(runs):
    envoy, emulator = runs["envoy"].responses, runs["emulator"].responses
    assert len(envoy) == len(emulator) == len(SCENARIO) + len(WHEN_REDIS_HANGS) + len(WHEN_REDIS_IS_DOWN)
    assert envoy == emulator, differences(envoy, emulator)


def test_the_scenario_covers_what_it_says(runs):
    """The scenario is worth comparing: it allows, rejects with and without Retry-After, denies a missing
    key, reaches the per-ip rate and fails open (checked on Envoy's run)."""
    by_label = {observed.label: observed for observed in runs["envoy"].responses}
    statuses = [by_label[f"alice {n} of a burst past the rate 3"].status for n in range(1, 5)]
    assert statuses == [200, 200, 200, 429]
    assert by_label["alice 4 of a burst past the rate 3"].headers["retry-after"] == "60"
    assert by_label["carol 2: pre-existing limiter at rate 1"].status == 429
    tiny = by_label["tenant tiny: 2 permits, its limiter's rate is 1"]
    assert tiny.status == 429 and "retry-after" not in tiny.headers
    assert by_label["no api_key: on_missing deny"].status == 429
    fay = by_label["fay: only the per-ip limiter is exhausted"]
    # All or nothing: per-ip rejected fay, so per-user took none of her permits (r=3, not 2).
    assert fay.status == 429 and '"per-user";r=3' in fay.headers["ratelimit"]
    assert fay.headers["x-ratelimited-by"] == "per-ip"
    assert "x-ratelimit-limit" in by_label["bob 1: his own limiter"].headers
    assert "ratelimit-policy" in by_label["bob 1: his own limiter"].headers
    again = by_label["alice again with tenant globex: per-user's local block rejects"]
    assert again.status == 429 and again.headers["retry-after"] == "60"
    assert [observed.status for observed in runs["envoy"].responses[-3:]] == [200, 429, 200]


def test_the_state_in_redis_is_the_same(runs):
    envoy, emulator = runs["envoy"].redis, runs["emulator"].redis
    assert sorted(envoy) == sorted(emulator)
    for key in envoy:
        assert envoy[key] == emulator[key], key
    assert "erl:per-ip:127.0.0.1" in envoy


def test_the_counters_are_the_same(runs):
    assert runs["envoy"].metrics == runs["emulator"].metrics
    # Alice's block outlives Redis: her request while Redis is down is rejected locally, not failed open.
    assert runs["envoy"].metrics["failure_allowed"] == len(WHEN_REDIS_HANGS) + len(WHEN_REDIS_IS_DOWN) - 1
    assert runs["envoy"].metrics["local_rejected"] == 2


def refusal(log: str) -> str:
    """The first `invalid configuration: <field>: <reason>` of a log."""
    lines = [line.split("edge-rate-limiter: ", 1)[1] for line in log.splitlines()
             if "edge-rate-limiter: invalid configuration: " in line]
    assert lines, log[-2000:]
    return lines[0].strip()


def test_an_invalid_configuration_is_refused_alike(stack, emulators):
    refused = emulators[1]
    envoy = stack.envoy(INVALID, wait_ready=False)

    assert envoy.wait_exit(timeout=20.0) not in (None, 0)
    assert refused.wait_exit(timeout=refused.READY_TIMEOUT) == 2, "wasm-host exits 2 when the plugin refuses"
    assert refusal(refused.log_text()) == refusal(envoy.log_text()) == (
        "invalid configuration: rules[1].rate: must be at least 1")
