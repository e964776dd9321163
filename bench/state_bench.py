"""Section 13 of `make bench` (bench/bench.py): Redis state per key (issue 41, "Quotas at any scale"): what one
limiter keeps in Redis, and how long Redis is busy with it, for a rule's two layouts (`layout`:
"sliding_log", Redisson's, the default; "sliding_window_counter") beside envoyproxy/ratelimit's layout, on one
redis-server, in the same run.

(a) Memory per key: MEMORY USAGE (SAMPLES 0: every element counted) summed over every key of one limiter after
    N admissions spread evenly over one window of 1 day, N = 100, 10,000 and 1,000,000, rate 2N per day (every
    call admitted), and the growth of INFO's used_memory over the fill:
    - the sliding log: the filter's ACQUIRE (src/script/lua/, as build.rs builds it: bench.acquire_source(),
      its SHA-1 checked in the stock module), one call of 1 permit per admission: the config hash `name`,
      `{name}:value` and `{name}:permits` (one sorted-set member per admission in the window);
    - the sliding window counter: the same script with type 2 and COUNTER_SLICES slices (one hash
      `{name}:counter`); 1 permit per call, unless N calls would take a minute (estimated after the first
      100,000: then the rest in calls of 1,000 permits, said so);
    - envoyproxy/ratelimit: what its Redis cache sends per request (src/redis/fixed_cache_impl.go), INCRBY key
      1 + EXPIRE key 86400 pipelined, on a key named as its CacheKeyGenerator names them
      (`<domain>_<descriptor key>_<value>_<window start, s>`, unit day), N times.
    The limiters' keys and arguments are checked against what the stock build itself writes: an Envoy with one
    rule of each layout (1 day) answers 100 requests of one user first, and the key names, the config hash,
    the counter's slice width and the filter's memory for those 100 are compared with this section's.
(b) SLOWLOG at 1,000 us (CONFIG SET slowlog-log-slower-than 1000, SLOWLOG RESET before each phase): the calls
    over 1 ms, and the slowest call by Redis's own latency tracking (INFO latencystats, p100 of EVALSHA,
    CONFIG RESETSTAT before each phase), for each layout: the fill of (a) at N = 1,000,000 (1 day); the window
    moving past it (201 calls, one every 1/200 of a day, the first one day after the fill began); and a burst
    (the counter: 1,000,000 permits at one instant in 1,000 calls; the sliding log: 100,000 members at one
    instant) released by one call a day later.

All on a redis-server of tests/e2e/harness.py (127.0.0.1, free port, stopped by PID), calls pipelined on one
connection with a simulated clock (ARGV now: the filter's `clock: "gateway"`), so a day passes in seconds.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any

import bench as b  # bench/bench.py: settings, tables, the ACQUIRE source, the RESP encoder
from bench import h, num, out, progress, table

DAY_MS = 86_400_000
COUNTS = (100, 10_000, 1_000_000)
CHUNK = 5_000  # calls pipelined per write
STEPS = 200  # (b): the window moves past the fill in this many steps (+1)
LOG_BURST = 100_000  # (b): the sliding log's members taken at one instant
COUNTER_BURST_CALLS, COUNTER_BURST_PERMITS = 1_000, 1_000  # (b): the counter's 1,000,000 permits at one instant
SLOWLOG_US = 1_000
COUNTER_LIMIT_S = 60.0  # 1,000,000 counter calls of 1 permit only if they take less than this (estimated
PROBE, BIG_PERMITS = 100_000, 1_000  # after the first PROBE calls); else the rest in calls of BIG_PERMITS
CONFIG_RS = b.REPO / "src" / "config" / "mod.rs"
T0 = 1_800_000_000_000  # the simulated clock's start (epoch ms; 2027-01-15)
CLIENT = "bench-client"  # the per-client keys' suffix (never written: type overall)
# envoyproxy/ratelimit: section 9's domain and descriptor (bench/ratelimit/config/peer-allowed.yaml), unit day.
RL_DOMAIN, RL_DESCRIPTOR, RL_USER = "peer-allowed", "x-user-id", "user-1"
RL_DIVIDER_S = 86_400


def counter_slices() -> int:
    """COUNTER_SLICES of src/config/mod.rs (the filter sends it as a counter's ARGV 7)."""
    match = re.search(r"pub const COUNTER_SLICES: u64 = (\d+);", CONFIG_RS.read_text())
    if not match:
        raise h.HarnessError("src/config/mod.rs has no `pub const COUNTER_SLICES: u64 = N;` (update bench/state_bench.py)")
    return int(match.group(1))


class Layout:
    """One of the filter's layouts: its keys and ACQUIRE's ARGV, as the filter's AcquireTemplate encodes them
    (checked against a real Envoy in check_against_filter())."""

    def __init__(self, kind: str, title: str, slices: int):
        self.kind = kind  # "log" or "counter"
        self.title = title
        self.slices = slices

    def keys(self, name: str) -> list[str]:
        value = "counter" if self.kind == "counter" else "value"
        return [name, h.limiter_key(name, value), h.limiter_key(name, f"value:{CLIENT}"),
                h.limiter_key(name, "permits"), h.limiter_key(name, f"permits:{CLIENT}")]

    def argv(self, now_ms: int, permits: int, rate: int, interval_ms: int) -> list[Any]:
        # ACQUIRE's ARGV: now, member bytes, permits, rate, interval, type, keepAliveTime (a counter: its
        # slices), apply (rate_source: config; off, the default).
        if self.kind == "counter":
            return [now_ms, os.urandom(16), permits, rate, interval_ms, 2, self.slices, 0]
        return [now_ms, os.urandom(16), permits, rate, interval_ms, 0, max(interval_ms, b.DEFAULT_KEEP_ALIVE_MS), 0]


class Pipe:
    """Commands pipelined on one raw connection (bench.RespClient), CHUNK at a time."""

    def __init__(self, port: int):
        self.raw = b.RespClient(port)

    def run(self, commands: list[bytes]) -> list[Any]:
        self.raw.sock.sendall(b"".join(commands))
        return [self.raw.reply() for _ in commands]

    def close(self) -> None:
        self.raw.close()


def acquired(reply: Any) -> bool:
    """ACQUIRE's reply: the permits left (acquired) or minus the delay (rejected), else an array [1, ...]."""
    return reply >= 0 if isinstance(reply, int) else int(reply[0]) == 1


@dataclass
class Fill:
    calls: int
    shape: str  # calls x permits
    seconds: float
    memory: int  # MEMORY USAGE, every key, SAMPLES 0
    grown: int  # INFO used_memory after - before
    keys: list[str]


class State:
    """The section's redis-server, the ACQUIRE script loaded."""

    def __init__(self, redis: h.Redis):
        self.redis = redis
        self.client = redis.client
        self.pipe = Pipe(redis.port)
        self.source = b.acquire_source()
        self.sha = self.client.script_load(self.source)

    def memory(self, keys: list[str]) -> tuple[int, list[str]]:
        present = [key for key in keys if self.client.exists(key)]
        return sum(int(self.client.memory_usage(key, samples=0) or 0) for key in present), present

    def used(self) -> int:
        return int(self.client.info("memory")["used_memory"])

    def acquire(self, layout: Layout, name: str, times: list[int], permits: int, rate: int,
                interval_ms: int = DAY_MS) -> int:
        """ACQUIREs of `permits` at each of `times` (ms), pipelined; returns how many were acquired."""
        keys = layout.keys(name)
        admitted = 0
        for start in range(0, len(times), CHUNK):
            commands = [b.RespClient.encode("EVALSHA", self.sha, 5, *keys, *layout.argv(t, permits, rate, interval_ms))
                        for t in times[start:start + CHUNK]]
            admitted += sum(acquired(reply) for reply in self.pipe.run(commands))
        return admitted

    def fill(self, layout: Layout, name: str, n: int, limit_s: float | None = None) -> Fill:
        """`n` permits admitted over one day in calls of 1 permit, evenly spread, rate 2n per day. With
        `limit_s`: if after PROBE calls the whole would take longer, the rest in calls of BIG_PERMITS (spread
        over the rest of the day)."""
        keys = layout.keys(name)
        self.client.delete(*keys)
        before = self.used()
        started = time.monotonic()
        times = [T0 + i * DAY_MS // n for i in range(n)]
        done = self.acquire(layout, name, times[:PROBE] if limit_s else times, 1, 2 * n)
        calls, big = done, 0
        if limit_s and n > PROBE:
            if (time.monotonic() - started) * n / PROBE < limit_s:
                done = self.acquire(layout, name, times[PROBE:], 1, 2 * n)
                calls += done
            else:
                big = (n - PROBE) // BIG_PERMITS
                done = self.acquire(layout, name, times[PROBE::BIG_PERMITS][:big], BIG_PERMITS, 2 * n)
                calls += done
        seconds = time.monotonic() - started
        expected = n if not big else PROBE + big
        if calls != expected:
            raise h.HarnessError(f"(13) {layout.title}, N={num(n)}: {expected - calls} of {expected} calls rejected")
        memory, present = self.memory(keys)
        shape = f"{num(n)} x 1" if not big else f"{num(PROBE)} x 1 + {num(big)} x {num(BIG_PERMITS)}"
        return Fill(expected, shape, seconds, memory, self.used() - before, present)

    def ratelimit_fill(self, n: int) -> Fill:
        """envoyproxy/ratelimit's Redis work for `n` requests of one descriptor in one day's window."""
        window = (T0 // 1000 // RL_DIVIDER_S) * RL_DIVIDER_S
        key = f"{RL_DOMAIN}_{RL_DESCRIPTOR}_{RL_USER}_{window}"
        self.client.delete(key)
        pair = b.RespClient.encode("INCRBY", key, 1) + b.RespClient.encode("EXPIRE", key, RL_DIVIDER_S)
        before = self.used()
        started = time.monotonic()
        for start in range(0, n, CHUNK):
            count = min(CHUNK, n - start)
            self.pipe.raw.sock.sendall(pair * count)
            for _ in range(2 * count):
                self.pipe.raw.reply()
        seconds = time.monotonic() - started
        if int(self.client.get(key) or 0) != n:
            raise h.HarnessError(f"(13) envoyproxy/ratelimit layout: {key} holds {self.client.get(key)!r}, not {n}")
        memory, present = self.memory([key])
        return Fill(n, f"{num(n)} x 1", seconds, memory, self.used() - before, present)

    def close(self) -> None:
        self.pipe.close()


# ---------------------------------------------------------------------------------------------------------
# The check against the stock build


def check_against_filter(state: State, stack: h.Stack, layouts: dict[str, Layout]) -> str:
    """An Envoy with the stock build, one rule per layout (1 day, rate 1,000), answers 100 requests of one user;
    the keys, the config hash and the counter's slice must be what this section's calls write. Returns the
    line that says so, with the filter's own memory for those 100 admissions."""
    module = h.WASM.read_bytes()
    if state.sha.encode() not in module:
        raise h.HarnessError(f"{h.WASM.name} does not hold the SHA-1 of ACQUIRE from src/script/lua/ "
                             f"({state.sha}): it is not the script the module runs (rebuild: make build)")
    user, requests = "state-check", 100
    try:
        plugin = h.plugin_config(h.rule("state-log", rate=1_000, interval="1d", layout="sliding_log"),
                                 h.rule("state-counter", rate=1_000, interval="1d", layout="sliding_window_counter"))
        envoy = stack.envoy(plugin, concurrency=1)
        started_ms = int(time.time() * 1000)
        statuses = [h.http_request(envoy.port, headers={"x-user-id": user}).status for _ in range(requests)]
        ended_ms = int(time.time() * 1000)
        if statuses.count(200) != requests:
            raise h.HarnessError(f"(13) the check's Envoy answered {sorted(set(statuses))}, not 200 to every request")
    finally:
        stack.stop_envoys()
        stack.webdis.stop()
        stack.upstream.stop()
    client = state.client
    found = {}
    lines = []
    for kind, rule_name in (("log", "state-log"), ("counter", "state-counter")):
        layout, name = layouts[kind], h.limiter_name(f"erl:{rule_name}", user)
        filters = sorted(k.decode() for k in client.keys(f"*{rule_name}*"))
        ours = "bench:check:" + kind
        state.acquire(layout, ours, [started_ms], 1, 1_000)
        mine = sorted(k.decode().replace(ours, name) for k in client.keys(f"*{ours}*"))
        if filters != mine:
            raise h.HarnessError(f"(13) {layout.title}: the filter wrote {filters}, this section writes {mine} "
                                 "(the module and src/ differ? rebuild: make build; else update bench/state_bench.py)")
        memory, _ = state.memory(filters)
        found[kind] = memory
        if kind == "log":
            fields = ("rate", "interval", "type", "keepAliveTime")
            theirs, own = client.hmget(name, *fields), client.hmget(ours, *fields)
            if theirs != own:
                raise h.HarnessError(f"(13) the sliding log's config: the filter wrote {theirs}, this section {own}")
        else:
            width = DAY_MS // layout.slices
            slices = {int(f) for f in client.hkeys(h.limiter_key(name, "counter"))}
            if not slices or not slices <= {started_ms // width, ended_ms // width}:
                raise h.HarnessError(f"(13) the filter's counter fields {slices} are not slices of {width} ms "
                                     f"({layout.slices} per day): update bench/state_bench.py")
            total = sum(int(v) for v in client.hvals(h.limiter_key(name, "counter")))
            if total != requests:
                raise h.HarnessError(f"(13) the filter's counter holds {total} permits, not {requests}")
        client.delete(*filters, *(k for k in client.keys(f"*{ours}*")))
        lines.append(f"{layout.title}: {', '.join(filters)}")
    return (f"Checked against the stock build ({h.WASM.name}, which holds ACQUIRE's SHA-1 {state.sha[:12]}): an Envoy "
            f"with one rule of each layout (1 day) answered {requests} requests of one user; it wrote the keys this "
            f"section writes for the same name ({'; '.join(lines)}), the same config hash, and counter fields that "
            f"are slices of 1/{layouts['counter'].slices} day. Its own memory for those {requests} admissions: sliding "
            f"log {num(found['log'])} B, counter {num(found['counter'])} B (one slice: {requests} requests in "
            f"{(ended_ms - started_ms) / 1000:.1f} s).")


# ---------------------------------------------------------------------------------------------------------
# (b) SLOWLOG


@dataclass
class Phase:
    layout: str
    what: str
    calls: int
    slow: list[int]  # durations (us) of the SLOWLOG entries, the EVALSHAs over SLOWLOG_US
    mean: float  # INFO commandstats usec_per_call of EVALSHA
    p99: float  # INFO latencystats of EVALSHA (us)
    p100: float


class Watch:
    """SLOWLOG and latency tracking over one phase."""

    def __init__(self, client: Any):
        self.client = client

    def start(self) -> None:
        self.client.slowlog_reset()
        self.client.config_resetstat()

    def phase(self, layout: str, what: str, calls: int) -> Phase:
        entries = self.client.slowlog_get(1_000)
        slow = sorted((int(e["duration"]) for e in entries if bytes(e["command"]).upper().startswith(b"EVALSHA")),
                      reverse=True)
        stats = self.client.info("latencystats").get("latency_percentiles_usec_evalsha", {})
        mean = float(self.client.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call", float("nan")))
        return Phase(layout, what, calls, slow, mean, float(stats.get("p99", float("nan"))),
                     float(stats.get("p100", float("nan"))))


def moving(state: State, layout: Layout, name: str, n: int) -> int:
    """STEPS + 1 calls of 1 permit as the window moves past the fill of `name` (n permits over T0's day)."""
    times = [T0 + DAY_MS + k * DAY_MS // STEPS for k in range(STEPS + 1)]
    for t in times:  # one at a time: each call's own time in SLOWLOG and latencystats
        state.acquire(layout, name, [t], 1, 2 * n)
    return len(times)


# ---------------------------------------------------------------------------------------------------------


def run_state() -> None:
    b.heading("13. Redis state per key: the sliding log vs the sliding window counter vs envoyproxy/ratelimit's "
              "layout (same redis-server)")
    started = time.monotonic()
    slices = counter_slices()
    log = Layout("log", "sliding log (default)", slices)
    counter = Layout("counter", "sliding window counter", slices)
    stack = h.Stack().start()  # redis-server, and webdis and the upstream for the check (stopped after it)
    state = State(stack.redis)
    client = state.client
    client.config_set("slowlog-log-slower-than", SLOWLOG_US)
    client.config_set("slowlog-max-len", 1_000)
    client.config_set("latency-tracking-info-percentiles", "50 99 100")
    watch = Watch(client)
    try:
        progress("(13) checking the keys against the stock build in Envoy")
        check = check_against_filter(state, stack, {"log": log, "counter": counter})
        client.flushall()
        fills: dict[tuple[str, int], Fill] = {}
        phases: list[Phase] = []
        for n in COUNTS:
            for kind, layout in (("counter", counter), ("log", log)):
                progress(f"(13a) {layout.title}, N={num(n)}")
                if n == COUNTS[-1]:
                    watch.start()
                limit = COUNTER_LIMIT_S if kind == "counter" and n == COUNTS[-1] else None
                fills[(kind, n)] = state.fill(layout, f"bench:state:{kind}:{n}", n, limit)
                if n == COUNTS[-1]:
                    fill = fills[(kind, n)]
                    phases.append(watch.phase(layout.title, f"fill: {num(n)} permits over 1 day, calls x permits "
                                              f"{fill.shape}", fill.calls))
                    progress(f"(13b) {layout.title}: the window moves past the {num(n)}")
                    watch.start()
                    calls = moving(state, layout, f"bench:state:{kind}:{n}", n)
                    phases.append(watch.phase(layout.title, f"the window moves past them: {calls} calls, one every "
                                              f"1/{STEPS} day from T+1 day", calls))
                    if kind == "log":
                        client.delete(*layout.keys(f"bench:state:{kind}:{n}"))  # ~120 MB
            progress(f"(13a) envoyproxy/ratelimit layout, N={num(n)}")
            fills[("ratelimit", n)] = state.ratelimit_fill(n)

        progress(f"(13b) the counter: {num(COUNTER_BURST_CALLS * COUNTER_BURST_PERMITS)} permits at one instant, "
                 "then one call a day later")
        name = "bench:state:counter:burst"
        watch.start()
        admitted = state.acquire(counter, name, [T0] * COUNTER_BURST_CALLS, COUNTER_BURST_PERMITS,
                                 2 * COUNTER_BURST_CALLS * COUNTER_BURST_PERMITS)
        burst_memory, _ = state.memory(counter.keys(name))
        phases.append(watch.phase(counter.title, f"burst: {num(COUNTER_BURST_CALLS * COUNTER_BURST_PERMITS)} permits "
                                  f"at one instant ({num(COUNTER_BURST_CALLS)} calls of "
                                  f"{num(COUNTER_BURST_PERMITS)})", COUNTER_BURST_CALLS))
        watch.start()
        admitted += state.acquire(counter, name, [T0 + DAY_MS], 1, 2 * COUNTER_BURST_CALLS * COUNTER_BURST_PERMITS)
        phases.append(watch.phase(counter.title, "one call a day later, releasing them all", 1))
        if admitted != COUNTER_BURST_CALLS + 1:
            raise h.HarnessError(f"(13b) counter burst: {COUNTER_BURST_CALLS + 1 - admitted} calls rejected")

        progress(f"(13b) the sliding log: {num(LOG_BURST)} members at one instant, then one call a day later")
        name = "bench:state:log:burst"
        watch.start()
        admitted = state.acquire(log, name, [T0] * LOG_BURST, 1, 2 * LOG_BURST)
        phases.append(watch.phase(log.title, f"burst: {num(LOG_BURST)} members at one instant", LOG_BURST))
        watch.start()
        admitted += state.acquire(log, name, [T0 + DAY_MS], 1, 2 * LOG_BURST)
        phases.append(watch.phase(log.title, f"one call a day later, releasing {num(LOG_BURST)} members", 1))
        if admitted != LOG_BURST + 1:
            raise h.HarnessError(f"(13b) sliding log burst: {LOG_BURST + 1 - admitted} calls rejected")
        left = client.zcard(h.limiter_key(name, "permits"))
        if left != 1:
            raise h.HarnessError(f"(13b) sliding log burst: {left} members left after the release, not 1")
    finally:
        state.close()
        stack.close()

    print_state(fills, phases, check, burst_memory)
    out(f"Section 13 took {time.monotonic() - started:.0f} s.")


def print_state(fills: dict[tuple[str, int], Fill], phases: list[Phase], check: str, burst_memory: int) -> None:
    titles = {"log": "our sliding log (default; Redisson's layout)", "counter": "our sliding window counter",
              "ratelimit": "envoyproxy/ratelimit (INCRBY + EXPIRE, fixed window)"}
    out(f"(a) Redis memory per key: MEMORY USAGE (SAMPLES 0) summed over every key of one limiter after N admissions "
        f"spread evenly over one window of 1 day, rate 2N per day (every call admitted); used_memory: INFO's growth "
        f"over the fill (with Redis's own buffers: meaningful at 1,000,000 only). Ours: ACQUIRE (src/script/lua/) "
        f"with a simulated clock, pipelined, 1 permit per call (the counter at N={num(COUNTS[-1])}: the rest in calls "
        f"of {num(BIG_PERMITS)} if the first {num(PROBE)} calls said 1 per call would take over {COUNTER_LIMIT_S:.0f} "
        f"s)"
        f"; envoyproxy/ratelimit: INCRBY key 1 + EXPIRE key {RL_DIVIDER_S} per request, its key "
        f"<domain>_<descriptor>_<value>_<window start> (unit day).")
    rows = []
    for kind in ("log", "counter", "ratelimit"):
        for n in COUNTS:
            fill = fills[(kind, n)]
            rows.append([titles[kind] if n == COUNTS[0] else "", num(n), fill.shape, num(fill.memory),
                         f"{fill.memory / n:.3g}",
                         num(fill.grown), f"{fill.seconds:.1f}", ", ".join(fill.keys)])
    out(table(["layout", "N", "calls x permits", "MEMORY USAGE B", "B per admission", "used_memory growth B", "fill s",
               "keys"], rows))
    worst = max(fills[("counter", n)].memory for n in COUNTS)
    out(f"Target: the sliding window counter at most 1 KB per key at every N: at most {num(worst)} B "
        f"({'met' if worst <= 1024 else 'not met'}); after {num(COUNTER_BURST_CALLS * COUNTER_BURST_PERMITS)} "
        f"permits at one instant (one slice): {num(burst_memory)} B. The sliding log at N={num(COUNTS[-1])}: "
        f"{num(fills[('log', COUNTS[-1])].memory)} B, {fills[('log', COUNTS[-1])].memory / COUNTS[-1]:.0f} B per "
        f"admission.")
    out(check)
    out()
    out(f"(b) SLOWLOG at {num(SLOWLOG_US)} us (slowlog-log-slower-than {SLOWLOG_US}, reset before each phase): the "
        "EVALSHA calls over 1 ms and the slowest of them; and Redis's own latency tracking of every EVALSHA of the "
        "phase (INFO latencystats, CONFIG RESETSTAT before each phase; wall time inside Redis, so a call the "
        "machine descheduled counts too).")
    rows = []
    for phase in phases:
        rows.append([phase.layout, phase.what, num(phase.calls), num(len(phase.slow)),
                     num(phase.slow[0]) if phase.slow else "-", f"{phase.mean:,.1f}", f"{phase.p99:,.0f}",
                     f"{phase.p100:,.0f}"])
    out(table(["layout", "phase", "calls", "calls > 1 ms (SLOWLOG)", "slowest logged us", "mean us", "p99 us",
               "slowest us"], rows, left=2))
    counter_slow = [d for p in phases if p.layout.startswith("sliding window counter") for d in p.slow]
    load = os.getloadavg()[0]
    out(f"Target: no call of the counter over 1 ms while a key of a 1-day window holds 1,000,000 permits: "
        f"{len(counter_slow)} SLOWLOG entries" + (f" ({', '.join(num(d) for d in counter_slow[:8])} us)" if counter_slow
                                                   else "") + f" ({'met' if not counter_slow else 'not met'}); load "
        f"average {load:.2f} now (a call descheduled by other work on the machine's CPUs counts its wait).")
