"""Section 9 of `make bench` (bench/bench.py): peers, each measured in the same run, with the same limits and
the same wrk load as our stock build, at each load of BENCH_PEER_CONNECTIONS (wrk -c8 and -c32), each load with
its own no-limit baseline.

What a stock Envoy user has for a limit shared by several gateways without our filter: Envoy's native
global rate limit filter (envoy.filters.http.ratelimit) asking a rate limit service over gRPC. Two services,
on the same redis-server as our filter:
- envoyproxy/ratelimit (bench/ratelimit/build.sh builds it from the Go module proxy at a pinned version), the
  service most Envoy and Istio users deploy: fixed windows of the clock, one INCRBY + EXPIRE pipelined per
  request. At its defaults, and at the settings its README recommends (REDIS_PIPELINE_WINDOW, and the local
  cache of over-limit keys, LOCAL_CACHE_SIZE_IN_BYTES): RATELIMIT_RECOMMENDED.
- erl-peer-rls (bench/rls): Kuadrant's limitador crate, the engine of Limitador, behind Envoy's
  RateLimitService API, with limitador's Redis storage (`redis`: the counters read and updated in Redis on
  every request) and its cached Redis storage (`redis_cached`: decided from a local cache, Redis updated in
  batches every second).
Envoy's in-process local_ratelimit (not shared between gateways) is the floor, and Envoy without a limit the
baseline. Our stock build runs in three rows: the rules' default layout (the sliding log, Redisson's), in (b)
again with `clock: "redis"`, and the same rules with `layout: "sliding_window_counter"` (issue 41: one small hash
per limiter), whose Redis CPU per decision and CPU per request each load prints beside the sliding log's and
envoyproxy/ratelimit's.

(a) Allowed: one Envoy at a time (--concurrency BENCH_CONCURRENCY) under wrk -t BENCH_THREADS -c (the load),
    x-user-id over BENCH_USERS users, Envoy answering 200 itself after the limiter, a per-user limit of
    1,000,000 per 1 s that nothing reaches: req/s, p50/p99 (and p50 with one connection), CPU per request
    by process (wrk, Envoy, the rate limit service, webdis, Redis), Redis calls per request (INFO
    commandstats), Redis CPU per decision and what one Redis core decides per second at that cost.
(b) Saturation: 2 Envoys (2 gateways), one global limit of BENCH_LEASE_RATE per 1 s (section 6's settings),
    both loaded at once far beyond it for BENCH_LEASE_SECONDS, each by its own wrk -t1 -c (the load): every
    admitted request's start time from Envoy's access log; admitted per fixed 1-s window of the clock against
    the rate, the most admitted in any sliding 1-s window, Redis calls and Redis CPU per decision, requests
    let through because the limiter failed. limitador: one service process per gateway (two replicas
    sharing Redis); envoyproxy/ratelimit: one service shared by both gateways, as its own example deployment
    runs it (docker-compose-example.yml: one ratelimit for two Envoys).

envoyproxy/ratelimit counts in fixed windows of the clock (its key names the window's start); limitador in
fixed windows that start at a counter's first hit (its Redis key's TTL), not on the clock's grid. Our
filter's limit is a sliding window (Redisson's RRateLimiter). The figures are what each does, side by side.

Every process comes from tests/e2e/harness.py (Envoy, redis-server, webdis, wrk) or is started here through
its Process class (erl-peer-rls, ratelimit) on 127.0.0.1, free ports, stopped by PID (SIGTERM) when its part
of the section ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import string
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench as b  # bench/bench.py: settings, wrk, tables, CPU readers, the saturation tools of section 6
import coalescing_bench as cb  # section 10: the acquires' own stamps of a saturation run
from bench import h, num, out, progress, table

RLS_DIR = b.REPO / "bench" / "rls"
RLS_BIN = Path(os.environ.get("ERL_PEER_RLS_BIN", RLS_DIR / "target" / "release" / "erl-peer-rls"))
RLS_BUILD_STATUS = RLS_DIR / "target" / "build.status"  # written by bench/rls/build.sh (make bench)
RATELIMIT_DIR = b.REPO / "bench" / "ratelimit"
RATELIMIT_BIN = Path(os.environ.get("RATELIMIT_BIN", RATELIMIT_DIR / "target" / "ratelimit"))
RATELIMIT_BUILD_STATUS = RATELIMIT_DIR / "target" / "build.status"  # written by bench/ratelimit/build.sh
RATELIMIT_VERSION = RATELIMIT_DIR / "target" / "ratelimit.version"  # module@version, written by build.sh
RATELIMIT_CONFIG = RATELIMIT_DIR / "config"  # its limits: templates, $domain and $rate filled in here

TIMEOUT_MS = 500  # our filter's Redis timeout and the ratelimit filter's gRPC timeout (Envoy's default: 20 ms)
TIMEOUT = f"{TIMEOUT_MS}ms"
ALLOWED_DOMAIN, SATURATED_DOMAIN = "peer-allowed", "peer-saturated"
ALLOWED_RATE = 1_000_000  # (a): per user per 1 s, never reached
RATE = b.SATURATION_RATE  # (b): the global limit per 1 s
INTERVAL_MS = b.SATURATION_INTERVAL_MS  # 1000: limitador's and envoyproxy/ratelimit's windows are whole seconds
SATURATED_S = b.SATURATION_S
GATEWAYS = 2
UNLOADED_S = 2
# wrk connections of each load (a: one wrk -t BENCH_THREADS; b: one wrk -t1 per gateway), each with its baseline.
LOADS = [int(part) for part in os.environ.get("BENCH_PEER_CONNECTIONS", "8,32").split(",") if part.strip()]

# limitador's limits (bench/rls/src/limits.rs): the same two limits in every rate limit service process.
LIMITS = [
    {"namespace": ALLOWED_DOMAIN, "name": "per-user", "max_value": ALLOWED_RATE, "seconds": 1,
     "variables": ["descriptors[0]['x-user-id']"]},
    {"namespace": SATURATED_DOMAIN, "name": "global", "max_value": RATE, "seconds": INTERVAL_MS // 1000},
]
# envoyproxy/ratelimit's limits: the same two, bench/ratelimit/config/*.yaml filled in.
RATELIMIT_LIMITS = {"peer-allowed.yaml": (ALLOWED_DOMAIN, ALLOWED_RATE), "peer-saturated.yaml": (SATURATED_DOMAIN, RATE)}
# The settings its README recommends for throughput: a write buffer window of 150-500 us ("For optimal
# performance, set REDIS_PIPELINE_WINDOW to 150us-500us"; the low end here) and the local cache of over-limit
# keys (freecache; the README names no size: 1 MiB, the size charts that deploy it set). At its defaults both
# are off (0).
RATELIMIT_RECOMMENDED = (("REDIS_PIPELINE_WINDOW", "150us"), ("LOCAL_CACHE_SIZE_IN_BYTES", "1048576"))
# Our filter's rules with the same limits.
OURS_ALLOWED = h.plugin_config(h.rule("peer-per-user", rate=ALLOWED_RATE, interval="1s"), timeout=TIMEOUT)
OURS_SATURATED = h.plugin_config(h.rule("peer-global", limit_by="global", rate=RATE, interval=f"{INTERVAL_MS}ms"),
                                 timeout=TIMEOUT)
# (b) again with acquires stamped by Redis's clock (`clock: "redis"`): no skew between the gateways' stamps.
OURS_SATURATED_REDIS_CLOCK = {**OURS_SATURATED, "clock": "redis"}
# The same rules with the sliding window counter (issue 41: `layout`, one hash `{name}:counter` per limiter,
# apart from the sliding log's keys of the same name).
COUNTER_LAYOUT = "sliding_window_counter"


def with_layout(plugin: dict, layout: str) -> dict:
    """`plugin` with `layout` in every rule."""
    return {**plugin, "rules": [{**rule, "layout": layout} for rule in plugin["rules"]]}


OURS_COUNTER_ALLOWED = with_layout(OURS_ALLOWED, COUNTER_LAYOUT)
OURS_COUNTER_SATURATED = with_layout(OURS_SATURATED, COUNTER_LAYOUT)
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
# The command of each Redis round trip, by who sends it: a script call (our filter, limitador), or
# envoyproxy/ratelimit's pipeline of INCRBY + EXPIRE per descriptor (one descriptor here: one INCRBY per call;
# the GETs of STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT are off).
SCRIPT_CALLS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script")
RATELIMIT_CALLS = ("cmdstat_incrby",)


@dataclass(frozen=True)
class Peer:
    """One row: how the gateway limits (`kind`: none, local, ours, rls) and, for rls, the rate limit service
    (`service`: limitador or ratelimit) with limitador's storage or envoyproxy/ratelimit's settings (env)."""
    key: str
    title: str
    kind: str
    service: str = ""
    storage: str = ""
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def calls(self) -> tuple[str, ...]:
        """The INFO commandstats names that count this row's Redis round trips."""
        return RATELIMIT_CALLS if self.service == "ratelimit" else SCRIPT_CALLS


