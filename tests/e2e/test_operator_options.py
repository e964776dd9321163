"""What operators ask for, end to end in real Envoy (docs/configuration.md, "Shadow mode", "Richer keys",
"Exemptions"; docs/operating.md, "Metrics"): shadow rules that count but never reject, per-rule counters,
the rejecting rule in the access log (filter state), composite keys, IP prefixes, per-value rates (exact
values in the stock build, regular expressions in the -regex build) and exemptions; each checked in what the
client sees, Envoy's stats and access log, and the limiters Redis holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import harness as h

REGEX_WASM = h.REPO / "dist" / "edge-rate-limiter-envoy-regex.wasm"
ACCESS_FORMAT = ("%REQ(X-USER-ID)% %RESPONSE_CODE% rejected_by=%FILTER_STATE(wasm.edge_rate_limiter.rejected_by:PLAIN)%"
                 " shadow=%FILTER_STATE(wasm.edge_rate_limiter.shadow_rejected_by:PLAIN)%\n")


def logged_envoy(stack: h.Stack, plugin: dict, *, wasm: Path = h.WASM) -> tuple[h.Envoy, Path]:
    """An Envoy of the stack whose access log names the rule that rejected each request (filter state)."""
    stack._count += 1
    envoy = h.Envoy(stack.workdir, plugin, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                    wasm=wasm, name=f"envoy-{stack._count}")
    log = stack.workdir / f"{envoy.name}-access.log"
    bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
    [listener] = bootstrap["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    manager["access_log"] = [{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(log),
            "log_format": {"text_format_source": {"inline_string": ACCESS_FORMAT}},
        },
    }]
    envoy.yaml_path.write_text(json.dumps(bootstrap))
    stack.envoys.append(envoy)
    return envoy.start(), log


def access_lines(log: Path, count: int) -> list[str]:
    """The first `count` lines of an access log, waiting for Envoy to write them."""
    def written() -> list[str] | None:
        lines = log.read_text().splitlines() if log.exists() else []
        return lines[:count] if len(lines) >= count else None

    return h.wait_until(written, 5.0, f"{count} access log lines")


def rule_stats(envoy: h.Envoy, rule: str) -> dict[str, int]:
    prefix = f"wasmcustom.edge_rate_limiter.rule.{rule}."
    stats = envoy.stats(filter=f"edge_rate_limiter.rule.{rule}.")
    return {name.removeprefix(prefix): value for name, value in stats.items()}


def test_a_shadow_rule_counts_and_names_what_it_would_reject_but_never_rejects(stack: h.Stack) -> None:
    plugin = h.plugin_config(
        h.rule("enforced", rate=3, interval="10s"),
        h.rule("trial", limit_by="global", rate=2, interval="10s", mode="shadow"),
        shadow_headers=True,
    )
    envoy, log = logged_envoy(stack, plugin)
    answers = [envoy.send(headers={"x-user-id": "alice"}) for _ in range(4)]
    assert [a.status for a in answers] == [200, 200, 200, 429], "only the enforced rule rejects"
    assert [a.headers.get("x-shadow-ratelimited-by") for a in answers[:3]] == [None, None, "trial"]
    assert "\"trial\";r=0" in answers[2].headers["ratelimit"], "shadow_headers: the shadow quota shows"
    assert answers[3].headers["x-ratelimited-by"] == "enforced"
    lines = access_lines(log, 4)
    assert lines[2] == "alice 200 rejected_by=- shadow=trial", lines
    assert lines[3].startswith("alice 429 rejected_by=enforced"), lines
    # The 4th request, rejected by the enforced rule, is one trial would reject too (its limiter is full).
    assert rule_stats(envoy, "trial") == {"allowed": 2, "shadow_rejected": 2, "rejected": 0,
                                          "local_rejected": 0, "failures": 0}
    enforced = rule_stats(envoy, "enforced")
    assert (enforced["allowed"], enforced["rejected"]) == (3, 1)
    # The shadow limiter holds the permits of the requests that went on, as an enforced one would (the
    # rejected request took none: all or nothing).
    permits = stack.redis.client.zcard(h.limiter_key("erl:trial", "permits"))
    assert permits == 2, permits


def test_global_shadow_mode_rejects_nothing_and_counts_per_rule(stack: h.Stack) -> None:
    envoy = stack.envoy(h.plugin_config(h.rule("per-user", rate=2, interval="10s"), mode="shadow"))
    statuses = [envoy.send(headers={"x-user-id": "bob"}).status for _ in range(5)]
    assert statuses == [200] * 5
    stats = rule_stats(envoy, "per-user")
    assert (stats["allowed"], stats["shadow_rejected"]) == (2, 3), stats
    assert envoy.stats()["wasmcustom.edge_rate_limiter.allowed"] == 5


def test_composite_keys_and_ip_prefixes_name_one_limiter_per_combination_and_network(stack: h.Stack) -> None:
    plugin = h.plugin_config(
        h.rule("combo", limit_by=[{"header": "x-user-id"}, "path"], rate=1, interval="10s"),
        h.rule("net", limit_by={"x_forwarded_for": {"hops": 1, "ipv4_prefix": 24, "ipv6_prefix": 48}},
               rate=2, interval="10s"),
    )
    envoy = stack.envoy(plugin)

    def send(user: str, path: str, xff: str) -> int:
        return envoy.send(path, headers={"x-user-id": user, "x-forwarded-for": xff}).status

    assert send("ann", "/a", "10.1.2.3") == 200
    assert send("ann", "/b", "10.1.2.99") == 200, "another path is another combination"
    assert send("ann", "/a", "10.1.3.1") == 429, "the combination (ann, /a) is spent"
    assert send("ben", "/a", "10.1.2.7") == 429, "the network 10.1.2.0/24 is spent by .3 and .99"
    assert send("ben", "/c", "2001:db8:1:2::5") == 200
    names = {key.decode() for key in stack.redis.client.keys("erl:*")}
    assert {"erl:combo:ann:/a", "erl:combo:ann:/b", "erl:net:10.1.2.0/24", "erl:net:10.1.3.0/24",
            "erl:net:2001:db8:1::/48"} <= names, names
    assert stack.redis.client.hget("erl:combo:ann:/a", "rate") == b"1"


def test_rates_by_value_give_listed_values_their_own_rate(stack: h.Stack) -> None:
    plugin = h.plugin_config(h.rule("tenant", limit_by={"header": "x-tenant"}, rate=1, interval="10s",
                                    rates_by_value=[{"values": ["gold", "platinum"], "rate": 3}]))
    envoy = stack.envoy(plugin)

    def admitted(tenant: str) -> int:
        return sum(envoy.send(headers={"x-tenant": tenant}).status == 200 for _ in range(5))

    assert (admitted("gold"), admitted("bronze"), admitted("platinum")) == (3, 1, 3)
    assert stack.redis.client.hget("erl:tenant:gold", "rate") == b"3"
    assert stack.redis.client.hget("erl:tenant:bronze", "rate") == b"1"


def test_a_regex_is_refused_by_the_stock_build_and_applied_by_the_regex_build(stack: h.Stack) -> None:
    plugin = h.plugin_config(h.rule("tenant", limit_by={"header": "x-tenant"}, rate=1, interval="10s",
                                    rates_by_value=[{"regex": "^silver-[0-9]+$", "rate": 2}]))
    refused = stack.envoy(plugin, wait_ready=False)
    h.wait_until(lambda: "this build has no regular expressions" in refused.log_text(), 20.0,
                 "the stock build's refusal")
    assert "rules[0].rates_by_value[0].regex" in refused.log_text()
    refused.stop()
    if not REGEX_WASM.is_file():
        pytest.fail(f"{REGEX_WASM} is missing: make build builds it")
    envoy = stack.envoy(plugin, wasm=REGEX_WASM)
    silver = [envoy.send(headers={"x-tenant": "silver-7"}).status for _ in range(3)]
    other = [envoy.send(headers={"x-tenant": "silver-x"}).status for _ in range(2)]
    assert (silver, other) == ([200, 200, 429], [200, 429])


def test_exemptions_skip_the_whole_request_or_one_rule(stack: h.Stack) -> None:
    plugin = h.plugin_config(
        h.rule("per-user", rate=1, interval="10s", exempt={"headers": {"x-plan": ["internal"]}}),
        h.rule("everyone", limit_by="global", rate=3, interval="10s"),
        exempt={"client_ips": ["192.0.2.0/24"], "headers": {"x-health": ["1"]}},
    )
    envoy = stack.envoy(plugin)
    health = [envoy.send(headers={"x-user-id": "cy", "x-health": "1"}).status for _ in range(5)]
    assert health == [200] * 5
    assert envoy.stats()["wasmcustom.edge_rate_limiter.exempt"] == 5
    assert stack.redis.client.keys("erl:*") == [], "exempt requests touch no limiter"
    internal = [envoy.send(headers={"x-user-id": "cy", "x-plan": "internal"}).status for _ in range(4)]
    assert internal == [200, 200, 200, 429], "per-user is skipped; the global rule still applies"
    assert envoy.send(headers={"x-user-id": "dee"}).status == 429


def test_the_higress_build_shadows_exempts_and_keys_alike_in_the_emulator(stack: h.Stack) -> None:
    plugin = h.host_plugin_config(
        h.rule("combo", limit_by=[{"header": "x-user-id"}, "path"], rate=1, interval="10s", mode="shadow"),
        h.rule("tenant", limit_by={"header": "x-tenant"}, rate=1, interval="10s",
               rates_by_value=[{"values": ["gold"], "rate": 2}], exempt={"headers": {"x-plan": ["internal"]}}),
        shadow_headers=True,
    )
    emulator = stack.emulator(plugin, vms=1)
    answers = [emulator.send("/a", headers={"x-user-id": "eve", "x-tenant": "gold"}) for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 429]
    assert answers[1].headers.get("x-shadow-ratelimited-by") == "combo"
    assert emulator.send("/a", headers={"x-user-id": "eve", "x-tenant": "gold", "x-plan": "internal"}).status == 200
    metrics = emulator.metrics()
    assert (metrics["rule.combo.shadow_rejected"], metrics["rule.tenant.rejected"]) == (3, 1), metrics
    assert stack.redis.client.hget("erl:tenant:gold", "rate") == b"2"
    assert stack.redis.client.exists("erl:combo:eve:/a")
