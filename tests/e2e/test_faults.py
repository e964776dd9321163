"""Faults between the gateway and Redis, injected for real while load runs, in both builds (tests/e2e/faults.py):

    stock build (real Envoy):       gateway --> webdis --> fault proxy --> redis-server
    Higress build (host emulator):  gateway's `redis` cluster --> fault proxy --> redis-server

The fault proxy (tests/e2e/faultproxy.py) adds latency, resets, blackholes, half-closes or drops the
connections; Redis itself is stopped and restarted, paused (`CLIENT PAUSE WRITE`), out of memory, asks for a
password the gateways do not have, or forgets its scripts (`SCRIPT FLUSH`). For each fault, with requests
running on a gateway failing open and one failing closed (`redis.timeout` 200 ms), every request must be
answered within the timeout + 50 ms, by a decision or by the failure mode's answer (and some by the latter,
unless the fault must not fail a decision), no VM may trap, the gateways must decide by Redis again within
1 s of Redis being healthy, and the filter's counters must account for every request sent.

One fault proxy, Redis and webdis for the module; the gateways of a build are started once and kept for
its faults.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from faults import BUILDS, FAULTS, Fault, FaultStack, Rig, run_case

# (build, fault name): why the filter fails that case. Such a case still runs, and must fail (strict xfail).
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def fault_stack() -> Iterator[FaultStack]:
    with FaultStack() as stack:
        stack.start()
        yield stack


@pytest.fixture(scope="module")
def build(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def rig(fault_stack: FaultStack, build: str) -> Iterator[Rig]:
    rig = Rig(fault_stack, build).start()
    try:
        yield rig
    finally:
        rig.stop()


# The build is a module-scoped parameter, so pytest runs every fault of one build before it starts the next.
@pytest.mark.parametrize("fault", FAULTS, ids=[fault.name for fault in FAULTS])
@pytest.mark.parametrize("build", BUILDS, indirect=True, scope="module")
def test_a_fault_under_load_is_answered_in_time_in_the_failure_mode_counted_and_recovered(
        rig: Rig, fault: Fault, request: pytest.FixtureRequest):
    reason = KNOWN_DEFECTS.get((rig.build, fault.name))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    result = run_case(rig, fault)
    problems = result.problems()
    assert not problems, f"{fault.name} ({fault.what}), {rig.build} build:\n{result.describe()}"
