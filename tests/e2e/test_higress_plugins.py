"""Real third-party Higress plugins in the emulator's Higress host (`wasm-host serve --host higress`).

The plugins are the built `plugin.wasm` files of the PyPI package `gpustack-higress-plugins` 0.5.1
(tests/requirements.txt; GPUStack's Higress plugins, wasm-go modules built with Go 1.24 for wasip1, ABI
`proxy_abi_version_0_2_100`). Each one runs in Higress mode with a configuration from its documentation and
its documented behaviour is checked:

- `gpustack-ip-acl` 0.1.0 (README.md of gpustack/gpustack-higress-plugin, extensions/gpustack-ip-acl):
  per-consumer (`x-mse-consumer`) source-IP allow and deny lists; a denied or not-allowed address gets a 403
  JSON local reply, deny beats allow, a consumer without a rule and a request without a consumer pass;
- `gpustack-set-header-pre-route` 1.0.1 (its README.md and main.go there): on a path with a configured
  suffix or prefix, the route name (property `route_name`) and the model (the service of the property
  `cluster_name`, `outbound|port||service`) are added as request headers; other paths are untouched;
- `transformer` 2.0.0 (Higress's plugin, alibaba/higress plugins/wasm-go/extensions/transformer/README_EN.md):
  request headers and query parameters removed, renamed, added; response headers added.

Envoy mode refuses every Go plugin of the package at load, as stock Envoy 1.40 does (it knows no
`proxy_abi_version_0_2_100`: "Missing or unknown Proxy-Wasm ABI version", checked with `envoy --mode
validate`), and the default host (compat) refuses them for the WASI functions the Go runtime imports
(`wasi_snapshot_preview1.sched_yield`, `poll_oneoff`, `fd_fdstat_set_flags`, `path_filestat_get`). Both are
checked before the module is compiled, so they cost milliseconds.

The emulator runs the 5-6 MB Go modules in wasmi (its default engine, tests/host/src/engine.rs), which
translates each function when it first runs: a plugin starts in about a second. One gateway per plugin (one
VM) serves every test of this module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from harness import REPO, WASM_HOST_BIN, Emulator, HarnessError

PACKAGE = "gpustack_higress_plugins"
PACKAGE_VERSION = "0.5.1"
# Every plugin starts at once, on a loaded 2-core machine.
START_TIMEOUT = 120.0

IP_ACL = "gpustack-ip-acl"
SET_HEADER = "gpustack-set-header-pre-route"
TRANSFORMER = "transformer"

IP_ACL_CONFIG = {
    "consumers": {
        "alice": {"allowedCidrs": ["192.168.1.0/24"], "deniedCidrs": ["192.168.1.13"]},
        "bob": {"deniedCidrs": ["203.0.113.0/24"]},
        "gpustack-*": {"allowedCidrs": ["10.0.0.0/8"]},
    }
}
SET_HEADER_CONFIG = {"routeNameHeader": "x-gpustack-route-name", "clusterNameHeader": "x-gpustack-model"}
# The Higress cluster of the route's upstream (Higress names them outbound|<port>||<service>).
CLUSTER_NAME = "outbound|80||qwen3-8b.static"
TRANSFORMER_CONFIG = {
    "reqRules": [
        {"operate": "remove", "headers": [{"key": "x-remove"}], "querys": [{"key": "debug"}]},
        {"operate": "rename", "headers": [{"oldKey": "x-old", "newKey": "x-new"}]},
        {"operate": "add", "headers": [{"key": "x-added", "value": "by-transformer"}],
         "querys": [{"key": "source", "value": "gateway"}]},
    ],
    "respRules": [
        {"operate": "add", "headers": [{"key": "x-transformed", "value": "yes"}]},
    ],
}


def package_plugins() -> Path:
    """The package's plugins/ directory; fails (never skips) when the package is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        pytest.fail(f"the Python package gpustack-higress-plugins=={PACKAGE_VERSION} is not installed in this "
                    f"interpreter ({sys.executable}): it provides the Higress plugins these tests load; "
                    f"install tests/requirements.txt (make setup)", pytrace=False)
    return Path(spec.origin).parent / "plugins"


def plugin_wasm(name: str) -> Path:
    """The plugin.wasm of a plugin, at the version the package's manifest calls the latest."""
    plugins = package_plugins()
    manifest = json.loads((plugins.parent / "manifest.json").read_text())
    if manifest.get("version") != PACKAGE_VERSION:
        pytest.fail(f"gpustack-higress-plugins {manifest.get('version')} is installed, these tests are written "
                    f"for {PACKAGE_VERSION} (tests/requirements.txt)", pytrace=False)
    path = plugins / name / manifest["plugins"][name]["latest"] / "plugin.wasm"
    if not path.is_file():
        pytest.fail(f"{path} is missing from gpustack-higress-plugins {PACKAGE_VERSION}", pytrace=False)
    return path


