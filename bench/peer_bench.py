"""Section 9 of `make bench` (bench/bench.py): peers, each measured in the same run, with the same limits and
the same wrk load as our stock build.

What a stock Envoy user has for a limit shared by several gateways without our filter: Envoy's native
global rate limit filter (envoy.filters.http.ratelimit) asking a rate limit service over gRPC. The service
here is erl-peer-rls (bench/rls): Kuadrant's limitador crate, the engine of Limitador, behind Envoy's
RateLimitService API, with limitador's Redis storage (`redis`: the counters read and updated in Redis on
every request) and its cached Redis storage (`redis_cached`: decided from a local cache, Redis updated in
batches every second), on the same redis-server as our filter. Envoy's in-process local_ratelimit (not
shared between gateways) is the floor, and Envoy without a limit the baseline.

(a) Allowed: one Envoy at a time (--concurrency BENCH_CONCURRENCY) under wrk as in section 1 (x-user-id over
    BENCH_USERS users, Envoy answering 200 itself after the limiter), a per-user limit of 1,000,000 per 1 s that nothing
    reaches: req/s, p50/p99 (and p50 with one connection), CPU per request by process (wrk, Envoy, the rate
    limit service, webdis, Redis), Redis calls per request (INFO commandstats).
(b) Saturation: 2 Envoys (2 gateways, each with its own rate limit service process for the peers: two
    replicas sharing Redis), one global limit of BENCH_LEASE_RATE per 1 s (section 6's settings), both
    loaded at once far beyond it for BENCH_LEASE_SECONDS: every admitted request's start time from Envoy's
    access log; admitted per fixed 1-s window of the clock against the rate, the most admitted in any sliding
    1-s window, Redis calls per admitted request, requests let through because the limiter failed.

limitador counts in fixed windows that start at a counter's first hit (its Redis key's TTL), not on the
clock's grid: a fixed window of the clock may straddle two of limitador's. Our filter's limit is a sliding
window (Redisson's RRateLimiter). The figures are what each does, side by side.

Every process comes from tests/e2e/harness.py (Envoy, redis-server, webdis, wrk) or is started here through
its Process class (erl-peer-rls) on 127.0.0.1, free ports, stopped by PID (SIGTERM) when the section ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench as b  # bench/bench.py: settings, wrk, tables, CPU readers, the saturation tools of section 6
from bench import h, num, out, progress, table

RLS_DIR = b.REPO / "bench" / "rls"
RLS_BIN = Path(os.environ.get("ERL_PEER_RLS_BIN", RLS_DIR / "target" / "release" / "erl-peer-rls"))
RLS_BUILD_STATUS = RLS_DIR / "target" / "build.status"  # written by bench/rls/build.sh (make bench)

TIMEOUT_MS = 500  # our filter's Redis timeout and the ratelimit filter's gRPC timeout (Envoy's default: 20 ms)
TIMEOUT = f"{TIMEOUT_MS}ms"
ALLOWED_DOMAIN, SATURATED_DOMAIN = "peer-allowed", "peer-saturated"
ALLOWED_RATE = 1_000_000  # (a): per user per 1 s, never reached
RATE = b.SATURATION_RATE  # (b): the global limit per 1 s
INTERVAL_MS = b.SATURATION_INTERVAL_MS  # 1000: limitador's windows are whole seconds
SATURATED_S = b.SATURATION_S
GATEWAYS = 2
UNLOADED_S = 2

# limitador's limits (bench/rls/src/limits.rs): the same two limits in every rate limit service process.
LIMITS = [
    {"namespace": ALLOWED_DOMAIN, "name": "per-user", "max_value": ALLOWED_RATE, "seconds": 1,
     "variables": ["descriptors[0]['x-user-id']"]},
    {"namespace": SATURATED_DOMAIN, "name": "global", "max_value": RATE, "seconds": INTERVAL_MS // 1000},
]
# Our filter's rules with the same limits.
OURS_ALLOWED = h.plugin_config(h.rule("peer-per-user", rate=ALLOWED_RATE, interval="1s"), timeout=TIMEOUT)
OURS_SATURATED = h.plugin_config(h.rule("peer-global", limit_by="global", rate=RATE, interval=f"{INTERVAL_MS}ms"),
                                 timeout=TIMEOUT)
OURS_PERMITS_KEY = h.limiter_key(h.limiter_name("erl:peer-global"), "permits")

# Envoy's ratelimit filter asks its service only on a route to a cluster (a direct_response route has no
# route entry: the filter lets every request through without a call). So in this section every gateway's
# route names the cluster `upstream`, and Envoy's fault filter, after the limiter, answers 200 itself: no
# upstream is reached or measured, the same for every row.
ANSWER_200 = """\
          - name: envoy.filters.http.fault
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault
              abort:
                http_status: 200
                percentage: { numerator: 100, denominator: HUNDRED }
