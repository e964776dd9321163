"""An upstream that answers like an LLM API, for the cost tests (`cost.settle`, docs/configuration.md): a real
HTTP/1.1 server (a thread per connection) whose answers carry token usage where each provider puts it.

Every request chooses its answer with headers:

- `x-test-format`: one of `FORMATS` (default `openai-json`);
- `x-test-input-tokens`, `x-test-output-tokens`: the usage reported (default 10 and 20);
- `x-test-events`: how many content events (SSE) or body pieces (JSON) (default 3);
- `x-test-delay-ms`: the pause before each event or piece after the first (default 0);
- `x-test-reset-after`: close the connection abruptly (TCP RST) after that many events or pieces, without
  ending the body (Envoy then resets the stream: an upstream reset mid-response);
- `x-test-cost`: answered as the response header `x-cost` (the `{"response_header": "x-cost"}` settle).

The bodies follow the providers' API documentation:

- OpenAI chat completions: a `chat.completion` object with `usage.prompt_tokens`, `completion_tokens` and
  `total_tokens`; streamed (`openai-sse`), `chat.completion.chunk` events whose `usage` is null, then, as
  `stream_options: {"include_usage": true}` asks, "an additional chunk ... before the `data: [DONE]` message.
  The `usage` field on this chunk shows the token usage statistics for the entire request, and the `choices`
  field will always be an empty array" (OpenAI's API reference, `ChatCompletionStreamOptions`, as generated
  into https://docs.rs/openai-struct/latest/openai_struct/models/struct.ChatCompletionStreamOptions.html;
  the object: https://docs.yutoai.net/en/api/chat-completion-object.html).
- Anthropic messages: a `message` with `usage.input_tokens` and `output_tokens`; streamed
  (`anthropic-sse`): `event: message_start` (the message with `usage: {"input_tokens": N, "output_tokens":
  1}`), `content_block_start`, `ping`, `content_block_delta` (`text_delta`) events, `content_block_stop`,
  `message_delta` (`stop_reason` and `usage: {"output_tokens": M}`, the total output) and `message_stop`
  (Anthropic's streaming documentation, as quoted at
  https://codex.kylestratis.com/Bins/Evergreen+Notes/Anthropic+Streaming+Event+Types; the message object:
  https://developers.cloudflare.com/ai/models/anthropic/claude-opus-4.6/schema-output.json).
- Gemini `generateContent`: `candidates[].content.parts[].text` and `usageMetadata.promptTokenCount`,
  `candidatesTokenCount`, `totalTokenCount` (https://docs.apiyi.com/en/api-capabilities/gemini/response-handling,
  https://firebase.google.com/docs/reference/js/vertexai-preview.usagemetadata); streamed
  (`streamGenerateContent?alt=sse`, `gemini-sse`): `data:` events of such responses, each with the usage so
  far (candidates counted cumulatively), no `[DONE]` (a real stream as shown in simonw/llm-gemini#97,
  https://github.com/simonw/llm-gemini/issues/97); events end with CRLF CRLF, which SSE allows (the JS SDK's
  reader accepts `\\n\\n`, `\\r\\r` and `\\r\\n\\r\\n`).
- `no-usage`: an OpenAI-style JSON answer without `usage` (a provider, or an error, that reports none).

`chunks()` gives the same bodies as the pieces the server writes, and `response_spec()` the emulator's
per-request answer (`harness.Emulator.send(..., response=...)`) with them; `reported()` says what usage a
stream cut after some pieces has reported so far.

A token budget in Redis (used by tests/e2e/test_cost.py and bench/cost_bench.py): `members()` decodes a
limiter's permit members, `MemberLog` follows them while clients run (each request's acquire-time score and
its settled size), `fullest_window()` and `fixed_windows()` add them up per window, and `run_load()` drives
concurrent clients whose costs stay within their reservations.
"""

from __future__ import annotations

import http.server
import json
import random
import socket
import struct
import threading
import time
from typing import Any, NamedTuple

import harness as h
from harness import Upstream

HOST = "127.0.0.1"

FORMATS = ("openai-json", "openai-sse", "anthropic-json", "anthropic-sse", "gemini-json", "gemini-sse",
           "no-usage")
# Which `cost.settle.usage` reads each format.
PROVIDER = {"openai-json": "openai", "openai-sse": "openai", "anthropic-json": "anthropic",
            "anthropic-sse": "anthropic", "gemini-json": "gemini", "gemini-sse": "gemini", "no-usage": "openai"}


