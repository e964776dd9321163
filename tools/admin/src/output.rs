//! Text output: the reports of `ops` (`report`) as aligned, human-readable lines; `--json` prints the
//! same reports with `serde_json` instead. Durations are written as humantime (`1m`, `2s 500ms`), times
//! as RFC 3339 UTC.

use std::fmt::Write as _;

use edge_rate_limiter::config::LimiterType;

use crate::calendar_text::{self, rate_text};
use crate::cost_text::cost_lines;
use crate::counter_text::{layout_text, window_lines};
use crate::explain::retry_after_s;
use crate::model::{type_name, Config, ConfigStep, HeldTotal};
use crate::plugin::{key_text, key_text_with};
use crate::report::{
    Applies, ChangeReport, DeleteReport, ExplainReport, KeyTtl, ListEntry, PermitsFrom, ReserveSource, RuleExplain,
    RuleVerdict, ShowReport, State, ValidateReport, Verdict,
};
use crate::units::{human_ms, timestamp, ttl_text};

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

/// How many reservations (and settled costs) `show` lists one by one in text; `--json` lists every one.
pub const HELD_LISTED: usize = 20;

/// The lines of the filter's reservations in flight or settled costs in a window: a total line, then
/// each one (permits, age in ms), oldest first, at most [`HELD_LISTED`]. Nothing when there is none.
/// `what`: how one and several are counted (`in flight`, `cost`/`costs`).
fn held_lines(out: &mut String, indent: &str, label: &str, what: (&str, &str), held: &HeldTotal) {
    if held.count == 0 {
        return;
    }
    let what = if held.count == 1 { what.0 } else { what.1 };
    let _ = writeln!(out, "{indent}  {label:<10} {} {what}, {} permits", held.count, held.permits);
    let width = held.members.iter().take(HELD_LISTED).map(|m| m.permits.to_string().len()).max().unwrap_or(1);
    for member in held.members.iter().take(HELD_LISTED) {
        let _ = writeln!(out, "{indent}    {:>width$} permits, age {} ms", member.permits, member.age_ms);
    }
    if held.members.len() > HELD_LISTED {
        let _ = writeln!(out, "{indent}    ... {} more (--json lists every one)", held.members.len() - HELD_LISTED);
    }
}

fn state_lines(out: &mut String, indent: &str, state: &State, config: &Config) {
    let window = &state.window;
    let below = if state.available < 0 {
        " (below zero: settled costs above their reservations; acquires wait for permits to leave)"
    } else {
        ""
    };
    let _ = writeln!(out, "{indent}available    {} of {}{below}", state.available, config.rate);
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
    held_lines(out, indent, "reserved", ("in flight", "in flight"), &window.reservations);
    held_lines(out, indent, "settled", ("cost", "costs"), &window.settled);
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
            None if entry.layout != "sliding_log" => [
                entry.name.clone(),
                "the rule's".to_string(),
                entry.layout.replace('_', " "),
                "-".to_string(),
                "- (see show)".to_string(),
            ],
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
                    match &rule.rates_by {
                        Some(rates_by) => extras.push(format!("for {value_match} of {}", key_text(rates_by))),
                        None => extras.push(format!("for {value_match}")),
                    }
                }
                if rule.permits != 1 && rule.cost.is_none() {
                    extras.push(format!("{} permits a request", rule.permits));
                }
                if rule.on_missing != "skip" {
                    extras.push(format!("on_missing {}", rule.on_missing));
                }
                if rule.limiter_type != "overall" {
                    extras.push(rule.limiter_type.to_string());
                }
                if let Some(slices) = rule.slices {
                    extras.push(format!("sliding window counter, {slices} slices"));
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
                    key_text(&rule.key),
                    match (rule.max_in_flight, rule.lease_ms) {
                        (Some(n), Some(lease)) => format!("{n} in flight, lease {}", human_ms(lease)),
                        _ => rate_text(rule.rate, rule.interval_ms, rule.period, rule.time_zone.as_deref()),
                    },
                    mode,
                ]
            })
            .collect();
        // A rule's cost once, under its last entry (a rule with `rates_by_value` has several, one cost).
        let lines = table("  ", &rows);
        for (index, (line, rule)) in lines.lines().zip(&config.rules).enumerate() {
            let _ = writeln!(out, "{line}");
            let last = config.rules.get(index + 1).is_none_or(|next| next.name != rule.name);
            if let (true, Some(cost)) = (last, &rule.cost) {
                cost_lines(&mut out, "    ", "  ", cost, "");
            }
        }
    }
    out
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

