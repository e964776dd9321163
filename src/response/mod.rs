//! How a decided request leaves the filter, and every header it carries: [`Verdict`] (go on, or answer
//! locally), the [`Report`] its headers are rendered from, and their rendering, in one place: `Retry-After`,
//! `x-ratelimited-by`, `x-shadow-ratelimited-by`, `x-envoy-ratelimited` and the rate limit headers
//! ([`values`]: the IETF draft and legacy fields, header values without allocation). [`cache`] keeps the
//! serialized headers of the last local reply.

use alloc::rc::Rc;
use core::ops::Deref;

use arrayvec::{ArrayString, ArrayVec};
use smallvec::SmallVec;

use crate::prelude::*;

use crate::config::HeaderStyle;

pub mod cache;
pub mod grpc;
mod values;

pub use values::{policy_value, push_number, rate_limit_headers, retry_after, seconds_ceil, Quota};

/// Longest value kept inline in a [`HeaderValue`] (no allocation), bytes.
pub const INLINE: usize = 38;

/// Most headers a decision carries (`Retry-After`, `x-ratelimited-by`, two draft and three legacy rate limit
/// headers, `x-envoy-ratelimited`, `x-shadow-ratelimited-by`, `content-type` or, for gRPC,
/// `grpc-retry-pushback-ms`): every header a reply can have, so a [`Headers`] never fills.
pub const MAX_HEADERS: usize = 10;

/// A header value: a constant, a value prepared once and shared, a short one kept inline, or one made for
/// this response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderValue {
    /// A constant (`true`, `text/plain`).
    Static(&'static str),
    /// Prepared once (a rule's `RateLimit-Policy`), shared by every response.
    Shared(Rc<str>),
    /// A short value made for this response, without an allocation.
    Inline(ArrayString<INLINE>),
    /// A longer value made for this response.
    Owned(String),
}

impl HeaderValue {
    /// `text` inline when it fits, else owned.
    pub fn new(text: &str) -> Self {
        match ArrayString::from(text) {
            Ok(inline) => HeaderValue::Inline(inline),
            Err(_) => HeaderValue::Owned(text.to_string()),
        }
    }

    /// A decimal number, inline.
    pub fn number(n: u64) -> Self {
        HeaderValue::new(itoa::Buffer::new().format(n))
    }
}

impl Deref for HeaderValue {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            HeaderValue::Static(text) => text,
            HeaderValue::Shared(text) => text,
            HeaderValue::Inline(text) => text,
            HeaderValue::Owned(text) => text,
        }
    }
}

/// A short string built on the stack (for header values and keys), spilling to the heap only past
/// [`INLINE`] bytes.
#[derive(Debug, Default)]
pub struct Builder {
    inline: ArrayString<INLINE>,
    spilled: Option<String>,
}

impl Builder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends text.
    pub fn push_str(&mut self, text: &str) {
        match &mut self.spilled {
            Some(spilled) => spilled.push_str(text),
            None => {
                if self.inline.try_push_str(text).is_err() {
                    let mut spilled = String::with_capacity(self.inline.len() + text.len() + 16);
                    spilled.push_str(&self.inline);
                    spilled.push_str(text);
                    self.spilled = Some(spilled);
                }
            }
        }
    }

    /// Appends a decimal number.
    pub fn push_number(&mut self, n: u64) {
        self.push_str(itoa::Buffer::new().format(n));
    }

    /// The text so far.
    pub fn as_str(&self) -> &str {
        match &self.spilled {
            Some(spilled) => spilled,
            None => &self.inline,
        }
    }

    /// The text as a header value (inline if it fits).
    pub fn into_value(self) -> HeaderValue {
        match self.spilled {
            Some(spilled) => HeaderValue::Owned(spilled),
            None => HeaderValue::Inline(self.inline),
        }
    }
}

