#!/usr/bin/env python3
"""Runs the hostcall probe in real Envoy and prints what it observed (the `probe:` log lines, the responses,
and what the upstream received), so the emulator's facts can be checked against Envoy.

    cargo build --release --target wasm32-wasip1 --manifest-path tests/host/probe/Cargo.toml
    python3 tests/host/probe/run_in_envoy.py [--envoy .venv/bin/envoy] > tests/host/probe/envoy-observed.txt

Everything listens on 127.0.0.1; every process started is stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MODULE = HERE / "target" / "wasm32-wasip1" / "release" / "hostcall_probe.wasm"

REQUESTS = [
    ("GET", "/plain", None),
    ("POST", "/plain-body", b"hello body"),
    ("GET", "/local", None),
    ("GET", "/local-pause", None),
    ("GET", "/callout/upstream/1000", None),
    ("GET", "/callout/upstream/1000/reply", None),
    ("GET", "/callout/refused/1000", None),
    ("GET", "/callout/hang/300", None),
    ("GET", "/callout-bad/no-authority", None),
    ("GET", "/callout-bad/unknown-cluster", None),
    ("GET", "/local-bare", None),
    ("GET", "/local-empty", None),
    ("ABORT", "/callout/hang/3000", None),
    ("GET", "/trap", None),
    ("GET", "/plain-after-trap", None),
]

YAML = """
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress_http
          route_config:
            name: local_route
            virtual_hosts:
            - name: upstream
              domains: ["*"]
              routes:
              - name: probe_route
                match: {{prefix: "/"}}
                route: {{cluster: upstream}}
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: probe-plugin
                root_id: probe_root
                vm_config:
                  vm_id: probe_vm
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: {module}}}}}
                  configuration:
                    "@type": type.googleapis.com/google.protobuf.StringValue
                    value: vm-config
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: {plugin_config}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
{clusters}
"""

CLUSTER = """  - name: {name}
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}
"""

received: list[dict] = []


class Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        received.append({"path": self.path, "headers": [[k.lower(), v] for k, v in self.headers.items()],
                         "body": body.decode("latin-1")})
        payload = b"upstream ok\n"
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("x-upstream", "yes")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:  # noqa: D401
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--envoy", default=str(REPO / ".venv" / "bin" / "envoy"))
    parser.add_argument("--module", default=str(MODULE))
    parser.add_argument("--plugin-config", default="plugin-config")
    args = parser.parse_args()

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(16)  # accepts (the kernel does), never answers
    refused = free_port()
    listen, admin = free_port(), free_port()
    clusters = "".join(CLUSTER.format(name=n, port=p) for n, p in
                       [("upstream", upstream.server_address[1]), ("hang", hang.getsockname()[1]),
                        ("refused", refused)])
    work = Path(tempfile.mkdtemp(prefix="probe-envoy-"))
    (work / "envoy.yaml").write_text(YAML.format(admin=admin, listen=listen, module=json.dumps(args.module),
                                                 plugin_config=json.dumps(args.plugin_config),
                                                 clusters=clusters))
    log_path = work / "envoy.log"
    proc = subprocess.Popen([args.envoy, "-c", str(work / "envoy.yaml"), "--concurrency", "1",
                             "--disable-hot-restart", "--base-id", str(os.getpid() % 100000 * 10 + 7),
                             "--log-level", "info", "--log-path", str(log_path),
                             "--file-flush-interval-msec", "50"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", admin, timeout=1)
                c.request("GET", "/ready")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        time.sleep(0.5)  # the first tick
        if proc.poll() is not None:
            print(f"===== envoy exited with code {proc.returncode} before serving")
        for method, path, body in REQUESTS if proc.poll() is None else []:
            mark = f"===== {method} {path}"
            print(mark)
            if method == "ABORT":
                # The client gives up after 0.5 s while the filter waits for a callout.
                with socket.create_connection(("127.0.0.1", listen), timeout=5) as raw:
                    raw.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nx-user-id: alice\r\n\r\n".encode())
                    time.sleep(0.5)
                print("client closed the connection after 0.5 s")
                time.sleep(3.0)
                continue
            c = http.client.HTTPConnection("127.0.0.1", listen, timeout=5)
            headers = {"x-user-id": "alice"}
            c.request(method, path, body=body, headers=headers)
            r = c.getresponse()
            text = r.read()
            print(f"response {r.status} headers={[(k.lower(), v) for k, v in r.getheaders()]} body={text!r}")
            c.close()
            time.sleep(0.3)
        time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        upstream.shutdown()
        hang.close()
    print("===== upstream received")
    for r in received:
        print(json.dumps(r))
    print("===== envoy log (wasm lines)")
    for line in log_path.read_text(errors="replace").splitlines():
        # "[time][thread][level][wasm] [file:line] wasm log <plugin> <root_id> <vm_id>: message"
        if "][wasm] " in line and "wasm log" in line:
            level = line.split("][")[2]
            print(level, "[thread " + line.split("][")[1] + "]", line.split(": ", 1)[1])
        elif "][wasm] " in line:
            print(line)


if __name__ == "__main__":
    main()