def go_plugins() -> list[str]:
    """Every Go (wasm-go) plugin of the package: those carrying the Go runtime's build information."""
    plugins = package_plugins()
    names = sorted(p.name for p in plugins.iterdir() if p.is_dir())
    return [name for name in names if b"Go cmd/compile" in plugin_wasm(name).read_bytes()]


def wasm_host(*args: str) -> subprocess.CompletedProcess[str]:
    """`wasm-host serve ARGS` with no request: its exit code and stderr (a refused module exits 1)."""
    if not WASM_HOST_BIN.is_file():
        pytest.fail(f"no wasm-host at {WASM_HOST_BIN}: cargo build -p proxy-wasm-host-emulator", pytrace=False)
    return subprocess.run([str(WASM_HOST_BIN), "serve", *args], input="", capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Emulator]]:
    """One Higress-mode gateway per plugin, started together."""
    workdir = tmp_path_factory.mktemp("higress-plugins")
    common = ("--host", "higress")
    specs = {
        IP_ACL: (IP_ACL_CONFIG, ()),
        SET_HEADER: (SET_HEADER_CONFIG, ("--property", f"cluster_name={CLUSTER_NAME}")),
        TRANSFORMER: (TRANSFORMER_CONFIG, ()),
    }
    started: dict[str, Emulator] = {}
    try:
        for name, (config, args) in specs.items():
            emulator = Emulator(workdir, config, clusters={}, wasm=plugin_wasm(name), vms=1, name=name,
                                args=common + args)
            started[name] = emulator.start(wait_ready=False)
        for emulator in started.values():
            emulator.wait_ready(START_TIMEOUT)
        yield started
    finally:
        for emulator in started.values():
            emulator.stop()


def forwarded(gateway: Emulator) -> dict[str, str]:
    """The request headers the last request went upstream with (it must have been let through)."""
    outcome = gateway.last_outcome()
    assert outcome["kind"] == "continued", outcome
    return {name: value for name, value in outcome["request_headers"]}


# --- Envoy and compat modes refuse them ------------------------------------------------------------------

def test_envoy_mode_refuses_every_go_plugin_of_the_package_for_its_abi() -> None:
    names = go_plugins()
    assert {IP_ACL, SET_HEADER, TRANSFORMER} <= set(names) and len(names) >= 10, names
    for name in names:
        run = wasm_host("--host", "envoy", "--module", str(plugin_wasm(name)))
        assert run.returncode == 1, (name, run.stderr)
        assert ("missing or unknown Proxy-Wasm ABI version: the module exports proxy_abi_version_0_2_100, "
                "which the envoy host does not know") in run.stderr, (name, run.stderr)


def test_the_default_host_refuses_them_naming_the_go_runtimes_wasi_imports() -> None:
    for name in (IP_ACL, SET_HEADER, TRANSFORMER):
        run = wasm_host("--module", str(plugin_wasm(name)))
        assert run.returncode == 1, (name, run.stderr)
        assert "the module imports what this host does not provide" in run.stderr, (name, run.stderr)
        for missing in ("sched_yield", "poll_oneoff", "fd_fdstat_set_flags", "path_filestat_get"):
            assert f"wasi_snapshot_preview1.{missing}" in run.stderr, (name, missing, run.stderr)


def test_envoy_mode_also_lacks_the_redis_calls_of_the_rate_limit_plugin() -> None:
    """gpustack-rate-limit imports Higress's Redis calls: refused by Envoy (ABI first, as Envoy 1.40 checks),
    loaded by Higress up to its configuration (which needs a Redis service, absent here)."""
    wasm = plugin_wasm("gpustack-rate-limit")
    assert b"proxy_redis_init" in wasm.read_bytes()
    run = wasm_host("--host", "envoy", "--module", str(wasm))
    assert run.returncode == 1 and "proxy_abi_version_0_2_100" in run.stderr, run.stderr


# --- gpustack-ip-acl -------------------------------------------------------------------------------------

