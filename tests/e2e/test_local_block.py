"""The exact local block (docs/configuration.md, "Local block"): once Redis rejects a limiter's acquire, every VM of the
gateway process rejects that limiter's requests that Redis would reject too, without a Redis call, until the
limiter's oldest permit leaves the window or the rule's `local_block_max` ends the block.

In real Envoy (2 workers, one wasm VM each) and in the host emulator (the stock build through webdis, the
Higress build through the host's Redis client, both clocks; conftest.GATEWAYS): shared across VMs, with
the rejection Redis would give (status, body, `Retry-After`, rate limit headers); a request asking for no
more permits than are free still goes to Redis; the block ends; a new plugin configuration forgets it;
`local_block_max: 0` turns it off; memory stays within the slots whatever the number of keys; and it
changes no decision: the same steps with and without it answer alike, and every sliding window of the
permits admitted holds at most the rate.
"""

from __future__ import annotations

import pytest

from harness import decode_permit, delta, limiter_key, plugin_config, round_trips, rule
from redisson_client import OVERALL, RateLimiter
from timing import EmulatorClock, RealClock

ALICE = {"x-user-id": "alice"}
BODY = "rate limit exceeded\n"


def assert_rejected_like_redis(response, *, retry_after: set[str], policy: str) -> None:
    """The rejection Redis's answer would give: status, body, Retry-After, rate limit headers."""
    assert response.status == 429, response
    assert response.body == BODY
    assert response.headers["retry-after"] in retry_after
    assert response.headers["x-envoy-ratelimited"] == "true"
    assert response.headers["ratelimit-policy"] == policy
    assert response.headers["ratelimit"] in {f'"per-user";r=0;t={s}' for s in retry_after}


# --- Every gateway ----------------------------------------------------------------------------------------

# Real Envoy with the default clock ("gateway"), the emulator with both (as before): the clock changes what
# the script is told the time is, not the block.
CLOCKS = [("envoy", "gateway"), ("emulator-envoy", "gateway"), ("emulator-envoy", "redis"),
          ("emulator-higress", "gateway"), ("emulator-higress", "redis")]


@pytest.mark.parametrize("gateway_kind,clock", CLOCKS, ids=["-".join(c) for c in CLOCKS])
def test_a_rejected_key_is_rejected_by_every_vm_without_a_redis_call(stack, start_gateway, clock):
    """Once Redis has rejected alice, every VM of the gateway (in Envoy, every worker) rejects her as Redis
    would, without asking it; another key still goes to Redis."""
    gateway = start_gateway(rule(rate=3, interval="1m"), clock=clock)
    assert [gateway.send(headers=ALICE).status for _ in range(3)] == [200] * 3
    scripts = stack.redis.script_calls()
    assert gateway.send(headers=ALICE).status == 429
    assert stack.redis.script_calls() == scripts + 1, "Redis rejected"
    if gateway.emulated:  # the emulator also counts each request's calls
        assert gateway.last_round_trips() == 1

    metrics, scripts, sent = gateway.metrics(), stack.redis.script_calls(), gateway.sent()
    responses = gateway.on_every_vm(ALICE, each=5)
    for response in responses:
        # 60 s and the clock guard's 20 ms from the oldest permit, rounded up (docs/redisson.md, "Clocks").
        assert_rejected_like_redis(response, retry_after={"59", "60", "61"}, policy='"per-user";q=3;w=60')
    assert stack.redis.script_calls() == scripts, "no request of a blocked key reached Redis"
    if gateway.emulated:
        assert gateway.round_trips_since(sent) == [0] * len(responses)
    n = len(responses)
    assert delta(metrics, gateway.metrics()) == {"rejected": n, "local_rejected": n, "rule.per-user.rejected": n,
                                                "rule.per-user.local_rejected": n}

    assert gateway.send(headers={"x-user-id": "bob"}).status == 200, "another key still goes to Redis"
    assert stack.redis.script_calls() == scripts + 1


