"""All-or-nothing rules: a request that one rule rejects takes no permits from any other rule.

With one Redis (the default), all of a request's limiters go in one Redis call (ACQUIRE_ALL), which checks
every limiter first and takes permits only if every one admits: a user rejected by their own limit costs
the shared (global) limit nothing, and each request costs one round trip however many rules it matches.

With `redis.redis_cluster: true`, limiters in different hash slots are asked in separate calls; when one
rejects after another admitted, the filter gives back what the admitting one took (GIVE_BACK, counted in
`compensations`), without making the client wait for it: the limiter ends up with the members and value it
had, and its value never exceeds its rate. A single redis-server stands in for the cluster: the slots are
computed (CRC16) exactly as Redis Cluster would, and limiters whose names share a hash tag share one call.

In real Envoy (2 workers) and in the host emulator (the stock build through webdis, the Higress build
through the host's Redis client). A rejection names the first rejecting rule in `x-ratelimited-by` and
counts in that rule's `rule.<name>.rejected`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (HarnessError, decode_permit, host_plugin_config, limiter_key, plugin_config, rule,
                     wait_until)

ALICE = {"x-user-id": "alice"}
BOB = {"x-user-id": "bob"}
CAROL = {"x-user-id": "carol"}

# A shared limit and a per-user one; the shared rule comes first, so it has admitted (and would have taken
# its permit) by the time the per-user rule rejects.
GLOBAL = rule("global", limit_by="global", rate=100, interval="1m")
PER_USER = rule("per-user", rate=2, interval="1m")
# The same rule without the local block: every request reaches Redis.
PER_USER_EVERY_TIME = {**PER_USER, "local_block_max": 0}

# Two global limiters in different Redis Cluster hash slots (`erl:a`, `erl:b`): a admits, b runs out.
RULE_A = rule("a", limit_by="global", rate=100, interval="1m")
RULE_B = rule("b", limit_by="global", rate=2, interval="1m", local_block_max=0)
CLUSTER = {"redis_cluster": True}

BUILDS = ["envoy", "higress"]


# --- Helpers ----------------------------------------------------------------------------------------------


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}


def round_trips(outcome: dict) -> int:
    """Calls to Redis an emulator request made: through webdis (HTTP) or the host's Redis client."""
    return outcome["redis_calls"] + outcome["http_calls"]


def crc16_xmodem(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def hash_slot(key: str) -> int:
    """Redis Cluster's slot of a key: CRC16/XMODEM of its hash tag (the text inside the first non-empty
    `{...}`), else of the whole key, modulo 16384."""
    raw = key.encode()
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1:end]
    return crc16_xmodem(raw) % 16384


def state(stack, name: str) -> tuple[int | None, dict[bytes, float]]:
    """A limiter's value (permits free) and its permit members with their scores."""
    client = stack.redis.client
    value = client.get(limiter_key(name, "value"))
    members = dict(client.zrange(limiter_key(name, "permits"), 0, -1, withscores=True))
    return (None if value is None else int(value)), members


def permits_of(members: dict[bytes, float]) -> list[int]:
    return sorted(decode_permit(member, score).permits for member, score in members.items())


def config_for(build: str, *rules: dict, **fields):
    """The stock build through webdis, the Higress build through the host's Redis client."""
    return (host_plugin_config if build == "higress" else plugin_config)(*rules, **fields)


