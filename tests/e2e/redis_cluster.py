"""A real Redis Cluster for the end-to-end tests and benchmarks, and the Envoy `redis_proxy` in front of it.

- `RedisCluster`: `masters` redis-server nodes started with `--cluster-enabled yes` on free loopback ports,
  `replicas` replicas per master, joined with `redis-cli --cluster create` (3 or more masters) or, for one
  master, `CLUSTER ADDSLOTSRANGE 0 16383` (redis-cli refuses fewer than 3). Every node is a `harness.Process`,
  stopped by its PID; `kill_master()` SIGKILLs one for the failover tests.
- `RedisProxy`: stock Envoy (`envoy/redis-proxy.yaml`, the shipped example) listening with the
  `envoy.filters.network.redis_proxy` filter for a cluster of type `envoy.clusters.redis` seeded with the
  nodes: what webdis talks to for the stock build (webdis speaks to one Redis, the proxy routes by key).

Slots are Redis Cluster's (`CLUSTER KEYSLOT`: CRC16 of the key's hash tag, mod 16384); the slot map is read
from the nodes (`CLUSTER SHARDS`), never assumed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import string
import subprocess
import time
from pathlib import Path
from typing import Any

import redis as redis_py
from redis.cluster import RedisCluster as RedisClusterClient

import harness
from harness import HOST, REDIS_BIN, REPO, HarnessError, Process, free_port, tail, wait_until

REDIS_CLI_BIN = os.environ.get("REDIS_CLI_BIN", "redis-cli")
REDIS_PROXY_TEMPLATE = REPO / "envoy" / "redis-proxy.yaml"
SLOTS = 16384


class ClusterNode:
    """One redis-server of the cluster: its port, its directory (nodes.conf) and its process."""

    def __init__(self, workdir: Path, node_timeout_ms: int, full_coverage: bool):
        self.port = free_port()
        # The cluster bus port; by default port + 10000, which may be taken (or above 65535).
        self.bus_port = free_port()
        self.dir = workdir / f"node-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node_timeout_ms = node_timeout_ms
        self.full_coverage = full_coverage
        self.process: Process | None = None

    def start(self) -> None:
        argv = [REDIS_BIN, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-port", str(self.bus_port),
                "--cluster-require-full-coverage", "yes" if self.full_coverage else "no",
                # A node that never met another (a 1-master cluster) would list its address as "" in
                # CLUSTER SLOTS, which Envoy's redis cluster refuses.
                "--cluster-announce-ip", HOST]
        self.process = Process(f"redis-node-{self.port}", argv, self.dir / "redis.log")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def client(self, socket_timeout: float = 5.0) -> redis_py.Redis:
        """A plain client of this node alone (raw bytes replies); the caller closes it."""
        return redis_py.Redis(host=HOST, port=self.port, socket_timeout=socket_timeout,
                              socket_connect_timeout=socket_timeout)

    def command(self, *args: Any, socket_timeout: float = 5.0) -> Any:
        client = self.client(socket_timeout)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def info(self, section: str) -> dict:
        client = self.client()
        try:
            return client.info(section)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crashed host: no goodbye to the cluster or the clients."""
        if self.process is not None and self.process.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(5.0)
        if self.process is not None:
            self.process.stop()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def log_tail(self, lines: int = 20) -> str:
        return tail(self.dir / "redis.log", lines)


