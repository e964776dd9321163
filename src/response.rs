//! Response headers: `Retry-After`, the IETF `RateLimit-Policy` / `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers-11) and the legacy `X-RateLimit-*` headers.

use crate::config::HeaderStyle;

/// One rule's state after its acquire, as the rate limit headers report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    /// The rule's name (the policy name in `RateLimit-Policy`).
    pub policy: String,
    /// Permits per window, as Redis holds it.
    pub limit: u64,
    /// Window length, ms, as Redis holds it.
    pub window_ms: u64,
    /// Permits left.
    pub remaining: u64,
    /// Time until permits are released (the oldest permit, or the delay when rejected), ms.
    pub reset_ms: u64,
}

/// Whole seconds, rounded up, of a number of milliseconds (`Retry-After` and header `t`/`w` values).
pub fn seconds_ceil(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// The `Retry-After` header for a delay in ms: whole seconds, rounded up, at least 1.
pub fn retry_after(delay_ms: u64) -> (String, String) {
    ("retry-after".to_string(), seconds_ceil(delay_ms).max(1).to_string())
}

/// The rate limit headers for the quotas of one request, in the given style.
///
/// Draft: `ratelimit-policy: "per-user";q=100;w=60` and `ratelimit: "per-user";r=42;t=12`, one list member
/// per rule. Legacy: `x-ratelimit-limit`, `-remaining`, `-reset` (seconds) of the rule with the fewest
/// permits left.
pub fn rate_limit_headers(style: HeaderStyle, quotas: &[Quota]) -> Vec<(String, String)> {
    let mut headers = Vec::new();
    if quotas.is_empty() {
        return headers;
    }
    if matches!(style, HeaderStyle::Draft | HeaderStyle::Both) {
        let policies: Vec<String> =
            quotas.iter().map(|q| format!("\"{}\";q={};w={}", q.policy, q.limit, seconds_ceil(q.window_ms))).collect();
        let states: Vec<String> = quotas
            .iter()
            .map(|q| format!("\"{}\";r={};t={}", q.policy, q.remaining, seconds_ceil(q.reset_ms)))
            .collect();
        headers.push(("ratelimit-policy".to_string(), policies.join(", ")));
        headers.push(("ratelimit".to_string(), states.join(", ")));
    }
    if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
        if let Some(tightest) = quotas.iter().min_by_key(|q| q.remaining) {
            headers.push(("x-ratelimit-limit".to_string(), tightest.limit.to_string()));
            headers.push(("x-ratelimit-remaining".to_string(), tightest.remaining.to_string()));
            headers.push(("x-ratelimit-reset".to_string(), seconds_ceil(tightest.reset_ms).to_string()));
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn quota(policy: &str, remaining: u64) -> Quota {
        Quota { policy: policy.into(), limit: 100, window_ms: 60_000, remaining, reset_ms: 1_001 }
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after(3).1, "1");
        assert_eq!(retry_after(1000).1, "1");
        assert_eq!(retry_after(1001).1, "2");
        assert_eq!(retry_after(0).1, "1");
    }

    #[test]
    fn draft_headers_list_every_rule() {
        let headers = rate_limit_headers(HeaderStyle::Draft, &[quota("per-user", 42), quota("per-ip", 7)]);
        assert_eq!(
            headers,
            vec![
                ("ratelimit-policy".into(), "\"per-user\";q=100;w=60, \"per-ip\";q=100;w=60".into()),
                ("ratelimit".into(), "\"per-user\";r=42;t=2, \"per-ip\";r=7;t=2".into()),
            ]
        );
    }

    #[test]
    fn legacy_headers_report_the_tightest_rule() {
        let headers = rate_limit_headers(HeaderStyle::Legacy, &[quota("a", 42), quota("b", 7)]);
        assert_eq!(
            headers,
            vec![
                ("x-ratelimit-limit".into(), "100".into()),
                ("x-ratelimit-remaining".into(), "7".into()),
                ("x-ratelimit-reset".into(), "2".into()),
            ]
        );
        assert_eq!(rate_limit_headers(HeaderStyle::Both, &[quota("a", 1)]).len(), 5);
        assert!(rate_limit_headers(HeaderStyle::None, &[quota("a", 1)]).is_empty());
        assert!(rate_limit_headers(HeaderStyle::Draft, &[]).is_empty());
    }
}
