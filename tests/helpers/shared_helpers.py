"""Helpers of the shared-lane tests (SPEC L11): relay configs that share one provider
through a real ``redis-server``, and a fake upstream that counts how many requests it
serves at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio
from fakes.upstream import FakeUpstream

__all__ = ["Peak", "ServeProc", "shared_config", "start_serve"]

ROOT = Path(__file__).resolve().parents[2]


def shared_config(up: FakeUpstream, url: str, relay_id: str, *, lanes: int = 4,
                  queue_max: int = 64, queue_timeout_s: float = 30, rpm: float = 0,
                  lease_s: float = 2.0, records: str = "records.jsonl",
                  extra: str = "") -> str:
    return f"""
[server]
records = "{records}"
coordination_url = "{url}"
relay_id = "{relay_id}"
coordination_lease_s = {lease_s}
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1", "slow", "hold"]
shared = true
[providers.up.profile]
lanes = {lanes}
queue_max = {queue_max}
queue_timeout_s = {queue_timeout_s}
run_timeout_s = 60
rpm = {rpm}
[providers.fake]
adapter = "fake"
models = ["echo"]
{extra}
"""


class Peak:
    """The most requests the upstream served at once, watched from its own counter."""

    def __init__(self, up: FakeUpstream) -> None:
        self.up = up
        self.peak = 0
        self.samples: list[int] = []
        original = up._set_active

        def set_active(delta: int) -> None:
            original(delta)
            self.peak = max(self.peak, up.active_responses())

        up._set_active = set_active  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"Peak({self.peak})"


def body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


class ServeProc:
    """``relay serve`` as a child process of this tree (its stderr in a file)."""

    def __init__(self, proc: trio.Process, log: Path) -> None:
        self.proc = proc
        self.log = log
        self.url = ""

    def text(self) -> str:
        return self.log.read_text(errors="replace")


async def start_serve(tmp_path: Path, config_text: str, *, name: str = "child",
                      wait: bool = True) -> ServeProc:
    """Start ``relay serve`` on a free port; with ``wait``, until it listens."""
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "relay.toml"
    conf.write_text(config_text)
    env = dict(os.environ)
    env["XDG_STATE_HOME"] = str(folder / "state")
    env["PYTHONPATH"] = str(ROOT)  # this tree's relay, whatever the venv has installed
    for var in ("RELAY_URL", "RELAY_TOKEN", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                "http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
    log = folder / "stderr.txt"
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "relay", "serve", "--config", str(conf), "--port", "0",
             "--log-level", "INFO"], cwd=folder, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out)
    child = ServeProc(proc, log)
    if wait:
        with trio.fail_after(30):
            while "relay listening on " not in child.text():
                assert proc.poll() is None, f"relay serve exited: {child.text()}"
                await trio.sleep(0.02)
        child.url = child.text().split("relay listening on ")[1].split()[0]
    return child
