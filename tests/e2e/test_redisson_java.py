"""Redisson's own Java client and the gateway on the same limiters: the filter in real Envoy, and beside it
Redisson 4.7.0 (`tests/interop/redisson`, one JVM for the module: one Redisson instance, its own client id),
against one Redis.

- Shared limiters: Java's `tryAcquire` and the gateway's requests interleaved one by one, each decision
  checked against Redisson's window at that moment (`RedissonWindow`); then both sides concurrently (Java
  threads and gateway clients), OVERALL and PER_CLIENT: no sliding window of admitted calls over the rate,
  no refusal while the window had room, and Java's `availablePermits` equal to `erl-admin show`.
- Changes made from Java (`trySetRate`, `setRate`, `setRate` keeping state, `updateRate`, `delete`,
  `expire`) as the gateway obeys them under each `rate_source`, and a limiter the gateway created as Java
  reads it.
- What the gateway writes, read and acquired by Java: a lease, reservations and settled costs (a value below
  zero after an excess), the degraded mode's return to Redis, members written by a batch of coalesced calls.

Redisson 3.52.0 (the last 3.x) is not run: its rate limiter scripts and keys are those of 4.7.0
(docs/redisson.md, "Versions").
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, NamedTuple

import pytest

import harness
import llm_upstream as llm
from harness import decode_permit, epoch_ms, erl_admin, limiter_key, plugin_config, rule, wait_until, worst_window
from redisson_java import OVERALL, PER_CLIENT, RedissonError, RedissonJava
from slowbridge import SlowBridge, webdis_form

ALICE = "erl:per-user:alice"
HEADERS = {"x-user-id": "alice"}


@pytest.fixture(scope="module")
def java(processes: harness.Stack) -> Iterator[RedissonJava]:
    """One Redisson instance for the module, on the module's Redis (stopped by PID after the module)."""
    with RedissonJava(processes.redis, processes.workdir) as client:
        assert client.version == "4.7.0", client.version
        yield client


# --- Redisson's window, and what the tests read off Redis and erl-admin ------------------------------------


class Member(NamedTuple):
    """A permit member: its bytes, score (acquire time, epoch ms) and permits."""

    raw: bytes
    score_ms: float
    permits: int


class RedissonWindow:
    """Redisson's sliding window as its scripts compute it (Redisson 4.7.0 `RedissonRateLimiter`,
    `tryAcquireAsync` and `availablePermitsAsync`): at time t the members whose score is above t - interval
    are in the window (the release step removes those at or below it), and `rate` minus their permits are
    free; an acquire of p permits is granted iff at least p are free, and a refusal takes nothing.

    The members are every member seen in Redis so far (`observe()`), kept after Redis released them."""

    def __init__(self, rate: int, interval_ms: int):
        self.rate = rate
        self.interval_ms = interval_ms
        self.members: dict[bytes, Member] = {}

    def observe(self, redis, key: str) -> list[Member]:
        """Reads the permits key; returns the members not seen before (and keeps them)."""
        new = []
        for raw, score in redis.zrange(key, 0, -1, withscores=True):
            if raw not in self.members:
                decode_permit(raw, score)  # Redisson 4.x's 21 bytes, or ValueError
                member = Member(raw, score, int.from_bytes(raw[17:21], "little"))
                self.members[raw] = member
                new.append(member)
        return new

    def in_window(self, t_ms: float) -> list[Member]:
        return [m for m in self.members.values() if m.score_ms > t_ms - self.interval_ms]

    def free_at(self, t_ms: float) -> int:
        """What Redisson's availablePermits answers at t_ms."""
        return self.rate - sum(m.permits for m in self.in_window(t_ms))

    def grants(self, permits: int, start_ms: float, end_ms: float) -> bool | None:
        """Whether Redisson's tryAcquire decided at some moment of [start, end] (nothing else acquiring)
        grants: True or False when every moment gives that answer (members only leave meanwhile, so the two
        ends decide), None when the window moved during the call."""
        first, last = self.free_at(start_ms) >= permits, self.free_at(end_ms) >= permits
        return first if first == last else None

    def oldest_at(self, t_ms: float) -> float:
        """The score of the oldest member in the window at t_ms (Redisson's delay counts from it)."""
        return min(m.score_ms for m in self.in_window(t_ms))


