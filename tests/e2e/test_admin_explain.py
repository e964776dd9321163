"""`erl-admin validate` and `erl-admin explain` against what stock Envoy with the filter does.

- validate: a configuration Envoy refuses gets the very line Envoy logs (`edge-rate-limiter: invalid
  configuration: <field>: <reason>`) and exit status 1; one it loads, exit 0 and a summary.
- explain: after requests through Envoy until a rule rejects, `explain` of the same request names the
  rules and limiters that Redis holds, the rule that rejected (`x-ratelimited-by`) and a wait that matches
  `Retry-After`; once that wait is over, it says allowed and Envoy lets the request through. Exemptions
  and shadow rules are explained as Envoy treats them, and `--cluster` reads each limiter on its master.

The Envoys here name their routes (`login` for /login, `default` for the rest), which the filter reads as
`xds.route_name` for `_rules_` selection; the stock template's route has no name. The binary is built
outside the tests (`cargo build -p erl-admin`), as for test_admin.py.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from harness import AdminResult, Envoy, Redis, Response, Stack, clock_guard, epoch_ms, erl_admin, plugin_config, rule
from redis_cluster import RedisCluster
from redisson_client import OVERALL, PER_CLIENT, RateLimiter

REFUSAL = "edge-rate-limiter: invalid configuration: "
_names = itertools.count(1)

# A header-keyed rule and a global rule; the route `login` has its own per-IP rule (and the same global one).
CONFIG = plugin_config(
    rule("per-user", rate=3, interval="4s"),
    rule("everyone", limit_by="global", rate=100, interval="4s"),
    _rules_=[{"_match_route_": ["login"],
              "rules": [rule("login", limit_by="client_ip", rate=2, interval="4s"),
                        rule("everyone", limit_by="global", rate=100, interval="4s")]}],
)


def routed_envoy(stack: Stack, config: dict) -> Envoy:
    """An Envoy with the filter whose routes have names (`login`: /login, `default`: the rest), started,
    and stopped with the test's other gateways."""
    envoy = Envoy(stack.workdir, config, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                  name=f"explain-{next(_names)}")
    bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["route_config"]["virtual_hosts"][0]["routes"] = [
        {"name": "login", "match": {"prefix": "/login"}, "route": {"cluster": "upstream"}},
        {"name": "default", "match": {"prefix": "/"}, "route": {"cluster": "upstream"}},
    ]
    envoy.yaml_path.write_text(yaml.safe_dump(bootstrap))
    stack.envoys.append(envoy)
    return envoy.start()


def config_file(stack: Stack, config: dict | str) -> Path:
    """The configuration as a file, byte for byte what the Envoys of this module get."""
    path = stack.workdir / f"plugin-{next(_names)}.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def admin(redis: Redis | None, *args: str) -> AdminResult:
    result = erl_admin(redis, *args)
    assert result.code == 0, f"erl-admin {' '.join(args)} exited {result.code}: {result.stderr}{result.stdout}"
    return result


def explain(stack: Stack, config: Path, *request: str) -> dict:
    return admin(stack.redis, "explain", str(config), *request, "--json").json()


def limiters_in_redis(stack: Stack) -> set[str]:
    """The limiter names in Redis: the config hashes (their value and permits keys start with `{`)."""
    client = stack.redis.client
    return {key.decode() for key in client.keys("erl:*") if client.type(key) == b"hash"}


class Rejection(NamedTuple):
    """The first rejected response, when its request was sent (epoch ms), and the statuses before it."""

    response: Response
    sent_ms: float
    allowed: list[int]


def send_until_rejected(envoy: Envoy, path: str, headers: dict[str, str], most: int = 10) -> Rejection:
    allowed = []
    for _ in range(most):
        sent_ms = epoch_ms()
        response = envoy.send(path, headers=headers)
        if response.status != 200:
            return Rejection(response, sent_ms, allowed)
        allowed.append(response.status)
    raise AssertionError(f"no rejection in {most} requests")


