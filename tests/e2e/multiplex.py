"""HTTP/2 and HTTP/3 downstream for the end-to-end tests: an Envoy of the stack with more listeners, and
small clients that put many requests on one connection.

- `protocol_envoy()`: the stock template (`envoy/envoy.yaml`, whose HTTP connection manager has codec_type
  AUTO, so its plain listener takes HTTP/1.1 and h2c with prior knowledge) plus a TLS listener (ALPN `h2`,
  `http/1.1`) and, with `quic=True`, a QUIC listener on UDP (codec HTTP3), every listener with the same
  filters and an access log (start time, duration, status, protocol, user, response flags and details).
  Certificates from `trustme`.
- `h2_burst()`: `n` requests as `n` streams of one HTTP/2 connection (h2c, or TLS with ALPN `h2`), every
  HEADERS frame written at once, with the `h2` package.
- `h3_burst()`, `h3_sustained()`: `n` requests as `n` streams of one QUIC connection at once, or a number
  of streams kept in flight for some seconds, with aioquic's `H3Connection`.
- `start_h2load()`, `finish_h2load()`: h2load (nghttp2-client) with one connection and many streams in
  flight, its report and per-request log.
- `access_entries()`: the access log as `Entry` rows, waiting until Envoy has written them.
- `check_burst()`, `sliding_windows()`: what a burst must show, and the admitted requests of a longer run
  in sliding windows.

The Python clients report every stream: its status and headers, or the reset that ended it (`reset`), or
that it was never answered before the deadline (`status` None, `reset` None).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, NamedTuple

import h2.config
import h2.connection
import h2.events
import trustme
import yaml
from aioquic.asyncio.client import connect as quic_connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

import harness as h

# One line per request: what the tests read the admitted requests' times from (the decision lies between
# the start and the end of the request as Envoy saw it).
ACCESS_FORMAT = ("%START_TIME(%s.%3f)% %DURATION% %RESPONSE_CODE% %PROTOCOL% %REQ(X-USER-ID)% %RESPONSE_FLAGS% "
                 "%RESPONSE_CODE_DETAILS%\n")
SERVER_NAME = "localhost"
# How late a window's refill may come in a run far beyond the limit (`sliding_windows()`).
REFILL_SLACK_MS = 100


class Entry(NamedTuple):
    """One access log line."""

    start_ms: float
    end_ms: float
    status: int
    protocol: str  # Envoy's %PROTOCOL%: HTTP/1.1, HTTP/2, HTTP/3
    user: str
    flags: str  # %RESPONSE_FLAGS%, e.g. UF (upstream connection failure), DC (downstream closed); "-": none
    details: str  # %RESPONSE_CODE_DETAILS%, e.g. via_upstream


@dataclass
class Answer:
    """What one stream got: the response (status, headers lowercased, body), or the reset that ended it."""

    sent_ms: float
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    ended_ms: float | None = None
    reset: int | None = None  # the error code of RST_STREAM / RESET_STREAM


@dataclass
class ProtocolEnvoy:
    """An Envoy of the stack with its listeners: `h2c_port` (the template's), `tls_port`, `quic_port` (UDP,
    None without QUIC); `ca_path` verifies the server certificate; `access_log` holds every request."""

    envoy: h.Envoy
    h2c_port: int
    tls_port: int
    quic_port: int | None
    ca_path: Path
    access_log: Path

    def tls_context(self, alpn: list[str] | None = None) -> ssl.SSLContext:
        """A client TLS context trusting the test CA, offering `alpn` (default `h2` only)."""
        context = ssl.create_default_context(cafile=str(self.ca_path))
        context.set_alpn_protocols(alpn or ["h2"])
        return context


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((h.HOST, 0))
        return sock.getsockname()[1]


def protocol_envoy(stack: h.Stack, plugin: dict, *, quic: bool = False, concurrency: int = 2) -> ProtocolEnvoy:
    """A started Envoy of the stack (stopped with the test's gateways) running `plugin` on the template's
    listener, a TLS listener and, with `quic`, a QUIC listener; every request in `access_log`."""
    workdir = stack.workdir
    ca = trustme.CA()
    issued = ca.issue_cert(SERVER_NAME, h.HOST)
    stack._count += 1
    name = f"envoy-{stack._count}"
    ca_path, cert_path, key_path = (workdir / f"{name}-{part}.pem" for part in ("ca", "cert", "key"))
    ca.cert_pem.write_to_path(str(ca_path))
    issued.private_key_pem.write_to_path(str(key_path))
    cert_path.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))

    envoy = h.Envoy(workdir, plugin, webdis_port=stack.webdis.port, upstream_port=stack.upstream.port,
                    concurrency=concurrency, name=name)
    access_log = workdir / f"{name}-access.log"
    bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
    listeners = bootstrap["static_resources"]["listeners"]
    [plain] = listeners
    manager = plain["filter_chains"][0]["filters"][0]["typed_config"]
    manager["access_log"] = [{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(access_log),
            "log_format": {"text_format_source": {"inline_string": ACCESS_FORMAT}},
        },
    }]
    certificates = [{"certificate_chain": {"filename": str(cert_path)},
                     "private_key": {"filename": str(key_path)}}]

    tls_port = h.free_port()
    tls = copy.deepcopy(plain)
    tls["name"] = "ingress-tls"
    tls["address"]["socket_address"]["port_value"] = tls_port
    tls["filter_chains"][0]["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {"tls_certificates": certificates, "alpn_protocols": ["h2", "http/1.1"]},
        },
    }
    listeners.append(tls)

    quic_port = None
    if quic:
        quic_port = free_udp_port()
        udp = copy.deepcopy(plain)
        udp["name"] = "ingress-quic"
        udp["address"] = {"socket_address": {"protocol": "UDP", "address": h.HOST, "port_value": quic_port}}
        udp["udp_listener_config"] = {"quic_options": {}}
        udp["filter_chains"][0]["transport_socket"] = {
            "name": "envoy.transport_sockets.quic",
            "typed_config": {
                "@type": ("type.googleapis.com/envoy.extensions.transport_sockets.quic.v3."
                          "QuicDownstreamTransport"),
                "downstream_tls_context": {"common_tls_context": {"tls_certificates": certificates,
                                                                  "alpn_protocols": ["h3"]}},
            },
        }
        quic_manager = udp["filter_chains"][0]["filters"][0]["typed_config"]
        quic_manager["codec_type"] = "HTTP3"
        quic_manager["http3_protocol_options"] = {}
        listeners.append(udp)

    envoy.yaml_path.write_text(json.dumps(bootstrap))
    stack.envoys.append(envoy)
    envoy.start()
    return ProtocolEnvoy(envoy, envoy.port, tls_port, quic_port, ca_path, access_log)


def access_entries(path: Path, count: int, timeout: float = 5.0) -> list[Entry]:
    """The access log's entries once it has at least `count` (Envoy writes them after each response)."""
    def written() -> list[Entry] | None:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) < count:
            return None
        entries = []
        for line in lines:
            start, duration, status, protocol, user, flags, details = line.split(" ")
            start_ms = float(start) * 1000.0
            entries.append(Entry(start_ms, start_ms + int(duration), int(status), protocol, user, flags, details))
        return entries

    return h.wait_until(written, timeout, f"{count} access log lines in {path.name}")


