"""Costs known after the response (a rule's `cost`, docs/configuration.md): a request reserves permits, and
when its response ends the filter settles the reservation to the real cost the response reports (LLM token
usage in JSON or server-sent events, or a response header): unused permits go back, an excess is charged.

The upstream is `llm_upstream.LlmUpstream`, a real HTTP/1.1 server answering as OpenAI, Anthropic and Gemini
do; in the emulator each request carries the same answer (`Emulator.send(..., response=...)`, body piece by
body piece, or reset by the upstream after some). Every test reads Redis with redis-py: the limiter
`erl:<rule>:<key>`, its `{...}:value` (permits free) and `{...}:permits` (members: 1 length byte, the random
bytes, 4-byte little-endian permits, scored with the acquire time in epoch ms).

What a user would notice if it broke: a budget charged the reservation instead of the tokens used (or
nothing), an excess that does not hold back the next request, a cut stream that gives its tokens away, a
header reservation or a plan's rate ignored, and a token budget that admits more than its rate per window
under concurrent clients (the promise, checked on the members' acquire-time scores and settled sizes: with
every cost within its reservation, no sliding window holds more than the rate), which charge-after
(`"reserve": 1`, what Higress's ai-token-ratelimit does) overshoots.
"""

from __future__ import annotations

import json
import random
import socket
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import pytest

import harness as h
import llm_upstream as llm
from conftest import GATEWAYS, Gateway

REQUEST_BODY = json.dumps({"model": "m", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]})


# --- Gateways in front of the LLM upstream ----------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_server() -> Iterator[llm.LlmUpstream]:
    with llm.LlmUpstream() as server:
        yield server


class LlmGateway(Gateway):
    """A gateway (conftest.Gateway) whose upstream answers like an LLM API: Envoy's `upstream` cluster is
    the LLM server; the emulator answers each request with the same bodies (`llm.response_spec`)."""

    def ask(self, key: dict[str, str], fmt: str = "openai-json", input_tokens: int = 10, output_tokens: int = 20,
            *, events: int = 3, reset_after: int | None = None, cost: int | None = None,
            headers: dict[str, str] | None = None, body: str = REQUEST_BODY) -> h.Response:
        """One POST of `key` headers (and `headers`) with JSON `body`, answered in `fmt` with this usage;
        `reset_after`: the upstream resets the stream after that many pieces (the response the client got so
        far, status 200)."""
        self._count(1)
        asked = {**key, **(headers or {}), "content-type": "application/json"}
        if isinstance(self.process, h.Emulator):
            return self.process.send("/v1/chat", asked, method="POST", body=body,
                                     response=llm.response_spec(fmt, input_tokens, output_tokens, events=events,
                                                                reset_after=reset_after, cost=cost))
        asked.update(llm.headers(fmt, input_tokens, output_tokens, events=events, reset_after=reset_after,
                                 cost=cost))
        if reset_after is None:
            return self.process.send("/v1/chat", asked, method="POST", body=body.encode())
        status, body = raw_exchange(self.process.port, asked)
        return h.Response(status, {}, body.decode(errors="replace"))


@pytest.fixture
def start_gateway(gateway_kind: str, stack: h.Stack, llm_server: llm.LlmUpstream) -> Iterator[Callable[..., LlmGateway]]:
    """conftest's `start_gateway` with the LLM upstream: `start_gateway(*rules, **fields)`, an Envoy (2
    workers) whose `upstream` cluster is the LLM server, or an emulator (2 VMs) of the test's kind. Every
    request an emulator got must have ended continued, answered locally or reset by the upstream (the
    tests that ask for it)."""
    kind = GATEWAYS[gateway_kind]
    started: list[LlmGateway] = []

    def start(*rules: dict, **fields: Any) -> LlmGateway:
        config = kind.config(*rules, **fields)
        if kind.emulated:
            process: h.Envoy | h.Emulator = stack.emulator(config, build=kind.build, vms=2)
        else:
            process = stack.envoy(config, concurrency=2, upstream_port=llm_server.port)
        started.append(LlmGateway(gateway_kind, process, stack))
        return started[-1]

    yield start
    for gateway in started:
        if isinstance(gateway.process, h.Emulator):
            kinds = set(gateway.process.outcome_kinds())
            assert kinds <= {"continued", "local_reply", "upstream_reset"}, f"{gateway.name}: requests ended {kinds}"


