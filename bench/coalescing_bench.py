"""Section 10 of `make bench` (bench/bench.py): request coalescing, the filter's defaults (`redis.max_batch`
32, `max_in_flight` 1: a VM's further acquire calls wait while one is in flight and go out together in one
ACQUIRE_BATCH script call) against `"max_batch": 1` (coalescing off: one script call per request, the
baseline), each measured in the same run.

(a) Throughput and cost, every request allowed: one Envoy at a time (--concurrency BENCH_CONCURRENCY, the
    route answering by direct_response as in section 1) under wrk -c BENCH_COALESCING_CONNECTIONS [32],
    x-user-id over 512 users (bench/users.lua), rule per-user 1,000,000 per 1 s: Envoy without the filter,
    the filter with max_batch 1 and with the defaults, BENCH_ROUNDS interleaved runs of BENCH_DURATION s.
    req/s and the ratio to no filter, Redis script calls per request (INFO commandstats EVALSHA + EVAL /
    requests answered), CPU microseconds per request by process (Envoy, webdis, Redis, wrk) and in all,
    p50/p99, the mean batch size (the filter's batched_calls / batches), next to the targets.
(b) One connection (wrk -t1 -c1, latency without queueing): p50 and p99 of the same three, BENCH_ROUNDS
    interleaved runs each; target: coalescing on within +10% of off at p50.
(c) Exactness: 2 Envoys x 2 workers per configuration, both loaded at once (each by its own wrk -t1 -c
    BENCH_COALESCING_CONNECTIONS over 64 users) far beyond one global limit of BENCH_LEASE_RATE per 1 s and
    under 64 per-user limits of 40 per 1 s (the global one binds), local block off so that every decision is
    Redis's (and goes in a batch): section 6's access-log measurement of every admitted request (with its
    user here), admitted per whole fixed window, the worst sliding window of the global limit and of any
    user's, Redis calls per admitted request, mean batch size.
(d) Guest cost: the Higress build in the host emulator (`wasm-host replay --concurrency 32`, 2 VMs), 4,000
    requests over 512 users, every one allowed: wasmtime fuel per request and Redis calls per request.

Every process comes from tests/e2e/harness.py (Envoy, redis-server, webdis, wrk; wasm-host as in section 5)
on 127.0.0.1 with free ports, stopped by PID when the section ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import bench as b  # bench/bench.py: settings, wrk, tables, CPU readers, the saturation tools of section 6
from bench import h, num, out, progress, table

CONNECTIONS = b._env_int("BENCH_COALESCING_CONNECTIONS", 32)
THREADS = min(b.THREADS, CONNECTIONS)
TIMEOUT = "500ms"  # the filter's Redis timeout, as in sections 1 and 6
UNLOADED_S = 2  # each one-connection run of (b)

# (a), (b): every request allowed.
ALLOWED_USERS = 512
ALLOWED_RATE = 1_000_000  # per user per 1 s, never reached

# (c): one global limit that binds and 64 per-user limits under it (64 x 40 = 2,560 per second > the rate).
SATURATED_USERS = 64
USER_RATE = 40
RATE = b.SATURATION_RATE  # BENCH_LEASE_RATE [1000] per INTERVAL_MS, as section 6 (b)
INTERVAL_MS = b.SATURATION_INTERVAL_MS
SATURATED_S = b.SATURATION_S
GATEWAYS, VMS = b.SATURATION_GATEWAYS, b.SATURATION_VMS
MARGIN_MS = b.TIMING_MARGIN_MS  # acquires stamped by different gateways a few ms apart (section 6)

# (d): the emulator.
REPLAY_REQUESTS = 4_000
REPLAY_CONCURRENCY = 32

# Targets (issue "Request coalescing").
RPS_TARGET = 0.45  # req/s of the filter with coalescing, x Envoy without the filter
SCRIPTS_TARGET = 0.25  # Redis script calls per allowed request
CPU_TARGET_US = 200.0  # CPU per allowed request, all processes
P50_TARGET = 1.10  # p50 with one connection, coalescing on / off
ADMITTED_TARGET = 0.99  # of the rate, every whole fixed window, with coalescing
FUEL_TARGET = 1.2  # guest fuel per request, coalescing on / off

# The access log of section 6 (b), each admitted request's start time followed by its user and "d" and its
# duration in ms (arrival to the last byte of the answer): b.read_admitted reads the times alone (each
# line's first word).
LOG_FORMAT = '"%START_TIME(%s%3f)%\\n"'
LOG_FORMAT_WITH_USER = '"%START_TIME(%s%3f)% %REQ(X-USER-ID)% d%DURATION%\\n"'


@dataclass(frozen=True)
class Config:
    """One row: `redis` is the plugin's `redis` overrides (None: Envoy without the filter)."""
    key: str
    title: str
    redis: dict[str, Any] | None


