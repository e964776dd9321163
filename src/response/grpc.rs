//! gRPC answers: a gRPC request the filter answers itself (rejected, or failed closed) gets a gRPC status,
//! not an HTTP error page.
//!
//! The filter passes the status to `proxy_send_local_response` (its `grpc_status` argument); Envoy then
//! answers the request, which it recognises as gRPC by its `content-type`, with a trailers-only response:
//! HTTP 200, `content-type: application/grpc`, `grpc-status`, `grpc-message` (the body, percent-encoded) and
//! the filter's headers, which a gRPC client reads as trailing metadata (gRPC's doc/PROTOCOL-HTTP2.md,
//! "Trailers-Only"). Without a status of ours Envoy maps the HTTP status: 429 and 503 become UNAVAILABLE
//! (14), which retry policies retry at once. A rejection also carries `grpc-retry-pushback-ms` (gRFC A6):
//! a client whose retry policy covers the status waits that long before its next attempt.

use super::{HeaderValue, Headers, Verdict};

/// The pushback trailer of gRFC A6 ("gRPC Retry Design"): milliseconds before the client's next attempt;
/// negative: do not retry.
pub const PUSHBACK_HEADER: &str = "grpc-retry-pushback-ms";

/// Whether a request with this `content-type` is a gRPC request, as Envoy 1.40 decides it
/// (`Grpc::Common::hasGrpcContentType`): `application/grpc`, or `application/grpc` followed by `+` (a
/// subtype: `application/grpc+proto`) or `;` (parameters). `application/grpc-web` is not (Envoy's
/// grpc_web filter translates those requests).
pub fn is_grpc(content_type: &[u8]) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    match content_type.strip_prefix(GRPC) {
        Some(rest) => matches!(rest.first(), None | Some(b'+' | b';')),
        None => false,
    }
}

/// The headers of a gRPC answer: the verdict's (`headers`, rendered as for HTTP by [`Verdict::headers`],
/// without the `content-type` Envoy sets) and, for a rejection, the pushback: the rejection's delay in ms,
/// or -1 when no wait can grant the request (it asks for more permits than the rate).
pub fn headers(verdict: &Verdict, mut headers: Headers) -> Headers {
    if let Verdict::Respond { report, rate_limited: true, .. } = verdict {
        let pushback = match report.retry_ms {
            Some(ms) => HeaderValue::number(ms),
            None => HeaderValue::Static("-1"),
        };
        // Every header a reply can carry still leaves room: MAX_HEADERS counts this one.
        let _ = headers.try_push((PUSHBACK_HEADER, pushback));
    }
    headers
}

/// The `grpc-message` of an answer: its HTTP body without trailing whitespace (Envoy percent-encodes the
/// rest; a newline would reach the client as `%0A`).
pub fn message(body: &str) -> &str {
    body.trim_end()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use alloc::rc::Rc;

    use super::*;
    use crate::response::Report;

    #[test]
    fn grpc_requests_are_recognised_by_content_type_as_envoy_does() {
        for yes in ["application/grpc", "application/grpc+proto", "application/grpc+json", "application/grpc;x=1"] {
            assert!(is_grpc(yes.as_bytes()), "{yes}");
        }
        for no in ["application/grpc-web", "application/grpc-web+proto", "application/json", "text/plain", ""] {
            assert!(!is_grpc(no.as_bytes()), "{no}");
        }
    }

    fn rejection(retry_ms: Option<u64>) -> Verdict {
        let report = Report { retry_ms, rejected_by: Some(0), ..Report::default() };
        Verdict::Respond { status: 429, report, rate_limited: true, body: Rc::from("rate limit exceeded\n") }
    }

    #[test]
    fn a_rejection_carries_its_delay_as_pushback() {
        let mut rendered = Headers::new();
        rendered.push(("retry-after", HeaderValue::Static("2")));
        let headers = super::headers(&rejection(Some(1_500)), rendered);
        let pairs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, &**v)).collect();
        assert_eq!(pairs, [("retry-after", "2"), (PUSHBACK_HEADER, "1500")]);
    }

    #[test]
    fn a_rejection_no_wait_can_grant_asks_the_client_not_to_retry() {
        let headers = super::headers(&rejection(None), Headers::new());
        assert_eq!(headers.iter().map(|(k, v)| (*k, &**v)).collect::<Vec<_>>(), [(PUSHBACK_HEADER, "-1")]);
    }

    #[test]
    fn failing_closed_sends_no_pushback() {
        let failed =
            Verdict::Respond { status: 503, report: Report::default(), rate_limited: false, body: Rc::from("") };
        assert!(super::headers(&failed, Headers::new()).is_empty());
    }

    #[test]
    fn the_message_is_the_body_without_its_trailing_newline() {
        assert_eq!(message("rate limit exceeded\n"), "rate limit exceeded");
    }
}
