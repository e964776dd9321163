"""Section 12 of `make bench` (bench/bench.py): what an in-flight rule (`max_in_flight`) costs per request next
to a rate rule, in the same run (issue 31's target: at most 1.3x a rate rule's CPU per request).

One Envoy at a time (--concurrency BENCH_CONCURRENCY, the route answering by direct_response as in section
1, so each request ends as soon as it is decided: the in-flight rule's permit is taken and given back for
every request) under wrk -c8 and -c32 (BENCH_INFLIGHT_CONNECTIONS), x-user-id over 64 users
(bench/users.lua): Envoy without the filter (the baseline), a per-user rate rule of 1,000,000 per 1 s (never
reached), and a per-user in-flight rule of 1,000,000 (never reached; lease 30 s). BENCH_ROUNDS interleaved
runs of BENCH_DURATION s each: req/s, CPU microseconds per request by process (Envoy, webdis, Redis, wrk) and
in all, Redis calls (script calls) per request. The in-flight rule's permits leave in one call per request
(SEMAPHORE_ACQUIRE; with a rate rule too, in the same call as its rate acquire) and go back with the next
acquire call of their destination (a SEMAPHORE_RELEASE segment of its batch), or from the tick when none
leaves within two ticks; its leases are extended every 10 s, which at these request lengths never happens.

Every process comes from tests/e2e/harness.py, on 127.0.0.1 with free ports, stopped by PID when the section
ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import bench as b  # bench/bench.py: settings, wrk, tables, CPU readers
import coalescing_bench as c  # the gateway of section 1 with the users of bench/users.lua
from bench import h, num, out, progress, table

LOADS = [int(part) for part in b.os.environ.get("BENCH_INFLIGHT_CONNECTIONS", "8,32").split(",") if part.strip()]
USERS = 64
HUGE = 1_000_000
TARGET = 1.3  # CPU per request, in-flight rule / rate rule
CPU_NAMES = ["Envoy", "webdis", "Redis", "wrk"]


@dataclass
class Row:
    key: str
    title: str
    plugin: dict | None
    runs: dict[int, list[b.GatewayRun]] = field(default_factory=dict)

    def requests(self, load: int) -> int:
        return sum(b.answers(run)[0] for run in self.runs.get(load, []))

    def cpu_us(self, load: int) -> dict[str, float]:
        requests = self.requests(load)
        if not requests:
            return {}
        runs = self.runs[load]
        cpu = {name: 1e6 * sum(run.cpu.get(name, 0.0) for run in runs) / requests for name in CPU_NAMES}
        cpu["total"] = sum(cpu.values())
        cpu["gateway"] = cpu["total"] - cpu["wrk"]
        return cpu

    def calls(self, load: int) -> float:
        requests = self.requests(load)
        scripts = sum(sum(run.commands.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
                      for run in self.runs.get(load, []))
        return scripts / requests if requests else float("nan")

    def rps(self, load: int) -> float:
        return b.median(run.wrk.rps for run in self.runs.get(load, [])) if self.runs.get(load) else 0.0


def rows() -> list[Row]:
    rate = h.rule("per-user", rate=HUGE, interval="1s")
    inflight = {"name": "per-user-inflight", "limit_by": {"header": "x-user-id"}, "max_in_flight": HUGE,
                "lease": "30s"}
    return [
        Row("none", "Envoy, no filter (baseline)", None),
        Row("rate", "a rate rule (per user, 1,000,000 per 1 s)", h.plugin_config(rate, timeout=c.TIMEOUT)),
        Row("inflight", "an in-flight rule (per user, 1,000,000 at once)", h.plugin_config(inflight, timeout=c.TIMEOUT)),
        Row("both", "both rules on each request", h.plugin_config(rate, inflight, timeout=c.TIMEOUT)),
    ]


def run_inflight() -> None:
    """Section 12: an in-flight rule's CPU per request against a rate rule's, at each load."""
    b.heading("12. In-flight rules: CPU per request against a rate rule (same run)")
    out(f"module    {c.module_line(h.WASM)}")
    measured = rows()
    with h.Stack() as stack:
        stack.start()
        envoys = {}
        for row in measured:
            plugin = row.plugin or h.plugin_config(h.rule("unused"), timeout=c.TIMEOUT)
            filters = "none" if row.plugin is None else "wasm"
            envoys[row.key] = c.gateway(stack, f"envoy-inflight-{row.key}", plugin, filters, b.CONCURRENCY)
        for envoy in envoys.values():
            envoy.wait_ready()
        with c.wrk_users(USERS):
            for load in LOADS:
                threads = min(b.THREADS, load)
                for row in measured:
                    progress(f"(12 -c{load}) warming up {row.key} for {b.WARM_UP_S} s")
                    b.run_wrk(envoys[row.key].port, b.WARM_UP_S, stack.workdir, f"warm-inflight-{row.key}", load,
                              threads)
                for round_index in range(b.ROUNDS):
                    for row in measured:
                        progress(f"(12 -c{load}) {row.title}: round {round_index + 1}/{b.ROUNDS}, {b.DURATION} s")
                        run = b.measured_run(envoys[row.key], stack, f"inflight-{row.key}-{load}-{round_index}",
                                             b.DURATION, load, threads)
                        row.runs.setdefault(load, []).append(run)
        held = stack.redis.client.zcard("{" + h.limiter_name("erl:per-user-inflight", "user0") + "}:timeout")
        stack.stop_envoys()
    print_inflight(measured, held)


def print_inflight(measured: list[Row], held: int) -> None:
    by_key = {row.key: row for row in measured}
    for load in LOADS:
        out()
        out(f"wrk -t{min(b.THREADS, load)} -c{load}, x-user-id over {USERS} users, {b.ROUNDS} interleaved runs of "
            f"{b.DURATION} s; the route answers by direct_response. CPU microseconds per answered request.")
        lines = []
        for row in measured:
            cpu = row.cpu_us(load)
            answers = b.answers(row.runs[load][0])[1] if row.runs.get(load) else {}
            lines.append([row.title, num(row.rps(load)), *(num(cpu.get(name, 0.0)) for name in CPU_NAMES),
                          num(cpu.get("total", 0.0)), num(cpu.get("gateway", 0.0)), f"{row.calls(load):.2f}",
                          ", ".join(f"{k} {v}" for k, v in answers.items())])
        out(table(["", "req/s", "Envoy", "webdis", "Redis", "wrk", "total", "without wrk", "script calls/req",
                   "answers (first run)"], lines))
        rate, inflight = by_key["rate"].cpu_us(load), by_key["inflight"].cpu_us(load)
        if rate and inflight:
            with_wrk = inflight["total"] / rate["total"]
            without = inflight["gateway"] / rate["gateway"]
            verdict = "met" if max(with_wrk, without) <= TARGET else f"not met, by {max(with_wrk, without) / TARGET - 1:.0%}"
            out(f"Target: the in-flight rule's CPU per request at most {TARGET}x the rate rule's: "
                f"{num(inflight['total'])} vs {num(rate['total'])} us, {with_wrk:.2f}x with wrk, "
                f"{without:.2f}x without it ({num(inflight['gateway'])} vs {num(rate['gateway'])} us): {verdict}.")
        both = by_key["both"]
        if both.runs.get(load) and by_key["rate"].runs.get(load):
            calls, alone = both.calls(load), by_key["rate"].calls(load)
            verdict = "met" if calls <= alone else f"not met: {calls / alone:.3f}x"
            out(f"Target (issue 42): a request's permits and rate acquires in one call per destination, its script "
                f"calls per request no more than the rate rule's alone: {calls:.3f} vs {alone:.3f}: {verdict}.")
    out(f"Permits still held by one user's semaphore after the runs (each released when its request ended): {held}.")
