"""Security review (issue 12, part 5): what a client, a misconfiguration or a failure can make the filter
reveal or do, in both builds: the stock build in real Envoy (Redis through webdis, Basic auth) and the
Higress build in the host emulator (Redis through the host, Redis AUTH).

1. Credentials: the Redis password (Redis AUTH of the Higress build, webdis's `redis_auth`, erl-admin's
   URL) and the bridge's Basic password never appear, raw or base64, in any log line, error or response,
   whatever fails: wrong password, no credentials, Redis down, Redis hung past the timeout, the bridge
   down, an unknown cluster, invalid configurations carrying the password.
2. Key values of any bytes get a limiter of their own whose keys share one hash slot (`CLUSTER KEYSLOT` of
   a real cluster-enabled redis-server) and no key of another value or rule (tests/key_safety.rs proves
   the same of the naming function over many more values).
3. `x-forwarded-for`: only the N-th address from the right counts; whatever a client prepends, it keeps
   its limiter. Fewer than N entries (or no address there) is no key value: `on_missing` decides.
4. Rejections: a 429's headers and body are the same whatever the request carried (CR/LF, long values,
   header-like text, non-ASCII), but for numbers.
5. The webdis example (envoy/istio-wasmplugin.yaml) accepts EVALSHA and EVAL only, and only with the
   credentials; every other command is refused with and without them.
6. Every key a client can create expires (default keep_alive); a global rule's limiter does not (docs/configuration.md:
   `"global"`: keep_alive 0), one per rule.

One module-wide stack: Redis with a password and webdis configured as the Istio example (its ACL and
Basic auth); one Higress emulator, reconfigured by each test (compiling it takes seconds). Defects found
are `xfail(strict=True)` tests that say what is wrong.
"""

from __future__ import annotations

import base64
import json
import random
import re
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import pytest
import yaml

import harness
from conftest import gateways_stopped
from harness import (
    HOST,
    REDIS_BIN,
    REPO,
    HarnessError,
    Response,
    erl_admin,
    host_plugin_config,
    http_request,
    limiter_key,
    limiter_name,
    plugin_config,
    rule,
    wait_until,
)

ISTIO_EXAMPLE = REPO / "envoy" / "istio-wasmplugin.yaml"

# Secrets are long and unlike anything else in a log, so a hit is a leak, never a coincidence.
REDIS_PASSWORD = "Rp-7d1f0c93-redis-secret"
WRONG_REDIS_PASSWORD = "Rw-52a9e6b0-wrong-redis"
BRIDGE_USER = "erl"
BRIDGE_PASSWORD = "Bp-4b8e2a17-bridge-secret"
WRONG_BRIDGE_PASSWORD = "Bw-9f03c5d2-wrong-bridge"
SECRETS = (REDIS_PASSWORD, WRONG_REDIS_PASSWORD, BRIDGE_PASSWORD, WRONG_BRIDGE_PASSWORD)

TIMEOUT_MS = 300
PAUSE_MS = 10_000
DEFAULT_KEEP_ALIVE_MS = 3_600_000


# ---------------------------------------------------------------------------------------------------------
# Credentials in text