NONE = Peer("none", "Envoy, no limit (baseline)", "none")
LOCAL = Peer("local", "Envoy local_ratelimit (in-process)", "local")
OURS = Peer("ours", "our filter, stock build (webdis -> Redis)", "ours")
OURS_REDIS_CLOCK = Peer("ours-redis-clock", "our filter, stock build, clock: \"redis\"", "ours")
OURS_COUNTER = Peer("ours-counter", "our filter, stock build, layout: sliding_window_counter", "ours")
RLS = Peer("rls", "Envoy ratelimit -> limitador, redis storage", "rls", "limitador", "redis")
RLS_CACHED = Peer("rls-cached", "Envoy ratelimit -> limitador, redis_cached", "rls", "limitador", "redis_cached")
RL_DEFAULTS = Peer("ratelimit-defaults", "Envoy ratelimit -> envoyproxy/ratelimit, defaults", "rls", "ratelimit")
RL = Peer("ratelimit", "Envoy ratelimit -> envoyproxy/ratelimit, recommended", "rls", "ratelimit",
          settings=RATELIMIT_RECOMMENDED)
PEERS_A = [NONE, LOCAL, OURS, OURS_COUNTER, RLS, RLS_CACHED, RL_DEFAULTS, RL]
PEERS_B = [OURS, OURS_REDIS_CLOCK, OURS_COUNTER, RLS, RLS_CACHED, RL_DEFAULTS, RL, LOCAL]


# ---------------------------------------------------------------------------------------------------------
# Processes


def locked_versions(*names: str) -> str:
    """"limitador 0.14.0, ..." as bench/rls/Cargo.lock pins them."""
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError):
        packages = tomllib.loads((RLS_DIR / "Cargo.lock").read_text()).get("package", [])
        versions = {package.get("name"): package.get("version") for package in packages}
        return ", ".join(f"{name} {versions.get(name, '?')}" for name in names)
    return "versions unknown"


def ratelimit_version() -> str:
    """"github.com/envoyproxy/ratelimit@v..." as bench/ratelimit/build.sh built it."""
    with contextlib.suppress(OSError):
        return RATELIMIT_VERSION.read_text().strip()
    return "version unknown"


