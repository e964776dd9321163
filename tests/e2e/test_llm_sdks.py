"""Token budgets with the clients LLM API users run: the official `openai` and `anthropic` Python SDKs at
their defaults, through real Envoy with the stock build (webdis, Redis), in front of `llm_upstream`, which
answers as the APIs do (docs/configuration.md, "Costs known after the response").

The clients are built as a user builds them: `base_url` (Envoy's listener), a dummy `api_key`, and nothing
that changes what they send; the test of the 429 sets `max_retries=0` (at the default of 2 the SDKs sleep
the Retry-After, here a minute, before giving up), and every client has `timeout=TIMEOUT_S` so that a hung
request fails the test instead of waiting the SDKs' 10 minutes. So the SDKs send what they always send:
`Accept-Encoding: gzip, deflate, br` (with brotli installed), the JSON bodies they build (`max_tokens`,
`max_completion_tokens`, `max_output_tokens`, `stream`, `stream_options`), the API key in `Authorization`,
and no `x-test-*` header: the upstream picks the answer from the path and body, and its usage from the
prompt (`llm.usage_of`: `say N tokens`, at most the body's limit).

What a user would notice if it broke: an SDK call that fails through the gateway (a body it cannot parse,
a compressed answer mangled), a token budget charged something other than the tokens the answer reported
(the reservation, nothing, or a compressed body the filter could not read), a reservation that is not the
`max_tokens` the request asked for, two models sharing one budget, a 429 the SDK does not recognise or that
has no Retry-After, a stream whose usage is never reported, an answer ending with trailers left unsettled.
Every admitted request must end as one settled permit member (`-s`) holding exactly the usage its answer
reported, none left reserved (`-r`), unless the answer reported none.

Several tests need what the filter is gaining: `{"body": ...}` in `cost.reserve` and `limit_by`, and
`cost.settle.include_usage` (until then the filter refuses the configuration at load, and such a test fails
saying so); `accept-encoding: identity` asked of the upstream for a usage-settled request (until then the
upstream gzips the answer, the filter cannot read its usage, and the test fails on the Accept-Encoding the
upstream got); the end of a response that ends with trailers (until then such a JSON answer keeps its
reservation). The first tests drive the upstream alone with the SDKs (and raw HTTP/1.1 and HTTP/2 clients):
what the gateway tests rely on from it.
"""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import anthropic
import h2.config
import h2.connection
import h2.events
import httpx2 as httpx  # the HTTP client the SDKs are built on (its `Response` as a raw answer)
import openai
import pytest
import yaml

import harness as h
import llm_upstream as llm

API_KEY = "sk-erl-test"
TIMEOUT_S = 20.0
OPENAI_MODEL = "gpt-4o-mini"
ANTHROPIC_MODEL = "claude-sonnet-4-6"
# What Envoy's access log says of each response: whether the upstream's trailer reached Envoy as a trailer,
# and the content coding the client got.
ACCESS_FORMAT = {"status": "%RESPONSE_CODE%", "path": "%REQ(:PATH)%", "details": "%RESPONSE_CODE_DETAILS%",
                 "trailer": f"%TRAILER({llm.TRAILER[0]})%", "encoding": "%RESP(CONTENT-ENCODING)%"}


# --- The upstream, the gateway and the clients ------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[llm.LlmUpstream]:
    """The LLM upstream at its defaults (HTTP/1.1, compressing JSON as the request allows)."""
    with llm.LlmUpstream() as server:
        yield server


@pytest.fixture
def start_upstream() -> Iterator[Callable[..., llm.LlmUpstream]]:
    """`start_upstream(**modes)`: another LLM upstream (`llm.LlmUpstream` arguments), stopped after the test."""
    started: list[llm.LlmUpstream] = []

    def start(**modes: Any) -> llm.LlmUpstream:
        started.append(llm.LlmUpstream(**modes).start())  # type: ignore[arg-type]
        return started[-1]

    yield start
    for server in started:
        server.stop()


class Gateway(NamedTuple):
    """An Envoy with the filter in front of an LLM upstream, and what to read off it."""

    envoy: h.Envoy
    upstream: llm.LlmUpstream
    access_log: Path
    served_before: int  # the upstream's answers before this gateway started

    @property
    def port(self) -> int:
        """Where the clients connect: Envoy's listener."""
        return self.envoy.port

    def openai(self, api_key: str = API_KEY, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{h.HOST}:{self.port}/v1", api_key=api_key,
                             timeout=TIMEOUT_S, **options)

    def anthropic(self, api_key: str = API_KEY, **options: Any) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=f"http://{h.HOST}:{self.port}", api_key=api_key,
                                   timeout=TIMEOUT_S, **options)

    def served(self, count: int) -> list[llm.Served]:
        """What the upstream answered through this gateway once it is `count` answers (checking it is no
        more), in the order the requests came (one after the other: the order of the calls)."""
        found = self.upstream.wait_served(count, self.served_before)
        assert len(found) == count, f"the upstream answered {len(found)} requests, wanted {count}: {found}"
        return sorted(found, key=lambda served: served.start_ms)

    def access(self, count: int) -> list[dict]:
        """Envoy's access log entries once there are `count` (written when each response ends)."""
        def written() -> list[dict] | None:
            lines = self.access_log.read_text().splitlines() if self.access_log.exists() else []
            return [json.loads(line) for line in lines] if len(lines) >= count else None
        return h.wait_until(written, 5.0, f"{count} access log entries")

    def counters(self, settlements: int, without_usage: int) -> dict[str, int]:
        """Waits until the filter counted this many `settlements` and `settled_without_usage` (they count
        when each response ends), then checks that it counted no more."""
        def reached() -> dict[str, int] | None:
            found = self.envoy.metrics()
            done = found.get("settlements", 0) >= settlements and found.get("settled_without_usage", 0) >= without_usage
            return found if done else None
        try:
            found = h.wait_until(reached, 5.0, "the counters")
        except h.HarnessError:
            found = self.envoy.metrics()
        counted = (found.get("settlements", 0), found.get("settled_without_usage", 0))
        assert counted == (settlements, without_usage), \
            f"(settlements, settled_without_usage) {counted}, wanted {(settlements, without_usage)}"
        return found


