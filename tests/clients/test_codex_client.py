"""The real Codex CLI (``codex exec``, pinned @openai/codex 0.171.0, installed by
`.ci/install-clis.sh`) as a *client* of relay, over ``/v1/responses`` (SPEC A7).

Codex, relay (``relay serve``, this tree) and the fake upstreams (tests/fakes/agent_fakes.py)
all run inside a network namespace that has only loopback, so nothing can reach the
network. Codex gets a custom model provider pointed at relay and only the switches the
issue allows (``--skip-git-repo-check``, ``-c analytics.enabled=false``, a sandbox mode);
it must answer, streamed, with one tool round trip — a shell call that reads a file only
the throwaway work folder holds — through each kind of provider:

(a) an OpenAI-compatible provider that speaks only chat completions (the translation),
(b) the anthropic adapter,
(c) an OpenAI-compatible provider that speaks Responses itself (``responses = true``:
    the pass-through).

And on the packaged default's ``fake/echo`` (no tool calls), with Codex's default
tools all offered: it answers, and the answer reports the tools dropped (SPEC A1a
amended: offered tools are advisory there).

A test skips, saying why, when ``codex``, ``ip netns`` or root is missing (CI makes skips
failures).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import netns_stage

PINNED = "@openai/codex 0.171.0"
KEY = "sk-ant-test"  # tests/fakes/fake_anthropic.py's


class Stage(netns_stage.Stage):
    """The namespace, with tests/fakes/agent_fakes.py and ``relay serve`` running inside it."""

    tool = "codex"
    fakes = "agent_fakes.py"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.work = root

    def config(self, ports: dict[str, int]) -> str:
        return f"""
[server]
records = "records.jsonl"
[providers.up]
adapter = "openai"
base_url = "http://127.0.0.1:{ports['chat']}/v1"
models = ["agent"]
[providers.up.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 30
run_timeout_s = 60
[providers.ant]
adapter = "anthropic"
base_url = "http://127.0.0.1:{ports['anthropic']}/v1"
api_key_env = "FAKE_ANTHROPIC_KEY"
models = ["claude-agent"]
[providers.oa]
adapter = "openai"
base_url = "http://127.0.0.1:{ports['responses']}/v1"
responses = true
models = ["gpt-agent"]
[providers.oa.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 30
run_timeout_s = 60
[providers.fake]                    # the packaged default's own
adapter = "fake"
models = ["echo"]
"""

    def env(self) -> dict[str, str]:
        return {"FAKE_ANTHROPIC_KEY": KEY}


@pytest.fixture(scope="module")
def stage() -> Iterator[Stage]:
    yield from netns_stage.open_stage(Stage, PINNED, "codex")


def run_codex(stage: Stage, model: str, prompt: str, *, check: bool = True,
              provider_extra: str = "") -> list[dict[str, Any]]:
    """``codex exec --json`` in a throwaway work folder: its events."""
    home = Path(tempfile.mkdtemp(prefix="home-", dir=stage.root))
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "relay"
[model_providers.relay]
name = "relay"
base_url = "{stage.url}/v1"
env_key = "RELAY_TEST_KEY"
wire_api = "responses"
supports_websockets = false
{provider_extra}""")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "CODEX_HOME": str(codex_home), "TMPDIR": str(home), "RELAY_TEST_KEY": "sk-x"}
    done = subprocess.run(
        ["ip", "netns", "exec", stage.name, "codex", "exec", "--skip-git-repo-check",
         "-c", "analytics.enabled=false", "--sandbox", "read-only", "--json",
         prompt], cwd=stage.work, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, timeout=120, check=False)
    events = [json.loads(line) for line in done.stdout.decode().splitlines()
              if line.startswith("{")]
    assert done.returncode == 0 or not check, (done.returncode, done.stdout.decode()[-3000:],
                                  done.stderr.decode()[-3000:])
    return events


@pytest.mark.parametrize(("model", "fake"), [
    ("up/agent", "chat"), ("ant/claude-agent", "anthropic"), ("oa/gpt-agent", "responses")])
