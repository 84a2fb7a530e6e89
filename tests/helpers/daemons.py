"""`relay` as users run it: a subprocess of this tree (`python -m relay`) with its config
written to a folder, and a daemon that the test always stops."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[2]


RELAY = [sys.executable, "-m", "relay"]


LISTENING = re.compile(rb"relay listening on (http://\S+:\d+) ")


FAKE_CONFIG = """
[server]
records = "r.jsonl"
drain_grace_s = 2
[providers.fake]
adapter = "fake"
models = ["echo"]
"""


def child_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env["PYTHONPATH"] = str(ROOT)   # this tree's relay, whatever the venv has installed
    for var in ("RELAY_URL", "RELAY_TOKEN", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                "http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
    return env


async def run_relay(tmp_path: Path, *args: str, limit_s: float = 20.0,
                    ) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(limit_s):
        return await trio.run_process([*RELAY, *args], cwd=tmp_path, env=child_env(tmp_path),
                                      capture_stdout=True, capture_stderr=True, check=False)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


class Stderr:
    """A daemon's stderr, read as it comes; ``ready`` is set once it is listening or gone."""

    def __init__(self) -> None:
        self.data = b""
        self.url: str | None = None
        self.ready = trio.Event()
        self.closed = trio.Event()

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        try:
            while chunk := await stream.receive_some():
                self.data += chunk
                if self.url is None and (m := LISTENING.search(self.data)):
                    self.url = m.group(1).decode()
                    self.ready.set()
        finally:
            self.closed.set()
            self.ready.set()

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@asynccontextmanager
async def daemon(tmp_path: Path, *args: str) -> AsyncIterator[tuple[trio.Process, Stderr]]:
    """``relay serve ARGS``, its stderr pumped; killed on the way out whatever happened."""
    proc = await trio.lowlevel.open_process(
        [*RELAY, "serve", *args], cwd=tmp_path, env=child_env(tmp_path),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = Stderr()
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stderr is not None
            nursery.start_soon(log.pump, proc.stderr)
            try:
                with trio.fail_after(15):
                    await log.ready.wait()
                yield proc, log
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()
