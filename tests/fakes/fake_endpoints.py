"""Fakes for relay's non-chat endpoints, speaking the real wire formats on loopback.

- `FakeEmbeddings`: an OpenAI-compatible server's ``POST /v1/embeddings`` (float or
  base64, ``dimensions``, usage) and ``GET /v1/models``;
- `CountingAnthropic`: the fake Anthropic API (tests/fakes/fake_anthropic.py) plus
  ``POST /v1/messages/count_tokens``, which refuses the fields Anthropic's counter
  refuses (``max_tokens``, ``stream``, …: "Extra inputs are not permitted");
- `EmbeddingGemini`: the fake Gemini API (tests/fakes/fake_gemini.py) plus
  ``:batchEmbedContents`` (at most 100 requests, each naming the URL's model) and
  ``:countTokens`` (``contents`` or a whole ``generateContentRequest``).

Everything they answer is deterministic: `vector_for` gives a text's vector, and a count
is `count_words` of what was sent (the words of every string, except the values of
``type``, ``role`` and ``model`` keys), so a test knows the exact answer beforehand.
Misbehaviour is scripted with ``status``/``error`` (an error answer), ``gate`` (answer
only once it is set) and ``hang``; `FakeEmbeddings` also with ``answer`` (a 200 body to
send instead of the right one, ``NaN`` and all).
"""

from __future__ import annotations

import base64
import struct
from typing import Any
from urllib.parse import unquote

import trio

from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic
from fakes.fake_anthropic import error_body as anthropic_error
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import FakeGemini
from fakes.fake_gemini import error_body as gemini_error
from fakes.fake_http import Exchange, FakeServer, serve_fake
from fakes.upstream import error_body as openai_error

__all__ = ["COUNT_FIELDS", "CountingAnthropic", "EmbeddingGemini", "FakeEmbeddings",
           "count_words", "serve_counting_anthropic", "serve_embedding_gemini",
           "serve_fake_embeddings", "vector_for"]

DEFAULT_DIMS = 4
SKIPPED_KEYS = {"type", "role", "model"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking",
                "cache_control", "output_config", "mcp_servers", "context_management",
                "speed"}


def vector_for(text: str, dims: int = DEFAULT_DIMS) -> list[float]:
    """A text's vector: ``dims`` numbers in [-0.5, 0.5), most not exact as float32."""
    seed = sum((i + 1) * ord(c) for i, c in enumerate(text)) + len(text)
    return [((seed * (k + 7) * 2654435761) % 1000) / 1000 - 0.5 for k in range(dims)]


