"""A loopback-only network namespace with fake upstreams and ``relay serve`` (this tree)
running inside it: the stage on which a real coding CLI runs as a *client* of relay
(tests/clients/test_codex_client.py, tests/clients/test_gemini_cli_client.py). Nothing
inside can reach the network. A test module subclasses `Stage` with its fakes script
(in tests/fakes), its relay config and its environment, and makes its fixture with `open_stage`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

FAKES = Path(__file__).parents[1] / "fakes"
ROOT = Path(__file__).parents[2]
LISTENING = re.compile(r"relay listening on (http://\S+:\d+) ")


def why_not(tool: str, pinned: str) -> str | None:
    """Why the stage cannot run here, or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux (a network namespace with only loopback)"
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2) for `ip netns`; .ci/install-clis.sh installs it"
    if shutil.which(tool) is None:
        return f"`{tool}` is not installed (npm install -g {pinned.replace(' ', '@')}; " \
            ".ci/install-clis.sh does it)"
    return None


def wait_file(path: Path, proc: subprocess.Popen[bytes],
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


class Stage:
    """The namespace, with the fake upstreams and ``relay serve`` running inside it."""

    tool = ""    # the CLI, by its command name
    fakes = ""   # the fake upstreams' script in tests/: it writes its ports as JSON

    def __init__(self, root: Path) -> None:
        self.root = root
        self.name = f"relay{self.tool}-{os.getpid()}"
        self.log = root / "upstream-requests.jsonl"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = ""

    def config(self, ports: dict[str, int]) -> str:
        """relay's config, given the fakes' ports."""
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """What relay's environment adds (the fakes' keys)."""
        return {}

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
        fakes = self.run_in([sys.executable, str(FAKES / self.fakes), "--ports",
                             str(ports_file), "--log", str(self.log)])
        ports = json.loads(wait_file(ports_file, fakes))
        (self.root / "relay.toml").write_text(self.config(ports))
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env.update(PYTHONPATH=str(ROOT), XDG_STATE_HOME=str(self.root / "state"),
                   **self.env())
        with (self.root / "relay.err").open("wb") as err:  # the child has its own copy
            relay = self.run_in([sys.executable, "-m", "relay", "serve", "--config",
                                 str(self.root / "relay.toml"), "--port", "0"],
                                cwd=self.root, env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
        text = wait_file(self.root / "relay.err", relay, LISTENING)
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


S = TypeVar("S", bound=Stage)


def open_stage(kind: type[S], pinned: str, what: str) -> Iterator[S]:
    """The body of a module's ``stage`` fixture: skips, saying why, when it cannot run."""
    why = why_not(kind.tool, pinned)
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix=f"relay-{kind.tool}-"))
    st = kind(root)
    try:
        st.start()
    except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
        st.stop()
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot stage relay and {what} in a loopback-only namespace: {exc}")
    yield st
    st.stop()
    shutil.rmtree(root, ignore_errors=True)
