"""Token-budget tests' common parts (SPEC L12, L12a): a relay in front of a metering fake
provider (`fakes.fake_metered`), requests sent through its ASGI app, their results."""

from __future__ import annotations

import functools
import json
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import trio

from helpers.assembled import ASGIResult, asgi_request, config_from, sse_events
from relay import Relay, open_relay
from relay.capacity.lanes import Lane

__all__ = ["ask", "config", "lane_of", "ok", "records", "relay_for", "send"]


def config(url: str, profile: str = "", extra: str = "", kind: str = "openai",
           own: str = "") -> str:
    base = f"{url}/v1"
    key = 'api_key_env = "FAKE_METERED_KEY"\n' if kind == "anthropic" else ""
    key += own
    return f"""
[server]
records = "records.jsonl"
[providers.p]
adapter = "{kind}"
base_url = "{base}"
{key}
[providers.p.profile]
lanes = 8
queue_max = 100
queue_timeout_s = 600
run_timeout_s = 600
{profile}
{extra}
"""


def relay_for(tmp_path: Path, text: str) -> AbstractAsyncContextManager[Relay]:
    return open_relay(config_from(text, tmp_path), discover=False)


def send(nursery: trio.Nursery, r: Relay, body: dict[str, Any],
         path: str = "/v1/chat/completions", *, token: str | None = None) -> ASGIResult:
    """``body`` to ``path`` of relay's ASGI app, in the background (``token``: a client's,
    as ``Authorization: Bearer``)."""
    result = ASGIResult()
    headers = {"authorization": f"Bearer {token}"} if token else None
    nursery.start_soon(functools.partial(asgi_request, r.app, path, body, result,
                                         headers=headers))
    return result


def ask(content: str, model: str = "p/m-out100", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def ok(result: ASGIResult) -> bool:
    if result.status != 200:
        return False
    if result.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(result.text())
        return "[DONE]" in events and not any(isinstance(e, dict) and "error" in e
                                              for e in events)
    return "choices" in result.json()


def lane_of(r: Relay) -> Lane:
    lane = r.providers["p"].lane
    assert isinstance(lane, Lane)
    return lane


def records(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]
