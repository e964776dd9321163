#!/usr/bin/env python3
"""`make bench`: what the filter costs, each figure printed next to a baseline measured in the same run.

1. Gateway overhead: the same Envoy (envoy/envoy.yaml, the route answering with `direct_response` so no
   Python upstream is measured) without the wasm filter (baseline) and with it: (b) every request allowed,
   (c) every request rejected, (d) failing open with Redis stopped, (e) a rule that never applies (the
   filter without a Redis call). Load from wrk on 127.0.0.1; then the same with one connection (latency
   without queueing), and the CPU time per request of each process (wrk, Envoy, webdis, Redis).
2. Redis cost per decision: the filter's ACQUIRE script (src/script/lua/acquire.lua) against Redisson's tryAcquire
   (bench/redisson_tryacquire.lua, the baseline) on the same redis-server from the same client, in the
   allowed and the rejected regime, with a small and a large window; and the cost of one call that
   releases a whole window of permits, as the window grows.
3. Redis round trips per allowed and per rejected request, counted by Redis during the runs of 1, next
   to the ideal (1); the checked claim that the benchmarked ACQUIRE is the script the filter runs.
4. Module size: dist/*.wasm next to the size budget of wasm-tools.toml.

Every process (redis-server, webdis, Envoys, wrk) is started by tests/e2e/harness.py on 127.0.0.1 with
free ports and stopped by its PID, also on Ctrl-C or SIGTERM. Figures vary from run to run (the machine,
other load); repeated measurements print their spread (min-max).

Settings (environment variables, defaults in brackets): BENCH_DURATION seconds per wrk run [4],
BENCH_ROUNDS wrk runs per scenario and chunks per script measurement [3], BENCH_CONNECTIONS [8],
BENCH_THREADS wrk threads [2], BENCH_CONCURRENCY Envoy workers [2], BENCH_USERS distinct x-user-id
values [64], BENCH_N script calls per script and case [20000], BENCH_ONLY sections to run, e.g. "2,4"
[1,2,3,4; 3 needs 1].
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import harness as h  # noqa: E402  (tests/e2e/harness.py: processes on free ports, stopped by PID)
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
ONLY = {part.strip() for part in os.environ.get("BENCH_ONLY", "1,2,3,4,5").split(",") if part.strip()}

WRK = os.environ.get("WRK_BIN", "wrk")
WRK_SCRIPT = REPO / "bench" / "users.lua"
REDISSON_LUA = REPO / "bench" / "redisson_tryacquire.lua"
LUA_DIR = REPO / "src" / "script" / "lua"
WASM_TOOLS = REPO / ".tools" / "bin" / "wasm-tools"
WARM_UP_S = 1
BURST_REPEATS = 5

# Redisson's trySetRate of the same generation as the tryAcquire baseline: run once per limiter.
REDISSON_TRY_SET_RATE = (
    "redis.call('hsetnx', KEYS[1], 'rate', ARGV[1]);"
    "redis.call('hsetnx', KEYS[1], 'interval', ARGV[2]);"
    "return redis.call('hsetnx', KEYS[1], 'type', ARGV[3]);"
)
# The filter's default keepAliveTime (README: "1h", or the interval if longer).
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


def bench_envoy_yaml(rendered: str, with_filter: bool) -> str:
    """envoy/envoy.yaml as the harness renders it, the route answering itself (`direct_response`) and,
    for the baseline, without the wasm filter: everything else identical."""
    if rendered.count(ROUTE) != 1 or WASM_FILTER_START not in rendered or ROUTER_FILTER_START not in rendered:
        raise h.HarnessError("envoy/envoy.yaml changed shape: update bench_envoy_yaml() in bench/bench.py")
    text = rendered.replace(ROUTE, DIRECT_RESPONSE)
    if not with_filter:
        start, end = text.index(WASM_FILTER_START), text.index(ROUTER_FILTER_START)
        text = text[:start] + text[end:]
    return text


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
            threads: int = THREADS) -> WrkResult:
    """wrk against 127.0.0.1:port for `seconds`, started and stopped by PID through the harness."""
    output = workdir / f"wrk-{label}.out"
    output.unlink(missing_ok=True)
    argv = [WRK, "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s", "--timeout", "5s",
            "-s", str(WRK_SCRIPT), f"http://{h.HOST}:{port}/"]
    process = h.Process("wrk", argv, output)
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
                 connections: int = CONNECTIONS, threads: int = THREADS) -> GatewayRun:
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
    result = run_wrk(envoy.port, seconds, stack.workdir, label, connections, threads)
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


def acquire_source() -> str:
    """The ACQUIRE script exactly as build.rs builds it from src/script/lua/: "-- edge-rate-limiter acquire",
    the prelude and the body without their full-line comments (checked against the script the filter makes
    Redis run, by SHA, in section 1)."""
    def code(name: str) -> str:
        lines = (LUA_DIR / name).read_text().splitlines()
        return "".join(f"{line}\n" for line in lines if not line.lstrip().startswith("--"))
    return "-- edge-rate-limiter acquire\n" + code("prelude.lua") + code("acquire.lua")


def sha1_hex(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


UNLOADED_S = 2


def run_gateway(stack: h.Stack) -> tuple[list[Scenario], str]:
    """Section 1's runs (3 reads them too). Returns the scenarios and a line on the script check."""
    timeout = "500ms"
    configs = {
        "a": None,
        "b": h.plugin_config(h.rule("allowed", rate=1_000_000, interval="1s"), timeout=timeout),
        "c": h.plugin_config(h.rule("rejected", rate=1, interval="1h"), timeout=timeout),
        # The rule's key is a header wrk never sends: the filter runs on every request, calls nothing.
        "e": h.plugin_config(h.rule("skipped", limit_by={"header": "x-absent"}, rate=1, interval="1h"),
                             timeout=timeout),
    }
    scenarios = {
        "a": Scenario("a", "baseline: no wasm filter", "2xx"),
        "b": Scenario("b", "filter, every request allowed (1,000,000/1 s)", "2xx"),
        "c": Scenario("c", "filter, every request rejected (1/1 h)", "4xx"),
        "d": Scenario("d", "filter failing open, Redis stopped", "2xx"),
        "e": Scenario("e", "filter, rule skipped: no Redis call", "2xx"),
    }
    progress(f"starting redis-server, webdis and {len(configs)} Envoys (--concurrency {CONCURRENCY})")
    for key, plugin in configs.items():
        envoy = h.Envoy(stack.workdir, plugin or h.plugin_config(h.rule()), webdis_port=stack.webdis.port,
                        upstream_port=stack.upstream.port, concurrency=CONCURRENCY, name=f"envoy-{key}")
        envoy.yaml_path.write_text(bench_envoy_yaml(envoy.yaml_path.read_text(), with_filter=plugin is not None))
        stack.envoys.append(envoy)  # stopped by Stack.close(), whatever happens
        envoy.start(wait_ready=False)
        scenarios[key].envoy = envoy
    for key in configs:
        scenarios[key].envoy.wait_ready()  # type: ignore[union-attr]
    scenarios["d"].envoy = scenarios["b"].envoy

    # (c) rejects from the second request of each user on: one allowed request per user first.
    rejecting = scenarios["c"].envoy
    assert rejecting is not None
    for user in range(USERS):
        status = rejecting.send(headers={"x-user-id": f"u{user}"}).status
        if status != 200:
            raise h.HarnessError(f"(c): the first request of u{user} got {status}, not 200")
    for key in configs:
        progress(f"warming up ({key}) for {WARM_UP_S} s")
        run_wrk(scenarios[key].envoy.port, WARM_UP_S, stack.workdir, f"warm-{key}")  # type: ignore[union-attr]

    def unloaded(key: str) -> None:
        scenario = scenarios[key]
        assert scenario.envoy is not None
        progress(f"({key}) {scenario.title}: one connection, {UNLOADED_S} s")
        scenario.unloaded = measured_run(scenario.envoy, stack, f"{key}-unloaded", UNLOADED_S, 1, 1)

    for round_index in range(ROUNDS):
        for key in configs:
            scenario = scenarios[key]
            assert scenario.envoy is not None
            progress(f"({key}) {scenario.title}: round {round_index + 1}/{ROUNDS}, {DURATION} s")
            scenario.runs.append(measured_run(scenario.envoy, stack, f"{key}-{round_index}"))
    for key in configs:
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
    return [scenarios[key] for key in "abcde"], check


