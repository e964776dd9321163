"""Faults between the gateway and Redis, injected for real under load and measured: the scenarios that
tests/e2e/test_faults.py asserts and `make bench` section 8 (bench/reliability_bench.py) prints.

Deployments (`FaultStack`): a `faultproxy.FaultProxyProcess` sits in front of redis-server, and everything
reaches Redis through it:

    stock build (real Envoy):       gateway --HTTP--> webdis --RESP--> fault proxy --> redis-server
    Higress build (host emulator):  gateway's `redis` cluster --------> fault proxy --> redis-server

Each build runs two gateways at once (`Rig`), one failing open (`failure_mode: allow`) and one failing closed
(`deny`, `failure_status` FAILURE_STATUS), with `redis.timeout` TIMEOUT_MS and one per-user rule with the
local block off, so every decision needs Redis. A `Load` keeps requests running on both while a `Fault` is
injected, held for a while and healed (`run_case`); every request is recorded (`Decision`) with its kind:

- `allowed` (200 carrying the `RateLimit` header), `rejected` (429): decided by Redis;
- `failure_allowed` (200 without it, fail open), `failure_denied` (FAILURE_STATUS, fail closed);
- `odd`: any other answer (a failure answer of the other mode, another status), `error`: none at all (a reset
  or refused connection, a client timeout; in the emulator a request left paused, reset or a VM that failed).

`GatewayRun.checks()` says what held, for each gateway: every request answered, and decided within
TIMEOUT_MS + MARGIN_MS (`Decision.wait_ms`: until the upstream got it, or the answer came), the failure
mode held (and the fault was felt: some failure answers, or none for faults that
must not fail a decision), no trap in the VM, the first decision by Redis within RECOVERY_MS of Redis being
healthy again, and the filter's counters account for every request sent (allowed + rejected +
failure_allowed + failure_denied == requests, and each counter == the answers of its kind).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import harness
from faultproxy import FaultProxyProcess

TIMEOUT_MS = 200
MARGIN_MS = 50
BOUND_MS = TIMEOUT_MS + MARGIN_MS
RECOVERY_MS = 1000
FAILURE_STATUS = 599  # no Envoy, webdis or upstream answer carries it: a failure answer is the filter's
RATE = 5  # per user per second: the load sees both allowed and rejected decisions
BUILDS = ("envoy", "higress")
FAILURE_MODES = ("allow", "deny")
COUNTERS = ("allowed", "rejected", "failure_allowed", "failure_denied")
REQUEST_TAG = "x-erl-request"  # names each request of the load, so the upstream can say when it arrived
# What a trap, a panic or a failed VM leaves in Envoy's log (V8) or in the emulator's log.
TRAP = re.compile(r"Uncaught|RuntimeError|panicked|wasm trap|trap:|VM failed|vm_failed|Function: \S+ failed",
                  re.IGNORECASE)


def now_ms() -> float:
    return time.monotonic() * 1000.0


# ---------------------------------------------------------------------------------------------------------
# The deployment


class NoDelayUpstream(harness.Upstream):
    """`harness.Upstream` answering without Nagle's delay, and noting when each request tagged `x-erl-request`
    arrived (`arrivals`, monotonic ms): when the filter let it through.

    The harness's handler writes the headers and the body in two sends, and Envoy's delayed ACK of the first
    holds the second 40 ms (measured: 44 ms median per request through Envoy, 4 ms without)."""

    def __init__(self) -> None:
        super().__init__()
        arrivals: dict[str, float] = {}

        def do_get(handler: Any) -> None:
            tag = handler.headers.get(REQUEST_TAG)
            if tag:
                arrivals[tag] = now_ms()
            base.do_GET(handler)

        base = self.server.RequestHandlerClass
        self.server.RequestHandlerClass = type("NoDelayHandler", (base,),
                                               {"disable_nagle_algorithm": True, "do_GET": do_get})
        self.arrivals = arrivals


class FaultStack(harness.Stack):
    """`harness.Stack` with a fault proxy between Redis and whatever talks to it: webdis (stock build) and the
    emulator's `redis` cluster (Higress build). webdis sends no password, as the gateways' configuration has
    none (the wrong-password fault turns `requirepass` on under them)."""

    def __init__(self, workdir: Path | None = None):
        super().__init__(workdir=workdir)
        self.upstream.stop()  # not started: closes its socket
        self.upstream = NoDelayUpstream()
        self.proxy = FaultProxyProcess(self.workdir, self.redis)
        self.webdis = harness.Webdis(self.workdir, self.proxy)  # type: ignore[arg-type]

    def start(self) -> "FaultStack":
        self.proxy.start()  # forwards to Redis's port, up or not yet
        return super().start()

    def emulator(self, plugin: dict | str, **kwargs: Any) -> harness.Emulator:
        """As `Stack.emulator`; the Higress build's `redis` cluster is the fault proxy by default."""
        kwargs.setdefault("clusters", {"redis": self.proxy.port})
        return super().emulator(plugin, **kwargs)

    def heal_all(self) -> None:
        """Undoes every fault: the proxy passes, Redis runs, unpaused, without a memory limit or password."""
        self.proxy.set_mode("pass")
        if not self.redis.running:
            self.redis.start()
        if self.redis.password:
            self.redis.require_password(None)
        self.redis.unpause()
        self.redis.client.config_set("maxmemory", 0)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.proxy.stop()


