"""HTTP/2 downstream in real Envoy with the filter (docs/deploying.md, "HTTP/2 and HTTP/3"): many
requests as concurrent streams of one connection, in cleartext (h2c with prior knowledge, on the template's
listener: its connection manager has codec_type AUTO) and over TLS with ALPN `h2`.

All of one connection's streams reach the same worker, so one VM decides them all at once; a user would
notice a limit that admits more than its rate, a stream reset or left unanswered, or responses without the
rate limit headers. A burst with the `h2` package (every stream's HEADERS in one write) must be limited
exactly, down to the remaining quota each admitted stream is told; a longer h2load run (50 streams in flight
on one connection) must keep every sliding window of admitted requests within the rate, and admit the rate
again each time the window has moved on.
"""

from __future__ import annotations

import collections

import pytest

import harness as h
import multiplex as m

RATE = 20
INTERVAL_MS = 10_000


@pytest.mark.parametrize("transport", ["h2c", "tls"])
def test_a_burst_of_streams_on_one_connection_is_limited_exactly(stack, transport):
    """200 streams at once on one HTTP/2 connection against a limit of 20 per 10 s: every stream is
    answered, exactly 20 reach the upstream, and each response carries the rate limit headers (the 429s
    `Retry-After` too), as over HTTP/1.1."""
    gateway = m.protocol_envoy(stack, h.plugin_config(h.rule(rate=RATE, interval="10s")))
    hits = stack.upstream.hits
    if transport == "tls":
        burst = m.h2_burst(gateway.tls_port, 200, h.user("alice"), tls=gateway.tls_context(["h2", "http/1.1"]))
        assert burst.alpn == "h2", f"ALPN agreed on {burst.alpn!r}"
    else:
        burst = m.h2_burst(gateway.h2c_port, 200, h.user("alice"))

    m.check_burst(stack, gateway, burst, protocol="HTTP/2", who="alice", rate=RATE, interval_ms=INTERVAL_MS,
                  hits_before=hits)


SUSTAINED_RATE = 20
SUSTAINED_INTERVAL_MS = 500


def test_50_streams_in_flight_for_thousands_of_requests_keep_every_sliding_window(stack):
    """h2load keeps 50 streams in flight on one connection, over h2c and over TLS at once (a user each),
    far beyond 20 per 500 ms: every request gets 200 or 429, every 500 ms sliding window of admitted
    requests (Envoy's access log: between the request's start and its end) holds at most 20, and each
    window the run spans admits its 20 again."""
    requests = 6000
    gateway = m.protocol_envoy(stack, h.plugin_config(h.rule(rate=SUSTAINED_RATE, interval="500ms")))
    hits = stack.upstream.hits
    urls = {"h2c": f"http://{h.HOST}:{gateway.h2c_port}/", "tls": f"https://{h.HOST}:{gateway.tls_port}/"}
    runs = {who: m.start_h2load(stack.workdir, f"h2load-{who}", url, requests=requests, rps=3000, streams=50,
                                headers=h.user(who))
            for who, url in urls.items()}
    reports = {who: m.finish_h2load(*run) for who, run in runs.items()}
    entries = m.access_entries(gateway.access_log, 2 * requests)

    summary = []
    for who, report in reports.items():
        assert report.protocol == {"h2c": "h2c", "tls": "h2"}[who], report.protocol
        counts = report.counts
        assert counts["done"] == counts["total"] == requests, counts
        assert (counts["errored"], counts["timeout"]) == (0, 0), f"{who}: streams that failed: {counts}"
        mine = [e for e in entries if e.user == who]
        assert len(mine) == requests, f"{who}: {len(mine)} requests in Envoy's access log"
        odd = [e for e in mine if e.status not in (200, 429)]
        assert not odd, f"{who}: {len(odd)} answers neither 200 nor 429, e.g. {odd[:3]}"
        statuses = collections.Counter(status for _, _, status in report.requests)
        assert set(statuses) == {200, 429}, f"{who}: statuses in h2load's log (-1: a failed stream): {statuses}"
        assert {e.protocol for e in mine} == {"HTTP/2"}
        assert collections.Counter(e.status for e in mine) == statuses, "Envoy and the client disagree"

        seen = m.sliding_windows([(e.start_ms, e.end_ms, e.status) for e in mine], SUSTAINED_INTERVAL_MS)
        client_worst = m.sliding_windows(report.requests, SUSTAINED_INTERVAL_MS).worst
        summary.append(f"{who}: {seen} (client's view: {client_worst})")
        assert seen.worst <= SUSTAINED_RATE, f"{who}: {seen.worst} admitted within one window: {seen}"
        assert client_worst <= SUSTAINED_RATE, f"{who}: {client_worst} admitted within one window (client)"
        assert seen.admitted >= SUSTAINED_RATE * seen.windows, f"{who}: fewer than the rate per window: {seen}"
    print("\n" + "\n".join(summary))
    admitted_total = sum(report.status_classes["2xx"] for report in reports.values())
    assert stack.upstream.hits - hits == admitted_total
