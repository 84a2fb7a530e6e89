"""The real opencode (``opencode run``, pinned opencode-ai 1.18.33, installed by
`.ci/install-clis.sh`) as a *client* of relay, with docs/agents.md's settings ("Coding
agents": relay as an ``@ai-sdk/openai-compatible`` provider in ``opencode.json``).

opencode and ``relay serve`` on the packaged default config run inside a network
namespace that has only loopback, so nothing can reach the network (opencode's model
catalogue fetch is off: ``OPENCODE_DISABLE_MODELS_FETCH``). With its default tools all
offered, it answers on the packaged default's ``fake/echo`` (no tool calls), and the
record of its turn names the tools dropped (SPEC A1a amended). Skipped, saying why,
without ``opencode``, root or ``ip netns`` (CI installs them and turns skips into
failures).
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
PIN = "1.18.33"
LISTENING = re.compile(r"relay listening on (http://\S+:\d+) ")


def _why_not() -> str | None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux (a network namespace with only loopback)"
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2) for `ip netns`; .ci/install-clis.sh installs it"
    found = shutil.which("opencode")
    if found is None:
        return f"`opencode` is not installed (npm install -g opencode-ai@{PIN}; " \
            ".ci/install-clis.sh does it)"
    version = subprocess.run([found, "--version"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    if version != PIN:
        return f"`opencode` is {version!r}, not the pinned {PIN}"
    return None


class Stage:
    """The namespace, with ``relay serve`` (the packaged default) running inside."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ns = f"relay-oc-{os.getpid()}"
        self.relay: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        subprocess.run(["ip", "netns", "add", self.ns], check=True, capture_output=True)
        subprocess.run(["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"],
                       check=True, capture_output=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root),
               "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(self.root / "state")}
        log = self.root / "relay.err"
        with log.open("wb") as err:   # the child has its own copy
            self.relay = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, sys.executable, "-m", "relay", "serve",
                 "--port", "0"], cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        for _ in range(2000):   # bounded: 20 s, waiting on the process, not a sleep
            found = LISTENING.search(log.read_text(errors="replace"))
            if found:
                self.url = found[1]
                return
            try:
                self.relay.wait(timeout=0.01)
                raise RuntimeError(f"relay serve exited: {log.read_text()}")
            except subprocess.TimeoutExpired:
                continue
        raise RuntimeError("relay serve did not start")

    def stop(self) -> None:
        if self.relay is not None:
            if self.relay.poll() is None:
                os.killpg(self.relay.pid, signal.SIGKILL)
            self.relay.wait()
        subprocess.run(["ip", "netns", "delete", self.ns], capture_output=True)

    def records(self) -> list[dict[str, Any]]:
        path = self.root / "state" / "relay" / "relay-requests.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line]


@pytest.fixture(scope="module")
def stage() -> Iterator[Stage]:
    why = _why_not()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="relay-opencode-"))
    st = Stage(root)
    try:
        st.start()
    except (subprocess.CalledProcessError, OSError) as exc:
        st.stop()
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot set up the loopback-only namespace here: {exc}")
    except RuntimeError as exc:   # relay's fault, not the machine's
        st.stop()
        pytest.fail(str(exc))
    yield st
    st.stop()
    shutil.rmtree(root, ignore_errors=True)


def opencode_json(url: str) -> dict[str, Any]:
    """docs/agents.md's ``opencode.json``, at relay's URL."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {"relay": {
            "npm": "@ai-sdk/openai-compatible", "name": "relay",
            "options": {"baseURL": f"{url}/v1", "apiKey": "x"},
            "models": {"fake/echo": {"name": "fake/echo"}}}},
        "model": "relay/fake/echo",
    }


def test_opencode_answers_on_fake_echo_with_its_default_tools(stage: Stage,
                                                              tmp_path: Path) -> None:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "opencode.json").write_text(json.dumps(opencode_json(stage.url)))
    before = len(stage.records())
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "TMPDIR": str(home), "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    done = subprocess.run(
        ["ip", "netns", "exec", stage.ns, "opencode", "run", "Say hello to FAKE-ECHO-7."],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=120,
        check=False)
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, (out, done.stderr.decode(errors="replace")[-3000:])
    assert "FAKE-ECHO-7" in out, out   # the echo of the prompt
    recs = stage.records()[before:]
    print(f"\nopencode run on fake/echo: {out.strip()[-80:]!r}; records: "
          f"{[(r['status'], r['ignored_fields']) for r in recs]}")
    assert recs and all(r["status"] == 200 and r["provider"] == "fake" for r in recs), recs
    assert any("tools" in r["ignored_fields"] for r in recs), recs   # its tools, dropped
