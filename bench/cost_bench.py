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
    completion body, wrk as in section 1 (x-user-id over 64 users, bench/users.lua), BENCH_ROUNDS
    interleaved runs of BENCH_DURATION s: Envoy without the filter, the rule with `permits: 1000` and no
    cost (the baseline: one acquire per request), and the same rule reserving 1000 and settled by its usage
    (OpenAI JSON, 0.3 KB; OpenAI event stream, 1.5 KB; Anthropic event stream): req/s, Redis script calls and
    CPU microseconds per request by process.
(c) Guest cost: the Higress build in the host emulator (`wasm-host replay --function-profile`, 2 VMs,
    2,000 requests, 16 at once), each request answered with the body in its pieces (one
    `proxy_on_response_body` each): fixed permits vs settled by usage, per format: all guest fuel per
    request and Redis calls per request.

Every process comes from tests/e2e/harness.py (Envoy, redis-server, webdis, wrk; wasm-host as in section 5)
on 127.0.0.1 with free ports, stopped by PID when the section ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

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


def run_cpu(stack: h.Stack) -> list[cb.AllowedRow]:
    rows = []
    for settle in [NONE, FIXED, *SETTLED]:
        fields: dict[str, Any] = {"cost": settle.cost} if settle.cost else {"permits": FIXED_PERMITS}
        plugin = h.plugin_config(h.rule("cost-allowed", rate=ALLOWED_RATE, interval="1s", **fields), timeout=TIMEOUT)
        envoy = h.Envoy(stack.workdir, plugin, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                        concurrency=b.CONCURRENCY, name=f"envoy-cost-{settle.key}")
        envoy.yaml_path.write_text(llm_envoy_yaml(envoy.yaml_path.read_text(), settle))
        stack.envoys.append(envoy)
        envoy.start(wait_ready=False)
        config = cb.Config(settle.key, settle.title, None if settle.filters == "none" else {})
        rows.append(cb.AllowedRow(config, b.Scenario(settle.key, settle.title, "2xx", envoy=envoy,
                                                      filters=settle.filters)))
    try:
        for row in rows:
            row.scenario.envoy.wait_ready()  # type: ignore[union-attr]
        with cb.wrk_users(USERS):
            for row in rows:
                b.run_wrk(row.scenario.envoy.port, b.WARM_UP_S, stack.workdir,  # type: ignore[union-attr]
                          f"warm-cost-{row.config.key}")
            for round_index in range(b.ROUNDS):
                for row in rows:
                    progress(f"(11b) {row.config.title}: round {round_index + 1}/{b.ROUNDS}, {b.DURATION} s")
                    row.runs.append(b.measured_run(row.scenario.envoy, stack,  # type: ignore[arg-type]
                                                   f"cost-{row.config.key}-{round_index}"))
    finally:
        stack.stop_envoys()
    return rows


def print_cpu(rows: list[cb.AllowedRow]) -> None:
    out()
    out(f"(b) What settling costs: one Envoy at a time, --concurrency {b.CONCURRENCY}, the route answering itself "
        f"(direct_response 200 with the body of the format named, reporting {INPUT_TOKENS} + {OUTPUT_TOKENS} "
        f"tokens), rule per-user {num(ALLOWED_RATE)} per 1 s over {USERS} users (never reached); wrk "
        f"-t{b.THREADS} -c{b.CONNECTIONS} -d{b.DURATION}s, medians of {b.ROUNDS} interleaved runs. Scripts/req: "
        "EVALSHA+EVAL in Redis / requests answered; CPU: microseconds per answered request by process; "
        "settlements/req: the filter's counter.")
    base = rows[0]
    rows_out = []
    for row in rows:
        cpu = row.cpu_per_request()
        requests = row.requests()
        rows_out.append([
            row.config.title, num(row.rps()), b.spread([run.wrk.rps for run in row.runs]),
            f"{row.rps() / base.rps():.2f}", f"{row.scripts_per_request():.3f}",
            f"{row.stat('settlements') / requests:.3f}" if requests else "-",
            *(f"{cpu.get(name, 0.0):.0f}" for name in cb.CPU_NAMES), f"{cpu.get('total', 0.0):.0f}",
            num(b.median(run.wrk.p50 for run in row.runs)), b._answers_cell(row.scenario, row.runs),
        ])
    out(table(["gateway", "req/s", "req/s spread", "vs no filter", "scripts/req", "settlements/req"]
              + [f"{name} us" for name in cb.CPU_NAMES] + ["total us", "p50 us", "answers"], rows_out))
    fixed, header = rows[1].cpu_per_request(), rows[2].cpu_per_request()

    def more(cpu: dict[str, float], than: dict[str, float]) -> str:
        return f"{cpu.get('total', 0) - than.get('total', 0):+.0f} us (Envoy {cpu.get('Envoy', 0) - than.get('Envoy', 0):+.0f})"

    reads = "; ".join(f"{row.config.key.removeprefix('settle-')} {more(row.cpu_per_request(), header)}" for row in rows[3:])
    out(f"Reading: over the fixed-permits baseline, the settle call (a cost header, the body not read) costs "
        f"{more(header, fixed)} per request: a second script call per request, through webdis, not coalesced. "
        f"Reading the usage from the body, over the cost header: {reads}.")


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
    args = ["--concurrency", str(REPLAY_CONCURRENCY), "--compile-cache", str(h.WASM_HOST_CACHE)]
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


def run_cost() -> None:
    """Section 11: token budgets, reserve then settle, against charge-after (the baseline)."""
    b.heading("11. Token budgets: reserve, then settle to the usage vs charge-after (reserve 1, baseline)")
    modules = "; ".join(cb.module_line(path) for path in (h.WASM, h.WASM_HIGRESS))
    out(f"modules   {modules}")
    with h.Stack() as stack, llm.LlmUpstream() as upstream:
        stack.start()
        exactness = run_exactness(stack, upstream)
        cpu = run_cpu(stack)
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
    if "; ".join(cb.module_line(path) for path in (h.WASM, h.WASM_HIGRESS)) != modules:
        out("WARNING: the modules changed during the section: rows measured after the change ran the new build.")