@pytest.mark.parametrize("consumer, address, status", [
    ("alice", "192.168.1.10", 200),    # inside alice's allowed range
    ("alice", "10.1.2.3", 403),        # outside it
    ("alice", "192.168.1.13", 403),    # denied beats allowed
    ("bob", "203.0.113.5", 403),       # bob's denied range
    ("bob", "198.51.100.1", 200),      # bob has no allow list
    ("gpustack-ci", "10.9.8.7", 200),  # wildcard consumer key, allowed
    ("gpustack-ci", "172.16.0.1", 403),
    ("carol", "203.0.113.5", 200),     # a consumer without a rule is unrestricted
    (None, "203.0.113.5", 200),        # so is a request without a consumer
])
def test_ip_acl_denies_and_allows_per_consumer(gateways: dict[str, Emulator], consumer: str | None,
                                               address: str, status: int) -> None:
    gateway = gateways[IP_ACL]
    headers = {"x-mse-consumer": consumer} if consumer else {}
    response = gateway.send("/v1/chat/completions", headers, source_address=f"{address}:40000")
    assert response.status == status, (consumer, address, response, gateway.log_tail())
    if status == 403:
        assert gateway.last_outcome()["kind"] == "local_reply"
        assert response.headers.get("content-type") == "application/json", response.headers
        assert "message" in json.loads(response.body), response.body
    else:
        assert response.body == "upstream ok\n", response.body


# --- gpustack-set-header-pre-route -----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings?x=1", "/model/proxy/anything"])
def test_set_header_adds_route_and_model_on_model_paths(gateways: dict[str, Emulator], path: str) -> None:
    gateway = gateways[SET_HEADER]
    response = gateway.send(path, method="POST", route_name="ai-route-qwen3")
    assert response.status == 200, response
    headers = forwarded(gateway)
    assert headers.get("x-gpustack-route-name") == "ai-route-qwen3", headers
    assert headers.get("x-gpustack-model") == "qwen3-8b.static", headers


def test_set_header_leaves_other_paths_alone(gateways: dict[str, Emulator]) -> None:
    gateway = gateways[SET_HEADER]
    assert gateway.send("/healthz", route_name="ai-route-qwen3").status == 200
    headers = forwarded(gateway)
    assert "x-gpustack-route-name" not in headers and "x-gpustack-model" not in headers, headers


# --- transformer -----------------------------------------------------------------------------------------

def test_transformer_rewrites_request_headers_and_query(gateways: dict[str, Emulator]) -> None:
    gateway = gateways[TRANSFORMER]
    response = gateway.send("/v1/models?debug=1&keep=2", {"x-remove": "gone", "x-old": "value", "x-other": "o"})
    assert response.status == 200, (response, gateway.log_tail())
    headers = forwarded(gateway)
    assert "x-remove" not in headers and "x-old" not in headers, headers
    assert headers.get("x-new") == "value" and headers.get("x-other") == "o", headers
    assert headers.get("x-added") == "by-transformer", headers
    path, _, query = headers[":path"].partition("?")
    assert path == "/v1/models", headers[":path"]
    assert sorted(query.split("&")) == ["keep=2", "source=gateway"], headers[":path"]


def test_transformer_adds_response_headers(gateways: dict[str, Emulator]) -> None:
    response = gateways[TRANSFORMER].send("/v1/models")
    assert response.headers.get("x-transformed") == "yes", response.headers


def test_plugins_log_through_higress_log_level_and_never_failed(gateways: dict[str, Emulator]) -> None:
    """The Go SDK asks the host's log level (foreign function get_log_level) before every line: with
    Higress's answer it logs its start at info; no VM failed, no request hung."""
    for name, gateway in gateways.items():
        text = gateway.log_text()
        assert f"[{name}]" in text and "plugin start successfully" in text, (name, text[-2000:])
        assert "no such foreign function" not in text, (name, text[-2000:])
        kinds = gateway.outcome_kinds()
        assert set(kinds) <= {"continued", "local_reply"}, (name, kinds)


def test_a_refused_plugin_configuration_is_reported_as_in_higress(tmp_path: Path) -> None:
    """set-header-pre-route refuses a configuration naming neither header (its parseConfig error): Higress's
    Go SDK then fails the plugin's start, and wasm-host exits 2 with the module's log."""
    emulator = Emulator(tmp_path, {}, clusters={}, wasm=plugin_wasm(SET_HEADER), vms=1, name="refused",
                        args=("--host", "higress"))
    try:
        with contextlib.suppress(HarnessError):
            emulator.start(wait_ready=True, timeout=START_TIMEOUT)
        assert emulator.wait_exit(START_TIMEOUT) == 2, emulator.log_text()
        assert "one of the routeNameHeader or clusterNameHeader should be configured" in emulator.log_text()
    finally:
        emulator.stop()
