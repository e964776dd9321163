"""An upstream that answers like an LLM API, for the cost tests (`cost.settle`, docs/configuration.md) and the
tests with the providers' own SDKs (tests/e2e/test_llm_sdks.py): a real HTTP/1.1 server (a thread per
connection), or with `LlmUpstream(http2=True)` a real HTTP/2 server (cleartext, prior knowledge) that ends
every answer with trailers, whose answers carry token usage where each provider puts it.

What a request gets is chosen in one of two ways.

**Test headers** (tests/e2e/test_cost.py, bench/cost_bench.py): a request with `x-test-format` gets exactly
what its headers ask, whatever its path and body:

- `x-test-format`: one of `FORMATS`;
- `x-test-input-tokens`, `x-test-output-tokens`: the usage reported (default 10 and 20);
- `x-test-events`: how many content events (SSE) or body pieces (JSON) (default 3);
- `x-test-delay-ms`: the pause before each event or piece after the first (default 0);
- `x-test-reset-after`: close the connection abruptly (TCP RST; HTTP/2: RST_STREAM) after that many events
  or pieces, without ending the body (Envoy then resets the stream: an upstream reset mid-response);
- `x-test-cost`: answered as the response header `x-cost` (the `{"response_header": "x-cost"}` settle).

An `openai-sse` answer chosen so always ends with its usage chunk (as if the request had asked for it).

**As the real API** (a request without `x-test-format`, as every SDK sends): the format comes from the path
and the JSON body's `stream` flag: `POST /v1/chat/completions` OpenAI chat completions, `POST /v1/responses`
OpenAI's Responses API, `POST /v1/messages` Anthropic messages, `...:generateContent` /
`...:streamGenerateContent` Gemini (anything else: an OpenAI chat completion). The usage is predictable
(`usage_of()`): input tokens = for each message (and system prompt or instructions) its whitespace-separated
words plus 1; output tokens = N when the last user message says `say N tokens`, else
`DEFAULT_OUTPUT_TOKENS`, at most the body's `max_completion_tokens`, `max_tokens`, `max_output_tokens` or
`generationConfig.maxOutputTokens` (the answer then says it stopped at the limit: `finish_reason: "length"`,
`stop_reason: "max_tokens"`, `status: "incomplete"`). The other `x-test-*` headers still apply, one by one.
As the APIs do:

- an OpenAI chat stream reports usage only when the request asked for it (`stream_options:
  {"include_usage": true}`): then every chunk has `"usage": null` and a last chunk before `data: [DONE]`
  has the usage and no choices; otherwise no chunk has a `usage` field;
- a chat request with `stream_options` that does not stream is refused: 400, `invalid_request_error`
  (OpenAI: "The 'stream_options' parameter is only allowed when 'stream' is enabled.");
- the model answered is the model asked.

**Compression**, either way: a JSON answer is compressed when the request's `Accept-Encoding` allows gzip,
deflate (zlib), br or zstd: the coding with the highest q-value, the client's order among equals
(`choose_encoding()`), with `content-encoding` and `vary: accept-encoding`; `identity`, nothing, or only
q=0 codings get it uncompressed. Event streams are never compressed (as the APIs' servers leave
`text/event-stream` alone). A JSON answer sent in pieces is the compressed bytes split into pieces.

**Modes of the server** (`Modes`, given to `LlmUpstream(...)`, and changeable while it runs through
`upstream.modes`): `compress` `"auto"` (the above), `"always"` (gzip on every JSON answer whatever
`Accept-Encoding` says: an upstream that ignores it) or `"never"`; `delay_ms`, the pause between pieces for
requests without `x-test-delay-ms` (a slow model); `events`, the pieces for requests without `x-test-events`.
`http2=True` (a constructor argument) serves HTTP/2 only and sends every answer as HEADERS, DATA, then a
HEADERS frame of trailers (`TRAILER`) with END_STREAM: the body's end arrives with the trailers, not with
the last DATA frame (Envoy's cluster needs `http2_protocol_options`).

The bodies follow the providers' API documentation:

- OpenAI chat completions: a `chat.completion` object with `usage.prompt_tokens`, `completion_tokens` and
  `total_tokens`; streamed (`openai-sse`), `chat.completion.chunk` events whose `usage` is null, then, as
  `stream_options: {"include_usage": true}` asks, "an additional chunk ... before the `data: [DONE]` message.
  The `usage` field on this chunk shows the token usage statistics for the entire request, and the `choices`
  field will always be an empty array" (OpenAI's API reference, `ChatCompletionStreamOptions`, as generated
  into https://docs.rs/openai-struct/latest/openai_struct/models/struct.ChatCompletionStreamOptions.html;
  the object: https://docs.yutoai.net/en/api/chat-completion-object.html).
- OpenAI Responses API: a `response` object with `output[]` (a `message` with `output_text` content) and
  `usage.input_tokens`, `output_tokens`, `total_tokens`; streamed (`responses-sse`): `event:` + `data:`
  events `response.created`, `response.in_progress`, `response.output_item.added`,
  `response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
  `response.content_part.done`, `response.output_item.done` and `response.completed`, whose `response`
  carries the usage (the shapes the openai SDK's `ResponseStreamEvent` types parse; src/usage.rs's tests
  quote such a stream).
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

`chunks()` gives the same bodies as the pieces the server writes (uncompressed), and `response_spec()` the
emulator's per-request answer (`harness.Emulator.send(..., response=...)`) with them; `reported()` says what
usage a stream cut after some pieces has reported so far. `LlmUpstream.served` lists what each request got
(`Served`: the request's path, JSON body and `Accept-Encoding`, the answer's format, usage and encoding).

A token budget in Redis (used by tests/e2e/test_cost.py and bench/cost_bench.py): `members()` decodes a
limiter's permit members, `MemberLog` follows them while clients run (each request's acquire-time score and
its settled size), `fullest_window()` and `fixed_windows()` add them up per window, and `run_load()` drives
concurrent clients whose costs stay within their reservations.
"""

