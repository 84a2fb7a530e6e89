#!/usr/bin/env python3
"""The model behind a real coding agent, faked: the upstreams relay serves a real client
(Claude Code) against in ``test_claude_code_client.py``, as one process that runs inside
the test's loopback-only network namespace.

It serves an OpenAI-compatible chat server (`upstream.FakeUpstream`) and the fake
Anthropic API (`fake_anthropic.FakeAnthropic`), each answering as an agent's model would:
a conversation with a ``Read`` tool and no tool result yet gets a ``Read`` tool call for
the file the user names (an absolute path ending in ``.txt``); one whose last turn is a
tool result gets a text answer that quotes it — so the client's final answer holds what
its tool read, only if the round trip went through. Anything else gets the scripts'
default answer.

Usage: ``agent_upstreams.py --ports FILE --log FILE``. Once both listen, FILE gets
``{"openai": port, "anthropic": port}``; every request is appended to the log as one JSON
line (``server``, ``path``, ``headers``, ``body``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the fakes package
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_anthropic import Script as AScript
from fakes.upstream import FakeUpstream, Script, serve_fake_upstream

PATH = re.compile(r"(/[^\s'\"`]+\.txt)")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    out = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict):
            if isinstance(part.get("text"), str):
                out.append(part["text"])
            elif part.get("type") == "tool_result":
                out.append(_text(part.get("content")))
    return "\n".join(out)


def _turns(messages: Any) -> list[dict[str, Any]]:
    """The conversation without its system messages (agents send them mid-way too)."""
    return [m for m in messages or () if isinstance(m, dict) and m.get("role") != "system"]


def _wanted(messages: list[dict[str, Any]]) -> str | None:
    for message in messages:
        if message.get("role") == "user" and (found := PATH.search(_text(
                message.get("content")))):
            return found.group(1)
    return None


def chat_agent(req: Any) -> Script | None:
    turns = _turns(req.get("messages"))
    tools = {(t.get("function") or {}).get("name") for t in req.get("tools") or ()}
    if turns and turns[-1].get("role") == "tool":
        return Script(chunks=["The file says: ", _text(turns[-1].get("content"))])
    path = _wanted(turns)
    if "Read" in tools and path:
        return Script(chunks=["Reading it."], tool_calls=[{
            "id": "call_read_1", "type": "function",
            "function": {"name": "Read", "arguments": json.dumps({"file_path": path})}}])
    return None


def messages_agent(req: Any) -> AScript | None:
    turns = _turns(req.get("messages"))
    tools = {t.get("name") for t in req.get("tools") or ()}
    last = turns[-1] if turns else {}
    results = [b for b in last.get("content") or () if isinstance(b, dict)
               and b.get("type") == "tool_result"] if last.get("role") == "user" else []
    if results:
        return AScript(chunks=["The file says: ", _text(results[-1].get("content"))])
    path = _wanted(turns)
    if "Read" in tools and path:
        return AScript(chunks=["Reading it."], tool_uses=[
            {"id": "toolu_read_1", "name": "Read", "input": {"file_path": path}}])
    return None


async def _log(server: Any, name: str, log: Path) -> None:
    seen = 0
    while True:
        await server.wait_until(lambda n=seen: len(server.requests) > n)
        for r in server.requests[seen:]:
            with log.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"server": name, "path": r.path, "headers": {
                    k: v for k, v in r.headers.items() if k not in ("authorization",
                                                                   "x-api-key")},
                    "body": r.json}) + "\n")
        seen = len(server.requests)


async def main(ports: Path, log: Path) -> None:
    async with trio.open_nursery() as nursery:
        up: FakeUpstream = await nursery.start(serve_fake_upstream)
        ant: FakeAnthropic = await nursery.start(serve_fake_anthropic)
        up.decide, ant.decide = chat_agent, messages_agent
        nursery.start_soon(_log, up, "openai", log)
        nursery.start_soon(_log, ant, "anthropic", log)
        tmp = ports.with_suffix(".tmp")
        tmp.write_text(json.dumps({"openai": up.port, "anthropic": ant.port}))
        tmp.rename(ports)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    trio.run(main, args.ports, args.log)
