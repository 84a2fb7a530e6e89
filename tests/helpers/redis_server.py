"""A real ``redis-server`` for the shared-lane tests (SPEC L11), on a free loopback port.

Started as a child process with no persistence (a restart loses the state, which is what
the tests want to see); stopped, paused (SIGSTOP), resumed (SIGCONT) and restarted on the
same port by the tests. Tests skip with a clear message where ``redis-server`` is not
installed (``.ci/install-redis.sh`` installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["ACL_PASSWORD", "RedisServer", "Sentinel", "documented_acl", "redis_fixture",
           "redis_shared_fixture", "require_redis"]

ACL_PASSWORD = "acl-user-secret-7"

REDIS = shutil.which("redis-server") or shutil.which("valkey-server")


def require_redis() -> str:
    if REDIS is None:
        pytest.skip("redis-server (or valkey-server) is not installed: shared-lane tests "
                    "need it (run .ci/install-redis.sh, or apt-get install redis-server)")
    return REDIS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One ``redis-server`` child process; see the module docstring."""

    def __init__(self, binary: str, workdir: Path, *, password: str | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.password = password
        self.args = args  # more of redis-server's options (--replicaof, --aclfile, …)
        self.acl: list[str] | None = None  # ACL SETUSER's arguments: relay's URL uses it
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.acl is not None:
            return f"redis://{self.acl[0]}:{ACL_PASSWORD}@127.0.0.1:{self.port}/0"
        return f"redis://127.0.0.1:{self.port}/0"

    def use_acl_user(self, rights: str) -> None:
        """relay's URL names a user with exactly ``rights`` (an ``ACL SETUSER`` line
        whose password is ``>PASSWORD``); made again at every (re)start."""
        words = rights.split()
        assert words[:2] == ["ACL", "SETUSER"] and ">PASSWORD" in words
        self.acl = [f">{ACL_PASSWORD}" if w == ">PASSWORD" else w for w in words[2:]]
        if self.proc is not None:
            self._make_user()

    def _make_user(self) -> None:
        assert self.acl is not None
        assert self.command("ACL", "SETUSER", *self.acl) == b"+OK\r\n"

    def argv(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
                *(["--requirepass", self.password] if self.password else []), *self.args]

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 10.0
        while True:  # bounded: until it answers PING
            if self.proc.poll() is not None:
                log_text = (self.workdir / "redis.log").read_text()
                raise RuntimeError(f"redis-server exited: {log_text}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not answer within 10 s")
            time.sleep(0.02)
        if self.acl is not None:
            self._make_user()

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signum)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        """Kill it and start a fresh one on the same port: every key is lost."""
        self.stop()
        self.start()

    def command(self, *args: str) -> bytes:
        """One command over a plain socket (for a test's own look at the keys)."""
        def wire(*parts: str) -> bytes:
            return f"*{len(parts)}\r\n".encode() + b"".join(
                f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in parts)
        auth = wire("AUTH", self.password) if self.password else b""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2.0) as s:
            s.sendall(auth + wire(*args))
            data = b""
            while (data.count(b"\r\n") < (2 if auth else 1)) or (
                    auth and not data.startswith(b"+OK\r\n")):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            return data.removeprefix(b"+OK\r\n") if auth else data


class Sentinel(RedisServer):
    """``redis-server FILE --sentinel`` watching ``primary`` as ``name`` (quorum 2; the
    primary counts as down after 500 ms without an answer)."""

    def __init__(self, binary: str, workdir: Path, primary_port: int, name: str = "lanes"
                 ) -> None:
        super().__init__(binary, workdir)
        self.primary_port = primary_port
        self.name = name

    def argv(self) -> list[str]:
        conf = self.workdir / "sentinel.conf"
        conf.write_text(f"""port {self.port}
bind 127.0.0.1
dir {self.workdir}
sentinel monitor {self.name} 127.0.0.1 {self.primary_port} 2
sentinel down-after-milliseconds {self.name} 500
sentinel failover-timeout {self.name} 3000
sentinel parallel-syncs {self.name} 1
""")
        return [self.binary, str(conf), "--sentinel"]

    def primary(self) -> int | None:
        """The port this Sentinel names for the primary now."""
        reply = self.command("SENTINEL", "get-master-addr-by-name", self.name)
        parts = reply.split(b"\r\n")
        return int(parts[4]) if reply.startswith(b"*2") else None


@pytest.fixture(name="redis")
def redis_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(require_redis(), tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def documented_acl() -> str:
    """The ``ACL SETUSER`` line of docs/operators.md's "Several machines, one account"."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "operators.md").read_text()
    (line,) = [x.strip() for x in guide.splitlines() if x.strip().startswith("ACL SETUSER")]
    return line


# The documented ACL user's rights are a subset of the default user's: a test that passes
# as that user passes as the default one. The long tests of the shared room (real time:
# leases, refills, failovers) run as that user only; the quick ones keep both, so the
# default user's connection (no AUTH, no key pattern) is still exercised everywhere.
acl_user_only = pytest.mark.parametrize("redis", ["documented ACL user"], indirect=True)


@pytest.fixture(name="redis", params=["default user", "documented ACL user"])
def redis_shared_fixture(request: pytest.FixtureRequest, tmp_path: Path
                         ) -> Iterator[RedisServer]:
    """The shared-lane tests' server, twice: relay as the default user, and as a user
    with exactly the rights docs/operators.md documents (SPEC O6)."""
    server = RedisServer(require_redis(), tmp_path / "redis")
    if request.param == "documented ACL user":
        server.use_acl_user(documented_acl())
    server.start()
    try:
        yield server
    finally:
        server.stop()
