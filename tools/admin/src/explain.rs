//! `explain`: which rules a request would meet, the limiters it would acquire from, their state in Redis,
//! and whether it would be allowed now or when.
//!
//! Which configuration applies is the filter's `Plugin::select`; which rules apply to the request and with
//! which limiter names is the filter's own `limiter::applications`, never worked out here. What the
//! acquire would find is read without writing anything (no script runs: `GET`, `ZRANGE`, `HMGET`, `PTTL`,
//! `SCAN`) and counted as the acquire script counts it (`model::Stored`): the config step first (a
//! missing limiter is created full, `rate_source: "config"` may update it), then the permits that left the
//! window come back.
//!
//! What it cannot see: a gateway's local block and leases (in the gateway's memory; both agree with Redis
//! on the answer, docs/configuration.md, "Local block"), and traffic between the read and the request.

use edge_rate_limiter::config::{LimiterType, Mode, Plugin, PluginConfig, RateSource, Reserve, Rule, WindowLayout};
use edge_rate_limiter::key::{extract, KeyValue, LimiterKeys};
use edge_rate_limiter::limiter::{applications, Applies as Applied};
use edge_rate_limiter::response::seconds_ceil;

use crate::calendar::{period_name, CalendarRule, CalendarWindow, ZoneNames};
use crate::counter::CounterWindow;
use crate::error::{AdminError, Result};
use crate::model::{next_config, parse_value, permits_of, summarize, Config, ConfigStep, Outlook, Stored};
use crate::ops::{client_ids, peek_config, peek_window, Peeked};
use crate::plugin::{config_name, cost_summary, key_parts, value_match_text};
use crate::redis_io::Redis;
use crate::report::InflightExplain;
use crate::report::{Applies, ExplainReport, PermitsFrom, RuleExplain, RuleVerdict, State, Verdict, WindowExplain};
use crate::request::Request;

/// `explain`: the request's configuration, each of its rules' limiter and state, and the verdict at
/// `now_ms`; for per-client limiters the window of `client_id`, or of every client found. `zones`: the zone
/// names of the configuration's calendar rules, as its document writes them.
///
/// # Errors
/// Redis unreachable or refusing the credentials; a limiter that cannot be read is a rule's `problem`.
pub fn explain(
    redis: &mut Redis,
    plugin: &Plugin,
    zones: &ZoneNames,
    request: Request,
    client_id: Option<&str>,
    now_ms: u64,
) -> Result<ExplainReport> {
    let mut report = ExplainReport::unlimited(request, now_ms);
    let Some((index, config)) = plugin.select(report.request.route.as_deref(), report.request.authority()) else {
        return Ok(report);
    };
    report.configuration = Some(config_name(index));
    let Some(applied) = applications(config, &report.request) else {
        report.verdict = Verdict::Exempt;
        return Ok(report);
    };
    for application in applied {
        let Some(rule) = config.rules.get(application.entry) else { continue };
        let permits = reserved(rule, &report.request);
        let entry = application.entry;
        let calendar = CalendarRule::of(rule, index, zones);
        let mut explained = match application.applies {
            Applied::Exempt => not_acquiring(rule, entry, permits, Applies::Exempt, RuleVerdict::Skipped),
            Applied::NoKey => not_acquiring(rule, entry, permits, Applies::NoKey, RuleVerdict::Skipped),
            Applied::Denied => not_acquiring(rule, entry, permits, Applies::Denied, RuleVerdict::Denied),
            Applied::Limiter { name } => {
                let mut explained = limiter_rule(redis, rule, entry, permits, &name, client_id, now_ms)?;
                if let Some(calendar) = &calendar {
                    read_calendar(redis, calendar, &name, now_ms, &mut explained)?;
                }
                explained
            }
        };
        explained.time_zone = calendar.and_then(|calendar| calendar.time_zone);
        report.rules.push(explained);
    }
    report.inflight = crate::semaphore::explain(redis, config, &report.request, now_ms)?;
    decide(&mut report, config);
    decide_inflight(&mut report, config);
    Ok(report)
}

