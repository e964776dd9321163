//! How the host numbers the guest's calls: the token `proxy_http_call` and `proxy_redis_call` answer, which
//! the reply's callback (`proxy_on_http_call_response`, `proxy_on_redis_call_response`) carries back.
//!
//! Facts (read, not copied):
//! - **Envoy** (proxy-wasm-cpp-host `include/proxy-wasm/wasm.h`, `WasmBase::nextHttpCallId`, since commit
//!   0318597, PR #186 "Make HTTP/gRPC callout IDs unique per WasmVM instance", 2021-08-11; still so at
//!   52a0291, 2026-07-01; Envoy `source/extensions/common/wasm/context.cc` `Context::httpCall` takes
//!   `wasm()->nextHttpCallId()`): one counter per VM (`WasmBase`) and per kind of callout, the kind in the
//!   low two bits (`CalloutType`: HttpCall 0, GrpcCall 1, GrpcStream 2; `kCalloutTypeMask` 3), each counter
//!   stepping by `kCalloutIncrement` 4 from its kind: HTTP calls get 4, 8, 12, ... (wrapping, no rollover
//!   protection).
//! - **Higress** (higress-group/proxy-wasm-cpp-host commit 1d590ef "support redis call", 2024-05-18, in
//!   7850d17, which higress-group/envoy branch envoy-1.27 at e9302f5574 pins in
//!   `bazel/repository_locations.bzl`, and still at 913c1b0): a fourth kind `CalloutType::RedisCall = 3`
//!   with its own counter, `nextRedisCallId()`, which `Context::redisCall` (`context.cc`, `#if
//!   defined(HIGRESS)`) uses: Redis calls get 7, 11, 15, ... Envoy keeps the pending calls in one map per
//!   kind (`http_request_`, `redis_request_`), keyed by token.
//!
//! So in Envoy and Higress the counters are separate but an HTTP call and a Redis call of one VM never get
//! the same token (their low two bits differ, and a wrap at 2^32 keeps them). [`CallTokens::Envoy`] plays
//! that; [`CallTokens::Shared`] (the default, the emulator's original numbering) gives unique small tokens
//! across kinds; [`CallTokens::PerKind`] is stricter than any host known: separate counters from the same
//! start, so the first HTTP call and the first Redis call of a VM both get token 1. A filter that keeps its
//! calls of both kinds in one map keyed by token alone mixes them up only under `PerKind`.

use std::fmt;
use std::str::FromStr;

use crate::faults::CallKind;

/// How the host numbers calls (per VM). See the module documentation for Envoy's and Higress's numbering.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CallTokens {
    /// One counter for HTTP and Redis calls: 1, 2, 3, ... (skipping 0 at the wrap); a token is unique per VM
    /// across kinds. The default (the emulator's original numbering).
    #[default]
    Shared,
    /// One counter per kind, both 1, 2, 3, ...: the n-th HTTP call and the n-th Redis call of a VM get the
    /// same token n. No known host does this; it shows a filter that tells replies apart by token alone.
    PerKind,
    /// As Envoy and Higress: one counter per kind, the kind in the low two bits, steps of 4: HTTP calls 4,
    /// 8, 12, ...; Redis calls 7, 11, 15, ...
    Envoy,
}

impl CallTokens {
    /// Every numbering, in the order the command line lists them.
    pub const ALL: [CallTokens; 3] = [CallTokens::Shared, CallTokens::PerKind, CallTokens::Envoy];

    /// Its name on the command line (`--call-tokens`).
    pub fn name(self) -> &'static str {
        match self {
            CallTokens::Shared => "shared",
            CallTokens::PerKind => "per-kind",
            CallTokens::Envoy => "envoy",
        }
    }
}

impl fmt::Display for CallTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CallTokens {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        CallTokens::ALL.into_iter().find(|t| t.name() == text).ok_or_else(|| {
            let names: Vec<&str> = CallTokens::ALL.iter().map(|t| t.name()).collect();
            format!("unknown call token numbering {text:?}: one of {}", names.join(", "))
        })
    }
}