def answers(run: GatewayRun) -> tuple[int, dict[str, int]]:
    classes = {cls: run.stat(f"downstream_rq_{cls}") for cls in ("2xx", "4xx", "5xx")}
    return sum(classes.values()), classes


def _answers_cell(s: Scenario, runs: list[GatewayRun]) -> str:
    total = sum(answers(r)[0] for r in runs)
    expected = sum(answers(r)[1][s.expect] for r in runs)
    socket_errors = sum(r.wrk.socket_errors for r in runs)
    cell = f"{100 * expected / total:.2f}% {s.expect}" if total else "none"
    return cell + (f", {socket_errors} socket errors" if socket_errors else "")


def print_gateway(scenarios: list[Scenario]) -> None:
    by_key = {s.key: s for s in scenarios}
    heading("1. Gateway overhead: the same Envoy with and without the filter")
    out(f"wrk -t{THREADS} -c{CONNECTIONS} -d{DURATION}s on 127.0.0.1, x-user-id cycling over {USERS} users; Envoy "
        f"--concurrency {CONCURRENCY}; the route answers itself (direct_response 200), so no upstream is measured.")
    out(f"Medians of {ROUNDS} runs per scenario (a, b, c, e interleaved; d after them, Redis stopped); spread = "
        "min-max over the runs. Latency in microseconds, closed loop: with every CPU busy it is mostly queueing.")
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

    out(f"Reading: at {CONNECTIONS} connections the filter adds, allowing, {delta('b')}; rejecting, {delta('c')}; "
        f"failing open, {delta('d')}; with no Redis call (e), {delta('e')}.")

    out()
    out(f"The same Envoys with one connection (wrk -t1 -c1 -d{UNLOADED_S}s, one run each): the latency of one "
        "request without queueing. One run: differences of a few tens of us are noise on a shared machine.")
    rows = []
    for s in scenarios:
        run = s.unloaded
        if run is None:
            continue
        rows.append([f"({s.key}) {s.title}", num(run.wrk.rps), num(run.wrk.p50), num(run.wrk.p90),
                     num(run.wrk.p99), _answers_cell(s, [run])])
    out(table(["scenario", "req/s", "p50", "p90", "p99", "answers"], rows))
    if all(by_key[key].unloaded is not None for key in "abce"):
        p50 = {key: by_key[key].unloaded.wrk.p50 for key in "abcde" if by_key[key].unloaded}  # type: ignore[union-attr]
        out(f"Reading: alone, a request through the filter takes {signed(p50['b'] - p50['a'])} us at p50 when allowed "
            f"and {signed(p50['c'] - p50['a'])} us when rejected; the filter without a Redis call "
            f"{signed(p50['e'] - p50['a'])} us: nearly all of it is the round trip Envoy -> webdis -> Redis -> back.")

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