/// The permits a request of entry `rule` asks for, as the filter counts them (its
/// `limiter::reservation::permits_of`): the rule's `permits`, or with a `cost.reserve` read from the request
/// its whole number clamped to 1..=rate, else its `default`. `explain` has no body and no properties: a
/// reservation read from them is its default.
pub fn reserved(rule: &Rule, request: &Request) -> (u64, PermitsFrom) {
    let Some(Reserve::From { source, default }) = rule.cost.as_ref().map(|cost| &cost.reserve) else {
        return (rule.permits, PermitsFrom::Rule);
    };
    let KeyValue::Value(value) = extract(source, request) else { return (*default, PermitsFrom::Default) };
    let asked = std::str::from_utf8(&value).ok().and_then(|text| text.trim().parse::<u64>().ok());
    asked.map_or((*default, PermitsFrom::Default), |permits| (permits.clamp(1, rule.rate), PermitsFrom::Request))
}

/// A rule that takes no permit from a limiter for this request; `permits`: what it would ask for
/// ([`reserved`]).
fn not_acquiring(
    rule: &Rule,
    entry: usize,
    (permits, permits_from): (u64, PermitsFrom),
    applies: Applies,
    verdict: RuleVerdict,
) -> RuleExplain {
    RuleExplain {
        rule: rule.name.clone(),
        entry,
        mode: rule.mode.name(),
        value_match: rule.value_match.as_ref().map(value_match_text),
        rate: rule.rate,
        interval_ms: rule.interval_ms,
        period: match rule.layout {
            WindowLayout::Calendar { period, .. } => Some(period_name(period)),
            _ => None,
        },
        time_zone: None,
        permits,
        permits_from,
        key: key_parts(&rule.source),
        rates_by: rule.rates_by.as_ref().map(key_parts),
        cost: rule.cost.as_ref().map(cost_summary),
        applies,
        limiter: None,
        redis_config: None,
        config_step: None,
        effective: None,
        config_ttl_ms: None,
        windows: Vec::new(),
        counter: None,
        calendar: None,
        verdict,
        remaining: None,
        wait_ms: None,
        delay_ms: None,
        problem: None,
    }
}

/// The config a rule's acquire sends (Redis's fields: rate, interval, type, keepAliveTime).
fn rule_config(rule: &Rule) -> Config {
    Config {
        rate: rule.rate,
        interval_ms: rule.interval_ms,
        limiter_type: rule.limiter_type,
        keep_alive_ms: rule.keep_alive_ms,
    }
}

/// A rule that acquires from limiter `name`: its config in Redis, the config the acquire obeys, each
/// window and its answer. Only an unreachable Redis fails; any other error is the rule's `problem`.
fn limiter_rule(
    redis: &mut Redis,
    rule: &Rule,
    entry: usize,
    permits: (u64, PermitsFrom),
    name: &str,
    client_id: Option<&str>,
    now_ms: u64,
) -> Result<RuleExplain> {
    let mut explained = not_acquiring(rule, entry, permits, Applies::Limiter, RuleVerdict::Unknown);
    explained.limiter = Some(name.to_string());
    if rule.layout.is_calendar() {
        // Read by `read_calendar`, which needs the zone's name.
        return Ok(explained);
    }
    match read_limiter(redis, rule, name, client_id, now_ms, &mut explained) {
        Ok(()) => {}
        Err(error @ (AdminError::Unreachable { .. } | AdminError::AuthFailed { .. })) => return Err(error),
        Err(error) => explained.problem = Some(error.to_string()),
    }
    Ok(explained)
}