def burst(send, headers: dict[str, str], n: int) -> list:
    """`n` requests in flight together, each on its own connection."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(lambda _: send(headers=headers), range(n)))


def assert_rejected_by(response, rule_name: str) -> None:
    assert response.status == 429, response
    assert response.headers["x-ratelimited-by"] == rule_name, response.headers
    # Redisson's delay, 3 ms past the oldest permit's departure from a 1-minute window: 61 s within 3 ms of
    # that permit, 59 s a second after it.
    assert response.headers["retry-after"] in {"59", "60", "61"}, response.headers
    assert response.headers["x-envoy-ratelimited"] == "true"


def wait_for_give_backs(stack, name: str, expected: tuple[int | None, dict[bytes, float]], rate: int) -> None:
    """Polls (up to 2 s) until limiter `name` is back to `expected`; every value seen meanwhile is at most
    the rate."""
    seen: list[tuple[int | None, dict[bytes, float]]] = []

    def restored() -> bool:
        seen.append(state(stack, name))
        return seen[-1] == expected

    try:
        wait_until(restored, 2.0, f"the give-backs to restore {name}")
    except HarnessError:
        value, members = seen[-1] if seen else (None, {})
        pytest.fail(f"{name} not restored within 2 s: value {value} (expected {expected[0]}), "
                    f"{len(members)} members (expected {len(expected[1])}), permits {permits_of(members)}")
    assert all(value is not None and value <= rate for value, _ in seen), [value for value, _ in seen]


@pytest.fixture(scope="module")
def emulators(processes):
    """One emulator per build for the whole module (compiling the module takes seconds); each test gives it
    its own configuration with `reconfigure()`, which also forgets every local block."""
    started = {build: processes.emulator(config_for(build, RULE_A), build=build, keep=True, wait_ready=False)
               for build in BUILDS}
    try:
        for gateway in started.values():
            gateway.wait_ready()
        yield started
    finally:
        for gateway in started.values():
            gateway.stop()


def gateway_with(emulators, build: str, *rules: dict, **fields):
    gateway = emulators[build]
    gateway.reconfigure(config_for(build, *rules, **fields))
    return gateway


# --- Real Envoy -------------------------------------------------------------------------------------------


def test_in_envoy_a_user_over_their_limit_costs_the_global_limit_nothing(stack):
    """Alice exhausts her per-user limit; her burst is rejected naming `per-user`, and the global limit's
    value and permits stay exactly as they were. Every request, allowed or rejected, is one Redis call."""
    envoy = stack.envoy(plugin_config(GLOBAL, PER_USER_EVERY_TIME), concurrency=2)
    assert envoy.send(headers=CAROL).status == 200  # loads the script into Redis (EVALSHA, then EVAL)

    metrics, scripts = envoy.metrics(), stack.redis.script_calls()
    for n in (1, 2):
        assert envoy.send(headers=ALICE).status == 200
        assert stack.redis.script_calls() - scripts == n, "both rules in one call"
    global_before = state(stack, "erl:global")
    assert global_before[0] == 97 and permits_of(global_before[1]) == [1, 1, 1]

    responses = burst(envoy.send, ALICE, 8)
    for response in responses:
        assert_rejected_by(response, "per-user")
    assert state(stack, "erl:global") == global_before, "the rejected burst took nothing from the global limit"
    assert state(stack, "erl:per-user:alice")[0] == 0
    assert stack.redis.script_calls() - scripts == 10, "one call per request, allowed or rejected"
    after = envoy.metrics()
    # The global rule admitted all 10 (per-rule counters count what each rule decided, not what it was charged).
    assert delta(metrics, after) == {"allowed": 2, "rejected": 8, "redis_calls": 10, "rule.per-user.rejected": 8,
                                     "rule.per-user.allowed": 2, "rule.global.allowed": 10}
    assert after["rule.global.rejected"] == 0

    assert envoy.send(headers=BOB).status == 200
    assert state(stack, "erl:global")[0] == 96, "the global limit still charges requests both rules admit"


def test_in_envoy_the_local_block_keeps_the_global_limit_untouched_too(stack):
    """With the local block (the default), Redis rejects alice once, in one call; her later requests are
    rejected without a call, and neither path takes a global permit."""
    envoy = stack.envoy(plugin_config(GLOBAL, PER_USER), concurrency=2)
    assert [envoy.send(headers=ALICE).status for _ in range(2)] == [200, 200]
    global_before = state(stack, "erl:global")

    metrics, scripts = envoy.metrics(), stack.redis.script_calls()
    assert_rejected_by(envoy.send(headers=ALICE), "per-user")
    assert stack.redis.script_calls() - scripts == 1
    for response in burst(envoy.send, ALICE, 6):
        assert_rejected_by(response, "per-user")
    assert stack.redis.script_calls() - scripts == 1, "the block: no call, so nothing asked of the global limit"
    assert state(stack, "erl:global") == global_before
    assert delta(metrics, envoy.metrics()) == {"rejected": 7, "local_rejected": 6, "redis_calls": 1,
                                              "rule.per-user.rejected": 7, "rule.per-user.local_rejected": 6,
                                              "rule.global.allowed": 1}


def test_in_envoy_with_redis_cluster_a_permit_taken_in_another_slot_is_given_back(stack):
    """Rules a and b live in different hash slots, so they are asked in two calls; b rejects a burst that a
    admitted. Each client gets 429 from b at once; the give-backs then restore a to the members and value it
    had, one `compensations` call per rejected request."""
    assert hash_slot(limiter_key("erl:a", "value")) != hash_slot(limiter_key("erl:b", "value"))
    envoy = stack.envoy(plugin_config(RULE_A, RULE_B, redis=CLUSTER), concurrency=2)
    assert [envoy.send().status for _ in range(2)] == [200, 200]  # b is out of permits
    a_before = state(stack, "erl:a")
    assert a_before[0] == 98 and permits_of(a_before[1]) == [1, 1]
    assert_rejected_by(envoy.send(), "b")  # loads GIVE_BACK into Redis
    wait_for_give_backs(stack, "erl:a", a_before, rate=100)

    metrics, b_before = envoy.metrics(), state(stack, "erl:b")
    for response in burst(envoy.send, {}, 8):
        assert_rejected_by(response, "b")
    wait_for_give_backs(stack, "erl:a", a_before, rate=100)
    assert state(stack, "erl:b") == b_before
    wait_until(lambda: delta(metrics, envoy.metrics()).get("compensations") == 8, 2.0, "8 compensations")
    assert delta(metrics, envoy.metrics()) == {"rejected": 8, "rule.b.rejected": 8, "compensations": 8,
                                              "rule.a.allowed": 8,
                                              "redis_calls": 8 * 3}  # a, b, and a's give-back


# --- The host emulator, both builds -----------------------------------------------------------------------


@pytest.mark.parametrize("build", BUILDS)
def test_a_user_over_their_limit_costs_the_global_limit_nothing_in_both_builds(stack, emulators, build):
    gateway = gateway_with(emulators, build, GLOBAL, PER_USER_EVERY_TIME)
    assert gateway.send(headers=CAROL).status == 200  # loads the script into Redis

    metrics, sent = gateway.metrics(), len(gateway.outcomes)
    assert [gateway.send(headers=ALICE).status for _ in range(2)] == [200, 200]
    global_before = state(stack, "erl:global")
    assert global_before[0] == 97

    responses = gateway.send_batch([{"headers": ALICE}] * 8)
    for response in responses:
        assert_rejected_by(response, "per-user")
    assert [round_trips(outcome) for outcome in gateway.outcomes[sent:]] == [1] * 10, "one call per request"
    assert state(stack, "erl:global") == global_before
    assert delta(metrics, gateway.metrics()) == {"allowed": 2, "rejected": 8, "redis_calls": 10,
                                                "rule.per-user.rejected": 8, "rule.per-user.allowed": 2,
                                                "rule.global.allowed": 10}


@pytest.mark.parametrize("build", BUILDS)
def test_with_redis_cluster_a_permit_taken_in_another_slot_is_given_back_in_both_builds(stack, emulators, build):
    gateway = gateway_with(emulators, build, RULE_A, RULE_B, redis=CLUSTER)
    assert [gateway.send().status for _ in range(2)] == [200, 200]
    a_before, b_before = state(stack, "erl:a"), state(stack, "erl:b")
    assert (a_before[0], b_before[0]) == (98, 0)
    assert_rejected_by(gateway.send(), "b")  # loads GIVE_BACK into Redis
    wait_for_give_backs(stack, "erl:a", a_before, rate=100)

    metrics, sent = gateway.metrics(), len(gateway.outcomes)
    for response in gateway.send_batch([{}] * 6):
        assert_rejected_by(response, "b")
    # Each request: a's acquire and b's (two slots, two calls), then a's give-back.
    assert [round_trips(outcome) for outcome in gateway.outcomes[sent:]] == [3] * 6
    wait_for_give_backs(stack, "erl:a", a_before, rate=100)
    assert state(stack, "erl:b") == b_before
    gateway.run_for(100)  # the give-backs' replies reach the filter
    assert delta(metrics, gateway.metrics()) == {"rejected": 6, "rule.b.rejected": 6, "compensations": 6,
                                                "rule.a.allowed": 6, "redis_calls": 6 * 3}


@pytest.mark.parametrize("build,cluster", [("envoy", False), ("higress", True)],
                         ids=["envoy-one-redis", "higress-redis-cluster"])
def test_when_every_rule_admits_each_limiter_is_charged_its_permits(stack, emulators, build, cluster):
    """The all-or-nothing path does charge: each limiter loses the rule's permits, as one member each."""
    a = rule("a", limit_by="global", rate=10, interval="1m", permits=2)
    b = rule("b", limit_by="global", rate=6, interval="1m", permits=3)
    gateway = gateway_with(emulators, build, a, b, redis={"redis_cluster": cluster})
    metrics = gateway.metrics()
    for n in (1, 2):
        assert gateway.send().status == 200
        (a_value, a_members), (b_value, b_members) = state(stack, "erl:a"), state(stack, "erl:b")
        assert (a_value, permits_of(a_members)) == (10 - 2 * n, [2] * n)
        assert (b_value, permits_of(b_members)) == (6 - 3 * n, [3] * n)
    # (The first request may also have loaded the script.)
    assert round_trips(gateway.last_outcome()) == (2 if cluster else 1)
    after = delta(metrics, gateway.metrics())
    assert after["allowed"] == 2 and "compensations" not in after and "rejected" not in after


