"""Every dialect's model list shows a client the models it may use (SPEC L14), through the
assembled relay on real sockets, with two clients' tokens: OpenAI's and Anthropic's
``/v1/models``, Gemini's ``/v1beta/models`` and ``/v1/models`` with a Google key,
Ollama's ``/api/tags``. Names and ``*`` patterns; a route counts by its name and a
pattern route by its pattern. A model the client may not use is ``forbidden_model``
when looked up, in the dialect's shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import start_relay

AGENT = "agent-token-0123456789"
CHAT = "chat-token-9876543210"

CONFIG = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo", "big"]
[providers.other]
adapter = "fake"
models = ["echo"]
[routes.fast]
primary = "fake/echo"
[routes.slow]
primary = "other/echo"
[routes."claude-*"]
primary = "fake/{model}"
[clients.agent]
token_env = "RELAY_TEST_AGENT_TOKEN"
models = ["fake/*", "fast", "claude-*"]
[clients.chat]
token_env = "RELAY_TEST_CHAT_TOKEN"
"""

# What each client may see: the agent its patterns' and names' models, the chat all.
AGENT_SEES = ["fast", "fake/echo", "fake/big"]
CHAT_SEES = ["fast", "slow", "fake/echo", "fake/big", "other/echo"]


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_AGENT_TOKEN", AGENT)
    monkeypatch.setenv("RELAY_TEST_CHAT_TOKEN", CHAT)


async def names(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> list[str]:
    r = await client.get(url, headers=headers)
    assert r.status_code == 200, (url, r.text)
    body: dict[str, Any] = r.json()
    if "data" in body:                                # OpenAI's and Anthropic's
        return [m["id"] for m in body["data"]]
    if "models" in body and body["models"] and "baseModelId" in body["models"][0]:
        return [m["name"].removeprefix("models/") for m in body["models"]]   # Google's
    return [m["name"] for m in body["models"]]      # Ollama's


async def test_every_dialects_model_list_shows_a_client_only_what_it_may_use(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        tokens: None) -> None:
    served = await start_relay(nursery, CONFIG, tmp_path)
    url = served.url
    for token, sees in ((AGENT, AGENT_SEES), (CHAT, CHAT_SEES)):
        bearer = {"authorization": f"Bearer {token}"}
        assert await names(client, url + "/v1/models", bearer) == sees
        assert await names(client, url + "/v1/models", {"x-api-key": token}) == sees
        google = {"x-goog-api-key": token}
        assert await names(client, url + "/v1beta/models", google) == sees
        assert await names(client, url + "/v1/models", google) == sees
        assert await names(client, url + f"/v1beta/models?key={token}", {}) == sees
        # Ollama's list holds the pattern routes, by their pattern.
        tags = await names(client, url + "/api/tags", bearer)
        want = (["fast", "claude-*", "fake/echo", "fake/big"] if token == AGENT
                else ["fast", "slow", "claude-*", "fake/echo", "fake/big", "other/echo"])
        assert tags == want, tags


async def test_a_model_a_client_may_not_use_is_forbidden_when_looked_up(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        tokens: None) -> None:
    served = await start_relay(nursery, CONFIG, tmp_path)
    url = served.url
    agent, chat = {"authorization": f"Bearer {AGENT}"}, {"authorization": f"Bearer {CHAT}"}
    for model in ("other/echo", "slow"):
        r = await client.get(f"{url}/v1/models/{model}", headers=agent)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "forbidden_model" and f"'{model}'" in err["message"], err
        assert "fake/*, fast, claude-*" in err["message"]
        assert (await client.get(f"{url}/v1/models/{model}", headers=chat)).status_code == 200
        r = await client.get(f"{url}/v1beta/models/{model}",
                             headers={"x-goog-api-key": AGENT})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["status"] == "PERMISSION_DENIED", r.text
        r = await client.post(f"{url}/api/show", json={"model": model}, headers=agent)
        assert r.status_code == 403 and "forbidden_model" in r.json()["error"], r.text
    # What it may use answers: a route, a provider's model, a name a pattern route takes.
    for model in ("fast", "fake/big", "claude-sonnet-4-5"):
        r = await client.get(f"{url}/v1/models/{model}", headers=agent)
        assert r.status_code == 200 and r.json()["id"] == model, r.text
    r = await client.get(f"{url}/v1beta/models/fake/echo", headers={"x-goog-api-key": AGENT})
    assert r.status_code == 200 and r.json()["name"] == "models/fake/echo", r.text