def unavailable(service: str) -> str | None:
    """Why a rate limit service (limitador: erl-peer-rls; ratelimit: envoyproxy/ratelimit) cannot run (None:
    it can): its build script's failure, or no binary."""
    script, status_file, binary = (("bench/ratelimit/build.sh", RATELIMIT_BUILD_STATUS, RATELIMIT_BIN)
                                   if service == "ratelimit" else ("bench/rls/build.sh", RLS_BUILD_STATUS, RLS_BIN))
    status = status_file.read_text().strip() if status_file.is_file() else ""
    if status and status != "ok":
        return f"{script} failed: {status}"
    if not binary.is_file():
        return f"no {binary}: build it with {script} (make bench does)"
    return None


class ServiceProcess:
    """One rate limit service on a free gRPC port of 127.0.0.1, on the stack's redis-server."""

    exit_codes: dict[str, list[int | None]] = {}  # by service, of every process stopped while it ran

    def __init__(self, service: str, name: str, argv: list[str], log: Path, port: int):
        self.service = service
        self.name = name
        self.port = port
        self.log = log
        self.process = h.Process(name, argv, log)

    def ready(self) -> bool:
        """True once the service answers (here: its gRPC port accepts connections)."""
        with socket.create_connection((h.HOST, self.port), timeout=0.5):
            return True

    def wait_ready(self, timeout: float = 10.0) -> None:
        def check() -> bool:
            if not self.process.alive():
                raise h.HarnessError(f"{self.name} exited with code {self.process.returncode}:\n{h.tail(self.log)}")
            return self.ready()

        h.wait_until(check, timeout, f"{self.name} to be ready on {self.port}")

    def stop(self) -> None:
        """SIGTERM (then SIGKILL after 5 s); its exit code is kept in `exit_codes` (0: it shut down cleanly)."""
        if self.process.alive():
            ServiceProcess.exit_codes.setdefault(self.service, []).append(self.process.stop())


def limitador(stack: h.Stack, name: str, storage: str, limits: Path) -> ServiceProcess:
    """erl-peer-rls with limitador's `storage`, the limits file `limits`, BENCH_CONCURRENCY threads."""
    port = h.free_port()
    argv = [str(RLS_BIN), "--port", str(port), "--redis", f"redis://{h.HOST}:{stack.redis.port}",
            "--limits", str(limits), "--storage", storage, "--threads", str(b.CONCURRENCY)]
    return ServiceProcess("limitador", name, argv, stack.workdir / f"{name}.log", port)


class Ratelimit(ServiceProcess):
    """envoyproxy/ratelimit configured by its environment only (`env -i`: nothing else of ours leaks in):
    Redis over TCP, its limits from RUNTIME_ROOT/ratelimit/config (written by write_ratelimit_config), stats
    kept in the process (USE_STATSD=false, as its README's local run), gRPC, HTTP and debug ports free on
    127.0.0.1, and `settings` on top."""

    def __init__(self, stack: h.Stack, name: str, runtime_root: Path, settings: tuple[tuple[str, str], ...]):
        port, self.http_port, self.debug_port = h.free_port(), h.free_port(), h.free_port()
        env = {"USE_STATSD": "false", "LOG_LEVEL": "warn", "REDIS_SOCKET_TYPE": "tcp",
               "REDIS_URL": f"{h.HOST}:{stack.redis.port}", "RUNTIME_ROOT": str(runtime_root),
               "RUNTIME_SUBDIRECTORY": "ratelimit", "RUNTIME_WATCH_ROOT": "false",
               "HOST": h.HOST, "PORT": str(self.http_port), "GRPC_HOST": h.HOST, "GRPC_PORT": str(port),
               "DEBUG_HOST": h.HOST, "DEBUG_PORT": str(self.debug_port), **dict(settings)}
        argv = ["env", "-i", *(f"{key}={value}" for key, value in env.items()), str(RATELIMIT_BIN)]
        super().__init__("ratelimit", name, argv, stack.workdir / f"{name}.log", port)

    def ready(self) -> bool:
        """Its gRPC port accepts connections and its debug endpoint lists both domains' limits."""
        super().ready()
        with urllib.request.urlopen(f"http://{h.HOST}:{self.debug_port}/rlconfig", timeout=1) as response:
            text = response.read().decode(errors="replace")
        return all(f"{domain}." in text for domain, _ in RATELIMIT_LIMITS.values())


def write_ratelimit_config(root: Path) -> Path:
    """bench/ratelimit/config/*.yaml with their $domain and $rate, under `root`/ratelimit/config; `root`."""
    config = root / "ratelimit" / "config"
    config.mkdir(parents=True, exist_ok=True)
    for name, (domain, rate) in RATELIMIT_LIMITS.items():
        template = string.Template((RATELIMIT_CONFIG / name).read_text())
        (config / name).write_text(template.substitute(domain=domain, rate=rate))
    return root


@dataclass
class Setup:
    """What the services of a run read: limitador's limits file, envoyproxy/ratelimit's RUNTIME_ROOT."""
    limits: Path
    runtime_root: Path

    def service(self, stack: h.Stack, name: str, peer: Peer) -> ServiceProcess:
        """A started rate limit service for `peer` (not waited for)."""
        if peer.service == "ratelimit":
            return Ratelimit(stack, name, self.runtime_root, peer.settings)
        return limitador(stack, name, peer.storage, self.limits)


