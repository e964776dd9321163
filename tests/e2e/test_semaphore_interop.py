"""In-flight permits shared with Redisson's own Java client: the filter's semaphore scripts
(src/script/lua/semaphore_*.lua, built as build.rs builds them) and Redisson 4.7.0's
`RPermitExpirableSemaphore` (tests/interop/redisson, `redisson_java.JavaSemaphore`) on one real Redis.
Each side takes, gives back, extends and reclaims the other's permits; a permit whose lease ended comes back
to both; together they never hold more than the semaphore's size (issue 31; the rule that uses the scripts
is the filter's in-flight rule, tested in real Envoy by test_inflight.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import harness as h
from redisson_java import RedissonJava

LUA = h.REPO / "src" / "script" / "lua"
NAME = "erl:inflight:team-a"
FREE, TAKEN, CHANNEL = NAME, "{" + NAME + "}:timeout", "redisson_sc:{" + NAME + "}"


def source(file: str) -> str:
    """The script as build.rs builds a `--@standalone` body: its first line, then its code without comment
    lines and indentation."""
    code = [line.strip() for line in (LUA / file).read_text().splitlines()]
    name = {"semaphore_acquire.lua": "semaphoreAcquire", "semaphore_release.lua": "semaphoreRelease",
            "semaphore_extend.lua": "semaphoreExtend"}[file]
    return f"-- edge-rate-limiter {name}\n" + "".join(f"{line}\n" for line in code if line and not line.startswith("--"))


class Gateway:
    """The filter's side: its scripts run by EVAL with its arguments (the gateway's clock, 16 random bytes per
    permit), as the filter will send them."""

    def __init__(self, redis: h.Redis, size: int):
        self.client = redis.client
        self.size = size
        self.scripts = {kind: source(f"semaphore_{kind}.lua") for kind in ("acquire", "release", "extend")}

    def acquire(self, lease_ms: int) -> tuple[bytes | None, list[int]]:
        """One permit with a lease: its id (None when refused) and the script's reply for it ([1, free] when
        taken, [0, free, end of the earliest lease or -1] when refused)."""
        permit, now = os.urandom(16), int(h.epoch_ms())
        reply = self.client.eval(self.scripts["acquire"], 3, FREE, TAKEN, CHANNEL, now, "publish", self.size,
                                 now + lease_ms, permit)
        numbers = [int(x) for x in reply]
        return (permit, numbers[:2]) if numbers[0] == 1 else (None, numbers)

    def release(self, *permits: bytes) -> int:
        return int(self.client.eval(self.scripts["release"], 3, FREE, TAKEN, CHANNEL, "publish", len(permits),
                                    *permits))

    def extend(self, lease_ms: int, *permits: bytes) -> int:
        now = int(h.epoch_ms())
        return int(self.client.eval(self.scripts["extend"], 3, FREE, TAKEN, CHANNEL, now, "publish", now + lease_ms,
                                    len(permits), *permits))


@pytest.fixture(scope="module")
def java(processes: h.Stack):
    """One Redisson instance for the module, on the module's Redis (stopped by PID after the module)."""
    with RedissonJava(processes.redis, processes.workdir) as process:
        yield process


def held(stack: h.Stack) -> int:
    return int(stack.redis.client.zcard(TAKEN))


def free(stack: h.Stack) -> int:
    return int(stack.redis.client.get(FREE) or 0)


