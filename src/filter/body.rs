//! Requests decided from their JSON body (docs/configuration.md, "Request fields"), and what a request of a
//! token-budget route changes before it goes upstream.
//!
//! A rule whose key (`limit_by`, `rates_by`) or reservation (`cost.reserve`) reads `{"body": ...}` decides
//! its request once the body has arrived: the headers go on at once (a proxy-wasm host turns a pause in the
//! request headers into "stop all", which would keep the body from the filter too: proxy-wasm-cpp-host
//! `convertVmCallResultToFilterHeadersStatus`), the body is held (Envoy buffers it) until its end, then at
//! most [`MAX_REQUEST_BODY`] bytes of it are read once and the request is decided: it goes on, or is answered
//! locally (Envoy then resets the upstream request, which never got its body). A body that is not JSON, or
//! larger, has no fields: the rule's default applies (a missing key follows `on_missing`, a reservation its
//! `default`). Nothing here fails a request.
//!
//! Before the headers go on: a route with a rule that settles to the usage in the response body asks the
//! upstream for an uncompressed answer (`accept-encoding: identity`: the SDKs accept gzip, which would hide
//! the usage); a route with `settle.include_usage` drops `content-length`, since the body it holds may grow
//! (the upstream then gets it chunked). At the body's end, a streamed OpenAI chat request without
//! `stream_options` gets `"stream_options": {"include_usage": true}` as its first member, so its stream
//! reports the usage.

use alloc::rc::Rc;

use crate::prelude::*;

use serde_json::Value;

use crate::host::Host;
use crate::key::MAX_REQUEST_BODY;

use super::hold::{BodyWhileHeld, HOLD_WITHOUT_BODY_MS};
use super::route::Route;
use super::{tick, Action, Filter};

/// A request waiting for its body: its route, and its headers as they were before they went on (Envoy lets
/// a filter read them only until then).
#[derive(Debug)]
pub(super) struct Awaiting {
    pub(super) route: Rc<Route>,
    pub(super) headers: Vec<(String, Vec<u8>)>,
    /// When its headers arrived ([`super::metrics::Metrics::clock`]).
    pub(super) since_us: u64,
    /// `hold_headers_for_body`: since when (ms) the filter holds its headers too, until no body callback
    /// has come ([`release_unfed`]); `None`: its headers went on.
    pub(super) held_since_ms: Option<u64>,
}

/// Whether a request of `route` whose body follows is held whole (its headers too) until it is decided:
/// `hold_headers_for_body`, unless the host showed that it gives no body then; or its body already came
/// while its headers were held (the host gives it).
pub(super) fn holds_headers<H: Host>(filter: &Filter<H>, route: &Route, context_id: u32) -> bool {
    (route.config.hold_headers_for_body && filter.body_while_held != BodyWhileHeld::Withheld)
        || filter.early_bodies.contains_key(&context_id)
}

/// From the tick: held headers that got no body callback in [`HOLD_WITHOUT_BODY_MS`] go on (the body then
/// comes as without `hold_headers_for_body`); the filter holds no more headers, and says so once.
pub(super) fn release_unfed<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    if filter.body_while_held == BodyWhileHeld::Given {
        return;
    }
    let due: Vec<u32> = filter
        .awaiting_body
        .iter()
        .filter(|(_, a)| a.held_since_ms.is_some_and(|since| now_ms.saturating_sub(since) >= HOLD_WITHOUT_BODY_MS))
        .map(|(&context_id, _)| context_id)
        .collect();
    for context_id in due {
        if let Some(awaiting) = filter.awaiting_body.get_mut(&context_id) {
            awaiting.held_since_ms = None;
        }
        if filter.body_while_held == BodyWhileHeld::Unknown {
            filter.body_while_held = BodyWhileHeld::Withheld;
            let message = "hold_headers_for_body: no request body came while the headers were held; the host \
                           needs allow_on_headers_stop_iteration (Envoy 1.35+): headers go on before the body";
            super::log(&filter.host, crate::host::LogLevel::Warn, message);
        }
        if filter.host.set_effective_context(context_id).is_err() || filter.host.resume_request().is_err() {
            super::metrics::host_refused(filter, "proxy_continue_stream");
        }
    }
}

/// A request of `route` whose rules read its body, and a body follows: waits for it, its headers held
/// ([`holds_headers`]) or gone on with a copy of them kept (Envoy lets a filter read them only until then).
pub(super) fn await_body<H: Host>(filter: &mut Filter<H>, context_id: u32, route: Rc<Route>, since_us: u64) -> Action {
    // The headers are readable only until they go on: the decision reads this copy of them.
    let headers = filter.host.request_headers().unwrap_or_default();
    let held = holds_headers(filter, &route, context_id);
    let held_since_ms = held.then(|| filter.host.now_ms());
    filter.awaiting_body.insert(context_id, Awaiting { route, headers, since_us, held_since_ms });
    if !held {
        return Action::Continue;
    }
    if let Some(Some(size)) = filter.early_bodies.remove(&context_id) {
        // Its body came (whole) while its permits were asked.
        return on_request_body(filter, context_id, Some(size), true);
    }
    tick::start(filter);
    Action::Pause
}