/// Response headers: a lowercase name and its value, on the stack ([`MAX_HEADERS`] is every header a reply
/// can have).
pub type Headers = ArrayVec<(&'static str, HeaderValue), MAX_HEADERS>;

/// The response header naming the rule that rejected a request (the first in configuration order).
pub const REJECTED_BY_HEADER: &str = "x-ratelimited-by";
/// With `shadow_headers`: the response header naming the first shadow rule that would have rejected the
/// request.
pub const SHADOW_REJECTED_BY_HEADER: &str = "x-shadow-ratelimited-by";

/// How a request leaves the filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Continue upstream, adding the report's headers to the upstream's response.
    Continue {
        /// What the rate limit headers of the response say.
        report: Report,
    },
    /// Answer locally.
    Respond {
        /// HTTP status.
        status: u16,
        /// What the response headers say (empty when failing closed).
        report: Report,
        /// Whether a limiter rejected the request (`x-envoy-ratelimited: true`).
        rate_limited: bool,
        /// Response body (`text/plain`).
        body: Rc<str>,
    },
}

impl Verdict {
    /// Its report, and whether a limiter rejected the request.
    pub fn report(&self) -> (&Report, bool) {
        match self {
            Verdict::Continue { report } => (report, false),
            Verdict::Respond { report, rate_limited, .. } => (report, *rate_limited),
        }
    }

    /// The response headers of this verdict (`Retry-After`, the rate limit headers in `style`,
    /// `x-envoy-ratelimited`), rendered for `rules`: the filter renders them only when it hands them to the
    /// host, so a decision stays small as it moves (docs/deploying.md, "Lean guest").
    pub fn headers(&self, rules: &RuleHeaders) -> Headers {
        let mut headers = Headers::new();
        let (report, rate_limited) = self.report();
        report.write_headers(rules, &mut headers);
        if rate_limited {
            headers.push(("x-envoy-ratelimited", HeaderValue::Static("true")));
        }
        headers
    }
}

/// What the headers of a decided request report: the quota of each rule that has one, in rule order, and
/// the delay of a rejection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// The rules' quotas.
    pub quotas: SmallVec<[RuleQuota; 2]>,
    /// The longest delay of a rejecting rule, ms (`Retry-After`); `None` when no wait helps or nothing
    /// rejected.
    pub retry_ms: Option<u64>,
    /// The first rule (in configuration order) that rejected: named in `x-ratelimited-by`.
    pub rejected_by: Option<usize>,
    /// The first shadow rule that would have rejected: in the request's filter state, and with
    /// `shadow_headers` named in `x-shadow-ratelimited-by`.
    pub shadow_rejected_by: Option<usize>,
}

/// A rule's state in the headers: its rule index and quota numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleQuota {
    /// The rule's index in the configuration.
    pub rule: usize,
    /// Permits per window, as Redis holds it.
    pub limit: u64,
    /// Window length, ms, as Redis holds it (0: an in-flight limit).
    pub window_ms: u64,
    /// Permits left.
    pub remaining: u64,
    /// Until the quota is whole again (allowed) or the next permit is released (rejected), ms.
    pub reset_ms: u64,
}

/// What the headers need of a configuration: its header style, whether shadow rules are named, and each
/// rule's name and policy (prepared once per configuration).
#[derive(Debug, Clone)]
pub struct RuleHeaders {
    /// `rate_limit_headers`.
    pub style: HeaderStyle,
    /// `shadow_headers`.
    pub shadow_headers: bool,
    /// By rule index: the rate rules (`rules[i]`), then the in-flight rules (`inflight[i]` at
    /// `rules.len() + i`).
    pub rules: Vec<RulePolicy>,
}

/// One rule as its headers show it.
#[derive(Debug, Clone)]
pub struct RulePolicy {
    /// Its name (the `x-ratelimited-by` value and the policy name).
    pub name: Rc<str>,
    /// Its `RateLimit-Policy` member for the configured limit and window ([`policy_value`]).
    pub policy: Rc<str>,
    /// The configured rate, permits per window.
    pub rate: u64,
    /// The configured window, ms.
    pub interval_ms: u64,
}

