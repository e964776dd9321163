"""HTTP/3 downstream in real Envoy with the filter (docs/deploying.md, "HTTP/2 and HTTP/3"): a QUIC
listener (UDP, `udp_listener_config.quic_options`, transport socket `envoy.transport_sockets.quic`, codec
HTTP3) with the template's filters, and an aioquic client putting many requests on one QUIC connection.

Stock Envoy 1.40 from PyPI serves HTTP/3 as built; the filter sees the same request headers as over
HTTP/1.1 and HTTP/2 and answers with the same local replies. Envoy lets 100 streams of a connection be open
at once (`max_concurrent_streams` of its QUIC protocol options): the client's further streams wait for
QUIC's MAX_STREAMS and go as earlier ones end, so a burst of 200 is two waves to the filter.
"""

from __future__ import annotations

import collections

import harness as h
import multiplex as m

RATE = 20
INTERVAL_MS = 10_000


def test_a_burst_of_streams_on_one_quic_connection_is_limited_exactly(stack):
    """200 streams at once on one QUIC connection against a limit of 20 per 10 s: every stream is
    answered, exactly 20 reach the upstream, and each response carries the rate limit headers (the 429s
    `Retry-After` too)."""
    gateway = m.protocol_envoy(stack, h.plugin_config(h.rule(rate=RATE, interval="10s")), quic=True)
    hits = stack.upstream.hits
    burst = m.h3_burst(gateway.quic_port, 200, h.user("alice"), ca_path=gateway.ca_path)
    assert burst.alpn == "h3", f"ALPN agreed on {burst.alpn!r}"

    m.check_burst(stack, gateway, burst, protocol="HTTP/3", who="alice", rate=RATE, interval_ms=INTERVAL_MS,
                  hits_before=hits)


SUSTAINED_RATE = 20
SUSTAINED_INTERVAL_MS = 500


def test_50_streams_in_flight_over_quic_keep_every_sliding_window(stack):
    """50 streams in flight on one QUIC connection for 2 s (a new one as each ends), far beyond 20 per
    500 ms: every stream gets 200 or 429 with the rate limit headers, every 500 ms sliding window of
    admitted requests (Envoy's access log) holds at most 20, and each window the run spans admits its 20."""
    gateway = m.protocol_envoy(stack, h.plugin_config(h.rule(rate=SUSTAINED_RATE, interval="500ms")), quic=True)
    hits = stack.upstream.hits
    run = m.h3_sustained(gateway.quic_port, 2.0, 50, h.user("bob"), ca_path=gateway.ca_path)

    assert not run.goaway, "the server closed the QUIC connection"
    unanswered = [a.reset for a in run.answers if a.status is None or a.reset is not None]
    assert not unanswered, f"{len(unanswered)} of {len(run.answers)} streams not answered: {unanswered[:10]}"
    statuses = collections.Counter(a.status for a in run.answers)
    assert set(statuses) == {200, 429}, statuses
    missing = [a.status for a in run.answers if "ratelimit" not in a.headers or "ratelimit-policy" not in a.headers
               or (a.status == 429 and "retry-after" not in a.headers)]
    assert not missing, f"{len(missing)} responses without the rate limit headers: {collections.Counter(missing)}"

    entries = m.access_entries(gateway.access_log, len(run.answers))
    assert len(entries) == len(run.answers) and {e.protocol for e in entries} == {"HTTP/3"}
    odd = [e for e in entries if e.status not in (200, 429)]
    assert not odd, f"{len(odd)} answers neither 200 nor 429 in Envoy's access log, e.g. {odd[:3]}"
    assert collections.Counter(e.status for e in entries) == statuses, "Envoy and the client disagree"
    seen = m.sliding_windows([(e.start_ms, e.end_ms, e.status) for e in entries], SUSTAINED_INTERVAL_MS)
    client_worst = h.worst_window([(a.sent_ms, a.ended_ms) for a in run.answers if a.status == 200],
                                  SUSTAINED_INTERVAL_MS)
    print(f"\nHTTP/3: {seen} (client's view: {client_worst})")
    assert seen.worst <= SUSTAINED_RATE, f"{seen.worst} admitted within one window: {seen}"
    assert client_worst <= SUSTAINED_RATE, f"{client_worst} admitted within one window (client)"
    assert seen.admitted >= SUSTAINED_RATE * seen.windows, f"fewer than the rate per window: {seen}"
    assert stack.upstream.hits - hits == statuses[200]