def _words(n: int) -> list[str]:
    """`n` pieces of generated text."""
    return [f"token{i} " for i in range(n)]


def _split(text: str, pieces: int) -> list[str]:
    """`text` in `pieces` parts of about equal length (at least one character each)."""
    pieces = max(1, min(pieces, len(text)))
    size = -(-len(text) // pieces)
    return [text[i:i + size] for i in range(0, len(text), size)]


def _openai_json(input_tokens: int, output_tokens: int, events: int, usage: bool = True) -> str:
    body: dict[str, Any] = {
        "id": "chatcmpl-erl1", "object": "chat.completion", "created": 1764000000, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(_words(events))},
                     "logprobs": None, "finish_reason": "stop"}],
    }
    if usage:
        body["usage"] = {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                         "total_tokens": input_tokens + output_tokens}
    return json.dumps(body)


def _openai_sse(input_tokens: int, output_tokens: int, events: int) -> list[str]:
    def chunk(choices: list, usage: Any = None) -> str:
        return "data: " + json.dumps({
            "id": "chatcmpl-erl1", "object": "chat.completion.chunk", "created": 1764000000,
            "model": "gpt-4o-mini", "system_fingerprint": None, "choices": choices, "usage": usage}) + "\n\n"

    out = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}])]
    out += [chunk([{"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": None}])
            for word in _words(events)]
    out.append(chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]))
    out.append(chunk([], {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                          "total_tokens": input_tokens + output_tokens}))
    out.append("data: [DONE]\n\n")
    return out


def _anthropic_json(input_tokens: int, output_tokens: int, events: int) -> str:
    return json.dumps({
        "id": "msg_erl1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": "".join(_words(events))}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    })


# The output tokens `message_start` reports (Anthropic's documented example shows 1).
ANTHROPIC_START_OUTPUT = 1


def _anthropic_sse(input_tokens: int, output_tokens: int, events: int) -> list[str]:
    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n"

    message = {"id": "msg_erl1", "type": "message", "role": "assistant", "content": [],
               "model": "claude-sonnet-4-5", "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": input_tokens, "output_tokens": ANTHROPIC_START_OUTPUT}}
    out = [event("message_start", {"type": "message_start", "message": message}),
           event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}}),
           event("ping", {"type": "ping"})]
    out += [event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": word}})
            for word in _words(events)]
    out += [event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                    "usage": {"output_tokens": output_tokens}}),
            event("message_stop", {"type": "message_stop"})]
    return out


def _gemini_response(text: str, input_tokens: int, candidates: int, finished: bool) -> dict:
    candidate: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"}, "index": 0}
    if finished:
        candidate["finishReason"] = "STOP"
    return {"candidates": [candidate],
            "usageMetadata": {"promptTokenCount": input_tokens, "candidatesTokenCount": candidates,
                              "totalTokenCount": input_tokens + candidates},
            "modelVersion": "gemini-2.0-flash", "responseId": "erl1"}