def gateway_config(build: str, failure_mode: str) -> dict:
    limit = harness.rule("per-user", rate=RATE, interval="1s", local_block_max=0)
    make = harness.plugin_config if build == "envoy" else harness.host_plugin_config
    return make(limit, timeout=f"{TIMEOUT_MS}ms", failure_mode=failure_mode, failure_status=FAILURE_STATUS)


@dataclass
class Gateway:
    """One gateway of a rig: the build's module in Envoy (stock) or in the emulator (Higress)."""

    build: str
    failure_mode: str
    target: Any  # harness.Envoy | harness.Emulator
    seen_log: set[str] = field(default_factory=set)

    @property
    def label(self) -> str:
        return f"{'stock' if self.build == 'envoy' else 'Higress'}/{self.failure_mode}"

    def metrics(self) -> dict[str, int]:
        return self.target.metrics()

    def classify(self, status: int | None, headers: dict[str, str]) -> str:
        if status == 200:
            if "ratelimit" in headers:
                return "allowed"
            return "failure_allowed" if self.failure_mode == "allow" else "odd"
        if status == 429:
            return "rejected"
        if status == FAILURE_STATUS and self.failure_mode == "deny":
            return "failure_denied"
        return "odd"

    def new_trap_lines(self) -> list[str]:
        """Log lines that tell of a trap, a panic or a failed VM, not seen by an earlier call."""
        lines = [line for line in self.target.log_text().splitlines() if TRAP.search(line)]
        fresh = [line[:300] for line in lines if line not in self.seen_log]
        self.seen_log.update(lines)
        return fresh

    def send_one(self, user: str) -> str:
        """One request outside the load (settling): its kind."""
        if self.build == "envoy":
            response = self.target.send(headers={"x-user-id": user}, timeout=5.0)
            return self.classify(response.status, response.headers)
        result = self.target._call({"headers": request_headers(user)}, timeout=10.0)
        return self.classify_outcome(result)

    def classify_outcome(self, result: dict) -> str:
        if result.get("kind") not in ("continued", "local_reply") or result.get("status") is None:
            return "error"
        headers = {name.lower(): value for name, value in result.get("headers", []) if not name.startswith(":")}
        return self.classify(int(result["status"]), headers)


def request_headers(user: str) -> list[list[str]]:
    return [[":path", "/"], [":method", "GET"], ["x-user-id", user]]


class Rig:
    """Both gateways of one build on a `FaultStack`, started once and kept (module scope)."""

    def __init__(self, stack: FaultStack, build: str, envoy_concurrency: int = 2, vms: int = 2):
        self.stack = stack
        self.build = build
        self.envoy_concurrency = envoy_concurrency
        self.vms = vms
        self.gateways: list[Gateway] = []

    def start(self) -> "Rig":
        try:
            for mode in FAILURE_MODES:
                config = gateway_config(self.build, mode)
                if self.build == "envoy":
                    target = self.stack.envoy(config, concurrency=self.envoy_concurrency)
                else:
                    # A request the filter never resumes ends as `paused` after 2 s, well past the bound.
                    target = self.stack.emulator(config, build="higress", vms=self.vms, keep=True,
                                                 wait_ready=False, pause_deadline_ms=2000)
                self.gateways.append(Gateway(self.build, mode, target))
            for gateway in self.gateways:
                if self.build != "envoy":
                    gateway.target.wait_ready()
                gateway.new_trap_lines()  # start-up lines are not a fault's
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.target.stop()
            for kept in (self.stack.envoys, self.stack.kept):
                if gateway.target in kept:
                    kept.remove(gateway.target)
        self.gateways.clear()

    def settle(self, tag: str, timeout: float = 15.0) -> None:
        """Heals every fault and waits until each gateway decides by Redis again (webdis may need a moment to
        reconnect its pool); HarnessError if one does not within `timeout`."""
        self.stack.heal_all()
        for gateway in self.gateways:
            users = iter(range(1_000_000))
            harness.wait_until(lambda g=gateway: all(g.send_one(f"{tag}-settle-{next(users)}") == "allowed"
                                                     for _ in range(3)),
                               timeout, f"{gateway.label} to decide by Redis again", interval=0.1)


