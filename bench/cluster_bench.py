"""Section 7 of `make bench` (bench/bench.py): the stock build on a Redis Cluster, each figure next to a
baseline measured in the same run.

(a) Scale: one gateway Envoy (stock build, the route answering itself, as in section 1) under wrk, x-user-id
    drawn at random from BENCH_CLUSTER_USERS users, one per-user rule; against one plain redis-server
    through webdis (the baseline: today's deployment), a 1-master cluster and a 3-master cluster, both
    through webdis -> Envoy's redis_proxy (envoy/redis-proxy.yaml). Decisions per second, and CPU per
    decision of Redis (INFO used_cpu_sys + used_cpu_user, summed over the masters), the proxy, webdis, the
    gateway and wrk.
(b) Spread: the limiters of (a)'s 3-master run over the hash slots and masters, from the keys each master
    holds (DBSIZE, KEYS) and from CRC16 (checked against CLUSTER KEYSLOT); the limiters whose keys are on
    more than one master.
(c) Failover (tests/e2e/failover.py): a master SIGKILLed under one client's requests, both builds, each on a
    fresh 3-master + 1-replica cluster (node timeout 1000 ms); the baseline is the same failover with the
    proxy on Envoy's default slot-map refresh settings (the five lines envoy/redis-proxy.yaml sets removed).

Every process comes from tests/e2e/harness.py and tests/e2e/redis_cluster.py on 127.0.0.1, free ports,
stopped by PID when its stack closes.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.crc import key_slot as crc16_slot  # CRC16/XMODEM of the hash tag, mod 16384

import bench as b  # bench/bench.py: settings, wrk, tables, CPU readers
from bench import h, num, out, progress, table
from failover import FailoverRun, run_failover
from redis_cluster import SLOTS, ClusterStack, RedisProxy

USERS = b._env_int("BENCH_CLUSTER_USERS", 10_000)
# (a): one permit per user per second; at 3,000-5,000 requests per second over 10,000 users drawn at random,
# a user comes about every 2-3 s, so most requests are allowed and some (a user's second within 1 s) not.
# local_block_max 0: every decision is one script in Redis, none is answered by the local block.
SCALE_RATE, SCALE_INTERVAL = 1, "1s"
SCALE_RULE = h.rule("per-user", rate=SCALE_RATE, interval=SCALE_INTERVAL, local_block_max=0)
SCALE_TIMEOUT = "500ms"

# (c): tests/e2e/test_redis_cluster.py's failover scenario.
FAILOVER_RATE, FAILOVER_INTERVAL_MS = 40, 4000
FAILOVER_TIMEOUT_MS = 200
FAILOVER_NODE_TIMEOUT_MS = 1000
# Long enough after the promotion for Envoy's default refresh (every 5 s) to find the new master.
FAILOVER_AFTER_S = 6.5
# The lines of envoy/redis-proxy.yaml that make the proxy read the slot map again after a failover.
REFRESH_SETTINGS = ("cluster_refresh_rate", "cluster_refresh_timeout", "redirect_refresh_interval",
                    "redirect_refresh_threshold", "failure_refresh_threshold")

# wrk: x-user-id u<N>, N at random over USERS (each thread its own seed); bench/users.lua's `done` is
# appended, so b.finish_wrk reads the result line.
RANDOM_USERS_LUA = """\
-- written by bench/cluster_bench.py: x-user-id u<N>, N drawn at random from {users} users per request
local users = {users}
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("seed", threads)
end
function init(args)
  math.randomseed(os.time() * 100 + seed)
end
function request()
  return wrk.format("GET", "/", {{ ["x-user-id"] = "u" .. math.random(0, users - 1) }})