def test_a_new_plugin_configuration_forgets_every_block(stack, start_gateway):
    """After a new plugin configuration (a control plane's update: the same process and VMs), a blocked key
    is asked of Redis again, and its rejection, in the new configuration's body, blocks it again in every
    VM."""
    gateway = start_gateway(rule(rate=2, interval="1m"), reloadable=True)
    assert [gateway.send(headers=ALICE).status for _ in range(2)] == [200, 200]
    scripts, sent = stack.redis.script_calls(), gateway.sent()
    assert [gateway.send(headers=ALICE).status for _ in range(3)] == [429] * 3
    assert stack.redis.script_calls() == scripts + 1, "Redis rejected once, then the block"
    if gateway.emulated:  # its VMs in turn: the block Redis's rejection left holds in the other VM too
        assert gateway.round_trips_since(sent) == [1, 0, 0]

    # The same rule, another body: a new configuration.
    gateway.reconfigure(rule(rate=2, interval="1m"), rejected_body="slow down\n")
    if gateway.emulated:  # the VMs' shared data keeps the block's entry
        assert gateway.process.shared_data(prefix="edge_rate_limiter.block.")["keys"] == 1
    scripts, sent = stack.redis.script_calls(), gateway.sent()
    first = gateway.send(headers=ALICE)
    assert (first.status, first.body) == (429, "slow down\n")
    assert stack.redis.script_calls() == scripts + 1, "the new configuration asked Redis again"
    responses = gateway.on_every_vm(ALICE)
    assert [(r.status, r.body) for r in responses] == [(429, "slow down\n")] * len(responses)
    assert stack.redis.script_calls() == scripts + 1, "and blocks again from Redis's answer, in every VM"
    if gateway.emulated:
        assert gateway.round_trips_since(sent) == [1, 0, 0]


# --- Real Envoy -------------------------------------------------------------------------------------------


def test_a_request_for_no_more_permits_than_are_free_still_goes_to_redis(stack):
    # One limiter per account, taken 3 permits at a time by heavy requests and 1 by light ones.
    heavy = rule("heavy", limit_by={"header": "x-heavy"}, limiter="erl:account", rate=4, interval="1m", permits=3)
    light = rule("light", limit_by={"header": "x-light"}, limiter="erl:account", rate=4, interval="1m")
    envoy = stack.envoy(plugin_config(heavy, light))

    def step(kind: str) -> tuple[int, int]:
        before = stack.redis.script_calls()
        status = envoy.send(headers={f"x-{kind}": "acme"}).status
        return status, stack.redis.script_calls() - before

    assert step("heavy") == (200, 1)  # 3 of 4 taken
    assert step("heavy") == (429, 1)  # Redis: 1 free, 3 wanted; the block remembers fewer than 3 are free
    assert step("heavy") == (429, 0)  # the block: no Redis call
    assert step("light") == (200, 1)  # 1 wanted: Redis decides, and grants it
    assert step("light") == (429, 1)  # Redis: none free
    assert [step("light"), step("heavy")] == [(429, 0), (429, 0)]  # nothing is free: both blocked
    assert stack.redis.client.zcard(limiter_key("erl:account:acme", "permits")) == 2


def test_in_envoy_the_block_ends_when_the_oldest_permit_leaves_the_window(stack):
    """Real time: the three requests before the release must happen within the 3 s window (they take a few
    ms; 3 s is the margin), and the wait for the release is a lower bound (a slow machine waits longer)."""
    envoy = stack.envoy(plugin_config(rule(rate=1, interval="3s", local_block_max="1m")))
    assert envoy.send(headers=ALICE).status == 200
    [(_, taken)] = stack.redis.client.zrange(limiter_key("erl:per-user:alice", "permits"), 0, -1, withscores=True)
    scripts = stack.redis.script_calls()
    assert [envoy.send(headers=ALICE).status for _ in range(3)] == [429] * 3
    assert stack.redis.script_calls() == scripts + 1, "Redis rejected once, then the block"
    RealClock().wait_until_ms(taken + 3_000 + 50)
    assert envoy.send(headers=ALICE).status == 200, "the permit left: the block ended with it"
    assert stack.redis.script_calls() == scripts + 2