/// A wait as text: `1s 234ms`, or why no wait helps.
fn wait_text(wait_ms: Option<u64>, delay_ms: Option<u64>) -> String {
    let retry = delay_ms.map(|delay| format!(" (Retry-After: {})", retry_after_s(delay))).unwrap_or_default();
    match wait_ms {
        Some(wait) => format!("allowed in {}{retry}", human_ms(wait)),
        None => format!("no wait admits it{retry}"),
    }
}

fn remaining_text(remaining: Option<u64>) -> String {
    match remaining {
        Some(1) => "1 more such request after this one".to_string(),
        Some(n) => format!("{n} more such requests after this one"),
        None => "no limiter applies".to_string(),
    }
}

/// `explain` as text: the configuration and verdict, then each rule with its limiter's state.
pub fn explain(report: &ExplainReport) -> String {
    let mut out = String::new();
    let Some(configuration) = &report.configuration else {
        return "configuration  none: no global rules and no _rules_ entry matches\nverdict        unlimited\n"
            .to_string();
    };
    let _ = writeln!(out, "configuration  {configuration}");
    let verdict = match report.verdict {
        Verdict::Unlimited => "unlimited".to_string(),
        Verdict::Exempt => "exempt: the configuration's exempt matches the request, no rule applies".to_string(),
        Verdict::Allowed => format!("allowed: {}", remaining_text(report.remaining)),
        Verdict::Rejected => {
            let by = report.rejected_by.as_deref().unwrap_or("?");
            let status = report.status.map(|s| format!(" ({s})")).unwrap_or_default();
            let retry = report.retry_after_s.map(|s| format!(" (Retry-After: {s})")).unwrap_or_default();
            let denied = report.rules.iter().any(|r| r.rule == by && r.verdict == RuleVerdict::Denied)
                || report.inflight.iter().any(|r| r.rule == by && r.verdict == RuleVerdict::Denied);
            let inflight = report.inflight.iter().any(|r| r.rule == by && r.verdict == RuleVerdict::Rejected);
            match report.wait_ms {
                _ if denied => format!("rejected{status} by {by}: the request has no key value for it"),
                Some(wait) if inflight => format!(
                    "rejected{status} by {by}: none free until a request ends (at the latest in {}, when the \
                     earliest lease ends){retry}",
                    human_ms(wait)
                ),
                None if inflight => format!("rejected{status} by {by}: none free until a request ends{retry}"),
                Some(wait) => format!("rejected{status} by {by}: allowed in {}{retry}", human_ms(wait)),
                None => format!("rejected{status} by {by}: no wait admits it{retry}"),
            }
        }
    };
    let _ = writeln!(out, "verdict        {verdict}");
    if !report.shadow_rejected_by.is_empty() {
        let _ = writeln!(
            out,
            "shadow         would be rejected by {} (shadow: not enforced)",
            report.shadow_rejected_by.join(", ")
        );
    }
    let _ = writeln!(out, "now            {}", timestamp(report.now_ms));
    for rule in &report.inflight {
        crate::semaphore::explain_lines(&mut out, rule);
    }
    for rule in &report.rules {
        rule_lines(&mut out, rule);
    }
    out
}