"""
# Envoy's ratelimit filter in place of ours, its descriptors from the filter's own rate_limits.
RATELIMIT_FILTER = """\
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: {domain}
              timeout: {timeout}
              failure_mode_deny: false
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{ cluster_name: peer_rls }}
              rate_limits:
              - actions:
                - {action}
"""
PER_USER_ACTION = "request_headers: { header_name: x-user-id, descriptor_key: x-user-id }"
GLOBAL_ACTION = "generic_key: { descriptor_value: global }"
RLS_CLUSTER = """\
  - name: peer_rls
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: peer_rls
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: 127.0.0.1, port_value: {port} }}
"""
CLUSTERS = "  clusters:\n"
# Envoy's local_ratelimit (section 1's, its bucket changed): one token bucket per Envoy, shared by its workers.
NATIVE_BUCKET = "token_bucket: { max_tokens: 1, tokens_per_fill: 1, fill_interval: 3600s }"
# The ratelimit filter's counters (ok, over_limit, error, failure_mode_allowed): under the route's cluster.
RLS_STATS = r"^cluster\.upstream\.ratelimit\."
# Redis commands the bench itself sends (INFO, CONFIG RESETSTAT; ZRANGE: section 6's sampler in b.saturate).
BENCH_COMMANDS = ("cmdstat_info", "cmdstat_config", "cmdstat_zrange")
CLIENT_COMMANDS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script")


@dataclass(frozen=True)
class Peer:
    """One row: how the gateway limits (`kind`: none, local, ours, rls) and, for rls, the storage."""
    key: str
    title: str
    kind: str
    storage: str = ""


NONE = Peer("none", "Envoy, no limit (baseline)", "none")
LOCAL = Peer("local", "Envoy local_ratelimit (in-process)", "local")
OURS = Peer("ours", "our filter, stock build (webdis -> Redis)", "ours")
RLS = Peer("rls", "Envoy ratelimit -> limitador, redis storage", "rls", "redis")
RLS_CACHED = Peer("rls-cached", "Envoy ratelimit -> limitador, redis_cached", "rls", "redis_cached")
PEERS_A = [NONE, LOCAL, OURS, RLS, RLS_CACHED]
PEERS_B = [OURS, RLS, RLS_CACHED, LOCAL]


# ---------------------------------------------------------------------------------------------------------
# Processes


def locked_versions(*names: str) -> str:
    """"limitador 0.14.0, ..." as bench/rls/Cargo.lock pins them."""
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError):
        packages = tomllib.loads((RLS_DIR / "Cargo.lock").read_text()).get("package", [])
        versions = {package.get("name"): package.get("version") for package in packages}
        return ", ".join(f"{name} {versions.get(name, '?')}" for name in names)
    return "versions unknown"


def rls_unavailable() -> str | None:
    """Why erl-peer-rls cannot run (None: it can): build.sh's failure, or no binary."""
    status = RLS_BUILD_STATUS.read_text().strip() if RLS_BUILD_STATUS.is_file() else ""
    if status and status != "ok":
        return f"bench/rls/build.sh failed: {status}"
    if not RLS_BIN.is_file():
        return f"no {RLS_BIN}: build it with bench/rls/build.sh (make bench does)"
    return None


