#!/usr/bin/env python3
"""`make bench`: what the filter costs, each figure printed next to a baseline measured in the same run.

1. Gateway overhead: the same Envoy (envoy/envoy.yaml, the route answering with `direct_response` so no
   Python upstream is measured) without the wasm filter (baseline) and with it: (b) every request allowed,
   (c) every request rejected by Redis (local block off), (d) failing open with Redis stopped, (e) a rule
   that never applies (the filter without a Redis call), (f) every request of a blocked key rejected by the
   local block, (g) Envoy's native local_ratelimit filter instead, rejecting every request (the in-process
   floor), (h) an attack: most requests from a few blocked keys, the rest from users who are allowed. Load
   from wrk on 127.0.0.1; then the same with one connection (latency without queueing; (a), (b) and (e) in
   interleaved rounds), the CPU time per request of each process (wrk, Envoy, webdis, Redis), and the local
   block's targets; (i) = (b) with `histograms: false`: what recording the histograms costs, and the pause
   histogram's p50 against the latency a client at one connection sees added.
2. Redis cost per decision: the filter's ACQUIRE script (src/script/lua/acquire.lua) against Redisson 4.x's
   tryAcquire (bench/redisson4_tryacquire.lua, the baseline; 3.x's as a reference row) on the same
   redis-server from the same client, in the allowed and the rejected regime, with a small and a large
   window, in time and (under valgrind's callgrind, when installed) in instructions; and the cost of one
   call that releases a whole window of permits, as the window grows.
3. Redis round trips per allowed and per rejected request, counted by Redis during the runs of 1, next
   to the ideal (1); the checked claim that the benchmarked ACQUIRE is the script the filter runs.
4. Module size: dist/*.wasm next to the size budget of wasm-tools.toml and the size targets, with and
   without the name section, and what each crate costs (twiggy).
5. Guest cost per decision (wasmtime fuel in the host emulator) of both builds: allowed, rejected by Redis,
   rejected by the local block, each over the no-rule baseline and next to its target.
6. Leases: a rule with `lease: {max_permits: 64, max_age: 50ms}` against the same rule without one (the
   baseline), in stock Envoy. (a) A hot global limiter below its rate (1,000,000/1 s), one Envoy under wrk
   as in 1: req/s and Redis calls per allowed request (target: at most 1/16 of the baseline's). (b)
   Saturation: 2 Envoys x 2 VMs on one Redis, one global limiter of BENCH_LEASE_RATE per 1 s, both loaded at
   once, far beyond the rate: every admitted request's time (Envoy's access log), admitted per fixed 1-s
   window against the rate (target >= 95% with the lease), the most admitted in any sliding 1-s window
   (at most the rate, within a few ms), Redis calls per allowed request (target: at most 1/16 of the
   baseline's), leases granted and the permits a lease uses, window by window.
7. Redis Cluster (bench/cluster_bench.py): the stock build through webdis -> Envoy's redis_proxy on a 1- and
   a 3-master cluster vs one redis-server (baseline): decisions/s and CPU per decision of Redis and the
   proxy; the limiters' spread over slots and masters; failover of both builds vs the proxy on Envoy's
   default refresh settings.
8. Reliability (bench/reliability_bench.py): faults between the gateway and Redis (the fault proxy's modes,
   Redis stopped, paused, out of memory, asking for a password, SCRIPT FLUSH) under load in both builds, as
   tests/e2e/test_faults.py runs them but longer: worst added latency against a no-fault baseline, recovery
   after Redis is healthy again, failure mode held, requests counted, traps.
9. Peers (bench/peer_bench.py): Envoy's native global rate limit filter with envoyproxy/ratelimit
   (bench/ratelimit, at its defaults and at its README's recommended settings) and with a rate limit service
   on Kuadrant's limitador crate (bench/rls, its Redis storage and its cached Redis storage) on the same Redis,
   Envoy's local_ratelimit (the in-process floor) and Envoy without a limit, each next to our stock build, at
   each load of BENCH_PEER_CONNECTIONS with its own baseline: (a) every request allowed, req/s, latency, CPU
   per request by process, Redis calls per request, Redis CPU per decision; (b) 2 gateways saturating one
   global limit (6's rate and length): admitted per window against the rate, Redis CPU per decision.
10. Request coalescing (bench/coalescing_bench.py): the filter's defaults (a VM's waiting acquire calls go out
   together in one ACQUIRE_BATCH call) against `redis: {max_batch: 1}` (coalescing off, the baseline) and
   Envoy without the filter: (a) every request allowed, BENCH_COALESCING_CONNECTIONS connections, 512
   users: req/s, Redis script calls and CPU per request by process, p50/p99, mean batch size, next to the
   targets; (b) one connection: p50/p99; (c) exactness, 2 Envoys x 2 workers far beyond one global limit
   (6's rate and length) and 64 per-user limits: admitted per window, the worst sliding window of the
   global limit and of any user's, Redis calls per admitted request; (d) guest fuel and Redis calls per
   request of the Higress build in the host emulator, 32 requests at once.
11. Token budgets (bench/cost_bench.py): a rule's `cost`, each request reserving its max_tokens and settled to
   the usage its response reports, against charge-after (`"reserve": 1`, the baseline): (a) 16 clients
   against one budget through a real LLM-like upstream: tokens per window (members' acquire-time scores and
   settled sizes, from Redis) against the budget, requests admitted; (b) CPU per request by process of
   settling by usage vs fixed permits (Envoy answering itself with a chat completion body, wrk); (c) guest
   fuel per request of each body format in the host emulator.
12. In-flight rules (bench/inflight_bench.py): CPU per request of a per-user in-flight rule (`max_in_flight`)
   against a per-user rate rule and Envoy without the filter, at wrk -c8 and -c32, in the same run.
13. Redis state per key (bench/state_bench.py): (a) MEMORY USAGE of one limiter's keys after N = 100, 10,000
   and 1,000,000 admissions in one window of 1 day, for the sliding log (a rule's default `layout`), the
   sliding window counter (`layout: "sliding_window_counter"`) and envoyproxy/ratelimit's layout (INCRBY +
   EXPIRE of one key per descriptor and window), the keys checked against the stock build in Envoy; (b)
   SLOWLOG at 1,000 us while a 1-day window fills with 1,000,000 permits, as the window moves past them, and
   when a burst is released at once, for both layouts.

Every process (redis-server, webdis, Envoys, wrk) is started by tests/e2e/harness.py on 127.0.0.1 with
free ports and stopped by its PID, also on Ctrl-C or SIGTERM. Figures vary from run to run (the machine,
other load); repeated measurements print their spread (min-max).

Settings (environment variables, defaults in brackets): BENCH_DURATION seconds per wrk run [4],
BENCH_ROUNDS wrk runs per scenario and chunks per script measurement [3], BENCH_CONNECTIONS [8],
BENCH_THREADS wrk threads [2], BENCH_CONCURRENCY Envoy workers [2], BENCH_USERS distinct x-user-id
values [64], BENCH_N script calls per script and case [20000], BENCH_LEASE_RATE the saturated limiter's
permits per second in 6 [1000], BENCH_LEASE_SECONDS its load [7], BENCH_CLUSTER_USERS the users of 7 [10000],
BENCH_FAULT_SECONDS each fault of 8 and the load after it [3], BENCH_COALESCING_CONNECTIONS wrk connections
per gateway in 10 [32], BENCH_PEER_CONNECTIONS the wrk connections of each load of 9 [8,32], BENCH_COST_CLIENTS, BENCH_COST_SECONDS and BENCH_COST_BUDGET of 11 (a) [16, 8, 10000],
BENCH_ONLY sections to run, e.g. "2,4" [1,2,3,4,5,6,7,8,9,10,11,12,13; 3 needs 1], BENCH_INFLIGHT_CONNECTIONS the wrk loads of 12 [8,32].
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import platform
import re
import resource
import signal
import socket
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import harness as h  # noqa: E402  (tests/e2e/harness.py: processes on free ports, stopped by PID)
from redisson_client import OVERALL, RateLimiter  # noqa: E402  (tests/e2e: Redisson's scripts, for operators)
import redis as redis_py  # noqa: E402


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        sys.exit(f"bench: {name}={value!r} is not a whole number")
    if number < 1:
        sys.exit(f"bench: {name} must be at least 1")
    return number


DURATION = _env_int("BENCH_DURATION", 4)
ROUNDS = _env_int("BENCH_ROUNDS", 3)
CONNECTIONS = _env_int("BENCH_CONNECTIONS", 8)
THREADS = min(_env_int("BENCH_THREADS", 2), CONNECTIONS)
CONCURRENCY = _env_int("BENCH_CONCURRENCY", 2)
USERS = _env_int("BENCH_USERS", 64)
N_CALLS = _env_int("BENCH_N", 20_000)
ONLY = {part.strip() for part in os.environ.get("BENCH_ONLY", "1,2,3,4,5,6,7,8,9,10,11,12,13").split(",")
        if part.strip()}

WRK = os.environ.get("WRK_BIN", "wrk")
WRK_SCRIPT = REPO / "bench" / "users.lua"
REDISSON4_LUA = REPO / "bench" / "redisson4_tryacquire.lua"
REDISSON3_LUA = REPO / "bench" / "redisson3_tryacquire.lua"
# Redis instructions per call are counted (callgrind) over this many calls per script and case.
N_INSTRUCTIONS = _env_int("BENCH_N_INSTRUCTIONS", 300)
LUA_DIR = REPO / "src" / "script" / "lua"
WARM_UP_S = 1
BURST_REPEATS = 5

# Redisson's trySetRate of the same generation as each tryAcquire: run once per limiter.
REDISSON3_TRY_SET_RATE = (
    "redis.call('hsetnx', KEYS[1], 'rate', ARGV[1]);"
    "redis.call('hsetnx', KEYS[1], 'interval', ARGV[2]);"
    "return redis.call('hsetnx', KEYS[1], 'type', ARGV[3]);"
)
REDISSON4_TRY_SET_RATE = (
    "redis.call('hsetnx', KEYS[1], 'rate', ARGV[1]);"
    "redis.call('hsetnx', KEYS[1], 'interval', ARGV[2]);"
    "redis.call('hsetnx', KEYS[1], 'keepAliveTime', ARGV[4]);"
    "local res = redis.call('hsetnx', KEYS[1], 'type', ARGV[3]);"
    "if res == 1 and tonumber(ARGV[4]) > 0 then redis.call('pexpire', KEYS[1], ARGV[4]); end;"
    "return res;"
)
# The filter's default keepAliveTime (docs/configuration.md: "1h", or the interval if longer).
DEFAULT_KEEP_ALIVE_MS = 3_600_000
CLIENT_ID = "bench-client"


def progress(message: str) -> None:
    """One line on stderr: what runs now (the tables go to stdout)."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


def out(text: str = "") -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Formatting