class Sampler:
    """Reads permit keys every 50 ms while in the `with` block and keeps every member ever seen (a member
    stays at least the interval, 1 s in these tests, before an acquire releases it)."""

    def __init__(self, redis: harness.Redis, keys: list[str]):
        self.redis, self.keys = redis, keys
        self.seen: dict[str, dict[bytes, Member]] = {key: {} for key in keys}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="member-sampler", daemon=True)

    def _run(self) -> None:
        client = self.redis.db(0)
        try:
            while True:
                for key in self.keys:
                    for raw, score in client.zrange(key, 0, -1, withscores=True):
                        permit = decode_permit(raw, score)
                        self.seen[key].setdefault(raw, Member(raw, score, permit.permits))
                if self._stop.is_set():
                    return
                time.sleep(0.05)
        finally:
            client.close()

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)

    def window(self, key: str, rate: int, interval_ms: int) -> RedissonWindow:
        window = RedissonWindow(rate, interval_ms)
        window.members = dict(self.seen[key])
        return window


def admin_show(stack: harness.Stack, name: str, client_id: str | None = None) -> tuple[int, int]:
    """`erl-admin show NAME [--client-id ID] --json`: the available permits and the time it computed them at
    (epoch ms)."""
    args = ["show", name, "--json"] + (["--client-id", client_id] if client_id else [])
    result = erl_admin(stack.redis, *args)
    assert result.code == 0, result.stderr
    report = result.json()
    return report["state"]["available"], report["now_ms"]


def assert_available_agree(stack: harness.Stack, limiter, window: RedissonWindow,
                           client_id: str | None = None) -> int:
    """Java's availablePermits and erl-admin's available permits, each equal to Redisson's window at the
    moment it was computed, and to each other when the window did not move in between. Returns Java's."""
    java = limiter._call("availablePermits")
    admin, admin_ms = admin_show(stack, limiter.name, client_id)
    expected = {window.free_at(java.start_ms), window.free_at(java.end_ms)}
    assert java.result in expected, f"Java's availablePermits {java.result}, the window's {expected}"
    assert admin == window.free_at(admin_ms), f"erl-admin {admin}, the window's {window.free_at(admin_ms)}"
    if window.free_at(java.start_ms) == window.free_at(admin_ms):
        assert java.result == admin
    return java.result


def remaining_quota(response: harness.Response) -> str:
    return response.headers.get("ratelimit-policy", "")


# --- Shared limiters ----------------------------------------------------------------------------------------


