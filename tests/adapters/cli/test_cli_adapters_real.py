"""The real ``claude``, ``codex`` and ``gemini`` behind relay, against a loopback fake API.

Each tool (installed from npm: `.ci/install-clis.sh`) runs inside a network namespace
that has only loopback, beside `fake_apis.py` (Anthropic Messages, OpenAI Responses and
Gemini, all answered by the fake), with its own HOME and the vendor's traffic off; so
nothing here can reach the network. Shown: relay returns a real answer through each tool
in both modes, a client stop mid-answer leaves no process behind, and — with the tools'
retries turned off by relay — a 401 or a 429 from the API surfaces in seconds with the
tool's own words. A test skips, saying why, when a tool, ``ip netns`` or root is missing
(CI makes skips failures: `.ci/install-clis.sh` installs what is needed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import chat, lane_idle, records, wait_for
from helpers.cli_procs import open_cli_relay, tool_processes
from helpers.raw_http import close, raw_post

FAKES = Path(__file__).parents[2] / "fakes"
PINNED = {"claude": "@anthropic-ai/claude-code 2.1.332", "codex": "@openai/codex 0.171.0",
          "gemini": "@google/gemini-cli 0.61.0"}
MARKERS = {"claude": "FAKE-ANT-OK", "codex": "FAKE-OAI-OK", "gemini": "FAKE-GEM-OK"}


class Namespace:
    """A network namespace with only loopback, the fake API server inside it."""

    def __init__(self, root: Path) -> None:
        self.name = f"relaytest-{os.getpid()}"
        self.root = root
        self.log = root / "api-requests.jsonl"
        self.server: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> None:
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        subprocess.run(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"],
                       check=True, capture_output=True)
        port_file = self.root / "api-port"
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", self.name, sys.executable, str(FAKES / "fake_apis.py"),
             "--port-file", str(port_file), "--log", str(self.log)],
            stdin=subprocess.DEVNULL, start_new_session=True)
        for _ in range(1000):   # bounded: the server writes the file once listening
            if port_file.exists():
                self.port = int(port_file.read_text())
                return
            try:
                self.server.wait(timeout=0.01)
                raise RuntimeError("the fake API server exited at start")
            except subprocess.TimeoutExpired:
                continue
        raise RuntimeError("the fake API server did not start")

    def stop(self) -> None:
        if self.server is not None:
            os.killpg(self.server.pid, 9)
            self.server.wait()
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)

    def requests(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]


def _why_not() -> str | None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux (a network namespace with only loopback)"
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2) for `ip netns`; .ci/install-clis.sh installs it"
    return None


@pytest.fixture(scope="module")
def netns() -> Iterator[Namespace]:
    why = _why_not()
    if why:
        pytest.skip(why)
    # Not under /tmp: gemini ignores a settings file below a folder others can write to.
    root = Path(tempfile.mkdtemp(prefix="relay-real-cli-", dir=_private_base()))
    ns = Namespace(root)
    try:
        ns.start()
    except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot make a loopback-only network namespace here: {exc}")
    yield ns
    ns.stop()
    shutil.rmtree(root, ignore_errors=True)


def _private_base() -> Path:
    base = Path.home() / ".cache"
    base.mkdir(parents=True, exist_ok=True)
    return base


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"`{tool}` is not installed (npm install -g {PINNED[tool].split()[0]}; "
                    ".ci/install-clis.sh does it)")
    return path


def provider_config(tool: str, ns: Namespace, home: Path, *, mode: str) -> str:
    """A provider whose command runs the real tool inside the namespace, with its own
    HOME pointed at the fake API."""
    real = _need(tool)
    wrapper = home / f"{tool}-in-netns"
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {ns.name} {real} "$@"\n')
    wrapper.chmod(0o755)
    (home / "tmp").mkdir(exist_ok=True)
    url = f"http://127.0.0.1:{ns.port}"
    env = {"HOME": str(home), "TMPDIR": str(home / "tmp")}
    extra = ""
    if tool == "claude":
        env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="sk-fake-test-key")
    elif tool == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(f"""\