def _request_headers(scheme: str, headers: dict[str, str]) -> list[tuple[str, str]]:
    return [(":method", "GET"), (":scheme", scheme), (":authority", SERVER_NAME), (":path", "/")] + [
        (name.lower(), value) for name, value in headers.items()]


def _merge(pairs: list[tuple[bytes, bytes]]) -> tuple[int | None, dict[str, str]]:
    status, merged = None, {}
    for raw_name, raw_value in pairs:
        name, value = raw_name.decode().lower(), raw_value.decode()
        if name == ":status":
            status = int(value)
        elif not name.startswith(":"):
            merged[name] = f"{merged[name]}, {value}" if name in merged else value
    return status, merged


@dataclass
class Burst:
    """The answers of one burst, in stream order, and the protocol the connection agreed on."""

    answers: list[Answer]
    alpn: str | None
    goaway: bool = False


def h2_burst(port: int, n: int, headers: dict[str, str], *, tls: ssl.SSLContext | None = None,
             timeout: float = 20.0) -> Burst:
    """`n` GET requests as `n` streams of one HTTP/2 connection to 127.0.0.1:port: h2c with prior knowledge,
    or TLS with `tls` (ALPN). The connection preface is exchanged first (the server's SETTINGS read), then
    every stream's HEADERS go in one write; the connection stays open until every stream ended or was
    reset, or `timeout` passed."""
    raw = socket.create_connection((h.HOST, port), timeout=timeout)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock = tls.wrap_socket(raw, server_hostname=SERVER_NAME) if tls is not None else raw
    alpn = sock.selected_alpn_protocol() if tls is not None else None
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    answers: dict[int, Answer] = {}
    open_streams: set[int] = set()
    deadline = time.monotonic() + timeout
    settings_seen = False
    goaway = False
    try:
        while time.monotonic() < deadline and not goaway:
            if settings_seen and not answers:
                sent_ms = h.epoch_ms()
                for _ in range(n):
                    stream_id = conn.get_next_available_stream_id()
                    conn.send_headers(stream_id, _request_headers("https" if tls else "http", headers),
                                      end_stream=True)
                    answers[stream_id] = Answer(sent_ms)
                    open_streams.add(stream_id)
                sock.sendall(conn.data_to_send())
            elif answers and not open_streams:
                break
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = sock.recv(65536)
            except (socket.timeout, TimeoutError):
                break
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    settings_seen = True
                elif isinstance(event, h2.events.ResponseReceived):
                    answer = answers[event.stream_id]
                    answer.status, answer.headers = _merge(event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    answers[event.stream_id].body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    answers[event.stream_id].ended_ms = h.epoch_ms()
                    open_streams.discard(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    answers[event.stream_id].reset = int(event.error_code)
                    open_streams.discard(event.stream_id)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    goaway = True
            pending = conn.data_to_send()
            if pending:
                sock.sendall(pending)
    finally:
        sock.close()
    return Burst([answers[stream_id] for stream_id in sorted(answers)], alpn, goaway)


class _H3Client(QuicConnectionProtocol):
    """An HTTP/3 client on aioquic: each request a stream, answered when the stream ends or is reset."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._http = H3Connection(self._quic)
        self._answers: dict[int, Answer] = {}
        self._done: dict[int, asyncio.Future] = {}
        self.terminated: ConnectionTerminated | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamReset) and event.stream_id in self._answers:
            self._answers[event.stream_id].reset = event.error_code
            self._finish(event.stream_id)
        elif isinstance(event, ConnectionTerminated):
            self.terminated = event
            for stream_id in list(self._done):
                self._finish(stream_id)
        for h3_event in self._http.handle_event(event):
            answer = self._answers.get(getattr(h3_event, "stream_id", -1))
            if answer is None:
                continue
            if isinstance(h3_event, HeadersReceived):
                answer.status, answer.headers = _merge(h3_event.headers)
            elif isinstance(h3_event, DataReceived):
                answer.body += h3_event.data
            if getattr(h3_event, "stream_ended", False):
                answer.ended_ms = h.epoch_ms()
                self._finish(h3_event.stream_id)

    def _finish(self, stream_id: int) -> None:
        future = self._done.pop(stream_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    def start(self, headers: dict[str, str]) -> asyncio.Future:
        """Sends one request's HEADERS (transmitted with the next `transmit()`); the future is done when its
        stream ended, was reset, or the connection closed."""
        stream_id = self._quic.get_next_available_stream_id()
        self._answers[stream_id] = Answer(h.epoch_ms())
        future = self._done[stream_id] = asyncio.get_running_loop().create_future()
        pairs = [(name.encode(), value.encode()) for name, value in _request_headers("https", headers)]
        self._http.send_headers(stream_id, pairs, end_stream=True)
        return future

    def answers(self) -> list[Answer]:
        """Every request's answer so far, in stream order."""
        return [self._answers[stream_id] for stream_id in sorted(self._answers)]


async def _h3_session(port: int, ca_path: Path, work: Callable[[_H3Client], Awaitable[None]]) -> Burst:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=SERVER_NAME)
    configuration.load_verify_locations(str(ca_path))
    async with quic_connect(h.HOST, port, configuration=configuration, create_protocol=_H3Client) as client:
        await work(client)
        return Burst(client.answers(), client._quic.tls.alpn_negotiated, client.terminated is not None)


def h3_burst(port: int, n: int, headers: dict[str, str], *, ca_path: Path, timeout: float = 20.0) -> Burst:
    """`n` GET requests as `n` streams of one QUIC connection to 127.0.0.1:port (HTTP/3, the server
    certificate verified against `ca_path`), every HEADERS sent in one flight. Streams beyond the server's
    limit of concurrent streams (Envoy: 100 by default) wait in the client (QUIC's MAX_STREAMS) and go as
    earlier ones end."""
    async def work(client: _H3Client) -> None:
        futures = [client.start(headers) for _ in range(n)]
        client.transmit()
        await asyncio.wait(futures, timeout=timeout)

    return asyncio.run(asyncio.wait_for(_h3_session(port, ca_path, work), timeout + 10.0))


def h3_sustained(port: int, seconds: float, streams: int, headers: dict[str, str], *, ca_path: Path,
                 timeout: float = 20.0) -> Burst:
    """`streams` requests in flight on one QUIC connection for `seconds`: each stream that ends is
    followed by a new one; the last ones are awaited."""
    async def work(client: _H3Client) -> None:
        stop = time.monotonic() + seconds

        async def lane() -> None:
            while time.monotonic() < stop and client.terminated is None:
                future = client.start(headers)
                client.transmit()
                await asyncio.wait([future], timeout=timeout)
                if not future.done():
                    return  # never answered: reported as such

        await asyncio.gather(*(lane() for _ in range(streams)))

    return asyncio.run(asyncio.wait_for(_h3_session(port, ca_path, work), seconds + timeout + 10.0))


# ---------------------------------------------------------------------------------------------------------
# h2load (nghttp2-client): many streams on one connection at the speed of C


class H2load(NamedTuple):
    """One h2load run: the protocol it agreed on, its request counters, its status classes, and each
    request from its `--log-file` as (start ms, end ms, status; -1 for a failed stream)."""

    protocol: str
    counts: dict[str, int]  # total, started, done, succeeded, failed, errored, timeout
    status_classes: dict[str, int]  # 2xx, 3xx, 4xx, 5xx
    requests: list[tuple[float, float, int]]


def start_h2load(workdir: Path, name: str, url: str, *, requests: int, rps: int, streams: int,
                 headers: dict[str, str]) -> tuple[h.Process, Path]:
    """Starts `h2load -n requests --rps rps -c 1 -m streams` against `url` (http: h2c with prior knowledge;
    https: TLS with ALPN h2, certificate not verified): one connection, up to `streams` requests in flight,
    `rps` started per second (so the run lasts requests / rps seconds on a fast machine, longer on a slow
    one, and ends with every request answered). Its output and per-request log go to `workdir`."""
    log = workdir / f"{name}.tsv"
    argv = ["h2load", "-n", str(requests), "--rps", str(rps), "-c", "1", "-m", str(streams),
            "--log-file", str(log), url]
    for header, value in headers.items():
        argv[1:1] = ["-H", f"{header}: {value}"]
    return h.Process(name, argv, workdir / f"{name}.out"), log


def finish_h2load(process: h.Process, log: Path, timeout: float = 60.0) -> H2load:
    """Waits for an h2load of `start_h2load()` (stopped by PID if it overruns) and reads its report."""
    code = process.wait(timeout)
    process.stop()
    output = process.output.read_text(errors="replace")
    if code != 0:
        raise h.HarnessError(f"h2load exited with {code}:\n{output[-2000:]}")
    protocol = re.search(r"Application protocol: (\S+)", output)
    counts = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                       r"(\d+) errored, (\d+) timeout", output)
    classes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", output)
    if not (protocol and counts and classes):
        raise h.HarnessError(f"no h2load report in its output:\n{output[-2000:]}")
    names = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    rows = []
    for line in log.read_text().splitlines():
        start_us, status, took_us = line.split("\t")[:3]
        rows.append((int(start_us) / 1000.0, (int(start_us) + int(took_us)) / 1000.0, int(status)))
    return H2load(protocol.group(1), dict(zip(names, map(int, counts.groups()))),
                  dict(zip(("2xx", "3xx", "4xx", "5xx"), map(int, classes.groups()))), rows)