fn read_limiter(
    redis: &mut Redis,
    rule: &Rule,
    name: &str,
    client_id: Option<&str>,
    now_ms: u64,
    explained: &mut RuleExplain,
) -> Result<()> {
    if rule.layout == WindowLayout::SlidingWindowCounter {
        return read_counter(redis, rule, name, now_ms, explained);
    }
    let wanted = rule_config(rule);
    let (held, record) = match peek_config(redis, name)? {
        None => (None, None),
        // Not initialized: the acquire's trySetRate fills in the missing fields (and, with no `type`,
        // starts afresh); an invalid field fails the acquire.
        Some((Err(AdminError::NotInitialized { .. }), _)) => (None, None),
        Some((held, record)) => (Some(held?), record),
    };
    let apply = rule.rate_source == RateSource::Config;
    // As the filter tells them apart: rate, interval and type; the keep-alive too when the rule applies its
    // config.
    let differs = |held: &Config| {
        (held.rate, held.interval_ms, held.limiter_type) != (wanted.rate, wanted.interval_ms, wanted.limiter_type)
            || apply && held.keep_alive_ms != wanted.keep_alive_ms
    };
    explained.redis_config = held.filter(differs);
    let (step, effective) = next_config(&wanted, apply, held.as_ref(), record.as_deref());
    explained.config_step = Some(step);
    explained.effective = Some(effective);
    explained.config_ttl_ms = Some(redis.pttl(name)?);
    let keys_of = |id: Option<&str>| LimiterKeys::new(name, id.unwrap_or(crate::ops::NO_CLIENT));
    let clients = windows_to_read(redis, name, effective.limiter_type, client_id)?;
    let type_changed = held.is_some_and(|held| held.limiter_type != effective.limiter_type);
    for id in clients {
        let keys = keys_of(id.as_deref());
        let (value_key, permits_key) = match effective.limiter_type {
            LimiterType::Overall => (&keys.value, &keys.permits),
            LimiterType::PerClient => (&keys.client_value, &keys.client_permits),
        };
        let Peeked { value, members, ttl } = match (effective.limiter_type, &id) {
            // A per-client limiter no gateway has used yet: nothing to read.
            (LimiterType::PerClient, None) => Peeked::default(),
            _ => peek_window(redis, name, value_key, permits_key)?,
        };
        let read = Stored { value: value.as_deref().map(parse_value), permits: permits_of(&members) };
        // What the acquire finds after its config step.
        let stored = match step {
            ConfigStep::Create => Stored::default(),
            ConfigStep::Update if type_changed => Stored::default(),
            ConfigStep::Update => read.updated(effective.rate, effective.interval_ms, now_ms),
            ConfigStep::Obey | ConfigStep::Stand => read,
        };
        let fresh = stored == Stored::default();
        // Keys the acquire deletes (a new or retyped limiter) or none at all: no TTL to show.
        let ttl = if fresh { Vec::new() } else { ttl };
        let window_members = if fresh { Vec::new() } else { in_window(&members, effective.interval_ms, now_ms) };
        let expired = if fresh { 0 } else { members.len() as u64 - window_members.len() as u64 };
        let state = State {
            client_id: id,
            available: stored.available_at(effective.rate, effective.interval_ms, now_ms),
            window: summarize(&window_members, now_ms),
            expired,
            ttl,
        };
        let outlook = stored.outlook(effective.rate, effective.interval_ms, explained.permits, now_ms);
        explained.windows.push(window_explain(state, outlook));
    }
    let (verdict, remaining, wait_ms, delay_ms) = worst(&explained.windows);
    explained.verdict = verdict;
    explained.remaining = remaining;
    explained.wait_ms = wait_ms;
    explained.delay_ms = delay_ms;
    Ok(())
}

/// A rule with `layout: "sliding_window_counter"`: its limiter's hash (none yet: an empty window) counted
/// with the rule's rate and interval, as the acquire script counts it.
fn read_counter(redis: &mut Redis, rule: &Rule, name: &str, now_ms: u64, explained: &mut RuleExplain) -> Result<()> {
    let window = CounterWindow::count(name, &crate::counter_ops::read(redis, name)?, Some(rule.interval_ms), now_ms);
    (explained.verdict, explained.remaining, explained.wait_ms, explained.delay_ms) =
        answer(window.outlook(rule.rate, explained.permits));
    explained.counter = Some(window);
    Ok(())
}