def print_round_trips(scenarios: list[Scenario], check: str) -> None:
    heading("3. Redis round trips per request, counted by Redis through Envoy")
    out("During the runs of section 1: EVALSHA+EVAL calls in Redis's INFO commandstats / requests Envoy "
        "answered; the filter's own redis_calls counter / its decisions.")
    rows = []
    for s in [x for x in scenarios if x.key in "bce"]:
        requests = sum(answers(r)[0] for r in s.runs)
        scripts = sum(r.commands.get(name, {}).get("calls", 0) for r in s.runs
                      for name in ("cmdstat_evalsha", "cmdstat_eval"))
        evals = sum(r.commands.get("cmdstat_eval", {}).get("calls", 0) for r in s.runs)
        usec = sum(r.commands.get(name, {}).get("usec", 0) for r in s.runs
                   for name in ("cmdstat_evalsha", "cmdstat_eval"))
        decisions = sum(r.stat("allowed") + r.stat("rejected") for r in s.runs)
        calls = sum(r.stat("redis_calls") for r in s.runs)
        kind = {"b": "every request allowed", "c": "every request rejected", "e": "rule skipped (no key)"}[s.key]
        rows.append([
            f"({s.key}) {kind}",
            num(requests),
            num(scripts) + (f" ({evals} EVAL)" if evals else ""),
            f"{scripts / requests:.3f}" if requests else "-",
            "0" if s.key == "e" else "1",
            f"{calls / decisions:.3f}" if decisions else "-",
            f"{usec / scripts:.1f}" if scripts else "-",
        ])
    out(table(["scenario", "requests", "scripts run", "per request", "ideal", "filter calls/decision",
               "Redis us/script"], rows))
    per_request = {row[0][1]: row[3] for row in rows}
    out(f"Reading: {per_request.get('b', '-')} round trips per allowed request and {per_request.get('c', '-')} per "
        f"rejected request against the ideal 1, {per_request.get('e', '-')} when no rule applies; Redis us/script "
        f"is under the load of section 1 (compare section 2, alone). Checked: {check}.")


# ---------------------------------------------------------------------------------------------------------
# 2: Redis cost per decision


