//! Which rules apply to a request and with which limiters: each rule's key value, its `rates_by_value`
//! entry, its exemptions and `on_missing`, and the limiter name. Shared with tools that explain a decision
//! (`erl-admin explain`, through [`applications`]).

use crate::prelude::*;

use crate::config::{OnMissing, PluginConfig};
use crate::key::{extract, match_text, write_limiter_name, KeyValue, RequestView};

/// How one rule treats a request, before any Redis call ([`applications`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applies {
    /// The request matches the rule's `exempt`: the rule does not apply.
    Exempt,
    /// The request has no key value for the rule and `on_missing` is `skip`: the rule does not apply.
    NoKey,
    /// The request has no key value and `on_missing` is `deny`: rejected without Redis.
    Denied,
    /// The rule applies with this limiter (its Redis name).
    Limiter {
        /// The limiter name.
        name: String,
    },
}

/// One rule's [`Applies`] for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleApplication {
    /// The rule's name.
    pub rule: String,
    /// The index in `config.rules` of the entry that applies (a rule with `rates_by_value` has several:
    /// this one's `rate`, `interval_ms`, `permits` and `mode` are the rule's for this request).
    pub entry: usize,
    /// How it applies.
    pub applies: Applies,
}

/// Which rules apply to `request` and with which limiters: what [`start`] acts on, without Redis, for
/// tools that explain a decision (`erl-admin explain`). `None`: the request matches the configuration's
/// `exempt`, and no rule is looked at.
pub fn applications(config: &PluginConfig, request: &impl RequestView) -> Option<Vec<RuleApplication>> {
    if config.exempt.as_ref().is_some_and(|exempt| exempt.matches(request)) {
        return None;
    }
    let mut applications = Vec::new();
    let mut name = String::new();
    let mut first = 0;
    while let Some(end) = group_end(config, first) {
        let (entry, applies) = match resolve(config, first, end, request, &mut name) {
            Resolved::Limiter(entry) => (entry, Applies::Limiter { name: name.clone() }),
            Resolved::Exempt => (end - 1, Applies::Exempt),
            Resolved::NoKey => (end - 1, Applies::NoKey),
            Resolved::Denied => (end - 1, Applies::Denied),
        };
        let rule = config.rules.get(entry).map(|r| r.name.clone()).unwrap_or_default();
        applications.push(RuleApplication { rule, entry, applies });
        first = end;
    }
    Some(applications)
}

/// The end (exclusive) of the rule whose entries start at `first`: its `rates_by_value` entries and its
/// default entry, the first with no value match. `None` past the last rule.
pub(super) fn group_end(config: &PluginConfig, first: usize) -> Option<usize> {
    let rest = config.rules.get(first..).filter(|rest| !rest.is_empty())?;
    Some(first + rest.iter().position(|rule| rule.value_match.is_none()).map_or(rest.len(), |at| at + 1))
}

/// How the rule with entries `first..end` treats a request.
pub(super) enum Resolved {
    Exempt,
    NoKey,
    Denied,
    /// This entry applies; its limiter name is in the caller's buffer.
    Limiter(usize),
}

/// Reads the key value of the rule with entries `first..end` (all share the source, `on_missing`, `exempt`
/// and limiter base), picks the entry whose value match accepts it (or accepts the `rates_by` value; else
/// the default, last), and writes the limiter name into `name`. (Not inlined: one copy for its callers.)
#[inline(never)]
pub(super) fn resolve(
    config: &PluginConfig,
    first: usize,
    end: usize,
    request: &impl RequestView,
    name: &mut String,
) -> Resolved {
    let Some(rule) = config.rules.get(first) else { return Resolved::NoKey };
    if rule.exempt.as_ref().is_some_and(|exempt| exempt.matches(request)) {
        return Resolved::Exempt;
    }
    let value = match (extract(&rule.source, request), rule.on_missing) {
        (KeyValue::Missing, OnMissing::Skip) => return Resolved::NoKey,
        (KeyValue::Missing, OnMissing::Deny) => return Resolved::Denied,
        (KeyValue::Missing, OnMissing::Share) => KeyValue::Value(Vec::new()),
        (value, _) => value,
    };
    let mut entry = end - 1;
    if end - first > 1 {
        // `rates_by`: the entry is picked by another value than the key (a plan header).
        let picked_by = rule.rates_by.as_ref().map(|source| extract(source, request));
        if let Some(text) = match_text(picked_by.as_ref().unwrap_or(&value)) {
            let matched = config.rules.get(first..end - 1).and_then(|entries| {
                entries.iter().position(|e| e.value_match.as_ref().is_some_and(|m| m.matches(&text)))
            });
            entry = matched.map_or(entry, |at| first + at);
        }
    }
    if write_limiter_name(&rule.limiter, &value, name) {
        Resolved::Limiter(entry)
    } else {
        Resolved::NoKey
    }
}