# ---------------------------------------------------------------------------------------------------------
# What a burst must show


def check_burst(stack: h.Stack, gateway: ProtocolEnvoy, burst: Burst, *, protocol: str, who: str, rate: int,
                interval_ms: int, hits_before: int, rule: str = "per-user") -> None:
    """Asserts what a burst far beyond a limit of `rate` per `interval_ms` (rule `rule` by `x-user-id`,
    user `who`, limiter empty before; the upstream had `hits_before` requests) shows, at the client, the
    upstream, Envoy's access log (every request as `protocol`) and Redis:

    every stream answered (no reset, no GOAWAY), exactly `rate` 200s from the upstream and 429s for the
    rest; the 200s carry the policy and a remaining quota that counts down exactly (`r` = rate-1 ... 0,
    each once); the 429s carry `Retry-After` from Redisson's delay (counted from the oldest permit's score
    in Redis), `x-ratelimited-by`, the policy and `r=0`; the limiter in Redis holds `rate` permits."""
    limiter = h.limiter_name(f"erl:{rule}", who)
    permits = stack.redis.client.zrange(h.limiter_key(limiter, "permits"), 0, -1, withscores=True)
    policy = f'"{rule}";q={rate};w={interval_ms // 1000}'
    unanswered = [(index, a.reset) for index, a in enumerate(burst.answers)
                  if a.status is None or a.reset is not None]
    assert not burst.goaway, "the server closed the connection (GOAWAY / CONNECTION_CLOSE)"
    assert not unanswered, f"streams not answered (index, reset code): {unanswered[:10]} of {len(unanswered)}"
    statuses = [a.status for a in burst.answers]
    admitted = [a for a in burst.answers if a.status == 200]
    rejected = [a for a in burst.answers if a.status != 200]
    assert len(admitted) == rate, f"{len(admitted)} admitted by a limit of {rate}: {sorted(set(statuses))}"
    assert {a.status for a in rejected} == {429}, sorted({a.status for a in rejected})
    assert {a.body for a in admitted} == {h.UPSTREAM_BODY}
    assert stack.upstream.hits - hits_before == rate, "a rejected stream must not reach the upstream"
    assert {a.headers.get("ratelimit-policy") for a in admitted} == {policy}
    remaining = sorted(_remaining(a, rule) for a in admitted)
    assert remaining == list(range(rate)), f"the admitted requests' remaining quotas: {remaining}"
    assert {a.body for a in rejected} == {b"rate limit exceeded\n"}
    assert {a.headers.get("x-ratelimited-by") for a in rejected} == {rule}
    assert {a.headers.get("ratelimit-policy") for a in rejected} == {policy}
    assert {_remaining(a, rule) for a in rejected} == {0}
    assert len(permits) == rate, f"{len(permits)} permits in Redis"
    oldest_ms = min(score for _, score in permits)
    wrong = []
    for answer in rejected:
        allowed = h.retry_after_range(interval_ms, oldest_ms, answer.sent_ms, answer.ended_ms)
        given = answer.headers.get("retry-after")
        if given is None or int(given) not in allowed:
            wrong.append((given, list(allowed)))
    assert not wrong, f"Retry-After (given, allowed) of {len(wrong)} rejections: {wrong[:5]}"
    entries = [e for e in access_entries(gateway.access_log, len(burst.answers)) if e.user == who]
    seen = collections.Counter((e.protocol, e.status) for e in entries)
    assert seen == {(protocol, 200): rate, (protocol, 429): len(rejected)}, f"Envoy's access log: {seen}"


