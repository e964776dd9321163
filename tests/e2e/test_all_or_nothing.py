"""All-or-nothing rules: a request that one rule rejects takes no permits from any other rule.

With one Redis (the default), all of a request's limiters go in one Redis call (ACQUIRE_ALL), which checks
every limiter first and takes permits only if every one admits: a user rejected by their own limit costs
the shared (global) limit nothing, and each request costs one round trip however many rules it matches.

With `redis.redis_cluster: true`, limiters in different hash slots are asked in separate calls; when one
rejects after another admitted, the filter gives back what the admitting one took (GIVE_BACK, counted in
`compensations`), without making the client wait for it: the limiter ends up with the members and value it
had, and its value never exceeds its rate. A single redis-server stands in for the cluster: the slots are
computed (CRC16) exactly as Redis Cluster would, and limiters whose names share a hash tag share one call.

In every gateway (conftest.GATEWAYS: real Envoy with 2 workers, the host emulator with the stock build
through webdis and with the Higress build through the host's Redis client) unless a test says otherwise.
A rejection names the first rejecting rule in `x-ratelimited-by` and counts in that rule's
`rule.<name>.rejected`.
"""

from __future__ import annotations

import pytest

from harness import HarnessError, decode_permit, delta, limiter_key, rule, wait_until

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
# Tests that count one Redis call per request (a burst's requests in flight together) turn request
# coalescing off: with it, the burst's waiting requests share calls (tests/e2e/test_coalescing.py).
ONE_CALL_EACH = {"max_batch": 1}


# --- Helpers ----------------------------------------------------------------------------------------------


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


def assert_rejected_by(response, rule_name: str) -> None:
    assert response.status == 429, response
    assert response.headers["x-ratelimited-by"] == rule_name, response.headers
    # Redisson's delay, 3 ms past the oldest permit's departure from a 1-minute window: 61 s within 3 ms of
    # that permit, 59 s a second after it.
    assert response.headers["retry-after"] in {"59", "60", "61"}, response.headers
    assert response.headers["x-envoy-ratelimited"] == "true"


def wait_for_give_backs(stack, gateway, name: str, expected: tuple[int | None, dict[bytes, float]],
                        rate: int) -> None:
    """Polls (up to 2 s) until limiter `name` is back to `expected`, the gateway working between the polls
    (an emulator delivers a give-back's reply, and sends its retry after NOSCRIPT, only then); every value
    seen meanwhile is at most the rate."""
    seen: list[tuple[int | None, dict[bytes, float]]] = []

    def restored() -> bool:
        gateway.let_run()
        seen.append(state(stack, name))
        return seen[-1] == expected

    try:
        wait_until(restored, 2.0, f"the give-backs to restore {name}")
    except HarnessError:
        value, members = seen[-1] if seen else (None, {})
        pytest.fail(f"{name} not restored within 2 s: value {value} (expected {expected[0]}), "
                    f"{len(members)} members (expected {len(expected[1])}), permits {permits_of(members)}")
    assert all(value is not None and value <= rate for value, _ in seen), [value for value, _ in seen]


# --- Every gateway ----------------------------------------------------------------------------------------


def test_a_user_over_their_limit_costs_the_global_limit_nothing(stack, start_gateway):
    """Alice exhausts her per-user limit; her burst is rejected naming `per-user`, and the global limit's
    value and permits stay exactly as they were. Every request, allowed or rejected, is one Redis call."""
    gateway = start_gateway(GLOBAL, PER_USER_EVERY_TIME, redis=ONE_CALL_EACH)
    assert gateway.send(headers=CAROL).status == 200  # loads the script into Redis (EVALSHA, then EVAL)

    metrics, scripts, sent = gateway.metrics(), stack.redis.script_calls(), gateway.sent()
    for n in (1, 2):
        assert gateway.send(headers=ALICE).status == 200
        assert stack.redis.script_calls() - scripts == n, "both rules in one call"
    global_before = state(stack, "erl:global")
    assert global_before[0] == 97 and permits_of(global_before[1]) == [1, 1, 1]

    for response in gateway.burst(ALICE, 8):
        assert_rejected_by(response, "per-user")
    assert state(stack, "erl:global") == global_before, "the rejected burst took nothing from the global limit"
    assert state(stack, "erl:per-user:alice")[0] == 0
    assert stack.redis.script_calls() - scripts == 10, "one call per request, allowed or rejected"
    if gateway.emulated:  # the emulator also tells which request made which call
        assert gateway.round_trips_since(sent) == [1] * 10, "one call per request"
    after = gateway.metrics()
    # The global rule admitted all 10 (per-rule counters count what each rule decided, not what it was charged).
    assert delta(metrics, after) == {"allowed": 2, "rejected": 8, "redis_calls": 10, "rule.per-user.rejected": 8,
                                     "rule.per-user.allowed": 2, "rule.global.allowed": 10}
    assert after["rule.global.rejected"] == 0

    assert gateway.send(headers=BOB).status == 200
    assert state(stack, "erl:global")[0] == 96, "the global limit still charges requests both rules admit"


