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
# Times to the µs (epoch µs; µs after the request's start): a request's upstream send read from whole ms can be
# up to 2 ms before the permit it went with was taken, and the in-flight peaks then counted permits twice.
ACCESS_FORMAT = {"status": "%RESPONSE_CODE%", "start": "%START_TIME(%s%6f)%", "duration": "%DURATION%",
                 "by": "%FILTER_STATE(wasm.edge_rate_limiter.rejected_by:PLAIN)%", "user": "%REQ(X-USER-ID)%", "flags": "%RESPONSE_FLAGS%",
                 "to_upstream": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
                 "to_end": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%"}


def upstream_span(entry: dict) -> tuple[float, float] | None:
    """A logged request's time in flight upstream, (start, end) in epoch ms to the µs: from when Envoy began
    sending it upstream (after the filter had its permits) to when the answer's last byte left for the
    client, or the stream's end when it never did (a whole ms, rounded down: the permit went back after
    it). None for a request that never went upstream: it held no permit past its end."""
    if entry["to_upstream"] in ("-", None):
        return None
    start_ms = int(entry["start"]) / 1000.0
    end_ms = int(entry["to_end"]) / 1000.0 if entry["to_end"] not in ("-", None) else float(entry["duration"])
    return start_ms + int(entry["to_upstream"]) / 1000.0, start_ms + end_ms


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
    access_log = stack.workdir / f"{name}-access.log"
    h.with_json_access_log(bootstrap, access_log, ACCESS_FORMAT)
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
    0 free; once they ended, the permits are back (2 free, none held) and a new request goes through. Every
    answer carries the draft-11 rate limit headers of an in-flight limit (no window, no reset): the policy
    `"inflight";q=2` and the permits left after the request's own, `r=1` or `r=0` for the two admitted
    (whichever ran first), `r=0` for the refused."""
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
    assert all(answer.headers.get("ratelimit-policy") == '"inflight";q=2' for answer in answers), answers
    assert sorted(answer.headers.get("ratelimit") for answer in answers if answer.status == 200) == [
        '"inflight";r=0', '"inflight";r=1'], answers
    assert all(answer.headers.get("ratelimit") == '"inflight";r=0' for answer in rejected), rejected
    assert during == (0, 2), f"while two run: (free, held) {during}"
    h.wait_until(lambda: free_permits(stack) == (2, 0), 2.0, "the permits back")
    assert envoy.send("/v1/chat/completions", slow(0, events=1)).status == 200
    metrics = envoy.metrics()
    assert (metrics.get("inflight_admitted"), metrics.get("inflight_rejected")) == (3, 3), metrics


def test_a_request_that_a_rate_rules_local_block_rejects_takes_no_permit(stack, upstream):
    """A rate rule of 2 per 10 s and an in-flight limit of 5 on one user, 6 requests one after the other:
    2 go through; the third is rejected by Redis (it had taken a permit, given back once rejected); the
    last 3 are rejected by the rate rule's local block at once, without taking a permit: 3 permits taken in
    all, none held at the end, every refusal named `per-user`."""
    rate = {"name": "per-user", "limit_by": {"header": "x-user-id"}, "rate": 2, "interval": "10s"}
    envoy, _ = gateway(stack, upstream, rate, inflight_rule(5))
    answers = [envoy.send("/v1/chat/completions", slow(0, events=1)) for _ in range(6)]
    assert [answer.status for answer in answers] == [200, 200, 429, 429, 429, 429], answers
    assert all(answer.headers.get("x-ratelimited-by") == "per-user" for answer in answers[2:]), answers
    metrics = envoy.metrics()
    counts = [metrics.get(name) for name in ("inflight_admitted", "local_rejected", "rejected")]
    assert counts == [3, 3, 4], metrics
    h.wait_until(lambda: free_permits(stack) == (5, 0), 2.0, "every permit back")



def test_a_requests_permit_and_rate_acquire_go_in_one_call_and_a_refused_request_takes_no_rate_permit(
        stack, upstream):
    """A rate rule (100 per 10 s) and an in-flight limit of 1 on one user. One slow request runs (about 0.6 s)
    while 3 more arrive one after the other: they get 429 from the in-flight rule. Redis's own record
    (MONITOR) shows each of the 4 requests asking in one script call for its permit and its rate acquire
    together, and Redis holds one rate permit only: the refused requests' acquires did not run."""
    rate = {"name": "per-user", "limit_by": {"header": "x-user-id"}, "rate": 100, "interval": "10s"}
    envoy, _ = gateway(stack, upstream, rate, inflight_rule(1))
    limiter = h.limiter_name("erl:per-user", USER)
    calls: list[tuple[bool, bool]] = []  # per EVALSHA/EVAL: (the semaphore's keys, the rate limiter's keys)

    def record(args: list[str]) -> None:
        if args and args[0].lower() in ("evalsha", "eval"):
            calls.append((SEMAPHORE in args, limiter in args))

    # Another user first: the batch script loaded (no NOSCRIPT and resend by source below).
    assert envoy.send("/v1/chat/completions", {**slow(0, events=1), "x-user-id": "bob"}).status == 200
    with h.Monitor(stack.redis, record):
        with ThreadPoolExecutor(max_workers=1) as pool:
            running = pool.submit(envoy.send, "/v1/chat/completions", slow(200))
            h.wait_until(lambda: free_permits(stack)[1] == 1, 2.0, "the slow request's permit")
            refused = [envoy.send("/v1/chat/completions", slow(0, events=1)) for _ in range(3)]
            assert running.result().status == 200
        h.wait_until(lambda: free_permits(stack) == (1, 0), 2.0, "the permit back")
    assert [answer.status for answer in refused] == [429, 429, 429], refused
    assert all(answer.headers.get("x-ratelimited-by") == "inflight" for answer in refused), refused
    acquires = [call for call in calls if call[1]]
    assert acquires == [(True, True)] * 4, f"each request's permit and rate acquire in one call: {calls}"
    assert stack.redis.client.zcard("{" + limiter + "}:permits") == 1, "only the admitted request's rate permit"
    metrics = envoy.metrics()
    assert (metrics.get("inflight_admitted"), metrics.get("inflight_rejected")) == (2, 3), metrics  # bob's too
    assert metrics.get("rule.per-user.allowed") == 2 and not metrics.get("redis_errors"), metrics


def test_erl_admin_shows_the_permits_in_flight_and_explains_the_rule(stack, upstream, tmp_path):
    """Limit 2, two requests running: `erl-admin show` of the semaphore lists 2 in flight, 0 free, both
    permits of one holder (the gateway process: its permit ids begin with its client id, a UUID v4) with
    their leases running; `erl-admin explain` of the configuration says a third request of that user is
    rejected by the in-flight rule (Retry-After 1) and another user's allowed. Once the two ended, the
    first user's is allowed too; `erl-admin validate` lists the rule with its limit and lease."""
    rule = inflight_rule(2)
    envoy, _ = gateway(stack, upstream, rule)
    config = tmp_path / "plugin.json"
    config.write_text(json.dumps(h.plugin_config(rule)))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(envoy.send, "/v1/chat/completions", slow(400)) for _ in range(2)]
        h.wait_until(lambda: free_permits(stack) == (0, 2), 3.0, "two requests to hold the permits")
        shown = h.erl_admin(stack.redis, "--json", "show", SEMAPHORE)
        text = h.erl_admin(stack.redis, "show", SEMAPHORE).stdout
        refused = h.erl_admin(stack.redis, "explain", str(config), "-H", f"x-user-id:{USER}").stdout
        other = h.erl_admin(stack.redis, "explain", str(config), "-H", "x-user-id:bob").stdout
        assert all(future.result().status == 200 for future in futures)
    assert shown.code == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert (report["free"], report["ended"], len(report["permits"])) == (0, 0, 2), report
    assert len(report["holders"]) == 1 and report["holders"][0]["permits"] == 2, report
    holder = report["holders"][0]["holder"]
    assert holder[14] == "4" and all(p["id"].startswith(holder.replace("-", "")) for p in report["permits"]), report
    now = report["now_ms"]
    assert all(now < p["lease_end_ms"] <= now + 3000 for p in report["permits"]), report
    assert "in flight    2" in text and f"holder {holder}  2 permit(s)" in text, text
    assert "verdict        rejected (429) by inflight: none free until a request ends" in refused, refused
    assert "Retry-After: 1" in refused, refused
    assert "rule inflight (enforce): 2 in flight at once: rejected: none free, 2 in flight" in refused, refused
    assert "verdict        allowed" in other, other
    h.wait_until(lambda: free_permits(stack) == (2, 0), 2.0, "the permits back")
    after = h.erl_admin(stack.redis, "explain", str(config), "-H", f"x-user-id:{USER}").stdout
    assert "verdict        allowed: 1 more" in after or "verdict        allowed" in after, after
    assert "allowed: 2 free, 0 in flight" in after, after
    validated = h.erl_admin(None, "validate", str(config)).stdout
    assert "inflight  header x-user-id  2 in flight, lease 3s  enforce" in validated, validated


