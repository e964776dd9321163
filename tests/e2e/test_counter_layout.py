"""The sliding window counter (a rule's `layout: "sliding_window_counter"`, docs/configuration.md, "Which
window to choose") in real Envoy: 2 Envoys x 2 workers far beyond a global limit and per-user limits,
beside the same load on the sliding log (Redisson's layout).

What a user would notice if it broke: a sliding window of really admitted requests holding more than the
rate; a saturated limit using much less than its rate (the counter's floor is k/(k+1) = 95.2% at k = 20
slices); Redis memory that grows with the admissions (the counter keeps one hash of at most k + 1 fields per
limiter, under 1 KB, where the sliding log keeps one member per admission in the window, about 120 B each).
"""

from __future__ import annotations

import math
import time

import pytest

from harness import clock_guard, epoch_ms, http_request, plugin_config, rule
from test_coalescing import GLOBAL_RATE, INTERVAL_MS, USER_RATE, measure_load, run_load
from test_exactness import admitted


def layout_config(layout: str) -> dict:
    return plugin_config(
        rule("all", limit_by="global", rate=GLOBAL_RATE, interval="1s", local_block_max=0, layout=layout),
        rule("per-user", rate=USER_RATE, interval="1s", layout=layout),
    )


def memory_of(stack, name: str) -> int:
    """MEMORY USAGE of every Redis key of limiter `name` (both layouts keep theirs under `{name}` or `name`)."""
    client = stack.redis.client
    keys = [key for key in client.keys("*") if key.decode().startswith((name, "{" + name + "}"))]
    return sum(client.memory_usage(key) or 0 for key in keys)


@pytest.mark.parametrize("layout", ["sliding_log", "sliding_window_counter"])
def test_two_envoys_of_two_workers_hold_each_rate_and_the_counter_holds_one_small_hash(stack, layout):
    stack.redis.client.flushall()
    envoys = [stack.envoy(layout_config(layout), concurrency=2) for _ in range(2)]
    spans, statuses, everyone, worst, worst_user, windows = measure_load(envoys)
    memory = memory_of(stack, "erl:all")
    keys = sorted(key.decode() for key in stack.redis.client.keys("*erl:all*"))
    print(f"\n{layout}: {len(spans)} requests {dict(statuses)}, whole windows {windows} of {GLOBAL_RATE}, worst "
          f"sliding window {worst}, worst per user {worst_user} (rate {USER_RATE}); the global limiter's keys "
          f"{keys}: {memory} B")
    assert len(spans) > 3 * len(everyone), "far beyond the limits: most requests rejected"
    assert worst <= GLOBAL_RATE, f"{worst} admitted in one sliding window of a {GLOBAL_RATE} per second limit"
    assert worst_user <= USER_RATE, f"{worst_user} admitted in one sliding window of a {USER_RATE} per second limit"
    # Saturated, both admit in bursts, and a fixed window of the clock can hold part of one (docs/configuration.md,
    # "Which window to choose"): what each uses is checked on average over the 4 s of load, at least 95% of
    # what its layout can use. The sliding log frees a permit the clock guard after the window passed it
    # (interval / (interval + guard): docs/redisson.md, "Clocks"; its bursts come one every interval + guard);
    # the counter a slice at a time (k/(k+1), one burst every interval + slice).
    share = INTERVAL_MS / (INTERVAL_MS + clock_guard(INTERVAL_MS)) if layout == "sliding_log" else 20 / 21
    used = len(everyone) / (4 * GLOBAL_RATE * share)
    assert used >= 0.95, f"{len(everyone)} admitted in 4 s: {used:.0%} of {share:.3f} of the rate"
    # Once the window has passed, an allowed response says what is left of each limit, as the sliding log's.
    time.sleep(1.2)
    response = http_request(envoys[0].port, headers={"x-user-id": "newcomer"})
    assert response.status == 200, response
    assert response.headers["ratelimit"] == f'"all";r={GLOBAL_RATE - 1};t=1, "per-user";r={USER_RATE - 1};t=1', \
        response.headers
    if layout == "sliding_window_counter":
        assert keys == ["{erl:all}:counter"], "one hash per limiter, nothing else"
        assert memory <= 1024, f"{memory} B"
        assert stack.redis.client.pttl("{erl:all}:counter") <= INTERVAL_MS + INTERVAL_MS // 20


QUOTA = 40


def test_a_calendar_quota_holds_each_minute_to_its_quota_across_the_boundary(stack):
    """`calendar: {"period": "minute"}` (a global quota of 40 a minute), 2 Envoys x 2 workers far beyond it
    for 6 s across a minute boundary. The zone is a POSIX TZ rule whose offset (in seconds) puts the local
    minute's end 2.5 s after the load starts, so the test waits for no clock. Each minute admits at most its
    quota (by the requests' own times and by the counter Redis holds, one field per minute), the new minute
    admits again at once, and a 429 says when its minute ends (`Retry-After`, `RateLimit` `t=`)."""
    boundary_s = time.time() + 8.0  # the load starts 2.5 s before it, once both Envoys are up
    offset_s = (60 - int(boundary_s) % 60) % 60
    zone = f"<T>-0:00:{offset_s:02d}"  # POSIX: local = UTC + offset_s
    boundary_ms = int(boundary_s) * 1000  # UTC when the local minute ends: (utc + offset) % 60 == 0
    quota = rule("quota", limit_by="global", rate=QUOTA, calendar={"period": "minute", "time_zone": zone})
    del quota["interval"]  # the period instead
    config = plugin_config(quota)
    envoys = [stack.envoy(config, concurrency=2) for _ in range(2)]
    time.sleep(max(0.0, boundary_ms / 1000 - 2.5 - time.time()))
    results = run_load(envoys, clients_per_envoy=6, seconds=6.0)
    spans = [span for _, run in results for span in run]
    ok = admitted(spans)
    before = [s for s in ok if s[1] < boundary_ms]
    after = [s for s in ok if s[0] >= boundary_ms]
    fields = {int(k): int(v) for k, v in stack.redis.client.hgetall("{erl:quota}:counter").items()}
    print(f"\ncalendar minute: {len(spans)} requests, {len(ok)} admitted: {len(before)} before the boundary, "
          f"{len(after)} after; the counter's fields {fields}")
    assert len(spans) > 3 * len(ok), "far beyond the quota"
    assert len(before) <= QUOTA and len(after) <= QUOTA, (len(before), len(after))
    assert len(fields) == 2 and all(count <= QUOTA for count in fields.values()), fields
    assert max(fields) - min(fields) == 60_000 and max(fields) == boundary_ms, (fields, boundary_ms)
    assert sum(fields.values()) == len(ok), "every admitted request counted once, in its minute"
    assert fields[boundary_ms] == QUOTA and after, "the new minute admits its whole quota again at once"
    response = http_request(envoys[0].port, headers={})
    assert response.status == 429
    left_s = (boundary_ms + 60_000 - epoch_ms()) / 1000
    assert abs(int(response.headers["retry-after"]) - left_s) <= 1.5, (response.headers, left_s)
    assert f"t={math.ceil(left_s)}" in response.headers["ratelimit"] or \
        f"t={math.floor(left_s)}" in response.headers["ratelimit"], (response.headers["ratelimit"], left_s)