end
"""


def random_users_script(workdir: Path) -> Path:
    users_lua = b.WRK_SCRIPT.read_text()
    if "function done(" not in users_lua:
        raise h.HarnessError("bench/users.lua has no `done`: update random_users_script() in bench/cluster_bench.py")
    path = workdir / "random-users.lua"
    path.write_text(RANDOM_USERS_LUA.format(users=USERS) + users_lua[users_lua.index("function done("):])
    return path


# ---------------------------------------------------------------------------------------------------------
# (a) Scale

IDLE_S = 2  # Redis CPU with no load, all deployments at once: the cluster bus and cron's share


def redis_counters(client: Any) -> dict[str, float]:
    """One Redis node's CPU seconds (used_cpu_sys + used_cpu_user), scripts run (EVALSHA + EVAL) and the
    microseconds Redis counted inside them (INFO commandstats)."""
    cpu, stats = client.info("cpu"), client.info("commandstats")
    scripts = [stats.get(f"cmdstat_{name}", {}) for name in ("evalsha", "eval")]
    return {"cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            "scripts": sum(int(s.get("calls", 0)) for s in scripts),
            "usec": sum(float(s.get("usec", 0)) for s in scripts)}


Counters = dict[int, dict[str, float]]  # redis_counters() per node (port)


def counter_deltas(after: Counters, before: Counters) -> Counters:
    return {port: {name: value - before[port][name] for name, value in counters.items()}
            for port, counters in after.items()}


@dataclass
class ScaleRun:
    wrk: b.WrkResult
    stats: dict[str, int]  # deltas of the gateway's b.ENVOY_STATS, short names
    redis: Counters  # redis_counters() deltas per master
    cpu: dict[str, float]  # CPU seconds: wrk, Envoy, webdis, proxy; "machine": every process

    @property
    def decisions(self) -> int:
        return self.stats.get("allowed", 0) + self.stats.get("rejected", 0)

    @property
    def decisions_per_s(self) -> float:
        return self.decisions / (self.wrk.duration_us / 1e6)


@dataclass
class Deployment:
    key: str
    title: str
    stack: h.Stack
    envoy: h.Envoy | None = None
    runs: list[ScaleRun] = field(default_factory=list)
    idle_cpu_per_s: float = float("nan")  # Redis CPU seconds per second without load, every master

    def redis_counters(self) -> Counters:
        if isinstance(self.stack, ClusterStack):
            cluster = self.stack.cluster
            counters = {}
            for port in cluster.master_ports():
                client = cluster.node(port).client()
                try:
                    counters[port] = redis_counters(client)
                finally:
                    client.close()
            return counters
        return {self.stack.redis.port: redis_counters(self.stack.redis.client)}

    def pids(self) -> dict[str, int]:
        proxy = self.stack.proxy.process if isinstance(self.stack, ClusterStack) else None
        return {"Envoy": self.envoy.process.pid if self.envoy and self.envoy.process else 0,
                "webdis": self.stack.webdis.process.pid if self.stack.webdis.process else 0,
                "proxy": proxy.pid if proxy else 0}

    def redis_total(self, name: str) -> dict[int, float]:
        """A redis_counters() figure summed over the runs, per master."""
        return {port: sum(r.redis[port][name] for r in self.runs) for port in self.runs[0].redis}

    def total(self, name: str) -> float:
        """Over the runs: decisions, seconds, CPU seconds of a process ("Redis": every master) or the machine."""
        if name == "decisions":
            return sum(r.decisions for r in self.runs)
        if name == "seconds":
            return sum(r.wrk.duration_us for r in self.runs) / 1e6
        if name == "Redis":
            return sum(self.redis_total("cpu").values())
        return sum(r.cpu.get(name, 0.0) for r in self.runs)

    def per_decision_us(self, name: str) -> float:
        decisions = self.total("decisions")
        return 1e6 * self.total(name) / decisions if decisions else float("nan")

    def rps(self) -> float:
        return b.median(r.decisions_per_s for r in self.runs)

    def busy(self) -> float:
        return self.total("machine") / self.total("seconds")


def one_master_stack() -> ClusterStack:
    return ClusterStack(masters=1)


def start_wrk(port: int, seconds: int, workdir: Path, label: str, script: Path) -> tuple[h.Process, Path]:
    output = workdir / f"wrk-{label}.out"
    output.unlink(missing_ok=True)
    argv = [b.WRK, "-t", str(b.THREADS), "-c", str(b.CONNECTIONS), "-d", f"{seconds}s", "--timeout", "5s",
            "-s", str(script), f"http://{h.HOST}:{port}/"]
    return h.Process("wrk", argv, output), output


def measure(dep: Deployment, label: str, script: Path, seconds: int) -> ScaleRun:
    assert dep.envoy is not None
    pids = dep.pids()
    stats_before, redis_before = dep.envoy.stats(filter=b.ENVOY_STATS), dep.redis_counters()
    cpu_before = {name: b.cpu_seconds(pid) for name, pid in pids.items()}
    wrk_before, machine_before = b.children_cpu_seconds(), b.machine_cpu_seconds()
    result = b.finish_wrk(start_wrk(dep.envoy.port, seconds, dep.stack.workdir, label, script), seconds)
    cpu = {"wrk": b.children_cpu_seconds() - wrk_before, "machine": b.machine_cpu_seconds() - machine_before}
    cpu.update({name: b.cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()})
    redis = counter_deltas(dep.redis_counters(), redis_before)
    stats_after = dep.envoy.stats(filter=b.ENVOY_STATS)
    stats = {b._short(name): value - stats_before.get(name, 0) for name, value in stats_after.items()}
    return ScaleRun(result, stats, redis, cpu)


def measure_idle(deployments: list[Deployment]) -> None:
    """Redis CPU per second of every deployment with no load (all at once, IDLE_S seconds)."""
    before = [dep.redis_counters() for dep in deployments]
    started = time.monotonic()
    time.sleep(IDLE_S)
    for dep, counters in zip(deployments, before):
        used = counter_deltas(dep.redis_counters(), counters)
        dep.idle_cpu_per_s = sum(c["cpu"] for c in used.values()) / (time.monotonic() - started)


def run_scale() -> tuple[list[Deployment], "Spread"]:
    """(a)'s runs, interleaved round by round, and (b) from the 3-master cluster they leave behind."""
    plugin = h.plugin_config(SCALE_RULE, timeout=SCALE_TIMEOUT)
    deployments = [
        Deployment("plain", "baseline: one redis-server via webdis", h.Stack()),
        Deployment("1-shard", "1-master cluster via webdis -> redis_proxy", one_master_stack()),
        Deployment("3-shard", "3-master cluster via webdis -> redis_proxy", ClusterStack(masters=3)),
    ]
    try:
        progress(f"(7a) starting a redis-server, a 1-master and a 3-master cluster, their webdis, 2 redis_proxy "
                 f"Envoys and {len(deployments)} gateway Envoys")
        for dep in deployments:
            dep.stack.start()
            dep.envoy = b.lease_gateway(dep.stack, f"envoy-{dep.key}", plugin, b.CONCURRENCY, None)
        for dep in deployments:
            assert dep.envoy is not None
            dep.envoy.wait_ready()
        script = random_users_script(deployments[0].stack.workdir)
        for dep in deployments:
            progress(f"(7a) warming up {dep.key} for {b.WARM_UP_S} s")
            measure(dep, f"warm-{dep.key}", script, b.WARM_UP_S)
        for round_index in range(b.ROUNDS):
            for dep in deployments:
                progress(f"(7a) {dep.title}: round {round_index + 1}/{b.ROUNDS}, {b.DURATION} s")
                dep.runs.append(measure(dep, f"{dep.key}-{round_index}", script, b.DURATION))
        progress(f"(7a) Redis CPU without load, {IDLE_S} s")
        measure_idle(deployments)
        progress("(7b) reading the keys of every master of the 3-master cluster")
        spread = read_spread(deployments[2].stack)
    finally:
        for dep in deployments:
            dep.stack.close()
    return deployments, spread


