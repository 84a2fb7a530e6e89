"""Accounts (SPEC L13), through the assembled relay, against a provider that meters each
key apart (`fakes.fake_accounts`), on virtual time: traffic spreads over the accounts, an
account's 429 or refused key moves the request to another at once, a conversation stays
on its account while that one can start it."""

from __future__ import annotations

import collections
import functools
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fakes.fake_accounts import KeyedMetered, serve_keyed
from fakes.fake_metered import Limits, prose
from helpers.assembled import ASGIResult, asgi_request
from helpers.metered import ask, lane_of, ok, records, relay_for, send

from relay import Relay

KEYS = {"KEY_A": "sk-account-a", "KEY_B": "sk-account-b", "KEY_C": "sk-account-c",
        "KEY_D": "sk-account-d"}
PER_KEY = Limits(rpm=100, itpm=40_000, otpm=16_000)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for env, key in KEYS.items():
        monkeypatch.setenv(env, key)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> KeyedMetered:
    server: KeyedMetered = await nursery.start(functools.partial(serve_keyed, PER_KEY))
    return server


async def status_of(r: Relay) -> dict[str, Any]:
    """Provider p's entry of ``GET /relay/v1/status``."""
    result = ASGIResult()
    await asgi_request(r.app, "/relay/v1/status", b"", result, method="GET")
    assert result.status == 200, result.text()
    providers: dict[str, Any] = result.json()["providers"]
    return providers["p"]  # type: ignore[no-any-return]


def config(url: str, accounts: str = "ab", profile: str = "", extra: str = "",
           lanes: int = 8) -> str:
    listed = "".join(f"""
[[providers.p.accounts]]
name = "{name}"
api_key_env = "KEY_{name.upper()}"
""" for name in accounts)
    return f"""
[server]
records = "records.jsonl"
[providers.p]
adapter = "openai"
base_url = "{url}/v1"
{listed}
[providers.p.profile]
lanes = {lanes}
queue_max = 200
queue_timeout_s = 600
run_timeout_s = 600
{profile}
{extra}
"""