def test_with_redis_cluster_a_permit_taken_in_another_slot_is_given_back(stack, start_gateway):
    """Rules a and b live in different hash slots, so they are asked in two calls; b rejects a burst that a
    admitted. Each client gets 429 from b at once; the give-backs then restore a to the members and value it
    had, one `compensations` call per rejected request."""
    assert hash_slot(limiter_key("erl:a", "value")) != hash_slot(limiter_key("erl:b", "value"))
    gateway = start_gateway(RULE_A, RULE_B, redis={**CLUSTER, **ONE_CALL_EACH})
    assert [gateway.send().status for _ in range(2)] == [200, 200]  # b is out of permits
    a_before, b_before = state(stack, "erl:a"), state(stack, "erl:b")
    assert (a_before[0], b_before[0]) == (98, 0) and permits_of(a_before[1]) == [1, 1]
    assert_rejected_by(gateway.send(), "b")  # loads GIVE_BACK into Redis
    wait_for_give_backs(stack, gateway, "erl:a", a_before, rate=100)

    metrics, sent = gateway.metrics(), gateway.sent()
    for response in gateway.burst({}, 8):
        assert_rejected_by(response, "b")
    if gateway.emulated:  # each request: a's acquire and b's (two slots, two calls), then a's give-back
        assert gateway.round_trips_since(sent) == [3] * 8
    wait_for_give_backs(stack, gateway, "erl:a", a_before, rate=100)
    assert state(stack, "erl:b") == b_before
    after = gateway.wait_for_metrics(lambda now: delta(metrics, now).get("compensations") == 8, "8 compensations")
    assert delta(metrics, after) == {"rejected": 8, "rule.b.rejected": 8, "compensations": 8, "rule.a.allowed": 8,
                                     "redis_calls": 8 * 3}  # a, b, and a's give-back


# --- Some gateways ----------------------------------------------------------------------------------------


# Real Envoy only (as before): with 2 workers, the local block in front of ACQUIRE_ALL; test_local_block.py
# checks the block itself in every gateway.
@pytest.mark.parametrize("gateway_kind", ["envoy"])
def test_the_local_block_keeps_the_global_limit_untouched_too(stack, start_gateway):
    """With the local block (the default), Redis rejects alice once, in one call; her later requests are
    rejected without a call, and neither path takes a global permit."""
    gateway = start_gateway(GLOBAL, PER_USER)
    assert [gateway.send(headers=ALICE).status for _ in range(2)] == [200, 200]
    global_before = state(stack, "erl:global")

    metrics, scripts = gateway.metrics(), stack.redis.script_calls()
    assert_rejected_by(gateway.send(headers=ALICE), "per-user")
    assert stack.redis.script_calls() - scripts == 1
    for response in gateway.burst(ALICE, 6):
        assert_rejected_by(response, "per-user")
    assert stack.redis.script_calls() - scripts == 1, "the block: no call, so nothing asked of the global limit"
    assert state(stack, "erl:global") == global_before
    assert delta(metrics, gateway.metrics()) == {"rejected": 7, "local_rejected": 6, "redis_calls": 1,
                                                "rule.per-user.rejected": 7, "rule.per-user.local_rejected": 6,
                                                "rule.global.allowed": 1}


# The emulator only (as before), where each request's Redis calls are counted: one Redis for the stock
# build, Redis Cluster's split calls for the Higress build.
@pytest.mark.parametrize("gateway_kind,cluster", [("emulator-envoy", False), ("emulator-higress", True)],
                         ids=["emulator-envoy-one-redis", "emulator-higress-redis-cluster"])
def test_when_every_rule_admits_each_limiter_is_charged_its_permits(stack, start_gateway, cluster):
    """The all-or-nothing path does charge: each limiter loses the rule's permits, as one member each."""
    a = rule("a", limit_by="global", rate=10, interval="1m", permits=2)
    b = rule("b", limit_by="global", rate=6, interval="1m", permits=3)
    gateway = start_gateway(a, b, redis={"redis_cluster": cluster})
    metrics = gateway.metrics()
    for n in (1, 2):
        assert gateway.send().status == 200
        (a_value, a_members), (b_value, b_members) = state(stack, "erl:a"), state(stack, "erl:b")
        assert (a_value, permits_of(a_members)) == (10 - 2 * n, [2] * n)
        assert (b_value, permits_of(b_members)) == (6 - 3 * n, [3] * n)
    # (The first request may also have loaded the script.)
    assert gateway.last_round_trips() == (2 if cluster else 1)
    after = delta(metrics, gateway.metrics())
    assert after["allowed"] == 2 and "compensations" not in after and "rejected" not in after


