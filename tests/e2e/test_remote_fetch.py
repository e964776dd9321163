"""Stock Envoy fetching the module over HTTP (`vm_config.code.remote`: an `http_uri` on a cluster and the
module's `sha256`), the way to deploy a pinned module without an image registry (docs/deploying.md,
"Remote fetch"). The module is served by a Python HTTP server on loopback, from a copy of
dist/edge-rate-limiter-envoy.wasm.

1. With the right sha256, Envoy fetches the module once and limits as usual (2 allowed, the 3rd 429).
2. With a wrong sha256, Envoy fetches the whole module (200) 1 + `retry_policy.num_retries` times and refuses
   it each time; then, as Envoy 1.40 does with a plugin that failed to load and the default failure policy,
   it serves and answers every request 503 with an empty body, the upstream reached by none. Its log says
   "Retry limit exceeded for fetching data from remote data source." (warning), "Plugin edge-rate-limiter failed
   to load" and "Plugin configured to fail closed failed to load" (critical). Envoy logs the checksum mismatch
   itself ("data is invalid") only at debug level.
3. With `failure_policy: FAIL_OPEN` the refused module is skipped: requests reach the upstream, unlimited
   (Envoy 1.40 still logs "Plugin configured to fail closed failed to load").
"""

from __future__ import annotations

import hashlib
import http.server
import threading
from typing import Any, Iterator

import pytest
import yaml

import harness as h

MODULE_CLUSTER = "module_server"
RETRIES = 1
FETCH_REFUSED = "Retry limit exceeded for fetching data from remote data source."
LOAD_FAILED = "Plugin edge-rate-limiter failed to load"
FAILED_CLOSED = "Plugin configured to fail closed failed to load"
RULE = h.rule("per-user", rate=2, interval="10s")


class _ModuleHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        server: ModuleServer = self.server.owner  # type: ignore[attr-defined]
        body = server.module
        server.served += 1  # before the answer goes: Envoy may log its verdict before this thread runs on
        self.send_response(200)
        self.send_header("content-type", "application/wasm")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class ModuleServer:
    """Serves `module` (bytes) with 200 at every path of http://127.0.0.1:<port>/; `served` counts the
    answers."""

    def __init__(self, module: bytes):
        self.module = module
        self.served = 0
        self.server = http.server.ThreadingHTTPServer((h.HOST, 0), _ModuleHandler)
        self.server.daemon_threads = True
        self.server.owner = self  # type: ignore[attr-defined]
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="module-server", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{h.HOST}:{self.port}/edge-rate-limiter-envoy.wasm"

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=5.0)
        self.server.server_close()


@pytest.fixture
def module_server() -> Iterator[ModuleServer]:
    # A copy read once: dist/ may be rebuilt while the test runs.
    server = ModuleServer(h.WASM.read_bytes())
    yield server
    server.stop()


def remote_envoy(stack: h.Stack, server: ModuleServer, sha256: str, **plugin_fields: Any) -> h.Envoy:
    """An Envoy of the stack (envoy/envoy.yaml) whose wasm filter fetches its code from `server`
    (`code.remote` instead of `code.local`, a STATIC cluster for the server, 1 retry 50-100 ms apart), with
    `plugin_fields` (e.g. failure_policy) set on the filter's PluginConfig; started, stopped after the test."""
    stack._count += 1
    envoy = h.Envoy(stack.workdir, h.plugin_config(RULE), webdis_port=stack.webdis.port,
                    upstream_port=stack.upstream.port, name=f"remote-{stack._count}")
    bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
    [listener] = bootstrap["static_resources"]["listeners"]
    [wasm, _router] = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    plugin = wasm["typed_config"]["config"]
    plugin["vm_config"]["code"] = {"remote": {
        "http_uri": {"uri": server.url, "cluster": MODULE_CLUSTER, "timeout": "5s"},
        "sha256": sha256,
        "retry_policy": {"num_retries": RETRIES,
                         "retry_back_off": {"base_interval": "0.05s", "max_interval": "0.1s"}},
    }}
    plugin.update(plugin_fields)
    bootstrap["static_resources"]["clusters"].append({
        "name": MODULE_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": MODULE_CLUSTER, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": h.HOST, "port_value": server.port}}}}]}]},
    })
    envoy.yaml_path.write_text(yaml.safe_dump(bootstrap))
    stack.envoys.append(envoy)
    return envoy.start()


def logged(envoy: h.Envoy, *lines: str) -> str:
    """Envoy's log once it holds every one of `lines` (HarnessError after 5 s)."""
    def holds() -> str | None:
        text = envoy.log_text()
        return text if all(line in text for line in lines) else None

    return h.wait_until(holds, 5.0, f"{envoy.name} to log {lines}")


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_envoy_fetches_the_module_by_its_sha256_and_limits_with_it(stack: h.Stack,
                                                                  module_server: ModuleServer) -> None:
    envoy = remote_envoy(stack, module_server, sha256_of(module_server.module))
    hits = stack.upstream.hits
    answers = [envoy.send(headers=h.user("alice")) for _ in range(3)]
    assert [answer.status for answer in answers] == [200, 200, 429]
    assert answers[2].headers["x-ratelimited-by"] == "per-user"
    assert int(answers[2].headers["retry-after"]) >= 1
    assert stack.upstream.hits - hits == 2
    assert module_server.served == 1, "fetched once, for both workers"


def test_a_wrong_sha256_refuses_the_module_and_every_request_gets_503(stack: h.Stack,
                                                                     module_server: ModuleServer) -> None:
    wrong = sha256_of(module_server.module + b"\x00")
    envoy = remote_envoy(stack, module_server, wrong)
    logged(envoy, FETCH_REFUSED, LOAD_FAILED, FAILED_CLOSED)
    assert module_server.served == 1 + RETRIES, "the whole module was served, and refused, each time"
    hits = stack.upstream.hits
    answers = [envoy.send(headers=h.user("alice")) for _ in range(3)]
    assert [(answer.status, answer.body) for answer in answers] == [(503, "")] * 3
    assert "ratelimit" not in answers[0].headers, "the filter never ran"
    assert stack.upstream.hits == hits
    assert stack.redis.client.dbsize() == 0


def test_with_failure_policy_fail_open_a_refused_module_lets_requests_through_unlimited(
        stack: h.Stack, module_server: ModuleServer) -> None:
    envoy = remote_envoy(stack, module_server, sha256_of(b"another module"), failure_policy="FAIL_OPEN")
    logged(envoy, FETCH_REFUSED, LOAD_FAILED)
    hits = stack.upstream.hits
    answers = [envoy.send(headers=h.user("alice")) for _ in range(4)]
    assert [answer.status for answer in answers] == [200] * 4, "past the rate of 2: nothing limits"
    assert "ratelimit" not in answers[-1].headers
    assert stack.upstream.hits - hits == 4
