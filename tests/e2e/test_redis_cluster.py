"""Both builds on a real Redis Cluster: 3 masters with a replica each (tests/e2e/redis_cluster.py).

The deployment (docs/deploying.md, "Redis Cluster"): the stock build in real Envoy reaches the cluster through
webdis and stock Envoy's `redis_proxy` (envoy/redis-proxy.yaml), which routes each script by its first key;
the Higress build in the host emulator reaches the same proxy as its Redis service. Higress's own Redis
client cannot route on a Redis Cluster: on a cluster of type `envoy.clusters.redis` every call fails at
once (InternalFailure), and pointed at one node it passes `-MOVED` through for the slots of the others
(tests/host/src/redis.rs cites the Higress sources); the filter then follows its failure mode and says
what to do.

Last, the failover: a master is killed while a client runs at a limiter (tests/e2e/failover.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

import pytest

from conftest import gateways_stopped
from failover import run_failover
from harness import host_plugin_config, limiter_key, plugin_config, rule, wait_until
from redis_cluster import ClusterStack

BUILDS = ["envoy", "higress"]
USERS = [f"user-{i}" for i in range(24)]
# The users of the failover runs so far: each run needs a master that still has a replica.
_failover_users: list[str] = []


@pytest.fixture(scope="module")
def cluster_stack() -> Iterator[ClusterStack]:
    # cluster-require-full-coverage no, as docs/deploying.md advises: a failed master fails only its own slots.
    with ClusterStack(masters=3, replicas=1, full_coverage=False) as stack:
        stack.start()
        yield stack


@pytest.fixture
def stack(cluster_stack: ClusterStack, request: pytest.FixtureRequest) -> Iterator[ClusterStack]:
    cluster_stack.cluster.flushall()
    with gateways_stopped(cluster_stack, request):
        yield cluster_stack


def gateway(stack: ClusterStack, build: str, *rules: dict, **fields):
    """The stock build in real Envoy (webdis -> redis_proxy) or the Higress build in the emulator (its Redis
    service is the proxy)."""
    if build == "envoy":
        return stack.envoy(plugin_config(*rules, **fields))
    return stack.emulator(host_plugin_config(*rules, **fields))


def name(user: str) -> str:
    return f"erl:per-user:{user}"


def keys_of(user: str) -> set[bytes]:
    limiter = name(user)
    return {limiter.encode(), limiter_key(limiter, "value").encode(), limiter_key(limiter, "permits").encode()}


@pytest.mark.parametrize("build", BUILDS)
def test_limiters_on_every_shard_limit_exactly_with_their_three_keys_on_one_node(stack, build):
    """24 users' limiters spread over the 3 masters; each allows exactly its rate, and each limiter's config
    hash, value and permits live together on the master that owns the slot of its name."""
    limit = gateway(stack, build, rule(rate=3, interval="1m"))
    for user in USERS:
        statuses = [limit.send(headers={"x-user-id": user}).status for _ in range(4)]
        assert statuses == [200, 200, 200, 429], user
    by_node = stack.cluster.keys_by_node()
    assert all(by_node.values()), f"a master holds no limiter: {by_node}"
    for user in USERS:
        owner = stack.cluster.master_of(name(user))
        assert keys_of(user) <= set(by_node[owner]), (user, owner, by_node[owner])
    metrics = limit.metrics()
    assert (metrics["allowed"], metrics["rejected"], metrics["redis_errors"]) == (72, 24, 0)


def cached_scripts(stack: ClusterStack) -> dict[int, int]:
    """`number_of_cached_scripts` of each master, by port."""
    return {port: int(stack.cluster.node(port).info("memory")["number_of_cached_scripts"])
            for port in stack.cluster.master_ports()}


@pytest.mark.parametrize("build", BUILDS)
def test_each_shard_learns_the_script_from_the_filter_after_noscript(stack, build):
    """The proxy passes -NOSCRIPT through, per shard; the filter sends the script by source to that shard
    and then by SHA. Flushing one master's scripts later costs no decision."""
    limit = gateway(stack, build, rule(rate=100, interval="1m", local_block_max=0))
    assert set(cached_scripts(stack).values()) == {0}
    for user in USERS:
        assert limit.send(headers={"x-user-id": user}).status == 200
    assert all(count >= 1 for count in cached_scripts(stack).values()), cached_scripts(stack)
    first = stack.cluster.master_ports()[0]
    stack.cluster.node(first).command("SCRIPT", "FLUSH")
    for user in USERS:
        assert limit.send(headers={"x-user-id": user}).status == 200
    assert cached_scripts(stack)[first] >= 1
    metrics = limit.metrics()
    assert (metrics["allowed"], metrics["redis_errors"], metrics["failure_allowed"]) == (48, 0, 0)


def two_global_rules_on_different_masters(stack: ClusterStack) -> tuple[dict, dict]:
    """Global rules `a` (rate 100) and `b` (rate 2) whose limiters (`erl:<name>`) are on different masters."""
    names = [f"shard-{i}" for i in range(64)]
    first = names[0]
    other = next(n for n in names if stack.cluster.master_of(f"erl:{n}") != stack.cluster.master_of(f"erl:{first}"))
    return (rule(first, limit_by="global", rate=100, interval="1m"),
            rule(other, limit_by="global", rate=2, interval="1m", local_block_max=0))


def available(stack: ClusterStack, limiter: str) -> int:
    """The limiter's `value` (free permits), read from its master."""
    return int(stack.cluster.client.get(limiter_key(limiter, "value")))