# The Higress build in the emulator only (as before), where each request's Redis calls are counted.
@pytest.mark.parametrize("gateway_kind", ["emulator-higress"])
def test_with_redis_cluster_limiters_sharing_a_hash_tag_are_asked_in_one_call(stack, start_gateway):
    """Limiter names with one hash tag (`{acct}`) are in one slot: one all-or-nothing call, nothing to give
    back."""
    a = rule("a", limit_by="global", limiter="{acct}.a", rate=100, interval="1m")
    b = rule("b", limit_by="global", limiter="{acct}.b", rate=1, interval="1m", local_block_max=0)
    assert hash_slot(limiter_key("{acct}.a", "value")) == hash_slot(limiter_key("{acct}.b", "permits"))
    gateway = start_gateway(a, b, redis=CLUSTER)
    assert gateway.send().status == 200
    a_before = state(stack, "{acct}.a")
    metrics = gateway.metrics()
    for _ in range(3):
        assert_rejected_by(gateway.send(), "b")
        assert gateway.last_round_trips() == 1
    assert state(stack, "{acct}.a") == a_before
    assert delta(metrics, gateway.metrics()) == {"rejected": 3, "rule.b.rejected": 3, "rule.a.allowed": 3,
                                                "redis_calls": 3}


# --- Two rules on one limiter -----------------------------------------------------------------------------

# Two rules on one limiter per account (`erl:shared:<account>`), 2 permits each, rate 3: a request both
# rules apply to asks 4 permits in total.
SHARED_ONE = rule("one", limit_by={"header": "x-one"}, limiter="erl:shared", rate=3, interval="1m", permits=2)
SHARED_TWO = rule("two", limit_by={"header": "x-two"}, limiter="erl:shared", rate=3, interval="1m", permits=2)
BOTH = {"x-one": "acme", "x-two": "acme"}


# The emulator only (as before), where each request's Redis calls are counted.
@pytest.mark.parametrize("gateway_kind", ["emulator-envoy", "emulator-higress"])
def test_two_rules_asking_one_limiter_for_more_than_its_rate_take_nothing(stack, start_gateway):
    """Each rule alone fits the rate, both together do not: the request is rejected by the second rule,
    nothing is taken, and a request only one rule applies to still gets its 2 of the 3 permits."""
    gateway = start_gateway(*[{**r, "local_block_max": 0} for r in (SHARED_ONE, SHARED_TWO)])
    metrics = gateway.metrics()
    for _ in range(2):
        response = gateway.send(headers=BOTH)
        assert response.status == 429 and response.headers["x-ratelimited-by"] == "two", response
        assert "retry-after" not in response.headers, "4 permits of a rate of 3: no wait can grant them"
        assert response.headers["ratelimit"] == '"one";r=3;t=60, "two";r=0;t=60', "one's 2 are free again"
        assert state(stack, "erl:shared:acme") == (3, {}), "nothing taken"
    assert gateway.last_round_trips() == 1
    assert gateway.send(headers={"x-one": "acme"}).status == 200
    value, members = state(stack, "erl:shared:acme")
    assert (value, permits_of(members)) == (1, [2])
    assert delta(metrics, gateway.metrics()) == {"allowed": 1, "rejected": 2, "rule.two.rejected": 2,
                                                "rule.one.allowed": 3, "redis_calls": 3}


# The stock build in the emulator only (as before), where each request's Redis calls are counted.
@pytest.mark.parametrize("gateway_kind", ["emulator-envoy"])
def test_the_block_a_combined_rejection_leaves_rejects_no_request_redis_would_admit(stack, start_gateway):
    """With the local block on (the default), after the 4-permit request is rejected, a request asking only 2
    of the limiter's 3 free permits is admitted, as Redis would admit it."""
    gateway = start_gateway(SHARED_ONE, SHARED_TWO)
    assert gateway.send(headers=BOTH).status == 429
    assert state(stack, "erl:shared:acme") == (3, {})
    response = gateway.send(headers={"x-one": "acme"})
    assert (response.status, gateway.last_round_trips()) == (200, 1), response
