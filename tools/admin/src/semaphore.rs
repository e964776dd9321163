//! Semaphores of in-flight rules (`max_in_flight`; docs/configuration.md, "In-flight limits") as `show`
//! reads them, without writing anything (`GET`, `ZRANGE ... WITHSCORES`): the permits free, the permits held,
//! each one's lease and holder. Layout as Redisson 4.7.0 `RedissonPermitExpirableSemaphore`
//! (docs/redisson.md, "Semaphores"): `name` the free count, `{name}:timeout` one member per permit held (its
//! 16-byte id), scored by its lease's end in ms since the epoch.
//!
//! Holders: the filter's permit ids begin with the first 8 bytes of its gateway process's client id (the
//! UUID of its PER_CLIENT keys), so the permits of one gateway share their first 16 hex digits; Redisson's
//! own ids are 16 random bytes, each its own holder.

use std::fmt::Write as _;

use serde::Serialize;

use edge_rate_limiter::config::{InflightApplies, PluginConfig};
use edge_rate_limiter::key::RequestView;
use edge_rate_limiter::script::{SemaphoreKeys, NO_LEASE_SCORE};

use crate::error::Result;
use crate::plugin::{key_parts, key_text};
use crate::redis_io::{integer, scored_members, Redis};
use crate::report::{Applies, InflightExplain, RuleVerdict};
use crate::units::{human_ms, timestamp};

/// `show` of a semaphore.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SemaphoreReport {
    /// The semaphore's name (its free-count key).
    pub name: String,
    /// "now" of the report, ms since the epoch.
    pub now_ms: u64,
    /// The permits free (`None`: no count key: the semaphore does not exist, or Redisson's 0 until set).
    pub free: Option<i64>,
    /// Permits held whose lease ended: reclaimed (back to `free`) by the next acquire, query or extension.
    pub ended: usize,
    /// The holders of the permits held, the most permits first.
    pub holders: Vec<Holder>,
    /// Every permit held, the earliest lease end first.
    pub permits: Vec<Permit>,
}

/// The permits of one holder.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Holder {
    /// The first 8 bytes of the permits' ids, as the start of a UUID (`xxxxxxxx-xxxx-xxxx`): a gateway
    /// process's client id begins so.
    pub holder: String,
    /// Permits held, their lease running.
    pub permits: usize,
}

/// One permit held.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Permit {
    /// Its id, 32 hex digits (how Java's Redisson names it).
    pub id: String,
    /// [`Holder::holder`] of it.
    pub holder: String,
    /// When its lease ends, ms since the epoch (`None`: no lease).
    pub lease_end_ms: Option<u64>,
}

/// The key of the permits held of semaphore `name` ([`SemaphoreKeys::taken`], as the filter names it).
fn timeout_key(name: &str) -> String {
    SemaphoreKeys::of(name).taken
}

/// Whether `name` is a semaphore: its key a string holding an integer (the free count), or its permits' key
/// a sorted set (a limiter's `name` is a hash; another string is neither, and `show` says so as for a
/// limiter).
///
/// # Errors
/// Redis unreachable.
pub fn is_semaphore(redis: &mut Redis, name: &str) -> Result<bool> {
    if redis.key_type(&timeout_key(name))? == "zset" {
        return Ok(true);
    }
    if redis.key_type(name)? != "string" {
        return Ok(false);
    }
    let value = redis.query(redis::cmd("GET").arg(name), &format!("reading {name}"))?;
    Ok(integer(&value).is_some())
}