def print_scale(deployments: list[Deployment]) -> None:
    out(f"(a) Scale: the stock build in one gateway Envoy (--concurrency {b.CONCURRENCY}, the route answering "
        f"itself), wrk -t{b.THREADS} -c{b.CONNECTIONS} -d{b.DURATION}s, x-user-id drawn at random from "
        f"{num(USERS)} users per request; rule per-user {SCALE_RATE} per {SCALE_INTERVAL[:-1]} s, local_block_max 0 "
        "(every decision is one script in Redis: most requests allowed, a user's second within a second "
        f"rejected). Medians of {b.ROUNDS} interleaved runs per deployment (spread min-max); CPU per decision "
        "over all runs: Redis from INFO (used_cpu_sys + used_cpu_user, summed over the masters; idle: the same "
        f"without load, {IDLE_S} s, per second / the decisions per second), the other processes from /proc (wrk "
        "by rusage). Decisions: the filter's allowed + rejected counters; failed: redis_errors + failure_allowed.")
    rows = []
    for dep in deployments:
        runs = dep.runs
        decisions = dep.total("decisions")
        allowed = sum(r.stats.get("allowed", 0) for r in runs)
        failed = sum(r.stats.get("redis_errors", 0) + r.stats.get("failure_allowed", 0) for r in runs)
        rows.append([dep.title, num(dep.rps()), b.spread([r.decisions_per_s for r in runs]),
                     num(b.median(r.wrk.p50 for r in runs)), num(b.median(r.wrk.p99 for r in runs)),
                     f"{100 * allowed / decisions:.1f}%" if decisions else "-", num(failed),
                     f"{dep.per_decision_us('Redis'):.1f}", f"{1e6 * dep.idle_cpu_per_s / dep.rps():.1f}",
                     *(f"{dep.per_decision_us(name):.1f}" if dep.total(name) or name != "proxy" else "-"
                       for name in ("proxy", "webdis", "Envoy", "wrk")),
                     f"{dep.busy():.2f}"])
    out(table(["deployment", "decisions/s", "spread", "p50 us", "p99 us", "allowed", "failed", "Redis us/dec",
               "of it idle", "proxy us/dec", "webdis us/dec", "gateway us/dec", "wrk us/dec", "CPUs busy"], rows))
    out("Per master, over the runs: share of the scripts / share of the Redis CPU / Redis CPU per script / time "
        "inside the script per call (INFO commandstats usec).")
    for dep in deployments:
        scripts, cpu, usec = dep.redis_total("scripts"), dep.redis_total("cpu"), dep.redis_total("usec")
        total_scripts, total_cpu = sum(scripts.values()), sum(cpu.values())
        if not total_scripts or not total_cpu:
            out(f"  {dep.key}: no scripts")
            continue
        out(f"  {dep.key + ':':9}" + "; ".join(
            f":{port} {100 * scripts[port] / total_scripts:.1f}% / {100 * cpu[port] / total_cpu:.1f}% / "
            f"{1e6 * cpu[port] / scripts[port]:.1f} us / {usec[port] / scripts[port]:.1f} us"
            for port in sorted(scripts) if scripts[port]))
    print_scale_reading(deployments)


