//! Faults the host injects on purpose, to test that a filter survives a host that misbehaves (all off by
//! default: the host is then as faithful as it can be).
//!
//! Set them with [`crate::HostBuilder::faults`] and change them at any time with
//! [`crate::Host::set_faults`] (or `wasm-host serve --drop-redis-replies ...` and the control line
//! `{"faults": {...}}`). The faults are host-wide (every VM). What happens to a call's reply is decided
//! when the guest makes the call (`proxy_http_call`, `proxy_redis_call`): turning a fault off later does
//! not bring back a reply already doomed, and turning it on does not touch calls already made.
//!
//! None of these is something Envoy or Higress is known to do on its own; they are the failures a filter
//! must not turn into a hung stream, a panic or a wrong decision: a callback that never comes (a host bug,
//! a lost connection the host forgets to fail), a callback with a token the filter never handed out, and a
//! hostcall that refuses a context id the filter still believes alive.

use serde::{Deserialize, Serialize};

/// What [`Faults::misroute_tokens`] adds to a call's token (wrapping) when it delivers the reply.
pub const MISROUTE_OFFSET: u32 = 1_000_000;

/// The faults in force. JSON (serve's control line and answer): the field names, every field optional
/// (omitted: off).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// `proxy_set_effective_context` answers BadArgument (status 2) for this many more calls, whatever the
    /// context id, then works again; `u32::MAX` means always (never counted down). Each refusal is logged
    /// by the host (debug).
    pub refuse_effective_context: u32,
    /// `proxy_redis_call` works (answers Ok and a token; the query still goes to Redis) but its reply or
    /// failure is never delivered: no `proxy_on_redis_call_response` (logged by the host, debug).
    pub drop_redis_replies: bool,
    /// `proxy_http_call` works (answers Ok and a token; the request still goes out) but its response is
    /// never delivered: no `proxy_on_http_call_response` (logged by the host, debug).
    pub drop_http_call_responses: bool,
    /// Replies (Redis and HTTP) are delivered with a token the guest was never given: its own plus
    /// [`MISROUTE_OFFSET`] (logged by the host, debug). A dropped reply is not delivered at all.
    pub misroute_tokens: bool,
}

impl Faults {
    /// No fault (the default).
    pub const NONE: Faults = Faults {
        refuse_effective_context: 0,
        drop_redis_replies: false,
        drop_http_call_responses: false,
        misroute_tokens: false,
    };

    /// Whether this call of `proxy_set_effective_context` is refused; counts one refusal down (except
    /// `u32::MAX`). Returns the refusals left after this one, `None` if the call goes through.
    pub(crate) fn take_refusal(&mut self) -> Option<u32> {
        match self.refuse_effective_context {
            0 => None,
            u32::MAX => Some(u32::MAX),
            n => {
                self.refuse_effective_context = n - 1;
                Some(n - 1)
            }
        }
    }

    /// What happens to the reply of a call of this kind made now.
    pub(crate) fn fate(&self, kind: CallKind) -> Fate {
        let dropped = match kind {
            CallKind::Http => self.drop_http_call_responses,
            CallKind::Redis => self.drop_redis_replies,
        };
        if dropped {
            Fate::Drop
        } else if self.misroute_tokens {
            Fate::Misroute
        } else {
            Fate::Deliver
        }
    }
}

/// Which kind of call a token belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallKind {
    /// `proxy_http_call`.
    Http,
    /// `proxy_redis_call`.
    Redis,
}

impl CallKind {
    /// How log lines name its reply.
    pub fn reply_name(self) -> &'static str {
        match self {
            CallKind::Http => "HTTP call response",
            CallKind::Redis => "Redis reply",
        }
    }
}

/// What the host does with one call's reply, decided when the call is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Delivered with its own token (no fault).
    Deliver,
    /// Never delivered.
    Drop,
    /// Delivered with its token plus [`MISROUTE_OFFSET`].
    Misroute,
}

/// A call made by the guest and not answered yet.
#[derive(Clone, Copy, Debug)]
pub struct PendingCall {
    /// The stream the call was made for (its fuel and call counts are charged to it), if any.
    pub owner: Option<u32>,
    /// The kind of call.
    pub kind: CallKind,
    /// What happens to its reply.
    pub fate: Fate,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_count_down_except_always() {
        let mut faults = Faults { refuse_effective_context: 2, ..Faults::NONE };
        assert_eq!(faults.take_refusal(), Some(1));
        assert_eq!(faults.take_refusal(), Some(0));
        assert_eq!(faults.take_refusal(), None);
        let mut always = Faults { refuse_effective_context: u32::MAX, ..Faults::NONE };
        assert_eq!(always.take_refusal(), Some(u32::MAX));
        assert_eq!(always.refuse_effective_context, u32::MAX);
    }

    #[test]
    fn a_drop_beats_a_misroute_and_each_kind_has_its_own_drop() {
        let faults = Faults { drop_redis_replies: true, misroute_tokens: true, ..Faults::NONE };
        assert_eq!(faults.fate(CallKind::Redis), Fate::Drop);
        assert_eq!(faults.fate(CallKind::Http), Fate::Misroute);
        assert_eq!(Faults::default().fate(CallKind::Http), Fate::Deliver);
        let parsed: Faults = serde_json::from_str(r#"{"drop_http_call_responses": true}"#).unwrap();
        assert_eq!(parsed, Faults { drop_http_call_responses: true, ..Faults::NONE });
        assert!(serde_json::from_str::<Faults>(r#"{"drop_everything": true}"#).is_err());
    }
}
