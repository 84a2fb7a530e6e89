"""Config errors a new user can act on (issue 15, SPEC 9): every unknown key named, with
"did you mean" where one is close and every valid key of its table; a TOML syntax error
with its line and column; no error reported because of another one.

Unit tests on `relay.parse_config` / `relay.load_config`, and `relay config check` as a
subprocess for what the user reads.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import attrs
import pytest
from helpers.assembled import config_from
from helpers.daemons import run_relay, write

from relay import ConfigError, adapters, load_config
from relay.config import COMMON_PROVIDER_KEYS


def problems_of(text: str, tmp_path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from(text, tmp_path)
    return info.value.problems


def the(problems: list[str], *words: str) -> str:
    hits = [p for p in problems if all(w in p for w in words)]
    assert len(hits) == 1, f"{words} in one problem of: {problems}"
    return hits[0]


def test_a_misspelt_adapter_key_is_named_with_the_key_it_means(tmp_path: Path) -> None:
    problems = problems_of('[providers.x]\nadaptor = "fake"\nmodels = ["echo"]\n', tmp_path)
    line = the(problems, "[providers.x] adaptor:")
    assert "unknown key (did you mean 'adapter'?)" in line
    for key in COMMON_PROVIDER_KEYS:
        assert key in line
    the(problems, "[providers.x] adapter: missing")
    assert len(problems) == 2


def test_a_typo_under_a_provider_lists_every_key_that_table_takes(tmp_path: Path) -> None:
    problems = problems_of('[providers.x]\nadapter = "fake"\nmodls = ["echo"]\n'
                           'rply = "hi"\n', tmp_path)
    models = the(problems, "[providers.x] modls:")
    assert "(did you mean 'models'?)" in models
    listed = models.partition("valid keys in [providers.x]: ")[2].split(", ")
    settings = [f.name for f in attrs.fields(adapters.ADAPTERS["fake"].Settings)]
    assert listed == [*COMMON_PROVIDER_KEYS, *settings]
    assert "(did you mean 'reply'?)" in the(problems, "[providers.x] rply:")
    assert len(problems) == 2    # every unknown key, once each


@pytest.mark.parametrize(("text", "key", "means", "table"), [
    ('[server]\nprot = 1\n', "prot", "port", "server"),
    ('[providers.x]\nadapter = "fake"\n[providers.x.profile]\nlane = 2\n', "lane", "lanes",
     "providers.x.profile"),
    ('[providers.x]\nadapter = "fake"\n[routes.r]\nprimary = "x/echo"\nfalbacks = []\n',
     "falbacks", "fallbacks", "routes.r"),
])
def test_every_table_names_the_key_a_typo_means(tmp_path: Path, text: str, key: str,
                                                means: str, table: str) -> None:
    line = the(problems_of(text, tmp_path), f"[{table}] {key}:")
    assert f"(did you mean {means!r}?)" in line
    assert f"valid keys in [{table}]: " in line and means in line


def test_a_route_cannot_set_its_own_name(tmp_path: Path) -> None:
    # `name` is filled in by relay from the table's name; the file setting it was ignored.
    line = the(problems_of('[providers.x]\nadapter = "fake"\n[routes.r]\nprimary = "x/echo"'
                           '\nname = "other"\n', tmp_path), "[routes.r] name:")
    assert "unknown key" in line and "name," not in line.partition("valid keys")[2]


def test_an_unknown_adapter_kind_gets_a_did_you_mean(tmp_path: Path) -> None:
    line = the(problems_of('[providers.x]\nadapter = "fak"\n', tmp_path), "adapter:")
    assert "unknown adapter kind 'fak' (did you mean 'fake'?)" in line


@pytest.mark.parametrize(("text", "line", "column"), [
    # tomllib says only "(at end of document)" for these: relay finds the line itself.
    pytest.param('[server]\nport = 8765\n[providers.fake', 3, 16, id="header-at-the-end"),
    pytest.param('[providers.x]\nadapter = "fake\n', 2, 16, id="unclosed-string"),
    pytest.param('[providers.x]\nadapter = "fake"\nmodels = ["echo"', 3, 17,
                 id="unclosed-list-at-the-end"),
    pytest.param('[server]\nport 8765\n', 2, 6, id="middle"),
])
def test_a_toml_syntax_error_gives_its_line_and_column(tmp_path: Path, text: str, line: int,
                                                       column: int) -> None:
    problems = problems_of(text, tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith(f"test.toml: line {line}, column {column}: not valid TOML: ")
    assert "end of document" not in problems[0]
    assert text.splitlines()[line - 1].strip() in problems[0]   # the line itself


def test_a_file_that_is_not_utf8_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[providers.x]\nadapter = "fake"\nreply = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"{path}: line 3, column 13: not UTF-8 text (byte 0xe9); "
                                   "save the file as UTF-8"]


def test_one_providers_errors_do_not_cascade_into_anothers(tmp_path: Path) -> None:
    problems = problems_of(textwrap.dedent("""
        [providers.a]
        adaptor = "fake"
        [providers.b]
        adapter = "fake"
        modls = ["x"]
        [routes.r]
        primary = "a/echo"
        fallbacks = ["b/echo", "nope/x"]
    """), tmp_path)
    # a's and b's own problems; the route's targets on a and b are not reported again ...
    assert not [p for p in problems if "'a/echo'" in p or "'b/echo'" in p], problems
    # ... and 'nope' really names no provider: the file defines a and b, not "none".
    nope = the(problems, "[routes.r] fallbacks[1]:")
    assert "(providers defined: a, b)" in nope and "none" not in nope
    assert len(problems) == 4, problems


async def test_config_check_prints_each_problem_on_its_own_line(tmp_path: Path) -> None:
    write(tmp_path, "bad.toml", """
        [providers.fake]
        adaptor = "fake"
        [providers.b]
        adapter = "fake"
        modls = []
    """)
    done = await run_relay(tmp_path, "config", "check", "--config", "bad.toml")
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert "bad.toml: [providers.fake] adaptor: unknown key (did you mean 'adapter'?)" in err
    assert "bad.toml: [providers.b] modls: unknown key (did you mean 'models'?); valid keys" \
        " in [providers.b]: adapter, models," in err
    assert "Traceback" not in err
