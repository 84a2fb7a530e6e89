"""The real Gemini CLI (``gemini -p``, pinned @google/gemini-cli 0.61.0, installed by
`.ci/install-clis.sh`) as a *client* of relay, over Google's Gemini API (SPEC A9).

The CLI, relay (``relay serve``, this tree) and the fake upstreams
(tests/fakes/gemini_agent_fakes.py) all run inside a network namespace that has only loopback,
so nothing can reach the network (its telemetry, update check and usage statistics are
off in its settings as well). The CLI is pointed at relay the one way it offers —
``GOOGLE_GEMINI_BASE_URL`` — with ``GEMINI_API_KEY`` and the ``gemini-api-key`` auth
type (without it, a base URL switches the CLI to "gateway" auth, which headless mode
refuses) and ``-m PROVIDER/MODEL`` (which also skips its model router's classifier
call). It must answer, streamed, through each kind of provider, with a tool round trip
(``list_directory`` on a folder only the throwaway work folder holds) where the
provider calls tools:

(a) an OpenAI-compatible provider that speaks only chat completions (translation),
(b) the anthropic adapter (translation),
(c) the gemini adapter (native: the CLI's own request, whole),
(d) a CLI-tool provider (the fake ``claude`` program) and ``fake/echo``, with the CLI's
    tools off and with its default tools on: offered tools are dropped there and
    reported in ``ignored_fields`` (SPEC A1a amended; checked below).

`run_gemini` takes the provider as a parameter, so more cases are one line each. A test
skips, saying why, when ``gemini``, ``ip netns`` or root is missing (CI makes skips
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
from helpers.cli_procs import FAKE_CLI

PINNED = "@google/gemini-cli 0.61.0"
ANTHROPIC_KEY = "sk-ant-test"  # tests/fakes/fake_anthropic.py's
GEMINI_KEY = "AIza-test"  # tests/fakes/fake_gemini.py's
# The CLI's settings: the API-key auth, one attempt (relay has done the retrying), and
# nothing that would phone home.
SETTINGS = {"security": {"auth": {"selectedType": "gemini-api-key"}},
            "general": {"maxAttempts": 1, "disableAutoUpdate": True,
                        "disableUpdateNag": True},
            "telemetry": {"enabled": False},
            "privacy": {"usageStatisticsEnabled": False}}


class Stage(netns_stage.Stage):
    """The namespace, with tests/fakes/gemini_agent_fakes.py and ``relay serve`` inside it."""

    tool = "gemini"
    fakes = "gemini_agent_fakes.py"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.cli_log = root / "cli.jsonl"

    def config(self, ports: dict[str, int]) -> str:
        return f"""
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
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
[providers.gem]
adapter = "gemini"
base_url = "http://127.0.0.1:{ports['gemini']}/v1beta"
api_key_env = "FAKE_GEMINI_KEY"
models = ["gemini-agent"]
[providers.gem.profile]
rpm = 0
[routes."gemini-3.5-flash-lite"]
primary = "up/agent"
[routes."gemini-3.1-pro-preview"]
primary = "up/agent"
[providers.tool]
adapter = "claude-cli"
command = "{FAKE_CLI / 'claude'}"
env = {{ FAKE_CLI_LOG = "{self.cli_log}" }}
"""

    def env(self) -> dict[str, str]:
        return {"FAKE_ANTHROPIC_KEY": ANTHROPIC_KEY, "FAKE_GEMINI_KEY": GEMINI_KEY}


@pytest.fixture(scope="module")
def stage() -> Iterator[Stage]:
    yield from netns_stage.open_stage(Stage, PINNED, "the Gemini CLI")


def run_gemini(stage: Stage, work: Path, model: str | None, prompt: str, *,
               settings: dict[str, Any] | None = None,
               check: bool = True) -> tuple[int, list[dict[str, Any]], str]:
    """``gemini -p PROMPT -m MODEL --output-format stream-json`` in ``work``, pointed at
    relay: its exit code, its events, its stderr."""
    home = Path(tempfile.mkdtemp(prefix="home-", dir=stage.root))
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps({**SETTINGS,
                                                                **(settings or {})}))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "TMPDIR": str(home), "GOOGLE_GEMINI_BASE_URL": stage.url,
           "GEMINI_API_KEY": "relay-key", "GEMINI_CLI_NO_RELAUNCH": "true",
           "NO_COLOR": "1"}
    done = subprocess.run(
        ["ip", "netns", "exec", stage.name, "gemini", "-p", prompt,
         *(["-m", model] if model else []),
         "--output-format", "stream-json", "--skip-trust"], cwd=work, env=env,
        stdin=subprocess.DEVNULL, capture_output=True, timeout=120, check=False)
    events = [json.loads(line) for line in done.stdout.decode().splitlines()
              if line.startswith("{")]
    stderr = done.stderr.decode()
    assert done.returncode == 0 or not check, (done.returncode, done.stdout.decode()[-3000:],
                                               stderr[-3000:])
    return done.returncode, events, stderr


def _answer(events: list[dict[str, Any]]) -> str:
    assert any(e.get("type") == "result" and e.get("status") == "success" for e in events), \
        events
    return "".join(e.get("content") or "" for e in events
                   if e.get("type") == "message" and e.get("role") == "assistant")


@pytest.mark.parametrize(("model", "fake"), [
    ("up/agent", "chat"), ("ant/claude-agent", "anthropic"), ("gem/gemini-agent", "gemini")])
def test_gemini_cli_answers_with_a_tool_round_trip(stage: Stage, tmp_path: Path,
                                                   model: str, fake: str) -> None:
    work = tmp_path / "work"
    (work / f"only-here-{secrets.token_hex(4)}").mkdir(parents=True)
    marker = next(work.iterdir()).name
    before = len(stage.requests())
    _, events, _ = run_gemini(stage, work, model, "RELAY-CALL list_directory "
                              + json.dumps({"dir_path": str(work)}))
    answer = _answer(events)
    assert answer.startswith("RELAY-DONE"), events
    assert marker in answer  # only the CLI's tool, in the work folder, could list it
    assert any(e.get("type") == "tool_use" and e.get("tool_name") == "list_directory"
               for e in events), events
    sent = [r for r in stage.requests()[before:] if r["fake"] == fake]
    assert len(sent) == 2, [r["path"] for r in stage.requests()[before:]]
    assert marker in json.dumps(sent[1]["body"])  # the tool output went back upstream
    if fake == "gemini":  # native: the CLI's own request, whole
        assert sent[0]["path"].endswith(":streamGenerateContent?alt=sse")
        assert "systemInstruction" in sent[0]["body"]
        assert "thinkingConfig" in json.dumps(sent[0]["body"])
    else:
        assert all(r["body"].get("stream") is True for r in sent)  # streamed all the way
    recs = [r for r in stage.records() if r["provider"] == model.split("/")[0]][-2:]
    assert [r["status"] for r in recs] == [200, 200] and all(r["stream"] for r in recs)
    assert all(r["endpoint"].endswith(":streamGenerateContent") for r in recs)


@pytest.mark.parametrize("model", ["tool/ok", "fake/echo"])
def test_gemini_cli_on_a_tool_less_provider(stage: Stage, tmp_path: Path, model: str) -> None:
    """A CLI tool as a plain answerer: with the CLI's tools off it answers; with its
    default tools (offered, AUTO) it answers too, and the dropped tools are reported in
    the record's ``ignored_fields`` (SPEC A1a amended) -- a refusal fails this test."""
    before = len(stage.records())
    _, events, _ = run_gemini(stage, tmp_path, model, "Say hi.",
                              settings={"tools": {"core": []}})
    assert _answer(events).strip(), events
    rc, events, stderr = run_gemini(stage, tmp_path, model, "Say hi.", check=False)
    recs = stage.records()[before:]
    assert recs[0]["status"] == 200
    assert rc == 0, (rc, stderr, recs[-1])
    assert recs[-1]["status"] == 200, recs[-1]
    assert _answer(events).strip(), events
    assert "tools" in recs[-1]["ignored_fields"], recs[-1]

def test_gemini_cli_without_a_model_uses_its_router(stage: Stage, tmp_path: Path) -> None:
    """Without ``-m`` the CLI first asks its router's classifier (``:generateContent`` in
    JSON mode — ``responseMimeType`` + ``responseJsonSchema``, checked by relay — on
    ``gemini-3.5-flash-lite``), then streams on the model it chose
    (``gemini-3.1-pro-preview`` for "pro"): relay routes named after them answer both."""
    before = len(stage.records())
    _, events, _ = run_gemini(stage, tmp_path, None, "Say hi.")
    assert _answer(events) == "RELAY-OK", events
    recs = stage.records()[before:]
    assert [(r["route"], r["status"]) for r in recs] == [
        ("gemini-3.5-flash-lite", 200), ("gemini-3.1-pro-preview", 200)], recs
    assert recs[0]["endpoint"].endswith("gemini-3.5-flash-lite:generateContent")
    asked = [r for r in stage.requests() if r["fake"] == "chat"][-2]["body"]
    assert asked["response_format"]["type"] == "json_schema"
