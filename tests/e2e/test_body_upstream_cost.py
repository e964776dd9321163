"""What a rejected request whose rule reads the body costs the upstream (issue 40), measured in real Envoy 1.40
from its own `cluster.upstream.*` counters, with the `openai` SDK as the client, over an HTTP/1.1 and an
HTTP/2 upstream (`llm_upstream`), with and without the plugin's `hold_headers_for_body`.

A token budget per API key and model (`limit_by: [{"header": "authorization"}, {"body": "model"}]`,
reserving the body's `max_tokens`, settled by the usage) needs the body to decide. By default the filter lets
the request headers go on to the router while it reads the body (in Envoy a pause in the headers also hides
the body from the filter), so the router has already started an upstream request when the filter answers
429: Envoy resets it, which over HTTP/1.1 closes the upstream connection (the next request opens a new one)
and over HTTP/2 resets a stream. `"hold_headers_for_body": true`, with the Wasm `PluginConfig` option
`allow_on_headers_stop_iteration: true` (Envoy 1.35 and later), holds the headers until the body is read and
decided: a rejected request never starts an upstream request.

What a user would notice: upstream connections opened and closed for requests that were refused anyway
(each one a TCP handshake for the upstream, and an upstream handler that ran on a request whose body never
came), or with the hold on any upstream request started for a 429; an admitted call that fails or reaches the
upstream without its whole body; a reservation left behind.

The run: 60 SDK calls one after the other on two clients: an API key whose budget (10,000 tokens a minute)
admits two calls of `max_tokens` 4,500 (each settles to 3,004 tokens) and rejects the rest, and every tenth call
from an API key with room to spare (its calls are admitted between the 429s). Envoy's upstream cluster
counters are read before each call, so each call's share (connections opened, requests started, resets,
connections closed) is known; each variant prints one line of figures (`pytest -s`).

Until the filter knows `hold_headers_for_body` it refuses such a configuration at load, and the `hold`
variants fail saying so.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator, NamedTuple

import openai
import pytest
import yaml

import harness as h
import llm_upstream as llm

MODEL = "gpt-4o-mini"
CALLS = 60
RICH_EVERY = 10  # every tenth call is the rich API key's
BUDGET = 10_000  # tokens a minute per API key and model
ASK, SAY = 4500, 3000  # the poor key's max_tokens (its reservation) and the output it asks for
POOR_KEY, RICH_KEY = "sk-erl-poor", "sk-erl-rich"
TIMEOUT_S = 20.0
# The counters of Envoy's upstream cluster read per call (`cluster.upstream.<name>`).
COUNTERS = ("upstream_cx_total", "upstream_rq_total", "upstream_rq_tx_reset", "upstream_rq_rx_reset",
            "upstream_rq_cancelled", "upstream_rq_pending_total", "upstream_cx_destroy",
            "upstream_cx_destroy_local", "upstream_cx_destroy_remote", "upstream_cx_destroy_local_with_active_rq",
            "upstream_cx_destroy_remote_with_active_rq", "upstream_rq_completed")
ACCESS_FORMAT = {"status": "%RESPONSE_CODE%", "flags": "%RESPONSE_FLAGS%", "details": "%RESPONSE_CODE_DETAILS%",
                 "upstream": "%UPSTREAM_HOST%", "auth": "%REQ(AUTHORIZATION)%"}

TOKEN_RULE = h.rule("tokens", limit_by=[{"header": "authorization"}, {"body": "model"}], rate=BUDGET, interval="1m",
                    cost={"reserve": {"body": "openai", "default": 4000}, "settle": {"usage": "openai"}})


def usage(prompt: str, max_tokens: int) -> int:
    """The usage the upstream reports for one user message (llm.usage_of)."""
    input_tokens, output_tokens, _ = llm.usage_of({"messages": [{"role": "user", "content": prompt}],
                                                   "max_tokens": max_tokens})
    return input_tokens + output_tokens


def poor_admitted() -> int:
    """How many of the poor key's calls its budget admits: each reserves ASK while that much is left, then
    settles to its usage."""
    left, admitted = BUDGET, 0
    while left >= ASK:
        left -= usage(f"say {SAY} tokens", ASK)
        admitted += 1
    return admitted


# --- The gateway ------------------------------------------------------------------------------------------


def with_stop_iteration_allowed(bootstrap: dict, allowed: bool) -> None:
    """Sets Envoy's Wasm `PluginConfig` option `allow_on_headers_stop_iteration` (beside `name`, `root_id`,
    `vm_config`) of the template's wasm filter to `allowed` (absent when not: Envoy's default, false), whatever
    the template says: with it, a filter that holds the headers still gets the body."""
    [listener] = bootstrap["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    [wasm] = [f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.wasm"]
    config = wasm["typed_config"]["config"]
    config.pop("allow_on_headers_stop_iteration", None)
    if allowed:
        config["allow_on_headers_stop_iteration"] = True


def with_http2_upstream(bootstrap: dict) -> None:
    """The `upstream` cluster speaks HTTP/2 (prior knowledge), as test_llm_sdks.py's gateway does."""
    [cluster] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "upstream"]
    cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }}