fn rule_lines(out: &mut String, rule: &RuleExplain) {
    let permits = if rule.permits == 1 { String::new() } else { format!(", {} permits a request", rule.permits) };
    let entry = rule.value_match.as_ref().map(|m| format!(", rates_by_value {m}")).unwrap_or_default();
    let rate = rate_text(rule.rate, rule.interval_ms, rule.period, rule.time_zone.as_deref());
    let _ = write!(out, "rule {} ({}{entry}): {rate}{permits}", rule.rule, rule.mode);
    match rule.applies {
        Applies::Exempt => {
            let _ = writeln!(out, ": skipped: the rule's exempt matches");
        }
        Applies::NoKey => {
            let _ = writeln!(out, ": skipped: the request has no key value");
        }
        Applies::Denied => {
            let _ = writeln!(out, ": denied: the request has no key value (on_missing deny), without Redis");
        }
        Applies::Limiter => out.push('\n'),
    }
    source_lines(out, rule);
    if rule.applies != Applies::Limiter {
        return;
    }
    let _ = writeln!(out, "  limiter      {}", rule.limiter.as_deref().unwrap_or("?"));
    if let Some(problem) = &rule.problem {
        let _ = writeln!(out, "  problem      {problem}");
        return;
    }
    if rule.counter.is_some() || rule.calendar.is_some() {
        if let Some(window) = &rule.counter {
            let _ = writeln!(out, "  layout       {} (no config in Redis: the rule's)", layout_text(window));
            window_lines(out, "  ", window);
        }
        if let Some(window) = &rule.calendar {
            let _ =
                writeln!(out, "  layout       {} (no config in Redis: the rule's)", calendar_text::layout_text(window));
            calendar_text::window_lines(out, "  ", window);
        }
        let _ =
            writeln!(out, "  verdict      {}", verdict_text(rule.verdict, rule.remaining, rule.wait_ms, rule.delay_ms));
        return;
    }
    config_step_line(out, rule);
    if let Some(ttl) = rule.config_ttl_ms.filter(|&ttl| ttl != -2) {
        let _ = writeln!(out, "  ttl  {}  {}", rule.limiter.as_deref().unwrap_or("?"), ttl_text(ttl));
    }
    let Some(effective) = &rule.effective else { return };
    for window in &rule.windows {
        if effective.limiter_type == LimiterType::PerClient {
            let client = window.state.client_id.as_deref().unwrap_or("any (no gateway has a window yet)");
            let _ = writeln!(out, "  client       {client}");
        }
        state_lines(out, "  ", &window.state, effective);
        if rule.windows.len() > 1 {
            let _ = writeln!(
                out,
                "  answer       {}",
                verdict_text(window.verdict, window.remaining, window.wait_ms, window.delay_ms)
            );
        }
    }
    let _ = writeln!(out, "  verdict      {}", verdict_text(rule.verdict, rule.remaining, rule.wait_ms, rule.delay_ms));
}

/// What the next acquire does to the limiter's config in Redis, when it is not simply the rule's.
fn config_step_line(out: &mut String, rule: &RuleExplain) {
    let brief = |config: &Config| {
        let (rate, interval, kind) = (config.rate, human_ms(config.interval_ms), type_name(config.limiter_type));
        format!("{rate} per {interval} ({kind}, keepAlive {})", keep_alive_brief(config.keep_alive_ms))
    };
    match (rule.config_step, &rule.redis_config) {
        (Some(ConfigStep::Create), _) => {
            let _ = writeln!(out, "  config       none in Redis: the next acquire creates it with the rule's, full");
        }
        (Some(ConfigStep::Update), Some(held)) => {
            let _ = writeln!(
                out,
                "  config       Redis holds {}: the next acquire updates it to the rule's (rate_source config), keeping consumed permits",
                brief(held)
            );
        }
        (Some(ConfigStep::Stand), Some(held)) => {
            let _ = writeln!(
                out,
                "  config       Redis holds {}, set by another writer after the rule: it stands",
                brief(held)
            );
        }
        (_, Some(held)) => {
            let _ = writeln!(out, "  config       Redis holds {}: it wins (rate_source redis)", brief(held));
        }
        _ => {}
    }
}

/// Where a rule's key parts, `rates_by` and reservation are read from, and the reservation of this request.
fn source_lines(out: &mut String, rule: &RuleExplain) {
    // `explain` takes no body: every part read from it stands as unread.
    let _ = writeln!(out, "  key          {}", key_text_with(&rule.key, "; explain reads no body"));
    if let Some(rates_by) = &rule.rates_by {
        let _ = writeln!(out, "  rates_by     {}", key_text_with(rates_by, "; explain reads no body"));
    }
    if let Some(cost) = &rule.cost {
        let request = match (rule.permits_from, cost.reserve.source) {
            (PermitsFrom::Rule, _) => String::new(),
            (PermitsFrom::Request, _) => format!("; this request: {}", rule.permits),
            (PermitsFrom::Default, ReserveSource::Body) => {
                format!("; this request: {} (explain reads no body)", rule.permits)
            }
            (PermitsFrom::Default, ReserveSource::Property) => {
                format!("; this request: {} (explain reads no property)", rule.permits)
            }
            (PermitsFrom::Default, _) => {
                format!("; this request: {} (no whole number in {})", rule.permits, cost.reserve.from.join(", "))
            }
        };
        cost_lines(out, "  ", "      ", cost, &request);
    }
}

