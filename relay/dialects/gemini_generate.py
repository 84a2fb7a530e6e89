"""The Gemini dialect: what clients of Google's Gemini API send to
``/v1beta/models/{model}:generateContent`` (and ``:streamGenerateContent``,
``:countTokens``) and what they get back (SPEC A9), for any provider behind relay.

A request is checked first against `relay.dialects.schemas.GEMINI_SCHEMA`
(`relay.dialects.typed.check`, as every front's: every field's type and range, a 400
naming each bad field's path — ``generationConfig.topK``,
``contents[2].parts[0].functionCall.args`` — in Google's shape, the path also in the
error's ``relay.param``), then structured (`structure`: what a schema cannot say), then
translated into relay's own `ChatInput` (OpenAI's message shapes), so the same queue,
lanes, fallbacks and adapters serve it. The model and whether it streams come from the path, not the
body. Translation tables:

=======================================  ==================================================
Gemini request                           relay (OpenAI shapes)
=======================================  ==================================================
``systemInstruction`` (text parts)       a ``system`` message (parts joined by newlines)
``contents[]`` role ``user`` / ``model``  ``user`` / ``assistant`` messages
``text`` / ``inlineData`` / ``fileData``  text / ``image_url`` (data: URL, or the file's URI)
                                         for images, ``file`` parts for the rest
``functionCall`` (model)                 ``tool_calls`` (JSON ``arguments``; its ``id``, or
                                         one relay makes)
``functionResponse`` (user)              a ``tool`` message answering the call of the same
                                         ``id``, else the earliest unanswered one of that name
``tools[].functionDeclarations``         function tools (``parametersJsonSchema`` as is;
                                         ``parameters``, Google's OpenAPI subset, as JSON
                                         Schema: lower-case types, ``nullable``)
``toolConfig.functionCallingConfig``     ``tool_choice``: AUTO→auto, ANY→required (one
                                         allowed name: that function), NONE→none;
                                         ``allowedFunctionNames`` keeps only those tools
``generationConfig``: ``temperature``, ``topP``, ``topK``, ``maxOutputTokens``,
``stopSequences``, ``seed``, ``presencePenalty``, ``frequencyPenalty`` → the chat-level
params (named back to the client by their Gemini names); ``responseMimeType``
``application/json`` (with ``responseSchema`` / ``responseJsonSchema``) →
``response_format``, checked by each provider's column as chat's is; ``responseLogprobs``
→ ``logprobs``; ``candidateCount`` above 1 is refused (one answer per request).
=======================================  ==================================================

Field names are taken in lowerCamelCase and snake_case alike, as Google's API takes
them (proto3 JSON: ``parameters_json_schema`` is ``parametersJsonSchema``), and read in
lowerCamelCase from then on; a name Google's API does not have is a 400 worded as
Google's (``Invalid JSON payload received. Unknown name "bogusField": Cannot find
field.``), never dropped (`relay.dialects.gemini_structure.known_names`).

Everything else is the dialect's own (SPEC A1a; `relay.api.fields.OWN_FIELDS`):
``generationConfig.thinkingConfig``, ``safetySettings``, thought parts and signatures
passed back, ``cachedContent``, Google's built-in tools (``googleSearch``, …) — they go in
the call's `relay.vocab.events.Inbound` with the request itself (names in
lowerCamelCase), so the ``gemini`` adapter gets the request unchanged (native) and every
other provider has them dropped and reported, or refused, by its column.
"""

from __future__ import annotations

import json
import math
from typing import Any

from relay.dialects.base import ChatInput
from relay.dialects.openai_chat import load_json
from relay.dialects.openai_embeddings import EmbeddingsInput
from relay.vocab.errors import RelayError
from relay.vocab.events import Inbound

from .gemini_render import GeminiRender
from .gemini_structure import (
    GENERATION,
    MODES,
    GeminiRequest,
    known_names,
    openapi_schema,
    structure,
)
from .schemas import GEMINI_SCHEMA, GPARTS
from .typed import INT_MAX, Arr, Int, Obj, Schema, Str, check

__all__ = ["GEMINI", "GEMINI_SDK", "GeminiDialect", "parse_gemini_body",
           "parse_gemini_embed", "render_gemini_embeddings"]

# --- translation: GeminiRequest → relay ----------------------------------------------------

def _media(mime: str, url: str) -> dict[str, Any]:
    if mime.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": "file", "file": {"file_data": url, "filename": "file"}}