# ---------------------------------------------------------------------------------------------------------
# Load


@dataclass
class Decision:
    """One request: sent and answered (monotonic ms), its status and kind (see the module docs), and when the
    upstream got it (`passed_ms`: Envoy, a request the filter let through)."""

    start_ms: float
    end_ms: float
    status: int | None
    kind: str
    detail: str = ""
    passed_ms: float | None = None

    @property
    def latency_ms(self) -> float:
        """As the client saw it, upstream included."""
        return self.end_ms - self.start_ms

    @property
    def wait_ms(self) -> float:
        """How long the gateway held the request before its decision: until the upstream got it (Envoy, let
        through), else until the client had the answer (a local reply; the emulator answers for the
        upstream at once)."""
        return (self.passed_ms if self.passed_ms is not None else self.end_ms) - self.start_ms


@dataclass(frozen=True)
class LoadProfile:
    """How hard the load pushes: `clients` threads per Envoy (one request at a time each, on a fresh
    connection), one thread per emulator sending 2 x `users` requests at once (a batch, VMs taking turns);
    each client waits at least `pace_ms` between the starts of its requests (batches). Requests alternate
    between `users` hot users (over their rate: mostly rejected, a decision Redis makes without writing) and
    users never seen before (allowed: Redis creates their limiter, so every fault that stops writes shows)."""

    users: int = 4
    clients: int = 2
    pace_ms: float = 8.0