@pytest.fixture
def start_gateway(stack: h.Stack, upstream: llm.LlmUpstream) -> Callable[..., Gateway]:
    """`start_gateway(*rules, upstream=None, **fields)`: an Envoy (2 workers, the template's listener and
    webdis) running the filter with these rules in front of `upstream` (default: the module's), logging
    each response to its access log; an HTTP/2 upstream gets a cluster with `http2_protocol_options`. A
    configuration the filter refuses fails the test with the filter's reason. Stopped after the test."""

    default_upstream = upstream

    def start(*rules: dict, upstream: llm.LlmUpstream | None = None, **fields: Any) -> Gateway:
        server = upstream or default_upstream
        stack._count += 1
        name = f"envoy-{stack._count}"
        envoy = h.Envoy(stack.workdir, h.plugin_config(*rules, **fields), webdis_port=stack.webdis.port,
                        upstream_port=server.port, name=name)
        bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
        access_log = stack.workdir / f"{name}-access.log"
        h.with_json_access_log(bootstrap, access_log, ACCESS_FORMAT)
        if server.http2:
            [cluster] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "upstream"]
            cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }}
        envoy.yaml_path.write_text(json.dumps(bootstrap))
        stack.envoys.append(envoy)
        try:
            envoy.start()
        except h.HarnessError:
            refused = [line[line.index("invalid configuration"):] for line in envoy.log_text().splitlines()
                       if "invalid configuration" in line]
            if refused:
                pytest.fail(f"the filter refused the configuration: {refused[0][:400]}", pytrace=False)
            raise
        return Gateway(envoy, server, access_log, len(server.served))

    return start


# --- SDK calls --------------------------------------------------------------------------------------------


class Call(NamedTuple):
    """One SDK call's outcome as the client saw it: the usage the SDK parsed (input + output tokens; None:
    the answer reported none), the `content-encoding` of the answer the client got, the text."""

    usage: int | None
    encoding: str | None
    text: str


def _streaming(stream: bool) -> dict:
    """The SDK's `stream` argument as a user passes it: only when streaming."""
    return {"stream": True} if stream else {}


def chat(client: openai.OpenAI, prompt: str, *, model: str = OPENAI_MODEL, stream: bool = False,
         **params: Any) -> Call:
    """`client.chat.completions.create` with one user message (the raw response for its headers)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}], **_streaming(stream), **params)
    parsed = raw.parse()
    encoding = raw.headers.get("content-encoding")
    if not stream:
        usage = parsed.usage.total_tokens if parsed.usage else None
        return Call(usage, encoding, parsed.choices[0].message.content or "")
    chunks = list(parsed)
    usages = [chunk.usage.total_tokens for chunk in chunks if chunk.usage is not None]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    return Call(usages[-1] if usages else None, encoding, text)


def respond(client: openai.OpenAI, prompt: str, *, model: str = OPENAI_MODEL, stream: bool = False,
            **params: Any) -> Call:
    """`client.responses.create` (the Responses API) with a string input."""
    raw = client.responses.with_raw_response.create(model=model, input=prompt, **_streaming(stream), **params)
    parsed = raw.parse()
    encoding = raw.headers.get("content-encoding")
    if not stream:
        return Call(parsed.usage.total_tokens if parsed.usage else None, encoding, parsed.output_text)
    events = list(parsed)
    completed = [event.response for event in events if event.type == "response.completed"]
    usage = completed[-1].usage.total_tokens if completed and completed[-1].usage else None
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    return Call(usage, encoding, text)


def message(client: anthropic.Anthropic, prompt: str, *, max_tokens: int, model: str = ANTHROPIC_MODEL,
            stream: bool = False, **params: Any) -> Call:
    """`client.messages.create` with one user message."""
    raw = client.messages.with_raw_response.create(
        model=model, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}], **_streaming(stream),
        **params)
    parsed = raw.parse()
    encoding = raw.headers.get("content-encoding")
    if not stream:
        return Call(parsed.usage.input_tokens + parsed.usage.output_tokens, encoding,
                    "".join(block.text for block in parsed.content if block.type == "text"))
    events = list(parsed)
    started = [event.message.usage.input_tokens for event in events if event.type == "message_start"]
    output = [event.usage.output_tokens for event in events if event.type == "message_delta"]
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    return Call(started[-1] + output[-1] if started and output else None, encoding, text)


def message_stream(client: anthropic.Anthropic, prompt: str, *, max_tokens: int, model: str = ANTHROPIC_MODEL,
                   **params: Any) -> Call:
    """`client.messages.stream(...)`, the SDK's streaming helper, to its final message."""
    with client.messages.stream(model=model, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}],
                                **params) as stream:
        final = stream.get_final_message()
    return Call(final.usage.input_tokens + final.usage.output_tokens, None,
                "".join(block.text for block in final.content if block.type == "text"))


def predicted(prompt: str, **body: Any) -> int:
    """The usage the upstream reports for one user message `prompt` with these body fields (llm.usage_of)."""
    input_tokens, output_tokens, _ = llm.usage_of({"messages": [{"role": "user", "content": prompt}], **body})
    return input_tokens + output_tokens


# The text of an answer of the upstream (llm._words; 3 pieces).
ANSWER_TEXT = "token0 token1 token2 "


# --- Redis ------------------------------------------------------------------------------------------------


def members(stack: h.Stack, name: str) -> list[llm.Member]:
    return llm.members(stack.redis.client, name)


def value(stack: h.Stack, name: str) -> int | None:
    raw = stack.redis.client.get(h.limiter_key(name, "value"))
    return None if raw is None else int(raw)


def _state(stack: h.Stack, name: str) -> str:
    found = [(m.random[:2].decode(errors="replace"), m.permits) for m in members(stack, name)]
    return f"{name}: members (mark, permits) {found}, value {value(stack, name)}"


def settled_to(stack: h.Stack, name: str, usages: list[int], timeout: float = 5.0) -> list[llm.Member]:
    """The limiter's members once they are exactly these usages, every one settled (`-s`): each admitted
    request settled to what its answer reported, none left reserved."""
    def check() -> list[llm.Member] | None:
        found = members(stack, name)
        done = sorted(m.permits for m in found) == sorted(usages) and all(m.random[:2] == b"-s" for m in found)
        return found if done else None
    try:
        return h.wait_until(check, timeout, f"{name} to settle to {usages}")
    except h.HarnessError:
        raise AssertionError(f"wanted settled members {sorted(usages)}; {_state(stack, name)}") from None