def _gemini_counts(output_tokens: int, events: int) -> list[int]:
    """The cumulative candidate tokens after each streamed event: the total at the last one."""
    return [output_tokens * (i + 1) // events for i in range(events)]


def _gemini_sse(input_tokens: int, output_tokens: int, events: int) -> list[str]:
    counts = _gemini_counts(output_tokens, events)
    return ["data: " + json.dumps(_gemini_response(word, input_tokens, count, i == events - 1)) + "\r\n\r\n"
            for i, (word, count) in enumerate(zip(_words(events), counts))]


def chunks(fmt: str, input_tokens: int = 10, output_tokens: int = 20, events: int = 3) -> list[str]:
    """The body of an answer in format `fmt` (`FORMATS`) as the pieces the server writes one by one: one SSE
    event each for the streamed formats, the JSON split in `events` parts for the others."""
    events = max(1, events)
    if fmt == "openai-json":
        return _split(_openai_json(input_tokens, output_tokens, events), events)
    if fmt == "no-usage":
        return _split(_openai_json(input_tokens, output_tokens, events, usage=False), events)
    if fmt == "anthropic-json":
        return _split(_anthropic_json(input_tokens, output_tokens, events), events)
    if fmt == "gemini-json":
        return _split(json.dumps(_gemini_response("".join(_words(events)), input_tokens, output_tokens, True)),
                      events)
    if fmt == "openai-sse":
        return _openai_sse(input_tokens, output_tokens, events)
    if fmt == "anthropic-sse":
        return _anthropic_sse(input_tokens, output_tokens, events)
    if fmt == "gemini-sse":
        return _gemini_sse(input_tokens, output_tokens, events)
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


def content_type(fmt: str) -> str:
    return "text/event-stream" if fmt.endswith("-sse") else "application/json"


def reported(fmt: str, input_tokens: int, output_tokens: int, pieces: int | None = None,
             events: int = 3) -> int | None:
    """The usage a response of format `fmt` has reported after its first `pieces` pieces (None: all of
    them), as its provider counts it (OpenAI `total_tokens`, Anthropic input + output, Gemini
    `totalTokenCount`); None when it has reported none (a JSON body is read whole)."""
    total = len(chunks(fmt, input_tokens, output_tokens, events))
    sent = total if pieces is None else min(pieces, total)
    if fmt == "no-usage":
        return None
    if fmt.endswith("-json"):
        return input_tokens + output_tokens if sent == total else None
    if fmt == "openai-sse":
        # The usage chunk is the one before `[DONE]`.
        return input_tokens + output_tokens if sent >= total - 1 else None
    if fmt == "anthropic-sse":
        if sent == 0:
            return None
        # message_delta is second from the end (then message_stop).
        return input_tokens + (output_tokens if sent >= total - 1 else ANTHROPIC_START_OUTPUT)
    if fmt == "gemini-sse":
        return input_tokens + _gemini_counts(output_tokens, events)[sent - 1] if sent else None
    raise ValueError(f"unknown format {fmt!r}")


def headers(fmt: str = "openai-json", input_tokens: int = 10, output_tokens: int = 20, *, events: int = 3,
            delay_ms: int = 0, reset_after: int | None = None, cost: int | None = None) -> dict[str, str]:
    """The request headers that ask the server for such an answer."""
    out = {"x-test-format": fmt, "x-test-input-tokens": str(input_tokens),
           "x-test-output-tokens": str(output_tokens), "x-test-events": str(events)}
    if delay_ms:
        out["x-test-delay-ms"] = str(delay_ms)
    if reset_after is not None:
        out["x-test-reset-after"] = str(reset_after)
    if cost is not None:
        out["x-test-cost"] = str(cost)
    return out


def response_spec(fmt: str = "openai-json", input_tokens: int = 10, output_tokens: int = 20, *,
                  events: int = 3, reset_after: int | None = None, cost: int | None = None) -> dict:
    """The same answer for the emulator, as wasm-host reads it (a request line's `response`; also
    `harness.Emulator.send(..., response=...)`): each piece one body callback; `reset_after` pieces, then the
    upstream's reset."""
    pairs = [["content-type", content_type(fmt)]]
    if fmt.endswith("-sse"):
        pairs.append(["transfer-encoding", "chunked"])
    if cost is not None:
        pairs.append(["x-cost", str(cost)])
    return {"status": 200, "headers": pairs, "body_chunks": chunks(fmt, input_tokens, output_tokens, events),
            "reset_after": reset_after}


class Served(NamedTuple):
    """One request the server answered: its format, the usage it reported in full, how many pieces it wrote
    of how many, whether it reset the connection, and when it started and ended (epoch ms)."""

    fmt: str
    input_tokens: int
    output_tokens: int
    pieces_sent: int
    pieces: int
    reset: bool
    start_ms: float
    end_ms: float


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # each piece is its own write: no 40 ms delayed-ACK waits

    def _answer(self) -> None:
        start = time.time() * 1000.0
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        server: _Server = self.server  # type: ignore[assignment]
        fmt = self.headers.get("x-test-format", "openai-json")
        input_tokens = int(self.headers.get("x-test-input-tokens", "10"))
        output_tokens = int(self.headers.get("x-test-output-tokens", "20"))
        events = int(self.headers.get("x-test-events", "3"))
        delay = int(self.headers.get("x-test-delay-ms", "0")) / 1000.0
        reset_after = self.headers.get("x-test-reset-after")
        cut = None if reset_after is None else int(reset_after)
        pieces = [piece.encode() for piece in chunks(fmt, input_tokens, output_tokens, events)]
        streamed = fmt.endswith("-sse")
        with server.lock:
            server.hits += 1
        self.send_response(200)
        self.send_header("content-type", content_type(fmt))
        if self.headers.get("x-test-cost") is not None:
            self.send_header("x-cost", self.headers["x-test-cost"])
        if streamed:
            self.send_header("transfer-encoding", "chunked")
            self.send_header("cache-control", "no-cache")
        else:
            self.send_header("content-length", str(sum(map(len, pieces))))
        self.end_headers()
        self.wfile.flush()
        sent = 0
        try:
            for index, piece in enumerate(pieces):
                if cut is not None and sent >= cut:
                    break
                if index and delay:
                    time.sleep(delay)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if streamed else piece)
                self.wfile.flush()
                sent += 1
            if cut is None:
                if streamed:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
            else:
                self._reset()
        except OSError:  # the client (Envoy) went away: it reset the stream
            cut = sent if cut is None else cut
            self.close_connection = True
        server.record(Served(fmt, input_tokens, output_tokens, sent, len(pieces), cut is not None, start,
                             time.time() * 1000.0))

    def _reset(self) -> None:
        """Closes the connection with a TCP RST (SO_LINGER 0) mid-body."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class _Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024  # many connections at once from Envoy when a window refills
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__((HOST, 0), _Handler)
        self.lock = threading.Lock()
        self.hits = 0
        self.served: list[Served] = []

    def record(self, served: Served) -> None:
        with self.lock:
            self.served.append(served)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a reset connection is part of the tests


class LlmUpstream(Upstream):
    """The LLM API stand-in on a free port of 127.0.0.1, started and stopped as the harness's `Upstream`
    (`start()`, `port`, `hits`: requests, `stop()`; a context manager), and `served`: each answer's
    `Served`, in the order they ended."""

    def __init__(self) -> None:  # not super().__init__(): that binds the harness's own server
        self.server = _Server()
        self.port: int = self.server.server_address[1]
        self.thread: threading.Thread | None = None

    @property
    def served(self) -> list[Served]:
        with self.server.lock:
            return list(self.server.served)

    def __enter__(self) -> "LlmUpstream":
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


# --- A token budget in Redis ------------------------------------------------------------------------------


class Member(NamedTuple):
    """One member of a limiter's `{N}:permits`: its random bytes, permits and score (acquire time, epoch ms)."""

    random: bytes
    permits: int
    score_ms: float


