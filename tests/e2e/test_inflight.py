"""In-flight rules (`max_in_flight`; docs/configuration.md, "In-flight limits") in real Envoy: each request
holds a permit of a semaphore in Redisson's `RPermitExpirableSemaphore` layout until its response ends; over
the limit, 429 with the rule's name and `Retry-After`; the permits come back when responses end, when the
upstream resets them, and, for a gateway killed with SIGKILL, when their lease ends. Java's Redisson shares
the semaphore."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

import harness as h
import llm_upstream as llm

USER = "alice"
SEMAPHORE = h.limiter_name("erl:inflight", USER)
TAKEN = "{" + SEMAPHORE + "}:timeout"
ACCESS_FORMAT = {"status": "%RESPONSE_CODE%", "start": "%START_TIME(%s%3f)%", "duration": "%DURATION%",
                 "by": "%RESP(X-RATELIMITED-BY)%"}


def inflight_rule(limit: int, lease: str = "3s", **fields: Any) -> dict:
    return {"name": "inflight", "limit_by": {"header": "x-user-id"}, "max_in_flight": limit, "lease": lease,
            **fields}


@pytest.fixture(scope="module")
def upstream() -> Iterator[llm.LlmUpstream]:
    with llm.LlmUpstream() as server:
        yield server


def gateway(stack: h.Stack, upstream: llm.LlmUpstream, *rules: dict, **fields: Any) -> tuple[h.Envoy, Path]:
    """An Envoy (2 workers) in front of the LLM upstream, logging each request's start, duration and status."""
    stack._count += 1
    name = f"envoy-{stack._count}"
    envoy = h.Envoy(stack.workdir, h.plugin_config(*rules, **fields), webdis_port=stack.webdis.port,
                    upstream_port=upstream.port, name=name)
    bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
    [listener] = bootstrap["static_resources"]["listeners"]
    access_log = stack.workdir / f"{name}-access.log"
    listener["filter_chains"][0]["filters"][0]["typed_config"]["access_log"] = [{
        "name": "envoy.access_loggers.file",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                         "path": str(access_log), "log_format": {"json_format": ACCESS_FORMAT}},
    }]
    envoy.yaml_path.write_text(json.dumps(bootstrap))
    stack.envoys.append(envoy)
    envoy.start()
    return envoy, access_log


def slow(delay_ms: int, events: int = 4, **extra: str) -> dict[str, str]:
    """Headers of a request whose answer takes about `events - 1` x `delay_ms` (the upstream streams it)."""
    return {"x-user-id": USER, **llm.headers("openai-sse", events=events, delay_ms=delay_ms), **extra}


def free_permits(stack: h.Stack) -> tuple[int | None, int]:
    """The semaphore's free permits and the permits held (members of `{name}:timeout`)."""
    raw = stack.redis.client.get(SEMAPHORE)
    return (None if raw is None else int(raw)), stack.redis.client.zcard(TAKEN)


def test_over_the_limit_a_request_gets_429_and_the_permits_come_back_when_responses_end(stack, upstream):
    """Limit 2: of 5 requests sent together, each answered over about 0.6 s, 2 go through and 3 get 429 at
    once, with `x-ratelimited-by: inflight` and `Retry-After: 1`; while the 2 run, Redis holds 2 permits and
    0 free; once they ended, the permits are back (2 free, none held) and a new request goes through."""
    envoy, _ = gateway(stack, upstream, inflight_rule(2))
    with ThreadPoolExecutor(max_workers=5) as pool:
        futures = [pool.submit(envoy.send, "/v1/chat/completions", slow(200)) for _ in range(5)]
        time.sleep(0.3)
        during = free_permits(stack)
        answers = [future.result() for future in futures]
    statuses = sorted(answer.status for answer in answers)
    assert statuses == [200, 200, 429, 429, 429], statuses
    rejected = [answer for answer in answers if answer.status == 429]
    assert all(answer.headers.get("x-ratelimited-by") == "inflight" for answer in rejected), rejected
    assert all(answer.headers.get("retry-after") == "1" for answer in rejected), rejected
    assert during == (0, 2), f"while two run: (free, held) {during}"
    h.wait_until(lambda: free_permits(stack) == (2, 0), 2.0, "the permits back")
    assert envoy.send("/v1/chat/completions", slow(0, events=1)).status == 200
    metrics = envoy.metrics()
    assert (metrics.get("inflight_admitted"), metrics.get("inflight_rejected")) == (3, 3), metrics