def assert_wait_matches(report: dict, rejection: Rejection) -> None:
    """explain's wait against Envoy's `Retry-After`: whole seconds rounded up from Redisson's delay and the
    gateway's clock guard (3 ms and 20 ms past the oldest permit's departure), decided before explain read
    the window, by at most `late` s."""
    retry_after = int(rejection.response.headers["retry-after"])
    late = (report["now_ms"] - rejection.sent_ms) / 1000
    assert report["wait_ms"] is not None, report
    wait = report["wait_ms"] / 1000
    assert abs(wait - retry_after) <= 1 + late + 0.01, (wait, retry_after, late)
    assert retry_after - 1 - math.ceil(late) <= report["retry_after_s"] <= retry_after, \
        (report["retry_after_s"], retry_after, late)


def test_explain_names_the_rules_limiters_and_wait_of_a_rejection_and_then_allows(stack):
    envoy = routed_envoy(stack, CONFIG)
    path = config_file(stack, CONFIG)
    alice = {"x-user-id": "alice"}
    rejection = send_until_rejected(envoy, "/", alice)
    assert (rejection.allowed, rejection.response.status) == ([200] * 3, 429)
    assert rejection.response.headers["x-ratelimited-by"] == "per-user"

    report = explain(stack, path, "--header", "x-user-id: alice", "--path", "/", "--client-ip", "127.0.0.1")
    assert report["configuration"] == "global"
    assert [(r["rule"], r["applies"]) for r in report["rules"]] == [("per-user", "limiter"), ("everyone", "limiter")]
    assert {r["limiter"] for r in report["rules"]} == limiters_in_redis(stack) == {"erl:per-user:alice",
                                                                                   "erl:everyone"}
    assert (report["verdict"], report["status"], report["rejected_by"]) == ("rejected", 429, "per-user")
    assert_wait_matches(report, rejection)
    per_user, everyone = report["rules"]
    assert (per_user["verdict"], per_user["mode"], per_user["rate"], per_user["interval_ms"]) == \
        ("rejected", "enforce", 3, 4000)
    [window] = per_user["windows"]
    assert (window["available"], window["window"]["permits"]) == (0, 3)
    # All or nothing: the rejected request took no permit from the global rule either.
    assert (everyone["verdict"], everyone["remaining"], everyone["windows"][0]["window"]["permits"]) == \
        ("allowed", 96, 3)

    text = admin(stack.redis, "explain", str(path), "-H", "x-user-id:alice").stdout
    assert text.startswith("configuration  global\nverdict        rejected (429) by per-user: allowed in "), text
    assert "  limiter      erl:per-user:alice\n" in text and "  available    0 of 3\n" in text

    time.sleep((report["wait_ms"] + 100) / 1000)
    again = explain(stack, path, "--header", "x-user-id:alice")
    assert (again["verdict"], again["rejected_by"], again["wait_ms"]) == ("allowed", None, None)
    # The permits taken within the same few ms may all have left by now: at least the oldest has.
    available = again["rules"][0]["windows"][0]["available"]
    assert 1 <= available <= 3 and again["remaining"] == available - 1
    assert envoy.send("/", headers=alice).status == 200
    assert stack.redis.client.hget("erl:per-user:alice", "rate") == b"3", "explain wrote nothing"


def test_explain_follows_the_route_to_its_match_rule(stack):
    envoy = routed_envoy(stack, CONFIG)
    path = config_file(stack, CONFIG)
    rejection = send_until_rejected(envoy, "/login", {})
    assert (rejection.allowed, rejection.response.status) == ([200] * 2, 429)
    assert rejection.response.headers["x-ratelimited-by"] == "login"

    report = explain(stack, path, "--route", "login", "--path", "/login", "--client-ip", "127.0.0.1:40000")
    assert report["configuration"] == "_rules_[0]"
    assert [r["limiter"] for r in report["rules"]] == ["erl:login:127.0.0.1", "erl:everyone"]
    assert {r["limiter"] for r in report["rules"]} == limiters_in_redis(stack)
    assert report["rejected_by"] == "login"
    assert_wait_matches(report, rejection)

    # Another route: the global rules, where a request without x-user-id meets only the global one.
    other = explain(stack, path, "--route", "default", "--client-ip", "127.0.0.1")
    assert other["configuration"] == "global"
    assert [(r["rule"], r["applies"], r["verdict"]) for r in other["rules"]] == [
        ("per-user", "no-key", "skipped"), ("everyone", "limiter", "allowed")]
    assert (other["verdict"], other["remaining"]) == ("allowed", 100 - 2 - 1)
    assert envoy.send("/", headers={}).status == 200


