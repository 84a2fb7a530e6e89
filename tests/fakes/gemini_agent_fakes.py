#!/usr/bin/env python3
"""The fake upstreams of the Gemini CLI client test (test_gemini_cli_client.py), as one
process: an OpenAI-compatible server that speaks only chat completions
(tests/fakes/upstream.py), the fake Anthropic API (tests/fakes/fake_anthropic.py) and
the fake Gemini API (tests/fakes/fake_gemini.py), each playing an agent's model
(tests/fakes/agent_turns.py): a user text ``RELAY-CALL <tool> <json>`` gets a call of
that tool when it is offered, and once the conversation holds its output,
``RELAY-DONE <the output>``.

It runs beside relay and the client inside a loopback-only network namespace:
``gemini_agent_fakes.py --ports FILE --log FILE`` writes ``{"chat": PORT, "anthropic":
PORT, "gemini": PORT}`` to ``--ports`` once all three listen, and appends every request
they get to ``--log`` as one JSON line (``{"fake", "path", "body"}``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the fakes package

from fakes.agent_fakes import log_requests
from fakes.agent_turns import Turn, decide
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_gemini import FakeGemini, Script
from fakes.fake_http import Exchange, serve_fake
from fakes.upstream import FakeUpstream, serve_fake_upstream
from fakes.upstream import Script as ChatScript


def from_gemini(body: dict[str, Any]) -> Turn:
    """A ``generateContent`` request read as the agent's three facts: the last user
    text, the functions offered, the function outputs after that text."""
    contents = [c for c in body.get("contents") or () if isinstance(c, dict)]
    last, user = -1, ""
    for i, content in enumerate(contents):
        texts = [p["text"] for p in content.get("parts") or ()
                 if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if content.get("role", "user") == "user" and texts:
            last, user = i, "\n".join(texts)
    tools = [d.get("name") for t in body.get("tools") or ()
             for d in t.get("functionDeclarations") or ()]
    outputs = [json.dumps(p["functionResponse"].get("response"))
               for c in contents[last + 1:] for p in c.get("parts") or ()
               if isinstance(p, dict) and isinstance(p.get("functionResponse"), dict)]
    return Turn(user, tools, outputs)


class AgentGemini(FakeGemini):
    """The fake Gemini API, answering as an agent's model (see the module docstring)."""

    async def respond(self, ex: Exchange) -> None:
        body = ex.json if isinstance(ex.json, dict) else {}
        name = ex.path.partition("/v1beta/models/")[2].partition(":")[0]
        kind, tool, text = decide(from_gemini(body))
        if kind == "call":
            self.scripts[name] = Script(chunks=[], function_calls=[
                {"name": tool, "args": json.loads(text)}])
        elif kind == "text":
            self.scripts[name] = Script(chunks=[text])
        else:
            self.scripts[name] = Script(status=int(text))
        await super().respond(ex)


def classifier(req: dict[str, Any]) -> Script | None:
    """The Gemini CLI's model router asks for a JSON choice (``responseJsonSchema``,
    a ``response_format`` by the time it reaches a chat server): "pro"."""
    if (req.get("response_format") or {}).get("type") != "json_schema":
        return None
    return ChatScript(chunks=['{"reasoning": "simple", "model_choice": "pro"}'])


async def main(ports: Path, log: Path) -> None:
    async with trio.open_nursery() as nursery:
        chat: FakeUpstream = await nursery.start(serve_fake_upstream)
        chat.agent, chat.decide = True, classifier
        anthropic: FakeAnthropic = await nursery.start(serve_fake_anthropic)
        anthropic.agent = True
        gemini: AgentGemini = await nursery.start(
            lambda task_status: serve_fake(AgentGemini, task_status=task_status))
        for name, fake in (("chat", chat), ("anthropic", anthropic), ("gemini", gemini)):
            nursery.start_soon(log_requests, name, fake, log)
        tmp = ports.with_suffix(".tmp")
        tmp.write_text(json.dumps({"chat": chat.port, "anthropic": anthropic.port,
                                   "gemini": gemini.port}))
        tmp.replace(ports)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    trio.run(main, Path(args.ports), Path(args.log))