def gateway(stack: h.Stack, name: str, peer: Peer, *, saturated: bool, concurrency: int,
            rls: ServiceProcess | None = None, admitted_log: Path | None = None) -> h.Envoy:
    """An Envoy limiting as `peer` does, with the allowed or the saturated limit, answering 200 itself after
    the limiter (ANSWER_200); with `admitted_log`, logging every admitted request's start time there (as in
    section 6). Started without waiting."""
    ours = peer.kind == "ours"
    plugin = (OURS_SATURATED if saturated else OURS_ALLOWED) if ours else h.plugin_config(h.rule())
    if peer is OURS_REDIS_CLOCK:
        plugin = OURS_SATURATED_REDIS_CLOCK
    elif peer is OURS_COUNTER:
        plugin = OURS_COUNTER_SATURATED if saturated else OURS_COUNTER_ALLOWED
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
    envoy.yaml_path.write_text(b.with_admitted_log(text, admitted_log, ADMITTED_LINE) if admitted_log else text)
    stack.envoys.append(envoy)  # stopped by Stack.close(), whatever happens
    envoy.start(wait_ready=False)
    return envoy


def redis_counts(commands: dict[str, dict[str, Any]], calls_named: tuple[str, ...]) -> tuple[int, int]:
    """(calls, commands) from INFO commandstats: the round trips clients made (counted by `calls_named`, e.g.
    Peer.calls: EVALSHA/EVAL/SCRIPT for our filter and limitador, INCRBY for envoyproxy/ratelimit), and every
    command Redis ran, those the scripts ran included; less the bench's own."""
    calls = sum(int(stats.get("calls", 0)) for name, stats in commands.items() if name.startswith(calls_named))
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


def redis_pid(stack: h.Stack) -> int:
    """The stack's redis-server PID (0 if it is not running)."""
    return stack.redis.process.pid if stack.redis.running and stack.redis.process is not None else 0


def per_decision(redis_us: float) -> str:
    """"12.3 us (81,300/s)": Redis CPU microseconds per decision, and the decisions one Redis core makes per
    second at that cost (1 / the CPU seconds per decision)."""
    if not redis_us or redis_us != redis_us:  # none, or NaN
        return "-"
    return f"{redis_us:.1f} us ({num(1e6 / redis_us)}/s)"


# ---------------------------------------------------------------------------------------------------------
# (a) Allowed


@dataclass
class AllowedRow:
    peer: Peer
    envoy: h.Envoy
    rls: ServiceProcess | None
    runs: list[b.GatewayRun] = field(default_factory=list)
    rls_stats: dict[str, int] = field(default_factory=dict)  # the ratelimit filter's, over the runs
    unloaded: b.GatewayRun | None = None

    def measure(self, stack: h.Stack, label: str, seconds: int, connections: int, threads: int) -> b.GatewayRun:
        """One wrk run (bench.measured_run), with the rate limit service's CPU time (seconds) and the filter's
        stats."""
        pid = self.rls.process.pid if self.rls else 0
        cpu_before = b.cpu_seconds(pid) if pid else 0.0
        stats_before = [self.envoy.stats(filter=RLS_STATS)]
        run = b.measured_run(self.envoy, stack, label, seconds, connections, threads)
        run.cpu["service"] = b.cpu_seconds(pid) - cpu_before if pid else 0.0
        for name, value in stat_deltas([self.envoy], stats_before, RLS_STATS).items():
            self.rls_stats[name] = self.rls_stats.get(name, 0) + value
        return run


def run_allowed(stack: h.Stack, setup: Setup, peers: list[Peer], connections: int) -> list[AllowedRow]:
    """(a) at `connections` wrk connections: every row's gateway started at once, then BENCH_ROUNDS rounds of
    BENCH_DURATION seconds, the rows interleaved in each round, then one connection alone per row."""
    services = {peer.key: setup.service(stack, f"rls-{peer.key}-c{connections}", peer)
                for peer in peers if peer.kind == "rls"}
    threads = min(b.THREADS, connections)
    try:
        for service in services.values():
            service.wait_ready()
        rows = [AllowedRow(peer, gateway(stack, f"envoy-peer-{peer.key}-c{connections}", peer, saturated=False,
                                         concurrency=b.CONCURRENCY, rls=services.get(peer.key)),
                           services.get(peer.key))
                for peer in peers]
        for row in rows:
            row.envoy.wait_ready()
        for row in rows:
            progress(f"(9a -c{connections}) warming up {row.peer.key} for {b.WARM_UP_S} s")
            b.run_wrk(row.envoy.port, b.WARM_UP_S, stack.workdir, f"warm-peer-{row.peer.key}-c{connections}",
                      connections, threads)
        for round_index in range(b.ROUNDS):
            for row in rows:
                progress(f"(9a -c{connections}) {row.peer.title}: round {round_index + 1}/{b.ROUNDS}, {b.DURATION} s")
                row.runs.append(row.measure(stack, f"peer-{row.peer.key}-c{connections}-{round_index}", b.DURATION,
                                            connections, threads))
        for row in rows:
            progress(f"(9a -c{connections}) {row.peer.title}: one connection, {UNLOADED_S} s")
            row.unloaded = row.measure(stack, f"peer-{row.peer.key}-c{connections}-unloaded", UNLOADED_S, 1, 1)
        return rows
    finally:
        stack.stop_envoys()
        for service in services.values():
            service.stop()


CPU_NAMES = ["wrk", "Envoy", "service", "webdis", "Redis"]


def per_request(row: AllowedRow) -> dict[str, float]:
    """CPU microseconds per answered request by process, and per request the Redis calls ("calls": round
    trips) and the commands Redis ran ("commands"; redis_counts())."""
    requests = sum(b.answers(run)[0] for run in row.runs)
    if not requests:
        return {}
    result = {name: 1e6 * sum(run.cpu.get(name, 0.0) for run in row.runs) / requests for name in CPU_NAMES}
    result["total"] = sum(result[name] for name in CPU_NAMES)
    counts = [redis_counts(run.commands, row.peer.calls) for run in row.runs]
    result["calls"] = sum(calls for calls, _ in counts) / requests
    result["commands"] = sum(ran for _, ran in counts) / requests
    return result