NONE = Config("none", "Envoy, no filter", None)
OFF = Config("off", "filter, max_batch 1 (coalescing off, baseline)", {"max_batch": 1})
ON = Config("on", "filter, defaults (coalescing on)", {})
# (a) and (b) only: the other setting of max_in_flight, for docs/configuration.md's "when to change".
TWO_IN_FLIGHT = Config("two", "filter, max_in_flight 2 (more, smaller batches)", {"max_in_flight": 2})
CONFIGS = [NONE, OFF, ON, TWO_IN_FLIGHT]


@contextlib.contextmanager
def wrk_users(users: int) -> Iterator[None]:
    """bench/users.lua (inside wrk) cycles x-user-id over BENCH_USERS users: `users` while in the block."""
    before = os.environ.get("BENCH_USERS")
    os.environ["BENCH_USERS"] = str(users)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("BENCH_USERS", None)
        else:
            os.environ["BENCH_USERS"] = before


def gateway(stack: h.Stack, name: str, plugin: dict, filters: str, concurrency: int,
            admitted_log: Path | None = None) -> h.Envoy:
    """An Envoy as in section 1 (the route answering itself; `filters`: "wasm" or "none"), started without
    waiting; with `admitted_log`, section 6's log of every admitted request, with its x-user-id."""
    envoy = h.Envoy(stack.workdir, plugin, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                    concurrency=concurrency, name=name)
    text = b.bench_envoy_yaml(envoy.yaml_path.read_text(), filters)
    if admitted_log is not None:
        text = b.with_admitted_log(text, admitted_log)
        if text.count(LOG_FORMAT) != 1:
            raise h.HarnessError("bench.ADMITTED_LOG changed: update LOG_FORMAT in bench/coalescing_bench.py")
        text = text.replace(LOG_FORMAT, LOG_FORMAT_WITH_USER)  # b.read_admitted reads the times alone
    envoy.yaml_path.write_text(text)
    stack.envoys.append(envoy)  # stopped by Stack.close(), whatever happens
    envoy.start(wait_ready=False)
    return envoy


def module_line(path: Path) -> str:
    """`dist/x.wasm sha256 0123456789ab, built 06:45:34 UTC`: which build a run measured."""
    if not path.is_file():
        return f"{path.name} missing"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(path.stat().st_mtime))
    name = path.relative_to(b.REPO) if path.is_relative_to(b.REPO) else path
    return f"{name} sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:12]}, built {stamp}"


def scripts(commands: dict[str, dict[str, Any]]) -> int:
    """EVALSHA + EVAL calls in an INFO commandstats reading."""
    return sum(int(commands.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))


def batch_size(batches: int, batched: int) -> str:
    return f"{batched / batches:.1f}" if batches else "- (no batch)"


def met(ok: bool) -> str:
    return "yes" if ok else "NO"


# ---------------------------------------------------------------------------------------------------------
# (a) and (b): every request allowed


@dataclass
class AllowedRow:
    config: Config
    scenario: b.Scenario  # runs at CONNECTIONS; b.answers(), b.scripts_run() read it
    alone: list[b.GatewayRun] = field(default_factory=list)  # one connection

    @property
    def runs(self) -> list[b.GatewayRun]:
        return self.scenario.runs

    def requests(self) -> int:
        return sum(b.answers(run)[0] for run in self.runs)

    def rps(self) -> float:
        return b.median(run.wrk.rps for run in self.runs)

    def stat(self, name: str) -> int:
        return sum(run.stat(name) for run in self.runs)

    def stat_alone(self, name: str) -> int:
        return sum(run.stat(name) for run in self.alone)

    def scripts_per_request(self) -> float:
        requests = self.requests()
        return b.scripts_run(self.scenario) / requests if requests else float("nan")

    def cpu_per_request(self) -> dict[str, float]:
        """CPU microseconds per answered request by process, and "total" (the four)."""
        requests = self.requests()
        if not requests:
            return {}
        cpu = {name: 1e6 * sum(run.cpu.get(name, 0.0) for run in self.runs) / requests for name in CPU_NAMES}
        cpu["total"] = sum(cpu.values())
        cpu["machine"] = 1e6 * sum(run.cpu.get("machine", 0.0) for run in self.runs) / requests
        return cpu


CPU_NAMES = ["Envoy", "webdis", "Redis", "wrk"]