def test_with_redis_cluster_limiters_sharing_a_hash_tag_are_asked_in_one_call(stack, emulators):
    """Limiter names with one hash tag (`{acct}`) are in one slot: one all-or-nothing call, nothing to give
    back."""
    a = rule("a", limit_by="global", limiter="{acct}.a", rate=100, interval="1m")
    b = rule("b", limit_by="global", limiter="{acct}.b", rate=1, interval="1m", local_block_max=0)
    assert hash_slot(limiter_key("{acct}.a", "value")) == hash_slot(limiter_key("{acct}.b", "permits"))
    gateway = gateway_with(emulators, "higress", a, b, redis=CLUSTER)
    assert gateway.send().status == 200
    a_before = state(stack, "{acct}.a")
    metrics = gateway.metrics()
    for _ in range(3):
        assert_rejected_by(gateway.send(), "b")
        assert round_trips(gateway.last_outcome()) == 1
    assert state(stack, "{acct}.a") == a_before
    assert delta(metrics, gateway.metrics()) == {"rejected": 3, "rule.b.rejected": 3, "rule.a.allowed": 3,
                                                "redis_calls": 3}


# --- Two rules on one limiter -----------------------------------------------------------------------------

# Two rules on one limiter per account (`erl:shared:<account>`), 2 permits each, rate 3: a request both
# rules apply to asks 4 permits in total.
SHARED_ONE = rule("one", limit_by={"header": "x-one"}, limiter="erl:shared", rate=3, interval="1m", permits=2)
SHARED_TWO = rule("two", limit_by={"header": "x-two"}, limiter="erl:shared", rate=3, interval="1m", permits=2)
BOTH = {"x-one": "acme", "x-two": "acme"}


