"""How the fake upstreams play a model in an agent's tool round trip.

A user message holding ``RELAY-CALL <tool> <json arguments>`` is answered with a call of
that tool (when the request offers it); once the conversation holds that call's output,
the answer is ``RELAY-DONE <the output>``. Anything else is answered ``RELAY-OK``. The
three wire formats (chat completions, Responses, Anthropic Messages) are read into the
same three facts: the last user text, the tools offered, the tool outputs after it.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["Turn", "decide", "from_chat", "from_messages", "from_responses"]

_CALL = re.compile(r"RELAY-CALL (\S+) (\{.*?\})(?:\s|$)", re.S)


class Turn:
    def __init__(self, user: str, tools: list[str], outputs: list[str]) -> None:
        self.user, self.tools, self.outputs = user, tools, outputs


def decide(turn: Turn) -> tuple[str, str, str]:
    """("call", name, arguments), ("text", "", text), or ("fail", "", status) when the
    user text holds ``RELAY-FAIL<status>``."""
    failing = re.search(r"RELAY-FAIL(\d{3})", turn.user)
    if failing:
        return "fail", "", failing[1]
    if turn.outputs:
        return "text", "", "RELAY-DONE " + " | ".join(o.strip() for o in turn.outputs)
    match = _CALL.search(turn.user)
    if match and match[1] in turn.tools:
        return "call", match[1], match[2]
    if match:
        return "text", "", f"RELAY-NO-TOOL {match[1]} (offered: {', '.join(turn.tools)})"
    return "text", "", "RELAY-OK"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    out = []
    for part in content or ():
        if isinstance(part, dict):
            for key in ("text", "output", "content"):
                if isinstance(part.get(key), str):
                    out.append(part[key])
    return "\n".join(out)


def from_chat(body: dict[str, Any]) -> Turn:
    messages = body.get("messages") or []
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    tools = [t["function"]["name"] for t in body.get("tools") or () if "function" in t]
    outputs = [_text(m.get("content")) for m in messages[last + 1:] if m.get("role") == "tool"]
    return Turn(_text(messages[last].get("content")) if last >= 0 else "", tools, outputs)


def from_responses(body: dict[str, Any]) -> Turn:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    items = items or []
    last = max((i for i, m in enumerate(items) if m.get("type", "message") == "message"
                and m.get("role") == "user"), default=-1)
    tools: list[str] = []
    for tool in body.get("tools") or ():
        if tool.get("type") == "namespace":
            tools += [t.get("name") for t in tool.get("tools") or ()]
        elif tool.get("name"):
            tools.append(tool["name"])
    outputs = [_text(o.get("output")) for o in items[last + 1:]
               if o.get("type") in ("function_call_output", "custom_tool_call_output")]
    return Turn(_text(items[last].get("content")) if last >= 0 else "", tools, outputs)


def from_messages(body: dict[str, Any]) -> Turn:
    messages = body.get("messages") or []
    user, outputs = "", []
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts = [b.get("text") for b in blocks or () if b.get("type") == "text"]
        results = [b for b in blocks or () if b.get("type") == "tool_result"]
        if texts and not results:
            user, outputs = "\n".join(t for t in texts if isinstance(t, str)), []
        for result in results:
            outputs.append(_text(result.get("content")))
    tools = [t.get("name") for t in body.get("tools") or ()]
    return Turn(user, tools, outputs)


def arguments(raw: str) -> dict[str, Any]:
    value = json.loads(raw)
    return value if isinstance(value, dict) else {}