def run_allowed(stack: h.Stack) -> list[AllowedRow]:
    rows = []
    for config in CONFIGS:
        plugin = h.plugin_config(h.rule("coalescing-allowed", rate=ALLOWED_RATE, interval="1s"), timeout=TIMEOUT,
                                 redis=config.redis)
        filters = "none" if config.redis is None else "wasm"
        envoy = gateway(stack, f"envoy-coalescing-{config.key}", plugin, filters, b.CONCURRENCY)
        rows.append(AllowedRow(config, b.Scenario(config.key, config.title, "2xx", envoy=envoy, filters=filters)))
    try:
        for row in rows:
            row.scenario.envoy.wait_ready()  # type: ignore[union-attr]
        with wrk_users(ALLOWED_USERS):
            for row in rows:
                progress(f"(10a) warming up {row.config.key} for {b.WARM_UP_S} s")
                b.run_wrk(row.scenario.envoy.port, b.WARM_UP_S, stack.workdir,  # type: ignore[union-attr]
                          f"warm-coalescing-{row.config.key}", CONNECTIONS, THREADS)
            for round_index in range(b.ROUNDS):
                for row in rows:
                    progress(f"(10a) {row.config.title}: round {round_index + 1}/{b.ROUNDS}, {b.DURATION} s")
                    row.runs.append(b.measured_run(row.scenario.envoy, stack,  # type: ignore[arg-type]
                                                   f"coalescing-{row.config.key}-{round_index}", b.DURATION,
                                                   CONNECTIONS, THREADS))
            for round_index in range(b.ROUNDS):
                for row in rows:
                    progress(f"(10b) {row.config.title}: one connection, round {round_index + 1}/{b.ROUNDS}, "
                             f"{UNLOADED_S} s")
                    row.alone.append(b.measured_run(row.scenario.envoy, stack,  # type: ignore[arg-type]
                                                    f"coalescing-{row.config.key}-alone-{round_index}",
                                                    UNLOADED_S, 1, 1))
    finally:
        stack.stop_envoys()
    return rows


def print_allowed(rows: list[AllowedRow]) -> None:
    by_key = {row.config.key: row for row in rows}
    base, off, on = by_key["none"], by_key["off"], by_key["on"]
    out(f"(a) Every request allowed: rule per-user {num(ALLOWED_RATE)} per 1 s (never reached), x-user-id over "
        f"{ALLOWED_USERS} users (bench/users.lua); one Envoy at a time, --concurrency {b.CONCURRENCY}, the route "
        f"answering itself (direct_response 200); wrk -t{THREADS} -c{CONNECTIONS} -d{b.DURATION}s; medians of "
        f"{b.ROUNDS} interleaved runs (spread min-max). Scripts/req: EVALSHA+EVAL in Redis's INFO commandstats / "
        "requests answered; CPU: microseconds per answered request by process (/proc/PID/stat; wrk by rusage), "
        "total = the four; mean batch: the filter's batched_calls / batches. Latency in microseconds.")
    rows_out = []
    for row in rows:
        cpu = row.cpu_per_request()
        rows_out.append([
            row.config.title, num(row.rps()), b.spread([run.wrk.rps for run in row.runs]),
            f"{row.rps() / base.rps():.2f}", f"{row.scripts_per_request():.3f}",
            *(f"{cpu.get(name, 0.0):.1f}" for name in CPU_NAMES), f"{cpu.get('total', 0.0):.1f}",
            num(b.median(run.wrk.p50 for run in row.runs)), num(b.median(run.wrk.p99 for run in row.runs)),
            batch_size(row.stat("batches"), row.stat("batched_calls")) if row.config.redis is not None else "-",
            b._answers_cell(row.scenario, row.runs),
        ])
    out(table(["gateway", "req/s", "req/s spread", "vs no filter", "scripts/req"]
              + [f"{name} us" for name in CPU_NAMES]
              + ["total us", "p50", "p99", "mean batch", "answers"], rows_out))
    ratio = {row.config.key: row.rps() / base.rps() for row in (off, on)}
    calls = {row.config.key: row.scripts_per_request() for row in (off, on)}
    cpu = {row.config.key: row.cpu_per_request().get("total", float("nan")) for row in (off, on)}
    out()
    out(table(["target (a)", "coalescing off (baseline)", "coalescing on", "target", "met"], [
        ["req/s vs Envoy without the filter", f"{ratio['off']:.2f}x", f"{ratio['on']:.2f}x",
         f">= {RPS_TARGET:.2f}x", met(ratio["on"] >= RPS_TARGET)],
        ["Redis script calls per request", f"{calls['off']:.3f}", f"{calls['on']:.3f}", f"<= {SCRIPTS_TARGET:.2f}",
         met(calls["on"] <= SCRIPTS_TARGET)],
        ["CPU per allowed request, all processes (us)", f"{cpu['off']:.0f}", f"{cpu['on']:.0f}",
         f"<= {CPU_TARGET_US:.0f}", met(cpu["on"] <= CPU_TARGET_US)],
    ]))
    machine = {row.config.key: row.cpu_per_request().get("machine", float("nan")) for row in rows}
    mean_batch = batch_size(on.stat("batches"), on.stat("batched_calls"))
    out(f"Reading: with coalescing the filter serves {on.rps() / off.rps():.2f}x the req/s of coalescing off with "
        f"{calls['on'] / calls['off']:.2f}x its script calls per request ({mean_batch} requests per batch) and "
        f"{cpu['on'] - cpu['off']:+.0f} us of CPU per request (Envoy "
        f"{on.cpu_per_request().get('Envoy', 0) - off.cpu_per_request().get('Envoy', 0):+.0f}, webdis "
        f"{on.cpu_per_request().get('webdis', 0) - off.cpu_per_request().get('webdis', 0):+.0f}, Redis "
        f"{on.cpu_per_request().get('Redis', 0) - off.cpu_per_request().get('Redis', 0):+.0f} us); Envoy "
        f"without the filter uses {base.cpu_per_request().get('total', 0):.0f} us per request. The whole machine "
        f"(other work included) was busy {machine['none']:.0f} / {machine['off']:.0f} / {machine['on']:.0f} us per "
        "request (no filter / off / on). With coalescing off, "
        + ("no batch was sent (as configured)." if off.stat("batches") == 0
           else f"{num(off.stat('batches'))} batches were sent: max_batch 1 was NOT applied."))