def _credential_forms() -> dict[str, str]:
    """Every way a secret can show: as is, and base64 (standard and url-safe) at each of the three byte
    alignments it can have inside a longer encoded text (only the characters that depend on the secret's
    bytes alone), and the whole `Authorization` value of the bridge credentials."""
    forms: dict[str, str] = {}
    for secret in SECRETS:
        forms[secret] = secret
        raw = secret.encode()
        for offset in range(3):
            aligned = raw[(3 - offset) % 3:]
            aligned = aligned[: len(aligned) // 3 * 3]
            for encode in (base64.b64encode, base64.urlsafe_b64encode):
                forms[encode(aligned).decode()] = f"base64 of {secret} (offset {offset})"
    for password in (BRIDGE_PASSWORD, WRONG_BRIDGE_PASSWORD):
        basic = base64.b64encode(f"{BRIDGE_USER}:{password}".encode()).decode()
        forms[basic] = f"Basic {BRIDGE_USER}:{password}"
    return forms


CREDENTIAL_FORMS = _credential_forms()


def credentials_in(text: str) -> list[str]:
    """The credentials (by description) that `text` shows in any form."""
    return sorted({what for form, what in CREDENTIAL_FORMS.items() if form in text})


def assert_no_credentials(texts: dict[str, str]) -> None:
    leaks = {where: credentials_in(text) for where, text in texts.items()}
    leaks = {where: found for where, found in leaks.items() if found}
    assert not leaks, f"credentials shown: {leaks}"


def response_text(response: Response) -> str:
    return json.dumps([response.status, response.headers, response.body])


def file_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------------------------------------------------
# The Istio example's webdis


def example_webdis_json() -> dict:
    """The `webdis.json` written out in the comments of envoy/istio-wasmplugin.yaml."""
    lines = ISTIO_EXAMPLE.read_text().split("# webdis.json", 1)[1].splitlines()[1:]
    block = []
    for line in lines:
        if not line.startswith("#   "):
            break
        block.append(line[4:])
    return json.loads("\n".join(block))


def example_plugin_redis() -> dict:
    """The `redis` section of the example's plugin configuration."""
    return next(yaml.safe_load_all(ISTIO_EXAMPLE.read_text()))["spec"]["pluginConfig"]["redis"]


class ExampleWebdis(harness.Webdis):
    """webdis with the Istio example's configuration: its ACL and verbosity, with loopback ports, this
    stack's Redis (and its password as `redis_auth`) and the test's bridge credentials instead of
    `erl:change-me`."""

    def config(self) -> dict:
        config = example_webdis_json()
        config.update(redis_host=HOST, redis_port=self.redis.port, redis_auth=self.redis.password, http_host=HOST,
                      http_port=self.port, threads=self.threads, daemonize=False, logfile=str(self.logfile))
        config["acl"] = [dict(entry, http_basic_auth=f"{BRIDGE_USER}:{BRIDGE_PASSWORD}")
                         if "http_basic_auth" in entry else entry for entry in config["acl"]]
        return config

    def logs(self) -> str:
        return file_text(self.workdir / "webdis.out") + file_text(self.logfile)


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


# ---------------------------------------------------------------------------------------------------------
# Configurations and fixtures


def stock_config(*rules: dict, redis: dict | None = None, **fields: Any) -> dict:
    """The stock build through the example's webdis, with its Basic credentials."""
    credentials = {"username": BRIDGE_USER, "password": BRIDGE_PASSWORD}
    return plugin_config(*rules, timeout=TIMEOUT_MS, redis={**credentials, **(redis or {})}, **fields)


def host_config(*rules: dict, redis: dict | None = None, **fields: Any) -> dict:
    """The Higress build with Redis AUTH."""
    return host_plugin_config(*rules, timeout=TIMEOUT_MS, redis={"password": REDIS_PASSWORD, **(redis or {})},
                              **fields)


@pytest.fixture(scope="module")
def secured() -> Iterator[harness.Stack]:
    stack = harness.Stack(redis_password=REDIS_PASSWORD)
    stack.webdis = ExampleWebdis(stack.workdir, stack.redis)
    with stack:
        stack.start()
        yield stack


@pytest.fixture(scope="module")
def higress(secured: harness.Stack) -> Iterator[harness.Emulator]:
    emulator = secured.emulator(host_config(rule()), build="higress", keep=True, wait_ready=False,
                                clusters={"redis": secured.redis.port, "webdis": secured.webdis.port})
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture(scope="module", autouse=True)
def _higress_compiles_meanwhile(higress: harness.Emulator) -> None:
    """Starts the emulator (compiling, seconds) before the stock build's tests run."""


@pytest.fixture
def stack(secured: harness.Stack, request: pytest.FixtureRequest) -> Iterator[harness.Stack]:
    """The module's stack with Redis and webdis up, unpaused and empty; the test's Envoys stopped after it
    (their logs printed if it failed)."""
    secured.redis.start()
    secured.webdis.start()
    secured.redis.unpause()
    secured.redis.client.flushall()
    with gateways_stopped(secured, request):
        yield secured


class Gateway(NamedTuple):
    """One build under test: `send(path, headers, source_address)`, the bytes a header value (str) reaches
    the filter as, and the filter's counters."""

    build: str
    send: Callable[..., Response]
    header_bytes: Callable[[str], bytes]
    metrics: Callable[[], dict[str, int]]


@pytest.fixture(params=["stock", "higress"])
def gateway(request: pytest.FixtureRequest, stack: harness.Stack,
            higress: harness.Emulator) -> Iterator[Callable[..., Gateway]]:
    """`gateway(*rules, **fields)`: the build of the parameter with these rules (stock: a new Envoy;
    Higress: the module's emulator, reconfigured)."""
    def make(*rules: dict, redis: dict | None = None, **fields: Any) -> Gateway:
        if request.param == "stock":
            envoy = stack.envoy(stock_config(*rules, redis=redis, **fields))
            return Gateway("stock", lambda path="/", headers=None, source_address=None: envoy.send(path, headers),
                           lambda text: text.encode("latin-1"), envoy.metrics)
        higress.wait_ready()
        higress.reconfigure(host_config(*rules, redis=redis, **fields))
        return Gateway("higress", higress.send, lambda text: text.encode(), higress.metrics)

    yield make
    report = getattr(request.node, "report_call", None)
    if request.param == "higress" and report is not None and report.failed:
        print(f"--- {higress.name} log (excerpt) ---\n{higress.log_excerpt()}")


def redis_keys(stack: harness.Stack) -> set[bytes]:
    return set(stack.redis.client.scan_iter(count=1000))


def limiter_keys(name: str) -> set[bytes]:
    return {name.encode(), limiter_key(name, "value").encode(), limiter_key(name, "permits").encode()}


def raw_request(port: int, head: bytes, timeout: float = 10.0) -> bytes:
    """Sends `head` (a whole HTTP/1.1 request, `Connection: close`) as bytes; returns the whole answer."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def raw_status(port: int, headers: list[bytes]) -> int:
    head = b"GET / HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n" + b"".join(h + b"\r\n" for h in headers)
    return int(raw_request(port, head + b"\r\n").split(b" ", 2)[1])


def enable_wasm_debug_logs(envoy: harness.Envoy) -> None:
    """Envoy logs the filter's debug lines too (`/logging?wasm=debug`), so every line it writes is grepped."""
    response = http_request(envoy.admin_port, "/logging?wasm=debug", method="POST")
    assert response.status == 200, response.body


# ---------------------------------------------------------------------------------------------------------
# 5. The webdis example: EVALSHA and EVAL, with the credentials only

# Commands a caller of webdis may try, as webdis paths (arguments after the command, `/`-separated).
OTHER_COMMANDS = [
    "GET/foo", "get/foo", "SET/foo/x", "FLUSHALL", "flushall", "FLUSHDB", "CONFIG/GET/requirepass",
    "CONFIG/SET/requirepass/x", "KEYS/*", "SCAN/0", "DEL/foo", "UNLINK/foo", "SCRIPT/FLUSH", "SCRIPT/LOAD/return 1",
    "FUNCTION/FLUSH", "FCALL/f/0", "EVAL_RO/return 1/0", "EVALSHA_RO/e0e1f9fabfc9d4800c877a703b823ac0578ff8db/0",
    "INFO", "PING", "HGETALL/foo", "ZADD/z/1/m", "ACL/LIST", "CLIENT/LIST", "DEBUG/SLEEP/0", "PUBLISH/c/m",
    "SELECT/1", "MULTI", "SAVE", "BGSAVE", "REPLICAOF/127.0.0.1/1", "SHUTDOWN", "GET/foo.raw", "GET/foo.json",
    "0/GET/foo", "%47ET/foo",
]


def test_the_example_webdis_runs_evalsha_and_eval_only_with_credentials(stack):
    config = example_webdis_json()
    credentials = f"{example_plugin_redis()['username']}:{example_plugin_redis()['password']}"
    assert config["acl"] == [{"disabled": ["*"]}, {"http_basic_auth": credentials, "enabled": ["EVALSHA", "EVAL"]}], \
        "the example's ACL or the plugin's credentials changed: review this test"
    port, redis = stack.webdis.port, stack.redis.client
    redis.set("foo", "bar")
    before = stack.redis.command_calls()

    def ask(path: str, who: dict[str, str]) -> list[int]:
        quoted = urllib.parse.quote(path, safe="/%*")
        answers = [http_request(port, f"/{quoted}", headers=who, timeout=5.0),
                   http_request(port, "/", headers={**who, "content-type": "text/plain"}, method="POST",
                                body=path.encode(), timeout=5.0)]
        if "/" in path:  # PUT: the body is the last argument
            head, last = path.rsplit("/", 1)
            answers.append(http_request(port, f"/{urllib.parse.quote(head, safe='/%*')}", headers=who,
                                        method="PUT", body=last.encode(), timeout=5.0))
        return [answer.status for answer in answers]

    nobody, wrong, right = {}, basic(BRIDGE_USER, WRONG_BRIDGE_PASSWORD), basic(BRIDGE_USER, BRIDGE_PASSWORD)
    refused = {(path, name): ask(path, who) for path in OTHER_COMMANDS
               for name, who in [("none", nobody), ("wrong", wrong), ("credentials", right)]}
    assert {key: statuses for key, statuses in refused.items() if set(statuses) != {403}} == {}
    for path in ["EVAL/return 1/0", "EVALSHA/e0e1f9fabfc9d4800c877a703b823ac0578ff8db/0", "eval/return 1/0"]:
        for who in (nobody, wrong, basic("other", BRIDGE_PASSWORD), {"Authorization": "Bearer x"}):
            assert set(ask(path, who)) == {403}, (path, who)
    after = stack.redis.command_calls()
    ran = {name: after[name] - before.get(name, 0) for name in after
           if after[name] != before.get(name, 0) and name != "info"}
    assert ran == {}, "webdis passed refused commands on to Redis"
    assert redis.get("foo") == b"bar" and redis.dbsize() == 1

    assert http_request(port, "/EVAL/return%201/0", headers=right).body == '{"EVAL":1}'
    assert http_request(port, "/EVALSHA/e0e1f9fabfc9d4800c877a703b823ac0578ff8db/0", headers=right).body \
        == '{"EVALSHA":1}', "sha1('return 1'), cached by the EVAL above"
    # As the example's comment says, EVAL runs any Lua: with the credential, a script reaches every key.
    # The credential (and who can reach webdis) is the whole boundary.
    script = urllib.parse.quote("return redis.call('get','foo')")
    assert http_request(port, f"/EVAL/{script}/0", headers=right).body == '{"EVAL":"bar"}'


# ---------------------------------------------------------------------------------------------------------
# 1. Credentials in logs and errors

INVALID_WITH_CREDENTIALS = {
    "rate 0": {"rules": [rule(rate=0)]},
    "password not a string": {"redis": {"password": [BRIDGE_PASSWORD, WRONG_BRIDGE_PASSWORD]}},
    "password an object": {"redis": {"password": {"value": BRIDGE_PASSWORD}}},
    "unknown field beside it": {"redis": {"password": BRIDGE_PASSWORD, "passwd": WRONG_BRIDGE_PASSWORD}},
    "username not a string": {"redis": {"username": [BRIDGE_PASSWORD], "password": BRIDGE_PASSWORD}},
    "override": {"_rules_": [{"_match_route_": ["r"], "redis": {"cluster": "webdis", "password": BRIDGE_PASSWORD},
                              "rules": [rule(rate=0)]}]},
}


def invalid_with_credentials(base: dict, change: dict) -> dict:
    config = json.loads(json.dumps(base))
    for field, value in change.items():
        if field == "redis":
            config["redis"].update(value)
        else:
            config[field] = value
    return config


def test_the_stock_build_shows_no_credential_whatever_fails(stack):
    limited = rule(rate=1, interval="1m")
    good = stack.envoy(stock_config(limited, failure_mode="deny"))
    wrong = stack.envoy(stock_config(limited, failure_mode="deny", redis={"password": WRONG_BRIDGE_PASSWORD}))
    nowhere = stack.envoy(stock_config(limited, failure_mode="deny", redis={"cluster": "nowhere"}))
    gateways = [good, wrong, nowhere]
    for envoy in gateways:
        enable_wasm_debug_logs(envoy)
    # An invalid configuration stops Envoy: they all start at once and exit on their own.
    refused = [stack.envoy(invalid_with_credentials(stock_config(rule()), change), wait_ready=False)
               for change in INVALID_WITH_CREDENTIALS.values()]
    answers: list[Response] = []

    def send(envoy: harness.Envoy, who: str) -> int:
        answers.append(envoy.send(headers={"x-user-id": who}))
        return answers[-1].status

    assert [send(good, "alice"), send(good, "alice")] == [200, 429], "the example's ACL lets the filter work"
    assert send(wrong, "bob") == 503
    assert send(nowhere, "bob") == 503
    stack.redis.pause(PAUSE_MS)
    try:
        assert send(good, "paused") == 503
    finally:
        stack.redis.unpause()
    stack.redis.stop()
    assert send(good, "down") == 503
    stack.redis.start()
    stack.webdis.stop()
    assert send(good, "bridge-down") == 503
    stack.webdis.start()
    for envoy in refused:
        assert envoy.wait_exit(20.0) not in (None, 0), "an invalid configuration must stop Envoy"

    def logged(envoy: harness.Envoy, text: str) -> bool:
        return text in envoy.log_text()

    # The failures were logged (the grep below is not vacuous), and the secrets are in what Envoy was given.
    wait_until(lambda: logged(wrong, "the Redis bridge answered HTTP 403"), 5.0, "the 403 in the log")
    wait_until(lambda: logged(nowhere, "BadArgument"), 5.0, "the unknown cluster in the log")
    # Each VM logs a kind of failure once until Redis answers again: one of the bridge's statuses at least.
    wait_until(lambda: logged(good, "the Redis bridge"), 5.0, "the failures in the log")
    assert all(logged(envoy, "invalid configuration") for envoy in refused)
    assert credentials_in(good.yaml_path.read_text()) and credentials_in(wrong.yaml_path.read_text())

    texts = {envoy.name: envoy.log_text() for envoy in gateways + refused}
    texts["webdis"] = stack.webdis.logs()
    texts["redis"] = stack.redis.log_tail(10_000)
    texts["responses"] = "\n".join(response_text(answer) for answer in answers)
    assert_no_credentials(texts)


def test_envoy_itself_shows_the_bridge_credential_at_debug_level_and_in_its_config_dump(stack):
    """Not the filter's doing, but what an operator must protect (docs/reliability.md, "Security"): the plugin
    configuration holds the credential in clear (Envoy's admin `/config_dump`, the WasmPlugin resource),
    and Envoy at log level debug prints the headers of the filter's calls to the bridge, Basic credentials
    included. At the default level (info, and the `wasm` logger at debug), nothing shows: tests above."""
    envoy = stack.envoy(stock_config(rule()))
    assert credentials_in(http_request(envoy.admin_port, "/config_dump").body) == [BRIDGE_PASSWORD]
    assert http_request(envoy.admin_port, "/logging?level=debug", method="POST").status == 200
    assert envoy.send(headers={"x-user-id": "alice"}).status == 200
    wait_until(lambda: f"Basic {BRIDGE_USER}:{BRIDGE_PASSWORD}" in credentials_in(envoy.log_text()), 5.0,
               "the bridge call's headers in Envoy's debug log")


def test_the_higress_build_shows_no_credential_whatever_fails(stack, higress):
    higress.wait_ready()
    limited = rule(rate=1, interval="1m")
    answers: list[Response] = []
    errors: list[str] = []

    def send(who: str, **redis: Any) -> int:
        higress.reconfigure(host_config(limited, failure_mode="deny", redis=redis))
        answers.append(higress.send(headers={"x-user-id": who}))
        return answers[-1].status

    assert send("alice") == 200
    assert send("alice") == 429
    assert send("bob", password=WRONG_REDIS_PASSWORD) == 503
    assert send("bob", username="erl", password=REDIS_PASSWORD) == 503, "no such ACL user"
    assert send("bob", cluster="nowhere") == 503
    # This build's http transport: the bridge's Basic credentials, as the stock build sends them.
    bridge = {"transport": "http", "cluster": "webdis", "username": BRIDGE_USER}
    assert send("dave", **bridge, password=BRIDGE_PASSWORD) == 200
    assert send("erin", **bridge, password=WRONG_BRIDGE_PASSWORD) == 503
    stack.webdis.stop()
    assert send("dave", **bridge, password=BRIDGE_PASSWORD) == 503
    stack.webdis.start()
    stack.redis.pause(PAUSE_MS)
    try:
        assert send("paused") == 503
    finally:
        stack.redis.unpause()
    stack.redis.stop()
    assert send("down") == 503
    stack.redis.start()
    for change in INVALID_WITH_CREDENTIALS.values():
        bad = invalid_with_credentials(host_config(rule()), change)
        with pytest.raises(HarnessError) as refusal:
            higress.reconfigure(bad)
        # The harness names the line by its fields only (never the configuration it carries).
        message = str(refusal.value)
        assert "configure" in message and BRIDGE_PASSWORD not in message
        errors.append(message)
    higress.reconfigure(host_config(limited))
    assert higress.send(headers={"x-user-id": "carol"}).status == 200, "back to a good configuration"

    log = higress.log_text()
    # Redis 7 answers an unauthenticated ACQUIRE (more than 10 arguments) "ERR Protocol error:
    # unauthenticated multibulk length" before AUTH's WRONGPASS can show.
    assert all(text in log for text in ("Redis error: ", "BadArgument", "HTTP 403")), \
        "failures were logged (the grep is not vacuous)"
    assert log.count("invalid configuration") >= len(INVALID_WITH_CREDENTIALS), "refusals were logged"
    assert_no_credentials({"emulator": log, "refusals": "\n".join(errors), "redis": stack.redis.log_tail(10_000),
                           "responses": "\n".join(response_text(answer) for answer in answers)})


def test_erl_admin_shows_no_password_of_its_url(stack):
    port = stack.redis.port
    url = f"redis://:{REDIS_PASSWORD}@{HOST}:{port}/0"
    runs = [
        ("--url", url, "list"),
        ("--url", url, "--json", "show", "erl:nope"),
        ("--url", f"redis://:{WRONG_REDIS_PASSWORD}@{HOST}:{port}/0", "list"),
        ("--url", f"redis://erl:{WRONG_REDIS_PASSWORD}@{HOST}:{port}/0", "list"),
        ("--url", f"redis://:{REDIS_PASSWORD}@{HOST}:1/0", "list"),
        ("--url", f"redis://:{REDIS_PASSWORD}@{HOST}:notaport/0", "list"),
        ("--url", f"redis://:{REDIS_PASSWORD}#x@{HOST}:{port}/0", "list"),
        ("--url", f"redis://:{REDIS_PASSWORD}?x@{HOST}:{port}/0", "list"),
        ("--url", f"redis://:{REDIS_PASSWORD}@{HOST}:{port}/99999", "list"),
        ("--url", f"http://:{REDIS_PASSWORD}@{HOST}:{port}", "list"),
        ("--url", f"redis+cluster://:{REDIS_PASSWORD}@{HOST}:{port}", "list"),
        ("--cluster", "--url", f"redis://:{REDIS_PASSWORD}@{HOST}:{port}", "list"),
        ("--url", url, "update-rate", "erl:nope", "--rate", "2", "--interval", "1m"),
    ]
    results = {" ".join(args): erl_admin(None, *args) for args in runs}
    results["ERL_REDIS_URL, wrong password"] = erl_admin(
        None, "list", env={"ERL_REDIS_URL": f"redis://:{WRONG_REDIS_PASSWORD}@{HOST}:{port}/0"})
    stack.redis.stop()
    results["Redis down"] = erl_admin(None, "--url", url, "list")
    stack.redis.start()

    assert results[" ".join(runs[0])].code == 0
    assert all(result.code == 1 for name, result in results.items() if name != " ".join(runs[0])), results
    assert_no_credentials({name: result.stdout + result.stderr for name, result in results.items()})


def test_erl_admin_hides_a_password_with_an_unencoded_slash(stack):
    result = erl_admin(None, "--url", f"redis://:{REDIS_PASSWORD}/x@{HOST}:{stack.redis.port}/0", "list")
    assert result.code == 1
    assert_no_credentials({"erl-admin": result.stdout + result.stderr})


# ---------------------------------------------------------------------------------------------------------
# 2. Key values: one slot per limiter, no key shared


class KeySlots:
    """`CLUSTER KEYSLOT` of a real redis-server started with cluster support (no slots needed for it)."""

    def __init__(self, workdir: Path):
        self.port = harness.free_port()
        argv = [REDIS_BIN, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-port", str(harness.free_port()),
                "--cluster-config-file", str(workdir / f"keyslot-{self.port}.conf"),
                "--dir", str(workdir)]
        self.process = harness.Process("redis-keyslot", argv, workdir / "redis-keyslot.log")
        self.client = harness.redis_py.Redis(host=HOST, port=self.port, socket_timeout=10.0)
        wait_until(lambda: self.process.alive() and self.client.ping(), 10.0, "the cluster-enabled redis-server")

    def of(self, keys: list[bytes]) -> dict[bytes, int]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.execute_command("CLUSTER", "KEYSLOT", key)
        return dict(zip(keys, (int(slot) for slot in pipe.execute())))

    def stop(self) -> None:
        self.client.close()
        self.process.stop()


@pytest.fixture(scope="module")
def key_slots(secured: harness.Stack) -> Iterator[KeySlots]:
    slots = KeySlots(secured.workdir)
    try:
        yield slots
    finally:
        slots.stop()


# Values that mean something in a Redis key, a hash tag or a limiter name, and the encodings' length limits.
TRICKY = ["{", "}", "{x}", "}{", "{}", ":", "~", "#", "~YQ", "#x", "a:value", "{erl:by-header:a}:value",
          "erl:by-query:a", "a" * 128, "a" * 129, "b" * 256, "b" * 257, "c" * 3000]
KEY_RULES = [rule(name, limit_by=source, rate=5, interval="1m") for name, source in
             [("by-header", {"header": "x-key"}), ("by-query", {"query": "k"}), ("by-cookie", {"cookie": "s"}),
              ("by-path", "path")]]


def random_text(rng: random.Random, alphabet: str) -> str:
    length = rng.choice([rng.randint(1, 40), rng.randint(120, 135), rng.randint(250, 262), rng.randint(300, 2000)])
    return "".join(rng.choice(alphabet) for _ in range(length))


def key_requests(gw: Gateway, count: int, seed: int) -> list[tuple[str, dict[str, str], dict[str, bytes]]]:
    """Requests each carrying a new value for every rule of KEY_RULES: (path, headers, {rule: value bytes
    the filter sees})."""
    rng = random.Random(seed)
    printable = "".join(map(chr, range(0x21, 0x7F)))
    header_alphabet = printable + " {}:~#" + "".join(map(chr, range(0xA0, 0x100)))
    cookie_alphabet = "".join(c for c in printable if c not in ';,"\\') + "{}:~#"
    query_alphabet = printable + " \r\n\t\0{}:~#&=+%é€😀" + "\U0010FFFF"
    requests = []
    for index in range(count):
        fixed = TRICKY[index] if index < len(TRICKY) else None
        header = fixed or random_text(rng, header_alphabet).strip()
        cookie = fixed or random_text(rng, cookie_alphabet)
        query = (fixed or random_text(rng, query_alphabet)).encode()
        path = "/p/" + urllib.parse.quote(fixed or random_text(rng, printable), safe="/:~")
        headers = {"x-key": header, "cookie": f"a=1; s={cookie}; z=2"}
        requests.append((f"{path}?k={urllib.parse.quote(query, safe='')}", headers, {
            "by-header": gw.header_bytes(header), "by-query": query, "by-cookie": cookie.encode(),
            "by-path": path.encode()}))
    return requests


def test_any_key_value_gets_a_limiter_of_its_own_in_one_slot(stack, gateway, key_slots):
    gw = gateway(*KEY_RULES)
    requests = key_requests(gw, 48, seed=1205)
    statuses = [gw.send(path, headers).status for path, headers, _ in requests]
    assert statuses == [200] * len(requests)

    expected: dict[str, tuple[str, bytes]] = {}
    for _, _, values in requests:
        for name, value in values.items():
            expected.setdefault(limiter_name(f"erl:{name}", value), (name, value))
    wanted = len({(name, value) for _, _, values in requests for name, value in values.items()})
    assert len(expected) == wanted, "README's naming gives every (rule, value) its own name"
    keys = redis_keys(stack)
    # Exactly the documented names (docs/configuration.md): three keys per limiter, nothing else.
    assert keys == set().union(*(limiter_keys(name) for name in expected))
    slots = key_slots.of(sorted(keys))
    for name in expected:
        assert len({slots[key] for key in limiter_keys(name)}) == 1, f"{name}'s keys span slots"
        assert "{" not in name and "}" not in name


def test_query_values_that_differ_in_invalid_utf8_get_their_own_limiters(stack):
    envoy = stack.envoy(stock_config(rule("by-query", limit_by={"query": "k"}, rate=1, interval="1m")))
    assert envoy.send("/?k=%FF").status == 200
    assert envoy.send("/?k=%FE").status == 200
    assert redis_keys(stack) == limiter_keys(limiter_name("erl:by-query", b"\xff")) \
        | limiter_keys(limiter_name("erl:by-query", b"\xfe"))


# ---------------------------------------------------------------------------------------------------------
# 3. x-forwarded-for: the trusted hops decide


def test_prepended_forwarded_addresses_cannot_choose_the_key(stack, gateway):
    """Two trusted proxies: the first appends the client's address (198.51.100.7), the second its own
    (10.0.0.1); `{"x_forwarded_for": 2}` takes the client's, whatever the client wrote before it."""
    gw = gateway(rule("xff", limit_by={"x_forwarded_for": 2}, rate=2, interval="1m"))
    spoofs = ["203.0.113.9", "203.0.113.9, 192.0.2.1", "198.51.100.8", "", " , ,", "unknown", "::1",
              "2001:db8::1", "1.2.3.4:80", "[2001:db8::2]:443", ", ".join(f"192.0.2.{i}" for i in range(200)),
              "x" * 2000, "198.51.100.7, 10.0.0.1"]
    statuses = [gw.send(headers={"x-forwarded-for": f"{spoof}, 198.51.100.7, 10.0.0.1"}).status
                for spoof in spoofs]
    assert statuses == [200, 200] + [429] * (len(spoofs) - 2)
    assert gw.send(headers={"x-forwarded-for": "198.51.100.8, 10.0.0.1"}).status == 200, "another client"
    assert redis_keys(stack) == limiter_keys("erl:xff:198.51.100.7") | limiter_keys("erl:xff:198.51.100.8")


@pytest.mark.parametrize("on_missing", ["skip", "deny", "share"])
def test_fewer_forwarded_entries_than_trusted_hops_is_no_key_value(stack, gateway, on_missing):
    """docs/configuration.md: `x_forwarded_for: N` is the N-th address from the right, and `on_missing` applies to a
    request without a key value. A header with fewer than N entries (a request that did not come through
    the trusted proxies), or no IP address at the N-th place, gives none (src/key.rs `forwarded_client`):
    skip (not limited by the rule), deny (rejected), share (one limiter for all such requests)."""
    gw = gateway(rule("xff", limit_by={"x_forwarded_for": 2}, rate=2, interval="1m", on_missing=on_missing))
    short = [{"x-forwarded-for": "198.51.100.7"}, {"x-forwarded-for": " 198.51.100.7 , "},
             {"x-forwarded-for": "unknown, 10.0.0.1"}, {}]
    statuses = [gw.send(headers=headers).status for headers in short]
    expected = {"skip": [200] * 4, "deny": [429] * 4, "share": [200, 200, 429, 429]}[on_missing]
    assert statuses == expected
    assert redis_keys(stack) == (limiter_keys(limiter_name("erl:xff", b"")) if on_missing == "share" else set())


def test_a_non_utf8_byte_before_the_trusted_entries_does_not_escape_the_limit(stack):
    envoy = stack.envoy(stock_config(rule("xff", limit_by={"x_forwarded_for": 2}, rate=2, interval="1m")))
    trusted = b"198.51.100.7, 10.0.0.1"
    assert [raw_status(envoy.port, [b"x-forwarded-for: 203.0.113.9, " + trusted]) for _ in range(2)] == [200, 200]
    spoofed = [raw_status(envoy.port, [b"x-forwarded-for: " + prefix + trusted])
               for prefix in (b"\xff, ", b"203.0.113.9\x80, ", b"caf\xe9, ")]
    assert spoofed == [429, 429, 429]


# ---------------------------------------------------------------------------------------------------------
# 4. Rejections: nothing of the request in the answer

MARK = "injected"
# What a client could send, for the Higress build in the emulator (any text reaches the filter) and for
# Envoy (which refuses CR, LF and NUL in header values itself: 400 before any filter runs).
HOSTILE_ANYWHERE = ['"per-user";r=999;t=0, ' + MARK, MARK * 2000, f"{MARK}: 1", f"<html>{MARK}</html>",
                    f"%0d%0aSet-Cookie:%20{MARK}"]
HOSTILE_EMULATOR = [f"alice\r\nSet-Cookie: {MARK}=1", f"\r\n\r\n<html>{MARK}</html>",
                    f"x\nx-ratelimited-by: {MARK}", f"\x00{MARK}", f"\u2028{MARK}\u0085", f"ü{MARK}€"]
HOSTILE_ENVOY = [f"\xff{MARK}\xfe", f"\xe9{MARK}"]


def shape(response: Response) -> tuple:
    """A response with its numbers blotted out (Retry-After, t=, dates), header names sorted."""
    def blot(text: str) -> str:
        return re.sub(r"[0-9]+", "N", text)
    return response.status, sorted((name, blot(value)) for name, value in response.headers.items()), response.body


def test_a_rejection_is_the_same_whatever_the_request_carried(stack, gateway):
    gw = gateway(rule("per-user", rate=1, interval="1m"), rule("by-query", limit_by={"query": "k"}, rate=1,
                 interval="1m"), rate_limit_headers="both")
    hostile = HOSTILE_ANYWHERE + (HOSTILE_ENVOY if gw.build == "stock" else HOSTILE_EMULATOR)

    def thrice(**request: Any) -> list[Response]:
        return [gw.send(**request) for _ in range(3)]  # allowed, rejected by Redis, rejected locally

    baseline = {"per-user": thrice(headers={"x-user-id": "alice"}), "by-query": thrice(path="/?k=alice")}
    for rule_name, answers in baseline.items():
        assert [a.status for a in answers] == [200, 429, 429]
        assert answers[1].body == "rate limit exceeded\n" and answers[1].headers["x-ratelimited-by"] == rule_name
    differing = {}
    for value in hostile:
        for rule_name, request in [("per-user", {"headers": {"x-user-id": value}}),
                                   ("by-query", {"path": "/?k=" + urllib.parse.quote(value.encode(), safe="%")})]:
            answers = thrice(**request)
            for answer, reference in zip(answers, baseline[rule_name]):
                if shape(answer) != shape(reference) or MARK in response_text(answer).lower():
                    differing[(rule_name, value[:40])] = shape(answer)
    assert differing == {}


# ---------------------------------------------------------------------------------------------------------
# 6. Every key a client can create expires


def test_every_key_a_client_can_create_has_a_ttl(stack, gateway):
    """Default keep_alive (1 h: every interval here is shorter), every kind of key value, per-client
    limiters, leases, all-or-nothing give-backs (redis_cluster: limiters in different slots), rejections."""
    gw = gateway(
        rule("per-user", rate=3, interval="2s"),
        rule("per-ip", limit_by="client_ip", rate=50, interval="1s"),
        rule("by-query", limit_by={"query": "k"}, rate=2, interval="1m", type="per_client"),
        rule("by-cookie", limit_by={"cookie": "s"}, rate=20, interval="1s", lease={"max_permits": 4,
                                                                                   "max_age": "50ms"}),
        rule("by-tenant", limit_by={"header": "x-tenant"}, rate=2, interval="10s", on_missing="share"),
        rule("xff", limit_by={"x_forwarded_for": 1}, rate=5, interval="1s"),
        rule("by-path", limit_by="path", rate=30, interval="1m"),
        rule("everyone", limit_by="global", rate=100_000, interval="1s"),
        redis={"redis_cluster": True},
    )
    rng = random.Random(612)
    before = gw.metrics()
    statuses = []
    for _ in range(150):
        headers = {"x-user-id": f"user-{rng.randrange(8)}", "cookie": f"s={rng.choice('abcde')}"}
        if rng.random() < 0.7:
            headers["x-tenant"] = f"tenant-{rng.randrange(3)}"
        if rng.random() < 0.7:
            headers["x-forwarded-for"] = f"192.0.2.{rng.randrange(6)}"
        path = f"/p{rng.randrange(4)}" + (f"?k={rng.randrange(6)}" if rng.random() < 0.8 else "")
        statuses.append(gw.send(path, headers, source_address=f"203.0.113.{rng.randrange(4)}:4000").status)
    assert {200, 429} <= set(statuses)
    time.sleep(0.5)  # give-backs are not waited for by the responses
    after = gw.metrics()
    assert after["compensations"] > before.get("compensations", 0), "give-backs ran"
    assert after["leases"] > before.get("leases", 0), "leases were granted"

    ttls = {key: stack.redis.client.pttl(key) for key in redis_keys(stack)}
    everyone = limiter_keys("erl:everyone")
    assert everyone <= set(ttls)
    # docs/configuration.md: a global rule's keep_alive defaults to 0 (never): its one limiter has no TTL, by design.
    assert {key: ttls[key] for key in everyone} == {key: -1 for key in everyone}
    per_client = [key for key in ttls if re.match(rb"\{erl:by-query:[0-9]\}:(value|permits):", key)]
    assert per_client, "per-client keys were created"
    assert {key for key in ttls if not key.startswith((b"erl:", b"{erl:"))} == set()
    lasting = {key: ttl for key, ttl in ttls.items() if key not in everyone
               and not 0 < ttl <= DEFAULT_KEEP_ALIVE_MS}
    assert lasting == {}, "keys a client created without a TTL"