def print_scale_reading(deployments: list[Deployment]) -> None:
    plain, one, three = deployments
    busy = statistics.mean(d.busy() for d in deployments)
    cores = len(os.sched_getaffinity(0))
    gateway = {d.key: sum(d.per_decision_us(n) for n in ("wrk", "Envoy", "webdis"))
               + (d.per_decision_us("proxy") if d.total("proxy") else 0.0) for d in deployments}
    redis = {d.key: d.per_decision_us("Redis") for d in deployments}
    idle = {d.key: 1e6 * d.idle_cpu_per_s / d.rps() for d in deployments}
    ratio = three.rps() / one.rps()
    saturated = busy >= 0.8 * cores and gateway["3-shard"] > redis["3-shard"]
    out(f"Reading: this machine has {cores} cores, shared by wrk, the gateway Envoy, webdis, the proxy and every "
        f"Redis node; during the runs {busy:.2f} of them were busy, and per decision the gateway side (wrk, "
        f"Envoy, webdis, proxy) used {gateway['3-shard']:.0f} us of CPU on the 3-master cluster against "
        f"{redis['3-shard']:.0f} us in Redis"
        + (", so the gateway side saturates the cores first" if saturated else
           " (the gateway side alone did not saturate the cores)")
        + (" and extra shards cannot show as more decisions per second here: " if saturated and ratio < 1.1 else
           "; yet 3 shards did show more decisions per second here: " if ratio >= 1.1 else ": ")
        + f"3 masters made {ratio:.2f}x the decisions/s of 1 master, the 1-master cluster "
        f"{one.rps() / plain.rps():.2f}x the baseline's (the proxy's "
        f"{one.per_decision_us('proxy'):.0f} us per decision comes out of the same cores). What carries over is "
        f"Redis CPU per decision: {redis['plain']:.1f} us on one redis-server, {redis['1-shard']:.1f} us on 1 "
        f"master, {redis['3-shard']:.1f} us summed over 3 masters (of which {idle['plain']:.1f}, "
        f"{idle['1-shard']:.1f} and {idle['3-shard']:.1f} us what each uses without load, at these decision "
        "rates), split across the masters as above.")
    inside = {d.key: sum(d.redis_total("usec").values()) / max(1.0, sum(d.redis_total("scripts").values()))
              for d in deployments}
    more = redis["3-shard"] / redis["1-shard"]
    if more >= 1.1:
        out(f"Measured, not assumed: 3 masters used {more:.2f}x the Redis CPU per decision of 1 master, only "
            f"{idle['3-shard'] - idle['1-shard']:.1f} us of the difference idle work (cluster bus, cron), and "
            f"spent {inside['3-shard']:.1f} us inside each script against {inside['1-shard']:.1f} us (wall time, "
            "INFO commandstats): on these 2 shared cores three Redis processes, each with a third of the "
            "scripts, compete with the rest; a master on cores of its own may need less per decision.")