class Contender:
    """A script under test: how it is called and how its reply says "acquired"."""

    def __init__(self, label: str, slug: str, source: str, redisson: bool = False,
                 keep_alive_ms: int | None = None):
        self.label = label
        self.slug = slug  # in key names
        self.source = source
        self.redisson = redisson
        self.keep_alive_ms = keep_alive_ms  # ACQUIRE's ARGV[7]; None: the filter's default
        self.sha = ""

    def load(self, client: redis_py.Redis) -> None:
        self.sha = client.script_load(self.source)

    def keys(self, name: str) -> list[str]:
        """Redisson's five keys of a limiter (the same layout for both scripts)."""
        return [name, f"{{{name}}}:value", f"{{{name}}}:value:{CLIENT_ID}", f"{{{name}}}:permits",
                f"{{{name}}}:permits:{CLIENT_ID}"]

    def prepare(self, client: redis_py.Redis, name: str, rate: int, interval_ms: int) -> None:
        """Redisson: trySetRate once. ACQUIRE needs nothing: its first call creates the limiter, as in Envoy."""
        if self.redisson:
            client.eval(REDISSON_TRY_SET_RATE, 1, name, rate, interval_ms, 0)

    def argv(self, now_ms: int, random: bytes, rate: int, interval_ms: int) -> list[Any]:
        if self.redisson:
            return [1, now_ms, random]
        keep_alive = max(interval_ms, DEFAULT_KEEP_ALIVE_MS) if self.keep_alive_ms is None else self.keep_alive_ms
        return [1, now_ms, random, rate, interval_ms, 0, keep_alive, 0]

    def acquired(self, reply: Any) -> bool:
        if self.redisson:
            return reply is None
        return int(reply[0]) == 1


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


def measure_case(client: redis_py.Redis, raw: RespClient, contenders: list[Contender], case: Case, t0: int,
                 tag: str) -> dict[str, Measurement]:
    """The case for each contender on its own limiter, in ROUNDS chunks alternating which goes first."""
    state = {}
    for contender in contenders:
        name = f"bench:{tag}:{contender.slug}"
        keys = contender.keys(name)
        client.delete(*keys)
        contender.prepare(client, name, case.rate, case.interval_ms)
        fill(client, contender, keys, case, t0)
        state[contender.label] = keys
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
    return results


def burst_release(client: redis_py.Redis, contender: Contender, window: int, t0: int, tag: str) -> float:
    """Redis usec of the one acquire that releases a window of `window` permits all taken at t0."""
    case = Case("burst", window, 60_000, [0] * window, [], True)
    name = f"bench:{tag}:{contender.slug}"
    keys = contender.keys(name)
    client.delete(*keys)
    contender.prepare(client, name, window, case.interval_ms)
    fill(client, contender, keys, case, t0)
    client.config_resetstat()
    reply = client.evalsha(contender.sha, 5, *keys, *contender.argv(t0 + 60_000, os.urandom(16), window, 60_000))
    calls, usec, _ = commandstats(client)
    if calls != 1 or not contender.acquired(reply):
        raise h.HarnessError(f"burst release of {window}: {contender.label} did not acquire")
    if client.zcard(keys[3]) != 1:
        raise h.HarnessError(f"burst release of {window}: {contender.label} left {client.zcard(keys[3])} permits")
    client.delete(*keys)
    return usec


