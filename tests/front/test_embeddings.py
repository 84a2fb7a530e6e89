"""``POST /v1/embeddings`` (SPEC A8) through the assembled relay: the official openai
client (which asks for base64 unless told otherwise) and plain HTTP, against fake
OpenAI-compatible and Gemini servers on loopback (tests/fakes/fake_endpoints.py) — floats and
base64, both wire formats, the lanes (queue, priorities, a full queue, a client that
leaves, a run timeout, a drain), the records, and the kinds that make no embeddings.
"""

from __future__ import annotations

import base64
import struct
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from fakes.fake_endpoints import (
    EmbeddingGemini,
    FakeEmbeddings,
    serve_embedding_gemini,
    serve_fake_embeddings,
    vector_for,
)
from fakes.fake_gemini import KEY as GEMINI_KEY
from helpers.assembled import lane_idle, records, start_relay, wait_for
from helpers.cloud_helpers import e1, http_client

from relay import Served

KEY_ENV = "RELAY_TEST_GEMINI_KEY"
EMBED = "/v1/embeddings"


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, GEMINI_KEY)


@pytest.fixture
async def emb(nursery: trio.Nursery) -> FakeEmbeddings:
    server: FakeEmbeddings = await nursery.start(serve_fake_embeddings)
    return server


@pytest.fixture
async def gem(nursery: trio.Nursery) -> EmbeddingGemini:
    server: EmbeddingGemini = await nursery.start(serve_embedding_gemini)
    return server


def config(emb: FakeEmbeddings, gem: EmbeddingGemini | None = None, *,
           run_timeout_s: float = 20, queue_max: int = 4, extra: str = "") -> str:
    text = f"""
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.emb]
adapter = "openai"
base_url = "{emb.url}"
models = ["e1", "e2"]
[providers.emb.profile]
lanes = 1
queue_max = {queue_max}
queue_timeout_s = 10
run_timeout_s = {run_timeout_s}
[routes.vectors]
primary = "emb/e1"
"""
    if gem is not None:
        text += f"""
[providers.gem]
adapter = "gemini"
base_url = "{gem.url}"
api_key_env = "{KEY_ENV}"
models = ["text-embedding-test"]
[providers.gem.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 300
rpm = 0
"""
    return text + extra


def f32(values: list[float]) -> list[float]:
    """What a float32 makes of each value (what base64 carries)."""
    return [struct.unpack("<f", struct.pack("<f", v))[0] for v in values]


def sdk(served: Served, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                              http_client=http)


def one(tmp_path: Path, endpoint: str = EMBED) -> list[dict[str, Any]]:
    return [r for r in records(tmp_path) if r.get("endpoint") == endpoint]


# --- OpenAI-compatible ----------------------------------------------------------------------

async def test_official_client_gets_base64_by_default_and_floats_when_asked(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings) -> None:
    served = await start_relay(nursery, config(emb), tmp_path)
    async with http_client() as http:
        client = sdk(served, http)
        # The client asks for base64 when no format is given, and decodes it itself.
        got = await client.embeddings.create(model="emb/e1", input=["one two", "three"])
        assert [d.embedding for d in got.data] == [f32(vector_for("one two")),
                                                   f32(vector_for("three"))]
        assert got.data[0].embedding != vector_for("one two")  # float32, not float64
        assert got.model == "emb/e1"
        assert (got.usage.prompt_tokens, got.usage.total_tokens) == (3, 3)
        assert emb.requests[-1].json == {"model": "e1", "input": ["one two", "three"],
                                         "encoding_format": "float"}

        floats = await client.embeddings.create(model="vectors", input="one two",
                                                encoding_format="float")
        assert floats.data[0].embedding == vector_for("one two")  # exactly as sent

        # Fields relay does not read pass through: dimensions, user, a server's own.
        shaped = await client.embeddings.create(
            model="emb/e2", input=[[1, 2, 3]], dimensions=3, user="u-1",
            encoding_format="float", extra_body={"input_type": "query"})
        assert shaped.data[0].embedding == vector_for("1 2 3", 3)
        assert emb.requests[-1].json == {"model": "e2", "input": [[1, 2, 3]],
                                         "encoding_format": "float", "dimensions": 3,
                                         "user": "u-1", "input_type": "query"}

        # base64 asked for explicitly, read as bytes: little-endian float32.
        r = await http.post(served.url + EMBED, json={
            "model": "emb/e1", "input": "three", "encoding_format": "base64"})
        assert r.status_code == 200
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        assert list(struct.unpack("<4f", raw)) == f32(vector_for("three"))
        assert r.json()["object"] == "list" and r.json()["data"][0]["object"] == "embedding"
    recs = one(tmp_path)
    assert len(recs) == 4
    first = recs[0]
    assert (first["status"], first["provider"], first["model"]) == (200, "emb", "e1")
    assert first["usage"]["prompt_tokens"] == 3
    assert first["attempts"][0]["ok"] and first["released_at"] is not None
    assert first["queue_ms"] is not None and first["run_ms"] is not None
    assert recs[1]["route"] == "vectors"