def test_the_gateway_and_java_take_give_back_and_extend_each_others_permits(stack, java):
    gateway, semaphore = Gateway(stack.redis, 5), java.semaphore(NAME)
    mine = []
    for left in (4, 3, 2):
        permit, reply = gateway.acquire(lease_ms=30_000)
        assert permit is not None and reply == [1, left], reply
        mine.append(permit)
    # The gateway created it with its size, as Redisson's trySetPermits would: Java sees the same state.
    assert not semaphore.try_set_permits(9), "it exists"
    assert (semaphore.permits(), semaphore.available_permits(), semaphore.acquired_permits()) == (5, 2, 3)
    theirs = [semaphore.try_acquire(lease_ms=20_000) for _ in range(3)]
    assert theirs[2] is None and all(theirs[:2]), theirs
    # Full: the gateway is refused, and told when the earliest lease ends (Java's, 20 s from its acquire).
    permit, reply = gateway.acquire(lease_ms=30_000)
    assert permit is None and reply[:2] == [0, 0], reply
    assert 15_000 < reply[2] - h.epoch_ms() <= 20_000, reply
    assert semaphore.try_release(theirs[0])
    permit, reply = gateway.acquire(lease_ms=30_000)
    assert permit is not None and reply == [1, 0], reply
    mine.append(permit)
    # Java addresses the gateway's permits by the hex of their 16 bytes: their lease, moved by the gateway.
    assert 25_000 < semaphore.lease_time_ms(mine[0].hex()) <= 30_000
    assert gateway.extend(90_000, mine[0], mine[1]) == 2
    assert 85_000 < semaphore.lease_time_ms(mine[0].hex()) <= 90_000
    assert gateway.release(mine[0], mine[1]) == 2
    assert gateway.release(mine[0]) == 0, "released already: nothing changes"
    assert (semaphore.available_permits(), semaphore.acquired_permits()) == (2, 3)
    assert semaphore.try_release(mine[2].hex()), "Java gives back a gateway's permit"
    assert gateway.release(mine[2]) == 0
    assert (semaphore.available_permits(), free(stack) + held(stack)) == (3, 5)


def test_a_dead_gateways_permits_come_back_within_its_lease_to_java_and_to_gateways(stack, java):
    gateway, semaphore = Gateway(stack.redis, 4), java.semaphore(NAME)
    dead = [gateway.acquire(lease_ms=1_500)[0] for _ in range(4)]
    assert all(dead)
    assert semaphore.try_acquire(lease_ms=10_000) is None, "every permit is held"
    time.sleep(1.6)
    # The gateway that took them is gone: nobody releases them; their leases ended.
    assert gateway.extend(10_000, *dead) == 0, "a lease that ended is not revived"
    assert semaphore.available_permits() == 4
    java_permit = semaphore.try_acquire(lease_ms=10_000)
    permit, reply = gateway.acquire(lease_ms=10_000)
    assert java_permit and permit and reply == [1, 2], reply
    assert free(stack) + held(stack) == 4


def test_java_and_the_gateway_together_never_hold_more_than_the_size(stack, java):
    size, seconds, hold_ms = 3, 2.0, 15
    gateway, semaphore = Gateway(stack.redis, size), java.semaphore(NAME)
    assert gateway.release() == 0, "no permit: nothing changes"
    assert semaphore.try_set_permits(size)
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def gateway_worker() -> None:
        while time.monotonic() < stop:
            permit, _ = gateway.acquire(lease_ms=5_000)
            taken = h.epoch_ms()
            if permit is None:
                time.sleep(0.001)
                continue
            time.sleep(hold_ms / 1000)
            released = h.epoch_ms()
            assert gateway.release(permit) == 1
            with lock:
                spans.append((taken, released))

    threads = [threading.Thread(target=gateway_worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    java_spans = semaphore.hammer(threads=3, ms=int(seconds * 1000), hold_ms=hold_ms, lease_ms=5_000)
    for thread in threads:
        thread.join()
    assert len(spans) > 10 and len(java_spans) > 10, (len(spans), len(java_spans))
    # Each span is inside the time its permit was held (read after the take, before the release, to the µs),
    # on the machine's one clock: at no instant more than `size` of them overlap.
    events = sorted([(a, 1) for a, _ in spans + java_spans] + [(b, -1) for _, b in spans + java_spans],
                    key=lambda e: (e[0], -e[1]))  # a take and a release at one instant: both held then
    most = running = 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most <= size, most
    assert most == size, f"the load should fill the semaphore: at most {most} at once"
    assert (semaphore.available_permits(), held(stack)) == (size, 0)