def count_words(value: Any) -> int:
    """The words of every string in ``value`` (values of type/role/model keys aside)."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(count_words(v) for v in value)
    if isinstance(value, dict):
        return sum(count_words(v) for k, v in value.items() if k not in SKIPPED_KEYS)
    return 0


class _Scripted:
    """What the three fakes share: an error to answer with, a gate, a hang."""

    status: int = 200
    error: dict[str, Any] | None = None
    gate: trio.Event | None = None
    hang: bool = False

    async def hold(self) -> None:
        if self.hang:
            await trio.sleep_forever()
        if self.gate is not None:
            await self.gate.wait()


class FakeEmbeddings(FakeServer, _Scripted):
    """An OpenAI-compatible embeddings server (``url`` ends in /v1)."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.url = f"{self.base_url}/v1"
        self.models = ["e1", "e2"]
        self.answering = 0  # requests past their body, not yet answered
        self.answer: Any = None

    async def respond(self, ex: Exchange) -> None:
        if ex.method == "GET" and ex.path == "/v1/models":
            await ex.send_json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "fake"} for m in self.models]})
            return
        if ex.method != "POST" or ex.path != "/v1/embeddings":
            await ex.send_json(404, openai_error(404, f"no route {ex.method} {ex.path}"))
            return
        self.answering += 1
        self.notify()
        try:
            await self.hold()
        finally:
            self.answering -= 1
            self.notify()
        if self.status != 200:
            await ex.send_json(self.status, self.error or openai_error(self.status))
            return
        if self.answer is not None:
            await ex.send_json(200, self.answer)
            return
        req = ex.json if isinstance(ex.json, dict) else {}
        raw = req.get("input")
        texts = [raw] if isinstance(raw, str) else list(raw or [])
        if texts and all(isinstance(t, int) for t in texts):
            texts = [texts]
        texts = [t if isinstance(t, str) else " ".join(map(str, t)) for t in texts]
        if not texts or req.get("model") not in self.models:
            await ex.send_json(400, openai_error(400, "input and a known model are required"))
            return
        dims = req.get("dimensions") or DEFAULT_DIMS
        data = []
        for i, text in enumerate(texts):
            vector = vector_for(text, dims)
            embedding: Any = vector
            if req.get("encoding_format") == "base64":
                embedding = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = sum(len(t.split()) for t in texts)
        await ex.send_json(200, {"object": "list", "data": data, "model": req["model"],
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


class CountingAnthropic(FakeAnthropic, _Scripted):
    async def respond(self, ex: Exchange) -> None:
        if ex.path != "/v1/messages/count_tokens" or ex.method != "POST":
            await super().respond(ex)
            return
        if ex.request.headers.get("x-api-key") != ANTHROPIC_KEY:
            await ex.send_json(401, anthropic_error(401, "invalid x-api-key"))
            return
        if "anthropic-version" not in ex.request.headers:
            await ex.send_json(400, anthropic_error(400, "anthropic-version: header is "
                                                    "required"))
            return
        await self.hold()
        if self.status != 200:
            await ex.send_json(self.status, self.error or anthropic_error(self.status))
            return
        req = ex.json if isinstance(ex.json, dict) else {}
        extra = sorted(set(req) - COUNT_FIELDS)
        if extra:
            await ex.send_json(400, anthropic_error(400, f"{extra[0]}: Extra inputs are not "
                                                    "permitted"))
            return
        if not isinstance(req.get("messages"), list) or not isinstance(req.get("model"), str):
            await ex.send_json(400, anthropic_error(400, "messages: Field required"))
            return
        words = sum(count_words(req.get(k)) for k in ("system", "messages", "tools"))
        await ex.send_json(200, {"input_tokens": words})


class EmbeddingGemini(FakeGemini, _Scripted):
    BATCH_LIMIT = 100

    async def respond(self, ex: Exchange) -> None:
        path = unquote(ex.path)
        name, _, method = path.removeprefix("/v1beta/models/").partition(":")
        if ex.method != "POST" or method not in ("batchEmbedContents", "countTokens"):
            await super().respond(ex)
            return
        if ex.request.headers.get("x-goog-api-key") != GEMINI_KEY:
            await ex.send_json(400, gemini_error(400, "API key not valid. Please pass a "
                                                 "valid API key."))
            return
        await self.hold()
        if self.status != 200:
            await ex.send_json(self.status, self.error or gemini_error(self.status))
            return
        req = ex.json if isinstance(ex.json, dict) else {}
        if method == "countTokens":
            inner = req.get("generateContentRequest", req)
            if not inner.get("contents"):
                await ex.send_json(400, gemini_error(400, "contents is not specified"))
                return
            words = sum(count_words(inner.get(k))
                        for k in ("contents", "systemInstruction", "tools"))
            await ex.send_json(200, {"totalTokens": words,
                                     "promptTokensDetails": [{"modality": "TEXT",
                                                              "tokenCount": words}]})
            return
        requests = req.get("requests")
        if not isinstance(requests, list) or not requests:
            await ex.send_json(400, gemini_error(400, "* requests: required"))
            return
        if len(requests) > self.BATCH_LIMIT:
            await ex.send_json(400, gemini_error(400, f"* BatchEmbedContentsRequest.requests:"
                                                 f" at most {self.BATCH_LIMIT} requests can "
                                                 "be in one batch"))
            return
        out = []
        for i, item in enumerate(requests):
            if item.get("model") != f"models/{name}":
                await ex.send_json(400, gemini_error(400, f"* requests[{i}].model: must be "
                                                     f"models/{name}, as in the URL"))
                return
            text = "".join(p.get("text", "") for p in item["content"]["parts"])
            out.append({"values": vector_for(text, item.get("outputDimensionality")
                                             or DEFAULT_DIMS)})
        await ex.send_json(200, {"embeddings": out})


async def serve_fake_embeddings(
        *, task_status: trio.TaskStatus[FakeEmbeddings] = trio.TASK_STATUS_IGNORED) -> None:
    await serve_fake(FakeEmbeddings, task_status=task_status)


async def serve_counting_anthropic(
        *, task_status: trio.TaskStatus[CountingAnthropic] = trio.TASK_STATUS_IGNORED
) -> None:
    await serve_fake(CountingAnthropic, task_status=task_status)


async def serve_embedding_gemini(
        *, task_status: trio.TaskStatus[EmbeddingGemini] = trio.TASK_STATUS_IGNORED) -> None:
    await serve_fake(EmbeddingGemini, task_status=task_status)
