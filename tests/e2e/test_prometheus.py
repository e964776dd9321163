"""What Prometheus scrapes from real Envoy (`/stats/prometheus`): the rule of a per-rule counter is a label,
through the tag extraction of envoy/envoy.yaml (`stats_config.stats_tags`; docs/operating.md, "Metrics"),
and the exposition is parsed by Prometheus's own Python text parser (`prometheus_client.parser`), so a
malformed one fails."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from harness import http_request, plugin_config, rule, wait_until

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