class Load:
    """Requests to every gateway of a rig, from threads, until `stop()`; `decisions[label]` as they come."""

    def __init__(self, rig: Rig, tag: str, profile: LoadProfile):
        self.rig = rig
        self.profile = profile
        self.users = {g.label: [f"{tag}-{g.failure_mode}-u{i}" for i in range(profile.users)] for g in rig.gateways}
        self.decisions: dict[str, list[Decision]] = {g.label: [] for g in rig.gateways}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.crashes: list[str] = []
        self.arrivals: dict[str, float] = getattr(rig.stack.upstream, "arrivals", {})

    def start(self) -> "Load":
        for gateway in self.rig.gateways:
            if gateway.build == "envoy":
                for index in range(self.profile.clients):
                    self._spawn(self._envoy_client, gateway, index)
            else:
                self._spawn(self._emulator_client, gateway, 0)
        return self

    def _spawn(self, target: Callable[[Gateway, int], None], gateway: Gateway, index: int) -> None:
        def run() -> None:
            try:
                target(gateway, index)
            except BaseException as error:  # noqa: BLE001 - reported by stop()
                self.crashes.append(f"{gateway.label} client {index}: {error!r}")

        thread = threading.Thread(target=run, name=f"load-{gateway.label}-{index}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _pace(self, started_ms: float) -> None:
        rest = self.profile.pace_ms - (now_ms() - started_ms)
        if rest > 0:
            self._stop.wait(rest / 1000.0)

    def _envoy_client(self, gateway: Gateway, index: int) -> None:
        hot = self.users[gateway.label]
        out = self.decisions[gateway.label]
        turn = 0
        while not self._stop.is_set():
            user = hot[(turn // 2 + index) % len(hot)] if turn % 2 == 0 else self._cold(gateway, index, turn)
            turn += 1
            tag = f"{gateway.label}-{index}-{turn}"
            start = now_ms()
            try:
                response = harness.http_request(gateway.target.port, headers={"x-user-id": user, REQUEST_TAG: tag},
                                                timeout=5.0)
            except OSError as error:
                out.append(Decision(start, now_ms(), None, "error", repr(error)))
            else:
                kind = gateway.classify(response.status, response.headers)
                out.append(Decision(start, now_ms(), response.status, kind,
                                    "" if kind != "odd" else f"{response.status} {response.body[:80]!r}",
                                    self.arrivals.pop(tag, None)))
            self._pace(start)

    def _cold(self, gateway: Gateway, client: int, turn: int) -> str:
        """A user never seen before: its limiter is created by this request (Redis must write)."""
        return f"{self.users[gateway.label][0].rsplit('-u', 1)[0]}-c{client}-{turn}"

    def _emulator_client(self, gateway: Gateway, index: int) -> None:
        hot = self.users[gateway.label]
        out = self.decisions[gateway.label]
        turn = 0
        while not self._stop.is_set():
            users = hot + [self._cold(gateway, index, turn + i) for i in range(len(hot))]
            turn += len(hot)
            batch = {"batch": [{"headers": request_headers(user)} for user in users]}
            start = now_ms()
            # The raw results (harness.Emulator.send_batch raises on the first request left paused).
            results = gateway.target._call(batch, timeout=30.0)["batch"]
            for result in results:
                kind = gateway.classify_outcome(result)
                elapsed = float(result.get("elapsed_ms") or (now_ms() - start))
                detail = "" if kind in ("allowed", "rejected", "failure_allowed", "failure_denied") else \
                    f"{result.get('kind')} {result.get('status')} {str(result.get('message', ''))[:120]}"
                out.append(Decision(start, start + elapsed, result.get("status"), kind, detail))
            self._pace(start)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise harness.HarnessError(f"load threads still running after {timeout} s: {alive}")


# ---------------------------------------------------------------------------------------------------------
# Faults


@dataclass(frozen=True)
class Fault:
    """A fault: `inject` starts it, `heal` ends it (Redis is healthy again when `heal` returns). `fails`: the
    decisions that need Redis fail while it lasts (else none may); `repeat_ms`: `inject` runs again that often
    while the fault lasts."""

    name: str
    what: str
    inject: Callable[[FaultStack], None]
    heal: Callable[[FaultStack], None]
    fails: bool = True
    repeat_ms: float | None = None


def _proxy(mode: str, latency_ms: int = 0) -> Callable[[FaultStack], None]:
    return lambda stack: stack.proxy.set_mode(mode, latency_ms)


def _pass(stack: FaultStack) -> None:
    stack.proxy.set_mode("pass")


def _nothing(stack: FaultStack) -> None:
    pass


def _oom(stack: FaultStack) -> None:
    stack.redis.client.config_set("maxmemory-policy", "noeviction")
    stack.redis.client.config_set("maxmemory", 1)  # below what Redis uses: every write is refused (-OOM)


def _no_memory_limit(stack: FaultStack) -> None:
    stack.redis.client.config_set("maxmemory", 0)


def _wrong_password(stack: FaultStack) -> None:
    stack.redis.require_password("fault-secret")  # the gateways (and webdis) have none
    stack.redis.kill_clients()  # so that their connections authenticate again, and cannot


SLOW_MS, TOO_SLOW_MS = 60, 150

FAULTS = [
    Fault("latency-60ms", f"proxy adds {SLOW_MS} ms each way ({2 * SLOW_MS} ms a round trip, below the timeout)",
          _proxy("latency", SLOW_MS), _pass, fails=False),
    Fault("latency-150ms", f"proxy adds {TOO_SLOW_MS} ms each way ({2 * TOO_SLOW_MS} ms, past the timeout)",
          _proxy("latency", TOO_SLOW_MS), _pass),
    Fault("reset", "proxy resets (RST) open and new connections", _proxy("reset"), _pass),
    Fault("blackhole", "proxy accepts and reads, answers nothing (delivered when it heals)",
          _proxy("blackhole"), _pass),
    Fault("half-close", "proxy shuts its write side towards the client (FIN)", _proxy("half_close"), _pass),
    Fault("drop", "proxy closes (FIN) open and new connections", _proxy("drop"), _pass),
    Fault("redis-restart", "redis-server stopped, then started again (empty, same port)",
          lambda stack: stack.redis.stop(), lambda stack: stack.redis.start()),
    Fault("pause", "CLIENT PAUSE WRITE: scripts wait", lambda stack: stack.redis.pause(60_000, "WRITE"),
          lambda stack: stack.redis.unpause()),
    Fault("oom", "maxmemory 1 byte, noeviction: scripts that write get -OOM", _oom, _no_memory_limit),
    Fault("wrong-password", "requirepass set and clients killed: -NOAUTH", _wrong_password,
          lambda stack: stack.redis.require_password(None)),
    Fault("script-flush", "SCRIPT FLUSH every 100 ms: -NOSCRIPT, scripts sent again",
          lambda stack: stack.redis.client.script_flush(), _nothing, fails=False, repeat_ms=100),
]
NO_FAULT = Fault("none", "no fault (baseline)", _nothing, _nothing, fails=False)
FAULTS_BY_NAME = {fault.name: fault for fault in FAULTS}


# ---------------------------------------------------------------------------------------------------------
# A run and what held


@dataclass(frozen=True)
class Timing:
    """Seconds of load before the fault (`warmup_s`), of the fault, and after Redis is healthy again."""

    warmup_s: float = 0.3
    # Two and a half timeouts (200 ms): requests sent during the fault reach the failure mode.
    fault_s: float = 0.5
    # The recovery must show within 1 s (RECOVERY_MS) of the heal.
    after_s: float = 1.2


@dataclass
class GatewayRun:
    """What one gateway answered during one case, and its counters around it."""

    gateway: Gateway
    fault: Fault
    decisions: list[Decision]
    before: dict[str, int]
    after: dict[str, int]
    trap_lines: list[str]
    injected_ms: float
    healed_ms: float

    def kinds(self) -> Counter:
        return Counter(d.kind for d in self.decisions)

    @property
    def failure_kind(self) -> str:
        return f"failure_{'allowed' if self.gateway.failure_mode == 'allow' else 'denied'}"

    def worst_ms(self) -> float:
        """The longest wait for a decision."""
        return max((d.wait_ms for d in self.decisions), default=0.0)

    def slowest(self) -> Decision | None:
        return max(self.decisions, key=lambda d: d.wait_ms, default=None)

    def failures(self) -> list[Decision]:
        return [d for d in self.decisions if d.kind == self.failure_kind]

    def recovery_ms(self) -> float | None:
        """From Redis healthy again to the end of the first request Redis decided among those sent after it
        and after every failure answer to a request sent after it (None: none such)."""
        late_failures = [d.start_ms for d in self.failures() if d.start_ms >= self.healed_ms]
        since = max(late_failures, default=self.healed_ms)
        decided = [d.end_ms for d in self.decisions if d.start_ms > since and d.kind in ("allowed", "rejected")]
        return min(decided) - self.healed_ms if decided else None

    def last_failure_ms(self) -> float | None:
        """From Redis healthy again to the end of the last failure answer (None: none after it)."""
        late = [d.end_ms for d in self.failures() if d.end_ms >= self.healed_ms]
        return max(late) - self.healed_ms if late else None

    def counted(self) -> dict[str, int | None]:
        """The counters' increase over the case (None: the filter has no such counter)."""
        return {name: (self.after[name] - self.before.get(name, 0)) if name in self.after else None
                for name in COUNTERS}

    def checks(self) -> dict[str, str | None]:
        """Each property of the case: None if it held, else what happened."""
        kinds = self.kinds()
        sent = len(self.decisions)

        def examples(kind: str) -> str:
            found = [d for d in self.decisions if d.kind == kind][:3]
            return "; ".join(f"{d.detail or d.status} after {d.wait_ms:.0f} ms "
                             f"(sent {d.start_ms - self.injected_ms:+.0f} ms from the fault)" for d in found)

        checks: dict[str, str | None] = {}
        checks["answered"] = (f"{kinds['error']} of {sent} requests got no answer: {examples('error')}"
                              if kinds["error"] else None)
        if sent == 0:
            checks["answered"] = "the load sent no request"
        slowest = self.slowest()
        checks["latency"] = None if slowest is None or slowest.wait_ms <= BOUND_MS else (
            f"a request waited {slowest.wait_ms:.0f} ms for its decision > {BOUND_MS} ms (timeout {TIMEOUT_MS} + "
            f"{MARGIN_MS}; {slowest.latency_ms:.0f} ms at the client); "
            f"it was sent {slowest.start_ms - self.injected_ms:+.0f} ms from the fault, healed at "
            f"{self.healed_ms - self.injected_ms:+.0f} ms, answered {slowest.kind} ({slowest.status})")
        failures = kinds[self.failure_kind]
        mode: str | None = None
        if kinds["odd"]:
            mode = f"{kinds['odd']} answers neither a decision nor the {self.gateway.failure_mode} failure " \
                   f"answer: {examples('odd')}"
        elif self.fault.fails and not failures:
            mode = f"no {self.failure_kind} answer: the fault was not felt"
        elif not self.fault.fails and failures:
            mode = f"{failures} {self.failure_kind} answers where no decision may fail: {examples(self.failure_kind)}"
        checks["failure mode"] = mode
        checks["no trap"] = ("; ".join(self.trap_lines[:3]) if self.trap_lines else None)
        recovery = self.recovery_ms()
        checks["recovery"] = ("no request sent after Redis was healthy again (and after its last failure) was "
                              "decided by Redis"
                              if recovery is None else
                              f"decisions by Redis only {recovery:.0f} ms after Redis was healthy again > "
                              f"{RECOVERY_MS} ms" if recovery > RECOVERY_MS else None)
        counted = self.counted()
        missing = [name for name, value in counted.items() if value is None]
        if missing:
            checks["counters"] = f"no counter {', '.join(missing)} for this gateway"
        else:
            total = sum(value for value in counted.values() if value is not None)
            wrong = {name: (counted[name], kinds[name]) for name in COUNTERS if counted[name] != kinds[name]}
            checks["counters"] = None if total == sent and not wrong else (
                f"counters {counted} sum to {total} for {sent} requests; counter vs answers: {wrong}")
        return checks

    def problems(self) -> dict[str, str]:
        return {name: problem for name, problem in self.checks().items() if problem}


@dataclass
class CaseResult:
    fault: Fault
    build: str
    runs: list[GatewayRun]
    injected_ms: float
    healed_ms: float

    def problems(self) -> dict[str, dict[str, str]]:
        return {run.gateway.label: problems for run in self.runs if (problems := run.problems())}

    def describe(self) -> str:
        """One paragraph per gateway: answers by kind, the slowest, recovery, counters, problems."""
        parts = []
        for run in self.runs:
            recovery = run.recovery_ms()
            parts.append(f"{run.gateway.label}: {dict(run.kinds())}, slowest {run.worst_ms():.0f} ms, recovery "
                         f"{'-' if recovery is None else f'{recovery:.0f} ms'}, counters {run.counted()}"
                         + "".join(f"\n  {name}: {problem}" for name, problem in run.problems().items()))
        return "\n".join(parts)


def run_case(rig: Rig, fault: Fault, timing: Timing = Timing(), profile: LoadProfile = LoadProfile(),
             tag: str | None = None) -> CaseResult:
    """Settles the rig, starts the load, injects the fault after `warmup_s`, heals it `fault_s` later, runs the
    load `after_s` more, and returns what every gateway answered and counted."""
    tag = tag or f"{rig.build}-{fault.name}-{int(time.time() * 1000) % 10**8}"
    rig.settle(tag)
    for gateway in rig.gateways:
        gateway.new_trap_lines()
    before = {gateway.label: gateway.metrics() for gateway in rig.gateways}
    load = Load(rig, tag, profile).start()
    injected = healed = now_ms()
    try:
        time.sleep(timing.warmup_s)
        injected = now_ms()
        fault.inject(rig.stack)
        deadline = injected + timing.fault_s * 1000
        if fault.repeat_ms:
            while now_ms() + fault.repeat_ms < deadline:
                time.sleep(fault.repeat_ms / 1000)
                fault.inject(rig.stack)
        harness.sleep_until(deadline / 1000)
        fault.heal(rig.stack)
        healed = now_ms()
        time.sleep(timing.after_s)
    finally:
        try:
            load.stop()
        finally:
            with contextlib.suppress(Exception):
                rig.stack.heal_all()
    if load.crashes:
        raise harness.HarnessError("load client failed: " + "; ".join(load.crashes))
    runs = []
    for gateway in rig.gateways:
        decisions = sorted(load.decisions[gateway.label], key=lambda d: d.start_ms)
        after = _settled_metrics(gateway, before[gateway.label], len(decisions))
        runs.append(GatewayRun(gateway, fault, decisions, before[gateway.label], after, gateway.new_trap_lines(),
                               injected, healed))
    return CaseResult(fault, rig.build, runs, injected, healed)


def _settled_metrics(gateway: Gateway, before: dict[str, int], sent: int, timeout: float = 2.0) -> dict[str, int]:
    """The counters once they account for `sent` more decisions (Envoy may publish a moment after the
    answer), or as they are after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        after = gateway.metrics()
        total = sum(after.get(name, 0) - before.get(name, 0) for name in COUNTERS)
        if total >= sent or time.monotonic() >= deadline:
            return after
        time.sleep(0.05)


def latency_summary(decisions: list[Decision]) -> tuple[float, float]:
    """(median, worst) wait for a decision in ms."""
    latencies = [d.wait_ms for d in decisions]
    return (statistics.median(latencies), max(latencies)) if latencies else (float("nan"), float("nan"))
