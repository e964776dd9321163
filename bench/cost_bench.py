"""Section 11 of `make bench` (bench/bench.py): token budgets, a rule's `cost` (docs/configuration.md): each
request reserves its `max_tokens` and is settled to the tokens its response reports ("reserve, then
settle"), against charge-after (`"reserve": 1`: the request takes 1 permit and its cost is charged when the
response ends, as Higress's ai-token-ratelimit and Envoy AI Gateway count tokens, the baseline), measured in
the same run.

(a) Exactness under load: one Envoy (--concurrency BENCH_CONCURRENCY) in front of tests/e2e/llm_upstream.py
    (a real HTTP/1.1 server answering as OpenAI's streamed chat completions with `include_usage`, 5 ms between
    events), BENCH_COST_CLIENTS [16] clients for BENCH_COST_SECONDS [8] per configuration, each request
    reserving `x-max-tokens` (500 to 2,000) and costing at most that, one budget of BENCH_COST_BUDGET
    [10000] tokens per 2 s: the tokens of the limiter's members (acquire-time scores, settled sizes, read
    from Redis all along) per whole 2-s window and in the fullest sliding 2-s window against the budget
    (overshoot), requests admitted and rejected, tokens per admitted request.
(b) What settling costs the gateway: one Envoy at a time answering itself (direct_response) with a chat
    completion body, wrk as in section 1 (x-user-id over 64 users, bench/users.lua) at each of
    BENCH_COST_CONNECTIONS [8,32] connections, BENCH_COST_ROUNDS [9,3] interleaved rounds of BENCH_DURATION s (per count): Envoy without
    the filter, the rule with `permits: 1000` and no cost (the baseline: one acquire per request), and the same
    rule reserving 1000 and settled by a response header or by its usage (OpenAI JSON, 0.3 KB; OpenAI event
    stream, 1.5 KB; Anthropic event stream): req/s, Redis script calls and CPU microseconds per request by
    process, against the target of at most +60 us per request for settling at -c8 (judged on the median of
    the rounds' paired differences: the cost header row minus the fixed permits row, run back to back).
(c) Guest cost: the Higress build in the host emulator (`wasm-host replay --function-profile`, 2 VMs,
    2,000 requests, 16 at once), each request answered with the body in its pieces (one
    `proxy_on_response_body` each): fixed permits vs settled by usage, per format: all guest fuel per
    request and Redis calls per request.
(d) The real SDKs on one budget: BENCH_COST_SDK_CLIENTS [16] clients at once, the last
    BENCH_COST_SDK_ANTHROPIC [4] of them the `anthropic` SDK and the others the `openai` SDK, one client per
    thread of a child process (this file run with --sdk-clients: its own interpreter lock), at the SDKs'
    defaults but base_url, api_key, max_retries=0 and timeout, half of the calls streamed, each asking
    max_tokens 500 to 2,000 and using less, for BENCH_COST_SDK_SECONDS [10] per configuration, through one
    Envoy with the filter, webdis and Redis to the LLM upstream answering as the APIs do (it compresses JSON
    when asked). The configuration a user writes: `reserve: {"body": "openai", ...}`, `settle: {"usage":
    "openai", "include_usage": true}`, and on the route of /v1/messages (`_rules_`) the Anthropic readers,
    one limiter for both; charge-after (`reserve: 1`) as the baseline. Every admitted call settled to the
    usage its response reported (the members against the upstream's record, none left `-r`), the fullest
    sliding window by acquire time against the budget, the tokens of every whole window (target >= 95%).
(e) The degraded mode with costs: 2 Envoys with `failure_mode: "local"`, `local_fallback: {"gateways": 2}`,
    the budget and clients of (d) for BENCH_COST_DEGRADED_SECONDS [8], Redis up (the baseline) then Redis
    stopped: what each gateway admitted per window, by its own clock (its access log: when each body went
    upstream after the decision, when each answer came back to be settled), against floor(rate / gateways);
    the same by the upstream's record of every request, for comparison.

Every process comes from tests/e2e/harness.py (Envoy, redis-server, webdis, wrk; wasm-host as in section 5)
on 127.0.0.1 with free ports, stopped by PID when the section ends.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

import bench as b  # bench/bench.py: settings, wrk, tables, CPU readers
import coalescing_bench as cb  # section 10: its rows of wrk runs, module lines, the profile's total
import llm_upstream as llm  # tests/e2e/llm_upstream.py: the LLM upstream and the token budget in Redis
from bench import h, num, out, progress, table

CLIENTS = b._env_int("BENCH_COST_CLIENTS", 16)
SECONDS = b._env_int("BENCH_COST_SECONDS", 8)
BUDGET = b._env_int("BENCH_COST_BUDGET", 10_000)
WINDOW_MS = 2000
RESERVE_RANGE = (500, 2000)
TIMEOUT = "500ms"  # the filter's Redis timeout, as in sections 1 and 10

# (b): every request allowed.
ALLOWED_RATE = 1_000_000  # per user per 1 s
FIXED_PERMITS = 1000
USERS = 64
# The usage each body of (b) and (c) reports.
INPUT_TOKENS, OUTPUT_TOKENS = 120, 345

# (c)
REPLAY_REQUESTS = 2_000
REPLAY_CONCURRENCY = 16


def _env_counts(name: str, default: str) -> list[int]:
    """A comma-separated list of whole numbers >= 1 (e.g. BENCH_COST_CONNECTIONS=8,32)."""
    text = os.environ.get(name, "").strip() or default
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sys.exit(f"bench: {name}={text!r} is not a list of whole numbers")
    if not values or min(values) < 1:
        sys.exit(f"bench: {name} must list whole numbers >= 1")
    return values


# (b): wrk connections, one pass of every row per value; interleaved rounds of every row per pass.
CPU_CONNECTIONS = _env_counts("BENCH_COST_CONNECTIONS", "8,32")
# Interleaved rounds per connection count, in CPU_CONNECTIONS' order (one value: every count): the target's
# load (-c8) gets more, since one round's pair moves by +/-25 us (a 5-round median moved 34-86 us over seven
# runs); -c32 is reported only.
CPU_ROUNDS = _env_counts("BENCH_COST_ROUNDS", "9,3")


def rounds_at(connections: int) -> int:
    """The interleaved rounds of (b) at `connections`."""
    at = CPU_CONNECTIONS.index(connections) if connections in CPU_CONNECTIONS else 0
    return CPU_ROUNDS[min(at, len(CPU_ROUNDS) - 1)]
SETTLE_CPU_TARGET_US = 60.0  # settling's CPU per request over fixed permits, at wrk -c8

# (d) and (e): the real SDKs.
SDK_CLIENTS = b._env_int("BENCH_COST_SDK_CLIENTS", 16)
SDK_ANTHROPIC = min(int(os.environ.get("BENCH_COST_SDK_ANTHROPIC", "").strip() or 4), SDK_CLIENTS)
SDK_SECONDS = b._env_int("BENCH_COST_SDK_SECONDS", 10)
DEGRADED_SECONDS = b._env_int("BENCH_COST_DEGRADED_SECONDS", 8)
SDK_TIMEOUT_S = 20.0  # the clients' `timeout` (the SDKs' default is 10 minutes)
SDK_BACKOFF_S = 0.05  # a client's pause after a 429 (max_retries=0: the SDK raises it at once)
SDK_INPUT = (20, 200)  # input tokens of a call (its prompt's words): the output is 1 to max_tokens - input
SDK_STREAMED = 0.5  # the share of streamed calls
SDK_DELAY_MS = 5  # the upstream's pause between events (streams) or pieces (JSON)
API_KEY = "sk-bench"
# The models the clients of each gateway ask for (one gateway in (d), two in (e)): the upstream's record of
# each request (its JSON body) tells which gateway it came through. The budget is one limiter whatever the model.
OPENAI_MODELS = ("gpt-4o-mini", "gpt-4.1-mini")
ANTHROPIC_MODELS = ("claude-sonnet-4-5", "claude-haiku-4-5")
ANTHROPIC_ROUTE = "anthropic-messages"  # the Envoy route of /v1/messages, named in `_rules_`
WHOLE_TARGET = 0.95  # of the budget, in every whole window, reserving then settling
NARROW_MS = 5  # acquires stamped by the gateway's clock reach Redis a few ms out of order (section 6)
GATEWAYS = 2  # (e): `local_fallback.gateways`, and the Envoys started


@dataclass(frozen=True)
class Settle:
    """One configuration: its title, the body format the upstream answers with, the rule's `cost` (None:
    `permits: FIXED_PERMITS`; `filters` "none": Envoy without the filter) and the `x-cost` header the upstream
    adds (for `{"response_header": "x-cost"}`)."""
    key: str
    title: str
    fmt: str
    cost: dict | None
    filters: str = "wasm"
    cost_header: int | None = None  # the upstream's x-cost response header


NONE = Settle("none", "Envoy, no filter", "openai-sse", None, "none")
FIXED = Settle("fixed", f"permits: {FIXED_PERMITS}, no cost (baseline)", "openai-sse", None)
# Settled by a response header with the same body: the settle call without reading the body.
HEADER = Settle("settle-header", "settled by a response header (x-cost)", "openai-sse",
                {"reserve": FIXED_PERMITS, "settle": {"response_header": "x-cost"}},
                cost_header=INPUT_TOKENS + OUTPUT_TOKENS)


def by_usage(fmt: str, title: str) -> Settle:
    """Reserving FIXED_PERMITS, settled by the usage of `fmt`'s provider, the upstream answering in `fmt`."""
    return Settle(f"settle-{fmt}", title, fmt, {"reserve": FIXED_PERMITS, "settle": {"usage": llm.PROVIDER[fmt]}})