def test_each_decision_of_java_and_the_gateway_taking_turns_is_redissons_at_that_moment(stack, java):
    """Java's tryAcquire and the gateway's requests one after the other on one OVERALL limiter (4 per 1.2 s),
    across window moves: each decision is the one Redisson's script makes at that moment (`RedissonWindow`
    over every member written so far), each new member is 21 bytes, scored within its call, with the permits
    asked; a gateway refusal's Retry-After counts from the oldest permit; afterwards Java's availablePermits
    and erl-admin agree, before and after a permit leaves."""
    rate, interval_ms = 4, 1200
    envoy = stack.envoy(plugin_config(rule(rate=rate, interval=interval_ms)))
    limiter = java.limiter(ALICE)
    assert limiter.try_set_rate(OVERALL, rate, interval_ms)
    redis, window = stack.redis.client, RedissonWindow(rate, interval_ms)
    permits_key = limiter_key(ALICE, "permits")
    decisions: list[tuple[str, int, bool | None, bool]] = []

    def step(side: str, permits: int = 1) -> bool:
        if side == "gateway":
            sent = epoch_ms()
            response = envoy.send(headers=HEADERS)
            start, end, granted = sent, epoch_ms(), response.status == 200
            assert response.status in (200, 429), response
        else:
            call = limiter.try_acquire_timed(permits)
            start, end, granted = call.start_ms, call.end_ms, call.result
        expected = window.grants(permits, start, end)
        if not granted and side == "gateway" and expected is False:
            oldest = window.oldest_at(start)
            assert int(response.headers["retry-after"]) in harness.retry_after_range(interval_ms, oldest, start, end)
        new = window.observe(redis, permits_key)
        assert len(new) == (1 if granted else 0), (side, granted, new)
        for member in new:
            assert member.permits == permits and start - 1 <= member.score_ms <= end + 1, (member, start, end)
        decisions.append((side, permits, expected, granted))
        return granted

    def after_leaving(member: Member) -> None:
        """Waits until `member` left the window (and 30 ms more)."""
        harness.sleep_until(time.monotonic() + (member.score_ms + interval_ms + 30 - epoch_ms()) / 1000)

    # Three permits 300 ms apart (their departures must not fall together), then two more permits for a full
    # window; then each departure frees what the next turns take.
    step("gateway")
    time.sleep(0.3)
    step("java", 2)
    time.sleep(0.3)
    step("gateway")
    step("java")
    step("gateway")
    first, second, third = sorted(window.members.values(), key=lambda m: m.score_ms)
    after_leaving(first)
    step("gateway")
    step("java")
    after_leaving(second)
    step("java", 2)
    step("gateway")
    after_leaving(third)
    step("java")
    step("gateway")
    assert_available_agree(stack, limiter, window)
    after_leaving(min(window.in_window(epoch_ms()), key=lambda m: m.score_ms))
    assert assert_available_agree(stack, limiter, window) >= 1, "a permit left"

    wrong = [d for d in decisions if d[2] is not None and d[2] != d[3]]
    assert not wrong, f"decisions unlike Redisson's (side, permits, Redisson's, made): {wrong}\nall: {decisions}"
    determined = {(side, expected) for side, _, expected, _ in decisions if expected is not None}
    # The run must have decided both ways on both sides where the answer was certain (a stalled machine can
    # blur a turn that falls on a window move, never all of them).
    assert determined == {("gateway", True), ("gateway", False), ("java", True), ("java", False)}, decisions


# A Redis timeout long enough that no call of a loaded machine fails open: a request admitted without Redis
# is the failure mode's doing, not the shared limiter's (checked: no failure counted).
TIMEOUT = "5s"


def hammer_both(stack, envoy, limiter, headers: dict[str, str], keys: list[str], seconds: float = 2.2,
                java_threads: int = 2, gateway_clients: int = 3) -> tuple[list, list, Sampler]:
    """Java threads (tryAcquire, 2 ms apart) and gateway clients (requests on fresh connections, back to
    back) on one limiter for `seconds`, while a Sampler reads `keys`: Java's calls and the gateway's, (start,
    end, granted) each, and the sampler. Every gateway decision was Redis's (no failure counted)."""
    with Sampler(stack.redis, keys) as sampler, ThreadPoolExecutor(max_workers=1) as pool:
        java_run = pool.submit(limiter.hammer, java_threads, int(seconds * 1000), 2)
        sends = [lambda: envoy.send(headers=headers).status] * gateway_clients
        gateway_runs = harness.hammer(sends, seconds)
        java_calls = java_run.result(timeout=seconds + 60)
    assert {outcome for _, _, outcome in java_calls} <= {0, 1}, "a Java tryAcquire threw"
    statuses = {status for run in gateway_runs for _, _, status in run}
    assert statuses <= {200, 429}, statuses
    gateway_calls = [(start, end, status == 200) for run in gateway_runs for start, end, status in run]
    metrics = envoy.metrics()
    assert not any(metrics.get(name) for name in ("redis_errors", "failure_allowed", "failure_denied")), metrics
    return [(start, end, outcome == 1) for start, end, outcome in java_calls], gateway_calls, sampler