@pytest.mark.parametrize("build", BUILDS)
def test_two_rules_asking_one_limiter_for_more_than_its_rate_take_nothing(stack, emulators, build):
    """Each rule alone fits the rate, both together do not: the request is rejected by the second rule,
    nothing is taken, and a request only one rule applies to still gets its 2 of the 3 permits."""
    gateway = gateway_with(emulators, build, *[{**r, "local_block_max": 0} for r in (SHARED_ONE, SHARED_TWO)])
    metrics = gateway.metrics()
    for _ in range(2):
        response = gateway.send(headers=BOTH)
        assert response.status == 429 and response.headers["x-ratelimited-by"] == "two", response
        assert "retry-after" not in response.headers, "4 permits of a rate of 3: no wait can grant them"
        assert response.headers["ratelimit"] == '"one";r=3;t=60, "two";r=0;t=60', "one's 2 are free again"
        assert state(stack, "erl:shared:acme") == (3, {}), "nothing taken"
    assert round_trips(gateway.last_outcome()) == 1
    assert gateway.send(headers={"x-one": "acme"}).status == 200
    value, members = state(stack, "erl:shared:acme")
    assert (value, permits_of(members)) == (1, [2])
    assert delta(metrics, gateway.metrics()) == {"allowed": 1, "rejected": 2, "rule.two.rejected": 2,
                                                "rule.one.allowed": 3, "redis_calls": 3}


def test_the_block_a_combined_rejection_leaves_rejects_no_request_redis_would_admit(stack, emulators):
    """With the local block on (the default), after the 4-permit request is rejected, a request asking only 2
    of the limiter's 3 free permits is admitted, as Redis would admit it."""
    gateway = gateway_with(emulators, "envoy", SHARED_ONE, SHARED_TWO)
    assert gateway.send(headers=BOTH).status == 429
    assert state(stack, "erl:shared:acme") == (3, {})
    response = gateway.send(headers={"x-one": "acme"})
    assert (response.status, round_trips(gateway.last_outcome())) == (200, 1), response