async def test_an_upstream_failure_is_an_e1_error(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings) -> None:
    served = await start_relay(nursery, config(emb), tmp_path)
    async with http_client() as http:
        emb.status = 401
        r = await http.post(served.url + EMBED, json={"model": "emb/e1", "input": "x"})
        e1(r, 502, "auth_required")
        emb.status = 400
        r = await http.post(served.url + EMBED, json={"model": "emb/e1", "input": "x"})
        assert e1(r, 400, "rejected")["relay"]["upstream_status"] == 400
        emb.status = 200
        emb.models = []  # the fake now answers 400 for the model; relay reads no vector
        with pytest.raises(openai.BadRequestError):
            await sdk(served, http).embeddings.create(model="emb/e1", input="x")
    assert [r["reason"] for r in one(tmp_path)] == ["auth_required", "rejected", "rejected"]


@pytest.mark.parametrize(("answer", "encoding", "words"), [
    ({"data": [{"index": 0, "embedding": [0.5]}]}, "float", "one vector for each of the 2"),
    ({"data": [{"index": 0, "embedding": [0.5]}, {"index": 0, "embedding": [0.5]}]},
     "float", "one vector for each of the 2"),
    ({"data": [{"embedding": [0.5, True]}, {"embedding": [1]}]}, "float", "one vector"),
    ({"data": [{"embedding": []}, {"embedding": [1]}]}, "float", "one vector"),
    ({"data": [{"embedding": [float("nan")]}, {"embedding": [1]}]}, "float",
     "a number that is not finite (vector 0)"),
    ({"data": [{"embedding": [1.0]}, {"embedding": [1e39]}]}, "base64",
     "a number too large for a float32 (vector 1)"),
    ([1, 2], "float", "an embeddings answer relay cannot read: '[1, 2]'"),
])
async def test_a_broken_embeddings_answer_is_bad_upstream_response(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings, answer: Any,
        encoding: str, words: str) -> None:
    served = await start_relay(nursery, config(emb), tmp_path)
    emb.answer = answer
    async with http_client() as http:
        r = await http.post(served.url + EMBED, json={
            "model": "emb/e1", "input": ["a", "b"], "encoding_format": encoding})
    assert words in e1(r, 502, "bad_upstream_response")["message"]
    assert one(tmp_path)[0]["reason"] == "bad_upstream_response"
    assert lane_idle(served)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "emb/e1"}, "input"),
    ({"model": "emb/e1", "input": []}, "input"),
    ({"model": "emb/e1", "input": [1, "two"]}, "input"),
    ({"model": "emb/e1", "input": [[]]}, "input"),
    ({"model": "emb/e1", "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x"}, "model"),
])
async def test_a_malformed_request_is_a_400_naming_the_field(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings, body: dict[str, Any],
        param: str) -> None:
    served = await start_relay(nursery, config(emb), tmp_path)
    async with http_client() as http:
        r = await http.post(served.url + EMBED, json=body)
    assert e1(r, 400, "invalid_request")["param"] == param
    assert not [q for q in emb.requests if q.method == "POST"]
    assert one(tmp_path)[0]["status"] == 400


