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

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

import harness
import llm_upstream as llm
from harness import clock_guard, decode_permit, epoch_ms, erl_admin, limiter_key, plugin_config, rule, wait_until, worst_window
from llm_upstream import Member
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


class RedissonWindow:
    """Redisson's sliding window as its scripts compute it (Redisson 4.7.0 `RedissonRateLimiter`,
    `tryAcquireAsync` and `availablePermitsAsync`): at time t the members whose score is above t - interval
    are in the window (the release step removes those at or below it), and `rate` minus their permits are
    free; an acquire of p permits is granted iff at least p are free, and a refusal takes nothing.

    The members (`llm_upstream.Member`, by their random bytes) are every member seen in Redis so far
    (`observe()`), kept after Redis released them."""

    def __init__(self, rate: int, interval_ms: int):
        self.rate = rate
        self.interval_ms = interval_ms
        self.members: dict[bytes, Member] = {}

    def observe(self, redis, key: str) -> list[Member]:
        """Reads the permits key; returns the members not seen before (and keeps them). Each must be
        Redisson 4.x's 21 bytes."""
        new = []
        for raw, score in redis.zrange(key, 0, -1, withscores=True):
            permit = decode_permit(raw, score)  # ValueError unless 21 bytes of Redisson 4.x
            if permit.random not in self.members:
                member = Member(permit.random, permit.permits, score)
                self.members[permit.random] = member
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
        self.longest_gap_ms = 0.0  # between two reads: a member lives at least the interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="member-sampler", daemon=True)

    def _run(self) -> None:
        client = self.redis.db(0)
        last = epoch_ms()
        try:
            while True:
                now = epoch_ms()
                self.longest_gap_ms, last = max(self.longest_gap_ms, now - last), now
                for key in self.keys:
                    for raw, score in client.zrange(key, 0, -1, withscores=True):
                        permit = decode_permit(raw, score)
                        self.seen[key].setdefault(permit.random, Member(permit.random, permit.permits, score))
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
        """Redisson's window over every member seen in `key` (HarnessError if reads were too far apart to
        see them all)."""
        if self.longest_gap_ms >= interval_ms - 100:
            raise harness.HarnessError(f"the sampler read {self.longest_gap_ms:.0f} ms apart: members missed")
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


# --- Shared limiters ----------------------------------------------------------------------------------------


def test_each_decision_of_java_and_the_gateway_taking_turns_is_redissons_at_that_moment(stack, java):
    """Java's tryAcquire (of 1 and 2 permits) and the gateway's requests one after the other on one OVERALL
    limiter (4 per 1.2 s), across window moves: each decision is the one Redisson's script makes at that
    moment (`RedissonWindow` over every member written so far), each new member is 21 bytes, scored within
    its call, with the permits asked; a gateway refusal's Retry-After counts from the oldest permit, Java's
    or its own; afterwards Java's availablePermits and erl-admin agree, before and after a permit leaves."""
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

    # Three members 300 ms apart (their departures must not fall together), Java's first, for a full
    # window; then each departure frees what the next turns take.
    step("java")
    time.sleep(0.3)
    step("gateway")
    time.sleep(0.3)
    step("java", 2)
    step("gateway")  # refused: its Retry-After counts from Java's first member
    step("java")
    first, second, third = sorted(window.members.values(), key=lambda m: m.score_ms)[:3]
    after_leaving(first)
    step("gateway")
    step("java")
    after_leaving(second)
    step("java")
    step("gateway")  # refused: the oldest is Java's member of 2
    after_leaving(third)  # 2 permits leave
    step("gateway")
    step("java", 2)  # refused: 1 free
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

# Redisson stamps an acquire with its JVM's clock (`System.currentTimeMillis()` as ARGV[2] of
# `RedissonRateLimiter.tryAcquireAsync`), the gateway with its own at the request's start; the two calls take
# different paths to Redis (Netty; Envoy, webdis), so an acquire can reach Redis a few ms after one stamped
# later, which lets a sliding window hold one more (docs/redisson.md, "Clocks"; seen once in about 18 runs:
# 21 of 20). A window this much narrower holds at most the rate.
CLOCK_SKEW_MS = 5