EXACTNESS_TARGET = 1.01  # issue 29: our worst sliding window in (b), at most this times the rate
# (b)'s access log, a line per admitted request: its start (epoch ms) and, us after it, when its answer's first
# byte left (the fault filter answers as soon as the limiter lets the request on: when it was admitted).
ADMITTED_LINE = "%START_TIME(%s%3f)% %COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:us)%"


def admission_times(logs: list[Path], since_ms: int) -> list[int]:
    """When each admitted request of `logs` (ADMITTED_LINE) from `since_ms` on was let through, epoch ms:
    its start plus the wait until its answer began, sorted."""
    times = []
    for path in logs:
        with contextlib.suppress(FileNotFoundError):
            for line in path.read_text().splitlines():
                start, _, waited = line.partition(" ")
                if start.isdigit() and waited.isdigit() and int(start) >= since_ms:
                    times.append(round(int(start) + int(waited) / 1000))
    return sorted(times)
CPU_TARGET = 0.75  # issue 29: our CPU per allowed request, at most this times the cheaper of the two peers'


def print_allowed(rows: list[AllowedRow], connections: int) -> None:
    """(a)'s tables at `connections`: req/s, latency (us), CPU per request by process (us), Redis calls and
    CPU per decision; the reading and issue 29's CPU target."""
    threads = min(b.THREADS, connections)
    rps = {row.peer.key: b.median(run.wrk.rps for run in row.runs) for row in rows}
    cost = {row.peer.key: per_request(row) for row in rows}
    out(f"(a) Allowed, wrk -c{connections}: per-user limit {num(ALLOWED_RATE)} per 1 s (never reached); one Envoy "
        f"at a time, --concurrency {b.CONCURRENCY}, wrk -t{threads} -c{connections} -d{b.DURATION}s, x-user-id over "
        f"{b.USERS} users; every gateway answers 200 itself after the limiter (Envoy's fault filter: the ratelimit "
        "filter calls its service only on a route to a cluster, so no direct_response here, and no upstream is "
        f"reached); medians of {b.ROUNDS} interleaved runs (spread min-max). "
        "local_ratelimit: one bucket of 1,000,000 per 1 s for all requests (it has no per-user key here). "
        "p50 alone: wrk -t1 -c1, one run. Latency in microseconds.")
    ours_rps = rps.get("ours", float("nan"))
    rows_out = []
    for row in rows:
        key = row.peer.key
        runs = row.runs
        requests = sum(b.answers(run)[0] for run in runs)
        ok = sum(b.answers(run)[1]["2xx"] for run in runs)
        failed = row.rls_stats.get("ratelimit.error", 0) + row.rls_stats.get("ratelimit.failure_mode_allowed", 0)
        rows_out.append([
            row.peer.title, num(rps[key]), b.spread([run.wrk.rps for run in runs]),
            f"{rps[key] / rps['none']:.2f}" if "none" in rps else "-", f"{rps[key] / ours_rps:.2f}",
            num(b.median(run.wrk.p50 for run in runs)), num(b.median(run.wrk.p99 for run in runs)),
            num(row.unloaded.wrk.p50) if row.unloaded else "-",
            (f"{100 * ok / requests:.2f}% 2xx" if requests else "none") + (f", {num(failed)} RLS errors" if failed else ""),
        ])
    out(table(["gateway", "req/s", "req/s spread", "vs none", "vs ours", "p50", "p99", "p50 alone", "answers"],
              rows_out))
    out()
    out("CPU time per answered request in microseconds, by process, over the loaded runs (/proc/PID/stat; wrk by "
        "rusage; service = the rate limit service: erl-peer-rls or ratelimit); per request, the Redis calls "
        "(round trips: EVALSHA/EVAL, every call our filter or limitador sends is a script; envoyproxy/ratelimit's "
        "INCRBY + EXPIRE pipelined, one call) and the commands Redis ran, the scripts' own included (INFO "
        "commandstats). Redis CPU per decision (each request is one) and what one Redis core decides per second "
        "at that cost: what a fleet of gateways shares.")
    ours = cost.get("ours", {})
    rows_out = []
    for row in rows:
        c = cost[row.peer.key]
        if not c:
            continue
        decides = per_decision(c["Redis"]) if row.peer.kind in ("ours", "rls") else "-"
        rows_out.append([row.peer.title] + [f"{c[name]:.1f}" for name in CPU_NAMES]
                        + [f"{c['total']:.1f}", f"{c['total'] / ours['total']:.2f}" if ours else "-",
                           f"{c['calls']:.3f}", f"{c['commands']:.2f}", decides])
    out(table(["gateway"] + [f"{name} us" for name in CPU_NAMES]
              + ["total us", "total vs ours", "Redis calls/req", "commands/req", "Redis CPU/decision (1 core)"],
              rows_out))
    counter = cost.get("ours-counter", {})
    if ours and counter:
        def gateway_us(c: dict[str, float]) -> str:
            return f"{c['total'] - c['wrk']:.0f} us ({c['total']:.0f} with wrk)"
        out(f"Layout (issue 41), allowed at -c{connections}: Redis CPU per decision, sliding window counter "
            f"{counter['Redis']:.1f} us ({counter['commands']:.2f} commands/req) vs sliding log {ours['Redis']:.1f} us "
            f"({ours['commands']:.2f})"
            + (f" vs envoyproxy/ratelimit recommended {rl_cost['Redis']:.1f} us ({rl_cost['commands']:.2f})"
               if (rl_cost := cost.get("ratelimit", {})) else "")
            + f"; CPU per request without wrk: counter {gateway_us(counter)}, sliding log {gateway_us(ours)}"
            + (f", envoyproxy/ratelimit recommended {gateway_us(rl_cost)}" if rl_cost else "") + ".")
    for row in rows:  # a service that decides in Redis on every request, and did not, measured nothing
        c = cost[row.peer.key]
        if row.peer.kind == "rls" and row.peer.storage != "redis_cached" and c and c["calls"] < 0.5:
            out(f"WARNING: {row.peer.title}: {c['calls']:.3f} Redis calls per request: its service did not apply "
                "the limit to every request (see its log in the bench's work directory).")
    rls, cached, local, rl = (cost.get(key, {}) for key in ("rls", "rls-cached", "local", "ratelimit"))
    if rls and cached and local and ours:
        out(f"Reading: allowing every request, our filter serves {ours_rps / rps['rls']:.2f}x the req/s of Envoy's "
            f"ratelimit filter with limitador on Redis ({ours['calls']:.2f} vs {rls['calls']:.2f} Redis calls per "
            f"request, {ours['total']:.0f} vs {rls['total']:.0f} us of CPU) and {ours_rps / rps['rls-cached']:.2f}x "
            f"that of limitador's cached storage ({cached['calls']:.3f} Redis calls per request); Envoy's "
            f"local_ratelimit, not shared between gateways, runs at {rps['local'] / rps['none']:.2f}x the "
            f"no-limit baseline.")
    if ours and rl and rls:
        cheaper_key, cheaper = min((("ratelimit", rl), ("rls", rls)), key=lambda pair: pair[1]["total"])
        ratio = ours["total"] / cheaper["total"]
        verdict = "met" if ratio <= CPU_TARGET else f"not met, by {ratio / CPU_TARGET - 1:.0%}"
        out(f"Target: our CPU per allowed request at most {CPU_TARGET}x the cheaper of envoyproxy/ratelimit "
            f"(recommended settings, {rl['total']:.0f} us) and limitador's redis storage ({rls['total']:.0f} us): "
            f"{ours['total']:.0f} us, {ratio:.2f}x {'envoyproxy/ratelimit' if cheaper_key == 'ratelimit' else 'limitador'}"
            f"'s: {verdict}. Without wrk: {ours['total'] - ours['wrk']:.0f} vs "
            f"{cheaper['total'] - cheaper['wrk']:.0f} us, "
            f"{(ours['total'] - ours['wrk']) / (cheaper['total'] - cheaper['wrk']):.2f}x. envoyproxy/ratelimit at "
            f"{rl['total']:.0f} us serves {rps['ratelimit'] / ours_rps:.2f}x our req/s.")