/// Envoy's `CalloutType` of a kind: the low two bits of its tokens under [`CallTokens::Envoy`].
fn envoy_callout_type(kind: CallKind) -> u32 {
    match kind {
        CallKind::Http => 0,
        CallKind::Redis => 3,
    }
}

/// Envoy's `kCalloutIncrement`.
const ENVOY_INCREMENT: u32 = 4;

/// The call counters of one VM.
#[derive(Clone, Debug)]
pub struct TokenCounters {
    numbering: CallTokens,
    /// The next token (Shared, PerKind) or the last one given (Envoy), for HTTP calls (Shared: all calls).
    http: u32,
    /// The same for Redis calls (unused under Shared).
    redis: u32,
}

impl TokenCounters {
    /// Fresh counters of a VM under this numbering.
    pub fn new(numbering: CallTokens) -> Self {
        match numbering {
            CallTokens::Shared | CallTokens::PerKind => TokenCounters { numbering, http: 1, redis: 1 },
            CallTokens::Envoy => TokenCounters {
                numbering,
                http: envoy_callout_type(CallKind::Http),
                redis: envoy_callout_type(CallKind::Redis),
            },
        }
    }

    /// The numbering these counters follow.
    pub fn numbering(&self) -> CallTokens {
        self.numbering
    }

    /// The token of a new call of this kind.
    pub fn next(&mut self, kind: CallKind) -> u32 {
        let counter = match (self.numbering, kind) {
            (CallTokens::Shared, _) | (_, CallKind::Http) => &mut self.http,
            (_, CallKind::Redis) => &mut self.redis,
        };
        match self.numbering {
            CallTokens::Shared | CallTokens::PerKind => {
                let token = *counter;
                *counter = counter.wrapping_add(1).max(1);
                token
            }
            CallTokens::Envoy => {
                // `return next_http_call_id_ += kCalloutIncrement;`
                *counter = counter.wrapping_add(ENVOY_INCREMENT);
                *counter
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first(numbering: CallTokens, kinds: &[CallKind]) -> Vec<u32> {
        let mut counters = TokenCounters::new(numbering);
        kinds.iter().map(|kind| counters.next(*kind)).collect()
    }

    #[test]
    fn each_numbering_gives_its_tokens() {
        use CallKind::{Http, Redis};
        let kinds = [Http, Redis, Redis, Http, Http];
        assert_eq!(first(CallTokens::Shared, &kinds), vec![1, 2, 3, 4, 5]);
        assert_eq!(first(CallTokens::PerKind, &kinds), vec![1, 1, 2, 2, 3]);
        assert_eq!(first(CallTokens::Envoy, &kinds), vec![4, 7, 11, 8, 12]);
    }

    #[test]
    fn counters_wrap_without_zero_or_a_kind_change() {
        let mut counters = TokenCounters { numbering: CallTokens::PerKind, http: u32::MAX, redis: 1 };
        assert_eq!((counters.next(CallKind::Http), counters.next(CallKind::Http)), (u32::MAX, 1));
        let mut envoy = TokenCounters { numbering: CallTokens::Envoy, http: 0, redis: u32::MAX };
        assert_eq!(envoy.next(CallKind::Redis), 3, "the low bits stay Redis's at the wrap");
    }

    #[test]
    fn names_round_trip_and_the_default_is_shared() {
        for numbering in CallTokens::ALL {
            assert_eq!(numbering.name().parse::<CallTokens>(), Ok(numbering));
            assert_eq!(numbering.to_string(), numbering.name());
        }
        assert_eq!(CallTokens::default(), CallTokens::Shared);
        assert!("perkind".parse::<CallTokens>().is_err_and(|e| e.contains("shared, per-kind, envoy")));
    }
}
