"""A Redis Cluster failover under traffic, measured: what `make test` asserts and `make bench` prints.

One client sends requests for one limiter, one after the other (so their spans never overlap), faster than
the limiter's rate. After `warmup_s` the master that owns the limiter's slot is SIGKILLed; its replica is
promoted after `cluster-node-timeout`; the client goes on for `after_s` once the slot is served again.

Figures (`FailoverRun`):
- `failing_ms`: from the first to the last failed decision (the failure mode's answer; `failure_mode: deny`
  makes it visible as `failure_status`), and `slowest_ms`, the longest a request waited meanwhile;
- `promotion_ms`: from the kill to a replica owning the slot; `recovery_ms`: from that promotion to the
  first decision after the last failure;
- `lost_permits`: permits the old master granted in the last window before the kill that the promoted
  replica did not hold (Redis replicates asynchronously); `worst_window`: the most admitted requests in
  any sliding window of `interval_ms` (counting only requests whose whole span lies inside, so the figure
  never overstates), which may exceed the rate by at most the lost permits.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import harness
from harness import decode_permit, limiter_key
from redis_cluster import RedisCluster


@dataclass
class Decision:
    """One request: when it was sent and answered (epoch ms) and its status."""

    start_ms: float
    end_ms: float
    status: int


@dataclass
class FailoverRun:
    """The decisions of one failover run and the cluster's events (epoch ms)."""

    rate: int
    interval_ms: int
    failure_status: int
    killed_ms: float
    promoted_ms: float
    old_master: int
    new_master: int
    admitted_before_kill: int
    permits_kept: int
    decisions: list[Decision] = field(default_factory=list)
    # Requests for a limiter on another master, sent between the others (`other` of `run_failover`).
    other_decisions: list[Decision] = field(default_factory=list)

    @property
    def other_failures(self) -> list[Decision]:
        """Failed decisions of the limiter on a master that stayed up."""
        return [d for d in self.other_decisions if d.status == self.failure_status]

    @property
    def failures(self) -> list[Decision]:
        return [d for d in self.decisions if d.status == self.failure_status]

    @property
    def failing_ms(self) -> float:
        failed = self.failures
        return failed[-1].end_ms - failed[0].start_ms if failed else 0.0

    @property
    def slowest_ms(self) -> float:
        """The longest request from the kill on."""
        return max((d.end_ms - d.start_ms for d in self.decisions if d.end_ms >= self.killed_ms), default=0.0)

    @property
    def promotion_ms(self) -> float:
        return self.promoted_ms - self.killed_ms

    @property
    def recovery_ms(self) -> float | None:
        """From the promotion to the first decision (allowed or rejected) after the last failure; None if
        the run never recovered."""
        last_failure = max((d.end_ms for d in self.failures), default=self.killed_ms)
        decided = [d for d in self.decisions if d.start_ms >= last_failure and d.status in (200, 429)]
        return decided[0].end_ms - self.promoted_ms if decided else None

    @property
    def lost_permits(self) -> int:
        return self.admitted_before_kill - self.permits_kept

    @property
    def worst_window(self) -> int:
        return harness.worst_window([(d.start_ms, d.end_ms) for d in self.decisions if d.status == 200],
                                    self.interval_ms)


