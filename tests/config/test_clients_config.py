"""``[clients.NAME]`` (SPEC L14) and ``[providers.NAME.prices."MODEL"]`` (O7) in the
config file: every problem named with its file, table and key; tokens read at load and
never shown by ``relay config check``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.assembled import config_from

from relay.vocab.errors import ConfigError

BASE = """
[providers.fake]
adapter = "fake"
models = ["echo"]
"""


def problems(text: str, tmp_path: Path, env: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config_from(text, tmp_path, environ=env)
    return [line.strip() for line in str(caught.value).splitlines()[1:]]


def test_every_problem_of_the_clients_is_named(tmp_path: Path) -> None:
    found = problems(BASE + """
[clients.agent]
token_env = "TA"
priority = "high"
weight = 0
lanes = -1
colour = "red"
models = []
[clients.nameless]
[clients.missing]
token_env = "NOT_SET"
[clients.one]
token_env = "SAME"
[clients.two]
token_env = "SAME"
[providers.fake.prices."echo"]
input = -1
outptu = 2
""", tmp_path, {"TA": "agent-token-123", "SAME": "same-token-123"})
    text = "\n".join(found)
    for line in (
            "test.toml: [clients.agent] colour: unknown key; valid keys in [clients.agent]: "
            "token_env, priority, models, weight, lanes, rpm, tpm, tokens_per_day, "
            "usd_per_day, usd_per_month",
            "test.toml: [clients.agent] priority: must be one of interactive, normal, "
            "background, got 'high'",
            "test.toml: [clients.agent] weight: must be > 0, got 0.0",
            "test.toml: [clients.agent] models: must be a non-empty list",
            "test.toml: [clients.nameless] token_env: missing",
            "test.toml: [clients.missing] token_env: the environment variable NOT_SET is "
            "not set",
            "test.toml: [clients.two] token_env: SAME holds the same token as client one",
            '[providers.fake.prices."echo"] outptu: unknown key (did you mean \'output\'?)',
            '[providers.fake.prices."echo"] input: must be a number of dollars per '
            "million tokens >= 0"):
        assert line in text, (line, text)
    assert "[clients.agent] lanes: must be >= 0" in text
    assert "same-token-123" not in text and "agent-token-123" not in text


def test_the_server_token_is_the_default_clients_and_off_loopback_needs_tokens(
        tmp_path: Path) -> None:
    server = '[server]\ntoken_env = "T0"\n'
    found = problems(server + BASE + '[clients.default]\ntoken_env = "TD"\n', tmp_path,
                     {"T0": "server-token-1", "TD": "default-token-1"})
    assert found == ["test.toml: [clients.default] token_env: [server] token_env is the "
                     "token of the client 'default' already; give it in one place"]
    off = '[server]\nhost = "0.0.0.0"\nallowed_hosts = ["relay.lan"]\n'
    found = problems(off + BASE + "[clients.default]\n", tmp_path, {})
    assert any("[clients.default] token_env: required when host is '0.0.0.0'" in p
               for p in found), found
    # Off loopback, clients with tokens are enough (no [server] token_env needed).
    config = config_from(off + BASE + '[clients.a]\ntoken_env = "TA"\n', tmp_path,
                         environ={"TA": "a-token-12345"})
    assert config.clients["a"].token == "a-token-12345"
    assert "a-token-12345" in config.secrets({}) and "TA" in config.providers[
        "fake"].secret_env


def test_config_check_lists_the_clients_never_their_tokens(tmp_path: Path) -> None:
    path = tmp_path / "profiles.toml"
    path.write_text('[server]\ntoken_env = "T0"\n' + BASE + """
[clients.agent]
token_env = "TA"
priority = "background"
models = ["fake/*"]
usd_per_day = 2.5
rpm = 30
[clients.default]
priority = "interactive"
""")
    env = {"T0": "server-token-abcdef", "TA": "agent-token-abcdef", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "relay", "config", "check", "--config",
                           str(path)], capture_output=True, text=True, env={
                               **env, "PYTHONPATH": ":".join(sys.path)}, check=False)
    assert done.returncode == 0, done.stderr
    assert ("  agent: token from TA; priority background, weight 1; models: fake/*; rpm 30, "
            "usd_per_day 2.5") in done.stdout
    assert ("  default: token from T0 ([server]); priority interactive, weight 1; "
            "models: *; no limits") in done.stdout
    assert "abcdef" not in done.stdout + done.stderr