# ---------------------------------------------------------------------------------------------------------
# (b) Spread


def limiter_of(key: str) -> tuple[str, str]:
    """(limiter name, part): `name` -> (name, "config"), `{name}:value` -> (name, "value")."""
    if key.startswith("{") and "}:" in key:
        name, _, suffix = key[1:].partition("}:")
        return name, suffix
    return key, "config"


@dataclass
class Spread:
    masters: list[int]
    owned_slots: dict[int, int]  # slots each master owns
    dbsize: dict[int, int]
    limiters: dict[str, dict[str, int]]  # name -> {part: master port}
    crc_master: dict[str, int]  # name -> master owning its CRC16 slot
    slots: set[int]
    keyslot_mismatches: int


def read_spread(stack: ClusterStack) -> Spread:
    cluster = stack.cluster
    ranges = cluster.slot_ranges()
    masters = cluster.master_ports()
    owned = {port: sum(last - first + 1 for first, last, p in ranges if p == port) for port in masters}
    dbsize = {port: int(cluster.node(port).command("DBSIZE")) for port in masters}
    limiters: dict[str, dict[str, int]] = {}
    for port, keys in cluster.keys_by_node().items():
        for key in keys:
            name, part = limiter_of(key.decode())
            limiters.setdefault(name, {})[part] = port
    names = sorted(limiters)
    slot_of = {name: crc16_slot(name.encode()) for name in names}
    client = cluster.node(masters[0]).client()
    try:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.execute_command("CLUSTER", "KEYSLOT", name)
        redis_slots = [int(slot) for slot in pipe.execute()]
    finally:
        client.close()
    mismatches = sum(1 for name, slot in zip(names, redis_slots) if slot_of[name] != slot)
    crc_master = {name: next(p for first, last, p in ranges if first <= slot_of[name] <= last) for name in names}
    return Spread(masters, owned, dbsize, limiters, crc_master, set(slot_of.values()), mismatches)


def print_spread(spread: Spread) -> None:
    limiters = spread.limiters
    count = len(limiters)
    out()
    out(f"(b) Spread: the limiters the 3-master run of (a) left in the cluster (erl:per-user:u<N>, drawn from "
        f"{num(USERS)} users), from the keys each master holds (DBSIZE; KEYS grouped by limiter) and from the "
        "slot of each limiter's name (CRC16 mod 16384, the slot of its hash tag for the {name}: keys; checked "
        "against CLUSTER KEYSLOT). Baseline: the share of the 16,384 slots each master owns.")
    expected_slots = SLOTS * (1 - (1 - 1 / SLOTS) ** count)
    total_keys = sum(spread.dbsize.values())
    rows = []
    for port in spread.masters:
        by_crc = sum(1 for name in limiters if spread.crc_master[name] == port)
        rows.append([f":{port}", f"{num(spread.owned_slots[port])} ({100 * spread.owned_slots[port] / SLOTS:.1f}%)",
                     f"{num(by_crc)} ({100 * by_crc / count:.1f}%)", num(3 * by_crc),
                     f"{num(spread.dbsize[port])} ({100 * spread.dbsize[port] / total_keys:.1f}%)",
                     "yes" if spread.dbsize[port] == 3 * by_crc else "NO"])
    out(table(["master", "slots owned (baseline)", "limiters by CRC16", "keys expected (3 each)",
               "keys (DBSIZE)", "equal"], rows))
    shares = [100 * spread.dbsize[port] / total_keys for port in spread.masters]
    split = sum(1 for parts in limiters.values() if len(set(parts.values())) > 1)
    incomplete = sum(1 for parts in limiters.values() if set(parts) != {"config", "value", "permits"})
    out(table(["measure", "measured", "baseline", "target"], [
        ["limiters (names in the run)", num(count), f"{num(USERS)} users to draw from", "-"],
        ["distinct hash slots of their names", num(len(spread.slots)),
         f"{num(expected_slots)} expected for {num(count)} names at random", "-"],
        ["keys per master: min / max", f"{num(min(spread.dbsize.values()))} / {num(max(spread.dbsize.values()))}",
         f"{num(total_keys / len(spread.masters))} each if even", "-"],
        ["keys per master: min / max share", f"{min(shares):.1f}% / {max(shares):.1f}%",
         f"{100 / len(spread.masters):.1f}% each if even", "-"],
        ["names whose CRC16 slot differs from CLUSTER KEYSLOT", num(spread.keyslot_mismatches), "0", "-"],
        ["limiters without all three keys (config hash, {name}:value, {name}:permits)", num(incomplete), "0", "-"],
        ["limiters with keys on more than one master", num(split), "0", "must be 0"],
    ], left=1))