def _messages(request: GeminiRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        messages.append({"role": "system", "content": request.system})
    unanswered: list[tuple[str, str]] = []  # (id, name) of the calls not yet answered
    for i, content in enumerate(request.contents):
        texts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for j, part in enumerate(content.parts):
            if part.text is not None and not part.thought:
                texts.append({"type": "text", "text": part.text})
            elif part.inline is not None:
                texts.append(_media(part.inline[0],
                                    f"data:{part.inline[0]};base64,{part.inline[1]}"))
            elif part.file is not None:
                texts.append(_media(*part.file))
            elif part.call is not None:
                ident, name, args = part.call
                ident = ident or f"call_{i}_{j}"
                unanswered.append((ident, name))
                calls.append({"id": ident, "type": "function", "function": {
                    "name": name, "arguments": json.dumps(args)}})
            elif part.response is not None:
                ident, name, response = part.response
                found = next((k for k, (c, n) in enumerate(unanswered)
                              if (c == ident if ident else n == name)), None)
                if found is None:
                    found = next((k for k, (_, n) in enumerate(unanswered) if n == name),
                                 None)
                if found is None:
                    raise RelayError("invalid_request", f"'contents[{i}].parts[{j}]."
                                     f"functionResponse' answers no earlier functionCall "
                                     f"named {name!r}", param=f"contents[{i}].parts[{j}]")
                call_id, _ = unanswered.pop(found)
                messages.append({"role": "tool", "tool_call_id": call_id,
                                 "content": json.dumps(response)})
        if content.role == "model":
            if texts or calls:
                text = "".join(p["text"] for p in texts if p["type"] == "text")
                message: dict[str, Any] = {"role": "assistant", "content": text or None}
                if calls:
                    message["tool_calls"] = calls
                messages.append(message)
        elif texts:
            single = len(texts) == 1 and texts[0]["type"] == "text"
            messages.append({"role": "user",
                             "content": texts[0]["text"] if single else texts})
    return messages


def _params(request: GeminiRequest) -> tuple[dict[str, Any], dict[str, str]]:
    params: dict[str, Any] = {}
    names: dict[str, str] = {}
    config = request.config
    for key, ours in GENERATION.items():
        if config.get(key) is not None:
            params[ours], names[ours] = config[key], f"generationConfig.{key}"
    if config.get("maxOutputTokens") is not None:
        params["max_tokens"] = config["maxOutputTokens"]
        names["max_tokens"] = "generationConfig.maxOutputTokens"
    if config.get("stopSequences"):
        params["stop"], names["stop"] = config["stopSequences"], "generationConfig.stopSequences"
    if config.get("responseLogprobs"):
        params["logprobs"], names["logprobs"] = True, "generationConfig.responseLogprobs"
    if config.get("responseMimeType") == "application/json":
        schema = config.get("responseJsonSchema")
        if schema is None and config.get("responseSchema") is not None:
            schema = openapi_schema(config["responseSchema"])
        params["response_format"] = ({"type": "json_schema", "json_schema": {
            "name": "output", "schema": schema}} if schema is not None
            else {"type": "json_object"})
        names["response_format"] = "generationConfig.responseMimeType"
    declarations = request.declarations
    if request.allowed is not None and request.mode != "NONE":
        declarations = tuple(d for d in declarations if d.name in request.allowed)
    if declarations:
        tools = []
        for decl in declarations:
            fn: dict[str, Any] = {"name": decl.name}
            if decl.description is not None:
                fn["description"] = decl.description
            fn["parameters"] = decl.parameters or {"type": "object", "properties": {}}
            tools.append({"type": "function", "function": fn})
        params["tools"] = tools
    elif request.declarations:
        params["tools"] = []  # every tool excluded by allowedFunctionNames
    if request.mode is not None:
        choice: Any = MODES[request.mode]
        if choice == "required" and len(declarations) == 1 and request.allowed is not None:
            choice = {"type": "function", "function": {"name": declarations[0].name}}
        params["tool_choice"], names["tool_choice"] = choice, "toolConfig"
    return params, names


def parse_gemini_body(body: bytes, model: str, *, stream: bool) -> ChatInput:
    """A Gemini request for ``model`` (from the path) → relay's `ChatInput`: the chat-level
    translation, and the request itself with its own fields in ``inbound``.

    Raises:
        RelayError: ``invalid_request`` naming the field's path; ``unsupported`` for
            parts relay cannot translate.
    """
    data = load_json(body)
    if not isinstance(data, dict):
        raise RelayError("invalid_request", "the body must be a JSON object")
    data = known_names(data, GEMINI_SCHEMA)   # both spellings; no unknown name
    check(data, GEMINI_SCHEMA)
    request = structure(data)
    messages = _messages(request)
    if all(m["role"] == "system" for m in messages):   # (a CLI tool's 400 named messages)
        raise RelayError("invalid_request", "'contents' holds nothing to answer: every "
                         "content's parts are empty or thoughts", param="contents")
    params, names = _params(request)
    inbound = Inbound(dialect="gemini", own=request.own, names=names,
                      body={k: v for k, v in data.items()
                            if k not in ("fallbacks", "model")},
                      turns=len(messages))
    return ChatInput(model=model, messages=messages, stream=stream, params=params,
                     fallbacks=request.fallbacks, include_usage=True, inbound=inbound)


# --- embeddings: ``:embedContent`` and ``:batchEmbedContents`` ---------------------------

_EMBED = Obj({"model": Str(), "content": Obj({"role": Str(), "parts": GPARTS},
                                             required=("parts",), nullable=False),
              "taskType": Str(), "title": Str(), "outputDimensionality": Int(1, INT_MAX)},
             required=("content",))
_EMBED_ONE = Schema("gemini embedContent", _EMBED.fields, required=("content",))
_EMBED_BATCH = Schema("gemini batchEmbedContents", {
    "requests": Arr(_EMBED, min_len=1, nullable=False)}, required=("requests",))


def parse_gemini_embed(body: bytes, model: str, *, batch: bool) -> EmbeddingsInput:
    """``:embedContent`` (one ``content``) or ``:batchEmbedContents`` (``requests``, each
    a content) for ``model`` (from the path) → relay's embeddings request: one text per
    content (its text parts joined by newlines); ``outputDimensionality`` →
    ``dimensions``.

    Raises:
        RelayError: ``invalid_request`` naming the field (Google's unknown names too);
            ``unsupported`` for ``taskType``/``title`` (relay passes neither: vectors
            for another task would be answered as if for this one) and non-text parts.
    """
    data = load_json(body)
    if not isinstance(data, dict):
        raise RelayError("invalid_request", "the body must be a JSON object")
    schema = _EMBED_BATCH if batch else _EMBED_ONE
    data = known_names(data, schema)
    check(data, schema)
    requests = data["requests"] if batch else [data]
    where = [f"requests[{i}]" for i in range(len(requests))] if batch else [""]
    inputs: list[str] = []
    dims: set[int | None] = set()
    for path, request in zip(where, requests, strict=True):
        at = f"{path}." if path else ""
        named = (request.get("model") or model).removeprefix("models/")
        if named != model:
            raise RelayError("invalid_request", f"'{at}model' {request['model']!r} is not "
                             f"the model of the path ({model!r})", param=f"{at}model")
        for key in ("taskType", "title"):
            if request.get(key) is not None:
                raise RelayError("unsupported", f"'{at}{key}': relay does not pass an "
                                 f"embedding {key} to providers; leave it out",
                                 param=f"{at}{key}")
        texts = []
        for j, part in enumerate(request["content"]["parts"]):
            if not isinstance(part.get("text"), str):
                raise RelayError("unsupported", f"'{at}content.parts[{j}]': relay embeds "
                                 "text parts only", param=f"{at}content.parts[{j}]")
            texts.append(part["text"])
        inputs.append("\n".join(texts))
        dims.add(request.get("outputDimensionality"))
    if len(dims) > 1:
        raise RelayError("unsupported", "'requests[].outputDimensionality' differs between "
                         "requests: relay asks for one size per batch; send one batch per "
                         "size", param="requests")
    size = dims.pop()
    return EmbeddingsInput(model=model, inputs=inputs, encoding_format="float",
                           params={} if size is None else {"dimensions": size})


def render_gemini_embeddings(vectors: list[list[float]], *, batch: bool,
                             provider: str) -> dict[str, Any]:
    """``{"embeddings": [{"values": […]}, …]}`` (batch) or ``{"embedding": {…}}``.

    Raises:
        RelayError: ``bad_upstream_response`` for a number that is not finite.
    """
    for index, vector in enumerate(vectors):
        if not all(map(math.isfinite, vector)):
            raise RelayError("bad_upstream_response", f"provider {provider!r} sent an "
                             f"embedding with a number that is not finite (vector {index})",
                             provider=provider)
    if batch:
        return {"embeddings": [{"values": v} for v in vectors]}
    return {"embedding": {"values": vectors[0]}}


class GeminiDialect(GeminiRender):
    """Requests and answers in Google's Gemini API shapes. The model and the streaming
    come from the path: the front calls `parse_gemini_body`; ``parse`` reads them from
    the body (``model``, ``stream``), for callers that have no path."""

    name = "gemini"

    def parse(self, body: bytes) -> ChatInput:
        data = load_json(body)
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, str) or not model:
            raise RelayError("invalid_request", "'model' is required", param="model")
        stream = isinstance(data, dict) and data.get("stream") is True
        return parse_gemini_body(body, model.removeprefix("models/"), stream=stream)


GEMINI = GeminiDialect()
# For Google's own SDKs, which cannot skip an SSE comment (`GeminiRender`).
GEMINI_SDK = GeminiDialect(comments=False)
