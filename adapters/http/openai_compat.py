"""Any OpenAI-compatible server: OpenAI, NVIDIA, DashScope (Qwen), LM Studio, Ollama, vLLM.

The request goes upstream as the client sent it (fields relay does not interpret pass
through, SPEC A1), with the model rewritten to the provider's own name. A request from
another dialect (Messages) arrives translated into chat terms; its own fields never come
here (SPEC A1a: `relay.api.fields`). A streamed answer
is read line by line from ``async with client.stream(...)``, so a stop — client gone, run
timeout, shutdown — leaves that block and closes the upstream connection at once, and a
local server stops generating (no ghost queue, SPEC C2).

What counts as complete (SPEC E4): a finish_reason for every choice. A stream that ends
before it is ``stream_cut``; one whose finish came but whose ``[DONE]`` did not is
complete; an event that is not JSON is skipped and reported as skipped. Streams are read
by the one SSE reader every HTTP adapter shares (`HTTPAdapter.read_sse`), bodies through
relay's bounded reader (SPEC O5).

Embeddings (SPEC A8): ``POST {base_url}/embeddings`` with the client's fields as they
came, the model rewritten and ``encoding_format`` always ``float`` (every
OpenAI-compatible server speaks it; relay encodes base64 for the client itself).

Presets (SPEC L4) fill the base URL, the key's variable and a profile fitting the kind of
server; the file overrides any of them.

A server that speaks OpenAI's Responses API itself (``responses = true``; the default for
the ``openai`` preset, SPEC 9) is given a ``/v1/responses`` request as the client sent it,
at its own ``/responses`` (`adapters._responses`); every other request, and every request
to a server without it, goes to ``/chat/completions`` (SPEC A7).
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

from relay.api.adapter import Capabilities, EmbedCall, Embeddings
from relay.api.fields import CHAT_FIELDS, PASSED, column
from relay.api.http import HTTPSettings
from relay.vocab.errors import RelayError, excerpt
from relay.vocab.events import Call, Delta, EventSink, Finish, Skipped, Usage
from relay.vocab.profile import Profile

from .base import HTTPAdapter, upstream_failure
from .responses import ResponsesReader
from .whole import count_of, post_json, unreadable, vector_of

__all__ = ["PRESETS", "OpenAIAdapter", "OpenAISettings", "Preset"]


@attrs.frozen
class Preset:
    base_url: str
    profile: Profile
    api_key_env: str | None = None
    max_call_s: float = 120.0  # run_timeout_s may not be set below this
    typical_call_s: float = 10.0
    server: str | None = None  # a local server: what to start when nothing listens


_LOCAL_ONE = Profile(lanes=1, queue_max=16, queue_timeout_s=300.0, run_timeout_s=180.0)
PRESETS: dict[str, Preset] = {
    # Local servers answer one request at a time on one GPU; calls can take minutes.
    "lmstudio": Preset("http://127.0.0.1:1234/v1", _LOCAL_ONE, typical_call_s=20.0,
                       server="LM Studio's server"),
    "ollama": Preset("http://127.0.0.1:11434/v1",
                     attrs.evolve(_LOCAL_ONE, run_timeout_s=300.0), typical_call_s=20.0,
                     server="Ollama (`ollama serve`)"),
    "vllm": Preset("http://127.0.0.1:8000/v1",
                   Profile(lanes=8, queue_max=64, queue_timeout_s=120.0, run_timeout_s=300.0),
                   server="the vLLM server (`vllm serve MODEL`)"),
    # Clouds take many requests at once but meter them; until a model has answered once
    # (its headers tell its limits), 2 of its requests run at once (SPEC L12a).
    "openai": Preset("https://api.openai.com/v1",
                     Profile(lanes=8, queue_max=64, queue_timeout_s=60.0, run_timeout_s=600.0,
                             rpm=500.0, first_starts=2), api_key_env="OPENAI_API_KEY"),
    "nvidia": Preset("https://integrate.api.nvidia.com/v1",
                     Profile(lanes=4, queue_max=32, queue_timeout_s=120.0, run_timeout_s=300.0,
                             rpm=40.0, first_starts=2), api_key_env="NVIDIA_API_KEY"),
    "dashscope": Preset("https://dashscope-intl.aliyuncs.com/compatible-mode/v1",
                        Profile(lanes=8, queue_max=64, queue_timeout_s=60.0,
                                run_timeout_s=300.0, rpm=60.0, first_starts=2),
                        api_key_env="DASHSCOPE_API_KEY"),
}


@attrs.frozen(kw_only=True)
class OpenAISettings(HTTPSettings):
    preset: str | None = None
    # The server speaks /v1/responses itself: pass those requests through. None: true
    # for the ``openai`` preset, false otherwise.
    responses: bool | None = None


class OpenAIAdapter(HTTPAdapter):
    kind = "openai"
    Settings = OpenAISettings
    # (vision, thinking: as the model behind it can; the kind cannot tell which it is)
    capabilities = Capabilities(tools=True, embeddings=True, vision=True, thinking=True)
    # It speaks OpenAI chat: every chat-level field passes, known or not (SPEC A1a).
    fields = column(speaks="openai", unknown=PASSED, passed=CHAT_FIELDS)

    def __init__(self, provider: Any) -> None:
        super().__init__(provider)
        preset = PRESETS.get(self.settings.preset or "")
        base = self.settings.base_url or (preset.base_url if preset else "")
        self.base_url = base.rstrip("/")
        self.key_env: str | None = self.key_env_for(self.settings)
        self.headers: dict[str, str] = {"user-agent": "relay"}
        key = os.environ.get(self.key_env) if self.key_env else None
        if key:
            self.headers["authorization"] = f"Bearer {key}"
        self.headers.update(self.settings.headers)
        self.key_missing = bool(self.key_env) and not key
        if self.speaks_responses(self.settings):
            self.capabilities = Capabilities(tools=True, responses=True, vision=True,
                                             thinking=True)

    @classmethod
    def speaks_responses(cls, settings: Any) -> bool:
        if settings.responses is not None:
            return bool(settings.responses)
        return bool(settings.preset == "openai")

    @classmethod
    def _preset(cls, settings: Any) -> Preset | None:
        return PRESETS.get(settings.preset or "")

    def unreachable_action(self) -> str | None:
        """A local server's preset says what to start (issue 15: the packaged default's
        LM Studio and Ollama entries, which most first runs have neither of)."""
        preset = self._preset(self.settings)
        if preset is None or preset.server is None:
            return None
        return f"start {preset.server}, or remove [providers.{self.name}] from the config"

    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile | None:
        preset = cls._preset(settings)
        return preset.profile if preset else None

    @classmethod
    def key_env_for(cls, settings: Any) -> str | None:
        preset = cls._preset(settings)
        return settings.api_key_env or (
            preset.api_key_env if preset else None)

    @classmethod
    def max_call_s(cls, settings: Any) -> float:
        preset = cls._preset(settings)
        return preset.max_call_s if preset else 0.0

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        preset = cls._preset(settings)
        return preset.typical_call_s if preset else 10.0

    @classmethod
    def describe_settings(cls, settings: Any) -> str:
        preset = cls._preset(settings)
        base = settings.base_url or (preset.base_url if preset else "?")
        key = settings.api_key_env or (preset.api_key_env if preset else None)
        proxy = f", proxy {settings.proxy}" if settings.proxy else ""
        responses = ", /v1/responses passed through" if cls.speaks_responses(settings) else ""
        return f"base_url {base}, key from {key or '(none)'}{proxy}{responses}"

    @classmethod
    def settings_problems(cls, settings: Any) -> list[tuple[str, str]]:
        problems = []
        if settings.preset is not None and settings.preset not in PRESETS:
            problems.append(("preset", f"unknown preset {settings.preset!r}; known: "
                             f"{', '.join(PRESETS)}"))
        elif settings.preset is None and not settings.base_url:
            problems.append(("base_url", "missing: give base_url, or a preset "
                             f"({', '.join(PRESETS)})"))
        url = settings.base_url or ""
        if url and not url.startswith(("http://", "https://")):
            problems.append(("base_url", f"must start with http:// or https://: {url!r}"))
        return problems

    async def models(self) -> list[str]:
        if self.provider.models_configured:
            return list(self.provider.models)
        text = await self.get_text(f"{self.base_url}/models", "model list")
        try:
            return [str(m["id"]) for m in json.loads(text)["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise RelayError("bad_upstream_response", f"provider {self.name!r} sent a model "
                             f"list relay cannot read: {excerpt(text, 200)!r}",
                             provider=self.name) from exc

    async def run(self, call: Call, events: EventSink) -> None:
        self.refuse_without_key()
        events = self.bounded(events)
        if call.responses is not None and self.capabilities.responses:
            await self._pass_responses(call, events)
            return
        body = {**call.params, "model": call.model, "messages": call.messages,
                "stream": call.stream}
        if call.stream:  # ask for usage always: the record wants it
            body["stream_options"] = {**(call.params.get("stream_options") or {}),
                                      "include_usage": True}
        await self.post(f"{self.base_url}/chat/completions", body, stream=call.stream,
                        events=events,
                        read_stream=lambda resp: self._read_stream(resp, events),
                        read_whole=lambda text: self._emit_whole(text, events))

    async def _pass_responses(self, call: Call, events: EventSink) -> None:
        assert call.responses is not None
        body = {**call.responses, "model": call.model, "stream": call.stream}
        reader = ResponsesReader(self.name, events,
                                 lambda err: _inband_error(self.name, err))
        await self.post(f"{self.base_url}/responses", body, stream=call.stream,
                        events=events,
                        read_stream=lambda resp: self.read_sse(
                            resp, reader.event, complete=lambda: reader.final),
                        read_whole=reader.whole)

    async def embed(self, call: EmbedCall) -> Embeddings:
        self.refuse_without_key()
        body = {**call.params, "model": call.model, "input": call.inputs,
                "encoding_format": "float"}
        answer = await post_json(self, f"{self.base_url}/embeddings", body,
                                 "an embeddings answer")
        data = answer.get("data")
        vectors: dict[int, list[float]] = {}
        for position, item in enumerate(data if isinstance(data, list) else ()):
            index = item.get("index", position) if isinstance(item, dict) else None
            vector = vector_of(item.get("embedding")) if isinstance(item, dict) else None
            if type(index) is not int or vector is None or index in vectors:
                break
            vectors[index] = vector
        if sorted(vectors) != list(range(len(call.inputs))):
            raise unreadable(self.name, f"an embeddings answer that is not one vector for "
                             f"each of the {len(call.inputs)} inputs", json.dumps(answer))
        usage = answer.get("usage")
        tokens = count_of(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
        return Embeddings(vectors=[vectors[i] for i in range(len(call.inputs))],
                          prompt_tokens=tokens)

    async def _read_stream(self, resp: Any, events: EventSink) -> None:
        open_choices: set[int] = set()
        finished: set[int] = set()

        async def handle(name: str | None, data: str) -> bool:
            return await self._event(data, events, open_choices, finished)

        await self.read_sse(resp, handle,
                            complete=lambda: bool(open_choices) and open_choices <= finished)

    async def _event(self, data: str, events: EventSink, open_choices: set[int],
                     finished: set[int]) -> bool:
        """One SSE event's data; True at ``[DONE]``. (A method, not a closure that calls
        itself: a closure over itself is a reference cycle, and every stream's sink and
        channel would wait for the cycle collector.)"""
        if data.strip() == "[DONE]":
            return True  # the rest of the body is drained, bounded
        try:
            chunk = json.loads(data)
        except ValueError:
            if "\n" in data:  # a server that leaves out the blank line between events
                for line in data.split("\n"):
                    if line.strip() and await self._event(line, events, open_choices,
                                                          finished):
                        return True
                return False
            await events.send(Skipped(f"not JSON: {excerpt(data, 120)!r}"))
            return False
        if not isinstance(chunk, dict):
            await events.send(Skipped(f"not an object: {excerpt(data, 120)!r}"))
            return False
        await self._chunk(chunk, events, open_choices, finished)
        return False

    async def _chunk(self, chunk: dict[str, Any], events: EventSink, open_choices: set[int],
                     finished: set[int]) -> None:
        if "error" in chunk:
            raise _inband_error(self.name, chunk["error"])
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            open_choices.add(index)
            delta = choice.get("delta") or {}
            content = delta.get("content")
            tools = delta.get("tool_calls")
            extra = {k: val for k, val in delta.items() if val is not None
                     and k not in ("role", "content", "tool_calls")}
            if content or tools or extra:
                await events.send(Delta(content=content or None, tool_calls=tools,
                                        extra=extra or None, index=index))
            reason = choice.get("finish_reason")
            if reason:
                finished.add(index)
                await events.send(Finish(reason, index))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            await events.send(_usage(usage))

    async def _emit_whole(self, text: str, events: EventSink) -> None:
        try:
            body = json.loads(text)
            choices = body["choices"]
            if not isinstance(choices, list) or not choices:
                raise ValueError("no choices")
        except (ValueError, KeyError, TypeError) as exc:
            raise RelayError("bad_upstream_response", f"provider {self.name!r} sent an "
                             f"answer relay cannot read: {excerpt(text, 300)!r}",
                             provider=self.name, upstream_message=text) from exc
        for choice in choices:
            index = choice.get("index", 0)
            message = choice.get("message") or {}
            tools = message.get("tool_calls")
            if tools:
                tools = [{"index": i, **tc} for i, tc in enumerate(tools)]
            extra = {k: val for k, val in message.items()
                     if k not in ("role", "content", "tool_calls") and val is not None}
            await events.send(Delta(content=message.get("content"), tool_calls=tools,
                                    extra=extra or None, index=index))
            reason = choice.get("finish_reason")
            if not reason:
                raise RelayError("bad_upstream_response", f"provider {self.name!r} sent an "
                                 "answer without a finish_reason", provider=self.name)
            await events.send(Finish(reason, index))
        if isinstance(body.get("usage"), dict):
            await events.send(_usage(body["usage"]))


def _usage(raw: dict[str, Any]) -> Usage:
    """OpenAI's usage: ``prompt_tokens`` counts the cached ones too, and
    ``prompt_tokens_details.cached_tokens`` says how many were read from the cache
    (SPEC L12a)."""
    def num(key: str) -> int | None:
        val = raw.get(key)
        return val if isinstance(val, int) and not isinstance(val, bool) else None
    details = raw.get("prompt_tokens_details")
    cached = count_of(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(num("prompt_tokens"), num("completion_tokens"), num("total_tokens"),
                 cache_read_tokens=cached)


# An error inside a 200 stream carries no HTTP status: the one its type or code stands for.
_INBAND_STATUS = {
    "invalid_request_error": 400, "context_length_exceeded": 400,
    "content_policy_violation": 400, "content_filter": 400,
    "authentication_error": 401, "invalid_api_key": 401, "permission_error": 403,
    "not_found_error": 404, "model_not_found": 404,
    "rate_limit_error": 429, "rate_limit_exceeded": 429, "insufficient_quota": 429,
}


def _inband_error(provider: str, err: Any) -> RelayError:
    """Classify an error event inside a stream like the same error as an answer (a
    content refusal stays ``rejected``, an auth failure ``auth_required``…)."""
    fields = err if isinstance(err, dict) else {"message": str(err)}
    status = fields.get("status") or fields.get("code")
    if not isinstance(status, int) or isinstance(status, bool):
        status = next((_INBAND_STATUS[k] for k in (fields.get("code"), fields.get("type"))
                       if isinstance(k, str) and k in _INBAND_STATUS), 500)
    return upstream_failure(provider, status, json.dumps({"error": fields}), {},
                            in_stream=True)
