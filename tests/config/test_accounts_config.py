"""``[[providers.NAME.accounts]]`` (SPEC L13) in the config file: each account's settings
laid over the provider's, its figures over the profile; every problem named with its
table and key; keys never shown by ``relay config check``; a reload adds and removes
accounts in place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio
from helpers.assembled import config_from

from relay import open_relay
from relay.capacity.lanes import Lane
from relay.vocab.errors import ConfigError

BASE = """
[providers.cloud]
adapter = "openai"
base_url = "http://127.0.0.1:9/v1"
headers = { "x-team" = "relay", "x-tier" = "base" }
[providers.cloud.profile]
lanes = 4
rpm = 60
queue_max = 10
queue_timeout_s = 30
run_timeout_s = 600
"""
TWO = BASE + """
[[providers.cloud.accounts]]
name = "a"
api_key_env = "KEY_A"
[[providers.cloud.accounts]]
name = "b"
api_key_env = "KEY_B"
base_url = "http://127.0.0.1:10/v1"
headers = { "x-tier" = "paid" }
lanes = 8
tpm = 90000
"""
ENV = {"KEY_A": "sk-secret-a-123456", "KEY_B": "sk-secret-b-654321", "PATH": "/usr/bin:/bin"}


def problems(text: str, tmp_path: Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config_from(text, tmp_path, environ=ENV)
    return [line.strip() for line in str(caught.value).splitlines()[1:]]


def test_each_account_lays_its_settings_and_figures_over_the_providers(
        tmp_path: Path) -> None:
    config = config_from(TWO, tmp_path, environ=ENV)
    cloud = config.providers["cloud"]
    a, b = cloud.accounts
    assert (a.name, a.settings.api_key_env, a.settings.base_url) == (
        "a", "KEY_A", "http://127.0.0.1:9/v1")
    assert b.settings.base_url == "http://127.0.0.1:10/v1"
    assert b.settings.headers == {"x-team": "relay", "x-tier": "paid"}  # merged
    assert (a.profile.lanes, a.profile.rpm, a.profile.tpm) == (4, 60, 0)
    assert (b.profile.lanes, b.profile.rpm, b.profile.tpm) == (8, 60, 90000)
    assert {"KEY_A", "KEY_B"} <= set(cloud.secret_envs)
    assert "sk-secret-a-123456" in config.secrets(ENV) and "paid" in config.secrets(ENV)


def test_every_problem_of_the_accounts_is_named(tmp_path: Path) -> None:
    found = problems(BASE + """
[[providers.cloud.accounts]]
name = "a"
api_key_envv = "KEY_A"
[[providers.cloud.accounts]]
name = "a"
[[providers.cloud.accounts]]
name = "has space"
[[providers.cloud.accounts]]
name = "c"
lanes = 0
""", tmp_path)
    text = "\n".join(found)
    assert ('[providers.cloud.accounts."a"] api_key_envv: unknown key (did you mean '
            "'api_key_env'?)") in text
    assert text.count("api_key_envv") == 1  # named once
    assert "two accounts of one provider share the name 'a'" in text
    assert "[providers.cloud.accounts[2]] name: each account needs a name" in text
    assert '[providers.cloud.accounts."c"] lanes:' in text
    assert problems(BASE + '[providers.cloud]\n', tmp_path)  # (a TOML error, for sure)
    assert any("accounts: must be an array of tables" in line for line in problems(
        BASE.replace("[providers.cloud.profile]", 'accounts = "a"\n[providers.cloud.profile]'),
        tmp_path))


def test_config_check_lists_the_accounts_never_their_keys(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(TWO)
    done = subprocess.run([sys.executable, "-m", "relay", "config", "check", "--config",
                           str(path)], capture_output=True, text=True, env={
                               **ENV, "PYTHONPATH": ":".join(sys.path)}, check=False)
    assert done.returncode == 0, done.stderr
    assert "    accounts (2; one queue" in done.stdout
    assert "      a: key from $KEY_A" in done.stdout
    assert "      b: key from $KEY_B" in done.stdout and "lanes 8, tpm 90000" in done.stdout
    assert "sk-secret" not in done.stdout + done.stderr


async def test_a_reload_adds_and_removes_accounts_in_place(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    async with open_relay(config_from(TWO, tmp_path, environ=ENV), discover=False) as r:
        lane = r.providers["cloud"].lane
        assert isinstance(lane, Lane)
        kept = lane.account("a")
        assert [a.name for a in lane.accounts] == ["a", "b"]
        assert lane.statistics().capacity == 12
        three = TWO + '[[providers.cloud.accounts]]\nname = "c"\napi_key_env = "KEY_A"\n'
        changes = await r.reload(config_from(three.replace('name = "b"', 'name = "d"'),
                                             tmp_path, environ=ENV))
        assert any("accounts changed" in line for line in changes)
        assert [a.name for a in lane.accounts] == ["a", "d", "c"]
        assert lane.account("a") is kept  # its pacer, budgets and state go on
        assert lane.statistics().capacity == 16
        assert set(r.providers["cloud"].handle.accounts) == {"a", "d", "c"}
        await trio.lowlevel.checkpoint()


def test_a_shared_provider_takes_accounts(tmp_path: Path) -> None:
    # SPEC L13 with L11: each account's lanes on the coordination server
    # (tests/shared/test_shared_accounts.py runs them).
    text = ('[server]\ncoordination_url = "redis://127.0.0.1:6379/0"\n'
            + TWO.replace("[providers.cloud.profile]", "shared = true\n[providers.cloud.profile]"))
    config = config_from(text, tmp_path, environ=ENV)
    cloud = config.providers["cloud"]
    assert cloud.shared and [a.name for a in cloud.accounts] == ["a", "b"]