def print_alone(rows: list[AllowedRow]) -> None:
    out()
    out(f"(b) One connection (wrk -t1 -c1 -d{UNLOADED_S}s, latency without queueing): the same three Envoys, "
        f"{b.ROUNDS} interleaved runs each, medians (spread min-max); microseconds. One request at a time never "
        "waits for a batch: what remains is the cost of the coalescing bookkeeping on the lone call's path.")
    rows_out = []
    for row in rows:
        runs = row.alone
        rows_out.append([row.config.title, num(b.median(run.wrk.rps for run in runs)),
                         num(b.median(run.wrk.p50 for run in runs)), b.spread([run.wrk.p50 for run in runs]),
                         num(b.median(run.wrk.p99 for run in runs)), b.spread([run.wrk.p99 for run in runs]),
                         batch_size(row.stat_alone("batches"), row.stat_alone("batched_calls"))
                         if row.config.redis is not None else "-"])
    out(table(["gateway", "req/s", "p50", "p50 spread", "p99", "p99 spread", "mean batch"], rows_out))
    by_key = {row.config.key: row for row in rows}
    p50 = {key: b.median(run.wrk.p50 for run in by_key[key].alone) for key in by_key}
    ratio = p50["on"] / p50["off"] if p50["off"] else float("nan")
    out()
    out(table(["target (b)", "coalescing off (baseline)", "coalescing on", "on / off", "target", "met"], [
        ["p50 with one connection (us)", num(p50["off"]), num(p50["on"]), f"{ratio:.2f}", f"<= {P50_TARGET:.2f}",
         met(ratio <= P50_TARGET)],
    ]))
    out(f"Reading: alone, a request through the filter takes {p50['off'] - p50['none']:+,.0f} us (off) and "
        f"{p50['on'] - p50['none']:+,.0f} us (on) over Envoy without the filter at p50; differences of a few tens "
        "of us are within the noise of a shared machine.")



# ---------------------------------------------------------------------------------------------------------
# (c) Exactness under coalescing


@dataclass
class SaturatedRow:
    config: Config
    run: b.SaturationRun
    by_user: dict[str, list[int]]  # admitted start times (epoch ms) per x-user-id, sorted
    waits: list[int]  # the admitted requests' durations (ms), sorted
    global_rule: str
    user_rule: str


def stamps(run: b.SaturationRun) -> list[int]:
    """The global limiter's permits taken during the load, by the filter's own stamps: the scores (epoch ms,
    the time the filter read before the call) of the permit members b.saturate saw in Redis, one per permit."""
    return sorted(score for score, permits in run.members.values() if score >= run.start_ms
                  for _ in range(permits))


def read_by_user(logs: list[Path], since_ms: int) -> tuple[dict[str, list[int]], list[int]]:
    """From the access logs (lines "<epoch ms> <x-user-id> d<duration ms>"): the admitted requests' start
    times per user, and their durations."""
    by_user: dict[str, list[int]] = {}
    waits = []
    for log in logs:
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) >= since_ms:
                by_user.setdefault(parts[1], []).append(int(parts[0]))
                waits.append(int(parts[2][1:]) if parts[2][1:].isdigit() else -1)
    return {user: sorted(times) for user, times in by_user.items()}, sorted(waits)