# ---------------------------------------------------------------------------------------------------------
# (c) Failover


class DefaultRefreshProxy(RedisProxy):
    """envoy/redis-proxy.yaml without its slot-map refresh settings: Envoy's defaults (refresh every 5 s,
    after 5 redirections at most every 5 s, never on failures)."""

    def render(self) -> str:
        lines = super().render().splitlines(keepends=True)
        kept = [line for line in lines if line.strip().split(":", 1)[0] not in REFRESH_SETTINGS]
        if len(lines) - len(kept) != len(REFRESH_SETTINGS):
            raise h.HarnessError("envoy/redis-proxy.yaml changed shape: update DefaultRefreshProxy in "
                                 "bench/cluster_bench.py")
        return "".join(kept)


@dataclass
class FailoverCase:
    build: str  # "envoy" (stock, real Envoy) or "higress" (the emulator)
    defaults: bool  # the proxy on Envoy's default refresh settings
    run: FailoverRun | None = None

    @property
    def title(self) -> str:
        build = "stock" if self.build == "envoy" else "Higress"
        return f"{build}: {'Envoy defaults (baseline)' if self.defaults else 'redis-proxy.yaml'}"


def run_failover_case(case: FailoverCase) -> None:
    with ClusterStack(masters=3, replicas=1, node_timeout_ms=FAILOVER_NODE_TIMEOUT_MS) as stack:
        if case.defaults:
            stack.proxy = DefaultRefreshProxy(stack.workdir, stack.cluster, name="redis-proxy-defaults")
            stack.webdis = h.Webdis(stack.workdir, stack.proxy)  # type: ignore[arg-type]
        stack.start()
        rule = h.rule(rate=FAILOVER_RATE, interval=f"{FAILOVER_INTERVAL_MS // 1000}s")
        fields = {"timeout": f"{FAILOVER_TIMEOUT_MS}ms", "failure_mode": "deny"}
        limit: Any = (stack.envoy(h.plugin_config(rule, **fields)) if case.build == "envoy"
                      else stack.emulator(h.host_plugin_config(rule, **fields)))
        user = "failover"
        limiter = h.limiter_name("erl:per-user", user)
        if not stack.cluster.replicas_of(stack.cluster.master_of(limiter)):
            raise h.HarnessError(f"the master of {limiter} has no replica")
        progress(f"(7c) failover, {case.title}: a master killed under load")
        case.run = run_failover(stack.cluster, lambda: limit.send(headers={"x-user-id": user}).status, limiter,
                                rate=FAILOVER_RATE, interval_ms=FAILOVER_INTERVAL_MS, after_s=FAILOVER_AFTER_S)


