"""The OpenAI Agents SDK's default model (the Responses API) through relay, with a
function tool: the agent calls it, gets its output back and answers (SPEC A7).

The SDK runs on asyncio, so each run has a thread and an event loop of its own; relay
and the fake upstream run on trio in the test's nursery, on loopback. Tracing is off:
nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.upstream import FakeUpstream
from helpers.assembled import records, start_relay, with_upstream
from helpers.cloud_helpers import posts

agents = pytest.importorskip("agents", reason="needs openai-agents (the [test] extra)")

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")


def run_agent(base_url: str, model: str, prompt: str) -> tuple[str, list[str]]:
    """One agent run in its own event loop: (final output, the tool's calls)."""
    import openai

    seen: list[str] = []

    @agents.function_tool
    def read_marker(name: str) -> str:
        """Read the marker with this name."""
        seen.append(name)
        return f"MARKER-{name}-CONTENT"

    async def main() -> str:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        agents.set_tracing_disabled(True)
        model_obj = agents.OpenAIResponsesModel(model=model, openai_client=client)
        agent = agents.Agent(name="tester", instructions="Use the tool when asked.",
                             model=model_obj, tools=[read_marker])
        result = await agents.Runner.run(agent, prompt, max_turns=4)
        await client.close()
        return str(result.final_output)

    return asyncio.run(main()), seen


async def _run(base_url: str, model: str, prompt: str) -> tuple[str, list[str]]:
    with trio.fail_after(60):
        return await trio.to_thread.run_sync(run_agent, base_url, model, prompt)


PROMPT = 'Read it. RELAY-CALL read_marker {"name": "blue"}'


async def test_agents_sdk_default_model_with_a_function_tool(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream) -> None:
    upstream.agent = True
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    output, seen = await _run(served.url + "/v1", "up/m2", PROMPT)
    assert seen == ["blue"]
    assert output == "RELAY-DONE MARKER-blue-CONTENT"
    sent: list[Any] = [r.json for r in posts(upstream)]
    assert len(sent) == 2
    assert sent[0]["tools"][0]["function"]["name"] == "read_marker"
    assert sent[1]["messages"][-1] == {"role": "tool", "tool_call_id": sent[1]["messages"][
        -2]["tool_calls"][0]["id"], "content": "MARKER-blue-CONTENT"}
    assert [r["status"] for r in records(tmp_path)] == [200, 200]


async def test_agents_sdk_through_the_anthropic_adapter(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    fake.agent = True
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", ANTHROPIC_KEY)
    served = await start_relay(nursery, f"""
[providers.ant]
adapter = "anthropic"
base_url = "{fake.url}"
api_key_env = "FAKE_ANTHROPIC_KEY"
models = ["claude-x"]
""", tmp_path)
    output, seen = await _run(served.url + "/v1", "ant/claude-x", PROMPT)
    assert (output, seen) == ("RELAY-DONE MARKER-blue-CONTENT", ["blue"])
    assert posts(fake)[0].json["system"][0]["text"] == "Use the tool when asked."
