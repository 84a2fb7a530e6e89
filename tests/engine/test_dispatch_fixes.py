"""The dispatcher's own bookkeeping: what it counts must have happened (SPEC F4, F8, A2, A5).

Each test here is a regression test for one bug in `relay.dispatch`: text counted as sent
to the client before it was, a provider's Retry-After slept outside every bound, queue
waits missing from the record and ``/metrics``, a lane notice dropped on a full channel,
a stall blamed on the provider while relay was waiting for a slow client, a finished
stream "rescued" after its finish had gone out, and an attempt recorded before it began.

The first group runs the assembled relay's ASGI app on virtual time with a client that
stops reading for a while (so the request's event channel fills up, as it does behind a
slow reader); the second goes through real sockets.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fakes.fake_http import Exchange, FakeServer, serve_fake
from fakes.upstream import FakeUpstream, Script, error_body
from helpers.assembled import (
    ASGIResult,
    asgi_request,
    chat,
    config_from,
    records,
    sse_events,
    wait_for,
)
from helpers.metrics import scrape, value

import relay
from relay import Relay, open_relay

FAKES = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 4
queue_max = 8
queue_timeout_s = 100
run_timeout_s = 500
[providers.other]
adapter = "fake"
models = ["echo"]
[providers.other.profile]
lanes = 1
queue_max = 8
queue_timeout_s = 100
run_timeout_s = 500
[providers.tight]
adapter = "fake"
models = ["echo"]
[providers.tight.profile]
lanes = 4
queue_max = 8
queue_timeout_s = 1
run_timeout_s = 500
"""

Send = Callable[[dict[str, Any]], Awaitable[None]]


