"""Provider state from real traffic (SPEC H5), the requests in flight in the status
(issue 15, item 9) and the model of refused requests in the records (item 8), through the
assembled relay.

Real traffic keeps the state honest: an answered request makes a provider `connected`
and clears its warning; a quota notice or a rate limit makes it `connected` with a
warning; a real cause (auth, unreachable) makes it `failing` with that reason; 5xx,
timeouts, capacity, client stops and refusals of one request's content change nothing.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fakes.upstream import FakeUpstream, Script, error_body
from helpers.assembled import (
    ASGIResult,
    asgi_request,
    chat,
    config_from,
    records,
    start_relay,
    wait_for,
)

from relay import open_relay

FAKE = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 100
run_timeout_s = 20
"""


async def ask(app: Any, model: str, **extra: Any) -> ASGIResult:
    result = ASGIResult()
    await asgi_request(app, "/v1/chat/completions", chat(model, **extra), result)
    return result


async def status(app: Any) -> dict[str, Any]:
    result = ASGIResult()
    await asgi_request(app, "/relay/v1/status", b"", result, method="GET")
    assert result.status == 200, result.text()
    providers: dict[str, Any] = result.json()["providers"]
    return providers


async def test_a_hundred_answered_requests_make_a_provider_connected(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    async with open_relay(config_from(FAKE, tmp_path), discover=False) as r:
        assert (await status(r.app))["fake"]["state"] == "unverified"
        for n in range(100):
            assert (await ask(r.app, "fake/echo", content=f"hi {n}")).status == 200
        fake = (await status(r.app))["fake"]
        assert fake["state"] == "connected" and fake["state_reason"] is None
        assert fake["checked_at"] is None and fake["seen_at"] is not None  # never checked


@pytest.mark.parametrize(("fail", "state", "reason"), [
    ("quota_exhausted", "connected", None),            # with a warning (H3)
    ("rate_limited", "connected", None),
    ("auth_required", "failing", "auth_required"),
    ("upstream_unavailable", "failing", "upstream_unavailable"),
])
async def test_what_a_real_requests_failure_does_to_the_state(
        tmp_path: Path, autojump_clock: trio.abc.Clock, fail: str, state: str,
        reason: str | None) -> None:
    async with open_relay(config_from(FAKE, tmp_path), discover=False) as r:
        failed = await ask(r.app, f"fake/echo?fail={fail}")
        assert failed.json()["error"]["code"] == fail
        fake = (await status(r.app))["fake"]
        assert (fake["state"], fake["state_reason"]) == (state, reason)
        assert f"told to fail with {fail!r}" in fake["warning"]
        assert fake["checked_at"] is None and fake["seen_at"] is not None
        # The next answered request makes it connected and clears the warning.
        assert (await ask(r.app, "fake/echo")).status == 200
        fake = (await status(r.app))["fake"]
        assert (fake["state"], fake["state_reason"], fake["warning"]) == (
            "connected", None, None)


@pytest.mark.parametrize("fail", [
    "upstream_error", "bad_upstream_response", "stream_cut",  # a 5xx, a broken answer
    "run_timeout", "first_token_timeout",                     # slow is not broken
    "rejected", "context_too_long", "unsupported", "invalid_request",  # this request's
    "unknown_model", "internal_error",
])
async def test_what_changes_nothing(tmp_path: Path, autojump_clock: trio.abc.Clock,
                                    fail: str) -> None:
    async with open_relay(config_from(FAKE, tmp_path), discover=False) as r:
        assert (await ask(r.app, "fake/echo?fail=rate_limited")).status == 429
        before = (await status(r.app))["fake"]
        assert before["state"] == "connected" and before["warning"]
        await trio.sleep(5)
        failed = await ask(r.app, f"fake/echo?fail={fail}")
        assert failed.json()["error"]["code"] == fail
        after = (await status(r.app))["fake"]
        for key in ("state", "state_reason", "warning", "seen_at", "checked_at"):
            assert after[key] == before[key], key


async def test_capacity_timeouts_and_client_stops_change_nothing(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    text = FAKE.replace("queue_max = 4", "queue_max = 1").replace(
        "queue_timeout_s = 100", "queue_timeout_s = 10")
    text += """
[routes.quick]
primary = "fake/echo?delay_s=30"
primary_timeout_s = 2
"""
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        provider = r.providers["fake"]
        provider.state, provider.state_reason = "failing", "upstream_unavailable"
        provider.warning = "nothing listens"
        before = (await status(r.app))["fake"]
        async with trio.open_nursery() as nursery:
            held, waiting = ASGIResult(), ASGIResult()
            nursery.start_soon(asgi_request, r.app, "/v1/chat/completions",
                               chat("fake/echo?delay_s=60"), held)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(asgi_request, r.app, "/v1/chat/completions",
                               chat("fake/echo"), waiting)
            await trio.testing.wait_all_tasks_blocked()
            full = await ask(r.app, "fake/echo")                 # capacity: queue full
            assert full.json()["error"]["code"] == "provider_queue_full"
            await waiting.done.wait()                            # capacity: queue timeout
            assert waiting.json()["error"]["code"] == "provider_queue_timeout"
            held.disconnect.set()                                # a client stop
            await held.done.wait()
        assert (await ask(r.app, "quick")).json()["error"]["code"] == "attempt_timeout"
        after = (await status(r.app))["fake"]
        for key in ("state", "state_reason", "warning", "seen_at"):
            assert after[key] == before[key], key
        assert [rec["reason"] for rec in r.records.recent] == [
            "provider_queue_full", "provider_queue_timeout", "client_disconnected",
            "attempt_timeout"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once it is closed


async def test_unreachable_and_logged_out_providers_read_failing_over_the_wire(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(status=401, error_body=error_body(401, "bad key"))
    text = f"""
[server]
records = "records.jsonl"
[providers.gone]
adapter = "openai"
base_url = "http://127.0.0.1:{closed_port()}/v1"
models = ["m"]
[providers.gone.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[providers.keyless]
adapter = "openai"
base_url = "{upstream.url}"
models = ["m1", "m2"]
[providers.keyless.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[providers.fallback]
adapter = "fake"
models = ["echo"]
[routes.saved]
primary = "gone/m"
fallbacks = ["fallback/echo"]
"""
    served = await start_relay(nursery, text, tmp_path)
    url = served.url
    r = await client.post(f"{url}/v1/chat/completions", json=chat("gone/m"))
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
    r = await client.post(f"{url}/v1/chat/completions", json=chat("keyless/m1"))
    assert r.status_code == 502 and r.json()["error"]["code"] == "auth_required"
    # A fallback that answers: its provider is connected, the primary's failure stays.
    r = await client.post(f"{url}/v1/chat/completions", json=chat("saved"))
    assert r.status_code == 200, r.text
    providers = (await client.get(f"{url}/relay/v1/status")).json()["providers"]
    gone, keyless = providers["gone"], providers["keyless"]
    assert (gone["state"], gone["state_reason"]) == ("failing", "upstream_unavailable")
    assert "could not be reached" in gone["warning"]
    assert (keyless["state"], keyless["state_reason"]) == ("failing", "auth_required")
    assert providers["fallback"]["state"] == "connected"
    # The same upstream answering again (a new key, say) makes it connected.
    upstream.scripts["m2"] = Script()
    r = await client.post(f"{url}/v1/chat/completions", json=chat("keyless/m2"))
    assert r.status_code == 200
    keyless = (await client.get(f"{url}/relay/v1/status")).json()["providers"]["keyless"]
    assert (keyless["state"], keyless["state_reason"], keyless["warning"]) == (
        "connected", None, None)


SLOW = """
[server]
records = "records.jsonl"
[providers.slow]
adapter = "fake"
models = ["echo"]
[providers.slow.profile]
lanes = 1
queue_max = 8
queue_timeout_s = 120
run_timeout_s = 120
[routes.story]
primary = "slow/echo?delay_s=60"
"""


async def hold(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               priority: str) -> None:
    await client.post(url, json=body, headers={"X-Relay-Priority": priority})


async def test_the_status_lists_each_providers_requests_in_flight(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, SLOW, tmp_path)
    url, lane = served.url, served.relay.providers["slow"].lane
    async with trio.open_nursery() as holders:
        for n, (model, priority) in enumerate([
                ("story", "normal"), ("slow/echo?delay_s=60", "background"),
                ("slow/echo?delay_s=61", "normal"), ("slow/echo?delay_s=62", "interactive")]):
            holders.start_soon(hold, client, f"{url}/v1/chat/completions", chat(model),
                               priority)
            await wait_for(lambda n=n: lane.statistics().running
                           + lane.statistics().queued == n + 1)
        await trio.sleep(0.3)
        listed = (await client.get(f"{url}/relay/v1/status")).json()[
            "providers"]["slow"]["requests"]
        # Running first, then the queue in its order: interactive, normal, background.
        assert [(q["state"], q["priority"], q["model"]) for q in listed] == [
            ("running", "normal", "echo?delay_s=60"),
            ("queued", "interactive", "echo?delay_s=62"),
            ("queued", "normal", "echo?delay_s=61"),
            ("queued", "background", "echo?delay_s=60")]
        assert listed[0]["route"] == "story" and listed[1]["route"] is None
        running, last = listed[0], listed[-1]
        assert running["running_s"] >= 0.3 and running["queued_s"] < 0.1
        assert last["running_s"] is None and last["queued_s"] >= 0.3
        assert all(q["since"].endswith("Z") for q in listed)
        holders.cancel_scope.cancel()
    await wait_for(lambda: len(records(tmp_path)) == 4)
    # The ids are the requests' own; once they have left, nothing is listed.
    assert {q["id"] for q in listed} == {rec["id"] for rec in records(tmp_path)}
    await wait_for(lambda: lane.statistics().running + lane.statistics().queued == 0)
    status = (await client.get(f"{url}/relay/v1/status")).json()
    assert status["providers"]["slow"]["requests"] == []
    # They left while queued: their queue time is in their records all the same.
    queued = [rec for rec in records(tmp_path) if rec["run_ms"] is None]
    assert len(queued) == 3 and all(rec["queue_ms"] >= 300 for rec in queued)


async def test_refused_requests_keep_the_model_they_asked_for(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, SLOW, tmp_path)
    url = served.url
    r = await client.post(f"{url}/v1/chat/completions", json=chat("nope/x"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model"
    r = await client.post(f"{url}/v1/messages", json={
        "model": "claude-nothing", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    r = await client.post(f"{url}/v1/chat/completions", json=chat("slow/echo", n=2))
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
    r = await client.post(f"{url}/v1/chat/completions", json=chat("slow/echo"))
    assert r.status_code == 200
    await wait_for(lambda: len(records(tmp_path)) == 4)
    asked = [(rec["requested_model"], rec["reason"], rec["model"])
             for rec in records(tmp_path)]
    assert asked == [("nope/x", "unknown_model", None),
                     ("claude-nothing", "unknown_model", None),
                     ("slow/echo", "unsupported", "echo"),
                     ("slow/echo", None, "echo")]
    recent = (await client.get(f"{url}/relay/v1/requests")).json()["requests"]
    assert recent[-1]["requested_model"] == "nope/x"


async def test_a_fan_out_that_left_while_queued_keeps_its_queue_time(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, SLOW, tmp_path)
    url, lane = served.url, served.relay.providers["slow"].lane
    async with trio.open_nursery() as holders:
        holders.start_soon(hold, client, f"{url}/v1/chat/completions",
                           chat("slow/echo?delay_s=60"), "normal")
        await wait_for(lambda: lane.statistics().running == 1)
        holders.start_soon(lambda: client.post(f"{url}/relay/v1/fanout", json={
            "models": ["slow/echo", "slow/echo?reply=b"],
            "messages": [{"role": "user", "content": "hi"}]}))
        await wait_for(lambda: lane.statistics().queued == 2)
        await trio.sleep(0.5)
        holders.cancel_scope.cancel()
    await wait_for(lambda: len(records(tmp_path)) == 2)
    fanout = next(rec for rec in records(tmp_path) if rec["route"] == "(fanout)")
    assert fanout["status"] == 499 and fanout["run_ms"] is None
    assert fanout["queue_ms"] is not None and fanout["queue_ms"] >= 500, fanout
    assert fanout["requested_model"] == "slow/echo,slow/echo?reply=b"