def hammer_both(stack, envoy, limiter, headers: dict[str, str], keys: list[str], seconds: float = 2.2,
                java_threads: int = 2, gateway_clients: int = 3) -> tuple[list, list, Sampler]:
    """Java threads (tryAcquire, 2 ms apart) and gateway clients (requests on fresh connections, back to
    back) on one limiter for `seconds`, while a Sampler reads `keys`: Java's calls and the gateway's, (start,
    end, granted) each, and the sampler. Every gateway decision was Redis's (no failure counted)."""
    with Sampler(stack.redis, keys) as sampler, ThreadPoolExecutor(max_workers=1) as pool:
        java_run = pool.submit(limiter.hammer, java_threads, int(seconds * 1000), 2)
        def send() -> int:
            try:
                return envoy.send(headers=headers).status
            except OSError:  # counted, not lost with its thread: the assertion below names it
                return -1

        sends = [send] * gateway_clients
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
    (start - interval - the gateway's clock guard, end], a superset of the window at any moment of the
    call (the gateway's window keeps a permit the guard longer)."""
    wrong = []
    for start, end, granted in calls:
        if not granted:
            earliest = start - window.interval_ms - clock_guard(window.interval_ms)
            held = sum(m.permits for m in window.members.values() if earliest < m.score_ms <= end)
            if held < window.rate:
                wrong.append((start, end, held))
    return wrong


def spans(calls: list[tuple[float, float, bool]]) -> list[tuple[float, float]]:
    """The (start, end) of the admitted calls."""
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
    assert len(window.members) == len(admitted), (len(window.members), len(admitted), "one member per admission")
    assert worst_window(admitted, interval_ms - CLOCK_SKEW_MS) <= rate
    assert worst_window(admitted, interval_ms) <= rate + 1, "one more at most, by two clocks a few ms apart"
    wrong = refused_with_room(java_calls + gateway_calls, window)
    assert not wrong, f"{len(wrong)} refusals with room (start, end, permits held): {wrong[:5]}"
    assert_available_agree(stack, limiter, window)


class StampLog:
    """The stamps of the acquire calls on one permits key, in the order Redis ran them (`harness.Monitor`):
    ("java", ms) for Redisson's `tryAcquire` (5 keys and 3 arguments: permits, its stamp, random bytes) and
    ("gateway", ms) for the gateway's ACQUIRE, alone or as a segment of ACQUIRE_BATCH (its first argument)."""

    def __init__(self, redis: harness.Redis, key: str):
        self.key = key
        self.calls: list[tuple[str, int]] = []
        self.monitor = harness.Monitor(redis, self._read)

    def __enter__(self) -> "StampLog":
        self.monitor.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self.monitor.__exit__(*exc_info)

    def _read(self, args: list[str]) -> None:
        if args[0].lower() not in ("evalsha", "eval") or len(args) < 3:
            return
        count = int(args[2])
        keys, argv = args[3:3 + count], args[3 + count:]
        if count == 5 and len(argv) == 3:
            if self.key in keys:
                self.calls.append(("java", int(argv[1])))
        elif count == 5:
            if self.key in keys and argv[0]:
                self.calls.append(("gateway", int(argv[0])))
        elif argv and argv[0].isdigit():  # ACQUIRE_BATCH: per segment its script, keys, arguments
            a, k = 1, 0
            for _ in range(int(argv[0])):
                script, key_count, arg_count = argv[a], int(argv[a + 1]), int(argv[a + 2])
                segment_keys, segment_args = keys[k:k + key_count], argv[a + 3:a + 3 + arg_count]
                if script == "1" and self.key in segment_keys and segment_args[0]:
                    self.calls.append(("gateway", int(segment_args[0])))
                a, k = a + 3 + arg_count, k + key_count

    def out_of_order_ms(self) -> dict[tuple[str, str], int]:
        """By (who ran first, who ran after): the most a call was stamped before an earlier-run one."""
        worst: dict[tuple[str, str], int] = {}
        newest: dict[str, int] = {}
        for who, stamp in self.calls:
            for other, latest in newest.items():
                if latest > stamp:
                    worst[(other, who)] = max(worst.get((other, who), 0), latest - stamp)
            newest[who] = max(newest.get(who, stamp), stamp)
        return worst

    def early_releases(self, members: list[Member], interval_ms: int) -> int:
        """Calls whose window counted a permit that an earlier-run gateway call may already have released:
        a member scored in (the call's stamp - interval, the gateway's cutoff], its cutoff its stamp -
        interval - its clock guard."""
        scores = sorted(m.score_ms for m in members)
        cutoff, early = None, 0
        for who, stamp in self.calls:
            if cutoff is not None and any(stamp - interval_ms < score <= cutoff for score in scores):
                early += 1
            if who == "gateway":
                mine = stamp - interval_ms - clock_guard(interval_ms)
                cutoff = mine if cutoff is None else max(cutoff, mine)
        return early


def worst_by_scores(members: list[Member], interval_ms: int) -> int:
    """The most permits of members scored in one sliding window (t - interval, t] (Redisson's window)."""
    scores = sorted((m.score_ms, m.permits) for m in members)
    return max((sum(p for s, p in scores if t - interval_ms < s <= t) for t, _ in scores), default=0)


# Runs of test_java_and_the_gateway_on_one_limiter_go_no_further_over_the_rate_than_java_alone: 1 in make test,
# 10 in `make java-share` (the measure).
SHARE_RUNS = int(os.environ.get("ERL_SHARE_RUNS", "1"))


def test_java_and_the_gateway_on_one_limiter_go_no_further_over_the_rate_than_java_alone(stack, java):
    """Redisson's `tryAcquire` (4 threads, 2 ms apart) alone on one limiter of 200 per second for 5 s, then
    with 4 gateway clients on another, in each of `SHARE_RUNS` runs: by the permits' own scores, the worst
    sliding window with the gateway is no more than Java's alone can be (the rate, or one more when two Java
    calls reach Redis out of their stamps' order), and no call ever counted a permit that an earlier-run
    gateway call had released: the gateway's clock guard kept its releases behind every later call's window
    (MONITOR: each call's stamp, in Redis's order)."""
    rate, interval_ms, seconds = 200, 1000, 5.0
    envoy = stack.envoy(plugin_config(rule(rate=rate, interval=interval_ms), timeout=TIMEOUT))
    lines = []
    for run in range(SHARE_RUNS):
        alone, together = java.limiter(f"erl:per-user:java-{run}"), java.limiter(f"erl:per-user:both-{run}")
        for limiter in (alone, together):
            assert limiter.try_set_rate(OVERALL, rate, interval_ms)
        alone_key, together_key = limiter_key(alone.name, "permits"), limiter_key(together.name, "permits")
        with Sampler(stack.redis, [alone_key]) as sampler, StampLog(stack.redis, alone_key) as alone_log:
            alone.hammer(4, int(seconds * 1000), 2)
        alone_worst = worst_by_scores(list(sampler.seen[alone_key].values()), interval_ms)
        with StampLog(stack.redis, together_key) as log:
            java_calls, gateway_calls, sampler = hammer_both(stack, envoy, together, {"x-user-id": f"both-{run}"},
                                                             [together_key], seconds, 4, 4)
        members = list(sampler.seen[together_key].values())
        worst, early = worst_by_scores(members, interval_ms), log.early_releases(members, interval_ms)
        lines.append(f"run {run + 1}: Java alone worst {alone_worst} (its calls out of stamp order by up to "
                     f"{alone_log.out_of_order_ms()} ms); Java and the gateway worst {worst} (Java "
                     f"{len(spans(java_calls))}, gateway {len(spans(gateway_calls))} admitted; out of stamp order "
                     f"by up to {log.out_of_order_ms()} ms; calls counting a permit a gateway had released: {early})")
        print(lines[-1])
        assert spans(java_calls) and spans(gateway_calls), "both sides were admitted"
        assert len(members) == len(spans(java_calls)) + len(spans(gateway_calls)), "one member per admission"
        assert early == 0, lines[-1]
        assert worst <= rate + 1, lines[-1]


def test_java_try_acquire_with_a_timeout_and_a_gateway_with_max_wait_wait_alike_on_one_limiter(stack, java):
    """Redisson's `tryAcquire(1, 1500 ms)` (2 Java threads, back to back) and 2 gateway clients on a rule with
    `max_wait` 1.5 s share one limiter of 10 per second for 3 s, far over it: both sides wait for their
    permits instead of being refused at once, and both get some; every admission on either side came within
    its wait (+ a margin for a loaded machine); by the permits' scores, no sliding second holds more than the
    rate (one more at most: two Java calls can reach Redis out of their stamps' order). Java refuses only once
    its timeout has passed; the gateway refuses as soon as its next try would come past `max_wait` (it
    answers a 429 with `Retry-After` earlier, docs/redisson.md)."""
    rate, interval_ms, wait_ms, seconds = 10, 1000, 1500, 3.0
    envoy = stack.envoy(plugin_config(rule(rate=rate, interval=interval_ms, max_wait=f"{wait_ms}ms"),
                                      timeout=TIMEOUT))
    limiter = java.limiter(ALICE)
    assert limiter.try_set_rate(OVERALL, rate, interval_ms)
    key = limiter_key(ALICE, "permits")
    with Sampler(stack.redis, [key]) as sampler, ThreadPoolExecutor(max_workers=1) as pool:
        java_run = pool.submit(limiter.hammer, 2, int(seconds * 1000), 0, 1, wait_ms)
        gateway_runs = harness.hammer([lambda: envoy.send(headers=HEADERS).status] * 2, seconds)
        java_calls = java_run.result(timeout=seconds + 60)
    assert {outcome for _, _, outcome in java_calls} <= {0, 1}, "a Java tryAcquire threw"
    gateway_calls = [(start, end, status) for run in gateway_runs for start, end, status in run]
    assert {status for _, _, status in gateway_calls} <= {200, 429}, gateway_calls
    java_admitted = [end - start for start, end, outcome in java_calls if outcome == 1]
    gateway_admitted = [end - start for start, end, status in gateway_calls if status == 200]
    print(f"{rate}/s, waits of {wait_ms} ms: Java admitted {len(java_admitted)} of {len(java_calls)} "
          f"(longest wait {max(java_admitted, default=0):.0f} ms), gateway {len(gateway_admitted)} of "
          f"{len(gateway_calls)} (longest {max(gateway_admitted, default=0):.0f} ms)")
    assert java_admitted and gateway_admitted, "both sides got permits"
    assert max(java_admitted) <= wait_ms + 500, java_calls
    assert max(gateway_admitted) <= wait_ms + 500, gateway_calls
    assert any(wait > interval_ms / 2 for wait in java_admitted), "Java waited for permits"
    assert any(wait > interval_ms / 2 for wait in gateway_admitted), "the gateway waited for permits"
    members = list(sampler.seen[key].values())
    assert len(members) == len(java_admitted) + len(gateway_admitted), "one member per admission"
    assert worst_by_scores(members, interval_ms) <= rate + 1, sorted(m.score_ms for m in members)
    metrics = envoy.metrics()
    assert metrics.get("waited_admitted", 0) > 0 and not metrics.get("redis_errors"), metrics


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


# --- Changes made from Java, as the gateway obeys them --------------------------------------------------------


def decisions(envoy: harness.Envoy, n: int, headers: dict[str, str] = HEADERS) -> list[tuple[int, int]]:
    """`n` requests: (status, the rate `q` of their `RateLimit-Policy`) each."""
    out = []
    for _ in range(n):
        response = envoy.send(headers=headers)
        policy = response.headers.get("ratelimit-policy", "")
        out.append((response.status, int(policy.split(";q=")[1].split(";")[0]) if ";q=" in policy else -1))
    return out


def gone(stack: harness.Stack, timeout: float = 5.0) -> None:
    """Waits until Redis holds no key (the limiter's TTL ran out)."""
    wait_until(lambda: not stack.redis.client.keys("*"), timeout, "the limiter's keys to expire")


def test_rates_java_sets_are_obeyed_by_the_gateway_with_rate_source_redis(stack, java):
    """`rate_source: "redis"` (the default): whatever Java writes is the limit, from the gateway's next
    request; Java's expire and delete end the limiter, which the gateway then creates anew with the rule's
    rate. (1 minute windows: nothing leaves them during the test; no local block, so every request asks
    Redis.)"""
    heavy = rule("heavy", limit_by={"header": "x-heavy"}, rate=5, interval="1m", permits=2, local_block_max=0)
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m", local_block_max=0), heavy))
    redis, limiter = stack.redis.client, java.limiter(ALICE)
    # A Java service that starts first creates the limiter (keepAliveTime 0): its rate wins over the rule's.
    assert limiter.try_set_rate(OVERALL, 3, 60_000)
    assert decisions(envoy, 4) == [(200, 3)] * 3 + [(429, 3)]
    assert not limiter.try_set_rate(OVERALL, 9, 60_000), "the limiter exists: trySetRate changes nothing"
    assert limiter.config() == {"type": "OVERALL", "rate": 3, "interval_ms": 60_000}
    assert decisions(envoy, 1) == [(429, 3)]

    limiter.set_rate(OVERALL, 4, 60_000)  # the reset: all 4 free again
    assert decisions(envoy, 5) == [(200, 4)] * 4 + [(429, 4)]
    limiter.set_rate_keeping_state(OVERALL, 6, 60_000)  # 4 of 6 taken
    assert decisions(envoy, 3) == [(200, 6)] * 2 + [(429, 6)]
    assert limiter.update_rate(OVERALL, 7, 60_000)  # 6 of 7 taken
    assert decisions(envoy, 2) == [(200, 7), (429, 7)]
    window = RedissonWindow(7, 60_000)
    window.observe(redis, limiter_key(ALICE, "permits"))
    assert assert_available_agree(stack, limiter, window) == 0
    limiter.release(2)  # Redisson 4.x: 2 permits back in the value, the members stay
    assert decisions(envoy, 3) == [(200, 7)] * 2 + [(429, 7)]

    # Redisson's expire on a limiter without keepAliveTime: the gateway's acquire keeps the TTL Java set
    # (it copies the hash's onto the other keys, as Redisson's acquire does), and the limiter ends with it.
    assert limiter.expire(800)
    assert decisions(envoy, 1) == [(429, 7)]
    assert 0 < redis.pttl(limiter_key(ALICE, "permits")) <= 800
    gone(stack)
    assert decisions(envoy, 6) == [(200, 5)] * 5 + [(429, 5)], "created anew, with the rule's rate"
    assert limiter.config() == {"type": "OVERALL", "rate": 5, "interval_ms": 60_000}
    # That limiter has the rule's keepAliveTime (1 h): an acquire renews every key's TTL over what Java set,
    # as Redisson's own acquire does.
    assert limiter.expire(800)
    assert decisions(envoy, 1) == [(429, 5)]
    assert limiter.remain_ttl_ms() > 3_500_000 and redis.pttl(limiter_key(ALICE, "permits")) > 3_500_000

    assert limiter.delete()
    assert not redis.keys("*")
    with pytest.raises(RedissonError, match="RateLimiter is not initialized"):
        limiter.try_acquire()
    assert decisions(envoy, 6) == [(200, 5)] * 5 + [(429, 5)], "created anew, with the rule's rate"
    assert limiter.try_acquire() is False

    # A rate set below the permits a request takes (2): no wait can admit it, so no Retry-After; a rate
    # raised again is obeyed at the next request.
    heavy_limiter, heavy_user = java.limiter("erl:heavy:h"), {"x-heavy": "h"}
    assert decisions(envoy, 1, heavy_user) == [(200, 5)]
    heavy_limiter.set_rate(OVERALL, 1, 60_000)
    refused = envoy.send(headers=heavy_user)
    assert refused.status == 429 and "retry-after" not in refused.headers, refused.headers
    heavy_limiter.set_rate(OVERALL, 5, 60_000)
    assert decisions(envoy, 1, heavy_user) == [(200, 5)]


def test_rates_java_sets_after_the_rule_stand_with_rate_source_config(stack, java):
    """`rate_source: "config"`: the rule's rate replaces a config no rule wrote (Java's trySetRate), keeping
    the permits taken; a config Java writes after the rule (setRate, setRate keeping state, updateRate)
    stands; after Java's expire or delete the gateway creates the limiter with the rule's rate again."""
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m", local_block_max=0, rate_source="config")))
    redis, limiter = stack.redis.client, java.limiter(ALICE)
    assert limiter.try_set_rate(OVERALL, 3, 60_000)
    assert limiter.try_acquire() and limiter.try_acquire()
    assert decisions(envoy, 4) == [(200, 5)] * 3 + [(429, 5)], "the rule's 5, Java's 2 permits still taken"
    assert limiter.config() == {"type": "OVERALL", "rate": 5, "interval_ms": 60_000}
    assert redis.hget(ALICE, "erlRuleConfig") == b"5:60000:0:3600000"

    limiter.set_rate(OVERALL, 2, 60_000)
    assert decisions(envoy, 3) == [(200, 2)] * 2 + [(429, 2)], "Java's reset stands"
    limiter.set_rate_keeping_state(OVERALL, 3, 60_000)
    assert decisions(envoy, 2) == [(200, 3), (429, 3)]
    assert limiter.update_rate(OVERALL, 4, 60_000)
    assert decisions(envoy, 2) == [(200, 4), (429, 4)]
    assert not limiter.try_set_rate(OVERALL, 9, 60_000)
    assert limiter.config() == {"type": "OVERALL", "rate": 4, "interval_ms": 60_000}

    assert limiter.expire(800)  # keepAliveTime 0 (Java's setRate): the TTL stands
    gone(stack)
    assert decisions(envoy, 6) == [(200, 5)] * 5 + [(429, 5)], "created anew, with the rule's rate"
    assert limiter.delete()
    assert decisions(envoy, 6) == [(200, 5)] * 5 + [(429, 5)], "created anew, with the rule's rate"
    assert limiter.try_acquire() is False


def test_limiters_the_gateway_created_are_read_and_taken_by_java(stack, java):
    """What a Java service finds on a limiter the gateway created: the rule's config and keep-alive, the
    permits left (agreeing with erl-admin), and permits it can take until the window is full; a PER_CLIENT
    one gives Java a window of its own, and Java's delete of it leaves the gateway's window, which the
    gateway drops when it creates the limiter again."""
    team_rule = rule("team", limit_by={"header": "x-team"}, rate=2, interval="1m", type="per_client",
                     local_block_max=0)  # the delete below must reach its next request
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m"), team_rule))
    assert decisions(envoy, 3) == [(200, 5)] * 3
    limiter = java.limiter(ALICE)
    assert limiter.config() == {"type": "OVERALL", "rate": 5, "interval_ms": 60_000}
    assert 3_500_000 < limiter.remain_ttl_ms() <= 3_600_000, "the rule's keep_alive, 1 h"
    window = RedissonWindow(5, 60_000)
    window.observe(stack.redis.client, limiter_key(ALICE, "permits"))
    assert assert_available_agree(stack, limiter, window) == 2
    assert [limiter.try_acquire() for _ in range(3)] == [True, True, False]
    assert decisions(envoy, 1) == [(429, 5)]

    red = {"x-team": "red"}
    assert decisions(envoy, 3, red) == [(200, 2)] * 2 + [(429, 2)]
    team = java.limiter("erl:team:red")
    assert team.config() == {"type": "PER_CLIENT", "rate": 2, "interval_ms": 60_000}
    assert team.available_permits() == 2, "Java's own window"
    assert [team.try_acquire() for _ in range(3)] == [True, True, False]
    assert admin_show(stack, "erl:team:red", java.client_id)[0] == 0
    assert decisions(envoy, 1, red) == [(429, 2)]
    # Java's delete removes the config and its own client keys, not the gateway's: the gateway creating the
    # limiter again drops its old window (a Redisson client's trySetRate would keep it: 0 free).
    assert team.delete()
    gateway_value = [k for k in stack.redis.client.keys("{erl:team:red}:value:*")]
    assert len(gateway_value) == 1 and stack.redis.client.get(gateway_value[0]) == b"0"
    assert decisions(envoy, 3, red) == [(200, 2)] * 2 + [(429, 2)]


def test_a_value_key_left_without_ttl_by_javas_available_permits_does_not_skew_the_gateways_new_limiter(stack, java):
    """Redisson's availablePermits SETs the value key once permits left the window, which drops the key's
    TTL: when the limiter expires (keepAliveTime after its last acquire) that key stays. The gateway that
    creates the limiter again starts it full, not from the stale value (Redisson's own trySetRate keeps it)."""
    envoy = stack.envoy(plugin_config(rule(rate=2, interval=1000, keep_alive="2s")), concurrency=1)
    redis, value_key = stack.redis.client, limiter_key(ALICE, "value")
    assert envoy.send(headers=HEADERS).status == 200
    time.sleep(0.5)
    assert envoy.send(headers=HEADERS).status == 200
    window = RedissonWindow(2, 1000)
    first, second = sorted(window.observe(redis, limiter_key(ALICE, "permits")), key=lambda m: m.score_ms)
    harness.sleep_until(time.monotonic() + (first.score_ms + 1030 - epoch_ms()) / 1000)
    available = java.limiter(ALICE)._call("availablePermits")
    assert available.end_ms < second.score_ms + 1000, "too slow: the second permit left too"
    assert available.result == 1 and redis.get(value_key) == b"1"
    assert redis.pttl(value_key) == -1, "Redisson's SET dropped the TTL"
    wait_until(lambda: redis.keys("*") == [value_key.encode()], 5.0, "the limiter to expire but its value key")
    assert [envoy.send(headers=HEADERS).status for _ in range(3)] == [200, 200, 429]


# --- What the gateway writes, as Java reads it ---------------------------------------------------------------


def members_of(stack: harness.Stack, name: str) -> list[Member]:
    """The overall permit members of limiter `name` now."""
    return llm.members(stack.redis.client, name)


def assert_java_reads(stack: harness.Stack, limiter, rate: int) -> int:
    """Java's availablePermits, equal to erl-admin's and to the rate less the permits of the members in Redis
    (1 minute windows: none leaves during the test). Returns it."""
    expected = rate - sum(m.permits for m in members_of(stack, limiter.name))
    available = limiter.available_permits()
    assert available == expected == admin_show(stack, limiter.name)[0], (available, expected)
    return available


def test_a_lease_is_permits_taken_for_java_before_and_after_it_is_settled(stack, java):
    """A lease (one member of the leased permits, scored at its expiry) is taken permits to Java; settled at
    the next lease, it holds the permits used and the rest are free again; Java and the gateway together then
    take exactly the rate."""
    rate = 20
    envoy = stack.envoy(plugin_config(rule("hot", limit_by="global", rate=rate, interval="1m",
                                           lease={"max_permits": 8, "max_age": "300ms"})), concurrency=1)
    limiter = java.limiter("erl:hot")
    assert [envoy.send().status for _ in range(3)] == [200] * 3
    [lease] = members_of(stack, "erl:hot")
    assert lease.permits == 8
    assert assert_java_reads(stack, limiter, rate) == 12

    time.sleep(max(0.0, (lease.score_ms + 20 - epoch_ms()) / 1000))  # the lease expired
    assert envoy.send().status == 200  # a new lease, settling the old one to its 3 permits used
    held = sorted(m.permits for m in members_of(stack, "erl:hot"))
    assert len(held) == 2 and 3 in held, held
    available = assert_java_reads(stack, limiter, rate)
    assert available == rate - sum(held) and available > 0
    assert [limiter.try_acquire() for _ in range(available + 1)] == [True] * available + [False]
    leased_left = sum(held) - 3 - 1  # the new lease's permits beyond the request that took it
    assert [envoy.send().status for _ in range(leased_left + 1)] == [200] * leased_left + [429]
    assert sum(m.permits for m in members_of(stack, "erl:hot")) == rate
    assert assert_java_reads(stack, limiter, rate) == 0


def test_reservations_and_settled_costs_are_read_and_respected_by_java(stack, java):
    """A `cost` rule's reservation in flight and its settled cost are permits taken to Java; an excess settled
    past the rate leaves the value below zero: Java's availablePermits says so (as erl-admin does), and its
    tryAcquire refuses (and does not fail on the filter's members)."""
    rate, reserve = 100, 10
    tokens = rule("tokens", limit_by={"header": "x-api-key"}, rate=rate, interval="1m",
                  cost={"reserve": reserve, "settle": {"usage": "openai"}})
    limiter = java.limiter("erl:tokens:acme")
    with llm.LlmUpstream() as upstream:
        envoy = stack.envoy(plugin_config(tokens), upstream_port=upstream.port, concurrency=1)

        def ask(cost: int, delay_ms: int = 0) -> harness.Response:
            """A chat completion whose streamed answer reports `cost` tokens at its end."""
            asked = {"x-api-key": "acme", **llm.headers("openai-sse", 1, cost - 1, events=3, delay_ms=delay_ms)}
            return envoy.send("/v1/chat", asked, method="POST", body=b"{}")

        with ThreadPoolExecutor(max_workers=1) as pool:
            slow = pool.submit(ask, 3, 500)  # its usage comes about 1 s after its headers
            wait_until(lambda: members_of(stack, "erl:tokens:acme"), 5.0, "the reservation")
            [reservation] = members_of(stack, "erl:tokens:acme")
            assert (reservation.random[:2], reservation.permits) == (b"-r", reserve)
            assert assert_java_reads(stack, limiter, rate) == rate - reserve
            assert slow.result(timeout=10).status == 200
        wait_until(lambda: [m.permits for m in members_of(stack, "erl:tokens:acme")] == [3], 5.0, "the settle")
        assert members_of(stack, "erl:tokens:acme")[0].random[:2] == b"-s"
        assert assert_java_reads(stack, limiter, rate) == rate - 3

        assert ask(150).status == 200  # costs 150, reserved 10: charged past the rate
        wait_until(lambda: sorted(m.permits for m in members_of(stack, "erl:tokens:acme")) == [3, 150], 5.0,
                   "the excess settled")
        assert assert_java_reads(stack, limiter, rate) == rate - 3 - 150 == -53
        assert limiter.try_acquire() is False
        assert ask(1).status == 429
        assert assert_java_reads(stack, limiter, rate) == -53, "refusals take nothing"


def test_after_the_degraded_mode_the_gateway_decides_in_redis_counting_what_java_took(stack, java):
    """The bridge to Redis down: the gateway decides locally (nothing written to Redis) while Java keeps
    acquiring in Redis; once the bridge is back, the gateway's decisions are Redis's again, counting the
    permits Java took meanwhile, and Java reads what the gateway took after."""
    rate = 10
    config = plugin_config(rule(rate=rate, interval="1m"), timeout="300ms", failure_mode="local",
                           local_fallback={"gateways": 1, "probe_interval": "100ms"})
    envoy = stack.envoy(config, concurrency=1)
    limiter = java.limiter(ALICE)
    assert decisions(envoy, 2) == [(200, rate)] * 2
    stack.webdis.stop()
    assert [envoy.send(headers=HEADERS).status for _ in range(3)] == [200] * 3
    assert envoy.metrics()["fallback_allowed"] == 3, "decided locally"
    assert [limiter.try_acquire() for _ in range(3)] == [True] * 3
    assert assert_java_reads(stack, limiter, rate) == 5, "the gateway's local decisions are not in Redis"

    stack.webdis.start()
    before = envoy.metrics()["allowed"]
    wait_until(lambda: envoy.send(headers={"x-user-id": "bob"}) and envoy.metrics()["allowed"] > before, 5.0,
               "Redis to decide again")
    assert decisions(envoy, 6) == [(200, rate)] * 5 + [(429, rate)], "Java's 3 permits counted"
    assert assert_java_reads(stack, limiter, rate) == 0
    assert limiter.try_acquire() is False


def test_members_a_batch_of_coalesced_calls_wrote_are_read_and_taken_by_java(stack, java):
    """Requests that waited behind a slow call went to Redis in one batch (`batches`): their members are
    Redisson's, Java reads and takes the permits they left."""
    rate = 20
    bridge = SlowBridge(stack.webdis.port, match=webdis_form(ALICE), delay_ms=300).start()
    try:
        config = plugin_config(rule(rate=rate, interval="1m"), redis={"max_in_flight": 1}, timeout="3s")
        envoy = stack.envoy(config, concurrency=1, webdis_port=bridge.port)
        with ThreadPoolExecutor(max_workers=8) as pool:
            first = pool.submit(envoy.send, headers=HEADERS)
            wait_until(lambda: bridge.matched >= 1, 5.0, "the first call held by the bridge")
            rest = [pool.submit(envoy.send, headers=HEADERS) for _ in range(7)]
            assert [f.result(timeout=10).status for f in [first] + rest] == [200] * 8
    finally:
        bridge.stop()
    metrics = envoy.metrics()
    assert metrics.get("batches", 0) >= 1 and metrics.get("batched_calls", 0) >= 2, metrics
    assert [m.permits for m in members_of(stack, ALICE)] == [1] * 8
    limiter = java.limiter(ALICE)
    assert assert_java_reads(stack, limiter, rate) == rate - 8
    assert [limiter.try_acquire() for _ in range(rate - 8 + 1)] == [True] * (rate - 8) + [False]