/// A rule with `calendar`: its limiter's hash (none yet: nothing taken) counted with the rule's period and
/// zone, as the acquire script counts it. Only an unreachable Redis fails; any other error is the `problem`.
fn read_calendar(
    redis: &mut Redis,
    rule: &CalendarRule,
    name: &str,
    now_ms: u64,
    explained: &mut RuleExplain,
) -> Result<()> {
    let hash = match crate::counter_ops::read(redis, name) {
        Ok(hash) => hash,
        Err(error @ (AdminError::Unreachable { .. } | AdminError::AuthFailed { .. })) => return Err(error),
        Err(error) => {
            explained.problem = Some(error.to_string());
            return Ok(());
        }
    };
    let window = CalendarWindow::count(name, &hash, Some(rule), now_ms);
    (explained.verdict, explained.remaining, explained.wait_ms, explained.delay_ms) =
        answer(window.outlook(rule.rate, explained.permits));
    explained.calendar = Some(window);
    Ok(())
}

/// Whose windows of limiter `name` to read: the one window of an overall limiter; of a per-client one,
/// `client_id`'s, or every gateway's that has one (none yet: one fresh window).
fn windows_to_read(
    redis: &mut Redis,
    name: &str,
    limiter_type: LimiterType,
    client_id: Option<&str>,
) -> Result<Vec<Option<String>>> {
    Ok(match (limiter_type, client_id) {
        (LimiterType::Overall, _) => vec![None],
        (LimiterType::PerClient, Some(id)) => vec![Some(id.to_string())],
        (LimiterType::PerClient, None) => {
            let found = client_ids(redis, name)?;
            if found.is_empty() {
                // No gateway has a window yet: each starts full.
                vec![None]
            } else {
                found.into_iter().map(Some).collect()
            }
        }
    })
}

/// The members scored after `now_ms - interval_ms`: those still in the window.
fn in_window(members: &[(Vec<u8>, f64)], interval_ms: u64, now_ms: u64) -> Vec<(Vec<u8>, f64)> {
    let cutoff = now_ms.saturating_sub(interval_ms) as f64;
    members.iter().filter(|(_, score)| *score > cutoff).cloned().collect()
}

fn window_explain(state: State, outlook: Outlook) -> WindowExplain {
    let (verdict, remaining, wait_ms, delay_ms) = answer(outlook);
    WindowExplain { state, verdict, remaining, wait_ms, delay_ms }
}

/// An outlook as a window's answer: verdict, remaining, wait and delay.
fn answer(outlook: Outlook) -> (RuleVerdict, Option<u64>, Option<u64>, Option<u64>) {
    match outlook {
        Outlook::Allowed { remaining } => (RuleVerdict::Allowed, Some(remaining), None, None),
        Outlook::Rejected { wait_ms, delay_ms } => (RuleVerdict::Rejected, None, wait_ms, Some(delay_ms)),
        Outlook::Never => (RuleVerdict::Never, None, None, None),
    }
}

/// A rule's answer from its windows: the worst one (never, then rejected with the longest wait, then
/// allowed with the fewest left): a per-client limiter without `--client-id` answers for every gateway.
fn worst(windows: &[WindowExplain]) -> (RuleVerdict, Option<u64>, Option<u64>, Option<u64>) {
    if windows.iter().any(|w| w.verdict == RuleVerdict::Never) {
        return (RuleVerdict::Never, None, None, None);
    }
    let rejected: Vec<&WindowExplain> = windows.iter().filter(|w| w.verdict == RuleVerdict::Rejected).collect();
    if !rejected.is_empty() {
        let wait = rejected.iter().map(|w| w.wait_ms).try_fold(0, |most, wait| wait.map(|wait| wait.max(most)));
        let delay = rejected.iter().filter_map(|w| w.delay_ms).max();
        return (RuleVerdict::Rejected, None, wait, delay);
    }
    let remaining = windows.iter().filter_map(|w| w.remaining).min();
    (RuleVerdict::Allowed, remaining, None, None)
}

