"""Requests to a relay in front of the fake CLI programs, and what those programs logged."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from helpers.cli_procs import FAKE_CLI
from relay import Served

GRACE_S = 0.5


TOOLS = ("claude", "codex", "gemini")


def config(tmp_path: Path, extra_env: str = "", grace: float = GRACE_S) -> str:
    log = tmp_path / "fake-cli.jsonl"
    text = '[server]\nrecords = "records.jsonl"\n'
    for tool in TOOLS:
        for suffix, mode in (("", "oneshot"), ("-s", "session")):
            text += f"""
[providers.{tool}{suffix}]
adapter = "{tool}-cli"
command = "{FAKE_CLI / tool}"
mode = "{mode}"
env = {{ FAKE_CLI_LOG = "{log}" {extra_env} }}
[providers.{tool}{suffix}.profile]
interrupt_grace_s = {grace}
"""
    return text


def fake_log(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "fake-cli.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def iso(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def post(client: httpx.AsyncClient, served: Served, body: dict[str, Any],
               **kw: Any) -> httpx.Response:
    return await client.post(f"{served.url}/v1/chat/completions", json=body, **kw)


def answer(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])
