"""A throw-away OCI registry for the OCI tests: Debian's `docker-registry` (CNCF Distribution 2.8, the
registry implementation behind Docker Hub's API: `docker-registry serve <config.yml>`) on 127.0.0.1, plain
HTTP, no authentication, storage in a temp dir; stopped by PID (harness.Process).

The configuration keys are Distribution's (docs/configuration.md of distribution/distribution 2.8:
`storage.filesystem.rootdirectory`, `http.addr`, `log.level`, `log.accesslog.disabled`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import yaml

import harness

REGISTRY_BIN = os.environ.get("DOCKER_REGISTRY_BIN", "/usr/bin/docker-registry")


class Registry(contextlib.AbstractContextManager):
    """`docker-registry serve` on 127.0.0.1:<free port>; `host` is `127.0.0.1:<port>`, as image references
    name it. Started by `start()` (or entering the context), which waits until `GET /v2/` answers 200."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = harness.free_port()
        self.process: harness.Process | None = None
        self.config_path = workdir / "registry.yml"
        self.log_path = workdir / "registry.log"

    @property
    def host(self) -> str:
        return f"{harness.HOST}:{self.port}"

    def config(self) -> dict:
        return {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.workdir / "registry-data")}},
            "http": {"addr": self.host},
        }

    def start(self, timeout: float = 10.0) -> "Registry":
        self.config_path.write_text(yaml.safe_dump(self.config()))
        self.process = harness.Process("docker-registry", [REGISTRY_BIN, "serve", str(self.config_path)],
                                       self.log_path)

        def answers() -> bool:
            if self.process is None or not self.process.alive():
                raise harness.HarnessError("docker-registry exited")
            return harness.http_request(self.port, "/v2/", timeout=1.0).status == 200

        try:
            harness.wait_until(answers, timeout, "docker-registry to answer GET /v2/")
        except harness.HarnessError as error:
            self.stop()
            raise harness.HarnessError(f"{error}\n--- registry.log (tail) ---\n{harness.tail(self.log_path)}") from None
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def __enter__(self) -> "Registry":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
