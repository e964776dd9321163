"""Fixtures of the end-to-end tests: real redis-server, webdis, upstream and Envoy with the filter.

`stack` gives each test the processes of its module (started once per module by harness.Stack) with an
empty Redis; Envoys a test starts with `stack.envoy(config)` are stopped after it, and their log tails
are printed when it failed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

import harness


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture(scope="module")
def processes() -> Iterator[harness.Stack]:
    with harness.Stack() as stack:
        stack.start()
        yield stack


@pytest.fixture
def stack(processes: harness.Stack, request: pytest.FixtureRequest) -> Iterator[harness.Stack]:
    # A previous test may have stopped or paused Redis.
    processes.redis.start()
    processes.webdis.start()
    processes.redis.unpause()
    processes.redis.client.flushall()
    with gateways_stopped(processes, request):
        yield processes


@contextlib.contextmanager
def gateways_stopped(stack: harness.Stack, request: pytest.FixtureRequest) -> Iterator[None]:
    """Stops the test's gateways when it ends; when it failed, prints their log excerpts first."""
    try:
        yield
    finally:
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            for gateway in stack.envoys:
                print(f"--- {gateway.name} log (excerpt) ---\n{gateway.log_excerpt()}")
        stack.stop_envoys()