/// The request headers of a route that reads or settles from bodies, before they go on.
pub(super) fn before_headers_go<H: Host>(filter: &mut Filter<H>, route: &Route, body_follows: bool) {
    if route.settles_from_body && filter.host.set_request_header("accept-encoding", Some("identity")).is_err() {
        super::metrics::host_refused(filter, "proxy_replace_header_map_value");
    }
    if body_follows && route.asks_usage && filter.host.set_request_header("content-length", None).is_err() {
        super::metrics::host_refused(filter, "proxy_remove_header_map_value");
    }
}

/// The request body of a waiting request: `size` bytes buffered so far (`None`: unknown, at its trailers),
/// `end`: all of it. Decides it once the body is whole or too large to read; until then Envoy buffers. A
/// request decided before its body ended (past [`MAX_REQUEST_BODY`]) whose decision still waits for Redis
/// keeps its body held: the rest of it must not go upstream before the decision.
pub(super) fn on_request_body<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    size: Option<usize>,
    end: bool,
) -> Action {
    let Some(awaiting) = filter.awaiting_body.get(&context_id) else {
        if filter.inflight.waits(context_id) {
            // Held at its headers for its permits, and the host gives the body anyway (Envoy's
            // `allow_on_headers_stop_iteration`): held too, its end kept for the rate stage.
            filter.body_while_held = BodyWhileHeld::Given;
            let ended = filter.early_bodies.entry(context_id).or_insert(None);
            *ended = if end { Some(size.unwrap_or(MAX_REQUEST_BODY + 1)) } else { *ended };
            return Action::Pause;
        }
        return if filter.flows.contains_key(&context_id) { Action::Pause } else { Action::Continue };
    };
    if awaiting.held_since_ms.is_some() {
        filter.body_while_held = BodyWhileHeld::Given;
    }
    let too_large = size.is_some_and(|size| size > MAX_REQUEST_BODY);
    if !end && !too_large {
        return Action::Pause;
    }
    let Some(Awaiting { route, headers, since_us, .. }) = filter.awaiting_body.remove(&context_id) else {
        return Action::Continue;
    };
    let mut body = None;
    if !too_large {
        let bytes = filter.host.request_body(size.unwrap_or(MAX_REQUEST_BODY + 1)).unwrap_or_default();
        if bytes.len() <= MAX_REQUEST_BODY {
            body = serde_json::from_slice::<Value>(&bytes).ok();
            if body.as_ref().is_some_and(lacks_usage_option) && route.asks_usage {
                add_usage_option(filter, &bytes);
            }
        }
    }
    filter.decide(context_id, route, body.as_ref(), Some(&headers), since_us)
}

/// A field of a JSON body by its path of member names: a string's bytes, or a whole number's decimal text
/// (a fraction is no value).
pub(super) fn field(body: &Value, path: &[String]) -> Option<Vec<u8>> {
    let mut value = body;
    for name in path {
        value = value.as_object()?.get(name)?;
    }
    match value {
        Value::String(text) => Some(text.as_bytes().to_vec()),
        // Whole numbers only (no float formatting in the module): a `max_tokens` or a numeric id.
        Value::Number(number) => match (number.as_u64(), number.as_i64()) {
            (Some(whole), _) => Some(format!("{whole}").into_bytes()),
            (None, Some(negative)) => Some(format!("{negative}").into_bytes()),
            (None, None) => None,
        },
        _ => None,
    }
}

/// A streamed chat completions request (`"stream": true`, `messages`) without `stream_options`: its stream
/// would report no usage. (The Responses API, `input`, reports it in `response.completed` anyway.)
fn lacks_usage_option(body: &Value) -> bool {
    body.get("stream") == Some(&Value::Bool(true))
        && body.get("messages").is_some()
        && body.get("stream_options").is_none()
}

/// Replaces the held body (`body`, all of it) by the same with `"stream_options":{"include_usage":true}` as
/// the object's first member.
fn add_usage_option<H: Host>(filter: &mut Filter<H>, body: &[u8]) {
    let Some(open) = body.iter().position(|&byte| byte == b'{') else { return };
    let (head, rest) = body.split_at(open + 1);
    let rewritten = [head, br#""stream_options":{"include_usage":true},"#, rest].concat();
    if filter.host.set_request_body(body.len(), &rewritten).is_err() {
        super::metrics::host_refused(filter, "proxy_set_buffer_bytes");
    }
}

impl<H: Host> Filter<H> {
    /// `proxy_on_request_body`: a request waiting for its body (`size` bytes buffered so far; `end`: all of
    /// it) is decided once the body has arrived or passed [`crate::key::MAX_REQUEST_BODY`]; until then Envoy
    /// buffers it; a request decided past that limit stays held while its decision waits for Redis. Other
    /// requests go on.
    pub fn on_request_body(&mut self, context_id: u32, size: usize, end: bool) -> Action {
        if self.awaiting_body.is_empty() && self.flows.is_empty() && self.inflight.is_idle() {
            return Action::Continue;
        }
        on_request_body(self, context_id, Some(size), end)
    }

    /// `proxy_on_request_trailers`: the request body ended (with trailers): a request waiting for it is
    /// decided.
    pub fn on_request_trailers(&mut self, context_id: u32) -> Action {
        if self.awaiting_body.is_empty() && self.flows.is_empty() && self.inflight.is_idle() {
            return Action::Continue;
        }
        on_request_body(self, context_id, None, true)
    }
}