/// Reads semaphore `name` at `now_ms`.
///
/// # Errors
/// Redis unreachable.
pub fn show(redis: &mut Redis, name: &str, now_ms: u64) -> Result<SemaphoreReport> {
    let free = integer(&redis.query(redis::cmd("GET").arg(name), &format!("reading {name}"))?);
    let key = timeout_key(name);
    let held =
        redis.query(redis::cmd("ZRANGE").arg(&key).arg(0).arg(-1).arg("WITHSCORES"), &format!("reading {key}"))?;
    let mut permits: Vec<Permit> = scored_members(&held)
        .into_iter()
        .map(|(id, score)| Permit {
            id: hex(&id),
            holder: holder_of(&id),
            lease_end_ms: (score < NO_LEASE_SCORE as f64).then_some(score.max(0.0) as u64),
        })
        .collect();
    permits.sort_by_key(|permit| permit.lease_end_ms.unwrap_or(u64::MAX));
    let running = |permit: &&Permit| permit.lease_end_ms.is_none_or(|end| end > now_ms);
    let ended = permits.len() - permits.iter().filter(running).count();
    let mut holders: Vec<Holder> = Vec::new();
    for permit in permits.iter().filter(running) {
        match holders.iter_mut().find(|holder| holder.holder == permit.holder) {
            Some(holder) => holder.permits += 1,
            None => holders.push(Holder { holder: permit.holder.clone(), permits: 1 }),
        }
    }
    holders.sort_by(|a, b| b.permits.cmp(&a.permits).then_with(|| a.holder.cmp(&b.holder)));
    Ok(SemaphoreReport { name: name.to_string(), now_ms, free, ended, holders, permits })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut out, byte| {
        let _ = write!(out, "{byte:02x}");
        out
    })
}

/// The first 8 bytes of a permit id as the start of a UUID: `xxxxxxxx-xxxx-xxxx`.
fn holder_of(id: &[u8]) -> String {
    let digits = hex(id.get(..8).unwrap_or(id));
    match (digits.get(..8), digits.get(8..12), digits.get(12..)) {
        (Some(a), Some(b), Some(c)) => format!("{a}-{b}-{c}"),
        _ => digits,
    }
}

/// `show` of a semaphore as text.
pub fn text_of(report: &SemaphoreReport) -> String {
    let mut out = String::new();
    let running: usize = report.holders.iter().map(|holder| holder.permits).sum();
    let _ = writeln!(out, "semaphore    {}", report.name);
    let _ = writeln!(out, "now          {}", timestamp(report.now_ms));
    match report.free {
        Some(free) => {
            let size = free + i64::try_from(report.permits.len()).unwrap_or(i64::MAX);
            let _ = writeln!(out, "size         {size} (free + held)");
            let _ = writeln!(out, "free         {free}");
        }
        None => {
            let _ = writeln!(out, "free         none (no count: the semaphore was never created)");
        }
    }
    let _ = writeln!(out, "in flight    {running}");
    if report.ended > 0 {
        let _ = writeln!(out, "ended        {} (lease over: free again at the next acquire)", report.ended);
    }
    for holder in &report.holders {
        let _ = writeln!(out, "  holder {}  {} permit(s)", holder.holder, holder.permits);
    }
    for permit in &report.permits {
        let lease = match permit.lease_end_ms {
            None => "no lease".to_string(),
            Some(end) if end > report.now_ms => format!("lease ends in {}", human_ms(end - report.now_ms)),
            Some(end) => format!("lease ended {} ago", human_ms(report.now_ms - end)),
        };
        let _ = writeln!(out, "  permit {}  {lease}", permit.id);
    }
    out
}