def start_envoy(stack: h.Stack, upstream: llm.LlmUpstream, hold: bool) -> tuple[h.Envoy, Any]:
    """An Envoy (2 workers) with the token rule in front of `upstream`, its access log, and with `hold` the
    plugin's `hold_headers_for_body` and Envoy's `allow_on_headers_stop_iteration` (without: neither, the
    filter's and Envoy's defaults). A configuration refused at load fails the test with the reason."""
    fields = {"hold_headers_for_body": True} if hold else {}
    stack._count += 1
    name = f"envoy-{stack._count}"
    envoy = h.Envoy(stack.workdir, h.plugin_config(TOKEN_RULE, **fields), webdis_port=stack.webdis.port,
                    upstream_port=upstream.port, name=name)
    bootstrap = yaml.safe_load(envoy.yaml_path.read_text())
    access_log = stack.workdir / f"{name}-access.log"
    h.with_json_access_log(bootstrap, access_log, ACCESS_FORMAT)
    if upstream.http2:
        with_http2_upstream(bootstrap)
    with_stop_iteration_allowed(bootstrap, hold)
    envoy.yaml_path.write_text(json.dumps(bootstrap))
    stack.envoys.append(envoy)
    try:
        envoy.start()
    except h.HarnessError as error:
        failure = str(error)
    else:
        return envoy, access_log
    refused = [line[line.index("invalid configuration"):] for line in envoy.log_text().splitlines()
               if "invalid configuration" in line]
    what = "the hold variant needs the filter's `hold_headers_for_body` (issue 40): " if hold else ""
    if refused:
        pytest.fail(f"{what}the filter refused the configuration: {refused[0][:400]}", pytrace=False)
    pytest.fail(f"{what}Envoy did not start: {failure[-1500:]}", pytrace=False)


@pytest.fixture
def start_upstream() -> Iterator[Callable[[bool], llm.LlmUpstream]]:
    """`start_upstream(http2)`: an LLM upstream that does not compress (the answers' encoding is not what
    this measures), stopped after the test."""
    started: list[llm.LlmUpstream] = []

    def start(http2: bool) -> llm.LlmUpstream:
        started.append(llm.LlmUpstream(http2=http2, compress="never").start())  # type: ignore[arg-type]
        return started[-1]

    yield start
    for server in started:
        server.stop()


# --- The run ----------------------------------------------------------------------------------------------


class Outcome(NamedTuple):
    """One SDK call: whose, its status as the client saw it (200, 429, or another error's), what Envoy's
    upstream cluster counted between its start and the next call's (`COUNTERS`), its body as sent."""

    key: str
    status: int
    counted: dict[str, int]
    body: dict


