"""The sliding window counter (a rule's `layout: "sliding_window_counter"`, docs/configuration.md, "Which
window to choose") in real Envoy: 2 Envoys x 2 workers far beyond a global limit and per-user limits,
beside the same load on the sliding log (Redisson's layout).

What a user would notice if it broke: a sliding window of really admitted requests holding more than the
rate; a saturated limit using much less than its rate (the counter's floor is k/(k+1) = 95.2% at k = 20
slices); Redis memory that grows with the admissions (the counter keeps one hash of at most k + 1 fields per
limiter, under 1 KB, where the sliding log keeps one member per admission in the window, about 120 B each).
"""

from __future__ import annotations

import collections

import pytest

from harness import epoch_ms, plugin_config, rule, worst_window
from test_coalescing import GLOBAL_RATE, INTERVAL_MS, USER_RATE, run_load
from test_exactness import admitted, whole_windows


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
    first = epoch_ms()
    results = run_load(envoys, clients_per_envoy=12, seconds=4.0)
    last = epoch_ms()
    spans = [span for _, run in results for span in run]
    statuses = collections.Counter(status for _, _, status in spans)
    assert statuses.keys() <= {200, 429}, dict(statuses)
    everyone = admitted(spans)
    worst = worst_window(everyone, INTERVAL_MS)
    per_user = collections.defaultdict(list)
    for user, run in results:
        per_user[user].extend(admitted(run))
    worst_user = max(worst_window(user_spans, INTERVAL_MS) for user_spans in per_user.values())
    windows = [count for _, count in whole_windows(everyone, INTERVAL_MS, first + 500, last)]
    memory = memory_of(stack, "erl:all")
    keys = sorted(key.decode() for key in stack.redis.client.keys("*erl:all*"))
    print(f"\n{layout}: {len(spans)} requests {dict(statuses)}, whole windows {windows} of {GLOBAL_RATE}, worst "
          f"sliding window {worst}, worst per user {worst_user} (rate {USER_RATE}); the global limiter's keys "
          f"{keys}: {memory} B")
    assert len(spans) > 3 * len(everyone), "far beyond the limits: most requests rejected"
    assert worst <= GLOBAL_RATE, f"{worst} admitted in one sliding window of a {GLOBAL_RATE} per second limit"
    assert worst_user <= USER_RATE, f"{worst_user} admitted in one sliding window of a {USER_RATE} per second limit"
    assert windows and min(windows) >= GLOBAL_RATE * 0.9, f"whole windows {windows} of {GLOBAL_RATE}"
    if layout == "sliding_window_counter":
        assert keys == ["{erl:all}:counter"], "one hash per limiter, nothing else"
        assert memory <= 1024, f"{memory} B"
        assert stack.redis.client.pttl("{erl:all}:counter") <= INTERVAL_MS + INTERVAL_MS // 20
