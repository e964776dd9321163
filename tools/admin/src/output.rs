//! Text output: the reports of `ops` (`report`) as aligned, human-readable lines; `--json` prints the
//! same reports with `serde_json` instead. Durations are written as humantime (`1m`, `2s 500ms`), times
//! as RFC 3339 UTC.

use std::fmt::Write as _;

use edge_rate_limiter::config::LimiterType;

use crate::model::{type_name, Config};
use crate::report::{ChangeReport, DeleteReport, KeyTtl, ListEntry, ShowReport, State, ValidateReport};
use crate::units::{human_ms, timestamp};

fn ttl_text(ttl_ms: i64) -> String {
    match ttl_ms {
        -2 => "no such key".to_string(),
        -1 => "no expiry".to_string(),
        ms => format!("{} ({ms} ms)", human_ms(u64::try_from(ms).unwrap_or(0))),
    }
}

fn keep_alive_text(ms: u64) -> String {
    if ms == 0 {
        "0 (never expires)".to_string()
    } else {
        format!("{ms} ms ({})", human_ms(ms))
    }
}

/// A keep-alive in a summary line or table cell: `none` for 0, else humantime.
fn keep_alive_brief(ms: u64) -> String {
    if ms == 0 {
        "none".to_string()
    } else {
        human_ms(ms)
    }
}

fn config_lines(out: &mut String, config: &Config) {
    let _ = writeln!(out, "type         {}", type_name(config.limiter_type));
    let _ =
        writeln!(out, "rate         {} per {} ms ({})", config.rate, config.interval_ms, human_ms(config.interval_ms));
    let _ = writeln!(out, "keepAlive    {}", keep_alive_text(config.keep_alive_ms));
}

fn ttl_lines(out: &mut String, indent: &str, ttls: &[KeyTtl]) {
    let width = ttls.iter().map(|t| t.key.len()).max().unwrap_or(0);
    for ttl in ttls {
        let _ = writeln!(out, "{indent}{:<width$}  {}", ttl.key, ttl_text(ttl.ttl_ms));
    }
}

fn state_lines(out: &mut String, indent: &str, state: &State, config: &Config) {
    let window = &state.window;
    let _ = writeln!(out, "{indent}available    {} of {}", state.available, config.rate);
    let _ = writeln!(
        out,
        "{indent}in window    {} permits in {} acquires (last {})",
        window.permits,
        window.acquires,
        human_ms(config.interval_ms)
    );
    if let (Some(oldest), Some(age)) = (window.oldest_ms, window.oldest_age_ms) {
        let _ = writeln!(out, "{indent}  oldest     {} ({} ago)", timestamp(oldest), human_ms(age));
    }
    if let (Some(newest), Some(age)) = (window.newest_ms, window.newest_age_ms) {
        let _ = writeln!(out, "{indent}  newest     {} ({} ago)", timestamp(newest), human_ms(age));
    }
    if window.unreadable > 0 {
        let _ = writeln!(out, "{indent}  unreadable {} members not in Redisson's format", window.unreadable);
    }
    if state.expired > 0 {
        let _ = writeln!(
            out,
            "{indent}  expired    {} members older than the window (released by the next acquire)",
            state.expired
        );
    }
    ttl_lines(out, &format!("{indent}ttl  "), &state.ttl);
}

/// `show` as text.
pub fn show(report: &ShowReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "limiter      {}", report.name);
    config_lines(&mut out, &report.config);
    let _ = writeln!(out, "now          {}", timestamp(report.now_ms));
    ttl_lines(&mut out, "ttl  ", &[KeyTtl { key: report.name.clone(), ttl_ms: report.config_ttl_ms }]);
    if let Some(state) = &report.state {
        if let Some(id) = &state.client_id {
            let _ = writeln!(out, "client       {id}");
        }
        state_lines(&mut out, "", state, &report.config);
    }
    if report.config.limiter_type == LimiterType::PerClient {
        let _ = writeln!(out, "clients      {}", report.clients.len());
        for client in &report.clients {
            let _ = writeln!(out, "  {}", client.client_id.as_deref().unwrap_or("?"));
            state_lines(&mut out, "    ", client, &report.config);
        }
    }
    out
}

/// `set-rate`, `try-set-rate`, `update-rate` as text.
pub fn change(report: &ChangeReport) -> String {
    let config = &report.config;
    let what = match (report.action, report.changed) {
        ("try-set-rate", true) => "created",
        ("try-set-rate", false) => "exists, left as it is",
        ("set-rate", _) => "rate set, state reset",
        _ => "rate updated, consumed permits kept",
    };
    let mut out = format!(
        "{}: {what}: {} per {} ({}, keepAlive {})\n",
        report.name,
        config.rate,
        human_ms(config.interval_ms),
        type_name(config.limiter_type),
        keep_alive_brief(config.keep_alive_ms),
    );
    if report.client_keys_removed > 0 {
        let _ = writeln!(out, "{}: removed {} keys of per-client state", report.name, report.client_keys_removed);
    }
    if report.clients_updated > 0 {
        let _ =
            writeln!(out, "{}: recomputed the available permits of {} clients", report.name, report.clients_updated);
    }
    out
}

/// `delete` as text.
pub fn delete(report: &DeleteReport) -> String {
    format!("{}: deleted ({} keys)\n", report.name, report.keys_removed)
}