impl RulePolicy {
    /// The policy of rule `name` limiting `rate` permits per `interval_ms` (0: requests in flight at once,
    /// no window).
    pub fn new(name: &str, rate: u64, interval_ms: u64) -> Self {
        RulePolicy { name: name.into(), policy: policy_value(name, rate, interval_ms).into(), rate, interval_ms }
    }
}

impl Report {
    /// Appends `Retry-After`, `x-ratelimited-by` (the rule that rejected), `x-shadow-ratelimited-by` and the
    /// rate limit headers, as `rules` says.
    pub fn write_headers(&self, rules: &RuleHeaders, headers: &mut Headers) {
        if let Some(delay_ms) = self.retry_ms {
            headers.push(retry_after(delay_ms));
        }
        if let Some(rule) = self.rejected_by.and_then(|index| rules.rules.get(index)) {
            headers.push((REJECTED_BY_HEADER, HeaderValue::Shared(Rc::clone(&rule.name))));
        }
        if let Some(rule) = self.shadow_rejected_by.and_then(|index| rules.rules.get(index)) {
            if rules.shadow_headers {
                headers.push((SHADOW_REJECTED_BY_HEADER, HeaderValue::Shared(Rc::clone(&rule.name))));
            }
        }
        let quotas: SmallVec<[Quota<'_>; 2]> = self
            .quotas
            .iter()
            .filter_map(|quota| {
                let rule = rules.rules.get(quota.rule)?;
                let configured = quota.limit == rule.rate && quota.window_ms == rule.interval_ms;
                Some(Quota {
                    policy: &rule.name,
                    prepared_policy: configured.then_some(&rule.policy),
                    limit: quota.limit,
                    window_ms: quota.window_ms,
                    remaining: quota.remaining,
                    reset_ms: quota.reset_ms,
                })
            })
            .collect();
        rate_limit_headers(rules.style, &quotas, headers);
    }

    /// Whether it shows anything on an upstream's response in `rules`' style.
    pub fn shows(&self, rules: &RuleHeaders) -> bool {
        (!self.quotas.is_empty() && rules.style != HeaderStyle::None)
            || (self.shadow_rejected_by.is_some() && rules.shadow_headers)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn the_fullest_reply_leaves_room_for_its_content_type() {
        // Every header a reply can carry: Retry-After, both styles of rate limit headers for two rules, and
        // x-envoy-ratelimited, x-ratelimited-by, x-shadow-ratelimited-by; the filter adds content-type.
        // `Headers` holds MAX_HEADERS and would panic past it.
        let rules = RuleHeaders {
            style: HeaderStyle::Both,
            shadow_headers: true,
            rules: vec![RulePolicy::new("a", 5, 2_000), RulePolicy::new("b", 9, 60_000)],
        };
        let quota = |rule, limit, window_ms| RuleQuota { rule, limit, window_ms, remaining: 0, reset_ms: 900 };
        let report = Report {
            quotas: [quota(0, 5, 2_000), quota(1, 7, 60_000)].into_iter().collect(),
            retry_ms: Some(900),
            rejected_by: Some(0),
            shadow_rejected_by: Some(1),
        };
        let verdict = Verdict::Respond { status: 429, report, rate_limited: true, body: "no".into() };
        assert_eq!(verdict.headers(&rules).len(), MAX_HEADERS - 1);
    }

    #[test]
    fn short_values_stay_inline_and_long_ones_spill() {
        assert!(matches!(HeaderValue::number(u64::MAX), HeaderValue::Inline(_)));
        assert_eq!(&*HeaderValue::number(42), "42");
        let mut builder = Builder::new();
        builder.push_str("\"per-user\";r=");
        builder.push_number(7);
        assert!(matches!(builder.as_str(), "\"per-user\";r=7"));
        builder.push_str(&"x".repeat(INLINE));
        let value = builder.into_value();
        assert!(matches!(value, HeaderValue::Owned(_)));
        assert_eq!(&*value, format!("\"per-user\";r=7{}", "x".repeat(INLINE)));
    }
}
