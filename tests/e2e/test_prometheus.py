"""What Prometheus scrapes from real Envoy (`/stats/prometheus`): the rule of a per-rule counter is a label,
through the tag extraction of envoy/envoy.yaml (`stats_config.stats_tags`; docs/operating.md, "Metrics"),
and the exposition is parsed by Prometheus's own Python text parser (`prometheus_client.parser`), so a
malformed one fails. Then a real Prometheus (Debian's 2.42, `prometheus_server.Prometheus`) scrapes a real
Envoy during a scripted mix of traffic, and every query of the dashboard and the alert rules in
observability/ runs through its HTTP API; `promtool check rules` checks the alerts; an alert fires when
Redis is stopped."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re

import yaml
from prometheus_client.parser import text_string_to_metric_families

import llm_upstream as llm
from harness import REPO, http_request, plugin_config, rule, wait_until
from prometheus_server import Prometheus, promtool_check_rules

OBSERVABILITY = REPO / "observability"

PER_USER = rule("per-user", rate=2, interval="1m")
PER_KEY = rule("per-key", limit_by={"header": "x-api-key"}, rate=3, interval="1m")


def scrape(envoy) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of the filter's metrics, by sample name, then by its labels (sorted pairs)."""
    response = http_request(envoy.admin_port, "/stats/prometheus", timeout=5.0)
    assert response.status == 200, response.status
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.body):
        for sample in family.samples:
            # The parser names a counter's samples `<name>_total`, as OpenMetrics does; Envoy writes `<name>`.
            name = family.name if sample.name == f"{family.name}_total" else sample.name
            if name.startswith("edge_rate_limiter_"):
                samples.setdefault(name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_each_rule_is_a_label_of_one_metric_and_the_labelled_counters_add_up_to_the_global_ones(stack):
    envoy = stack.envoy(plugin_config(PER_USER, PER_KEY))
    # alice: 2 allowed by per-user, then 1 rejected; key k1: 3 allowed by per-key, then 1 rejected; a request
    # with neither header: no rule applies.
    statuses = [envoy.send(headers={"x-user-id": "alice"}).status for _ in range(3)]
    statuses += [envoy.send(headers={"x-api-key": "k1"}).status for _ in range(4)]
    statuses.append(envoy.send().status)
    assert statuses == [200, 200, 429, 200, 200, 200, 429, 200]

    def counted() -> dict | None:
        samples = scrape(envoy)
        return samples if samples.get("edge_rate_limiter_allowed", {}).get(()) == 5 else None

    samples = wait_until(counted, 5.0, "the scrape to count the 5 allowed requests")
    assert samples["edge_rate_limiter_rule_allowed"] == {(("rule", "per-key"),): 3, (("rule", "per-user"),): 2}
    assert samples["edge_rate_limiter_rule_rejected"] == {(("rule", "per-key"),): 1, (("rule", "per-user"),): 1}
    for outcome in ("local_rejected", "shadow_rejected", "failures"):
        assert set(samples[f"edge_rate_limiter_rule_{outcome}"]) == {(("rule", "per-key"),), (("rule", "per-user"),)}
    # No metric name carries a rule: one name per counter, whatever the rules.
    assert not [name for name in samples if "per_user" in name or "per_key" in name], sorted(samples)
    # Each request a rule decided counts once in its rule's counters and once in the global ones.
    for outcome in ("allowed", "rejected"):
        assert sum(samples[f"edge_rate_limiter_rule_{outcome}"].values()) == samples[f"edge_rate_limiter_{outcome}"][()]


# ---------------------------------------------------------------------------------------------------------
# A real Prometheus: the dashboard's and the alerts' queries (observability/), against what the traffic implies

TOKENS = rule("tokens", limit_by={"header": "x-team"}, rate=1_000_000, interval="1m",
              cost={"reserve": 1000, "settle": {"usage": "openai"}})
# What each of the token rule's responses reports: 150 + 100 = 250 tokens of the 1,000 reserved (25%).
INPUT_TOKENS, OUTPUT_TOKENS = 150, 100
RATE_WINDOW = "1m"  # Grafana's $__rate_interval, in the queries run here


def dashboard_queries() -> list[tuple[str, str, str]]:
    """Every query of the dashboard: (panel title, legend, PromQL with $__rate_interval filled in)."""
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    return [(panel["title"], target.get("legendFormat", ""), target["expr"].replace("$__rate_interval", RATE_WINDOW))
            for panel in dashboard["panels"] if panel["type"] != "row" for target in panel["targets"]]


def alert_rules(fire_at_once: bool) -> list[dict]:
    """The alert rules of observability/alerts.yaml (with `for: 0s` when `fire_at_once`)."""
    rules = yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())["groups"][0]["rules"]
    if fire_at_once:
        for alert in rules:
            alert["for"] = "0s"
    return rules


