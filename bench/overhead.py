"""How much relay costs: relay vs a direct call to the same fake upstream, in one run.

    python -m bench.overhead [--quick] [--queued N] [--json FILE] [--profile] [--pin]
    python -m bench.overhead --clients [--quick] [--rounds N] [--json FILE]

Three processes, so the load client is never what is measured:

- the fake OpenAI-compatible upstream (``tests/fakes/upstream.py``), in a subprocess of its
  own (``--serve-upstream PORTFILE``), with a small line-JSON control port that tells the
  bench when a tagged request arrived and when its connection closed;
- the relay daemon, exactly as users start it: ``python -m relay serve --config FILE
  --port 0`` (its start-up time and memory are section 5);
- the load client: this process, raw trio sockets speaking minimal HTTP/1.1 with
  keep-alive (hand-written request bytes; Content-Length and chunked bodies), which is
  far cheaper per request than httpx. The direct figures show its ceiling.

Sections: 1. added latency at concurrency 1, in each front (chat completions, Messages,
Responses); 2. throughput at concurrency 32, beside the raw-ASGI ceiling (bench/ceiling.py);
3. SSE chunks/s at concurrency 32; 4. stop → upstream-closed latency (mid-stream,
non-stream on a slow upstream, and queued in a 1-lane provider); 5. start-up time and RSS;
6. streamed requests queued on one lane, each getting its waiting notices (bench/queued.py):
RSS, and the grant of the next waiter with 100 and with 10,000 queued (``--queued N``;
``--quick``: 2,000), beside the stack's own memory for as many streams (hypercorn and a
raw ASGI app sending the same notices: bench/ceiling.py's ``/stream``); 7. a shared-lane
slot over a local one (bench/shared.py's parts 1-2, on a redis-server it starts itself;
"NOT MEASURED" without one). Every figure is printed with its target (issue 16), beside
the direct call measured in the same run. The bench raises its own open-file limit.
``--profile`` then runs a second daemon under cProfile (``--serve-relay-profiled``;
profiling on only during the load window, toggled by SIGUSR1/SIGUSR2) for the c=32
non-stream and SSE loads, and prints the top functions.

Reading the numbers. Each load section prints every process's CPU use and what other
programs used meanwhile ("others"): the server at ~100% means it was the bottleneck,
and a high "others" means the rates are low because the machine was shared. The
"server CPU per request" rows (and "at 100% of one core", their inverse) move much less
with noise than the rates do. Sections 1-3 run in interleaved rounds (direct, relay,
direct, ...) so a burst of noise hits both sides.

Placement. By default the scheduler places the processes. ``--pin`` puts relay alone on
CPU 0 and the client on CPU 1 (the upstream on CPU 0 for direct runs, CPU 1 for relay
runs); on a small VM that is often slower, because every request then wakes a process
on the other CPU (a loopback ping-pong measured 66 µs across CPUs vs 16 µs on one).

``--clients`` measures only what clients and their usage add (issue 35): the added p50
at concurrency 1 of three daemons in the same run, in interleaved rounds against the
same upstream — "plain" (this bench's config: records, and so the usage database, on;
no ``[clients]``), "clients" (the same with two ``[clients]`` tokens, the request sent
with one, a price for the model and every limit on: the token check, the cost, the
dollar reservation, the per-minute gate), and "no usage" (plain with the usage
database's task off); on all three the upstream has a key, as a real provider does —
and the median over rounds of each round's difference (target: clients - plain within
0.05 ms), with each daemon's CPU time per request (less noisy than a latency).

Times across processes are ``time.perf_counter()`` (CLOCK_MONOTONIC, the same clock in
every process); the upstream converts its trio timestamps to it. Every subprocess is
killed in a ``finally``; the upstream also exits when the bench's pipe to it closes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

RELAY_CPU, CLIENT_CPU = 0, 1
CONTENT = b'"content":"tok'  # one content chunk of the bench's answers, as relay and the
#                              upstream both write it (the upstream's role chunk has "")
SSE_CHUNKS = 200
LISTENING = re.compile(r"relay listening on (http://\S+)")

TARGETS = {  # issue 16
    "added_p50_ms": 1.0,  # at most, in every front
    "added_p99_ms": 2.5,  # at most, in every front
    "fronts_spread": 0.15,  # the fronts' added p50s within 15 % of each other
    "rps_c32": 700.0,  # at least
    "chunks_per_s": 30_000.0,  # at least
    "stop_p99_ms": 5.0,  # at most: stop -> upstream connection closed (stream and plain)
    "start_to_answer_s": 0.5,  # under
    "rss_mib": 50.0,  # under
    "queued_rss_mib": 300.0,  # under, with QUEUED_MANY streams queued on one lane
    "grant_growth": 3.0,  # granting the next waiter: QUEUED_MANY / QUEUED_FEW at most this
    "shared_slot_ms": 1.0,  # at most: a shared-lane slot's p50 over a local one's
}
QUEUED_FEW, QUEUED_MANY = 100, 10_000

# The three fronts, each to the same OpenAI-compatible upstream through the openai
# adapter: front → (path, body for a model, the bytes that end a complete stream).
FRONTS: dict[str, tuple[str, Any, bytes]] = {
    "chat": ("/v1/chat/completions", lambda model, stream: {
        "model": model, "stream": stream,
        "messages": [{"role": "user", "content": "hello"}]}, b"data: [DONE]\n\n"),
    "messages": ("/v1/messages", lambda model, stream: {
        "model": model, "stream": stream, "max_tokens": 1000,
        "messages": [{"role": "user", "content": "hello"}]}, b"message_stop"),
    "responses": ("/v1/responses", lambda model, stream: {
        "model": model, "stream": stream, "input": "hello", "store": False},
        b"response.completed"),
}


@dataclass(frozen=True)
class Sizes:
    """How much work each section does (``--quick`` is a smoke run). Sections 1-3 run in
    ``rounds``, direct and relay interleaved, so a burst of other work on the machine
    hits both sides; the load sections report the median round."""

    rounds: int = 3
    latency_warmup: int = 50
    latency_requests: int = 300  # in all, over the rounds
    load_warmup_s: float = 0.5
    load_s: float = 2.0  # per round
    stop_tries: int = 20
    profile_s: float = 4.0
    grant_tries: int = 3  # of QUEUED_FEW waiters (the many: once)
    queued_many: int = QUEUED_MANY  # section 6's many waiters (the targets are for 10,000)
    slot_rounds: int = 2000  # section 7's acquire+release rounds (a quarter as hand-offs)


QUICK = Sizes(rounds=1, latency_warmup=10, latency_requests=60, load_s=1.5, stop_tries=3,
              profile_s=1.5, grant_tries=1, queued_many=2_000, slot_rounds=400)


# --- a light HTTP/1.1 client --------------------------------------------------------------

class HTTPConnection:
    """One keep-alive HTTP/1.1 connection: send raw request bytes, read one response."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = bytearray()

    @classmethod
    async def open(cls, host: str, port: int) -> HTTPConnection:
        return cls(await trio.open_tcp_stream(host, port))  # TCP_NODELAY is trio's default

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError("the server closed the connection")
        self._buf += data

    async def send(self, raw: bytes) -> None:
        await self.stream.send_all(raw)

    async def read_line(self) -> bytes:
        while (eol := self._buf.find(b"\n")) < 0:
            await self._fill()
        line = bytes(self._buf[:eol])
        del self._buf[:eol + 1]
        return line

    async def read_head(self) -> tuple[int, dict[bytes, bytes]]:
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            await self._fill()
        lines = bytes(self._buf[:end]).split(b"\r\n")
        del self._buf[:end + 4]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return int(lines[0].split(b" ", 2)[1]), headers

    async def read_body(self, headers: dict[bytes, bytes],
                        on_data: Callable[[bytes], bool] | None = None) -> bytes:
        """The body, by Content-Length or chunked. ``on_data(piece)`` sees each decoded
        chunk; when it returns True the read stops there (then close the connection)."""
        length = headers.get(b"content-length")
        if length is not None:
            n = int(length)
            while len(self._buf) < n:
                await self._fill()
            body = bytes(self._buf[:n])
            del self._buf[:n]
            if on_data is not None:
                on_data(body)
            return body
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            raise ValueError(f"a response with neither length nor chunks: {headers}")
        parts: list[bytes] = []
        while True:
            while (eol := self._buf.find(b"\r\n")) < 0:
                await self._fill()
            size = int(bytes(self._buf[:eol]).split(b";")[0], 16)
            need = eol + 2 + size + 2  # size line, data, CRLF (for the last chunk: no trailers)
            while len(self._buf) < need:
                await self._fill()
            piece = bytes(self._buf[eol + 2:eol + 2 + size])
            del self._buf[:need]
            if size == 0:
                return b"".join(parts)
            parts.append(piece)
            if on_data is not None and on_data(piece):
                return b"".join(parts)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        await self.send(raw)
        status, headers = await self.read_head()
        body = await self.read_body(headers)
        if headers.get(b"connection", b"").lower() == b"close":
            # The server ends this connection (hypercorn's: after 1,000 requests on it):
            # the next request goes on a new one, as a keep-alive client's does.
            host, port = self.stream.socket.getpeername()[:2]
            await self.stream.aclose()
            self.stream, self._buf = await trio.open_tcp_stream(host, port), bytearray()
        return status, body