async def test_fallbacks_are_refused_and_kinds_that_do_not_embed_are_unsupported(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings) -> None:
    served = await start_relay(nursery, config(emb), tmp_path)
    async with http_client() as http:
        r = await http.post(served.url + EMBED, json={"model": "emb/e1", "input": "x",
                                                       "fallbacks": ["emb/e2"]})
        assert e1(r, 400, "unsupported")["param"] == "fallbacks"
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk(served, http).embeddings.create(model="fake/echo", input="x")
        err = refused.value.body
        assert isinstance(err, dict)
        assert err["code"] == "unsupported" and err["relay"]["provider"] == "fake"
        assert "'fake' (fake) makes no embeddings" in err["message"]
        assert "openai" in err["message"] and "gemini" in err["message"]
        r = await http.post(served.url + EMBED, json={"model": "nope/x", "input": "x"})
        e1(r, 404, "unknown_model")
    assert not [q for q in emb.requests if q.method == "POST"]
    assert [r["reason"] for r in one(tmp_path)] == ["unsupported", "unsupported",
                                                    "unknown_model"]


# --- Gemini -----------------------------------------------------------------------------

async def test_gemini_embeds_in_batches_with_dimensions_and_reports_user(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings,
        gem: EmbeddingGemini) -> None:
    served = await start_relay(nursery, config(emb, gem), tmp_path)
    async with http_client() as http:
        client = sdk(served, http)
        got = await client.embeddings.create(model="gem/text-embedding-test",
                                             input="hello world", dimensions=3)
        assert got.data[0].embedding == f32(vector_for("hello world", 3))
        assert got.model == "gem/text-embedding-test"
        sent = gem.requests[-1]
        assert sent.path == "/v1beta/models/text-embedding-test:batchEmbedContents"
        assert sent.json == {"requests": [{
            "model": "models/text-embedding-test", "outputDimensionality": 3,
            "content": {"parts": [{"text": "hello world"}]}}]}

        # More texts than one batch takes: sent in order, in two.
        texts = [f"text number {i}" for i in range(150)]
        many = await client.embeddings.create(model="gem/text-embedding-test", input=texts,
                                              encoding_format="float")
        assert [d.embedding for d in many.data] == [vector_for(t) for t in texts]
        assert [len(q.json["requests"]) for q in gem.requests[-2:]] == [100, 50]

        # user is advisory here: dropped, and the answer says so.
        r = await http.post(served.url + EMBED, json={
            "model": "gem/text-embedding-test", "input": "x", "user": "u-1"})
        assert r.status_code == 200
        assert r.headers["x-relay-ignored-fields"] == "user"
        assert "user" not in gem.requests[-1].json["requests"][0]

        before = len(gem.requests)
        r = await http.post(served.url + EMBED, json={
            "model": "gem/text-embedding-test", "input": [[1, 2]]})
        assert e1(r, 400, "unsupported")["param"] == "input"
        r = await http.post(served.url + EMBED, json={
            "model": "gem/text-embedding-test", "input": "x", "input_type": "query"})
        assert e1(r, 400, "unsupported")["param"] == "input_type"
        assert len(gem.requests) == before  # refused before anything was sent

        gem.status = 429
        r = await http.post(served.url + EMBED, json={
            "model": "gem/text-embedding-test", "input": "x"})
        e1(r, 429, "rate_limited")


# --- the lanes -----------------------------------------------------------------------------

async def post(http: httpx.AsyncClient, served: Served, text: str, out: dict[str, Any],
               priority: str = "normal") -> None:
    r = await http.post(served.url + EMBED, json={"model": "emb/e1", "input": text},
                        headers={"x-relay-priority": priority})
    out[text] = r


