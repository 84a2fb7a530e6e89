"""The real Claude Code (``claude``, pinned 2.1.332) as a *client* of relay (issue 13).

Claude Code, relay (``relay serve``, this tree) and the fake upstreams behind it
(``agent_upstreams.py``: an OpenAI-compatible chat server and the fake Anthropic API,
each answering as an agent's model: a ``Read`` tool call, then an answer quoting what it
read) all run inside a network namespace that has only loopback, so nothing can reach the
network. Claude Code gets only what the issue allows: its base URL, a key and the model;
the switches that turn its telemetry, error reports and updates off; and
``ANTHROPIC_SMALL_FAST_MODEL`` naming a route of relay's for the small model it uses in the
background. Shown, each with a ``Read`` of a file placed in a throwaway work folder:
``claude -p`` answers through relay, streamed, against (a) an OpenAI-compatible provider
that answers with tool calls and (b) the ``anthropic`` adapter; ``claude -p`` answers
through a CLI-tool provider (the fake claude) and on the packaged default's ``fake/echo``,
with its default tools (offered tools are advisory there, SPEC A1a amended: dropped and
reported in the record), and with ``--tools ""``. Skipped, saying why, without
``claude``, root or ``ip netns`` (CI installs them and turns skips into failures).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from helpers.cli_procs import FAKE_CLI

FAKES = Path(__file__).parents[1] / "fakes"
ROOT = Path(__file__).parents[2]
PIN = "2.1.332"
SECRET = "SECRET-LINE-4711"
LISTENING = re.compile(r"relay listening on (http://\S+:\d+) ")


class Sandbox:
    """A loopback-only network namespace with the fake upstreams and ``relay serve``
    inside, and a HOME and work folder for the client."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ns = f"relay-cc-{os.getpid()}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = ""
        self.work = root / "work"
        self.home = root / "home"
        self.log = root / "upstream-requests.jsonl"

    def start(self) -> None:
        subprocess.run(["ip", "netns", "add", self.ns], check=True, capture_output=True)
        subprocess.run(["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"],
                       check=True, capture_output=True)
        for folder in (self.work, self.home / "tmp", self.root / "state"):
            folder.mkdir(parents=True)
        (self.work / "note.txt").write_text(f"The secret line is {SECRET}.\n")
        ports_file = self.root / "ports.json"
        self._spawn([sys.executable, str(FAKES / "agent_upstreams.py"), "--ports",
                     str(ports_file), "--log", str(self.log)], stderr=None)
        self._wait(lambda: ports_file.exists(), "the fake upstreams did not start")
        ports = json.loads(ports_file.read_text())
        (self.root / "relay.toml").write_text(textwrap.dedent(f"""
            [server]
            records = "records.jsonl"
            [providers.up]
            adapter = "openai"
            base_url = "http://127.0.0.1:{ports['openai']}/v1"
            models = ["agent"]
            [providers.up.profile]
            lanes = 2
            queue_max = 8
            queue_timeout_s = 30
            run_timeout_s = 60
            [providers.upr]             # (c): a server that speaks /v1/responses too
            adapter = "openai"
            base_url = "http://127.0.0.1:{ports['openai']}/v1"
            responses = true
            models = ["agent"]
            [providers.upr.profile]
            lanes = 2
            queue_max = 8
            queue_timeout_s = 30
            run_timeout_s = 60
            [providers.ant]
            adapter = "anthropic"
            base_url = "http://127.0.0.1:{ports['anthropic']}/v1"
            api_key_env = "RELAY_TEST_ANTHROPIC_KEY"
            models = ["claude-agent"]
            [providers.ant.profile]
            rpm = 0
            [providers.tool]
            adapter = "claude-cli"
            command = "{FAKE_CLI / 'claude'}"
            [providers.fake]        # the packaged default's own
            adapter = "fake"
            models = ["echo"]
            [routes.small]
            primary = "up/agent"
            """))
        said = self.root / "relay.log"
        with said.open("wb") as log:
            self._spawn([sys.executable, "-m", "relay", "serve", "--config",
                         str(self.root / "relay.toml"), "--port", "0"], stderr=log, env={
                             "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(self.root / "state"),
                             "RELAY_TEST_ANTHROPIC_KEY": ANTHROPIC_KEY})
        self._wait(lambda: LISTENING.search(said.read_text(errors="replace")) is not None,
                   "relay serve did not start")
        found = LISTENING.search(said.read_text(errors="replace"))
        assert found is not None
        self.url = found.group(1)

    def _spawn(self, argv: list[str], *, stderr: Any, env: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root)}
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv],
                                env={**base, **(env or {})}, cwd=self.root,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _wait(self, ready: Any, why: str) -> None:
        for _ in range(2000):   # bounded; each step waits on the process, not a sleep
            if ready():
                return
            for proc in self.procs:
                try:
                    proc.wait(timeout=0.005)
                    log = self.root / "relay.log"
                    raise RuntimeError(f"{why}: a process exited ({proc.args}); relay said: "
                                       f"{log.read_text() if log.exists() else ''}")
                except subprocess.TimeoutExpired:
                    pass
        raise RuntimeError(why)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run(["ip", "netns", "delete", self.ns], capture_output=True)

    async def claude(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        """``claude -p`` inside the namespace, as a client of relay."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home),
            "TMPDIR": str(self.home / "tmp"),
            "ANTHROPIC_BASE_URL": self.url, "ANTHROPIC_API_KEY": "sk-relay-client",
            "ANTHROPIC_SMALL_FAST_MODEL": "small",
            # telemetry, error reports and updates off
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1"}
        with trio.fail_after(120):
            return await trio.run_process(
                ["ip", "netns", "exec", self.ns, shutil.which("claude") or "claude", "-p",
                 *args], env=env, cwd=self.work, stdin=subprocess.DEVNULL,
                capture_stdout=True, capture_stderr=True, check=False)

    def requests(self, server: str) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [r for r in map(json.loads, lines) if r["server"] == server]

    def records(self) -> list[dict[str, Any]]:
        path = self.root / "records.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line]


def _why_not() -> str | None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux (a network namespace with only loopback)"
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2) for `ip netns`; .ci/install-clis.sh installs it"
    claude = shutil.which("claude")
    if claude is None:
        return (f"`claude` is not installed (npm install -g @anthropic-ai/claude-code@{PIN};"
                " .ci/install-clis.sh does it)")
    version = subprocess.run([claude, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    if not version.startswith(PIN):
        return f"`claude` is {version.strip()!r}, not the pinned {PIN}"
    return None


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    why = _why_not()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="relay-claude-client-"))
    box = Sandbox(root)
    try:
        box.start()
    except (subprocess.CalledProcessError, RuntimeError, OSError, AssertionError) as exc:
        box.stop()
        shutil.rmtree(root, ignore_errors=True)
        if "relay serve did not start" in str(exc):   # relay's fault, not the machine's
            pytest.fail(str(exc))
        pytest.skip(f"cannot set up the loopback-only namespace here: {exc}")
    yield box
    box.stop()
    shutil.rmtree(root, ignore_errors=True)


PROMPT = "Read the file {path} and tell me the secret line in it."


@pytest.mark.parametrize(("model", "server"), [("up/agent", "openai"),
                                               ("upr/agent", "openai"),
                                               ("ant/claude-agent", "anthropic")])
async def test_claude_code_reads_a_file_through_relay(sandbox: Sandbox, model: str,
                                                      server: str) -> None:
    before = len(sandbox.requests(server))
    records_before = len(sandbox.records())
    done = await sandbox.claude(PROMPT.format(path=sandbox.work / "note.txt"),
                                "--model", model)
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, (out, done.stderr.decode(errors="replace"))
    assert SECRET in out, out   # what its Read tool returned, via the model's answer
    sent = sandbox.requests(server)[before:]
    assert len(sent) >= 2, sent   # the tool call, then the answer from its result
    last = sent[-1]["body"]
    if server == "openai":
        results = [m for m in last["messages"] if m.get("role") == "tool"]
        assert results and results[-1]["tool_call_id"] == "call_read_1"
        assert SECRET in json.dumps(results[-1]["content"])
        assert all("thinking" not in r["body"] and "context_management" not in r["body"]
                   for r in sent)   # nothing of the Messages dialect raw
    else:
        blocks = [b for m in last["messages"] if isinstance(m.get("content"), list)
                  for b in m["content"] if b.get("type") == "tool_result"]
        assert blocks and blocks[-1]["tool_use_id"] == "toolu_read_1"
        assert SECRET in json.dumps(blocks[-1]["content"])
        assert "anthropic-beta" in sent[-1]["headers"]   # passed on unchanged
    assert all(r["body"].get("stream") is True for r in sent)   # streamed
    recs = sandbox.records()[records_before:]
    print(f"\nclaude -p --model {model}: {out.strip()!r}; relay records: "
          f"{[(r['model'], r['status'], r['stream'], r['ignored_fields']) for r in recs]}")
    assert recs and all(r["status"] == 200 and r["stream"] for r in recs), recs
    assert not [r for r in recs if r["reason"] == "unknown_model"], recs


async def test_claude_code_with_no_tools_through_a_cli_tool_provider(
        sandbox: Sandbox) -> None:
    done = await sandbox.claude("Say hello.", "--tools", "", "--model", "tool/ok")
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, (out, done.stderr.decode(errors="replace"))
    assert "FAKE-CLAUDE-OK" in out, out

    records_before = len(sandbox.records())
    done = await sandbox.claude("Say hello.", "--model", "tool/ok")   # its default tools
    said = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, said
    assert "FAKE-CLAUDE-OK" in said, said
    recs = [r for r in sandbox.records()[records_before:] if r["provider"] == "tool"]
    assert recs and all(r["status"] == 200 for r in recs), recs
    assert "tools" in recs[-1]["ignored_fields"], recs[-1]   # offered: dropped, reported


async def test_claude_code_on_fake_echo_with_its_default_tools(sandbox: Sandbox) -> None:
    records_before = len(sandbox.records())
    done = await sandbox.claude("Say hello to FAKE-ECHO-7.", "--model", "fake/echo")
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, (out, done.stderr.decode(errors="replace"))
    assert "FAKE-ECHO-7" in out, out   # the echo of the prompt
    recs = [r for r in sandbox.records()[records_before:] if r["provider"] == "fake"]
    print(f"\nclaude -p --model fake/echo: {out.strip()[:80]!r}; ignored: "
          f"{recs[-1]['ignored_fields'] if recs else None}")
    assert recs and all(r["status"] == 200 and r["stream"] for r in recs), recs
    assert "tools" in recs[-1]["ignored_fields"], recs[-1]