def upstream_counters(envoy: h.Envoy) -> dict[str, int]:
    stats = envoy.stats(filter=r"^cluster\.upstream\.upstream_(cx|rq)_")
    return {name: stats.get(f"cluster.upstream.{name}", 0) for name in COUNTERS}


def call(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[int, int | None]:
    """One chat completion: (status, the usage the SDK parsed); a refusal's status from the SDK's error."""
    try:
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens)
    except openai.APIStatusError as error:
        return error.status_code, None
    except openai.APIConnectionError:
        return 0, None  # reset or closed: no answer at all
    return 200, answer.usage.total_tokens if answer.usage else None


def run_calls(envoy: h.Envoy) -> list[Outcome]:
    """CALLS calls one after the other, the rich key's every RICH_EVERY-th; each admitted call must get the
    usage the upstream reports."""
    clients = {key: openai.OpenAI(base_url=f"http://{h.HOST}:{envoy.port}/v1", api_key=key, timeout=TIMEOUT_S,
                                  max_retries=0) for key in (POOR_KEY, RICH_KEY)}
    outcomes: list[Outcome] = []
    try:
        before = upstream_counters(envoy)
        for index in range(CALLS):
            key = RICH_KEY if index % RICH_EVERY == RICH_EVERY - 1 else POOR_KEY
            prompt, max_tokens = ("say 5 tokens", 10) if key == RICH_KEY else (f"say {SAY} tokens", ASK)
            status, reported = call(clients[key], prompt, max_tokens)
            if status == 200:
                assert reported == usage(prompt, max_tokens), f"call {index}: the SDK parsed usage {reported}"
            if index == CALLS - 1:
                time.sleep(0.3)  # what the last call's reset does to the connection, counted as its own
            after = upstream_counters(envoy)
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
            outcomes.append(Outcome(key, status, {n: after[n] - before[n] for n in COUNTERS}, body))
            before = after
    finally:
        for client in clients.values():
            client.close()
    return outcomes


def per_call(outcomes: list[Outcome], name: str) -> float:
    """A counter's share per call, over these calls."""
    return sum(o.counted[name] for o in outcomes) / len(outcomes) if outcomes else 0.0


def settled_members(stack: h.Stack, want: int) -> list[llm.Member]:
    """Every permit member of the token rule's limiters once they are `want`, all settled (`-s`); fails with
    what is there if some stay reserved (`-r`) or their number differs."""
    def found() -> list[llm.Member]:
        client = stack.redis.client
        return [llm.decode_member(member, score) for key in client.scan_iter(match="*erl:tokens*:permits")
                for member, score in client.zrange(key, 0, -1, withscores=True)]

    def settled() -> list[llm.Member] | None:
        members = found()
        return members if len(members) == want and all(m.random[:2] == b"-s" for m in members) else None

    try:
        return h.wait_until(settled, 5.0, f"{want} settled members")
    except h.HarnessError:
        raise AssertionError(f"wanted {want} settled members; found (mark, permits) "
                             f"{[(m.random[:2], m.permits) for m in found()]}") from None


def access_entries(path: Any, count: int) -> list[dict]:
    """Envoy's access log once it has `count` entries (each written when its response ends)."""
    def written() -> list[dict] | None:
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines] if len(lines) >= count else None
    return h.wait_until(written, 5.0, f"{count} access log entries")