def table(headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    """A plain-text table: the first `left` columns left-aligned, the others right-aligned."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in [headers] + cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [cell.ljust(width) if i < left else cell.rjust(width)
                 for i, (cell, width) in enumerate(zip(row, widths))]
        return "  ".join(parts).rstrip()

    rule_line = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule_line] + [line(row) for row in cells])


def num(value: float, digits: int = 0) -> str:
    """Thousands separated by commas: 21,345 / 1,234.5."""
    return f"{value:,.{digits}f}"


def signed(value: float) -> str:
    """+1,234 / -9: a difference to a baseline."""
    return f"{value:+,.0f}"


def spread(values: list[float], digits: int = 0) -> str:
    if len(values) < 2:
        return "-"
    return f"{num(min(values), digits)}-{num(max(values), digits)}"


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(p / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


def heading(title: str) -> None:
    out()
    out(title)
    out("=" * len(title))


# ---------------------------------------------------------------------------------------------------------
# Machine and versions


def _first_line(argv: list[str]) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unavailable ({error})"
    text = (result.stdout or result.stderr).strip()
    return text.splitlines()[0] if text else "unavailable"


def machine_header() -> None:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = "unknown"
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    envoy = _first_line([h.ENVOY_BIN, "--version"])
    envoy_match = re.search(r"/(\d+\.\d+\.\d+)/", envoy)
    redis_version = _first_line([h.REDIS_BIN, "--version"])
    redis_match = re.search(r"v=(\S+)", redis_version)
    webdis = _first_line(["dpkg-query", "-W", "-f", "${Version}", "webdis"])
    wrk = _first_line([WRK, "-v"])
    git = _first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    load = os.getloadavg()
    heading("edge-rate-limiter benchmarks (make bench)")
    out(f"machine   {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {cpu}, {memory} RAM, "
        f"Linux {platform.release()}")
    out(f"versions  Envoy {envoy_match.group(1) if envoy_match else envoy}, "
        f"redis-server {redis_match.group(1) if redis_match else redis_version}, webdis {webdis}, "
        f"{wrk.split(' Copyright')[0]}, Python {platform.python_version()}, redis-py {redis_py.__version__}")
    out(f"source    git {git}{' (uncommitted changes)' if dirty else ''}, "
        f"filter {h.WASM.relative_to(REPO) if h.WASM.is_relative_to(REPO) else h.WASM}")
    out(f"load      load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start "
        f"(everything below shares these CPUs: load generator, Envoy, webdis, Redis, and any other work)")
    out(f"settings  wrk {DURATION} s x {ROUNDS} rounds per scenario, {CONNECTIONS} connections, {THREADS} "
        f"threads, {USERS} users; Envoy --concurrency {CONCURRENCY}; {num(N_CALLS)} script calls per case")
    out("Figures vary from run to run (several processes share few CPUs); repeated runs show their spread "
        "(min-max).")


# ---------------------------------------------------------------------------------------------------------
# 1 + 3: the gateway under wrk


ROUTE = "route: { cluster: upstream }"
DIRECT_RESPONSE = 'direct_response: { status: 200, body: { inline_string: "upstream ok\\n" } }'
WASM_FILTER_START = "          - name: envoy.filters.http.wasm\n"
ROUTER_FILTER_START = "          - name: envoy.filters.http.router\n"


# Envoy's own in-process limiter, rejecting every request once its one token is gone: the floor of what a
# rejection can cost in this Envoy (envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit).
NATIVE_LOCAL_RATELIMIT = """\
          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: native_local_rate_limit
              token_bucket: { max_tokens: 1, tokens_per_fill: 1, fill_interval: 3600s }
              filter_enabled:
                runtime_key: native_local_rate_limit_enabled
                default_value: { numerator: 100, denominator: HUNDRED }
              filter_enforced:
                runtime_key: native_local_rate_limit_enforced
                default_value: { numerator: 100, denominator: HUNDRED }
"""


def bench_envoy_yaml(rendered: str, filters: str) -> str:
    """envoy/envoy.yaml as the harness renders it, the route answering itself (`direct_response`), with
    `filters` "wasm" (as rendered), "none" (the baseline) or "local_ratelimit" (Envoy's native filter in
    place of the wasm filter): everything else identical."""
    if rendered.count(ROUTE) != 1 or WASM_FILTER_START not in rendered or ROUTER_FILTER_START not in rendered:
        raise h.HarnessError("envoy/envoy.yaml changed shape: update bench_envoy_yaml() in bench/bench.py")
    text = rendered.replace(ROUTE, DIRECT_RESPONSE)
    if filters != "wasm":
        start, end = text.index(WASM_FILTER_START), text.index(ROUTER_FILTER_START)
        text = text[:start] + (NATIVE_LOCAL_RATELIMIT if filters == "local_ratelimit" else "") + text[end:]
    return text


@dataclass(frozen=True)
class Attack:
    """Part of the load from a few attacking keys (x-user-id: attacker<N>), the rest from the users."""
    keys: int
    percent: int


@dataclass
class WrkResult:
    requests: int
    duration_us: int
    errors: dict[str, int]
    p50: int
    p90: int
    p99: int

    @property
    def rps(self) -> float:
        return self.requests / (self.duration_us / 1e6)

    @property
    def socket_errors(self) -> int:
        return sum(self.errors[name] for name in ("connect", "read", "write", "timeout"))


def run_wrk(port: int, seconds: int, workdir: Path, label: str, connections: int = CONNECTIONS,
            threads: int = THREADS, attack: Attack | None = None) -> WrkResult:
    """wrk against 127.0.0.1:port for `seconds`, started and stopped by PID through the harness; with
    `attack`, that share of the requests comes from the attacking keys (bench/users.lua)."""
    return finish_wrk(start_wrk(port, seconds, workdir, label, connections, threads, attack), seconds)


def start_wrk(port: int, seconds: int, workdir: Path, label: str, connections: int = CONNECTIONS,
              threads: int = THREADS, attack: Attack | None = None) -> tuple[h.Process, Path]:
    """Starts wrk (see `run_wrk`) without waiting for it: `finish_wrk` waits and reads its result."""
    output = workdir / f"wrk-{label}.out"
    output.unlink(missing_ok=True)
    argv = [WRK, "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s", "--timeout", "5s",
            "-s", str(WRK_SCRIPT), f"http://{h.HOST}:{port}/"]
    os.environ["BENCH_ATTACKERS"] = str(attack.keys if attack else 0)  # read by bench/users.lua
    os.environ["BENCH_ATTACK_PERCENT"] = str(attack.percent if attack else 0)
    return h.Process("wrk", argv, output), output


def finish_wrk(started: tuple[h.Process, Path], seconds: int) -> WrkResult:
    process, output = started
    code = process.wait(seconds + 30)
    process.stop()
    text = output.read_text(errors="replace")
    match = re.search(r"^BENCH (\{.*\})$", text, re.M)
    if code != 0 or match is None:
        raise h.HarnessError(f"wrk failed (exit {code}):\n{text[-2000:]}")
    data = json.loads(match.group(1))
    errors = {name: data[name] for name in ("connect", "read", "write", "status", "timeout")}
    return WrkResult(data["requests"], data["duration_us"], errors, data["p50"], data["p90"], data["p99"])


ENVOY_STATS = r"^(http\.ingress_http\.downstream_rq_(completed|2xx|4xx|5xx)|wasmcustom\..*)$"


def rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, all threads (0 if it is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def machine_cpu_seconds() -> float:
    """CPU time every CPU of the machine spent busy (all processes, from /proc/stat)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    return 0.0


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class GatewayRun:
    wrk: WrkResult
    envoy: dict[str, int]  # deltas of ENVOY_STATS, short names
    commands: dict[str, dict[str, float]]  # INFO commandstats during the run ({} if Redis is down)
    rss_kib: int
    cpu: dict[str, float]  # CPU seconds used during the run: wrk, Envoy, webdis, Redis; "machine": all

    def stat(self, name: str) -> int:
        return self.envoy.get(name, 0)


def _short(name: str) -> str:
    return name.removeprefix("http.ingress_http.").removeprefix(h.METRIC_PREFIX)


def measured_run(envoy: h.Envoy, stack: h.Stack, label: str, seconds: int = DURATION,
                 connections: int = CONNECTIONS, threads: int = THREADS, attack: Attack | None = None
                 ) -> GatewayRun:
    redis = stack.redis
    pids = {"Envoy": envoy.process.pid if envoy.process is not None else 0,
            "webdis": stack.webdis.process.pid if stack.webdis.process is not None else 0,
            "Redis": redis.process.pid if redis.running and redis.process is not None else 0}
    before = envoy.stats(filter=ENVOY_STATS)
    if redis.running:
        redis.client.config_resetstat()
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    wrk_before, machine_before = children_cpu_seconds(), machine_cpu_seconds()
    # run_wrk reaps wrk: its CPU time is in RUSAGE_CHILDREN then.
    result = run_wrk(envoy.port, seconds, stack.workdir, label, connections, threads, attack)
    cpu = {"wrk": children_cpu_seconds() - wrk_before, "machine": machine_cpu_seconds() - machine_before}
    cpu.update({name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()})
    after = envoy.stats(filter=ENVOY_STATS)
    commands = redis.client.info("commandstats") if redis.running else {}
    deltas = {_short(name): after[name] - before.get(name, 0) for name in after}
    return GatewayRun(result, deltas, commands, rss_kib(pids["Envoy"]), cpu)


@dataclass
class Scenario:
    key: str
    title: str
    expect: str  # "2xx" or "4xx": the answer every request must get
    envoy: h.Envoy | None = None
    runs: list[GatewayRun] = field(default_factory=list)
    unloaded: GatewayRun | None = None  # one connection: latency without queueing
    unloaded_p50s: list[float] = field(default_factory=list)  # p50 of each run at one connection
    # (b): the filter's pause histogram during its runs at one connection: cumulative count by bound (us)
    unloaded_paused: dict[float, float] | None = None
    filters: str = "wasm"  # bench_envoy_yaml(): "wasm", "none" or "local_ratelimit"
    attack: Attack | None = None


PRELUDE_MARK, FUNCTION_MARK = "--@prelude", "--@function "  # build.rs's markers


def prelude_function(prelude: str, name: str) -> str:
    """Prelude function `name` as build.rs's `prelude_function` cuts it: from its `local function name(`
    line up to the first `end` at column 0 (ending "\\nend")."""
    start = prelude.find(f"local function {name}(")
    end = prelude.find("\nend\n", start) if start >= 0 else -1
    if end < 0:
        raise h.HarnessError(f"src/script/lua/prelude.lua has no function {name} (build.rs would fail too)")
    return prelude[start:end + 4]


def acquire_source() -> str:
    """The ACQUIRE script exactly as build.rs builds it from src/script/lua/: "-- edge-rate-limiter acquire",
    the body with the prelude at its `--@prelude` line and one prelude function at each `--@function <name>`
    line (or the prelude before a body with neither), without comment lines, blank lines and indentation
    (checked against the script the filter makes Redis run, by SHA, in sections 1 and 6)."""
    prelude = (LUA_DIR / "prelude.lua").read_text()
    body = (LUA_DIR / "acquire.lua").read_text()

    def expand(line: str) -> str:
        mark = line.strip()
        if mark == PRELUDE_MARK:
            return prelude
        if mark.startswith(FUNCTION_MARK):
            return prelude_function(prelude, mark.removeprefix(FUNCTION_MARK).strip())
        return line

    marked = any(line.strip() == PRELUDE_MARK or line.strip().startswith(FUNCTION_MARK) for line in body.splitlines())
    text = "\n".join(expand(line) for line in body.splitlines()) if marked else f"{prelude}\n{body}"
    lines = (line.strip() for line in text.splitlines())
    return "-- edge-rate-limiter acquire\n" + "".join(f"{line}\n" for line in lines if line and not line.startswith("--"))


def sha1_hex(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


UNLOADED_S = 4
UNLOADED_ROUNDS = 3  # (a), (b) and (e) at one connection, interleaved


# (h): 90% of the load from 4 attacking keys, the rest from the users. The rule allows 100,000 per hour per
# key, which no user comes near; an operator has set the attackers' limiters to 1 per hour beforehand (in
# Redis, Redisson's trySetRate: Redis's rate wins with the default rate_source), so each is blocked after its
# first request.
ATTACK = Attack(keys=4, percent=90)


def run_gateway(stack: h.Stack) -> tuple[list[Scenario], str]:
    """Section 1's runs (3 reads them too). Returns the scenarios and a line on the script check."""
    timeout = "500ms"
    configs = {
        "a": None,
        "b": h.plugin_config(h.rule("allowed", rate=1_000_000, interval="1s"), timeout=timeout),
        # (b) without the histograms (`histograms: false`): what recording them costs, run right after (b).
        "i": h.plugin_config(h.rule("allowed", rate=1_000_000, interval="1s"), timeout=timeout, histograms=False),
        "c": h.plugin_config(h.rule("rejected", rate=1, interval="1h", local_block_max=0), timeout=timeout),
        # The rule's key is a header wrk never sends: the filter runs on every request, calls nothing.
        "e": h.plugin_config(h.rule("skipped", limit_by={"header": "x-absent"}, rate=1, interval="1h"),
                             timeout=timeout),
        # One limiter for every request, blocked after its one permit (local_block_max at its default).
        "f": h.plugin_config(h.rule("blocked", limit_by="global", rate=1, interval="1h"), timeout=timeout),
        "g": None,
        "h": h.plugin_config(h.rule("per-user", rate=100_000, interval="1h"), timeout=timeout),
    }
    scenarios = {
        "a": Scenario("a", "baseline: no wasm filter", "2xx", filters="none"),
        "b": Scenario("b", "filter, every request allowed (1,000,000/1 s)", "2xx"),
        "i": Scenario("i", "(b) with histograms: false", "2xx"),
        "c": Scenario("c", "filter, every request rejected by Redis (1/1 h, local block off)", "4xx"),
        "d": Scenario("d", "filter failing open, Redis stopped", "2xx"),
        "e": Scenario("e", "filter, rule skipped: no Redis call", "2xx"),
        "f": Scenario("f", "filter, every request of a blocked key rejected locally (1/1 h, global)", "4xx"),
        "g": Scenario("g", "Envoy's native local_ratelimit, every request rejected", "4xx",
                      filters="local_ratelimit"),
        "h": Scenario("h", f"attack: {ATTACK.percent}% from {ATTACK.keys} blocked keys, the rest allowed users",
                      "mix", attack=ATTACK),
    }
    progress(f"starting redis-server, webdis and {len(configs)} Envoys (--concurrency {CONCURRENCY})")
    for key, plugin in configs.items():
        envoy = h.Envoy(stack.workdir, plugin or h.plugin_config(h.rule()), webdis_port=stack.webdis.port,
                        upstream_port=stack.upstream.port, concurrency=CONCURRENCY, name=f"envoy-{key}")
        envoy.yaml_path.write_text(bench_envoy_yaml(envoy.yaml_path.read_text(), scenarios[key].filters))
        stack.envoys.append(envoy)  # stopped by Stack.close(), whatever happens
        envoy.start(wait_ready=False)
        scenarios[key].envoy = envoy
    for key in configs:
        scenarios[key].envoy.wait_ready()  # type: ignore[union-attr]
    scenarios["d"].envoy = scenarios["b"].envoy

    # (c) rejects from the second request of each user on: one allowed request per user first; (f) and (g)
    # from the second request.
    rejecting = scenarios["c"].envoy
    assert rejecting is not None
    for user in range(USERS):
        status = rejecting.send(headers={"x-user-id": f"u{user}"}).status
        if status != 200:
            raise h.HarnessError(f"(c): the first request of u{user} got {status}, not 200")
    for key in "fg":
        status = scenarios[key].envoy.send().status  # type: ignore[union-attr]
        if status != 200:
            raise h.HarnessError(f"({key}): the first request got {status}, not 200")
    for attacker in range(ATTACK.keys):
        RateLimiter(stack.redis.client, f"erl:per-user:attacker{attacker}").try_set_rate(OVERALL, 1, 3_600_000)
    for key in configs:
        progress(f"warming up ({key}) for {WARM_UP_S} s")
        run_wrk(scenarios[key].envoy.port, WARM_UP_S, stack.workdir, f"warm-{key}",  # type: ignore[union-attr]
                attack=scenarios[key].attack)

    def unloaded(key: str, round_index: int = 0) -> None:
        scenario = scenarios[key]
        assert scenario.envoy is not None
        progress(f"({key}) {scenario.title}: one connection, {UNLOADED_S} s")
        scenario.unloaded = measured_run(scenario.envoy, stack, f"{key}-unloaded-{round_index}", UNLOADED_S, 1, 1,
                                         scenario.attack)
        scenario.unloaded_p50s.append(scenario.unloaded.wrk.p50)

    for round_index in range(ROUNDS):
        for key in configs:
            scenario = scenarios[key]
            assert scenario.envoy is not None
            progress(f"({key}) {scenario.title}: round {round_index + 1}/{ROUNDS}, {DURATION} s")
            scenario.runs.append(measured_run(scenario.envoy, stack, f"{key}-{round_index}", attack=scenario.attack))
    # (a), (b) and (e) at one connection in interleaved rounds (the added latency the pause histogram is
    # checked against); the pause histogram of (b)'s rounds alone: Envoy merges its workers' histograms when
    # it flushes stats (every 5 s), so it is read a flush after the last load and a flush after the rounds.
    time.sleep(STATS_FLUSH_S)
    paused_before = paused_buckets(scenarios["b"].envoy)  # type: ignore[arg-type]
    for round_index in range(UNLOADED_ROUNDS):
        for key in "abe":
            unloaded(key, round_index)
    time.sleep(STATS_FLUSH_S)
    paused_after = paused_buckets(scenarios["b"].envoy)  # type: ignore[arg-type]
    scenarios["b"].unloaded_paused = {le: paused_after[le] - paused_before.get(le, 0) for le in paused_after}
    for key in configs:
        if key not in "abe":
            unloaded(key)

    # The script benchmarked in section 2 must be the one the filter runs.
    sha = sha1_hex(acquire_source())
    if not stack.redis.client.script_exists(sha)[0]:
        raise h.HarnessError(f"Redis has no script {sha}: the ACQUIRE built from src/script/lua/ is not the "
                             f"script {h.WASM.name} runs (rebuild: make build)")
    check = f"the filter's script in Redis has the SHA-1 of ACQUIRE from src/script/lua/ ({sha[:12]})"

    progress("stopping redis-server for (d)")
    stack.redis.stop()
    failing = scenarios["d"].envoy
    run_wrk(failing.port, WARM_UP_S, stack.workdir, "warm-d")
    for round_index in range(ROUNDS):
        progress(f"(d) {scenarios['d'].title}: round {round_index + 1}/{ROUNDS}, {DURATION} s")
        scenarios["d"].runs.append(measured_run(failing, stack, f"d-{round_index}"))
    unloaded("d")
    return [scenarios[key] for key in "abcdefghi"], check


STATS_FLUSH_S = 6  # Envoy's stats_flush_interval (5 s by default) and a margin


def paused_buckets(envoy: h.Envoy) -> dict[float, float]:
    """The filter's pause histogram (`edge_rate_limiter_paused_us`, every outcome) from Envoy's
    /stats/prometheus, parsed by Prometheus's own text parser: cumulative count by bucket bound (us)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = h.http_request(envoy.admin_port, "/stats/prometheus", timeout=10.0)
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(response.body):
        for sample in family.samples:
            if sample.name == "edge_rate_limiter_paused_us_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """The q-quantile of a histogram's cumulative buckets, interpolated within its bucket as Prometheus's
    `histogram_quantile` does (nan when empty)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower


def answers(run: GatewayRun) -> tuple[int, dict[str, int]]:
    classes = {cls: run.stat(f"downstream_rq_{cls}") for cls in ("2xx", "4xx", "5xx")}
    return sum(classes.values()), classes


def _answers_cell(s: Scenario, runs: list[GatewayRun]) -> str:
    total = sum(answers(r)[0] for r in runs)
    socket_errors = sum(r.wrk.socket_errors for r in runs)
    if not total:
        cell = "none"
    elif s.expect == "mix":
        cell = ", ".join(f"{100 * sum(answers(r)[1][cls] for r in runs) / total:.1f}% {cls}" for cls in ("2xx", "4xx"))
    else:
        cell = f"{100 * sum(answers(r)[1][s.expect] for r in runs) / total:.2f}% {s.expect}"
    return cell + (f", {socket_errors} socket errors" if socket_errors else "")


def print_gateway(scenarios: list[Scenario]) -> None:
    by_key = {s.key: s for s in scenarios}
    heading("1. Gateway overhead: the same Envoy with and without the filter")
    out(f"wrk -t{THREADS} -c{CONNECTIONS} -d{DURATION}s on 127.0.0.1, x-user-id cycling over {USERS} users; Envoy "
        f"--concurrency {CONCURRENCY}; the route answers itself (direct_response 200), so no upstream is measured.")
    out(f"Medians of {ROUNDS} runs per scenario (all but d interleaved; d after them, Redis stopped); spread = "
        "min-max over the runs. Latency in microseconds, closed loop: with every CPU busy it is mostly queueing.")
    out(f"(f) and (g) reject every request after the first; (h) sends {ATTACK.percent}% of its requests with "
        f"x-user-id attacker0..{ATTACK.keys - 1}, whose limiters an operator set to 1/1 h, and the rest with the "
        "users', rule 100,000/1 h per user.")
    rows = []
    for s in scenarios:
        runs = s.runs
        rows.append([
            f"({s.key}) {s.title}",
            num(median(r.wrk.rps for r in runs)),
            spread([r.wrk.rps for r in runs]),
            num(median(r.wrk.p50 for r in runs)),
            spread([r.wrk.p50 for r in runs]),
            num(median(r.wrk.p90 for r in runs)),
            num(median(r.wrk.p99 for r in runs)),
            _answers_cell(s, runs),
            f"{median(r.rss_kib for r in runs) / 1024:.0f} MiB",
        ])
    out(table(["scenario", "req/s", "req/s spread", "p50", "p50 spread", "p90", "p99", "answers",
               "Envoy RSS"], rows))

    def med(s: Scenario, name: str) -> float:
        if name == "rps":
            return median(r.wrk.rps for r in s.runs)
        return median(getattr(r.wrk, name) for r in s.runs)

    base = by_key["a"]

    def delta(key: str) -> str:
        s = by_key[key]
        return (f"{signed(med(s, 'p50') - med(base, 'p50'))} us at p50 ({100 * med(s, 'rps') / med(base, 'rps'):.0f}% "
                f"of the baseline's req/s)")

    out(f"Reading: at {CONNECTIONS} connections the filter adds, allowing, {delta('b')}; rejecting through Redis, "
        f"{delta('c')}; rejecting a blocked key locally, {delta('f')}; failing open, {delta('d')}; with no Redis "
        f"call (e), {delta('e')}. Envoy's own local_ratelimit: {delta('g')}.")

    out()
    out("Targets of the local block (issue \"Shed load at the edge\"), from the runs above:")
    f, g, c, hh = by_key["f"], by_key["g"], by_key["c"], by_key["h"]
    f_requests, hh_requests = sum(answers(r)[0] for r in f.runs), sum(answers(r)[0] for r in hh.runs)
    f_scripts, hh_scripts = scripts_run(f), scripts_run(hh)
    hh_allowed = sum(r.stat("allowed") for r in hh.runs)
    hh_rejected = sum(r.stat("rejected") for r in hh.runs)
    hh_local = sum(r.stat("local_rejected") for r in hh.runs)
    ratio = med(f, "rps") / med(g, "rps")
    f_calls = f_scripts / f_requests if f_requests else float("nan")
    hh_calls = (hh_scripts - hh_allowed) / hh_rejected if hh_rejected else float("nan")
    rows = [
        ["(f) / (g) req/s: locally rejected vs Envoy's native local_ratelimit", f"{ratio:.2f}", ">= 0.75",
         "yes" if ratio >= 0.75 else "NO"],
        ["(f) Redis calls per locally rejected request (one key under attack)",
         f"{f_calls:.5f} ({num(f_scripts)} in {num(f_requests)})", "<= 0.01", "yes" if f_calls <= 0.01 else "NO"],
        ["(f) / (c) req/s: a rejection without vs with a Redis call", f"{med(f, 'rps') / med(c, 'rps'):.1f}x", "-", "-"],
        ["(h) Redis calls per rejected attack request", f"{hh_calls:.5f} ({num(hh_local)} of {num(hh_rejected)} "
         "rejected locally)", "<= 0.01", "yes" if hh_calls <= 0.01 else "NO"],
        ["(h) requests allowed (the users' share of the load)",
         f"{100 * hh_allowed / hh_requests:.1f}% ({100 - ATTACK.percent}%)" if hh_requests else "-", "-", "-"],
    ]
    out(table(["measure", "measured", "target", "met"], rows))

    out()
    out(f"The same Envoys with one connection (wrk -t1 -c1 -d{UNLOADED_S}s; (a), (b) and (e) {UNLOADED_ROUNDS} "
        "interleaved runs, p50 their median, the rest one run; the other columns from the last run): the latency "
        "of one request without queueing. One run: differences of a few tens of us are noise on a shared machine.")
    rows = []
    for s in scenarios:
        run = s.unloaded
        if run is None:
            continue
        rows.append([f"({s.key}) {s.title}", num(run.wrk.rps), num(median(s.unloaded_p50s)), num(run.wrk.p90),
                     num(run.wrk.p99), _answers_cell(s, [run])])
    out(table(["scenario", "req/s", "p50", "p90", "p99", "answers"], rows))
    if all(by_key[key].unloaded is not None for key in "abce"):
        p50 = {key: median(by_key[key].unloaded_p50s) for key in "abcde" if by_key[key].unloaded}
        out(f"Reading: alone, a request through the filter takes {signed(p50['b'] - p50['a'])} us at p50 when allowed "
            f"and {signed(p50['c'] - p50['a'])} us when rejected; the filter without a Redis call "
            f"{signed(p50['e'] - p50['a'])} us: nearly all of it is the round trip Envoy -> webdis -> Redis -> back.")
    print_histograms(by_key)

    out()
    out("Where the CPU goes: CPU time per answered request in microseconds, by process, over the runs at "
        f"{CONNECTIONS} connections (/proc/PID/stat; wrk by rusage). CPUs busy: ours = these processes, "
        "machine = every process (the difference is other work on the machine).")
    names = ["wrk", "Envoy", "webdis", "Redis"]
    rows = []
    per_request: dict[str, dict[str, float]] = {}
    for s in scenarios:
        requests = sum(answers(r)[0] for r in s.runs)
        seconds = sum(r.wrk.duration_us for r in s.runs) / 1e6
        used = {name: sum(r.cpu.get(name, 0.0) for r in s.runs) for name in names}
        machine = sum(r.cpu.get("machine", 0.0) for r in s.runs)
        per_request[s.key] = {name: 1e6 * value / requests for name, value in used.items()} if requests else {}
        rows.append([f"({s.key}) {s.title}"]
                    + [f"{per_request[s.key].get(name, 0):.1f}" for name in names]
                    + [f"{sum(per_request[s.key].values()):.1f}",
                       f"{sum(used.values()) / seconds:.2f}" if seconds else "-",
                       f"{machine / seconds:.2f}" if seconds else "-"])
    out(table(["scenario"] + [f"{name} us" for name in names] + ["total us", "CPUs busy: ours", "machine"], rows))
    a, b, e = per_request["a"], per_request["b"], per_request["e"]
    out(f"Reading: an allowed request costs {signed(sum(b.values()) - sum(a.values()))} us of CPU over the "
        f"baseline: Envoy {b.get('Envoy', 0) - a.get('Envoy', 0):+.0f} us (of which "
        f"{e.get('Envoy', 0) - a.get('Envoy', 0):+.0f} us without a Redis call), webdis {b.get('webdis', 0):.0f} us, "
        f"Redis {b.get('Redis', 0):.0f} us, wrk {b.get('wrk', 0) - a.get('wrk', 0):+.0f} us; with the CPUs "
        "saturated, req/s follow the total.")


HISTOGRAM_COST_TARGET = 0.03  # of (b)'s req/s, against (i) without histograms
HISTOGRAM_ACCURACY_TARGET = 0.10  # of the added latency a client measures at one connection


def print_histograms(by_key: dict[str, Scenario]) -> None:
    """The histograms' targets: what recording them costs ((b) against (i), round by round: the two run back
    to back in each round), and how well the pause histogram's p50 tells the latency a client sees added."""
    b, i, a = by_key["b"], by_key["i"], by_key["a"]
    ratios = [rb.wrk.rps / ri.wrk.rps for rb, ri in zip(b.runs, i.runs) if ri.wrk.rps]
    cost = 1 - median(ratios)

    def cpu(s: Scenario) -> float:
        requests = sum(answers(r)[0] for r in s.runs)
        used = sum(r.cpu.get(name, 0.0) for r in s.runs for name in ("Envoy", "webdis", "Redis", "wrk"))
        return 1e6 * used / requests if requests else float("nan")

    rows = [["(b) / (i) req/s, round by round: recording the histograms vs not",
             f"{', '.join(f'{r:.3f}' for r in ratios)}; median {median(ratios):.3f} (cost {100 * cost:+.1f}%)",
             f"cost <= {100 * HISTOGRAM_COST_TARGET:.0f}%", "yes" if cost <= HISTOGRAM_COST_TARGET else "NO"],
            ["(b) - (i) CPU per request, all processes", f"{cpu(b) - cpu(i):+.1f} us", "-", "-"]]
    e = by_key["e"]
    if b.unloaded is not None and a.unloaded is not None and e.unloaded is not None and b.unloaded_paused:
        recorded = histogram_quantile(0.5, b.unloaded_paused)
        requests = num(b.unloaded_paused.get(float("inf"), 0))
        for over, label, target in ((a, "the no-filter baseline (a)", True),
                                    (e, "the filter without a Redis call (e): the pause alone", False)):
            client = median(b.unloaded_p50s) - median(over.unloaded_p50s)
            error = abs(recorded - client) / client if client > 0 else float("nan")
            rows.append([f"(b) alone: p50 of edge_rate_limiter_paused_us (histogram_quantile of its buckets) vs "
                         f"what wrk -c1 sees added over {label} (medians of {UNLOADED_ROUNDS} interleaved runs' p50)",
                         f"{recorded:.0f} us vs {client:.0f} us ({requests} requests): {100 * error:.1f}% apart",
                         f"<= {100 * HISTOGRAM_ACCURACY_TARGET:.0f}%" if target else "-",
                         ("yes" if error <= HISTOGRAM_ACCURACY_TARGET else "NO") if target else "-"])
    out()
    out("Histograms (docs/operating.md, \"Histograms\"): their cost and the accuracy of the added latency they report.")
    out(table(["measure", "measured", "target", "met"], rows))


def scripts_run(s: Scenario) -> int:
    """EVALSHA + EVAL calls Redis counted during a scenario's runs (INFO commandstats)."""
    return sum(r.commands.get(name, {}).get("calls", 0) for r in s.runs for name in ("cmdstat_evalsha", "cmdstat_eval"))


def print_round_trips(scenarios: list[Scenario], check: str) -> None:
    heading("3. Redis round trips per request, counted by Redis through Envoy")
    out("During the runs of section 1: EVALSHA+EVAL calls in Redis's INFO commandstats / requests Envoy "
        "answered; the filter's own redis_calls counter / its decisions.")
    rows = []
    ideal = {"b": "1", "c": "1", "e": "0", "f": "0", "h": f"{(100 - ATTACK.percent) / 100:.1f}"}
    for s in [x for x in scenarios if x.key in ideal]:
        requests = sum(answers(r)[0] for r in s.runs)
        scripts = scripts_run(s)
        evals = sum(r.commands.get("cmdstat_eval", {}).get("calls", 0) for r in s.runs)
        usec = sum(r.commands.get(name, {}).get("usec", 0) for r in s.runs
                   for name in ("cmdstat_evalsha", "cmdstat_eval"))
        decisions = sum(r.stat("allowed") + r.stat("rejected") for r in s.runs)
        calls = sum(r.stat("redis_calls") for r in s.runs)
        kind = {"b": "every request allowed", "c": "every request rejected by Redis", "e": "rule skipped (no key)",
                "f": "every request of a blocked key", "h": "attack on 4 keys, users allowed"}[s.key]
        rows.append([
            f"({s.key}) {kind}",
            num(requests),
            num(scripts) + (f" ({evals} EVAL)" if evals else ""),
            f"{scripts / requests:.3f}" if requests else "-",
            ideal[s.key],
            f"{calls / decisions:.3f}" if decisions else "-",
            f"{usec / scripts:.1f}" if scripts else "-",
        ])
    out(table(["scenario", "requests", "scripts run", "per request", "ideal", "filter calls/decision",
               "Redis us/script"], rows))
    per_request = {row[0][1]: row[3] for row in rows}
    out(f"Reading: {per_request.get('b', '-')} round trips per allowed request and {per_request.get('c', '-')} per "
        f"request rejected by Redis against the ideal 1, {per_request.get('f', '-')} per request of a blocked key, "
        f"{per_request.get('e', '-')} when no rule applies; Redis us/script "
        f"is under the load of section 1 (compare section 2, alone). Checked: {check}.")


# ---------------------------------------------------------------------------------------------------------
# 2: Redis cost per decision


class Contender:
    """A script under test: how it is created, called, and how its reply says "acquired".

    `kind`: "acquire" (the filter's ACQUIRE), "redisson4" (Redisson 4.x tryAcquire, the baseline) or
    "redisson3" (Redisson 3.x tryAcquire, before keepAliveTime: a reference). `keep_alive_ms`: the
    limiter's keepAliveTime (None: the filter's default for the case's interval)."""

    def __init__(self, label: str, slug: str, source: str, kind: str, keep_alive_ms: int | None = None):
        self.label = label
        self.slug = slug  # in key names
        self.source = source
        self.kind = kind
        self.keep_alive_ms = keep_alive_ms
        self.sha = ""

    def load(self, client: redis_py.Redis) -> None:
        self.sha = client.script_load(self.source)

    def keys(self, name: str) -> list[str]:
        """Redisson's five keys of a limiter (the same layout for every script)."""
        return [name, f"{{{name}}}:value", f"{{{name}}}:value:{CLIENT_ID}", f"{{{name}}}:permits",
                f"{{{name}}}:permits:{CLIENT_ID}"]

    def keep_alive(self, interval_ms: int) -> int:
        return max(interval_ms, DEFAULT_KEEP_ALIVE_MS) if self.keep_alive_ms is None else self.keep_alive_ms

    def prepare(self, client: redis_py.Redis, name: str, rate: int, interval_ms: int) -> None:
        """Redisson: its trySetRate once. ACQUIRE needs nothing: its first call creates the limiter, as in Envoy."""
        if self.kind == "redisson4":
            client.eval(REDISSON4_TRY_SET_RATE, 1, name, rate, interval_ms, 0, self.keep_alive(interval_ms))
        elif self.kind == "redisson3":
            client.eval(REDISSON3_TRY_SET_RATE, 1, name, rate, interval_ms, 0)

    def argv(self, now_ms: int, random: bytes, rate: int, interval_ms: int) -> list[Any]:
        if self.kind != "acquire":
            return [1, now_ms, random]
        # ACQUIRE's ARGV: now, member bytes, permits, rate, interval, type, keepAliveTime, apply.
        return [now_ms, random, 1, rate, interval_ms, 0, self.keep_alive(interval_ms), 0]

    def acquired(self, reply: Any) -> bool:
        if self.kind != "acquire":
            return reply is None
        # ACQUIRE answers with the permits left (acquired) or minus the delay (rejected), else an array.
        return reply >= 0 if isinstance(reply, int) else int(reply[0]) == 1


@dataclass
class Case:
    title: str
    rate: int
    interval_ms: int
    fill: list[int]  # times (ms after t0) of the acquires that set the window up, not measured
    times: list[int]  # times (ms after t0) of the measured acquires
    expect_acquired: bool


@dataclass
class Measurement:
    usec: list[float] = field(default_factory=list)  # Redis usec_per_call per chunk
    inner: list[float] = field(default_factory=list)  # commands run inside the script, per call
    walls_ns: list[int] = field(default_factory=list)
    acquired: int = 0
    calls: int = 0
    redis_usec_total: float = 0.0


def commandstats(client: redis_py.Redis) -> tuple[int, float, int]:
    """(EVALSHA calls, EVALSHA usec, calls of every command a script ran) since CONFIG RESETSTAT."""
    stats = client.info("commandstats")
    evalsha = stats.get("cmdstat_evalsha", {})
    inner = sum(int(fields["calls"]) for name, fields in stats.items()
                if name not in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_info")
                and not name.startswith("cmdstat_config"))
    return int(evalsha.get("calls", 0)), float(evalsha.get("usec", 0)), inner


def fill(client: redis_py.Redis, contender: Contender, keys: list[str], case: Case, t0: int) -> None:
    """Runs the case's set-up acquires pipelined (not measured); all must be acquired."""
    for start in range(0, len(case.fill), 2000):
        pipe = client.pipeline(transaction=False)
        for offset in case.fill[start:start + 2000]:
            pipe.evalsha(contender.sha, 5, *keys,
                         *contender.argv(t0 + offset, os.urandom(16), case.rate, case.interval_ms))
        replies = pipe.execute()
        if not all(contender.acquired(reply) for reply in replies):
            raise h.HarnessError(f"{case.title}: a set-up acquire of {contender.label} was rejected")


class RespClient:
    """A minimal RESP2 client on one TCP connection: the measured calls go through it, so the client's wall
    time is the loopback and Redis, not a library's Python overhead. Commands are encoded beforehand."""

    def __init__(self, port: int):
        self.sock = socket.create_connection((h.HOST, port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb", buffering=1 << 16)

    @staticmethod
    def encode(*args: Any) -> bytes:
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        return b"".join(parts)

    def call(self, command: bytes) -> Any:
        self.sock.sendall(command)
        return self.reply()

    def reply(self) -> Any:
        line = self.reader.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b":":
            return int(rest)
        if kind == b"$":
            return None if rest == b"-1" else self.reader.read(int(rest) + 2)[:-2]
        if kind == b"*":
            return None if rest == b"-1" else [self.reply() for _ in range(int(rest))]
        if kind == b"+":
            return rest
        raise h.HarnessError(f"Redis answered {line!r}")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def snapshot(client: redis_py.Redis, keys: list[str]) -> list[tuple[str, int, bytes]]:
    """The keys as `DUMP` payloads with their TTLs, for `RESTORE` on another server."""
    return [(key, max(0, client.pttl(key)), client.dump(key)) for key in keys if client.exists(key)]


def measure_case(client: redis_py.Redis, raw: RespClient, contenders: list[Contender], case: Case, t0: int,
                 tag: str) -> tuple[dict[str, Measurement], dict[str, list]]:
    """The case for each contender on its own limiter, in ROUNDS chunks alternating which goes first. Also
    returns each limiter's state after its set-up (`snapshot`), for the instruction counts."""
    state = {}
    snapshots = {}
    for contender in contenders:
        name = f"bench:{tag}:{contender.slug}"
        keys = contender.keys(name)
        client.delete(*keys)
        contender.prepare(client, name, case.rate, case.interval_ms)
        fill(client, contender, keys, case, t0)
        state[contender.label] = keys
        snapshots[contender.label] = snapshot(client, keys)
    results = {contender.label: Measurement() for contender in contenders}
    randoms = [os.urandom(16) for _ in case.times]
    size = -(-len(case.times) // ROUNDS)
    for chunk in range(ROUNDS):
        indices = range(chunk * size, min(len(case.times), (chunk + 1) * size))
        order = contenders if chunk % 2 == 0 else list(reversed(contenders))
        for contender in order:
            keys, result = state[contender.label], results[contender.label]
            sha, rate, interval = contender.sha, case.rate, case.interval_ms
            walls = result.walls_ns
            acquired = 0
            commands = [RespClient.encode("EVALSHA", sha, 5, *keys,
                                          *contender.argv(t0 + case.times[i], randoms[i], rate, interval))
                        for i in indices]
            client.config_resetstat()
            for command in commands:
                started = time.perf_counter_ns()
                reply = raw.call(command)
                walls.append(time.perf_counter_ns() - started)
                acquired += contender.acquired(reply)
            calls, usec, inner = commandstats(client)
            if calls != len(indices):
                raise h.HarnessError(f"{case.title}: Redis counted {calls} EVALSHA, {len(indices)} were sent")
            result.usec.append(usec / calls)
            result.inner.append(inner / calls)
            result.redis_usec_total += usec
            result.calls += calls
            result.acquired += acquired
    for contender in contenders:
        result = results[contender.label]
        expected = result.calls if case.expect_acquired else 0
        if result.acquired != expected:
            raise h.HarnessError(f"{case.title}: {contender.label} acquired {result.acquired} of {result.calls}, "
                                 f"expected {expected}: the case is not in the regime it claims")
    return results, snapshots


class CallgrindRedis:
    """A redis-server under valgrind's callgrind: instructions it executes, counted between `zero()` and
    `dump()` (callgrind_control). Unlike time, repeatable whatever else the machine does."""

    def __init__(self, workdir: Path):
        self.port = h.free_port()
        self.out = workdir / "redis-callgrind.out"
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}", "redis-server", "--port",
                str(self.port), "--bind", h.HOST, "--save", "", "--appendonly", "no"]
        self.process = h.Process("redis-server (callgrind)", argv, workdir / "redis-callgrind.log")
        self.client = redis_py.Redis(host=h.HOST, port=self.port, socket_timeout=120)
        h.wait_until(lambda: self.client.ping(), 120.0, "redis-server under callgrind to answer PING")

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.process.pid)], capture_output=True, check=True,
                       timeout=120)

    def zero(self) -> None:
        self._control("-z")

    def dump(self) -> int:
        """Instructions since the last `zero()`."""
        before = set(self.out.parent.glob(self.out.name + ".*"))
        self._control("-d")
        newest = sorted(set(self.out.parent.glob(self.out.name + ".*")) - before, key=lambda p: p.stat().st_mtime)
        for line in newest[-1].read_text().splitlines():
            if line.startswith("summary:"):
                return int(line.split()[1])
        raise h.HarnessError(f"no summary in {newest[-1]}")

    def stop(self) -> None:
        self.client.close()
        self.process.stop(timeout=30)


