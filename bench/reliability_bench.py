"""Section 8 of `make bench` (bench/bench.py): faults between the gateway and Redis under load, both builds,
each figure next to a no-fault baseline measured in the same run.

The matrix of tests/e2e/test_faults.py (tests/e2e/faults.py), longer and under more load: the stock build in
real Envoy (gateway -> webdis -> fault proxy -> redis-server) and the Higress build in the host emulator (its
`redis` cluster -> fault proxy -> redis-server), each as two gateways (failing open and failing closed,
`redis.timeout` 200 ms) under load while a fault lasts BENCH_FAULT_SECONDS [3] and for as long after Redis
is healthy again. The baseline is the same run without a fault. Per fault and build: the worst added
latency (the longest wait for a decision among the requests answered from the fault on, less the baseline's
median; a wait ends when the upstream gets the request, or when the answer comes), the recovery (from
Redis healthy again to the first request Redis decided after the last failure answer), and whether the
failure mode held, every request was counted and no VM trapped.

Every process comes from tests/e2e/harness.py, faults.py and faultproxy.py on 127.0.0.1, free ports, stopped
by PID when its stack closes.
"""

from __future__ import annotations

import statistics
import time

import bench as b  # bench/bench.py: settings, tables
from bench import num, out, progress, table
import faults as f  # tests/e2e/faults.py (bench.py puts tests/e2e on the path)

FAULT_S = b._env_int("BENCH_FAULT_SECONDS", 3)
TIMING = f.Timing(warmup_s=1.0, fault_s=float(FAULT_S), after_s=float(FAULT_S))
# More than the tests' load: 4 clients per Envoy, 16 requests per emulator batch, 5 ms apart.
PROFILE = f.LoadProfile(users=8, clients=4, pace_ms=5.0)


def _build_name(build: str) -> str:
    return "stock (Envoy)" if build == "envoy" else "Higress (emulator)"


def run_build(stack: f.FaultStack, build: str) -> tuple[f.CaseResult, list[f.CaseResult]]:
    rig = f.Rig(stack, build).start()
    try:
        progress(f"(8) {_build_name(build)}: baseline, no fault")
        baseline = f.run_case(rig, f.NO_FAULT, TIMING, PROFILE)
        results = []
        for fault in f.FAULTS:
            progress(f"(8) {_build_name(build)}: {fault.name}")
            results.append(f.run_case(rig, fault, TIMING, PROFILE))
        return baseline, results
    finally:
        rig.stop()


def _decisions(result: f.CaseResult, since_fault: bool = False) -> list[f.Decision]:
    return [d for run in result.runs for d in run.decisions if not since_fault or d.end_ms >= result.injected_ms]


def outcome(result: f.CaseResult) -> str:
    """"mode held / all N counted / no trap", each part naming the gateways where it did not hold."""
    problems = result.problems()
    held = [label for label, p in problems.items() if "failure mode" in p or "answered" in p]
    sent = sum(len(run.decisions) for run in result.runs)
    counted = sum(sum(v for v in run.counted().values() if v is not None) for run in result.runs)
    miscounted = [label for label, p in problems.items() if "counters" in p]
    trapped = [label for label, p in problems.items() if "no trap" in p]
    return " / ".join([
        "mode held" if not held else f"NOT held ({', '.join(held)})",
        f"all {num(sent)} counted" if not miscounted else f"{num(counted)} of {num(sent)} counted "
                                                          f"({', '.join(miscounted)})",
        "no trap" if not trapped else f"TRAP ({', '.join(trapped)})",
    ])


def failure_median_ms(result: f.CaseResult) -> float | None:
    """The median wait of the failure answers (None: there were none)."""
    latencies = [d.wait_ms for run in result.runs for d in run.failures()]
    return statistics.median(latencies) if latencies else None