def by(result: list[tuple[dict[str, str], float]], label: str) -> dict[str, float]:
    return {labels.get(label, ""): value for labels, value in result}


def test_promtool_accepts_the_alert_rules():
    checked = promtool_check_rules(OBSERVABILITY / "alerts.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 5 rules found" in checked.stdout, checked.stdout


def test_the_dashboard_and_alert_queries_return_what_the_traffic_implies_and_an_alert_fires_without_redis(
        stack, tmp_path):
    with llm.LlmUpstream() as upstream:
        envoy = stack.envoy(plugin_config(PER_USER, TOKENS), upstream_port=upstream.port)
        rules_path = tmp_path / "alerts.yaml"
        rules_path.write_text(yaml.safe_dump({"groups": [{"name": "edge-rate-limiter",
                                                          "rules": alert_rules(fire_at_once=True)}]}))
        with Prometheus(stack.workdir, [envoy.admin_port], [rules_path]) as prometheus:
            wait_until(prometheus.scraped_up, 15.0, "Prometheus to scrape Envoy")
            # The mix: alice 2 allowed then 3 rejected by per-user; 6 token requests, each settled to 25% of
            # its reservation; 8 token requests at once (coalesced into batches when they meet).
            statuses = [envoy.send(headers={"x-user-id": "alice"}).status for _ in range(5)]
            assert statuses == [200, 200, 429, 429, 429]
            asked = {"x-team": "blue", "content-type": "application/json",
                     **llm.headers("openai-json", INPUT_TOKENS, OUTPUT_TOKENS)}
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
            for _ in range(6):
                assert envoy.send("/v1/chat/completions", asked, method="POST", body=body).status == 200
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                burst = list(pool.map(lambda _: envoy.send("/v1/chat/completions", asked, method="POST",
                                                           body=body).status, range(8)))
            assert burst == [200] * 8
            decided = 5 + 6 + 8

            # Envoy merges its workers' histograms when it flushes stats (every 5 s): wait for every decision.
            wait_until(lambda: prometheus.value("sum(edge_rate_limiter_paused_us_count)") == decided, 20.0,
                       f"Prometheus to see {decided} pauses")
            wait_until(lambda: prometheus.value("sum(edge_rate_limiter_rule_settled_percent_count)") == 14, 20.0,
                       "Prometheus to see the 14 settles")

            # The labelled counters add up to the global ones, in Prometheus too.
            for outcome in ("allowed", "rejected"):
                assert (prometheus.value(f"sum(edge_rate_limiter_rule_{outcome})")
                        == prometheus.value(f"sum(edge_rate_limiter_{outcome})")), outcome
            assert prometheus.value("sum(edge_rate_limiter_allowed)") == 2 + 14
            assert by(prometheus.query("sum by (outcome) (edge_rate_limiter_paused_us_count)"), "outcome") == {
                "allowed": 16, "rejected": 3, "failure_allowed": 0, "failure_denied": 0,
                "fallback_allowed": 0, "fallback_rejected": 0}

            # Every query of the dashboard runs; those the traffic speaks to say what it implies.
            results = {}
            for title, legend, expr in dashboard_queries():
                results[(title, legend)] = prometheus.query(expr)  # raises QueryError if Prometheus refuses it
            positive = lambda key: {k: v for k, v in by(results[key], "outcome").items() if v > 0}  # noqa: E731
            assert set(positive(("Decisions by outcome (requests/s)", "{{outcome}}"))) == {"allowed", "rejected"}
            rejected = by(results[("Rejections by rule (requests/s)", "{{rule}} rejected")], "rule")
            assert rejected["per-user"] > 0 and rejected["tokens"] == 0, rejected
            allowed = by(results[("Admissions by rule (requests/s)", "{{rule}}")], "rule")
            assert allowed["tokens"] > allowed["per-user"] > 0, allowed
            share = by(results[("Share rejected by rule", "{{rule}}")], "rule")
            assert math.isclose(share["per-user"], 3 / 5, rel_tol=1e-6) and share["tokens"] == 0, share
            p50, p99 = (results[("Added latency, p50 and p99 (all decided requests)", q)][0][1] for q in ("p50", "p99"))
            assert 0 < p50 <= p99 < 1_000_000, (p50, p99)
            calls = by(results[("Redis calls and errors (per second)", "calls")], "")[""]
            errors = by(results[("Redis calls and errors (per second)", "errors")], "")[""]
            assert calls > 0 and errors == 0, (calls, errors)
            round_trip = results[("Redis round trip, p50 and p99", "p50")][0][1]
            assert 0 < round_trip < 1_000_000, round_trip
            settled = by(results[("Token budgets: share of a reservation used, p50 and p99 by rule", "{{rule}} p50")],
                         "rule")
            assert 20 <= settled["tokens"] <= 30, settled
            # Batches: a batch carries at least 2 calls (a lone call goes as itself); the burst may have made none.
            batches = prometheus.value("sum(edge_rate_limiter_batches)")
            mean_batch = results[("Batches: calls per batch", "mean")]
            if batches:
                assert mean_batch[0][1] >= 2, (batches, mean_batch)
                # histogram_quantile interpolates inside the bucket (1, 2]: batches of exactly 2 read 1.99.
                assert results[("Batches: calls per batch", "p99")][0][1] > 1, results
            else:
                assert all(math.isnan(value) for _, value in mean_batch), mean_batch
            settles = by(results[("Token budgets: settles (per second)", "settled")], "")[""]
            assert settles > 0, settles
            for key in [("Failure-mode and degraded-mode decisions (requests/s)", "failed open"),
                        ("Leases (per second)", "permits lost")]:
                assert [value for _, value in results[key]] == [0], (key, results[key])
            # alice's rejections after Redis's first: the local block's (it knows her window is full).
            local = by(results[("Local block rejections (requests/s)", "{{rule}}")], "rule")
            assert local.get("tokens", 0) == 0, local
            assert (prometheus.value("sum(edge_rate_limiter_local_rejected)")
                    == prometheus.value('sum(edge_rate_limiter_rule_local_rejected{rule="per-user"})') <= 2)
            assert not [a for a in prometheus.alerts() if a["state"] == "firing"], prometheus.alerts()
            for alert in alert_rules(fire_at_once=False):
                prometheus.query(alert["expr"])

            # Redis stops: requests fail open, and the alerts say so.
            stack.redis.stop()
            for _ in range(5):
                assert envoy.send(headers={"x-user-id": "bob"}).status == 200

            def firing() -> set[str] | None:
                names = {a["labels"]["alertname"] for a in prometheus.alerts() if a["state"] == "firing"}
                return names if {"EdgeRateLimiterFailingOpen", "EdgeRateLimiterRedisErrors"} <= names else None

            names = wait_until(firing, 15.0, "the failing-open and Redis-error alerts to fire")
            assert "EdgeRateLimiterFailingClosed" not in names and "EdgeRateLimiterDegraded" not in names, names
            failed_open = [prometheus.query(expr) for title, legend, expr in dashboard_queries()
                           if legend == "failed open"]
            assert failed_open and failed_open[0][0][1] > 0, failed_open


def test_the_istio_bootstrap_override_says_what_envoy_yaml_says():
    """envoy/istio-wasmplugin.yaml's ConfigMap (for Istio's and Higress's gateways) carries envoy/envoy.yaml's
    stats_config, tags and buckets alike: the labels and buckets tested above are what they get."""
    envoy_yaml = yaml.safe_load(re.sub(r"\$\{[A-Z_]+\}", "0", (REPO / "envoy" / "envoy.yaml").read_text()))
    documents = list(yaml.safe_load_all((REPO / "envoy" / "istio-wasmplugin.yaml").read_text()))
    [config_map] = [d for d in documents if d["kind"] == "ConfigMap"]
    override = json.loads(config_map["data"]["custom_bootstrap.json"])
    assert override == {"stats_config": envoy_yaml["stats_config"]}
