"""The status never shows a half-reloaded relay (issue 29, SPEC L10, A3).

A real ``relay serve`` process under load (requests running all the time) takes a storm
of reloads — SIGHUP bursts and ``POST /relay/v1/reload``, alternating two valid configs A
and B with an invalid one and one that is not TOML, each written *in place* the way an
operator's script or editor does (truncate, then write, in two steps) — while a poller
asks ``GET /relay/v1/status`` back to back, without pause. Every answer must show
exactly A's providers with A's lanes or B's with B's: never none (issue 29 saw
``{"providers": {}}``), never some of one and some of the other. Twenty rounds in a row.
"""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import trio
from helpers.faults import start_serve

ROUNDS = 20

CONFIG = """
[server]
records = "records.jsonl"
drain_grace_s = 5
{providers}
"""
PROVIDER = """
[providers.{name}]
adapter = "fake"
models = ["echo"]
[providers.{name}.profile]
lanes = {lanes}
queue_max = 64
queue_timeout_s = 30
run_timeout_s = 30
"""
# What the status must show: provider -> lanes (its capacity). "fake" is in both (the
# load runs on it); its lanes differ, so each reload opens it a new adapter too.
A = {"fake": 4, "alpha": 1, "gamma": 2}
B = {"fake": 6, "beta": 2}
INVALID = CONFIG.format(providers=PROVIDER.format(name="fake", lanes=4)
                        + '[providers.broken]\nadapter = "no-such-kind"\n')
NOT_TOML = "[server]\n[providers.fake]\nthis is not = = TOML\n"


def text_of(providers: dict[str, int]) -> str:
    return CONFIG.format(providers="".join(PROVIDER.format(name=name, lanes=lanes)
                                           for name, lanes in providers.items()))


async def write_in_place(path: Path, text: str) -> None:
    """As a script rewrites a file: truncate it, then write it in two steps 2 ms apart,
    cut before its last provider's table (a reader in between sees it empty, or as a
    valid config with a provider missing)."""
    data = text.encode()
    cut = [m.start() for m in re.finditer(rb"^\[providers\.[a-z]+\]$", data, re.M)][-1]
    with open(path, "wb", buffering=0) as f:  # noqa: ASYNC230 (a small local file)
        f.write(data[:cut])
        await trio.sleep(0.002)
        f.write(data[cut:])


def shown(status: dict[str, Any]) -> dict[str, int]:
    return {name: p["lanes"]["capacity"] for name, p in status["providers"].items()}


async def test_the_status_shows_config_a_or_b_through_a_reload_storm_under_load(
        tmp_path: Path) -> None:
    conf = tmp_path / "relay.toml"
    conf.write_text(text_of(A))
    proc, url = await start_serve(tmp_path, conf)
    seen: list[dict[str, int]] = []
    wrong: list[dict[str, int]] = []
    answered = refused = polls = 0
    log = bytearray()
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client, \
                trio.open_nursery() as nursery:
            async def drain_log() -> None:
                assert proc.stderr is not None
                while chunk := await proc.stderr.receive_some():
                    log.extend(chunk)

            async def poll() -> None:
                nonlocal polls
                while True:   # back to back, no pause
                    r = await client.get(f"{url}/relay/v1/status")
                    polls += 1
                    assert r.status_code == 200, r.text
                    now = shown(r.json())
                    if now not in (A, B):
                        wrong.append(now)
                    if not seen or seen[-1] != now:
                        seen.append(now)

            async def load(n: int) -> None:
                nonlocal answered
                while True:
                    body = {"model": "fake/echo?delay_s=0.02&chunks=3", "stream": n % 2 == 0,
                            "messages": [{"role": "user", "content": f"load {n}"}]}
                    r = await client.post(f"{url}/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    answered += 1

            async def reload_post(expect: int) -> None:
                nonlocal refused
                r = await client.post(f"{url}/relay/v1/reload")
                assert r.status_code == expect, r.text
                refused += r.status_code != 200

            def sighup(times: int) -> None:
                for _ in range(times):
                    proc.send_signal(signal.SIGHUP)

            nursery.start_soon(drain_log)
            nursery.start_soon(poll)
            for n in range(8):
                nursery.start_soon(load, n)
            for n in range(ROUNDS):
                first, then = (B, A) if n % 2 == 0 else (A, B)
                await write_in_place(conf, text_of(first))
                sighup(5)
                await reload_post(200)
                await write_in_place(conf, INVALID)      # refused through the admin call ...
                await reload_post(400)
                sighup(2)                          # ... and by SIGHUP
                if n == 0:  # (once, waited for: later rounds move on before a SIGHUP's
                    # reload finds the file stable for its 50 ms, as an editor would)
                    with trio.fail_after(10):
                        while b"SIGHUP: the config has problems" not in log:
                            await trio.sleep(0.01)
                await write_in_place(conf, NOT_TOML)
                sighup(3)
                await write_in_place(conf, text_of(then))
                sighup(5)
                await reload_post(200)             # the last word: ``then``
                with trio.fail_after(10):
                    while not seen or seen[-1] != then:
                        await trio.sleep(0.01)
                assert not wrong, f"round {n}: the status showed {wrong[0]}"
            nursery.cancel_scope.cancel()
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            with contextlib.suppress(trio.TooSlowError), trio.move_on_after(5):
                await proc.wait()
    assert not wrong, f"the status showed {wrong[0]}"
    assert proc.returncode == 0
    assert refused == ROUNDS and answered > 100 and polls > 20 * ROUNDS, (
        refused, answered, polls)
    assert len(seen) >= ROUNDS, seen   # A and B took turns
    assert b"SIGHUP: the config has problems" in log   # the signals' reloads ran too
