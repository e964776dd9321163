//! Response headers: `Retry-After`, the IETF `RateLimit-Policy` / `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers-11) and the legacy `X-RateLimit-*` headers.
//!
//! Built for the request path: a header value is a constant, a value shared with the configuration (a
//! rule's policy is formatted once, see [`policy_value`]), or a short string written with `itoa`.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::config::HeaderStyle;

use super::{Builder, HeaderValue, Headers};

/// One rule's state after its acquire, as the rate limit headers report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota<'a> {
    /// The rule's name (the policy name in `RateLimit-Policy`).
    pub policy: &'a str,
    /// The rule's `RateLimit-Policy` member, prepared, when Redis holds the configured limit and window.
    pub prepared_policy: Option<&'a Rc<str>>,
    /// Permits per window, as Redis holds it.
    pub limit: u64,
    /// Window length, ms, as Redis holds it; 0 for an in-flight limit, which has no window (no `w`, `t` or
    /// `x-ratelimit-reset`: both are optional in draft-11).
    pub window_ms: u64,
    /// Permits left.
    pub remaining: u64,
    /// In ms: until the quota is whole again (the window length, after an allowed acquire) or until the
    /// next permit is released (Redisson's delay, after a rejection).
    pub reset_ms: u64,
}

/// Whole seconds, rounded up, of a number of milliseconds (`Retry-After` and header `t`/`w` values).
pub fn seconds_ceil(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// Appends `n` in decimal.
pub fn push_number(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// The `Retry-After` header for a delay in ms: whole seconds, rounded up, at least 1.
pub fn retry_after(delay_ms: u64) -> (&'static str, HeaderValue) {
    ("retry-after", HeaderValue::number(seconds_ceil(delay_ms).max(1)))
}

/// One `RateLimit-Policy` member: `"name";q=<limit>;w=<window seconds>`, or `"name";q=<limit>` for an
/// in-flight limit (`window_ms` 0: requests at once, no window).
pub fn policy_value(policy: &str, limit: u64, window_ms: u64) -> String {
    let mut out = String::with_capacity(policy.len() + 24);
    push_policy(&mut out, policy, limit, window_ms);
    out
}

fn push_policy(out: &mut String, policy: &str, limit: u64, window_ms: u64) {
    out.push('"');
    out.push_str(policy);
    out.push_str("\";q=");
    push_number(out, limit);
    if window_ms > 0 {
        out.push_str(";w=");
        push_number(out, seconds_ceil(window_ms));
    }
}

fn push_state(out: &mut Builder, quota: &Quota<'_>) {
    out.push_str("\"");
    out.push_str(quota.policy);
    out.push_str("\";r=");
    out.push_number(quota.remaining);
    if quota.window_ms > 0 {
        out.push_str(";t=");
        out.push_number(seconds_ceil(quota.reset_ms));
    }
}

/// The rate limit headers for the quotas of one request, in the given style, appended to `headers`.
///
/// Draft: `ratelimit-policy: "per-user";q=100;w=60` and `ratelimit: "per-user";r=42;t=12`, one list member
/// per rule. Legacy: `x-ratelimit-limit`, `-remaining`, `-reset` (seconds) of the rule with the fewest
/// permits left. An in-flight limit (`window_ms` 0) shows no window and no reset: `"in-flight";q=8` and
/// `"in-flight";r=3`, and no `x-ratelimit-reset` when it has the fewest left.
pub fn rate_limit_headers(style: HeaderStyle, quotas: &[Quota<'_>], headers: &mut Headers) {
    let Some(first) = quotas.first() else { return };
    if matches!(style, HeaderStyle::Draft | HeaderStyle::Both) {
        let policies = match (quotas.len(), first.prepared_policy) {
            (1, Some(prepared)) => HeaderValue::Shared(Rc::clone(prepared)),
            _ => {
                let mut policies = String::with_capacity(32 * quotas.len());
                for (index, q) in quotas.iter().enumerate() {
                    if index > 0 {
                        policies.push_str(", ");
                    }
                    match q.prepared_policy {
                        Some(prepared) => policies.push_str(prepared),
                        None => push_policy(&mut policies, q.policy, q.limit, q.window_ms),
                    }
                }
                HeaderValue::Owned(policies)
            }
        };
        let mut states = Builder::new();
        for (index, q) in quotas.iter().enumerate() {
            if index > 0 {
                states.push_str(", ");
            }
            push_state(&mut states, q);
        }
        headers.push(("ratelimit-policy", policies));
        headers.push(("ratelimit", states.into_value()));
    }
    if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
        if let Some(tightest) = quotas.iter().min_by_key(|q| q.remaining) {
            headers.push(("x-ratelimit-limit", HeaderValue::number(tightest.limit)));
            headers.push(("x-ratelimit-remaining", HeaderValue::number(tightest.remaining)));
            if tightest.window_ms > 0 {
                headers.push(("x-ratelimit-reset", HeaderValue::number(seconds_ceil(tightest.reset_ms))));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    fn quota(policy: &str, remaining: u64) -> Quota<'_> {
        Quota { policy, prepared_policy: None, limit: 100, window_ms: 60_000, remaining, reset_ms: 1_001 }
    }

    fn headers(style: HeaderStyle, quotas: &[Quota<'_>]) -> Vec<(&'static str, String)> {
        let mut out = Headers::new();
        rate_limit_headers(style, quotas, &mut out);
        out.into_iter().map(|(name, value)| (name, value.to_string())).collect()
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(&*retry_after(3).1, "1");
        assert_eq!(&*retry_after(1000).1, "1");
        assert_eq!(&*retry_after(1001).1, "2");
        assert_eq!(&*retry_after(0).1, "1");
    }

    #[test]
    fn draft_headers_list_every_rule() {
        assert_eq!(
            headers(HeaderStyle::Draft, &[quota("per-user", 42), quota("per-ip", 7)]),
            vec![
                ("ratelimit-policy", "\"per-user\";q=100;w=60, \"per-ip\";q=100;w=60".into()),
                ("ratelimit", "\"per-user\";r=42;t=2, \"per-ip\";r=7;t=2".into()),
            ]
        );
    }

    #[test]
    fn a_prepared_policy_is_shared_and_reads_the_same() {
        let prepared: Rc<str> = policy_value("per-user", 100, 60_000).into();
        let shared = Quota { prepared_policy: Some(&prepared), ..quota("per-user", 42) };
        let mut out = Headers::new();
        rate_limit_headers(HeaderStyle::Draft, std::slice::from_ref(&shared), &mut out);
        assert!(matches!(&out[0].1, HeaderValue::Shared(value) if Rc::ptr_eq(value, &prepared)));
        assert_eq!(
            headers(HeaderStyle::Draft, std::slice::from_ref(&shared)),
            headers(HeaderStyle::Draft, &[quota("per-user", 42)])
        );
        assert_eq!(
            headers(HeaderStyle::Draft, &[shared, quota("per-ip", 7)])[0].1,
            "\"per-user\";q=100;w=60, \"per-ip\";q=100;w=60"
        );
    }

    #[test]
    fn legacy_headers_report_the_tightest_rule() {
        assert_eq!(
            headers(HeaderStyle::Legacy, &[quota("a", 42), quota("b", 7)]),
            vec![
                ("x-ratelimit-limit", "100".into()),
                ("x-ratelimit-remaining", "7".into()),
                ("x-ratelimit-reset", "2".into()),
            ]
        );
        assert_eq!(headers(HeaderStyle::Both, &[quota("a", 1)]).len(), 5);
        assert!(headers(HeaderStyle::None, &[quota("a", 1)]).is_empty());
        assert!(headers(HeaderStyle::Draft, &[]).is_empty());
    }

    #[test]
    fn an_in_flight_limit_shows_no_window_and_no_reset() {
        let inflight = Quota { limit: 8, window_ms: 0, remaining: 3, reset_ms: 0, ..quota("in-flight", 3) };
        assert_eq!(
            headers(HeaderStyle::Draft, &[quota("per-user", 42), inflight.clone()]),
            vec![
                ("ratelimit-policy", "\"per-user\";q=100;w=60, \"in-flight\";q=8".into()),
                ("ratelimit", "\"per-user\";r=42;t=2, \"in-flight\";r=3".into()),
            ]
        );
        assert_eq!(policy_value("in-flight", 8, 0), "\"in-flight\";q=8");
        // The tightest is the in-flight limit: no reset to give.
        assert_eq!(
            headers(HeaderStyle::Legacy, &[quota("per-user", 42), inflight]),
            vec![("x-ratelimit-limit", "8".into()), ("x-ratelimit-remaining", "3".into())]
        );
    }
}
