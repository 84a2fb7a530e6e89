"""The Anthropic adapter's request: a Messages request passed on as the client sent it
(`native_request`), or relay's call (OpenAI shapes) translated into one, field by field
(`messages_request`) (SPEC P1, A1a, A6)."""

from __future__ import annotations

from typing import Any

from relay.vocab.errors import RelayError
from relay.vocab.events import Call

from .cloud import data_url, obj, stop_sequences, tool_calls

DEFAULT_MAX_TOKENS = 4096  # for requests that give none (Anthropic requires one)

# OpenAI request field → Messages field, passed as given.
_SAME: dict[str, str] = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_TOOL_CHOICE: dict[str, dict[str, Any]] = {
    "auto": {"type": "auto"}, "none": {"type": "none"}, "required": {"type": "any"}}



# --- request: OpenAI shapes → Messages ------------------------------------------------------

def _text(part: Any, where: str) -> str:
    text = part.get("text") if isinstance(part, dict) else None
    if not isinstance(text, str):
        raise RelayError("invalid_request", f"{where}.text must be a string",
                         param="messages")
    return text


def _unsupported(what: str, where: str) -> RelayError:
    return RelayError("unsupported", f"the anthropic adapter cannot send {what} "
                      f"({where}); remove it or choose another provider", param="messages")


def _image_block(part: dict[str, Any], where: str) -> dict[str, Any]:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise RelayError("invalid_request", f"{where}.image_url.url must be a string",
                         param="messages")
    inline = data_url(url)
    if inline is not None:
        return {"type": "image", "source": {"type": "base64", "media_type": inline[0],
                                            "data": inline[1]}}
    if url.startswith(("http://", "https://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise _unsupported("an image that is neither a base64 data: URL nor an http(s) URL",
                       where)


def _marked(block: dict[str, Any], marker: Any) -> dict[str, Any]:
    """``block`` with the client's ``cache_control`` marker, if it gave one (SPEC L12a:
    the marker reaches the provider that honours it)."""
    return {**block, "cache_control": marker} if isinstance(marker, dict) else block


def _blocks(content: Any, where: str, *, images: bool) -> list[dict[str, Any]]:
    """OpenAI content (a string or parts) → Messages content blocks (empty text dropped:
    Anthropic refuses empty text blocks). A part's ``cache_control`` goes on its block."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type")
        marker = part.get("cache_control")
        if kind == "text":
            if text := _text(part, at):
                out.append(_marked({"type": "text", "text": text}, marker))
        elif kind == "image_url" and images:
            out.append(_marked(_image_block(part, at), marker))
        elif kind == "file" and images:
            inline = data_url(str(obj(part.get("file")).get("file_data") or ""))
            if inline is None or inline[0] != "application/pdf":
                raise _unsupported("a file other than a PDF as a base64 data: URL", at)
            out.append(_marked({"type": "document", "source": {"type": "base64",
                                "media_type": inline[0], "data": inline[1]}}, marker))
        else:
            raise _unsupported(f"a content part of type {kind!r}", at)
    return out


def _message_blocks(message: dict[str, Any], blocks: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """A message's ``cache_control`` (as LiteLLM and OpenRouter take it: the cache ends
    with this message) goes on its last block."""
    if blocks and isinstance(message.get("cache_control"), dict):
        blocks[-1] = _marked(blocks[-1], message["cache_control"])
    return blocks


def _add(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if not blocks:
        return
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": list(blocks)})


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise RelayError("invalid_request", "'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RelayError("unsupported", f"tools[{i}]: the anthropic adapter takes "
                             "function tools ({'type': 'function', 'function': {'name', …}})"
                             " only", param="tools")
        spec: dict[str, Any] = {"name": fn["name"], "input_schema": fn.get("parameters")
                                or {"type": "object", "properties": {}}}
        if fn.get("description"):
            spec["description"] = fn["description"]
        out.append(_marked(spec, tool.get("cache_control")))
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if isinstance(choice, str) and choice in _TOOL_CHOICE:
        return dict(_TOOL_CHOICE[choice])
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"),
                                               str):
        return {"type": "tool", "name": choice["function"]["name"]}
    raise RelayError("unsupported", f"tool_choice {choice!r} has no Messages equivalent; "
                     "use auto, none, required or a function", param="tool_choice")


def _turns(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                   list[dict[str, Any]]]:
    """relay's messages → Messages ``system`` blocks and alternating turns."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where, role = f"messages[{i}]", message.get("role")
        content = message.get("content")
        if role in ("system", "developer"):
            system += _message_blocks(message, _blocks(content, where, images=False))
        elif role == "user":
            _add(turns, "user", _message_blocks(message, _blocks(content, where,
                                                                 images=True)))
        elif role == "assistant":
            blocks = _blocks(content, where, images=False)
            for j, (call_id, name, args, _) in enumerate(tool_calls(message, where)):
                if call_id is None:
                    raise RelayError("invalid_request", f"{where}.tool_calls[{j}] needs an "
                                     "id", param="messages")
                blocks.append({"type": "tool_use", "id": call_id, "name": name,
                               "input": args})
            _add(turns, "assistant", _message_blocks(message, blocks))
        elif role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise RelayError("invalid_request", f"{where}.tool_call_id is required",
                                 param="messages")
            result: dict[str, Any] = {"type": "tool_result",
                                      "tool_use_id": message["tool_call_id"]}
            texts = _blocks(content, where, images=False)
            if texts:
                result["content"] = texts
            _add(turns, "user", _message_blocks(message, [result]))
        else:
            raise _unsupported(f"a message with role {role!r}", where)

    return system, turns