/// The in-flight rules of `config` for `request` at `now_ms`, read without writing anything, as the
/// filter's acquire would find them (`InflightRule::applies` names the semaphore, as the filter does).
///
/// # Errors
/// Redis unreachable.
pub fn explain(
    redis: &mut Redis,
    config: &PluginConfig,
    request: &impl RequestView,
    now_ms: u64,
) -> Result<Vec<InflightExplain>> {
    let mut explained = Vec::new();
    for rule in &config.inflight {
        let mut entry = InflightExplain {
            rule: rule.name.clone(),
            mode: rule.mode.name(),
            max_in_flight: rule.max_in_flight,
            key: key_parts(&rule.source),
            applies: Applies::Limiter,
            semaphore: None,
            free: None,
            in_flight: 0,
            verdict: RuleVerdict::Skipped,
            wait_ms: None,
            retry_after_s: None,
        };
        match rule.applies(request) {
            InflightApplies::Exempt => entry.applies = Applies::Exempt,
            InflightApplies::NoKey => entry.applies = Applies::NoKey,
            InflightApplies::Denied => (entry.applies, entry.verdict) = (Applies::Denied, RuleVerdict::Denied),
            InflightApplies::Semaphore { name } => {
                let state = show(redis, &name, now_ms)?;
                let count = state.free.unwrap_or(i64::try_from(rule.max_in_flight).unwrap_or(i64::MAX));
                let free = count.saturating_add(i64::try_from(state.ended).unwrap_or(0));
                entry.in_flight = state.holders.iter().map(|holder| holder.permits).sum();
                entry.free = Some(free);
                entry.semaphore = Some(name);
                if free >= 1 {
                    entry.verdict = RuleVerdict::Allowed;
                } else {
                    entry.verdict = RuleVerdict::Rejected;
                    let running = state.permits.iter().filter_map(|p| p.lease_end_ms).find(|end| *end > now_ms);
                    entry.wait_ms = running.map(|end| end - now_ms);
                }
            }
        }
        if matches!(entry.verdict, RuleVerdict::Rejected | RuleVerdict::Denied) {
            entry.retry_after_s = Some(rule.retry_after_ms.div_ceil(1000).max(1));
        }
        explained.push(entry);
    }
    Ok(explained)
}

/// An in-flight rule of `explain` as text.
pub fn explain_lines(out: &mut String, rule: &InflightExplain) {
    let _ = write!(out, "rule {} ({}): {} in flight at once", rule.rule, rule.mode, rule.max_in_flight);
    let what = match (rule.applies, rule.verdict) {
        (Applies::Exempt, _) => "skipped: the rule's exempt matches".to_string(),
        (Applies::NoKey, _) => "skipped: the request has no key value".to_string(),
        (Applies::Denied, _) => "denied: the request has no key value (on_missing deny), without Redis".to_string(),
        (_, RuleVerdict::Allowed) => format!("allowed: {} free, {} in flight", rule.free.unwrap_or(0), rule.in_flight),
        (_, _) => match rule.wait_ms {
            Some(wait) => format!(
                "rejected: none free, {} in flight; the earliest lease ends in {}",
                rule.in_flight,
                human_ms(wait)
            ),
            None => format!("rejected: none free, {} in flight", rule.in_flight),
        },
    };
    let _ = writeln!(out, ": {what}");
    let _ = writeln!(out, "  key          {}", key_text(&rule.key));
    if let Some(name) = &rule.semaphore {
        let _ = writeln!(out, "  semaphore    {name} (erl-admin show {name})");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn names_and_holders_follow_redissons_layout_and_the_filters_ids() {
        assert_eq!(timeout_key("erl:inflight:alice"), "{erl:inflight:alice}:timeout");
        assert_eq!(timeout_key("{erl:total}"), "{erl:total}:timeout");
        let id = [0x01, 0x23, 0xab, 0xcd, 0xef, 0x45, 0x46, 0x78, 9, 9, 9, 9, 9, 9, 9, 9];
        assert_eq!(holder_of(&id), "0123abcd-ef45-4678");
        assert_eq!(hex(&id[..2]), "0123");
    }

    #[test]
    fn the_text_counts_running_and_ended_leases() {
        let permit = |id: &str, holder: &str, end| Permit { id: id.into(), holder: holder.into(), lease_end_ms: end };
        let report = SemaphoreReport {
            name: "erl:inflight:alice".into(),
            now_ms: 10_000,
            free: Some(1),
            ended: 1,
            holders: vec![Holder { holder: "0123abcd-ef45-4678".into(), permits: 2 }],
            permits: vec![permit("aa", "x", Some(9_000)), permit("bb", "y", Some(12_000)), permit("cc", "y", None)],
        };
        let text = text_of(&report);
        assert!(text.contains("size         4 (free + held)"), "{text}");
        assert!(text.contains("in flight    2"), "{text}");
        assert!(text.contains("ended        1"), "{text}");
        assert!(text.contains("holder 0123abcd-ef45-4678  2 permit(s)"), "{text}");
        assert!(text.contains("permit bb  lease ends in 2s"), "{text}");
        assert!(text.contains("permit cc  no lease"), "{text}");
    }
}