# ---------------------------------------------------------------------------------------------------------
# (b) Saturation


@dataclass
class SaturatedRow:
    peer: Peer
    run: b.SaturationRun
    calls: int  # Redis calls during the load (redis_counts())
    commands: int  # commands Redis ran during the load, the scripts' own included
    failed: int  # requests let through because the limiter failed (fail open)
    redis_cpu: float  # Redis CPU seconds during the load
    services: int  # rate limit service processes
    admitted_at: list[int]  # when each admitted request was let through (admission_times()), epoch ms


def saturate_peer(stack: h.Stack, envoys: list[h.Envoy], logs: list[Path], label: str, connections: int
                  ) -> tuple[b.SaturationRun, dict[str, dict[str, Any]]]:
    """Every gateway loaded at once by its own wrk (1 thread, `connections`), as b.saturate does for our
    filter; the admitted requests are those the access logs hold, as many as Envoy answered 200 (checked).
    Also INFO commandstats over the load."""
    before = [envoy.stats(filter=b.ENVOY_STATS + "|" + RLS_STATS) for envoy in envoys]
    stack.redis.client.config_resetstat()
    start_ms = int(time.time() * 1000)
    started = [b.start_wrk(envoy.port, SATURATED_S, stack.workdir, f"{label}-{i}", connections, 1)
               for i, envoy in enumerate(envoys)]
    results = [b.finish_wrk(run, SATURATED_S) for run in started]
    end_ms = min(int(time.time() * 1000), start_ms + 1000 * SATURATED_S)
    commands = stack.redis.client.info("commandstats")
    stats = stat_deltas(envoys, before, b.ENVOY_STATS + "|" + RLS_STATS)
    expected = stats.get("downstream_rq_2xx", 0)

    def logged() -> list[int] | None:
        times = sorted(t for log in logs for t in b.read_admitted(log, start_ms))
        return times if len(times) >= expected else None

    admitted = h.wait_until(logged, 5.0, f"({label}) the access logs to hold the {expected} requests answered 200")
    return b.SaturationRun(admitted, start_ms, end_ms, stats, 0, results, [], [], {}), commands


