//! Plugin configurations as the filter loads them, for `validate` and `explain`: the JSON read from a file
//! or stdin, then handed to the filter's own `filter::load` (what `proxy_on_configure` runs before it
//! touches the host), so a configuration is refused here exactly when, and with the words with which, a
//! gateway refuses it: the parser's checks (`Plugin::from_json`) and the load-time ones besides (a
//! `redis.transport: "host"` in the stock Envoy build).

use std::io::Read as _;
use std::path::Path;

use edge_rate_limiter::config::{
    Cost, FailureMode, InflightRule, OnMissing, Plugin, PluginConfig, Reserve, Rule, Settle, TransportKind,
    WindowLayout, COUNTER_SLICES,
};
use edge_rate_limiter::filter;
use edge_rate_limiter::key::{KeySource, UNREAD_BODY_PART};
use edge_rate_limiter::matching::{Exemption, ValueMatch};
use edge_rate_limiter::usage::{UsageFormat, Weights};

use crate::calendar::{period_name, ZoneNames};
use crate::error::{AdminError, Result};
use crate::model::type_name;
use crate::report::{
    ConfigSummary, CostSummary, KeyPart, ReserveSource, ReserveSummary, RuleSummary, SettleSource, SettleSummary,
    WeightsSummary,
};

/// What the filter writes before the reason when it refuses a configuration.
pub use edge_rate_limiter::filter::REFUSAL_PREFIX;

/// The build a configuration is loaded by (docs/deploying.md, "Builds"). Whether it has regular expressions
/// (`rates_by_value`'s `regex`: the -regex artifacts) is this tool's own build's: its feature `regex`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Build {
    /// `edge-rate-limiter-envoy[-regex].wasm`: stock Envoy and Istio; `redis.transport: "http"` only.
    Envoy,
    /// `edge-rate-limiter-higress[-regex].wasm`: Higress; `"host"` and `"http"`.
    Higress,
}

impl Build {
    /// Its artifact's name part: `envoy`, `higress`, with `-regex` when this tool has regular expressions.
    pub fn name(self) -> &'static str {
        match (self, cfg!(feature = "regex")) {
            (Build::Envoy, false) => "envoy",
            (Build::Higress, false) => "higress",
            (Build::Envoy, true) => "envoy-regex",
            (Build::Higress, true) => "higress-regex",
        }
    }
}

/// The log line of a gateway that refuses a configuration for `reason`.
pub fn refusal_line(reason: &str) -> String {
    format!("{REFUSAL_PREFIX}{reason}")
}

/// The bytes of a configuration file, or of stdin for `-`.
///
/// # Errors
/// [`AdminError::ConfigFile`] when it cannot be read.
pub fn read_document(path: &str) -> Result<Vec<u8>> {
    let failed = |error: std::io::Error| AdminError::ConfigFile { path: path.to_string(), reason: error.to_string() };
    if path == "-" {
        let mut bytes = Vec::new();
        std::io::stdin().read_to_end(&mut bytes).map_err(failed)?;
        return Ok(bytes);
    }
    std::fs::read(Path::new(path)).map_err(failed)
}

/// Loads a configuration as `build` does at `proxy_on_configure`: the parsed configuration, or the reason
/// the filter refuses it (what it logs after [`REFUSAL_PREFIX`]).
///
/// # Errors
/// The filter's reason, naming the field (`rules[0].rate: must be at least 1`).
pub fn load(bytes: &[u8], build: Build) -> Result<Plugin, String> {
    filter::load(bytes, build == Build::Higress).map_err(|error| error.to_string())
}

/// The name of configuration `index` of [`Plugin::configs`]: `global` (0) or `_rules_[index - 1]`.
pub fn config_name(index: usize) -> String {
    match index.checked_sub(1) {
        None => "global".to_string(),
        Some(rule) => format!("_rules_[{rule}]"),
    }
}

/// Each configuration of `plugin` as `validate` lists it; `zones`: the zone names of its calendar rules, as
/// its document writes them.
pub fn summarize(plugin: &Plugin, zones: &ZoneNames) -> Vec<ConfigSummary> {
    plugin
        .configs()
        .map(|(index, config)| {
            let (routes, domains) = match index.checked_sub(1).and_then(|i| plugin.overrides.get(i)) {
                Some(rule) => (rule.routes.clone(), rule.domains.clone()),
                None => (Vec::new(), Vec::new()),
            };
            let transport = match config.redis.transport {
                TransportKind::Http => "http",
                TransportKind::Host => "host",
            };
            let failure_mode = match config.failure_mode {
                FailureMode::Allow => "allow",
                FailureMode::Deny => "deny",
                FailureMode::Local => "local",
            };
            ConfigSummary {
                name: config_name(index),
                routes,
                domains,
                redis: format!("cluster {} ({transport})", config.redis.cluster),
                failure_mode,
                exempt: config.exempt.as_ref().map(exemption_text),
                rules: config
                    .rules
                    .iter()
                    .map(|rule| rule_summary(rule, zones.get(index, &rule.name)))
                    .chain(config.inflight.iter().map(inflight_summary))
                    .collect(),
            }
        })
        .collect()
}