def raw_exchange(port: int, headers: dict[str, str], *, abort_after: bytes | None = None,
                 times: int = 1, timeout: float = 10.0) -> tuple[int, bytes]:
    """One POST on a raw socket, read until the connection ends (a reset stream closes it) or, with
    `abort_after`, until `abort_after` occurred `times` times in what came: then the client leaves with a
    TCP RST. Returns the status and the raw bytes after the response headers (chunked framing included)."""
    body = REQUEST_BODY.encode()
    lines = ["POST /v1/chat HTTP/1.1", "host: erl", f"content-length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    sock = socket.create_connection((h.HOST, port), timeout=timeout)
    data = b""
    try:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        while True:
            if abort_after is not None and data.count(abort_after) >= times and b"\r\n\r\n" in data:
                break
            try:
                piece = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not piece:
                break
            data += piece
    finally:
        if abort_after is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    return status, rest


# --- Redis ------------------------------------------------------------------------------------------------


def members(stack: h.Stack, name: str) -> list[llm.Member]:
    return llm.members(stack.redis.client, name)


def value(stack: h.Stack, name: str) -> int | None:
    raw = stack.redis.client.get(h.limiter_key(name, "value"))
    return None if raw is None else int(raw)


def settled(stack: h.Stack, gateway: LlmGateway, name: str, permits: list[int], timeout: float = 5.0) -> list[llm.Member]:
    """The limiter's members once they hold these permits (the settle call is sent when the response ended;
    the emulator runs its event loop meanwhile)."""
    def check() -> list[llm.Member] | None:
        if isinstance(gateway.process, h.Emulator):
            gateway.process.run_for(20)
        found = members(stack, name)
        return found if sorted(m.permits for m in found) == sorted(permits) else None

    try:
        return h.wait_until(check, timeout, f"{name} to hold {permits}")
    except h.HarnessError:
        raise AssertionError(f"{name} holds {members(stack, name)}, value {value(stack, name)}; wanted {permits}; "
                             f"metrics {gateway.metrics()}") from None


def counters(gateway: LlmGateway, settlements: int, without_usage: int) -> dict[str, int]:
    """Waits until the counters reach these values (they count when the response ends), then returns them."""
    return gateway.wait_for_metrics(
        lambda m: m.get("settlements", 0) >= settlements and m.get("settled_without_usage", 0) >= without_usage,
        f"{settlements} settlements and {without_usage} settled without usage", timeout=5.0)


# --- Settling ---------------------------------------------------------------------------------------------

RATE = 100_000
RESERVE = 1000


def token_rule(name: str, usage: Any, **fields: Any) -> dict:
    """A rule limited by the header `x-<name>-key`, reserving RESERVE and settled by `usage` (or `settle`)."""
    settle = fields.pop("settle", {"usage": usage})
    return h.rule(name, limit_by={"header": f"x-{name}-key"}, rate=RATE, interval="1m",
                  cost={"reserve": fields.pop("reserve", RESERVE), "settle": settle}, **fields)


def test_a_response_settles_its_reservation_to_the_usage_it_reports(start_gateway, stack):
    """Each provider's answer, JSON and streamed, and each way of reading a cost: the member reserved at the
    request ends holding the real cost, the value moved by reserve - cost, the client got the body as the
    upstream sent it."""
    gateway = start_gateway(
        token_rule("openai", "openai"), token_rule("anthropic", "anthropic"), token_rule("gemini", "gemini"),
        token_rule("paths", {"paths": ["usage.prompt_tokens", "usage.completion_tokens"]}),
        token_rule("metered", None, settle={"response_header": "x-cost"}))
    cases = [("openai", fmt, 120 + i, 345 + i) for i, fmt in enumerate(["openai-json", "openai-sse"])]
    cases += [("anthropic", fmt, 210 + i, 34 + i) for i, fmt in enumerate(["anthropic-json", "anthropic-sse"])]
    cases += [("gemini", fmt, 55 + i, 601 + i) for i, fmt in enumerate(["gemini-json", "gemini-sse"])]
    cases += [("paths", "openai-json", 70, 7)]
    for rule_name, fmt, inp, out in cases:
        response = gateway.ask({f"x-{rule_name}-key": fmt}, fmt, inp, out)
        assert response.status == 200, (rule_name, fmt, response)
        assert response.body == "".join(llm.chunks(fmt, inp, out)), f"{fmt}: the body reached the client as sent"
    metered = gateway.ask({"x-metered-key": "k"}, "no-usage", cost=777)
    assert metered.status == 200 and metered.headers.get("x-cost") == "777"

    for rule_name, fmt, inp, out in cases + [("metered", "no-usage", 0, 777)]:
        name = f"erl:{rule_name}:{'k' if rule_name == 'metered' else fmt}"
        [member] = settled(stack, gateway, name, [inp + out])
        assert value(stack, name) == RATE - (inp + out), f"{fmt}: value moved by reserve - cost"
    assert counters(gateway, 8, 0)["settled_without_usage"] == 0


def test_an_excess_is_charged_and_the_next_request_waits(start_gateway, stack):
    """A response that cost more than its reservation is charged in full: the value goes below zero, and the
    next request is rejected with the Retry-After of the oldest permit until the window has room again."""
    gateway = start_gateway(h.rule("tokens", limit_by={"header": "x-api-key"}, rate=1000, interval="5s",
                                   cost={"reserve": 100, "settle": {"usage": "openai"}}))
    assert gateway.ask({"x-api-key": "acme"}, "openai-sse", 400, 800).status == 200
    [member] = settled(stack, gateway, "erl:tokens:acme", [1200])
    assert value(stack, "erl:tokens:acme") == 1000 - 1200
    sent = h.epoch_ms()
    rejected = gateway.ask({"x-api-key": "acme"}, "openai-json", 1, 1)
    answered = h.epoch_ms()
    assert rejected.status == 429, rejected
    assert int(rejected.headers["retry-after"]) in h.retry_after_range(5000, member.score_ms, sent, answered)
    assert value(stack, "erl:tokens:acme") == -200, "a rejection takes nothing"
    assert gateway.ask({"x-api-key": "other"}, "openai-json", 1, 1).status == 200, "other keys are not held back"


def test_a_response_without_a_cost_keeps_its_reservation(start_gateway, stack):
    """No usage in the body, or no cost header: the reservation stays what the request took, and
    `settled_without_usage` counts it (no settle call is sent)."""
    gateway = start_gateway(token_rule("openai", "openai"),
                            token_rule("metered", None, settle={"response_header": "x-cost"}))
    assert gateway.ask({"x-openai-key": "a"}, "no-usage").status == 200
    assert gateway.ask({"x-openai-key": "b"}, "gemini-json", 5, 5).status == 200  # Gemini's usageMetadata
    assert gateway.ask({"x-metered-key": "c"}, "openai-json").status == 200  # no x-cost
    metrics = counters(gateway, 0, 3)
    assert (metrics.get("settlements", 0), metrics["settled_without_usage"]) == (0, 3)
    for name in ("erl:openai:a", "erl:openai:b", "erl:metered:c"):
        assert [m.permits for m in members(stack, name)] == [RESERVE], name
        assert value(stack, name) == RATE - RESERVE, name


# Streams cut by the upstream: (format, input, output, pieces before the reset). What each has reported by
# then: Anthropic's message_start (input + its output 1), Gemini's cumulative usage after 2 of 3 events,
# nothing for OpenAI (the usage chunk comes last) or a JSON body cut in the middle.
CUTS = [("anthropic-sse", 300, 900, 3), ("gemini-sse", 40, 90, 2), ("openai-sse", 50, 60, 3),
        ("openai-json", 50, 60, 1)]


def test_a_stream_the_upstream_resets_settles_to_what_it_reported(start_gateway, stack):
    """An upstream that resets mid-response: the reservation is settled to the usage the stream reported
    before the reset (Anthropic: message_start's input tokens; Gemini: its last usage), else kept."""
    rules = [token_rule(llm.PROVIDER[fmt], llm.PROVIDER[fmt]) for fmt in ("anthropic-sse", "gemini-sse", "openai-sse")]
    gateway = start_gateway(*rules)

    def cut_short(cut: tuple[str, int, int, int]) -> h.Response:
        fmt, inp, out, pieces = cut
        return gateway.ask({f"x-{llm.PROVIDER[fmt]}-key": fmt}, fmt, inp, out, reset_after=pieces)

    # In Envoy at once: it closes a reset client's connection after its delayed_close_timeout (1 s). The
    # emulator answers one line at a time.
    with ThreadPoolExecutor(1 if gateway.emulated else len(CUTS)) as pool:
        responses = list(pool.map(cut_short, CUTS))
    assert [r.status for r in responses] == [200] * len(CUTS), responses
    kept = 0
    for fmt, inp, out, cut in CUTS:
        reported = llm.reported(fmt, inp, out, cut)
        kept += reported is None
        name = f"erl:{llm.PROVIDER[fmt]}:{fmt}"
        settled(stack, gateway, name, [RESERVE if reported is None else reported])
        assert value(stack, name) == RATE - (RESERVE if reported is None else reported), fmt
    assert llm.reported("anthropic-sse", 300, 900, 3) == 301 and kept == 2
    counters(gateway, len(CUTS) - kept, kept)
    if gateway.emulated:
        assert gateway.process.outcome_kinds().get("upstream_reset") == len(CUTS)


# The client's leaving is the emulator's upstream reset for the filter (no more body, then the end): real
# Envoy only.
@pytest.mark.parametrize("gateway_kind", ["envoy"])
def test_a_client_that_leaves_mid_stream_settles_to_what_was_reported(start_gateway, stack, llm_server):
    """A client that closes its connection after Anthropic's first events: Envoy resets the stream, and the
    reservation is settled to the input tokens message_start reported, not kept and not released."""
    gateway = start_gateway(token_rule("anthropic", "anthropic"))
    headers = {"x-anthropic-key": "leaver", **llm.headers("anthropic-sse", 250, 700, delay_ms=300)}
    status, got = raw_exchange(gateway.process.port, headers, abort_after=b"event: ping", times=1)
    assert status == 200 and b"message_start" in got and b"message_delta" not in got
    settled(stack, gateway, "erl:anthropic:leaver", [250 + llm.ANTHROPIC_START_OUTPUT])
    h.wait_until(lambda: llm_server.served and llm_server.served[-1].reset, 5.0, "the upstream to see the reset")
    assert llm_server.served[-1].pieces_sent < llm_server.served[-1].pieces, "the stream was cut short"


def test_the_reservation_comes_from_a_request_header(start_gateway, stack):
    """`reserve: {"header": "x-max-tokens", "default": 700}`: the header's number (clamped to the rate), or
    the default when the header is missing or not a number; seen in Redis as the reservation a response
    without a cost keeps."""
    gateway = start_gateway(h.rule("tokens", limit_by={"header": "x-api-key"}, rate=5000, interval="1m",
                                   cost={"reserve": {"header": "x-max-tokens", "default": 700},
                                         "settle": {"response_header": "x-cost"}}))
    for key, max_tokens, reserved in [("a", "300", 300), ("b", None, 700), ("c", "999999", 5000), ("d", "lots", 700)]:
        extra = {} if max_tokens is None else {"x-max-tokens": max_tokens}
        assert gateway.ask({"x-api-key": key}, "no-usage", headers=extra).status == 200
        assert [m.permits for m in members(stack, f"erl:tokens:{key}")] == [reserved], key
    # The same header with a cost: the reservation is settled as usual.
    assert gateway.ask({"x-api-key": "e"}, "no-usage", cost=42, headers={"x-max-tokens": "900"}).status == 200
    settled(stack, gateway, "erl:tokens:e", [42])
    assert value(stack, "erl:tokens:e") == 5000 - 42


def test_the_reservation_and_the_key_come_from_the_json_request_body(start_gateway, stack):
    """`limit_by: {"body": "model"}` and `reserve: {"body": "openai", "default": 700}`: one budget per model
    named in the JSON body, each request reserving its `max_completion_tokens` (else `max_tokens`), the
    default when the body has neither or is not JSON, in both builds (the request headers go on before the
    body is read: the decision reads a copy of them)."""
    gateway = start_gateway(h.rule("per-model", limit_by={"body": "model"}, rate=5000, interval="1m",
                                   cost={"reserve": {"body": "openai", "default": 700},
                                         "settle": {"usage": "openai"}}))
    cases = [("gpt-a", {"max_tokens": 300}, 300), ("gpt-b", {"max_completion_tokens": 400, "max_tokens": 9}, 400),
             ("gpt-c", {}, 700), ("gpt-d", {"max_tokens": 999999}, 5000)]
    for model, fields, reserved in cases:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **fields})
        assert gateway.ask({}, "no-usage", body=body).status == 200
        assert [m.permits for m in members(stack, f"erl:per-model:{model}")] == [reserved], model
    # A usage settles as usual; a body that is not JSON has no model: the key is missing, nothing is charged.
    assert gateway.ask({}, input_tokens=5, output_tokens=37, body=json.dumps({"model": "gpt-e"})).status == 200
    settled(stack, gateway, "erl:per-model:gpt-e", [42])
    assert gateway.ask({}, body="not json").status == 200
    assert members(stack, "erl:per-model:") == []