def lane(served: Served) -> tuple[int, int]:
    stats = served.relay.providers["emb"].lane.statistics()
    return stats.running, stats.queued


async def test_embeddings_wait_in_the_lane_by_priority(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings) -> None:
    served = await start_relay(nursery, config(emb), tmp_path)
    emb.gate = trio.Event()
    got: dict[str, Any] = {}
    async with http_client() as http, trio.open_nursery() as clients:
        clients.start_soon(post, http, served, "first", got)
        with trio.fail_after(5):
            await emb.wait_until(lambda: emb.answering == 1)
        clients.start_soon(post, http, served, "background", got, "background")
        await wait_for(lambda: lane(served) == (1, 1))
        clients.start_soon(post, http, served, "interactive", got, "interactive")
        await wait_for(lambda: lane(served) == (1, 2))
        emb.gate.set()
    order = [q.json["input"] for q in emb.requests if q.method == "POST"]
    assert order == [["first"], ["interactive"], ["background"]]
    assert all(r.status_code == 200 for r in got.values())
    recs = {r["priority"]: r for r in one(tmp_path)}
    assert recs["background"]["queue_ms"] > recs["interactive"]["queue_ms"] > 0
    assert lane_idle(served)


async def test_a_full_queue_a_client_that_leaves_and_a_drain(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings) -> None:
    served = await start_relay(nursery, config(emb, queue_max=1), tmp_path)
    emb.gate = trio.Event()
    got: dict[str, Any] = {}
    async with http_client() as http, trio.open_nursery() as clients:
        clients.start_soon(post, http, served, "running", got)
        with trio.fail_after(5):
            await emb.wait_until(lambda: emb.answering == 1)
        leaves = trio.CancelScope()
        clients.start_soon(_in, leaves, post(http, served, "leaves", got))
        await wait_for(lambda: lane(served) == (1, 1))
        r = await http.post(served.url + EMBED, json={"model": "emb/e1", "input": "x"})
        e1(r, 429, "provider_queue_full")
        assert int(r.headers["retry-after"]) >= 1
        leaves.cancel()  # its client leaves while it waits in the queue
        await wait_for(lambda: lane(served) == (1, 0))
        # A drain stops what is still running: its client gets shutting_down.
        await served.relay.drain(0.0)
    e1(got["running"], 503, "shutting_down")
    assert "leaves" not in got
    reasons = {r["reason"] for r in one(tmp_path)}
    assert reasons == {"provider_queue_full", "client_disconnected", "shutting_down"}
    gone = next(r for r in one(tmp_path) if r["reason"] == "client_disconnected")
    assert gone["status"] == 499 and gone["queue_ms"] > 0
    stopped = next(r for r in one(tmp_path) if r["reason"] == "shutting_down")
    assert stopped["stop_requested_at"] is not None and stopped["released_at"] is not None
    assert stopped["attempts"][0]["failure"] == "stopped"
    with trio.fail_after(2):
        await emb.wait_all_closed()
    assert lane_idle(served)


async def _in(scope: trio.CancelScope, work: Any) -> None:
    with scope:
        await work


async def test_a_run_timeout_stops_the_upstream_call(
        nursery: trio.Nursery, tmp_path: Path, emb: FakeEmbeddings) -> None:
    served = await start_relay(nursery, config(emb, run_timeout_s=0.3), tmp_path)
    emb.hang = True
    async with http_client() as http:
        started = trio.current_time()
        r = await http.post(served.url + EMBED, json={"model": "emb/e1", "input": "x"})
        took = trio.current_time() - started
    e1(r, 504, "run_timeout")
    assert 0.3 <= took < 3.0
    with trio.fail_after(2):
        await emb.wait_all_closed()  # relay closed the upstream connection
    rec = one(tmp_path)[0]
    assert rec["reason"] == "run_timeout" and rec["attempts"][0]["failure"] == "run_timeout"
    assert lane_idle(served)