def route(name: str, primary: str, fallbacks: list[str], **keys: Any) -> str:
    lines = [f"[routes.{name}]", f'primary = "{primary}"',
             "fallbacks = [" + ", ".join(f'"{f}"' for f in fallbacks) + "]"]
    lines += [f"{k} = {v}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def pieces(n: int, start: int = 0) -> str:
    """The fake's ``chunks=N`` answer (or its tail from piece ``start``)."""
    return "".join(f"t{i} " for i in range(start, n))


class SlowReader:
    """A client that takes the first ``take`` body writes at once, then reads nothing
    until ``resume`` is set (like a reader whose socket buffer is full)."""

    def __init__(self, take: int) -> None:
        self.take = take
        self.taken = 0
        self.resume = trio.Event()

    def wrap(self, app: Any) -> Any:
        async def gated_app(scope: dict[str, Any], receive: Any, send: Send) -> None:
            async def gated_send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body":
                    if self.taken >= self.take:
                        await self.resume.wait()
                    self.taken += 1
                await send(message)
            await app(scope, receive, gated_send)
        return gated_app


def content_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def finishes(events: list[Any]) -> int:
    return sum(1 for e in events if isinstance(e, dict) and e.get("choices")
               and e["choices"][0].get("finish_reason"))


def chat_models(requests: list[Any]) -> list[str]:
    """The models of the chat requests an upstream saw (not model discovery)."""
    return [q.json["model"] for q in requests if q.path.startswith("/v1/chat/completions")]


def started(r: Relay, name: str) -> int:
    """How many calls provider ``name`` (a fake) has begun."""
    adapter: Any = r.providers[name].adapter
    return int(adapter.started)


def attempts(r: Relay) -> list[tuple[str, str, bool, str | None]]:
    return [(a["provider"], a["role"], a["ok"], a["failure"])
            for a in r.records.recent[-1]["attempts"]]


@pytest.fixture
def make(tmp_path: Path) -> Any:
    def build(extra: str) -> Any:
        return open_relay(config_from(FAKES + extra, tmp_path), discover=False)
    return build


async def slow_stream(r: Relay, model: str, reader: SlowReader, *, resume_at: float,
                      before: Callable[[], Awaitable[None]] | None = None) -> ASGIResult:
    """Stream ``model`` to a client that stalls after its first write and reads again
    at ``resume_at`` (virtual seconds from now)."""
    res = ASGIResult()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        if before is not None:
            await before()
        nursery.start_soon(asgi_request, reader.wrap(r.app), "/v1/chat/completions",
                           chat(model, stream=True), res)
        await trio.sleep_until(t0 + resume_at)
        reader.resume.set()
    return res


# --- 1. the prefill holds exactly the text the client got -----------------------------------

async def test_a_prefill_continues_after_the_last_piece_the_client_got(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    # The client stops reading at once, so the channel fills and the primary's adapter
    # blocks handing over a piece; its 2 s timeout cancels that hand-over. That piece never
    # reached the client, so the fallback must continue from just before it: one answer,
    # no hole (seen before the fix: 399 of 400 pieces, and [DONE]).
    extra = route("r", "fake/echo?chunks=400&chunk_delay_s=0.01", ["other/echo?chunks=400"],
                  primary_timeout_s=2, fallback_timeout_s=60)
    async with make(extra) as r:
        res = await slow_stream(r, "r", SlowReader(take=1), resume_at=3)
        events = sse_events(res.text())
        assert events[-1] == "[DONE]"
        assert content_of(events) == pieces(400)
        assert finishes(events) == 1
        assert attempts(r) == [("fake", "primary", False, "attempt_timeout"),
                               ("other", "fallback", True, None)]


# --- a stall is the provider's silence, not relay waiting for a slow client ----------------

async def test_a_slow_reader_is_not_a_stalled_provider(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    # The provider sends a piece every 10 ms; the client reads nothing for 3 s (within
    # write_timeout_s, so it is waited for, SPEC C3). While relay waits for the client the
    # adapter cannot read its upstream: the 1 s stall limit must not fire then.
    extra = route("st", "fake/echo?chunks=200&chunk_delay_s=0.01", ["other/echo"],
                  stall_timeout_s=1)
    async with make(extra) as r:
        res = await slow_stream(r, "st", SlowReader(take=1), resume_at=3)
        events = sse_events(res.text())
        assert events[-1] == "[DONE]" and content_of(events) == pieces(200)
        assert attempts(r) == [("fake", "primary", True, None)]
        assert started(r, "other") == 0


async def test_the_stall_limit_still_fires_on_a_silent_provider(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    extra = route("st", "fake/echo?chunks=5&chunk_delay_s=50", ["other/echo?chunks=5"],
                  stall_timeout_s=10)
    async with make(extra) as r:
        t0 = trio.current_time()
        res = await slow_stream(r, "st", SlowReader(take=99), resume_at=0)
        assert trio.current_time() - t0 == pytest.approx(10)
        events = sse_events(res.text())
        assert events[-1] == "[DONE]" and content_of(events) == pieces(5)
        assert attempts(r) == [("fake", "primary", False, "stall_timeout"),
                               ("other", "fallback", True, None)]


# --- 4. lane notices: never dropped on a full channel ---------------------------------------
# These place events in the request's channel exactly: they assume its size is 64
# (CHANNEL_SIZE in the front). The writer takes piece 0, blocks writing piece 1, so a
# primary that fails after N pieces leaves N - 2 events behind.

async def occupy(r: Relay, nursery: trio.Nursery, provider: str, model: str) -> None:
    """Hold ``provider``'s only lane with a plain request for ``model``."""
    nursery.start_soon(asgi_request, r.app, "/v1/chat/completions", chat(model), ASGIResult())
    lane = r.providers[provider].lane
    await wait_for(lambda: lane.statistics().running == 1)


def waiting_notices(res: ASGIResult) -> list[float]:
    return [t for t, piece in res.pieces for _ in re.finditer(rb": waiting", piece)]


async def test_waiting_notices_stop_when_the_fallback_starts(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    # The primary fills the channel to 62 behind a client that stopped reading, then
    # fails; the fallback's announcement and its "queued" notice take the last two places.
    # When the fallback gets its lane (t=1) the channel is still full: the "started"
    # notice must not be dropped, or the writer sends waiting notices between the
    # fallback's tokens for the rest of the answer.
    extra = route("w", "fake/echo?chunks=100&chunk_delay_s=0.01&fail=upstream_error"
                  "&fail_after=64", ["other/echo?chunks=100&chunk_delay_s=0.5"])
    async with make(extra) as r, trio.open_nursery() as nursery:
        res = await slow_stream(r, "w", SlowReader(take=1), resume_at=3,
                                before=lambda: occupy(r, nursery, "other",
                                                      "other/echo?delay_s=1"))
        events = sse_events(res.text())
        assert events[-1] == "[DONE]" and content_of(events) == pieces(100)
        first_fallback_token = next(t for t, piece in res.pieces if b'"t64 "' in piece)
        assert [t for t in waiting_notices(res) if t >= first_fallback_token] == []
        assert attempts(r) == [("fake", "primary", False, "upstream_error"),
                               ("other", "fallback", True, None)]


async def test_a_queued_notice_that_finds_the_channel_full_is_sent_once_there_is_room(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    # As above, but the primary leaves 63 events behind, so the fallback's announcement
    # fills the channel and its "queued" notice finds no room. The fallback then waits
    # 30 s for its lane: the client must get a waiting notice every 2 s of it (SPEC A2),
    # not only keep-alives.
    extra = route("w", "fake/echo?chunks=100&chunk_delay_s=0.01&fail=upstream_error"
                  "&fail_after=65", ["other/echo?chunks=100"])
    async with make(extra) as r, trio.open_nursery() as nursery:
        t0 = trio.current_time()
        res = await slow_stream(r, "w", SlowReader(take=1), resume_at=3,
                                before=lambda: occupy(r, nursery, "other",
                                                      "other/echo?delay_s=30"))
        events = sse_events(res.text())
        assert events[-1] == "[DONE]" and content_of(events) == pieces(100)
        notices = [t - t0 for t in waiting_notices(res)]
        assert notices, "no waiting notice while the fallback waited 27 s for its lane"
        assert notices[0] == pytest.approx(3)   # as soon as the client reads again
        assert notices[-1] >= 28
        assert all(b - a <= 2.0 + 1e-6 for a, b in itertools.pairwise(notices))


# --- an attempt is recorded once it has begun -------------------------------------------------

async def test_a_client_gone_before_the_fallback_began_leaves_no_fallback_attempt(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    # The primary fills the channel completely and fails; the dispatcher waits to tell
    # the writer a fallback begins; the client leaves then. The fallback never began, so
    # the record must not list it (nor call it a fallback, nor name its provider).
    extra = route("g", "fake/echo?chunks=100&chunk_delay_s=0.01&fail=upstream_error"
                  "&fail_after=66", ["other/echo?chunks=100"])
    async with make(extra) as r:
        res = ASGIResult()
        reader = SlowReader(take=1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(asgi_request, reader.wrap(r.app), "/v1/chat/completions",
                               chat("g", stream=True), res)
            await trio.sleep(2)
            res.disconnect.set()
        rec = r.records.recent[-1]
        assert rec["status"] == 499
        assert attempts(r) == [("fake", "primary", False, "upstream_error")]
        assert rec["fallback_triggered"] is False and rec["provider"] == "fake"
        assert started(r, "other") == 0


# --- a streamed answer whose finish reached the client is complete -----------------------------

class FinishThenStall(FakeServer):
    """An OpenAI-compatible fake: model ``p`` sends its text and its finish chunk, then
    stalls before the usage chunk and ``[DONE]``; model ``f`` answers at once."""

    async def respond(self, exchange: Exchange) -> None:
        if exchange.path != "/v1/chat/completions":  # model discovery
            await exchange.send_json(200, {"object": "list", "data": []})
            return
        body = exchange.json or {}
        model = body.get("model")
        await exchange.start_sse()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return ("data: " + json.dumps({
                "id": "c", "object": "chat.completion.chunk", "created": 1, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
                + "\n\n").encode()

        await exchange.send_raw(chunk({"role": "assistant", "content": f"from {model}"}))
        await exchange.send_raw(chunk({}, "stop"))
        if model == "p":
            await trio.sleep(30)
        await exchange.send_raw(b"data: [DONE]\n\n")
        await exchange.end()


async def test_a_stall_after_the_finish_reached_the_client_ends_the_answer_cleanly(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    fake: FinishThenStall = await nursery.start(serve_fake, FinishThenStall)
    config = config_from(f"""
[server]
records = "records.jsonl"
[providers.a]
adapter = "openai"
base_url = "{fake.base_url}/v1"
prefill = true
[providers.a.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[routes.r]
primary = "a/p"
fallbacks = ["a/f"]
stall_timeout_s = 0.5
""", tmp_path)
    served: relay.Served = await nursery.start(functools.partial(relay.serve, config, port=0))
    with trio.fail_after(10):
        r = await client.post(f"{served.url}/v1/chat/completions",
                              json=chat("r", stream=True))
    events = sse_events(r.text)
    # The client has the whole answer and its finish: it ends there, never continued by
    # the fallback (text after a finish) and never with an error after a finish.
    assert events[-1] == "[DONE]", events
    assert content_of(events) == "from p" and finishes(events) == 1
    assert chat_models(fake.requests) == ["p"]
    await wait_for(lambda: len(records(tmp_path)) == 1)
    rec = records(tmp_path)[0]
    assert rec["status"] == 200 and rec["reason"] is None
    assert [(a["ok"], a["failure"]) for a in rec["attempts"]] == [(True, None)]


# --- 2. a Retry-After that does not fit is not slept --------------------------------------------

async def test_a_retry_after_longer_than_the_providers_queue_timeout_is_not_slept(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    # The fake asks to be retried after 2 s; the provider's profile allows 1 s of waiting
    # and the route sets no timeouts: the wait does not fit, so no retry.
    extra = (route("alone", "tight/echo?fail=rate_limited", [], retries=2)
             + route("fb", "tight/echo?fail=rate_limited", ["fake/echo?reply=fb"], retries=2)
             + route("fits", "fake/echo?fail=rate_limited", [], retries=1))
    async with make(extra) as r:
        t0 = trio.current_time()
        res = ASGIResult()
        await asgi_request(r.app, "/v1/chat/completions", chat("alone"), res)
        assert trio.current_time() == t0
        assert res.status == 429 and res.json()["error"]["code"] == "rate_limited"
        assert res.headers["retry-after"] == "2"
        assert started(r, "tight") == 1

        res = ASGIResult()
        await asgi_request(r.app, "/v1/chat/completions", chat("fb"), res)
        assert trio.current_time() == t0
        assert res.json()["choices"][0]["message"]["content"] == "fb"
        assert started(r, "tight") == 2

        # Where the profile allows the wait (fake: 100 s), it is slept and retried.
        res = ASGIResult()
        await asgi_request(r.app, "/v1/chat/completions", chat("fits"), res)
        assert trio.current_time() - t0 == pytest.approx(2)
        assert started(r, "fake") == 3


RETRY = """
[server]
records = "records.jsonl"
[providers.a]
adapter = "openai"
base_url = "{url}"
[providers.a.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
[routes.r]
primary = "a/p"
retries = 1
[providers.b]
adapter = "openai"
base_url = "{url}"
[providers.b.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
[routes.rf]
primary = "a/p"
fallbacks = ["b/f"]
retries = 1
"""


async def test_a_day_long_retry_after_is_passed_on_not_slept(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    config = config_from(RETRY.format(url=upstream.url), tmp_path)
    served: relay.Served = await nursery.start(functools.partial(relay.serve, config, port=0))
    upstream.scripts["p"] = Script(status=429, headers={"retry-after": "86400"},
                                   error_body=error_body(429, "come back tomorrow"))
    upstream.scripts["f"] = Script(chunks=["from f"])
    with trio.fail_after(10):   # before the fix: a day's sleep
        r = await client.post(f"{served.url}/v1/chat/completions", json=chat("r"))
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limited"
    # (SPEC L12a: a 429's hold lasts at most max_hold_s, 900 s by default, and so does
    # the Retry-After relay gives: relay asks the provider again after it.)
    assert r.headers["retry-after"] == "900"
    assert "come back tomorrow" in r.json()["error"]["message"]
    with trio.fail_after(10):   # with a fallback: it is tried at once
        r = await client.post(f"{served.url}/v1/chat/completions", json=chat("rf"))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "from f"
    # The day-long 429 holds provider a (SPEC L12): the route's primary is not sent again,
    # and the fallback on another provider answers at once.
    assert chat_models(upstream.requests) == ["p", "f"]


# --- 3. queue time is recorded however the wait ended -------------------------------------------

QUEUES = """
[server]
records = "records.jsonl"
[providers.one]
adapter = "fake"
models = ["echo"]
[providers.one.profile]
lanes = 1
queue_max = 4
queue_timeout_s = {queue_timeout}
run_timeout_s = 60
"""


async def test_queue_timeouts_and_clients_gone_while_queued_have_their_queue_time(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    config = config_from(QUEUES.format(queue_timeout=0.3), tmp_path)
    served: relay.Served = await nursery.start(functools.partial(relay.serve, config, port=0))
    url = f"{served.url}/v1/chat/completions"
    lane = served.relay.providers["one"].lane
    async with trio.open_nursery() as holders:
        holders.start_soon(functools.partial(client.post, url, json=chat("one/echo?delay_s=30")))
        await wait_for(lambda: lane.statistics().running == 1)
        r = await client.post(url, json=chat("one/echo"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "provider_queue_timeout"
        await wait_for(lambda: len(records(tmp_path)) == 1)
        timed_out = records(tmp_path)[0]
        assert timed_out["reason"] == "provider_queue_timeout"
        assert timed_out["queue_ms"] is not None and 300 <= timed_out["queue_ms"] < 2000

        # A client that leaves while queued: its record has the time it waited. (A
        # reload raises the queue timeout so this one waits until it leaves.)
        await served.relay.reload(config_from(QUEUES.format(queue_timeout=60), tmp_path))
        async with trio.open_nursery() as leaver:
            leaver.start_soon(functools.partial(client.post, url, json=chat("one/echo")))
            await wait_for(lambda: lane.statistics().queued == 1)
            await trio.sleep(0.2)   # how long it waits: the record must show it
            leaver.cancel_scope.cancel()
        await wait_for(lambda: len(records(tmp_path)) == 2)
        gone = records(tmp_path)[1]
        assert gone["status"] == 499 and gone["reason"] == "client_disconnected"
        assert gone["queue_ms"] is not None and 200 <= gone["queue_ms"] < 2000
        samples = await scrape(client, served.url)
        holders.cancel_scope.cancel()
    # /metrics counts both waits in the queue histogram, with their seconds.
    assert value(samples, "relay_queue_seconds_count", provider="one") == 2
    total = value(samples, "relay_queue_seconds_sum", provider="one")
    assert total == pytest.approx((timed_out["queue_ms"] + gone["queue_ms"]) / 1000)
    assert value(samples, "relay_queue_seconds_bucket", provider="one", le="0.1") == 0