@pytest.mark.parametrize("build", BUILDS)
def test_all_or_nothing_across_shards_gives_back_what_the_other_shard_took(stack, build):
    """With `redis_cluster: true` the two limiters (on different masters) are asked in two calls; when b
    rejects, what a took is given back on a's master, so a's free permits count only admitted requests."""
    a, b = two_global_rules_on_different_masters(stack)
    limit = gateway(stack, build, a, b, redis={"redis_cluster": True})
    assert [limit.send().status for _ in range(5)] == [200, 200, 429, 429, 429]
    wait_until(lambda: available(stack, f"erl:{a['name']}") == 98, 5.0, "a's permits to be given back")
    metrics = limit.metrics()
    assert (metrics["allowed"], metrics["compensations"], metrics["redis_errors"]) == (2, 3, 0)


@pytest.mark.parametrize("build", BUILDS)
def test_without_redis_cluster_a_request_spanning_two_slots_fails_and_says_to_set_it(stack, build):
    """Without `redis_cluster: true` both limiters go in one script call, which a Redis Cluster refuses
    (CROSSSLOT): the failure mode applies and the log names the setting to change."""
    a, b = two_global_rules_on_different_masters(stack)
    limit = gateway(stack, build, a, b, failure_mode="deny")
    assert limit.send().status == 503
    assert limit.metrics()["failure_denied"] == 1
    wait_until(lambda: "set redis.redis_cluster to true" in limit.log_text(), 5.0, "the CROSSSLOT hint")


def test_higress_redis_client_gets_no_host_in_an_envoy_redis_cluster(stack):
    """Higress's Redis client picks a host without a hash key, which a cluster of type
    envoy.clusters.redis never gives one for: each call fails at once, the failure mode applies, and the
    log says to put a proxy in front."""
    ports = [node.port for node in stack.cluster.nodes if node.alive]
    limit = stack.emulator(host_plugin_config(rule(rate=3, interval="1m")), clusters={},
                           redis_clusters={"redis": ports})
    assert [limit.send(headers={"x-user-id": "alice"}).status for _ in range(4)] == [200] * 4
    metrics = limit.metrics()
    assert (metrics["failure_allowed"], metrics["allowed"]) == (4, 0)
    assert "envoy.clusters.redis" in limit.log_text()
    assert stack.cluster.keys_by_node() == {port: [] for port in stack.cluster.master_ports()}


def test_higress_redis_client_on_one_node_serves_its_slots_and_passes_moved_through(stack):
    """Pointed at one master directly (a plain cluster), Higress's client does not follow redirections:
    limiters that master owns limit exactly, the others get -MOVED and follow the failure mode."""
    master = stack.cluster.master_ports()[0]
    here = [u for u in USERS if stack.cluster.master_of(name(u)) == master][:2]
    elsewhere = [u for u in USERS if stack.cluster.master_of(name(u)) != master][:2]
    limit = stack.emulator(host_plugin_config(rule(rate=3, interval="1m"), failure_mode="deny"),
                           clusters={"redis": master})
    for user in here:
        assert [limit.send(headers={"x-user-id": user}).status for _ in range(4)] == [200, 200, 200, 429]
    for user in elsewhere:
        assert limit.send(headers={"x-user-id": user}).status == 503
    assert limit.metrics()["failure_denied"] == 2
    log = limit.log_text()
    assert "MOVED" in log and "node not holding this limiter: use a proxy" in log


# --- Failover (last: each run uses up one master's replica) -----------------------------------------------


@pytest.mark.parametrize("build", BUILDS)
def test_a_killed_master_costs_decisions_only_until_its_replica_is_promoted(stack, build):
    """A client runs at 40 permits per 4 s (faster than the rate) while the limiter's master is SIGKILLed.
    Meanwhile decisions follow the failure mode (deny: 503), none waits past the timeout (200 ms), and a
    limiter on another master is not affected; once the replica is promoted the next decisions are exact
    again, and the promoted replica holds the permits the old master granted (Redis replicates
    asynchronously: any permits lost would allow at most that many extra in their window)."""
    users = [f"failover-{build}-{i}" for i in range(64)]
    taken = {stack.cluster.master_of(name(u)) for u in _failover_users}
    user = next(u for u in users if stack.cluster.master_of(name(u)) not in taken
                and stack.cluster.replicas_of(stack.cluster.master_of(name(u))))
    _failover_users.append(user)
    bystander = next(u for u in users if stack.cluster.master_of(name(u)) != stack.cluster.master_of(name(user)))
    limit = gateway(stack, build, rule(rate=40, interval="4s"), timeout="200ms", failure_mode="deny")
    run = run_failover(stack.cluster, lambda: limit.send(headers={"x-user-id": user}).status, name(user),
                       rate=40, interval_ms=4000, other=lambda: limit.send(headers={"x-user-id": bystander}).status)
    statuses = Counter(d.status for d in run.decisions)
    assert set(statuses) == {200, 429, 503}, statuses
    assert run.slowest_ms < 200 + 150, run.slowest_ms
    assert run.failures[0].start_ms >= run.killed_ms - 50
    assert run.recovery_ms is not None and run.recovery_ms < 1500, run.recovery_ms
    assert run.admitted_before_kill > 0
    assert run.worst_window <= run.rate + run.lost_permits, (run.worst_window, run.lost_permits)
    after = [d.status for d in run.decisions if d.start_ms > run.promoted_ms + 1500]
    assert after and 503 not in after
    assert run.other_decisions and not run.other_failures, Counter(d.status for d in run.other_decisions)