def run_redis_cost(redis: h.Redis) -> None:
    heading("2. Redis cost per decision: ACQUIRE vs Redisson's tryAcquire (baseline), same server and client")
    client = redis_py.Redis(host=h.HOST, port=redis.port, socket_timeout=30)  # set-up and INFO
    raw = RespClient(redis.port)  # the measured calls
    client.flushall()
    client.script_flush()
    acquire = acquire_source()
    contenders = [Contender("ACQUIRE (filter default)", "acquire", acquire),
                  Contender("ACQUIRE, keep_alive 0", "acquire0", acquire, keep_alive_ms=0),
                  Contender("Redisson (baseline)", "redisson", REDISSON_LUA.read_text(), redisson=True)]
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
        "every call is in the stated regime; checked). ACQUIRE runs as the filter calls it: by default "
        "keepAliveTime 1 h (3 PEXPIRE per call), and with keep_alive 0 (no PEXPIRE, as Redisson without "
        "expire). Redisson's limiter is created by its trySetRate once, before.")
    out("Redis us/call: INFO commandstats usec_per_call of EVALSHA (the whole script); cmds inside: commands "
        "the script ran per call. Client us: wall time of one call from a minimal RESP client (command encoded "
        "beforehand): loopback and Redis.")
    rows = []
    costs: list[tuple[str, list[float]]] = []
    client_p50: list[float] = []
    for index, case in enumerate(cases):
        progress(f"(2) {case.title}")
        results = measure_case(client, raw, contenders, case, t0 + index * 10_000_000, f"case{index}")
        for position, contender in enumerate(contenders):
            result = results[contender.label]
            walls = sorted(result.walls_ns)
            client_p50.append(percentile(walls, 50) / 1000)
            rows.append([
                case.title if position == 0 else "",
                contender.label,
                f"{result.redis_usec_total / result.calls:.1f}",
                spread(result.usec, 1),
                f"{median(result.inner):.1f}",
                f"{percentile(walls, 50) / 1000:.0f}",
                f"{percentile(walls, 99) / 1000:.0f}",
                f"{result.acquired:,}/{result.calls:,} acquired",
            ])
        costs.append((case.title.split(":")[0] + (", large window" if case.rate == 10_000 else ""),
                      [results[c.label].redis_usec_total / results[c.label].calls for c in contenders]))
    out(table(["case (the same for every script)", "script", "Redis us/call", "spread", "cmds inside",
               "client us p50", "p99", "decisions"], rows, left=2))
    out("Reading: Redis us per decision, ACQUIRE / keep_alive 0 / Redisson: "
        + "; ".join(f"{title} {mine:.1f} / {zero:.1f} / {theirs:.1f} ({mine / theirs:.2f}x)"
                    for title, (mine, zero, theirs) in costs)
        + ". ACQUIRE does more in its one call (creates a missing limiter, reads keepAliveTime, returns the "
          f"reset time, refreshes the TTLs). A call's wall time at the client (p50 {min(client_p50):.0f}-"
          f"{max(client_p50):.0f} us) is mostly the trip, not the script.")

    out()
    burst = [contenders[0], contenders[-1]]
    out(f"Growth with the window: one acquire that releases a whole window of W permits, all taken in one "
        f"burst one interval earlier (rate W/1 min); Redis us of that one call, median of {BURST_REPEATS}.")
    rows = []
    growth = []
    for window in (100, 1_000, 10_000):
        progress(f"(2) burst release of {num(window)} permits")
        timings: dict[str, list[float]] = {c.label: [] for c in burst}
        for repeat in range(BURST_REPEATS):
            for contender in burst if repeat % 2 == 0 else list(reversed(burst)):
                timings[contender.label].append(
                    burst_release(client, contender, window, t0 + 10**9 + repeat * 10**6, f"burst{window}"))
        mine, theirs = (median(timings[c.label]) for c in burst)
        growth.append((window, mine, theirs))
        rows.append([num(window), num(mine), spread(timings[burst[0].label]), num(theirs),
                     spread(timings[burst[1].label]), f"{mine / theirs:.2f}x", f"{1000 * mine / window:.0f}",
                     f"{1000 * theirs / window:.0f}"])
    out(table(["W (permits released)", "ACQUIRE us", "spread", "Redisson us", "spread", "ratio",
               "ACQUIRE ns/permit", "Redisson ns/permit"], rows))
    (w0, m0, r0), (w1, m1, r1) = growth[0], growth[-1]
    out(f"Reading: from W={num(w0)} to W={num(w1)} that call grows from {num(m0)} to {num(m1)} us (ACQUIRE) and "
        f"from {num(r0)} to {num(r1)} us (Redisson), about linearly: both scripts read every expired member "
        f"into Lua to sum its permits (the Redisson layout), and Redis serves no one else meanwhile.")
    raw.close()
    client.close()


# ---------------------------------------------------------------------------------------------------------
# 4: module size


def wasm_sections(path: Path) -> dict[str, int]:
    if not WASM_TOOLS.exists():
        return {}
    result = subprocess.run([str(WASM_TOOLS), "objdump", str(path)], capture_output=True, text=True,
                            check=False)
    sections = {}
    for line in result.stdout.splitlines():
        match = re.match(r"\s*(code|data|custom \"name\")\s*\|.*\|\s*(\d+) bytes", line)
        if match:
            sections[match.group(1).replace('custom "name"', "name")] = int(match.group(2))
    return sections


