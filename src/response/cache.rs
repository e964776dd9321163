//! The serialized headers of the last local reply: under an attack on one key, the rejections of one
//! second are alike, so each reuses the last one's headers instead of rendering and serializing them again
//! (docs/deploying.md, "Lean guest").

use arrayvec::ArrayVec;

use crate::host::HeaderMap;

use super::{seconds_ceil, HeaderValue, RuleHeaders, Verdict, MAX_HEADERS};

/// Every local reply is `text/plain`.
pub const CONTENT_TYPE: (&str, HeaderValue) = ("content-type", HeaderValue::Static("text/plain"));

/// The serialized headers of the last local reply, and what they were rendered from.
#[derive(Debug, Default)]
pub struct ReplyCache {
    last: Option<(Option<ReplyKey>, HeaderMap)>,
}

impl ReplyCache {
    /// The serialized headers (with `content-type`) of a local reply of `verdict` in configuration `route`
    /// (`rules` its header data): the last reply's when they would be the same, else rendered now and kept.
    pub fn headers(&mut self, route: usize, verdict: &Verdict, rules: &RuleHeaders) -> &HeaderMap {
        let key = ReplyKey::of(route, verdict);
        if !matches!((&self.last, &key), (Some((Some(last), _)), Some(key)) if last.same(key)) {
            self.last = None;
        }
        let (_, headers) = self.last.get_or_insert_with(|| {
            let mut headers = verdict.headers(rules);
            headers.push(CONTENT_TYPE);
            let pairs: ArrayVec<(&str, &str), MAX_HEADERS> = headers.iter().map(|(k, v)| (*k, &**v)).collect();
            (key, HeaderMap::new(&pairs))
        });
        headers
    }
}

/// Everything a local reply's headers are rendered from, in the units they show (whole seconds): two
/// replies with equal keys have equal headers. Replies of more than [`ReplyKey::QUOTAS`] quotas have none.
#[derive(Debug)]
struct ReplyKey {
    route: usize,
    rate_limited: bool,
    retry_s: Option<u64>,
    rejected_by: Option<usize>,
    shadow_rejected_by: Option<usize>,
    count: usize,
    /// Rule, limit, window (ms: whether it is the configured one decides the policy's form), remaining,
    /// reset (s).
    quotas: [(usize, u64, u64, u64, u64); ReplyKey::QUOTAS],
}

impl ReplyKey {
    const QUOTAS: usize = 2;

    /// The key of a verdict's headers; `None` when it has too many quotas to keep.
    fn of(route: usize, verdict: &Verdict) -> Option<Self> {
        let (report, rate_limited) = verdict.report();
        let mut key = ReplyKey {
            route,
            rate_limited,
            retry_s: report.retry_ms.map(seconds_ceil),
            rejected_by: report.rejected_by,
            shadow_rejected_by: report.shadow_rejected_by,
            count: report.quotas.len(),
            quotas: [(0, 0, 0, 0, 0); ReplyKey::QUOTAS],
        };
        if key.count > ReplyKey::QUOTAS {
            return None;
        }
        for (slot, q) in key.quotas.iter_mut().zip(&report.quotas) {
            *slot = (q.rule, q.limit, q.window_ms, q.remaining, seconds_ceil(q.reset_ms));
        }
        Some(key)
    }

    /// Field by field (a derived comparison of the arrays calls `memcmp`, a byte loop in wasi-libc).
    fn same(&self, other: &ReplyKey) -> bool {
        self.route == other.route
            && self.rate_limited == other.rate_limited
            && self.retry_s == other.retry_s
            && self.rejected_by == other.rejected_by
            && self.shadow_rejected_by == other.shadow_rejected_by
            && self.count == other.count
            && self
                .quotas
                .iter()
                .zip(&other.quotas)
                .all(|(a, b)| a.0 == b.0 && a.1 == b.1 && a.2 == b.2 && a.3 == b.3 && a.4 == b.4)
    }
}
