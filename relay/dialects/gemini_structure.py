"""The Gemini dialect's requests, checked (SPEC A9): `structure` reads a request body into a
`GeminiRequest`, every field relay reads checked for type and range here and nowhere else,
a 400 naming the field's path (``generationConfig.topK``,
``contents[2].parts[0].functionCall.args``). `relay.dialects.gemini_generate` translates
the result into relay's own terms.
"""

from __future__ import annotations

from typing import Any, NoReturn

import attrs

from relay.dialects.openai_chat import INT_MAX
from relay.vocab.errors import RelayError

__all__ = ["GENERATION", "MODES", "Content", "Declaration", "GeminiRequest", "Part",
           "openapi_schema", "structure"]

# The top-level fields this dialect reads; every other one is its own (kept as sent).
_READ = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig",
         "model", "fallbacks"}
# generationConfig's fields that are chat-level params (with the client's name for each).
GENERATION: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)), "topP": ("top_p", (int, float)),
    "topK": ("top_k", (int, float)), "seed": ("seed", int),
    "presencePenalty": ("presence_penalty", (int, float)),
    "frequencyPenalty": ("frequency_penalty", (int, float)),
}
_CONFIG_READ = {*GENERATION, "maxOutputTokens", "stopSequences", "candidateCount",
                "responseMimeType", "responseSchema", "responseJsonSchema",
                "responseLogprobs", "logprobs"}
MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto",
          "MODE_UNSPECIFIED": "auto"}
_OPENAPI_TYPES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL",
                  "TYPE_UNSPECIFIED"}
# Google's OpenAPI-subset keys that JSON Schema does not have (dropped on the way).
_OPENAPI_ONLY = {"nullable", "propertyOrdering"}


def _bad(path: str, what: str) -> NoReturn:
    raise RelayError("invalid_request", f"'{path}' {what}", param=path)