def run_saturated(stack: h.Stack, setup: Setup, peers: list[Peer], connections: int) -> list[SaturatedRow]:
    """(b) at `connections` wrk connections per gateway, one row after the other."""
    rows = []
    for peer in peers:
        # limitador: one service per gateway; envoyproxy/ratelimit: one shared by both (see the docstring).
        count = 0 if peer.kind != "rls" else (1 if peer.service == "ratelimit" else GATEWAYS)
        services = [setup.service(stack, f"rls-sat-{peer.key}-c{connections}-{i}", peer) for i in range(count)]
        try:
            for service in services:
                service.wait_ready()
            logs = [stack.workdir / f"admitted-peer-{peer.key}-c{connections}-{i}.log" for i in range(GATEWAYS)]
            envoys = [gateway(stack, f"envoy-sat-{peer.key}-c{connections}-{i}", peer, saturated=True,
                              concurrency=b.SATURATION_VMS, rls=services[i % count] if services else None,
                              admitted_log=logs[i]) for i in range(GATEWAYS)]
            for envoy in envoys:
                envoy.wait_ready()
            progress(f"(9b -c{connections}) {peer.title}: warming up {b.WARM_UP_S} s, then {SATURATED_S} s on "
                     f"{GATEWAYS} gateways at once")
            for started in [b.start_wrk(e.port, b.WARM_UP_S, stack.workdir, f"warm-sat-{peer.key}-c{connections}-{i}",
                                        connections, 1) for i, e in enumerate(envoys)]:
                b.finish_wrk(started, b.WARM_UP_S)
            pid = redis_pid(stack)
            redis_before = b.cpu_seconds(pid)
            label = f"sat-{peer.key}-c{connections}"
            if peer.kind == "ours":
                # The sampler reads the sliding log's permit members; a counter keeps none. Requests in flight
                # when wrk stops make the allowed counter and the logs differ by a few (as in section 10 (c);
                # print_saturated reports the difference).
                permits_key = "" if peer is OURS_COUNTER else OURS_PERMITS_KEY
                run = b.saturate(stack, envoys, logs, label, SATURATED_S, permits_key, connections,
                                 slack=GATEWAYS * connections)
                commands = stack.redis.client.info("commandstats")
                failed = run.stat("failure_allowed")
            else:
                run, commands = saturate_peer(stack, envoys, logs, label, connections)
                failed = run.stat("ratelimit.failure_mode_allowed")
            redis_cpu = b.cpu_seconds(pid) - redis_before
            calls, ran = redis_counts(commands, peer.calls)
            admitted_at = admission_times(logs, run.start_ms)
            rows.append(SaturatedRow(peer, run, calls, ran, failed, redis_cpu, len(services), admitted_at))
        finally:
            stack.stop_envoys()
            for service in services:
                service.stop()
    return rows


def print_saturated(rows: list[SaturatedRow], connections: int) -> None:
    """(b)'s table at `connections`: admitted per fixed and sliding 1-s window against the rate, Redis calls
    and Redis CPU (us) per decision, failed open; the admitted counts window by window, and the reading."""
    out()
    out(f"(b) Saturation, wrk -c{connections} per gateway: {GATEWAYS} Envoys x {b.SATURATION_VMS} workers, one "
        f"global limit of {num(RATE)} per {INTERVAL_MS} ms, both gateways loaded at once by their own wrk -t1 "
        f"-c{connections} for {SATURATED_S} s after a {b.WARM_UP_S} s warm-up; one run per row. Each limitador "
        "gateway has its own erl-peer-rls (two limitador replicas on one Redis); both envoyproxy/ratelimit "
        "gateways share one ratelimit (its example deployment); local_ratelimit has a bucket of the rate in each "
        "Envoy. Admitted: every request answered 200, from the access logs (START_TIME, epoch ms; as many as "
        "Envoy counted, checked), and when each was let through (START_TIME plus "
        "%COMMON_DURATION(DS_RX_BEG:DS_TX_BEG)%: Envoy's fault filter answers as soon as the limiter lets the "
        "request on; a request that waited for its limiter, a batch or a gRPC answer, is admitted after its "
        "start). Fixed windows: the whole 1-s windows of the clock's grid inside the load, by start time; "
        "sliding: every 1-s window starting at an admitted request, by start time and by admission time (the "
        "limiter's promise: at most the rate admitted in any window). Decisions: requests answered (200 or 429); "
        "Redis CPU per decision over the load (our filter's row includes the bench's ZRANGE sampler of section "
        "6). Failed open: requests let through because the limiter failed.")

    def demand(run: b.SaturationRun) -> float:
        return sum(r.requests for r in run.wrk) / ((run.end_ms - run.start_ms) / 1000)

    def share(value: float) -> str:
        return f"{num(value)} ({100 * value / RATE:.0f}%)"

    def answered(run: b.SaturationRun) -> int:
        return sum(run.stat(f"downstream_rq_{cls}") for cls in ("2xx", "4xx", "5xx"))

    def per(value: float, count: int) -> float:
        return value / count if count else float("nan")

    ours = next((row for row in rows if row.peer.key == "ours"), None)
    ours_calls = per(ours.calls, len(ours.run.admitted)) if ours else float("nan")
    rows_out = []
    for row in rows:
        run, counts = row.run, row.run.counts()
        most, _ = b.max_in_sliding_window(run.admitted, INTERVAL_MS)
        most_admitted, _ = b.max_in_sliding_window(row.admitted_at, INTERVAL_MS)
        calls = per(row.calls, len(run.admitted))
        rows_out.append([
            row.peer.title, f"{num(demand(run))} ({demand(run) * INTERVAL_MS / 1000 / RATE:.1f}x)",
            share(min(counts)) if counts else "-", share(statistics.mean(counts)) if counts else "-",
            share(max(counts)) if counts else "-", share(most), share(most_admitted),
            f"{calls:.3f}", f"{calls / ours_calls:.2f}" if ours_calls > 0 else "-",
            f"{per(row.calls, answered(run)):.3f}", f"{per(row.commands, answered(run)):.2f}",
            per_decision(1e6 * per(row.redis_cpu, answered(run))) if row.commands else "-", num(row.failed),
        ])
    out(table(["gateways", "demand/s (x rate)", "admitted/window: min", "mean", "max", "worst sliding 1 s",
               "by admission time",
               "Redis calls/admitted", "vs ours", "calls/answered", "commands/answered",
               "Redis CPU/decision (1 core)", "failed open"], rows_out))
    out("Admitted per fixed window, in order:")
    for row in rows:
        out(f"  {row.peer.key + ':':20} " + " ".join(num(n) for n in row.run.counts()))

    def worst(key: str) -> str:
        row = next((row for row in rows if row.peer.key == key), None)
        if row is None or not row.run.counts():
            return "-"
        counts, most = row.run.counts(), b.max_in_sliding_window(row.admitted_at, INTERVAL_MS)[0]
        low, high = (f"{100 * n / RATE:.0f}" for n in (min(counts), max(counts)))
        return (f"{low if low == high else f'{low}-{high}'}% of the rate per fixed window and "
                f"{100 * most / RATE:.0f}% in the worst sliding window by admission time")

    for ours_row in (row for row in rows if row.peer.kind == "ours" and row.run.admitted):
        by_log = b.max_in_sliding_window(ours_row.run.admitted, INTERVAL_MS)[0]
        by_admission = b.max_in_sliding_window(ours_row.admitted_at, INTERVAL_MS)[0]
        stamped = cb.stamps(ours_row.run)
        by_stamp = b.max_in_sliding_window(stamped, INTERVAL_MS)[0] if stamped else 0
        margin = b.margin_needed(ours_row.run.admitted, RATE, INTERVAL_MS)
        worst_share = max(by_admission, by_stamp) / RATE
        verdict = "met" if worst_share <= EXACTNESS_TARGET else f"not met, by {worst_share / EXACTNESS_TARGET - 1:.1%}"
        by_stamps = (f"{num(by_stamp)} ({100 * by_stamp / RATE:.1f}%) by the acquires' own stamps (the scores of the "
                     f"{num(len(stamped))} permit members the sampler saw in Redis)" if ours_row.peer is not OURS_COUNTER
                     else "no stamps (a counter keeps no member per admission)")
        out(f"Target (b), {ours_row.peer.title}: our worst sliding 1-s window at most {EXACTNESS_TARGET}x the rate, "
            f"judged by when requests were admitted: {num(by_admission)} ({100 * by_admission / RATE:.1f}%) by the "
            f"access logs' admission times, {by_stamps}: {verdict}. By "
            f"start times (a request admitted after it waited counts at its arrival): {num(by_log)} "
            f"({100 * by_log / RATE:.1f}%); the rate holds in every window "
            f"{'> 50 ms' if margin is None else f'{margin} ms'} narrower."
            + (f" The access logs hold {num(len(ours_row.run.admitted))} admitted requests, the filter counted "
               f"{num(ours_row.run.stat('allowed'))} allowed (requests in flight when wrk stopped)."
               if len(ours_row.run.admitted) != ours_row.run.stat("allowed") else ""))
    counter = next((row for row in rows if row.peer is OURS_COUNTER), None)
    if ours and counter:
        cpu = {row.peer.key: 1e6 * per(row.redis_cpu, answered(row.run)) for row in rows}
        out(f"Layout (issue 41), saturated: Redis CPU per decision, sliding window counter {cpu['ours-counter']:.1f} us "
            f"vs sliding log {cpu['ours']:.1f} us"
            + (f" vs envoyproxy/ratelimit recommended {cpu['ratelimit']:.1f} us" if "ratelimit" in cpu else "")
            + f"; the counter admitted {worst('ours-counter')}.")
    out(f"Reading: beyond the rate on {GATEWAYS} gateways, our filter admitted {worst('ours')} (a sliding window: "
        f"at most the rate but for acquires stamped a few ms apart, see section 6); envoyproxy/ratelimit "
        f"{worst('ratelimit')} (its defaults: {worst('ratelimit-defaults')}): fixed windows of the clock, one atomic "
        f"INCRBY each; limitador on Redis {worst('rls')}, its cached storage {worst('rls-cached')}: limitador's "
        "windows are fixed and start at a counter's first hit, so the end of one and the start of the next can both "
        f"fall in one sliding window. local_ratelimit, one bucket per gateway, not shared: {worst('local')}.")


