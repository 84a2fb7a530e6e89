"""The OpenAI Responses dialect, the translation: a Responses request's fields and
items in relay's own terms (OpenAI chat shapes), field by field. The tables are in
`relay.dialects.openai_responses`, which parses a request through this module."""

from __future__ import annotations

import json
from typing import Any

import attrs

from relay.dialects.openai_chat import INT_MAX, bad_request
from relay.vocab.errors import RelayError

from .responses_custom import custom_as_function

__all__ = ["ADVISORY", "FIELDS", "HOSTED_TOOLS", "Translation", "tool_choice",
           "translate_fields", "translate_input", "translate_tools", "unsupported"]

# Tools OpenAI runs itself (or that only its own models are trained for): nothing relay
# can run behind another provider.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview",
    "web_search_preview_2025_03_11", "file_search", "code_interpreter", "computer",
    "computer_use_preview", "image_generation", "mcp", "local_shell", "shell",
    "apply_patch", "tool_search", "programmatic_tool_calling"})
# Call items of hosted tools: history the translation drops (and reports).
_HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "image_generation_call",
    "code_interpreter_call", "mcp_call", "mcp_list_tools", "tool_search_call",
    "tool_search_output"})
# Advisory on the translation: dropped and reported (SPEC A1a).
ADVISORY = frozenset({
    "metadata", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "safety_identifier", "client_metadata", "max_tool_calls", "context_management"})
# Every field this dialect knows, and what the translation does with it (for the field
# policy's walk: relay.api.fields).
FIELDS: dict[str, str] = {
    "model": "relay", "input": "translated", "instructions": "translated",
    "stream": "relay", "store": "relay", "previous_response_id": "relay",
    "fallbacks": "relay", "tools": "translated", "tool_choice": "translated",
    "parallel_tool_calls": "translated", "text": "translated", "reasoning": "translated",
    "max_output_tokens": "translated", "temperature": "translated", "top_p": "translated",
    "top_logprobs": "translated", "user": "translated", "include": "neutral",
    "stream_options": "neutral", "truncation": "neutral", "service_tier": "neutral",
    "background": "refused", "conversation": "refused", "prompt": "refused",
    **dict.fromkeys(ADVISORY, "advisory"),
}
_NEUTRAL_INCLUDE_LOGPROBS = "message.output_text.logprobs"


def unsupported(message: str, param: str) -> RelayError:
    return RelayError("unsupported", message, param=param)


@attrs.define
class Translation:
    """A Responses request in relay's own terms, and what the translation had to drop
    (``ignored``) or cannot do (``problems``, each a 400 when the translation runs)."""

    messages: list[dict[str, Any]] = attrs.field(factory=list)
    params: dict[str, Any] = attrs.field(factory=dict)
    ignored: list[str] = attrs.field(factory=list)
    problems: list[RelayError] = attrs.field(factory=list)
    # a chat-level param → the client's name for it, where they differ (Inbound.names)
    names: dict[str, str] = attrs.field(factory=dict)
    custom: set[str] = attrs.field(factory=set)            # chat names of custom tools
    namespaced: dict[str, tuple[str, str]] = attrs.field(factory=dict)  # chat name → ns, name

    def drop(self, name: str) -> None:
        if name not in self.ignored:
            self.ignored.append(name)

    def refuse(self, error: RelayError) -> None:
        self.problems.append(error)


# --- input items → messages ----------------------------------------------------------------

def _text_of(part: dict[str, Any], key: str, where: str) -> str:
    value = part.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", "input")
    return value


