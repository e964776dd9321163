//! A rule's `cost` in words, for `validate` and `explain` (`output`): where its reservation is read from
//! and where the real cost is settled from.

use std::fmt::Write as _;

use crate::report::{CostSummary, ReserveSource, ReserveSummary, SettleSource, SettleSummary};

/// A reservation in words: `4000`, `the body's max_completion_tokens|max_tokens|max_output_tokens
/// (openai), else 4000`, `header x-max-tokens, else 4000`.
pub fn reserve_text(reserve: &ReserveSummary) -> String {
    let from = reserve.from.join("|");
    match reserve.source {
        ReserveSource::Fixed => reserve.default.to_string(),
        ReserveSource::Body => {
            let api = reserve.api.map(|api| format!(" ({api})")).unwrap_or_default();
            format!("the body's {from}{api}, else {}", reserve.default)
        }
        ReserveSource::Header => format!("header {from}, else {}", reserve.default),
        ReserveSource::Property => format!("property {from}, else {}", reserve.default),
    }
}

/// Where a settlement reads the cost, in words: `the usage in the response body (openai, include_usage)`,
/// `the response body's usage.total_tokens`, `response header x-cost`.
pub fn settle_text(settle: &SettleSummary) -> String {
    if settle.source == SettleSource::ResponseHeader {
        return format!("response header {}", settle.from.join(", "));
    }
    let mut details = Vec::new();
    if settle.include_usage {
        details.push("include_usage".to_string());
    }
    if let Some(w) = &settle.weights {
        details.push(format!(
            "weights input {} cached_input {} cache_write {} output {}",
            w.input, w.cached_input, w.cache_write, w.output
        ));
    }
    match settle.usage {
        Some("paths") | None => {
            let details = details.iter().map(|d| format!(" ({d})")).collect::<String>();
            format!("the response body's {}{details}", settle.from.join(" + "))
        }
        Some(api) => {
            let details = [api.to_string()].into_iter().chain(details).collect::<Vec<_>>().join(", ");
            format!("the usage in the response body ({details})")
        }
    }
}

/// A cost's `reserve` and `settle` lines, labels padded to `pad` past `indent`; `request`: what the
/// reservation is for the request explained (empty in `validate`).
pub fn cost_lines(out: &mut String, indent: &str, pad: &str, cost: &CostSummary, request: &str) {
    let _ = writeln!(out, "{indent}reserve{pad}{}{request}", reserve_text(&cost.reserve));
    let _ = writeln!(out, "{indent}settle {pad}{}", settle_text(&cost.settle));
}