from __future__ import annotations

import gzip
import http.server
import json
import random
import re
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import brotli
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import zstandard

import harness as h
from harness import Upstream

HOST = "127.0.0.1"

FORMATS = ("openai-json", "openai-sse", "responses-json", "responses-sse", "anthropic-json", "anthropic-sse",
           "gemini-json", "gemini-sse", "no-usage")
# Which `cost.settle.usage` reads each format.
PROVIDER = {"openai-json": "openai", "openai-sse": "openai", "responses-json": "openai",
            "responses-sse": "openai", "anthropic-json": "anthropic", "anthropic-sse": "anthropic",
            "gemini-json": "gemini", "gemini-sse": "gemini", "no-usage": "openai"}
# The output tokens of an answer to a request that does not say `say N tokens`.
DEFAULT_OUTPUT_TOKENS = 20
# The trailer the HTTP/2 server ends every answer with (name, value).
TRAILER = ("x-llm-upstream-trailer", "end")
# The content codings the server compresses with (`Accept-Encoding`).
CODINGS = ("gzip", "deflate", "br", "zstd")
COMPRESS_MODES = ("auto", "always", "never")
# A model name when the request names none (and the answers of test-header requests).
OPENAI_MODEL, ANTHROPIC_MODEL, GEMINI_MODEL = "gpt-4o-mini", "claude-sonnet-4-5", "gemini-2.0-flash"


def _words(n: int) -> list[str]:
    """`n` pieces of generated text."""
    return [f"token{i} " for i in range(n)]


def _split(text: str, pieces: int) -> list[str]:
    """`text` in `pieces` parts of about equal length (at least one character each)."""
    pieces = max(1, min(pieces, len(text)))
    size = -(-len(text) // pieces)
    return [text[i:i + size] for i in range(0, len(text), size)]


def _split_bytes(data: bytes, pieces: int) -> list[bytes]:
    """`data` in `pieces` parts of about equal length (at least one byte each)."""
    pieces = max(1, min(pieces, len(data)))
    size = -(-len(data) // pieces)
    return [data[i:i + size] for i in range(0, len(data), size)]


def _openai_json(input_tokens: int, output_tokens: int, events: int, usage: bool = True, *,
                 model: str = OPENAI_MODEL, capped: bool = False) -> str:
    body: dict[str, Any] = {
        "id": "chatcmpl-erl1", "object": "chat.completion", "created": 1764000000, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(_words(events))},
                     "logprobs": None, "finish_reason": "length" if capped else "stop"}],
    }
    if usage:
        body["usage"] = {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                         "total_tokens": input_tokens + output_tokens}
    return json.dumps(body)


