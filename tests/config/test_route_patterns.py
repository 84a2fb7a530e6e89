"""Pattern routes (SPEC F9): ``[routes."claude-*"]`` with ``{model}`` in its targets.

Loading and its errors, which pattern wins, `relay config check`'s resolutions, the
packaged default's routes for the coding agents' own model names, and the assembled relay
answering a pattern-matched name over HTTP (exact names first, a 404 for a name nothing
takes, patterns left out of the model list).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import FAKE_ONLY, chat, config_from, records, start_relay, wait_for
from helpers.cloud_helpers import posts

from relay import ConfigError
from relay.assembly.describe import AGENT_MODELS, resolution
from relay.config import PACKAGED_DEFAULT, best_pattern

ROOT = Path(__file__).resolve().parents[2]


def routes(**tables: str) -> str:
    """``[routes."NAME"]`` tables: name → its body."""
    return "".join(f'[routes."{name}"]\n{body}\n' for name, body in tables.items())


def pattern_config(up_url: str = "http://127.0.0.1:9/v1") -> str:
    return FAKE_ONLY + f"""
[providers.up]
adapter = "openai"
base_url = "{up_url}"
[providers.up.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[routes."claude-*"]
primary = "up/{{model}}"
fallbacks = ["fake/echo"]
[routes."claude-haiku-*"]
primary = "up/small-{{model}}"
[routes."claude-*-4-5"]
primary = "up/four-five"
[routes."*-preview"]
primary = "fake/echo"
[routes.claude-opus-5-5]
primary = "up/exact"
"""


# --- loading ---------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "body", "words"), [
    ("claude-**", 'primary = "fake/echo"', "'**' matches what one '*' does"),
    ("*", 'primary = "fake/echo"', "would answer every unknown name"),
    ("**", 'primary = "fake/echo"', "'**'"),
    ("claude-{x}*", 'primary = "fake/echo"', "no '{' or '}'"),
    ("claude *", 'primary = "fake/echo"', "no spaces"),
    ("claude-*", 'primary = "fake/{modle}"', "the only placeholder is {model}"),
    ("claude-*", 'primary = "{model}/echo"', "only in the model part"),
    ("claude-*", 'primary = "nobody/{model}"', "names no provider"),
    ("claude-*", 'primary = "fake/echo"\nfallbacks = ["fake/{model}", "fake/{model}"]',
     "listed twice"),
])
def test_a_bad_pattern_route_is_a_config_error_naming_it(
        tmp_path: Path, name: str, body: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from(FAKE_ONLY + routes(**{name: body}), tmp_path)
    problems = [p for p in caught.value.problems if f'[routes."{name}"]' in p]
    assert len(problems) == 1, caught.value.problems
    assert problems[0].startswith("test.toml: ") and words in problems[0], problems


def test_model_placeholder_only_in_a_pattern_route(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from(FAKE_ONLY + '[routes.plain]\nprimary = "fake/{model}"\n', tmp_path)
    (problem,) = caught.value.problems
    assert "[routes.plain] primary" in problem and "only a pattern route's" in problem


def test_a_model_placeholder_target_checks_its_provider_only(tmp_path: Path) -> None:
    # fake lists only "echo": a {model} target's model is known per request only.
    config = config_from(FAKE_ONLY + routes(**{"claude-*": 'primary = "fake/{model}"'}),
                         tmp_path)
    assert config.routes["claude-*"].is_pattern
    assert not config.routes["claude-*"].primary.startswith("fake/claude")


# --- which pattern wins ------------------------------------------------------------------

@pytest.mark.parametrize(("name", "route", "primary"), [
    ("claude-sonnet-4-5-20250929", "claude-*", "up/claude-sonnet-4-5-20250929"),
    # the longest literal prefix wins ("claude-haiku-" over "claude-")
    ("claude-haiku-4-5", "claude-haiku-*", "up/small-claude-haiku-4-5"),
    # same prefix "claude-": more literal characters win
    ("claude-sonnet-4-5", "claude-*-4-5", "up/four-five"),
    # "*" matches any run, "/" and nothing included
    ("claude-", "claude-*", "up/claude-"),
    ("claude-x/y", "claude-*", "up/claude-x/y"),
    ("gemini-3.1-pro-preview", "*-preview", "fake/echo"),
    # a longer prefix beats a pattern with more literal characters in all
    ("claude-3-preview", "claude-*", "up/claude-3-preview"),
])
def test_the_longest_literal_prefix_wins(tmp_path: Path, name: str, route: str,
                                         primary: str) -> None:
    config = config_from(pattern_config(), tmp_path)
    found = best_pattern(config.routes, name)
    assert found is not None
    assert (found.name, found.primary) == (route, primary)
    if route == "claude-*":  # {model} is filled in the fallbacks too
        assert found.fallbacks == ("fake/echo",)


def test_a_full_tie_goes_to_the_first_defined(tmp_path: Path) -> None:
    # "q*1" and "q*2*": the same literal prefix ("q") and as many literal characters (2)
    # each, and both match "q-21": the one the file defines first wins, either way round.
    one, two = 'primary = "fake/echo"', 'primary = "fake/echo"'
    config = config_from(FAKE_ONLY + routes(**{"q*1": one, "q*2*": two}), tmp_path)
    found = best_pattern(config.routes, "q-21")
    assert found is not None and found.name == "q*1"
    config = config_from(FAKE_ONLY + routes(**{"q*2*": two, "q*1": one}), tmp_path)
    found = best_pattern(config.routes, "q-21")
    assert found is not None and found.name == "q*2*"


def test_no_pattern_is_none(tmp_path: Path) -> None:
    config = config_from(pattern_config(), tmp_path)
    assert best_pattern(config.routes, "gpt-6") is None
    assert best_pattern(config.routes, "xclaude-1") is None  # anchored at both ends


# --- relay config check ------------------------------------------------------------------

def test_resolutions_as_config_check_says_them(tmp_path: Path) -> None:
    config = config_from(pattern_config(), tmp_path)
    assert resolution(config, "claude-opus-5-5") == "route claude-opus-5-5: up/exact"
    assert resolution(config, "claude-haiku-4-5-20251001") == (
        'route "claude-haiku-*": up/small-claude-haiku-4-5-20251001')
    assert resolution(config, "claude-sonnet-5") == (
        'route "claude-*": up/claude-sonnet-5, then fake/echo')
    assert resolution(config, "echo") == "provider fake, model echo (no route)"
    assert resolution(config, "up/claude-x") == "provider up, model claude-x (no route)"
    assert resolution(config, "fake/claude-x").startswith("404 unknown_model: provider")
    assert resolution(config, "gpt-6.2-sol").startswith("404 unknown_model")


def _relay(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "relay", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_config_check_prints_routes_and_where_the_agents_names_go(tmp_path: Path) -> None:
    # From an empty folder: the packaged default.
    done = _relay("config", "check", "--model", "nobody-knows", "--model", "fake/echo",
                  cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert '  "claude-*" (pattern): fake/echo' in out
    for agent, names in AGENT_MODELS:
        for name in names:
            assert f"  {name} ({agent}) -> route " in out, (name, out)
    assert "  nobody-knows (asked) -> 404 unknown_model" in out
    assert "  fake/echo (asked) -> provider fake, model echo (no route)" in out
    bad = tmp_path / "bad.toml"
    bad.write_text(FAKE_ONLY + routes(**{"claude-**": 'primary = "fake/echo"'}))
    done = _relay("config", "check", "--config", str(bad), cwd=tmp_path)
    assert done.returncode == 2
    assert f'{bad}: [routes."claude-**"]: bad pattern' in done.stderr + done.stdout


def test_the_packaged_default_routes_every_agents_own_names_to_the_fake() -> None:
    config = config_from(PACKAGED_DEFAULT.read_text(), PACKAGED_DEFAULT.parent)
    for _, names in AGENT_MODELS:
        for name in names:
            found = best_pattern(config.routes, name)
            assert found is not None and found.primary == "fake/echo", name
    assert resolution(config, "claude-opus-4-1-20250805").endswith(": fake/echo")


# --- through the assembled relay ----------------------------------------------------------

async def test_a_pattern_route_answers_over_http_exact_names_first(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, pattern_config(upstream.url), tmp_path)
    url = served.url

    async def ask(model: str) -> httpx.Response:
        return await client.post(f"{url}/v1/chat/completions", json=chat(model))

    r = await ask("claude-sonnet-4-5-20250929")
    assert r.status_code == 200, r.text
    assert posts(upstream)[-1].json["model"] == "claude-sonnet-4-5-20250929"
    r = await ask("claude-haiku-4-5-20251001")
    assert r.status_code == 200, r.text
    assert posts(upstream)[-1].json["model"] == "small-claude-haiku-4-5-20251001"
    r = await ask("claude-opus-5-5")  # the exact route wins over every pattern
    assert r.status_code == 200 and posts(upstream)[-1].json["model"] == "exact"
    sent = len(posts(upstream))
    r = await ask("echo")  # a bare model a provider lists wins (no pattern matches it)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello"
    r = await ask("fake/claude-x")  # PROVIDER/… is the provider's: its own 404
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model"
    assert "'fake/claude-x'" in r.json()["error"]["message"]
    # A name no route, provider or pattern takes: a 404 naming what is known.
    r = await ask("gpt-6.2-sol")
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "unknown_model"
    assert "claude-*" in error["message"] and "fake/echo" in error["message"]
    assert len(posts(upstream)) == sent  # nothing else answered in its place

    await wait_for(lambda: len(records(tmp_path)) == 6)
    by_model = {rec["requested_model"]: rec for rec in records(tmp_path)}
    haiku = by_model["claude-haiku-4-5-20251001"]
    assert (haiku["route"], haiku["provider"], haiku["model"]) == (
        "claude-haiku-*", "up", "small-claude-haiku-4-5-20251001")
    assert by_model["claude-opus-5-5"]["route"] == "claude-opus-5-5"

    # Patterns are no models to pick: the list shows the exact names; a name a pattern
    # takes is found.
    listed = (await client.get(f"{url}/v1/models")).json()["data"]
    ids = [m["id"] for m in listed]
    assert "claude-opus-5-5" in ids and "fake/echo" in ids
    assert not [i for i in ids if "*" in i]
    one = await client.get(f"{url}/v1/models/claude-haiku-9")
    assert one.status_code == 200 and one.json()["owned_by"] == "relay"
    assert (await client.get(f"{url}/v1/models/gpt-6")).status_code == 404
    beta = (await client.get(f"{url}/v1beta/models")).json()["models"]
    assert not [m for m in beta if "*" in m["name"]]


async def test_a_pattern_falls_back_like_any_route(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["claude-x"] = Script(status=503)
    served = await start_relay(nursery, pattern_config(upstream.url), tmp_path)
    r = await client.post(f"{served.url}/v1/chat/completions", json=chat("claude-x", "hi"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hi"
    await wait_for(lambda: len(records(tmp_path)) == 1)
    (rec,) = records(tmp_path)
    assert [(a["provider"], a["model"], a["ok"]) for a in rec["attempts"]] == [
        ("up", "claude-x", False), ("fake", "echo", True)]


async def test_the_agents_own_names_answer_on_the_packaged_default(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    text = PACKAGED_DEFAULT.read_text().replace(
        "[server]\n", '[server]\nrecords = "records.jsonl"\n', 1)
    served = await start_relay(nursery, text, tmp_path)
    url = served.url
    r = await client.post(f"{url}/v1/messages", json={
        "model": "claude-haiku-4-5-20251001", "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello from claude"}]})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "hello from claude"
    r = await client.post(f"{url}/v1/responses", json={"model": "gpt-6.2-sol",
                                                        "input": "hello from codex"})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == (
        "hello from codex")
    r = await client.post(f"{url}/v1beta/models/gemini-3.5-flash-lite:generateContent",
                          json={"contents": [{"parts": [{"text": "hello from gemini"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["candidates"][0]["content"]["parts"][0]["text"] == "hello from gemini"
    await wait_for(lambda: len(records(tmp_path)) == 3)
    assert sorted((rec["route"], rec["provider"], rec["model"])
                  for rec in records(tmp_path)) == [
        ("claude-*", "fake", "echo"), ("gemini-*", "fake", "echo"), ("gpt-*", "fake", "echo")]
