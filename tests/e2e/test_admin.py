"""The operator tool `erl-admin` on limiters the filter made through Envoy, and its errors.

The binary is built outside the tests (`cargo build -p erl-admin`; `make test` does it): the tests use
`target/debug/erl-admin`, or `$ERL_ADMIN_BIN`.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from harness import (
    METRIC_PREFIX,
    AdminResult,
    Redis,
    erl_admin,
    epoch_ms,
    free_port,
    limiter_key,
    plugin_config,
    rule,
    user,
    wait_until,
)
from timing import RealClock, permit_scores

ALICE = "erl:per-user:alice"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def admin(redis: Redis, *args: str) -> AdminResult:
    """`erl-admin` on this Redis; fails the test with its output unless it exits 0."""
    result = erl_admin(redis, *args)
    assert result.code == 0, f"erl-admin {' '.join(args)} exited {result.code}: {result.stderr}{result.stdout}"
    return result


def failing(redis: Redis | None, *args: str, **kwargs) -> AdminResult:
    """`erl-admin` expected to fail: exit code 1, one error line on stderr."""
    result = erl_admin(redis, *args, **kwargs)
    assert result.code == 1, f"erl-admin {' '.join(args)} exited {result.code}: {result.stderr}{result.stdout}"
    assert result.stderr.startswith("erl-admin: error: "), result.stderr
    return result


def test_show_reports_config_available_permits_window_and_ttls_of_a_limiter_the_filter_made(stack):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m")))
    before_ms = epoch_ms()
    assert [envoy.send(headers=user("alice")).status for _ in range(3)] == [200, 200, 200]
    after_ms = epoch_ms()

    report = admin(stack.redis, "show", ALICE, "--json").json()
    assert report["name"] == ALICE
    assert report["config"] == {"rate": 5, "interval_ms": 60000, "type": "overall", "keep_alive_ms": 3600000}
    state = report["state"]
    assert state["available"] == 2
    window = state["window"]
    assert (window["acquires"], window["permits"], window["unreadable"]) == (3, 3, 0)
    assert before_ms - 1000 <= window["oldest_ms"] <= window["newest_ms"] <= after_ms + 1000
    # Ages by erl-admin's clock, read after the requests: within the 1 minute window however slow the machine.
    assert 0 <= window["newest_age_ms"] <= window["oldest_age_ms"] < 60_000
    assert 0 < report["config_ttl_ms"] <= 3_600_000
    assert {ttl["key"] for ttl in state["ttl"]} == {limiter_key(ALICE, "value"), limiter_key(ALICE, "permits")}
    assert all(0 < ttl["ttl_ms"] <= 3_600_000 for ttl in state["ttl"])
    assert report["clients"] == []

    text = admin(stack.redis, "show", ALICE).stdout
    assert f"limiter      {ALICE}\n" in text
    assert "rate         5 per 60000 ms (1m)\n" in text
    assert "keepAlive    3600000 ms (1h)\n" in text
    assert "available    2 of 5\n" in text
    assert "in window    3 permits in 3 acquires (last 1m)\n" in text
    assert re.search(r"oldest +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \(\d+ms ago\)", text), text
    # show changed nothing the filter counts on.
    assert envoy.send(headers=user("alice")).status == 200
    assert stack.redis.client.get(limiter_key(ALICE, "value")) == b"1"


def test_set_rate_resets_the_limiter_so_the_filter_allows_again_at_once(stack):
    # No local block: it would hold alice's rejection for up to local_block_max (test_local_block.py).
    envoy = stack.envoy(plugin_config(rule(rate=3, interval="1m", local_block_max=0)))
    assert [envoy.send(headers=user("alice")).status for _ in range(4)] == [200, 200, 200, 429]

    report = admin(stack.redis, "set-rate", ALICE, "--rate", "3", "--interval", "1m", "--json").json()
    assert report["config"] == {"rate": 3, "interval_ms": 60000, "type": "overall", "keep_alive_ms": 0}
    redis = stack.redis.client
    assert not redis.exists(limiter_key(ALICE, "permits"), limiter_key(ALICE, "value"))
    assert redis.pttl(ALICE) == -1, "keep-alive 0: the config no longer expires"

    assert [envoy.send(headers=user("alice")).status for _ in range(4)] == [200, 200, 200, 429]


def test_update_rate_keeps_consumed_permits_so_raising_the_rate_causes_no_burst(stack):
    envoy = stack.envoy(plugin_config(rule(rate=3, interval="1m", local_block_max=0)))
    assert [envoy.send(headers=user("alice")).status for _ in range(4)] == [200, 200, 200, 429]

    text = admin(stack.redis, "update-rate", ALICE, "--rate", "5").stdout
    assert text == f"{ALICE}: rate updated, consumed permits kept: 5 per 1m (overall, keepAlive 1h)\n"

    # 3 of the 5 permits are still taken: exactly 2 more pass through Envoy.
    assert [envoy.send(headers=user("alice")).status for _ in range(3)] == [200, 200, 429]
    assert stack.redis.client.hget(ALICE, "rate") == b"5"


def test_show_and_update_rate_leave_the_value_key_expiring_with_the_limiter(stack):
    envoy = stack.envoy(plugin_config(rule(rate=2, interval="1s")))
    assert [envoy.send(headers=user("alice")).status for _ in range(2)] == [200, 200]
    # Both permits leave the window: show's availablePermits releases them (a SET). erl-admin's clock cannot
    # be moved (local or Redis TIME), so the test sleeps until 100 ms past the newer permit's end of window; a
    # sleep is only a lower bound, a loaded machine cannot make it too short.
    RealClock().wait_until_ms(max(permit_scores(stack.redis.client, ALICE)) + 1000 + 100)

    assert admin(stack.redis, "show", ALICE, "--json").json()["state"]["available"] == 2
    assert 0 < stack.redis.client.pttl(limiter_key(ALICE, "value")) <= 3_600_000
    admin(stack.redis, "update-rate", ALICE, "--rate", "4")
    assert 0 < stack.redis.client.pttl(limiter_key(ALICE, "value")) <= 3_600_000


def test_update_rate_of_a_limiter_that_does_not_exist_fails_and_creates_nothing(stack):
    result = failing(stack.redis, "update-rate", "erl:nobody", "--rate", "5")
    assert result.stderr == "erl-admin: error: no limiter named erl:nobody (no config hash)\n"
    assert stack.redis.client.keys("*") == []


def test_try_set_rate_creates_a_limiter_once_and_never_overwrites_it(stack):
    created = admin(stack.redis, "try-set-rate", "erl:orders", "--rate", "10", "--interval", "1s",
                    "--keep-alive", "1h", "--json").json()
    assert created["changed"] is True
    assert created["config"] == {"rate": 10, "interval_ms": 1000, "type": "overall", "keep_alive_ms": 3600000}
    assert 0 < stack.redis.client.pttl("erl:orders") <= 3_600_000

    kept = admin(stack.redis, "try-set-rate", "erl:orders", "--rate", "99", "--interval", "1m")
    assert kept.stdout == "erl:orders: exists, left as it is: 10 per 1s (overall, keepAlive 1h)\n"
    assert stack.redis.client.hget("erl:orders", "rate") == b"10"


def test_delete_removes_every_key_and_the_filter_starts_afresh(stack):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m")))
    assert [envoy.send(headers=user("alice")).status for _ in range(3)] == [200, 200, 200]

    assert admin(stack.redis, "delete", ALICE, "--json").json() == {"name": ALICE, "keys_removed": 3}
    assert stack.redis.client.keys("*") == []

    again = envoy.send(headers=user("alice"))
    assert again.status == 200
    assert again.headers["ratelimit"].startswith('"per-user";r=4;')

    result = failing(stack.redis, "delete", "erl:nobody")
    assert result.stderr == "erl-admin: error: no limiter named erl:nobody (no config hash)\n"


def test_list_shows_the_limiters_whose_name_starts_with_a_prefix(stack):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m")))
    for name, requests in (("alice", 2), ("bob", 1)):
        for _ in range(requests):
            assert envoy.send(headers=user(name)).status == 200
    admin(stack.redis, "try-set-rate", "other:thing", "--rate", "7", "--interval", "2s")
    redis = stack.redis.client
    redis.hset("erl:not-a-limiter", "foo", "bar")
    redis.hset("erl:half", "rate", "1")  # no interval
    redis.set("erl:a-string", "x")

    listed = admin(stack.redis, "list", "--json").json()
    assert [(entry["name"], entry["available"]) for entry in listed] == [("erl:per-user:alice", 3),
                                                                           ("erl:per-user:bob", 4)]
    assert listed[0]["config"] == {"rate": 5, "interval_ms": 60000, "type": "overall", "keep_alive_ms": 3600000}

    assert admin(stack.redis, "list", "erl:per-user:a").stdout.splitlines() == [
        "NAME                RATE  TYPE     KEEPALIVE  AVAILABLE",
        "erl:per-user:alice  5/1m  overall  1h         3",
    ]
    assert [entry["name"] for entry in admin(stack.redis, "list", "other:", "--json").json()] == ["other:thing"]
    # The prefix is literal: glob characters match only themselves.
    assert admin(stack.redis, "list", "erl:per-user:*", "--json").json() == []


def test_per_client_limiters_show_their_clients_and_update_every_one(stack):
    envoy = stack.envoy(plugin_config(rule(rate=4, interval="1m", type="per_client")))
    assert [envoy.send(headers=user("alice")).status for _ in range(3)] == [200, 200, 200]

    report = admin(stack.redis, "show", ALICE, "--json").json()
    assert report["config"]["type"] == "per-client"
    assert report["state"] is None, "no --client-id: no single window to show"
    [client] = report["clients"]
    assert UUID.match(client["client_id"]), client
    assert (client["available"], client["window"]["permits"]) == (1, 3)
    client_id = client["client_id"]
    assert stack.redis.client.exists(f"{limiter_key(ALICE, 'value')}:{client_id}")

    selected = admin(stack.redis, "show", ALICE, "--client-id", client_id, "--json").json()["state"]
    assert (selected["client_id"], selected["available"], selected["window"]["acquires"]) == (client_id, 1, 3)
    assert f"  {client_id}\n" in admin(stack.redis, "show", ALICE).stdout

    # Raised to 6 keeping state: the gateway's client has 3 more, not 6.
    update = admin(stack.redis, "update-rate", ALICE, "--rate", "6", "--json").json()
    assert update["clients_updated"] == 1
    assert [envoy.send(headers=user("alice")).status for _ in range(4)] == [200, 200, 200, 429]


def test_scripts_are_sent_again_after_redis_forgot_them(stack):
    envoy = stack.envoy(plugin_config(rule(rate=5, interval="1m")))
    assert envoy.send(headers=user("alice")).status == 200
    stack.redis.client.script_flush()
    evals_before = stack.redis.command_calls().get("eval", 0)

    assert admin(stack.redis, "show", ALICE, "--json").json()["state"]["available"] == 4
    assert stack.redis.command_calls().get("eval", 0) == evals_before + 1, "EVALSHA, NOSCRIPT, then EVAL once"


def test_the_url_comes_from_erl_redis_url_when_not_given(stack):
    admin(stack.redis, "try-set-rate", "erl:x", "--rate", "1", "--interval", "1s")
    result = erl_admin(None, "show", "erl:x", "--json", env={"ERL_REDIS_URL": stack.redis.url})
    assert result.code == 0, result.stderr
    assert result.json()["config"]["rate"] == 1


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ["show", "erl:nobody"], "no limiter named erl:nobody (no config hash)"),
        (lambda r: r.hset("erl:half", "type", "0"), ["show", "erl:half"],
         "limiter erl:half is not initialized (its hash has no rate field)"),
        (lambda r: r.set("erl:str", "x"), ["show", "erl:str"],
         "wrong type of key: erl:str is a string, but a limiter's config is a hash"),
        (lambda r: r.set("erl:str", "x"), ["delete", "erl:str"],
         "wrong type of key: erl:str is a string, but a limiter's config is a hash"),
        (lambda r: r.hset("erl:bad", mapping={"rate": "many", "interval": "1000", "type": "0"}), ["show", "erl:bad"],
         "limiter erl:bad has an invalid rate: \"many\""),
        (None, ["show", "erl:x", "--client-id", "gateway-1"],
         "invalid client id \"gateway-1\": expected a UUID (a Redisson client instance id)"),
        (None, ["set-rate", "erl:x", "--rate", "1", "--interval", "1m", "--keep-alive", "1s"],
         "keep-alive 1s is shorter than the interval 1m: use 0 (never expire) or at least the interval"),
    ],
    ids=["unknown", "uninitialized", "wrong-type", "delete-wrong-type", "invalid-field", "bad-client-id",
         "short-keep-alive"],
)
def test_errors_are_one_clear_line_and_exit_code_1(stack, setup, args, message):
    if setup is not None:
        setup(stack.redis.client)
    keys_before = sorted(stack.redis.client.keys("*"))

    result = failing(stack.redis, *args)
    assert result.stderr == f"erl-admin: error: {message}\n"
    assert result.stdout == ""
    assert sorted(stack.redis.client.keys("*")) == keys_before, "a failed command changes nothing"

    as_json = failing(stack.redis, *args, "--json")
    assert as_json.json() == {"error": message}


def test_an_unreachable_redis_is_named_by_its_url(stack):
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    result = failing(None, "--url", url, "--timeout", "2s", "show", ALICE)
    assert result.stderr.startswith(f"erl-admin: error: cannot reach Redis at redis://:***@127.0.0.1:"), result.stderr
    assert "secret" not in result.stderr
    # A refused connection fails at once; the bound is the 2 s timeout plus 3 s for starting the tool on a
    # loaded machine, and erl_admin() itself gives up on a hang after 30 s.
    assert time.monotonic() - started < 2 + 3


def test_usage_errors_exit_with_code_2(stack):
    assert erl_admin(stack.redis, "set-rate", ALICE, "--rate", "0", "--interval", "1m").code == 2
    assert erl_admin(stack.redis, "set-rate", ALICE, "--rate", "1", "--interval", "soon").code == 2
    assert erl_admin(stack.redis, "set-rate", ALICE, "--rate", "1", "--interval", "1m", "--type", "x").code == 2
    nothing = failing(stack.redis, "update-rate", ALICE)
    assert "nothing to change" in nothing.stderr


def test_show_lists_the_reservations_in_flight_and_the_settled_costs_of_rules_with_cost(stack):
    """Reserve, then settle (docs/configuration.md, "Costs known after the response") in real Envoy: the
    stack's upstream answers `upstream ok\\n` with `content-length: 12`, so a rule settling to that header
    settles each reservation of 100 to 12 (`-s` members), and one settling to an LLM usage finds none and
    keeps its reservations (`-r` members, counted in settled_without_usage)."""
    settled_rule = rule("settled", rate=1000, interval="1m",
                        cost={"reserve": 100, "settle": {"response_header": "content-length"}})
    kept_rule = rule("kept", rate=1000, interval="1m", cost={"reserve": 100, "settle": {"usage": "openai"}})
    envoy = stack.envoy(plugin_config(settled_rule, kept_rule))
    assert [envoy.send(headers=user("alice")).status for _ in range(2)] == [200, 200]
    wait_until(lambda: envoy.stats().get(METRIC_PREFIX + "settlements", 0) >= 2, 5.0, "the two settle calls")
    wait_until(lambda: len(stack.redis.client.zrange("{erl:settled:alice}:permits", 0, -1)) == 2
               and all(m[1:3] == b"-s" for m in stack.redis.client.zrange("{erl:settled:alice}:permits", 0, -1)),
               5.0, "the settle calls' replies")

    settled = admin(stack.redis, "show", "erl:settled:alice", "--json").json()["state"]
    assert settled["available"] == 1000 - 2 * 12, "each reservation of 100 settled to the 12 bytes it cost"
    window = settled["window"]
    assert (window["settled"]["count"], window["settled"]["permits"]) == (2, 24)
    assert window["reservations"]["count"] == 0

    kept = admin(stack.redis, "show", "erl:kept:alice", "--json").json()["state"]
    assert kept["available"] == 1000 - 2 * 100, "no usage in the body: the reservations stay"
    assert (kept["window"]["reservations"]["count"], kept["window"]["reservations"]["permits"]) == (2, 200)
    assert envoy.stats().get(METRIC_PREFIX + "settled_without_usage") == 2
    text = admin(stack.redis, "show", "erl:settled:alice").stdout
    assert "settled" in text, text


def test_show_and_explain_count_a_sliding_window_counter_as_the_filter_does(stack):
    config = plugin_config(rule(rate=3, interval="4s", layout="sliding_window_counter", local_block_max=0))
    path = stack.workdir / "counter-plugin.json"
    path.write_text(json.dumps(config))
    envoy = stack.envoy(config)
    assert [envoy.send(headers=user("alice")).status for _ in range(3)] == [200, 200, 200]
    rejected = envoy.send(headers=user("alice"))
    assert rejected.status == 429
    counter = "{" + ALICE + "}:counter"
    assert stack.redis.client.keys("*") == [counter.encode()], "one hash, no config hash"

    shown = admin(stack.redis, "show", ALICE, "--config", str(path), "--json").json()
    window = shown["window"]
    assert (window["layout"], window["key"], window["slices"]) == ("sliding_window_counter", counter, 20)
    assert (window["interval_ms"], window["width_ms"], window["interval_from"]) == (4000, 200, "rule")
    assert window["permits"] == sum(s["permits"] for s in window["counted"]) == 3
    fields = {int(k): int(v) for k, v in stack.redis.client.hgetall(counter).items()}
    assert {s["index"]: s["permits"] for s in window["counted"]} == fields, "every field, as Redis holds it"
    assert all(s["start_ms"] == s["index"] * 200 and 0 < s["leaves_in_ms"] <= 4200 for s in window["counted"])
    assert (shown["rule"], shown["left"]) == ({"name": "per-user", "rate": 3, "interval_ms": 4000}, 0)
    assert shown["next_permit_ms"] == window["counted"][0]["leaves_in_ms"], "when the oldest slice leaves"
    assert 0 < window["ttl_ms"] <= 4200

    inferred = admin(stack.redis, "show", ALICE, "--json").json()
    assert (inferred["window"]["interval_from"], inferred["window"]["width_ms"]) == ("inferred", 200)
    assert (inferred["window"]["permits"], inferred["rule"], inferred["left"]) == (3, None, None)
    text = admin(stack.redis, "show", ALICE, "--config", str(path)).stdout
    assert "layout       sliding window counter, 20 slices of 200ms\n" in text, text
    assert "rate         3 per 4s (rule per-user)\nleft         0 of 3\nnext permit  in " in text, text
    assert re.search(r"in window    3 permits in [123] slices? \(last 4s", text), text

    report = admin(stack.redis, "explain", str(path), "-H", "x-user-id:alice", "--json").json()
    assert (report["verdict"], report["rejected_by"], report["status"]) == ("rejected", "per-user", 429)
    [per_user] = report["rules"]
    assert (per_user["counter"]["permits"], per_user["windows"], per_user["effective"]) == (3, [], None)
    assert 0 < report["wait_ms"] <= shown["next_permit_ms"], "the same slices, read later"
    assert 1 <= report["retry_after_s"] <= int(rejected.headers["retry-after"])
    text = admin(stack.redis, "explain", str(path), "-H", "x-user-id:alice").stdout
    assert "  layout       sliding window counter, 20 slices of 200ms (no config in Redis: the rule's)\n" in text
    assert "  verdict      rejected: allowed in " in text, text

    time.sleep((report["wait_ms"] + 100) / 1000)
    again = admin(stack.redis, "explain", str(path), "-H", "x-user-id:alice", "--json").json()
    assert again["verdict"] == "allowed" and again["remaining"] == 2 - again["rules"][0]["counter"]["permits"]
    assert envoy.send(headers=user("alice")).status == 200, "Envoy agrees"

    assert "enforce, sliding window counter, 20 slices" in admin(stack.redis, "validate", str(path)).stdout
    assert [(e["name"], e["layout"]) for e in admin(stack.redis, "list", "--json").json()] == \
        [(ALICE, "sliding_window_counter")]
    refused = failing(stack.redis, "set-rate", ALICE, "--rate", "9", "--interval", "4s")
    assert "is a sliding window counter" in refused.stderr and "change the rule" in refused.stderr
    assert admin(stack.redis, "delete", ALICE, "--json").json() == {"name": ALICE, "keys_removed": 1}
    assert stack.redis.client.keys("*") == []


def test_show_and_explain_count_a_calendar_quota_as_the_filter_does(stack):
    # A zone whose offset (in seconds: a POSIX TZ rule) ends the local minute 12 s after the start: the
    # requests, show and explain all fall in one minute, and the next one comes without waiting for a clock.
    boundary_s = int(time.time()) + 12
    zone = f"<T>-0:00:{(60 - boundary_s % 60) % 60:02d}"
    per_minute = rule(rate=3, local_block_max=0, calendar={"period": "minute", "time_zone": zone})
    del per_minute["interval"]
    config = plugin_config(per_minute)
    path = stack.workdir / "calendar-plugin.json"
    path.write_text(json.dumps(config))
    envoy = stack.envoy(config)
    minute_ms = boundary_s * 1000 - 60_000
    assert epoch_ms() < boundary_s * 1000 - 6_000, "Envoy took too long to start"
    assert [envoy.send(headers=user("alice")).status for _ in range(3)] == [200, 200, 200]
    rejected = envoy.send(headers=user("alice"))
    assert rejected.status == 429 and 1 <= int(rejected.headers["retry-after"]) <= 12
    counter = "{" + ALICE + "}:counter"
    assert stack.redis.client.keys("*") == [counter.encode()], "one hash, no config hash"
    assert stack.redis.client.hgetall(counter) == {str(minute_ms).encode(): b"3"}, "the minute's start: 3 permits"

    shown = admin(stack.redis, "show", ALICE, "--config", str(path), "--json").json()
    window, current = shown["window"], shown["window"]["current"]
    assert (window["layout"], window["key"], window["period"], window["time_zone"]) == \
        ("calendar", counter, "minute", zone)
    assert (current["start_ms"], current["end_ms"], current["used"]) == (minute_ms, minute_ms + 60_000, 3)
    assert current["label"].startswith("minute ") and current["label"].endswith(f" in {zone}")
    assert shown["rule"] == {"name": "per-user", "rate": 3, "period": "minute", "time_zone": zone}
    assert (shown["left"], shown["next_permit_ms"]) == (0, current["ends_in_ms"])
    assert window["fields"] == [{"start_ms": minute_ms, "start": current["start"], "permits": 3, "role": "current"}]
    assert current["ends_in_ms"] < window["ttl_ms"] <= current["ends_in_ms"] + 1_000, "expires 1 s after its end"
    text = admin(stack.redis, "show", ALICE, "--config", str(path)).stdout
    assert f"layout       calendar quota, per minute in {zone}\n" in text, text
    assert "rate         3 per minute (rule per-user)\nleft         0 of 3\nnext permit  in " in text, text
    assert f"used         3 permits in this period (field {minute_ms})\n" in text, text
    bare = admin(stack.redis, "show", ALICE, "--json").json()
    assert (bare["rule"], bare["window"]["current"], bare["window"]["fields"][0]["role"]) == (None, None, "unknown")
    assert "each field is the start of a period" in admin(stack.redis, "show", ALICE).stdout

    report = admin(stack.redis, "explain", str(path), "-H", "x-user-id:alice", "--json").json()
    assert (report["verdict"], report["rejected_by"], report["status"]) == ("rejected", "per-user", 429)
    [per_user] = report["rules"]
    assert (per_user["calendar"]["current"]["used"], per_user["windows"], per_user["effective"]) == (3, [], None)
    assert 0 < report["wait_ms"] <= shown["next_permit_ms"], "the same period's end, read later"
    assert int(rejected.headers["retry-after"]) - 2 <= report["retry_after_s"] <= int(rejected.headers["retry-after"])
    text = admin(stack.redis, "explain", str(path), "-H", "x-user-id:alice").stdout
    assert f"rule per-user (enforce): 3 per minute ({zone})\n" in text, text
    assert f"  layout       calendar quota, per minute in {zone} (no config in Redis: the rule's)\n" in text
    assert "  verdict      rejected: allowed in " in text, text
    assert f"3 per minute ({zone})" in admin(stack.redis, "validate", str(path)).stdout
    refused = failing(stack.redis, "set-rate", ALICE, "--rate", "9", "--interval", "1m")
    assert "a calendar quota" in refused.stderr and "change the rule" in refused.stderr

    # The next minute (within the second the hash outlives it): the quota is whole again; the previous
    # minute's field stays, no longer counted, as the new write moves the expiry to the new minute's end.
    time.sleep(max(0, minute_ms + 60_150 - epoch_ms()) / 1000)
    assert envoy.send(headers=user("alice")).status == 200, "the explained wait was the minute's end"
    again = admin(stack.redis, "explain", str(path), "-H", "x-user-id:alice", "--json").json()
    assert (again["verdict"], again["remaining"]) == ("allowed", 1)
    after = admin(stack.redis, "show", ALICE, "--config", str(path), "--json").json()
    assert [(f["start_ms"], f["permits"], f["role"]) for f in after["window"]["fields"]] == \
        [(minute_ms, 3, "earlier"), (minute_ms + 60_000, 1, "current")]
    assert (after["left"], after["next_permit_ms"]) == (2, 0)
    assert "an earlier period: no longer counted" in admin(stack.redis, "show", ALICE, "--config", str(path)).stdout
    assert admin(stack.redis, "delete", ALICE, "--json").json() == {"name": ALICE, "keys_removed": 1}