def test_rates_by_picks_the_rate_from_a_plan_header(start_gateway, stack):
    """`rates_by: {"header": "x-plan"}`: `rates_by_value` matches the plan header (set by an authentication
    filter), not the key: each API key's token budget is its plan's (gold 5,000, free 300), a key without a
    plan gets the rule's own (1,000); the limiters stay named by the key."""
    gateway = start_gateway(h.rule("tokens", limit_by={"header": "x-api-key"}, rate=1000, interval="1m",
                                   rates_by={"header": "x-plan"},
                                   rates_by_value=[{"values": ["gold"], "rate": 5000},
                                                   {"values": ["free"], "rate": 300}],
                                   cost={"reserve": 100, "settle": {"usage": "openai"}}))

    def admitted(key: str, plan: str | None, n: int) -> int:
        plan_header = {} if plan is None else {"x-plan": plan}
        return sum(gateway.ask({"x-api-key": key, **plan_header}, "openai-json", 40, 60).status == 200
                   for _ in range(n))

    assert admitted("acme", "free", 5) == 3, "free: 300 tokens, 100 a request"
    assert admitted("initech", "gold", 12) == 12, "gold: 5,000"
    assert admitted("globex", None, 12) == 10, "no plan: the rule's 1,000"
    rates = {key: stack.redis.client.hget(f"erl:tokens:{key}", "rate") for key in ("acme", "initech", "globex")}
    assert rates == {"acme": b"300", "initech": b"5000", "globex": b"1000"}


