"""The Gemini adapter's request: relay's call (OpenAI shapes) translated into a
``generateContent`` request, field by field (SPEC P1, A1a)."""

from __future__ import annotations

import json
import secrets
from typing import Any

from relay.vocab.errors import RelayError
from relay.vocab.events import Call

from .cloud import data_url, obj, stop_sequences, tool_calls

# OpenAI request field → generationConfig field, passed as given.
GENERATION: dict[str, str] = {
    "temperature": "temperature", "top_p": "topP", "top_k": "topK", "seed": "seed",
    "presence_penalty": "presencePenalty", "frequency_penalty": "frequencyPenalty",
    "n": "candidateCount",
}
_TOOL_MODES: dict[str, str] = {"auto": "AUTO", "none": "NONE", "required": "ANY"}
_SIGNATURE = "__ts_"  # in a tool call id: the thought signature follows (urlsafe base64)



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


def _generation_config(params: dict[str, Any]) -> dict[str, Any]:
    """relay's sampling and length params → ``generationConfig``."""
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
    return config


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
    config = _generation_config(params)
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


def native_request(call: Call) -> dict[str, Any] | None:
    """The client's own Gemini request for ``call`` (SPEC A1a *passed*, A9), or None when
    the client spoke another dialect: every field as sent — thought parts and their
    signatures, ``thinkingConfig``, ``safetySettings``, fields relay does not know. A
    continuation relay adds (SPEC F8: messages after the body's own) is appended as
    ``model`` text."""
    inbound = call.inbound
    if inbound.dialect != "gemini" or inbound.body is None:
        return None
    body = dict(inbound.body)
    contents = list(body.get("contents") or ())
    for i, message in enumerate(call.messages[inbound.turns:], start=len(contents)):
        parts = _parts(message.get("content"), f"messages[{i}]", media=False)
        if parts:
            _add(contents, "model", parts)
    body["contents"] = contents
    return body
