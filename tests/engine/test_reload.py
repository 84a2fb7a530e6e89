"""Live reload (SPEC L10): lanes change in place under load; bad files change nothing."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import chat, lane_idle, wait_for, with_upstream
from trio.testing import wait_all_tasks_blocked

import relay

BASE = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = {lanes}
queue_max = 10
queue_timeout_s = 30
run_timeout_s = 60
"""
OTHER = """
[providers.other]
adapter = "fake"
models = ["echo"]
"""


async def start(nursery: trio.Nursery, path: Path) -> relay.Served:
    served: relay.Served = await nursery.start(functools.partial(
        relay.serve, relay.load_config(path), port=0))
    return served


def stats(served: relay.Served, name: str = "fake") -> tuple[int, int, int]:
    s = served.relay.providers[name].lane.statistics()
    return s.running, s.queued, s.capacity


async def reload(client: httpx.AsyncClient, served: relay.Served) -> httpx.Response:
    return await client.post(f"{served.url}/relay/v1/reload")


async def test_lanes_grow_and_shrink_in_place_under_load(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(BASE.format(lanes=1))
    served = await start(nursery, path)
    url = f"{served.url}/v1/chat/completions"
    answers: list[int] = []

    async def call(delay: float) -> None:
        r = await client.post(url, json=chat(f"fake/echo?delay_s={delay}"))
        answers.append(r.status_code)

    for _ in range(3):
        nursery.start_soon(call, 0.6)
    await wait_for(lambda: stats(served) == (1, 2, 1))
    path.write_text(BASE.format(lanes=3))
    r = await reload(client, served)
    assert r.status_code == 200, r.text
    assert any("lanes 1→3" in c for c in r.json()["changes"])
    assert stats(served) == (3, 0, 3)       # the waiting ones started at once, in place
    await wait_for(lambda: len(answers) == 3)

    for _ in range(3):
        nursery.start_soon(call, 0.6)
    await wait_for(lambda: stats(served) == (3, 0, 3))
    path.write_text(BASE.format(lanes=1))
    assert (await reload(client, served)).status_code == 200
    assert stats(served) == (3, 0, 1)       # running work is never revoked
    nursery.start_soon(call, 0.0)
    await wait_for(lambda: stats(served)[1] == 1)   # a new request waits its turn
    await wait_for(lambda: len(answers) == 7)
    assert answers == [200] * 7
    await wait_for(lambda: lane_idle(served))


async def test_an_invalid_file_changes_nothing(nursery: trio.Nursery, tmp_path: Path,
                                               client: httpx.AsyncClient) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(BASE.format(lanes=2))
    served = await start(nursery, path)
    path.write_text(BASE.format(lanes=5).replace("queue_max", "queue_mx"))
    r = await reload(client, served)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and "queue_mx" in err["message"]
    assert stats(served)[2] == 2
    r = await client.post(f"{served.url}/v1/chat/completions", json=chat("fake/echo"))
    assert r.status_code == 200


async def test_providers_come_and_go(nursery: trio.Nursery, tmp_path: Path,
                                     client: httpx.AsyncClient) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(BASE.format(lanes=1) + OTHER)
    served = await start(nursery, path)
    url = f"{served.url}/v1/chat/completions"
    result: dict[str, Any] = {}

    async def long_call() -> None:
        result["r"] = await client.post(url, json=chat("other/echo?delay_s=0.5", "still"))

    nursery.start_soon(long_call)
    other = served.relay.providers["other"]
    await wait_for(lambda: other.lane.statistics().running == 1)
    path.write_text(BASE.format(lanes=1) + OTHER.replace("other", "third"))
    r = await reload(client, served)
    changes = r.json()["changes"]
    assert any("other: removed" in c for c in changes)
    assert any("third: added" in c for c in changes)
    r = await client.post(url, json=chat("other/echo"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model"
    r = await client.post(url, json=chat("third/echo", "new"))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "new"
    await wait_for(lambda: "r" in result)
    assert result["r"].status_code == 200     # the removed provider's request finished
    assert result["r"].json()["choices"][0]["message"]["content"] == "still"
    status = (await client.get(f"{served.url}/relay/v1/status")).json()["providers"]
    assert set(status) == {"fake", "third"}


async def test_a_replaced_adapter_closes_when_its_last_attempt_ends(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    # Found in review: a replaced adapter used to wait for its lane to be idle, which
    # under steady load never happens (old pools and warm processes piled up).
    path = tmp_path / "relay.toml"
    path.write_text(BASE.format(lanes=2))
    served = await start(nursery, path)
    url = f"{served.url}/v1/chat/completions"
    old = served.relay.providers["fake"].handle
    answers: dict[str, str] = {}

    async def call(name: str, model: str) -> None:
        r = await client.post(url, json=chat(model, "old words"))
        answers[name] = r.json()["choices"][0]["message"]["content"]

    nursery.start_soon(call, "a", "fake/echo?delay_s=0.5")
    await wait_for(lambda: stats(served)[0] == 1)
    path.write_text(BASE.format(lanes=3).replace('models = ["echo"]',
                                                 'models = ["echo"]\nreply = "new words"'))
    changes = (await reload(client, served)).json()["changes"]
    assert any("adapter reopened" in c for c in changes)
    assert old.retiring and not old.closed                    # still used by "a"
    nursery.start_soon(call, "b", "fake/echo?delay_s=2")     # keeps the lane busy
    await wait_for(lambda: "a" in answers)
    assert answers["a"] == "old words"                        # finished on the old one
    await wait_for(lambda: old.closed)
    assert stats(served)[0] == 1                              # closed while the lane is busy
    await wait_for(lambda: "b" in answers)
    assert answers["b"] == "new words"


async def test_a_removed_providers_queued_requests_finish_on_its_retiring_adapter(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        upstream: FakeUpstream) -> None:
    # Found in review: a reload removed a provider while requests were queued on it; its
    # adapter (an HTTP pool) was closed when the running attempt ended, then the queued
    # requests were granted and ran on the closed pool (7 of 10 → 500).
    upstream.scripts["slow"] = Script(chunks=["done"], first_byte_delay_s=0.3)
    path = tmp_path / "relay.toml"
    text = with_upstream(upstream, profile="", extra="")
    path.write_text(text)
    served = await start(nursery, path)
    url = f"{served.url}/v1/chat/completions"
    handle = served.relay.providers["up"].handle
    codes: list[int] = []

    async def call() -> None:
        r = await client.post(url, json=chat("up/slow"))
        codes.append(r.status_code)

    for _ in range(4):   # one runs (lanes = 1), three wait (queue_max = 4)
        nursery.start_soon(call)
    await wait_for(lambda: stats(served, "up")[:2] == (1, 3))
    path.write_text(text.split("[providers.up]")[0])
    changes = (await reload(client, served)).json()["changes"]
    assert any("provider up: removed" in c for c in changes)
    assert handle.retiring and not handle.closed
    await wait_for(lambda: len(codes) == 4, limit_s=10)
    assert codes == [200, 200, 200, 200]
    await wait_for(lambda: handle.closed)   # then closed, once nothing is inside
    assert handle.attempts == 0


async def test_a_file_with_no_provider_is_refused_and_changes_nothing(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    # Issue 29: a SIGHUP read the file while a script rewrote it, found it empty (a valid
    # config with no providers), and relay served none until the next good reload.
    path = tmp_path / "relay.toml"
    path.write_text(BASE.format(lanes=2))
    served = await start(nursery, path)
    for text in ("", "[server]\nrecords = 'records.jsonl'\n"):
        path.write_text(text)
        r = await reload(client, served)
        assert r.status_code == 400
        assert "no provider is configured" in r.json()["error"]["message"]
        assert list(served.relay.providers) == ["fake"] and stats(served)[2] == 2


async def test_a_burst_of_signal_reloads_is_two_reloads(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    # A SIGHUP while a reload waits its turn is covered by it (it reads the file when its
    # turn comes); one that comes while a reload already reads gets one more.
    path = tmp_path / "relay.toml"
    path.write_text(BASE.format(lanes=2))
    async with relay.open_relay(relay.load_config(path), discover=False) as r:
        changes: list[list[str] | None] = []

        async def signal_reload() -> None:
            changes.append(await r.reload_from_file())

        async with trio.open_nursery() as signals:
            path.write_text(BASE.format(lanes=3))
            signals.start_soon(signal_reload)
            await wait_all_tasks_blocked()        # the first one reads the file
            for _ in range(99):
                signals.start_soon(signal_reload)
        assert changes.count(None) == 98
        first, second = (c for c in changes if c is not None)
        assert any("lanes 2→3" in line for line in first) and second == []
        assert r.providers["fake"].lane.statistics().capacity == 3


async def test_a_file_that_keeps_changing_is_refused(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(BASE.format(lanes=2))
    async with relay.open_relay(relay.load_config(path), discover=False) as r:
        async with trio.open_nursery() as nursery:
            async def keep_writing() -> None:
                for n in range(1000):
                    path.write_text(BASE.format(lanes=3) + "#" * n)  # a new size each
                    await trio.sleep(r.SETTLE_S / 3)

            nursery.start_soon(keep_writing)
            start = trio.current_time()
            with pytest.raises(relay.ConfigError, match="kept changing for 2 s"):
                await r.reload()
            assert trio.current_time() - start == pytest.approx(r.SETTLE_MAX_S, abs=0.1)
            nursery.cancel_scope.cancel()
        assert r.providers["fake"].lane.statistics().capacity == 2