def refused_with_room(calls: list[tuple[float, float, bool]], window: RedissonWindow) -> list:
    """Refusals that no moment of their call explains: fewer than `rate` permits of members scored in
    (start - interval, end], a superset of the window at any moment of the call."""
    wrong = []
    for start, end, granted in calls:
        if not granted:
            held = sum(m.permits for m in window.members.values()
                       if start - window.interval_ms < m.score_ms <= end)
            if held < window.rate:
                wrong.append((start, end, held))
    return wrong


def spans(calls: list[tuple[float, float, bool]]) -> list[tuple[float, float]]:
    return [(start, end) for start, end, granted in calls if granted]


def test_java_threads_and_the_gateway_together_never_exceed_an_overall_rate_nor_refuse_with_room(stack, java):
    rate, interval_ms = 20, 1000
    envoy = stack.envoy(plugin_config(rule(rate=rate, interval=interval_ms), timeout=TIMEOUT))
    limiter = java.limiter(ALICE)
    assert limiter.try_set_rate(OVERALL, rate, interval_ms)
    key = limiter_key(ALICE, "permits")
    java_calls, gateway_calls, sampler = hammer_both(stack, envoy, limiter, HEADERS, [key])

    window = sampler.window(key, rate, interval_ms)
    admitted = spans(java_calls) + spans(gateway_calls)
    print(f"overall {rate}/s: Java {len(spans(java_calls))} of {len(java_calls)}, gateway "
          f"{len(spans(gateway_calls))} of {len(gateway_calls)}; worst sliding window "
          f"{worst_window(admitted, interval_ms)}")
    assert spans(java_calls) and spans(gateway_calls), "both sides were admitted"
    assert len(window.members) == len(admitted), "one member per admitted call, none other"
    assert worst_window(admitted, interval_ms) <= rate
    assert not refused_with_room(java_calls + gateway_calls, window)
    assert_available_agree(stack, limiter, window)


def test_per_client_windows_of_java_and_the_gateway_each_hold_the_rate_and_are_apart(stack, java):
    rate, interval_ms = 10, 1000
    envoy = stack.envoy(plugin_config(rule(rate=rate, interval=interval_ms, type="per_client"), timeout=TIMEOUT))
    limiter = java.limiter(ALICE)
    assert limiter.try_set_rate(PER_CLIENT, rate, interval_ms)
    assert envoy.send(headers=HEADERS).status == 200  # the gateway's client keys appear
    [gateway_key] = [k.decode() for k in stack.redis.client.keys(limiter_key(ALICE, "permits") + ":*")]
    gateway_id = gateway_key.rsplit(":", 1)[1]
    java_key = f"{limiter_key(ALICE, 'permits')}:{java.client_id}"
    assert gateway_id != java.client_id
    java_calls, gateway_calls, sampler = hammer_both(stack, envoy, limiter, HEADERS, [java_key, gateway_key])

    java_window = sampler.window(java_key, rate, interval_ms)
    gateway_window = sampler.window(gateway_key, rate, interval_ms)
    print(f"per client {rate}/s: worst sliding window Java {worst_window(spans(java_calls), interval_ms)}, "
          f"gateway {worst_window(spans(gateway_calls), interval_ms)}, together "
          f"{worst_window(spans(java_calls) + spans(gateway_calls), interval_ms)}")
    assert len(java_window.members) == len(spans(java_calls))
    assert len(gateway_window.members) == len(spans(gateway_calls)) + 1  # and the first request's
    assert worst_window(spans(java_calls), interval_ms) <= rate
    assert worst_window(spans(gateway_calls), interval_ms) <= rate
    assert worst_window(spans(java_calls) + spans(gateway_calls), interval_ms) > rate, "two windows, not one"
    assert not refused_with_room(java_calls, java_window)
    assert not refused_with_room(gateway_calls, gateway_window)
    assert not stack.redis.client.exists(limiter_key(ALICE, "value"), limiter_key(ALICE, "permits"))
    assert_available_agree(stack, limiter, java_window, client_id=java.client_id)
    gateway_available, at_ms = admin_show(stack, ALICE, gateway_id)
    assert gateway_available == gateway_window.free_at(at_ms)