def print_sizes() -> None:
    heading("4. Module size: dist/*.wasm next to the budget of wasm-tools.toml")
    config = tomllib.loads((REPO / "wasm-tools.toml").read_text())
    default_budget = config.get("postbuild", {}).get("size_budget_bytes")
    rows = []
    used = []
    for path in sorted((REPO / "dist").glob("*.wasm")):
        profile = path.stem.removeprefix("edge-rate-limiter-")
        budget = config.get("artifact", {}).get(profile, {}).get("size_budget_bytes", default_budget)
        size = path.stat().st_size
        sections = wasm_sections(path)
        rows.append([f"dist/{path.name}", num(size), num(budget) if budget else "none",
                     f"{100 * size / budget:.0f}%" if budget else "-",
                     *(num(sections[name]) if name in sections else "?" for name in ("code", "data", "name"))])
        if budget:
            used.append((path.name, size, budget))
    out(table(["artifact", "bytes", "budget", "of budget", "code", "data", "name section"], rows))
    if used:
        name, size, budget = max(used, key=lambda item: item[1] / item[2])
        out(f"Reading: the largest share is {name} at {100 * size / budget:.0f}% of its budget "
            f"({num(budget - size)} bytes of room); the name section (kept for readable traps) is part of it.")


# ---------------------------------------------------------------------------------------------------------


def replay(build: str, config: dict, clusters: dict[str, int], requests: list[dict], workdir: Path) -> dict:
    """`wasm-host replay --json` of `requests` over 2 VMs: the emulator's summary (fuel, round trips...)."""
    config_path, requests_path = workdir / f"{build}.json", workdir / f"{build}-requests.jsonl"
    config_path.write_text(json.dumps(config))
    requests_path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    argv = [str(h.WASM_HOST_BIN), "replay", "--module", str(h.BUILDS[build]), "--config", str(config_path),
            "--vms", "2", "--requests", str(requests_path), "--json"]
    for name, port in clusters.items():
        argv += ["--cluster", f"{name}=127.0.0.1:{port}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise h.HarnessError(f"wasm-host replay ({build}) exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def run_guest_cost() -> None:
    """Section 5: guest cost (wasmtime fuel, about one unit per wasm instruction) and round trips per
    request of both builds in the host emulator, next to the same filter when no rule applies (baseline)."""
    heading("5. Guest cost per request in the host emulator: stock build vs Higress build")
    out("wasm-host replay, 2 VMs, one at a time; rule per-user, 50 per minute over 4 users: 400 requests (200 allowed,")
    out("200 rejected); baseline: the same 400 requests without the key header (the rule is skipped, no Redis call).")
    out("Fuel: wasmtime fuel consumed by every guest call for the request (callbacks included), about one per")
    out("wasm instruction: repeatable, unlike time. Round trips: HTTP calls to webdis (stock) or proxy_redis_call")
    out("(Higress) per request.")
    rule_ = h.rule(rate=50, interval="1m")
    decided = [{"headers": [["x-user-id", f"u{i % 4}"]]} for i in range(400)]
    skipped = [{"headers": [["x-other", "1"]]} for _ in range(400)]
    rows = []
    with h.Stack() as stack:
        stack.start()
        builds = {
            "envoy": (h.plugin_config(rule_), {"webdis": stack.webdis.port}, "http_calls_per_request"),
            "higress": (h.host_plugin_config(rule_), {"redis": stack.redis.port}, "redis_round_trips"),
        }
        for build, (config, clusters, trips_key) in builds.items():
            stack.redis.client.flushall()
            stack.redis.client.script_load(acquire_source())  # both builds start with the script cached
            result = replay(build, config, clusters, decided, stack.workdir)
            baseline = replay(build, config, clusters, skipped, stack.workdir)
            trips = result[trips_key]["per_request"] if trips_key == "redis_round_trips" else result[trips_key]
            rows.append([f"{build} ({h.BUILDS[build].name})", num(baseline["fuel_allowed"]["p50"] if baseline["fuel_allowed"]["count"] else 0),
                         num(result["fuel_allowed"]["p50"]), num(result["fuel_allowed"]["mean"]),
                         num(result["fuel_rejected"]["p50"]), num(result["fuel_rejected"]["mean"]),
                         f"{trips['mean']:.3f}", ", ".join(f"{n} {k}" for k, n in sorted(result["outcomes"].items()))])
    out(table(["build", "no rule (baseline) p50", "allowed p50", "allowed mean", "rejected p50", "rejected mean",
               "round trips/request", "outcomes"], rows))
    out("Reading: deciding a request costs the guest the difference between the allowed/rejected and baseline "
        "columns; the two builds differ only in their transport code.")


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
            print_sizes()
        if "5" in ONLY:
            run_guest_cost()
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