SETTLED = [HEADER] + [by_usage(fmt, f"reserve {FIXED_PERMITS}, settled by usage: {fmt}")
                      for fmt in ("openai-json", "openai-sse", "anthropic-sse")]
REPLAYED = [FIXED, HEADER] + [by_usage(fmt, f"settled by usage: {fmt}")
                              for fmt in ("openai-json", "openai-sse", "anthropic-sse", "gemini-sse")]
# A row of wasm-host's "top 40 by exclusive fuel" table: exclusive, %, inclusive, %, calls, function.
TOP_ROW = re.compile(r"^\s+([0-9.]+)\s+[0-9.]+\s+([0-9.]+)\s+[0-9.]+\s+([0-9.]+)\s+(\S.*)$")


# ---------------------------------------------------------------------------------------------------------
# (a) exactness under load


@dataclass
class LoadRow:
    title: str
    load: llm.Load
    window: llm.Window = field(init=False)
    whole: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.window = llm.fullest_window(self.load.found, WINDOW_MS)
        self.whole = llm.fixed_windows(self.load.found, WINDOW_MS, self.load.start_ms, self.load.end_ms)


def run_exactness(stack: h.Stack, upstream: llm.LlmUpstream) -> list[LoadRow]:
    reserve = h.rule("settle", limit_by={"header": "x-settle-key"}, rate=BUDGET, interval=WINDOW_MS,
                     cost={"reserve": {"header": "x-max-tokens", "default": 1000}, "settle": {"usage": "openai"}})
    after = h.rule("after", limit_by={"header": "x-after-key"}, rate=BUDGET, interval=WINDOW_MS,
                   cost={"reserve": 1, "settle": {"usage": "openai"}})
    envoy = stack.envoy(h.plugin_config(reserve, after, timeout=TIMEOUT), concurrency=b.CONCURRENCY,
                        upstream_port=upstream.port)
    rows = []
    try:
        for name, title in (("after", "charge-after: reserve 1 (baseline)"),
                            ("settle", "reserve x-max-tokens, then settle")):
            progress(f"(11a) {title}: {CLIENTS} clients, {SECONDS} s")
            load = llm.run_load(envoy.port, {f"x-{name}-key": "team"}, stack.redis, f"erl:{name}:team", WINDOW_MS,
                                clients=CLIENTS, seconds=SECONDS, reserve=RESERVE_RANGE)
            rows.append(LoadRow(title, load))
    finally:
        stack.stop_envoys()
    return rows


def print_exactness(rows: list[LoadRow]) -> None:
    out(f"(a) Exactness: one Envoy (--concurrency {b.CONCURRENCY}) in front of a real LLM-like upstream "
        f"(tests/e2e/llm_upstream.py, OpenAI streamed chat completions, 5 ms between events), {CLIENTS} clients "
        f"back to back for {SECONDS} s per configuration (a client pauses 50 ms after a 429), each request "
        f"reserving x-max-tokens ({num(RESERVE_RANGE[0])}-{num(RESERVE_RANGE[1])}) and costing at most that; "
        f"one budget of {num(BUDGET)} tokens per {WINDOW_MS // 1000} s. Tokens: the limiter's members read from "
        "Redis every 50 ms (each request's acquire-time score and settled size).")
    rows_out = []
    for row in rows:
        load = row.load
        over = row.window.tokens / BUDGET - 1
        whole = f"{num(min(row.whole))}-{num(max(row.whole))}" if row.whole else "-"
        rows_out.append([
            row.title, num(load.admitted), num(load.rejected), num(load.tokens),
            num(load.tokens / load.admitted) if load.admitted else "-", whole,
            num(row.window.tokens), f"{over:+.1%}", num(row.window.requests),
            num(sum(m.permits for m in load.found) - load.tokens), num(load.other),
        ])
    out(table(["configuration", "admitted", "rejected", "tokens admitted", "tokens/request",
               f"tokens per whole {WINDOW_MS // 1000}-s window", "fullest sliding window", "vs budget",
               "requests in it", "Redis - upstream tokens", "other answers"], rows_out))
    after, settle = rows
    out(f"Reading: charge-after admits a request while the budget has 1 token left, so every request in flight "
        f"spends past the budget: its fullest window held {num(after.window.tokens)} tokens "
        f"({after.window.tokens / BUDGET - 1:+.0%}); reserving first, no window held more than the budget "
        f"({num(settle.window.tokens)}, {settle.window.tokens / BUDGET:.0%} of it), and settling gave the unused "
        f"part of each reservation back ({num(settle.load.tokens / settle.load.admitted) if settle.load.admitted else '-'} "
        f"tokens per request of {num(sum(RESERVE_RANGE) / 2)} reserved on average). Redis - upstream: the members' "
        "permits minus the tokens the upstream reported for the admitted requests (0: every request was settled "
        "to its usage).")


# ---------------------------------------------------------------------------------------------------------
# (b) CPU per request


def llm_envoy_yaml(rendered: str, settle: Settle) -> str:
    """Section 1's Envoy (the route answering itself) answering with `settle.fmt`'s body and content type."""
    text = b.bench_envoy_yaml(rendered, settle.filters)
    if text.count(b.DIRECT_RESPONSE) != 1:
        raise h.HarnessError("bench.DIRECT_RESPONSE changed: update llm_envoy_yaml() in bench/cost_bench.py")
    line = next(line for line in text.splitlines() if b.DIRECT_RESPONSE in line)
    indent = line[:len(line) - len(line.lstrip())]
    body = "".join(llm.chunks(settle.fmt, INPUT_TOKENS, OUTPUT_TOKENS))
    added = [("content-type", llm.content_type(settle.fmt))]
    added += [("x-cost", str(settle.cost_header))] if settle.cost_header is not None else []
    headers = ", ".join(f"{{ header: {{ key: {name}, value: \"{value}\" }}, append_action: OVERWRITE_IF_EXISTS_OR_ADD }}"
                        for name, value in added)
    answer = (f"direct_response: {{ status: 200, body: {{ inline_string: {json.dumps(body)} }} }}\n{indent}"
              f"response_headers_to_add: [{headers}]")
    return text.replace(b.DIRECT_RESPONSE, answer)