def decode_member(member: bytes, score: float) -> Member:
    """`struct.pack('Bc0I', len, random, permits)`: 1 length byte, the random bytes, 4-byte LE permits."""
    length = member[0]
    if len(member) != 1 + length + 4:
        raise ValueError(f"not a permit member: {member!r}")
    return Member(member[1:1 + length], struct.unpack("<I", member[1 + length:])[0], score)


def members(client: Any, name: str) -> list[Member]:
    """The permit members of limiter `name` now (one ZRANGE: a consistent snapshot)."""
    pairs = client.zrange(h.limiter_key(name, "permits"), 0, -1, withscores=True)
    return [decode_member(member, score) for member, score in pairs]


class MemberLog:
    """Reads a limiter's members every 50 ms while in the `with` block and keeps every member's last state.
    A member that vanished while still inside the window was replaced by its settled member (the settle
    script adds the settled member, same score, and removes the reservation in one step); one that vanished
    after it left the window was released by a later acquire: it keeps its last state. `members()`: each
    request's acquire-time score and settled size, the reservation if it was never settled."""

    def __init__(self, redis: h.Redis, name: str, interval_ms: float):
        self.redis, self.name, self.interval_ms = redis, name, interval_ms
        self.last: dict[tuple[bytes, float], Member] = {}
        self.replaced: set[tuple[bytes, float]] = set()
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"member-log-{name}", daemon=True)

    def _run(self) -> None:
        client = self.redis.db(0)
        try:
            while not self._stop.is_set():
                self._read(client)
                time.sleep(0.05)
            self._read(client)
        finally:
            client.close()

    def _read(self, client: Any) -> None:
        found = members(client, self.name)
        # After the read: a member a later acquire released had left the window by then.
        now = h.epoch_ms()
        present = set()
        for member in found:
            present.add((member.random, member.score_ms))
            self.last[(member.random, member.score_ms)] = member
        for key, member in self.last.items():
            # 5 ms: the score and `now` are read from the same machine clock, a few ms apart.
            if key not in present and member.score_ms + self.interval_ms > now + 5:
                self.replaced.add(key)
        self.reads += 1

    def __enter__(self) -> "MemberLog":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def members(self) -> list[Member]:
        return [member for key, member in self.last.items() if key not in self.replaced]


