"""The operator tool `erl-admin` on a real Redis Cluster (`--cluster`): every command on limiters whose keys
live on each of the 3 masters, `list` across all of them, scripts re-sent by the one node that forgot them,
and the one-line errors of a wrong `--cluster` / URL.

One 3-master cluster (no replicas, `redis_cluster.RedisCluster`) serves the whole module; each test starts
from empty masters. Limiters are made with the tool itself, or by an independent Redisson client
(`redisson_client.RateLimiter` over redis-py's cluster client) when a test needs consumed permits or
per-client state. The binary is built outside the tests (`cargo build -p erl-admin`): `target/debug/erl-admin`
or `$ERL_ADMIN_BIN`.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis as redis_py

from harness import AdminResult, Redis, erl_admin, free_port, limiter_key
from redis_cluster import RedisCluster
from redisson_client import OVERALL, PER_CLIENT, RateLimiter

OVERALL_1M = {"type": "overall", "interval_ms": 60000, "keep_alive_ms": 0}


@pytest.fixture(scope="module")
def running_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path_factory.mktemp("admin-cluster"), masters=3) as started:
        yield started


@pytest.fixture
def cluster(running_cluster: RedisCluster) -> RedisCluster:
    running_cluster.flushall()
    return running_cluster


def seed_urls(cluster: RedisCluster) -> str:
    """Every node as a comma-separated `--url` of seeds."""
    return ",".join(f"redis://{host}:{port}" for host, port in cluster.seeds)


def node_url(port: int) -> str:
    return f"redis://127.0.0.1:{port}"


def admin(cluster: RedisCluster, *args: str, url: str | None = None) -> AdminResult:
    """`erl-admin --cluster --url <seeds> ARGS`; fails the test with its output unless it exits 0."""
    result = erl_admin(None, "--cluster", "--url", url or seed_urls(cluster), *args)
    assert result.code == 0, f"erl-admin {' '.join(args)} exited {result.code}: {result.stderr}{result.stdout}"
    return result


def failing(*args: str, **kwargs) -> AdminResult:
    """`erl-admin ARGS` (no implied URL) expected to fail: exit code 1, one error line, nothing on stdout."""
    result = erl_admin(None, *args, **kwargs)
    assert result.code == 1, f"erl-admin {' '.join(args)} exited {result.code}: {result.stderr}{result.stdout}"
    assert result.stderr.startswith("erl-admin: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == ""
    return result


def one_name_per_master(cluster: RedisCluster, base: str) -> list[tuple[int, str]]:
    """(master port, limiter name `<base><i>`) for each master, by port: names whose slots differ."""
    owners: dict[int, str] = {}
    masters = cluster.master_ports()
    for index in itertools.count():
        name = f"{base}{index}"
        owners.setdefault(cluster.master_of(name), name)
        if len(owners) == len(masters):
            return sorted(owners.items())
    raise AssertionError("itertools.count() ended")


def keys_on(cluster: RedisCluster, name: str) -> dict[int, list[bytes]]:
    """The keys of limiter `name` (its hash and `{name}:...`) on each master that holds any, by port."""
    tagged = limiter_key(name, "").encode()
    found = {port: [key for key in keys if key == name.encode() or key.startswith(tagged)]
             for port, keys in cluster.keys_by_node().items()}
    return {port: keys for port, keys in found.items() if keys}


def eval_calls(cluster: RedisCluster) -> dict[int, int]:
    """`EVAL` calls (scripts sent by source) served by each master since its start, by port."""
    return {port: int(cluster.node(port).info("commandstats").get("cmdstat_eval", {}).get("calls", 0))
            for port in cluster.master_ports()}


def test_set_rate_writes_each_limiter_on_the_master_of_its_slot(cluster):
    limiters = one_name_per_master(cluster, "erl:per-user:u")
    assert len({port for port, _ in limiters}) == 3
    for rate, (port, name) in enumerate(limiters, start=3):
        report = admin(cluster, "set-rate", name, "--rate", str(rate), "--interval", "1m", "--json").json()
        assert (report["name"], report["action"], report["changed"]) == (name, "set-rate", True)
        assert report["config"] == {"rate": rate, **OVERALL_1M}
        assert keys_on(cluster, name) == {port: [name.encode()]}, "the config hash, on its slot's master only"
        assert cluster.node(port).command("HGET", name, "rate") == str(rate).encode()
        assert cluster.node(port).command("PTTL", name) == -1
        # A Redisson client (routing by slot itself) finds the limiter the tool made.
        assert RateLimiter(cluster.client, name).config() == {"rate": rate, "interval": 60000, "type": 0,
                                                              "keepAliveTime": 0}


def test_show_reads_consumed_permits_of_limiters_on_every_master(cluster):
    for taken, (port, name) in enumerate(one_name_per_master(cluster, "erl:per-user:s"), start=1):
        redisson = RateLimiter(cluster.client, name)
        redisson.try_set_rate(OVERALL, 5, 60_000, 3_600_000)
        for _ in range(taken):
            assert redisson.try_acquire().acquired
        assert set(keys_on(cluster, name)) == {port}

        report = admin(cluster, "show", name, "--json").json()
        assert report["config"] == {"rate": 5, "interval_ms": 60000, "type": "overall", "keep_alive_ms": 3600000}
        state = report["state"]
        assert state["available"] == 5 - taken
        assert (state["window"]["acquires"], state["window"]["permits"]) == (taken, taken)
        assert {ttl["key"] for ttl in state["ttl"]} == {limiter_key(name, "value"), limiter_key(name, "permits")}
        assert all(0 < ttl["ttl_ms"] <= 3_600_000 for ttl in state["ttl"])
        assert 0 < report["config_ttl_ms"] <= 3_600_000

        by_redis_clock = admin(cluster, "show", name, "--clock", "redis", "--json").json()
        assert by_redis_clock["state"]["available"] == 5 - taken
        assert abs(by_redis_clock["now_ms"] - time.time() * 1000) < 60_000, "TIME of a cluster node"

        text = admin(cluster, "show", name).stdout
        assert f"limiter      {name}\n" in text
        assert f"available    {5 - taken} of 5\n" in text
        assert f"in window    {taken} permits in {taken} acquires (last 1m)\n" in text


def test_list_finds_the_limiters_of_every_master(cluster):
    limiters = one_name_per_master(cluster, "erl:per-user:l")
    for rate, (_, name) in enumerate(limiters, start=2):
        admin(cluster, "try-set-rate", name, "--rate", str(rate), "--interval", "1m")
    taker = RateLimiter(cluster.client, limiters[0][1])
    assert taker.try_acquire().acquired
    admin(cluster, "set-rate", "erl:shared", "--rate", "9", "--interval", "1s", "--type", "per-client")
    admin(cluster, "set-rate", "other:thing", "--rate", "7", "--interval", "2s")
    cluster.client.hset("erl:half", "rate", "1")  # no interval: no limiter
    cluster.client.set("erl:a-string", "x")
    assert len({port for port, keys in cluster.keys_by_node().items() if keys}) == 3

    expected = sorted([(name, rate - (name == limiters[0][1])) for rate, (_, name) in enumerate(limiters, start=2)]
                      + [("erl:shared", None)])
    listed = admin(cluster, "list", "--json").json()
    assert [(entry["name"], entry["available"]) for entry in listed] == expected
    assert all(entry["problem"] is None for entry in listed)

    # Any one node as the seed finds the same limiters, on its own and on the other masters.
    for port, _ in limiters:
        assert admin(cluster, "list", "--json", url=node_url(port)).json() == listed

    lines = admin(cluster, "list", "erl:per-user:").stdout.splitlines()
    assert lines[0].split() == ["NAME", "RATE", "TYPE", "KEEPALIVE", "AVAILABLE"]
    assert [line.split()[0] for line in lines[1:]] == [name for name, _ in expected if name != "erl:shared"]
    assert [entry["name"] for entry in admin(cluster, "list", "other:", "--json").json()] == ["other:thing"]
    assert admin(cluster, "list", "erl:per-user:*", "--json").json() == [], "the prefix is literal"


def test_list_reads_every_scan_page_of_every_master(cluster):
    # 3000 other keys per master: SCAN ... COUNT 1000 takes several pages on each.
    for port, tag in one_name_per_master(cluster, "junk"):
        client = cluster.node(port).client()
        try:
            pipe = client.pipeline(transaction=False)
            for index in range(3000):
                pipe.set(f"{{{tag}}}:{index}", "x")
            pipe.execute()
        finally:
            client.close()
    names = sorted(f"erl:bulk:{index}" for index in range(60))
    pipe = cluster.client.pipeline()
    for name in names:
        pipe.hset(name, mapping={"rate": "2", "interval": "1000", "type": "0"})
    pipe.execute()
    for port in cluster.master_ports():
        cursor, _ = cluster.node(port).command("SCAN", 0, "MATCH", "erl:bulk:*", "COUNT", 1000, "TYPE", "hash")
        assert cursor != b"0", "the first page is not the last"

    listed = admin(cluster, "list", "erl:bulk:", "--json").json()
    assert [entry["name"] for entry in listed] == names
    assert {entry["available"] for entry in listed} == {2}


def test_update_rate_keeps_consumed_permits_on_every_master(cluster):
    for port, name in one_name_per_master(cluster, "erl:per-user:r"):
        redisson = RateLimiter(cluster.client, name)
        redisson.try_set_rate(OVERALL, 3, 60_000)
        assert [redisson.try_acquire().acquired for _ in range(4)] == [True, True, True, False]

        text = admin(cluster, "update-rate", name, "--rate", "5").stdout
        assert text == f"{name}: rate updated, consumed permits kept: 5 per 1m (overall, keepAlive none)\n"
        assert cluster.node(port).command("HGET", name, "rate") == b"5"
        # 3 of the 5 permits are still taken: exactly 2 more.
        assert [redisson.try_acquire().acquired for _ in range(3)] == [True, True, False]
        assert set(keys_on(cluster, name)) == {port}


def test_try_set_rate_creates_a_limiter_once_on_the_master_of_its_slot(cluster):
    for port, name in one_name_per_master(cluster, "erl:orders:"):
        created = admin(cluster, "try-set-rate", name, "--rate", "10", "--interval", "1s", "--keep-alive", "1h",
                        "--json").json()
        assert created["changed"] is True
        assert created["config"] == {"rate": 10, "interval_ms": 1000, "type": "overall", "keep_alive_ms": 3600000}
        assert 0 < cluster.node(port).command("PTTL", name) <= 3_600_000

        kept = admin(cluster, "try-set-rate", name, "--rate", "99", "--interval", "1m")
        assert kept.stdout == f"{name}: exists, left as it is: 10 per 1s (overall, keepAlive 1h)\n"
        assert keys_on(cluster, name) == {port: [name.encode()]}
        assert cluster.node(port).command("HGET", name, "rate") == b"10"


def test_delete_removes_every_key_of_a_limiter_from_its_master_and_nothing_else(cluster):
    limiters = one_name_per_master(cluster, "erl:per-user:d")
    (overall_port, overall), (client_port, per_client), (_, untouched) = limiters
    redisson = RateLimiter(cluster.client, overall)
    redisson.try_set_rate(OVERALL, 5, 60_000)
    assert redisson.try_acquire().acquired
    for _ in range(2):  # two Redisson instances: two clients' state
        instance = RateLimiter(cluster.client, per_client)
        instance.try_set_rate(PER_CLIENT, 5, 60_000)
        assert instance.try_acquire().acquired
    admin(cluster, "set-rate", untouched, "--rate", "1", "--interval", "1m")
    assert len(keys_on(cluster, overall)[overall_port]) == 3
    assert len(keys_on(cluster, per_client)[client_port]) == 5

    assert admin(cluster, "delete", overall, "--json").json() == {"name": overall, "keys_removed": 3}
    assert admin(cluster, "delete", per_client, "--json").json() == {"name": per_client, "keys_removed": 5}
    assert keys_on(cluster, overall) == {} and keys_on(cluster, per_client) == {}
    assert list(keys_on(cluster, untouched).values()) == [[untouched.encode()]]

    result = failing("--cluster", "--url", seed_urls(cluster), "delete", overall)
    assert result.stderr == f"erl-admin: error: no limiter named {overall} (no config hash)\n"


def test_per_client_limiters_show_update_and_reset_every_client(cluster):
    for port, name in one_name_per_master(cluster, "erl:per-client:"):
        first, second = RateLimiter(cluster.client, name), RateLimiter(cluster.client, name)
        first.try_set_rate(PER_CLIENT, 4, 60_000)
        assert [first.try_acquire().acquired for _ in range(3)] == [True, True, True]
        assert second.try_acquire().acquired

        report = admin(cluster, "show", name, "--json").json()
        assert report["config"]["type"] == "per-client" and report["state"] is None
        clients = {client["client_id"]: client["available"] for client in report["clients"]}
        assert clients == {first.client_id: 1, second.client_id: 3}
        selected = admin(cluster, "show", name, "--client-id", second.client_id, "--json").json()["state"]
        assert (selected["client_id"], selected["available"], selected["window"]["permits"]) == (second.client_id, 3, 1)

        update = admin(cluster, "update-rate", name, "--rate", "6", "--json").json()
        assert (update["clients_updated"], update["config"]["rate"]) == (2, 6)
        # Consumed permits kept for each client: 3 more for the first, not 6.
        assert [first.try_acquire().acquired for _ in range(4)] == [True, True, True, False]

        reset = admin(cluster, "set-rate", name, "--rate", "2", "--interval", "1m", "--type", "per-client",
                      "--json").json()
        assert reset["client_keys_removed"] == 4, "value and permits keys of both clients"
        assert keys_on(cluster, name) == {port: [name.encode()]}
        assert [first.try_acquire().acquired for _ in range(3)] == [True, True, False]


def test_scripts_are_sent_again_by_the_one_node_that_forgot_them(cluster):
    for port, name in one_name_per_master(cluster, "erl:per-user:n"):
        redisson = RateLimiter(cluster.client, name)
        redisson.try_set_rate(OVERALL, 5, 60_000)
        assert redisson.try_acquire().acquired
        admin(cluster, "show", name)  # the tool's scripts are loaded on every master that ran them
        cluster.node(port).command("SCRIPT", "FLUSH")
        before = eval_calls(cluster)

        assert admin(cluster, "show", name, "--json").json()["state"]["available"] == 4
        after = eval_calls(cluster)
        assert after[port] == before[port] + 1, "EVALSHA, NOSCRIPT, then EVAL once on the owning master"
        assert {p: n for p, n in after.items() if p != port} == {p: n for p, n in before.items() if p != port}

        assert admin(cluster, "show", name, "--json").json()["state"]["available"] == 4
        assert eval_calls(cluster) == after, "the script is cached there again"


def test_seeds_are_tried_in_turn_and_may_be_given_by_repeated_url_or_the_environment(cluster):
    _, name = one_name_per_master(cluster, "erl:per-user:e")[0]
    live = cluster.seeds[-1][1]
    dead = node_url(free_port())
    admin(cluster, "set-rate", name, "--rate", "3", "--interval", "1m", url=f"{dead},{node_url(live)}")
    repeated = erl_admin(None, "--cluster", "--url", dead, "--url", node_url(live), "show", name, "--json")
    assert repeated.code == 0, repeated.stderr
    assert repeated.json()["config"]["rate"] == 3
    from_env = erl_admin(None, "show", name, "--json",
                         env={"ERL_REDIS_URL": node_url(live), "ERL_REDIS_CLUSTER": "true"})
    assert from_env.code == 0, from_env.stderr
    assert from_env.json()["config"]["rate"] == 3


def test_the_password_of_the_seed_url_opens_every_master(cluster):
    password = "s3cret"
    limiters = one_name_per_master(cluster, "erl:per-user:a")
    masters = cluster.master_ports()
    for port in masters:
        cluster.node(port).command("CONFIG", "SET", "requirepass", password)
    try:
        seeds = ",".join(f"redis://:{password}@{host}:{port}" for host, port in cluster.seeds)
        for port, name in limiters:
            admin(cluster, "set-rate", name, "--rate", "2", "--interval", "1m", url=seeds)
        assert [entry["name"] for entry in admin(cluster, "list", "--json", url=seeds).json()] == sorted(
            name for _, name in limiters)

        wrong = failing("--cluster", "--url", seeds.replace(password, "wrong"), "list")
        assert wrong.stderr.startswith(f"erl-admin: error: Redis at {seeds.replace(password, '***')} refused the "
                                       "credentials: "), wrong.stderr
        assert password not in wrong.stderr and "wrong" not in wrong.stderr
    finally:
        for port in masters:
            client = redis_py.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5.0)
            try:
                client.config_set("requirepass", "")
            finally:
                client.close()
    for port, name in limiters:
        assert keys_on(cluster, name) == {port: [name.encode()]}


def test_a_plain_url_naming_a_cluster_node_is_refused_and_changes_nothing(cluster):
    limiters = one_name_per_master(cluster, "erl:per-user:p")
    for port, name in limiters:
        for args in (["show", name], ["list"], ["set-rate", name, "--rate", "1", "--interval", "1m"],
                     ["delete", name]):
            result = failing("--url", node_url(port), *args)
            assert result.stderr == (
                f"erl-admin: error: Redis at {node_url(port)} is a Redis Cluster node (INFO: cluster_enabled:1): "
                "add --cluster (or ERL_REDIS_CLUSTER=true) to reach every master\n")
    assert cluster.keys_by_node() == {port: [] for port in cluster.master_ports()}


def test_cluster_to_a_redis_without_cluster_support_is_refused(tmp_path: Path, cluster):
    plain = Redis(tmp_path).start()
    try:
        message = (f"Redis at {plain.url} is not a Redis Cluster (CLUSTER SLOTS: ERR This instance has cluster "
                   "support disabled): drop --cluster (and ERL_REDIS_CLUSTER) to use it as one Redis")
        for args in (["list"], ["set-rate", "erl:x", "--rate", "1", "--interval", "1m"]):
            assert failing("--cluster", "--url", plain.url, *args).stderr == f"erl-admin: error: {message}\n"
        assert erl_admin(None, "--cluster", "--url", plain.url, "list", "--json").json() == {"error": message}
        assert plain.client.keys("*") == []
        # The same URL without --cluster is a plain Redis again.
        assert erl_admin(None, "--url", plain.url, "list", "--json").json() == []
    finally:
        plain.stop()


def test_other_wrong_cluster_input_gets_one_line_saying_what_to_do(cluster):
    host, port = cluster.seeds[0]
    scheme = failing("--url", f"redis+cluster://{host}:{port}", "list")
    assert scheme.stderr == (f"erl-admin: error: invalid Redis URL redis+cluster://{host}:{port}: erl-admin has no "
                             "redis+cluster:// scheme: give --cluster and redis:// URLs of seed nodes\n")
    several = failing("--url", node_url(port), "--url", node_url(cluster.seeds[1][1]), "list")
    assert several.stderr == ("erl-admin: error: several --url are seed nodes of a Redis Cluster: add --cluster "
                              "(or ERL_REDIS_CLUSTER=true)\n")
    unknown = failing("--cluster", "--url", seed_urls(cluster), "show", "erl:nobody")
    assert unknown.stderr == "erl-admin: error: no limiter named erl:nobody (no config hash)\n"

    dead = [node_url(free_port()), node_url(free_port())]
    started = time.monotonic()
    unreachable = failing("--cluster", "--url", ",".join(dead), "--timeout", "2s", "list")
    assert unreachable.stderr.startswith(f"erl-admin: error: cannot reach Redis at {','.join(dead)}: "
                                         "Failed to connect to each cluster node ("), unreachable.stderr
    # Refused connections fail at once; 2 s timeout plus 3 s for starting the tool on a loaded machine.
    assert time.monotonic() - started < 2 + 3