# --- Exactness under concurrent requests (real Envoy) -----------------------------------------------------

BUDGET, WINDOW_MS, CLIENTS, RUN_S = 10_000, 2000, 16, 4.0


@pytest.mark.parametrize("gateway_kind", ["envoy"])
def test_a_token_budget_holds_exactly_under_concurrent_requests(start_gateway, stack):
    """16 clients for 4 s against a budget of 10,000 tokens per 2 s, each request reserving its max_tokens and
    costing at most that: no sliding window of the limiter's members (acquire-time scores, settled sizes)
    holds more than 10,000 tokens. The same load with charge-after (`"reserve": 1`, the cost charged when
    the response ends) admits every request while the value is positive and overshoots the budget.

    Why windows of acquire times: a request is admitted only if the permits of the members scored in the
    last interval plus its reservation fit the rate, and its member keeps that score when it is settled; a
    settlement within the reservation only lowers it. So the window ending at any admission held at most the
    rate then, and holds no more once everything is settled. Windows of settle times carry no such bound:
    requests admitted late in one window settle in the next, beside that window's own admissions."""
    reserve = h.rule("settle", limit_by={"header": "x-settle-key"}, rate=BUDGET, interval=WINDOW_MS,
                     cost={"reserve": {"header": "x-max-tokens", "default": 1000}, "settle": {"usage": "openai"}})
    after = h.rule("after", limit_by={"header": "x-after-key"}, rate=BUDGET, interval=WINDOW_MS,
                   cost={"reserve": 1, "settle": {"usage": "openai"}})
    port = start_gateway(reserve, after).process.port
    # Both loads at once (two limiters, one each), so the test lasts RUN_S, not twice that.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(llm.run_load, port, {header: "team"}, stack.redis, name, WINDOW_MS,
                            clients=CLIENTS, seconds=RUN_S)
                for header, name in (("x-settle-key", "erl:settle:team"), ("x-after-key", "erl:after:team"))]
        exact, loose = (run.result() for run in runs)
    windows = [llm.fullest_window(load.found, WINDOW_MS) for load in (exact, loose)]
    print(f"\nreserve-then-settle: {exact.admitted} admitted, {exact.rejected} rejected, fullest window {windows[0]}"
          f"\ncharge-after: {loose.admitted} admitted, {loose.rejected} rejected, fullest window {windows[1]}")
    assert exact.other == 0 and loose.other == 0, "every request was answered 200 or 429"
    assert sum(m.permits for m in exact.found) == exact.tokens, "every admitted request settled to its usage"
    assert windows[0].tokens > BUDGET // 2, f"the budget was used: {windows[0]}"
    assert windows[0].tokens <= BUDGET, f"a window held {windows[0].tokens} tokens of {BUDGET}"
    assert windows[1].tokens > BUDGET, f"charge-after stayed within the budget: {windows[1]}"