class Window(NamedTuple):
    """A sliding window of members: their permits, where it starts (epoch ms) and how many requests."""

    tokens: int
    start_ms: float
    requests: int


def fullest_window(found: list[Member], interval_ms: float) -> Window:
    """The sliding window [score, score + interval) holding the most permits, over windows starting at each
    member's score."""
    ordered = sorted(found, key=lambda m: m.score_ms)
    best = Window(0, 0.0, 0)
    end = 0
    total = 0
    for start, first in enumerate(ordered):
        while end < len(ordered) and ordered[end].score_ms < first.score_ms + interval_ms:
            total += ordered[end].permits
            end += 1
        if total > best.tokens:
            best = Window(total, first.score_ms, end - start)
        total -= first.permits
    return best


def fixed_windows(found: list[Member], interval_ms: float, since_ms: float, until_ms: float) -> list[int]:
    """The permits of the members scored in each whole window [since + k * interval, + interval) before
    `until_ms`."""
    count = int((until_ms - since_ms) // interval_ms)
    totals = [0] * count
    for member in found:
        index = int((member.score_ms - since_ms) // interval_ms)
        if 0 <= index < count:
            totals[index] += member.permits
    return totals


class Load(NamedTuple):
    """What a run of concurrent clients got: requests admitted and rejected, the tokens the admitted ones
    really cost (as the upstream reported them), other answers, the limiter's members (`MemberLog`) and
    when the run started and ended (epoch ms)."""

    admitted: int
    rejected: int
    tokens: int
    other: int
    found: list[Member]
    start_ms: float
    end_ms: float


def run_load(port: int, key: dict[str, str], redis: h.Redis, limiter: str, interval_ms: float, *,
             clients: int = 16, seconds: float = 4.0, reserve: tuple[int, int] = (500, 2000),
             fmt: str = "openai-sse", delay_ms: int = 5, backoff_s: float = 0.05, seed: int = 0,
             usage: tuple[int, int] | None = None) -> Load:
    """`clients` threads sending POSTs with the `key` headers back to back for `seconds` through the gateway
    at `port`, each reserving `x-max-tokens` (uniform in `reserve`) and costing at most that (input 20 to
    200 tokens, output 1 to the rest), answered in `fmt` with `delay_ms` between events; a client pauses
    `backoff_s` after a rejection. `usage`: each request costs input + output uniform in this range instead
    (at least 2; not bounded by its reservation). The members of `limiter` are read all along."""
    stop = time.monotonic() + seconds
    tallies = {"admitted": 0, "rejected": 0, "tokens": 0, "other": 0}
    lock = threading.Lock()
    body = json.dumps({"model": "m", "stream": fmt.endswith("-sse"), "messages": [{"role": "user", "content": "hi"}]})

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < stop:
            most = rng.randint(*reserve)
            if usage is None:
                inp = rng.randint(20, 200)
                out = rng.randint(1, most - inp)
            else:
                cost = rng.randint(*usage)
                inp = rng.randint(1, cost - 1)
                out = cost - inp
            sent = {**key, "x-max-tokens": str(most), "content-type": "application/json",
                    **headers(fmt, inp, out, delay_ms=delay_ms)}
            try:
                status = h.http_request(port, "/v1/chat", sent, method="POST", body=body.encode()).status
            except OSError:
                status = 0
            outcome = {200: "admitted", 429: "rejected"}.get(status, "other")
            with lock:
                tallies[outcome] += 1
                tallies["tokens"] += inp + out if status == 200 else 0
            if status != 200:
                time.sleep(backoff_s)

    started = h.epoch_ms()
    with MemberLog(redis, limiter, interval_ms) as log:
        threads = [threading.Thread(target=client, args=(i,), name=f"llm-client-{i}") for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 30)
        ended = h.epoch_ms()
        time.sleep(0.3)  # the last responses' settle calls
    return Load(tallies["admitted"], tallies["rejected"], tallies["tokens"], tallies["other"], log.members(),
                started, ended)