class RlsProcess:
    """One erl-peer-rls on a free port, with the limits file `limits`, on the stack's redis-server."""

    def __init__(self, stack: h.Stack, name: str, storage: str, limits: Path):
        self.name = name
        self.port = h.free_port()
        self.log = stack.workdir / f"{name}.log"
        argv = [str(RLS_BIN), "--port", str(self.port), "--redis", f"redis://{h.HOST}:{stack.redis.port}",
                "--limits", str(limits), "--storage", storage, "--threads", str(b.CONCURRENCY)]
        self.process = h.Process(name, argv, self.log)

    def wait_ready(self, timeout: float = 10.0) -> None:
        def listening() -> bool:
            if not self.process.alive():
                raise h.HarnessError(f"{self.name} exited with code {self.process.returncode}:\n{h.tail(self.log)}")
            with socket.create_connection((h.HOST, self.port), timeout=0.5):
                return True

        h.wait_until(listening, timeout, f"{self.name} to listen on {self.port}")

    def stop(self) -> None:
        """SIGTERM (then SIGKILL after 5 s); its exit code is kept in `exit_codes` (0: it shut down cleanly)."""
        if self.process.alive():
            RlsProcess.exit_codes.append(self.process.stop())

    exit_codes: list[int | None] = []  # of every RlsProcess stopped while it ran


def gateway(stack: h.Stack, name: str, peer: Peer, *, saturated: bool, concurrency: int,
            rls: RlsProcess | None = None, admitted_log: Path | None = None) -> h.Envoy:
    """An Envoy limiting as `peer` does, with the allowed or the saturated limit, answering 200 itself after
    the limiter (ANSWER_200); with `admitted_log`, logging every admitted request's start time there (as in
    section 6). Started without waiting."""
    ours = peer.kind == "ours"
    plugin = (OURS_SATURATED if saturated else OURS_ALLOWED) if ours else h.plugin_config(h.rule())
    envoy = h.Envoy(stack.workdir, plugin, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                    concurrency=concurrency, name=name)
    text = b.bench_envoy_yaml(envoy.yaml_path.read_text(), "wasm" if ours else "none")
    text = text.replace(b.DIRECT_RESPONSE, b.ROUTE)
    filters = ""
    if peer.kind == "local":
        if b.NATIVE_LOCAL_RATELIMIT.count(NATIVE_BUCKET) != 1:
            raise h.HarnessError("bench.NATIVE_LOCAL_RATELIMIT changed: update NATIVE_BUCKET in bench/peer_bench.py")
        tokens = RATE if saturated else ALLOWED_RATE
        filters = b.NATIVE_LOCAL_RATELIMIT.replace(NATIVE_BUCKET, f"token_bucket: {{ max_tokens: {tokens}, "
                                                   f"tokens_per_fill: {tokens}, fill_interval: {INTERVAL_MS / 1000:g}s }}")
    elif peer.kind == "rls":
        assert rls is not None
        if text.count(CLUSTERS) != 1:
            raise h.HarnessError("envoy/envoy.yaml changed shape: update gateway() in bench/peer_bench.py")
        filters = RATELIMIT_FILTER.format(domain=SATURATED_DOMAIN if saturated else ALLOWED_DOMAIN,
                                          timeout=f"{TIMEOUT_MS / 1000:g}s",
                                          action=GLOBAL_ACTION if saturated else PER_USER_ACTION)
        text = text.replace(CLUSTERS, CLUSTERS + RLS_CLUSTER.format(port=rls.port))
    router = text.index(b.ROUTER_FILTER_START)
    text = text[:router] + filters + ANSWER_200 + text[router:]
    envoy.yaml_path.write_text(b.with_admitted_log(text, admitted_log) if admitted_log else text)
    stack.envoys.append(envoy)  # stopped by Stack.close(), whatever happens
    envoy.start(wait_ready=False)
    return envoy