/// The overall verdict from the rules' answers, as the filter decides: a denied rule rejects at once
/// (without Redis); otherwise the first enforced rule that rejects names the rejection, the longest delay
/// is `Retry-After` and the longest wait is when every limiter admits; shadow rules never reject.
fn decide(report: &mut ExplainReport, config: &PluginConfig) {
    let enforced = |rule: &&RuleExplain| rule.mode == Mode::Enforce.name();
    let rejecting =
        |rule: &&RuleExplain| matches!(rule.verdict, RuleVerdict::Denied | RuleVerdict::Rejected | RuleVerdict::Never);
    report.shadow_rejected_by =
        report.rules.iter().filter(|r| !enforced(r) && rejecting(r)).map(|r| r.rule.clone()).collect();
    let denied = report.rules.iter().filter(enforced).find(|r| r.verdict == RuleVerdict::Denied);
    let rejected: Vec<&RuleExplain> = report.rules.iter().filter(enforced).filter(rejecting).collect();
    if let Some(denied) = denied {
        report.verdict = Verdict::Rejected;
        report.rejected_by = Some(denied.rule.clone());
    } else if let Some(first) = rejected.first() {
        report.verdict = Verdict::Rejected;
        report.rejected_by = Some(first.rule.clone());
        report.wait_ms = rejected.iter().map(|r| r.wait_ms).try_fold(0, |most, wait| wait.map(|w| w.max(most)));
        if rejected.iter().all(|r| r.verdict == RuleVerdict::Rejected) {
            report.retry_after_s = rejected.iter().filter_map(|r| r.delay_ms).max().map(retry_after_s);
        }
    } else {
        report.verdict = Verdict::Allowed;
        report.remaining = report.rules.iter().filter(enforced).filter_map(|r| r.remaining).min();
    }
    if report.verdict == Verdict::Rejected {
        report.status = Some(config.rejection.status);
    }
}