def instructions_per_call(cg: CallgrindRedis, contender: Contender, keys: list[str], case: Case, t0: int,
                          state: list[tuple[str, int, bytes]], calls: int) -> float:
    """Redis instructions per call of the case's first `calls` acquires, from the limiter's set-up state."""
    client = cg.client
    client.delete(*keys)
    for key, ttl, payload in state:
        client.restore(key, ttl, payload, replace=True)
    if not client.script_exists(contender.sha)[0]:
        client.script_load(contender.source)
    pipe = client.pipeline(transaction=False)
    for i in range(calls):
        pipe.evalsha(contender.sha, 5, *keys, *contender.argv(t0 + case.times[i], os.urandom(16), case.rate,
                                                              case.interval_ms))
    cg.zero()
    replies = pipe.execute()
    total = cg.dump()
    if sum(contender.acquired(reply) for reply in replies) != (calls if case.expect_acquired else 0):
        raise h.HarnessError(f"{case.title}: {contender.label} left its regime under callgrind")
    return total / calls


def burst_state(client: redis_py.Redis, contender: Contender, window: int, t0: int, tag: str) -> list[str]:
    """Sets up a limiter of rate `window`/1 min whose window is full of permits all taken at t0; its keys."""
    case = Case("burst", window, 60_000, [0] * window, [], True)
    keys = contender.keys(f"bench:{tag}:{contender.slug}")
    client.delete(*keys)
    contender.prepare(client, keys[0], window, case.interval_ms)
    fill(client, contender, keys, case, t0)
    return keys


