"""A real Prometheus server (Debian's `prometheus` package, 2.42) on 127.0.0.1 and a free port, scraping
Envoys' `/stats/prometheus` every second and evaluating rule files every second, with its storage in the
test's work directory; stopped by PID (`harness.Process`). Queries go through its HTTP API
(`/api/v1/query`, `/api/v1/alerts`), as Grafana's and Alertmanager's do."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from harness import HOST, HarnessError, Process, free_port, http_request, tail, wait_until

PROMETHEUS_BIN = os.environ.get("PROMETHEUS_BIN", "prometheus")
PROMTOOL_BIN = os.environ.get("PROMTOOL_BIN", "promtool")
INTERVAL = "1s"  # scrape and rule evaluation


class QueryError(AssertionError):
    """Prometheus refused a query (its `errorType` and `error`)."""


class Prometheus:
    """Prometheus scraping the admin ports `targets` (job `envoy`), with `rule_files` loaded."""

    def __init__(self, workdir: Path, targets: list[int], rule_files: list[Path] | None = None):
        self.workdir = workdir / f"prometheus-{free_port()}"
        self.port = free_port()
        self.targets = targets
        self.rule_files = rule_files or []
        self.process: Process | None = None

    def config(self) -> dict:
        return {
            "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL, "scrape_timeout": INTERVAL},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [{
                "job_name": "envoy",
                "metrics_path": "/stats/prometheus",
                "static_configs": [{"targets": [f"{HOST}:{port}" for port in self.targets]}],
            }],
        }

    def start(self, timeout: float = 20.0) -> "Prometheus":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config()))
        argv = [PROMETHEUS_BIN, f"--config.file={config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address={HOST}:{self.port}", "--log.level=warn"]
        self.process = Process("prometheus", argv, self.workdir / "prometheus.out")

        def ready() -> bool:
            if self.process is None or not self.process.alive():
                raise HarnessError(f"prometheus exited\n{tail(self.workdir / 'prometheus.out')}")
            try:
                return http_request(self.port, "/-/ready", timeout=1.0).status == 200
            except OSError:
                return False

        wait_until(ready, timeout, "Prometheus to be ready")
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        response = http_request(self.port, f"{path}?{query}" if query else path, timeout=10.0)
        answer = json.loads(response.body)
        if answer.get("status") != "success":
            raise QueryError(f"{params}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: each series' labels and value (NaN stays NaN); an invalid query raises QueryError."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(series["metric"], float(series["value"][1])) for series in data["result"]]

    def value(self, expr: str) -> float | None:
        """The value of a query that returns one series (None if it returns none)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr}: {result}"
        return result[0][1] if result else None

    def alerts(self) -> list[dict]:
        """The alerts pending or firing now (`/api/v1/alerts`)."""
        return self._get("/api/v1/alerts")["alerts"]

    def scraped_up(self) -> bool:
        """Whether every target was scraped successfully at least once, its last scrape up."""
        result = self.query('up{job="envoy"}')
        return len(result) == len(self.targets) and all(value == 1 for _, value in result)


def promtool_check_rules(path: Path) -> subprocess.CompletedProcess:
    """`promtool check rules <path>`: exit code and output."""
    return subprocess.run([PROMTOOL_BIN, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