def _parts(content: Any, where: str, t: Translation) -> str | list[dict[str, Any]] | None:
    """A message's (or a tool output's) content → chat content."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"{at} must be an object with a 'type'", "input")
        if kind in ("input_text", "output_text", "text"):
            out.append({"type": "text", "text": _text_of(part, "text", at)})
        elif kind == "refusal":
            out.append({"type": "text", "text": _text_of(part, "refusal", at)})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            out.append({"type": "image_url", "image_url": image})
        elif kind == "input_file" and isinstance(part.get("file_data"), str):
            out.append({"type": "file", "file": {
                "file_data": part["file_data"],
                "filename": str(part.get("filename") or "file")}})
        else:
            t.refuse(unsupported(f"{at}: relay cannot pass a {kind!r} part (file ids and "
                                  "file URLs live at OpenAI) to this provider", "input"))
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _chat_name(item: dict[str, Any], t: Translation) -> str:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("a tool call item needs a 'name'", "input")
    namespace = item.get("namespace")
    return f"{namespace}__{name}" if isinstance(namespace, str) and namespace else name


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.call_id must be a string", "input")
    return call_id


def translate_input(items: list[Any], t: Translation) -> None:
    """Input items (already expanded) → chat messages, into ``t``."""
    messages = t.messages
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or "
                                  "assistant", "input")
            content = _parts(item.get("content"), f"{where}.content", t)
            if role == "assistant":
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and \
                        "tool_calls" not in last and isinstance(content, str):
                    last["content"] = (last["content"] or "") + content
                    continue
            messages.append({"role": "system" if role == "developer" else role,
                             "content": content if content is not None else ""})
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "function_call":
                args = item.get("arguments")
                if not isinstance(args, str):
                    raise bad_request(f"{where}.arguments must be a string", "input")
            else:
                args = json.dumps({"input": _text_of(item, "input", where)})
            _add_call(messages, {"id": _call_id(item, where), "type": "function",
                                 "function": {"name": _chat_name(item, t),
                                              "arguments": args}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = _parts(item.get("output"), f"{where}.output", t)
            messages.append({"role": "tool", "tool_call_id": _call_id(item, where),
                             "content": output if output is not None else ""})
        elif kind == "reasoning":
            t.drop("input.reasoning")
        elif kind in _HOSTED_ITEMS:
            t.drop(f"input.{kind}")
        else:
            t.refuse(unsupported(f"{where}: relay cannot pass a {kind!r} item to this "
                                  "provider", "input"))


# --- tools ---------------------------------------------------------------------------------

def _function(tool: dict[str, Any], name: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name,
                          "parameters": tool.get("parameters") or {"type": "object",
                                                                   "properties": {}}}
    for key in ("description", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _client_tool(tool: dict[str, Any], where: str, t: Translation, namespace: str | None
                 ) -> dict[str, Any] | None:
    kind, name = tool.get("type"), tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where} needs a 'name'", "tools")
    chat = f"{namespace}__{name}" if namespace else name
    if namespace:
        t.namespaced[chat] = (namespace, name)
    if kind == "function":
        return _function(tool, chat)
    if kind == "custom":
        t.custom.add(chat)
        return custom_as_function(tool, chat)
    return None


def translate_tools(tools: Any, t: Translation) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"{where} must be an object with a 'type'", "tools")
        if kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list) or not isinstance(tool.get("name"), str):
                raise bad_request(f"{where} needs a 'name' and a list of 'tools'", "tools")
            for j, sub in enumerate(inner):
                fn = _client_tool(sub, f"{where}.tools[{j}]", t, tool["name"]) \
                    if isinstance(sub, dict) else None
                if fn is None:
                    raise bad_request(f"{where}.tools[{j}] must be a function or custom "
                                      "tool", "tools")
                out.append(fn)
            continue
        fn = _client_tool(tool, where, t, None) if kind in ("function", "custom") else None
        if fn is not None:
            out.append(fn)
        elif kind in HOSTED_TOOLS:
            t.drop(f"tools.{kind}")  # offered, not required: the model answers without it
        else:
            t.refuse(unsupported(f"{where}: relay does not know the tool type {kind!r}",
                                  "tools"))
    names = [fn["function"]["name"] for fn in out]
    if len(set(names)) != len(names):
        raise bad_request("two tools have the same name (a namespace's tools are named "
                          "NAMESPACE__NAME here)", "tools")
    return out


def tool_choice(choice: Any, tools: list[dict[str, Any]], t: Translation) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise bad_request("'tool_choice' must be auto, none, required or an object",
                          "tool_choice")
    kind = choice["type"]
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools" and isinstance(choice.get("tools"), list):
        allowed = {c.get("name") for c in choice["tools"] if isinstance(c, dict)}
        tools[:] = [fn for fn in tools if fn["function"]["name"] in allowed
                    or t.namespaced.get(fn["function"]["name"], ("", ""))[1] in allowed]
        return choice.get("mode") if choice.get("mode") in ("auto", "required") else "auto"
    t.refuse(unsupported(f"tool_choice asks for the tool {kind!r}, which relay cannot "
                          "run for this provider (OpenAI runs it itself)", "tool_choice"))
    return None


# --- the other fields ----------------------------------------------------------------------

def _text_format(text: Any, t: Translation) -> None:
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object", "text")
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        t.params["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be an object", "text")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description")
                  if fmt.get(k) is not None}
        schema.setdefault("name", "response")
        t.params["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("text.format.type must be text, json_object or json_schema", "text")
    if text.get("verbosity") not in (None, "medium"):
        t.drop("text.verbosity")


def _reasoning(reasoning: Any, t: Translation) -> None:
    if not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object", "reasoning")
    if isinstance(reasoning.get("effort"), str):
        t.params["reasoning_effort"] = reasoning["effort"]
        t.names["reasoning_effort"] = "reasoning.effort"
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, "none"):
            t.drop(f"reasoning.{key}")


def _whole(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 1 <= value <= INT_MAX):
        raise bad_request(f"'{key}' must be a whole number from 1 to {INT_MAX}", key)
    return value


def _number(data: dict[str, Any], key: str) -> None:
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise bad_request(f"'{key}' must be a number", key)


def translate_fields(data: dict[str, Any], t: Translation) -> None:
    params = t.params
    if (limit := _whole(data, "max_output_tokens")) is not None:
        params["max_tokens"] = limit
        t.names["max_tokens"] = "max_output_tokens"
    for key in ("temperature", "top_p"):
        _number(data, key)
        if data.get(key) is not None:
            params[key] = data[key]
    if data.get("top_logprobs") is not None:
        params["logprobs"] = True
        params["top_logprobs"] = data["top_logprobs"]
        t.names["logprobs"] = "top_logprobs"
    if data.get("user") is not None:
        params["user"] = data["user"]
    if data.get("parallel_tool_calls") is not None:
        params["parallel_tool_calls"] = data["parallel_tool_calls"]
    include = data.get("include")
    if include is not None and not isinstance(include, list):
        raise bad_request("'include' must be a list", "include")
    if _NEUTRAL_INCLUDE_LOGPROBS in (include or ()):
        params["logprobs"] = True
        t.names.setdefault("logprobs", "include")
    if data.get("text") is not None:
        _text_format(data["text"], t)
        t.names["response_format"] = "text.format"
    if data.get("reasoning") is not None:
        _reasoning(data["reasoning"], t)
    if data.get("truncation") not in (None, "disabled"):
        t.drop("truncation")
    if data.get("service_tier") not in (None, "auto", "default"):
        t.drop("service_tier")
    for key in sorted(ADVISORY):
        if data.get(key) is not None:
            t.drop(key)
    for key in data:
        if key not in FIELDS and data[key] is not None:
            t.refuse(unsupported(f"relay does not know the Responses field {key!r}, so it "
                                  "cannot pass it to a provider that does not speak "
                                  "Responses", key))
