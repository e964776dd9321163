"""Higress per-route and per-domain configuration (`matchRules`, passed to the plugin as `_rules_`), with
the Higress build in the host emulator: a route match beats a domain match beats the global rules."""

from __future__ import annotations

import pytest

from harness import host_plugin_config, plugin_config, rule

CONFIG = host_plugin_config(
    rule(rate=3, interval="1m"),
    _rules_=[
        {"_match_route_": ["default/login"], "failure_mode": "deny",
         "rules": [rule("login", limit_by="client_ip", rate=1, interval="1m")]},
        {"_match_domain_": ["*.partner.example"],
         "rules": [rule("partner", limit_by="global", rate=2, interval="1m")]},
    ],
)


@pytest.fixture(scope="module")
def gateway(processes):
    emulator = processes.emulator(CONFIG, build="higress", keep=True)
    try:
        yield emulator
    finally:
        emulator.stop()


def statuses_and_policy(gateway, n: int, **request) -> tuple[list[int], str]:
    responses = [gateway.send(**request) for _ in range(n)]
    return [r.status for r in responses], responses[-1].headers.get("ratelimit-policy", "-")


def test_a_route_rule_beats_the_domain_and_global_rules(stack, gateway):
    request = {"headers": {"x-user-id": "alice", ":authority": "eu.partner.example"},
               "route_name": "default/login", "source_address": "10.1.2.3:5555"}
    assert statuses_and_policy(gateway, 2, **request) == ([200, 429], '"login";q=1;w=60')
    assert stack.redis.client.exists("erl:login:10.1.2.3")


def test_a_domain_rule_applies_to_subdomains_only(stack, gateway):
    partner = {"headers": {"x-user-id": "bob", ":authority": "eu.partner.example:8443"}}
    assert statuses_and_policy(gateway, 3, **partner) == ([200, 200, 429], '"partner";q=2;w=60')
    apex = {"headers": {"x-user-id": "bob", ":authority": "partner.example"}}
    assert statuses_and_policy(gateway, 1, **apex) == ([200], '"per-user";q=3;w=60'), "the global rules"


def test_other_requests_follow_the_global_rules(stack, gateway):
    other = {"headers": {"x-user-id": "carol", ":authority": "www.example"}, "route_name": "default/shop"}
    assert statuses_and_policy(gateway, 4, **other) == ([200, 200, 200, 429], '"per-user";q=3;w=60')
    assert sorted(k.decode() for k in stack.redis.client.keys("erl:*")) == ["erl:per-user:carol"]


def test_an_invalid_match_rule_is_refused_with_its_path(stack):
    invalid = plugin_config(rule(), _rules_=[{"_match_route_": ["r"], "rules": [rule(rate=0)]}])
    envoy = stack.envoy(invalid, wait_ready=False)
    assert envoy.wait_exit(timeout=20.0) not in (None, 0)
    assert "invalid configuration: _rules_[0].rules[0].rate: must be at least 1" in envoy.log_text()
