"""Google's Gemini API (``models/{model}:generateContent`` and
``:streamGenerateContent?alt=sse``), behind relay's OpenAI shapes.

Theory of operation. As in the ``anthropic`` adapter, a pure function
(`gemini_request`) translates a `Call` — so `check_call` refuses what it cannot send
before anything is queued — and a sans-IO reader (`CandidateReader`) turns each
``GenerateContentResponse`` (a stream chunk, or the whole answer) into relay events.

Requests: system and developer messages become ``systemInstruction``; user turns
``user`` and assistant turns ``model`` contents; parts are text, and ``inlineData`` from
``data:`` URLs (images, PDFs, ``input_audio``). Gemini cannot fetch an http(s) image for
relay, so such a part is refused (``unsupported``), never dropped. Assistant
``tool_calls`` become ``functionCall`` parts and ``tool`` messages ``functionResponse``
parts (named from the call they answer). Gemini's thought signatures — which Gemini 3
requires back with each function call of the current turn — travel inside the tool
call's id (`tool_call_id`), so any OpenAI client that echoes ids round-trips them.
Generation fields map by `GENERATION` (``max_tokens`` → ``maxOutputTokens``, ``stop`` →
``stopSequences``, ``n`` → ``candidateCount``…); JSON response formats map to
``responseMimeType`` / ``responseJsonSchema``; ``user`` (an end-user id for abuse
monitoring, which Gemini has no field for) is accepted and not sent.

Answers: text parts → content (``thought`` parts → ``reasoning_content``),
``functionCall`` parts → whole tool-call deltas, ``usageMetadata`` → usage,
``finishReason`` by `FINISH_REASONS` (MAX_TOKENS is ``length``); a finish in `REFUSALS`
(SAFETY, RECITATION, …) or a ``promptFeedback.blockReason`` is ``rejected`` with the
reason in its message, one in `BROKEN` is ``bad_upstream_response``. A stream is
complete once every candidate it opened has a finish reason; one that ends before is
``stream_cut``.

Embeddings (SPEC A8): ``:batchEmbedContents``, at most `EMBED_BATCH` texts a request
(more are sent in order, in several); ``dimensions`` → ``outputDimensionality``; ``user``
is dropped and reported, as for chat; token-id inputs and other fields are
``unsupported``. Token counts (SPEC A6): ``:countTokens`` with the whole
``generateContentRequest`` the answer would have had (system instruction and tools
count), its ``totalTokens``.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import attrs

from relay.api.adapter import Capabilities, EmbedCall, Embeddings
from relay.api.fields import ACCOUNTING, EFFORT, LIMITS, REFUSED, SAMPLING, Rule, column
from relay.api.http import HTTPSettings
from relay.vocab.errors import RelayError, excerpt
from relay.vocab.events import Call, Delta, Event, EventSink, Finish, Skipped, Usage
from relay.vocab.profile import Profile

from .base import upstream_failure
from .cloud import CloudAdapter
from .gemini_request import (
    GENERATION,
    gemini_request,
    native_request,
    split_tool_call_id,
    tool_call_id,
)
from .whole import count_of, post_json, unreadable, vector_of

__all__ = ["BROKEN", "FINISH_REASONS", "GENERATION", "REFUSALS", "CandidateReader",
           "GeminiAdapter", "GeminiSettings", "gemini_request", "split_tool_call_id",
           "tool_call_id"]

FINISH_REASONS: dict[str, str] = {"STOP": "stop", "MAX_TOKENS": "length"}
# A finish that means Gemini refused or withheld the answer: the client gets the reason.
REFUSALS: dict[str, str] = {
    "SAFETY": "the answer was blocked by Gemini's safety filters",
    "RECITATION": "the answer was stopped because it recited training data",
    "BLOCKLIST": "the answer contained terms from a blocklist",
    "PROHIBITED_CONTENT": "the answer was blocked as prohibited content",
    "SPII": "the answer contained sensitive personal information",
    "IMAGE_SAFETY": "the generated image was blocked by Gemini's safety filters",
    "LANGUAGE": "the answer was in a language Gemini does not support",
}
# A finish that means the answer is broken (not the client's fault, not complete).
BROKEN: dict[str, str] = {
    "MALFORMED_FUNCTION_CALL": "the model produced a function call Gemini could not parse",
    "UNEXPECTED_TOOL_CALL": "the model called a tool that was not offered",
    "TOO_MANY_TOOL_CALLS": "the model made too many tool calls",
    "MISSING_THOUGHT_SIGNATURE": "a function call was sent back without its thought "
                                 "signature",
    "OTHER": "Gemini stopped for an unspecified reason",
    "FINISH_REASON_UNSPECIFIED": "Gemini stopped for an unspecified reason",
}
EMBED_BATCH = 100  # texts in one batchEmbedContents request (Gemini's own limit)


@attrs.frozen(kw_only=True)
class GeminiSettings(HTTPSettings):
    pass


# --- answer: Gemini → relay events -----------------------------------------------------------

def usage_of(raw: Any) -> Usage:
    raw = raw if isinstance(raw, dict) else {}

    def num(key: str) -> int | None:
        val = raw.get(key)
        return val if isinstance(val, int) and not isinstance(val, bool) else None

    prompt = num("promptTokenCount")
    answer, thoughts = num("candidatesTokenCount"), num("thoughtsTokenCount")
    completion = None if answer is None and thoughts is None else (answer or 0) + (
        thoughts or 0)
    # promptTokenCount counts the cached ones too; cachedContentTokenCount says how many
    # (SPEC L12a).
    return Usage(prompt, completion, num("totalTokenCount"),
                 cache_read_tokens=count_of(raw.get("cachedContentTokenCount")))


class CandidateReader:
    """``GenerateContentResponse`` objects → relay events, without I/O."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.opened: set[int] = set()
        self.finished: set[int] = set()
        self.tools: dict[int, int] = {}  # candidate index → tool calls so far

    @property
    def complete(self) -> bool:
        return bool(self.opened) and self.opened <= self.finished

    def _refused(self, what: str, reason: str, detail: Any) -> RelayError:
        words = f"{what} ({reason})"
        return RelayError("rejected", f"provider {self.provider!r} refused: {words}",
                          provider=self.provider, upstream_message=json.dumps(detail))

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """One response object (a stream chunk or the whole answer).

        Raises:
            RelayError: ``rejected`` (a blocked prompt, a refused answer),
                ``bad_upstream_response`` (a broken finish), or the mapped failure of an
                error object inside the stream.
        """
        if isinstance(chunk.get("error"), dict):
            err = chunk["error"]
            status = err.get("code") if isinstance(err.get("code"), int) else 500
            raise upstream_failure(self.provider, status, json.dumps(chunk), {},
                                   in_stream=True)
        feedback = chunk.get("promptFeedback") or {}
        if feedback.get("blockReason"):
            reason = str(feedback["blockReason"])
            why = feedback.get("blockReasonMessage") or REFUSALS.get(reason, "blocked")
            raise self._refused(f"the prompt was blocked: {why}", reason, feedback)
        out: list[Event] = []
        finishes: list[Event] = []
        for cand in chunk.get("candidates") or ():
            index = int(cand.get("index", 0))
            self.opened.add(index)
            for part in (cand.get("content") or {}).get("parts") or ():
                out += self._part(index, part)
            reason = cand.get("finishReason")
            if reason and index not in self.finished:
                finishes.append(self._finish(index, str(reason), cand))
        if isinstance(chunk.get("usageMetadata"), dict):
            out.append(usage_of(chunk["usageMetadata"]))
        return out + finishes

    def _part(self, index: int, part: dict[str, Any]) -> list[Event]:
        if isinstance(part.get("text"), str):
            if not part["text"]:
                return []
            if part.get("thought"):
                return [Delta(extra={"reasoning_content": part["text"]}, index=index)]
            return [Delta(content=part["text"], index=index)]
        call = part.get("functionCall")
        if isinstance(call, dict):
            ordinal = self.tools[index] = self.tools.get(index, 0) + 1
            return [Delta(tool_calls=[{
                "index": ordinal - 1, "id": tool_call_id(part.get("thoughtSignature")),
                "type": "function", "function": {
                    "name": call.get("name"), "arguments": json.dumps(call.get("args") or {})}
            }], index=index)]
        kinds = ", ".join(sorted(k for k in part if k != "thoughtSignature")) or "empty"
        return [] if kinds == "empty" else [Skipped(f"a part of kind {kinds} not relayed")]

    def _finish(self, index: int, reason: str, cand: dict[str, Any]) -> Finish:
        if reason in REFUSALS:
            raise self._refused(REFUSALS[reason], reason, cand.get("safetyRatings") or cand)
        if reason in BROKEN or reason not in FINISH_REASONS:
            words = BROKEN.get(reason, f"unknown finishReason {reason!r}")
            raise RelayError("bad_upstream_response", f"provider {self.provider!r}: {words} "
                             f"(finishReason {reason})", provider=self.provider,
                             upstream_message=cand.get("finishMessage") or reason)
        self.finished.add(index)
        finish = FINISH_REASONS[reason]
        if finish == "stop" and self.tools.get(index):
            finish = "tool_calls"
        return Finish(finish, index)


