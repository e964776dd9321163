"""Configuration as Envoy 1.40 handles it: a valid one loads, an invalid one stops Envoy, naming the field.

With the filter in the static configuration (and the default fail-closed plugin policy), Envoy 1.40 logs
`wasm log: edge-rate-limiter: invalid configuration: <field>: <reason>`, then
`Plugin edge-rate-limiter failed to load` and `Unable to create Wasm plugin edge-rate-limiter`,
and exits with code 1 without ever becoming ready.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import harness
from harness import REPO, limiter_key, plugin_config, rule

INVALID = {
    "rate-zero": (plugin_config(rule(rate=0)), "rules[0].rate"),
    "unknown-top-level-field": (plugin_config(rule(), burst_size=3), "burst_size"),
    "unknown-rule-field": (plugin_config(rule(burst=3)), "burst"),
    "empty-header-name": (plugin_config(rule(limit_by={"header": ""})), "rules[0].limit_by"),
    "zero-interval": (plugin_config(rule(interval=0)), "rules[0].interval"),
    "permits-above-rate": (plugin_config(rule(rate=5, permits=6)), "rules[0].permits"),
    "keep-alive-shorter-than-interval": (plugin_config(rule(interval="1m", keep_alive="1s")),
                                         "rules[0].keep_alive"),
    "second-rule-bad-name": (plugin_config(rule(), rule("per ip", limit_by="client_ip")), "rules[1].name"),
    "unknown-failure-mode": (plugin_config(rule(), failure_mode="maybe"), "failure_mode"),
}


@pytest.mark.parametrize(("config", "field"), INVALID.values(), ids=INVALID.keys())
def test_invalid_configuration_stops_envoy_and_names_the_field(stack, config, field):
    envoy = stack.envoy(config, wait_ready=False)

    code = envoy.wait_exit(timeout=20.0)
    log = envoy.log_text()
    assert code is not None, "Envoy should refuse the plugin and exit, it is still running"
    assert code != 0
    refusals = [line for line in log.splitlines() if "edge-rate-limiter: invalid configuration: " in line]
    assert refusals, "no 'invalid configuration' line in Envoy's log"
    assert field in refusals[0].split("invalid configuration: ", 1)[1]
    assert "Unable to create Wasm plugin edge-rate-limiter" in log


def readme_example() -> dict:
    """The configuration example of README.md (the first json block of its "Configuration" section)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Configuration", 1)[1]
    match = re.search(r"```json\n(.*?)```", section, re.S)
    assert match, "README.md has no json example under Configuration"
    return json.loads(match.group(1))


def test_the_readme_example_configuration_loads_and_limits(stack):
    config = readme_example()
    envoy = stack.envoy(config)

    # per-ip (client_ip, 20 per second) is the tighter rule for one client sending quickly. Real time: the
    # 21 requests must reach the filter within its 1 s window, so they are sent together (0.1-0.2 s, also
    # beside CPU hogs; one after the other they took 0.55-0.7 s of the second on an idle machine).
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=21) as pool:
        statuses = list(pool.map(lambda _: envoy.send(headers={"x-user-id": "alice"}).status, range(21)))
    took = time.monotonic() - started
    assert took < 1.0, f"too slow: the 21 requests took {took:.2f} s, longer than the per-ip window"
    assert sorted(statuses) == [200] * 20 + [429]
    assert stack.redis.client.get(limiter_key("erl:per-ip:127.0.0.1", "value")) == b"0"


def test_envoy_validate_mode_checks_the_plugin_configuration(stack):
    """`envoy --mode validate` (a CI step before deploying) runs the plugin's validation too."""
    bad = harness.Envoy(stack.workdir, plugin_config(rule(rate=0)), webdis_port=stack.webdis.port,
                        upstream_port=stack.upstream.port, name="validate-bad")
    good = harness.Envoy(stack.workdir, plugin_config(rule()), webdis_port=stack.webdis.port,
                         upstream_port=stack.upstream.port, name="validate-good")

    code, output = bad.validate()
    assert code != 0
    assert "invalid configuration: rules[0].rate" in output
    code, output = good.validate()
    assert code == 0, output[-2000:]