fn rule_summary(rule: &Rule, time_zone: Option<&str>) -> RuleSummary {
    RuleSummary {
        name: rule.name.clone(),
        limit_by: key_source(&rule.source),
        key: key_parts(&rule.source),
        on_missing: on_missing_name(rule.on_missing),
        rates_by: rule.rates_by.as_ref().map(key_parts),
        value_match: rule.value_match.as_ref().map(value_match_text),
        rate: rule.rate,
        interval_ms: rule.interval_ms,
        permits: rule.permits,
        cost: rule.cost.as_ref().map(cost_summary),
        limiter_type: type_name(rule.limiter_type),
        layout: Some(layout_name(rule.layout)),
        slices: (rule.layout == WindowLayout::SlidingWindowCounter).then_some(COUNTER_SLICES),
        period: match rule.layout {
            WindowLayout::Calendar { period, .. } => Some(period_name(period)),
            _ => None,
        },
        time_zone: time_zone.filter(|_| rule.layout.is_calendar()).map(str::to_string),
        mode: rule.mode.name(),
        limiter: rule.limiter.clone(),
        exempt: rule.exempt.as_ref().map(exemption_text),
        max_in_flight: None,
        lease_ms: None,
    }
}

fn inflight_summary(rule: &InflightRule) -> RuleSummary {
    RuleSummary {
        name: rule.name.clone(),
        limit_by: key_source(&rule.source),
        key: key_parts(&rule.source),
        on_missing: on_missing_name(rule.on_missing),
        rates_by: None,
        value_match: None,
        rate: 0,
        interval_ms: 0,
        permits: 1,
        cost: None,
        limiter_type: "overall",
        layout: None,
        slices: None,
        period: None,
        time_zone: None,
        mode: rule.mode.name(),
        limiter: rule.limiter.clone(),
        exempt: rule.exempt.as_ref().map(exemption_text),
        max_in_flight: Some(rule.max_in_flight),
        lease_ms: Some(rule.lease_ms),
    }
}

/// A `rates_by_value` entry's match in words: `values ["a","b"]`, `regex ^vip`.
pub fn value_match_text(value_match: &ValueMatch) -> String {
    match value_match {
        ValueMatch::Values(values) => format!("values {}", serde_json::Value::from(texts(values))),
        ValueMatch::Regex(pattern) => format!("regex {}", pattern.source()),
    }
}

/// A `limit_by` as the configuration writes it (`"client_ip"`, `{"header":"x-user-id"}`, `[...]`).
pub fn key_source(source: &KeySource) -> serde_json::Value {
    use serde_json::json;
    match source {
        KeySource::Header(name) => json!({ "header": name }),
        KeySource::Query(name) => json!({ "query": name }),
        KeySource::Cookie(name) => json!({ "cookie": name }),
        KeySource::ClientIp => json!("client_ip"),
        KeySource::XForwardedFor(hops) => json!({ "x_forwarded_for": hops }),
        KeySource::Path => json!("path"),
        KeySource::Global => json!("global"),
        KeySource::Network { of, prefix } => {
            let (ipv4, ipv6) = (prefix.ipv4, prefix.ipv6);
            match **of {
                KeySource::XForwardedFor(hops) => {
                    json!({ "x_forwarded_for": { "hops": hops, "ipv4_prefix": ipv4, "ipv6_prefix": ipv6 } })
                }
                _ => json!({ "client_ip": { "ipv4_prefix": ipv4, "ipv6_prefix": ipv6 } }),
            }
        }
        KeySource::Composite(parts) => serde_json::Value::Array(parts.iter().map(key_source).collect()),
        KeySource::Property(path) => json!({ "property": path }),
        KeySource::Body(paths) => match paths.as_slice() {
            [only] => json!({ "body": only.join(".") }),
            _ => json!({ "body": { "paths": paths.iter().map(|path| path.join(".")).collect::<Vec<_>>() } }),
        },
    }
}

/// A key's parts in words: `header authorization, body model (unreadable body: !missing)`.
pub fn key_text(parts: &[KeyPart]) -> String {
    key_text_with(parts, "")
}

