"""Custom (free-form) tools for providers that have none (SPEC A7): such a tool goes to
the provider as a function with one string argument, ``input``; its calls come back as
``custom_tool_call`` items, their input decoded from the arguments as they stream."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["StringValue", "custom_as_function", "custom_input"]

_PREFIX = re.compile(r'\s*\{\s*"input"\s*:\s*"')


def custom_as_function(tool: dict[str, Any], name: str) -> dict[str, Any]:
    found = tool.get("format")
    fmt: dict[str, Any] = found if isinstance(found, dict) else {}
    about = "The tool's whole input, as free-form text."
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        about += (f" It must match this {fmt.get('syntax', 'lark')} grammar:\n"
                  f"{fmt['definition']}")
    fn: dict[str, Any] = {"name": name, "parameters": {
        "type": "object", "properties": {"input": {"type": "string", "description": about}},
        "required": ["input"], "additionalProperties": False}}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def custom_input(arguments: str) -> str:
    """The one string argument of a translated custom tool's call (the arguments whole,
    when the model did not keep to the schema)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


class StringValue:
    """The string a translated custom tool's arguments (``{"input": "…"}``) hold,
    decoded as its JSON arrives, so its input streams as the model writes it."""

    def __init__(self) -> None:
        self.raw = ""
        self.pos: int | None = None
        self.stopped = False

    def feed(self, piece: str) -> str:
        self.raw += piece
        if self.stopped:
            return ""
        if self.pos is None:
            match = _PREFIX.match(self.raw)
            if match is None:
                if len(self.raw) > 64 or not '{"input":"'.startswith(
                        re.sub(r"\s", "", self.raw)[:10]):
                    self.stopped = True  # not the expected shape: given whole at the end
                return ""
            self.pos = match.end()
        end, i, raw = self.pos, self.pos, self.raw
        while i < len(raw):
            c = raw[i]
            if c == '"':
                self.stopped = True
                break
            if c == "\\":
                if i + 1 >= len(raw):
                    break
                if raw[i + 1] == "u":
                    width = 6
                    if i + 6 <= len(raw) and 0xD800 <= int(raw[i + 2:i + 6] or "0", 16) \
                            <= 0xDBFF:
                        width = 12  # a surrogate pair is decoded whole
                    if i + width > len(raw):
                        break
                    i += width
                else:
                    i += 2
            else:
                i += 1
            end = i
        try:
            text = json.loads('"' + raw[self.pos:end] + '"')
        except ValueError:
            self.stopped = True
            return ""
        self.pos = end
        return str(text)