# --- the adapter --------------------------------------------------------------------------

class GeminiAdapter(CloudAdapter):
    kind = "gemini"
    Settings = GeminiSettings
    # Gemini does not reliably continue a final model turn: no prefill.
    capabilities = Capabilities(tools=True, embeddings=True, count_tokens=True, vision=True,
                                thinking=True, context_tokens=1_048_576)
    default_base_url = "https://generativelanguage.googleapis.com/v1beta"
    default_key_env = "GEMINI_API_KEY"
    # SPEC A1a: generation settings, limits, stops, JSON modes and tools are translated;
    # Gemini calls tools in parallel anyway (parallel_tool_calls: true asks nothing).
    fields = column(
        speaks="gemini",  # a Gemini request (SPEC A9) passes, unchanged
        translated=(*SAMPLING, "n", *LIMITS, "stop", "response_format", "tools",
                    "tool_choice", "stream_options"),
        advisory=(*EFFORT, *ACCOUNTING),
        refused=("functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
                 "modalities", "audio", "web_search_options", "moderation"),
        rules={"parallel_tool_calls": Rule(REFUSED, neutral=lambda value, _: value is True)})

    def key_headers(self, key: str) -> dict[str, str]:
        return {"x-goog-api-key": key}

    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile:
        # rpm 10 fits the free tier's per-model limits; a paid key should raise it.
        return Profile(lanes=8, queue_max=64, queue_timeout_s=60.0, run_timeout_s=600.0,
                       rpm=10.0, first_starts=2)  # (2 until a model's first answer, L12a)

    @classmethod
    def max_call_s(cls, settings: Any) -> float:
        return 300.0  # thinking models take minutes on hard prompts

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        return 15.0

    def check_request(self, call: Call) -> None:
        if native_request(call) is None:
            gemini_request(call)

    @staticmethod
    def _path(model: str) -> str:
        return model if model.startswith(("models/", "tunedModels/")) else f"models/{model}"

    def _url(self, model: str, method: str) -> str:
        return f"{self.base_url}/{quote(self._path(model), safe='/')}:{method}"

    # --- embeddings and token counts ------------------------------------------------------
    def check_embed(self, call: EmbedCall) -> None:
        if not all(isinstance(item, str) for item in call.inputs):
            raise RelayError("unsupported", f"provider {self.name!r} (gemini) embeds texts, "
                             "not token ids; send the texts", provider=self.name,
                             param="input")
        for key, value in call.params.items():
            if value is None or key == "user":
                continue
            if key != "dimensions":
                raise RelayError("unsupported", f"provider {self.name!r} (gemini) cannot "
                                 f"honour the embeddings field {key!r}; remove it or choose "
                                 "another provider", provider=self.name, param=key)
            if type(value) is not int or value < 1:
                raise RelayError("invalid_request", "'dimensions' must be a whole number "
                                 "of at least 1", param="dimensions")

    async def embed(self, call: EmbedCall) -> Embeddings:
        self.refuse_without_key()
        self.check_embed(call)
        extra: dict[str, Any] = {}
        if call.params.get("dimensions") is not None:
            extra["outputDimensionality"] = call.params["dimensions"]
        vectors: list[list[float]] = []
        url = self._url(call.model, "batchEmbedContents")
        for start in range(0, len(call.inputs), EMBED_BATCH):
            texts = call.inputs[start:start + EMBED_BATCH]
            body = {"requests": [{"model": self._path(call.model), **extra,
                                  "content": {"parts": [{"text": text}]}} for text in texts]}
            answer = await post_json(self, url, body, "an embeddings answer")
            got = answer.get("embeddings")
            batch = [vector_of(e.get("values")) if isinstance(e, dict) else None
                     for e in (got if isinstance(got, list) else ())]
            if len(batch) != len(texts) or any(v is None for v in batch):
                raise unreadable(self.name, f"an embeddings answer that is not one vector "
                                 f"for each of the {len(texts)} texts", json.dumps(answer))
            vectors += [v for v in batch if v is not None]
        ignored = ("user",) if call.params.get("user") is not None else ()
        return Embeddings(vectors=vectors, ignored=ignored)

    async def count_tokens(self, call: Call) -> int:
        self.refuse_without_key()
        request = native_request(call) or gemini_request(call)
        request.pop("generationConfig", None)  # how to answer: it adds no input tokens
        body = {"generateContentRequest": {"model": self._path(call.model), **request}}
        answer = await post_json(self, self._url(call.model, "countTokens"), body,
                                 "a token count")
        total = count_of(answer.get("totalTokens"))
        if total is None:
            raise unreadable(self.name, "a token count without totalTokens",
                             json.dumps(answer))
        return total

    async def models(self) -> list[str]:
        if self.provider.models_configured:
            return list(self.provider.models)
        names: list[str] = []
        token = ""
        for _ in range(20):
            page = await self.get_json(f"{self.base_url}/models?pageSize=1000{token}",
                                       "model list")
            try:
                for model in page.get("models") or ():
                    methods = model.get("supportedGenerationMethods")
                    if methods is None or "generateContent" in methods:
                        names.append(str(model["name"]).removeprefix("models/"))
                nxt = page.get("nextPageToken")
            except (KeyError, TypeError, AttributeError) as exc:
                raise self.unreadable("a model list", json.dumps(page)) from exc
            if not nxt:
                break
            token = f"&pageToken={quote(str(nxt))}"
        return names

    async def run(self, call: Call, events: EventSink) -> None:
        self.refuse_without_key()
        events = self.bounded(events)
        body = native_request(call) or gemini_request(call)
        reader = CandidateReader(self.name)
        url = self._url(call.model, "streamGenerateContent?alt=sse" if call.stream
                        else "generateContent")
        await self.post(url, body, stream=call.stream, events=events,
                        read_stream=lambda resp: self._read_stream(resp, reader, events),
                        read_whole=lambda text: self._emit_whole(text, reader, events))

    async def _read_stream(self, resp: Any, reader: CandidateReader,
                           events: EventSink) -> None:
        async def handle(name: str | None, data: str) -> bool:
            try:
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError("not an object")
            except ValueError:
                await events.send(Skipped(f"not JSON: {excerpt(data, 120)!r}"))
                return False
            for out in reader.feed(chunk):
                await events.send(out)
            return reader.complete

        await self.read_sse(resp, handle)

    async def _emit_whole(self, text: str, reader: CandidateReader,
                          events: EventSink) -> None:
        try:
            answer = json.loads(text)
            if not isinstance(answer, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise self.unreadable("an answer", text) from exc
        for out in reader.feed(answer):
            await events.send(out)
        if not reader.complete:
            raise self.unreadable("an answer without a finished candidate", text)