# --- Exactness: 2 gateways x 2 workers far beyond the limits ------------------------------------------------

PER_KEY, TOTAL = 8, 32
USERS = [f"user{i}" for i in range(6)]
def in_flight_peak(spans: list[tuple[float, float]]) -> int:
    """The most spans (start ms, end ms) open at one moment (an end and a start at the same ms: not both)."""
    events = sorted([(start, 1) for start, end in spans] + [(end, -1) for start, end in spans],
                    key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


class SemaphoreWatch:
    """The permits a semaphore held, in the order Redis changed them: `MONITOR` (`harness.Monitor`) from
    entering to leaving, replaying each `ZADD`, `ZREM` and `DEL` of the semaphore's `{name}:timeout` set (one
    member per permit held), those that scripts ran included. `peak`: the most members it ever had at once;
    `writes`: the commands replayed. No clock is involved: Redis's order is the truth."""

    def __init__(self, redis: h.Redis, key: str):
        self.redis, self.key = redis, key
        self.peak = self.writes = 0
        self._members: set[str] = set()
        self._monitor = h.Monitor(redis, self._replay)

    def __enter__(self) -> "SemaphoreWatch":
        if self.redis.client.zcard(self.key):
            raise h.HarnessError(f"{self.key} holds permits already: the replay would not know them")
        self._monitor.__enter__()
        return self

    def _replay(self, args: list[str]) -> None:
        if len(args) < 2 or args[1] != self.key:
            return
        command = args[0].lower()
        if command == "zadd":
            rest = args[2:]
            flags = set()
            while rest and rest[0].upper() in ("NX", "XX", "GT", "LT", "CH", "INCR"):
                flags.add(rest.pop(0).upper())
            if "XX" not in flags:
                self._members.update(rest[1::2])
        elif command == "zrem":
            self._members.difference_update(args[2:])
        elif command in ("del", "unlink"):
            self._members.clear()
        else:
            return
        self.writes += 1
        self.peak = max(self.peak, len(self._members))

    def __exit__(self, *exc: object) -> None:
        self._monitor.__exit__(*exc)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hammer(port: int, seconds: float, clients: int, seed: int, users: list[str] | None = None) -> list[str]:
    """`clients` threads sending, back to back for `seconds`, requests of a random user whose answers stream
    1 to 6 pieces 20 to 60 ms apart; one in 8 the upstream resets after its first piece, one in 8 the client
    leaves after 50 ms. Returns how each ended ("200", "429", "reset", "left")."""
    import random

    def run(index: int) -> list[str]:
        rng = random.Random(seed * 1000 + index)
        ends = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            user = rng.choice(users or USERS)
            fate = rng.randrange(8)
            extra = {"reset_after": 1} if fate == 0 else {}
            headers = {"x-user-id": user,
                       **llm.headers("openai-sse", events=rng.randint(1, 6), delay_ms=rng.randint(20, 60), **extra)}
            try:
                answer = h.http_request(port, "/v1/chat/completions", headers, timeout=0.05 if fate == 1 else 5.0)
                ends.append(str(answer.status))
            except Exception as error:  # a reset or the client's own timeout: both end the stream
                ends.append("left" if fate == 1 else f"reset:{type(error).__name__}")
        return ends

    with ThreadPoolExecutor(max_workers=clients) as pool:
        return [end for ends in pool.map(run, range(clients)) for end in ends]


def test_two_gateways_never_hold_more_than_the_limits_in_flight(stack, upstream):
    """2 Envoys x 2 workers, 24 clients each, 6 users, far beyond 8 in flight per user and 32 in total (two
    rules), with answers of random length, upstream resets and clients that leave: by both access logs, no
    user ever had more than 8 requests in flight at once, and all of them never more than 32 (each request
    counted from when Envoy began sending it upstream to its last byte); both limits were reached
    (they were the bound, not the load); and once the load ended, every permit is back in Redis."""
    rules = [inflight_rule(PER_KEY, name="per-user"), inflight_rule(TOTAL, name="total", limit_by="global")]
    gateways = [gateway(stack, upstream, *rules) for _ in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda g: hammer(g[0].port, 3.0, 24, g[0].port), gateways))
    ends = [end for run in runs for end in run]
    entries = [entry for _, log in gateways for entry in read_log(log)]
    spans = [(*found, e) for e in entries if (found := upstream_span(e)) is not None]
    logged = [(int(e["start"]) / 1000.0, int(e["start"]) / 1000.0 + float(e["duration"]))
              for e in entries if e["status"] != 429]
    assert "429" in ends and "200" in ends, sorted(set(ends))
    total_peak = in_flight_peak([(s, t) for s, t, _ in spans])
    print(f"ends {dict((end, ends.count(end)) for end in set(ends))}; peak in flight: total {total_peak}, "
          f"from request start to end {in_flight_peak(logged)}")
    assert total_peak <= TOTAL, total_peak
    assert total_peak >= TOTAL - 2, f"the total limit was not reached ({total_peak}): the test proves nothing"
    rejected_by = {e["by"] for e in entries if e["status"] == 429}
    assert rejected_by <= {"per-user", "total"}, rejected_by
    for name in ("per-user", "total"):
        assert name in rejected_by, f"{name} never refused: {rejected_by}"
    for user in USERS:
        mine = [(s, t) for s, t, e in spans if e.get("user") == user]
        assert in_flight_peak(mine) <= PER_KEY, (user, in_flight_peak(mine))
    def back() -> bool:
        held = [stack.redis.client.zcard("{" + h.limiter_name("erl:per-user", user) + "}:timeout") for user in USERS]
        return sum(held) == 0 and stack.redis.client.zcard("{erl:total}:timeout") == 0
    h.wait_until(back, 3.0, "every permit back")
    assert int(stack.redis.client.get("erl:total")) == TOTAL


