"""The Gemini dialect's requests, structured (SPEC A9): `structure` reads a request body,
already checked against `relay.dialects.schemas.GEMINI_SCHEMA` (every field's type and
range, a 400 naming the field's path, in one place: `relay.dialects.typed.check`), into a
`GeminiRequest`, and refuses here only what a schema cannot say (a part holds exactly one
kind, ``candidateCount`` above 1, a ``responseSchema`` without JSON output, …).
`relay.dialects.gemini_generate` checks, then structures, then translates the result into
relay's own terms.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import attrs

from relay.vocab.errors import RelayError

from .typed import Arr, Obj, OneOf, Schema, Spec

__all__ = ["GENERATION", "MODES", "Content", "Declaration", "GeminiRequest", "Part",
           "known_names", "openapi_schema", "structure"]

# The top-level fields this dialect reads; every other one is its own (kept as sent).
_READ = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig",
         "model", "fallbacks"}
# generationConfig's fields that are chat-level params: Gemini's name → chat's.
GENERATION: dict[str, str] = {
    "temperature": "temperature", "topP": "top_p", "topK": "top_k", "seed": "seed",
    "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty"}
_CONFIG_READ = {*GENERATION, "maxOutputTokens", "stopSequences", "candidateCount",
                "responseMimeType", "responseSchema", "responseJsonSchema",
                "responseLogprobs", "logprobs"}
# (the schema's GEMINI_MODES, each as a tool_choice)
MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto",
          "MODE_UNSPECIFIED": "auto"}
_OPENAPI_TYPES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL",
                  "TYPE_UNSPECIFIED"}
# Google's OpenAPI-subset keys that JSON Schema does not have (dropped on the way).
_OPENAPI_ONLY = {"nullable", "propertyOrdering"}


# --- field names: both spellings, and no unknown one -------------------------------------

_SNAKE = re.compile(r"_([a-z0-9])")


def _camel(key: str) -> str:
    """``parameters_json_schema`` → ``parametersJsonSchema`` (proto3 JSON's rule)."""
    return _SNAKE.sub(lambda m: m[1].upper(), key)


def _closed(spec: Spec) -> Obj | None:
    """The object spec whose keys are a closed list (Google's message types), if any."""
    if isinstance(spec, OneOf):
        spec = next((s for s in spec.specs if isinstance(s, Obj)), spec)
    return spec if isinstance(spec, Obj) and spec.fields else None


def known_names(data: dict[str, Any], schema: Schema) -> dict[str, Any]:
    """``data`` with every field name in Google's lowerCamelCase, as its API takes them
    (proto3 JSON: ``parameters_json_schema`` is ``parametersJsonSchema``; SPEC A9), in
    every message the schema lists — never inside a free-form value (``args``, a JSON
    Schema, ``labels``).

    Raises:
        RelayError: ``invalid_request``, as Google words it, naming every unknown field
            (``Unknown name "bogusField"``) and every field sent in both spellings.
    """
    unknown: list[tuple[str, str]] = []   # (name as sent, the message's path)

    def walk(value: Any, spec: Spec, path: str) -> Any:
        if isinstance(spec, Arr) and isinstance(value, list):
            return [walk(v, spec.item, f"{path}[{i}]") for i, v in enumerate(value)]
        closed = _closed(spec)
        if closed is None or not isinstance(value, dict):
            return value
        return obj(value, closed.fields, path)

    def obj(value: dict[str, Any], fields: dict[str, Spec], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, entry in value.items():
            name = key if key in fields else _camel(key)
            if name not in fields:
                unknown.append((key, path))
                continue
            if name in out:
                raise RelayError("invalid_request", "Invalid JSON payload received. "
                                 f"'{_join(path, name)}' is sent in both spellings "
                                 "(lowerCamelCase and snake_case); send one",
                                 param=_join(path, name))
            out[name] = walk(entry, fields[name], _join(path, name))
        return out

    normal = obj(data, schema.fields, "")
    if unknown:
        said = "\n".join(f'Unknown name "{key}"' + (f" at '{path}'" if path else "")
                         + ": Cannot find field." for key, path in unknown)
        raise RelayError("invalid_request", f"Invalid JSON payload received. {said}",
                         param=", ".join(_join(path, key) for key, path in unknown))
    return normal


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _bad(path: str, what: str) -> NoReturn:
    raise RelayError("invalid_request", f"'{path}' {what}", param=path)


# --- the one structuring function -----------------------------------------------------------

@attrs.frozen
class Part:
    """One part of a content, checked: exactly one of its kinds is set."""

    text: str | None = None
    thought: bool = False
    signature: str | None = None
    inline: tuple[str, str] | None = None        # mimeType, base64 data
    file: tuple[str, str] | None = None          # mimeType, fileUri
    call: tuple[str | None, str, dict[str, Any]] | None = None     # id, name, args
    response: tuple[str | None, str, Any] | None = None            # id, name, response


@attrs.frozen
class Content:
    role: str
    parts: tuple[Part, ...]


@attrs.frozen
class Declaration:
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # JSON Schema


@attrs.frozen
class GeminiRequest:
    """A Gemini request, structured (`structure`) from a body `GEMINI_SCHEMA` passed."""

    contents: tuple[Content, ...]
    system: str | None
    declarations: tuple[Declaration, ...]
    mode: str | None                       # AUTO | ANY | NONE | VALIDATED | …
    allowed: tuple[str, ...] | None
    config: dict[str, Any]                 # generationConfig as sent (checked)
    own: dict[str, Any]                    # the dialect's own fields, by dotted name
    fallbacks: Any


def _part(data: dict[str, Any], path: str, own: dict[str, Any]) -> Part:
    thought = data.get("thought") is True
    signature = data.get("thoughtSignature")
    if signature is not None:
        own.setdefault("contents.thoughtSignature", True)
    if thought:
        own.setdefault("contents.thought", True)
    kinds = [k for k in ("text", "inlineData", "fileData", "functionCall",
                         "functionResponse") if data.get(k) is not None]
    others = [k for k in data if k not in (*kinds, "thought", "thoughtSignature")
              and data[k] is not None]
    if others and not kinds:
        raise RelayError("unsupported", f"'{path}.{others[0]}': relay cannot pass a "
                         f"{others[0]!r} part to a provider of another kind",
                         param=f"{path}.{others[0]}")
    if len(kinds) != 1:
        _bad(path, "must hold exactly one of text, inlineData, fileData, functionCall, "
                   "functionResponse")
    kind = kinds[0]
    value = data[kind]
    if kind == "text":
        return Part(text=value, thought=thought, signature=signature)
    if kind == "inlineData":
        return Part(inline=(value["mimeType"], value["data"]))
    if kind == "fileData":
        return Part(file=(value["mimeType"], value["fileUri"]))
    ident, name = value.get("id"), value["name"]
    if kind == "functionCall":
        return Part(call=(ident, name, value.get("args") or {}), signature=signature)
    return Part(response=(ident, name, value.get("response") or {}))


def _content(data: dict[str, Any], path: str, own: dict[str, Any]) -> Content:
    return Content(role=data.get("role") or "user",
                   parts=tuple(_part(p, f"{path}.parts[{j}]", own)
                               for j, p in enumerate(data["parts"])))


def openapi_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Google's OpenAPI-subset schema (``parameters``, ``responseSchema``) → JSON Schema."""
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items() if k not in _OPENAPI_ONLY}
        kind = node.get("type")
        if isinstance(kind, str) and kind.upper() in _OPENAPI_TYPES:
            out["type"] = kind.lower()
            if kind.upper() == "TYPE_UNSPECIFIED":
                del out["type"]
        if node.get("nullable") is True and isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        return out

    return dict(walk(schema))


def _declarations(tools: list[dict[str, Any]], own: dict[str, Any]) -> tuple[Declaration, ...]:
    out: list[Declaration] = []
    for tool in tools:
        for key, value in tool.items():
            if key != "functionDeclarations" and value is not None:
                own.setdefault(f"tools.{key}", value)  # Google's built-in tools
        for fn in tool.get("functionDeclarations") or ():
            params: dict[str, Any] | None = None
            if fn.get("parametersJsonSchema") is not None:
                params = fn["parametersJsonSchema"]
            elif fn.get("parameters") is not None:
                params = openapi_schema(fn["parameters"])
            out.append(Declaration(fn["name"], fn.get("description"), params))
    return tuple(out)


def _config(config: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    path = "generationConfig"
    if config.get("candidateCount") not in (None, 1):
        raise RelayError("unsupported", "'generationConfig.candidateCount' above 1: relay "
                         "answers one candidate per request; send several requests",
                         param=f"{path}.candidateCount")
    mime = config.get("responseMimeType")
    if mime not in (None, "text/plain", "application/json"):
        raise RelayError("unsupported", f"'{path}.responseMimeType' {mime!r}: relay "
                         "translates text/plain and application/json",
                         param=f"{path}.responseMimeType")
    for key in ("responseSchema", "responseJsonSchema"):
        if config.get(key) is not None and mime != "application/json":
            _bad(f"{path}.{key}", "needs responseMimeType 'application/json'")
    for key, value in config.items():
        if key not in _CONFIG_READ and value is not None:
            own.setdefault(f"generationConfig.{key}", value)
    return config


def structure(data: dict[str, Any]) -> GeminiRequest:
    """A Gemini request body that `GEMINI_SCHEMA` passed (`relay.dialects.typed.check`:
    every field's type and range) → `GeminiRequest`.

    Raises:
        RelayError: ``invalid_request`` naming the field's path, for what a schema cannot
            say (a part holding no kind or two, a system instruction's role, a schema
            without JSON output); ``unsupported`` for what relay cannot translate
            (``candidateCount`` above 1, executable code parts, …).
    """
    own: dict[str, Any] = {}
    contents = tuple(_content(c, f"contents[{i}]", own)
                     for i, c in enumerate(data["contents"]))
    system = None
    instruction = data.get("systemInstruction")
    if isinstance(instruction, str):
        system = instruction
    elif instruction is not None:
        content = _content(instruction, "systemInstruction", own)
        texts = [p.text for p in content.parts if p.text is not None]
        if len(texts) != len(content.parts):
            raise RelayError("unsupported", "'systemInstruction': relay passes text "
                             "parts only", param="systemInstruction")
        system = "\n".join(texts)
    declarations = _declarations(data.get("tools") or [], own)
    calling = (data.get("toolConfig") or {}).get("functionCallingConfig") or {}
    names = calling.get("allowedFunctionNames")
    config = _config(data.get("generationConfig") or {}, own)
    for key, value in data.items():
        if key not in _READ and value is not None:
            own.setdefault(key, value)
    return GeminiRequest(contents=contents, system=system or None,
                         declarations=declarations, mode=calling.get("mode"),
                         allowed=None if names is None else tuple(names),
                         config=config, own=own, fallbacks=data.get("fallbacks"))