def _remaining(answer: Answer, rule: str) -> int:
    """`r` of the rule's member of the `ratelimit` header (`"per-user";r=4;t=2`)."""
    match = re.fullmatch(rf'"{re.escape(rule)}";r=(\d+);t=(\d+)', answer.headers.get("ratelimit", ""))
    assert match, f"ratelimit header: {answer.headers.get('ratelimit')!r}"
    return int(match.group(1))


class Windows(NamedTuple):
    """The admitted requests of a sustained run, in sliding windows."""

    requests: int
    admitted: int
    worst: int  # the most admitted requests certainly inside one window (harness.worst_window)
    windows: int  # the windows the run spans after its first admission, each refill allowed `slack_ms` late
    seconds: float  # from the first request's start to the last's

    def __str__(self) -> str:
        return (f"{self.requests} requests in {self.seconds:.2f} s, {self.admitted} admitted, worst window "
                f"{self.worst}, {self.windows} windows")


def sliding_windows(spans: list[tuple[float, float, int]], interval_ms: int,
                    slack_ms: float = REFILL_SLACK_MS) -> Windows:
    """`spans`: every request of a run as (start ms, end ms, status); its admitted ones are the 200s.
    After the first admission a limit far exceeded refills every interval, at the first request after the
    oldest permits left: a few ms late on an idle machine, up to a request's latency on a loaded one; the
    run is taken to span a window for every `interval_ms + slack_ms` after its first admission."""
    admitted = sorted((start, end) for start, end, status in spans if status == 200)
    first_start, last_start = min(s for s, _, _ in spans), max(s for s, _, _ in spans)
    windows = 1 + int((last_start - admitted[0][0]) // (interval_ms + slack_ms)) if admitted else 0
    return Windows(len(spans), len(admitted), h.worst_window(admitted, interval_ms), windows,
                   (last_start - first_start) / 1000.0)