def run_failover(cluster: RedisCluster, send: Callable[[], int], limiter: str, *, rate: int, interval_ms: int,
                 failure_status: int = 503, warmup_s: float = 2.5, after_s: float = 3.0,
                 pace_s: float = 0.01, promotion_timeout_s: float = 30.0,
                 other: Callable[[], int] | None = None) -> FailoverRun:
    """Runs the scenario; `send()` makes one request for `limiter` (its Redis name) and returns its status.
    It is called from one thread, one request at a time. `other()`, if given, makes a request for a limiter
    on another master, after each of `send()`'s (its decisions: `FailoverRun.other_decisions`)."""
    decisions: list[Decision] = []
    other_decisions: list[Decision] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def client() -> None:
        try:
            while not stop.is_set():
                start = harness.epoch_ms()
                status = send()
                decisions.append(Decision(start, harness.epoch_ms(), status))
                if other is not None:
                    start = harness.epoch_ms()
                    status = other()
                    other_decisions.append(Decision(start, harness.epoch_ms(), status))
                time.sleep(pace_s)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            errors.append(error)

    old_master = cluster.master_of(limiter)
    replicas = cluster.replicas_of(old_master)
    slot = cluster.key_slot(limiter)
    thread = threading.Thread(target=client, name="failover-client", daemon=True)
    thread.start()
    try:
        time.sleep(warmup_s)
        killed_ms = cluster.kill_master(old_master) * 1000.0
        # The replicas hold what was replicated before the kill; read it before one is promoted and its
        # first script drops the permits that have left the window meanwhile.
        held = {port: _permits(cluster, port, limiter) for port in replicas}
        new_master = 0
        give_up = time.monotonic() + promotion_timeout_s
        while not new_master:
            if time.monotonic() > give_up or errors:
                raise harness.HarnessError(f"no replica took over slot {slot} of {old_master}:\n"
                                           f"{errors or cluster.log_tail()}")
            new_master = _owner_if_promoted(cluster, slot, old_master) or 0
            time.sleep(0.01)
        promoted_ms = harness.epoch_ms()
        time.sleep(after_s)
    finally:
        stop.set()
        thread.join(10.0)
    if errors:
        raise errors[0]
    admitted, kept = _admitted_and_kept(held.get(new_master, []), decisions, killed_ms, interval_ms)
    return FailoverRun(rate, interval_ms, failure_status, killed_ms, promoted_ms, old_master, new_master,
                       admitted, kept, decisions, other_decisions)


def _permits(cluster: RedisCluster, replica: int, limiter: str) -> list[tuple[bytes, float]]:
    """The permit members (member, score) a replica holds for `limiter` (READONLY: a replica serves reads
    of its master's slots)."""
    client = cluster.node(replica).client()
    try:
        client.execute_command("READONLY")
        return client.zrange(limiter_key(limiter, "permits"), 0, -1, withscores=True)
    finally:
        client.close()


def _owner_if_promoted(cluster: RedisCluster, slot: int, old_master: int) -> int | None:
    """The master serving `slot` if it is no longer `old_master` and reports cluster_state:ok."""
    for node in cluster.nodes:
        if not node.alive:
            continue
        try:
            ranges = cluster._slot_ranges(node)
            owner = next(port for first, last, port in ranges if first <= slot <= last)
            if owner == old_master:
                return None
            return owner if b"cluster_state:ok" in cluster.node(owner).command("CLUSTER", "INFO") else None
        except Exception:  # noqa: BLE001 - a node mid-failover answers anything; try the next one
            continue
    return None


def _admitted_and_kept(held: list[tuple[bytes, float]], decisions: list[Decision], killed_ms: float,
                       interval_ms: int) -> tuple[int, int]:
    """Permits the old master granted in the last window before the kill (requests answered 200 before
    it), and how many of them the promoted replica held.

    The requests never overlap, so a bound in the gap between two of them separates their permits' scores
    (stamped by the filter while the request was in flight) exactly.
    """
    before = [d for d in decisions if d.status == 200 and d.end_ms <= killed_ms]
    window_start = killed_ms - interval_ms
    recent = [d for d in before if d.start_ms >= window_start]
    if not recent:
        return 0, 0
    earlier = [d for d in before if d.start_ms < window_start]
    low = (earlier[-1].end_ms + recent[0].start_ms) / 2 if earlier else recent[0].start_ms - 1
    high = recent[-1].end_ms
    kept = sum(decode_permit(member, score).permits for member, score in held if low < score <= high)
    return len(recent), kept
