"""A model with no known price under a client with a dollar limit (SPEC L14, O7), through
the assembled relay on real sockets: refused before anything is queued — 403
``forbidden_model`` naming the model and the config table that would give it a price — in
every dialect's shape, fallbacks included; a priced model goes through and counts, a
client without a dollar limit may use the unpriced one, and a token count (free) is not
refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from helpers.assembled import chat, records, start_relay, wait_for

AGENT = "agent-token-0123456789"
CHAT = "chat-token-9876543210"

CONFIG = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo", "priced"]
[providers.fake.prices."priced"]
input = 1.0
output = 2.0
[clients.agent]
token_env = "RELAY_TEST_AGENT_TOKEN"
usd_per_day = 10
[clients.chat]
token_env = "RELAY_TEST_CHAT_TOKEN"
tokens_per_day = 100000
"""


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_AGENT_TOKEN", AGENT)
    monkeypatch.setenv("RELAY_TEST_CHAT_TOKEN", CHAT)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def test_an_unpriced_model_under_a_dollar_limit_is_refused_naming_how_to_price_it(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        tokens: None) -> None:
    served = await start_relay(nursery, CONFIG, tmp_path)
    url = served.url + "/v1/chat/completions"
    for body in (chat("fake/echo"), chat("fake/priced", fallbacks=["fake/echo"])):
        r = await client.post(url, json=body, headers=bearer(AGENT))
        assert r.status_code == 403, r.text
        assert r.headers["x-should-retry"] == "false"
        err = r.json()["error"]
        assert err["code"] == "forbidden_model", err
        assert "'fake/echo'" in err["message"] and "usd_per_day $10" in err["message"], err
        assert '[providers.fake.prices."echo"]' in err["relay"]["action"], err
    r = await client.post(served.url + "/v1/messages", json={
        "model": "fake/echo", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": AGENT})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    r = await client.post(served.url + "/v1beta/models/fake/echo:generateContent",
                          json={"contents": [{"role": "user", "parts": [{"text": "x"}]}]},
                          headers={"x-goog-api-key": AGENT})
    assert r.status_code == 403 and r.json()["error"]["status"] == "PERMISSION_DENIED"
    r = await client.post(served.url + "/api/chat", json={
        "model": "fake/echo", "stream": False, "messages": [{"role": "user", "content": "x"}]},
        headers=bearer(AGENT))
    assert r.status_code == 403 and "prices" in r.json()["error"], r.text
    assert served.relay.providers["fake"].adapter.started == 0  # type: ignore[attr-defined]
    # A token count costs nothing: not refused.
    r = await client.post(served.url + "/v1/messages/count_tokens", json={
        "model": "fake/echo", "messages": [{"role": "user", "content": "x y z"}]},
        headers={"x-api-key": AGENT})
    assert r.status_code == 200, r.text
    # A priced model counts against the limit; a client without one may use either.
    for model, token in (("fake/priced", AGENT), ("fake/echo", CHAT)):
        r = await client.post(url, json=chat(model, "one two"), headers=bearer(token))
        assert r.status_code == 200, (model, r.text)
    await wait_for(lambda: len([x for x in records(tmp_path) if x["status"] == 200]) == 3)
    answered = [(x["client"], x["model"], x["cost_usd"]) for x in records(tmp_path)
                if x["status"] == 200 and x["endpoint"] == "/v1/chat/completions"]
    assert answered == [("agent", "priced", pytest.approx(2 * 1e-6 + 2 * 2e-6)),
                        ("chat", "echo", None)], answered
    assert served.relay.clients.spent("agent")["usd_today"] == pytest.approx(6e-6)
    refusals = [x for x in records(tmp_path) if x["status"] == 403]
    assert len(refusals) == 5 and all(x["attempts"] == [] for x in refusals)
