//! Holding a request's headers while its body arrives (`hold_headers_for_body`): what the filter has seen
//! of the host's support for it (Envoy's `allow_on_headers_stop_iteration`).

use crate::host::Host;

use super::Filter;

/// Whether the host gives a filter the request body while it holds the request headers (Envoy's
/// `allow_on_headers_stop_iteration`), as this filter has seen it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum BodyWhileHeld {
    /// Not seen yet: held headers are let go after [`HOLD_WITHOUT_BODY_MS`] without a body callback.
    #[default]
    Unknown,
    /// A body callback came while the headers were held.
    Given,
    /// Held headers got no body callback in [`HOLD_WITHOUT_BODY_MS`]: the host holds the body with them
    /// (a pause in the headers is "stop all"), so this filter holds headers no more.
    Withheld,
}

/// How long held headers wait for a first body callback before the filter lets them go (and holds no
/// headers any more, [`BodyWhileHeld::Withheld`]), ms: a host without `allow_on_headers_stop_iteration`
/// gives no body until the headers go on.
pub(super) const HOLD_WITHOUT_BODY_MS: u64 = 1_000;

impl<H: Host> Filter<H> {
    /// Whether held headers wait for the host's first body callback (`hold_headers_for_body`; the tick
    /// lets them go after [`HOLD_WITHOUT_BODY_MS`] without one).
    pub(super) fn waits_for_a_first_body(&self) -> bool {
        self.body_while_held == BodyWhileHeld::Unknown && self.awaiting_body.values().any(|a| a.held_since_ms.is_some())
    }
}