def _strip_prefill(turns: list[dict[str, Any]]) -> str:
    """Cut the whitespace from the end of a final assistant message (a prefill: Anthropic
    refuses trailing whitespace there) and return what was cut."""
    stripped = ""
    last = turns[-1] if turns else None
    if last is not None and last["role"] == "assistant" and last["content"][-1]["type"] == \
            "text":
        text = last["content"][-1]["text"]
        kept = text.rstrip()
        stripped = text[len(kept):]
        if kept:
            last["content"][-1] = {**last["content"][-1], "text": kept}
        else:
            last["content"].pop()
            if not last["content"]:
                turns.pop()

    return stripped


def messages_request(call: Call, default_max_tokens: int = DEFAULT_MAX_TOKENS
                     ) -> tuple[dict[str, Any], str]:
    """The Messages request for ``call``, and the whitespace cut from the end of a final
    assistant message (a prefill), which the continuation will not repeat.

    Raises:
        RelayError: ``unsupported`` (a part or field it cannot send) or
            ``invalid_request`` (tool arguments that are not JSON), naming the field.
    """
    system, turns = _turns(call.messages)
    stripped = _strip_prefill(turns)
    params = call.params
    body: dict[str, Any] = {
        "model": call.model, "messages": turns,
        "max_tokens": params.get("max_completion_tokens") or params.get("max_tokens")
        or default_max_tokens}
    if system:
        body["system"] = system
    for ours, theirs in _SAME.items():
        if params.get(ours) is not None:
            body[theirs] = params[ours]
    stop = params.get("stop")
    if stop is not None:
        body["stop_sequences"] = stop_sequences(stop)
    if params.get("tools") is not None:
        body["tools"] = _tools(params["tools"])
    if params.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(params["tool_choice"])
    if params.get("parallel_tool_calls") is False:
        body["tool_choice"] = {**body.get("tool_choice", {"type": "auto"}),
                               "disable_parallel_tool_use": True}
    if params.get("user") is not None:
        body["metadata"] = {"user_id": str(params["user"])}
    if call.stream:
        body["stream"] = True
    return body, stripped


def native_request(call: Call) -> tuple[dict[str, Any], str] | None:
    """The client's own Messages request for ``call`` (SPEC A1a *passed*), or None when
    the client spoke another dialect: every field as sent — thinking blocks and their
    signatures, ``cache_control``, ``context_management``, fields relay does not know —
    with the provider's model name and the call's ``stream``. A continuation relay adds
    (SPEC F8: messages after the body's own) is appended as assistant text. As in
    `messages_request`, whitespace at the end of a final assistant text is cut (Anthropic
    refuses it) and returned, for the continuation not to repeat it.
    """
    inbound = call.inbound
    if inbound.dialect != "anthropic" or inbound.body is None:
        return None
    body = dict(inbound.body)
    body["model"] = call.model
    if call.stream:
        body["stream"] = True
    else:
        body.pop("stream", None)
    turns = list(body.get("messages") or ())
    for i, message in enumerate(call.messages[inbound.turns:], start=len(turns)):
        blocks = _blocks(message.get("content"), f"messages[{i}]", images=False)
        if not blocks:
            continue
        if turns and turns[-1].get("role") == "assistant":
            last = turns[-1]
            turns[-1] = {**last, "content": _as_blocks(last.get("content")) + blocks}
        else:
            turns.append({"role": "assistant", "content": blocks})
    stripped = ""
    if turns and turns[-1].get("role") == "assistant":
        last = turns[-1]
        content = _as_blocks(last.get("content"))
        if content and content[-1].get("type") == "text" and isinstance(
                content[-1].get("text"), str):
            text = content[-1]["text"]
            kept = text.rstrip()
            if kept != text:
                stripped = text[len(kept):]
                content[-1] = {**content[-1], "text": kept}
                if not kept:
                    content.pop()
                turns[-1] = {**last, "content": content}
                if not content:
                    turns.pop()
    body["messages"] = turns
    return body, stripped


def _as_blocks(content: Any) -> list[Any]:
    """Messages content (a string or blocks) as a new list of blocks."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content) if isinstance(content, list) else []