model = "fake-model"
[model_providers.fake]
name = "Fake"
base_url = "{url}/v1"
env_key = "FAKE_OPENAI_KEY"
wire_api = "responses"
supports_websockets = false
""")
        env.update(CODEX_HOME=str(codex_home), FAKE_OPENAI_KEY="sk-fake-test-key")
        extra = 'model_provider = "fake"\n'
    else:
        gemini_home = home / ".gemini"
        gemini_home.mkdir(exist_ok=True)
        (gemini_home / "settings.json").write_text(json.dumps(
            {"security": {"auth": {"selectedType": "gemini-api-key"}}}))
        env.update(GOOGLE_GEMINI_BASE_URL=url, GEMINI_API_KEY="fake-test-key")
        extra = 'model = "gemini-2.5-flash"\n'
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    return f"""
[server]
records = "records.jsonl"
[providers.{tool}]
adapter = "{tool}-cli"
command = "{wrapper}"
mode = "{mode}"
env = {{ {table} }}
{extra}[providers.{tool}.profile]
interrupt_grace_s = 3
"""


@pytest.fixture
def home(netns: Namespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="home-", dir=netns.root))
    # relay's own folder for the tools (its state dir) must not be under /tmp (gemini).
    monkeypatch.setenv("XDG_STATE_HOME", str(folder / "state"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def iso(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


TOOL_MODES = [(tool, mode) for tool in ("claude", "codex", "gemini")
              for mode in ("oneshot", "session")]


@pytest.mark.parametrize(("tool", "mode"), TOOL_MODES)
async def test_a_real_answer_through_the_real_tool(
        netns: Namespace, home: Path, tmp_path: Path, tool: str, mode: str) -> None:
    text = provider_config(tool, netns, home, mode=mode)
    async with open_cli_relay(text, tmp_path, marker=str(home)) as served, \
            httpx.AsyncClient(trust_env=False, timeout=60) as client:
        body = {"model": f"{tool}/default", "messages": [
            {"role": "system", "content": "RELAY-SYSTEM-PROMPT: answer briefly."},
            {"role": "user", "content": "Say hello."}]}
        resp = await client.post(f"{served.url}/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        answer = resp.json()["choices"][0]["message"]["content"]
        assert MARKERS[tool] in answer, answer
        if mode == "oneshot":
            assert tool_processes(str(home)) == []
    sent = json.dumps([r["body"] for r in netns.requests()])
    assert "RELAY-SYSTEM-PROMPT" in sent   # the system prompt reached the model


@pytest.mark.parametrize(("tool", "mode"), TOOL_MODES)
async def test_a_client_stop_mid_answer_leaves_no_process(
        netns: Namespace, home: Path, tmp_path: Path, tool: str, mode: str) -> None:
    text = provider_config(tool, netns, home, mode=mode)
    async with open_cli_relay(text, tmp_path, marker=str(home)) as served:
        before = len(netns.requests())
        stream = await raw_post(served.url, chat(f"{tool}/default", "Count slowly. SLOW",
                                                 stream=True))
        # Once the API is answering (a delta every 0.2 s for a minute), stop the client.
        await wait_for(lambda: any("SLOW" in json.dumps(r["body"])
                                   for r in netns.requests()[before:]), limit_s=30)
        await close(stream, "fin")
        await wait_for(lambda: lane_idle(served) and len(records(tmp_path)) == 1,
                       limit_s=10)
        rec = records(tmp_path)[0]
        took = iso(rec["released_at"]) - iso(rec["stop_requested_at"])
        print(f"\nreal {tool} ({mode}): stop → lane released in {took * 1000:.0f} ms")
        assert rec["status"] == 499 and took < 3.0 + 2.0
        if mode == "oneshot":
            assert tool_processes(str(home)) == []


@pytest.mark.parametrize("tool", ["claude", "codex", "gemini"])
@pytest.mark.parametrize(("trigger", "status", "reason"), [
    ("FAIL401", 502, "auth_required"), ("FAIL429", 429, "quota_exhausted")])
async def test_api_failures_surface_fast_in_the_tools_words(
        netns: Namespace, home: Path, tmp_path: Path, tool: str, trigger: str, status: int,
        reason: str) -> None:
    text = provider_config(tool, netns, home, mode="oneshot")
    async with open_cli_relay(text, tmp_path, marker=str(home)) as served, \
            httpx.AsyncClient(trust_env=False, timeout=60) as client:
        t0 = trio.current_time()
        resp = await client.post(f"{served.url}/v1/chat/completions",
                                 json=chat(f"{tool}/default", f"Hi {trigger}"))
        took = trio.current_time() - t0
        print(f"\nreal {tool}: {trigger} → {resp.status_code} in {took:.2f} s")
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert error["code"] == reason, error
        assert error["relay"]["upstream_message"]   # the tool's own words, whole
        assert took < 10.0   # retries off: not minutes of hidden retries