def test_explain_of_a_configuration_that_selects_nothing_is_unlimited(stack):
    # Only `_rules_`, no global fields: requests no match rule selects are not limited.
    only_login = {"_rules_": [{"_match_route_": ["login"], **plugin_config(rule("login"))}]}
    report = explain(stack, config_file(stack, only_login), "--route", "default", "-H", "x-user-id:alice")
    assert (report["configuration"], report["verdict"], report["rules"]) == (None, "unlimited", [])


BROKEN = {
    "rate-zero": plugin_config(rule(rate=0)),
    "unknown-field": plugin_config(rule(), burst_size=3),
    "duplicate-rule": plugin_config(rule(), rule()),
    "host-transport-in-the-envoy-build": plugin_config(rule(), redis={"transport": "host"}),
    "match-rule": plugin_config(rule(), _rules_=[{"_match_route_": ["r"], "rules": [rule(interval=0)]}]),
    "not-json": "{\"redis\": ",
    "regex-in-a-build-without": plugin_config(rule(rates_by_value=[{"regex": "^vip", "rate": 10}])),
}


def envoy_refusal(stack: Stack, config: dict | str) -> str:
    """The refusal Envoy logs loading `config` (`envoy --mode validate`: the plugin is loaded and
    configured, nothing served)."""
    envoy = Envoy(stack.workdir, config, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                  name=f"validate-{next(_names)}")
    code, output = envoy.validate()
    assert code != 0, output[-2000:]
    lines = [line for line in output.splitlines() if REFUSAL in line]
    assert lines, output[-2000:]
    return REFUSAL + lines[0].split(REFUSAL, 1)[1]


@pytest.mark.parametrize("config", BROKEN.values(), ids=BROKEN.keys())
def test_validate_prints_the_refusal_envoy_logs_and_exits_1(stack, config):
    path = config_file(stack, config)
    logged = envoy_refusal(stack, config)

    result = erl_admin(None, "validate", str(path))
    assert (result.code, result.stdout, result.stderr) == (1, logged + "\n", "")
    as_json = erl_admin(None, "validate", str(path), "--json")
    assert as_json.code == 1
    assert as_json.json() == {"valid": False, "build": "envoy", "error": logged, "configurations": []}


def test_validate_summarizes_a_configuration_envoy_loads(stack):
    path = config_file(stack, CONFIG)
    code, output = Envoy(stack.workdir, CONFIG, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                         name=f"validate-{next(_names)}").validate()
    assert code == 0, output[-2000:]

    assert admin(None, "validate", str(path)).stdout.splitlines() == [
        "valid: 2 configurations (envoy build)",
        "global: redis cluster webdis (http); failure_mode allow",
        "  per-user  header x-user-id  3 per 4s    enforce",
        "  everyone  global            100 per 4s  enforce",
        "_rules_[0]: routes login; redis cluster webdis (http); failure_mode allow",
        "  login     client_ip  2 per 4s    enforce",
        "  everyone  global     100 per 4s  enforce",
    ]
    summary = admin(None, "validate", str(path), "--json").json()
    assert summary["valid"] is True
    assert [c["name"] for c in summary["configurations"]] == ["global", "_rules_[0]"]
    assert summary["configurations"][1]["rules"][0]["limit_by"] == "client_ip"
    # Higress's transport is the Higress build's.
    host = config_file(stack, plugin_config(rule(), redis={"transport": "host"}))
    assert admin(None, "validate", str(host), "--build", "higress").stdout.startswith("valid: 1 configuration")


# A configuration-wide exemption, a rule's own exemption and a shadow rule.
EXEMPT_AND_SHADOW = plugin_config(
    rule("per-user", rate=2, interval="1m", exempt={"headers": {"x-user-id": ["ops"]}}),
    rule("trial", limit_by="global", rate=1, interval="1m", mode="shadow"),
    exempt={"headers": {"x-internal": ["yes"]}},
    shadow_headers=True,
)


