"""Two logins of one CLI tool as two accounts of a provider (SPEC L13), through the
assembled relay and the fake ``claude`` program (a login's ``scenario`` file makes it
behave as that login would): each account runs with its own configuration directory,
and a usage-window notice from one login moves the request to the other at once."""

from __future__ import annotations

from pathlib import Path

import httpx
from helpers.assembled import records
from helpers.cli_procs import FAKE_CLI, open_cli_relay
from helpers.cli_turns import answer, fake_log, post


def config(tmp_path: Path) -> str:
    log = tmp_path / "fake-cli.jsonl"
    accounts = "".join(f"""
[[providers.claude.accounts]]
name = "{name}"
env = {{ CLAUDE_CONFIG_DIR = "{tmp_path / name}" }}
""" for name in ("work", "home"))
    return f"""
[server]
records = "records.jsonl"
[providers.claude]
adapter = "claude-cli"
command = "{FAKE_CLI / "claude"}"
env = {{ FAKE_CLI_LOG = "{log}" }}
{accounts}
[providers.claude.profile]
lanes = 1
interrupt_grace_s = 0.5
"""


async def test_a_usage_window_on_one_login_moves_the_work_to_the_other(
        tmp_path: Path) -> None:
    for name in ("work", "home"):
        (tmp_path / name).mkdir()
    (tmp_path / "work" / "scenario").write_text("success-hitlimit")
    async with open_cli_relay(config(tmp_path), tmp_path) as served, \
            httpx.AsyncClient(timeout=30) as client:
        body = {"model": "claude/ok", "messages": [{"role": "user", "content": "hi"}]}
        first = await post(client, served, body)
        assert answer(first)  # the client never saw the usage window
        second = await post(client, served, body)
        assert answer(second)
        status = (await client.get(f"{served.url}/relay/v1/status")).json()
        accounts = {a["name"]: a for a in status["providers"]["claude"]["accounts"]}
        assert accounts["work"]["state"] == "held"
        assert accounts["work"]["budgets"]["hold"]["reason"] == "quota_exhausted"
        assert accounts["home"]["state"] == "ok"
    logins = [line["login"] for line in fake_log(tmp_path) if line.get("event") == "turn"]
    assert logins == [str(tmp_path / "work"), str(tmp_path / "home"),
                      str(tmp_path / "home")]
    recs = records(tmp_path)
    assert [(a["account"], a["failure"]) for a in recs[0]["attempts"]] == [
        ("work", "quota_exhausted"), ("home", None)]
    assert recs[1]["account"] == "home" and len(recs[1]["attempts"]) == 1
    config_text = (tmp_path / "records.jsonl").read_text()
    assert str(tmp_path / "work") not in config_text  # an account's env is never shown