def kept(stack: h.Stack, name: str, reservations: list[int]) -> None:
    """The limiter holds exactly these reservations, unsettled (`-r`)."""
    found = members(stack, name)
    assert sorted(m.permits for m in found) == sorted(reservations) and all(m.random[:2] == b"-r" for m in found), \
        f"wanted reservations {sorted(reservations)} kept; {_state(stack, name)}"


def key_limiter(rule: str, api_key: str = API_KEY) -> str:
    """The limiter of an API key under a rule limited by the `authorization` header the SDKs send."""
    return h.limiter_name(f"erl:{rule}", f"Bearer {api_key}")


# --- The upstream alone (no gateway): what the gateway tests rely on ---------------------------------------


def test_the_upstream_answers_the_openai_sdk_as_the_api_does(upstream):
    """Chat completions and the Responses API, JSON and streamed, parse in the openai SDK with the usage the
    upstream predicts; a chat stream carries usage only when `stream_options.include_usage` asked; a token
    limit caps the output (`finish_reason: "length"`); `stream_options` without `stream` is a 400; JSON
    answers are compressed as the SDK allows, streams are not."""
    before = len(upstream.served)
    with openai.OpenAI(base_url=f"http://{h.HOST}:{upstream.port}/v1", api_key=API_KEY, timeout=TIMEOUT_S) as client:
        assert chat(client, "say 40 tokens", max_tokens=300) == Call(predicted("say 40 tokens"), "gzip", ANSWER_TEXT)
        capped = client.chat.completions.create(
            model="gpt-4.1", messages=[{"role": "user", "content": "say 500 tokens"}], max_completion_tokens=60)
        assert (capped.model, capped.choices[0].finish_reason, capped.usage.completion_tokens) == \
            ("gpt-4.1", "length", 60)
        assert chat(client, "say 7 tokens", stream=True) == Call(None, None, ANSWER_TEXT), "no usage unless asked"
        assert chat(client, "say 7 tokens", stream=True, stream_options={"include_usage": True}) == \
            Call(predicted("say 7 tokens"), None, ANSWER_TEXT)
        assert respond(client, "say 25 tokens", max_output_tokens=300) == \
            Call(predicted("say 25 tokens"), "gzip", ANSWER_TEXT)
        assert respond(client, "say 35 tokens", stream=True) == Call(predicted("say 35 tokens"), None, ANSWER_TEXT)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=OPENAI_MODEL, messages=[{"role": "user", "content": "hi"}],
                                           stream_options={"include_usage": True})
        assert refused.value.status_code == 400 and "stream_options" in str(refused.value)
    served = sorted(upstream.wait_served(7, before), key=lambda s: s.start_ms)
    assert [s.fmt for s in served] == ["openai-json", "openai-json", "openai-sse", "openai-sse", "responses-json",
                                       "responses-sse", "error"]
    assert all("gzip" in (s.accept_encoding or "") for s in served), "the SDK accepts gzip"
    assert [s.encoding for s in served] == ["gzip", "gzip", "identity", "identity", "gzip", "identity", "gzip"]
    assert [s.include_usage for s in served[2:4]] == [False, True]


def test_the_upstream_answers_the_anthropic_sdk_as_the_api_does(upstream):
    """Messages, JSON and streamed (`create(stream=True)` and the `messages.stream()` helper), parse in the
    anthropic SDK with the usage the upstream predicts (a system prompt counts as input); `max_tokens` caps
    the output (`stop_reason: "max_tokens"`)."""
    before = len(upstream.served)
    with anthropic.Anthropic(base_url=f"http://{h.HOST}:{upstream.port}", api_key=API_KEY,
                             timeout=TIMEOUT_S) as client:
        assert message(client, "say 40 tokens", max_tokens=300) == \
            Call(predicted("say 40 tokens", max_tokens=300), "gzip", ANSWER_TEXT)
        capped = client.messages.create(model="claude-haiku-4-5", max_tokens=100,
                                        messages=[{"role": "user", "content": "say 500 tokens"}])
        assert (capped.model, capped.stop_reason, capped.usage.output_tokens) == \
            ("claude-haiku-4-5", "max_tokens", 100)
        assert message(client, "say 30 tokens", max_tokens=300, stream=True) == \
            Call(predicted("say 30 tokens"), None, ANSWER_TEXT)
        system = "answer briefly"
        want = sum(llm.usage_of({"system": system, "messages": [{"role": "user", "content": "say 25 tokens"}]})[:2])
        assert message_stream(client, "say 25 tokens", max_tokens=300, system=system) == Call(want, None, ANSWER_TEXT)
    served = sorted(upstream.wait_served(4, before), key=lambda s: s.start_ms)
    assert [(s.fmt, s.encoding) for s in served] == [("anthropic-json", "gzip"), ("anthropic-json", "gzip"),
                                                     ("anthropic-sse", "identity"), ("anthropic-sse", "identity")]


def post(port: int, path: str, body: dict, accept_encoding: str | None) -> tuple[dict[str, str], bytes]:
    """One POST with exactly this `Accept-Encoding` (None: no such header); the headers and the raw body."""
    conn = http.client.HTTPConnection(h.HOST, port, timeout=10)
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        data = json.dumps(body).encode()
        fields = {"content-type": "application/json", "content-length": str(len(data))}
        if accept_encoding is not None:
            fields["accept-encoding"] = accept_encoding
        for name, field in fields.items():
            conn.putheader(name, field)
        conn.endheaders(data)
        response = conn.getresponse()
        return {name.lower(): field for name, field in response.getheaders()}, response.read()
    finally:
        conn.close()


# Accept-Encoding -> the coding of the answer (None: uncompressed).
ACCEPTED = [("gzip", "gzip"), ("deflate", "deflate"), ("br", "br"), ("zstd", "zstd"), ("gzip, deflate, br", "gzip"),
            ("br;q=1.0, gzip;q=0.8", "br"), ("gzip;q=0.5, zstd", "zstd"), ("*", "gzip"), ("identity", None),
            ("gzip;q=0", None), (None, None)]


