"""The real Gemini CLI (``gemini -p``, pinned @google/gemini-cli 0.61.0, installed by
`.ci/install-clis.sh`) as a *client* of relay, over Google's Gemini API (SPEC A9).

The CLI, relay (``relay serve``, this tree) and the fake upstreams
(tests/gemini_agent_fakes.py) all run inside a network namespace that has only loopback,
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
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_procs import FAKE_CLI

HERE = Path(__file__).parent
ROOT = HERE.parent
PINNED = "@google/gemini-cli 0.61.0"
LISTENING = re.compile(r"relay listening on (http://\S+:\d+) ")
ANTHROPIC_KEY = "sk-ant-test"  # tests/fake_anthropic.py's
GEMINI_KEY = "AIza-test"  # tests/fake_gemini.py's
# The CLI's settings: the API-key auth, one attempt (relay has done the retrying), and
# nothing that would phone home.
SETTINGS = {"security": {"auth": {"selectedType": "gemini-api-key"}},
            "general": {"maxAttempts": 1, "disableAutoUpdate": True,
                        "disableUpdateNag": True},
            "telemetry": {"enabled": False},
            "privacy": {"usageStatisticsEnabled": False}}


def _why_not() -> str | None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux (a network namespace with only loopback)"
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2) for `ip netns`; .ci/install-clis.sh installs it"
    if shutil.which("gemini") is None:
        return f"`gemini` is not installed (npm install -g {PINNED.replace(' ', '@')}; " \
            ".ci/install-clis.sh does it)"
    return None


class Stage:
    """The namespace, with the fake upstreams and ``relay serve`` running inside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.name = f"relaygemini-{os.getpid()}"
        self.log = root / "upstream-requests.jsonl"
        self.cli_log = root / "cli.jsonl"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = ""

    def run_in(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["ip", "netns", "exec", self.name, *argv],
                                stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        subprocess.run(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"],
                       check=True, capture_output=True)
        ports_file = self.root / "ports.json"
        fakes = self.run_in([sys.executable, str(HERE / "gemini_agent_fakes.py"), "--ports",
                             str(ports_file), "--log", str(self.log)])
        ports = json.loads(_wait_file(ports_file, fakes))
        (self.root / "relay.toml").write_text(f"""
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
""")
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env.update(PYTHONPATH=str(ROOT), XDG_STATE_HOME=str(self.root / "state"),
                   FAKE_ANTHROPIC_KEY=ANTHROPIC_KEY, FAKE_GEMINI_KEY=GEMINI_KEY)
        with (self.root / "relay.err").open("wb") as err:  # the child has its own copy
            relay = self.run_in([sys.executable, "-m", "relay", "serve", "--config",
                                 str(self.root / "relay.toml"), "--port", "0"],
                                cwd=self.root, env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
        text = _wait_file(self.root / "relay.err", relay, LISTENING)
        match = LISTENING.search(text)
        assert match is not None
        self.url = match[1]

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)

    def requests(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]

    def records(self) -> list[dict[str, Any]]:
        path = self.root / "records.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]


def _wait_file(path: Path, proc: subprocess.Popen[bytes],
               pattern: re.Pattern[str] | None = None) -> str:
    """The file's text once it exists (and matches ``pattern``): bounded, 20 s."""
    for _ in range(2000):
        if path.exists():
            text = path.read_text(errors="replace")
            if pattern is None or pattern.search(text):
                return text
        try:
            proc.wait(timeout=0.01)
            raise RuntimeError(f"{proc.args} exited at start: "
                               f"{path.read_text() if path.exists() else ''}")
        except subprocess.TimeoutExpired:
            continue
    raise RuntimeError(f"{proc.args} did not start")


@pytest.fixture(scope="module")
def stage() -> Iterator[Stage]:
    why = _why_not()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="relay-gemini-"))
    st = Stage(root)
    try:
        st.start()
    except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
        st.stop()
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot stage relay and the Gemini CLI in a loopback-only namespace: "
                    f"{exc}")
    yield st
    st.stop()
    shutil.rmtree(root, ignore_errors=True)


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
