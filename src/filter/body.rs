//! Requests decided from their JSON body (docs/configuration.md, "Request fields"): a rule whose key
//! (`limit_by`, `rates_by`) or reservation (`cost.reserve`) reads `{"body": ...}` holds its request until the
//! body has arrived (Envoy buffers it meanwhile), reads at most [`MAX_REQUEST_BODY`] bytes of it once, and
//! decides. A body that is not JSON, or larger, has no fields: the rule's default applies (a missing key
//! follows `on_missing`, a reservation its `default`). Nothing here fails a request.
//!
//! And `cost.settle.include_usage`: a streamed OpenAI chat request without `stream_options` gets
//! `"stream_options": {"include_usage": true}` added when it goes upstream with a reservation of such a rule,
//! so that its stream reports the usage.

use crate::prelude::*;

use serde_json::Value;

use crate::config::Settle;
use crate::host::Host;
use crate::key::MAX_REQUEST_BODY;
use crate::usage::UsageFormat;

use super::{Action, Filter};

/// The request body of a waiting request: `size` bytes buffered so far (`None`: unknown, at its trailers),
/// `end`: all of it. Decides it once the body is whole or too large to read; until then Envoy buffers.
pub(super) fn on_request_body<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    size: Option<usize>,
    end: bool,
) -> Action {
    if !filter.awaiting_body.contains_key(&context_id) {
        return Action::Continue;
    }
    let too_large = size.is_some_and(|size| size > MAX_REQUEST_BODY);
    if !end && !too_large {
        return Action::Pause;
    }
    let Some(route) = filter.awaiting_body.remove(&context_id) else { return Action::Continue };
    let mut read = 0;
    let body = if too_large {
        None
    } else {
        let bytes = filter.host.request_body(size.unwrap_or(MAX_REQUEST_BODY + 1)).unwrap_or_default();
        read = bytes.len();
        (read <= MAX_REQUEST_BODY).then(|| serde_json::from_slice::<Value>(&bytes).ok()).flatten()
    };
    if let Some(body) = &body {
        let asks_usage =
            route.config.rules.iter().any(|rule| rule.cost.as_ref().is_some_and(|cost| cost.include_usage));
        if asks_usage && lacks_usage_option(body) {
            filter.body_rewrites.insert(context_id, read);
        }
    }
    filter.decide(context_id, route, body.as_ref())
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

/// A streamed chat request (`"stream": true`) without `stream_options`: its stream would report no usage.
fn lacks_usage_option(body: &Value) -> bool {
    body.get("stream") == Some(&Value::Bool(true)) && body.get("stream_options").is_none()
}

/// Request `context_id` goes upstream: if its body was marked for `include_usage` and one of its
/// reservations' rules asks for it (OpenAI usage), `"stream_options":{"include_usage":true}` is added as the
/// body object's first member and `content-length` set to the new size.
pub(super) fn before_upstream<H: Host>(filter: &mut Filter<H>, context_id: u32, rules_ask: bool) {
    let Some(size) = filter.body_rewrites.remove(&context_id) else { return };
    if !rules_ask {
        return;
    }
    let Ok(body) = filter.host.request_body(size) else { return };
    let Some(open) = body.iter().position(|&byte| byte == b'{') else { return };
    let (head, rest) = body.split_at(open + 1);
    let rewritten = [head, br#""stream_options":{"include_usage":true},"#, rest].concat();
    if filter.host.set_request_body(size, &rewritten).is_err() {
        super::end::host_refused(filter, "proxy_set_buffer_bytes");
        return;
    }
    if matches!(filter.host.request_header("content-length"), Ok(Some(_))) {
        let length = rewritten.len().to_string();
        if filter.host.set_request_header("content-length", Some(&length)).is_err() {
            super::end::host_refused(filter, "proxy_replace_header_map_value");
        }
    }
}

/// Whether a rule settles with OpenAI's usage and asks for `include_usage`.
pub(super) fn asks_usage(settle: &Settle, include_usage: bool) -> bool {
    include_usage && matches!(settle, Settle::Usage(UsageFormat::OpenAi))
}