class RedisCluster:
    """A Redis Cluster of `masters` masters with `replicas` replicas each, on 127.0.0.1.

    `node_timeout_ms` is `cluster-node-timeout`: how long a master may be unreachable before its replica
    takes over (the failover tests keep it short). `full_coverage` is `cluster-require-full-coverage`
    (Redis's default, yes: every node refuses commands while any slot has no master; no: only the slots of
    a failed master fail).
    """

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 full_coverage: bool = True):
        if masters < 1 or (masters < 3 and replicas):
            raise ValueError("a cluster has 1 master without replicas, or 3 or more masters")
        self.workdir = workdir / f"cluster-{masters}x{replicas + 1}-{free_port()}"
        self.masters = masters
        self.replicas = replicas
        self.nodes = [ClusterNode(self.workdir, node_timeout_ms, full_coverage)
                      for _ in range(masters * (replicas + 1))]
        self._client: RedisClusterClient | None = None

    # ---- life cycle

    def start(self, timeout: float = 60.0) -> "RedisCluster":
        try:
            for node in self.nodes:
                node.start()
            for node in self.nodes:
                wait_until(lambda n=node: self._pings(n), 10.0, f"cluster node {node.port} to answer PING")
            if self.masters == 1:
                self.nodes[0].command("CLUSTER", "ADDSLOTSRANGE", 0, SLOTS - 1)
            else:
                self._create(timeout)
            wait_until(self._consistent, timeout, "every cluster node to agree on a complete slot map")
        except BaseException as error:
            logs = "\n".join(f"--- node {n.port} ---\n{n.log_tail()}" for n in self.nodes)
            self.stop()
            if isinstance(error, HarnessError):
                raise HarnessError(f"{error}\n{logs}") from None
            raise
        return self

    def _pings(self, node: ClusterNode) -> bool:
        if not node.alive:
            raise HarnessError(f"cluster node {node.port} exited")
        with contextlib.suppress(redis_py.RedisError):
            return bool(node.command("PING", socket_timeout=1.0))
        return False

    def _create(self, timeout: float) -> None:
        argv = [REDIS_CLI_BIN, "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise HarnessError("redis-cli --cluster create did not finish") from None
        if done.returncode != 0:
            raise HarnessError(f"redis-cli --cluster create failed:\n{done.stdout.decode(errors='replace')}"
                               f"{done.stderr.decode(errors='replace')}")

    def _consistent(self) -> bool:
        """Every live node reports cluster_state:ok and the same owner of every slot range, and every
        replica has finished its first sync."""
        views = []
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                if node.info("cluster").get("cluster_enabled") != 1:
                    return False
                state = node.command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in state:
                    return False
                views.append(sorted(self._slot_ranges(node)))
                replication = node.info("replication")
                if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                    return False
            except redis_py.RedisError:
                return False
        return bool(views) and all(view == views[0] for view in views)

    def stop(self) -> None:
        """Stops every node by its PID; idempotent."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "RedisCluster":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # ---- topology

    @staticmethod
    def _slot_ranges(node: ClusterNode) -> list[tuple[int, int, int]]:
        """(first slot, last slot, master port) from one node's `CLUSTER SLOTS`."""
        ranges = []
        for entry in node.command("CLUSTER", "SLOTS"):
            first, last, master = entry[0], entry[1], entry[2]
            ranges.append((int(first), int(last), int(master[1])))
        return ranges

    def _any_live(self) -> ClusterNode:
        for node in self.nodes:
            if node.alive:
                return node
        raise HarnessError("no cluster node is running")

    def node(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def slot_ranges(self) -> list[tuple[int, int, int]]:
        """The slot map as a live node sees it: (first, last, master port), sorted."""
        return sorted(self._slot_ranges(self._any_live()))

    def master_ports(self) -> list[int]:
        """The ports of the masters that own slots, sorted."""
        return sorted({port for _, _, port in self.slot_ranges()})

    def key_slot(self, key: str | bytes) -> int:
        return int(self._any_live().command("CLUSTER", "KEYSLOT", key))

    def master_of(self, key: str | bytes) -> int:
        """The port of the master that owns `key`'s slot."""
        slot = self.key_slot(key)
        return next(port for first, last, port in self.slot_ranges() if first <= slot <= last)

    def replicas_of(self, master_port: int) -> list[int]:
        """The ports of the replicas of a master, from its `INFO replication`."""
        info = self.node(master_port).info("replication")
        return sorted(int(value["port"]) for key, value in info.items()
                      if key.startswith("slave") and isinstance(value, dict))

    def master_holding(self, key: str | bytes) -> ClusterNode:
        return self.node(self.master_of(key))

    @property
    def seeds(self) -> list[tuple[str, int]]:
        """Every node's (host, port): the seed list of a cluster client or of Envoy's redis cluster."""
        return [(HOST, n.port) for n in self.nodes]

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:port` of a live node: a seed, as `erl-admin --cluster --url` takes it."""
        return f"redis://{HOST}:{self._any_live().port}"

    # ---- data

    @property
    def client(self) -> RedisClusterClient:
        """A redis-py cluster client (raw bytes replies) that follows the slot map and redirections."""
        if self._client is None:
            self._client = RedisClusterClient(host=HOST, port=self._any_live().port, socket_timeout=10.0,
                                              socket_connect_timeout=10.0)
        return self._client

    def flushall(self) -> None:
        """FLUSHALL and SCRIPT FLUSH on every master (replicas follow)."""
        for port in self.master_ports():
            self.node(port).command("FLUSHALL")
            self.node(port).command("SCRIPT", "FLUSH")

    def keys_by_node(self) -> dict[int, list[bytes]]:
        """Every master's keys, by port (`KEYS *`: test-sized data only)."""
        return {port: sorted(self.node(port).command("KEYS", "*")) for port in self.master_ports()}

    def script_calls(self) -> dict[int, int]:
        """EVALSHA + EVAL calls served by each master since its start, by port."""
        calls = {}
        for port in self.master_ports():
            stats = self.node(port).info("commandstats")
            calls[port] = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))
        return calls

    def cpu_seconds(self) -> dict[int, float]:
        """`used_cpu_sys + used_cpu_user` of each master, by port."""
        cpu = {}
        for port in self.master_ports():
            info = self.node(port).info("cpu")
            cpu[port] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return cpu

    # ---- failover

    def kill_master(self, port: int) -> float:
        """SIGKILLs the master on `port`; returns the time (epoch seconds) of the kill."""
        killed_at = time.time()
        self.node(port).kill()
        return killed_at

    def wait_promoted(self, key: str | bytes, old_master: int, timeout: float = 30.0) -> int:
        """Waits until a node other than `old_master` owns `key`'s slot and reports cluster_state:ok;
        returns that node's port (the promoted replica)."""
        slot = self.key_slot(key)

        def promoted() -> int | None:
            try:
                owner = next(port for first, last, port in self.slot_ranges() if first <= slot <= last)
                if owner == old_master:
                    return None
                return owner if b"cluster_state:ok" in self.node(owner).command("CLUSTER", "INFO") else None
            except (redis_py.RedisError, StopIteration):
                return None

        return wait_until(promoted, timeout, f"a replica of {old_master} to take over slot {slot}")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(f"--- node {n.port} ---\n{n.log_tail(lines)}" for n in self.nodes)


class RedisProxy:
    """Stock Envoy with only the `redis_proxy` listener of `envoy/redis-proxy.yaml`, in front of a cluster.

    webdis connects to `port` as if it were one Redis; Envoy keeps the slot map (`CLUSTER SLOTS`), routes
    every command by its first key and follows `MOVED`/`ASK`.
    """

    # webdis reads `port` and `password` of the Redis it talks to; the proxy asks for none.
    password = None

    def __init__(self, workdir: Path, cluster: RedisCluster, name: str = "redis-proxy"):
        self.workdir = workdir
        self.cluster = cluster
        self.name = name
        self.port = free_port()
        self.admin_port = free_port()
        self.yaml_path = workdir / f"{name}.yaml"
        self.log_path = workdir / f"{name}.log"
        self.process: Process | None = None

    def render(self) -> str:
        seeds = "\n        ".join(
            f"- endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}"
            for host, port in self.cluster.seeds)
        return string.Template(REDIS_PROXY_TEMPLATE.read_text()).substitute(
            REDIS_PROXY_PORT=self.port, ADMIN_PORT=self.admin_port, REDIS_CLUSTER_SEEDS=seeds)

    def start(self, timeout: float = 30.0) -> "RedisProxy":
        self.yaml_path.write_text(self.render())
        argv = [harness.ENVOY_BIN, "-c", str(self.yaml_path), "--base-id", str(harness._unique_base_id()),
                "--concurrency", "1", "--log-path", str(self.log_path), "-l", "info"]
        self.process = Process(self.name, argv, self.workdir / f"{self.name}.out")

        def ready() -> bool:
            if self.process is None or not self.process.alive():
                raise HarnessError(f"{self.name} exited:\n{tail(self.workdir / f'{self.name}.out')}"
                                   f"\n{tail(self.log_path)}")
            with contextlib.suppress(OSError):
                # A keyed command: answered only once Envoy has the slot map.
                return self.command("EXISTS", "erl-proxy-ready", timeout=1.0).startswith(b":")
            return False

        try:
            wait_until(ready, timeout, f"{self.name} to route a command")
        except HarnessError:
            self.stop()
            raise
        return self

    def command(self, *args: str | bytes | int, timeout: float = 5.0) -> bytes:
        """Sends one command on a fresh connection and returns its raw RESP reply (one read: small replies).

        Not redis-py: its connection handshake (`CLIENT SETINFO`) is not a command the proxy supports.
        """
        parts = [arg if isinstance(arg, bytes) else str(arg).encode() for arg in args]
        query = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection((HOST, self.port), timeout=timeout) as connection:
            connection.sendall(query)
            return connection.recv(65536)

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges starting with `prefix`."""
        response = harness.http_request(self.admin_port, "/stats?format=json", timeout=5.0)
        stats = json.loads(response.body).get("stats", [])
        return {s["name"]: int(s["value"]) for s in stats if "value" in s and s["name"].startswith(prefix)}

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


class ClusterStack(harness.Stack):
    """`harness.Stack` on a Redis Cluster: webdis talks to a `RedisProxy` in front of a `RedisCluster`, and
    Higress-build emulators reach the same proxy as their `redis` cluster (docs/deploying.md, "Redis Cluster").

    The stack's single `redis` is never started; `cluster` and `proxy` take its place.
    """

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 workdir: Path | None = None, full_coverage: bool = True):
        super().__init__(workdir=workdir)
        self.cluster = RedisCluster(self.workdir, masters, replicas, node_timeout_ms, full_coverage)
        self.proxy = RedisProxy(self.workdir, self.cluster)
        self.webdis = harness.Webdis(self.workdir, self.proxy)  # type: ignore[arg-type]

    def start(self) -> "ClusterStack":
        try:
            self.cluster.start()
            self.proxy.start()
            self.webdis.start()
            self.upstream.start()
        except BaseException:
            self.close()
            raise
        return self

    def emulator(self, plugin: dict | str, **kwargs: Any) -> harness.Emulator:
        """As `Stack.emulator`; a Higress-build emulator's `redis` cluster is the proxy by default."""
        section = plugin.get("redis", {}) if isinstance(plugin, dict) else {}
        if section.get("transport") == "host" and "clusters" not in kwargs:
            kwargs["clusters"] = {harness.redis_cluster(section): self.proxy.port}
        return super().emulator(plugin, **kwargs)

    def close(self) -> None:
        try:
            self.stop_envoys()
            self.webdis.stop()
            self.proxy.stop()
            self.cluster.stop()
        finally:
            super().close()
