"""Every ``upstream_unavailable``, ``auth_required``, ``unknown_model``, capacity and
timeout error says what to do next, true to its cause (issue 15; SPEC E1, L7).

Each reason of that list is walked through the assembled relay where the stack allows —
on virtual time through its ASGI app for queues and deadlines, on loopback for real
upstreams (a port nothing listens on, a server that answers 401 or drops the connection,
a CLI command that is not installed or dies) — and, for what loopback cannot stage (a
connect timeout, a name that does not resolve, a TLS failure, every other httpx error),
at its source, `transport_errors`. `ACTION_FITS` says, per reason, what a fitting action
names; a capacity action never says "connection" (SPEC L7: that advice made seed 000's jam
worse).
"""

from __future__ import annotations

import functools
import re
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import ASGIResult, asgi_request, chat, config_from, sse_events
from helpers.httpx_errors import _httpx_exception_classes, _instance

import relay
from relay import Relay, open_relay
from relay.api.http import transport_errors
from relay.vocab.errors import DEFAULT_ACTIONS, REASONS, RelayError

# What a fitting action names, per reason: the limit to raise (with its value) or what to
# start, fix or set. Checked on every error the walk meets.
ACTION_FITS: dict[str, Callable[[str], bool]] = {
    "provider_queue_full": lambda a: "Retry-After" in a and "queue_max (now" in a,
    "provider_queue_timeout": lambda a: "Retry-After" in a and "queue_timeout_s (now" in a,
    "run_timeout": lambda a: "run_timeout_s in [providers." in a,
    "attempt_timeout": lambda a: re.search(r"(primary|fallback)_timeout_s \(now", a) is not None,
    "budget_exhausted": lambda a: "budget_s (now" in a,
    "first_token_timeout": lambda a: "first_token_timeout_s (now" in a,
    "stall_timeout": lambda a: "stall_timeout_s (now" in a,
    "unknown_model": lambda a: "GET /v1/models" in a or "models" in a or "provider" in a,
    "auth_required": lambda a: "key" in a.lower() or "login" in a.lower(),
    "upstream_unavailable": lambda a: any(w in a for w in (
        "start", "base_url", "network", "proxy", "retry", "install")),
    # SPEC L12: it could never start there: make it smaller, or send it where it fits.
    "request_too_large": lambda a: "max_tokens" in a and "fallback" in a,
    # SPEC L14: a client's day or month is spent: wait for its reset, or raise the limit.
    "client_limit": lambda a: "reset" in a and "[clients." in a,
}


def assert_fits(error: dict[str, Any], reason: str, *, says: str | None = None) -> str:
    """The E1 body's ``relay`` part has ``reason`` and an action that fits it."""
    detail = error["relay"]
    assert detail["reason"] == reason, error
    action = detail["action"]
    assert isinstance(action, str) and action.strip(), error
    assert ACTION_FITS[reason](action), f"{reason}: {action!r}"
    if detail["phase"] == "capacity":
        assert "connection" not in action.lower(), action
    if says is not None:
        assert says in action, action
    return action


# --- capacity and timeouts, on virtual time through the assembled relay ----------------

CONFIG = """
[server]
records = "records.jsonl"
heartbeat_s = 1000
[providers.one]
adapter = "fake"
models = ["echo"]
[providers.one.profile]
lanes = 1
queue_max = 1
queue_timeout_s = 10
run_timeout_s = 50
[providers.two]
adapter = "fake"
models = ["echo", "other"]
[routes.r]
primary = "two/echo?delay_s=1000"
primary_timeout_s = 5
[routes.budget]
primary = "two/echo?delay_s=1000"
fallbacks = ["one/echo"]
primary_timeout_s = 5
fallback_timeout_s = 5
budget_s = 3
[routes.first]
primary = "two/echo?delay_s=1000"
first_token_timeout_s = 2
[routes.stall]
primary = "two/echo?chunks=3&chunk_delay_s=1000"
stall_timeout_s = 2
"""


@pytest.fixture
async def relay_(tmp_path: Path) -> AsyncIterator[Relay]:
    async with open_relay(config_from(CONFIG, tmp_path), discover=False) as r:
        yield r


def start(nursery: trio.Nursery, r: Relay, body: dict[str, Any]) -> ASGIResult:
    result = ASGIResult()
    nursery.start_soon(lambda: asgi_request(r.app, "/v1/chat/completions", body, result))
    return result