def run_saturated(stack: h.Stack) -> list[SaturatedRow]:
    rows = []
    for config in (OFF, ON):
        global_rule, user_rule = f"coalescing-global-{config.key}", f"coalescing-user-{config.key}"
        plugin = h.plugin_config(
            h.rule(global_rule, limit_by="global", rate=RATE, interval=f"{INTERVAL_MS}ms", local_block_max=0),
            h.rule(user_rule, rate=USER_RATE, interval=f"{INTERVAL_MS}ms", local_block_max=0),
            timeout=TIMEOUT, redis=config.redis)
        logs = [stack.workdir / f"admitted-coalescing-{config.key}-{i}.log" for i in range(GATEWAYS)]
        try:
            envoys = [gateway(stack, f"envoy-coalescing-sat-{config.key}-{i}", plugin, "wasm", VMS, log)
                      for i, log in enumerate(logs)]
            for envoy in envoys:
                envoy.wait_ready()
            with wrk_users(SATURATED_USERS):
                progress(f"(10c) {config.title}: warming up {b.WARM_UP_S} s, then {SATURATED_S} s on {GATEWAYS} "
                         "gateways at once")
                for started in [b.start_wrk(e.port, b.WARM_UP_S, stack.workdir,
                                            f"warm-coalescing-sat-{config.key}-{i}", CONNECTIONS, 1)
                                for i, e in enumerate(envoys)]:
                    b.finish_wrk(started, b.WARM_UP_S)
                permits_key = h.limiter_key(h.limiter_name(f"erl:{global_rule}"), "permits")
                # Requests in flight when wrk stops make the allowed counter and the logs differ by a few
                # (b.saturate): both are shown.
                run = b.saturate(stack, envoys, logs, f"coalescing-sat-{config.key}", SATURATED_S, permits_key,
                                 CONNECTIONS, slack=GATEWAYS * CONNECTIONS)
            # The sampler read the members every 100 ms until the load ended; those taken since are still there.
            for member, score in stack.redis.client.zrange(permits_key, 0, -1, withscores=True):
                permit = h.decode_permit(member, score)
                run.members.setdefault(permit.random, (int(score), permit.permits))
            by_user, waits = read_by_user(logs, run.start_ms)
            named = sum(len(times) for times in by_user.values())
            if named != len(run.admitted):
                raise h.HarnessError(f"(10c) {config.key}: the access logs name a user for {named} of "
                                     f"{len(run.admitted)} admitted requests")
            rows.append(SaturatedRow(config, run, by_user, waits, global_rule, user_rule))
        finally:
            stack.stop_envoys()
    return rows