def _openai_sse(input_tokens: int, output_tokens: int, events: int, usage: bool = True, *,
                model: str = OPENAI_MODEL, capped: bool = False) -> list[str]:
    """With `usage` (the request's `include_usage`): `"usage": null` on every chunk and the usage chunk last;
    without: no chunk has a `usage` field."""
    def chunk(choices: list, reported: Any = None) -> str:
        data = {"id": "chatcmpl-erl1", "object": "chat.completion.chunk", "created": 1764000000,
                "model": model, "system_fingerprint": None, "choices": choices}
        if usage:
            data["usage"] = reported
        return "data: " + json.dumps(data) + "\n\n"

    out = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}])]
    out += [chunk([{"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": None}])
            for word in _words(events)]
    out.append(chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length" if capped else "stop"}]))
    if usage:
        out.append(chunk([], {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                              "total_tokens": input_tokens + output_tokens}))
    out.append("data: [DONE]\n\n")
    return out


def _response_object(input_tokens: int, output_tokens: int, text: str | None, *, model: str,
                     capped: bool) -> dict:
    """A Responses API `response`: `text` None is the object of `response.created` (in progress, no output,
    `"usage": null`)."""
    done = text is not None
    output = [] if not done else [_response_message(text, done=True)]
    return {
        "id": "resp_erl1", "object": "response", "created_at": 1764000000,
        "status": ("incomplete" if capped else "completed") if done else "in_progress",
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if done and capped else None,
        "instructions": None, "max_output_tokens": None, "model": model, "output": output,
        "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": True, "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
        "tools": [], "top_p": 1.0, "truncation": "disabled", "user": None, "metadata": {},
        "usage": None if not done else {
            "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens},
    }


def _response_message(text: str, *, done: bool) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if done else []
    return {"type": "message", "id": "msg_erl1", "status": "completed" if done else "in_progress",
            "role": "assistant", "content": content}


def _responses_json(input_tokens: int, output_tokens: int, events: int, *, model: str = OPENAI_MODEL,
                    capped: bool = False) -> str:
    return json.dumps(_response_object(input_tokens, output_tokens, "".join(_words(events)), model=model,
                                       capped=capped))


def _responses_sse(input_tokens: int, output_tokens: int, events: int, *, model: str = OPENAI_MODEL,
                   capped: bool = False) -> list[str]:
    sequence = iter(range(1 << 20))

    def event(name: str, **fields: Any) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': next(sequence), **fields})}\n\n"

    words = _words(events)
    text = "".join(words)
    started = _response_object(input_tokens, output_tokens, None, model=model, capped=capped)
    part = {"type": "output_text", "text": "", "annotations": []}
    at = {"item_id": "msg_erl1", "output_index": 0, "content_index": 0}
    out = [event("response.created", response=started), event("response.in_progress", response=started),
           event("response.output_item.added", output_index=0, item=_response_message("", done=False)),
           event("response.content_part.added", **at, part=part)]
    out += [event("response.output_text.delta", **at, delta=word, logprobs=[]) for word in words]
    out += [event("response.output_text.done", **at, text=text, logprobs=[]),
            event("response.content_part.done", **at, part={**part, "text": text}),
            event("response.output_item.done", output_index=0, item=_response_message(text, done=True)),
            event("response.completed",
                  response=_response_object(input_tokens, output_tokens, text, model=model, capped=capped))]
    return out


def _anthropic_json(input_tokens: int, output_tokens: int, events: int, *, model: str = ANTHROPIC_MODEL,
                    capped: bool = False) -> str:
    return json.dumps({
        "id": "msg_erl1", "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": "".join(_words(events))}],
        "stop_reason": "max_tokens" if capped else "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    })


# The output tokens `message_start` reports (Anthropic's documented example shows 1).
ANTHROPIC_START_OUTPUT = 1


def _anthropic_sse(input_tokens: int, output_tokens: int, events: int, *, model: str = ANTHROPIC_MODEL,
                   capped: bool = False) -> list[str]:
    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n"

    message = {"id": "msg_erl1", "type": "message", "role": "assistant", "content": [],
               "model": model, "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": input_tokens, "output_tokens": ANTHROPIC_START_OUTPUT}}
    out = [event("message_start", {"type": "message_start", "message": message}),
           event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}}),
           event("ping", {"type": "ping"})]
    out += [event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": word}})
            for word in _words(events)]
    stop = "max_tokens" if capped else "end_turn"
    out += [event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop, "stop_sequence": None},
                                    "usage": {"output_tokens": output_tokens}}),
            event("message_stop", {"type": "message_stop"})]
    return out