# The emulator: requests in flight together, each answered by its own streamed usage (both builds).
EMULATED_BUDGET, EMULATED_WINDOW_MS, EMULATED_ROUNDS, EMULATED_BATCH = 3_000, 1_000, 8, 16


@pytest.mark.parametrize("gateway_kind", ["emulator-envoy", "emulator-higress"])
def test_a_token_budget_holds_exactly_for_requests_in_flight_together_in_both_builds(start_gateway, stack):
    """Rounds of 16 requests in flight at once on the emulator's 2 VMs, each reserving 200-600 tokens
    (x-max-tokens) and streaming an Anthropic usage within its reservation, every 150 ms against a budget of
    3,000 per 1 s: no sliding window of the members (acquire-time scores, settled sizes) holds more than the
    budget, and every admitted request settled to its usage. Charge-after (`reserve: 1`) on the same rounds
    overshoots."""
    rules = [h.rule(name, limit_by={"header": f"x-{name}-key"}, rate=EMULATED_BUDGET, interval=EMULATED_WINDOW_MS,
                    cost={"reserve": reserve, "settle": {"usage": "anthropic"}})
             for name, reserve in (("settle", {"header": "x-max-tokens", "default": 600}), ("after", 1))]
    gateway = start_gateway(*rules)
    emulator = gateway.process
    assert isinstance(emulator, h.Emulator)
    rng = random.Random(7)
    windows, used = [], []
    for name in ("settle", "after"):
        admitted_tokens = 0
        with llm.MemberLog(stack.redis, f"erl:{name}:team", EMULATED_WINDOW_MS) as log:
            for _ in range(EMULATED_ROUNDS):
                asks = []
                for _ in range(EMULATED_BATCH):
                    reserve = rng.randrange(200, 601)
                    output = rng.randrange(1, reserve - 50)
                    asks.append(({"x-max-tokens": str(reserve), f"x-{name}-key": "team"},
                                 llm.response_spec("anthropic-sse", 50, output, events=2), 50 + output))
                answers = emulator.send_batch([{"path": "/v1/messages", "headers": headers, "method": "POST",
                                                "body": REQUEST_BODY, "response": response}
                                               for headers, response, _ in asks])
                admitted_tokens += sum(cost for (_, _, cost), answer in zip(asks, answers) if answer.status == 200)
                emulator.run_for(150)
            emulator.run_for(100)
        found = log.members()
        windows.append(llm.fullest_window(found, EMULATED_WINDOW_MS))
        used.append((sum(m.permits for m in found), admitted_tokens))
    print(f"\nreserve-then-settle: fullest window {windows[0]}, settled {used[0]}"
          f"\ncharge-after: fullest window {windows[1]}, settled {used[1]}")
    assert used[0][0] == used[0][1], f"every admitted request settled to its usage: {used[0]}"
    assert EMULATED_BUDGET // 2 < windows[0].tokens <= EMULATED_BUDGET, f"reserve-then-settle: {windows[0]}"
    assert windows[1].tokens > EMULATED_BUDGET, f"charge-after stayed within the budget: {windows[1]}"