def print_saturated(rows: list[SaturatedRow]) -> None:
    out()
    out(f"(c) Exactness: {GATEWAYS} Envoys x {VMS} workers on one Redis (through webdis) per configuration, two "
        f"rules, local block off (every decision is Redis's, so every one can go in a batch): one global limit of "
        f"{num(RATE)} per {INTERVAL_MS} ms and a per-user limit of {USER_RATE} per {INTERVAL_MS} ms ({SATURATED_USERS} "
        f"users x {USER_RATE} = {num(SATURATED_USERS * USER_RATE)} > {num(RATE)}: the global limit binds). Both "
        f"gateways loaded at once, each by its own wrk -t1 -c{CONNECTIONS} over {SATURATED_USERS} users, for "
        f"{SATURATED_S} s after a {b.WARM_UP_S} s warm-up; one run per configuration. Admitted: every request "
        "answered 200, from each Envoy's access log with its START_TIME (epoch ms), x-user-id and DURATION, as in "
        "section 6 (b) (checked against the filter's allowed counter: equal but for requests in flight when wrk "
        "stops). Fixed windows: the whole windows of the clock's "
        "grid inside the load; sliding: every window starting at an admitted request. Redis calls: the filter's "
        "redis_calls (a batch once) / allowed.")
    off, on = rows[0], rows[1]

    def demand(run: b.SaturationRun) -> float:
        return sum(r.requests for r in run.wrk) / ((run.end_ms - run.start_ms) / 1000)

    def share(value: float, rate: int = RATE) -> str:
        return f"{num(value)} ({100 * value / rate:.1f}%)"

    def windows(row: SaturatedRow, pick: Any) -> str:
        counts = row.run.counts()
        return share(pick(counts)) if counts else "-"

    def worst(row: SaturatedRow, width: int) -> tuple[int, str]:
        most, at = b.max_in_sliding_window(row.run.admitted, width)
        return most, f"{num(most)} (at +{(at - row.run.start_ms) / 1000:.1f} s)"

    def worst_user(row: SaturatedRow, width: int) -> tuple[int, str]:
        found = [(b.max_in_sliding_window(times, width)[0], user) for user, times in row.by_user.items()]
        if not found:
            return 0, "-"
        most, user = max(found)
        return most, f"{most} ({user}; {100 * most / USER_RATE:.0f}% of {USER_RATE})"

    def margin(times: list[int]) -> str:
        needed = b.margin_needed(times, RATE, INTERVAL_MS)
        return "> 50 ms" if needed is None else f"{needed} ms"

    def worst_stamps(row: SaturatedRow) -> tuple[int, str]:
        most, at = b.max_in_sliding_window(stamps(row.run), INTERVAL_MS)
        return most, f"{num(most)} (at +{(at - row.run.start_ms) / 1000:.1f} s)" if most else "-"

    def per_admitted(row: SaturatedRow, value: float) -> str:
        allowed = row.run.stat("allowed")
        return f"{value / allowed:.3f}" if allowed else "-"

    def outcomes(row: SaturatedRow) -> str:
        stat = row.run.stat
        return (f"{num(stat('allowed'))} / {num(stat('rejected'))} (global "
                f"{num(stat(f'rule.{row.global_rule}.rejected'))}, per user "
                f"{num(stat(f'rule.{row.user_rule}.rejected'))})")

    counts_on = on.run.counts()
    min_on = min(counts_on) / RATE if counts_on else float("nan")
    within_on = b.max_in_sliding_window(on.run.admitted, INTERVAL_MS - MARGIN_MS)[0]
    user_within_on = worst_user(on, INTERVAL_MS - MARGIN_MS)[0]
    failed = {row.config.key: row.run.stat("failure_allowed") + row.run.stat("failure_denied")
              + row.run.stat("redis_errors") for row in rows}
    rows_out = [
        ["demand: answers/s, both gateways (x the rate)",
         *(f"{num(demand(r.run))} ({demand(r.run) * INTERVAL_MS / 1000 / RATE:.1f}x)" for r in rows),
         "far beyond the rate", met(min(demand(r.run) for r in rows) * INTERVAL_MS / 1000 >= 1.5 * RATE)],
        ["admitted per whole fixed window: min (of the rate)", windows(off, min), windows(on, min),
         f">= {ADMITTED_TARGET:.0%} with coalescing", met(min_on >= ADMITTED_TARGET)],
        ["admitted per whole fixed window: mean", windows(off, statistics.mean), windows(on, statistics.mean),
         "-", "-"],
        ["admitted per whole fixed window: max", windows(off, max), windows(on, max), "-", "-"],
        [f"worst sliding {INTERVAL_MS} ms window (max admitted)", worst(off, INTERVAL_MS)[1],
         worst(on, INTERVAL_MS)[1], f"<= {num(RATE)}", "see below"],
        [f"worst sliding {INTERVAL_MS - MARGIN_MS} ms window ({MARGIN_MS} ms of client clock)",
         worst(off, INTERVAL_MS - MARGIN_MS)[1], worst(on, INTERVAL_MS - MARGIN_MS)[1], f"<= {num(RATE)}",
         met(within_on <= RATE)],
        ["margin the rate needs (every window narrower by it holds <= rate)", margin(off.run.admitted),
         margin(on.run.admitted), f"<= {MARGIN_MS} ms", "-"],
        ["global permits taken in Redis during the load / allowed (in flight at the end: taken, not answered)",
         *(f"{num(len(stamps(r.run)))} / {num(r.run.stat('allowed'))}" for r in rows), "-", "-"],
        [f"worst sliding {INTERVAL_MS} ms window of the filter's stamps (permit scores)", worst_stamps(off)[1],
         worst_stamps(on)[1], f"<= {num(RATE)}", "see below"],
        ["margin the rate needs, by the stamps", margin(stamps(off.run)), margin(stamps(on.run)), "-", "-"],
        [f"worst per-user sliding {INTERVAL_MS} ms window", worst_user(off, INTERVAL_MS)[1],
         worst_user(on, INTERVAL_MS)[1], f"<= {USER_RATE}", "see below"],
        [f"worst per-user sliding {INTERVAL_MS - MARGIN_MS} ms window", worst_user(off, INTERVAL_MS - MARGIN_MS)[1],
         worst_user(on, INTERVAL_MS - MARGIN_MS)[1], f"<= {USER_RATE}", met(user_within_on <= USER_RATE)],
        ["admitted requests' time, arrival to answer (access log DURATION): p50 / p99 / max ms",
         *(f"{b.percentile(r.waits, 50):.0f} / {b.percentile(r.waits, 99):.0f} / {max(r.waits, default=0)}"
           for r in rows), "-", "-"],
        ["users admitted", *(f"{len(r.by_user)} of {SATURATED_USERS}" for r in rows), "-", "-"],
        ["allowed (filter counter) / answered 200 (access logs; in flight at the end: a few apart)",
         *(f"{num(r.run.stat('allowed'))} / {num(len(r.run.admitted))}" for r in rows), "-", "-"],
        ["Redis calls per admitted request (filter counters)",
         *(per_admitted(r, r.run.stat("redis_calls")) for r in rows), "-", "-"],
        ["scripts Redis ran per admitted request (commandstats)", *(per_admitted(r, r.run.scripts) for r in rows),
         "-", "-"],
        ["mean batch size (batched_calls / batches)",
         *(batch_size(r.run.stat("batches"), r.run.stat("batched_calls")) for r in rows), "-", "-"],
        ["allowed / rejected (by rule)", outcomes(off), outcomes(on), "-", "-"],
        ["Redis errors, failed open or closed", *(num(failed[r.config.key]) for r in rows), "0",
         met(failed["on"] == 0)],
    ]
    out(table(["measure (c)", "coalescing off (baseline)", "coalescing on", "target", "met"], rows_out))
    out("Admitted per whole fixed window, in order:")
    for row in rows:
        out(f"  {row.config.key + ':':5} " + " ".join(num(n) for n in row.run.counts())
            + "; Redis calls per allowed request by window "
            + " ".join(f"{c:.2f}" for c in row.run.calls_per_window()))
    out(f"Reading: under coalescing ({batch_size(on.run.stat('batches'), on.run.stat('batched_calls'))} requests per "
        f"batch) every whole window admitted {windows(on, min)} to {windows(on, max)} of the rate, against "
        f"{windows(off, min)} to {windows(off, max)} without; Redis calls per admitted request "
        f"{per_admitted(on, on.run.stat('redis_calls'))} against {per_admitted(off, off.run.stat('redis_calls'))}. "
        f"No user came near its own limit (worst {worst_user(on, INTERVAL_MS)[0]} of {USER_RATE}; "
        f"{num(on.run.stat(f'rule.{on.user_rule}.rejected'))} per-user rejections): the global limit decided, and "
        "each request's per-user permit was taken only with its global one (all or nothing). "
        f"The worst sliding window held {worst(on, INTERVAL_MS)[0]:,} with coalescing and "
        f"{worst(off, INTERVAL_MS)[0]:,} without by the access log, {worst_stamps(on)[0]:,} and "
        f"{worst_stamps(off)[0]:,} by the filter's own stamps (the permits' scores in Redis), and needed margins "
        f"of {margin(stamps(on.run))} and {margin(stamps(off.run))} (by the stamps); admitted requests took up to "
        f"{max(on.waits, default=0)} ms and {max(off.waits, default=0)} ms from arrival to answer. A sliding "
        "window may hold a few more than the rate in both: the filter stamps a call when its request arrives, "
        "and calls stamped a few ms apart (by different gateways, or while one waits in its VM's queue or in a "
        "busy worker) can reach Redis in the other order; Redisson's limiter releases permits by the stamp it is "
        "given (section 6). Narrowed by the margin shown, every window holds at most the rate.")


