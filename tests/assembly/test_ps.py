"""``relay ps`` (SPEC 9) and the status's ``requests`` it reads: what runs and waits now,
each with its provider, model, client, priority, state (queued / held / running) and how
long it has been so — the real command, run as a subprocess against a relay whose
provider is slow (one lane: one request runs, the next waits)."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import trio
from helpers.assembled import chat, start_relay, wait_for
from helpers.daemons import RELAY, child_env

SLOW = """
[server]
records = "records.jsonl"
[providers.slow]
adapter = "fake"
models = ["echo"]
[providers.slow.profile]
lanes = 1
queue_max = 8
queue_timeout_s = 120
run_timeout_s = 120
[providers.idle]
adapter = "fake"
models = ["echo"]
"""


async def ps(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(30):
        return await trio.run_process([*RELAY, "ps", "--url", url, *args], cwd=tmp_path,
                                      env=child_env(tmp_path), capture_stdout=True,
                                      capture_stderr=True, check=False)


async def ask(client: httpx.AsyncClient, url: str, model: str, priority: str) -> None:
    await client.post(f"{url}/v1/chat/completions", json=chat(model),
                      headers={"X-Relay-Priority": priority})


async def test_ps_shows_the_running_and_the_waiting_request_with_their_states(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, SLOW, tmp_path)
    url, provider = served.url, served.relay.providers["slow"]
    lane = provider.lane
    done = await ps(tmp_path, url)
    assert done.returncode == 0 and done.stdout.decode().strip() == "nothing runs or waits"
    async with trio.open_nursery() as holders:
        first_sent = trio.current_time()
        holders.start_soon(ask, client, url, "slow/echo?delay_s=60", "background")
        await wait_for(lambda: lane.statistics().running == 1)
        second_sent = trio.current_time()
        holders.start_soon(ask, client, url, "slow/echo?delay_s=61", "interactive")
        await wait_for(lambda: lane.statistics().queued == 1)

        done = await ps(tmp_path, url, "--json")
        asked = trio.current_time()
        assert done.returncode == 0, done.stderr.decode()
        lines: list[dict[str, Any]] = json.loads(done.stdout)
        assert [set(line) for line in lines] == [
            {"provider", "account", "model", "client", "priority", "state", "for_s"}] * 2
        assert [(q["provider"], q["model"], q["client"], q["priority"], q["state"])
                for q in lines] == [
            ("slow", "echo?delay_s=60", "default", "background", "running"),
            ("slow", "echo?delay_s=61", "default", "interactive", "queued")]
        # Each has been so since it was sent at the earliest, and the running one longer.
        running, queued = lines
        assert 0 < running["for_s"] <= asked - first_sent
        assert 0 < queued["for_s"] <= asked - second_sent
        assert running["for_s"] >= queued["for_s"]

        table = (await ps(tmp_path, url)).stdout.decode().splitlines()
        assert table[0].split() == ["PROVIDER", "MODEL", "CLIENT", "PRIORITY", "STATE",
                                    "FOR"]
        assert [row.split()[:5] for row in table[1:]] == [
            ["slow", "echo?delay_s=60", "default", "background", "running"],
            ["slow", "echo?delay_s=61", "default", "interactive", "queued"]]
        assert all(row.split()[5].endswith("s") for row in table[1:])

        # The provider says wait (SPEC L12): the request that waits is held, not queued.
        assert provider.budgets() is not None
        lane.budget.hold(trio.current_time() + 60, "the provider said wait")  # type: ignore[attr-defined]
        states = [q["state"] for q in json.loads((await ps(tmp_path, url, "--json")).stdout)]
        assert states == ["running", "held"]
        holders.cancel_scope.cancel()
    await wait_for(lambda: lane.statistics().running + lane.statistics().queued == 0)
    status = (await client.get(f"{url}/relay/v1/status")).json()
    assert status["requests"] == []


async def test_ps_without_a_daemon_says_where_it_looked(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    done = await ps(tmp_path, f"http://127.0.0.1:{port}")
    assert done.returncode == 1
    err = done.stderr.decode()
    assert f"127.0.0.1:{port}" in err and "relay serve" in err