def _obj(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _bad(path, "must be an object")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        _bad(path, "must be a list")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _bad(path, "must be a string")
    return value


def _opt_str(data: dict[str, Any], key: str, path: str) -> str | None:
    value = data.get(key)
    return None if value is None else _str(value, f"{path}.{key}")


def _number(value: Any, path: str, kinds: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) or not isinstance(value, kinds) or (
            isinstance(value, int) and abs(value) > INT_MAX):
        _bad(path, "must be a whole number" if kinds is int else "must be a number")
    return value


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
    """A Gemini request, every field relay reads type-checked (`structure`)."""

    contents: tuple[Content, ...]
    system: str | None
    declarations: tuple[Declaration, ...]
    mode: str | None                       # AUTO | ANY | NONE | VALIDATED | …
    allowed: tuple[str, ...] | None
    config: dict[str, Any]                 # generationConfig as sent (checked)
    own: dict[str, Any]                    # the dialect's own fields, by dotted name
    fallbacks: Any


def _part(raw: Any, path: str, own: dict[str, Any]) -> Part:
    data = _obj(raw, path)
    thought = data.get("thought")
    if thought is not None and not isinstance(thought, bool):
        _bad(f"{path}.thought", "must be true or false")
    signature = _opt_str(data, "thoughtSignature", path)
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
    at = f"{path}.{kind}"
    if kind == "text":
        return Part(text=_str(value, at), thought=bool(thought), signature=signature)
    if kind in ("inlineData", "fileData"):
        blob = _obj(value, at)
        mime = _str(blob.get("mimeType"), f"{at}.mimeType")
        key = "data" if kind == "inlineData" else "fileUri"
        payload = _str(blob.get(key), f"{at}.{key}")
        return (Part(inline=(mime, payload)) if kind == "inlineData"
                else Part(file=(mime, payload)))
    fn = _obj(value, at)
    ident = _opt_str(fn, "id", at)
    name = _str(fn.get("name"), f"{at}.name")
    if kind == "functionCall":
        args = fn.get("args")
        args = {} if args is None else _obj(args, f"{at}.args")
        return Part(call=(ident, name, args), signature=signature)
    response = fn.get("response")
    response = {} if response is None else _obj(response, f"{at}.response")
    return Part(response=(ident, name, response))


def _content(raw: Any, path: str, own: dict[str, Any], *, system: bool = False) -> Content:
    data = _obj(raw, path)
    role = data.get("role")
    if role is None or system:
        role = "user" if role is None else role
    if not isinstance(role, str) or (not system and role not in ("user", "model")):
        _bad(f"{path}.role", "must be 'user' or 'model'")
    parts = _list(data.get("parts"), f"{path}.parts")
    return Content(role=role, parts=tuple(_part(p, f"{path}.parts[{j}]", own)
                                          for j, p in enumerate(parts)))


def openapi_schema(schema: Any, path: str) -> dict[str, Any]:
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

    return dict(walk(_obj(schema, path)))


def _declarations(raw: Any, own: dict[str, Any]) -> tuple[Declaration, ...]:
    out: list[Declaration] = []
    for i, tool in enumerate(_list(raw, "tools")):
        at = f"tools[{i}]"
        data = _obj(tool, at)
        for key, value in data.items():
            if key != "functionDeclarations" and value is not None:
                own.setdefault(f"tools.{key}", value)  # Google's built-in tools
        for j, decl in enumerate(_list(data.get("functionDeclarations") or [],
                                       f"{at}.functionDeclarations")):
            where = f"{at}.functionDeclarations[{j}]"
            fn = _obj(decl, where)
            name = _str(fn.get("name"), f"{where}.name")
            if not name:
                _bad(f"{where}.name", "must not be empty")
            params: dict[str, Any] | None = None
            if fn.get("parametersJsonSchema") is not None:
                params = _obj(fn["parametersJsonSchema"], f"{where}.parametersJsonSchema")
            elif fn.get("parameters") is not None:
                params = openapi_schema(fn["parameters"], f"{where}.parameters")
            out.append(Declaration(name, _opt_str(fn, "description", where), params))
    return tuple(out)


def _config(raw: Any, own: dict[str, Any]) -> dict[str, Any]:
    config = _obj(raw, "generationConfig")
    path = "generationConfig"
    for key, (_, kinds) in GENERATION.items():
        if config.get(key) is not None:
            _number(config[key], f"{path}.{key}", kinds)
    for key in ("maxOutputTokens", "candidateCount"):
        if config.get(key) is not None:
            value = _number(config[key], f"{path}.{key}", int)
            if value < 1:
                _bad(f"{path}.{key}", "must be at least 1")
    if config.get("candidateCount") not in (None, 1):
        raise RelayError("unsupported", "'generationConfig.candidateCount' above 1: relay "
                         "answers one candidate per request; send several requests",
                         param=f"{path}.candidateCount")
    stops = config.get("stopSequences")
    if stops is not None and not all(isinstance(s, str) for s in _list(
            stops, f"{path}.stopSequences")):
        _bad(f"{path}.stopSequences", "must be a list of strings")
    mime = _opt_str(config, "responseMimeType", path)
    if mime not in (None, "text/plain", "application/json"):
        raise RelayError("unsupported", f"'{path}.responseMimeType' {mime!r}: relay "
                         "translates text/plain and application/json",
                         param=f"{path}.responseMimeType")
    for key in ("responseSchema", "responseJsonSchema"):
        if config.get(key) is not None:
            _obj(config[key], f"{path}.{key}")
            if mime != "application/json":
                _bad(f"{path}.{key}", "needs responseMimeType 'application/json'")
    for key in ("responseLogprobs",):
        if config.get(key) is not None and not isinstance(config[key], bool):
            _bad(f"{path}.{key}", "must be true or false")
    if config.get("logprobs") is not None:
        _number(config["logprobs"], f"{path}.logprobs", int)
    for key, value in config.items():
        if key not in _CONFIG_READ and value is not None:
            own.setdefault(f"generationConfig.{key}", value)
    return config


def _tool_config(raw: Any) -> tuple[str | None, tuple[str, ...] | None]:
    data = _obj(raw, "toolConfig")
    calling = data.get("functionCallingConfig")
    if calling is None:
        return None, None
    at = "toolConfig.functionCallingConfig"
    calling = _obj(calling, at)
    mode = _opt_str(calling, "mode", at)
    if mode is not None and mode not in MODES:
        _bad(f"{at}.mode", f"must be one of {', '.join(MODES)}")
    names = calling.get("allowedFunctionNames")
    if names is None:
        return mode, None
    if not all(isinstance(n, str) for n in _list(names, f"{at}.allowedFunctionNames")):
        _bad(f"{at}.allowedFunctionNames", "must be a list of strings")
    return mode, tuple(names)


def structure(data: Any) -> GeminiRequest:
    """A Gemini request body (JSON) → `GeminiRequest`: every field relay reads checked
    for type and range, here and nowhere else.

    Raises:
        RelayError: ``invalid_request`` naming the field's path; ``unsupported`` for what
            relay cannot translate (``candidateCount`` above 1, executable code parts, …).
    """
    if not isinstance(data, dict):
        raise RelayError("invalid_request", "the body must be a JSON object")
    own: dict[str, Any] = {}
    raw = _list(data.get("contents"), "contents")
    if not raw:
        _bad("contents", "must not be empty")
    contents = tuple(_content(c, f"contents[{i}]", own) for i, c in enumerate(raw))
    system = None
    if data.get("systemInstruction") is not None:
        instruction = data["systemInstruction"]
        if isinstance(instruction, str):
            system = instruction
        else:
            content = _content(instruction, "systemInstruction", own, system=True)
            texts = [p.text for p in content.parts if p.text is not None]
            if len(texts) != len(content.parts):
                raise RelayError("unsupported", "'systemInstruction': relay passes text "
                                 "parts only", param="systemInstruction")
            system = "\n".join(texts)
    declarations = (_declarations(data["tools"], own) if data.get("tools") is not None
                    else ())
    mode, allowed = (_tool_config(data["toolConfig"]) if data.get("toolConfig") is not None
                     else (None, None))
    config = (_config(data["generationConfig"], own)
              if data.get("generationConfig") is not None else {})
    if data.get("model") is not None:
        _str(data["model"], "model")
    for key, value in data.items():
        if key not in _READ and value is not None:
            own.setdefault(key, value)
    return GeminiRequest(contents=contents, system=system or None,
                         declarations=declarations, mode=mode, allowed=allowed,
                         config=config, own=own, fallbacks=data.get("fallbacks"))