# ---------------------------------------------------------------------------------------------------------
# (d) Guest cost in the emulator

PROFILE_TOTAL = re.compile(r"total ([0-9.]+) = requests ([0-9.]+) \+ outside any request")


@dataclass
class ReplayRow:
    config: Config
    summary: dict[str, Any]
    fuel_total: float  # all guest fuel during the requests (the function profile's total) per request
    scripts: int  # EVALSHA + EVAL Redis ran

    def metric(self, name: str) -> int:
        return int(self.summary.get("metrics", {}).get(f"{h.EMULATOR_METRIC_PREFIX}{name}", 0))


def run_guest_cost(stack: h.Stack) -> list[ReplayRow]:
    requests = [{"headers": [["x-user-id", f"u{i % ALLOWED_USERS}"]]} for i in range(REPLAY_REQUESTS)]
    warm = requests[:2 * REPLAY_CONCURRENCY]
    args = ["--concurrency", str(REPLAY_CONCURRENCY)]
    clusters = {"redis": stack.redis.port}
    rows = []
    for config in (OFF, ON):
        plugin = h.host_plugin_config(h.rule("coalescing-replay", rate=ALLOWED_RATE, interval="1s"), timeout=TIMEOUT,
                                      redis=config.redis)
        stack.redis.client.flushall()
        progress(f"(10d) {config.title}: wasm-host replay, {num(REPLAY_REQUESTS)} requests, --concurrency "
                 f"{REPLAY_CONCURRENCY}")
        # A first replay loads the scripts into Redis (NOSCRIPT then EVAL) and the module into the compile cache.
        b.replay_output("higress", plugin, clusters, warm, stack.workdir, args)
        stack.redis.client.config_resetstat()
        summary, stderr = b.replay_output("higress", plugin, clusters, requests, stack.workdir,
                                          args + ["--function-profile"])
        match = PROFILE_TOTAL.search(stderr)
        if match is None:
            raise h.HarnessError(f"wasm-host replay --function-profile printed no total:\n{stderr[-2000:]}")
        rows.append(ReplayRow(config, summary, float(match.group(1)),
                              scripts(stack.redis.client.info("commandstats"))))
    return rows


