"""relay.redis.resp against a real ``redis-server``: reply types and error replies, scripts
by SHA-1 with the EVAL fallback after ``SCRIPT FLUSH``, pipelining kept in step when a caller
is cancelled, ``reset``, a server restart, a server that accepts but never answers, AUTH
(password, ACL user, wrong password), SELECT, pub/sub, URLs, a unix socket and TLS."""

from __future__ import annotations

import contextlib
import random
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing
from helpers.redis_server import RedisServer, _free_port, require_redis

from relay.redis import resp

T = 1.0  # every client's timeout_s


def client(url: str) -> contextlib.AbstractAsyncContextManager[resp.Client]:
    return resp.open_client(url, timeout_s=T, name="t")


@contextlib.asynccontextmanager
async def own_server(workdir: Path, *args: str) -> AsyncIterator[str]:
    """A ``redis-server`` with ``args`` (no TCP port unless they say): gives "" once it is
    ready, or its log if it exited instead (the wait is bounded)."""
    log = workdir / "own.log"
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(
            [require_redis(), "--port", "0", "--save", "", "--appendonly", "no", "--dir",
             str(workdir), *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        with trio.fail_after(10):
            while b"ready to accept connections" not in log.read_bytes().lower():
                if proc.poll() is not None:
                    break
                await trio.sleep(0.01)
        yield log.read_text() if proc.poll() is not None else ""
    finally:
        proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


async def test_execute_returns_each_reply_type_and_survives_error_replies(
        redis: RedisServer) -> None:
    async with client(redis.url) as c:
        assert await c.execute("SET", "k", "v") == "OK"
        assert await c.execute("GET", "k") == "v"
        assert await c.execute("GET", "missing") is None
        assert await c.execute("INCRBY", "n", 41) == 41
        assert await c.execute("RPUSH", "l", "a", b"b", "c") == 3
        assert await c.execute("LRANGE", "l", 0, -1) == ["a", "b", "c"]
        assert await c.execute("LRANGE", "missing", 0, -1) == []
        assert await c.execute("EVAL", "return {1, {'a', 'b'}, 'x'}", 0) == [1, ["a", "b"], "x"]
        assert await c.execute("SET", "ключ", "значение ✓") == "OK"
        assert await c.execute("GET", "ключ") == "значение ✓"
        big = "x" * 1_000_000  # many reads for one reply
        await c.execute("SET", "big", big)
        assert await c.execute("GET", "big") == big
        assert await c.execute("CLIENT", "GETNAME") == "t"
        with pytest.raises(resp.RespError) as err:
            await c.execute("LPUSH", "k", "x")
        assert err.value.code == "WRONGTYPE"
        with pytest.raises(resp.RespError) as err:
            await c.execute("NOSUCHCOMMAND")
        assert err.value.code == "ERR"
        assert await c.execute("ECHO", "still here") == "still here"


async def test_script_runs_by_sha_and_sends_its_source_only_when_the_server_lacks_it(
        redis: RedisServer) -> None:
    echo = resp.Script("return ARGV[1]")
    async with client(redis.url) as c:
        await c.execute("CONFIG", "RESETSTAT")
        assert await c.script(echo, [], ["one"]) == "one"  # NOSCRIPT -> EVAL
        assert await c.script(echo, [], ["two"]) == "two"  # EVALSHA alone
        assert await c.execute("SCRIPT", "FLUSH") == "OK"
        assert await c.script(echo, [], ["three"]) == "three"  # NOSCRIPT -> EVAL again
        assert "cmdstat_eval:calls=2," in await c.execute("INFO", "commandstats")
        await c.execute("SET", "key", "value")
        get = resp.Script("return redis.call('GET', KEYS[1])")
        assert await c.script(get, ["key"], []) == "value"
        boom = resp.Script("return redis.error_reply('BOOM it failed')")
        for _ in range(2):  # a script's own error is raised, not retried as EVAL
            with pytest.raises(resp.RespError) as err:
                await c.script(boom, [], [])
            assert err.value.code == "BOOM"
        assert "cmdstat_eval:calls=4," in await c.execute("INFO", "commandstats")


async def test_a_cancelled_callers_reply_is_dropped_not_handed_to_the_next(
        redis: RedisServer) -> None:
    got: dict[str, str] = {}

    async def echo(word: str) -> None:
        got[word] = await c.execute("ECHO", word)

    async with client(redis.url) as c:
        await c.execute("PING")  # connected
        redis.pause()
        try:
            async with trio.open_nursery() as abandoned:
                abandoned.start_soon(echo, "abandoned")
                await trio.testing.wait_all_tasks_blocked()  # sent, waiting for its reply
                abandoned.cancel_scope.cancel()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(echo, "a")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(echo, "b")
                await trio.testing.wait_all_tasks_blocked()
                redis.resume()
        finally:
            redis.resume()
        assert got == {"a": "a", "b": "b"}


async def test_many_concurrent_commands_each_get_their_own_reply(redis: RedisServer) -> None:
    got: dict[int, object] = {}

    async def one(i: int) -> None:
        if i % 10 == 0:  # error replies in the same pipeline
            with pytest.raises(resp.RespError):
                await c.execute("INCR", f"nan{i}")
        got[i] = await c.execute("ECHO", f"m{i}")

    async with client(redis.url) as c:
        await c.execute("MSET", *[x for i in range(0, 200, 10) for x in (f"nan{i}", "x")])
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(one, i)
    assert got == {i: f"m{i}" for i in range(200)}


async def test_cancels_landing_anywhere_never_cost_the_other_callers_their_replies(
        redis: RedisServer) -> None:
    """Callers cancelled at random moments — waiting for the send lock, as it is handed
    over, waiting for a reply, reading one — while others never are: those others all
    get their own replies, on the one connection (a cancel before anything was sent must
    not fail it)."""
    rng = random.Random(7)
    wrong: list[object] = []

    async def steady(k: int) -> None:
        for i in range(100):
            if (got := await c.execute("ECHO", f"{k}.{i}")) != f"{k}.{i}":
                wrong.append(got)

    async def jittery(k: int) -> None:
        for i in range(100):
            with trio.move_on_after(rng.uniform(0, 0.003)):
                if (got := await c.execute("ECHO", f"j{k}.{i}")) != f"j{k}.{i}":
                    wrong.append(got)

    async with client(redis.url) as c:
        ids = {await c.execute("CLIENT", "ID")}
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for k in range(10):
                    nursery.start_soon(steady, k)
                    nursery.start_soon(jittery, k)
        ids.add(await c.execute("CLIENT", "ID"))
    assert wrong == []
    assert len(ids) == 1  # never failed, never reconnected


async def test_a_reply_too_deeply_nested_fails_the_connection_not_every_later_command(
        redis: RedisServer) -> None:
    deep = "local t = {} for _ = 1, 3000 do t = {t} end return t"
    async with client(redis.url) as c:
        with pytest.raises(resp.ConnectionLost):
            await c.execute("EVAL", deep, 0)
        assert await c.execute("PING") == "PONG"  # a new connection, in step


async def test_reset_drops_the_connection_and_fails_a_waiting_command(
        redis: RedisServer) -> None:
    async def waiting() -> None:
        with pytest.raises(resp.ConnectionLost):
            await c.execute("ECHO", "never")

    async with client(redis.url) as c:
        first = await c.execute("CLIENT", "ID")
        c.reset()
        second = await c.execute("CLIENT", "ID")
        assert second != first  # connected anew
        redis.pause()
        try:
            with trio.fail_after(3):  # a stuck server: reset fails the command waiting on it
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(waiting)
                    await trio.testing.wait_all_tasks_blocked()
                    c.reset()
        finally:
            redis.resume()
        assert await c.execute("CLIENT", "ID") not in (first, second)


async def test_after_a_server_restart_commands_reconnect_and_replies_never_cross(
        redis: RedisServer) -> None:
    lost: list[int] = []

    async def until_answered(i: int) -> None:
        while True:
            try:
                assert await c.execute("ECHO", f"r{i}") == f"r{i}"
                return
            except resp.ConnectionLost:
                lost.append(i)

    async with client(redis.url) as c:
        await c.execute("SET", "k", "before")
        redis.restart()  # every key lost
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(until_answered, i)
        assert len(set(lost)) == len(lost)  # each lost once at most: nothing retries
        assert await c.execute("GET", "k") is None  # the new server's


async def test_auth_by_password_and_acl_user_a_wrong_password_and_select(
        tmp_path: Path, redis: RedisServer) -> None:
    secured = RedisServer(require_redis(), tmp_path / "secured", password="pw")
    secured.start()
    try:
        at = f"127.0.0.1:{secured.port}"
        async with client(f"redis://:pw@{at}/0") as c:
            assert await c.execute("ACL", "SETUSER", "alice", "on", ">secret", "~*",
                                   "+@all") == "OK"
            assert await c.execute("ACL", "WHOAMI") == "default"
        async with client(f"valkey://alice:secret@{at}/0") as c:
            assert await c.execute("ACL", "WHOAMI") == "alice"
        for url, code in ((f"redis://:wrong-pw-7@{at}/0", "WRONGPASS"),
                          (f"redis://alice:wrong-pw-7@{at}/0", "WRONGPASS"),
                          (f"redis://{at}/0", "NOAUTH")):
            async with client(url) as c:
                with pytest.raises(resp.RespError) as err:
                    await c.execute("PING")
            assert err.value.code == code and "wrong-pw-7" not in str(err.value)
    finally:
        secured.stop()
    base = f"redis://127.0.0.1:{redis.port}"
    async with client(f"{base}/3") as three, client(f"{base}/0") as zero:
        await three.execute("SET", "in3", "yes")
        assert await zero.execute("GET", "in3") is None
        assert await three.execute("GET", "in3") == "yes"
    async with client(f"{base}/99") as c:
        with pytest.raises(resp.RespError):  # DB index is out of range
            await c.execute("PING")


async def test_subscribe_gets_published_messages_until_the_server_stops(
        redis: RedisServer) -> None:
    async with client(redis.url) as c, c.subscribe("ch") as sub:
        assert await c.execute("PUBLISH", "ch", "hello") == 1
        assert await c.execute("PUBLISH", "ch", "world") == 1
        with trio.fail_after(5):
            assert await sub.message() == "hello"
            assert await sub.message() == "world"
            redis.stop()
            with pytest.raises(resp.ConnectionLost):
                await sub.message()


@pytest.mark.parametrize("how", ["execute", "subscribe"])
async def test_a_server_that_accepts_but_never_answers_raises_connection_lost(
        redis: RedisServer, how: str) -> None:
    redis.pause()  # the kernel still accepts: the set-up's replies never come
    try:
        async with client(redis.url) as c:
            with trio.fail_after(5), pytest.raises(resp.ConnectionLost):
                if how == "execute":
                    await c.execute("PING")
                else:
                    async with c.subscribe("ch"):
                        pass
    finally:
        redis.resume()


def test_parse_url_schemes_and_errors_that_never_quote_the_password() -> None:
    t = resp.parse_url("valkey://u:p@example.org:7000/2")
    assert (t.host, t.port, t.username, t.password, t.db, t.ssl_context) == (
        "example.org", 7000, "u", "p", 2, None)
    assert resp.parse_url("valkeys://h/0").ssl_context is not None
    assert resp.parse_url("redis://h").db == 0
    u = resp.parse_url("unix:///run/r.sock?db=4&password=s%40cret")
    assert (u.path, u.db, u.password) == ("/run/r.sock", 4, "s@cret")
    assert resp.parse_url("redis://:@h/0").password is None  # no AUTH for an empty one
    for bad in ("redis://:hunter2@h/abc", "unix:///r.sock?db=x&password=hunter2",
                "http://:hunter2@h/0", "rediss://:hunter2@h/0?ssl_ca_certs=/no/such.pem",
                "redis://:hunter2\uff03x@h:6379/0",  # urlsplit's own error quotes it
                "redis://:hunter2@h:99999/0"):
        with pytest.raises(ValueError) as err:
            resp.parse_url(bad)
        assert "hunter2" not in str(err.value)


async def test_a_unix_socket_with_password_and_db_in_the_query(tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    async with own_server(tmp_path, "--unixsocket", str(sock), "--requirepass", "pw") as log:
        assert not log
        async with client(f"unix://{sock}?db=2&password=pw") as two, \
                client(f"unix://{sock}?password=pw") as zero:
            assert await two.execute("SET", "k", "v") == "OK"
            assert await zero.execute("GET", "k") is None
            assert await two.execute("GET", "k") == "v"


def make_certs(d: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 that it signed."""
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                               "authorityKeyIdentifier=keyid,issuer\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
                 "-subj", "/CN=test CA"],
                ["req", *ec, "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=srv"],
                ["x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", "srv.pem", "-days", "1", "-extfile", "ext.cnf"]):
        subprocess.run(["openssl", *cmd], cwd=d, check=True, capture_output=True)


async def test_tls_verified_against_a_given_ca_and_refused_without_it(tmp_path: Path) -> None:
    make_certs(tmp_path)
    port = _free_port()
    async with own_server(tmp_path, "--bind", "127.0.0.1", "--tls-port", str(port),
                          "--tls-cert-file", str(tmp_path / "srv.pem"),
                          "--tls-key-file", str(tmp_path / "srv.key"),
                          "--tls-auth-clients", "no") as log:
        if "bad directive" in log.lower():  # built without TLS: "tls-port" is unknown
            pytest.skip(f"this redis-server cannot serve TLS: {log[-300:]}")
        assert not log
        at = f"127.0.0.1:{port}/0"
        async with client(f"rediss://{at}?ssl_ca_certs={tmp_path / 'ca.pem'}") as c:
            assert await c.execute("ECHO", "over tls") == "over tls"
        async with client(f"valkeys://{at}?ssl_cert_reqs=none") as c:
            assert await c.execute("ECHO", "unverified") == "unverified"
        async with client(f"rediss://{at}") as c:  # the system's CAs do not know ours
            with trio.fail_after(5), pytest.raises(resp.ConnectionLost):
                await c.execute("PING")