def run_cpu(stack: h.Stack) -> dict[int, list[cb.AllowedRow]]:
    """Every row's Envoy started once; per wrk connection count (CPU_CONNECTIONS), a warm-up of each, then
    rounds_at(connections) interleaved runs of each (a round runs every row once, one after the other)."""
    envoys = []
    for settle in [NONE, FIXED, *SETTLED]:
        fields: dict[str, Any] = {"cost": settle.cost} if settle.cost else {"permits": FIXED_PERMITS}
        plugin = h.plugin_config(h.rule("cost-allowed", rate=ALLOWED_RATE, interval="1s", **fields), timeout=TIMEOUT)
        envoy = h.Envoy(stack.workdir, plugin, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                        concurrency=b.CONCURRENCY, name=f"envoy-cost-{settle.key}")
        envoy.yaml_path.write_text(llm_envoy_yaml(envoy.yaml_path.read_text(), settle))
        stack.envoys.append(envoy)
        envoy.start(wait_ready=False)
        envoys.append((settle, envoy))
    by_connections: dict[int, list[cb.AllowedRow]] = {}
    try:
        for _, envoy in envoys:
            envoy.wait_ready()
        with cb.wrk_users(USERS):
            for connections in CPU_CONNECTIONS:
                rows = []
                for settle, envoy in envoys:
                    config = cb.Config(settle.key, settle.title, None if settle.filters == "none" else {})
                    rows.append(cb.AllowedRow(config, b.Scenario(settle.key, settle.title, "2xx", envoy=envoy,
                                                                  filters=settle.filters)))
                by_connections[connections] = rows
                threads = min(b.THREADS, connections)
                for row in rows:
                    b.run_wrk(row.scenario.envoy.port, b.WARM_UP_S, stack.workdir,  # type: ignore[union-attr]
                              f"warm-cost-{row.config.key}-c{connections}", connections, threads)
                for round_index in range(rounds_at(connections)):
                    for row in rows:
                        progress(f"(11b) {row.config.title}, -c{connections}: round {round_index + 1}/"
                                 f"{rounds_at(connections)}, "
                                 f"{b.DURATION} s")
                        row.runs.append(b.measured_run(row.scenario.envoy, stack,  # type: ignore[arg-type]
                                                       f"cost-{row.config.key}-c{connections}-{round_index}",
                                                       connections=connections, threads=threads))
    finally:
        stack.stop_envoys()
    return by_connections


def run_cpu_per_request(run: b.GatewayRun) -> float:
    """One run's CPU microseconds per answered request, the four processes together (nan without answers)."""
    answered = b.answers(run)[0]
    if not answered:
        return float("nan")
    return 1e6 * sum(run.cpu.get(name, 0.0) for name in cb.CPU_NAMES) / answered


def paired_over(row: cb.AllowedRow, baseline: cb.AllowedRow) -> list[float]:
    """Per round, `row`'s CPU per request minus `baseline`'s (us): the rows of a round run back to back."""
    return [run_cpu_per_request(a) - run_cpu_per_request(z) for a, z in zip(row.runs, baseline.runs)]


def print_cpu(by_connections: dict[int, list[cb.AllowedRow]]) -> None:
    out()
    out(f"(b) What settling costs: one Envoy at a time, --concurrency {b.CONCURRENCY}, the route answering itself "
        f"(direct_response 200 with the body of the format named, reporting {INPUT_TOKENS} + {OUTPUT_TOKENS} "
        f"tokens), rule per-user {num(ALLOWED_RATE)} per 1 s over {USERS} users (never reached); wrk "
        f"-t{b.THREADS} -d{b.DURATION}s at " + " and ".join(f"-c{c} ({rounds_at(c)} rounds)" for c in by_connections)
        + ", interleaved (req/s: the median; CPU: all rounds' CPU over all their requests). Scripts/req: EVALSHA+EVAL in Redis / requests answered; CPU: microseconds per answered "
        "request by process; settlements/req: the filter's counter; mean batch: batched_calls / batches (acquires "
        "and settles together).")
    summary = []
    for connections, rows in by_connections.items():
        base = rows[0]
        rows_out = []
        for row in rows:
            cpu = row.cpu_per_request()
            requests = row.requests()
            rows_out.append([
                row.config.title, num(row.rps()), b.spread([run.wrk.rps for run in row.runs]),
                f"{row.rps() / base.rps():.2f}", f"{row.scripts_per_request():.3f}",
                f"{row.stat('settlements') / requests:.3f}" if requests else "-",
                cb.batch_size(row.stat("batches"), row.stat("batched_calls")) if row.config.redis is not None else "-",
                *(f"{cpu.get(name, 0.0):.0f}" for name in cb.CPU_NAMES), f"{cpu.get('total', 0.0):.0f}",
                num(b.median(run.wrk.p50 for run in row.runs)), b._answers_cell(row.scenario, row.runs),
            ])
        out()
        out(f"wrk -c{connections}:")
        out(table(["gateway", "req/s", "req/s spread", "vs no filter", "scripts/req", "settlements/req",
                   "mean batch"] + [f"{name} us" for name in cb.CPU_NAMES] + ["total us", "p50 us", "answers"],
                  rows_out))
        fixed, header = rows[1].cpu_per_request(), rows[2].cpu_per_request()

        def more(cpu: dict[str, float], than: dict[str, float]) -> str:
            return (f"{cpu.get('total', 0) - than.get('total', 0):+.0f} us "
                    f"(Envoy {cpu.get('Envoy', 0) - than.get('Envoy', 0):+.0f})")

        reads = "; ".join(f"{row.config.key.removeprefix('settle-')} {more(row.cpu_per_request(), header)}"
                          for row in rows[3:])
        out(f"Reading (-c{connections}): over the fixed-permits baseline, the settle call (a cost header, the body "
            f"not read) costs {more(header, fixed)} per request ({rows[1].scripts_per_request():.3f} -> "
            f"{rows[2].scripts_per_request():.3f} script calls per request: settles ride in the acquire calls "
            f"that leave for their destination, else go out from the tick in one batch per destination). Reading the usage from the body, over the cost header: {reads}.")
        pooled = header.get("total", 0) - fixed.get("total", 0)
        paired = paired_over(rows[2], rows[1])
        added = b.median(paired)
        out(f"Paired rounds (-c{connections}): the cost header row over fixed permits, round by round (the two "
            f"rows run back to back in each round): {', '.join(f'{d:+.0f}' for d in paired)} us; median "
            f"{added:+.0f} us (all rounds pooled: {pooled:+.0f} us). The target is judged on the median of the "
            "paired rounds: a round that the machine disturbed moves one pair, not the figure.")
        by_usage = [row.cpu_per_request().get("total", 0) - fixed.get("total", 0) for row in rows[3:]]
        worst = max(row.scripts_per_request() for row in rows[2:])
        summary.append([f"-c{connections}", f"{added:+.0f} us (pooled {pooled:+.0f})", f"{min(by_usage):+.0f} to {max(by_usage):+.0f} us",
                        f"{rows[1].scripts_per_request():.3f}", f"{worst:.3f}",
                        f"<= +{SETTLE_CPU_TARGET_US:.0f} us" if connections == 8 else "(reported)",
                        _met(added <= SETTLE_CPU_TARGET_US) if connections == 8 else "-"])
    out()
    out(table(["target (b)", "settling's CPU per request over fixed permits (cost header row; median of paired rounds)",
               "settled by usage over fixed permits", "script calls per request: fixed permits",
               "settled rows (most)", "target", "met"], summary))


# ---------------------------------------------------------------------------------------------------------
# (c) guest fuel


