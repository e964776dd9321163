"""Request coalescing in real Envoy (docs/configuration.md, "Request coalescing"): under concurrent load a
VM's waiting requests go out together in one script call, and the limits stay exact.

The promise checked: 2 Envoys x 2 workers, far beyond one global limit and per-user limits, every sliding
window of the requests really admitted holds at most each limiter's rate, the load admits (nearly) all of
the global limit on average, and the batches did happen (`batches`, `batched_calls`); with
`max_batch: 1` nothing is batched. And a batch of requests whose rules have mixed outcomes answers each
request its own decision.
"""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import pytest

from harness import clock_guard, config_for, epoch_ms, hammer, plugin_config, rule, wait_until, worst_window
from slowbridge import SlowBridge, webdis_form
from test_exactness import KeepAliveClient, admitted, whole_windows

# The global limit binds (the users together could take 24 x 10 = 240 per second); each user's limit binds
# for its own requests.
GLOBAL_RATE = 150
USER_RATE = 10
USERS = 24
INTERVAL_MS = 1_000


def coalescing_config(**redis: object) -> dict:
    return plugin_config(
        rule("all", limit_by="global", rate=GLOBAL_RATE, interval="1s", local_block_max=0),
        rule("per-user", rate=USER_RATE, interval="1s", local_block_max=0),
        redis=redis or None,
    )


def run_load(envoys, clients_per_envoy: int, seconds: float):
    """Keep-alive clients, each for one user of USERS, on every Envoy: (user, spans) per client."""
    clients = []
    for envoy in envoys:
        for _ in range(clients_per_envoy):
            user = f"u{len(clients) % USERS}"
            clients.append((user, KeepAliveClient(envoy.port, {"x-user-id": user})))
    try:
        runs = hammer([client.send for _, client in clients], seconds)
    finally:
        for _, client in clients:
            client.close()
    return [(user, run) for (user, _), run in zip(clients, runs)]


class Measured(NamedTuple):
    """What `measure_load` saw: every request's span, the statuses, the admitted spans, the worst sliding
    window of all of them and of one user's, and the admitted requests of each whole window."""

    spans: list[tuple[float, float, int]]
    statuses: collections.Counter
    everyone: list[tuple[float, float]]
    worst: int
    worst_user: int
    windows: list[int]


def measure_load(envoys, seconds: float = 4.0) -> Measured:
    """`run_load` with 12 clients per Envoy, measured: only 200s and 429s, checked."""
    first = epoch_ms()
    results = run_load(envoys, clients_per_envoy=12, seconds=seconds)
    last = epoch_ms()
    spans = [span for _, run in results for span in run]
    statuses = collections.Counter(status for _, _, status in spans)
    assert statuses.keys() <= {200, 429}, dict(statuses)
    everyone = admitted(spans)
    per_user = collections.defaultdict(list)
    for user, run in results:
        per_user[user].extend(admitted(run))
    worst_user = max(worst_window(user_spans, INTERVAL_MS) for user_spans in per_user.values())
    windows = [count for _, count in whole_windows(everyone, INTERVAL_MS, first + 500, last)]
    return Measured(spans, statuses, everyone, worst_window(everyone, INTERVAL_MS), worst_user, windows)


def test_two_envoys_of_two_workers_coalesce_and_every_window_holds_each_rate(stack):
    envoys = [stack.envoy(coalescing_config(), concurrency=2) for _ in range(2)]
    spans, statuses, everyone, worst, worst_user, windows = measure_load(envoys)
    metrics = [envoy.metrics() for envoy in envoys]
    batches = sum(m.get("batches", 0) for m in metrics)
    batched = sum(m.get("batched_calls", 0) for m in metrics)
    calls = sum(m.get("redis_calls", 0) for m in metrics)
    print(f"\ncoalescing: {len(spans)} requests {dict(statuses)}, whole windows {windows}, worst sliding window "
          f"{worst} (rate {GLOBAL_RATE}), worst per user {worst_user} (rate {USER_RATE}); {calls} Redis calls, "
          f"{batches} batches carrying {batched} requests")
    assert len(spans) > 3 * len(everyone), "far beyond the limits: most requests rejected"
    assert worst <= GLOBAL_RATE, f"{worst} admitted in one sliding window of a {GLOBAL_RATE} per second limit"
    assert worst_user <= USER_RATE, f"{worst_user} admitted in one sliding window of a {USER_RATE} per second limit"
    # Saturated, the sliding log admits in bursts one interval and the clock guard apart (docs/redisson.md,
    # "Clocks"): a fixed window of the clock can hold part of one, so the use is checked on average over the
    # 4 s of load, at least 95% of interval / (interval + guard) of the rate.
    share = INTERVAL_MS / (INTERVAL_MS + clock_guard(INTERVAL_MS))
    assert len(everyone) >= 0.95 * 4 * GLOBAL_RATE * share, f"{len(everyone)} admitted in 4 s; whole windows {windows}"
    assert batches > 0 and batched >= 2 * batches, "requests went out together"
    assert calls < len(spans), "fewer Redis calls than requests"