/// `list` as an aligned table.
pub fn list(entries: &[ListEntry]) -> String {
    let rows: Vec<[String; 5]> = entries
        .iter()
        .map(|entry| match &entry.config {
            Some(config) => [
                entry.name.clone(),
                format!("{}/{}", config.rate, human_ms(config.interval_ms)),
                type_name(config.limiter_type).to_string(),
                keep_alive_brief(config.keep_alive_ms),
                entry.available.map_or_else(|| "-".to_string(), |n| n.to_string()),
            ],
            None => [
                entry.name.clone(),
                "?".to_string(),
                "?".to_string(),
                "?".to_string(),
                entry.problem.clone().unwrap_or_default(),
            ],
        })
        .collect();
    let header = ["NAME", "RATE", "TYPE", "KEEPALIVE", "AVAILABLE"].map(str::to_string);
    table("", &[&[header][..], &rows].concat())
}

/// `validate` as text: the verdict, then each configuration and its rules (aligned).
pub fn validate(report: &ValidateReport) -> String {
    if let Some(error) = &report.error {
        return format!("{error}\n");
    }
    let count = report.configurations.len();
    let plural = if count == 1 { "" } else { "s" };
    let mut out = format!("valid: {count} configuration{plural} ({} build)\n", report.build);
    for config in &report.configurations {
        let mut scope = Vec::new();
        if !config.routes.is_empty() {
            scope.push(format!("routes {}", config.routes.join(", ")));
        }
        if !config.domains.is_empty() {
            scope.push(format!("domains {}", config.domains.join(", ")));
        }
        scope.push(format!("redis {}", config.redis));
        scope.push(format!("failure_mode {}", config.failure_mode));
        if let Some(exempt) = &config.exempt {
            scope.push(format!("exempt {exempt}"));
        }
        let _ = writeln!(out, "{}: {}", config.name, scope.join("; "));
        let rows: Vec<[String; 4]> = config
            .rules
            .iter()
            .map(|rule| {
                let mut extras = Vec::new();
                if let Some(value_match) = &rule.value_match {
                    extras.push(format!("for {value_match}"));
                }
                if rule.permits != 1 {
                    extras.push(format!("{} permits a request", rule.permits));
                }
                if rule.limiter_type != "overall" {
                    extras.push(rule.limiter_type.to_string());
                }
                if rule.limiter != format!("erl:{}", rule.name) {
                    extras.push(format!("limiter {}", rule.limiter));
                }
                if let Some(exempt) = &rule.exempt {
                    extras.push(format!("exempt {exempt}"));
                }
                let mode = [rule.mode.to_string()].into_iter().chain(extras).collect::<Vec<_>>().join(", ");
                [
                    rule.name.clone(),
                    limit_by_text(&rule.limit_by),
                    format!("{} per {}", rule.rate, human_ms(rule.interval_ms)),
                    mode,
                ]
            })
            .collect();
        out.push_str(&table("  ", &rows));
    }
    out
}

/// A `limit_by` in a summary: a name as it is (`client_ip`), an object or list as compact JSON.
fn limit_by_text(limit_by: &serde_json::Value) -> String {
    match limit_by {
        serde_json::Value::String(name) => name.clone(),
        other => other.to_string(),
    }
}

/// Rows as aligned columns, each line after `indent`, trailing blanks trimmed.
fn table<const N: usize>(indent: &str, rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = indent.to_string();
        for (index, (width, cell)) in widths.iter().zip(row).enumerate() {
            if index > 0 {
                line.push_str("  ");
            }
            let _ = write!(line, "{cell:<width$}");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_times_are_human() {
        assert_eq!(human_ms(60_000), "1m");
        assert_eq!(human_ms(2_500), "2s 500ms");
        assert_eq!(human_ms(0), "0s");
        assert_eq!(timestamp(1_000), "1970-01-01T00:00:01.000Z");
        assert_eq!(ttl_text(-1), "no expiry");
        assert_eq!(ttl_text(-2), "no such key");
        assert_eq!(ttl_text(1_500), "1s 500ms (1500 ms)");
    }

    #[test]
    fn validate_shows_the_refusal_alone_or_each_configuration_and_rule() {
        let refused = ValidateReport {
            valid: false,
            build: "envoy",
            error: Some("edge-rate-limiter: invalid configuration: rules[0].rate: must be at least 1".into()),
            configurations: Vec::new(),
        };
        assert_eq!(validate(&refused), "edge-rate-limiter: invalid configuration: rules[0].rate: must be at least 1\n");
        let json = r#"{"redis":{"cluster":"webdis"},"rules":[
            {"name":"per-user","limit_by":{"header":"x-user-id"},"rate":100,"interval":"1m","permits":2},
            {"name":"per-ip","limit_by":"client_ip","rate":20,"interval":"1s","type":"per_client","mode":"shadow"}],
            "_rules_":[{"_match_route_":["login"],"_match_domain_":["*.example.com"],"exempt":{"client_ips":["10.0.0.0/8"]},
              "rules":[{"name":"login","limit_by":[{"header":"x-user-id"},"path"],"rate":2,"interval":"1m","limiter":"auth:login",
                "rates_by_value":[{"values":["bob:/x"],"rate":1}]}]}]}"#;
        let plugin = crate::plugin::load(json.as_bytes(), crate::plugin::Build::Envoy).unwrap();
        let report = ValidateReport {
            valid: true,
            build: "envoy",
            error: None,
            configurations: crate::plugin::summarize(&plugin),
        };
        assert_eq!(
            validate(&report),
            r#"valid: 2 configurations (envoy build)
global: redis cluster webdis (http); failure_mode allow
  per-user  {"header":"x-user-id"}  100 per 1m  enforce, 2 permits a request
  per-ip    client_ip               20 per 1s   shadow, per-client
_rules_[0]: routes login; domains *.example.com; redis cluster webdis (http); failure_mode allow; exempt client_ips 10.0.0.0/8
  login  [{"header":"x-user-id"},"path"]  1 per 1m  enforce, for values ["bob:/x"], limiter auth:login
  login  [{"header":"x-user-id"},"path"]  2 per 1m  enforce, limiter auth:login
"#
        );
    }
}