@dataclass
class FuelRow:
    settle: Settle
    summary: dict[str, Any]
    fuel_total: float  # all guest fuel during the replay (the function profile's total) per request
    top: list[tuple[float, float, str]]  # per request: exclusive fuel, calls, function (top by exclusive)

    def metric(self, name: str) -> int:
        return int(self.summary.get("metrics", {}).get(f"{h.EMULATOR_METRIC_PREFIX}{name}", 0))


def run_fuel(stack: h.Stack) -> list[FuelRow]:
    args = ["--concurrency", str(REPLAY_CONCURRENCY)]
    clusters = {"redis": stack.redis.port}
    rows = []
    for settle in REPLAYED:
        fields: dict[str, Any] = {"cost": settle.cost} if settle.cost else {"permits": FIXED_PERMITS}
        plugin = h.host_plugin_config(h.rule("cost-replay", rate=ALLOWED_RATE, interval="1s", **fields),
                                      timeout=TIMEOUT)
        response = llm.response_spec(settle.fmt, INPUT_TOKENS, OUTPUT_TOKENS, cost=settle.cost_header)
        requests = [{"headers": [["x-user-id", f"u{i % USERS}"]], "response": response}
                    for i in range(REPLAY_REQUESTS)]
        stack.redis.client.flushall()
        progress(f"(11c) {settle.title}: wasm-host replay, {num(REPLAY_REQUESTS)} requests")
        b.replay_output("higress", plugin, clusters, requests[:2 * REPLAY_CONCURRENCY], stack.workdir, args)
        summary, stderr = b.replay_output("higress", plugin, clusters, requests, stack.workdir,
                                          args + ["--function-profile"])
        match = cb.PROFILE_TOTAL.search(stderr)
        if match is None:
            raise h.HarnessError(f"wasm-host replay --function-profile printed no total:\n{stderr[-2000:]}")
        rows.append(FuelRow(settle, summary, float(match.group(1)), top_functions(stderr)))
    return rows


def top_functions(stderr: str) -> list[tuple[float, float, str]]:
    """wasm-host's top functions by exclusive fuel, per request: (exclusive fuel, calls, function)."""
    table = stderr.split("by exclusive fuel:", 1)[-1].split("by inclusive fuel:", 1)[0]
    return [(float(m.group(1)), float(m.group(3)), m.group(4))
            for m in map(TOP_ROW.match, table.splitlines()) if m]


def print_fuel(rows: list[FuelRow]) -> None:
    out()
    out(f"(c) Guest cost: the Higress build ({h.WASM_HIGRESS.name}) in the host emulator, wasm-host replay --vms 2 "
        f"--concurrency {REPLAY_CONCURRENCY}, {num(REPLAY_REQUESTS)} requests over {USERS} users, each answered with "
        "the format's body in its pieces (one proxy_on_response_body each, then the end of stream), after a warm-up "
        "replay. Fuel: wasmtime fuel (about one per wasm instruction), all guest fuel of the replay (the function "
        "profile's total, the settle replies included) / requests.")
    base = rows[0]
    header = next(row for row in rows if row.settle is HEADER)
    rows_out = []
    for row in rows:
        requests = row.summary["requests"]
        body = sum(len(piece) for piece in llm.chunks(row.settle.fmt, INPUT_TOKENS, OUTPUT_TOKENS))
        reads = row.settle.cost is not None and "usage" in row.settle.cost["settle"]
        rows_out.append([
            row.settle.title, row.settle.fmt, num(body), num(row.fuel_total), f"{row.fuel_total - base.fuel_total:+,.0f}",
            f"{(row.fuel_total - header.fuel_total) / body:.1f}" if reads else "-",
            f"{row.metric('redis_calls') / requests:.2f}", num(row.metric("settlements")),
            ", ".join(f"{n} {k}" for k, n in sorted(row.summary["outcomes"].items())),
        ])
    out(table(["configuration", "body", "body bytes", "fuel per request", "vs fixed permits",
               "reading the usage: fuel per body byte", "Redis calls/req", "settlements", "outcomes"], rows_out))
    out(f"Reading: the settle call alone (a cost header, the body not read) costs "
        f"{header.fuel_total - base.fuel_total:+,.0f} fuel per request; reading the usage adds the rest (per body "
        "byte: the row's fuel over the cost header's, / the body's bytes). Where the fuel of the slowest format goes (exclusive fuel per request, calls per request):")
    worst = max(rows, key=lambda row: row.fuel_total)
    out(table([f"function ({worst.settle.fmt})", "exclusive fuel/req", "calls/req"],
              [[name[:90], num(fuel), f"{calls:.1f}"] for fuel, calls, name in worst.top[:8]]))


# ---------------------------------------------------------------------------------------------------------
# (d) the real SDKs, 16 at once on one budget; (e) the degraded mode with costs


def sdk_rule(name: str, api: str, reserve_body: bool) -> dict:
    """A rule of the token budget `erl:<name>` as a user writes it for `api`'s clients: reserving the
    request body's max tokens (or 1: charge-after, the baseline), settled to the usage `api` reports. Every
    rule of the budget names the same limiter (`limit_by: "global"`, `limiter`): one budget for every call."""
    settle: dict[str, Any] = {"usage": api}
    if api == "openai":
        settle["include_usage"] = True
    reserve: Any = {"body": api, "default": RESERVE_RANGE[1]} if reserve_body else 1
    return h.rule(f"{name}-{api}", limit_by="global", limiter=f"erl:{name}", rate=BUDGET, interval=WINDOW_MS,
                  cost={"reserve": reserve, "settle": settle})


def sdk_plugin(name: str, reserve_body: bool, **fields: Any) -> dict:
    """The gateway's configuration: the OpenAI rule on every route, the Anthropic rule (Anthropic's body and
    usage, the same limiter) on the route of /v1/messages (`_rules_`); the local block at its default."""
    return h.plugin_config(sdk_rule(name, "openai", reserve_body), timeout=TIMEOUT,
                           _rules_=[{"_match_route_": [ANTHROPIC_ROUTE],
                                     "rules": [sdk_rule(name, "anthropic", reserve_body)]}], **fields)


# (e)'s access log: per request, its x-request-id (Envoy's, sent upstream too), its start (epoch us) and, us
# after it, when its body's last byte arrived (the filter decides in that callback), when the body had gone
# upstream (after the decision) and when the answer's last byte came back (the filter settles in that one).
GATEWAY_TIMES = {"id": "%REQ(X-REQUEST-ID)%", "status": "%RESPONSE_CODE%", "start_us": "%START_TIME(%s%6f)%",
                 "body_end_us": "%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)%",
                 "body_sent_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_END:us)%",
                 "answer_end_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_END:us)%"}


def llm_gateway(stack: h.Stack, upstream: llm.LlmUpstream, plugin: dict, name: str,
                access_log: Path | None = None) -> h.Envoy:
    """An Envoy (--concurrency BENCH_CONCURRENCY) with the filter in front of the LLM upstream, its route of
    /v1/messages named ANTHROPIC_ROUTE, and with `access_log` GATEWAY_TIMES per request; started without
    waiting."""
    envoy = h.Envoy(stack.workdir, plugin, webdis_port=stack.webdis.port, upstream_port=upstream.port,
                    concurrency=b.CONCURRENCY, name=name)
    bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
    [listener] = bootstrap["static_resources"]["listeners"]
    [host] = listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"]
    host["routes"] = [
        {"name": ANTHROPIC_ROUTE, "match": {"prefix": "/v1/messages"}, "route": {"cluster": "upstream"}},
        {"name": "openai", "match": {"prefix": "/"}, "route": {"cluster": "upstream"}},
    ]
    if access_log is not None:
        h.with_json_access_log(bootstrap, access_log, GATEWAY_TIMES)
    envoy.yaml_path.write_text(json.dumps(bootstrap))
    stack.envoys.append(envoy)  # stopped by Stack.close(), whatever happens
    envoy.start(wait_ready=False)
    return envoy


