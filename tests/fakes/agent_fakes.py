#!/usr/bin/env python3
"""The three fake upstreams of the agent-client tests, as one process: an
OpenAI-compatible server that speaks only chat completions (tests/fakes/upstream.py), the fake
Anthropic API (tests/fakes/fake_anthropic.py) and a server that speaks Responses itself
(tests/fakes/fake_responses.py), each playing an agent's model (tests/fakes/agent_turns.py).

It runs beside relay and the client inside a loopback-only network namespace, so it is
a process of its own: ``agent_fakes.py --ports FILE --log FILE`` writes
``{"chat": PORT, "anthropic": PORT, "responses": PORT}`` to ``--ports`` once all three
listen, and appends every request they get to ``--log`` as one JSON line
(``{"fake", "path", "body"}``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the fakes package

from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_responses import FakeResponses, serve_fake_responses
from fakes.upstream import FakeUpstream, serve_fake_upstream


async def log_requests(name: str, fake: Any, log: Path) -> None:
    written = 0
    while True:
        await fake.wait_until(lambda n=written: len(fake.requests) > n)
        with log.open("a", encoding="utf-8") as f:
            for r in fake.requests[written:]:
                f.write(json.dumps({"fake": name, "path": r.path, "body": r.json}) + "\n")
        written = len(fake.requests)


async def main(ports: Path, log: Path) -> None:
    async with trio.open_nursery() as nursery:
        chat: FakeUpstream = await nursery.start(serve_fake_upstream)
        chat.agent = True
        anthropic: FakeAnthropic = await nursery.start(serve_fake_anthropic)
        anthropic.agent = True
        responses: FakeResponses = await nursery.start(serve_fake_responses)
        for name, fake in (("chat", chat), ("anthropic", anthropic),
                           ("responses", responses)):
            nursery.start_soon(log_requests, name, fake, log)
        tmp = ports.with_suffix(".tmp")
        tmp.write_text(json.dumps({"chat": chat.port, "anthropic": anthropic.port,
                                   "responses": responses.port}))
        tmp.replace(ports)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    trio.run(main, Path(args.ports), Path(args.log))