def test_with_redis_down_each_gateway_holds_its_share_of_the_limit(stack, upstream):
    """The degraded mode (`failure_mode: "local"`, `gateways: 2`): Redis stopped, 2 Envoys x 2 workers, 12
    clients each on one user, far beyond a limit of 5 in flight, with answers of random length, upstream
    resets and clients that leave. By each gateway's access log, it never had more than floor(5 / 2) = 2 of
    the user's requests in flight (its workers share the count), both together never more than 4, and each
    reached its 2 (the count was the bound, not the load); requests that ended gave their permits back to the
    count (later ones were admitted). Nothing reached Redis."""
    degraded = {"failure_mode": "local", "local_fallback": {"gateways": 2, "probe_interval": "1s"},
                "timeout": "200ms"}
    gateways = [gateway(stack, upstream, inflight_rule(5), **degraded) for _ in range(2)]
    stack.redis.stop()
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            runs = list(pool.map(lambda g: hammer(g[0].port, 3.0, 12, g[0].port, users=[USER]), gateways))
    finally:
        stack.redis.start()
    ends = [end for run in runs for end in run]
    each = [[span for e in read_log(log) if (span := upstream_span(e)) is not None] for _, log in gateways]
    peaks = [in_flight_peak(mine) for mine in each]
    together = in_flight_peak(each[0] + each[1])
    print(f"Redis down: ends {dict((end, ends.count(end)) for end in set(ends))}; peak in flight per gateway "
          f"{peaks}, together {together}; admitted {[len(mine) for mine in each]}")
    assert "429" in ends and "200" in ends, sorted(set(ends))
    assert all(peak <= 2 for peak in peaks), peaks
    assert together <= 4, together
    assert peaks == [2, 2], f"a gateway never reached its share ({peaks}): the test proves nothing"
    assert all(len(mine) > 10 for mine in each), "permits that ended went back to the count"
    metrics = [envoy.metrics() for envoy, _ in gateways]
    assert all(m["inflight_admitted"] == m["inflight_released"] for m in metrics), metrics