def test_the_upstream_compresses_json_answers_as_the_request_allows(upstream, start_upstream):
    """Each coding alone, the client's preference (q-values, then order), identity, none: the JSON body
    decodes to the same answer; an event stream is never compressed; the `always` mode compresses what
    asked for identity, the `never` mode nothing."""
    body = {"model": OPENAI_MODEL, "messages": [{"role": "user", "content": "say 12 tokens"}]}
    plain = json.loads(b"".join(piece.encode() for piece in llm.chunks("openai-json", 4, 12, model=OPENAI_MODEL)))
    for accept, coding in ACCEPTED:
        fields, raw = post(upstream.port, "/v1/chat/completions", body, accept)
        assert fields.get("content-encoding") == coding, accept
        assert json.loads(llm.decompress(raw, coding)) == plain, accept
        assert coding is None or fields.get("vary") == "accept-encoding"
    fields, raw = post(upstream.port, "/v1/chat/completions", {**body, "stream": True}, "gzip")
    assert fields["content-type"] == "text/event-stream" and "content-encoding" not in fields
    assert raw.startswith(b"data: {") and raw.endswith(b"data: [DONE]\n\n")

    always = start_upstream(compress="always")
    fields, raw = post(always.port, "/v1/messages", {**body, "max_tokens": 100}, "identity")
    assert fields.get("content-encoding") == "gzip"
    assert json.loads(llm.decompress(raw, "gzip"))["usage"] == {"input_tokens": 4, "output_tokens": 12}
    never = start_upstream(compress="never")
    fields, raw = post(never.port, "/v1/chat/completions", body, "gzip, br")
    assert "content-encoding" not in fields and json.loads(raw) == plain


def test_the_upstream_reads_a_chunked_request_body(upstream):
    """A request body sent chunked (as Envoy forwards a body a filter changed, without its content-length) is
    read whole: the answer follows its `stream` flag and `say N tokens`."""
    body = json.dumps({"model": OPENAI_MODEL, "stream": True, "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": "say 17 tokens"}]}).encode()
    before = len(upstream.served)
    conn = http.client.HTTPConnection(h.HOST, upstream.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=iter([body[:20], body[20:]]), encode_chunked=True,
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        got = response.read().decode()
    finally:
        conn.close()
    assert response.status == 200 and got == "".join(llm.chunks("openai-sse", 4, 17, model=OPENAI_MODEL))
    [served] = upstream.wait_served(1, before)
    assert served.request == json.loads(body) and served.usage == 21


def h2_exchange(port: int, path: str, body: dict) -> tuple[list[str], dict[str, str], bytes, dict[str, str]]:
    """One POST on a new HTTP/2 connection (cleartext, prior knowledge): the frames' kinds in order
    (`headers`, `data`, `trailers`, `end`; repeated data frames once), the response headers, the body and
    the trailers."""
    sock = socket.create_connection((h.HOST, port), timeout=10)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    data = json.dumps(body).encode()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", f"{h.HOST}:{port}"),
                          (":path", path), ("content-type", "application/json"), ("content-length", str(len(data)))])
    conn.send_data(1, data, end_stream=True)
    kinds: list[str] = []
    response: dict[str, str] = {}
    trailers: dict[str, str] = {}
    got = bytearray()
    try:
        sock.sendall(conn.data_to_send())
        while "end" not in kinds and "reset" not in kinds:
            received = sock.recv(65536)
            if not received:
                break
            for event in conn.receive_data(received):
                if isinstance(event, h2.events.ResponseReceived):
                    kinds.append("headers")
                    response = dict(event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    if kinds[-1:] != ["data"]:
                        kinds.append("data")
                    got.extend(event.data)
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.TrailersReceived):
                    kinds.append("trailers")
                    trailers = dict(event.headers)
                elif isinstance(event, h2.events.StreamEnded):
                    kinds.append("end")
                elif isinstance(event, h2.events.StreamReset):
                    kinds.append("reset")
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()
    return kinds, response, bytes(got), trailers