def burst_release(client: redis_py.Redis, contender: Contender, window: int, t0: int, tag: str,
                  cg: CallgrindRedis | None = None) -> float:
    """Redis usec of the one acquire that releases a window of `window` permits all taken at t0; with `cg`,
    the instructions of that call instead, on the callgrind Redis (the state copied there by DUMP/RESTORE)."""
    keys = burst_state(client, contender, window, t0, tag)
    target = client
    if cg is not None:
        target = cg.client
        for key, ttl, payload in snapshot(client, keys):
            target.restore(key, ttl, payload, replace=True)
        if not target.script_exists(contender.sha)[0]:
            target.script_load(contender.source)
        cg.zero()
    else:
        client.config_resetstat()
    reply = target.evalsha(contender.sha, 5, *keys, *contender.argv(t0 + 60_000, os.urandom(16), window, 60_000))
    cost = float(cg.dump()) if cg is not None else commandstats(client)[1]
    if (cg is None and commandstats(client)[0] != 1) or not contender.acquired(reply):
        raise h.HarnessError(f"burst release of {window}: {contender.label} did not acquire")
    if target.zcard(keys[3]) != 1:
        raise h.HarnessError(f"burst release of {window}: {contender.label} left {target.zcard(keys[3])} permits")
    client.delete(*keys)
    target.delete(*keys)
    return cost


