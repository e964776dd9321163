#!/usr/bin/env python3
"""`make soak` (not in CI): does the gateway's memory plateau under a stream of new keys, and does Redis give
its memory back when keys expire?

1. Saturation with many keys: one stock Envoy (dist/edge-rate-limiter-envoy.wasm, --concurrency
   BENCH_CONCURRENCY, the route answering itself as in `make bench` section 1) under wrk for SOAK_SECONDS,
   x-user-id drawn at random from SOAK_KEYS users (bench/cluster_bench.py's key stream), one per-user rule
   (1 per 1 h, keep_alive at its default 1 h): most keys are new for a long time, a user's later requests
   are rejected (by Redis, then for up to 5 s by the local block). Every ~30 s: elapsed, requests so far,
   distinct keys seen (Redis DBSIZE / 3: a limiter is a hash, a value and a permits key), Envoy's RSS
   (/proc), Redis used_memory. Envoy does not expose shared data, so the Higress build runs meanwhile in the
   host emulator (tests/host `wasm-host serve`, its own redis-server) on the same key stream at
   SOAK_EMULATOR_RPS: its shared data (keys, bytes) and its process's RSS. The per-VM config cache (src/cache.rs)
   is an LRU of at most `cache_size` names, and no metric exposes its size: its bound is printed, with an
   estimate of its fill. At the end, a verdict per series from the data: growth over the last third of the
   run against the first third.
2. Keys that expire: the same load for SOAK_EXPIRY_SECONDS on a rule of 1 per 1 s with keep_alive 2 s
   (docs/configuration.md: keep_alive must be 0 or >= interval), then no load: Redis DBSIZE and used_memory, polled
   until every limiter is gone or keep_alive + SOAK_DRAIN_MARGIN seconds have passed, against where they started.

Every process comes from tests/e2e/harness.py on 127.0.0.1 with free ports and is stopped by its PID, also
on Ctrl-C. Settings (environment, defaults in brackets): SOAK_SECONDS [600], SOAK_KEYS [1000000],
SOAK_EMULATOR_RPS [300], SOAK_PRINT_SECONDS [30], SOAK_EXPIRY_SECONDS [SOAK_SECONDS / 4, 10..120],
SOAK_DRAIN_MARGIN [30], SOAK_RSS_TOLERANCE percent of growth over the last third that still counts as a
plateau [2]; bench/bench.py's BENCH_CONNECTIONS, BENCH_THREADS, BENCH_CONCURRENCY.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import bench as b  # bench/bench.py: settings, wrk, tables, /proc readers, section 1's Envoy
from bench import h, num, out, table

SECONDS = b._env_int("SOAK_SECONDS", 600)
KEYS = b._env_int("SOAK_KEYS", 1_000_000)
EMULATOR_RPS = b._env_int("SOAK_EMULATOR_RPS", 300)
PRINT_S = b._env_int("SOAK_PRINT_SECONDS", 30)
EXPIRY_SECONDS = b._env_int("SOAK_EXPIRY_SECONDS", max(10, min(120, SECONDS // 4)))
DRAIN_MARGIN_S = b._env_int("SOAK_DRAIN_MARGIN", 30)
RSS_TOLERANCE = b._env_int("SOAK_RSS_TOLERANCE", 2)
SAMPLE_S = max(1, min(5, SECONDS // 12))  # samples for the verdicts; a row is printed every ~PRINT_S

os.environ["BENCH_CLUSTER_USERS"] = str(KEYS)  # the users of cluster_bench's key stream, read at its import
import cluster_bench  # noqa: E402  (bench/cluster_bench.py: wrk with x-user-id drawn at random)

TIMEOUT = "500ms"
# 1: a user's first request is allowed, every later one rejected; keys live keep_alive (default: 1 h).
SOAK_RULE = h.rule("per-user", rate=1, interval="1h")
# 2: keys that expire 2 s after their last use.
KEEP_ALIVE_S = 2
EXPIRING_RULE = h.rule("expiring", rate=1, interval="1s", keep_alive=f"{KEEP_ALIVE_S}s")
STALE_PCT = 10  # Redis's ACTIVE_EXPIRE_CYCLE_ACCEPTABLE_STALE (src/expire.c), at active-expire-effort 1
KEYS_PER_LIMITER = 3  # the config hash, {name}:value, {name}:permits (docs/configuration.md, "Limiter names in Redis")
BLOCK_PREFIX = "edge_rate_limiter.block."  # src/block.rs KEY_PREFIX: the local block's shared data slots
EMULATOR_BATCH = 32


def progress(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


def source_default(path: str, pattern: str, what: str) -> int:
    """A default the filter's source spells out (the first group of `pattern`): the bound printed is the one
    the source holds, not a copy of it."""
    match = re.search(pattern, (b.REPO / path).read_text())
    if match is None:
        raise h.HarnessError(f"{path} no longer matches {pattern!r} ({what}): update bench/soak.py")
    return int(match.group(1).replace("_", ""))


CACHE_SIZE = source_default("src/config/validate.rs", r'number::<usize>\("cache_size"\)\?\.unwrap_or\(([\d_]+)\)',
                            "the default cache_size")
BLOCK_SLOTS = source_default("src/config/validate.rs", r"DEFAULT_LOCAL_BLOCK_SLOTS: u32 = ([\d_]+);",
                             "the default local_block_slots")
if "LruCache<" not in (b.REPO / "src" / "cache.rs").read_text():
    raise h.HarnessError("src/cache.rs no longer holds an LruCache: check what bounds the config cache and "
                         "update bench/soak.py")


def cache_fill(requests: int, vms: int) -> int:
    """The names one VM's config cache holds, estimated (no metric tells): each VM takes 1/vms of the
    requests, drawn at random from KEYS users, and keeps at most CACHE_SIZE of the names it saw."""
    per_vm = requests / vms
    return min(CACHE_SIZE, round(KEYS * -math.expm1(-per_vm / KEYS)))


def redis_memory(client: Any) -> tuple[int, int]:
    """(DBSIZE, used_memory)."""
    return int(client.dbsize()), int(client.info("memory")["used_memory"])


def mib(n: float) -> str:
    return f"{n / 1048576:,.1f}"


# ---------------------------------------------------------------------------------------------------------
# The emulator beside Envoy


class EmulatorLoad:
    """The Higress build in the host emulator, fed the same key stream as Envoy (x-user-id drawn at random
    from KEYS users) in batches of EMULATOR_BATCH requests in flight, at most `rps` per second, in a thread.
    `snapshot()` asks it between two batches (the emulator answers one line at a time)."""

    def __init__(self, emulator: h.Emulator, redis: h.Redis, rps: int):
        self.emulator, self.redis, self.rps = emulator, redis, rps
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.requests = 0
        self.statuses: dict[int, int] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="soak-emulator", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        draw = random.Random(20261123).randrange
        started = time.monotonic()
        try:
            while not self.done.is_set():
                batch = [{"headers": {"x-user-id": f"u{draw(KEYS)}"}} for _ in range(EMULATOR_BATCH)]
                with self.lock:
                    responses = self.emulator.send_batch(batch)
                    self.emulator.outcomes.clear()  # the harness keeps every result: this process would grow
                for response in responses:
                    self.statuses[response.status] = self.statuses.get(response.status, 0) + 1
                self.requests += len(responses)
                self.done.wait(max(0.0, self.requests / self.rps - (time.monotonic() - started)))
        except BaseException as error:  # noqa: BLE001 - handed to the main thread, which raises it
            self.error = error

    def snapshot(self) -> dict[str, int]:
        if self.error is not None:
            raise h.HarnessError(f"the emulator's load failed: {self.error}")
        with self.lock:
            everything = self.emulator.shared_data("")
            blocks = self.emulator.shared_data(BLOCK_PREFIX)
            metrics = self.emulator.metrics()
        assert self.emulator.process is not None
        return {"requests": self.requests, "keys": everything["keys"], "bytes": everything["bytes"],
                "block_keys": blocks["keys"], "block_bytes": blocks["bytes"],
                "rss": b.rss_kib(self.emulator.process.pid), "limiters": self.redis.client.dbsize() // KEYS_PER_LIMITER,
                "allowed": metrics.get("allowed", 0), "rejected": metrics.get("rejected", 0),
                "local_rejected": metrics.get("local_rejected", 0)}

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=30)


# ---------------------------------------------------------------------------------------------------------
# 1: saturation with many keys


@dataclass
class Sample:
    t: float  # seconds since the load started
    stats: dict[str, int]  # Envoy: b.ENVOY_STATS, short names
    dbsize: int
    used_memory: int
    tables: int  # Redis's key tables (MEMORY STATS db.0 overhead.hashtable.*): they double at powers of two
    dataset: int  # MEMORY STATS dataset.bytes: used_memory less every overhead (tables, clients, scripts...)
    envoy_rss: int  # KiB
    emu: dict[str, int]

    @property
    def requests(self) -> int:
        return self.stats.get("downstream_rq_completed", 0)

    @property
    def limiters(self) -> int:
        return self.dbsize // KEYS_PER_LIMITER


ROW_HEADERS = ["elapsed s", "requests", "req/s", "keys (DBSIZE/3)", "Envoy RSS KiB", "Redis used MiB",
               "cache/VM est.", "emu requests", "emu keys", "emu shared keys", "emu shared B", "emu RSS KiB"]


def row(sample: Sample, previous: Sample | None) -> list[str]:
    rate = ((sample.requests - previous.requests) / (sample.t - previous.t)
            if previous is not None and sample.t > previous.t else 0.0)
    emu = sample.emu
    return [f"{sample.t:.0f}", num(sample.requests), num(rate), num(sample.limiters), num(sample.envoy_rss),
            mib(sample.used_memory), num(cache_fill(sample.requests, b.CONCURRENCY)), num(emu["requests"]),
            num(emu["limiters"]), num(emu["keys"]), num(emu["bytes"]), num(emu["rss"])]


def print_live(cells: list[str]) -> None:
    widths = [max(len(header), 11) for header in ROW_HEADERS]
    out("  ".join(cell.rjust(width) for cell, width in zip(cells, widths)))


@dataclass
class Soak:
    samples: list[Sample]
    shown: list[Sample]  # printed as rows, every ~PRINT_S
    wrk: b.WrkResult
    emulator_statuses: dict[int, int]


def run_soak(stack: h.Stack) -> Soak:
    progress(f"starting Envoy (--concurrency {b.CONCURRENCY}) and the host emulator (Higress build, own Redis)")
    envoy = b.lease_gateway(stack, "envoy-soak", h.plugin_config(SOAK_RULE, timeout=TIMEOUT), b.CONCURRENCY, None)
    emulator_dir = stack.workdir / "emulator-redis"
    emulator_dir.mkdir()
    emulator_redis = h.Redis(emulator_dir).start()
    load: EmulatorLoad | None = None
    try:
        emulator = stack.emulator(h.host_plugin_config(SOAK_RULE, timeout=TIMEOUT), build="higress",
                                  clusters={"redis": emulator_redis.port}, vms=b.CONCURRENCY)
        envoy.wait_ready()
        assert envoy.process is not None
        load = EmulatorLoad(emulator, emulator_redis, EMULATOR_RPS)
        script = cluster_bench.random_users_script(stack.workdir)
        started = time.monotonic()

        def sample() -> Sample:
            dbsize, used = redis_memory(stack.redis.client)
            memory = stack.redis.client.memory_stats()
            tables = sum(memory.get("db.0", {}).values())
            stats = {b._short(name): value for name, value in envoy.stats(filter=b.ENVOY_STATS).items()}
            return Sample(time.monotonic() - started, stats, dbsize, used, tables, int(memory["dataset.bytes"]),
                          b.rss_kib(envoy.process.pid), load.snapshot())

        samples = [sample()]
        samples[0].t = 0.0
        shown = [samples[0]]  # the samples printed as rows
        out()
        print_live(ROW_HEADERS)
        print_live(row(samples[0], None))
        started = time.monotonic()
        load.start()
        wrk = cluster_bench.start_wrk(envoy.port, SECONDS, stack.workdir, "soak", script)

        def keep(new: Sample, last: bool = False) -> None:
            samples.append(new)
            if last or new.t - shown[-1].t >= PRINT_S - SAMPLE_S / 2:
                print_live(row(new, shown[-1]))
                shown.append(new)

        next_sample = SAMPLE_S
        while wrk[0].alive():
            time.sleep(max(0.0, min(0.5, next_sample - (time.monotonic() - started))))
            if time.monotonic() - started >= next_sample and wrk[0].alive():
                keep(sample())
                next_sample += SAMPLE_S
        result = b.finish_wrk(wrk, SECONDS)
        keep(sample(), last=True)
        return Soak(samples, shown, result, dict(load.statuses))
    finally:
        if load is not None:
            load.stop()
        stack.stop_envoys()
        emulator_redis.stop()


# ---------------------------------------------------------------------------------------------------------
# 2: keys that expire


@dataclass
class Expiry:
    start: tuple[int, int]  # (DBSIZE, used_memory) before the load
    loaded: list[tuple[float, int, int, int]]  # (s since the load started, DBSIZE, used_memory, requests)
    drain: list[tuple[float, int, int, int]]  # (s since wrk's duration ended, DBSIZE, used_memory, expired keys)
    settings: dict[str, str]
    wrk: b.WrkResult
    wrk_exit_s: float | None  # when wrk exited, s after its duration (None: later than the drain)
    stats: dict[str, int] = field(default_factory=dict)


def run_expiry(stack: h.Stack) -> Expiry:
    client = stack.redis.client
    client.flushall()  # phase 1's limiters (keep_alive 1 h) would stay for an hour
    settings = {name: str(value) for name in ("hz", "active-expire-effort")
                for value in client.config_get(name).values()}
    progress(f"phase 2: a rule of 1 per 1 s, keep_alive {KEEP_ALIVE_S} s, {EXPIRY_SECONDS} s of load, then none")
    envoy = b.lease_gateway(stack, "envoy-expiring", h.plugin_config(EXPIRING_RULE, timeout=TIMEOUT),
                            b.CONCURRENCY, None)
    try:
        envoy.wait_ready()
        script = cluster_bench.random_users_script(stack.workdir)
        start = redis_memory(client)
        expired_before = int(client.info("stats")["expired_keys"])
        loaded: list[tuple[float, int, int, int]] = []
        started = time.monotonic()
        wrk = cluster_bench.start_wrk(envoy.port, EXPIRY_SECONDS, stack.workdir, "expiring", script)
        stopped = started + EXPIRY_SECONDS  # wrk sends nothing after its duration (it may exit later)
        while wrk[0].alive() and time.monotonic() < stopped - 1.0:
            time.sleep(min(1.0, max(0.0, stopped - 1.0 - time.monotonic())))
            requests = envoy.stats(filter=b.ENVOY_STATS).get("http.ingress_http.downstream_rq_completed", 0)
            loaded.append((time.monotonic() - started, *redis_memory(client), requests))
        time.sleep(max(0.0, stopped - time.monotonic()))
        drain: list[tuple[float, int, int, int]] = []
        deadline, emptied, exited = stopped + KEEP_ALIVE_S + DRAIN_MARGIN_S, None, None
        while time.monotonic() < deadline:
            dbsize, used = redis_memory(client)
            now = time.monotonic()
            drain.append((now - stopped, dbsize, used, int(client.info("stats")["expired_keys"]) - expired_before))
            if exited is None and not wrk[0].alive():
                exited = now - stopped
            if dbsize <= start[0] and emptied is None:
                emptied = now
                deadline = min(deadline, now + 2.0)  # a little longer: used_memory may still fall
            time.sleep(0.25)
        result = b.finish_wrk(wrk, EXPIRY_SECONDS)
        stats = {b._short(name): value for name, value in envoy.stats(filter=b.ENVOY_STATS).items()}
        return Expiry(start, loaded, drain, settings, result, exited, stats)
    finally:
        stack.stop_envoys()


# ---------------------------------------------------------------------------------------------------------
# Verdicts


def nearest(samples: list[Any], t: float, time_of: Callable[[Any], float]) -> Any:
    return min(samples, key=lambda s: abs(time_of(s) - t))


def thirds(samples: list[Any], since: float, value: Callable[[Any], float], time_of: Callable[[Any], float]
           ) -> tuple[list[float], list[Any]]:
    """The values at the start, 1/3, 2/3 and end of [since, last sample], and those samples."""
    end = time_of(samples[-1])
    points = [nearest(samples, since + k * (end - since) / 3, time_of) for k in range(4)]
    return [value(p) for p in points], points


def plateau_verdict(growth_first: float, growth_last: float, level: float, tolerance_pct: float) -> str:
    def pct(growth: float) -> float:
        return 100 * growth / level if level else (0.0 if growth == 0 else math.inf)

    if pct(growth_last) <= 0:
        return f"not growing: {pct(growth_last):+.1f}% over the last third"
    if pct(growth_last) <= tolerance_pct:
        return f"plateau: {pct(growth_last):+.1f}% over the last third (<= +{tolerance_pct}%)"
    return (f"STILL GROWING: {pct(growth_last):+.1f}% over the last third (> +{tolerance_pct}%), "
            f"{pct(growth_first):+.1f}% over the first")


def filled_at(samples: list[Sample], requests: Callable[[Sample], int]) -> tuple[float, bool]:
    """(when the VMs' config caches are full, estimated; whether they are) for the gateway whose requests so
    far `requests` reads; (0, False) if they fill only in the run's last tenth or never."""
    full = next((s for s in samples if cache_fill(requests(s), b.CONCURRENCY) >= CACHE_SIZE), None)
    if full is None or full.t > 0.9 * samples[-1].t:
        return 0.0, False
    return full.t, True


def growth_cells(values: list[float], delta: Callable[[float], str], level: Callable[[float], str],
                 last_note: str = "") -> list[str]:
    """A verdict row's middle cells from thirds(): growth over the first and the last third, start -> end."""
    return [delta(values[1] - values[0]), delta(values[3] - values[2]) + last_note,
            f"{level(values[0])} -> {level(values[3])}"]


def kib(n: float) -> str:
    return f"{num(n)} KiB"


def kib_delta(n: float) -> str:
    return f"{n:+,.0f} KiB"


def soak_verdicts(soak: Soak) -> list[list[str]]:
    samples = soak.samples
    at = lambda s: s.t  # noqa: E731
    rows = []
    # The config caches fill first (a growth they bound); the RSS verdicts count from when they are full
    # (estimated), or from the start if they fill in the last tenth of the run or never.
    since, full = filled_at(samples, lambda s: s.requests)
    values, points = thirds(samples, since, lambda s: s.envoy_rss, at)
    new_last = points[3].limiters - points[2].limiters
    per_key = f", {1024 * (values[3] - values[2]) / new_last:.1f} B per new key" if new_last > 0 else ""
    rows.append([f"Envoy RSS, from {since:.0f} s" + (" (config caches full, est.)" if full else " (caches filling)"),
                 *growth_cells(values, kib_delta, kib, f" ({num(new_last)} new keys{per_key})"),
                 plateau_verdict(values[1] - values[0], values[3] - values[2], values[2], RSS_TOLERANCE)])

    # Redis: the limiters' own memory (dataset.bytes over the start) per limiter.
    values, points = thirds(samples, 0.0, lambda s: s.used_memory, at)
    per = [(p.dataset - samples[0].dataset) / p.limiters if p.limiters else float("nan") for p in points]
    linear = abs(per[3] - per[1]) <= 0.25 * per[1] if per[1] == per[1] else False
    rows.append(["Redis used_memory (keys live 1 h)",
                 *growth_cells(values, lambda n: f"{mib(n)} MiB", lambda n: f"{mib(n)} MiB"),
                 (f"grows with the limiters it holds, as it must: {per[1]:,.0f} B of data per limiter at 1/3, "
                  f"{per[3]:,.0f} at the end" + ("" if linear else " (NOT proportional)")
                  + f", plus key tables of {mib(points[1].tables)} -> {mib(points[3].tables)} MiB (they double at "
                  "powers of two of the keys: the steps in used_memory)")])

    name_max = len(h.limiter_name(f"erl:{SOAK_RULE['name']}", f"u{KEYS - 1}"))
    for key, label, bound, unit in (("block_keys", "slots (keys)", BLOCK_SLOTS, ""),
                                    ("block_bytes", "bytes", BLOCK_SLOTS * (29 + 37 + name_max), " B")):
        values, _ = thirds(samples, 0.0, lambda s: s.emu[key], at)  # noqa: B023 - used at once
        most = max(s.emu[key] for s in samples)
        rows.append([f"emulator shared data: block {label}",
                     *growth_cells(values, lambda n: f"{n:+,.0f}{unit}", lambda n: f"{num(n)}{unit}"),  # noqa: B023
                     f"{'bounded' if most <= bound else 'OVER THE BOUND'}: at most {num(most)}{unit} of {num(bound)}"
                     + (f" ({num(BLOCK_SLOTS)} x (29 + 37 + {name_max}))" if unit else " slots")])
    other = max(s.emu["keys"] - s.emu["block_keys"] for s in samples)
    rows.append(["emulator shared data: other keys", "", "", f"at most {other}",
                 "the process's Redisson client id" if other <= 1 else "MORE THAN THE CLIENT ID"])

    since, full = filled_at(samples, lambda s: s.emu["requests"])
    values, _ = thirds(samples, since, lambda s: s.emu["rss"], at)
    rows.append([f"emulator (wasm-host) RSS, from {since:.0f} s"
                 + (" (config caches full, est.)" if full else " (config caches still filling)"),
                 *growth_cells(values, kib_delta, kib),
                 plateau_verdict(values[1] - values[0], values[3] - values[2], values[2], RSS_TOLERANCE)])
    last = samples[-1]
    rows.append(["config cache (src/cache.rs, per VM)", "", "", f"<= {num(CACHE_SIZE)} names",
                 f"bounded by construction (LRU, default cache_size); no metric exposes its size; est. fill at the "
                 f"end: Envoy {num(cache_fill(last.requests, b.CONCURRENCY))}, emulator "
                 f"{num(cache_fill(last.emu['requests'], b.CONCURRENCY))} per VM"])
    return rows


def expiry_verdicts(expiry: Expiry) -> list[list[str]]:
    """Under load, Redis should hold only the limiters used in the last keep_alive, plus keys whose TTL has
    passed that its active expiry has not reached yet: it stops a cycle once at most
    STALE_PCT - (active-expire-effort - 1) % of the sampled keys with a TTL are expired (Redis's
    expire.c, ACTIVE_EXPIRE_CYCLE_ACCEPTABLE_STALE). How many there are follows the request rate, which moves
    with whatever else the machine runs, so the verdict is on limiters per recent request, not on thirds."""
    rows = []
    stale = (STALE_PCT - (int(expiry.settings.get("active-expire-effort", "1")) - 1)) / 100
    window = KEEP_ALIVE_S + 1  # samples are ~1 s apart
    ratios, rates = [], []
    for (t0, _, _, r0), (t1, _, _, r1) in zip(expiry.loaded, expiry.loaded[1:]):
        rates.append((r1 - r0) / (t1 - t0))
    for t, dbsize, _, requests in expiry.loaded:
        earlier = [s for s in expiry.loaded if s[0] <= t - window]
        if earlier:
            ratios.append((dbsize // KEYS_PER_LIMITER) / max(1, requests - earlier[-1][3]))
    loaded = [s for s in expiry.loaded if s[0] >= KEEP_ALIVE_S]  # the first keep_alive: keys pile up
    if ratios and loaded:
        bound = 1 / (1 - stale)
        rows.append([f"Redis limiters / requests of the preceding {window} s, under load", "", "",
                     f"{min(ratios):.2f} .. {max(ratios):.2f}",
                     (f"only recently used limiters (<= {bound:.2f}: up to {stale:.0%} of the keys with a TTL may "
                      "be expired but not yet removed)" if max(ratios) <= bound
                      else f"MORE LIMITERS THAN RECENT TRAFFIC EXPLAINS (> {bound:.2f})")])
        rows.append([f"Redis under load, from {loaded[0][0]:.0f} s", "", "",
                     f"DBSIZE {num(min(s[1] for s in loaded))} .. {num(max(s[1] for s in loaded))}, "
                     f"{mib(min(s[2] for s in loaded))} .. {mib(max(s[2] for s in loaded))} MiB",
                     f"follows the request rate ({num(min(rates))} .. {num(max(rates))} req/s a second), not time"])
    start_db, start_used = expiry.start
    peak = max((s for s in expiry.loaded + [(0, 0, 0, 0)]), key=lambda s: s[2])
    end = expiry.drain[-1] if expiry.drain else (0.0, 0, 0, 0)
    emptied = next((d for d in expiry.drain if d[1] <= start_db), None)
    added = max(peak[2], end[2]) - start_used
    back = (max(peak[2], end[2]) - end[2]) / added if added > 0 else float("nan")
    rows.append(["Redis after the load stopped", "", "",
                 f"{num(end[1])} keys, {mib(end[2])} MiB (start {num(start_db)}, {mib(start_used)} MiB)",
                 (f"every limiter gone {emptied[0]:.1f} s after the load ended" if emptied else
                  f"NOT EMPTY after {end[0]:.0f} s") + f"; {back * 100:.0f}% of the memory the load added is back"])
    return rows


def print_results(soak: Soak, expiry: Expiry) -> None:
    b.heading("Summary")
    out(f"1. {SECONDS} s at saturation through Envoy, x-user-id drawn at random from {num(KEYS)} users, rule "
        f"{SOAK_RULE['name']} {SOAK_RULE['rate']}/{SOAK_RULE['interval']} (keep_alive 1 h); wrk -t{b.THREADS} "
        f"-c{b.CONNECTIONS}: {num(soak.wrk.requests)} requests, {num(soak.wrk.rps)} req/s, "
        f"{soak.wrk.socket_errors} socket errors.")
    out(f"   Emulator: Higress build, {b.CONCURRENCY} VMs, the same key stream at <= {EMULATOR_RPS} req/s, its own "
        f"redis-server. cache/VM est.: names in one VM's config cache, estimated from the requests (each VM takes "
        f"1/{b.CONCURRENCY} of them) and capped at cache_size {num(CACHE_SIZE)} (src/config/validate.rs); no "
        "metric exposes it. The emulator reports shared data and counters, not a VM's linear memory: its "
        "process RSS (which holds both VMs' linear memories) stands in.")
    out(table(ROW_HEADERS, [row(s, p) for s, p in zip(soak.shown, [None] + soak.shown[:-1])], left=0))
    last = soak.samples[-1]
    stats, emu = last.stats, last.emu
    out(f"Answers: Envoy allowed {num(stats.get('allowed', 0))}, rejected {num(stats.get('rejected', 0))} (of them "
        f"locally {num(stats.get('local_rejected', 0))}), Redis errors {num(stats.get('redis_errors', 0))}, "
        f"failing open {num(stats.get('failure_allowed', 0))}; emulator allowed {num(emu['allowed'])}, rejected "
        f"{num(emu['rejected'])} (locally {num(emu['local_rejected'])}), statuses "
        + ", ".join(f"{num(n)} x {status}" for status, n in sorted(soak.emulator_statuses.items())) + ".")
    out()
    out(table(["series", "first third", "last third", "start -> end", "verdict"], soak_verdicts(soak)))

    out()
    out(f"2. Keys that expire: rule {EXPIRING_RULE['name']} {EXPIRING_RULE['rate']}/{EXPIRING_RULE['interval']}, "
        f"keep_alive {EXPIRING_RULE['keep_alive']}, {EXPIRY_SECONDS} s of the same load ({num(expiry.wrk.requests)} "
        f"requests, {num(expiry.wrk.rps)} req/s), then none. Redis hz {expiry.settings.get('hz')}, "
        f"active-expire-effort {expiry.settings.get('active-expire-effort')}: keys expire when touched (lazily) "
        "and in the cron's sampling of keys with a TTL (actively); with no load, only the latter. Rows "
        f"'end +s': seconds after wrk's {EXPIRY_SECONDS} s ended (wrk exited "
        + (f"{expiry.wrk_exit_s:.1f} s after)." if expiry.wrk_exit_s is not None else "later)."))
    step = max(1, len(expiry.loaded) // 10)
    loaded = expiry.loaded[::step] + [s for s in expiry.loaded[-1:] if s not in expiry.loaded[::step]]
    rows = [[f"load {t:.0f}", num(requests), num(dbsize), num(dbsize // KEYS_PER_LIMITER), mib(used), ""]
            for t, dbsize, used, requests in loaded]
    # After the load: the first poll of every second, the first poll that found every limiter gone, the last.
    shown: list[tuple[float, int, int, int]] = []
    emptied = next((d for d in expiry.drain if d[1] <= expiry.start[0]), None)
    for entry in expiry.drain:
        if not shown or math.floor(entry[0]) != math.floor(shown[-1][0]) or entry is emptied \
                or entry is expiry.drain[-1]:
            shown.append(entry)
    rows += [[f"end +{t:.2f}", "", num(dbsize), num(dbsize // KEYS_PER_LIMITER), mib(used), num(expired)]
             for t, dbsize, used, expired in shown]
    out(f"Start: DBSIZE {num(expiry.start[0])}, used_memory {mib(expiry.start[1])} MiB.")
    out(table(["s", "requests", "DBSIZE", "limiters", "used MiB", "expired keys"], rows))
    out()
    out(table(["series", "first third", "last third", "start -> end", "verdict"], expiry_verdicts(expiry)))


def main() -> int:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, b._interrupt)
    started = time.monotonic()
    wasm = h.WASM
    try:
        b.heading("edge-rate-limiter soak (make soak)")
        load = os.getloadavg()
        changes = b._first_line(["git", "-C", str(b.REPO), "status", "--porcelain", "--", "src"])
        dirty = not changes.startswith("unavailable")  # a first line: something under src/ changed
        out(f"machine {os.cpu_count()} CPUs, load average {load[0]:.2f} at the start (shared by everything below)")
        for module in (wasm, h.WASM_HIGRESS):
            out(f"module {module.relative_to(b.REPO) if module.is_relative_to(b.REPO) else module}: "
                f"{num(module.stat().st_size)} B, sha256 {hashlib.sha256(module.read_bytes()).hexdigest()[:12]}, built "
                f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(module.stat().st_mtime))}")
        out(f"source git {b._first_line(['git', '-C', str(b.REPO), 'rev-parse', '--short', 'HEAD'])}"
            f"{' (src/ has uncommitted changes)' if dirty else ''}; SOAK_SECONDS {SECONDS}, SOAK_KEYS {num(KEYS)}, "
            f"sample every {SAMPLE_S} s")
        out(f"Bounds in the source: config cache <= {num(CACHE_SIZE)} names per VM (src/cache.rs, default cache_size), "
            f"local block <= {num(BLOCK_SLOTS)} shared data slots per process (src/block.rs), leases <= 64 per VM "
            "(src/lease.rs; no rule here leases).")
        with h.Stack() as stack:
            stack.start()
            soak = run_soak(stack)
            expiry = run_expiry(stack)
        print_results(soak, expiry)
    except (KeyboardInterrupt, h.HarnessError) as error:
        interrupted = isinstance(error, KeyboardInterrupt)
        print("\nsoak: interrupted; every process it started is stopped" if interrupted else f"soak: FAILED: {error}",
              file=sys.stderr)
        return 130 if interrupted else 1
    finally:
        h.Process.stop_all()
    out()
    out(f"Done in {time.monotonic() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