def test_the_http2_upstream_ends_every_answer_with_trailers(start_upstream):
    """The HTTP/2 mode: HEADERS, DATA, then the trailers with END_STREAM (the body's end comes with the
    trailers), for a JSON answer (with its content-length) and an event stream, the same bodies as over
    HTTP/1.1."""
    server = start_upstream(http2=True, compress="never")
    body = {"model": OPENAI_MODEL, "messages": [{"role": "user", "content": "say 9 tokens"}], "max_tokens": 50}
    kinds, response, got, trailers = h2_exchange(server.port, "/v1/chat/completions", body)
    assert kinds == ["headers", "data", "trailers", "end"]
    assert response[":status"] == "200" and response["content-length"] == str(len(got))
    assert json.loads(got)["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}
    assert trailers == dict([llm.TRAILER])
    kinds, response, got, trailers = h2_exchange(server.port, "/v1/messages", {**body, "stream": True})
    assert kinds == ["headers", "data", "trailers", "end"] and response["content-type"] == "text/event-stream"
    assert got.decode() == "".join(llm.chunks("anthropic-sse", 4, 9, model=OPENAI_MODEL))
    # An answer is recorded just after its last frame went out: the client may have it a moment before.
    assert [(s.protocol, s.trailers) for s in server.wait_served(2)] == [("HTTP/2", (llm.TRAILER,))] * 2


# --- Through the gateway ----------------------------------------------------------------------------------

RATE = 100_000


def token_rule(name: str, *, reserve: Any = 1000, settle: Any = None, **fields: Any) -> dict:
    """A token budget per API key (the `authorization` header the SDKs send), RATE per minute, settled by
    OpenAI's usage unless `settle` says otherwise."""
    return h.rule(name, limit_by=fields.pop("limit_by", {"header": "authorization"}), rate=fields.pop("rate", RATE),
                  interval="1m", cost={"reserve": reserve, "settle": settle or {"usage": "openai"}}, **fields)


def test_openai_sdk_calls_settle_to_the_usage_they_report(start_gateway, stack):
    """Chat completions (`max_tokens`; `max_completion_tokens` capping the output; streamed with
    `include_usage`) and the Responses API (`max_output_tokens`, JSON and streamed) through the gateway,
    reserving from the body (`{"body": "openai"}`): each call succeeds with the usage the upstream reported,
    uncompressed although the SDK accepted gzip (the filter asked the upstream for identity), and the API
    key's budget holds exactly those usages, settled."""
    gateway = start_gateway(token_rule("tokens", reserve={"body": "openai", "default": 1000}))
    with gateway.openai() as client:
        calls = [chat(client, "say 40 tokens", max_tokens=300),
                 chat(client, "say 500 tokens", max_completion_tokens=200),
                 chat(client, "say 30 tokens", stream=True, stream_options={"include_usage": True}, max_tokens=300),
                 respond(client, "say 25 tokens", max_output_tokens=300),
                 respond(client, "say 35 tokens", stream=True, max_output_tokens=300)]
    usages = [predicted("say 40 tokens"), predicted("say 500 tokens", max_tokens=200), predicted("say 30 tokens"),
              predicted("say 25 tokens"), predicted("say 35 tokens")]
    assert calls == [Call(usage, None, ANSWER_TEXT) for usage in usages]
    assert [s.accept_encoding for s in gateway.served(5)] == ["identity"] * 5, "the filter asks for identity"
    name = key_limiter("tokens")
    settled_to(stack, name, usages)
    assert value(stack, name) == RATE - sum(usages)
    gateway.counters(5, 0)


def test_anthropic_sdk_calls_settle_to_the_usage_they_report(start_gateway, stack):
    """Messages through the gateway reserving `max_tokens` from the body (`{"body": "anthropic"}`), settled
    by Anthropic's usage: JSON (one capped by `max_tokens`), `create(stream=True)` and the
    `messages.stream()` helper with a system prompt; each call gets the usage the upstream reported,
    uncompressed, and the budget holds exactly those usages, settled."""
    gateway = start_gateway(token_rule("tokens", reserve={"body": "anthropic", "default": 1000},
                                       settle={"usage": "anthropic"}))
    system = "answer briefly"
    with gateway.anthropic() as client:
        calls = [message(client, "say 40 tokens", max_tokens=300),
                 message(client, "say 500 tokens", max_tokens=100),
                 message(client, "say 30 tokens", max_tokens=300, stream=True),
                 message_stream(client, "say 25 tokens", max_tokens=300, system=system)]
    usages = [predicted("say 40 tokens"), predicted("say 500 tokens", max_tokens=100), predicted("say 30 tokens"),
              sum(llm.usage_of({"system": system, "messages": [{"role": "user", "content": "say 25 tokens"}]})[:2])]
    assert calls == [Call(usage, None, ANSWER_TEXT) for usage in usages]
    assert [s.accept_encoding for s in gateway.served(4)] == ["identity"] * 4, "the filter asks for identity"
    name = key_limiter("tokens")
    settled_to(stack, name, usages)
    assert value(stack, name) == RATE - sum(usages)
    gateway.counters(4, 0)


# A prompt whose request body is over 64 KiB: the reservation is then the default.
LONG_PROMPT = "word " * 14_000


def test_the_reservation_is_the_max_tokens_the_body_asks_for(start_gateway, stack):
    """Two rules reserving from the body, `{"body": "openai"}` (max_completion_tokens, else max_tokens, else
    max_output_tokens) and `{"body": "anthropic"}` (max_tokens), default 700, rate 5,000, settled by a
    header the upstream never sends, so each call's reservation stays as taken: for each call (its own API
    key) each rule holds what its reader finds in the body, the rate when more, the default when none or
    when the body is over 64 KiB."""
    rules = [token_rule(name, reserve={"body": name, "default": 700}, settle={"response_header": "x-cost"}, rate=5000)
             for name in ("openai", "anthropic")]
    gateway = start_gateway(*rules)
    # (API key, the call, its reservation under the openai rule, under the anthropic rule)
    cases: list[tuple[str, Callable[[Any], Call], int, int]] = [
        ("max-tokens", lambda c: chat(c, "hi", max_tokens=300), 300, 300),
        ("max-completion-tokens", lambda c: chat(c, "hi", max_completion_tokens=400), 400, 700),
        ("both", lambda c: chat(c, "hi", max_completion_tokens=400, max_tokens=350), 400, 350),
        ("max-output-tokens", lambda c: respond(c, "hi", max_output_tokens=250), 250, 700),
        ("none", lambda c: chat(c, "hi"), 700, 700),
        ("over-the-rate", lambda c: chat(c, "hi", max_tokens=999_999), 5000, 5000),
        ("streamed", lambda c: chat(c, "hi", stream=True, max_tokens=320), 320, 320),
        ("long-prompt", lambda c: chat(c, LONG_PROMPT, max_tokens=300), 700, 700),
    ]
    anthropic_cases: list[tuple[str, Callable[[Any], Call], int, int]] = [
        ("anthropic", lambda c: message(c, "hi", max_tokens=350), 350, 350),
        ("anthropic-long-prompt", lambda c: message(c, LONG_PROMPT, max_tokens=300), 700, 700),
    ]
    for key, call, _, _ in cases:
        with gateway.openai(api_key=key) as client:
            assert call(client).text == ANSWER_TEXT, key
    for key, call, _, _ in anthropic_cases:
        with gateway.anthropic(api_key=key) as client:
            assert call(client).text == ANSWER_TEXT, key
    everything = cases + anthropic_cases
    gateway.counters(0, 2 * len(everything))
    for key, _, openai_reserved, anthropic_reserved in everything:
        kept(stack, key_limiter("openai", key), [openai_reserved])
        kept(stack, key_limiter("anthropic", key), [anthropic_reserved])


def test_a_streamed_answer_holds_its_max_tokens_until_it_ends(start_gateway, start_upstream, stack):
    """A slow stream (150 ms between events): while it runs, the budget holds one reservation of the
    request's `max_tokens` (321); when it ends, that member is settled to the usage, nothing else left."""
    slow = start_upstream(delay_ms=150, events=6)
    gateway = start_gateway(token_rule("tokens", reserve={"body": "openai", "default": 1000}), upstream=slow)
    name = key_limiter("tokens")
    with gateway.openai() as client:
        stream = client.chat.completions.create(
            model=OPENAI_MODEL, messages=[{"role": "user", "content": "say 50 tokens"}], max_tokens=321, stream=True,
            stream_options={"include_usage": True})
        chunks = [next(stream)]
        kept(stack, name, [321])
        during = members(stack, name)
        chunks += list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == predicted("say 50 tokens")
    [after] = settled_to(stack, name, [predicted("say 50 tokens")])
    assert after.score_ms == during[0].score_ms, "settled in place: the acquire time stays"
    assert after.random[2:] == during[0].random[2:], "the reservation's member, renamed"
    gateway.counters(1, 0)


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_budget_per_model_keeps_two_models_apart_and_its_429_reaches_the_sdk(start_gateway, stack, sdk):
    """`limit_by: {"body": "model"}`, 1,000 tokens a minute per model, reserving `max_tokens`: a call that
    used 604 tokens of model A leaves 396, so A's next call asking 600 is rejected: the SDK raises its
    RateLimitError (429) with the Retry-After of A's first permit and the rule's name, and the upstream
    never sees its body; model B still has its whole budget, and A's call asking 300 fits. Each model's limiter
    holds exactly its own calls' usages."""
    gateway = start_gateway(h.rule("per-model", limit_by={"body": "model"}, rate=1000, interval="1m",
                                   cost={"reserve": {"body": sdk, "default": 1000}, "settle": {"usage": sdk}}))
    model_a, model_b = {"openai": ("gpt-4o-mini", "gpt-4.1"),
                        "anthropic": ("claude-sonnet-4-6", "claude-haiku-4-5")}[sdk]
    rate_limit_error = {"openai": openai.RateLimitError, "anthropic": anthropic.RateLimitError}[sdk]
    client = gateway.openai(max_retries=0) if sdk == "openai" else gateway.anthropic(max_retries=0)

    def ask(model: str, tokens: int) -> Call:
        prompt = f"say {tokens} tokens"
        if sdk == "openai":
            return chat(client, prompt, model=model, max_tokens=tokens)  # type: ignore[arg-type]
        return message(client, prompt, model=model, max_tokens=tokens)  # type: ignore[arg-type]

    with client:
        assert ask(model_a, 600).usage == predicted("say 600 tokens") == 604
        [first] = settled_to(stack, f"erl:per-model:{model_a}", [604])
        sent = h.epoch_ms()
        with pytest.raises(rate_limit_error) as rejected:
            ask(model_a, 600)
        answered = h.epoch_ms()
        error = rejected.value
        assert error.status_code == 429
        waits = h.retry_after_range(60_000, first.score_ms, sent, answered)
        assert int(error.response.headers["retry-after"]) in waits, (error.response.headers, waits)
        assert error.response.headers["x-ratelimited-by"] == "per-model"
        assert ask(model_b, 600).usage == 604, "the other model has its own budget"
        assert ask(model_a, 300).usage == 304, "what is left of A's budget"
    settled_to(stack, f"erl:per-model:{model_a}", [604, 304])
    settled_to(stack, f"erl:per-model:{model_b}", [604])
    # A rule reading the body decides once the body has arrived; the headers went on before (a pause there
    # would keep the body from the filter in Envoy): the rejected call's upstream request was reset before
    # it got its body, and the upstream never saw what it asked.
    served = gateway.served(4)
    assert [s.request["model"] for s in served if s.request is not None] == [model_a, model_b, model_a]
    assert [(s.request, s.reset) for s in served if s.request is None] == [(None, True)], \
        "the rejected call's body stayed at the gateway"
    gateway.counters(3, 0)


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_weights_price_output_tokens_at_four_times_the_input(start_gateway, stack, sdk):
    """`settle.weights` {"input": 1, "cached_input": 0.1, "output": 4}, as LLM prices go: each SDK call, JSON
    and streamed (OpenAI's stream with `include_usage` added by the filter), reserves 1,300 (its 300
    `max_tokens` at 4, and room for the prompt) and settles to input + 4 x output tokens of the usage its
    answer reported (no cached tokens reported), so
    the budget holds exactly those prices; the SDK still sees the token counts the upstream sent."""
    settle = {"usage": sdk, "weights": {"input": 1, "cached_input": 0.1, "output": 4}}
    if sdk == "openai":
        settle["include_usage"] = True
    gateway = start_gateway(token_rule("priced", reserve=1300, settle=settle))
    prompts = ["say 40 tokens", "say 30 tokens", "say 250 tokens"]
    with (gateway.openai() if sdk == "openai" else gateway.anthropic()) as client:
        if sdk == "openai":
            calls = [chat(client, prompts[0], max_tokens=300), chat(client, prompts[1], max_tokens=300, stream=True),
                     chat(client, prompts[2], max_tokens=300)]
        else:
            calls = [message(client, prompts[0], max_tokens=300),
                     message(client, prompts[1], max_tokens=300, stream=True),
                     message_stream(client, prompts[2], max_tokens=300)]
    counts = [llm.usage_of({"messages": [{"role": "user", "content": prompt}]})[:2] for prompt in prompts]
    assert [call.usage for call in calls] == [i + o for i, o in counts], "the SDK reads the token counts"
    priced = [i + 4 * o for i, o in counts]
    name = key_limiter("priced")
    settled_to(stack, name, priced)
    assert value(stack, name) == RATE - sum(priced)
    gateway.counters(3, 0)


def test_include_usage_is_added_to_a_streamed_chat_request(start_gateway, stack):
    """`settle: {"usage": "openai", "include_usage": true}`: a streamed chat request without
    `stream_options` reaches the upstream asking for the usage (the rest of its body as the SDK sent it), so
    the stream ends with a usage chunk, which the SDK shows, and it settles; a non-streamed request is left
    alone (OpenAI refuses `stream_options` without `stream`), as are a stream that asked already and a
    Responses API stream (which reports usage anyway)."""
    gateway = start_gateway(token_rule("tokens", settle={"usage": "openai", "include_usage": True}))
    with gateway.openai() as client:
        calls = [chat(client, "say 30 tokens", stream=True, max_tokens=300),
                 chat(client, "say 31 tokens", max_tokens=300),
                 chat(client, "say 32 tokens", stream=True, stream_options={"include_usage": True}),
                 respond(client, "say 33 tokens", stream=True)]
    usages = [predicted(f"say {n} tokens") for n in (30, 31, 32, 33)]
    assert [c.usage for c in calls] == usages, "every answer reported its usage to the client"
    requests = {s.request["messages"][0]["content"] if "messages" in s.request else s.request["input"]: s.request
                for s in gateway.served(4)}
    assert requests["say 30 tokens"] == {
        "model": OPENAI_MODEL, "messages": [{"role": "user", "content": "say 30 tokens"}], "stream": True,
        "max_tokens": 300, "stream_options": {"include_usage": True}}
    assert "stream_options" not in requests["say 31 tokens"]
    assert requests["say 32 tokens"]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in requests["say 33 tokens"]
    settled_to(stack, key_limiter("tokens"), usages)
    gateway.counters(4, 0)


def test_a_stream_without_include_usage_keeps_its_reservation(start_gateway, stack):
    """Without `include_usage` in the rule, a chat stream whose client did not ask for the usage reports
    none: it keeps its reservation of 1,000 (counted in `settled_without_usage`) and reaches the upstream as
    the SDK sent it; a stream that asked settles to its usage."""
    gateway = start_gateway(token_rule("tokens", limit_by="global"))
    with gateway.openai() as client:
        assert chat(client, "say 30 tokens", stream=True).usage is None
        asked = chat(client, "say 31 tokens", stream=True, stream_options={"include_usage": True})
    assert asked.usage == predicted("say 31 tokens")
    requests = [s.request for s in gateway.served(2)]
    assert "stream_options" not in requests[0] and requests[1]["stream_options"] == {"include_usage": True}
    gateway.counters(1, 1)
    found = members(stack, "erl:tokens")
    assert sorted((m.random[:2], m.permits) for m in found) == sorted([(b"-r", 1000), (b"-s", asked.usage)]), \
        _state(stack, "erl:tokens")


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_usage_settled_request_gets_an_uncompressed_answer(start_gateway, stack, sdk):
    """The SDK accepts gzip, deflate and br; for a request a rule settles by usage, the filter asks the
    upstream for `identity` so that it can read the usage: the call succeeds uncompressed and settles. The
    route asks it for every request before its headers go on, so an API key exempt from the token budget
    gets an uncompressed answer too (docs/configuration.md, "Costs known after the response")."""
    gateway = start_gateway(
        h.rule("requests", limit_by={"header": "authorization"}, rate=1000, interval="1m"),
        token_rule("tokens", settle={"usage": sdk}, exempt={"headers": {"authorization": ["Bearer sk-plain"]}}))

    def ask(api_key: str, prompt: str) -> Call:
        if sdk == "openai":
            with gateway.openai(api_key=api_key) as client:
                return chat(client, prompt, max_tokens=300)
        with gateway.anthropic(api_key=api_key) as anthropic_client:
            return message(anthropic_client, prompt, max_tokens=300)

    metered = ask(API_KEY, "say 40 tokens")
    plain = ask("sk-plain", "say 41 tokens")
    served = gateway.served(2)
    assert [s.accept_encoding for s in served] == ["identity", "identity"], "the route's requests ask identity"
    assert plain == Call(predicted("say 41 tokens"), None, ANSWER_TEXT)
    assert served[0].accept_encoding == "identity", \
        f"the upstream was asked for {served[0].accept_encoding!r} and answered {served[0].encoding}"
    assert metered == Call(predicted("say 40 tokens"), None, ANSWER_TEXT)
    settled_to(stack, key_limiter("tokens"), [predicted("say 40 tokens")])
    assert members(stack, key_limiter("tokens", "sk-plain")) == []
    gateway.counters(1, 0)


def test_an_upstream_that_compresses_anyway_keeps_the_reservation(start_gateway, start_upstream, stack):
    """An upstream that ignores Accept-Encoding and gzips its JSON whatever the request says: the filter
    cannot read the usage, so the request keeps its reservation of 1,000 (`settled_without_usage`), and the
    client still gets the compressed answer intact (the SDK decodes it to the right usage and text)."""
    gzipping = start_upstream(compress="always")
    gateway = start_gateway(token_rule("tokens", limit_by="global"), upstream=gzipping)
    with gateway.openai() as client:
        assert chat(client, "say 40 tokens", max_tokens=300) == Call(predicted("say 40 tokens"), "gzip", ANSWER_TEXT)
    [served] = gateway.served(1)
    assert served.encoding == "gzip"
    gateway.counters(0, 1)
    kept(stack, "erl:tokens", [1000])
    assert value(stack, "erl:tokens") == RATE - 1000


def test_an_answer_that_ends_with_trailers_settles_to_its_usage(start_gateway, start_upstream, stack):
    """An HTTP/2 upstream that ends each answer with trailers (Envoy's access log shows each trailer arrived
    as one): chat completions JSON and streamed, and a Responses API answer, each settle to the usage they
    reported, as they do without trailers. (The upstream does not compress, so only the trailers differ.)
    The client stays connected until Envoy has logged the three: a JSON answer is whole for the SDK at its
    content-length, and a client that closed then could end the last stream before its trailers reached
    Envoy (seen once under load: that stream settles by its reset instead)."""
    server = start_upstream(http2=True, compress="never")
    gateway = start_gateway(token_rule("tokens", limit_by="global"), upstream=server)
    with gateway.openai() as client:
        calls = [chat(client, "say 40 tokens", max_tokens=300),
                 chat(client, "say 41 tokens", stream=True, stream_options={"include_usage": True}),
                 respond(client, "say 42 tokens", max_output_tokens=300)]
        logged = gateway.access(3)
    usages = [predicted(f"say {n} tokens") for n in (40, 41, 42)]
    assert calls == [Call(usage, None, ANSWER_TEXT) for usage in usages]
    assert [(s.protocol, s.trailers) for s in gateway.served(3)] == [("HTTP/2", (llm.TRAILER,))] * 3
    assert [entry["trailer"] for entry in logged] == [llm.TRAILER[1]] * 3, "Envoy got the trailers"
    settled_to(stack, "erl:tokens", usages)
    gateway.counters(3, 0)


# --- Bodies the filter cannot read, answers the upstream never gave (issue 40) ------------------------------


def unread_limiter(rule: str, api_key: str) -> str:
    """The limiter a tenant's requests whose body gives no `model` are charged to, under a rule keyed by the
    `authorization` header the SDKs send and the body's `model`: the model part written `!missing`."""
    return h.limiter_name(f"erl:{rule}", f"Bearer {api_key}") + ":!missing"


# The budget of docs/configuration.md ("Costs known after the response"): per API key and per model,
# reserving the body's max_tokens (default 700 here), settled to the usage.
DOCS_BUDGET = h.rule("tokens", limit_by=[{"header": "authorization"}, {"body": "model"}], rate=100_000, interval="1m",
                     cost={"reserve": {"body": "openai", "default": 700}, "settle": {"usage": "openai"}})


@pytest.mark.parametrize("hold", [False, True], ids=["headers-go-on", "held"])
def test_a_body_the_filter_cannot_read_is_charged_to_its_own_tenant(start_gateway, stack, hold):
    """Every kind of body the filter cannot read, sent with the `openai` SDK (its own API key each): over
    64 KiB (a long prompt), not JSON, no `model`, a `model` that is not a string. None passes the budget
    uncounted (before, each skipped the rule: `on_missing` left the key missing), and none is charged to a
    limiter other tenants share: each tenant's limiter of unread bodies (`...:!missing`) holds exactly its
    one request, reserved at the rule's default or settled to the usage its answer reported; the tenant
    whose body was read is charged under its model as before."""
    gateway = start_gateway(DOCS_BUDGET, **({"hold_headers_for_body": True} if hold else {}))
    messages = [{"role": "user", "content": "say 20 tokens"}]
    cases: dict[str, Callable[[openai.OpenAI], Any]] = {
        "too-large": lambda c: chat(c, LONG_PROMPT, max_tokens=300),
        "not-json": lambda c: c.post("/chat/completions", cast_to=httpx.Response,
                                     content=b"model=gpt-4o-mini&max_tokens=5"),
        "no-model": lambda c: c.post("/chat/completions", body={"messages": messages, "max_tokens": 300},
                                     cast_to=httpx.Response),
        "model-not-a-string": lambda c: chat(c, "say 20 tokens", max_tokens=300, extra_body={"model": ["gpt-4o"]}),
    }
    for key, call in cases.items():
        with gateway.openai(api_key=key, max_retries=0) as client:
            try:
                call(client)
            except openai.APIStatusError as error:  # the upstream refuses what it cannot read either
                assert error.status_code != 429, f"{key}: {error}"
    with gateway.openai(api_key="readable") as client:
        assert chat(client, "say 20 tokens", max_tokens=300).usage == predicted("say 20 tokens", max_tokens=300)
    gateway.served(len(cases) + 1)

    def charged() -> dict[str, list[llm.Member]] | None:
        found = {key: members(stack, unread_limiter("tokens", key)) for key in cases}
        settled = all(m.random[:2] in (b"-s", b"-r") for ms in found.values() for m in ms)
        return found if settled and all(len(ms) == 1 for ms in found.values()) else None

    try:
        found = h.wait_until(charged, 5.0, "each tenant's unread body to be charged")
    except h.HarnessError:
        states = {key: _state(stack, unread_limiter("tokens", key)) for key in cases}
        raise AssertionError(f"an unreadable body passed uncounted: {states}") from None
    for key, [member] in found.items():
        assert member.permits > 0, f"{key}: {member}"
        if member.random[:2] == b"-r":
            assert member.permits == 700, f"{key}: kept at the reservation's default: {member}"
    assert found["too-large"][0].permits == predicted(LONG_PROMPT, max_tokens=300), "settled to its usage"
    settled_to(stack, f"{key_limiter('tokens', 'readable')}:{OPENAI_MODEL}", [predicted("say 20 tokens", max_tokens=300)])
    shared = [name for name in stack.redis.client.keys("*!missing*") if b"Bearer" not in name and b"~" not in name]
    assert shared == [], f"a limiter of unread bodies shared by all tenants: {shared}"


def test_a_request_the_upstream_never_answered_gives_its_reservation_back(start_gateway, start_upstream, stack):
    """The upstream is down: Envoy answers the SDK's call itself (503, `UF`: the connection failed). The
    request's reservation (its 300 `max_tokens`) settles to 0 at once, counted in `settled_unanswered`, so
    the tenant's budget is whole again (no member left, the value back at the rate); before, it stayed reserved for the whole interval. With the held
    headers of the docs' configuration: the upstream request starts once the reservation is taken."""
    down = start_upstream()
    gateway = start_gateway(DOCS_BUDGET, upstream=down, hold_headers_for_body=True)
    down.stop()
    with gateway.openai(max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as refused:
            chat(client, "say 20 tokens", max_tokens=300)
    assert refused.value.status_code == 503
    name = f"{key_limiter('tokens')}:{OPENAI_MODEL}"

    def given_back() -> bool:
        # The settle to 0 removes the member and gives its 300 permits back to the value.
        return members(stack, name) == [] and value(stack, name) == 100_000

    try:
        h.wait_until(given_back, 5.0, "the reservation to settle to 0")
    except h.HarnessError:
        raise AssertionError(f"the reservation was not given back: {_state(stack, name)}; "
                             f"{gateway.envoy.metrics()}; {gateway.access(1)}") from None
    assert gateway.envoy.metrics().get("settled_unanswered") == 1


def test_a_token_budget_on_a_sliding_window_counter_settles_each_call_into_its_slice(start_gateway, stack):
    """The docs' budget with `layout: "sliding_window_counter"` (one small hash per API key and model, issue
    41): two `openai` SDK calls each reserve their 300 `max_tokens` in the slice of their acquire, and settle
    to the usage their answer reported, so the hash holds exactly the two usages (nothing left reserved),
    in one key."""
    gateway = start_gateway(dict(DOCS_BUDGET, layout="sliding_window_counter"), hold_headers_for_body=True)
    with gateway.openai() as client:
        usages = [chat(client, f"say {n} tokens", max_tokens=300).usage for n in (20, 50)]
    assert usages == [predicted("say 20 tokens", max_tokens=300), predicted("say 50 tokens", max_tokens=300)]
    name = f"{key_limiter('tokens')}:{OPENAI_MODEL}"
    counter = "{" + name + "}:counter"

    def settled() -> dict | None:
        slices = {int(k): int(v) for k, v in stack.redis.client.hgetall(counter).items()}
        return slices if sum(slices.values()) == sum(usages) else None

    try:
        slices = h.wait_until(settled, 5.0, "the counter to hold the two usages")
    except h.HarnessError:
        raise AssertionError(f"{counter}: {stack.redis.client.hgetall(counter)}, wanted {sum(usages)}") from None
    assert 1 <= len(slices) <= 2, slices
    assert sorted(k.decode() for k in stack.redis.client.keys(f"*{name}*")) == [counter], "one key"
    gateway.counters(2, 0)
