"""gRPC through real Envoy with the stock build: a real gRPC client and server (grpcio from PyPI).

A rejected gRPC request gets a gRPC answer, not an HTTP 429 page: trailers-only, RESOURCE_EXHAUSTED by
default, the wait as `grpc-retry-pushback-ms` (gRFC A6) and the rate limit headers as trailing metadata.
Without the filter's status Envoy would map 429 to UNAVAILABLE, which retry policies retry at once. A client
whose retry policy covers RESOURCE_EXHAUSTED waits the pushback and then gets through; a streaming call is
limited once, when it opens; failing closed answers UNAVAILABLE without pushback; shadow and exempt requests
go on untouched.

The gRPC service is a generic handler on raw bytes (no generated code): `/erl.Echo/Say` (unary) answers
the request's bytes, `/erl.Echo/Chat` (bidirectional streaming) echoes every message.
"""

from __future__ import annotations

import json
import time
import tomllib
from concurrent import futures
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import yaml

import harness as h

SAY = "/erl.Echo/Say"
CHAT = "/erl.Echo/Chat"


def _say(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _chat(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from requests


@pytest.fixture(scope="module")
def grpc_server() -> Iterator[int]:
    """The gRPC upstream on 127.0.0.1 (a free port, plaintext HTTP/2): its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("erl.Echo", {
        "Say": grpc.unary_unary_rpc_method_handler(_say),
        "Chat": grpc.stream_stream_rpc_method_handler(_chat),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(grace=None)


def grpc_envoy(stack: h.Stack, plugin: dict, upstream_port: int, *, webdis_port: int | None = None) -> h.Envoy:
    """An Envoy with the filter in front of the gRPC server: the `upstream` cluster speaks HTTP/2 (gRPC);
    started and ready, stopped with the test's gateways."""
    envoy = h.Envoy(stack.workdir, plugin, webdis_port=webdis_port or stack.webdis.port,
                    upstream_port=upstream_port, name=f"envoy-grpc-{len(stack.envoys)}")
    bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
    [upstream] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "upstream"]
    upstream["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }}
    envoy.yaml_path.write_text(json.dumps(bootstrap))
    stack.envoys.append(envoy)
    return envoy.start()


def channel(envoy: h.Envoy, service_config: dict | None = None) -> grpc.Channel:
    options: list[tuple[str, Any]] = [("grpc.enable_retries", 1 if service_config else 0)]
    if service_config is not None:
        options.append(("grpc.service_config", json.dumps(service_config)))
    return grpc.insecure_channel(f"127.0.0.1:{envoy.port}", options=options)


def user(name: str) -> list[tuple[str, str]]:
    return [("x-user-id", name)]


def rejection_of(call: Any) -> grpc.RpcError:
    """The error a call that must fail raised."""
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def test_a_rejected_call_gets_resource_exhausted_with_pushback_and_the_headers_as_metadata(
        stack: h.Stack, grpc_server: int) -> None:
    envoy = grpc_envoy(stack, h.plugin_config(h.rule(rate=2, interval="10s")), grpc_server)
    with channel(envoy) as ch:
        say = ch.unary_unary(SAY)
        assert [say(b"hello", metadata=user("alice"), timeout=5) for _ in range(2)] == [b"hello", b"hello"]
        started = time.monotonic()
        error = rejection_of(lambda: say(b"hello", metadata=user("alice"), timeout=5))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert error.details() == "rate limit exceeded"
        trailers = dict(error.trailing_metadata())
        pushback = int(trailers["grpc-retry-pushback-ms"])
        # The first permit leaves the 10 s window about 10 s after it was taken (+3 ms, Redisson's delay).
        # Redisson's delay and the clock guard's 20 ms (docs/redisson.md, "Clocks").
        assert 9_000 <= pushback <= 10_023 + int(1000 * (time.monotonic() - started)), trailers
        assert trailers["retry-after"] == str(-(-pushback // 1000)), trailers
        assert trailers["x-ratelimited-by"] == "per-user"
        assert trailers["ratelimit"].startswith('"per-user";r=0;t='), trailers
        assert "ratelimit-policy" in trailers and trailers["x-envoy-ratelimited"] == "true"
        # Another user is not limited, and an HTTP/1.1 request of alice still gets the HTTP answer.
        assert say(b"hi", metadata=user("bob"), timeout=5) == b"hi"
    response = h.http_request(envoy.port, "/", headers={"x-user-id": "alice"})
    assert response.status == 429 and "grpc-retry-pushback-ms" not in response.headers


def test_a_client_with_a_retry_policy_waits_for_the_pushback_and_gets_through(
        stack: h.Stack, grpc_server: int) -> None:
    envoy = grpc_envoy(stack, h.plugin_config(h.rule(rate=1, interval="1s")), grpc_server)
    # Backoff alone (10 ms, at most 50 ms) would spend the 4 attempts in about 0.1 s and fail.
    policy = {"methodConfig": [{"name": [{"service": "erl.Echo"}], "retryPolicy": {
        "maxAttempts": 4, "initialBackoff": "0.01s", "maxBackoff": "0.05s", "backoffMultiplier": 2,
        "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]}
    with channel(envoy, policy) as ch:
        say = ch.unary_unary(SAY)
        assert say(b"first", metadata=user("carol"), timeout=10) == b"first"
        started = time.monotonic()
        response, call = say.with_call(b"second", metadata=user("carol"), timeout=10)
        waited = time.monotonic() - started
    assert response == b"second"
    # The permit of the first call leaves the window 1 s after it was taken: the retry came after that.
    assert 0.8 <= waited <= 3.0, waited
    rejected = envoy.stats(filter="wasmcustom").get("wasmcustom.edge_rate_limiter.rejected", 0)
    assert 1 <= rejected <= 2, f"the client waited between attempts instead of hammering: {rejected} rejected"


def test_a_stream_is_limited_when_it_opens_and_runs_on_once_admitted(stack: h.Stack, grpc_server: int) -> None:
    envoy = grpc_envoy(stack, h.plugin_config(h.rule(rate=2, interval="10s")), grpc_server)
    with channel(envoy) as ch:
        chat = ch.stream_stream(CHAT)
        messages = [f"m{i}".encode() for i in range(20)]
        first = list(chat(iter(messages), metadata=user("dave"), timeout=5))
        assert first == messages, "20 messages on one admitted stream: one permit"
        assert list(chat(iter([b"x"]), metadata=user("dave"), timeout=5)) == [b"x"]
        error = rejection_of(lambda: list(chat(iter([b"y"]), metadata=user("dave"), timeout=5)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(error.trailing_metadata())["grpc-retry-pushback-ms"]) > 0


def test_shadow_and_exempt_calls_go_on_untouched(stack: h.Stack, grpc_server: int) -> None:
    plugin = h.plugin_config(h.rule("watch", rate=1, interval="10s", mode="shadow"),
                             exempt={"headers": {"x-plan": ["internal"]}})
    envoy = grpc_envoy(stack, plugin, grpc_server)
    with channel(envoy) as ch:
        say = ch.unary_unary(SAY)
        for _ in range(3):
            response, call = say.with_call(b"ok", metadata=user("erin"), timeout=5)
            assert response == b"ok" and call.code() == grpc.StatusCode.OK
        assert say(b"ok", metadata=[*user("erin"), ("x-plan", "internal")], timeout=5) == b"ok"
    stats = envoy.stats(filter="wasmcustom")
    assert stats.get("wasmcustom.edge_rate_limiter.rule.watch.shadow_rejected") == 2, stats


def test_failing_closed_answers_unavailable_without_pushback(stack: h.Stack, grpc_server: int) -> None:
    plugin = h.plugin_config(h.rule(rate=5, interval="10s"), timeout="200ms", failure_mode="deny")
    envoy = grpc_envoy(stack, plugin, grpc_server, webdis_port=h.free_port())  # no bridge listens there
    with channel(envoy) as ch:
        error = rejection_of(lambda: ch.unary_unary(SAY)(b"x", metadata=user("frank"), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error.details() == "rate limiter unavailable"
    assert "grpc-retry-pushback-ms" not in dict(error.trailing_metadata())


def test_the_module_logs_its_plugin_version_when_it_loads(stack: h.Stack, grpc_server: int) -> None:
    version = tomllib.loads((h.REPO / "Cargo.toml").read_text())["package"]["version"]
    envoy = grpc_envoy(stack, h.plugin_config(h.rule()), grpc_server)
    assert f"plugin_version {version}: configured 1 rule(s)" in envoy.log_text()


def test_every_gateway_answers_a_limited_grpc_request_trailers_only(start_gateway: Any) -> None:
    """Both builds, in Envoy and in the emulator (which answers gRPC requests' local replies as Envoy does):
    the rejection of a request with a gRPC content-type is HTTP 200 with grpc-status 8 and the pushback,
    whatever the HTTP version; the same request without it gets the 429."""
    gw = start_gateway(h.rule(rate=1, interval="10s"))
    grpc_headers = {"x-user-id": "gina", "content-type": "application/grpc"}
    assert gw.send("/erl.Echo/Say", grpc_headers).status != 429
    rejected = gw.send("/erl.Echo/Say", grpc_headers)
    assert (rejected.status, rejected.headers.get("grpc-status")) == (200, "8"), rejected
    assert rejected.headers.get("content-type") == "application/grpc"
    assert rejected.headers.get("grpc-message") == "rate limit exceeded"
    assert 9_000 <= int(rejected.headers["grpc-retry-pushback-ms"]) <= 10_023, rejected.headers
    assert rejected.body == ""
    plain = gw.send("/", {"x-user-id": "gina"})
    assert plain.status == 429 and "grpc-status" not in plain.headers
