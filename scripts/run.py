#!/usr/bin/env python3
"""`make run`: the filter in stock Envoy, in front of a tiny upstream, limiting with Redis through webdis.

Starts redis-server, webdis, an upstream and Envoy 1.40 with dist/edge-rate-limiter-envoy.wasm (all on
127.0.0.1, free ports; tests/e2e/harness.py), sends a burst of requests as one user and prints what each
got, then keeps everything up for your own curl until Ctrl-C (or exits at once with RUN_ONCE=1 / --once).
Every process it started is stopped on exit, also on SIGTERM.

With HOST=higress (`make run HOST=higress`) the Higress build (dist/edge-rate-limiter-higress.wasm) runs in the
project's host emulator (tests/host, `wasm-host`) and reaches Redis through the Higress Redis hostcalls,
with no bridge; the emulator has no HTTP listener, so the interactive part reads user ids on stdin.

Environment: ERL_WASM (the module), ENVOY_BIN (Envoy), HOST=envoy|higress, RUN_ONCE=1, ERL_KEEP_LOGS=1 (keep
the temp dir).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

import harness  # noqa: E402 - after the path set-up above
from harness import HarnessError, host_plugin_config, limiter_key, plugin_config, rule  # noqa: E402

RATE = 5
INTERVAL_S = 3
USER = "demo"
# When each request is sent (seconds from the first): a quick burst of 8 (5 pass, 3 are rejected), then 4
# more once the first permits have slid out of the 3 s window.
SCHEDULE = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 3.25, 3.65, 4.05, 4.45]


def demo_config(host: str) -> dict:
    return (host_plugin_config if host == "higress" else plugin_config)(
        rule("per-user", limit_by={"header": "x-user-id"}, rate=RATE, interval=f"{INTERVAL_S}s"),
        timeout="200ms",
        rate_limit_headers="both",
    )


def _terminate(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM / SIGHUP: the same orderly stop as Ctrl-C


def send_burst(stack: harness.Stack, envoy: harness.Envoy | harness.Emulator) -> None:
    print(f"Sending {len(SCHEDULE)} requests as x-user-id: {USER} over {SCHEDULE[-1]:.1f} s "
          f"(limit: {RATE} per {INTERVAL_S} s, sliding window)\n")
    print(f"  {'time':>6}  {'status':<6}  {'retry-after':<11}  {'ratelimit':<24}  {'x-ratelimit-remaining':<21}  body")
    calls_before = stack.redis.command_calls()
    counts: dict[int, int] = {}
    start = time.monotonic()
    for offset in SCHEDULE:
        harness.sleep_until(start + offset)
        elapsed = time.monotonic() - start
        response = envoy.send(headers={"x-user-id": USER})
        counts[response.status] = counts.get(response.status, 0) + 1
        h = response.headers
        print(f"  {elapsed:5.2f}s  {response.status:<6}  {h.get('retry-after', '-'):<11}  "
              f"{h.get('ratelimit', '-'):<24}  {h.get('x-ratelimit-remaining', '-'):<21}  "
              f"{response.body.strip()!r}")
    calls_after = stack.redis.command_calls()

    delta = {c: calls_after.get(c, 0) - calls_before.get(c, 0) for c in ("evalsha", "eval")}
    summary = ", ".join(f"{n} x {status}" for status, n in sorted(counts.items()))
    print(f"\nSummary: {summary}.")
    note = " (a fresh Redis answered the first EVALSHA with NOSCRIPT; it was sent again as EVAL)" \
        if delta["eval"] else ""
    print(f"Redis round trips: {delta['evalsha'] + delta['eval']} for {len(SCHEDULE)} requests: "
          f"{delta['evalsha']} EVALSHA + {delta['eval']} EVAL{note}.")
    metrics = envoy.metrics()
    print("Filter counters (edge_rate_limiter.*): "
          + " ".join(f"{name}={value}" for name, value in sorted(metrics.items())))

    redis = stack.redis.client
    name = f"erl:per-user:{USER}"
    value, permits = limiter_key(name, "value"), limiter_key(name, "permits")
    config = " ".join(f"{k.decode()}={v.decode()}" for k, v in sorted(redis.hgetall(name).items()))
    print("Redis state (Redisson RRateLimiter layout):")
    print(f"  HGETALL {name:<28} {config}")
    print(f"  GET {value:<32} {(redis.get(value) or b'-').decode()} permits available")
    print(f"  ZCARD {permits:<30} {redis.zcard(permits)} permits taken in the last {INTERVAL_S} s")


def run_emulator(stack: harness.Stack, once: bool) -> int:
    """The demo with the Higress build in the host emulator: Redis through proxy_redis_call, no bridge."""
    emulator = stack.emulator(demo_config("higress"), build="higress")
    print("edge-rate-limiter demo (Higress build in the host emulator)")
    print(f"  filter    {harness.BUILDS['higress']}")
    print(f"  host      wasm-host (tests/host), 2 VMs, Redis cluster 'redis' -> 127.0.0.1:{stack.redis.port}\n")
    send_burst(stack, emulator)
    if once:
        return 0
    print("\nThe emulator has no HTTP listener: type a user id and Enter to send a request as that user; "
          "Ctrl-D or Ctrl-C to stop.")
    for line in sys.stdin:
        user_id = line.strip() or USER
        response = emulator.send(headers={"x-user-id": user_id})
        h = response.headers
        print(f"  {user_id}: {response.status}  retry-after={h.get('retry-after', '-')}  "
              f"ratelimit={h.get('ratelimit', '-')}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="exit after the burst (as RUN_ONCE=1)")
    once = parser.parse_args().once or os.environ.get("RUN_ONCE") == "1"
    host = os.environ.get("HOST", "envoy")
    if host not in ("envoy", "higress"):
        print(f"run: HOST must be envoy or higress, not {host!r}", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)

    try:
        with harness.Stack() as stack:
            stack.start()
            if host == "higress":
                return run_emulator(stack, once)
            envoy = stack.envoy(demo_config(host))
            print("edge-rate-limiter demo")
            print(f"  filter    {harness.WASM}")
            print(f"  Envoy     {envoy.url}  (admin http://127.0.0.1:{envoy.admin_port}/)")
            print(f"  webdis    http://127.0.0.1:{stack.webdis.port}/  ->  Redis 127.0.0.1:{stack.redis.port}")
            print(f"  upstream  http://127.0.0.1:{stack.upstream.port}/\n")
            send_burst(stack, envoy)
            if once:
                return 0
            print(f"\nEnvoy is listening on {envoy.url} — try: curl -i -H 'x-user-id: me' {envoy.url}")
            print(f"Counters: curl -s 'http://127.0.0.1:{envoy.admin_port}/stats?filter=wasmcustom'   "
                  f"Redis: redis-cli -p {stack.redis.port}")
            print("Press Ctrl-C to stop.")
            while envoy.running:
                time.sleep(0.5)
            print(f"Envoy exited (code {envoy.process.returncode if envoy.process else None}); "
                  f"last log lines:\n{envoy.log_tail(20)}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("\nStopping Envoy, webdis, Redis and the upstream.")
        return 0
    except HarnessError as error:
        print(f"run: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