@pytest.mark.parametrize("hold", [False, True], ids=["headers-first", "hold"])
@pytest.mark.parametrize("protocol", ["h1", "h2"])
def test_rejected_body_requests_cost_the_upstream(stack, start_upstream, protocol, hold):
    """Rejected SDK calls whose rule reads the body, and what each costs Envoy's upstream cluster: without
    the hold, over HTTP/1.1, about an upstream connection opened and closed per 429 (the figure is recorded,
    it is the cost the hold removes); over HTTP/2 no connection beyond the first (a stream reset instead);
    with the hold, on both protocols, no upstream request started and no connection opened for a 429.
    Whatever the variant, every call is answered 200 or 429 (no 503 from a reset upstream), every admitted
    call reaches the upstream with its whole body and gets its usage, and every admitted call's reservation
    ends settled (none left reserved, nothing reserved for a 429)."""
    upstream = start_upstream(protocol == "h2")
    envoy, access_log = start_envoy(stack, upstream, hold)
    started = time.monotonic()
    outcomes = run_calls(envoy)
    seconds = time.monotonic() - started

    statuses = sorted({o.status for o in outcomes})
    admitted = [o for o in outcomes if o.status == 200]
    rejected = [o for o in outcomes if o.status == 429]
    rich = sum(1 for o in outcomes if o.key == RICH_KEY)
    log = access_entries(access_log, len(outcomes))
    flags = sorted({(e["status"], e["flags"]) for e in log})
    upstream.wait_served(len(admitted))
    served = upstream.served
    whole = [s for s in served if s.request is not None]
    partial = len(served) - len(whole)  # answered by an upstream handler whose request body never came
    picked = sum(1 for e in log if str(e["status"]) == "429" and e["upstream"] not in ("", "-", None))
    total = {n: sum(o.counted[n] for o in outcomes) for n in COUNTERS}
    variant = f"{protocol} {'hold' if hold else 'headers-first'}"
    print(f"\nbody-upstream-cost {variant}: {len(outcomes)} calls ({len(admitted)} admitted, {len(rejected)} "
          f"rejected 429) in {seconds:.1f} s; per 429: "
          f"{per_call(rejected, 'upstream_cx_total'):.2f} upstream connections opened, "
          f"{per_call(rejected, 'upstream_rq_total'):.2f} upstream requests started "
          f"(+{per_call(rejected, 'upstream_rq_cancelled'):.2f} cancelled while connecting), "
          f"{per_call(rejected, 'upstream_rq_tx_reset'):.2f} streams reset, "
          f"{per_call(rejected, 'upstream_cx_destroy_local_with_active_rq'):.2f} connections closed with the "
          f"request on them, {partial / max(1, len(rejected)):.2f} upstream handlers run without the body, "
          f"{picked / max(1, len(rejected)):.2f} picked an upstream host; whole run: "
          f"{total['upstream_cx_total']} upstream connections opened, {total['upstream_cx_destroy']} closed; "
          f"(status, flags) {flags}")
    print(f"  {variant} counters of the 429s: "
          f"{ {n: sum(o.counted[n] for o in rejected) for n in COUNTERS} }; of the admitted calls: "
          f"{ {n: sum(o.counted[n] for o in admitted) for n in COUNTERS} }")

    assert statuses == [200, 429], f"every call answered 200 or 429; statuses {statuses}, (status, flags) {flags}"
    assert len(admitted) == poor_admitted() + rich, \
        f"{len(admitted)} admitted, wanted the poor key's {poor_admitted()} and the rich key's {rich}"
    assert sorted(json.dumps(s.request, sort_keys=True) for s in whole) == \
        sorted(json.dumps(o.body, sort_keys=True) for o in admitted), "each admitted call's whole body, once"
    settled_members(stack, len(admitted))
    if protocol == "h2" and not hold:
        assert sum(o.counted["upstream_cx_total"] for o in rejected) == 0, \
            "over HTTP/2 a 429 opens no upstream connection (its stream is reset)"
        assert sum(o.counted["upstream_cx_destroy"] for o in rejected) == 0, \
            "over HTTP/2 a 429 closes no upstream connection"
    if hold:
        for name in ("upstream_rq_total", "upstream_cx_total", "upstream_rq_tx_reset", "upstream_rq_cancelled",
                     "upstream_rq_pending_total", "upstream_cx_destroy"):
            assert sum(o.counted[name] for o in rejected) == 0, f"with the hold, 429s counted {name}"
        assert partial == 0, f"with the hold, the upstream saw {partial} requests without their body"
        assert picked == 0, f"with the hold, {picked} 429s picked an upstream host"