def redis_counts(commands: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(calls, commands) from INFO commandstats: the calls clients sent (EVALSHA, EVAL, SCRIPT: neither our
    filter nor limitador sends anything else on the request path), and every command Redis ran, those the
    scripts ran included; less the bench's own."""
    calls = sum(int(stats.get("calls", 0)) for name, stats in commands.items() if name.startswith(CLIENT_COMMANDS))
    ran = sum(int(stats.get("calls", 0)) for name, stats in commands.items() if not name.startswith(BENCH_COMMANDS))
    return calls, ran


def stat_deltas(envoys: list[h.Envoy], before: list[dict[str, int]], pattern: str) -> dict[str, int]:
    """The Envoys' stats matching `pattern` now less `before`, summed, short names."""
    total: dict[str, int] = {}
    for envoy, old in zip(envoys, before):
        for name, value in envoy.stats(filter=pattern).items():
            short = b._short(name).removeprefix("cluster.upstream.")
            total[short] = total.get(short, 0) + value - old.get(name, 0)
    return total


# ---------------------------------------------------------------------------------------------------------
# (a) Allowed


@dataclass
class AllowedRow:
    peer: Peer
    envoy: h.Envoy
    rls: RlsProcess | None
    runs: list[b.GatewayRun] = field(default_factory=list)
    rls_stats: dict[str, int] = field(default_factory=dict)  # the ratelimit filter's, over the runs
    unloaded: b.GatewayRun | None = None

    def measure(self, stack: h.Stack, label: str, seconds: int, connections: int, threads: int) -> b.GatewayRun:
        """One wrk run (bench.measured_run), with the rate limit service's CPU time and the filter's stats."""
        pid = self.rls.process.pid if self.rls else 0
        cpu_before = b.cpu_seconds(pid) if pid else 0.0
        stats_before = [self.envoy.stats(filter=RLS_STATS)]
        run = b.measured_run(self.envoy, stack, label, seconds, connections, threads)
        run.cpu["RLS"] = b.cpu_seconds(pid) - cpu_before if pid else 0.0
        for name, value in stat_deltas([self.envoy], stats_before, RLS_STATS).items():
            self.rls_stats[name] = self.rls_stats.get(name, 0) + value
        return run


def run_allowed(stack: h.Stack, limits: Path) -> list[AllowedRow]:
    rlss = {peer.key: RlsProcess(stack, f"rls-{peer.key}", peer.storage, limits) for peer in PEERS_A if peer.kind == "rls"}
    try:
        for rls in rlss.values():
            rls.wait_ready()
        rows = [AllowedRow(peer, gateway(stack, f"envoy-peer-{peer.key}", peer, saturated=False,
                                         concurrency=b.CONCURRENCY, rls=rlss.get(peer.key)), rlss.get(peer.key))
                for peer in PEERS_A]
        for row in rows:
            row.envoy.wait_ready()
        for row in rows:
            progress(f"(9a) warming up {row.peer.key} for {b.WARM_UP_S} s")
            b.run_wrk(row.envoy.port, b.WARM_UP_S, stack.workdir, f"warm-peer-{row.peer.key}")
        for round_index in range(b.ROUNDS):
            for row in rows:
                progress(f"(9a) {row.peer.title}: round {round_index + 1}/{b.ROUNDS}, {b.DURATION} s")
                row.runs.append(row.measure(stack, f"peer-{row.peer.key}-{round_index}", b.DURATION, b.CONNECTIONS,
                                            b.THREADS))
        for row in rows:
            progress(f"(9a) {row.peer.title}: one connection, {UNLOADED_S} s")
            row.unloaded = row.measure(stack, f"peer-{row.peer.key}-unloaded", UNLOADED_S, 1, 1)
        return rows
    finally:
        stack.stop_envoys()
        for rls in rlss.values():
            rls.stop()


CPU_NAMES = ["wrk", "Envoy", "RLS", "webdis", "Redis"]


def per_request(row: AllowedRow) -> dict[str, float]:
    """CPU microseconds per answered request by process, and per request the Redis calls ("calls") and the
    commands Redis ran ("commands"; redis_counts())."""
    requests = sum(b.answers(run)[0] for run in row.runs)
    if not requests:
        return {}
    result = {name: 1e6 * sum(run.cpu.get(name, 0.0) for run in row.runs) / requests for name in CPU_NAMES}
    result["total"] = sum(result[name] for name in CPU_NAMES)
    counts = [redis_counts(run.commands) for run in row.runs]
    result["calls"] = sum(calls for calls, _ in counts) / requests
    result["commands"] = sum(ran for _, ran in counts) / requests
    return result


def print_allowed(rows: list[AllowedRow]) -> None:
    rps = {row.peer.key: b.median(run.wrk.rps for run in row.runs) for row in rows}
    cost = {row.peer.key: per_request(row) for row in rows}
    out(f"(a) Allowed: per-user limit {num(ALLOWED_RATE)} per 1 s (never reached); one Envoy at a time, "
        f"--concurrency {b.CONCURRENCY}, wrk -t{b.THREADS} -c{b.CONNECTIONS} -d{b.DURATION}s, x-user-id over "
        f"{b.USERS} users; every gateway answers 200 itself after the limiter (Envoy's fault filter: the ratelimit "
        "filter calls its service only on a route to a cluster, so no direct_response here, and no upstream is "
        f"reached); medians of {b.ROUNDS} interleaved runs (spread min-max). "
        "local_ratelimit: one bucket of 1,000,000 per 1 s for all requests (it has no per-user key here). "
        "p50 alone: wrk -t1 -c1, one run. Latency in microseconds.")
    ours_rps = rps["ours"]
    rows_out = []
    for row in rows:
        key = row.peer.key
        runs = row.runs
        requests = sum(b.answers(run)[0] for run in runs)
        ok = sum(b.answers(run)[1]["2xx"] for run in runs)
        failed = row.rls_stats.get("ratelimit.error", 0) + row.rls_stats.get("ratelimit.failure_mode_allowed", 0)
        rows_out.append([
            row.peer.title, num(rps[key]), b.spread([run.wrk.rps for run in runs]),
            f"{rps[key] / rps['none']:.2f}", f"{rps[key] / ours_rps:.2f}",
            num(b.median(run.wrk.p50 for run in runs)), num(b.median(run.wrk.p99 for run in runs)),
            num(row.unloaded.wrk.p50) if row.unloaded else "-",
            (f"{100 * ok / requests:.2f}% 2xx" if requests else "none") + (f", {num(failed)} RLS errors" if failed else ""),
        ])
    out(table(["gateway", "req/s", "req/s spread", "vs none", "vs ours", "p50", "p99", "p50 alone", "answers"],
              rows_out))
    out()
    out("CPU time per answered request in microseconds, by process, over the loaded runs (/proc/PID/stat; wrk by "
        "rusage; RLS = erl-peer-rls); per request, the Redis calls (EVALSHA/EVAL: every call either sends is a "
        "script) and the commands Redis ran, the scripts' own included (INFO commandstats).")
    ours = cost["ours"]
    rows_out = []
    for row in rows:
        c = cost[row.peer.key]
        if not c:
            continue
        rows_out.append([row.peer.title] + [f"{c[name]:.1f}" for name in CPU_NAMES]
                        + [f"{c['total']:.1f}", f"{c['total'] / ours['total']:.2f}" if ours else "-",
                           f"{c['calls']:.3f}", f"{c['commands']:.2f}"])
    out(table(["gateway"] + [f"{name} us" for name in CPU_NAMES]
              + ["total us", "total vs ours", "Redis calls/req", "commands/req"], rows_out))
    rls, cached, local = cost.get("rls", {}), cost.get("rls-cached", {}), cost.get("local", {})
    if rls and cached and local and ours:
        out(f"Reading: allowing every request, our filter serves {ours_rps / rps['rls']:.2f}x the req/s of Envoy's "
            f"ratelimit filter with limitador on Redis ({ours['calls']:.2f} vs {rls['calls']:.2f} Redis calls per "
            f"request, {ours['total']:.0f} vs {rls['total']:.0f} us of CPU) and {ours_rps / rps['rls-cached']:.2f}x "
            f"that of limitador's cached storage ({cached['calls']:.3f} Redis calls per request); Envoy's "
            f"local_ratelimit, not shared between gateways, runs at {rps['local'] / rps['none']:.2f}x the "
            f"no-limit baseline.")


# ---------------------------------------------------------------------------------------------------------
# (b) Saturation


@dataclass
class SaturatedRow:
    peer: Peer
    run: b.SaturationRun
    calls: int  # Redis calls during the load (redis_counts())
    commands: int  # commands Redis ran during the load, the scripts' own included
    failed: int  # requests let through because the limiter failed (fail open)


def saturate_peer(stack: h.Stack, envoys: list[h.Envoy], logs: list[Path], label: str
                  ) -> tuple[b.SaturationRun, int, int]:
    """Every gateway loaded at once by its own wrk (1 thread, BENCH_CONNECTIONS), as b.saturate does for our
    filter; the admitted requests are those the access logs hold, as many as Envoy answered 200 (checked)."""
    before = [envoy.stats(filter=b.ENVOY_STATS + "|" + RLS_STATS) for envoy in envoys]
    stack.redis.client.config_resetstat()
    start_ms = int(time.time() * 1000)
    started = [b.start_wrk(envoy.port, SATURATED_S, stack.workdir, f"{label}-{i}", b.CONNECTIONS, 1)
               for i, envoy in enumerate(envoys)]
    results = [b.finish_wrk(run, SATURATED_S) for run in started]
    end_ms = min(int(time.time() * 1000), start_ms + 1000 * SATURATED_S)
    calls, commands = redis_counts(stack.redis.client.info("commandstats"))
    stats = stat_deltas(envoys, before, b.ENVOY_STATS + "|" + RLS_STATS)
    expected = stats.get("downstream_rq_2xx", 0)

    def logged() -> list[int] | None:
        times = sorted(t for log in logs for t in b.read_admitted(log, start_ms))
        return times if len(times) >= expected else None

    admitted = h.wait_until(logged, 5.0, f"({label}) the access logs to hold the {expected} requests answered 200")
    run = b.SaturationRun(admitted, start_ms, end_ms, stats, 0, results, [], [], {})
    return run, calls, commands


def run_saturated(stack: h.Stack, limits: Path) -> list[SaturatedRow]:
    rows = []
    for peer in PEERS_B:
        rlss = [RlsProcess(stack, f"rls-sat-{peer.key}-{i}", peer.storage, limits) for i in range(GATEWAYS)] \
            if peer.kind == "rls" else []
        try:
            for rls in rlss:
                rls.wait_ready()
            logs = [stack.workdir / f"admitted-peer-{peer.key}-{i}.log" for i in range(GATEWAYS)]
            envoys = [gateway(stack, f"envoy-sat-{peer.key}-{i}", peer, saturated=True, concurrency=b.SATURATION_VMS,
                              rls=rlss[i] if rlss else None, admitted_log=logs[i]) for i in range(GATEWAYS)]
            for envoy in envoys:
                envoy.wait_ready()
            progress(f"(9b) {peer.title}: warming up {b.WARM_UP_S} s, then {SATURATED_S} s on {GATEWAYS} gateways "
                     "at once")
            for started in [b.start_wrk(e.port, b.WARM_UP_S, stack.workdir, f"warm-sat-{peer.key}-{i}", b.CONNECTIONS, 1)
                            for i, e in enumerate(envoys)]:
                b.finish_wrk(started, b.WARM_UP_S)
            if peer.kind == "ours":
                run = b.saturate(stack, envoys, logs, f"sat-{peer.key}", SATURATED_S, OURS_PERMITS_KEY)
                calls, commands = redis_counts(stack.redis.client.info("commandstats"))
                failed = run.stat("failure_allowed")
            else:
                run, calls, commands = saturate_peer(stack, envoys, logs, f"sat-{peer.key}")
                failed = run.stat("ratelimit.failure_mode_allowed")
            rows.append(SaturatedRow(peer, run, calls, commands, failed))
        finally:
            stack.stop_envoys()
            for rls in rlss:
                rls.stop()
    return rows


def print_saturated(rows: list[SaturatedRow]) -> None:
    out()
    out(f"(b) Saturation: {GATEWAYS} Envoys x {b.SATURATION_VMS} workers, one global limit of {num(RATE)} per "
        f"{INTERVAL_MS} ms, both gateways loaded at once by their own wrk -t1 -c{b.CONNECTIONS} for {SATURATED_S} s "
        f"after a {b.WARM_UP_S} s warm-up; one run per row. Each ratelimit gateway has its own erl-peer-rls (two "
        "limitador replicas on one Redis); local_ratelimit has a bucket of the rate in each Envoy. Admitted: every "
        "request answered 200, from the access logs (START_TIME, epoch ms; as many as Envoy counted, checked). "
        "Fixed windows: the whole 1-s windows of the clock's grid inside the load; sliding: every 1-s window "
        "starting at an admitted request. Failed open: requests let through because the limiter failed.")

    def demand(run: b.SaturationRun) -> float:
        return sum(r.requests for r in run.wrk) / ((run.end_ms - run.start_ms) / 1000)

    def share(value: float) -> str:
        return f"{num(value)} ({100 * value / RATE:.0f}%)"

    def answered(run: b.SaturationRun) -> int:
        return sum(run.stat(f"downstream_rq_{cls}") for cls in ("2xx", "4xx", "5xx"))

    def per(value: int, count: int) -> float:
        return value / count if count else float("nan")

    ours = next((row for row in rows if row.peer.key == "ours"), None)
    ours_calls = per(ours.calls, len(ours.run.admitted)) if ours else float("nan")
    rows_out = []
    for row in rows:
        run, counts = row.run, row.run.counts()
        most, _ = b.max_in_sliding_window(run.admitted, INTERVAL_MS)
        calls = per(row.calls, len(run.admitted))
        rows_out.append([
            row.peer.title, f"{num(demand(run))} ({demand(run) * INTERVAL_MS / 1000 / RATE:.1f}x)",
            share(min(counts)) if counts else "-", share(statistics.mean(counts)) if counts else "-",
            share(max(counts)) if counts else "-", share(most),
            f"{calls:.3f}", f"{calls / ours_calls:.2f}" if ours_calls > 0 else "-",
            f"{per(row.calls, answered(run)):.3f}", f"{per(row.commands, answered(run)):.2f}", num(row.failed),
        ])
    out(table(["gateways", "demand/s (x rate)", "admitted/window: min", "mean", "max", "worst sliding 1 s",
               "Redis calls/admitted", "vs ours", "calls/answered", "commands/answered", "failed open"], rows_out))
    out("Admitted per fixed window, in order:")
    for row in rows:
        out(f"  {row.peer.key + ':':12} " + " ".join(num(n) for n in row.run.counts()))

    def worst(key: str) -> str:
        row = next((row for row in rows if row.peer.key == key), None)
        if row is None or not row.run.counts():
            return "-"
        counts, most = row.run.counts(), b.max_in_sliding_window(row.run.admitted, INTERVAL_MS)[0]
        low, high = (f"{100 * n / RATE:.0f}" for n in (min(counts), max(counts)))
        return (f"{low if low == high else f'{low}-{high}'}% of the rate per fixed window and "
                f"{100 * most / RATE:.0f}% in the worst sliding window")

    out(f"Reading: beyond the rate on {GATEWAYS} gateways, our filter admitted {worst('ours')} (a sliding window: "
        f"at most the rate but for acquires stamped a few ms apart, see section 6); limitador on Redis "
        f"{worst('rls')}, its cached storage {worst('rls-cached')}: limitador's windows are fixed and start at a "
        "counter's first hit, so the end of one and the start of the next can both fall in one sliding window. "
        f"local_ratelimit, one bucket per gateway, not shared: {worst('local')}.")


# ---------------------------------------------------------------------------------------------------------


def run_peers() -> None:
    """Section 9: Envoy's global rate limit filter with limitador, Envoy's local_ratelimit and no limit, each
    next to our stock build."""
    b.heading("9. Peers: Envoy's ratelimit filter + limitador (RLS over gRPC), local_ratelimit, no limit; "
              "vs our stock build")
    why = rls_unavailable()
    if why:
        out(f"Skipped: {why}.")
        return
    with h.Stack() as stack:
        stack.start()
        limits = stack.workdir / "peer-limits.json"
        limits.write_text(json.dumps(LIMITS, indent=1))
        allowed = run_allowed(stack, limits)
        saturated = run_saturated(stack, limits)
    print_allowed(allowed)
    print_saturated(saturated)
    codes = RlsProcess.exit_codes
    out(f"erl-peer-rls ({locked_versions('limitador', 'envoy-types', 'tonic')}): {len(codes)} processes stopped by SIGTERM, "
        + ("every one exited with code 0." if all(code == 0 for code in codes) else f"exit codes {codes}."))