fn verdict_text(verdict: RuleVerdict, remaining: Option<u64>, wait_ms: Option<u64>, delay_ms: Option<u64>) -> String {
    match verdict {
        RuleVerdict::Allowed => format!("allowed: {}", remaining_text(remaining)),
        RuleVerdict::Rejected => format!("rejected: {}", wait_text(wait_ms, delay_ms)),
        RuleVerdict::Never => "rejected: it asks more permits than the rate, no wait admits it".to_string(),
        RuleVerdict::Denied => "denied".to_string(),
        RuleVerdict::Skipped => "skipped".to_string(),
        RuleVerdict::Unknown => "unknown".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Window;
    use crate::report::WindowExplain;

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
    fn show_lists_reservations_and_settled_costs_with_totals_and_a_value_below_zero() {
        let member =
            |random: &[u8; 16], permits: u32| [vec![16u8], random.to_vec(), permits.to_le_bytes().to_vec()].concat();
        let mut members = vec![
            (member(b"0123456789abcdef", 1), 1_000.0),
            (member(b"-sCCCCCCCCCCCCCC", 1_500), 1_100.0),
            (member(b"-rAAAAAAAAAAAAAA", 400), 1_300.0),
        ];
        members.extend((0..22u32).map(|i| (member(b"-rBBBBBBBBBBBBBB", 10 + i), 1_400.0 + f64::from(i))));
        let window = crate::model::summarize(&members, 2_000);
        let state = State {
            client_id: None,
            available: -7,
            window,
            expired: 0,
            ttl: vec![KeyTtl { key: "{erl:llm}:value".into(), ttl_ms: -1 }],
        };
        let config = Config { rate: 1_000, interval_ms: 60_000, limiter_type: LimiterType::Overall, keep_alive_ms: 0 };
        let report = ShowReport {
            name: "erl:llm".into(),
            config,
            now_ms: 2_000,
            config_ttl_ms: -1,
            state: Some(state),
            clients: vec![],
        };
        let text = show(&report);
        let expected_start = "limiter      erl:llm
type         overall
rate         1000 per 60000 ms (1m)
keepAlive    0 (never expires)
now          1970-01-01T00:00:02.000Z
ttl  erl:llm  no expiry
available    -7 of 1000 (below zero: settled costs above their reservations; acquires wait for permits to leave)
in window    2352 permits in 25 acquires (last 1m)
  oldest     1970-01-01T00:00:01.000Z (1s ago)
  newest     1970-01-01T00:00:01.421Z (579ms ago)
  reserved   23 in flight, 851 permits
    400 permits, age 700 ms
     10 permits, age 600 ms
     11 permits, age 599 ms
";
        assert!(text.starts_with(expected_start), "{text}");
        let expected_end = "     28 permits, age 582 ms
    ... 3 more (--json lists every one)
  settled    1 cost, 1500 permits
    1500 permits, age 900 ms
ttl  {erl:llm}:value  no expiry
";
        assert!(text.ends_with(expected_end), "{text}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["state"]["available"], -7);
        assert_eq!(json["state"]["window"]["reservations"]["count"], 23);
        assert_eq!(json["state"]["window"]["reservations"]["members"].as_array().unwrap().len(), 23, "all of them");
        assert_eq!(json["state"]["window"]["settled"]["members"][0]["age_ms"], 900);
        let plain =
            State { available: 3, window: crate::model::summarize(&members[..1], 2_000), ..report.state.unwrap() };
        let mut lines = String::new();
        state_lines(&mut lines, "", &plain, &config);
        assert!(!lines.contains("reserved") && !lines.contains("settled") && !lines.contains("below zero"), "{lines}");
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
            configurations: crate::plugin::summarize(&plugin, &crate::calendar::ZoneNames::read(json.as_bytes())),
        };
        assert_eq!(
            validate(&report),
            r#"valid: 2 configurations (envoy build)
global: redis cluster webdis (http); failure_mode allow
  per-user  header x-user-id  100 per 1m  enforce, 2 permits a request
  per-ip    client_ip         20 per 1s   shadow, per-client
_rules_[0]: routes login; domains *.example.com; redis cluster webdis (http); failure_mode allow; exempt client_ips 10.0.0.0/8
  login  header x-user-id, path  1 per 1m  enforce, for values ["bob:/x"], limiter auth:login
  login  header x-user-id, path  2 per 1m  enforce, limiter auth:login
"#
        );
    }

    #[test]
    fn explain_shows_the_verdict_then_each_rule_and_its_window() {
        let window = Window {
            acquires: 3,
            permits: 3,
            oldest_ms: Some(1_000),
            oldest_age_ms: Some(1_500),
            newest_ms: Some(2_000),
            newest_age_ms: Some(500),
            unreadable: 0,
            reservations: HeldTotal::default(),
            settled: HeldTotal::default(),
        };
        let ttl = vec![KeyTtl { key: "{erl:u:alice}:value".into(), ttl_ms: 3_000 }];
        let state = State { client_id: None, available: 0, window, expired: 1, ttl };
        let config = Config { rate: 3, interval_ms: 4_000, limiter_type: LimiterType::Overall, keep_alive_ms: 0 };
        let limited = RuleExplain {
            rule: "u".into(),
            entry: 0,
            mode: "enforce",
            value_match: None,
            rate: 5,
            interval_ms: 4_000,
            period: None,
            time_zone: None,
            permits: 1,
            permits_from: PermitsFrom::Rule,
            key: crate::plugin::key_parts(&edge_rate_limiter::key::KeySource::header("x-user-id")),
            rates_by: None,
            cost: None,
            applies: Applies::Limiter,
            limiter: Some("erl:u:alice".into()),
            redis_config: Some(config),
            config_step: Some(ConfigStep::Obey),
            effective: Some(config),
            config_ttl_ms: Some(-1),
            counter: None,
            calendar: None,
            windows: vec![WindowExplain {
                state,
                verdict: RuleVerdict::Rejected,
                remaining: None,
                wait_ms: Some(1_500),
                delay_ms: Some(1_503),
            }],
            verdict: RuleVerdict::Rejected,
            remaining: None,
            wait_ms: Some(1_500),
            delay_ms: Some(1_503),
            problem: None,
        };
        let skipped = RuleExplain {
            rule: "ip".into(),
            key: crate::plugin::key_parts(&edge_rate_limiter::key::KeySource::ClientIp),
            applies: Applies::NoKey,
            verdict: RuleVerdict::Skipped,
            mode: "shadow",
            limiter: None,
            windows: Vec::new(),
            ..limited.clone()
        };
        let report = ExplainReport {
            configuration: Some("global".into()),
            verdict: Verdict::Rejected,
            status: Some(429),
            rejected_by: Some("u".into()),
            wait_ms: Some(1_500),
            retry_after_s: Some(2),
            rules: vec![limited, skipped],
            ..ExplainReport::unlimited(crate::request::Request::new(&[], None, None, None, None), 2_500)
        };
        assert_eq!(
            explain(&report),
            "configuration  global
verdict        rejected (429) by u: allowed in 1s 500ms (Retry-After: 2)
now            1970-01-01T00:00:02.500Z
rule u (enforce): 5 per 4s
  key          header x-user-id
  limiter      erl:u:alice
  config       Redis holds 3 per 4s (overall, keepAlive none): it wins (rate_source redis)
  ttl  erl:u:alice  no expiry
  available    0 of 3
  in window    3 permits in 3 acquires (last 4s)
    oldest     1970-01-01T00:00:01.000Z (1s 500ms ago)
    newest     1970-01-01T00:00:02.000Z (500ms ago)
    expired    1 members older than the window (released by the next acquire)
  ttl  {erl:u:alice}:value  3s (3000 ms)
  verdict      rejected: allowed in 1s 500ms (Retry-After: 2)
rule ip (shadow): 5 per 4s: skipped: the request has no key value
  key          client_ip
"
        );
        let unlimited = ExplainReport::unlimited(report.request, 0);
        assert!(explain(&unlimited).ends_with("verdict        unlimited\n"));
    }

    /// The token-budget configuration of docs/configuration.md and docs/operating.md.
    pub(crate) const TOKENS: &str = r#"{"redis":{"cluster":"webdis","timeout":"200ms"},"rules":[{"name":"tokens",
        "limit_by":[{"header":"authorization"},{"body":"model"}],"rate":100000,"interval":"1m",
        "rates_by":{"header":"x-plan"},"rates_by_value":[{"values":["gold"],"rate":1000000}],
        "cost":{"reserve":{"body":"openai","default":4000},"settle":{"usage":"openai","include_usage":true}}}]}"#;

    fn validated(json: &str) -> ValidateReport {
        let plugin = crate::plugin::load(json.as_bytes(), crate::plugin::Build::Envoy).unwrap();
        ValidateReport {
            valid: true,
            build: "envoy",
            error: None,
            configurations: crate::plugin::summarize(&plugin, &crate::calendar::ZoneNames::read(json.as_bytes())),
        }
    }

    #[test]
    fn validate_says_where_a_body_key_part_and_a_body_reservation_are_read() {
        let report = validated(TOKENS);
        assert_eq!(
            validate(&report),
            r#"valid: 1 configuration (envoy build)
global: redis cluster webdis (http); failure_mode allow
  tokens  header authorization, body model (unreadable body: !missing)  1000000 per 1m  enforce, for values ["gold"] of header x-plan
  tokens  header authorization, body model (unreadable body: !missing)  100000 per 1m   enforce
    reserve  the body's max_completion_tokens|max_tokens|max_output_tokens (openai), else 4000
    settle   the usage in the response body (openai, include_usage)
"#
        );
        let json = serde_json::to_value(&report).unwrap();
        let rule = &json["configurations"][0]["rules"][1];
        assert_eq!(rule["limit_by"], serde_json::json!([{"header": "authorization"}, {"body": "model"}]));
        assert_eq!(
            rule["key"],
            serde_json::json!([
                {"source": "header", "text": "header authorization", "unread": null},
                {"source": "body", "text": "body model", "unread": "!missing"}])
        );
        assert_eq!(rule["on_missing"], "skip");
        assert_eq!(
            rule["rates_by"],
            serde_json::json!([{"source": "header", "text": "header x-plan", "unread": null}])
        );
        assert_eq!(
            rule["cost"],
            serde_json::json!({
                "reserve": {"source": "body", "from": ["max_completion_tokens", "max_tokens", "max_output_tokens"],
                    "api": "openai", "default": 4000},
                "settle": {"source": "usage", "usage": "openai", "from": [], "include_usage": true, "weights": null}})
        );
        assert_eq!(rule["permits"], 4000);
    }

    #[test]
    fn validate_words_every_key_source_reservation_and_settlement() {
        let json = r#"{"redis":{"cluster":"webdis"},"rules":[
            {"name":"fixed","limit_by":{"query":"key"},"rate":100,"interval":"1m","on_missing":"deny",
             "cost":{"reserve":40,"settle":{"response_header":"X-Cost"}}},
            {"name":"header","limit_by":[{"cookie":"s"},{"x_forwarded_for":2}],"rate":100,"interval":"1m",
             "cost":{"reserve":{"header":"x-max-tokens","default":10},"settle":{"usage":{"paths":["usage.a","b"]}}}},
            {"name":"property","limit_by":{"property":["metadata","envoy.jwt","sub"]},"rate":100,"interval":"1m",
             "cost":{"reserve":{"property":"filter_state.max","default":10},
                     "settle":{"usage":"anthropic","weights":{"cached_input":0.1,"output":4}}}},
            {"name":"paths","limit_by":{"client_ip":{"ipv4_prefix":24}},"rate":100,"interval":"1m",
             "cost":{"reserve":{"body":{"paths":["a.b","c"]},"default":10},"settle":{"usage":"gemini"}}},
            {"name":"plan","limit_by":{"body":"user.id"},"rate":5,"interval":"1s","permits":2,
             "rates_by":{"body":"plan"},"rates_by_value":[{"values":["pro"],"rate":10}]}]}"#;
        assert_eq!(
            validate(&validated(json)),
            r#"valid: 1 configuration (envoy build)
global: redis cluster webdis (http); failure_mode allow
  fixed     query key                                 100 per 1m  enforce, on_missing deny
    reserve  40
    settle   response header x-cost
  header    cookie s, x_forwarded_for 2 hops          100 per 1m  enforce
    reserve  header x-max-tokens, else 10
    settle   the response body's usage.a + b
  property  property ["metadata","envoy.jwt","sub"]   100 per 1m  enforce
    reserve  property filter_state.max, else 10
    settle   the usage in the response body (anthropic, weights input 1 cached_input 0.1 cache_write 1 output 4)
  paths     client_ip /24 (IPv6 /128)                 100 per 1m  enforce
    reserve  the body's a.b|c, else 10
    settle   the usage in the response body (gemini)
  plan      body user.id (unreadable body: !missing)  10 per 1s   enforce, for values ["pro"] of body plan (unreadable body: !missing), 2 permits a request
  plan      body user.id (unreadable body: !missing)  5 per 1s    enforce, 2 permits a request
"#
        );
    }

    #[test]
    fn explain_says_where_the_key_and_the_reservation_are_read_and_what_explain_cannot_read() {
        let calls = r#"{"name":"calls","limit_by":{"header":"authorization"},"rate":500,"interval":"1m",
            "cost":{"reserve":{"header":"x-max-tokens","default":40},"settle":{"response_header":"x-cost"}}}"#;
        let json = format!("{},{calls}]}}", TOKENS.strip_suffix("]}").unwrap());
        let config = edge_rate_limiter::config::PluginConfig::from_json(json.as_bytes()).unwrap();
        let headers: Vec<_> = ["authorization:sk-a", "x-plan:gold", "x-max-tokens:250"]
            .iter()
            .map(|h| crate::request::parse_header(h).unwrap())
            .collect();
        let request = crate::request::Request::new(&headers, Some("/v1/chat/completions"), None, None, None);
        let text = explain(&crate::explain::without_redis(&config, request));
        assert!(
            text.ends_with(
                r#"rule tokens (enforce, rates_by_value values ["gold"]): 1000000 per 1m, 4000 permits a request
  key          header authorization, body model (unreadable body: !missing; explain reads no body)
  rates_by     header x-plan
  reserve      the body's max_completion_tokens|max_tokens|max_output_tokens (openai), else 4000; this request: 4000 (explain reads no body)
  settle       the usage in the response body (openai, include_usage)
  limiter      erl:tokens:sk-a:!missing
rule calls (enforce): 500 per 1m, 250 permits a request
  key          header authorization
  reserve      header x-max-tokens, else 40; this request: 250
  settle       response header x-cost
  limiter      erl:calls:sk-a
"#
            ),
            "{text}"
        );
        let request = crate::request::Request::new(&headers[..1], None, None, None, None);
        let text = explain(&crate::explain::without_redis(&config, request));
        assert!(
            text.contains(
                "  reserve      header x-max-tokens, else 40; this request: 40 (no whole number in x-max-tokens)\n"
            ),
            "{text}"
        );
        assert!(text.contains("  limiter      erl:tokens:sk-a:!missing\n"), "no plan: the default entry, {text}");
    }

    /// A counter rule beside a sliding log one.
    const COUNTER: &str = r#"{"redis":{"cluster":"webdis"},"rules":[
        {"name":"per-user","limit_by":{"header":"x-user-id"},"rate":5,"interval":"2s","layout":"sliding_window_counter"},
        {"name":"everyone","limit_by":"global","rate":100,"interval":"2s"}]}"#;

    #[test]
    fn validate_and_list_name_the_sliding_window_counter() {
        let report = validated(COUNTER);
        assert_eq!(
            validate(&report),
            "valid: 1 configuration (envoy build)
global: redis cluster webdis (http); failure_mode allow
  per-user  header x-user-id  5 per 2s    enforce, sliding window counter, 20 slices
  everyone  global            100 per 2s  enforce
"
        );
        let json = serde_json::to_value(&report).unwrap();
        let rules = &json["configurations"][0]["rules"];
        assert_eq!((&rules[0]["layout"], &rules[0]["slices"]), (&"sliding_window_counter".into(), &20.into()));
        assert_eq!((&rules[1]["layout"], &rules[1]["slices"]), (&"sliding_log".into(), &serde_json::Value::Null));
        let config = Config { rate: 3, interval_ms: 2_000, limiter_type: LimiterType::Overall, keep_alive_ms: 0 };
        let entries = [
            ListEntry {
                name: "erl:a".into(),
                layout: "sliding_log",
                config: Some(config),
                problem: None,
                available: Some(2),
            },
            ListEntry {
                name: "erl:b:x".into(),
                layout: "sliding_window_counter",
                config: None,
                problem: None,
                available: None,
            },
        ];
        assert_eq!(
            list(&entries),
            "NAME     RATE        TYPE                    KEEPALIVE  AVAILABLE
erl:a    3/2s        overall                 none       2
erl:b:x  the rule's  sliding window counter  -          - (see show)
"
        );
    }

    #[test]
    fn explain_counts_a_counter_rules_slices_instead_of_a_config() {
        let config = edge_rate_limiter::config::PluginConfig::from_json(COUNTER.as_bytes()).unwrap();
        let headers = [crate::request::parse_header("x-user-id:alice").unwrap()];
        let mut report =
            crate::explain::without_redis(&config, crate::request::Request::new(&headers, None, None, None, None));
        report.rules.truncate(1);
        let hash = crate::counter::Hash { fields: vec![(981, 4), (1_000, 1)], unreadable: 0, ttl_ms: 2_090 };
        let rule = &mut report.rules[0];
        let window = crate::counter::CounterWindow::count("erl:per-user:alice", &hash, Some(2_000), 100_050);
        (rule.verdict, rule.wait_ms, rule.delay_ms) = (RuleVerdict::Rejected, Some(150), Some(150));
        rule.counter = Some(window);
        assert!(
            explain(&report).ends_with(
                "rule per-user (enforce): 5 per 2s
  key          header x-user-id
  limiter      erl:per-user:alice
  layout       sliding window counter, 20 slices of 100ms (no config in Redis: the rule's)
  in window    5 permits in 2 slices (last 2s: slices from 980 on, 1970-01-01T00:01:38.000Z)
    slice 981   1970-01-01T00:01:38.100Z  4 permits, leaves in 150ms
    slice 1000  1970-01-01T00:01:40.000Z  1 permit, leaves in 2s 50ms
  ttl  {erl:per-user:alice}:counter  2s 90ms (2090 ms)
  verdict      rejected: allowed in 150ms (Retry-After: 1)
"
            ),
            "{}",
            explain(&report)
        );
    }

    /// docs/configuration.md's monthly token budget, and a daily quota in UTC.
    const CALENDAR: &str = r#"{"redis":{"cluster":"webdis"},"rules":[
        {"name":"monthly","limit_by":{"header":"authorization"},"rate":50000000,
         "calendar":{"period":"month","time_zone":"Europe/Berlin"}},
        {"name":"daily","limit_by":"global","rate":3,"calendar":{"period":"day"}}]}"#;

    #[test]
    fn validate_and_explain_name_a_calendar_quotas_period_and_zone() {
        let report = validated(CALENDAR);
        assert!(validate(&report).contains(
            "  monthly  header authorization  50000000 per month (Europe/Berlin)  enforce
  daily    global                3 per day (UTC)                     enforce
"
        ));
        let json = serde_json::to_value(&report).unwrap();
        let monthly = &json["configurations"][0]["rules"][0];
        assert_eq!((&monthly["layout"], &monthly["period"]), (&"calendar".into(), &"month".into()));
        assert_eq!(
            (&monthly["time_zone"], &monthly["interval_ms"]),
            (&"Europe/Berlin".into(), &2_592_000_000_u64.into())
        );
        let plugin = crate::plugin::load(CALENDAR.as_bytes(), crate::plugin::Build::Envoy).unwrap();
        let config = plugin.global.unwrap();
        let mut report =
            crate::explain::without_redis(&config, crate::request::Request::new(&[], None, None, None, None));
        let zones = crate::calendar::ZoneNames::read(CALENDAR.as_bytes());
        let daily = crate::calendar::CalendarRule::of(&config.rules[1], 0, &zones).unwrap();
        // 1970-01-02T00:00:59.500Z: day 2 of 1970 holds 3 permits (its field 86400000), day 1 still 1.
        let hash = crate::counter::Hash { fields: vec![(86_400_000, 3), (0, 1)], unreadable: 0, ttl_ms: 86_341_500 };
        let rule = report.rules.iter_mut().find(|rule| rule.rule == "daily").unwrap();
        rule.calendar = Some(crate::calendar::CalendarWindow::count("erl:daily", &hash, Some(&daily), 86_459_500));
        rule.time_zone = Some("UTC".into());
        (rule.verdict, rule.wait_ms, rule.delay_ms) = (RuleVerdict::Rejected, Some(86_340_500), Some(86_340_500));
        assert_eq!(
            explain(&report).split_once("rule daily").map(|(_, rule)| rule),
            Some(
                " (enforce): 3 per day (UTC)
  key          global
  limiter      erl:daily
  layout       calendar quota, per day in UTC (no config in Redis: the rule's)
  period       day 1970-01-02 in UTC: 1970-01-02T00:00:00.000Z to 1970-01-03T00:00:00.000Z
  used         3 permits in this period (field 86400000)
  period ends  in 23h 59m 500ms (1970-01-03T00:00:00.000Z): the quota is whole again
  other fields 1 period
    period from 1970-01-01T00:00:00.000Z (0)  1 permit, an earlier period: no longer counted (goes when the hash expires)
  ttl  {erl:daily}:counter  23h 59m 1s 500ms (86341500 ms)
  verdict      rejected: allowed in 23h 59m 500ms (Retry-After: 86341)
"
            )
        );
    }
}