def test_explain_says_exempt_and_what_a_shadow_rule_would_reject(stack):
    envoy = routed_envoy(stack, EXEMPT_AND_SHADOW)
    path = config_file(stack, EXEMPT_AND_SHADOW)

    internal = {"x-internal": "yes", "x-user-id": "carol"}
    assert [envoy.send("/", headers=internal).status for _ in range(3)] == [200] * 3
    assert stack.redis.client.keys("*") == [], "no rule looked at the exempt requests"
    report = explain(stack, path, "-H", "x-internal:yes", "-H", "x-user-id:carol")
    assert (report["configuration"], report["verdict"], report["rules"]) == ("global", "exempt", [])
    assert "verdict        exempt: " in admin(stack.redis, "explain", str(path), "-H", "x-internal:yes").stdout

    bob = {"x-user-id": "bob"}
    assert envoy.send("/", headers=bob).status == 200
    report = explain(stack, path, "-H", "x-user-id:bob")
    assert (report["verdict"], report["remaining"], report["shadow_rejected_by"]) == ("allowed", 0, ["trial"])
    trial = report["rules"][1]
    assert (trial["rule"], trial["mode"], trial["limiter"], trial["verdict"]) == \
        ("trial", "shadow", "erl:trial", "rejected")
    # Envoy agrees: the shadow rule would reject, the request goes on.
    response = envoy.send("/", headers=bob)
    assert (response.status, response.headers.get("x-shadow-ratelimited-by")) == (200, "trial")
    assert {r["limiter"] for r in report["rules"]} == limiters_in_redis(stack)

    # The rule's own exemption: per-user leaves ops alone; only the shadow rule is left, and it never rejects.
    ops = explain(stack, path, "-H", "x-user-id:ops")
    assert [(r["rule"], r["applies"], r["verdict"]) for r in ops["rules"]] == [
        ("per-user", "exempt", "skipped"), ("trial", "limiter", "rejected")]
    assert (ops["verdict"], ops["rejected_by"], ops["shadow_rejected_by"]) == ("allowed", None, ["trial"])
    assert envoy.send("/", headers={"x-user-id": "ops"}).status == 200
    text = admin(stack.redis, "explain", str(path), "-H", "x-user-id:ops").stdout
    assert "rule per-user (enforce): 2 per 1m: skipped: the rule's exempt matches\n" in text
    assert "shadow         would be rejected by trial (shadow: not enforced)\n" in text


def test_explain_reads_limiters_on_every_master_of_a_redis_cluster(tmp_path):
    """`--cluster`: each limiter read from its own master, per-client windows found by a scan of all."""
    config = plugin_config(rule("per-user", rate=3, interval="1m"),
                           rule("per-gateway", limit_by="global", rate=2, interval="1m", type="per_client"))
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps(config))
    with RedisCluster(tmp_path, masters=3) as cluster:
        seeds = ",".join(f"redis://{host}:{port}" for host, port in cluster.seeds)

        def explain_on_cluster(user: str) -> dict:
            result = erl_admin(None, "--cluster", "--url", seeds, "explain", str(path), "-H", f"x-user-id:{user}",
                               "--json")
            assert result.code == 0, result.stderr
            return result.json()

        users: dict[int, str] = {}
        for index in itertools.count():
            users.setdefault(cluster.master_of(f"erl:per-user:u{index}"), f"u{index}")
            if len(users) == len(cluster.master_ports()):
                break
        gateway = RateLimiter(cluster.client, "erl:per-gateway")
        gateway.try_set_rate(PER_CLIENT, 2, 60_000)
        assert gateway.try_acquire().acquired
        for taken, user in enumerate(sorted(users.values()), start=1):
            redisson = RateLimiter(cluster.client, f"erl:per-user:{user}")
            redisson.try_set_rate(OVERALL, 3, 60_000, 3_600_000)
            for _ in range(taken):
                assert redisson.try_acquire().acquired

            report = explain_on_cluster(user)
            per_user, per_gateway = report["rules"]
            assert (per_user["limiter"], per_user["windows"][0]["available"]) == (f"erl:per-user:{user}", 3 - taken)
            [window] = per_gateway["windows"]
            assert (window["client_id"], window["available"]) == (gateway.client_id, 1)
            if taken < 3:
                assert (report["verdict"], report["remaining"]) == ("allowed", 0)
            else:
                assert (report["verdict"], report["rejected_by"]) == ("rejected", "per-user")
                assert 55_000 < report["wait_ms"] <= 60_000 + clock_guard(60_000), "a minute and the gateway's guard"