/// A key's parts in words, `note` added to what stands for an unread body part.
pub fn key_text_with(parts: &[KeyPart], note: &str) -> String {
    let texts: Vec<String> = parts
        .iter()
        .map(|part| match part.unread {
            Some(unread) => format!("{} (unreadable body: {unread}{note})", part.text),
            None => part.text.clone(),
        })
        .collect();
    texts.join(", ")
}

/// `layout` as the configuration writes it.
pub fn layout_name(layout: WindowLayout) -> &'static str {
    match layout {
        WindowLayout::SlidingLog => "sliding_log",
        WindowLayout::SlidingWindowCounter => crate::counter::LAYOUT,
        WindowLayout::Calendar { .. } => crate::calendar::LAYOUT,
    }
}

/// `on_missing` as the configuration writes it.
pub fn on_missing_name(on_missing: OnMissing) -> &'static str {
    match on_missing {
        OnMissing::Skip => "skip",
        OnMissing::Deny => "deny",
        OnMissing::Share => "share",
    }
}

/// A key (`limit_by`, `rates_by`) part by part: where each part is read from, in words, and for a part
/// read from the body what stands for it when the body does not give it ([`UNREAD_BODY_PART`]).
pub fn key_parts(source: &KeySource) -> Vec<KeyPart> {
    match source {
        KeySource::Composite(parts) => parts.iter().flat_map(key_parts).collect(),
        one => vec![key_part(one)],
    }
}

fn key_part(source: &KeySource) -> KeyPart {
    let (kind, text) = match source {
        KeySource::Header(name) => ("header", format!("header {name}")),
        KeySource::Query(name) => ("query", format!("query {name}")),
        KeySource::Cookie(name) => ("cookie", format!("cookie {name}")),
        KeySource::ClientIp => ("client_ip", "client_ip".to_string()),
        KeySource::XForwardedFor(1) => ("x_forwarded_for", "x_forwarded_for 1 hop".to_string()),
        KeySource::XForwardedFor(hops) => ("x_forwarded_for", format!("x_forwarded_for {hops} hops")),
        KeySource::Path => ("path", "path".to_string()),
        KeySource::Global => ("global", "global".to_string()),
        KeySource::Network { of, prefix } => {
            let address = key_part(of);
            (address.source, format!("{} /{} (IPv6 /{})", address.text, prefix.ipv4, prefix.ipv6))
        }
        KeySource::Property(path) => ("property", format!("property {}", property_path(path))),
        KeySource::Body(paths) => ("body", format!("body {}", dotted(paths).join("|"))),
        // Not a part (a composite key is never nested): as the configuration writes it.
        KeySource::Composite(_) => ("composite", key_source(source).to_string()),
    };
    KeyPart { source: kind, text, unread: matches!(source, KeySource::Body(_)).then_some(UNREAD_BODY_PART) }
}

/// A property path as dotted text, or as its list of segments when one holds a dot.
fn property_path(path: &[String]) -> String {
    if path.iter().any(|segment| segment.contains('.')) {
        serde_json::Value::from(path.to_vec()).to_string()
    } else {
        path.join(".")
    }
}

/// Body paths (member names) as dotted paths.
fn dotted(paths: &[Vec<String>]) -> Vec<String> {
    paths.iter().map(|path| path.join(".")).collect()
}

/// The API names `cost.reserve.body` takes (the filter's `RESERVE_BODY_FIELDS`).
const RESERVE_BODY_APIS: [&str; 3] = ["openai", "anthropic", "gemini"];

/// The API whose request-body fields `paths` are, as `{"body": "<api>"}` names them: asked of the filter's
/// own parser, so the fields are never listed here.
fn body_api(paths: &[Vec<String>]) -> Option<&'static str> {
    RESERVE_BODY_APIS.into_iter().find(|api| {
        let json = format!(
            r#"{{"redis":{{"cluster":"c"}},"rules":[{{"name":"r","limit_by":"global","rate":1,"interval":1000,
                "cost":{{"reserve":{{"body":"{api}","default":1}},"settle":{{"response_header":"x"}}}}}}]}}"#
        );
        let parsed = PluginConfig::from_json(json.as_bytes()).ok();
        let reserve = parsed.as_ref().and_then(|config| config.rules.first()).and_then(|rule| rule.cost.as_ref());
        matches!(reserve.map(|cost| &cost.reserve),
            Some(Reserve::From { source: KeySource::Body(fields), .. }) if fields == paths)
    })
}

