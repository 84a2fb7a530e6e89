"""The shared lanes' config keys (SPEC 9, L11): every problem named with its table and
key, the URL's password never quoted, and it is a secret (redacted everywhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.assembled import config_from

from relay import ConfigError

PROVIDER = """
[providers.up]
adapter = "openai"
base_url = "http://127.0.0.1:9/v1"
models = ["m1"]
shared = {shared}
[providers.up.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 60
"""


def problems(text: str, tmp_path: Path, **kw: object) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config_from(text, tmp_path, **kw)
    return caught.value.problems


def test_a_shared_provider_needs_a_coordination_server(tmp_path: Path) -> None:
    (p,) = problems(PROVIDER.format(shared="true"), tmp_path)
    assert "[providers.up] shared:" in p and "coordination_url" in p


def test_shared_must_be_a_boolean(tmp_path: Path) -> None:
    (p,) = problems('[server]\ncoordination_url = "redis://h:1/0"\n'
                    + PROVIDER.format(shared='"yes"'), tmp_path)
    assert p.endswith("[providers.up] shared: expected true or false")


def test_the_url_is_checked_without_quoting_it(tmp_path: Path) -> None:
    text = '[server]\ncoordination_url = "http://:hunter2hunter2@h/0"\n' + PROVIDER.format(
        shared="true")
    (p,) = problems(text, tmp_path)
    assert "[server] coordination_url: must be a Redis or Valkey URL" in p
    assert "hunter2" not in p


def test_url_and_url_env_exclude_each_other_and_the_variable_must_be_set(
        tmp_path: Path) -> None:
    text = ('[server]\ncoordination_url = "redis://h:1/0"\ncoordination_url_env = "RC"\n'
            + PROVIDER.format(shared="true"))
    found = problems(text, tmp_path, environ={})
    assert any("give coordination_url or coordination_url_env, not both" in p for p in found)
    assert any("the environment variable RC is not set" in p for p in found)


def test_the_password_from_the_environment_is_a_secret(tmp_path: Path) -> None:
    text = '[server]\ncoordination_url_env = "RC"\nrelay_id = "a"\n' + PROVIDER.format(
        shared="true")
    env = {"RC": "redis://:pa%24%24word-long@127.0.0.1:6379/0"}
    config = config_from(text, tmp_path, environ=env)
    assert config.coordination_url(env) == env["RC"]
    assert "pa$$word-long" in config.secrets(env)
    assert config.relay_id == "a" and config.shared_providers == ("up",)
    assert config.server.coordination_lease_s == 10.0
    assert config.server.coordination_prefix == "relay"


@pytest.mark.parametrize(("url", "secrets"), [
    ("redis+sentinel://:primary-pass-1@h:1,h:2/lanes?sentinel_password=sentinel-pass-2",
     ("primary-pass-1", "sentinel-pass-2")),
    ("valkey+sentinel://h:1/lanes?password=primary-pass-3", ("primary-pass-3",)),
    ("unix:///run/redis.sock?db=1&password=unix-pass-4", ("unix-pass-4",)),
])
def test_every_password_a_url_holds_is_a_secret(tmp_path: Path, url: str,
                                                secrets: tuple[str, ...]) -> None:
    # The Sentinels' own password, and one given as ``?password=``, are redacted too
    # (SPEC E1), not only the URL as a whole and the password before its ``@``.
    text = '[server]\ncoordination_url_env = "RC"\nrelay_id = "a"\n' + PROVIDER.format(
        shared="true")
    env = {"RC": url}
    found = config_from(text, tmp_path, environ=env).secrets(env)
    for secret in secrets:
        assert secret in found, (secret, found)


def test_names_must_be_plain(tmp_path: Path) -> None:
    text = ('[server]\ncoordination_url = "redis://h:1/0"\nrelay_id = "a b"\n'
            'coordination_prefix = ""\n' + PROVIDER.format(shared="false"))
    found = problems(text, tmp_path)
    assert any(p.endswith("[server] relay_id: must be a non-empty name without spaces, "
                          "'{', '}' or '|'") for p in found)
    assert any("[server] coordination_prefix:" in p for p in found)


def test_a_sentinel_url_names_the_sentinels_the_primary_and_the_db() -> None:
    from relay.config.coordination_url import parse_url
    t = parse_url("redis+sentinel://app:s%40cret@10.0.0.1:26379,[::1]:26380,h:1/lanes/3"
                  "?sentinel_password=sp")
    assert t.sentinels == (("10.0.0.1", 26379), ("::1", 26380), ("h", 1))
    assert (t.master_name, t.db, t.username, t.password, t.sentinel_password) == (
        "lanes", 3, "app", "s@cret", "sp")
    v = parse_url("valkey+sentinel://:pw@h:5000/primary")
    assert (v.sentinels, v.master_name, v.db, v.username, v.password) == (
        (("h", 5000),), "primary", 0, None, "pw")
    assert "pw" not in repr(v) and "s@cret" not in repr(t) and "sp" not in repr(t)


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://h:1", "must name the primary"),
    ("redis+sentinel://h:1,h2/name", "each Sentinel must be HOST:PORT"),
    ("redis+sentinel://:hunter2hunter2@h:99999/name", "each Sentinel must be HOST:PORT"),
    ("valkey+sentinel://h:1/name/x", "must be a number"),
])
def test_a_bad_sentinel_url_is_named_without_quoting_it(tmp_path: Path, url: str,
                                                         says: str) -> None:
    text = f'[server]\ncoordination_url = "{url}"\n' + PROVIDER.format(shared="true")
    (p,) = problems(text, tmp_path)
    assert p.startswith("test.toml: [server] coordination_url: ") and says in p, p
    assert "hunter2" not in p