def print_guest_cost(rows: list[ReplayRow]) -> None:
    out()
    out(f"(d) Guest cost: the Higress build ({h.WASM_HIGRESS.name}, Redis through the host's client) in the host "
        f"emulator, wasm-host replay --vms 2 --concurrency {REPLAY_CONCURRENCY} ({REPLAY_CONCURRENCY} requests "
        f"started together, then the next {REPLAY_CONCURRENCY}), {num(REPLAY_REQUESTS)} requests over "
        f"{ALLOWED_USERS} users, rule per-user {num(ALLOWED_RATE)} per 1 s (every request allowed), after a warm-up "
        "replay that loads the scripts. Fuel: wasmtime fuel, about one per wasm instruction. Attributed: the "
        "emulator's per-request figures (as section 5's), which charge a reply's callback to the request that "
        "sent the call; a batch is sent from the callback of an earlier reply, on behalf of the request that "
        "reply answered, and its own reply comes after that request has ended, so the fuel of decoding it and "
        "deciding its requests is in no request's figure. All: the function profile's total (every guest call "
        "during the replay, ticks and such late callbacks included; wasm-host --function-profile, exact) / "
        "requests, the measure of the target. Redis calls: the filter's redis_calls / requests; scripts: "
        "EVALSHA+EVAL Redis ran / requests.")
    rows_out = []
    for row in rows:
        fuel, requests = row.summary["fuel_allowed"], row.summary["requests"]
        rows_out.append([
            row.config.title, num(requests), num(fuel["p50"]), num(fuel["mean"]), num(row.fuel_total),
            f"{row.metric('redis_calls') / requests:.3f}", f"{row.scripts / requests:.3f}",
            batch_size(row.metric("batches"), row.metric("batched_calls")),
            ", ".join(f"{n} {k}" for k, n in sorted(row.summary["outcomes"].items())),
        ])
    out(table(["build: Higress", "requests", "fuel p50 (attributed)", "fuel mean (attributed)",
               "fuel per request (all)", "Redis calls/req", "scripts/req", "mean batch", "outcomes"], rows_out))
    off, on = rows
    ratio = on.fuel_total / off.fuel_total
    out()
    out(table(["target (d)", "coalescing off (baseline)", "coalescing on", "on / off", "target", "met"], [
        ["guest fuel per request (all guest fuel / requests)", num(off.fuel_total), num(on.fuel_total),
         f"{ratio:.2f}x", f"<= {FUEL_TARGET:.1f}x", met(ratio <= FUEL_TARGET)],
        ["guest fuel per request, p50 as attributed (for reference)", num(off.summary["fuel_allowed"]["p50"]),
         num(on.summary["fuel_allowed"]["p50"]),
         f"{on.summary['fuel_allowed']['p50'] / off.summary['fuel_allowed']['p50']:.2f}x", "-", "-"],
    ]))
    out(f"Reading: with coalescing the guest spends {on.fuel_total - off.fuel_total:+,.0f} fuel per request "
        f"({ratio:.2f}x) for {on.metric('redis_calls') / on.summary['requests']:.3f} Redis calls per request instead "
        f"of {off.metric('redis_calls') / off.summary['requests']:.3f}: encoding each batch and splitting its reply "
        "come on top of each request's own call; the attributed p50 falls because most requests no longer receive "
        "a reply of their own.")


# ---------------------------------------------------------------------------------------------------------


def run_coalescing() -> None:
    """Section 10: request coalescing (the defaults) against max_batch 1 (the baseline) and Envoy alone."""
    b.heading("10. Request coalescing: the defaults (max_batch 32, max_in_flight 1) vs max_batch 1 (off, baseline)")
    modules = "; ".join(module_line(path) for path in (h.WASM, h.WASM_HIGRESS))
    out(f"modules   {modules}")
    with h.Stack() as stack:
        stack.start()
        progress(f"(10) starting {len(CONFIGS)} Envoys (--concurrency {b.CONCURRENCY})")
        allowed = run_allowed(stack)
        progress(f"(10c) starting {GATEWAYS} Envoys x {VMS} workers per configuration")
        saturated = run_saturated(stack)
        stack.webdis.stop()
        missing = [path for path in (h.WASM_HOST_BIN, h.WASM_HIGRESS) if not path.is_file()]
        guest = run_guest_cost(stack) if not missing else []
    print_allowed(allowed)
    print_alone(allowed)
    print_saturated(saturated)
    if guest:
        print_guest_cost(guest)
    else:
        out()
        out(f"(d) Skipped: no {' and no '.join(str(path) for path in missing)} (make bench builds both).")
    after = "; ".join(module_line(path) for path in (h.WASM, h.WASM_HIGRESS))
    if after != modules:
        out(f"WARNING: the modules changed during the section (now {after}): rows started after the change "
            "measured the new build.")