def run_redis_cost(redis: h.Redis) -> None:
    heading("2. Redis cost per decision: ACQUIRE vs Redisson 4.x's tryAcquire (baseline), same server and client")
    client = redis_py.Redis(host=h.HOST, port=redis.port, socket_timeout=30)  # set-up and INFO
    raw = RespClient(redis.port)  # the measured calls
    client.flushall()
    client.script_flush()
    acquire = acquire_source()
    redisson4 = REDISSON4_LUA.read_text()
    contenders = [Contender("ACQUIRE (filter default, keepAlive 1 h)", "acquire", acquire, "acquire"),
                  Contender("Redisson 4.x, keepAlive 1 h (baseline)", "redisson4", redisson4, "redisson4"),
                  Contender("ACQUIRE, keep_alive 0", "acquire0", acquire, "acquire", keep_alive_ms=0),
                  Contender("Redisson 4.x, keepAlive 0 (baseline)", "redisson40", redisson4, "redisson4",
                            keep_alive_ms=0),
                  Contender("Redisson 3.x (no keepAlive; reference)", "redisson3", REDISSON3_LUA.read_text(),
                            "redisson3")]
    pairs = [(0, 1), (2, 3)]  # (ACQUIRE, its baseline): the same keepAliveTime
    for contender in contenders:
        contender.load(client)
    n = N_CALLS
    t0 = int(time.time() * 1000)
    cases = [
        Case("allowed: 100/1 s, window full, 1 permit released per call", 100, 1000,
             [10 * i for i in range(100)], [10 * (100 + i) for i in range(n)], True),
        Case("rejected: 1/1 h, after one allowed", 1, 3_600_000, [0], [1 + i for i in range(n)], False),
        Case("allowed: 10,000/1 min, 10,000 in window, 1 released per call", 10_000, 60_000,
             [6 * i for i in range(10_000)], [6 * (10_000 + i) for i in range(n)], True),
        Case("rejected: 10,000/1 min, window full (10,000)", 10_000, 60_000,
             list(range(10_000)), [10_000 + i for i in range(n)], False),
    ]
    out(f"{num(n)} EVALSHA per script and case, one at a time on one connection, in {ROUNDS} chunks alternating "
        f"the order of the scripts (spread = min-max over the chunks).")
    out("All scripts get the same rate, interval and acquire times (a simulated clock passed as ARGV, so "
        "every call is in the stated regime; checked). ACQUIRE runs as the filter calls it, with the filter's "
        "default keepAliveTime (1 h: 3 PEXPIRE per call) and with keep_alive 0; the baseline is Redisson 4.x's "
        "tryAcquire (bench/redisson4_tryacquire.lua) with the same keepAliveTime, its limiter created by its "
        "trySetRate once, before. Redisson 3.x's script (before keepAliveTime) is a reference.")
    out("Redis us/call: INFO commandstats usec_per_call of EVALSHA (the whole script); Redis instr/call: "
        f"instructions redis-server executes per call, counted by callgrind over {N_INSTRUCTIONS} calls from "
        "the same state (repeatable, unlike time); cmds inside: commands the script ran per call. Client us: "
        "wall time of one call from a minimal RESP client: loopback and Redis.")
    cg = None
    if shutil.which("valgrind") and shutil.which("callgrind_control"):
        progress("(2) starting a redis-server under callgrind for the instruction counts")
        cg = CallgrindRedis(Path(tempfile.mkdtemp(prefix="erl-bench-cg-")))
    rows = []
    costs: list[tuple[str, list[float], list[float]]] = []
    client_p50: list[float] = []
    try:
        for index, case in enumerate(cases):
            progress(f"(2) {case.title}")
            case_t0 = t0 + index * 10_000_000
            results, snapshots = measure_case(client, raw, contenders, case, case_t0, f"case{index}")
            instructions = []
            for contender in contenders:
                if cg is None:
                    instructions.append(float("nan"))
                    continue
                keys = contender.keys(f"bench:case{index}:{contender.slug}")
                instructions.append(instructions_per_call(cg, contender, keys, case, case_t0,
                                                          snapshots[contender.label], N_INSTRUCTIONS))
            for position, contender in enumerate(contenders):
                result = results[contender.label]
                walls = sorted(result.walls_ns)
                client_p50.append(percentile(walls, 50) / 1000)
                rows.append([
                    case.title if position == 0 else "",
                    contender.label,
                    f"{result.redis_usec_total / result.calls:.1f}",
                    spread(result.usec, 1),
                    num(instructions[position]) if instructions[position] == instructions[position] else "-",
                    f"{median(result.inner):.1f}",
                    f"{percentile(walls, 50) / 1000:.0f}",
                    f"{result.acquired:,}/{result.calls:,} acquired",
                ])
            title = case.title.split(":")[0] + (", large window" if case.rate == 10_000 else "")
            costs.append((title, [results[c.label].redis_usec_total / results[c.label].calls for c in contenders],
                          instructions))
    except BaseException:
        if cg is not None:
            cg.stop()
        raise
    out(table(["case (the same for every script)", "script", "Redis us/call", "spread", "Redis instr/call",
               "cmds inside", "client us p50", "decisions"], rows, left=2))

    def ratio(values: list[float], mine: int, theirs: int) -> str:
        return f"{values[mine] / values[theirs]:.2f}x" if values[theirs] == values[theirs] else "-"

    summary = []
    for title, usec, instr in costs:
        ratios = ", ".join(f"{'keepAlive 1 h' if mine == 0 else 'keep_alive 0'} {ratio(instr, mine, theirs)} "
                           f"instr ({ratio(usec, mine, theirs)} us)" for mine, theirs in pairs)
        summary.append(f"{title}: {ratios}; vs Redisson 3.x {ratio(instr, 0, 4)} instr")
    out("Target: ACQUIRE <= 1.0x Redisson 4.x's tryAcquire in every case. ACQUIRE / baseline: " + "; ".join(summary)
        + f". ACQUIRE also creates a missing limiter and applies a rule's config in the same call. A call's wall "
          f"time at the client (p50 {min(client_p50):.0f}-{max(client_p50):.0f} us) is mostly the trip.")

    out()
    burst = [contenders[0], contenders[1]]
    out(f"Growth with the window: one acquire that releases a whole window of W permits, all taken in one "
        f"burst one interval earlier (rate W/1 min); Redis us of that one call, median of {BURST_REPEATS}, and "
        f"the instructions of that call under callgrind (the same state, copied by DUMP/RESTORE).")
    rows = []
    growth = []
    try:
        for window in (100, 1_000, 10_000):
            progress(f"(2) burst release of {num(window)} permits")
            timings: dict[str, list[float]] = {c.label: [] for c in burst}
            for repeat in range(BURST_REPEATS):
                for contender in burst if repeat % 2 == 0 else list(reversed(burst)):
                    timings[contender.label].append(
                        burst_release(client, contender, window, t0 + 10**9 + repeat * 10**6, f"burst{window}"))
            instr = [burst_release(client, c, window, t0 + 2 * 10**9, f"burst{window}", cg) if cg else float("nan")
                     for c in burst]
            mine, theirs = (median(timings[c.label]) for c in burst)
            growth.append((window, mine, theirs))
            rows.append([num(window), num(mine), spread(timings[burst[0].label]), num(theirs),
                         spread(timings[burst[1].label]), f"{mine / theirs:.2f}x",
                         *((num(instr[0]), num(instr[1]), f"{instr[0] / instr[1]:.2f}x") if cg else ("-", "-", "-")),
                         f"{1000 * mine / window:.0f}", f"{1000 * theirs / window:.0f}"])
    finally:
        if cg is not None:
            cg.stop()
    out(table(["W (permits released)", "ACQUIRE us", "spread", "Redisson 4.x us", "spread", "ratio (us)",
               "ACQUIRE instr", "Redisson instr", "ratio (instr)", "ACQUIRE ns/permit", "Redisson ns/permit"], rows))
    (w0, m0, r0), (w1, m1, r1) = growth[0], growth[-1]
    out(f"Reading: from W={num(w0)} to W={num(w1)} that call grows from {num(m0)} to {num(m1)} us (ACQUIRE) and "
        f"from {num(r0)} to {num(r1)} us (Redisson 4.x), about linearly: both scripts read every expired member "
        f"into Lua to sum its permits (the Redisson layout), and Redis serves no one else meanwhile.")
    raw.close()
    client.close()


