"""The paths relay serves (SPEC 9): ``GET /v1/models/{id}`` with ``/`` in the id, raw or
``%2F``-encoded (SPEC A8), the official client's ``models.retrieve``; and a path relay
does not serve — a 404 that lists the paths it does, in the right shape, logged and
recorded. The table those paths come from is the one both routers use.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
from fakes.upstream import FakeUpstream
from helpers.assembled import chat, records, start_relay, with_upstream
from helpers.cloud_helpers import e1, http_client

ROUTE = """
[routes.storyboard]
primary = "fake/echo"
"""


async def test_one_model_by_its_id_with_slashes_raw_or_encoded(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream) -> None:
    served = await start_relay(nursery, with_upstream(upstream) + ROUTE, tmp_path)
    async with http_client() as http:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x",
                                    max_retries=0, http_client=http)
        echo = await client.models.retrieve("fake/echo")  # the client sends fake%2Fecho
        assert (echo.id, echo.object, echo.owned_by) == ("fake/echo", "model", "fake")
        qwen = await client.models.retrieve("up/Qwen/Qwen3-8B")
        assert (qwen.id, qwen.owned_by) == ("up/Qwen/Qwen3-8B", "up")
        route = await client.models.retrieve("storyboard")
        assert (route.id, route.owned_by) == ("storyboard", "relay")
        bare = await client.models.retrieve("m2")  # listed by one provider only
        assert (bare.id, bare.owned_by) == ("m2", "up")
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("up/not-there")
        assert isinstance(missing.value.body, dict)
        assert missing.value.body["code"] == "unknown_model"
        assert "fake/echo" in missing.value.body["message"]  # it lists what exists

        for path in ("/v1/models/up/Qwen/Qwen3-8B", "/v1/models/up%2FQwen%2FQwen3-8B",
                     "/v1/models/up/Qwen%2FQwen3-8B"):
            r = await http.get(served.url + path)
            assert r.status_code == 200, path
            assert r.json() == {"id": "up/Qwen/Qwen3-8B", "object": "model", "created": 0,
                                "owned_by": "up"}
        e1(await http.get(served.url + "/v1/models/nope%2Fx"), 404, "unknown_model")

        # Everything the list shows can be asked for one by one.
        listed = (await http.get(served.url + "/v1/models")).json()["data"]
        for entry in listed:
            one = await client.models.retrieve(entry["id"])
            assert (one.id, one.owned_by) == (entry["id"], entry["owned_by"])


@pytest.mark.parametrize(("method", "path", "guess"), [
    ("POST", "/v1/completions", "/v1/chat/completions"),
    ("POST", "/chat/completions", "/v1/chat/completions"),
    ("POST", "/v1/chat/completion", "/v1/chat/completions"),
    ("POST", "/v1/v1/embeddings", "/v1/embeddings"),
    ("GET", "/models", "/v1/models"),
    ("GET", "/v2/whatever", None),
])
async def test_a_path_relay_does_not_serve_gets_the_list_logged_and_recorded(
        nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        method: str, path: str, guess: str | None) -> None:
    served = await start_relay(nursery, with_upstream_less(), tmp_path)
    caplog.set_level(logging.INFO, logger="relay.front.paths")
    async with http_client() as http:
        r = await http.request(method, served.url + path, json=chat("fake/echo"))
    err = e1(r, 404, "invalid_request")
    message = err["message"]
    assert message.startswith(f"relay does not serve {method} {path}.")
    from relay.front.paths import SERVED  # here: the test runs (and fails) without it

    for entry in SERVED:  # every path relay serves, with its methods
        assert f"{'|'.join(entry.methods)} {entry.shown}" in message
    assert "GET /v1/models/{model}" in message
    if guess is None:
        assert "Did you mean" not in message
    else:
        assert f"Did you mean {guess}?" in message
    rec = [x for x in records(tmp_path) if x.get("endpoint") == path]
    assert len(rec) == 1
    assert (rec[0]["status"], rec[0]["reason"], rec[0]["phase"]) == (
        404, "invalid_request", "request")
    assert rec[0]["id"] == r.headers["x-relay-request-id"]
    lines = [x for x in caplog.records if x.name == "relay.front.paths"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert path in lines[0].getMessage()


def with_upstream_less() -> str:
    return """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