async def test_a_burst_spreads_over_both_accounts_with_no_429(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    # Each key: 40,000 input tokens a minute. 60 requests of ~1,200 tokens (72,000) fit
    # both keys' full buckets at once, and only one key's over almost two minutes.
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        start = trio.current_time()
        sent = [send(nursery, r, ask(prose(1150, i), model="p/m-out50", max_tokens=50))
                for i in range(60)]
        for result in sent:
            await result.done.wait()
        took = trio.current_time() - start
        assert all(ok(s) for s in sent), [s.text() for s in sent if not ok(s)][:2]
        assert sum(fake.refused.values()) == 0
        assert fake.served[KEYS["KEY_A"]] > 15 and fake.served[KEYS["KEY_B"]] > 15
        assert took < 30, took  # one key alone: ~50 s of refill
        used = {rec["account"] for rec in records(tmp_path)}
        assert used == {"a", "b"}
        status = (await status_of(r))
        assert [a["name"] for a in status["accounts"]] == ["a", "b"]
        assert status["lanes"]["capacity"] == 16
        assert sum(a["started"] for a in status["accounts"]) == 60


async def test_a_large_request_finds_one_accounts_room_whole_after_small_ones(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    # Each key: 10,000 input tokens a minute, configured. Eight requests of ~1,000 go
    # to the account they leave fullest (best fit), so a ~8,000-token one that follows
    # finds the other's bucket whole and starts at once; spread evenly, each account
    # would have ~6,000 left and it would wait ~15 s for the refill.
    fake.configure(Limits(rpm=100, itpm=10_000, otpm=100_000))
    async with relay_for(tmp_path, config(fake.base_url, profile="itpm = 10000")) as r:
        small = [send(nursery, r, ask(prose(900, i), model="p/m-out10", max_tokens=10))
                 for i in range(8)]
        await fake.wait_until(lambda: sum(fake.served.values()) >= 8)
        start = trio.current_time()
        large = send(nursery, r, ask(prose(7500, 99), model="p/m-out10", max_tokens=10))
        await large.done.wait()
        assert trio.current_time() - start < 2, trio.current_time() - start
        for result in small:
            await result.done.wait()
        assert all(ok(s) for s in [*small, large])
        assert sum(fake.refused.values()) == 0
        placed = collections.Counter(rec["account"] for rec in records(tmp_path)
                                     if rec["usage"]["prompt_tokens"] < 2_000)
        assert sorted(placed.values()) == [8], placed


async def test_small_requests_leave_a_slot_where_a_large_one_fits(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    # Each key: 10,000 input tokens a minute, learned from the headers; 3 lanes an
    # account; every answer takes ~10 s. A ~6,000-token request runs on one account;
    # three small ones follow. Spread by token room alone, all three went to the other
    # account and took its every slot: the next ~6,000-token one fit only that account's
    # bucket and waited ~10 s for a slot. Counting the free slots as room, the third
    # small one goes where the large one left little, and the large one starts at once.
    fake.configure(Limits(rpm=100, itpm=10_000, otpm=100_000))
    fake.tokens_per_s = 5.0
    async with relay_for(tmp_path, config(fake.base_url, lanes=3)) as r:
        warm = [send(nursery, r, ask(prose(120, i), model="p/m-out50", max_tokens=1))
                for i in range(2)]
        for result in warm:
            await result.done.wait()
        assert all(ok(w) for w in warm) and set(fake.served) == set(KEYS.values()) - {
            KEYS["KEY_C"], KEYS["KEY_D"]}
        running = [send(nursery, r, ask(prose(6000, 10), model="p/m-out50", max_tokens=50))]
        await fake.wait_until(lambda: fake.active == 1)
        for i in range(3):
            running.append(send(nursery, r, ask(prose(200, 20 + i), model="p/m-out50",
                                                max_tokens=50)))
            await fake.wait_until(functools.partial(lambda n: fake.active == n, 2 + i))
        start = trio.current_time()
        large = send(nursery, r, ask(prose(6000, 30), model="p/m-out50", max_tokens=50))
        await large.done.wait()
        assert ok(large), large.text()
        assert trio.current_time() - start < 14, trio.current_time() - start  # not ~20 s
        for result in running:
            await result.done.wait()
        assert all(ok(res) for res in running)
        assert sum(fake.refused.values()) == 0
        placed = collections.Counter(rec["account"] for rec in records(tmp_path)
                                     if rec["usage"]["prompt_tokens"] > 2_000)
        assert sorted(placed.values()) == [1, 1], placed  # a large one on each account


async def test_an_accounts_429_moves_the_request_to_the_other_at_once(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    # Key A's input bucket is spent by someone else; relay has heard nothing of it.
    fake.configure(PER_KEY, send_headers=True)
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        import httpx
        async with httpx.AsyncClient() as direct:
            got = await direct.post(f"{fake.base_url}/v1/chat/completions", json=ask(
                prose(39_000, 9), model="m-out10", max_tokens=10),
                headers={"authorization": f"Bearer {KEYS['KEY_A']}"})
            assert got.status_code == 200
        start = trio.current_time()
        res = send(nursery, r, ask(prose(3000, 1), model="p/m-out10", max_tokens=10))
        await res.done.wait()
        assert ok(res), res.text()
        assert trio.current_time() - start < 2.0  # moved at once, not after the hold
        rec = records(tmp_path)[-1]
        assert [(a["account"], a["failure"]) for a in rec["attempts"]] == [
            ("a", "rate_limited"), ("b", None)]
        assert rec["account"] == "b" and rec["status"] == 200
        # Account a is held now: the next request goes straight to b.
        again = send(nursery, r, ask(prose(3000, 2), model="p/m-out10", max_tokens=10))
        await again.done.wait()
        assert ok(again) and records(tmp_path)[-1]["account"] == "b"
        assert fake.refused[KEYS["KEY_A"]] == 1
        accounts = {a["name"]: a for a in (await status_of(r))["accounts"]}
        assert accounts["a"]["state"] == "held" and accounts["b"]["state"] == "ok"


async def test_a_refused_key_takes_its_account_out_and_the_client_never_sees_it(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    fake.revoked.add(KEYS["KEY_A"])
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        results = []
        for i in range(6):
            res = send(nursery, r, ask(f"question {i}", model="p/m-out10", max_tokens=10))
            await res.done.wait()
            results.append(res)
        assert all(ok(res) for res in results), results[0].text()
        assert fake.unauthorized[KEYS["KEY_A"]] == 1  # once: then it is out of the choice
        first = records(tmp_path)[0]
        assert [(a["account"], a["failure"]) for a in first["attempts"]] == [
            ("a", "auth_required"), ("b", None)]
        status = (await status_of(r))
        accounts = {a["name"]: a for a in status["accounts"]}
        assert accounts["a"]["state"] == "out"
        assert accounts["a"]["state_reason"] == "auth_required"
        assert status["state"] == "connected" and "account 'a'" in status["warning"]
        assert "sk-account" not in str(status)
        # Out for a while, then tried again by the next request that needs it.
        fake.revoked.clear()
        await trio.sleep(31)
        burst = [send(nursery, r, ask(prose(200, i), model="p/m-out10", max_tokens=10))
                 for i in range(20)]
        for res in burst:
            await res.done.wait()
        assert all(ok(res) for res in burst)
        accounts = {a["name"]: a for a in (await status_of(r))["accounts"]}
        assert accounts["a"]["state"] == "ok"
        assert fake.served[KEYS["KEY_A"]] > 0


async def test_when_every_account_fails_the_message_names_each(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    fake.revoked.update({KEYS["KEY_A"], KEYS["KEY_B"]})
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        res = send(nursery, r, ask("hello", model="p/m-out10", max_tokens=10))
        await res.done.wait()
        assert res.status == 502, res.text()  # relay's keys, not the client's
        rec = records(tmp_path)[-1]
        assert [(a["account"], a["failure"]) for a in rec["attempts"]] == [
            ("a", "auth_required"), ("b", "auth_required")]
        message = res.json()["error"]["message"]
        assert "(account a): auth_required" in message
        assert "(account b): auth_required" in message
        assert (await status_of(r))["state"] == "failing"


async def test_a_conversation_stays_on_its_account_and_leaves_it_when_held(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        # Other traffic, mixed in, spreads over both accounts.
        for turn in range(20):
            body = {"model": "p/m-out10", "max_tokens": 10, "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "the conversation"},
                *[{"role": "assistant" if i % 2 == 0 else "user", "content": f"t{i}"}
                  for i in range(2 * turn)]]}
            noise = [send(nursery, r, ask(prose(300, 100 * turn + i), model="p/m-out10",
                                          max_tokens=10)) for i in range(3)]
            res = send(nursery, r, body)
            await res.done.wait()
            assert ok(res)
            for other in noise:
                await other.done.wait()
        keys = fake.conversations["You are terse."]
        assert len(keys) == 20 and len(set(keys)) == 1  # every turn on one account
        assert len({k for k, n in fake.served.items() if n}) == 2  # the rest on both
        # Its account is held (a 429 from someone else's traffic): the next turn moves.
        held_key = keys[0]
        lane = lane_of(r)
        held = next(a for a in lane.accounts if KEYS[f"KEY_{a.name.upper()}"] == held_key)
        held.meter.hold(trio.current_time() + 60, "the provider said wait")
        start = trio.current_time()
        res = send(nursery, r, body)
        await res.done.wait()
        assert ok(res) and trio.current_time() - start < 1.0
        assert fake.conversations["You are terse."][-1] != held_key


async def test_a_conversation_waits_a_little_for_its_busy_account(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    # One lane an account: the conversation's account is busy with its own last turn's
    # answer; the next turn waits for it (affinity_wait_s 2) rather than start on the
    # free one — but not past affinity_wait_s.
    text = config(fake.base_url, profile="affinity_wait_s = 2", lanes=1)
    async with relay_for(tmp_path, text) as r:
        convo = {"model": "p/m-out250", "max_tokens": 250, "prompt_cache_key": "conv-1",
                 "messages": [{"role": "user", "content": "conversation one"}]}
        first = send(nursery, r, convo)
        await first.done.wait()
        home = records(tmp_path)[-1]["account"]
        busy = send(nursery, r, convo)  # ~0.7 s on `home`
        await trio.sleep(0.05)
        second = send(nursery, r, convo)
        await second.done.wait()
        await busy.done.wait()
        assert ok(first) and ok(busy) and ok(second)
        assert [rec["account"] for rec in records(tmp_path)] == [home] * 3
        fake.tokens_per_s = 25.0  # its next answer takes 10 s
        slow = send(nursery, r, convo)
        await trio.sleep(0.05)
        running = [(q["state"], q["account"]) for q in (await status_of(r))["requests"]]
        assert running == [("running", home)]  # `relay ps` names the account
        third = send(nursery, r, convo)
        await third.done.wait()
        third_record = records(tmp_path)[-1]
        assert third_record["account"] != home
        assert 1.9 < third_record["queue_ms"] / 1000 < 2.5, third_record["queue_ms"]
        await slow.done.wait()
        assert ok(third) and ok(slow)


def test_relay_status_lists_each_account_under_its_provider() -> None:
    from relay.assembly.describe import describe_providers
    table = describe_providers({"p": {
        "adapter": "openai", "state": "connected", "models": ["m"],
        "lanes": {"running": 1, "capacity": 16, "queued": 0, "queue_max": 200},
        "accounts": [
            {"name": "a", "state": "out", "state_reason": "auth_required", "running": 0,
             "capacity": 8, "started": 3, "budgets": {"hold": None}},
            {"name": "b", "state": "held", "state_reason": None, "running": 1,
             "capacity": 8, "started": 9,
             "budgets": {"hold": {"reason": "rate_limited", "left_s": 12.2}}}]}})
    lines = table.splitlines()
    assert lines[2].split() == ["account", "a", "out", "(auth_required)", "0/8", "3",
                                "started"]
    assert lines[3].split() == ["account", "b", "held", "(rate_limited,", "12", "s)",
                                "1/8", "9", "started"]


async def test_a_check_tries_every_account_and_brings_one_back(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: KeyedMetered,
        tmp_path: Path) -> None:
    fake.revoked.add(KEYS["KEY_A"])
    text = config(fake.base_url).replace('adapter = "openai"\n',
                                         'adapter = "openai"\ncheck_model = "m-out10"\n')
    async with relay_for(tmp_path, text) as r:
        res = send(nursery, r, ask("hello", model="p/m-out10", max_tokens=10))
        await res.done.wait()
        assert ok(res)
        accounts = {a["name"]: a for a in (await status_of(r))["accounts"]}
        assert accounts["a"]["state"] == "out"
        # A check while a's key is still refused: b answers, a stays out, and the
        # provider is connected with a warning that names a.
        check = ASGIResult()
        await asgi_request(r.app, "/relay/v1/providers/p/check", b"", check)
        assert check.status == 200, check.text()
        said = check.json()
        assert said["outcome"] == "answered", said["message"]
        assert "account a: auth_required" in said["message"]
        assert "account b: answered" in said["message"]
        status = await status_of(r)
        assert status["state"] == "connected" and "account a" in status["warning"]
        # The key works again: the next check brings a back at once (no 30 s wait).
        fake.revoked.clear()
        check = ASGIResult()
        await asgi_request(r.app, "/relay/v1/providers/p/check", b"", check)
        assert check.json()["outcome"] == "answered", check.text()
        status = await status_of(r)
        assert {a["name"]: a["state"] for a in status["accounts"]} == {"a": "ok", "b": "ok"}
        assert status["warning"] is None
        checks = [rec for rec in records(tmp_path) if rec["route"] == "(check)"]
        assert [rec["account"] for rec in checks] == ["a", "b", "a", "b"]