def _gemini_response(text: str, input_tokens: int, candidates: int, finished: bool, *,
                     model: str = GEMINI_MODEL, capped: bool = False) -> dict:
    candidate: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"}, "index": 0}
    if finished:
        candidate["finishReason"] = "MAX_TOKENS" if capped else "STOP"
    return {"candidates": [candidate],
            "usageMetadata": {"promptTokenCount": input_tokens, "candidatesTokenCount": candidates,
                              "totalTokenCount": input_tokens + candidates},
            "modelVersion": model, "responseId": "erl1"}


def _gemini_counts(output_tokens: int, events: int) -> list[int]:
    """The cumulative candidate tokens after each streamed event: the total at the last one."""
    return [output_tokens * (i + 1) // events for i in range(events)]


def _gemini_sse(input_tokens: int, output_tokens: int, events: int, *, model: str = GEMINI_MODEL,
                capped: bool = False) -> list[str]:
    counts = _gemini_counts(output_tokens, events)
    return ["data: " + json.dumps(_gemini_response(word, input_tokens, count, i == events - 1, model=model,
                                                   capped=capped)) + "\r\n\r\n"
            for i, (word, count) in enumerate(zip(_words(events), counts))]


def chunks(fmt: str, input_tokens: int = 10, output_tokens: int = 20, events: int = 3, *,
           include_usage: bool = True, model: str | None = None, capped: bool = False) -> list[str]:
    """The body of an answer in format `fmt` (`FORMATS`) as the pieces the server writes one by one
    (uncompressed): one SSE event each for the streamed formats, the JSON split in `events` parts for the
    others. `include_usage`: whether an `openai-sse` stream ends with its usage chunk; `model`: the model
    named (default: the provider's `*_MODEL`); `capped`: the answer stopped at the request's token limit."""
    events = max(1, events)
    named = {} if model is None else {"model": model}
    if fmt == "openai-json":
        return _split(_openai_json(input_tokens, output_tokens, events, **named, capped=capped), events)
    if fmt == "no-usage":
        return _split(_openai_json(input_tokens, output_tokens, events, usage=False, **named), events)
    if fmt == "responses-json":
        return _split(_responses_json(input_tokens, output_tokens, events, **named, capped=capped), events)
    if fmt == "anthropic-json":
        return _split(_anthropic_json(input_tokens, output_tokens, events, **named, capped=capped), events)
    if fmt == "gemini-json":
        return _split(json.dumps(_gemini_response("".join(_words(events)), input_tokens, output_tokens, True,
                                                  **named, capped=capped)), events)
    if fmt == "openai-sse":
        return _openai_sse(input_tokens, output_tokens, events, include_usage, **named, capped=capped)
    if fmt == "responses-sse":
        return _responses_sse(input_tokens, output_tokens, events, **named, capped=capped)
    if fmt == "anthropic-sse":
        return _anthropic_sse(input_tokens, output_tokens, events, **named, capped=capped)
    if fmt == "gemini-sse":
        return _gemini_sse(input_tokens, output_tokens, events, **named, capped=capped)
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


def content_type(fmt: str) -> str:
    return "text/event-stream" if fmt.endswith("-sse") else "application/json"


def reported(fmt: str, input_tokens: int, output_tokens: int, pieces: int | None = None,
             events: int = 3, *, include_usage: bool = True) -> int | None:
    """The usage a response of format `fmt` has reported after its first `pieces` pieces (None: all of
    them), as its provider counts it (OpenAI `total_tokens`, Responses API and Anthropic input + output,
    Gemini `totalTokenCount`); None when it has reported none (a JSON body is read whole; an OpenAI chat
    stream without `include_usage` reports none)."""
    total = len(chunks(fmt, input_tokens, output_tokens, events, include_usage=include_usage))
    sent = total if pieces is None else min(pieces, total)
    if fmt == "no-usage":
        return None
    if fmt.endswith("-json"):
        return input_tokens + output_tokens if sent == total else None
    if fmt == "openai-sse":
        # The usage chunk is the one before `[DONE]`.
        return input_tokens + output_tokens if include_usage and sent >= total - 1 else None
    if fmt == "responses-sse":
        # `response.completed` is the last event.
        return input_tokens + output_tokens if sent == total else None
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


# --- Requests as the SDKs send them -----------------------------------------------------------------------

_SAY = re.compile(r"\bsay (\d+) tokens?\b", re.IGNORECASE)


def _texts(content: Any) -> list[str]:
    """The text of a message's content: a string, or the `text` of its parts (OpenAI `text` /
    `input_text` parts, Anthropic text blocks, Gemini `parts`)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return []


def messages_of(request: Any) -> list[tuple[str, str]]:
    """(role, text) of each message a JSON request carries, system prompt first: OpenAI chat `messages`,
    the Responses API's `instructions` and `input` (a string: one user message), Anthropic's `system` and
    `messages`, Gemini's `systemInstruction` and `contents`."""
    if not isinstance(request, dict):
        return []
    out: list[tuple[str, str]] = []
    for key in ("system", "instructions"):
        if request.get(key) is not None:
            out.append(("system", " ".join(_texts(request[key]))))
    if isinstance(request.get("systemInstruction"), dict):
        out.append(("system", " ".join(_texts(request["systemInstruction"].get("parts")))))
    given = request.get("input")
    if isinstance(given, str):
        out.append(("user", given))
    listed = [item for key in ("messages", "contents") if isinstance(request.get(key), list)
              for item in request[key]]
    listed += given if isinstance(given, list) else []
    for item in listed:
        if isinstance(item, dict):
            role = str(item.get("role", "user"))
            out.append((role, " ".join(_texts(item.get("content", item.get("parts"))))))
    return out


def max_tokens_of(request: Any) -> int | None:
    """The output token limit a JSON request asks: `max_completion_tokens`, else `max_tokens` (OpenAI chat,
    Anthropic), else `max_output_tokens` (Responses API), else `generationConfig.maxOutputTokens` (Gemini)."""
    if not isinstance(request, dict):
        return None
    config = request.get("generationConfig")
    candidates = [request.get("max_completion_tokens"), request.get("max_tokens"), request.get("max_output_tokens"),
                  config.get("maxOutputTokens") if isinstance(config, dict) else None]
    return next((value for value in candidates if isinstance(value, int) and not isinstance(value, bool)), None)


def usage_of(request: Any) -> tuple[int, int, bool]:
    """The usage the server reports for a JSON request (the SDK path): (input tokens, output tokens,
    whether the output stopped at the request's limit). Input: each message's words plus 1 (at least 1);
    output: `say N tokens` in the last user message, else DEFAULT_OUTPUT_TOKENS, at most `max_tokens_of`."""
    found = messages_of(request)
    input_tokens = max(1, sum(len(text.split()) + 1 for _, text in found))
    users = [text for role, text in found if role == "user"]
    said = _SAY.search(users[-1]) if users else None
    wanted = int(said.group(1)) if said else DEFAULT_OUTPUT_TOKENS
    limit = max_tokens_of(request)
    if limit is not None and 0 < limit < wanted:
        return input_tokens, limit, True
    return input_tokens, wanted, False


def format_for(path: str, request: Any) -> str:
    """The answer's format for a request without `x-test-format`: from its path and `stream` flag."""
    route = path.split("?", 1)[0]
    streamed = isinstance(request, dict) and request.get("stream") is True
    if route.endswith(":streamGenerateContent"):
        return "gemini-sse"
    if route.endswith(":generateContent"):
        return "gemini-json"
    if route.endswith("/responses"):
        return "responses-sse" if streamed else "responses-json"
    if route.endswith("/messages"):
        return "anthropic-sse" if streamed else "anthropic-json"
    return "openai-sse" if streamed else "openai-json"


# --- Content codings --------------------------------------------------------------------------------------


def choose_encoding(accept: str | None) -> str:
    """The coding of a JSON answer for this `Accept-Encoding`: among `CODINGS` and `identity`, the highest
    q-value (default 1; q=0 refuses), the first listed among equals; `*` stands for gzip. `identity` when the
    header is missing, empty or allows none of them."""
    best, best_q = "identity", 0.0
    for item in (accept or "").split(","):
        name, _, params = item.strip().partition(";")
        name = name.strip().lower()
        name = "gzip" if name == "*" else name
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if (name in CODINGS or name == "identity") and q > best_q:
            best, best_q = name, q
    return best


def compress(data: bytes, coding: str) -> bytes:
    if coding == "gzip":
        return gzip.compress(data, mtime=0)
    if coding == "deflate":
        return zlib.compress(data)  # HTTP's "deflate" is the zlib format (RFC 9110 8.4.1.2)
    if coding == "br":
        return brotli.compress(data)
    if coding == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    if coding == "identity":
        return data
    raise ValueError(f"unknown coding {coding!r}")


def decompress(data: bytes, coding: str | None) -> bytes:
    """`data` as it was before `compress(data, coding)` (None or "identity": as is)."""
    if coding in (None, "", "identity"):
        return data
    if coding == "gzip":
        return gzip.decompress(data)
    if coding == "deflate":
        return zlib.decompress(data)
    if coding == "br":
        return brotli.decompress(data)
    if coding == "zstd":
        return zstandard.ZstdDecompressor().decompress(data)
    raise ValueError(f"unknown coding {coding!r}")


# --- The server -------------------------------------------------------------------------------------------


@dataclass
class Modes:
    """How the server answers besides what each request asks (see the module's docstring)."""

    compress: str = "auto"  # COMPRESS_MODES
    delay_ms: int = 0
    events: int = 3

    def __post_init__(self) -> None:
        if self.compress not in COMPRESS_MODES:
            raise ValueError(f"compress: one of {COMPRESS_MODES}, not {self.compress!r}")


class Answer(NamedTuple):
    """What the server sends for one request: status, headers (no framing ones), the body's pieces as
    written (compressed if so), whether it streams (SSE), the pause between pieces, after how many pieces it
    resets (None: it ends), and what it is."""

    status: int
    headers: list[tuple[str, str]]
    pieces: list[bytes]
    streamed: bool
    delay: float
    cut: int | None
    fmt: str
    input_tokens: int
    output_tokens: int
    include_usage: bool
    encoding: str
    request: Any


def _json_request(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def answer(modes: Modes, path: str, got: dict[str, str], body: bytes) -> Answer:
    """The answer to a request for `path` with these headers (names lowercased) and body."""
    request = _json_request(body)
    delay = int(got.get("x-test-delay-ms", modes.delay_ms)) / 1000.0
    events = max(1, int(got.get("x-test-events", modes.events)))
    cut = None if got.get("x-test-reset-after") is None else int(got["x-test-reset-after"])
    extra = [] if got.get("x-test-cost") is None else [("x-cost", got["x-test-cost"])]
    model: str | None = None
    capped = False
    include_usage = True
    if "x-test-format" in got:
        fmt = got["x-test-format"]
        input_tokens = int(got.get("x-test-input-tokens", "10"))
        output_tokens = int(got.get("x-test-output-tokens", "20"))
    else:
        fmt = format_for(path, request)
        input_tokens, output_tokens, capped = usage_of(request)
        input_tokens = int(got.get("x-test-input-tokens", input_tokens))
        output_tokens = int(got.get("x-test-output-tokens", output_tokens))
        if isinstance(request, dict) and isinstance(request.get("model"), str):
            model = request["model"]
        options = request.get("stream_options") if isinstance(request, dict) else None
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        if fmt == "openai-json" and options is not None:
            error = {"error": {"message": "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                               "type": "invalid_request_error", "param": "stream_options", "code": None}}
            return _encoded(modes, got, Answer(400, [("content-type", "application/json")] + extra,
                                               [json.dumps(error).encode()], False, 0.0, None, "error",
                                               input_tokens, output_tokens, False, "identity", request))
    pieces = [piece.encode() for piece in chunks(fmt, input_tokens, output_tokens, events,
                                                   include_usage=include_usage, model=model, capped=capped)]
    streamed = fmt.endswith("-sse")
    out = [("content-type", content_type(fmt))] + extra
    if streamed:
        out.append(("cache-control", "no-cache"))
    return _encoded(modes, got, Answer(200, out, pieces, streamed, delay, cut, fmt, input_tokens, output_tokens,
                                       include_usage, "identity", request))


def _encoded(modes: Modes, got: dict[str, str], plain: Answer) -> Answer:
    """The answer compressed as the request's Accept-Encoding (and the server's mode) says: JSON only."""
    if plain.streamed or modes.compress == "never":
        return plain
    coding = "gzip" if modes.compress == "always" else choose_encoding(got.get("accept-encoding"))
    if coding == "identity":
        return plain
    data = compress(b"".join(plain.pieces), coding)
    return plain._replace(headers=plain.headers + [("content-encoding", coding), ("vary", "accept-encoding")],
                          pieces=_split_bytes(data, len(plain.pieces)), encoding=coding)


class Served(NamedTuple):
    """One request the server answered: its format, the usage it reported in full, how many pieces it wrote
    of how many, whether it reset the connection (or stream), when it started and ended (epoch ms); the
    request's path, JSON body (None if not JSON) and `Accept-Encoding` (None: none), the answer's status,
    content coding, whether an OpenAI chat stream carried its usage chunk, the protocol and the trailers sent."""

    fmt: str
    input_tokens: int
    output_tokens: int
    pieces_sent: int
    pieces: int
    reset: bool
    start_ms: float
    end_ms: float
    path: str = ""
    request: Any = None
    accept_encoding: str | None = None
    status: int = 200
    encoding: str = "identity"
    include_usage: bool = True
    protocol: str = "HTTP/1.1"
    trailers: tuple[tuple[str, str], ...] = ()

    @property
    def usage(self) -> int | None:
        """The usage the answer reported (as `reported()` counts it), None when it reported none."""
        if self.status != 200:
            return None
        return reported(self.fmt, self.input_tokens, self.output_tokens,
                        self.pieces_sent if self.reset else None, include_usage=self.include_usage)


def _served(reply: Answer, path: str, got: dict[str, str], sent: int, reset: bool, start: float,
            protocol: str, trailers: tuple = ()) -> Served:
    return Served(reply.fmt, reply.input_tokens, reply.output_tokens, sent, len(reply.pieces), reset, start,
                  time.time() * 1000.0, path, reply.request, got.get("accept-encoding"), reply.status,
                  reply.encoding, reply.include_usage, protocol, trailers)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # each piece is its own write: no 40 ms delayed-ACK waits

    def _body(self) -> bytes:
        """The request body: by content-length, or chunked (a filter that changed the body, e.g. Envoy)."""
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _answer(self) -> None:
        start = time.time() * 1000.0
        body = self._body()
        server: _Server = self.server  # type: ignore[assignment]
        got: dict[str, str] = {}
        for name, value in self.headers.items():
            name = name.lower()
            got[name] = f"{got[name]}, {value}" if name in got else value
        reply = answer(server.modes, self.path, got, body)
        with server.lock:
            server.hits += 1
        self.send_response(reply.status)
        for name, value in reply.headers:
            self.send_header(name, value)
        if reply.streamed:
            self.send_header("transfer-encoding", "chunked")
        else:
            self.send_header("content-length", str(sum(map(len, reply.pieces))))
        self.end_headers()
        self.wfile.flush()
        sent = 0
        cut = reply.cut
        try:
            for index, piece in enumerate(reply.pieces):
                if cut is not None and sent >= cut:
                    break
                if index and reply.delay:
                    time.sleep(reply.delay)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if reply.streamed else piece)
                self.wfile.flush()
                sent += 1
            if cut is None:
                if reply.streamed:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
            else:
                self._reset()
        except OSError:  # the client (Envoy) went away: it reset the stream
            cut = sent if cut is None else cut
            self.close_connection = True
        server.record(_served(reply, self.path, got, sent, cut is not None, start, "HTTP/1.1"))

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

    def __init__(self, modes: Modes) -> None:
        super().__init__((HOST, 0), _Handler)
        self.modes = modes
        self.lock = threading.Lock()
        self.hits = 0
        self.served: list[Served] = []

    def record(self, served: Served) -> None:
        with self.lock:
            self.served.append(served)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a reset connection is part of the tests


class _H2Connection:
    """One HTTP/2 connection of `_H2Server`: a thread reads frames; each request is answered by a thread of
    its own (streams run side by side), all writing through one `h2` state machine under `lock`."""

    def __init__(self, server: "_H2Server", sock: socket.socket) -> None:
        self.server, self.sock = server, sock
        config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a window update, or the connection's end
        self.requests: dict[int, tuple[list[tuple[str, str]], bytearray]] = {}
        self.closed = False

    def run(self) -> None:
        try:
            with self.lock:
                self.conn.initiate_connection()
                self._flush()
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                with self.lock:
                    for event in self.conn.receive_data(data):
                        self._event(event)
                    self._flush()
                    self.changed.notify_all()
        except (OSError, h2.exceptions.H2Error):
            pass
        finally:
            with self.lock:
                self.closed = True
                self.changed.notify_all()
            self.server.forget(self.sock)

    def _event(self, event: Any) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self.requests[event.stream_id] = (list(event.headers), bytearray())
            if event.stream_ended is not None:
                self._start(event.stream_id)
        elif isinstance(event, h2.events.DataReceived):
            if event.stream_id in self.requests:
                self.requests[event.stream_id][1].extend(event.data)
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self._start(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self.requests.pop(event.stream_id, None)

    def _start(self, stream_id: int) -> None:
        pair = self.requests.pop(stream_id, None)
        if pair is not None:
            threading.Thread(target=self._respond, args=(stream_id, *pair), daemon=True,
                             name=f"h2-stream-{stream_id}").start()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def _send_data(self, stream_id: int, data: bytes) -> None:
        """Sends `data` on the stream as the flow-control windows allow (waiting for window updates)."""
        view = memoryview(data)
        with self.lock:
            while view:
                if self.closed:
                    raise OSError("the connection closed")
                room = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
                if room <= 0:
                    self.changed.wait(1.0)
                    continue
                self.conn.send_data(stream_id, bytes(view[:room]))
                view = view[room:]
                self._flush()

    def _respond(self, stream_id: int, request_headers: list[tuple[str, str]], body: bytearray) -> None:
        start = time.time() * 1000.0
        pseudo = {name: value for name, value in request_headers if name.startswith(":")}
        got: dict[str, str] = {}
        for name, value in request_headers:
            if not name.startswith(":"):
                got[name] = f"{got[name]}, {value}" if name in got else value
        path = pseudo.get(":path", "/")
        reply = answer(self.server.modes, path, got, bytes(body))
        with self.server.lock:
            self.server.hits += 1
        sent, reset, trailers = 0, False, ()
        try:
            framing = [] if reply.streamed else [("content-length", str(sum(map(len, reply.pieces))))]
            with self.lock:
                self.conn.send_headers(stream_id, [(":status", str(reply.status))] + reply.headers + framing)
                self._flush()
            for index, piece in enumerate(reply.pieces):
                if reply.cut is not None and sent >= reply.cut:
                    break
                if index and reply.delay:
                    time.sleep(reply.delay)
                self._send_data(stream_id, piece)
                sent += 1
            with self.lock:
                if reply.cut is None:
                    self.conn.send_headers(stream_id, [TRAILER], end_stream=True)
                    trailers = (TRAILER,)
                else:
                    self.conn.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.INTERNAL_ERROR)
                    reset = True
                self._flush()
        except (OSError, h2.exceptions.H2Error):  # Envoy reset the stream, or left
            reset = True
        self.server.record(_served(reply, path, got, sent, reset, start, "HTTP/2", trailers))


class _H2Server:
    """An HTTP/2 server (cleartext, prior knowledge: what Envoy's `http2_protocol_options` cluster speaks) on
    a free port of 127.0.0.1, a thread per connection; the interface `harness.Upstream` drives (as
    socketserver's): `serve_forever()`, `shutdown()`, `server_close()`, `server_address`."""

    def __init__(self, modes: Modes) -> None:
        self.modes = modes
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((HOST, 0))
        self.sock.listen(1024)
        self.server_address = self.sock.getsockname()
        self.lock = threading.Lock()
        self.hits = 0
        self.served: list[Served] = []
        self._stop = threading.Event()
        self._connections: set[socket.socket] = set()

    def serve_forever(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self._connections.add(conn)
            threading.Thread(target=_H2Connection(self, conn).run, daemon=True, name="h2-connection").start()

    def forget(self, conn: socket.socket) -> None:
        with self.lock:
            self._connections.discard(conn)
        try:
            conn.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """Stops accepting and closes every connection (their threads end)."""
        self._stop.set()
        with self.lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def server_close(self) -> None:
        self.sock.close()

    def record(self, served: Served) -> None:
        with self.lock:
            self.served.append(served)


class LlmUpstream(Upstream):
    """The LLM API stand-in on a free port of 127.0.0.1, started and stopped as the harness's `Upstream`
    (`start()`, `port`, `hits`: requests, `stop()`; a context manager), and `served`: each answer's
    `Served`, in the order they ended (`wait_served()`). `http2`: an HTTP/2 server ending every answer with trailers;
    `compress`, `delay_ms`, `events`: its `Modes` (`modes`, changeable while it runs)."""

    def __init__(self, *, http2: bool = False, compress: str = "auto", delay_ms: int = 0,
                 events: int = 3) -> None:  # not super().__init__(): that binds the harness's own server
        self.modes = Modes(compress, delay_ms, events)
        self.http2 = http2
        self.server: Any = _H2Server(self.modes) if http2 else _Server(self.modes)
        self.port: int = self.server.server_address[1]
        self.thread: threading.Thread | None = None

    @property
    def served(self) -> list[Served]:
        with self.server.lock:
            return list(self.server.served)

    def wait_served(self, count: int, since: int = 0, timeout: float = 5.0) -> list[Served]:
        """`served[since:]` once it holds `count` answers (an answer is recorded just after its last byte
        went out, so a client may have it a moment before); HarnessError after `timeout` seconds."""
        def enough() -> list[Served] | None:
            found = self.served[since:]
            return found if len(found) >= count else None
        return h.wait_until(enough, timeout, f"{count} answers of the LLM upstream")

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