/// A rule's `cost`: where its reservation is read from and where its settlement reads the real cost.
pub fn cost_summary(cost: &Cost) -> CostSummary {
    let reserve = match &cost.reserve {
        Reserve::Fixed(permits) => {
            ReserveSummary { source: ReserveSource::Fixed, from: Vec::new(), api: None, default: *permits }
        }
        Reserve::From { source, default } => {
            let (kind, from, api) = match source {
                KeySource::Header(name) => (ReserveSource::Header, vec![name.clone()], None),
                KeySource::Property(path) => (ReserveSource::Property, vec![property_path(path)], None),
                KeySource::Body(paths) => (ReserveSource::Body, dotted(paths), body_api(paths)),
                // Unreachable: the parser reads a reservation from a header, a property or the body only.
                other => (ReserveSource::Header, vec![key_part(other).text], None),
            };
            ReserveSummary { source: kind, from, api, default: *default }
        }
    };
    let settle = match &cost.settle {
        Settle::Usage(format, weights) => {
            let (usage, from) = match format {
                UsageFormat::OpenAi => ("openai", Vec::new()),
                UsageFormat::Anthropic => ("anthropic", Vec::new()),
                UsageFormat::Gemini => ("gemini", Vec::new()),
                UsageFormat::Paths(paths) => ("paths", dotted(paths)),
            };
            SettleSummary {
                source: SettleSource::Usage,
                usage: Some(usage),
                from,
                include_usage: cost.include_usage,
                weights: weights.as_ref().map(weights_summary),
            }
        }
        Settle::ResponseHeader(name) => SettleSummary {
            source: SettleSource::ResponseHeader,
            usage: None,
            from: vec![name.clone()],
            include_usage: false,
            weights: None,
        },
    };
    CostSummary { reserve, settle }
}

/// Weights (thousandths of a permit per token) as permits per token.
fn weights_summary(weights: &Weights) -> WeightsSummary {
    let permits = |thousandths: u32| f64::from(thousandths) / 1000.0;
    WeightsSummary {
        input: permits(weights.input),
        cached_input: permits(weights.cached_input),
        cache_write: permits(weights.cache_write),
        output: permits(weights.output),
    }
}

/// An `exempt` section in words: `client_ips 10.0.0.0/8; headers x-internal ["yes"]`.
fn exemption_text(exemption: &Exemption) -> String {
    let mut parts = Vec::new();
    if !exemption.client_ips.is_empty() {
        let networks: Vec<String> = exemption.client_ips.iter().map(ToString::to_string).collect();
        parts.push(format!("client_ips {}", networks.join(", ")));
    }
    for (name, values) in &exemption.headers {
        parts.push(format!("header {name} {}", serde_json::Value::from(texts(values))));
    }
    parts.join("; ")
}

/// Byte strings as text (invalid UTF-8 replaced), for a summary.
fn texts(values: &[Vec<u8>]) -> Vec<String> {
    values.iter().map(|value| String::from_utf8_lossy(value).into_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str =
        r#"{"redis":{"cluster":"webdis"},"rules":[{"name":"r","limit_by":"global","rate":5,"interval":"1s"}]}"#;

    #[test]
    fn a_valid_configuration_loads_in_both_builds() {
        for build in [Build::Envoy, Build::Higress] {
            let plugin = load(MINIMAL.as_bytes(), build).unwrap();
            assert_eq!(plugin.global.unwrap().rules[0].name, "r");
        }
    }

    #[test]
    fn refusals_are_the_filters_own_words() {
        let zero = MINIMAL.replace("\"rate\":5", "\"rate\":0");
        assert_eq!(load(zero.as_bytes(), Build::Envoy).unwrap_err(), "rules[0].rate: must be at least 1");
        assert_eq!(
            refusal_line("rules[0].rate: must be at least 1"),
            "edge-rate-limiter: invalid configuration: rules[0].rate: must be at least 1"
        );
        assert!(load(b"", Build::Envoy).unwrap_err().starts_with("EOF while parsing"));
    }

    #[test]
    fn the_host_transport_needs_the_higress_build() {
        let host = MINIMAL.replace(r#""cluster":"webdis""#, r#""cluster":"redis","transport":"host""#);
        let refused = load(host.as_bytes(), Build::Envoy).unwrap_err();
        assert!(refused.starts_with("redis.transport: \"host\" needs the host-redis build"), "{refused}");
        assert!(load(host.as_bytes(), Build::Higress).is_ok());
    }

    #[test]
    fn configurations_are_named_global_then_by_match_rule() {
        assert_eq!(config_name(0), "global");
        assert_eq!(config_name(2), "_rules_[1]");
    }
}