"""


async def test_under_v1_messages_the_404_is_anthropic_shaped(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, with_upstream_less(), tmp_path)
    async with http_client() as http:
        r = await http.post(served.url + "/v1/messages/batches", json={"model": "fake/echo"})
    assert r.status_code == 404
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert "POST /v1/messages/count_tokens" in body["error"]["message"]
    assert r.headers["x-should-retry"] == "false"
    assert [x["endpoint"] for x in records(tmp_path)] == ["/v1/messages/batches"]


async def test_the_official_client_with_a_base_url_without_v1_is_told_the_path(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, with_upstream_less(), tmp_path)
    async with http_client() as http:
        client = openai.AsyncOpenAI(base_url=served.url, api_key="x", max_retries=0,
                                    http_client=http)
        with pytest.raises(openai.NotFoundError) as wrong:
            await client.chat.completions.create(
                model="fake/echo", messages=[{"role": "user", "content": "hi"}])
    assert "Did you mean /v1/chat/completions?" in str(wrong.value)


async def test_a_relay_route_asked_with_another_method_is_a_405_recorded(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, with_upstream_less(), tmp_path)
    async with http_client() as http:
        r = await http.get(served.url + "/v1/embeddings")
        e1(r, 405, "invalid_request")
        assert "use POST for /v1/embeddings" in r.json()["error"]["message"]
        r = await http.post(served.url + "/v1/models", json={})
        assert r.status_code == 405  # a Quart route: Quart's own 405, in E1's shape
        assert r.json()["error"]["relay"]["reason"] == "invalid_request"
    assert [x["endpoint"] for x in records(tmp_path)] == ["/v1/embeddings"]


def test_one_table_routes_both_the_raw_routes_and_quart() -> None:
    from relay.front import app as front_app
    from relay.front.paths import SERVED, match
    from relay.front.routes import make_quart_app

    none: Any = None  # building the app reads neither the relay nor its metrics
    quart = make_quart_app(none, none)
    rules = {(r.rule, frozenset(r.methods - {"HEAD", "OPTIONS"}))
             for r in quart.url_map.iter_rules() if r.endpoint != "static"}
    table = {(e.rule, frozenset(e.methods)) for e in SERVED if e.kind == "quart"}
    assert rules == table  # Quart serves exactly the table's quart entries
    from relay.front.info import _ANSWERS
    assert set(_ANSWERS) == {e.rule for e in SERVED if e.kind == "info"}
    kinds = {e.kind for e in SERVED if e.relay_route}
    # Every relay route has its handler (stored responses are answered by serve_stored,
    # Google's Gemini API by serve_gemini, Ollama's by serve_ollama).
    assert kinds == {*front_app._HANDLERS, "stored", "gemini", "ollama"}
    assert match("/v1/models/a/b/c") is not None and match("/v1/models/") is None
    assert match("/relay/v1/providers/x/check") is not None
    assert match("/relay/v1/providers/x/y/check") is None


# Run in a clean interpreter: the test process has imported Quart long before.
POLLED_WITHOUT_QUART = """
import functools, json, sys
import httpx, trio, relay

async def main(path):
    out = {}
    async with trio.open_nursery() as nursery:
        served = await nursery.start(functools.partial(
            relay.serve, relay.load_config(path), port=0))
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            chat = {"model": "fake/echo", "messages": [{"role": "user", "content": "hi"}]}
            asked = [("GET", "/healthz", None), ("HEAD", "/healthz", None),
                     ("GET", "/v1/models", None), ("GET", "/v1/models/fake%2Fecho", None),
                     ("GET", "/relay/v1/status", None), ("POST", "/healthz", {}),
                     ("POST", "/v1/chat/completions", chat)]
            for method, url, body in asked:
                r = await http.request(method, url, json=body)
                out[method + " " + url] = [r.status_code, r.text,
                                           r.headers.get("content-length")]
            out["quart before the page"] = "quart" in sys.modules
            got = []

            async def ask(url):
                got.append((url, (await http.get(url)).status_code))

            async with trio.open_nursery() as first:  # Quart's first routes, together
                for url in ("/", "/", "/metrics", "/relay/v1/requests"):
                    first.start_soon(ask, url)
            out["first quart routes"] = sorted(got)
            out["quart after the page"] = "quart" in sys.modules
        nursery.cancel_scope.cancel()
    print(json.dumps(out))

trio.run(main, sys.argv[1])
"""


async def test_the_polled_routes_answer_without_quart_which_comes_with_the_page(
        tmp_path: Path) -> None:
    (tmp_path / "relay.toml").write_text(with_upstream_less())
    done = await trio.run_process([sys.executable, "-c", POLLED_WITHOUT_QUART,
                                   str(tmp_path / "relay.toml")], cwd=tmp_path,
                                  capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = json.loads(done.stdout)
    status, body, length = out["GET /healthz"]
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    assert out["HEAD /healthz"] == [200, "", length]  # the same head, no body
    assert [e["id"] for e in json.loads(out["GET /v1/models"][1])["data"]] == ["fake/echo"]
    assert json.loads(out["GET /v1/models/fake%2Fecho"][1])["owned_by"] == "fake"
    assert out["GET /relay/v1/status"][0] == 200
    assert "fake" in json.loads(out["GET /relay/v1/status"][1])["providers"]
    status, body, _ = out["POST /healthz"]
    assert status == 405
    assert json.loads(body)["error"]["relay"]["reason"] == "invalid_request"
    assert out["POST /v1/chat/completions"][0] == 200
    assert out["quart before the page"] is False
    assert out["first quart routes"] == [["/", 200], ["/", 200], ["/metrics", 200],
                                         ["/relay/v1/requests", 200]]
    assert out["quart after the page"] is True