# ---------------------------------------------------------------------------------------------------------


def run_peers() -> None:
    """Section 9: Envoy's global rate limit filter with envoyproxy/ratelimit and with limitador, Envoy's
    local_ratelimit and no limit, each next to our stock build, at each load of LOADS."""
    b.heading("9. Peers: Envoy's ratelimit filter + envoyproxy/ratelimit or limitador (RLS over gRPC), "
              "local_ratelimit, no limit; vs our stock build")
    missing = {service: why for service in ("ratelimit", "limitador") if (why := unavailable(service))}
    for service, why in missing.items():
        out(f"Skipped: the {service} rows ({why}).")
    peers_a = [peer for peer in PEERS_A if peer.service not in missing]
    peers_b = [peer for peer in PEERS_B if peer.service not in missing]
    started = time.monotonic()
    with h.Stack() as stack:
        stack.start()
        limits = stack.workdir / "peer-limits.json"
        limits.write_text(json.dumps(LIMITS, indent=1))
        setup = Setup(limits, write_ratelimit_config(stack.workdir / "ratelimit-runtime"))
        for connections in LOADS:
            allowed = run_allowed(stack, setup, peers_a, connections)
            saturated = run_saturated(stack, setup, peers_b, connections)
            out()
            out(f"Load wrk -c{connections} (load average {os.getloadavg()[0]:.2f}):")
            print_allowed(allowed, connections)
            print_saturated(saturated, connections)
    out()
    settings = " ".join(f"{key}={value}" for key, value in RATELIMIT_RECOMMENDED)
    out(f"envoyproxy/ratelimit ({ratelimit_version()}), recommended: {settings}; defaults: both 0 (off).")
    out(f"erl-peer-rls ({locked_versions('limitador', 'envoy-types', 'tonic')}).")
    for service, codes in ServiceProcess.exit_codes.items():
        out(f"{service}: {len(codes)} processes stopped by SIGTERM, "
            + ("every one exited with code 0." if all(code == 0 for code in codes) else f"exit codes {codes}."))
    out(f"Section 9 took {time.monotonic() - started:.0f} s.")