def print_failover(cases: list[FailoverCase]) -> None:
    out()
    out(f"(c) Failover: one client sends requests for one limiter (rule per-user {FAILOVER_RATE} per "
        f"{FAILOVER_INTERVAL_MS // 1000} s, timeout {FAILOVER_TIMEOUT_MS} ms, failure_mode deny: a failed decision "
        "answers 503), one after the other, 10 ms apart; 2.5 s in, the master owning the limiter is SIGKILLed "
        f"(3 masters + 1 replica each, cluster-node-timeout {FAILOVER_NODE_TIMEOUT_MS} ms, a fresh cluster per "
        f"run); it goes on {FAILOVER_AFTER_S} s after a replica owns the slot. The client runs ahead of the rate, "
        "so the limiter is blocked locally (429 without a Redis call) when the master dies: decisions start "
        "failing when the block ends and the next request needs Redis. Baseline: the proxy on Envoy's "
        "default slot-map refresh (cluster_refresh_rate, cluster_refresh_timeout, redirect_refresh_interval, "
        "redirect_refresh_threshold, failure_refresh_threshold removed from envoy/redis-proxy.yaml). One run "
        "each. Failing: first to last failed decision; recovery: promotion to the first decision after the "
        "last failure; lost permits: granted by the old master in the last window before the kill, not held "
        "by the promoted replica; worst window: most admitted in any sliding window of the interval.")

    def cell(case: FailoverCase, pick: Any) -> str:
        return pick(case.run) if case.run is not None else "-"

    def ms(value: float | None) -> str:
        return "not recovered" if value is None else f"{num(value)} ms"

    measures = [
        ("decisions 200 / 429 / 503", "-", lambda r: " / ".join(
            num(sum(1 for d in r.decisions if d.status == s)) for s in (200, 429, r.failure_status))),
        ("first failed decision after the kill", "-", lambda r: ms(r.failures[0].start_ms - r.killed_ms)
         if r.failures else "none"),
        ("failing (first to last failed decision)", "-", lambda r: ms(r.failing_ms)),
        ("slowest request from the kill on", f"timeout {FAILOVER_TIMEOUT_MS} ms", lambda r: ms(r.slowest_ms)),
        ("promotion (kill to a replica owning the slot)", "-", lambda r: ms(r.promotion_ms)),
        ("recovery (promotion to the next decision)", "-", lambda r: ms(r.recovery_ms)),
        ("kill to the first decision after the last failure", "-",
         lambda r: ms(None if r.recovery_ms is None else r.promotion_ms + r.recovery_ms)),
        ("admitted in the window before the kill", "-", lambda r: num(r.admitted_before_kill)),
        ("lost permits (not on the promoted replica)", "-", lambda r: num(r.lost_permits)),
        (f"worst sliding {FAILOVER_INTERVAL_MS // 1000} s window (admitted)",
         f"rate {FAILOVER_RATE} + lost permits", lambda r: f"{num(r.worst_window)} of {r.rate}"),
    ]
    out(table(["measure", *(case.title for case in cases), "reference", "target"],
              [[label, *(cell(case, pick) for case in cases), reference, "-"] for label, reference, pick in measures]))
    for build in ("envoy", "higress"):
        tuned = next((c.run for c in cases if c.build == build and not c.defaults and c.run), None)
        default = next((c.run for c in cases if c.build == build and c.defaults and c.run), None)
        if tuned is None or default is None:
            continue
        name = "stock build" if build == "envoy" else "Higress build"
        back = {kind: None if r.recovery_ms is None else r.promotion_ms + r.recovery_ms
                for kind, r in (("tuned", tuned), ("default", default))}
        if back["tuned"] is None or back["default"] is None:
            out(f"Reading ({name}): a run did not recover within {FAILOVER_AFTER_S} s of the promotion (see above).")
            continue
        out(f"Reading ({name}): with envoy/redis-proxy.yaml's refresh settings the limiter's decisions were back "
            f"{num(back['tuned'])} ms after the kill ({num(tuned.promotion_ms)} ms to the promotion, "
            f"{num(tuned.recovery_ms)} ms more), {num(tuned.failing_ms)} ms of them failing; on Envoy's defaults "
            f"after {num(back['default'])} ms ({num(default.promotion_ms)} + {num(default.recovery_ms)} ms), "
            f"{num(default.failing_ms)} ms failing: "
            + (f"{num(back['default'] - back['tuned'])} ms longer, as the proxy reads the slot map again only "
               "on its periodic refresh (every 5 s by default) and not on failures." if back["default"] > back["tuned"]
               else "no longer in this run."))
    out("One run each: after the promotion the proxy waits for its next refresh, so recovery varies from run to "
        "run with where the refresh period stands (up to 5 s on Envoy's defaults, up to 1 s with "
        "redis-proxy.yaml's cluster_refresh_rate, sooner when a failure triggers a refresh after the promotion).")


# ---------------------------------------------------------------------------------------------------------


def run_cluster() -> None:
    """Section 7: (a) and (b) on three deployments at once, then (c) on a fresh cluster per run."""
    started = time.monotonic()
    b.heading("7. Redis Cluster: webdis -> redis_proxy -> cluster vs one redis-server (baseline)")
    deployments, spread = run_scale()
    print_scale(deployments)
    print_spread(spread)
    cases = [FailoverCase("envoy", False), FailoverCase("envoy", True), FailoverCase("higress", False),
             FailoverCase("higress", True)]
    for case in cases:
        run_failover_case(case)
    print_failover(cases)
    out(f"Section 7 took {time.monotonic() - started:.0f} s.")