def test_local_block_max_zero_sends_every_request_to_redis(stack):
    envoy = stack.envoy(plugin_config(rule(rate=1, interval="1m", local_block_max=0)))
    scripts, metrics = stack.redis.script_calls(), envoy.metrics()
    assert [envoy.send(headers=ALICE).status for _ in range(6)] == [200] + [429] * 5
    assert stack.redis.script_calls() - scripts == 6
    assert delta(metrics, envoy.metrics()) == {"allowed": 1, "rejected": 5, "redis_calls": 6,
                                                  "rule.per-user.rejected": 5, "rule.per-user.allowed": 1}


# --- The host emulator ------------------------------------------------------------------------------------

def test_the_block_ends_when_the_oldest_permit_leaves_or_at_local_block_max(stack):
    gateway = stack.emulator(plugin_config(rule(rate=1, interval="10s", local_block_max="3s")))
    clock = EmulatorClock(gateway)

    def step(at_ms: float) -> tuple[int, int, str | None]:
        """The request at `at_ms` of the guest clock: status, Redis calls, Retry-After."""
        clock.wait_until_ms(at_ms)
        response = gateway.send(headers=ALICE)
        return response.status, round_trips(gateway.last_outcome()), response.headers.get("retry-after")

    assert step(clock.now_ms()) == (200, 1, None)
    [(_, taken)] = stack.redis.client.zrange(limiter_key("erl:per-user:alice", "permits"), 0, -1, withscores=True)
    # The permit leaves at taken + 10 s. Every step below is at least 200 ms from a whole second of
    # Retry-After and from a block's end: what real time adds to a step (a few ms) cannot change its answer.
    assert step(taken + 500) == (429, 1, "10"), "Redis rejects; the block lasts 3 s of its 9.5 s delay"
    assert step(taken + 2_500) == (429, 0, "8"), "blocked; Retry-After counts down to the release, not the block's end"
    assert step(taken + 4_200) == (429, 1, "6"), "local_block_max ended the block: Redis decides (and rejects) again"
    assert step(taken + 7_500) == (429, 1, "3"), "and again 3 s later"
    assert step(taken + 9_500) == (429, 0, "1"), "this block ends with the permit, before local_block_max"
    assert step(taken + 10_200) == (200, 1, None), "the oldest permit left: the block ended with it"


def test_an_operator_raising_the_rate_reaches_a_blocked_key_within_local_block_max(stack):
    gateway = stack.emulator(plugin_config(rule(rate=1, interval="1m", local_block_max="2s")))
    clock = EmulatorClock(gateway)
    assert [gateway.send(headers=ALICE).status for _ in range(2)] == [200, 429]
    blocked_at_ms = clock.now_ms()

    operator = RateLimiter(stack.redis.client, "erl:per-user:alice")
    assert operator.update_rate(OVERALL, 5, 60_000)  # 1 of 5 taken: 4 free now
    assert gateway.send(headers=ALICE).status == 429, "the block does not know yet"
    assert round_trips(gateway.last_outcome()) == 0
    clock.wait_until_ms(blocked_at_ms + 2_000)
    assert gateway.send(headers=ALICE).status == 200, "local_block_max bounds how long the change waits"