def http_request(method: str, hostport: str, path: str, body: bytes = b"",
                 token: str | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {hostport}\r\n"
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


@dataclass(frozen=True)
class Target:
    """Where the load goes: the upstream itself, or relay in front of it."""

    label: str
    host: str
    port: int
    prefix: str  # model prefix: "" direct, "up/" through relay
    as_relay_sends: bool  # direct streams ask for usage, as relay's adapter does upstream
    token: str | None = None  # a client's, sent as Authorization: Bearer

    @property
    def hostport(self) -> str:
        return f"{self.host}:{self.port}"

    async def connect(self) -> HTTPConnection:
        return await HTTPConnection.open(self.host, self.port)

    def front(self, front: str, model: str) -> bytes:
        """A plain request to one of the `FRONTS`."""
        path, body, _ = FRONTS[front]
        return http_request("POST", self.hostport, path, json.dumps(
            body(self.prefix + model, False), separators=(",", ":")).encode(), self.token)

    def chat(self, model: str, *, stream: bool = False, tag: str | None = None) -> bytes:
        body: dict[str, Any] = {"model": self.prefix + model, "stream": stream,
                                "messages": [{"role": "user", "content": "hello"}]}
        if tag is not None:
            body["user"] = tag  # passes through relay; the upstream finds requests by it
        if stream and self.as_relay_sends:
            body["stream_options"] = {"include_usage": True}
        return http_request("POST", self.hostport, "/v1/chat/completions",
                            json.dumps(body, separators=(",", ":")).encode(), self.token)


# --- the fake upstream, in its own process -----------------------------------------------

def _scripts(script_class: Any) -> dict[str, Any]:
    return {
        "fast": script_class(),  # "Hello world", at once
        "sse200": script_class(chunks=["tok "] * SSE_CHUNKS),
        "drip": script_class(chunks=["tok "] * 4000, chunk_delay_s=0.005),  # a 20 s stream
        "slow": script_class(hang=True),  # never answers
    }


async def serve_upstream(portfile: str) -> None:
    """Run the fake upstream and its control port until killed; announce both ports."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fakes import upstream as fake  # type: ignore[import-not-found]  # tests/fakes

    async with trio.open_nursery() as nursery:
        scripts = _scripts(fake.Script)
        up = await nursery.start(partial(fake.serve_fake_upstream, models=list(scripts)))
        up.scripts.update(scripts)
        state = {"trimmed": 0}
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(trio.serve_listeners, partial(_control, up, state), listeners)
        nursery.start_soon(_trim_requests, up, state)
        nursery.start_soon(_exit_with_parent, nursery)
        _write_json_atomically(portfile, {
            "port": up.port, "control_port": listeners[0].socket.getsockname()[1]})


async def _exit_with_parent(nursery: trio.Nursery) -> None:
    # stdin is a pipe from the bench: at EOF the bench is gone (even by SIGKILL): stop.
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
        while await stdin.receive_some():
            pass
    nursery.cancel_scope.cancel()


async def _trim_requests(up: Any, state: dict[str, int]) -> None:
    # The fake keeps every request; under load that is tens of thousands. Keep the recent.
    while True:
        await trio.sleep(0.5)
        if len(up.requests) > 5000:
            state["trimmed"] += len(up.requests) - 1000
            del up.requests[:-1000]


async def _control(up: Any, state: dict[str, int], stream: trio.SocketStream) -> None:
    """One JSON object per line in, one per line out (see `_control_answer`)."""
    buf = bytearray()
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while True:
            while (eol := buf.find(b"\n")) < 0:
                data = await stream.receive_some(4096)
                if not data:
                    return
                buf += data
            question = json.loads(bytes(buf[:eol]))
            del buf[:eol + 1]
            answer = await _control_answer(up, state, question)
            await stream.send_all(json.dumps(answer).encode() + b"\n")


async def _control_answer(up: Any, state: dict[str, int], q: dict[str, Any]) -> Any:
    """``seen``, ``stats``, ``wait_received`` and ``wait_closed`` (times: perf_counter)."""
    tag = q.get("tag")

    def find() -> Any:
        for r in reversed(up.requests):
            if isinstance(r.json, dict) and r.json.get("user") == tag:
                return r
        return None

    def closed() -> bool:
        r = find()
        return r is not None and up.connections[r.conn_id].closed_at is not None

    def pc(t: float | None) -> float | None:  # trio's clock is perf_counter + an offset
        return None if t is None else t + (time.perf_counter() - trio.current_time())

    if q["op"] == "seen":
        return {"seen": find() is not None}
    if q["op"] == "stats":
        return {"requests": state["trimmed"] + len(up.requests),
                "connections": len(up.connections), "open": up.open_connections}
    with trio.move_on_after(q.get("timeout", 5.0)):
        if q["op"] == "wait_received":
            await up.wait_until(lambda: find() is not None)
            return {"received_at": pc(find().received_at)}
        if q["op"] == "wait_closed":
            await up.wait_until(closed)
            conn = up.connections[find().conn_id]
            return {"closed_at": pc(conn.closed_at), "closed_by": conn.closed_by}
        return {"error": f"unknown op {q['op']!r}"}
    return {"timeout": True}


class Control:
    """The bench's side of the upstream's control port."""

    def __init__(self, conn: HTTPConnection) -> None:
        self.conn = conn

    async def call(self, op: str, **kw: Any) -> Any:
        await self.conn.send(json.dumps({"op": op, **kw}).encode() + b"\n")
        answer = json.loads(await self.conn.read_line())
        if "timeout" in answer or "error" in answer:
            raise RuntimeError(f"upstream control {op} {kw}: {answer}")
        return answer


# --- processes: start, pin, measure, stop ------------------------------------------------

def _write_json_atomically(path: str, obj: Any) -> None:
    with open(f"{path}.tmp", "w") as f:
        json.dump(obj, f)
    os.replace(f"{path}.tmp", path)


async def spawn(cmd: list[str], *, cwd: Path, stdin: int = subprocess.DEVNULL
                ) -> trio.Process:
    # (Not PR_SET_PDEATHSIG: trio forks from a worker thread, and the signal would come
    # when that thread idles out, not when the bench dies.)
    return await trio.lowlevel.open_process(cmd, cwd=cwd, stdin=stdin,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


def pin(pid: int, cpu: int | None) -> None:
    """Run process ``pid`` on ``cpu`` only; None: on every CPU (the scheduler decides)."""
    if can_pin():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(pid, {cpu} if cpu is not None else os.sched_getaffinity(1))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (utime and stime of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def busy_cpu_seconds() -> float:
    """CPU time the whole machine spent busy (every CPU; /proc/stat minus idle, iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class CPUWindow:
    """CPU use of some processes over a window, as % of one core; ``others`` is what the
    rest of the machine used meanwhile (other programs: noise in the figures)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self._t = 0.0

    def _sample(self) -> dict[str, float]:
        return {"machine": busy_cpu_seconds(),
                **{name: cpu_seconds(pid) for name, pid in self.pids.items()}}

    def start(self) -> None:
        self._t = time.perf_counter()
        self._start = self._sample()

    def add(self, name: str, pid: int) -> None:
        """Count a process started after the window began (from now on)."""
        self.pids[name] = pid
        self._start[name] = cpu_seconds(pid)

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self._t
        used = {name: value - self._start[name] for name, value in self._sample().items()}
        used["others"] = used.pop("machine") - sum(used.values())
        return {name: max(0, round(100 * value / wall)) for name, value in used.items()}


@dataclass
class Child:
    """A subprocess of the bench, with the tail of its stderr."""

    name: str
    proc: trio.Process
    log: deque[str] = field(default_factory=lambda: deque(maxlen=30))
    url: str | None = None
    spawned_at: float = 0.0
    listening_at: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def failure(self, what: str) -> RuntimeError:
        tail = "\n    ".join(self.log) or "(no output)"
        return RuntimeError(f"{self.name} {what} (exit code {self.proc.poll()}); its last "
                            f"output:\n    {tail}")

    async def stop(self, sig: int = signal.SIGKILL, wait_s: float = 5.0) -> None:
        with trio.CancelScope(shield=True):
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            with trio.move_on_after(wait_s):
                await self.proc.wait()
            if self.proc.poll() is None:
                self.proc.kill()
                await self.proc.wait()


async def start_upstream(nursery: trio.Nursery, tmp: Path) -> tuple[Child, int, int]:
    portfile = trio.Path(tmp / "upstream.json")
    proc = await spawn([PY, "-m", "bench.overhead", "--serve-upstream", str(portfile)],
                       cwd=ROOT, stdin=subprocess.PIPE)  # its EOF: the bench is gone
    child = Child("the fake upstream", proc)
    nursery.start_soon(_read_stderr, child, None)
    for _ in range(1000):
        if await portfile.exists():
            ports = json.loads(await portfile.read_text())
            return child, ports["port"], ports["control_port"]
        if proc.poll() is not None:
            break
        await trio.sleep(0.01)
    await child.stop()
    raise child.failure("did not start")


async def start_relay(nursery: trio.Nursery, cmd: list[str], name: str,
                      cpu: int | None) -> Child:
    """Spawn a relay daemon (on ``cpu``); return once it said it listens."""
    announced = trio.Event()
    spawned_at = time.perf_counter()
    proc = await spawn(cmd, cwd=ROOT)
    pin(proc.pid, cpu)
    child = Child(name, proc, spawned_at=spawned_at)
    nursery.start_soon(_read_stderr, child, announced)
    with trio.move_on_after(20):
        await announced.wait()
    if child.url is None:
        await child.stop()
        raise child.failure("did not say it listens")
    return child


async def _read_stderr(child: Child, announced: trio.Event | None) -> None:
    """Keep the child's stderr drained; note the "relay listening on URL" line."""
    assert child.proc.stderr is not None
    pending = b""
    try:
        async for data in child.proc.stderr:
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                child.log.append(text)
                match = LISTENING.search(text)
                if match and child.url is None:
                    child.listening_at = time.perf_counter()
                    child.url = match.group(1)
                    if announced is not None:
                        announced.set()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    if announced is not None:
        announced.set()  # it exited: stop waiting


async def start_ceiling(nursery: trio.Nursery, tmp: Path) -> tuple[Child, Target]:
    """hypercorn serving a raw ASGI JSON answer (bench/ceiling.py), in its own process."""
    portfile = trio.Path(tmp / "ceiling.json")
    await portfile.unlink(missing_ok=True)  # (one left by an earlier ceiling: not this one's)
    proc = await spawn([PY, "-m", "bench.ceiling", str(portfile)], cwd=ROOT,
                       stdin=subprocess.PIPE)
    child = Child("the raw-ASGI ceiling", proc)
    nursery.start_soon(_read_stderr, child, None)
    for _ in range(1000):
        if await portfile.exists():
            port = json.loads(await portfile.read_text())["port"]
            return child, Target("ceiling", "127.0.0.1", port, "up/", as_relay_sends=False)
        if proc.poll() is not None:
            break
        await trio.sleep(0.01)
    await child.stop()
    raise child.failure("did not start")


async def measure_floor(nursery: trio.Nursery, tmp: Path, count: int) -> dict[str, Any]:
    """The stack's own memory for ``count`` queued streams: hypercorn and a raw ASGI app
    (bench/ceiling.py's ``/stream``) holding each open with a waiting notice every 2 s, as
    relay's queued requests get. RSS idle and with all of them open."""
    from bench.queued import OPEN_WINDOW, _until

    child, target = await start_ceiling(nursery, tmp)
    streams: list[trio.SocketStream] = []
    try:
        idle = rss_mib(child.pid)
        window = trio.Semaphore(OPEN_WINDOW)  # (as bench.queued: the listen queue holds)
        raw = http_request("POST", target.hostport, "/stream", b"{}")

        async def first_notice(stream: trio.SocketStream) -> None:
            try:
                await _until(stream, b": waiting", 30.0)
            finally:
                window.release()

        async with trio.open_nursery() as openers:
            for _ in range(count):
                await window.acquire()
                streams.append(await trio.open_tcp_stream(target.host, target.port))
                await streams[-1].send_all(raw)
                openers.start_soon(first_notice, streams[-1])
        held = rss_mib(child.pid)
    finally:
        for stream in streams:
            await stream.aclose()
        await child.stop()
    return {"count": count, "rss_idle": idle, "rss_held": held}


async def measure_queued(nursery: trio.Nursery, tmp: Path, sizes: Sizes) -> dict[str, Any]:
    """bench/queued.py's measure, for few and many waiters on one lane: RSS, and how long
    the first waiter takes to get its answer once the lane is freed (the grant)."""
    from bench.queued import queue_up, start_queue_relay

    relay = await start_queue_relay(nursery, tmp, sizes.queued_many + 8)
    try:
        idle = rss_mib(relay.pid)
        few = [await queue_up(relay, QUEUED_FEW, nursery) for _ in range(sizes.grant_tries)]
        many = await queue_up(relay, sizes.queued_many, nursery)
        after = rss_mib(relay.pid)
    finally:
        await relay.stop()
    few_ms = sorted(f["grant_ms"] for f in few)
    return {"rss_idle": idle, "few": few, "many": many, "rss_after": after,
            "grant_few_ms": few_ms[len(few_ms) // 2], "grant_many_ms": many["grant_ms"]}


async def measure_shared_slot(tmp: Path, sizes: Sizes) -> dict[str, Any] | None:
    """bench/shared.py's parts 1 and 2 (an uncontended slot, local and shared, and the
    hand-off between two relays) on a redis-server of its own; None without one."""
    from bench.shared import REDIS, RedisServer, measure_slots, wait_until_granting

    if REDIS is None:
        return None
    server = RedisServer(REDIS, tmp / "redis")
    await trio.to_thread.run_sync(server.start)
    try:
        await trio.to_thread.run_sync(wait_until_granting, server)
        times = await measure_slots(server.url, sizes.slot_rounds)
    finally:
        await trio.to_thread.run_sync(server.stop)
    return {kind: {"n": len(v), "p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99)}
            for kind, v in times.items()}


def relay_target(child: Child) -> Target:
    assert child.url is not None
    host, _, port = child.url.removeprefix("http://").rpartition(":")
    return Target("relay", host, int(port), "up/", as_relay_sends=False)


def write_config(tmp: Path, upstream_port: int) -> Path:
    base_url = f"http://127.0.0.1:{upstream_port}/v1"
    providers = ""
    for name, lanes, queue_max in (("up", 64, 256), ("one", 1, 16)):
        providers += f"""
[providers.{name}]
adapter = "openai"
base_url = "{base_url}"
models = ["fast", "sse200", "drip", "slow"]
[providers.{name}.profile]
lanes = {lanes}
queue_max = {queue_max}
queue_timeout_s = 30
run_timeout_s = 60
"""
    path = tmp / "relay.toml"
    path.write_text(f"""\
[server]
records = {json.dumps(str(tmp / "records.jsonl"))}
drain_grace_s = 1

[providers.fake]
adapter = "fake"
models = ["echo"]
{providers}""")
    return path


# --- measurements -------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile, in ms."""
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def measure_latency(target: Target, warmup: int, requests: int,
                          front: str = "chat") -> list[float]:
    """Sequential non-stream requests on one keep-alive connection (seconds each)."""
    conn = await target.connect()
    raw = target.front(front, "fast")
    times = []
    try:
        for i in range(warmup + requests):
            t = time.perf_counter()
            status, body = await conn.request(raw)
            elapsed = time.perf_counter() - t
            if status != 200:
                raise RuntimeError(f"{target.label} answered {status}: {body[:300]!r}")
            if i >= warmup:
                times.append(elapsed)
    finally:
        await conn.aclose()
    return times


@dataclass
class Load:
    """Counters of one load run; only what happens inside the window counts."""

    t0: float
    t1: float
    completed: int = 0
    chunks: int = 0
    errors: int = 0
    first_error: str | None = None
    latencies: list[float] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or what


async def run_load(target: Target, *, stream: bool, concurrency: int, warmup_s: float,
                   duration_s: float, cpu: CPUWindow, control: Control | None = None,
                   on_window: Callable[[bool], object] | None = None) -> dict[str, Any]:
    """``concurrency`` connections sending back to back for warm-up + window.

    Inside the window: completed requests (and, streamed, content chunks received), CPU
    use of every process, and the upstream connections opened (with ``control``).
    ``on_window(True/False)`` is called as the window opens and closes.
    """
    start = time.perf_counter()
    load = Load(t0=start + warmup_s, t1=start + warmup_s + duration_s)
    raw = target.chat("sse200" if stream else "fast", stream=stream)

    async def one(conn: HTTPConnection) -> None:
        await conn.send(raw)
        status, headers = await conn.read_head()
        got = 0
        last = b""

        def on_data(piece: bytes) -> bool:
            nonlocal got, last
            n = piece.count(CONTENT)
            got += n
            last = piece
            if load.t0 <= time.perf_counter() <= load.t1:
                load.chunks += n
            return False

        body = await conn.read_body(headers, on_data if stream else None)
        if status != 200:
            load.error(f"{status}: {body[:300]!r}")
        elif stream and (got != SSE_CHUNKS or not last.endswith(b"data: [DONE]\n\n")):
            load.error(f"a stream with {got} of {SSE_CHUNKS} chunks, ending {last[-80:]!r}")

    async def worker() -> None:
        conn = None
        while (t := time.perf_counter()) < load.t1:
            try:
                conn = conn or await target.connect()
                await one(conn)
            except (OSError, EOFError, ValueError, trio.BrokenResourceError) as exc:
                load.error(repr(exc))
                if conn is not None:
                    await conn.aclose()
                conn = None
                continue
            done = time.perf_counter()
            if load.t0 <= done <= load.t1:
                load.completed += 1
                load.latencies.append(done - t)
        if conn is not None:
            await conn.aclose()

    async def upstream_connections() -> int:
        return (await control.call("stats"))["connections"] if control else 0

    async def window() -> None:
        await trio.sleep(load.t0 - time.perf_counter())
        opened = await upstream_connections()
        cpu.start()
        if on_window is not None:
            on_window(True)
        await trio.sleep(load.t1 - time.perf_counter())
        if on_window is not None:
            on_window(False)
        out["cpu_pct"] = cpu.stop()
        out["upstream_connections"] = await upstream_connections() - opened

    out: dict[str, Any] = {"window_s": duration_s}
    with trio.fail_after(warmup_s + duration_s + 30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(window)
            for _ in range(concurrency):
                nursery.start_soon(worker)
    out.update({
        "completed": load.completed, "req_per_s": load.completed / duration_s,
        "errors": load.errors, "first_error": load.first_error,
        "p50_ms": pct(load.latencies, 0.5) if load.latencies else None,
        "p99_ms": pct(load.latencies, 0.99) if load.latencies else None})
    units = load.completed
    if stream:
        out["chunks_per_s"] = load.chunks / duration_s
        units = load.chunks
    # CPU the serving process spent per request (per chunk, streamed): unlike the rates,
    # this hardly moves when other programs take CPU, and 1 / it is one core's capacity.
    server = next(p for p in ("relay", "ceiling", "upstream") if p in out["cpu_pct"])
    busy_s = out["cpu_pct"][server] / 100 * duration_s
    out["server_cpu_us_per_unit"] = 1e6 * busy_s / units if units else None
    return out


def median_round(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round with the median rate, with every round's rate beside it."""
    ordered = sorted(rounds, key=lambda r: r[key])
    return {**ordered[len(ordered) // 2], "rounds": [r[key] for r in rounds],
            "errors": sum(r["errors"] for r in rounds),
            "first_error": next((r["first_error"] for r in rounds if r["first_error"]), None)}


async def stop_mid_stream(target: Target, control: Control, tag: str) -> float:
    """(a) close after 5 chunks of a flowing stream; → the upstream sees its conn close."""
    conn = await target.connect()
    await conn.send(target.chat("drip", stream=True, tag=tag))
    _, headers = await conn.read_head()
    seen = 0

    def enough(piece: bytes) -> bool:
        nonlocal seen
        seen += piece.count(CONTENT)
        return seen >= 5

    await conn.read_body(headers, enough)
    closed_at = time.perf_counter()
    await conn.aclose()
    return float((await control.call("wait_closed", tag=tag))["closed_at"]) - closed_at


async def stop_waiting(target: Target, control: Control, tag: str) -> float:
    """(b) close a non-stream request the upstream holds without answering."""
    conn = await target.connect()
    await conn.send(target.chat("slow", tag=tag))
    await control.call("wait_received", tag=tag)
    closed_at = time.perf_counter()
    await conn.aclose()
    return float((await control.call("wait_closed", tag=tag))["closed_at"]) - closed_at


async def lane_queued(poller: HTTPConnection, target: Target, provider: str) -> int:
    status, body = await poller.request(http_request("GET", target.hostport,
                                                     "/relay/v1/status"))
    if status != 200:
        raise RuntimeError(f"status answered {status}: {body[:200]!r}")
    return int(json.loads(body)["providers"][provider]["lanes"]["queued"])


async def stop_queued(target: Target, control: Control, tag: str) -> dict[str, Any]:
    """(c) provider ``one`` (1 lane) is held by a request the upstream never answers; a
    streamed request queues behind it (its first bytes are relay's "waiting" notice), and
    its client closes. Measured: close → the lane's ``queued`` back to 0, by polling
    relay's status route back to back (so the figure is an upper bound)."""
    hold_tag, queued_tag = f"{tag}-hold", f"{tag}-queued"
    holder, queued, poller = (await target.connect(), await target.connect(),
                              await target.connect())
    try:
        await holder.send(http_request("POST", target.hostport, "/v1/chat/completions",
                                       _chat_body("one/slow", hold_tag)))
        await control.call("wait_received", tag=hold_tag)  # it holds the lane now
        await queued.send(http_request("POST", target.hostport, "/v1/chat/completions",
                                       _chat_body("one/fast", queued_tag, stream=True)))
        status, headers = await queued.read_head()
        await queued.read_body(headers, lambda piece: b": waiting" in piece)
        if status != 200 or await lane_queued(poller, target, "one") != 1:
            raise RuntimeError("the second request to provider 'one' did not queue")
        closed_at = time.perf_counter()
        await queued.aclose()
        polls = []
        for _ in range(2000):
            sent = time.perf_counter()
            n = await lane_queued(poller, target, "one")
            answered = time.perf_counter()
            polls.append(answered - sent)
            if n == 0:
                break
        else:
            raise RuntimeError("the queued request was never taken off the queue")
        reached = (await control.call("seen", tag=queued_tag))["seen"]
    finally:
        for conn in (holder, queued, poller):
            await conn.aclose()
    await control.call("wait_closed", tag=hold_tag)  # the holder is gone: the lane is free
    return {"s": answered - closed_at, "poll_s": sum(polls) / len(polls),
            "reached_upstream": reached,
            "request_id": headers.get(b"x-relay-request-id", b"").decode()}


def _chat_body(model: str, tag: str, *, stream: bool = False) -> bytes:
    return json.dumps({"model": model, "stream": stream, "user": tag,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()


def median_max_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {"median_ms": 1000 * median, "max_ms": 1000 * ordered[-1], "tries": len(values),
            "p99_ms": pct(values, 0.99)}


def read_records(tmp: Path) -> dict[str, dict[str, Any]]:
    records = {}
    for path in sorted(tmp.glob("records.jsonl*")):
        for line in path.read_text().splitlines():
            if line:
                record = json.loads(line)
                records[record["id"]] = record
    return records


async def first_answer(child: Child) -> float:
    """Send one chat to fake/echo; the time since spawn when it is answered."""
    target = relay_target(child)
    conn = await target.connect()
    try:
        raw = http_request("POST", target.hostport, "/v1/chat/completions", json.dumps(
            {"model": "fake/echo", "messages": [{"role": "user", "content": "hi"}]}).encode())
        status, body = await conn.request(raw)
    finally:
        await conn.aclose()
    if status != 200:
        raise RuntimeError(f"the first chat answered {status}: {body[:300]!r}")
    return time.perf_counter() - child.spawned_at


# --- the run -------------------------------------------------------------------------------

def note(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def run_bench(sizes: Sizes, pinned: bool, profile: bool, tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"sizes": asdict(sizes), "pinned": pinned}
    # Where each process runs, by phase (with --pin; otherwise the scheduler decides).
    relay_cpu = RELAY_CPU if pinned else None
    upstream_cpu = ({"direct": RELAY_CPU, "relay": CLIENT_CPU} if pinned
                    else {"direct": None, "relay": None})
    pin(os.getpid(), CLIENT_CPU if pinned else None)
    children: list[Child] = []
    async with trio.open_nursery() as nursery:
        try:
            upstream, up_port, control_port = await start_upstream(nursery, tmp)
            children.append(upstream)
            control = Control(await HTTPConnection.open("127.0.0.1", control_port))
            config = write_config(tmp, up_port)

            note("5. starting the relay daemon (start-up time)")
            relay = await start_relay(nursery, [PY, "-m", "relay", "serve", "--config",
                                                str(config), "--port", "0"], "relay serve",
                                      relay_cpu)
            children.append(relay)
            answer_s = await first_answer(relay)
            assert relay.listening_at is not None
            await trio.sleep(0.5)
            results["startup"] = {"listening_s": relay.listening_at - relay.spawned_at,
                                  "first_answer_s": answer_s, "rss_idle": rss_mib(relay.pid)}

            direct = Target("direct", "127.0.0.1", up_port, "", as_relay_sends=True)
            through = relay_target(relay)
            targets = (direct, through)
            cpu = {"direct": CPUWindow({"upstream": upstream.pid, "client": os.getpid()}),
                   "relay": CPUWindow({"relay": relay.pid, "upstream": upstream.pid,
                                       "client": os.getpid()})}
            whole_run = CPUWindow({"relay": relay.pid, "upstream": upstream.pid,
                                   "client": os.getpid()})
            whole_run.start()

            note("1. latency at concurrency 1 (direct, then relay's three fronts)")
            runs = [("direct", direct, "chat")] + [(front, through, front) for front in FRONTS]
            times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
            per_round = math.ceil(sizes.latency_requests / sizes.rounds)
            # Every side warmed before any is measured: the first front measured would
            # otherwise also pay for warming what all of them share (the adapter, the
            # pool, the writer: ~0.3 ms of added p50 in a quick run, always chat's).
            for _, target, front in runs:
                pin(upstream.pid, upstream_cpu[target.label])
                await measure_latency(target, sizes.latency_warmup, 0, front)
            for _ in range(sizes.rounds):  # interleaved, so noise hits every side alike
                for label, target, front in runs:
                    pin(upstream.pid, upstream_cpu[target.label])
                    times[label] += await measure_latency(target, 10, per_round, front)
            results["latency"] = {label: {"requests": len(t), "p50_ms": pct(t, 0.5),
                                          "p99_ms": pct(t, 0.99)}
                                  for label, t in times.items()}
            results["latency"]["relay"] = results["latency"]["chat"]

            ceiling_child, ceiling = await start_ceiling(nursery, tmp)
            children.append(ceiling_child)
            whole_run.add("ceiling", ceiling_child.pid)  # the bench's own: not "others"
            pin(ceiling_child.pid, relay_cpu)
            cpu["ceiling"] = CPUWindow({"ceiling": ceiling_child.pid, "client": os.getpid()})
            for key, stream, what in (("throughput", False, "2. throughput at c=32"),
                                      ("sse", True, "3. SSE chunks/s at c=32")):
                note(what)
                rounds: dict[str, list[dict[str, Any]]] = {"direct": [], "relay": []}
                loaded = targets if stream else (*targets, ceiling)
                if not stream:
                    rounds["ceiling"] = []
                for _ in range(sizes.rounds):
                    for target in loaded:
                        pin(upstream.pid, upstream_cpu.get(target.label))
                        rounds[target.label].append(await run_load(
                            target, stream=stream, concurrency=32,
                            warmup_s=sizes.load_warmup_s, duration_s=sizes.load_s,
                            cpu=cpu[target.label], control=control))
                rate = "chunks_per_s" if stream else "req_per_s"
                results[key] = {label: median_round(r, rate) for label, r in rounds.items()}

            note("4. stop → upstream closed")
            pin(upstream.pid, upstream_cpu["relay"])
            results["stops"] = await measure_stops(targets, control, sizes, tmp)
            results["startup"]["rss_after_load"] = rss_mib(relay.pid)
            results["others_cpu_pct"] = whole_run.stop()["others"]
            await relay.stop()
            await ceiling_child.stop()

            note(f"6. {QUEUED_FEW} then {sizes.queued_many:,} streams queued on one lane")
            results["queued"] = await measure_queued(nursery, tmp, sizes)
            results["queued"]["floor"] = await measure_floor(nursery, tmp, sizes.queued_many)

            note("7. a shared-lane slot over a local one (a redis-server of its own)")
            results["shared_slot"] = await measure_shared_slot(tmp, sizes)

            if profile:
                note("profiling relay under cProfile (c=32 non-stream, then SSE)")
                results["profile"] = await profile_relay(nursery, config, tmp, sizes,
                                                         upstream, children, relay_cpu)
        finally:
            for child in reversed(children):
                await child.stop()
            nursery.cancel_scope.cancel()
    return results


async def measure_stops(targets: tuple[Target, Target], control: Control, sizes: Sizes,
                        tmp: Path) -> dict[str, Any]:
    stops: dict[str, Any] = {}
    nonce = os.urandom(3).hex()
    for label, measure in (("mid_stream", stop_mid_stream), ("waiting", stop_waiting)):
        for target in targets:
            values = [await measure(target, control, f"{label}-{nonce}-{target.label}-{i}")
                      for i in range(sizes.stop_tries)]
            stops.setdefault(label, {})[target.label] = median_max_ms(values)
    relay = targets[1]
    tries = [await stop_queued(relay, control, f"queued-{nonce}-{i}")
             for i in range(sizes.stop_tries)]
    await trio.sleep(0.2)  # each record is written as its request ends
    records = read_records(tmp)
    never_started = sum(
        1 for t in tries if (r := records.get(t["request_id"])) is not None
        and r["status"] == 499 and r["reason"] == "client_disconnected"
        and r["run_ms"] is None and r["queue_ms"] is not None)  # waited, never ran
    stops["queued"] = {
        "relay": median_max_ms([t["s"] for t in tries]),
        "poll_ms": 1000 * sum(t["poll_s"] for t in tries) / len(tries),
        "reached_upstream": sum(t["reached_upstream"] for t in tries),
        "records_never_started": never_started}
    return stops


# --- profiling -----------------------------------------------------------------------------

# --- --clients: what clients and their usage add ------------------------------------------

CLIENT_TOKENS = {"BENCH_AGENT_TOKEN": "bench-agent-token-0123456789abcdef",
                 "BENCH_CHAT_TOKEN": "bench-chat-token-0123456789abcdef",
                 # Every side's upstream has a key, as a real provider does: relay then
                 # redacts every record on all three (with no secret at all it skips
                 # that, and a client's token would look like the cost of clients).
                 "BENCH_UPSTREAM_KEY": "bench-upstream-key-0123456789abcdef"}
CLIENTS_TOML = """
[providers.up.prices."fast"]
input = 3.0
output = 15.0
[clients.agent]
token_env = "BENCH_AGENT_TOKEN"
models = ["up/*", "fake/*"]
lanes = 64
rpm = 10000000
tpm = 10000000000
tokens_per_day = 10000000000
usd_per_day = 1000000
usd_per_month = 10000000
[clients.chat]
token_env = "BENCH_CHAT_TOKEN"
priority = "interactive"
"""
CLIENTS_TARGET_MS = 0.05  # issue 35: clients - plain, added p50, at most


def serve_relay_without_usage(config: str) -> int:
    """``relay serve`` with the usage database's task off (the bench's "no usage" side:
    records are written, nothing reads them into the database)."""
    from relay.assembly.cli import main as relay_main
    from relay.engine import engine

    engine.UsageStore = lambda path: None  # type: ignore[assignment,misc,return-value]
    return relay_main(["serve", "--config", config, "--port", "0"])


async def run_clients_bench(rounds: int, per_round: int, tmp: Path) -> dict[str, Any]:
    """Sequential chat requests (c=1) to the upstream and to the three daemons, in
    interleaved rounds (each round's order turned by one); each side's p50 per round."""
    os.environ.update(CLIENT_TOKENS)
    sides = {"plain": "", "clients": CLIENTS_TOML, "no usage": ""}
    children: list[Child] = []
    p50s: dict[str, list[float]] = {"direct": [], **{name: [] for name in sides}}
    # Each daemon's CPU time while its own requests ran, per request (µs): moves much
    # less with the machine's noise than a latency does.
    cpu_us: dict[str, list[float]] = {name: [] for name in sides}
    pids: dict[str, int] = {}
    async with trio.open_nursery() as nursery:
        try:
            upstream, up_port, _ = await start_upstream(nursery, tmp)
            children.append(upstream)
            targets = [Target("direct", "127.0.0.1", up_port, "", as_relay_sends=True)]
            for name, extra in sides.items():
                folder = tmp / name.replace(" ", "-")
                folder.mkdir()
                config = write_config(folder, up_port)
                config.write_text(config.read_text().replace(
                    '[providers.up]\nadapter = "openai"\n', '[providers.up]\nadapter = '
                    '"openai"\napi_key_env = "BENCH_UPSTREAM_KEY"\n') + extra)
                cmd = ([PY, "-m", "bench.overhead", "--serve-relay-without-usage",
                        str(config)] if name == "no usage" else
                       [PY, "-m", "relay", "serve", "--config", str(config), "--port", "0"])
                child = await start_relay(nursery, cmd, f"relay ({name})", None)
                children.append(child)
                pids[name] = child.pid
                target = relay_target(child)
                token = CLIENT_TOKENS["BENCH_AGENT_TOKEN"] if extra else None
                targets.append(replace(target, label=name, token=token))
            note(f"clients: warming up, then {rounds} rounds of {per_round} requests a side")
            for target in targets:
                await measure_latency(target, 100, 0)
            for r in range(rounds):
                turned = targets[r % len(targets):] + targets[:r % len(targets)]
                for target in turned:
                    pid = pids.get(target.label)
                    before = cpu_seconds(pid) if pid else 0.0
                    p50s[target.label].append(pct(await measure_latency(
                        target, 10, per_round), 0.5))
                    if pid:
                        cpu_us[target.label].append(
                            (cpu_seconds(pid) - before) / (per_round + 10) * 1e6)
        finally:
            for child in children:
                await child.stop()
            nursery.cancel_scope.cancel()
    added = {name: [p - d for p, d in zip(p50s[name], p50s["direct"], strict=True)]
             for name in sides}
    diff = {"clients - plain": [c - p for c, p in zip(added["clients"], added["plain"],
                                                      strict=True)],
            "plain - no usage": [p - n for p, n in zip(added["plain"], added["no usage"],
                                                       strict=True)],
            "clients - no usage": [c - n for c, n in zip(added["clients"],
                                                         added["no usage"], strict=True)]}
    return {"rounds": rounds, "per_round": per_round, "p50_ms": p50s, "added_ms": added,
            "differences_ms": diff, "cpu_us_per_request": cpu_us}


def render_clients(results: dict[str, Any]) -> tuple[str, bool]:
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    lines = [f"What clients and their usage add (issue 35): added p50 at c=1, chat, "
             f"{results['rounds']} rounds of {results['per_round']} requests a side; the "
             f"median of the rounds (lowest … highest round)"]
    rows = [["", "added p50", "rounds"]]
    direct = results["p50_ms"]["direct"]
    rows.append(["direct p50 (the upstream)", f"{median(direct):.3f} ms",
                 f"{min(direct):.3f} … {max(direct):.3f}"])
    for name, values in results["added_ms"].items():
        rows.append([name, f"{median(values):.3f} ms", f"{min(values):.3f} … "
                     f"{max(values):.3f}"])
    for name, values in results["differences_ms"].items():
        rows.append([name, f"{median(values):+.3f} ms", f"{min(values):+.3f} … "
                     f"{max(values):+.3f}"])
    lines += _table(rows)
    # (The CPU clock ticks every 10 ms: a round's figure is ±50 µs; the whole run's,
    # each side's CPU over all its rounds' requests, is ±3 µs.)
    cpu = {name: sum(values) / len(values) for name, values in
           results["cpu_us_per_request"].items()}
    lines.append("  relay's CPU per request (all rounds): " + ", ".join(
        f"{name} {value:.0f} µs" for name, value in cpu.items())
        + f"; clients - plain {cpu['clients'] - cpu['plain']:+.0f} µs")
    moved = median(results["differences_ms"]["clients - plain"])
    ok = moved <= CLIENTS_TARGET_MS
    lines.append(f"clients - plain: {moved:+.3f} ms (target ≤ {CLIENTS_TARGET_MS} ms) "
                 f"{_verdict(ok)}")
    return "\n".join(lines), ok


def serve_relay_profiled(config: str, prefix: str) -> int:
    """``relay serve``, with cProfile on between SIGUSR1 and SIGUSR2 (stats: PREFIX.N)."""
    import cProfile

    from relay.assembly.cli import main as relay_main

    state: dict[str, Any] = {"profile": None, "n": 0}

    def start(signum: int, frame: Any) -> None:
        state["profile"] = cProfile.Profile()
        state["profile"].enable()

    def stop(signum: int, frame: Any) -> None:
        profile, state["profile"] = state["profile"], None
        if profile is not None:
            profile.disable()
            state["n"] += 1
            path = f"{prefix}.{state['n']}"
            profile.dump_stats(f"{path}.tmp")
            os.replace(f"{path}.tmp", path)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    return relay_main(["serve", "--config", config, "--port", "0", "--log-level", "WARNING"])


async def profile_relay(nursery: trio.Nursery, config: Path, tmp: Path, sizes: Sizes,
                        upstream: Child, children: list[Child],
                        relay_cpu: int | None) -> dict[str, Any]:
    prefix = tmp / "relay.prof"
    relay = await start_relay(nursery, [PY, "-m", "bench.overhead", "--serve-relay-profiled",
                                        str(config), str(prefix)], "relay serve (cProfile)",
                              relay_cpu)
    children.append(relay)
    target = relay_target(relay)
    cpu = CPUWindow({"relay": relay.pid, "upstream": upstream.pid, "client": os.getpid()})
    out = {}
    for n, (label, stream) in enumerate((("c32_nonstream", False), ("c32_sse", True)), 1):
        load = await run_load(
            target, stream=stream, concurrency=32, warmup_s=sizes.load_warmup_s,
            duration_s=sizes.profile_s, cpu=cpu, on_window=lambda on: relay.proc.send_signal(
                signal.SIGUSR1 if on else signal.SIGUSR2))
        path = trio.Path(f"{prefix}.{n}")
        for _ in range(500):
            if await path.exists():
                break
            await trio.sleep(0.01)
        else:
            raise relay.failure("wrote no profile")
        out[label] = {"load": load, **summarize_profile(Path(path))}
    await relay.stop(signal.SIGTERM)
    return out


PACKAGES = ("trio", "hypercorn", "h11", "httpx", "httpcore", "quart", "anyio", "json")


def _where(file: str) -> str:
    if file == "~":
        return "builtins (C)"
    path = Path(file)
    if ROOT in path.parents:
        return path.relative_to(ROOT).parts[0]
    parts = path.parts
    for package in PACKAGES:
        if package in parts:
            return package
    return "stdlib/other"


def _func(key: tuple[str, int, str]) -> str:
    file, line, name = key
    if file == "~":
        return name
    parts = Path(file).parts
    if ROOT in Path(file).parents:
        short = str(Path(file).relative_to(ROOT))
    elif "site-packages" in parts:
        short = "/".join(parts[parts.index("site-packages") + 1:])
    else:
        short = "/".join(parts[-2:])
    return f"{short}:{line}({name})"


def summarize_profile(path: Path, top: int = 15) -> dict[str, Any]:
    stats = pstats.Stats(str(path))
    rows = [{"func": _func(key), "ncalls": nc, "tottime_s": tt, "cumtime_s": ct}
            for key, (_, nc, tt, ct, _) in stats.stats.items()]  # type: ignore[attr-defined]
    total = sum(r["tottime_s"] for r in rows)
    by_package: dict[str, float] = {}
    for key, (_, _, tt, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        by_package[_where(key[0])] = by_package.get(_where(key[0]), 0.0) + tt
    # The run loop's own frames (trio's unrolled_run, Context.run, coroutine.send) hold
    # nearly all the time and say nothing: the cumulative list leaves them out.
    plumbing = [r for r in rows if r["cumtime_s"] >= 0.9 * total]
    return {
        "total_s": total,
        "plumbing": [r["func"] for r in plumbing],
        "cumulative": sorted((r for r in rows if r not in plumbing),
                             key=lambda r: -r["cumtime_s"])[:top],
        "tottime": sorted(rows, key=lambda r: -r["tottime_s"])[:top],
        "by_package_pct": {k: round(100 * v / total, 1) for k, v in
                           sorted(by_package.items(), key=lambda kv: -kv[1])},
    }


# --- the report ----------------------------------------------------------------------------

def _table(rows: list[list[str]], indent: str = "  ", left: tuple[int, ...] = (0,)
           ) -> list[str]:
    """Aligned columns: ``left`` ones flush left, the others flush right."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=False))
                               ).rstrip() for row in rows]


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _n(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _rounds(load: dict[str, Any]) -> str:
    return " ".join(f"{v:,.0f}" for v in load["rounds"])


def _cpu(load: dict[str, Any]) -> str:
    return " ".join(f"{name} {value:.0f}%" for name, value in load["cpu_pct"].items())


def render(results: dict[str, Any]) -> tuple[str, list[bool]]:
    met: list[bool] = []
    lines = [f"relay overhead bench: Python {sys.version.split()[0]}, trio {trio.__version__}, "
             f"{os.cpu_count()} CPUs"]
    if results["pinned"]:
        lines.append(f"  pinned: relay on CPU {RELAY_CPU}, client on CPU {CLIENT_CPU}; the fake "
                     f"upstream on CPU {RELAY_CPU} for direct runs, CPU {CLIENT_CPU} for "
                     "relay runs")
    else:
        lines.append("  not pinned: the scheduler places relay, the fake upstream and the "
                     "client (--pin to split them)")
    lines.append(f"  other programs used {results['others_cpu_pct']:.0f}% of one core on "
                 "average during sections 1-4 (the rates are noisy when that is high; the "
                 "CPU-per-request rows much less)")
    sizes = results["sizes"]

    lat = results["latency"]
    d = lat["direct"]
    lines += ["", f"1. added latency, concurrency 1, non-stream, each front to the same "
              f"OpenAI-compatible upstream through the openai adapter, access log on "
              f"({d['requests']} requests each; {sizes['latency_warmup']} warm-up each "
              "before any is measured, 10 more before each round; one keep-alive "
              "connection"
              + (f", {sizes['rounds']} rounds, direct and the fronts interleaved)"
                 if sizes["rounds"] > 1 else ")")]
    rows = [["", "direct", *FRONTS, "target"]]
    for q, key in (("p50", "added_p50_ms"), ("p99", "added_p99_ms")):
        added = {f: lat[f][f"{q}_ms"] - d[f"{q}_ms"] for f in FRONTS}
        met.append(all(a <= TARGETS[key] for a in added.values()))
        rows += [[f"{q} ms", f"{d[f'{q}_ms']:.2f}", *(f"{lat[f][f'{q}_ms']:.2f}" for f in FRONTS),
                  ""],
                 [f"added {q} ms", "", *(f"{added[f]:.2f}" for f in FRONTS),
                  f"<= {TARGETS[key]:g} ms each: {_verdict(met[-1])}"]]
        if q == "p50":
            low, high = min(added.values()), max(added.values())
            spread = (high - low) / low if low > 0 else math.inf
            met.append(spread <= TARGETS["fronts_spread"])
            spread_row = ["fronts' added p50 spread", "", f"{100 * spread:.0f} %", "", "",
                          f"<= {100 * TARGETS['fronts_spread']:g} %: {_verdict(met[-1])}"]
    lines += _table([*rows, spread_row])

    for key, title, unit, target_key in (
            ("throughput", "2. throughput, concurrency 32, non-stream", "req/s", "rps_c32"),
            ("sse", f"3. SSE, concurrency 32, {SSE_CHUNKS} chunks per answer, no delays",
             "chunks/s", "chunks_per_s")):
        d, r = results[key]["direct"], results[key]["relay"]
        field_ = "chunks_per_s" if key == "sse" else "req_per_s"
        met.append(r[field_] >= TARGETS[target_key])
        lines += ["", f"{title} ({'median of ' if sizes['rounds'] > 1 else ''}"
                  f"{_n(sizes['rounds'], 'round')} of {d['window_s']:g} s after "
                  f"{sizes['load_warmup_s']:g} s warm-up)"]
        rows = [["", "direct", "relay", "relay/direct", "target"],
                [unit, f"{d[field_]:,.0f}", f"{r[field_]:,.0f}",
                 f"{r[field_] / d[field_]:.2f}x" if d[field_] else "-",
                 f">= {TARGETS[target_key]:,.0f}: {_verdict(met[-1])}"]]
        if sizes["rounds"] > 1:
            rows.append([f"{unit}, every round", _rounds(d), _rounds(r), "", ""])
        if key == "throughput":
            c = results[key]["ceiling"]
            rows += [["raw-ASGI ceiling, req/s", "", f"{c['req_per_s']:,.0f}",
                      f"relay/ceiling {r['req_per_s'] / c['req_per_s']:.2f}x"
                      if c["req_per_s"] else "-", "(hypercorn, a raw ASGI JSON answer)"],
                     ["ceiling CPU, ms per request", "",
                      f"{c['server_cpu_us_per_unit'] / 1e3:.2f}", "", ""]]
        if key == "sse":
            rows.append(["answers/s", f"{d['req_per_s']:.1f}", f"{r['req_per_s']:.1f}",
                         f"{r['req_per_s'] / d['req_per_s']:.2f}x" if d["req_per_s"] else "-",
                         ""])
        scale, per = (1e3, "ms per request") if key == "throughput" else (1, "us per chunk")
        rows += [[f"server CPU, {per}", f"{d['server_cpu_us_per_unit'] / scale:.2f}",
                  f"{r['server_cpu_us_per_unit'] / scale:.2f}", "", "(upstream / relay)"],
                 [f"{unit} at 100% of one core", f"{1e6 / d['server_cpu_us_per_unit']:,.0f}",
                  f"{1e6 / r['server_cpu_us_per_unit']:,.0f}", "", ""]]
        rows += [["p50 / p99 ms", f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f}",
                  f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}", "", ""],
                 ["upstream conns opened", str(d["upstream_connections"]),
                  str(r["upstream_connections"]), "", ""],
                 ["errors", str(d["errors"]), str(r["errors"]), "", ""]]
        lines += _table(rows)
        lines += [f"  CPU (% of one core): direct: {_cpu(d)}; relay: {_cpu(r)}"]
        for label, load in (("direct", d), ("relay", r)):
            if load["first_error"]:
                lines.append(f"  first {label} error: {load['first_error']}")

    stops = results["stops"]
    lines += ["", f"4. stop -> upstream closed, ms (median / max of "
              f"{stops['queued']['relay']['tries']} tries; the client closes its connection)"]

    def mm(v: dict[str, float]) -> str:
        return f"{v['median_ms']:.1f} / {v['max_ms']:.1f}"

    queued = stops["queued"]
    rows = [["", "direct", "relay", "relay p99", "target"]]
    for label, key in (("(a) mid-stream -> upstream conn closed", "mid_stream"),
                       ("(b) non-stream, upstream silent -> conn closed", "waiting")):
        p99 = stops[key]["relay"]["p99_ms"]
        met.append(p99 <= TARGETS["stop_p99_ms"])
        rows.append([label, mm(stops[key]["direct"]), mm(stops[key]["relay"]), f"{p99:.1f}",
                     f"<= {TARGETS['stop_p99_ms']:g} ms: {_verdict(met[-1])}"])
    rows.append(["(c) queued (1 lane held) -> lane queued = 0", "-", mm(queued["relay"]),
                 f"{queued['relay']['p99_ms']:.1f}", ""])
    lines += _table(rows)
    tries = queued["relay"]["tries"]
    ok_c = queued["reached_upstream"] == 0 and queued["records_never_started"] == tries
    lines += [f"  (c) is an upper bound: relay's status route polled back to back, "
              f"{queued['poll_ms']:.1f} ms per poll",
              f"  (c) queued requests that reached the upstream: {queued['reached_upstream']} "
              f"of {tries}; records 499 client_disconnected, queued, never ran: "
              f"{queued['records_never_started']} of {tries}: {'ok' if ok_c else 'FAILED'}"]

    s = results["startup"]
    met.append(s["first_answer_s"] < TARGETS["start_to_answer_s"])
    idle, after = s["rss_idle"]["VmRSS"], s["rss_after_load"]["VmRSS"]
    lines += ["", "5. start-up and memory (python -m relay serve --config FILE --port 0)"]
    rows = [["spawn -> 'relay listening' line", f"{s['listening_s']:.2f} s", ""],
            ["spawn -> first chat answer (fake/echo)", f"{s['first_answer_s']:.2f} s",
             f"< {TARGETS['start_to_answer_s']:g} s: {_verdict(met[-1])}"]]
    for label, value in (("RSS idle", idle), ("RSS after the load", after)):
        met.append(value < TARGETS["rss_mib"])
        rows.append([label, f"{value:.1f} MiB",
                     f"< {TARGETS['rss_mib']:g} MB: {_verdict(met[-1])}"])
    rows.append(["peak RSS (VmHWM)", f"{s['rss_after_load']['VmHWM']:.1f} MiB", ""])
    lines += _table(rows)

    q = results["queued"]
    few, many = q["few"][0], q["many"]
    lines += ["", f"6. streamed requests queued on one lane (a fake provider, its one lane "
              f"held), each getting its waiting notices (one every 2 s each: "
              f"{many['count'] / 2:,.0f} sends a second with {many['count']:,})"]
    full = many["count"] >= QUEUED_MANY
    if full:
        met.append(bool(many["rss_queued"]["VmRSS"] < TARGETS["queued_rss_mib"]
                        and many["notices"] and many["granted"]))
    rss_verdict = (f"< {TARGETS['queued_rss_mib']:g} MB: {_verdict(met[-1])}" if full else
                   f"(the < {TARGETS['queued_rss_mib']:g} MB target is for "
                   f"{QUEUED_MANY:,}: --queued {QUEUED_MANY})")
    growth = q["grant_many_ms"] / q["grant_few_ms"] if q["grant_few_ms"] else math.inf
    rows = [["", f"{few['count']:,} queued", f"{many['count']:,} queued", "target"],
            ["opened and all queued in", f"{few['opened_s']:.2f} s",
             f"{many['opened_s']:.2f} s", ""],
            ["RSS with all queued", f"{few['rss_queued']['VmRSS']:.1f} MiB",
             f"{many['rss_queued']['VmRSS']:.1f} MiB", rss_verdict],
            ["every waiter its first notice, the first another", str(few["notices"]),
             str(many["notices"]), ""]]
    met.append(bool(growth <= TARGETS["grant_growth"]))
    rows += [["lane freed -> first waiter's answer (grant)",
              f"{q['grant_few_ms']:.1f} ms", f"{q['grant_many_ms']:.1f} ms",
              f"{many['count'] // few['count']}x the waiters, at most "
              f"{TARGETS['grant_growth']:g}x the time (O(n) would be ~"
              f"{many['count'] // few['count']}x): {growth:.2f}x {_verdict(met[-1])}"],
             ["all cut off -> queue empty", f"{1000 * few['drained_s']:.0f} ms",
              f"{1000 * many['drained_s']:.0f} ms", ""]]
    lines += _table(rows)
    if len(q["few"]) > 1:
        lines.append(f"  grant with {few['count']} queued, every try: " + ", ".join(
            f"{f['grant_ms']:.1f}" for f in q["few"]) + " ms (the median above)")
    floor = q.get("floor")
    if floor is not None:  # the stack's own part, as the ceiling is for throughput
        n = floor["count"]
        stack = floor["rss_held"]["VmRSS"] - floor["rss_idle"]["VmRSS"]
        relay_each = (many["rss_queued"]["VmRSS"] - q["rss_idle"]["VmRSS"]) * 1024 / n
        best = q["rss_idle"]["VmRSS"] + stack
        left = (TARGETS["queued_rss_mib"] - best) * 1024 / n
        lines.append(f"  the stack alone (hypercorn + a raw ASGI app, bench/ceiling.py /stream), "
                     f"the same {n:,} streams and notices: +{stack:.1f} MiB "
                     f"({stack * 1024 / n:.1f} KiB each); relay holds {relay_each:.1f} KiB "
                     "each" + (f". relay's idle + the stack's = {best:.1f} MiB, which leaves "
                               f"{left:.1f} KiB a stream of the "
                               f"{TARGETS['queued_rss_mib']:g} MB target for all relay "
                               "holds per queued request" if full else ""))

    slot = results.get("shared_slot")
    lines += ["", "7. a shared-lane slot (SPEC L11) over a local one, in one process: "
              "acquire + release, uncontended (bench/shared.py parts 1-2, a redis-server "
              "of its own on loopback)"]
    if slot is None:
        lines.append("  NOT MEASURED: redis-server is not installed (.ci/install-redis.sh)")
    else:
        extra = slot["shared"]["p50_ms"] - slot["local"]["p50_ms"]
        met.append(extra <= TARGETS["shared_slot_ms"])
        rows = [["", "local", "shared", "target"],
                ["p50 ms", f"{slot['local']['p50_ms']:.3f}", f"{slot['shared']['p50_ms']:.3f}",
                 ""],
                ["p99 ms", f"{slot['local']['p99_ms']:.3f}", f"{slot['shared']['p99_ms']:.3f}",
                 ""],
                ["shared over local, p50 ms", "", f"{extra:.3f}",
                 f"<= {TARGETS['shared_slot_ms']:g} ms: {_verdict(met[-1])}"],
                ["hand-off between two relays, p50 / p99 ms", "",
                 f"{slot['handoff']['p50_ms']:.2f} / {slot['handoff']['p99_ms']:.2f}", ""]]
        lines += _table(rows)
    lines += ["", f"targets met: {sum(met)} of {len(met)}"]

    for label, prof in (results.get("profile") or {}).items():
        lines += render_profile(label, prof)
    return "\n".join(lines), [ok_c] + [results[k][t]["errors"] == 0
                                       for k in ("throughput", "sse")
                                       for t in ("direct", "relay")]


def render_profile(label: str, prof: dict[str, Any]) -> list[str]:
    load = prof["load"]
    rate = (f"{load['chunks_per_s']:,.0f} chunks/s" if "chunks_per_s" in load
            else f"{load['req_per_s']:,.0f} req/s")
    lines = ["", f"profile {label}: relay under cProfile, {load['window_s']:g} s, {rate} "
             f"(slowed by the profiler), {prof['total_s']:.2f} s of profiled time",
             "  own time by package: " + ", ".join(
                 f"{k} {v:g}%" for k, v in prof["by_package_pct"].items() if v >= 0.5)]
    total = prof["total_s"]
    for key, title in (("cumulative", "top by cumulative time (without the run loop's own "
                        f"frames: {', '.join(prof['plumbing'])})"),
                       ("tottime", "top by own time")):
        lines.append(f"  {title}:")
        lines += _table([["ncalls", "tottime", "cumtime", "cum %", "function"]] + [
            [str(r["ncalls"]), f"{r['tottime_s']:.3f}", f"{r['cumtime_s']:.3f}",
             f"{100 * r['cumtime_s'] / total:.1f}", r["func"]]
            for r in prof[key]], indent="    ", left=(4,))
    lines.append("  (ncalls of a coroutine counts its resumptions; cumtime is time spent "
                 "running inside it, not waiting)")
    return lines


def compile_sources() -> None:
    """Byte-compile relay's own modules, as ``pip install`` does (and as an editable
    install's first run does, unless ``PYTHONDONTWRITEBYTECODE`` is set): section 5 then
    measures the start-up a user has every time but the first, not a recompile of every
    module of relay's (0.15-0.2 s here)."""
    import compileall
    for package in ("relay", "adapters"):
        if not compileall.compile_dir(ROOT / package, quiet=1):
            note(f"could not byte-compile {package}/: start-up includes compiling it")
    note("relay/ and adapters/ byte-compiled, as pip install does (section 5 is a user's "
         "usual start, not a first one)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="then profile relay's hot path under cProfile")
    parser.add_argument("--pin", action="store_true",
                        help=f"relay alone on CPU {RELAY_CPU}, client on CPU {CLIENT_CPU} "
                        "(on a VM, cross-CPU wake-ups can cost more than they save)")
    parser.add_argument("--queued", type=int, metavar="N",
                        help=f"section 6's many waiters (default {QUEUED_MANY:,}; --quick: "
                        f"{QUICK.queued_many:,})")
    parser.add_argument("--clients", action="store_true",
                        help="only what [clients] tokens and the usage database add to the "
                        "added p50 (issue 35): plain, clients and no-usage daemons")
    parser.add_argument("--rounds", type=int, metavar="N",
                        help="--clients: rounds (default 15; --quick: 3)")
    parser.add_argument("--serve-upstream", metavar="PORTFILE", help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay-without-usage", metavar="CONFIG",
                        help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay-profiled", nargs=2, metavar=("CONFIG", "PREFIX"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_upstream:
        trio.run(serve_upstream, args.serve_upstream)
        return 0
    if args.serve_relay_profiled:
        return serve_relay_profiled(*args.serve_relay_profiled)
    if args.serve_relay_without_usage:
        return serve_relay_without_usage(args.serve_relay_without_usage)
    if args.clients:
        rounds = args.rounds or (3 if args.quick else 15)
        with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
            found = trio.run(run_clients_bench, rounds, 60 if args.quick else 200,
                             Path(tmp))
        text, ok = render_clients(found)
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps(found, indent=2) + "\n")
        return 0 if ok else 1

    sizes = QUICK if args.quick else Sizes()
    if args.queued:
        sizes = replace(sizes, queued_many=args.queued)
    from bench.queued import raise_file_limit
    if raise_file_limit() < sizes.queued_many + 200:
        print(f"[bench] warning: the open-file limit is below {sizes.queued_many + 200}; "
              f"section 6 needs a socket per queued request on both sides", file=sys.stderr)
    compile_sources()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        results = trio.run(run_bench, sizes, args.pin and can_pin(), args.profile,
                           Path(tmp))
    results["elapsed_s"] = time.perf_counter() - started
    report, checks = render(results)
    print(report)
    print(f"\n(bench took {results['elapsed_s']:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
