"""Fixtures of the end-to-end tests: real redis-server, webdis, upstream and Envoy with the filter.

`stack` gives each test the processes of its module (started once per module by harness.Stack) with an
empty Redis; Envoys a test starts with `stack.envoy(config)` are stopped after it, and their log tails
are printed when it failed.

A scenario that holds in every gateway is written once and runs in each: it takes `start_gateway`, which
starts a `Gateway` of the kind the test is parametrized with (`gateway_kind`, by default every one of
`GATEWAYS`). A test that runs in some gateways only lists them, saying why:

    # The emulator only: it counts each request's Redis calls.
    @pytest.mark.parametrize("gateway_kind", ["emulator-envoy", "emulator-higress"])
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, NamedTuple

import pytest

import harness
from timing import EmulatorClock, GatewayClock, RealClock


# The modules whose tests measure no time: no deadline, no latency, no window that must be filled under load,
# no clock margin (each asserts what was answered, written or refused, and exactness's upper bounds only where
# Redis decides alone). `make test` runs them two at a time (pytest-xdist, `-n 2 --dist loadfile -m
# side_by_side`: 73 s one after the other, 47 s side by side on 2 cores), then every other module one at a
# time: a test that measures time shares the machine with nothing (one run of the whole suite two at a time
# lost `test_coalescing.py`'s whole windows, 114 of a rate of 150 where it wants 90%).
SIDE_BY_SIDE = frozenset({
    "test_admin.py", "test_admin_cluster.py", "test_admin_explain.py", "test_call_tokens.py", "test_config.py",
    "test_fidelity.py", "test_harness.py", "test_higress_plugins.py", "test_llm_sdks.py", "test_match_rules.py",
    "test_oci.py", "test_operator_options.py", "test_prometheus.py", "test_rate_changes.py", "test_redis_layout.py",
    "test_remote_fetch.py", "test_security.py", "test_semaphore_interop.py",
})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "side_by_side: a test that measures no time (conftest.SIDE_BY_SIDE): make "
                                       "test runs these two at a time")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SIDE_BY_SIDE:
            item.add_marker(pytest.mark.side_by_side)


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


# ---------------------------------------------------------------------------------------------------------
# Gateways: one scenario, every gateway


class GatewayKind(NamedTuple):
    """Where the filter runs: stock Envoy or the host emulator, which build, which Redis transport."""

    emulated: bool  # the project's host emulator (harness.Emulator), else stock Envoy (harness.Envoy)
    build: str  # the module (harness.BUILDS)
    config: Callable[..., dict]  # the plugin configuration for its Redis transport


GATEWAYS = {
    # Stock Envoy, 2 workers (a wasm VM each), with the stock build: Redis through webdis (HTTP calls).
    "envoy": GatewayKind(False, "envoy", harness.plugin_config),
    # The host emulator, 2 VMs, with the stock build: also through webdis.
    "emulator-envoy": GatewayKind(True, "envoy", harness.plugin_config),
    # The host emulator, 2 VMs, with the Higress build: the host's Redis client (transport "host").
    "emulator-higress": GatewayKind(True, "higress", harness.host_plugin_config),
}


class Gateway:
    """A gateway running the filter, driven alike whichever kind it is (`GATEWAYS`). Requests go on fresh
    connections; in the emulator, requests without a VM of their own go to its VMs in turn."""

    def __init__(self, kind: str, process: harness.Envoy | harness.Emulator, stack: harness.Stack):
        self.kind = kind
        self.process = process
        self.emulated = GATEWAYS[kind].emulated
        self._stack = stack
        self._clock: GatewayClock | None = None
        self._sent = 0  # requests sent through this object (Envoy's count of `sent()`), under the lock
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.process.name

    def config(self, *rules: dict, **fields: Any) -> dict:
        """A plugin configuration of these rules and top-level fields for this gateway's Redis transport."""
        return GATEWAYS[self.kind].config(*rules, **fields)

    def send(self, path: str = "/", headers: dict[str, str] | None = None) -> harness.Response:
        self._count(1)
        return self.process.send(path, headers)

    def burst(self, headers: dict[str, str], n: int) -> list[harness.Response]:
        """`n` requests in flight together: each on its own connection in Envoy, one batch in the emulator."""
        self._count(n)
        if isinstance(self.process, harness.Emulator):
            return self.process.send_batch([{"headers": headers}] * n)
        with ThreadPoolExecutor(max_workers=n) as pool:
            return list(pool.map(lambda _: self.process.send(headers=headers), range(n)))

    def on_every_vm(self, headers: dict[str, str], each: int = 1, most: int = 400) -> list[harness.Response]:
        """Requests until every VM has answered at least `each`: in the emulator its VMs in turn; in Envoy,
        fresh connections until each worker (one VM each) has accepted `each` more (HarnessError after
        `most` requests)."""
        if isinstance(self.process, harness.Emulator):
            vms = range(self.process.vms)
            self._count(each * len(vms))
            return [self.process.send(headers=headers, vm=vm) for _ in range(each) for vm in vms]
        envoy, responses = self.process, []
        before = envoy.worker_connections()
        while min(now - then for now, then in zip(envoy.worker_connections(), before)) < each:
            if len(responses) >= most:
                raise harness.HarnessError(f"{most} connections did not reach every worker: "
                                           f"{envoy.worker_connections()}")
            responses.append(envoy.send(headers=headers))
            self._count(1)
        return responses

    def metrics(self) -> dict[str, int]:
        """The filter's counters by short name ("allowed", "redis_calls", ...)."""
        return self.process.metrics()

    def let_run(self, ms: int = 20) -> None:
        """Lets the gateway work for `ms` between a test's reads: the emulator runs its event loop (late
        replies, such as give-backs' and their NOSCRIPT retries, and ticks) only when asked; Envoy's always
        runs."""
        if isinstance(self.process, harness.Emulator):
            self.process.run_for(ms)

    def wait_for_metrics(self, check: Callable[[dict[str, int]], bool], what: str,
                         timeout: float = 2.0) -> dict[str, int]:
        """Reads the counters until `check(counters)` holds, and returns them; the emulator's event loop runs
        between the reads (it delivers late replies, such as give-backs', only while it runs)."""
        def checked() -> dict[str, int] | None:
            self.let_run()
            metrics = self.process.metrics()
            return metrics if check(metrics) else None
        return harness.wait_until(checked, timeout, f"{self.name}: {what}")

    def reconfigure(self, *rules: dict, **fields: Any) -> None:
        """A new plugin configuration for the running gateway, as a control plane's update: the same
        process and VMs (an Envoy must have been started with `reloadable=True`)."""
        self.process.reconfigure(self.config(*rules, **fields))

    def sent(self) -> int:
        """How many requests the gateway has answered so far: a mark for `round_trips_since()`."""
        return len(self.process.outcomes) if isinstance(self.process, harness.Emulator) else self._sent

    def _count(self, n: int) -> None:
        with self._lock:
            self._sent += n

    # What only the emulator can tell: which request made which Redis calls.

    def round_trips_since(self, mark: int) -> list[int]:
        """The Redis calls (HTTP calls to webdis, or the host's Redis calls) of each request since `mark`."""
        return [harness.round_trips(outcome) for outcome in self._emulator("counts calls").outcomes[mark:]]

    def last_round_trips(self) -> int:
        """The Redis calls of the last request."""
        return harness.round_trips(self._emulator("counts calls").last_outcome())

    def _emulator(self, what: str) -> harness.Emulator:
        if not isinstance(self.process, harness.Emulator):
            raise harness.HarnessError(f"only the emulator {what} per request, not {self.kind}")
        return self.process

    @property
    def clock(self) -> GatewayClock:
        """The clock the filter stamps permits with: the emulator's can be moved, Envoy's only waited for."""
        if self._clock is None:
            emulator = isinstance(self.process, harness.Emulator)
            self._clock = EmulatorClock(self.process) if emulator else RealClock()
        return self._clock

    def upstream_hits(self) -> int:
        """Requests that reached the upstream: the stack's upstream for Envoy (one Envoy per test), the
        requests the emulator let through (it answers for the upstream)."""
        if isinstance(self.process, harness.Emulator):
            return self.process.outcome_kinds().get("continued", 0)
        return self._stack.upstream.hits