# ---------------------------------------------------------------------------------------------------------
# 4: module size


def wasm_sections(path: Path) -> dict[str, int]:
    """The sizes of the code, data and name sections (bytes of their contents), by wabt's `wasm-objdump -h`."""
    if not shutil.which("wasm-objdump"):
        return {}
    result = subprocess.run(["wasm-objdump", "-h", str(path)], capture_output=True, text=True, check=False)
    sections = {}
    for line in result.stdout.splitlines():
        # "     Code start=0x0000082b end=0x0004eba0 (size=0x0004e375) count: 524", '   Custom ... "name"'
        match = re.match(r'\s*(Code|Data|Custom)\s.*\(size=0x([0-9a-f]+)\)(?:.*"(name)")?', line)
        if match and (match.group(1) != "Custom" or match.group(3)):
            sections[match.group(3) or match.group(1).lower()] = int(match.group(2), 16)
    return sections


# The targets of the issue "Shed load at the edge" for the stock build, bytes.
SIZE_TARGET_NAMED, SIZE_TARGET_STRIPPED = 250_000, 180_000


def stripped_size(path: Path, workdir: Path) -> int | None:
    """The module's size without any custom section (wabt's `wasm-strip`), bytes."""
    if not shutil.which("wasm-strip"):
        return None
    out_path = workdir / f"{path.stem}.stripped.wasm"
    done = subprocess.run(["wasm-strip", str(path), "-o", str(out_path)], capture_output=True, check=False)
    return out_path.stat().st_size if done.returncode == 0 else None


def crate_of(item: str) -> str:
    """The crate a twiggy item (a demangled function name or a section) belongs to."""
    if item.startswith("data segment"):
        return "data (constants: strings, tables, the Lua source)"
    if item.startswith('"') or item.startswith("custom section"):
        return "name section" if "names" in item else item
    if item.startswith("proxy_on_") or item.startswith("export "):
        return "edge_rate_limiter"  # the ABI entry points, with the filter code inlined into them
    match = re.match(r"^[<&(\s]*(?:dyn |mut |impl )?([A-Za-z_][A-Za-z0-9_]*)(?:\[[0-9a-f]+\])?::", item)
    return match.group(1) if match else "other (compiler intrinsics, glue)"


