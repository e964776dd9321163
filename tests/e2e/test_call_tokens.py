"""An HTTP call and a Redis call with the same token, in flight together: each reply must reach its own
request.

The Higress build can reach Redis two ways at once: the global configuration through the host's Redis
client (`redis.transport: "host"`, `proxy_redis_call`, cluster `redis`: the stack's redis-server) and a
route override through the HTTP bridge (`transport: "http"`, `proxy_http_call`, cluster `webdis`). The
emulator runs it with `--call-tokens per-kind`: HTTP calls and Redis calls are numbered by separate
counters from the same start, so the n-th HTTP call and the n-th Redis call of the VM share token n, and
each reply comes back through its own callback (`proxy_on_http_call_response`,
`proxy_on_redis_call_response`) with that token (tests/host README, "Call tokens"). Envoy and Higress
number the two kinds apart (the kind in the low two bits: HTTP 4, 8, ...; Redis 7, 11, ...), so there the
tokens never meet; `per-kind` is the stricter host, and a filter that tells its calls apart by token alone
mixes them up in it.

One VM; the two configurations' calls are first brought level (sequential requests, counted from the
emulator's per-request `http_calls` and `redis_calls`), then one request of each is sent in one batch, so
their calls share a token. Each configuration answers recognisably: the route's rule `bridge-deny` (1 per
minute, its permit taken by the first request) rejects with 429 and `x-ratelimited-by: bridge-deny`; the
global rule `host-allow` (1000 per minute) allows. Both orders of the replies are played: the Redis reply
first (direct), and the HTTP reply first (Redis behind a fault proxy adding latency).
"""

from __future__ import annotations

import pytest

from faultproxy import FaultProxy
from harness import host_plugin_config, limiter_key, rule

ROUTE = "bridge-route"
TIMEOUT_MS = 500
# Under "http-first", what the fault proxy adds to each direction of the Redis connection: a Redis round
# trip takes 2 x this more, well past the bridge's round trip (ms on the loopback) and within TIMEOUT_MS.
REDIS_LATENCY_MS = 100

CONFIG = host_plugin_config(
    rule("host-allow", limit_by="global", rate=1000, interval="1m"),
    timeout=f"{TIMEOUT_MS}ms",
    _rules_=[{
        "_match_route_": [ROUTE],
        "redis": {"transport": "http", "cluster": "webdis", "timeout": f"{TIMEOUT_MS}ms"},
        # No local block: every request of this rule asks Redis (through the bridge), rejected ones too.
        "rules": [rule("bridge-deny", limit_by="global", rate=1, interval="1m", local_block_max=0)],
    }],
)

BRIDGE = {"route_name": ROUTE}  # the override: HTTP calls to webdis
HOST = {}  # the global configuration: Redis calls through the host

# (status, x-ratelimited-by, ratelimit-policy) each configuration answers.
BRIDGE_REJECTS = (429, "bridge-deny", '"bridge-deny";q=1;w=60')
HOST_ALLOWS = (200, None, '"host-allow";q=1000;w=60')


def answer(response) -> tuple:
    return (response.status, response.headers.get("x-ratelimited-by"), response.headers.get("ratelimit-policy"))


@pytest.mark.parametrize("first", ["redis-first", "http-first"])
def test_an_http_call_and_a_redis_call_sharing_a_token_each_answer_their_own_request(stack, first):
    proxy = None
    redis_port = stack.redis.port
    if first == "http-first":
        proxy = FaultProxy(stack.redis.port).start()
        proxy.set_mode("latency", latency_ms=REDIS_LATENCY_MS)
        redis_port = proxy.port
    try:
        # Every first acquire of a run sends EVALSHA, NOSCRIPT, then EVAL: the same count each run.
        stack.redis.client.script_flush()
        gateway = stack.emulator(CONFIG, build="higress", vms=1, call_tokens="per-kind",
                                 clusters={"redis": redis_port, "webdis": stack.webdis.port})

        assert answer(gateway.send(**BRIDGE)) == (200, None, BRIDGE_REJECTS[2]), "its one permit"
        assert answer(gateway.send(**BRIDGE)) == BRIDGE_REJECTS
        assert answer(gateway.send(**HOST)) == HOST_ALLOWS
        sent = {"bridge": 2, "host": 1}

        def calls() -> tuple[int, int]:
            """HTTP calls and Redis calls the VM made so far: its counters' next tokens are these + 1."""
            return (sum(o["http_calls"] for o in gateway.outcomes), sum(o["redis_calls"] for o in gateway.outcomes))

        # Bring the counters level: the next HTTP call and the next Redis call get the same token.
        while calls()[0] != calls()[1]:
            behind = "bridge" if calls()[0] < calls()[1] else "host"
            expected = BRIDGE_REJECTS if behind == "bridge" else HOST_ALLOWS
            assert answer(gateway.send(**(BRIDGE if behind == "bridge" else HOST))) == expected
            sent[behind] += 1
        http_calls, redis_calls = calls()
        assert http_calls == redis_calls
        token = http_calls + 1

        bridge, host = gateway.send_batch([BRIDGE, HOST])
        sent = {"bridge": sent["bridge"] + 1, "host": sent["host"] + 1}
        batch = gateway.outcomes[-2:]
        got = {"bridge": answer(bridge), "host": answer(host)}
        detail = (f"both calls had token {token} ({first}); the route's request (HTTP call) answered "
                  f"{got['bridge']} after {batch[0]['elapsed_ms']:.0f} ms ({batch[0]['kind']}), the global "
                  f"one's (Redis call) {got['host']} after {batch[1]['elapsed_ms']:.0f} ms ({batch[1]['kind']})\n"
                  f"{gateway.log_tail(20)}")
        assert (batch[0]["http_calls"], batch[0]["redis_calls"]) == (1, 0), detail
        assert (batch[1]["http_calls"], batch[1]["redis_calls"]) == (0, 1), detail
        assert got == {"bridge": BRIDGE_REJECTS, "host": HOST_ALLOWS}, detail

        # Redis: the route's limiter holds the one permit it granted, the global one a permit per request.
        client = stack.redis.client
        name = "erl:bridge-deny"
        assert client.zcard(limiter_key(name, "permits")) == 1
        assert client.get(limiter_key(name, "value")) == b"0"
        name = "erl:host-allow"
        assert client.zcard(limiter_key(name, "permits")) == sent["host"]
        assert client.get(limiter_key(name, "value")) == str(1000 - sent["host"]).encode()
    finally:
        if proxy is not None:
            proxy.stop()