@pytest.fixture(params=list(GATEWAYS))
def gateway_kind(request: pytest.FixtureRequest) -> str:
    """The kind of gateway `start_gateway` starts: every one of `GATEWAYS`, unless the test lists some."""
    return request.param


@pytest.fixture
def start_gateway(gateway_kind: str, stack: harness.Stack) -> Iterator[Callable[..., Gateway]]:
    """`start_gateway(*rules, reloadable=False, **fields)`: a new gateway of the test's kind running the
    filter with these rules and top-level fields; `reloadable`: an Envoy that can take `reconfigure()` (an
    emulator always can). Stopped after the test with the stack's Envoys (their logs printed if it failed).
    Every request an emulator got must have ended continued or answered: none left paused, reset or on a
    failed VM."""
    kind = GATEWAYS[gateway_kind]
    started: list[Gateway] = []

    def start(*rules: dict, reloadable: bool = False, **fields: Any) -> Gateway:
        config = kind.config(*rules, **fields)
        if kind.emulated:
            process: harness.Envoy | harness.Emulator = stack.emulator(config, build=kind.build, vms=2)
        else:
            process = stack.envoy(config, concurrency=2, reloadable=reloadable)
        started.append(Gateway(gateway_kind, process, stack))
        return started[-1]

    yield start
    for gateway in started:
        if isinstance(gateway.process, harness.Emulator):
            kinds = set(gateway.process.outcome_kinds())
            assert kinds <= {"continued", "local_reply"}, f"{gateway.name}: requests ended {kinds}"