def test_memory_stays_within_the_slots_whatever_the_number_of_keys(stack):
    slots = 32
    gateway = stack.emulator(plugin_config(rule(rate=1, interval="1m"), local_block_slots=slots))
    users = [{"x-user-id": f"user-{n:03}"} for n in range(400)]
    for batch in (users[i:i + 50] for i in range(0, len(users), 50)):
        statuses = [r.status for r in gateway.send_batch([{"headers": h} for h in batch for _ in range(2)])]
        assert sorted(statuses) == [200] * 50 + [429] * 50
    prefix = "edge_rate_limiter.block."
    view = gateway.shared_data(prefix=prefix)
    assert 0 < view["keys"] <= slots, view
    # docs/configuration.md, "Local block": an entry is its key (the prefix and the slot number) and 37 bytes
    # + the name.
    assert view["bytes"] <= slots * (len(prefix) + len(str(slots - 1)) + 37 + len("erl:per-user:user-000")), view
    # The newest block takes its slot: a user just rejected by Redis is rejected again without Redis. The
    # request checked is the one after the first that Redis rejects: the first request here may be answered
    # by a block still live (local_block_max, 5 s) in a VM's own cache of recent blocks, which is as right.
    # Two clean-clone CI runs failed when the test took the first request for Redis's; it never failed alone
    # (45 runs, [1, 0] each time), and whether a cached block was the cause is not known: a failure prints
    # what it saw.
    trips: list[int] = []
    while 1 not in trips[:-1] and len(trips) < 4:
        assert gateway.send(headers=users[0]).status == 429
        trips.append(round_trips(gateway.last_outcome()))
    slots_now = gateway.shared_data(prefix=prefix)
    assert 1 in trips[:-1], f"no request of user-000 asked Redis: round trips {trips}; {slots_now}"
    assert trips[trips.index(1) + 1] == 0, (f"rejected by Redis, then asked Redis again: round trips {trips}; "
                                            f"counters {gateway.metrics()}; the slots {slots_now}")