def error_of(result: ASGIResult) -> dict[str, Any]:
    """The E1 error of a plain answer, or of a stream's in-band error event."""
    if result.headers.get("content-type", "").startswith("text/event-stream"):
        errors = [e["error"] for e in sse_events(result.text())
                  if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1, result.text()
        return errors[0]  # type: ignore[no-any-return]
    body = result.json()
    assert "error" in body, body
    return body["error"]  # type: ignore[no-any-return]


async def test_capacity_says_wait_or_give_the_lane_room_never_check_the_connection(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    running = start(nursery, relay_, chat("one/echo?delay_s=1000"))
    await trio.testing.wait_all_tasks_blocked()
    waiting = start(nursery, relay_, chat("one/echo"))
    await trio.testing.wait_all_tasks_blocked()
    full = start(nursery, relay_, chat("one/echo"))
    await full.done.wait()
    assert full.status == 429
    action = assert_fits(error_of(full), "provider_queue_full",
                         says="[providers.one.profile]")
    assert "queue_max (now 1)" in action and "lanes (now 1)" in action
    await waiting.done.wait()          # ten seconds in the queue, behind the running one
    assert waiting.status == 429
    action = assert_fits(error_of(waiting), "provider_queue_timeout")
    assert "queue_timeout_s (now 10 s)" in action
    running.disconnect.set()


@pytest.mark.parametrize(("model", "stream", "reason", "says"), [
    ("one/echo?delay_s=1000", False, "run_timeout", "over 50 s, raise run_timeout_s in "
                                                   "[providers.one.profile]"),
    ("r", False, "attempt_timeout", "primary_timeout_s (now 5 s) in [routes.r]"),
    ("budget", False, "budget_exhausted", "budget_s (now 3 s) in [routes.budget]"),
    ("first", True, "first_token_timeout", "first_token_timeout_s (now 2 s) in [routes.first]"),
    ("stall", True, "stall_timeout", "stall_timeout_s (now 2 s) in [routes.stall]"),
])
async def test_a_timeout_names_the_limit_that_fired_and_where_it_is_set(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock, model: str,
        stream: bool, reason: str, says: str) -> None:
    result = start(nursery, relay_, chat(model, stream=stream))
    await result.done.wait()
    assert_fits(error_of(result), reason, says=says)


@pytest.mark.parametrize(("model", "says"), [
    ("nope/x", "'nope' is no provider here: use one of one, two"),
    ("one/zzz", "use one of one's models (echo), or add 'zzz' to models in [providers.one]"),
    ("zzz", "GET /v1/models"),
    ("echo", "name the provider: one of one/echo, two/echo"),
])
async def test_an_unknown_model_says_which_names_exist(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock, model: str,
        says: str) -> None:
    result = start(nursery, relay_, chat(model))
    await result.done.wait()
    assert result.status == 404
    assert_fits(error_of(result), "unknown_model", says=says)


async def test_an_unknown_fallback_in_the_body_says_how_to_name_one(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    result = start(nursery, relay_, chat("one/echo", fallbacks=["nope/x"]))
    await result.done.wait()
    assert result.status == 404
    assert_fits(error_of(result), "unknown_model", says="'fallbacks'")


# --- real upstreams on loopback ---------------------------------------------------------

def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def post(served: relay.Served, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
        return await client.post(served.url + "/v1/chat/completions", json=body)


async def serve(nursery: trio.Nursery, text: str, tmp_path: Path) -> relay.Served:
    config = config_from(text, tmp_path)
    served: relay.Served = await nursery.start(functools.partial(relay.serve, config, port=0))
    return served


async def test_nothing_listening_says_what_to_start(nursery: trio.Nursery,
                                                    tmp_path: Path) -> None:
    port, lm_port = closed_port(), closed_port()
    served = await serve(nursery, f"""
        [providers.dead]
        adapter = "openai"
        base_url = "http://127.0.0.1:{port}/v1"
        models = ["m"]
        [providers.dead.profile]
        lanes = 1
        queue_max = 1
        queue_timeout_s = 10
        run_timeout_s = 30
        [providers.lm]
        adapter = "openai"
        preset = "lmstudio"
        base_url = "http://127.0.0.1:{lm_port}/v1"
        models = ["m"]
    """, tmp_path)
    r = await post(served, chat("dead/m"))
    assert r.status_code == 502
    error = r.json()["error"]
    assert f"nothing listens on 127.0.0.1:{port}" in error["message"]
    assert_fits(error, "upstream_unavailable", says=f"start the provider's server at "
                f"127.0.0.1:{port}, or fix base_url in [providers.dead]")
    r = await post(served, chat("lm/m"))
    error = r.json()["error"]
    assert (f"nothing listens on 127.0.0.1:{lm_port} — start LM Studio's server, or remove "
            "[providers.lm]") in error["message"]
    assert_fits(error, "upstream_unavailable",
                says="start LM Studio's server, or remove [providers.lm] from the config")


async def test_a_dropped_connection_and_a_401_say_what_to_do(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        monkeypatch: pytest.MonkeyPatch) -> None:
    upstream.scripts["drop"] = Script(cut_after=0)
    upstream.scripts["denied"] = Script(status=401)
    monkeypatch.setenv("UP_KEY", "sk-test-not-a-real-key")
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    served = await serve(nursery, f"""
        [providers.up]
        adapter = "openai"
        base_url = "{upstream.url}"
        api_key_env = "UP_KEY"
        models = ["drop", "denied"]
        [providers.up.profile]
        lanes = 2
        queue_max = 2
        queue_timeout_s = 10
        run_timeout_s = 30
        [providers.nokey]
        adapter = "openai"
        preset = "openai"
        base_url = "{upstream.url}"
        api_key_env = "NO_SUCH_KEY_VAR"
        models = ["m1"]
    """, tmp_path)
    r = await post(served, chat("up/drop"))
    assert_fits(r.json()["error"], "upstream_unavailable", says="retry")
    r = await post(served, chat("up/denied"))
    assert_fits(r.json()["error"], "auth_required", says="UP_KEY")
    r = await post(served, chat("nokey/m1"))
    assert_fits(r.json()["error"], "auth_required",
                says="set the environment variable NO_SUCH_KEY_VAR")


async def test_a_cli_tool_missing_or_dying_says_how_to_fix_it(nursery: trio.Nursery,
                                                              tmp_path: Path) -> None:
    served = await serve(nursery, """
        [providers.gone]
        adapter = "claude-cli"
        command = "/nonexistent/claude"
        [providers.dies]
        adapter = "claude-cli"
        command = "false"
    """, tmp_path)
    r = await post(served, chat("gone/default"))
    assert_fits(r.json()["error"], "upstream_unavailable", says="install")
    r = await post(served, chat("dies/default"))
    assert_fits(r.json()["error"], "upstream_unavailable", says="run `false` in a terminal")


# --- at the source: what loopback cannot stage ------------------------------------------

def _connect_error(cause: BaseException) -> httpx.ConnectError:
    request = httpx.Request("POST", "https://api.example.test:8443/v1/chat/completions")
    exc = httpx.ConnectError(str(cause), request=request)
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(("exc", "said", "does"), [
    (_connect_error(socket.gaierror(-2, "Name or service not known")),
     "the host name api.example.test could not be resolved", "DNS"),
    (_connect_error(ConnectionRefusedError(111, "Connection refused")),
     "nothing listens on api.example.test:8443", "nothing between this machine and it"),
    (_connect_error(OSError(113, "No route to host")),
     "no connection to api.example.test:8443 could be made", "firewall"),
    (httpx.ConnectTimeout("timed out", request=httpx.Request("GET", "http://10.9.9.9:80/")),
     "10.9.9.9:80 did not accept a connection in time", "VPN"),
    (httpx.ProxyError("bad gateway", request=httpx.Request("GET", "http://a.test/")),
     "through its proxy", "proxy"),
])
def test_a_failed_connect_says_why_and_what_to_check(exc: Exception, said: str,
                                                     does: str) -> None:
    with pytest.raises(RelayError) as info, transport_errors("up", "request"):
        raise exc
    error = info.value.body()["error"]
    assert said in error["message"], error
    assert_fits(error, "upstream_unavailable", says=does)


@pytest.mark.parametrize("cls", _httpx_exception_classes(), ids=lambda c: c.__name__)
def test_every_httpx_failure_that_is_unavailable_has_an_action(
        cls: type[BaseException]) -> None:
    exc = _instance(cls)
    with pytest.raises(RelayError) as info, transport_errors("up", "answer"):
        raise exc
    if info.value.reason == "upstream_unavailable":
        assert_fits(info.value.body()["error"], "upstream_unavailable")


def test_the_list_is_every_capacity_timeout_auth_unreachable_and_unknown_model_reason(
        ) -> None:
    """The reasons walked above are the whole list of issue 15, and each also has a
    fallback action for a place that has nothing more specific to say (never "check the
    connection" for capacity)."""
    listed = {r for r, spec in REASONS.items() if spec.phase in ("capacity", "timeout")}
    listed |= {"upstream_unavailable", "auth_required", "unknown_model"}
    assert set(ACTION_FITS) == listed
    assert set(DEFAULT_ACTIONS) == listed
    for reason in listed:
        action = RelayError(reason, "said", provider="p").action
        assert action and "{" not in action, (reason, action)
        assert "connection" not in action or REASONS[reason].phase != "capacity"


async def test_a_provider_removed_by_a_reload_says_to_use_another(relay_: Relay) -> None:
    # The plan was made before the reload; the attempt finds its adapter closed.
    handle = relay_.providers["one"].handle
    handle.retire()
    with pytest.raises(RelayError) as info, handle.use():
        pass
    assert_fits(info.value.body()["error"], "unknown_model",
                says="a provider that is still configured")