def test_max_batch_one_sends_each_request_alone(stack):
    envoy = stack.envoy(coalescing_config(max_batch=1), concurrency=2)
    results = run_load([envoy], clients_per_envoy=8, seconds=1.5)
    requests = sum(len(run) for _, run in results)
    metrics = envoy.metrics()
    assert metrics.get("batches", 0) == 0
    # Every request not rejected by the local block (off here) made its own call (the first may be sent
    # twice: NOSCRIPT on a fresh Redis).
    assert requests <= metrics["redis_calls"] <= requests + 2 * envoy.concurrency


def test_a_batch_answers_each_request_its_own_decision(stack):
    """Users with their permit spent and users with one left wait behind one slow call (max_in_flight 1) and
    go out in one batch when it ends: each gets its own answer, and the batch's reply comes in webdis's
    form (integers as bulk strings)."""
    bridge = SlowBridge(stack.webdis.port).start()
    try:
        config = plugin_config(rule("per-user", rate=1, interval="1h", local_block_max=0),
                               redis={"max_in_flight": 1}, timeout="2s")
        envoy = stack.envoy(config, concurrency=1, webdis_port=bridge.port)
        spent = [f"spent{i}" for i in range(5)]
        for user in spent:
            assert envoy.send(headers={"x-user-id": user}).status == 200
        fresh = [f"fresh{i}" for i in range(5)]
        bridge.set(match=webdis_form("erl:per-user:slow"), delay_ms=400)
        slow = threading.Thread(target=lambda: envoy.send(headers={"x-user-id": "slow"}))
        slow.start()
        wait_until(lambda: bridge.matched >= 1, 5, "the slow call held by the bridge")
        clients = [KeepAliveClient(envoy.port, {"x-user-id": user}) for user in spent + fresh]
        try:
            statuses = send_once_each([client.send for client in clients])
        finally:
            for client in clients:
                client.close()
        slow.join(10)
    finally:
        bridge.stop()
    assert statuses == [429] * 5 + [200] * 5, statuses
    metrics = envoy.metrics()
    assert metrics.get("batches", 0) >= 1, metrics
    assert metrics.get("batched_calls", 0) >= 2, metrics


def send_once_each(sends) -> list[int]:
    """Each send once, all released at the same moment (one thread each): their statuses, in order."""
    barrier = threading.Barrier(len(sends))
    statuses = [0] * len(sends)

    def run(index: int) -> None:
        barrier.wait()
        statuses[index] = sends[index]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sends))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return statuses


@pytest.mark.parametrize("build", ["envoy", "higress"])
def test_in_the_emulator_both_builds_batch_concurrent_requests_and_answer_each_its_own(stack, build):
    """12 requests in flight together on one VM (the emulator starts them all, then runs its event loop):
    one goes out alone (max_in_flight 1), the others wait and go out in batches; each request gets the answer
    of its own limiter (spent users 429, fresh users 200), through webdis (stock build) and through the
    host's Redis client (Higress build)."""
    gateway = stack.emulator(config_for(build, rule("per-user", rate=1, interval="1h", local_block_max=0)),
                             build=build, vms=1)
    spent = [f"spent{i}" for i in range(6)]
    for user in spent:
        assert gateway.send(headers={"x-user-id": user}).status == 200
    before = gateway.metrics()
    users = [u for pair in zip(spent, (f"fresh{i}" for i in range(6))) for u in pair]
    responses = gateway.send_batch([{"headers": {"x-user-id": user}, "vm": 0} for user in users])
    statuses = {user: response.status for user, response in zip(users, responses)}
    assert statuses == {user: 429 if user.startswith("spent") else 200 for user in users}, statuses
    after = gateway.metrics()
    batches = after.get("batches", 0) - before.get("batches", 0)
    calls = after.get("redis_calls", 0) - before.get("redis_calls", 0)
    assert batches >= 1, after
    assert calls < len(users), f"{calls} Redis calls for {len(users)} requests"