/// The in-flight rules' part of the verdict: the filter asks them before the rate rules, so the first
/// enforced one that refuses decides (the rate rules are not asked); shadow ones that would refuse are
/// named; an admitted request's remaining counts their free permits too.
fn decide_inflight(report: &mut ExplainReport, config: &PluginConfig) {
    let refusing = |rule: &&InflightExplain| matches!(rule.verdict, RuleVerdict::Denied | RuleVerdict::Rejected);
    let enforced = |rule: &&InflightExplain| rule.mode == Mode::Enforce.name();
    let shadow = report.inflight.iter().filter(|r| !enforced(r) && refusing(r)).map(|r| r.rule.clone());
    report.shadow_rejected_by.splice(0..0, shadow.collect::<Vec<_>>());
    if let Some(first) = report.inflight.iter().filter(enforced).find(refusing) {
        report.verdict = Verdict::Rejected;
        report.rejected_by = Some(first.rule.clone());
        (report.wait_ms, report.retry_after_s) = (first.wait_ms, first.retry_after_s);
        report.status = Some(config.rejection.status);
        return;
    }
    if report.verdict == Verdict::Allowed {
        let free = report.inflight.iter().filter(enforced).filter_map(|r| r.free).map(|f| f.saturating_sub(1));
        let inflight_left = free.filter_map(|f| u64::try_from(f).ok()).min();
        report.remaining = match (report.remaining, inflight_left) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
}

/// `Retry-After` of a delay, seconds, as the filter computes it (`response::retry_after`: whole seconds
/// rounded up, at least 1).
pub fn retry_after_s(delay_ms: u64) -> u64 {
    seconds_ceil(delay_ms).max(1)
}

/// What `explain` reports of each rule of `config` for `request`, without Redis: its rules with their key,
/// permits, cost and limiter name, no window read (for the text's tests).
#[cfg(test)]
pub(crate) fn without_redis(config: &PluginConfig, request: Request) -> ExplainReport {
    let mut report = ExplainReport::unlimited(request, 0);
    report.configuration = Some("global".into());
    for applied in applications(config, &report.request).into_iter().flatten() {
        let Some(rule) = config.rules.get(applied.entry) else { continue };
        let permits = reserved(rule, &report.request);
        let mut explained = not_acquiring(rule, applied.entry, permits, Applies::Limiter, RuleVerdict::Unknown);
        if let Applied::Limiter { name } = applied.applies {
            explained.limiter = Some(name);
        }
        report.rules.push(explained);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(
        verdict: RuleVerdict,
        remaining: Option<u64>,
        wait_ms: Option<u64>,
        delay_ms: Option<u64>,
    ) -> WindowExplain {
        let empty = summarize(&[], 0);
        let state = State { client_id: None, available: 0, window: empty, expired: 0, ttl: Vec::new() };
        WindowExplain { state, verdict, remaining, wait_ms, delay_ms }
    }

    fn rule(name: &str, mode: Mode, verdict: RuleVerdict) -> RuleExplain {
        let config = PluginConfig::from_json(
            br#"{"redis":{"cluster":"c"},"rules":[{"name":"r","limit_by":"global","rate":5,"interval":1000}]}"#,
        )
        .unwrap();
        let rule = Rule { name: name.to_string(), mode, ..config.rules[0].clone() };
        not_acquiring(&rule, 0, (rule.permits, PermitsFrom::Rule), Applies::Limiter, verdict)
    }

    fn allowed(name: &str, mode: Mode, remaining: u64) -> RuleExplain {
        RuleExplain { remaining: Some(remaining), ..rule(name, mode, RuleVerdict::Allowed) }
    }

    fn rejected(name: &str, mode: Mode, wait_ms: u64, delay_ms: u64) -> RuleExplain {
        RuleExplain { wait_ms: Some(wait_ms), delay_ms: Some(delay_ms), ..rule(name, mode, RuleVerdict::Rejected) }
    }

    fn decided(rules: Vec<RuleExplain>) -> ExplainReport {
        let config = PluginConfig::from_json(
            br#"{"redis":{"cluster":"c"},"rejected_status":503,"rules":[{"name":"r","limit_by":"global","rate":5,"interval":1000}]}"#,
        )
        .unwrap();
        let mut report = ExplainReport {
            configuration: Some("global".into()),
            rules,
            ..ExplainReport::unlimited(Request::new(&[], None, None, None, None), 0)
        };
        decide(&mut report, &config);
        report
    }

    #[test]
    fn the_first_enforced_rejection_names_it_and_the_longest_wait_allows_it() {
        let report = decided(vec![
            allowed("a", Mode::Enforce, 7),
            rejected("b", Mode::Enforce, 1_500, 1_503),
            rejected("c", Mode::Enforce, 2_500, 900),
            rejected("d", Mode::Shadow, 9_000, 9_003),
        ]);
        assert_eq!((report.verdict, report.status), (Verdict::Rejected, Some(503)));
        assert_eq!(report.rejected_by.as_deref(), Some("b"));
        assert_eq!((report.wait_ms, report.retry_after_s), (Some(2_500), Some(2)), "a shadow rule never counts");
        assert_eq!(report.shadow_rejected_by, ["d"]);
    }

    #[test]
    fn a_denial_rejects_without_a_wait_and_shadow_rejections_let_the_request_go() {
        let denied =
            decided(vec![rejected("a", Mode::Enforce, 100, 103), rule("b", Mode::Enforce, RuleVerdict::Denied)]);
        assert_eq!((denied.rejected_by.as_deref(), denied.wait_ms, denied.retry_after_s), (Some("b"), None, None));
        let never = decided(vec![rule("a", Mode::Enforce, RuleVerdict::Never)]);
        assert_eq!((never.verdict, never.wait_ms, never.retry_after_s), (Verdict::Rejected, None, None));
        let shadow = decided(vec![
            allowed("a", Mode::Enforce, 3),
            allowed("b", Mode::Enforce, 1),
            rule("c", Mode::Shadow, RuleVerdict::Denied),
            rule("d", Mode::Enforce, RuleVerdict::Skipped),
        ]);
        assert_eq!((shadow.verdict, shadow.remaining, shadow.status), (Verdict::Allowed, Some(1), None));
        assert_eq!(shadow.shadow_rejected_by, ["c"]);
    }

    #[test]
    fn a_per_client_rule_answers_with_its_worst_window() {
        let allowed =
            [window(RuleVerdict::Allowed, Some(4), None, None), window(RuleVerdict::Allowed, Some(2), None, None)];
        assert_eq!(worst(&allowed), (RuleVerdict::Allowed, Some(2), None, None));
        let mixed = [
            window(RuleVerdict::Allowed, Some(4), None, None),
            window(RuleVerdict::Rejected, None, Some(300), Some(303)),
            window(RuleVerdict::Rejected, None, Some(900), Some(100)),
        ];
        assert_eq!(worst(&mixed), (RuleVerdict::Rejected, None, Some(900), Some(303)));
        let stuck =
            [window(RuleVerdict::Rejected, None, None, Some(5)), window(RuleVerdict::Rejected, None, Some(1), Some(4))];
        assert_eq!(worst(&stuck).2, None, "a window no wait frees: no wait for the rule");
        assert_eq!(worst(&[window(RuleVerdict::Never, None, None, None)]).0, RuleVerdict::Never);
    }

    #[test]
    fn retry_after_is_the_filters_header_value() {
        assert_eq!((retry_after_s(3), retry_after_s(1_000), retry_after_s(1_001)), (1, 1, 2));
    }

    /// docs/operating.md's token-budget rule, and a rule reserving a header's number.
    const TOKENS: &str = r#"{"redis":{"cluster":"webdis","timeout":"200ms"},"rules":[{"name":"tokens",
        "limit_by":[{"header":"authorization"},{"body":"model"}],"rate":100000,"interval":"1m",
        "rates_by":{"header":"x-plan"},"rates_by_value":[{"values":["gold"],"rate":1000000}],
        "cost":{"reserve":{"body":"openai","default":4000},"settle":{"usage":"openai","include_usage":true}}},
        {"name":"calls","limit_by":{"header":"authorization"},"rate":500,"interval":"1m",
        "cost":{"reserve":{"header":"x-max-tokens","default":40},"settle":{"response_header":"x-cost"}}}]}"#;

    /// A request of `headers` to `/v1/chat/completions`.
    fn request(headers: &[&str]) -> Request {
        let headers: Vec<_> = headers.iter().map(|h| crate::request::parse_header(h).unwrap()).collect();
        Request::new(&headers, Some("/v1/chat/completions"), None, None, None)
    }

    #[test]
    fn a_body_key_part_is_charged_as_missing_and_a_body_reservation_is_its_default() {
        let config = PluginConfig::from_json(TOKENS.as_bytes()).unwrap();
        let report = without_redis(&config, request(&["authorization:sk-a", "x-plan:gold", "x-max-tokens:250"]));
        let json = serde_json::to_value(&report).unwrap();
        let (tokens, calls) = (&json["rules"][0], &json["rules"][1]);
        assert_eq!(tokens["limiter"], "erl:tokens:sk-a:!missing", "charged to the API key's limiter");
        assert_eq!(tokens["key"][1], serde_json::json!({"source": "body", "text": "body model", "unread": "!missing"}));
        assert_eq!((&tokens["permits"], &tokens["permits_from"]), (&4000.into(), &"default".into()));
        assert_eq!(tokens["cost"]["reserve"]["source"], "body");
        assert_eq!((&calls["permits"], &calls["permits_from"]), (&250.into(), &"request".into()));
    }

    #[test]
    fn a_reservation_read_from_a_header_is_clamped_else_its_default() {
        let config = PluginConfig::from_json(TOKENS.as_bytes()).unwrap();
        let calls = &config.rules[2];
        let with = |value: &str| {
            let headers = [crate::request::parse_header(&format!("x-max-tokens:{value}")).unwrap()];
            reserved(calls, &Request::new(&headers, None, None, None, None))
        };
        assert_eq!(with(" 250 "), (250, PermitsFrom::Request));
        assert_eq!(with("9999999"), (500, PermitsFrom::Request), "clamped to the rate");
        assert_eq!(with("0"), (1, PermitsFrom::Request), "at least 1");
        assert_eq!(with("many"), (40, PermitsFrom::Default));
        assert_eq!(reserved(calls, &Request::new(&[], None, None, None, None)), (40, PermitsFrom::Default));
        let body = [crate::request::parse_header("max_tokens:9").unwrap()];
        let read = reserved(&config.rules[1], &Request::new(&body, None, None, None, None));
        assert_eq!(read, (4000, PermitsFrom::Default), "explain reads no body");
        let fixed = rule("r", Mode::Enforce, RuleVerdict::Allowed);
        assert_eq!((fixed.permits, fixed.permits_from), (1, PermitsFrom::Rule));
    }
}