def _openai_call(client: Any, model: str, prompt: str, stream: bool, limit: dict[str, int]) -> int | None:
    """`chat.completions.create` as a user calls it; the usage the SDK parsed (total tokens)."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        answer = client.chat.completions.create(model=model, messages=messages, **limit)
        return answer.usage.total_tokens if answer.usage is not None else None
    usage = None
    with client.chat.completions.create(model=model, messages=messages, stream=True, **limit) as chunks:
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage.total_tokens
    return usage


def _anthropic_call(client: Any, model: str, prompt: str, stream: bool, most: int) -> int | None:
    """`messages.create` as a user calls it; the usage the SDK parsed (input + output tokens)."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        answer = client.messages.create(model=model, max_tokens=most, messages=messages)
        return answer.usage.input_tokens + answer.usage.output_tokens
    started = delta = None
    with client.messages.create(model=model, max_tokens=most, messages=messages, stream=True) as events:
        for event in events:
            if event.type == "message_start":
                started = event.message.usage.input_tokens
            elif event.type == "message_delta":
                delta = event.usage.output_tokens
    return started + delta if started is not None and delta is not None else None


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sdk_clients_main() -> int:
    """The SDK clients in a child process of their own (`cost_bench.py --sdk-clients`: its own interpreter
    lock, apart from the upstream's threads in the bench's process): one JSON line of parameters on stdin;
    builds one client per thread, prints `ready`, starts at the line `go`, and prints every call (JSON)."""
    import threading

    import anthropic
    import openai

    params = json.loads(sys.stdin.readline())
    urls, clients, share = params["urls"], params["clients"], params["anthropic"]

    def make(index: int) -> tuple[str, int, Any]:
        gateway = index % len(urls)
        if index >= clients - share:
            return "anthropic", gateway, anthropic.Anthropic(base_url=urls[gateway], api_key=API_KEY, max_retries=0,
                                                             timeout=SDK_TIMEOUT_S)
        return "openai", gateway, openai.OpenAI(base_url=f"{urls[gateway]}/v1", api_key=API_KEY, max_retries=0,
                                                timeout=SDK_TIMEOUT_S)

    made = [make(index) for index in range(clients)]
    limited = (openai.RateLimitError, anthropic.RateLimitError)
    calls: list[dict] = []
    lock = threading.Lock()
    print("ready", flush=True)
    sys.stdin.readline()
    started, cpu_before = time.time(), _cpu_self()
    stop = time.monotonic() + params["seconds"]

    def run(index: int) -> None:
        sdk, gateway, client = made[index]
        rng = random.Random(params["seed"] * 1000 + index)
        # Half the OpenAI clients send `max_completion_tokens` (the current field), half `max_tokens`.
        field_name = "max_completion_tokens" if sdk == "openai" and index % 2 else "max_tokens"
        while time.monotonic() < stop:
            most = rng.randint(*RESERVE_RANGE)
            inp = rng.randint(*SDK_INPUT)
            out_tokens = rng.randint(1, most - inp)
            # The upstream counts each word of the prompt and 1 more as input (llm.usage_of): `inp` in all.
            prompt = " ".join([f"say {out_tokens} tokens"] + ["word"] * (inp - 4))
            stream = rng.random() < SDK_STREAMED
            call: dict[str, Any] = {"client": index, "sdk": sdk, "gateway": gateway, "stream": stream,
                                    "max_tokens": most, "expected": inp + out_tokens, "start_ms": time.time() * 1000}
            try:
                if sdk == "openai":
                    call["usage"] = _openai_call(client, OPENAI_MODELS[gateway], prompt, stream, {field_name: most})
                else:
                    call["usage"] = _anthropic_call(client, ANTHROPIC_MODELS[gateway], prompt, stream, most)
                call["outcome"] = "admitted"
            except limited as error:
                call.update(outcome="rejected", retry_after=error.response.headers.get("retry-after"))
            except Exception as error:  # noqa: BLE001 - any other failure is counted and shown, not raised
                call.update(outcome="other", error=f"{type(error).__name__}: {error}"[:300])
            call["end_ms"] = time.time() * 1000
            with lock:
                calls.append(call)
            if call["outcome"] != "admitted":
                time.sleep(SDK_BACKOFF_S)

    threads = [threading.Thread(target=run, args=(index,), name=f"sdk-{index}", daemon=True)
               for index in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(params["seconds"] + SDK_TIMEOUT_S + 10)
    for _, _, client in made:
        client.close()
    print(json.dumps({"calls": calls, "start_ms": started * 1000, "stop_ms": (started + params["seconds"]) * 1000,
                      "cpu_s": _cpu_self() - cpu_before, "wall_s": time.time() - started}), flush=True)
    return 0


@dataclass
class SdkRun:
    """What one run of the SDK clients got and left."""
    title: str
    calls: list[dict]  # every call the clients made (sdk_clients_main)
    served: list[llm.Served]  # the upstream's answers during the run
    start_ms: float
    stop_ms: float  # when the clients stopped starting calls
    cpu_s: float  # the client process's CPU time during the run
    wall_s: float
    metrics: dict[str, int]  # the filter's counters during the run, every gateway together
    found: list[llm.Member] | None  # the limiter's members all along (None: not read, Redis down)
    reserved_at_end: int | None  # members still reserved (`-r`) in Redis at the end
    # (e): the gateways' access logs, by request id
    gateway_times: dict[str, GatewayTimes] = field(default_factory=dict)

    def count(self, outcome: str, **match: Any) -> int:
        return sum(1 for call in self.calls
                   if call["outcome"] == outcome and all(call[k] == v for k, v in match.items()))

    def answered(self) -> list[llm.Served]:
        """The upstream's whole answers (a rejected call's upstream request is reset before its body)."""
        return [s for s in self.served if s.status == 200 and not s.reset and s.request is not None]

    def reported(self) -> list[int]:
        return [s.usage for s in self.answered() if s.usage is not None]

    def window(self, width: int = WINDOW_MS) -> llm.Window:
        return llm.fullest_window(self.found or [], width)

    def whole(self) -> list[int]:
        return llm.fixed_windows(self.found or [], WINDOW_MS, self.start_ms, self.stop_ms)

    def left_reserved(self) -> int:
        """Members never seen settled: their last state in the member log was a reservation (`-r`)."""
        return sum(1 for m in self.found or [] if m.random[:2] == b"-r")


def drive_sdks(stack: h.Stack, upstream: llm.LlmUpstream, envoys: list[h.Envoy], title: str, seconds: int,
               limiter: str | None, seed: int = 0) -> SdkRun:
    """SDK_CLIENTS clients (the last SDK_ANTHROPIC of them Anthropic's), client i through envoys[i % n], for
    `seconds`; the members of `limiter` read all along (None: Redis is down)."""
    params = {"urls": [f"http://{h.HOST}:{envoy.port}" for envoy in envoys], "clients": SDK_CLIENTS,
              "anthropic": SDK_ANTHROPIC, "seconds": seconds, "seed": seed}
    child = h.Process("sdk-clients", [sys.executable, str(Path(__file__).resolve()), "--sdk-clients"],
                      stack.workdir / "sdk-clients.log", pipes=True)
    try:
        assert child.popen.stdin is not None and child.popen.stdout is not None
        child.popen.stdin.write(json.dumps(params).encode() + b"\n")
        child.popen.stdin.flush()
        if child.popen.stdout.readline().strip() != b"ready":
            raise h.HarnessError(f"the SDK clients did not start:\n{h.tail(child.output)}")
        before = [envoy.metrics() for envoy in envoys]
        served_before = len(upstream.served)
        log = llm.MemberLog(stack.redis, limiter, WINDOW_MS) if limiter else None
        with log or contextlib.nullcontext():
            child.popen.stdin.write(b"go\n")
            child.popen.stdin.flush()
            text = child.popen.stdout.read()
            time.sleep(0.5)  # the last responses' settle calls, from the next tick
        if child.wait(10) != 0 or not text.strip():
            raise h.HarnessError(f"the SDK clients failed:\n{h.tail(child.output)}")
    finally:
        child.stop()
    result = json.loads(text)
    metrics: collections.Counter[str] = collections.Counter()
    for envoy, was in zip(envoys, before):
        metrics.update(h.delta(was, envoy.metrics()))
    reserved_at_end = None
    if limiter:
        reserved_at_end = sum(1 for m in llm.members(stack.redis.client, limiter) if m.random[:2] == b"-r")
    return SdkRun(title, result["calls"], upstream.served[served_before:], result["start_ms"], result["stop_ms"],
                  result["cpu_s"], result["wall_s"], dict(metrics), log.members() if log else None, reserved_at_end)


def run_sdks(stack: h.Stack, upstream: llm.LlmUpstream) -> list[SdkRun]:
    configs = [("sdk-after", "charge-after: reserve 1 (baseline)", False),
               ("sdk-settle", "reserve the body's max tokens, then settle", True)]
    envoys = [llm_gateway(stack, upstream, sdk_plugin(name, reserve_body), f"envoy-{name}")
              for name, _, reserve_body in configs]
    runs = []
    try:
        for envoy in envoys:
            envoy.wait_ready()
        for (name, title, _), envoy in zip(configs, envoys):
            progress(f"(11d) {title}: {SDK_CLIENTS} SDK clients ({SDK_ANTHROPIC} Anthropic), {SDK_SECONDS} s")
            runs.append(drive_sdks(stack, upstream, [envoy], title, SDK_SECONDS, f"erl:{name}"))
    finally:
        stack.stop_envoys()
    return runs


def _spread(values: list[int], of: int) -> str:
    if not values:
        return "-"
    return f"{num(min(values))}-{num(max(values))} ({min(values) / of:.1%}-{max(values) / of:.1%})"


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def _latency(run: SdkRun, outcome: str) -> str:
    spans = sorted(call["end_ms"] - call["start_ms"] for call in run.calls if call["outcome"] == outcome)
    return f"{b.percentile(spans, 50):.0f} / {b.percentile(spans, 99):.0f}" if spans else "-"


def print_sdks(runs: list[SdkRun]) -> None:
    out()
    out(f"(d) The real SDKs: {SDK_CLIENTS} clients at once (threads of one child process, a client each: "
        f"{SDK_CLIENTS - SDK_ANTHROPIC} `openai`, {SDK_ANTHROPIC} `anthropic`), at their defaults but base_url, "
        f"api_key, max_retries=0 (a 429 raises at once; the client pauses {SDK_BACKOFF_S * 1000:.0f} ms) and "
        f"timeout={SDK_TIMEOUT_S:.0f}s, for {SDK_SECONDS} s per configuration; {SDK_STREAMED:.0%} of the calls "
        f"streamed; each asks max_tokens (max_completion_tokens for half the OpenAI clients) "
        f"{num(RESERVE_RANGE[0])}-{num(RESERVE_RANGE[1])} and uses {SDK_INPUT[0]}-{SDK_INPUT[1]} input tokens "
        "plus 1 to the rest in output. One Envoy (--concurrency "
        f"{b.CONCURRENCY}) with the filter, webdis, Redis, tests/e2e/llm_upstream.py answering as the APIs do "
        f"({SDK_DELAY_MS} ms between events or pieces; JSON compressed when asked). One budget of {num(BUDGET)} "
        f"tokens per {WINDOW_MS // 1000} s: the OpenAI rule (reserve {{\"body\": \"openai\"}}, settle "
        "{\"usage\": \"openai\", \"include_usage\": true}) and, on the route of /v1/messages, the Anthropic rule "
        "({\"body\": \"anthropic\"}, {\"usage\": \"anthropic\"}), both naming one limiter; the local block at its "
        "default. Tokens: the limiter's members read from Redis every 50 ms.")
    rows = []

    def row(label: str, cell: Any) -> None:
        rows.append([label, *(cell(run) for run in runs)])

    row("calls admitted / rejected (429) / other", lambda r: f"{num(r.count('admitted'))} / "
        f"{num(r.count('rejected'))} / {num(r.count('other'))}")
    row("admitted: OpenAI JSON / streamed, Anthropic JSON / streamed", lambda r: " / ".join(
        num(r.count("admitted", sdk=sdk, stream=stream)) for sdk in ("openai", "anthropic") for stream in (False, True)))
    row("calls per second (all), client CPU per call", lambda r: f"{len(r.calls) / r.wall_s:.0f}/s, "
        f"{1e3 * r.cpu_s / max(1, len(r.calls)):.1f} ms ({r.cpu_s / r.wall_s:.0%} of a core)")
    row("latency admitted / rejected, p50 / p99 (ms)", lambda r: f"{_latency(r, 'admitted')}; {_latency(r, 'rejected')}")
    row("tokens the upstream reported (per admitted call)", lambda r: f"{num(sum(r.reported()))} "
        f"({num(sum(r.reported()) / max(1, len(r.reported())))})")
    row("usage the SDKs parsed = the upstream's", lambda r: _met(
        sum(c.get("usage") or 0 for c in r.calls if c["outcome"] == "admitted") == sum(r.reported())
        and all(c.get("usage") == c["expected"] for c in r.calls if c["outcome"] == "admitted")))
    row("members' permits = the upstream's usages (one member each)", lambda r: _members_match(r))
    row("members left reserved (-r): never settled / in Redis at the end", lambda r: f"{r.left_reserved()} / "
        f"{r.reserved_at_end}")
    row("settlements / settled_without_usage", lambda r: f"{num(r.metrics.get('settlements', 0))} / "
        f"{num(r.metrics.get('settled_without_usage', 0))}")
    row("upstream asked Accept-Encoding / answered", lambda r: ", ".join(
        f"{n} {k}" for k, n in sorted(collections.Counter(f"{s.accept_encoding} / {s.encoding}"
                                                         for s in r.answered()).items())))
    row(f"tokens per whole {WINDOW_MS // 1000}-s window (of the budget)", lambda r: _spread(r.whole(), BUDGET))
    row(f"fullest sliding {WINDOW_MS // 1000}-s window vs the budget", lambda r: f"{num(r.window().tokens)} "
        f"({r.window().tokens / BUDGET - 1:+.1%}, {r.window().requests} calls)")
    row(f"the same narrowed by {NARROW_MS} ms", lambda r: f"{num(r.window(WINDOW_MS - NARROW_MS).tokens)}")
    row("Redis calls per admitted call (batches)", lambda r: f"{r.metrics.get('redis_calls', 0) / max(1, r.count('admitted')):.2f} "
        f"({num(r.metrics.get('batches', 0))})")
    row("rejected by the local block / by Redis", lambda r: f"{num(r.metrics.get('local_rejected', 0))} / "
        f"{num(r.metrics.get('rejected', 0) - r.metrics.get('local_rejected', 0))}")
    out(table(["measure"] + [run.title for run in runs], rows))
    others = [call["error"] for run in runs for call in run.calls if call["outcome"] == "other"]
    if others:
        out(f"Other outcomes ({len(others)}), first: {others[0]}")
    after, settle = runs
    whole = settle.whole()
    settled = _members_match(settle) == "equal" and settle.left_reserved() == 0 and settle.reserved_at_end == 0
    out()
    out(table(["target (d)", "charge-after (baseline)", "reserve, then settle", "target", "met"], [
        ["every admitted call settled to its usage (members = upstream, none left -r)",
         _members_match(after), _members_match(settle), "equal, 0 left", _met(settled)],
        ["fullest sliding window vs the budget", f"{after.window().tokens / BUDGET:.1%}",
         f"{settle.window().tokens / BUDGET:.1%}", "<= 100%", _met(settle.window().tokens <= BUDGET)],
        ["usage of every whole window", _spread(after.whole(), BUDGET), _spread(whole, BUDGET),
         f">= {WHOLE_TARGET:.0%}", _met(bool(whole) and min(whole) >= WHOLE_TARGET * BUDGET)],
    ]))
    busy = max(run.cpu_s / run.wall_s for run in runs)
    out(f"Reading: the SDK clients made {len(settle.calls) / settle.wall_s:.0f} calls/s using {busy:.0%} of a core at "
        f"most (one interpreter lock for the {SDK_CLIENTS} threads)" + (": they were CPU-bound, the calls/s is what they could drive"
                                                            if busy >= 0.85 else "") + ".")


def _members_match(run: SdkRun) -> str:
    if run.found is None:
        return "-"
    permits, usages = sorted(m.permits for m in run.found), sorted(run.reported())
    if permits == usages:
        return "equal"
    return f"DIFFER: {len(permits)} members, {num(sum(permits))} permits; {len(usages)} answers, {num(sum(usages))} tokens"


# (e)


class Admission(NamedTuple):
    """An admitted request as the upstream saw it: when it started and ended (epoch ms), what it reserved
    (the max tokens of its body) and what it cost (the usage it reported)."""
    at_ms: float
    end_ms: float
    reserved: int
    usage: int


def gateway_of(served: llm.Served) -> int:
    model = served.request.get("model") if isinstance(served.request, dict) else None
    for models in (OPENAI_MODELS, ANTHROPIC_MODELS):
        if model in models:
            return models.index(model)
    return -1


# Where body_times() writes, in the upstream's record of a JSON request, when its body had arrived and the
# request's x-request-id (the key of the gateway's access log).
BODY_MS = "_bench_body_ms"
REQUEST_ID = "_bench_request_id"


@contextlib.contextmanager
def body_times() -> Any:
    """While in the block, the upstream's record of each JSON request (`Served.request`) also holds when its
    body had arrived (BODY_MS, epoch ms). A rule reading the body decides once the body is at the gateway,
    and Envoy sends the body upstream only then (the headers went on before, so `Served.start_ms` is before
    the decision by the decision's wait): the body's arrival is the decision, a moment later."""
    plain = llm.answer

    def timed(modes: llm.Modes, path: str, got: dict[str, str], body: bytes) -> llm.Answer:
        reply = plain(modes, path, got, body)
        if isinstance(reply.request, dict):
            reply = reply._replace(request={**reply.request, BODY_MS: time.time() * 1000,
                                            REQUEST_ID: got.get("x-request-id")})
        return reply

    llm.answer = timed  # the upstream's handlers call llm_upstream.answer by its module name
    try:
        yield
    finally:
        llm.answer = plain


class GatewayTimes(NamedTuple):
    """One request in a gateway's access log (GATEWAY_TIMES), epoch ms by the gateway's clock: when its body
    had arrived (the filter decides in that callback: the decision is at or after it), when the body had gone
    upstream (the decision is before it) and when the answer's last byte came back (the filter settles then)."""
    body_end_ms: float
    body_sent_ms: float
    answer_end_ms: float


def gateway_times(paths: list[Path], want: set[str], wait_s: float = 5.0) -> dict[str, GatewayTimes]:
    """The access log entries of `paths` (GATEWAY_TIMES) by request id, waiting up to `wait_s` for Envoy to
    flush the ids of `want` (its file access log writes once a second)."""
    deadline = time.monotonic() + wait_s
    while True:
        found: dict[str, GatewayTimes] = {}
        for path in paths:
            for line in path.read_text().splitlines() if path.exists() else []:
                entry = json.loads(line)
                start_ms = int(entry["start_us"]) / 1000
                try:
                    found[entry["id"]] = GatewayTimes(*(start_ms + int(entry[k]) / 1000 for k in
                                                        ("body_end_us", "body_sent_us", "answer_end_us")))
                except (TypeError, ValueError):  # "-": a request that never went upstream
                    continue
        if want <= found.keys() or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def admissions(run: SdkRun, gateway: int | None, clock: str = "upstream") -> list[Admission]:
    """The admitted requests of one gateway (None: all) by `clock`: "upstream" (when the body reached the
    upstream and the answer ended there) or "gateway" (its access log: when the body had gone upstream, which
    is just after the decision, and when the answer came back). A request missing from the access log counts
    by the upstream's clock."""
    found = []
    for s in run.answered():
        if gateway is not None and gateway_of(s) != gateway:
            continue
        at_ms, end_ms = s.request.get(BODY_MS, s.start_ms), s.end_ms
        times = run.gateway_times.get(s.request.get(REQUEST_ID) or "")
        if clock == "gateway" and times is not None:
            at_ms, end_ms = times.body_sent_ms, times.answer_end_ms
        found.append(Admission(at_ms, end_ms, llm.max_tokens_of(s.request) or 0, s.usage or 0))
    return sorted(found)


def held_at_admission(found: list[Admission], width_ms: float = WINDOW_MS, end_slack_ms: float = 0) -> int:
    """The most a window held just after an admission: each request admitted in the `width_ms` before it
    (itself included) counts its usage if its response had ended by then (`end_slack_ms` later: the gateway
    may settle a moment before the upstream records the answer's end), else its reservation."""
    most = 0
    for a in found:
        held = sum(x.usage if x.end_ms <= a.at_ms + end_slack_ms and x is not a else x.reserved for x in found
                   if a.at_ms - width_ms < x.at_ms <= a.at_ms)
        most = max(most, held)
    return most


def as_members(found: list[Admission], reserved: bool = False) -> list[llm.Member]:
    return [llm.Member(b"", x.reserved if reserved else x.usage, x.at_ms) for x in found]


@dataclass
class DegradedRun:
    run: SdkRun
    redis_up: bool
    calls_to_redis: int  # the filter's Redis calls (while Redis is down: the probes)

    def part(self, gateway: int | None, clock: str = "upstream") -> dict[str, Any]:
        found = admissions(self.run, gateway, clock)
        members = as_members(found)
        return {"admitted": len(found), "whole": llm.fixed_windows(members, WINDOW_MS, self.run.start_ms, self.run.stop_ms),
                "fullest": llm.fullest_window(members, WINDOW_MS),
                "held": held_at_admission(found),
                "reserved": llm.fullest_window(as_members(found, reserved=True), WINDOW_MS).tokens}


def run_degraded(stack: h.Stack, upstream: llm.LlmUpstream) -> list[DegradedRun]:
    degraded = {"failure_mode": "local", "local_fallback": {"gateways": GATEWAYS, "probe_interval": "1s"}}
    logs = [stack.workdir / f"envoy-degraded-{i}-access.log" for i in range(GATEWAYS)]
    envoys = [llm_gateway(stack, upstream, sdk_plugin("degraded", True, **degraded), f"envoy-degraded-{i}", log)
              for i, log in enumerate(logs)]
    runs = []
    try:
        for envoy in envoys:
            envoy.wait_ready()
        for redis_up in (True, False):
            title = "Redis up (baseline)" if redis_up else "Redis stopped: the degraded mode"
            if not redis_up:
                stack.redis.stop()
            progress(f"(11e) {title}: {SDK_CLIENTS} SDK clients over {GATEWAYS} Envoys, {DEGRADED_SECONDS} s")
            with body_times():
                run = drive_sdks(stack, upstream, envoys, title, DEGRADED_SECONDS,
                                 "erl:degraded" if redis_up else None, seed=1)
            run.gateway_times = gateway_times(logs, {s.request.get(REQUEST_ID) for s in run.answered()})
            runs.append(DegradedRun(run, redis_up, run.metrics.get("redis_calls", 0)))
    finally:
        stack.stop_envoys()
        stack.redis.start()  # empty again
    return runs


def _waits(run: SdkRun) -> str:
    """The gateway's wait between a body's arrival and its sending upstream (the decision is in between),
    ms: median / max over the run's admitted requests."""
    waits = sorted(t.body_sent_ms - t.body_end_ms for t in
                   (run.gateway_times.get(s.request.get(REQUEST_ID) or "") for s in run.answered()) if t)
    return f"{b.percentile(waits, 50):.2f} / {max(waits):.1f} ms" if waits else "-"


def print_degraded(runs: list[DegradedRun]) -> None:
    local = BUDGET // GATEWAYS
    out()
    out(f"(e) The degraded mode with costs: {GATEWAYS} Envoys (--concurrency {b.CONCURRENCY} each) with "
        f"failure_mode \"local\", local_fallback {{\"gateways\": {GATEWAYS}, \"probe_interval\": \"1s\"}}, the budget "
        f"and clients of (d) ({SDK_CLIENTS} SDK clients, client i through gateway i mod {GATEWAYS}) for "
        f"{DEGRADED_SECONDS} s: Redis up (the baseline), then Redis stopped (webdis up, answering errors). With "
        "Redis up, the limiter's members are the account (acquire times, settled sizes). Per gateway, and with "
        "Redis down, each admitted request's times by two clocks: the gateway's own (its access log: when the "
        "body had gone upstream, which it does once the filter decided, and when the answer's last byte came "
        "back, when the filter settles it in the local window) and, for comparison, the upstream's record (when "
        "the body reached it, when it ended the answer); with the max tokens its body reserved and the usage it "
        f"reported. The local budget is floor(rate / gateways) = {num(local)} tokens per gateway per window. Held "
        "at admission: the most a gateway's window held just after an admission, each request admitted in the "
        "window before it counted at its usage if its answer had ended, else at its reservation (the local "
        "window's own account).")
    rows = []
    for degraded in runs:
        run = degraded.run
        for gateway in [*range(GATEWAYS), None]:
            bound = BUDGET if gateway is None else local
            label = degraded.run.title if gateway == 0 else ""
            if gateway is None and run.found is not None:
                rows.append([label, "together (Redis's members)", "Redis", num(len(run.found)),
                             _spread(run.whole(), BUDGET),
                             f"{num(run.window().tokens)} ({run.window().tokens / BUDGET:.1%})", "-", "-"])
                continue
            for clock in ("gateway", "upstream") if not degraded.redis_up else ("gateway",):
                part = degraded.part(gateway, clock)
                held = "-" if degraded.redis_up else f"{num(part['held'])} ({part['held'] / bound:.1%})"
                rows.append([
                    label if clock == "gateway" else "",
                    ("together" if gateway is None else f"gateway {gateway}") if clock == "gateway" else "",
                    "gateway" if clock == "gateway" else "upstream", num(part["admitted"]),
                    _spread(part["whole"], bound), f"{num(part['fullest'].tokens)} ({part['fullest'].tokens / bound:.1%})",
                    held, num(part["reserved"]),
                ])
    out(table(["run", "gateway", "clock", "admitted", "tokens per whole window (of the bound)", "fullest sliding window",
               "held at admission", "reservations in the fullest window"], rows, left=3))
    for degraded in runs:
        m = degraded.run.metrics
        out(f"{degraded.run.title}: calls admitted {num(degraded.run.count('admitted'))}, rejected "
            f"{num(degraded.run.count('rejected'))}, other {num(degraded.run.count('other'))}; filter counters: "
            f"allowed {num(m.get('allowed', 0))}, fallback_allowed {num(m.get('fallback_allowed', 0))}, "
            f"fallback_rejected {num(m.get('fallback_rejected', 0))}, settlements {num(m.get('settlements', 0))}, "
            f"redis_calls {num(m.get('redis_calls', 0))}, redis_errors {num(m.get('redis_errors', 0))}; the "
            f"gateway's wait from a body's arrival to its sending upstream (median / max): {_waits(degraded.run)}")
    up = next(d for d in runs if d.redis_up).run
    down = next(d for d in runs if not d.redis_up)
    parts = [down.part(gateway, "gateway") for gateway in range(GATEWAYS)]
    by_upstream = [down.part(gateway) for gateway in range(GATEWAYS)]
    worst = max(max(p["held"], p["fullest"].tokens) for p in parts)
    together = down.part(None, "gateway")
    out()
    out(table(["target (e)", "Redis up (baseline: Redis's members)", "Redis down (gateway's clock)",
               "(the upstream's clock)", "target", "met"], [
        ["each gateway's fullest window (usage; held at admission)", "(one budget for both)",
         " / ".join(f"{num(p['fullest'].tokens)}; {num(p['held'])}" for p in parts),
         " / ".join(f"{num(p['fullest'].tokens)}; {num(p['held'])}" for p in by_upstream), f"<= {num(local)}",
         _met(worst <= local)],
        ["both gateways, fullest sliding window", num(up.window().tokens), num(together["fullest"].tokens),
         num(down.part(None)["fullest"].tokens), f"<= {num(BUDGET)}", _met(together["fullest"].tokens <= BUDGET)],
        ["both gateways, tokens per whole window", _spread(up.whole(), BUDGET), _spread(together["whole"], BUDGET),
         "", "(reported)", "-"],
    ]))
    reserved = max(p["reserved"] for p in parts)
    out(f"Reading: with Redis down each gateway admitted at most {num(max(p['fullest'].tokens for p in parts))} "
        f"tokens of usage in any sliding window and held at most {num(max(p['held'] for p in parts))} at an "
        f"admission, by its own clock, against its {num(local)}; the reservations it admitted in a window add up "
        f"to more (up to {num(reserved)}), since each settled to its usage when its answer ended and gave the rest "
        "back to the local window. The upstream's clock is a few ms off the gateway's (a body reaches it after the "
        "decision, an answer ends there before the gateway settles it): a window that holds a request decided at "
        "its very start, and one decided at its very end, can look fuller or emptier by that clock. Redis, up, "
        f"admitted {_spread(up.whole(), BUDGET)} per whole window for the two together.")


# ---------------------------------------------------------------------------------------------------------


def run_cost() -> None:
    """Section 11: token budgets, reserve then settle, against charge-after (the baseline)."""
    started = time.monotonic()
    b.heading("11. Token budgets: reserve, then settle to the usage vs charge-after (reserve 1, baseline)")
    modules = "; ".join(cb.module_line(path) for path in (h.WASM, h.WASM_HIGRESS))
    out(f"modules   {modules}")
    # SDK requests (no x-test-* headers) get SDK_DELAY_MS between pieces; (a) asks its own per request.
    with h.Stack() as stack, llm.LlmUpstream(delay_ms=SDK_DELAY_MS) as upstream:
        stack.start()
        exactness = run_exactness(stack, upstream)
        sdks = run_sdks(stack, upstream)
        cpu = run_cpu(stack)
        degraded = run_degraded(stack, upstream)  # stops Redis, then starts it again, empty
        stack.webdis.stop()
        missing = [path for path in (h.WASM_HOST_BIN, h.WASM_HIGRESS) if not path.is_file()]
        fuel = run_fuel(stack) if not missing else []
    print_exactness(exactness)
    print_cpu(cpu)
    if fuel:
        print_fuel(fuel)
    else:
        out()
        out(f"(c) Skipped: no {' and no '.join(str(path) for path in missing)} (make bench builds both).")
    print_sdks(sdks)
    print_degraded(degraded)
    if "; ".join(cb.module_line(path) for path in (h.WASM, h.WASM_HIGRESS)) != modules:
        out("WARNING: the modules changed during the section: rows measured after the change ran the new build.")
    out()
    out(f"Section 11 ran {time.monotonic() - started:.0f} s.")


if __name__ == "__main__":
    if sys.argv[1:] == ["--sdk-clients"]:
        sys.exit(sdk_clients_main())
    sys.exit("bench/cost_bench.py is section 11 of bench/bench.py (BENCH_ONLY=11 make bench)")