def test_the_block_changes_no_decision_and_every_window_holds_at_most_the_rate(stack):
    """The same steps (requests of 1 or 3 permits of shared limiters, on 2 VMs, at set times) with and without
    the block answer alike; with it, fewer reach Redis; every sliding window of the permits admitted holds at
    most the rate, and every admitted request is a permit in Redis."""
    rate, interval_ms, grid_ms = 4, 2_100, 200  # a permit leaves 100 ms off the grid the requests are on
    rules = (rule("heavy", limit_by={"header": "x-heavy"}, limiter="erl:acct", rate=rate, interval="2100ms",
                  permits=3),
             rule("light", limit_by={"header": "x-light"}, limiter="erl:acct", rate=rate, interval="2100ms"))
    # Steps: (grid ticks to wait, vm, kind, account); deterministic, dense enough to reject often.
    steps = []
    for n in range(160):
        steps.append(((n * 7) % 3, n % 2, "heavy" if n % 3 == 0 else "light", f"a{n % 2}"))

    def play(local_block_max: str | int) -> tuple[list[int], int, list[tuple[bytes, float, int]]]:
        """Statuses, Redis calls, and every permit admitted as (permits key, score, permits)."""
        stack.redis.client.flushall()
        gateway = stack.emulator(plugin_config(*[{**r, "local_block_max": local_block_max} for r in rules]))
        clock = EmulatorClock(gateway)
        start = (clock.now_ms() // grid_ms + 2) * grid_ms
        at, statuses, permits = start, [], {}
        for wait, vm, kind, account in steps:
            at += wait * grid_ms
            clock.wait_until_ms(at)
            statuses.append(gateway.send(headers={f"x-{kind}": account}, vm=vm).status)
            for key in stack.redis.client.keys("*:permits"):
                for member, score in stack.redis.client.zrange(key, 0, -1, withscores=True):
                    permits[(key, member)] = (score, decode_permit(member, score).permits)
        redis_calls = gateway.metrics()["redis_calls"]
        gateway.stop()
        return statuses, redis_calls, [(key, score, n) for (key, _), (score, n) in permits.items()]

    with_block, calls_with, admitted = play("1m")
    without_block, calls_without, _ = play(0)
    assert with_block == without_block
    assert 200 in with_block and 429 in with_block
    assert calls_with < calls_without, (calls_with, calls_without)

    # Every permit admitted, from the members seen after each step (a member stays in its set at least until
    # the acquire after it left the window): each sliding window of one interval holds at most the rate.
    weights = {"heavy": 3, "light": 1}
    admitted_permits = sum(weights[kind] for (_, _, kind, _), status in zip(steps, with_block) if status == 200)
    assert sum(permits for _, _, permits in admitted) == admitted_permits, "every admitted request is in Redis"
    for key in {key for key, _, _ in admitted}:
        taken = sorted((score, permits) for k, score, permits in admitted if k == key)
        for at, _ in taken:
            in_window = sum(permits for score, permits in taken if at - interval_ms < score <= at)
            assert in_window <= rate, (key, at, in_window)


def test_with_skewed_gateway_clocks_each_block_ends_when_its_own_clock_frees_a_permit(stack):
    """Two gateway processes on one limiter, B's clock `skew_ms` ahead of A's (`clock: "gateway"`): each
    block ends when its own gateway's clock passes the oldest permit's expiry, which is when Redis, asked
    with that gateway's time, frees it. B's block ends `skew_ms` earlier than A's: A's outlasts B's view of
    Redis by the skew (docs/configuration.md, "Local block"), and A never admits a permit B's view had already
    given away."""
    skew_ms, step_ms, interval_ms = 1_000, 100, 60_000
    config = plugin_config(rule(rate=2, interval="1m", local_block_max="5m"))
    a, b = stack.emulator(config, vms=1), stack.emulator(config, vms=1)
    b.advance_clock(skew_ms)
    clock_a, clock_b = EmulatorClock(a), EmulatorClock(b)
    assert round(clock_b.now_ms() - clock_a.now_ms()) == skew_ms

    assert [a.send(headers=ALICE).status, b.send(headers=ALICE).status] == [200, 200]
    for gateway in (a, b):  # Redis rejects each once, then each gateway's block does
        assert gateway.send(headers=ALICE).status == 429 and round_trips(gateway.last_outcome()) == 1
        assert gateway.send(headers=ALICE).status == 429 and round_trips(gateway.last_outcome()) == 0
    oldest = min(stack.redis.client.zrange(limiter_key("erl:per-user:alice", "permits"), 0, -1,
                                           withscores=True), key=lambda member: member[1])[1]
    frees_at = oldest + interval_ms  # in the clock of whichever gateway asks

    # Step both clocks together (A's clock is the common time) until each has sent a request to Redis.
    ended: dict[str, tuple[float, int]] = {}  # gateway -> (A's clock at its block's end, the status)
    at = frees_at - skew_ms - 5 * step_ms + step_ms / 2  # no step on a boundary: real time adds a few ms
    while len(ended) < 2 and at < frees_at + 10 * step_ms:
        clock_a.wait_until_ms(at)
        clock_b.wait_until_ms(at + skew_ms)
        for name, gateway in (("B", b), ("A", a)):
            if name not in ended:
                status = gateway.send(headers=ALICE).status
                if round_trips(gateway.last_outcome()):
                    ended[name] = (at, status)
                else:
                    assert status == 429
        at += step_ms

    # B's block ended with B's view of Redis (the first step after its clock passed the expiry), and Redis
    # admitted that request: the block did not outlast the permit in B's time.
    assert frees_at - skew_ms <= ended["B"][0] < frees_at - skew_ms + step_ms, (frees_at, ended)
    assert ended["B"][1] == 200
    # A's block ended `skew_ms` later, with A's view; by then B had taken the freed permit, and Redis
    # (in A's time) rejected A: the skew delays A, it never lets A admit more.
    assert frees_at <= ended["A"][0] < frees_at + step_ms, (frees_at, ended)
    assert ended["A"][1] == 429
    assert round(ended["A"][0] - ended["B"][0]) == skew_ms