def print_reliability(by_build: dict[str, tuple[f.CaseResult, list[f.CaseResult]]]) -> None:
    out(f"Load: per gateway {PROFILE.clients} clients (Envoy, one request at a time on a fresh connection) or "
        f"batches of {2 * PROFILE.users} requests (emulator, 2 VMs), {PROFILE.pace_ms:.0f} ms apart, alternating "
        f"{PROFILE.users} users over their rate ({f.RATE}/s, mostly rejected) and new users (allowed: Redis "
        f"writes); two gateways per build, failure_mode allow and deny (failure_status {f.FAILURE_STATUS}), "
        f"redis.timeout {f.TIMEOUT_MS} ms, local block off. Each fault lasts {FAULT_S} s after {TIMING.warmup_s:.0f} s "
        f"of load; the load goes on {FAULT_S} s after Redis is healthy again. Latency here is the wait for a "
        "decision: until the upstream got the request (Envoy, let through) or the answer came (a local reply; the "
        "emulator answers for the upstream at once). Bounds (as in tests/e2e/test_faults.py): every decision "
        f"within {f.BOUND_MS} ms (timeout + {f.MARGIN_MS}), recovery within {f.RECOVERY_MS} ms.")
    for build, (baseline, _) in by_build.items():
        median, worst = f.latency_summary(_decisions(baseline))
        out(f"Baseline, {_build_name(build)}: {num(len(_decisions(baseline)))} requests without a fault, wait for a "
            f"decision: median {median:.1f} ms, worst {worst:.0f} ms; {outcome(baseline)}.")
    rows = []
    for build, (baseline, results) in by_build.items():
        median, _ = f.latency_summary(_decisions(baseline))
        for result in results:
            worst = max((d.wait_ms for d in _decisions(result, since_fault=True)), default=0.0)
            recoveries = [run.recovery_ms() for run in result.runs]
            if any(r is None for r in recoveries):
                recovery = "not recovered"
            else:
                slowest = max(r for r in recoveries if r is not None)
                recovery = num(slowest) + (" (> bound)" if slowest > f.RECOVERY_MS else "")
            failures = sum(len(run.failures()) for run in result.runs)
            waited = failure_median_ms(result)
            rows.append([result.fault.name, _build_name(build), num(len(_decisions(result))), num(failures),
                         "-" if waited is None else num(waited),
                         f"{worst - median:+,.0f}" + (" (> bound)" if worst > f.BOUND_MS else ""), recovery,
                         outcome(result)])
    out(table(["fault", "build", "requests", "failure answers", "their median (ms)", "worst added latency (ms)",
               "recovery (ms)", "outcome"], rows, left=2))
    out("Faults: " + "; ".join(f"{fault.name}: {fault.what}" for fault in f.FAULTS) + ".")
    details = [(build, result) for build, (_, results) in by_build.items() for result in results
               if result.problems()]
    for build, result in details:
        out(f"Not held, {result.fault.name}, {_build_name(build)}:\n{result.describe()}")
    if not details:
        results = [result for _, results in by_build.values() for result in results]
        waits = [(failure_median_ms(r), r.fault.name) for r in results if failure_median_ms(r) is not None]
        hung = sorted({name for wait, name in waits if wait is not None and wait >= f.TIMEOUT_MS * 0.9})
        at_once = sorted({name for wait, name in waits if wait is not None and wait < f.TIMEOUT_MS * 0.9})
        out("Reading: in both builds every request of every fault was answered within the bound, by a decision "
            "or the failure mode's answer, counted once, and no VM trapped. A failed decision waits for the "
            f"timeout where Redis hangs ({', '.join(hung) or 'none'}), and fails at once where the connection "
            f"fails or Redis answers an error ({', '.join(at_once) or 'none'}); latency below the timeout and "
            "SCRIPT FLUSH fail no decision. Worst added latency includes the machine's noise (see the "
            "baseline's worst).")
    out("Recovery: from Redis healthy again (the proxy passing, Redis answering PING, unpaused, the limit or "
        "password gone) to the first request Redis decided among those sent after the last failure answer, "
        "the slower of the two gateways.")


def run_reliability() -> None:
    """Section 8: both builds on one fault stack, one rig per build at a time."""
    started = time.monotonic()
    b.heading("8. Reliability: faults between the gateway and Redis under load, vs no fault (baseline)")
    by_build = {}
    with f.FaultStack() as stack:
        stack.start()
        for build in f.BUILDS:
            by_build[build] = run_build(stack, build)
    print_reliability(by_build)
    out(f"Section 8 took {time.monotonic() - started:.0f} s.")