def test_codex_exec_answers_with_a_shell_round_trip(stage: Stage, tmp_path: Path,
                                                    model: str, fake: str) -> None:
    stage.work = tmp_path / "work"
    stage.work.mkdir()
    marker = f"MARKER-{secrets.token_hex(4)}"
    (stage.work / "relay-marker.txt").write_text(marker + "\n")
    before = len(stage.requests())
    events = run_codex(stage, model,
                       'RELAY-CALL exec_command {"cmd": "cat relay-marker.txt"}')
    messages = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages and messages[-1].startswith("RELAY-DONE"), events
    assert marker in messages[-1]  # only the shell in the work folder could read it
    ran = [e["item"] for e in events if e.get("type") == "item.completed"
           and e["item"].get("type") == "command_execution"]
    assert ran and "relay-marker.txt" in ran[0]["command"]
    sent = [r for r in stage.requests()[before:] if r["fake"] == fake]
    assert len(sent) == 2, [r["path"] for r in stage.requests()[before:]]
    assert marker in json.dumps(sent[1]["body"])  # the tool output went back upstream
    assert all(r["body"].get("stream") is True for r in sent)  # streamed all the way
    if fake == "responses":  # passed through: Codex's own request, whole
        assert sent[0]["path"] == "/v1/responses"
        assert any(t.get("type") == "web_search" for t in sent[0]["body"]["tools"])
        assert "previous_response_id" not in sent[1]["body"]
    recs = [r for r in stage.records() if r["provider"] == model.split("/")[0]][-2:]
    assert [r["status"] for r in recs] == [200, 200] and all(r["stream"] for r in recs)
    if fake != "responses":
        assert "tools.web_search" in recs[0]["ignored_fields"]


@pytest.mark.parametrize("model", ["up/agent", "oa/gpt-agent"])
def test_codex_gets_relays_verdict_on_a_failure(stage: Stage, tmp_path: Path,
                                                model: str) -> None:
    """An upstream 500 that relay has already answered for: a 502 ``upstream_error``
    with ``x-should-retry: false`` and relay's words, which Codex shows.

    Codex 0.171 does not read ``x-should-retry``: with its defaults it resends the
    request (``request_max_retries`` 4, then ``stream_max_retries`` 5 reconnects: 30
    requests, measured). Its own provider settings turn that off, as they do for any
    provider that retries for it; with them, relay sees the request exactly once.
    """
    stage.work = tmp_path
    before = len(stage.records())
    events = run_codex(stage, model, "Say hi. RELAY-FAIL500", check=False,
                       provider_extra="request_max_retries = 0\nstream_max_retries = 0\n")
    failed = [e for e in events if e.get("type") == "turn.failed"]
    assert failed, events
    assert "upstream_error" in failed[-1]["error"]["message"] or \
        "502" in failed[-1]["error"]["message"], failed
    recs = stage.records()[before:]
    assert [(r["status"], r["reason"]) for r in recs] == [(502, "upstream_error")], recs


def test_codex_answers_on_fake_echo_with_its_default_tools(stage: Stage,
                                                           tmp_path: Path) -> None:
    stage.work = tmp_path
    before = len(stage.records())
    # docs/agents.md's settings, retries off included.
    events = run_codex(stage, "fake/echo", "Say hello to FAKE-ECHO-7.",
                       provider_extra="request_max_retries = 0\nstream_max_retries = 0\n")
    messages = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages and "FAKE-ECHO-7" in messages[-1], events   # the echo of the prompt
    recs = [r for r in stage.records()[before:] if r["provider"] == "fake"]
    print(f"\ncodex exec on fake/echo: {messages[-1][:80]!r}; ignored: "
          f"{recs[-1]['ignored_fields'] if recs else None}")
    assert recs and all(r["status"] == 200 and r["stream"] for r in recs), recs
    assert "tools" in recs[-1]["ignored_fields"], recs[-1]   # its tools, dropped
