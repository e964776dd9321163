"""Redisson's own Java client, driven from the tests: `tests/interop/redisson` (`RedissonDriver`) in a JVM of
its own, one Redisson instance per process (its own client id, as Redisson's PER_CLIENT windows are per
instance), speaking JSON lines on stdin and stdout.

`scripts/setup.sh` builds it (`target/classes` and `target/classpath.txt`, Maven's repository in
`.tools/m2`); the tests never build it. The JVM is `$JAVA_HOME/bin/java` when `JAVA_HOME` is set, else
`java` on PATH (Java 17 or later). It connects to one `harness.Redis` on 127.0.0.1 and is stopped by its PID.

    java = RedissonJava(stack.redis, stack.workdir).start()
    limiter = java.limiter("erl:per-user:alice")
    limiter.try_set_rate(OVERALL, rate=5, interval_ms=60_000)
    limiter.try_acquire()            # Redisson's RRateLimiter.tryAcquire(1): True / False

Every call answers with the result and the wall-clock span of the Redisson call (`Timed`: epoch ms read just
before and after it, in the JVM; the same machine clock as `harness.epoch_ms()`). A Redisson exception
raises `RedissonError` with its message (`RateLimiter is not initialized`, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from pathlib import Path
from typing import Any, NamedTuple

import harness

DRIVER = harness.REPO / "tests" / "interop" / "redisson"
CLASSES = DRIVER / "target" / "classes"
CLASSPATH = DRIVER / "target" / "classpath.txt"
MAIN_CLASS = "erl.interop.RedissonDriver"

#: Redisson's `RateType` names, as the driver takes them.
OVERALL = "OVERALL"
PER_CLIENT = "PER_CLIENT"


def java_bin() -> str:
    """The `java` to run: `$JAVA_HOME/bin/java` if `JAVA_HOME` is set, else `java` on PATH."""
    home = os.environ.get("JAVA_HOME")
    return str(Path(home) / "bin" / "java") if home else "java"


class RedissonError(Exception):
    """Redisson threw: `message` (Redis's error text for a script's `assert`), `exception` (the Java class)."""

    def __init__(self, message: str, exception: str):
        super().__init__(f"{exception}: {message[:300]}")
        self.message = message
        self.exception = exception


class Timed(NamedTuple):
    """A Redisson call's result and when it ran: epoch ms read in the JVM just before and after the call
    (an acquire is stamped by Redisson with its `System.currentTimeMillis()` in between)."""

    result: Any
    start_ms: int
    end_ms: int


class RedissonJava:
    """One Redisson instance (Redisson 4.7.0, `tests/interop/redisson/pom.xml`) in its own JVM."""

    READY_TIMEOUT = 60.0  # a JVM and Redisson's connections on a loaded 2-CPU machine: ~2 s usually

    def __init__(self, redis: harness.Redis, workdir: Path, name: str = "redisson-java"):
        self.redis = redis
        self.workdir = workdir
        self.name = name
        self.log_path = workdir / f"{name}.err"
        self.process: harness.Process | None = None
        self.client_id = ""  # Redisson's `getId()`: the `<id>` of this instance's PER_CLIENT keys
        self.version = ""  # Redisson's version, from its jar's manifest
        self._lines: "queue.Queue[str | None]" = queue.Queue()
        self._next_id = 0
        self._lock = threading.Lock()

    def start(self) -> "RedissonJava":
        if not CLASSPATH.is_file() or not CLASSES.is_dir():
            raise harness.HarnessError(f"{DRIVER} is not built: run scripts/setup.sh (make setup)")
        classpath = os.pathsep.join([str(CLASSES), CLASSPATH.read_text().strip()])
        redis_url = f"redis://{harness.HOST}:{self.redis.port}"
        if self.redis.password:
            redis_url = f"redis://:{self.redis.password}@{harness.HOST}:{self.redis.port}"
        argv = [java_bin(), "-XX:TieredStopAtLevel=1", "-Xss512k", "-cp", classpath, MAIN_CLASS, redis_url]
        self.process = harness.Process(self.name, argv, self.log_path, pipes=True)
        harness.follow_lines(self.process, self._lines)
        ready = self._answer(self.READY_TIMEOUT, "its ready line")
        if not ready.get("ready"):
            self.stop()
            raise harness.HarnessError(f"{self.name} started with {ready} instead of its ready line")
        self.client_id, self.version = ready["id"], ready["version"]
        return self

    def _answer(self, timeout: float, what: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise harness.HarnessError(f"{self.name} did not answer {what} within {timeout:.0f}s\n"
                                       f"--- {self.name} stderr ---\n{harness.tail(self.log_path)}") from None
        if line is None:
            self._lines.put(None)
            code = self.process.wait(5.0) if self.process else None
            raise harness.HarnessError(f"{self.name} exited with code {code}\n--- {self.name} stderr ---\n"
                                       f"{harness.tail(self.log_path)}")
        return json.loads(line)

    def call(self, op: str, timeout: float = 30.0, **fields: Any) -> Timed:
        """One operation (`RedissonDriver`'s `op`, its fields as keyword arguments); raises RedissonError if
        Redisson threw. Calls from several threads are answered one after the other."""
        if self.process is None:
            raise harness.HarnessError(f"{self.name} was not started")
        with self._lock:
            self._next_id += 1
            call_id = self._next_id
            try:
                self.process.popen.stdin.write(json.dumps({"id": call_id, "op": op, **fields}).encode() + b"\n")
                self.process.popen.stdin.flush()
            except (OSError, ValueError):
                pass  # it exited: _answer says how
            answer = self._answer(timeout, f"{op}")
        if answer.get("id") != call_id:
            raise harness.HarnessError(f"{self.name} answered {answer} to call {call_id} ({op})")
        if "error" in answer:
            raise RedissonError(answer["error"], answer.get("exception", ""))
        return Timed(answer["result"], answer["start_ms"], answer["end_ms"])

    def limiter(self, name: str) -> "JavaLimiter":
        """`redisson.getRateLimiter(name)`."""
        return JavaLimiter(self, name)

    def semaphore(self, name: str) -> "JavaSemaphore":
        """`redisson.getPermitExpirableSemaphore(name)`."""
        return JavaSemaphore(self, name)

    def stop(self) -> None:
        """Closes stdin (the driver shuts Redisson down and exits), then stops it by PID if it lingers."""
        if self.process is not None:
            with contextlib.suppress(OSError, ValueError):
                self.process.popen.stdin.close()
            self.process.wait(5.0)
            self.process.stop()
            self.process = None

    def __enter__(self) -> "RedissonJava":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


class JavaLimiter:
    """Redisson's `RRateLimiter` of one name, on one `RedissonJava` instance. Intervals and keep-alive times
    in ms; `rate_type` is `OVERALL` or `PER_CLIENT`. Method names follow Redisson's (Redisson 4.7.0
    `RedissonRateLimiter`)."""

    def __init__(self, java: RedissonJava, name: str):
        self.java = java
        self.name = name

    def _call(self, op: str, **fields: Any) -> Timed:
        return self.java.call(op, name=self.name, **fields)

    def try_set_rate(self, rate_type: str, rate: int, interval_ms: int, keep_alive_ms: int = 0) -> bool:
        """`trySetRate(type, rate, interval, keepAliveTime)`: creates the limiter unless its config exists."""
        return self._call("trySetRate", type=rate_type, rate=rate, interval_ms=interval_ms,
                          keep_alive_ms=keep_alive_ms).result

    def set_rate(self, rate_type: str, rate: int, interval_ms: int, keep_alive_ms: int = 0) -> None:
        """`setRate(type, rate, interval, keepAliveTime)`: writes the config, resets the state of that type."""
        self._call("setRate", type=rate_type, rate=rate, interval_ms=interval_ms, keep_alive_ms=keep_alive_ms)

    def set_rate_keeping_state(self, rate_type: str, rate: int, interval_ms: int, keep_alive_ms: int = 0) -> None:
        """`setRate(RateLimiterArgs.of(type, rate, interval).keepAliveTime(..).keepState(true))` (4.4+):
        writes the config; permits taken in the window stay taken."""
        self._call("setRateArgs", type=rate_type, rate=rate, interval_ms=interval_ms, keep_alive_ms=keep_alive_ms,
                   keep_state=True)

    def update_rate(self, rate_type: str, rate: int, interval_ms: int, keep_alive_ms: int = 0,
                    keep_state: bool = True) -> bool:
        """`updateRate(RateLimiterArgs ... keepState(keep_state))` (4.4+): as setRate, but False and nothing
        written when the limiter does not exist."""
        return self._call("updateRate", type=rate_type, rate=rate, interval_ms=interval_ms,
                          keep_alive_ms=keep_alive_ms, keep_state=keep_state).result

    def try_acquire(self, permits: int = 1) -> bool:
        """`tryAcquire(permits)`: takes them now if available, else False (never waits)."""
        return self._call("tryAcquire", permits=permits).result

    def try_acquire_timed(self, permits: int = 1) -> Timed:
        """`tryAcquire(permits)` with the span of the call (Redisson's acquire time lies within it)."""
        return self._call("tryAcquire", permits=permits)

    def available_permits(self) -> int:
        """`availablePermits()`: releases the permits that left the window and returns the value."""
        return self._call("availablePermits").result

    def config(self) -> dict:
        """`getConfig()`: {"type": "OVERALL" | "PER_CLIENT", "rate": n, "interval_ms": n} (all 0 and OVERALL
        when the limiter does not exist, as Redisson answers)."""
        return self._call("getConfig").result

    def delete(self) -> bool:
        """`delete()`: the hash, both value and both permits keys (this instance's client keys)."""
        return self._call("delete").result

    def expire(self, ttl_ms: int) -> bool:
        """`expire(Duration)`: PEXPIRE of the same five keys."""
        return self._call("expire", ttl_ms=ttl_ms).result

    def remain_ttl_ms(self) -> int:
        """`remainTimeToLive()`: the config hash's PTTL (-1 none, -2 no hash)."""
        return self._call("remainTimeToLive").result

    def release(self, permits: int) -> None:
        """`release(permits)` (4.x): the value key rises by `permits`, at most to the rate; no member goes."""
        self._call("release", permits=permits)

    def hammer(self, threads: int, ms: int, pause_ms: int = 0, permits: int = 1,
               timeout_ms: int = 0) -> list[tuple[int, int, int]]:
        """`threads` threads of this instance calling `tryAcquire(permits)` (with `timeout_ms` > 0:
        `tryAcquire(permits, timeout_ms, MILLISECONDS)`, which waits for the permits up to it) for `ms`, each
        pausing `pause_ms` after each call: (start ms, end ms, 1 acquired / 0 refused / -1 threw) of every
        call."""
        calls = self.java.call("hammer", name=self.name, threads=threads, ms=ms, pause_ms=pause_ms, permits=permits,
                               timeout_ms=timeout_ms, timeout=(ms + timeout_ms) / 1000 + 30).result
        return [tuple(call) for call in calls]


class JavaSemaphore:
    """Redisson's `RPermitExpirableSemaphore` of one name, on one `RedissonJava` instance (Redisson 4.7.0
    `RedissonPermitExpirableSemaphore`). Permit ids as Java shows them: 32 hex digits of 16 bytes; leases in
    ms."""

    def __init__(self, java: RedissonJava, name: str):
        self.java = java
        self.name = name

    def _call(self, op: str, **fields: Any) -> Timed:
        return self.java.call(op, name=self.name, **fields)

    def try_set_permits(self, permits: int) -> bool:
        return bool(self._call("semTrySetPermits", permits=permits).result)

    def try_acquire(self, lease_ms: int) -> str | None:
        """`tryAcquire(0, lease_ms, MILLISECONDS)`: a permit's id, or None when none is free."""
        return self._call("semTryAcquire", lease_ms=lease_ms).result

    def try_release(self, permit: str) -> bool:
        return bool(self._call("semRelease", permit=permit).result)

    def available_permits(self) -> int:
        return int(self._call("semAvailablePermits").result)

    def acquired_permits(self) -> int:
        return int(self._call("semAcquiredPermits").result)

    def permits(self) -> int:
        """`getPermits()`: free plus held."""
        return int(self._call("semPermits").result)

    def lease_time_ms(self, permit: str) -> int:
        """`getLeaseTime(id)`: ms left of the permit's lease (-1: no lease)."""
        return int(self._call("semLeaseTime", permit=permit).result)

    def hammer(self, threads: int, ms: int, hold_ms: int, lease_ms: int) -> list[tuple[float, float]]:
        """`threads` threads taking a permit (lease `lease_ms`), holding it `hold_ms` and releasing it, for
        `ms`: each permit's (taken, released) epoch ms with a µs fraction, read in the JVM after the take and
        before the release."""
        timed = self._call("semHammer", threads=threads, ms=ms, hold_ms=hold_ms, lease_ms=lease_ms)
        return [(int(a) / 1000.0, int(b) / 1000.0) for a, b in timed.result]