def test_a_gateway_killed_while_holding_permits_frees_them_within_one_lease(stack, upstream):
    """Limit 4 per user, lease 2 s, two gateways. Gateway A holds all 4 permits with answers that stream
    for about 5 s, extending their leases from its tick; A is killed with SIGKILL. Gateway B's requests,
    one every 100 ms, are refused (the permits are still leased: B never goes over the limit), until the
    leases A last extended end: B's first admission comes within one lease (+ 0.3 s) of the kill, and not
    before A's last extension could have ended (1 s: a third of the lease before the kill at the latest,
    minus the request's own time). Then every permit is B's or free."""
    rule = inflight_rule(4, lease="2s")
    gateway_a, _ = gateway(stack, upstream, rule)
    gateway_b, _ = gateway(stack, upstream, rule)
    long_answer = slow(500, events=11)
    pool = ThreadPoolExecutor(max_workers=4)
    try:
        held = [pool.submit(h.http_request, gateway_a.port, "/v1/chat/completions", long_answer, timeout=10.0)
                for _ in range(4)]
        h.wait_until(lambda: free_permits(stack) == (0, 4), 3.0, "A to hold the 4 permits")
        time.sleep(1.0)  # A's tick extends the leases (every 667 ms)
        assert free_permits(stack) == (0, 4)
        os.kill(gateway_a.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        statuses = []
        while time.monotonic() - killed < 3.0:
            status = gateway_b.send("/v1/chat/completions", slow(0, events=1)).status
            statuses.append((round(time.monotonic() - killed, 2), status))
            if status == 200:
                break
            time.sleep(0.1)
        for future in held:
            with __import__("contextlib").suppress(Exception):
                future.result(timeout=5)
    finally:
        pool.shutdown(wait=False)
    admitted = [at for at, status in statuses if status == 200]
    print(f"B's requests after the kill (s, status): {statuses}")
    assert admitted, f"B was never admitted within 3 s of the kill: {statuses}"
    assert all(status == 429 for _, status in statuses[:-1]), statuses
    assert 1.0 <= admitted[0] <= 2.3, f"first admission {admitted[0]} s after the kill: {statuses}"
    h.wait_until(lambda: free_permits(stack) == (4, 0), 2.0, "every permit back once B's request ended")


def test_java_and_the_gateway_share_one_semaphore(stack, upstream, tmp_path):
    """Redisson 4.7.0's `RPermitExpirableSemaphore` (tests/interop/redisson) and the gateway on one
    semaphore of 4: Java sees the semaphore the gateway created (`trySetPermits` refused, 4 permits); while
    Java holds 2, the gateway admits 2 requests at once and refuses the third; then Java threads (lease 5 s)
    and gateway clients together for 2 s never hold more than 4 (Java's permits from take to release, the
    gateway's from Envoy's upstream send to the answer's end); afterwards Java's `availablePermits` is 4."""
    from redisson_java import RedissonJava

    envoy, log = gateway(stack, upstream, inflight_rule(4))
    assert envoy.send("/v1/chat/completions", slow(0, events=1)).status == 200
    h.wait_until(lambda: free_permits(stack) == (4, 0), 2.0, "the first permit back")
    with RedissonJava(stack.redis, tmp_path) as java:
        semaphore = java.semaphore(SEMAPHORE)
        assert not semaphore.try_set_permits(9), "the gateway created it"
        assert (semaphore.permits(), semaphore.available_permits()) == (4, 4)
        javas = [semaphore.try_acquire(lease_ms=10_000) for _ in range(2)]
        assert all(javas)
        with ThreadPoolExecutor(max_workers=3) as pool:
            answers = [pool.submit(envoy.send, "/v1/chat/completions", slow(300, events=3)) for _ in range(3)]
            statuses = sorted(future.result().status for future in answers)
        assert statuses == [200, 200, 429], statuses
        for permit in javas:
            assert semaphore.try_release(permit)
        h.wait_until(lambda: semaphore.available_permits() == 4, 2.0, "every permit back, as Java sees it")
        with SemaphoreWatch(stack.redis, TAKEN) as watch, ThreadPoolExecutor(max_workers=1) as pool:
            java_run = pool.submit(semaphore.hammer, 3, 2000, 20, 5000)
            gateway_ends = hammer(envoy.port, 2.0, 6, 7, users=[USER])
            java_spans = java_run.result(timeout=60)
        h.wait_until(lambda: semaphore.available_permits() == 4, 3.0, "every permit back after the load")
    mine = [e for e in read_log(log) if e["user"] == USER]
    gateway_spans = [span for e in mine if (span := upstream_span(e)) is not None]
    peak = in_flight_peak(java_spans + gateway_spans)
    # The same spans read to the whole ms, as this test read them before (for the record: the flake it had):
    # the start's ms and the upstream send's ms after it, each rounded down; Java's `currentTimeMillis()`.
    whole = in_flight_peak([(float(a // 1), float(b // 1)) for a, b in java_spans] + [
        (int(e["start"]) // 1000 + int(e["to_upstream"]) // 1000,
         int(e["start"]) // 1000 + (int(e["to_end"]) // 1000 if e["to_end"] not in ("-", None) else int(e["duration"])))
        for e in mine if e["to_upstream"] not in ("-", None)])
    print(f"Java {len(java_spans)} permits, gateway {len(gateway_spans)} requests in flight; peak {peak} "
          f"({whole} read to the whole ms); the semaphore held at most {watch.peak} ({watch.writes} writes); "
          f"gateway ends {sorted(set(gateway_ends))}")
    assert java_spans and len(gateway_spans) > 3 and watch.writes > 2 * len(java_spans)
    assert watch.peak <= 4, f"the semaphore itself held {watch.peak} permits at once"
    assert peak <= 4, peak


@pytest.mark.parametrize("build", ["higress", "envoy"])
def test_in_the_host_emulator_a_batch_of_requests_in_flight_together_gets_one_permit(stack, build):
    """Both builds in the project's host emulator (the Higress build through the host's Redis client, the
    stock build through webdis): limit 1, three requests of one user in flight together (one VM) take
    their permits in two ACQUIRE_BATCH calls (the first alone; the second and third wait for it and go out
    together, as rate acquires are coalesced): one is admitted, two get 429 naming the rule; when they
    ended, the permit is back."""
    config = h.config_for(build, inflight_rule(1))
    emulator = stack.emulator(config, build=build, vms=1)
    answers = emulator.send_batch([{"headers": {"x-user-id": USER}, "vm": 0} for _ in range(3)])
    assert sorted(answer.status for answer in answers) == [200, 429, 429], answers
    assert all(a.headers.get("x-ratelimited-by") == "inflight" for a in answers if a.status == 429), answers
    def back() -> bool:
        emulator.run_for(50)
        return free_permits(stack) == (1, 0)
    h.wait_until(back, 3.0, "the permit back")
    metrics = emulator.metrics()
    assert (metrics.get("inflight_admitted"), metrics.get("inflight_rejected")) == (1, 2), metrics
    assert (metrics.get("batches"), metrics.get("batched_calls")) == (2, 3), metrics
