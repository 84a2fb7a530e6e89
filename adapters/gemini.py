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
"""

from __future__ import annotations

import json
import secrets
from typing import Any
from urllib.parse import quote

import attrs

from relay.api.adapter import Capabilities
from relay.api.http import HTTPSettings
from relay.vocab.errors import RelayError, excerpt
from relay.vocab.events import Call, Delta, Event, EventSink, Finish, Skipped, Usage
from relay.vocab.profile import Profile

from .base import upstream_failure
from .cloud import CloudAdapter, data_url, obj, stop_sequences, tool_calls

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
# OpenAI request field → generationConfig field, passed as given.
GENERATION: dict[str, str] = {
    "temperature": "temperature", "top_p": "topP", "top_k": "topK", "seed": "seed",
    "presence_penalty": "presencePenalty", "frequency_penalty": "frequencyPenalty",
    "n": "candidateCount",
}
_TOOL_MODES: dict[str, str] = {"auto": "AUTO", "none": "NONE", "required": "ANY"}
_SIGNATURE = "__ts_"  # in a tool call id: the thought signature follows (urlsafe base64)


@attrs.frozen(kw_only=True)
class GeminiSettings(HTTPSettings):
    pass


def tool_call_id(signature: str | None) -> str:
    """A fresh tool call id carrying Gemini's thought signature, if any. The signature is
    base64; it travels urlsafe and unpadded, so the id stays ``[A-Za-z0-9_-]`` (which
    Anthropic requires of tool ids, should the conversation move there)."""
    base = f"call_{secrets.token_hex(6)}"
    if not signature:
        return base
    return base + _SIGNATURE + signature.replace("+", "-").replace("/", "_").rstrip("=")


def split_tool_call_id(call_id: str) -> str | None:
    """The thought signature inside a tool call id made by `tool_call_id`, or None."""
    _, mark, packed = call_id.partition(_SIGNATURE)
    if not mark or not packed:
        return None
    return packed.replace("-", "+").replace("_", "/") + "=" * (-len(packed) % 4)


# --- request: OpenAI shapes → Gemini ---------------------------------------------------------

def _unsupported(what: str, where: str, param: str = "messages") -> RelayError:
    return RelayError("unsupported", f"the gemini adapter cannot send {what} ({where}); "
                      "remove it or choose another provider", param=param)


def _inline(url: Any, where: str, what: str) -> dict[str, Any]:
    inline = data_url(url) if isinstance(url, str) else None
    if inline is None:
        raise _unsupported(f"{what} that is not a base64 data: URL (Gemini takes inline "
                           "data; relay does not fetch URLs for it)", where)
    return {"inlineData": {"mimeType": inline[0], "data": inline[1]}}


def _parts(content: Any, where: str, *, media: bool) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"text": content}] if content else []
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise RelayError("invalid_request", f"{at}.text must be a string",
                                 param="messages")
            if text:
                out.append({"text": text})
        elif kind == "image_url" and media:
            image = part.get("image_url")
            out.append(_inline(image.get("url") if isinstance(image, dict) else image, at,
                               "an image"))
        elif kind == "file" and media:
            out.append(_inline(obj(part.get("file")).get("file_data"), at, "a file"))
        elif kind == "input_audio" and media:
            audio = obj(part.get("input_audio"))
            fmt, data = audio.get("format"), audio.get("data")
            if not isinstance(fmt, str) or not isinstance(data, str):
                raise RelayError("invalid_request", f"{at}.input_audio needs data and "
                                 "format", param="messages")
            out.append({"inlineData": {"mimeType": f"audio/{fmt}", "data": data}})
        else:
            raise _unsupported(f"a content part of type {kind!r}", at)
    return out


def _add(contents: list[dict[str, Any]], role: str, parts: list[dict[str, Any]]) -> None:
    if not parts:
        return
    if contents and contents[-1]["role"] == role:
        contents[-1]["parts"].extend(parts)
    else:
        contents.append({"role": role, "parts": list(parts)})


def _function_response(message: dict[str, Any], name: str) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    try:
        value = json.loads(content) if isinstance(content, str) else content
    except ValueError:
        value = content
    # A functionResponse's response is an object (a protobuf Struct).
    response = value if isinstance(value, dict) else {"result": value}
    return {"functionResponse": {"name": name, "response": response}}


def _tools(params: dict[str, Any]) -> list[dict[str, Any]]:
    tools = params["tools"]
    if not isinstance(tools, list):
        raise RelayError("invalid_request", "'tools' must be a list", param="tools")
    declarations = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _unsupported("a tool that is not a function", f"tools[{i}]", "tools")
        decl: dict[str, Any] = {"name": fn["name"]}
        if fn.get("description"):
            decl["description"] = fn["description"]
        if fn.get("parameters"):  # JSON Schema as given, not Gemini's OpenAPI subset
            decl["parametersJsonSchema"] = fn["parameters"]
        declarations.append(decl)
    return [{"functionDeclarations": declarations}] if declarations else []


def _tool_config(choice: Any) -> dict[str, Any]:
    if isinstance(choice, str) and choice in _TOOL_MODES:
        return {"functionCallingConfig": {"mode": _TOOL_MODES[choice]}}
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if isinstance(name, str):
        return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [name]}}
    raise RelayError("unsupported", f"tool_choice {choice!r} has no Gemini equivalent; use "
                     "auto, none, required or a function", param="tool_choice")


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"responseMimeType": "application/json"}
    schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt, dict) else None
    if kind == "json_schema" and isinstance(schema, dict):
        return {"responseMimeType": "application/json", "responseJsonSchema": schema}
    raise RelayError("unsupported", f"response_format {fmt!r} has no Gemini equivalent",
                     param="response_format")


def gemini_request(call: Call) -> dict[str, Any]:
    """The ``generateContent`` body for ``call``.

    Raises:
        RelayError: ``unsupported`` (a part or field it cannot send) or
            ``invalid_request`` (tool arguments that are not JSON), naming the field.
    """
    system: list[dict[str, Any]] = []
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id → function name (functionResponse needs it)
    for i, message in enumerate(call.messages):
        where, role = f"messages[{i}]", message.get("role")
        content = message.get("content")
        if role in ("system", "developer"):
            system += _parts(content, where, media=False)
        elif role == "user":
            _add(contents, "user", _parts(content, where, media=True))
        elif role == "assistant":
            parts = _parts(content, where, media=False)
            for call_id, name, args, tc in tool_calls(message, where):
                names[call_id or ""] = name
                part: dict[str, Any] = {"functionCall": {"name": name, "args": args}}
                google = obj(obj(tc.get("extra_content")).get("google"))
                signature = split_tool_call_id(call_id or "") or google.get(
                    "thought_signature")
                if signature:
                    part["thoughtSignature"] = signature
                parts.append(part)
            _add(contents, "model", parts)
        elif role == "tool":
            answers = names.get(str(message.get("tool_call_id"))) or message.get("name")
            if not isinstance(answers, str):
                raise RelayError("invalid_request", f"{where}: tool_call_id "
                                 f"{message.get('tool_call_id')!r} answers no earlier tool "
                                 "call (Gemini needs the function's name)", param="messages")
            _add(contents, "user", [_function_response(message, answers)])
        else:
            raise _unsupported(f"a message with role {role!r}", where)

    params = call.params
    config: dict[str, Any] = {}
    for ours, theirs in GENERATION.items():
        if params.get(ours) is not None:
            config[theirs] = params[ours]
    limit = params.get("max_completion_tokens") or params.get("max_tokens")
    if limit is not None:
        config["maxOutputTokens"] = limit
    stop = params.get("stop")
    if stop is not None:
        config["stopSequences"] = stop_sequences(stop)
    if params.get("response_format") is not None:
        config.update(_response_format(params["response_format"]))
    body: dict[str, Any] = {"contents": contents}
    if system:
        body["systemInstruction"] = {"parts": system}
    if config:
        body["generationConfig"] = config
    if params.get("tools") is not None and (tools := _tools(params)):
        body["tools"] = tools
    if params.get("tool_choice") is not None:
        body["toolConfig"] = _tool_config(params["tool_choice"])
    return body


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
    return Usage(prompt, completion, num("totalTokenCount"))


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
    capabilities = Capabilities(tools=True)
    default_base_url = "https://generativelanguage.googleapis.com/v1beta"
    default_key_env = "GEMINI_API_KEY"
    supported_params = frozenset({
        *GENERATION, "max_tokens", "max_completion_tokens", "stop", "response_format",
        "tools", "tool_choice", "stream_options",
        # An end-user id for the provider's abuse monitoring: Gemini has no such field,
        # and leaving it out changes nothing in the answer (Anthropic clients always
        # send one, as metadata.user_id).
        "user"})
    neutral_params = {"parallel_tool_calls": True, "logprobs": False}

    def key_headers(self, key: str) -> dict[str, str]:
        return {"x-goog-api-key": key}

    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile:
        # rpm 10 fits the free tier's per-model limits; a paid key should raise it.
        return Profile(lanes=8, queue_max=64, queue_timeout_s=60.0, run_timeout_s=600.0,
                       rpm=10.0)

    @classmethod
    def max_call_s(cls, settings: Any) -> float:
        return 300.0  # thinking models take minutes on hard prompts

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        return 15.0

    def check_call(self, call: Call) -> None:
        super().check_call(call)
        gemini_request(call)

    def _url(self, model: str, method: str) -> str:
        path = model if model.startswith(("models/", "tunedModels/")) else f"models/{model}"
        return f"{self.base_url}/{quote(path, safe='/')}:{method}"

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
        body = gemini_request(call)
        reader = CandidateReader(self.name)
        url = self._url(call.model, "streamGenerateContent?alt=sse" if call.stream
                        else "generateContent")
        await self.post(url, body, stream=call.stream,
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
