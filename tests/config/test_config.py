"""Config loading (SPEC L1-L5, O1, O4, 9): every problem at once, each naming file, table, key.

Unit tests on `relay.parse_config` / `relay.load_config`; no daemon, no network.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest
from helpers.assembled import FAKE_ONLY, config_from

import relay
from relay import ConfigError, adapters, load_config, parse_config
from relay.adapters.http.openai_compat import PRESETS, OpenAIAdapter
from relay.vocab.profile import REQUIRED_PROFILE_FIELDS, Profile

ROOT = Path(__file__).resolve().parents[2]
PACKAGED = ROOT / "relay" / "profiles.toml"


# --- helpers -----------------------------------------------------------------------------

def problems_of(text: str, tmp_path: Path, **kw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from(text, tmp_path, **kw)
    problems = info.value.problems
    assert problems, "a ConfigError must list its problems"
    for line in problems:  # the ConfigError's own text carries every line too
        assert line in str(info.value)
    return problems


def find(problems: list[str], table: str, key: str | None = None,
         source: str = "test.toml") -> str:
    """The one problem line naming ``source``, ``[table]`` and ``key`` (a whole word)."""
    hits = [p for p in problems
            if p.startswith(f"{source}: ") and f"[{table}]" in p
            and (key is None or re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", p))]
    assert hits, f"no problem names [{table}] {key}: {problems}"
    assert len(hits) == 1, f"[{table}] {key} reported more than once: {hits}"
    return hits[0]


def provider(extra: str = "", *, name: str = "x", adapter: str = "fake",
             profile: str = "") -> str:
    text = f'[providers.{name}]\nadapter = "{adapter}"\n{textwrap.dedent(extra)}\n'
    if profile:
        text += f"[providers.{name}.profile]\n{textwrap.dedent(profile)}\n"
    return text


FOUR = "lanes = 2\nqueue_max = 8\nqueue_timeout_s = 30\nrun_timeout_s = 90\n"


# --- the packaged default (SPEC O1, A5) ---------------------------------------------------

def test_packaged_default_loads_from_an_empty_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./profiles.toml here
    config = load_config()
    assert Path(config.source).resolve() == PACKAGED.resolve()
    assert set(config.providers) == {"fake", "lmstudio", "ollama"}
    assert config.providers["fake"].adapter == "fake"
    assert config.providers["lmstudio"].adapter == "openai"
    assert config.providers["ollama"].adapter == "openai"
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8765
    assert config.warnings == ()  # the default itself must not trip a loud warning
    # Records go to the user's state directory, never beside the installed package.
    assert config.records_path is not None
    assert not config.records_path.is_relative_to(PACKAGED.parent)
    if sys.platform.startswith("linux"):
        assert config.records_path.parent == tmp_path / "state" / "relay"
        assert config.records_path.name == "relay-requests.jsonl"


def test_local_profiles_toml_wins_over_the_packaged_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "profiles.toml").write_text(FAKE_ONLY)
    monkeypatch.chdir(tmp_path)
    config = load_config()
    assert set(config.providers) == {"fake"}
    # records = "records.jsonl" is relative to the config file's folder
    assert config.records_path is not None
    assert config.records_path.resolve() == (tmp_path / "records.jsonl").resolve()


def test_records_relative_to_the_config_file_not_the_cwd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "relay.toml").write_text(FAKE_ONLY)
    monkeypatch.chdir(tmp_path)
    config = load_config(folder / "relay.toml")
    assert config.records_path == folder / "records.jsonl"


def test_an_unreadable_file_names_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert len(info.value.problems) == 1
    assert str(missing) in info.value.problems[0]


# --- unknown names ------------------------------------------------------------------------

def test_unknown_adapter_kind_lists_the_known_ones(tmp_path: Path) -> None:
    problems = problems_of(provider(adapter="nope"), tmp_path)
    line = find(problems, "providers.x", "adapter")
    assert "'nope'" in line
    for kind in adapters.ADAPTERS:
        assert kind in line
    assert len(problems) == 1


def test_missing_adapter_key(tmp_path: Path) -> None:
    problems = problems_of('[providers.x]\nmodels = ["m"]\n', tmp_path)
    line = find(problems, "providers.x", "adapter")
    assert "missing" in line
    assert all(kind in line for kind in adapters.ADAPTERS)




@pytest.mark.parametrize(("text", "table", "key"), [
    pytest.param('[server]\nprot = 1\n', "server", "prot", id="server"),
    pytest.param(provider('preset = "lmstudio"\nbase_ur = "http://127.0.0.1:1/v1"',
                          adapter="openai"), "providers.x", "base_ur", id="provider"),
    pytest.param(provider('base_ur = "x"'), "providers.x", "base_ur", id="fake-provider"),
    pytest.param(provider(profile="lane = 2"), "providers.x.profile", "lane", id="profile"),
])
def test_a_typo_key_is_an_error_naming_table_and_key(
        tmp_path: Path, text: str, table: str, key: str) -> None:
    problems = problems_of(text, tmp_path)
    find(problems, table, key)
    assert len(problems) == 1


def test_a_typo_key_in_a_provider_is_reported_at_all(tmp_path: Path) -> None:
    # Whatever the table label, the key itself must be reported and the provider refused.
    problems = problems_of(provider('preset = "lmstudio"\nbase_ur = "http://a/v1"',
                                    adapter="openai", profile="lane = 2"), tmp_path)
    assert any("base_ur" in p for p in problems), problems
    assert any("] lane: unknown key" in p for p in problems), problems
    assert all(p.startswith("test.toml: ") for p in problems)


def test_an_unknown_top_level_table(tmp_path: Path) -> None:
    problems = problems_of(FAKE_ONLY + '[provider.y]\nadapter = "fake"\n', tmp_path)
    line = find(problems, "provider")
    assert "unknown table" in line
    assert len(problems) == 1


# --- types and validators -----------------------------------------------------------------

@pytest.mark.parametrize(("text", "table", "key", "said"), [
    pytest.param(provider(profile='lanes = "2"'), "providers.x.profile", "lanes",
                 "expected int", id="lanes-str"),
    pytest.param(provider(profile="lanes = true"), "providers.x.profile", "lanes",
                 "boolean", id="lanes-bool"),
    pytest.param(provider(profile="lanes = 2.5"), "providers.x.profile", "lanes",
                 "expected int", id="lanes-float"),
    pytest.param(provider(profile='run_timeout_s = "90"'), "providers.x.profile",
                 "run_timeout_s", "expected float", id="run-timeout-str"),
    pytest.param('[server]\nheartbeat_s = "x"\n', "server", "heartbeat_s", "expected float",
                 id="heartbeat-str"),
    pytest.param('[server]\nport = "8765"\n', "server", "port", "expected int",
                 id="port-str"),
    pytest.param(provider('models = "m"'), "providers.x", "models", "list",
                 id="models-str"),
    pytest.param(provider("models = [1]"), "providers.x", "models", "list",
                 id="models-ints"),
    pytest.param(provider('prefill = "yes"'), "providers.x", "prefill", "true or false",
                 id="prefill-str"),
    pytest.param(provider("check_interval_s = 0"), "providers.x", "check_interval_s", "> 0",
                 id="check-interval-0"),
    pytest.param(provider('profile = "fast"'), "providers.x.profile", None, "table",
                 id="profile-not-a-table"),
])
def test_wrong_types(tmp_path: Path, text: str, table: str, key: str | None,
                     said: str) -> None:
    problems = problems_of(text, tmp_path)
    assert said in find(problems, table, key)
    assert len(problems) == 1




@pytest.mark.parametrize(("text", "table", "key"), [
    pytest.param(provider(profile="lanes = 0"), "providers.x.profile", "lanes", id="lanes-0"),
    pytest.param('[server]\nport = 70000\n', "server", "port", id="port-70000"),
    pytest.param('[server]\nport = -1\n', "server", "port", id="port-negative"),
    pytest.param(provider(profile="queue_max = -1"), "providers.x.profile", "queue_max",
                 id="queue-max-negative"),
    pytest.param(provider(profile="queue_timeout_s = 0"), "providers.x.profile",
                 "queue_timeout_s", id="queue-timeout-0"),
    pytest.param('[server]\nheartbeat_s = 0\n', "server", "heartbeat_s", id="heartbeat-0"),
    pytest.param(provider(profile="rpm = -1"), "providers.x.profile", "rpm", id="rpm-negative"),
])
def test_validators_name_the_key(tmp_path: Path, text: str, table: str, key: str) -> None:
    problems = problems_of(text, tmp_path)
    find(problems, table, key)
    assert len(problems) == 1


@pytest.mark.parametrize("text", [
    pytest.param(provider(profile="queue_timeout_s = 0"), id="queue-timeout-0"),
    pytest.param('[server]\nheartbeat_s = 0\n', id="heartbeat-0"),
])
def test_a_bad_value_is_refused_even_where_the_key_is_not_named(
        tmp_path: Path, text: str) -> None:
    problems = problems_of(text, tmp_path)
    assert len(problems) == 1
    assert "must be > 0" in problems[0]


def test_two_bad_values_in_one_table_are_both_reported(tmp_path: Path) -> None:
    problems = problems_of(provider(profile="lanes = 0\nqueue_max = -1"), tmp_path)
    find(problems, "providers.x.profile", "lanes")
    find(problems, "providers.x.profile", "queue_max")


def test_every_problem_in_the_file_is_reported_at_once(tmp_path: Path) -> None:
    text = """
    [server]
    heartbeat_s = "x"
    [routez]
    a = 1
    [providers.x]
    adapter = "nope"
    [providers.y]
    adapter = "fake"
    models = "m"
    [providers.z]
    adapter = "openai"
    preset = "lmstudio"
    [providers.z.profile]
    run_timeout_s = 30
    [providers.w]
    adapter = "fake"
    [providers.w.profile]
    lanes = "2"
    """
    problems = problems_of(text, tmp_path)
    assert len(problems) >= 6, problems
    find(problems, "server", "heartbeat_s")
    find(problems, "routez")
    find(problems, "providers.x", "adapter")
    find(problems, "providers.y", "models")
    find(problems, "providers.z.profile", "run_timeout_s")
    find(problems, "providers.w.profile", "lanes")


# --- no silent defaults (SPEC L2) ---------------------------------------------------------

def test_openai_without_preset_or_profile_is_an_error_naming_the_missing_fields(
        tmp_path: Path) -> None:
    problems = problems_of(provider('base_url = "http://127.0.0.1:9/v1"', adapter="openai"),
                           tmp_path)
    assert len(problems) == 1
    line = problems[0]
    assert line.startswith("test.toml: [providers.x.profile]")
    assert "'x'" in line
    for field in ("lanes", "queue_max", "queue_timeout_s", "run_timeout_s"):
        assert field in line
    assert "no global default" in line
    assert set(REQUIRED_PROFILE_FIELDS) == {"lanes", "queue_max", "queue_timeout_s",
                                            "run_timeout_s"}


def test_a_partial_profile_names_only_what_is_missing(tmp_path: Path) -> None:
    problems = problems_of(provider('base_url = "http://127.0.0.1:9/v1"', adapter="openai",
                                    profile="lanes = 2\nqueue_max = 8"), tmp_path)
    assert len(problems) == 1
    head = problems[0].split(":")[1]  # "test.toml: [table] fields: ..." → the key part
    assert "queue_timeout_s" in head and "run_timeout_s" in head
    assert "lanes" not in head and "queue_max" not in head


def test_openai_with_all_four_profile_fields_loads(tmp_path: Path) -> None:
    config = config_from(provider('base_url = "http://127.0.0.1:9/v1"', adapter="openai",
                                  profile=FOUR), tmp_path)
    p = config.providers["x"]
    assert p.profile == Profile(lanes=2, queue_max=8, queue_timeout_s=30.0,
                                run_timeout_s=90.0, rpm=0.0, interrupt_grace_s=5.0)
    assert p.settings.base_url == "http://127.0.0.1:9/v1"
    assert config.warnings == ()


# --- presets (SPEC L4, L5) ----------------------------------------------------------------

def test_openai_without_base_url_or_preset(tmp_path: Path) -> None:
    problems = problems_of(provider(adapter="openai", profile=FOUR), tmp_path)
    line = find(problems, "providers.x", "base_url")
    assert "preset" in line
    assert len(problems) == 1


def test_an_unknown_preset_lists_the_presets(tmp_path: Path) -> None:
    problems = problems_of(provider('preset = "lmstudios"', adapter="openai"), tmp_path)
    line = find(problems, "providers.x", "preset")
    assert "'lmstudios'" in line
    for name in PRESETS:
        assert name in line
    assert len(problems) == 1


def test_base_url_must_be_http(tmp_path: Path) -> None:
    problems = problems_of(provider('base_url = "127.0.0.1:1234/v1"', adapter="openai",
                                    profile=FOUR), tmp_path)
    find(problems, "providers.x", "base_url")


@pytest.mark.parametrize("name", ["lmstudio", "ollama", "vllm", "openai", "nvidia",
                                  "dashscope"])
def test_every_preset_loads_and_fills_base_url_and_profile(
        tmp_path: Path, name: str) -> None:
    assert name in PRESETS
    config = config_from(provider(f'preset = "{name}"', adapter="openai"), tmp_path)
    p = config.providers["x"]
    assert p.profile == PRESETS[name].profile
    assert p.profile.run_timeout_s >= PRESETS[name].max_call_s
    adapter = OpenAIAdapter(p)  # built, not entered: no client, no network
    assert adapter.base_url == PRESETS[name].base_url.rstrip("/")
    assert adapter.base_url.startswith(("http://", "https://"))
    assert adapter.key_env == PRESETS[name].api_key_env


def test_the_presets_are_exactly_the_specs() -> None:
    assert set(PRESETS) == {"lmstudio", "ollama", "vllm", "openai", "nvidia", "dashscope"}


def test_lmstudio_preset_is_one_lane_three_minutes(tmp_path: Path) -> None:  # SPEC L5
    profile = config_from(provider('preset = "lmstudio"', adapter="openai"),
                          tmp_path).providers["x"].profile
    assert profile.lanes == 1
    assert profile.run_timeout_s == 180


def test_the_file_overrides_a_presets_base_url(tmp_path: Path) -> None:
    config = config_from(provider('preset = "lmstudio"\nbase_url = "http://127.0.0.1:9999/v1/"',
                                  adapter="openai"), tmp_path)
    adapter = OpenAIAdapter(config.providers["x"])
    assert adapter.base_url == "http://127.0.0.1:9999/v1"
    assert config.providers["x"].profile == PRESETS["lmstudio"].profile


# --- L3 validation ------------------------------------------------------------------------

def test_run_timeout_below_the_adapters_max_call_is_an_error(tmp_path: Path) -> None:
    assert PRESETS["lmstudio"].max_call_s == 120
    problems = problems_of(provider('preset = "lmstudio"', adapter="openai",
                                    profile="run_timeout_s = 30"), tmp_path)
    line = find(problems, "providers.x.profile", "run_timeout_s")
    assert "30" in line and "120" in line
    assert len(problems) == 1


def test_run_timeout_equal_to_the_max_call_loads(tmp_path: Path) -> None:
    config = config_from(provider('preset = "lmstudio"', adapter="openai",
                                  profile="run_timeout_s = 120"), tmp_path)
    assert config.providers["x"].profile.run_timeout_s == 120


def test_short_queue_timeout_with_one_lane_warns_loudly(tmp_path: Path) -> None:
    config = config_from(provider('preset = "lmstudio"', adapter="openai",
                                  profile="queue_timeout_s = 5"), tmp_path)  # loads
    assert config.providers["x"].profile.queue_timeout_s == 5
    assert len(config.warnings) == 1
    warning = config.warnings[0]
    assert warning.startswith("test.toml: [providers.x.profile] queue_timeout_s")
    assert "WARNING" in warning


def test_short_queue_timeout_with_two_lanes_does_not_warn(tmp_path: Path) -> None:
    config = config_from(provider('preset = "lmstudio"', adapter="openai",
                                  profile="queue_timeout_s = 5\nlanes = 2"), tmp_path)
    assert config.warnings == ()


# --- profile overrides --------------------------------------------------------------------

def test_a_profile_field_overrides_the_recommended_and_keeps_the_rest(tmp_path: Path) -> None:
    config = config_from(provider('preset = "lmstudio"', adapter="openai",
                                  profile="lanes = 3"), tmp_path)
    assert config.providers["x"].profile == attrs.evolve(PRESETS["lmstudio"].profile, lanes=3)

    fake = config_from(provider(profile="lanes = 3\nrpm = 30"), tmp_path).providers["x"]
    recommended = adapters.ADAPTERS["fake"].recommended_profile(fake.settings)
    assert recommended is not None
    assert fake.profile == attrs.evolve(recommended, lanes=3, rpm=30.0)


def test_integers_are_accepted_for_seconds(tmp_path: Path) -> None:
    config = config_from(provider(profile="run_timeout_s = 200\ninterrupt_grace_s = 1"),
                         tmp_path)
    assert config.providers["x"].profile.run_timeout_s == 200.0
    assert isinstance(config.providers["x"].profile.run_timeout_s, float)


# --- server safety (SPEC O4) --------------------------------------------------------------

def test_off_loopback_needs_token_env_and_allowed_hosts(tmp_path: Path) -> None:
    problems = problems_of('[server]\nhost = "0.0.0.0"\n' + FAKE_ONLY.replace("[server]", ""),
                           tmp_path, environ={})
    find(problems, "server", "token_env")
    find(problems, "server", "allowed_hosts")
    assert len(problems) == 2


def test_token_env_naming_an_unset_variable(tmp_path: Path) -> None:
    problems = problems_of('[server]\ntoken_env = "RELAY_TEST_TOKEN"\n', tmp_path, environ={})
    line = find(problems, "server", "token_env")
    assert "RELAY_TEST_TOKEN" in line
    problems = problems_of('[server]\ntoken_env = "RELAY_TEST_TOKEN"\n', tmp_path,
                           environ={"RELAY_TEST_TOKEN": ""})
    find(problems, "server", "token_env")


def test_off_loopback_with_token_and_hosts_loads(tmp_path: Path) -> None:
    text = """
    [server]
    host = "0.0.0.0"
    token_env = "RELAY_TEST_TOKEN"
    allowed_hosts = ["relay.lan"]
    """
    config = config_from(text, tmp_path, environ={"RELAY_TEST_TOKEN": "s3cret"})
    assert config.server.host == "0.0.0.0"
    assert config.server.token_env == "RELAY_TEST_TOKEN"
    assert config.server.allowed_hosts == ("relay.lan",)
    assert "s3cret" not in repr(config)  # the token's value is never kept in the config


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_need_no_token(tmp_path: Path, host: str) -> None:
    config = config_from(f'[server]\nhost = "{host}"\n', tmp_path, environ={})
    assert config.server.host == host


# --- names and syntax ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ['"a/b"', '""', '" x"'])
def test_bad_provider_names_are_rejected(tmp_path: Path, name: str) -> None:
    problems = problems_of(f"[providers.{name}]\nadapter = \"fake\"\n", tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("test.toml: [providers.")
    assert "'/'" in problems[0]


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    problems = problems_of('[server\nport = 1\n', tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("test.toml: ")
    assert "TOML" in problems[0] and "line 1" in problems[0]

    path = tmp_path / "broken.toml"
    path.write_text('[providers.x]\nadapter = "fake\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems[0].startswith(f"{path}: ")


def test_problems_from_a_file_name_its_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(provider(adapter="nope"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems[0].startswith(f"{path}: [providers.x] adapter")


def test_parse_config_is_the_public_one() -> None:
    assert relay.parse_config is parse_config
    assert relay.load_config is load_config


# --- the registry (SPEC L4) ---------------------------------------------------------------

PRESETS_BY_KIND: dict[str, dict[str, Any]] = {"openai": PRESETS}


def _declared_settings() -> list[tuple[str, str, Any]]:
    out = []
    for kind, cls in adapters.ADAPTERS.items():
        presets = PRESETS_BY_KIND.get(kind)
        if presets:
            out += [(kind, name, cls.Settings(preset=name)) for name in presets]
        else:
            out.append((kind, "defaults", cls.Settings()))
    return out


def test_the_registry_has_the_built_in_kinds() -> None:
    assert {"fake", "openai"} <= set(adapters.ADAPTERS)
    for kind, cls in adapters.ADAPTERS.items():
        assert cls.kind == kind
        assert issubclass(cls, adapters.Adapter)
        assert attrs.has(cls.Settings)


@pytest.mark.parametrize(("kind", "variant", "settings"), _declared_settings(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_registered_adapter_declares_a_profile(
        kind: str, variant: str, settings: Any) -> None:
    cls = adapters.ADAPTERS[kind]
    profile = cls.recommended_profile(settings)
    assert isinstance(profile, Profile), f"{kind} ({variant}) declares no profile"
    assert cls.max_call_s(settings) <= profile.run_timeout_s
    assert cls.typical_call_s(settings) > 0
    assert cls.settings_problems(settings) == []

