"""Shared lanes (SPEC O6) with a least-privilege ACL user and a chosen eviction policy, on
a real ``redis-server``: docs/operators.md's ACL line is the one relay builds; `relay config
check` names what the server refuses (with that line) and an eviction policy that could
evict lane keys; ``relay serve`` warns about that policy at start; a user with only the
required commands (no INFO, CONFIG, ROLE, CLIENT SETNAME) still serves. (Every test of
test_shared_lanes.py and test_shared_failures.py also runs as the documented user.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream
from helpers.assembled import start_relay, wait_for
from helpers.redis_server import ACL_PASSWORD, RedisServer, documented_acl, require_redis
from helpers.shared_helpers import ROOT, body, shared_config

from relay.shared.deployment import OPTIONAL, acl_line

OPTIONAL_RIGHTS = {f"+{c}" for c in OPTIONAL}


def server(tmp_path: Path, *args: str) -> RedisServer:
    return RedisServer(require_redis(), tmp_path / "redis", args=args)


async def config_check(tmp_path: Path, text: str) -> tuple[int, str]:
    conf = tmp_path / "relay.toml"
    conf.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path / "state")}
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, "-m", "relay", "config", "check", "--config", str(conf)],
            cwd=tmp_path, env=env, capture_stdout=True, capture_stderr=True, check=False,
            stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout.decode() + done.stderr.decode()


def test_the_documented_acl_line_is_the_one_relay_builds() -> None:
    assert documented_acl() == acl_line("relay")


async def test_config_check_names_refused_rights_and_an_evicting_policy(
        tmp_path: Path, upstream: FakeUpstream) -> None:
    redis = server(tmp_path, "--maxmemory-policy", "volatile-lru")
    # Redis 7's default for a new user: every key and command, but no channel.
    redis.use_acl_user("ACL SETUSER relay on >PASSWORD ~* +@all")
    redis.start()
    try:
        code, out = await config_check(tmp_path, shared_config(upstream, redis.url, "r"))
    finally:
        redis.stop()
    assert code == 0, out
    assert "WARNING coordination server: refused publish, subscribe" in out, out
    assert acl_line("relay") in out
    assert "maxmemory-policy is volatile-lru" in out and "noeviction" in out
    assert ACL_PASSWORD not in out


async def test_config_check_passes_the_documented_user_on_a_noeviction_server(
        tmp_path: Path, upstream: FakeUpstream) -> None:
    redis = server(tmp_path)
    redis.use_acl_user(documented_acl())
    redis.start()
    try:
        code, out = await config_check(tmp_path, shared_config(upstream, redis.url, "r"))
    finally:
        redis.stop()
    assert code == 0, out
    assert "every command the shared lanes use is allowed" in out, out
    assert "maxmemory-policy noeviction" in out
    assert "WARNING" not in out


async def test_serve_warns_at_start_about_an_evicting_policy(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    redis = server(tmp_path, "--maxmemory-policy", "allkeys-lru")
    redis.start()
    try:
        async with trio.open_nursery() as nursery:
            served = await start_relay(nursery, shared_config(upstream, redis.url, "r"),
                                       tmp_path)
            warned = [r for r in caplog.records if r.levelno == logging.WARNING
                      and "maxmemory-policy is allkeys-lru" in r.getMessage()]
            assert len(warned) == 1 and "noeviction" in warned[0].getMessage()
            r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
            assert r.status_code == 200  # a warning, not a refusal
            nursery.cancel_scope.cancel()
    finally:
        redis.stop()


async def test_a_user_with_only_the_required_rights_serves(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    """No INFO, CONFIG, ROLE nor CLIENT SETNAME: a refused CLIENT SETNAME is not fatal,
    the scripts do without INFO, the policy that cannot be read is said once."""
    required = " ".join(w for w in documented_acl().split() if w not in OPTIONAL_RIGHTS)
    redis = server(tmp_path)
    redis.use_acl_user(required)
    redis.start()
    caplog.set_level(logging.INFO)
    try:
        async with trio.open_nursery() as nursery:
            served = await start_relay(nursery, shared_config(upstream, redis.url, "r"),
                                       tmp_path)
            for _ in range(3):
                r = await client.post(f"{served.url}/v1/chat/completions",
                                      json=body("up/m1"))
                assert r.status_code == 200, r.text
            assert any("maxmemory-policy could not be read" in r.getMessage()
                       for r in caplog.records)
            nursery.cancel_scope.cancel()
    finally:
        redis.stop()


async def test_a_user_refused_ping_is_named_and_its_subscription_does_not_flap(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    """The documented rights without ``+ping``: `relay config check` names it, and the
    subscription's health check takes the server's refusal as the answer it is (the
    connection is alive) instead of subscribing again at every ping."""
    rights = " ".join(w for w in documented_acl().split() if w != "+ping")
    redis = server(tmp_path)
    redis.use_acl_user(rights)
    redis.start()
    try:
        code, out = await config_check(tmp_path, shared_config(upstream, redis.url, "r"))
        assert code == 0, out
        assert "WARNING coordination server: refused ping" in out, out
        async with trio.open_nursery() as nursery:
            served = await start_relay(nursery, shared_config(
                upstream, redis.url, "r", lease_s=2.0), tmp_path)
            coord = served.relay.coordinator
            assert coord is not None

            def answered() -> int:
                current = coord._subscription
                return 0 if current is None else current[0].pongs

            await wait_for(lambda: answered() >= 3, limit_s=10 * coord.ping_s)
            assert coord.subscription_renewals == 0
            assert not [r for r in caplog.records if "did not answer a ping" in r.getMessage()]
            r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
            assert r.status_code == 200, r.text
            nursery.cancel_scope.cancel()
    finally:
        redis.stop()