def twiggy_table(path: Path, top: int = 14) -> list[list[str]] | None:
    """Bytes per crate of the module (twiggy top over every item), largest first."""
    twiggy = REPO / ".tools" / "bin" / "twiggy"
    if not twiggy.exists():
        return None
    done = subprocess.run([str(twiggy), "top", "-n", "100000", "--format", "csv", str(path)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        return None
    by_crate: dict[str, int] = {}
    for row in csv.DictReader(done.stdout.splitlines()):
        crate = crate_of(row["Name"])
        by_crate[crate] = by_crate.get(crate, 0) + int(row["ShallowSize"])
    total = sum(by_crate.values())
    ranked = sorted(by_crate.items(), key=lambda item: -item[1])
    rows = [[crate, num(size), f"{100 * size / total:.1f}%"] for crate, size in ranked[:top]]
    rest = sum(size for _, size in ranked[top:])
    if rest:
        rows.append([f"{len(ranked) - top} more", num(rest), f"{100 * rest / total:.1f}%"])
    return rows


def print_sizes(workdir: Path) -> None:
    heading("4. Module size: dist/*.wasm next to the budget of wasm-tools.toml and the targets")
    config = tomllib.loads((REPO / "wasm-tools.toml").read_text())
    default_budget = config.get("postbuild", {}).get("size_budget_bytes")
    rows = []
    used = []
    for path in sorted((REPO / "dist").glob("*.wasm")):
        profile = path.stem.removeprefix("edge-rate-limiter-")
        budget = config.get("artifact", {}).get(profile, {}).get("size_budget_bytes", default_budget)
        size = path.stat().st_size
        stripped = stripped_size(path, workdir)
        sections = wasm_sections(path)
        rows.append([f"dist/{path.name}", num(size), num(stripped) if stripped else "?",
                     num(budget) if budget else "none", f"{100 * size / budget:.0f}%" if budget else "-",
                     *(num(sections[name]) if name in sections else "?" for name in ("code", "data", "name"))])
        if budget:
            used.append((path.name, size, budget))
        if profile == "envoy":
            envoy = (size, stripped)
    out(table(["artifact", "bytes (names kept)", "bytes stripped", "budget", "of budget", "code", "data",
               "name section"], rows))
    if used:
        name, size, budget = max(used, key=lambda item: item[1] / item[2])
        out(f"Reading: the largest share is {name} at {100 * size / budget:.0f}% of its budget "
            f"({num(budget - size)} bytes of room); the name section (kept for readable traps) is part of it.")
    if "envoy" in {path.stem.removeprefix("edge-rate-limiter-") for path in (REPO / "dist").glob("*.wasm")}:
        named, stripped = envoy
        out()
        out(table(["target (stock build)", "measured", "target", "met"], [
            ["with the name section", num(named), f"<= {num(SIZE_TARGET_NAMED)}",
             "yes" if named <= SIZE_TARGET_NAMED else "NO"],
            ["stripped (wasm-strip)", num(stripped) if stripped else "?", f"<= {num(SIZE_TARGET_STRIPPED)}",
             "yes" if stripped and stripped <= SIZE_TARGET_STRIPPED else "NO"],
        ]))
        rows = twiggy_table(REPO / "dist" / "edge-rate-limiter-envoy.wasm")
        if rows:
            out()
            out("What each crate costs in dist/edge-rate-limiter-envoy.wasm (twiggy top, shallow bytes; after "
                "inlining, a function counts where it was inlined):")
            out(table(["crate or part", "bytes", "share"], rows))


# ---------------------------------------------------------------------------------------------------------


def replay(build: str, config: dict, clusters: dict[str, int], requests: list[dict], workdir: Path) -> dict:
    """`wasm-host replay --json` of `requests` over 2 VMs: the emulator's summary (fuel, round trips...)."""
    return replay_output(build, config, clusters, requests, workdir)[0]


def replay_output(build: str, config: dict, clusters: dict[str, int], requests: list[dict], workdir: Path,
                  extra_args: Iterable[str] = ()) -> tuple[dict, str]:
    """`replay` with more `wasm-host replay` options (e.g. --concurrency, --function-profile): the summary
    and what wasm-host printed on stderr (the profiles)."""
    config_path, requests_path = workdir / f"{build}.json", workdir / f"{build}-requests.jsonl"
    config_path.write_text(json.dumps(config))
    requests_path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    argv = [str(h.WASM_HOST_BIN), "replay", "--module", str(h.BUILDS[build]), "--config", str(config_path),
            "--vms", "2", "--requests", str(requests_path), "--json", *extra_args]
    for name, port in clusters.items():
        argv += ["--cluster", f"{name}=127.0.0.1:{port}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise h.HarnessError(f"wasm-host replay ({build}) exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout), done.stderr


# Fuel over the no-rule baseline, per decision (issue "Shed load at the edge").
FUEL_TARGETS = {"allowed": 15_000, "rejected by Redis": 15_000, "rejected locally": 3_000}


def run_guest_cost() -> None:
    """Section 5: guest cost (wasmtime fuel, about one unit per wasm instruction) and round trips per
    request of both builds in the host emulator, next to the same filter when no rule applies (baseline)."""
    heading("5. Guest cost per request in the host emulator: stock build vs Higress build")
    out("wasm-host replay, 2 VMs, one at a time; rule per-user, 50 per minute over 4 users: 400 requests (200 allowed,")
    out("200 rejected, all but the first of each user by the local block); the same with local_block_max 0 (every")
    out("rejection by Redis); baseline: the same 400 requests without the key header (the rule is skipped, no Redis")
    out("call). Fuel: wasmtime fuel consumed by every guest call for the request (callbacks included), about one")
    out("per wasm instruction: repeatable, unlike time. Round trips: HTTP calls to webdis (stock) or")
    out("proxy_redis_call (Higress) per request, with the local block.")
    decided = [{"headers": [["x-user-id", f"u{i % 4}"]]} for i in range(400)]
    skipped = [{"headers": [["x-other", "1"]]} for _ in range(400)]
    rows, over = [], {}
    with h.Stack() as stack:
        stack.start()
        builds = {
            "envoy": (h.plugin_config, {"webdis": stack.webdis.port}, "http_calls_per_request"),
            "higress": (h.host_plugin_config, {"redis": stack.redis.port}, "redis_round_trips"),
        }
        for build, (make_config, clusters, trips_key) in builds.items():
            def run(requests: list[dict], **fields: Any) -> dict:
                stack.redis.client.flushall()
                stack.redis.client.script_load(acquire_source())  # every run starts with the script cached
                config = make_config(h.rule(rate=50, interval="1m", **fields))
                return replay(build, config, clusters, requests, stack.workdir)

            blocked, unblocked, baseline = run(decided), run(decided, local_block_max=0), run(skipped)
            base = baseline["fuel_allowed"]["p50"] if baseline["fuel_allowed"]["count"] else 0
            over[build] = {"allowed": blocked["fuel_allowed"]["p50"] - base,
                           "rejected by Redis": unblocked["fuel_rejected"]["p50"] - base,
                           "rejected locally": blocked["fuel_rejected"]["p50"] - base}
            trips = blocked[trips_key]["per_request"] if trips_key == "redis_round_trips" else blocked[trips_key]
            rows.append([f"{build} ({h.BUILDS[build].name})", num(base),
                         *(f"{num(base + over[build][kind])} ({signed(over[build][kind])})" for kind in FUEL_TARGETS),
                         f"{trips['mean']:.3f}",
                         ", ".join(f"{n} {k}" for k, n in sorted(blocked["outcomes"].items()))])
    out(table(["build", "no rule (baseline) p50", "allowed p50", "rejected by Redis p50", "rejected locally p50",
               "round trips/request", "outcomes"], rows))
    out()
    out(table(["fuel over the baseline, p50", *FUEL_TARGETS, ""], [
        [build, *(f"{signed(over[build][kind])} ({'yes' if over[build][kind] <= FUEL_TARGETS[kind] else 'NO'})"
                  for kind in FUEL_TARGETS), ""] for build in over
    ] + [["target", *(f"<= {num(target)}" for target in FUEL_TARGETS.values()), ""]]))
    out("Reading: deciding a request costs the guest the difference to the baseline column; the two builds differ "
        "only in their transport code. A local rejection finds the block among its VM's recent blocks (or in one "
        "shared data entry) and answers.")


# ---------------------------------------------------------------------------------------------------------
# 6: leases


LEASE = {"max_permits": 64, "max_age": "50ms"}
LEASE_HOT_RATE = 1_000_000  # (a): a hot limiter that never rejects
# (b): one global limiter under saturation, 2 gateways x 2 VMs, SATURATION_RATE per SATURATION_INTERVAL_MS:
# about half of what the two gateways admit through Redis without a lease here (2,000-2,500/s in all while
# both are loaded), so the baseline is limited by the rate, not by its round trips.
SATURATION_RATE = _env_int("BENCH_LEASE_RATE", 1000)
SATURATION_INTERVAL_MS = 1000
SATURATION_S = _env_int("BENCH_LEASE_SECONDS", 7)
SATURATION_GATEWAYS, SATURATION_VMS = 2, 2
# Redisson's guarantee (at most the rate in any window of the interval) holds for permits in the order Redis
# runs the acquires; with the gateways' clocks (clock: gateway, as Redisson's clients) acquires stamped a
# few ms apart can reach Redis in the other order, so a window may hold a few more (the baseline too). The
# check allows this margin: at most the rate in every window of the interval minus TIMING_MARGIN_MS.
TIMING_MARGIN_MS = 5
ADMITTED_TARGET = 0.95  # of the rate, in every fixed window, with the lease
CALLS_TARGET = 1 / 16  # Redis calls per allowed request with the lease / without

# Every admitted request (status 200, the route's direct_response) logged with its start time in epoch ms
# (`line`: another line format).
ADMITTED_LOG = """\
          access_log:
          - name: envoy.access_loggers.file
            filter:
              status_code_filter:
                comparison:
                  op: EQ
                  value: {{ default_value: 200, runtime_key: erl_bench_admitted_log }}
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {path}
              log_format:
                text_format_source:
                  inline_string: "{line}\\n"
"""
HCM_STAT_PREFIX = "          stat_prefix: ingress_http\n"


def with_admitted_log(text: str, path: Path, line: str = "%START_TIME(%s%3f)%") -> str:
    """The Envoy yaml with an access log of the admitted requests at `path`, a line each: their start times
    (epoch ms), or `line` (Envoy's command operators)."""
    if text.count(HCM_STAT_PREFIX) != 1:
        raise h.HarnessError("envoy/envoy.yaml changed shape: update with_admitted_log() in bench/bench.py")
    return text.replace(HCM_STAT_PREFIX, HCM_STAT_PREFIX + ADMITTED_LOG.format(path=json.dumps(str(path)), line=line))


def read_admitted(path: Path, since_ms: int) -> list[int]:
    """Start times (epoch ms, each line's first word) of the admitted requests logged at `path` from
    `since_ms` on."""
    with contextlib.suppress(FileNotFoundError):
        words = (line.split(maxsplit=1)[0] for line in path.read_text().splitlines() if line.strip())
        return [t for t in (int(word) for word in words if word.isdigit()) if t >= since_ms]
    return []


def max_in_sliding_window(times: list[int], width_ms: int) -> tuple[int, int]:
    """The most of the sorted `times` in any window [t, t + width_ms), and where that window starts."""
    best, at, first = 0, 0, 0
    for last, t in enumerate(times):
        while t - times[first] >= width_ms:
            first += 1
        if last - first + 1 > best:
            best, at = last - first + 1, times[first]
    return best, at


def margin_needed(times: list[int], most: int, width_ms: int) -> int | None:
    """The least m (ms) such that no window of `width_ms` - m holds more than `most` of `times`."""
    for margin in range(0, 51):
        if max_in_sliding_window(times, width_ms - margin)[0] <= most:
            return margin
    return None


def lease_gateway(stack: h.Stack, name: str, plugin: dict, concurrency: int, admitted_log: Path | None) -> h.Envoy:
    """An Envoy as in section 1 (the route answering itself), started without waiting; with `admitted_log`,
    logging every admitted request's start time there."""
    envoy = h.Envoy(stack.workdir, plugin, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                    concurrency=concurrency, name=name)
    text = bench_envoy_yaml(envoy.yaml_path.read_text(), "wasm")
    envoy.yaml_path.write_text(with_admitted_log(text, admitted_log) if admitted_log else text)
    stack.envoys.append(envoy)  # stopped by Stack.close(), whatever happens
    envoy.start(wait_ready=False)
    return envoy


@dataclass
class SaturationRun:
    admitted: list[int]  # start times of the admitted requests, epoch ms, sorted
    start_ms: int
    end_ms: int
    stats: dict[str, int]  # deltas of ENVOY_STATS, both gateways, short names
    scripts: int  # EVALSHA + EVAL Redis ran
    wrk: list[WrkResult]
    vm_connections: list[list[int]]  # per gateway, per VM
    samples: list[tuple[int, int, int]]  # (ms, allowed, redis_calls) of both gateways at the window edges
    members: dict[bytes, tuple[int, int]]  # the limiter's permit members seen in Redis: random -> (score, permits)

    def stat(self, name: str) -> int:
        return self.stats.get(name, 0)

    def windows(self) -> list[tuple[int, int]]:
        """(start ms, admitted) of every whole fixed window of the interval, on the clock's grid, inside
        the load (the partial first and last windows left out; the load counts as started WRK_START_MS late)."""
        interval = SATURATION_INTERVAL_MS
        first = -(-(self.start_ms + WRK_START_MS) // interval)
        last = self.end_ms // interval  # exclusive
        counts = {k: 0 for k in range(first, last)}
        for t in self.admitted:
            if t // interval in counts:
                counts[t // interval] += 1
        return [(k * interval, n) for k, n in sorted(counts.items())]

    def counts(self) -> list[int]:
        return [n for _, n in self.windows()]

    def calls_per_window(self) -> list[float]:
        """Redis calls per allowed request in each fixed window (the filter's counters, read at the edges)."""
        edges = {ms: (allowed, calls) for ms, allowed, calls in self.samples}
        result = []
        for start, _ in self.windows():
            if start in edges and start + SATURATION_INTERVAL_MS in edges:
                (a0, c0), (a1, c1) = edges[start], edges[start + SATURATION_INTERVAL_MS]
                result.append((c1 - c0) / (a1 - a0) if a1 > a0 else float("nan"))
        return result

    def calls_per_allowed(self) -> float:
        return self.stat("redis_calls") / self.stat("allowed") if self.stat("allowed") else float("nan")

    def permits_per_member(self) -> list[float]:
        """Mean permits per member Redis held, by the fixed window of the member's score: one per acquire
        without a lease, the permits a lease used (once settled) with one."""
        by_window: dict[int, list[int]] = {}
        for score, permits in self.members.values():
            by_window.setdefault(score // SATURATION_INTERVAL_MS * SATURATION_INTERVAL_MS, []).append(permits)
        return [statistics.mean(by_window[start]) if by_window.get(start) else float("nan")
                for start, _ in self.windows()]


MEMBER_POLL_S = 0.1  # a member stays at least the interval in Redis: every one is seen
WRK_START_MS = 100  # from starting the wrk processes to their load


def saturate(stack: h.Stack, envoys: list[h.Envoy], logs: list[Path], label: str, seconds: int,
             permits_key: str, connections: int = CONNECTIONS, slack: int = 0) -> SaturationRun:
    """Loads every gateway at once with its own wrk (1 thread, `connections`, default BENCH_CONNECTIONS) for
    `seconds`; meanwhile reads the filter's counters at every edge of the fixed windows and the limiter's
    permit members (`permits_key`; empty: none, a sliding window counter keeps no member) every MEMBER_POLL_S.
    The access logs must hold as many requests as the filter counted allowed, give or take `slack` (requests
    in flight when wrk stops: counted allowed after the counters are read, or allowed and never answered
    because wrk closed the connection; the caller reports the difference)."""
    redis = stack.redis
    before = [envoy.stats(filter=ENVOY_STATS) for envoy in envoys]
    vms_before = [envoy.worker_connections() for envoy in envoys]
    redis.client.config_resetstat()
    samples: list[tuple[int, int, int]] = []
    members: dict[bytes, tuple[int, int]] = {}
    done = threading.Event()
    poller = redis_py.Redis(host=h.HOST, port=redis.port, socket_timeout=5)

    def sample() -> None:
        interval = SATURATION_INTERVAL_MS
        edge = (int(time.time() * 1000) // interval + 1) * interval
        while not done.is_set():
            if time.time() * 1000 >= edge:
                with contextlib.suppress(h.HarnessError, OSError):
                    metrics = [envoy.metrics() for envoy in envoys]
                    samples.append((edge, sum(m.get("allowed", 0) for m in metrics),
                                    sum(m.get("redis_calls", 0) for m in metrics)))
                edge = (int(time.time() * 1000) // interval + 1) * interval
            with contextlib.suppress(redis_py.RedisError, ValueError):
                for member, score in poller.zrange(permits_key, 0, -1, withscores=True) if permits_key else []:
                    permit = h.decode_permit(member, score)
                    members[permit.random] = (int(score), permit.permits)  # a settled lease replaces its grant
            done.wait(max(0.0, min(MEMBER_POLL_S, edge / 1000 - time.time())))

    sampler = threading.Thread(target=sample, name="bench-sampler", daemon=True)
    sampler.start()
    start_ms = int(time.time() * 1000)
    try:
        started = [start_wrk(envoy.port, seconds, stack.workdir, f"{label}-{i}", connections, 1)
                   for i, envoy in enumerate(envoys)]
        results = [finish_wrk(run, seconds) for run in started]
    finally:
        done.set()
        sampler.join(timeout=10)
        poller.close()
    end_ms = min(int(time.time() * 1000), start_ms + 1000 * seconds)
    commands = redis.client.info("commandstats")
    stats: dict[str, int] = {}
    for envoy, old in zip(envoys, before):
        for name, value in envoy.stats(filter=ENVOY_STATS).items():
            stats[_short(name)] = stats.get(_short(name), 0) + value - old.get(name, 0)
    vm_connections = [[now - then for now, then in zip(envoy.worker_connections(), old)]
                      for envoy, old in zip(envoys, vms_before)]
    scripts = sum(commands.get(name, {}).get("calls", 0) for name in ("cmdstat_evalsha", "cmdstat_eval"))
    # Envoy writes its access logs out every 100 ms (the harness's --file-flush-interval-msec).
    allowed = stats.get("allowed", 0)
    admitted: list[int] = []

    def logged() -> bool:
        nonlocal admitted
        admitted = sorted(t for log in logs for t in read_admitted(log, start_ms))
        return len(admitted) >= allowed

    with contextlib.suppress(h.HarnessError):
        h.wait_until(logged, 5.0, "the access logs to hold every admitted request")
    if abs(len(admitted) - allowed) > slack:
        raise h.HarnessError(f"({label}) the access logs hold {len(admitted)} admitted requests, the filter "
                             f"counted {allowed} allowed")
    return SaturationRun(admitted, start_ms, end_ms, stats, scripts, results, vm_connections, samples, members)


def run_leases() -> None:
    """Section 6: a rule's permit lease against the same rule without one (baseline), in stock Envoy."""
    heading("6. Leases: a hot limiter with lease {max_permits: 64, max_age: 50ms} vs without (baseline)")
    timeout = "500ms"
    rate, interval = SATURATION_RATE, SATURATION_INTERVAL_MS
    with h.Stack() as stack:
        stack.start()
        progress(f"(6) starting {2 + 2 * SATURATION_GATEWAYS} Envoys")
        hot = {
            "off": lease_gateway(stack, "envoy-hot-off", h.plugin_config(
                h.rule("hot-off", limit_by="global", rate=LEASE_HOT_RATE, interval="1s"), timeout=timeout),
                CONCURRENCY, None),
            "lease": lease_gateway(stack, "envoy-hot-lease", h.plugin_config(
                h.rule("hot-lease", limit_by="global", rate=LEASE_HOT_RATE, interval="1s", lease=LEASE),
                timeout=timeout), CONCURRENCY, None),
        }
        saturated: dict[str, tuple[list[h.Envoy], list[Path]]] = {}
        for kind in ("off", "lease"):
            fields = {"lease": LEASE} if kind == "lease" else {}
            plugin = h.plugin_config(h.rule(f"saturated-{kind}", limit_by="global", rate=rate,
                                            interval=f"{interval}ms", **fields), timeout=timeout)
            logs = [stack.workdir / f"admitted-{kind}-{i}.log" for i in range(SATURATION_GATEWAYS)]
            saturated[kind] = ([lease_gateway(stack, f"envoy-saturated-{kind}-{i}", plugin, SATURATION_VMS, log)
                                for i, log in enumerate(logs)], logs)
        for envoy in list(hot.values()) + [e for envoys, _ in saturated.values() for e in envoys]:
            envoy.wait_ready()

        # (a) One gateway at a time, as in section 1.
        runs: dict[str, list[GatewayRun]] = {kind: [] for kind in hot}
        for kind, envoy in hot.items():
            progress(f"(6a) warming up, lease {kind}, {WARM_UP_S} s")
            run_wrk(envoy.port, WARM_UP_S, stack.workdir, f"warm-hot-{kind}")
        for round_index in range(ROUNDS):
            for kind, envoy in hot.items():
                progress(f"(6a) hot limiter below its rate, lease {kind}: round {round_index + 1}/{ROUNDS}, "
                         f"{DURATION} s")
                runs[kind].append(measured_run(envoy, stack, f"hot-{kind}-{round_index}"))

        # (b) Both gateways of a kind at once, after a warm-up that also fills the window.
        saturation: dict[str, SaturationRun] = {}
        for kind, (envoys, logs) in saturated.items():
            progress(f"(6b) saturation, lease {kind}: warming up {WARM_UP_S} s, then {SATURATION_S} s on "
                     f"{len(envoys)} gateways at once")
            for run in [start_wrk(e.port, WARM_UP_S, stack.workdir, f"warm-sat-{kind}-{i}", CONNECTIONS, 1)
                        for i, e in enumerate(envoys)]:
                finish_wrk(run, WARM_UP_S)
            permits_key = h.limiter_key(h.limiter_name(f"erl:saturated-{kind}"), "permits")
            saturation[kind] = saturate(stack, envoys, logs, f"sat-{kind}", SATURATION_S, permits_key)

        sha = sha1_hex(acquire_source())
        if not stack.redis.client.script_exists(sha)[0]:
            raise h.HarnessError(f"Redis has no script {sha}: the ACQUIRE built from src/script/lua/ is not the "
                                 f"script {h.WASM.name} runs (rebuild: make build)")
    print_leases(runs, saturation, sha)


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def print_leases(runs: dict[str, list[GatewayRun]], saturation: dict[str, SaturationRun], sha: str) -> None:
    rate, interval = SATURATION_RATE, SATURATION_INTERVAL_MS
    out(f"(a) Hot limiter below its rate: one rule, limit_by global, {num(LEASE_HOT_RATE)} per 1 s (nothing is "
        f"rejected), one Envoy --concurrency {CONCURRENCY} at a time, wrk -t{THREADS} -c{CONNECTIONS} "
        f"-d{DURATION}s, the route answering itself; medians of {ROUNDS} interleaved runs (spread min-max). Redis "
        "calls: the filter's redis_calls / allowed counters; scripts: EVALSHA+EVAL in Redis's INFO commandstats "
        "/ allowed; other calls per lease: Redis calls that took no lease (requests that asked for their own "
        "permit, e.g. while their VM's lease acquire was on its way), per lease granted.")

    def totals(kind: str) -> dict[str, float]:
        kind_runs = runs[kind]
        allowed = sum(r.stat("allowed") for r in kind_runs)
        calls = sum(r.stat("redis_calls") for r in kind_runs)
        leases = sum(r.stat("leases") for r in kind_runs)
        scripts = sum(r.commands.get(name, {}).get("calls", 0) for r in kind_runs
                      for name in ("cmdstat_evalsha", "cmdstat_eval"))
        nan = float("nan")
        return {"calls": calls / allowed if allowed else nan, "scripts": scripts / allowed if allowed else nan,
                "leases": leases, "others": (calls - leases) / leases if leases else nan}

    rows = []
    for kind, title in (("off", "no lease (baseline)"), ("lease", "lease 64 / 50 ms")):
        kind_runs, total = runs[kind], totals(kind)
        requests = sum(answers(r)[0] for r in kind_runs)
        ok = sum(answers(r)[1]["2xx"] for r in kind_runs)
        rows.append([title, num(median(r.wrk.rps for r in kind_runs)), spread([r.wrk.rps for r in kind_runs]),
                     num(median(r.wrk.p50 for r in kind_runs)), num(median(r.wrk.p99 for r in kind_runs)),
                     f"{total['calls']:.4f}", f"{total['scripts']:.4f}", num(total["leases"]),
                     f"{total['others']:.1f}" if total["leases"] else "-",
                     f"{100 * ok / requests:.2f}% 2xx" if requests else "none"])
    out(table(["scenario", "req/s", "req/s spread", "p50 us", "p99 us", "Redis calls/allowed",
               "scripts/allowed", "leases", "other calls/lease", "answers"], rows))
    rps = {kind: median(r.wrk.rps for r in runs[kind]) for kind in runs}
    off_calls, lease_calls = totals("off")["calls"], totals("lease")["calls"]
    out()
    out(table(["measure (a)", "no lease (baseline)", "lease", "lease / baseline", "target", "met"], [
        ["allowed req/s", num(rps["off"]), num(rps["lease"]), f"{rps['lease'] / rps['off']:.2f}x", "-", "-"],
        ["Redis calls per allowed request", f"{off_calls:.4f}", f"{lease_calls:.4f}",
         f"{lease_calls / off_calls:.4f}" if off_calls else "-",
         f"<= 1/16 of the baseline ({off_calls * CALLS_TARGET:.4f})", _met(lease_calls <= off_calls * CALLS_TARGET)],
    ]))

    out()
    off, lease = saturation["off"], saturation["lease"]
    out(f"(b) Saturation: {SATURATION_GATEWAYS} Envoys x {SATURATION_VMS} VMs (--concurrency {SATURATION_VMS}) on "
        f"one Redis (through webdis), one rule limit_by global, {num(rate)} per {interval} ms; every gateway "
        f"loaded at once by its own wrk -t1 -c{CONNECTIONS} for {SATURATION_S} s after a {WARM_UP_S} s warm-up "
        "(the window is full when it starts); one run per kind. Admitted: every request answered 200, logged by "
        "its Envoy's access log with its START_TIME (epoch ms: the clock the filter stamps permits with, read "
        "just before the filter decides); the logs hold exactly the filter's allowed count (checked). Fixed "
        f"windows: the whole {interval} ms windows of the clock's grid inside the load (the partial first and "
        "last left out). Sliding windows: every window of that width starting at an admitted request.")

    def fraction(run: SaturationRun, pick: Any) -> str:
        counts = run.counts()
        if not counts:
            return "-"
        value = pick(counts)
        return f"{num(value)} ({100 * value / rate:.1f}%)"

    def demand(run: SaturationRun) -> float:
        return sum(r.requests for r in run.wrk) / ((run.end_ms - run.start_ms) / 1000)

    def worst(run: SaturationRun, width: int) -> str:
        most, at = max_in_sliding_window(run.admitted, width)
        return f"{num(most)} (at +{(at - run.start_ms) / 1000:.1f} s)"

    def margin(run: SaturationRun) -> str:
        needed = margin_needed(run.admitted, rate, interval)
        return "> 50 ms" if needed is None else f"{needed} ms"

    def lost(run: SaturationRun) -> str:
        counts = run.counts()
        return f"{rate - statistics.mean(counts):,.1f} (max {rate - min(counts):,})" if counts else "-"

    lease_counts = lease.counts()
    lease_min = min(lease_counts) / rate if lease_counts else float("nan")
    off_calls_b, lease_calls_b = off.calls_per_allowed(), lease.calls_per_allowed()
    within_margin = max_in_sliding_window(lease.admitted, interval - TIMING_MARGIN_MS)[0]
    lease_margin = margin_needed(lease.admitted, rate, interval)
    rows = [
        ["demand: answers/s, both gateways (x the rate)",
         *(f"{num(demand(r))} ({demand(r) * interval / 1000 / rate:.1f}x)" for r in (off, lease)),
         "well above the rate", _met(min(demand(off), demand(lease)) * interval / 1000 >= 1.5 * rate)],
        ["admitted per fixed window: min (of the rate)", fraction(off, min), fraction(lease, min),
         f">= {ADMITTED_TARGET:.0%} with lease", _met(lease_min >= ADMITTED_TARGET)],
        ["admitted per fixed window: mean", fraction(off, statistics.mean), fraction(lease, statistics.mean),
         "-", "-"],
        ["permits lost per window: rate - admitted, mean", lost(off), lost(lease), "-", "-"],
        [f"worst sliding {interval} ms window (max admitted)", worst(off, interval), worst(lease, interval),
         f"<= {num(rate)}", "see below"],
        [f"worst sliding {interval - TIMING_MARGIN_MS} ms window ({TIMING_MARGIN_MS} ms margin)",
         worst(off, interval - TIMING_MARGIN_MS), worst(lease, interval - TIMING_MARGIN_MS), f"<= {num(rate)}",
         _met(within_margin <= rate)],
        ["margin the rate needs (every window narrower by it holds <= rate)", margin(off), margin(lease),
         f"<= {TIMING_MARGIN_MS} ms", _met(lease_margin is not None and lease_margin <= TIMING_MARGIN_MS)],
        ["Redis calls per allowed request (filter counters)", f"{off_calls_b:.4f}", f"{lease_calls_b:.4f}",
         f"<= 1/16 of the baseline ({off_calls_b * CALLS_TARGET:.4f})",
         _met(lease_calls_b <= off_calls_b * CALLS_TARGET)],
        ["scripts Redis ran per allowed request", *(f"{r.scripts / r.stat('allowed'):.4f}" if r.stat("allowed")
                                                    else "-" for r in (off, lease)), "-", "-"],
        ["allowed / rejected (of which locally)", *(f"{num(r.stat('allowed'))} / {num(r.stat('rejected'))} "
                                                    f"({num(r.stat('local_rejected'))})" for r in (off, lease)),
         "-", "-"],
        ["leases granted", *(num(r.stat("leases")) for r in (off, lease)), "-", "-"],
    ]
    out(table(["measure (b)", "no lease (baseline)", "lease 64 / 50 ms", "target", "met"], rows))
    out("Per fixed window, in order: admitted; Redis calls per allowed request (the filter's counters read at "
        "the window edges, give or take a few ms); mean permits per member of the limiter in Redis (by the "
        "member's score; read every 100 ms: one per acquire without a lease, what a lease used with one).")
    for kind, run in (("no lease", off), ("lease", lease)):
        out(f"  {kind + ':':10} admitted " + " ".join(num(n) for n in run.counts())
            + "; calls/allowed " + " ".join(f"{c:.3f}" for c in run.calls_per_window())
            + "; permits/member " + " ".join(f"{c:.1f}" for c in run.permits_per_member())
            + "; connections per VM " + " / ".join(",".join(str(c) for c in vms) for vms in run.vm_connections))
    per_member = [value for value in lease.permits_per_member() if value == value]
    out(f"Reading: below its rate (a), the lease serves {rps['lease'] / rps['off']:.1f}x the requests per second "
        f"of the baseline with {lease_calls / off_calls:.3f}x its Redis calls per allowed request "
        f"({totals('lease')['others']:.1f} calls per lease took none: requests that asked Redis for their own "
        f"permit). Saturated (b), the lease admits {fraction(lease, min)} of the rate in its worst window with "
        f"{lease_calls_b:.3f} Redis calls per allowed request ({lease_calls_b / off_calls_b:.2f}x the baseline's)"
        + (f"; permits used per lease member, first and last window: {per_member[0]:.1f}, {per_member[-1]:.1f} "
           "(a lease takes what is free up to what its VM's last lease served, so leases keep their size from "
           "window to window)" if per_member else "")
        + ". A sliding "
        "window of the whole interval may hold a few more than the rate, the baseline's too: acquires stamped "
        "by different gateways a few ms apart reach Redis in the other order (Redisson's semantics with client "
        "clocks); narrowed by the margin shown, every window holds at most the rate.")
    out(f"Checked: the filter's script in Redis has the SHA-1 of ACQUIRE from src/script/lua/ ({sha[:12]}).")


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    os.environ["BENCH_USERS"] = str(USERS)  # read by bench/users.lua inside wrk
    started = time.monotonic()
    try:
        machine_header()
        with h.Stack() as stack:
            if "1" in ONLY or "3" in ONLY or "2" in ONLY:
                stack.start()
            scenarios, check = [], ""
            if "1" in ONLY or "3" in ONLY:
                scenarios, check = run_gateway(stack)
                stack.stop_envoys()
                stack.webdis.stop()
                if "1" in ONLY:
                    print_gateway(scenarios)
            if "2" in ONLY:
                stack.redis.start()  # empty again (stopped for (d))
                run_redis_cost(stack.redis)
            if "3" in ONLY and scenarios:
                print_round_trips(scenarios, check)
        if "4" in ONLY:
            with tempfile.TemporaryDirectory(prefix="bench-sizes-") as sizes_dir:
                print_sizes(Path(sizes_dir))
        if "5" in ONLY:
            run_guest_cost()
        if "6" in ONLY:
            run_leases()
        if "7" in ONLY:
            import cluster_bench  # bench/cluster_bench.py (it imports this file as `bench`)
            cluster_bench.run_cluster()
        if "8" in ONLY:
            import reliability_bench  # bench/reliability_bench.py (it imports this file as `bench`)
            reliability_bench.run_reliability()
        if "9" in ONLY:
            import peer_bench  # bench/peer_bench.py (it imports this file as `bench`)
            peer_bench.run_peers()
        if "10" in ONLY:
            import coalescing_bench  # bench/coalescing_bench.py (it imports this file as `bench`)
            coalescing_bench.run_coalescing()
        if "11" in ONLY:
            import cost_bench  # bench/cost_bench.py (it imports this file as `bench`)
            cost_bench.run_cost()
        if "12" in ONLY:
            import inflight_bench  # bench/inflight_bench.py (it imports this file as `bench`)
            inflight_bench.run_inflight()
        if "13" in ONLY:
            import state_bench  # bench/state_bench.py (it imports this file as `bench`)
            state_bench.run_state()
    except KeyboardInterrupt:
        print("\nbench: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    except h.HarnessError as error:
        print(f"bench: FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        h.Process.stop_all()
    load = os.getloadavg()
    out()
    out(f"Done in {time.monotonic() - started:.0f} s; load average {load[0]:.2f} at the end.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
