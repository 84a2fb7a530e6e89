"""What each front costs: chat completions, Messages, Responses and Gemini, side by side, against
the same fake OpenAI-compatible upstream, in one run.

    python -m bench.dialects [--requests N] [--seconds S] [--concurrency C] [--json FILE]

The processes and the client are `bench.overhead`'s (the fake upstream in a process of
its own, ``relay serve`` as users start it, raw keep-alive HTTP/1.1 from this process).
For each front — and for the upstream called directly, the baseline — it measures:

1. latency at concurrency 1: N sequential plain requests in 5 rounds, the targets
   interleaved, p50/p99, and what relay adds over the direct call;
2. throughput at concurrency C for S seconds: plain requests/s, and streamed answers/s
   (200 chunks each), with relay's CPU per request.

Every front translates into relay's one internal request and back, so the difference
between them is the dialect's parse and render; the Responses, Messages and Gemini
fronts' bodies are the same question as the chat one (`bench.overhead.FRONTS`, whose
section 1 measures the same latency among its other figures; the Gemini front's is
here, ``/v1beta/models/up/fast:generateContent``). ``added_vs_chat_pct``: a front's added
p50 latency against chat's.

3. in process (``in_process``): each front to the fake provider through the assembled
   relay's ASGI app in memory, interleaved in rounds — relay's own path with no sockets
   and no other process, so the figure a busy machine disturbs least; ``vs_chat_pct`` is
   a front's p50 against chat's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.overhead import (
    FRONTS,
    PY,
    Child,
    CPUWindow,
    HTTPConnection,
    http_request,
    pct,
    start_relay,
    start_upstream,
    write_config,
)


def _gemini(model: str, stream: bool) -> tuple[str, dict[str, Any]]:
    """Google's Gemini API (SPEC A9): the model and the streaming are in the path."""
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    return (f"/v1beta/models/{model}:{method}",
            {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]})


# The fronts measured: `bench.overhead.FRONTS`, and the Gemini front (its path carries
# the model), each → the bytes that end a complete stream.
ENDS: dict[str, bytes] = {**{f: end for f, (_, _, end) in FRONTS.items()},
                          "gemini": b'"finishReason"'}


ROUNDS = 5


def raw(hostport: str, front: str, model: str, stream: bool) -> bytes:
    if front == "gemini":
        path, body = _gemini(model, stream)
    else:
        path, make, _ = FRONTS[front]
        body = make(model, stream)
    return http_request("POST", hostport, path,
                        json.dumps(body, separators=(",", ":")).encode())


async def latency(host: str, port: int, request: bytes, warmup: int, n: int) -> list[float]:
    conn = await HTTPConnection.open(host, port)
    times = []
    try:
        for i in range(warmup + n):
            t = time.perf_counter()
            status, body = await conn.request(request)
            if status != 200:
                raise RuntimeError(f"answered {status}: {body[:300]!r}")
            if i >= warmup:
                times.append(time.perf_counter() - t)
    finally:
        await conn.aclose()
    return times


async def load(host: str, port: int, request: bytes, end: bytes | None, concurrency: int,
               seconds: float, cpu: CPUWindow) -> dict[str, Any]:
    t0 = time.perf_counter() + 0.5  # half a second of warm-up
    t1 = t0 + seconds
    done = errors = 0

    async def worker() -> None:
        nonlocal done, errors
        conn = await HTTPConnection.open(host, port)
        try:
            while time.perf_counter() < t1:
                status, body = await conn.request(request)
                if status != 200 or (end is not None and end not in body[-4000:]):
                    errors += 1
                elif t0 <= time.perf_counter() <= t1:
                    done += 1
        finally:
            await conn.aclose()

    async def window() -> None:
        await trio.sleep(t0 - time.perf_counter())
        cpu.start()
        await trio.sleep(t1 - time.perf_counter())
        out["cpu_pct"] = cpu.stop()

    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(window)
        for _ in range(concurrency):
            nursery.start_soon(worker)
    out.update(req_per_s=round(done / seconds, 1), errors=errors)
    relay_pct = out["cpu_pct"].get("relay")
    if relay_pct is not None and done:
        out["relay_cpu_us_per_req"] = round(1e6 * relay_pct / 100 * seconds / done)
    return out


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    children: list[Child] = []
    try:
        async with trio.open_nursery() as nursery:
            upstream, up_port, _ = await start_upstream(nursery, tmp)
            children.append(upstream)
            config = write_config(tmp, up_port)
            relay = await start_relay(nursery, [PY, "-m", "relay", "serve", "--config",
                                                str(config), "--port", "0"],
                                      "relay serve", None)
            children.append(relay)
            assert relay.url is not None
            host, _, port_text = relay.url.removeprefix("http://").rpartition(":")
            port = int(port_text)
            pids = {"relay": relay.pid, "upstream": upstream.pid}
            targets = {"direct": ("127.0.0.1", up_port, "", "chat")}
            targets.update({f: (host, port, "up/", f) for f in ENDS})
            # Latency in rounds, the targets interleaved, so a burst of other work on a
            # shared machine hits every front alike (a front's p50: all its samples').
            samples: dict[str, list[float]] = {name: [] for name in targets}
            for _ in range(ROUNDS):
                for name, (h, p, prefix, front) in targets.items():
                    samples[name] += await latency(
                        h, p, raw(f"{h}:{p}", front, prefix + "fast", False), 30,
                        max(1, args.requests // ROUNDS))
            for name, (h, p, prefix, front) in targets.items():
                hp = f"{h}:{p}"
                times = samples[name]
                plain = await load(h, p, raw(hp, front, prefix + "fast", False), None,
                                   args.concurrency, args.seconds, CPUWindow(pids))
                streamed = await load(h, p, raw(hp, front, prefix + "sse200", True),
                                      ENDS[front], args.concurrency, args.seconds,
                                      CPUWindow(pids))
                results[name] = {"p50_ms": round(pct(times, 0.5), 3),
                                 "p99_ms": round(pct(times, 0.99), 3),
                                 "plain": plain, "streamed": streamed}
                print(f"{name:>10}: p50 {results[name]['p50_ms']:.2f} ms, p99 "
                      f"{results[name]['p99_ms']:.2f} ms; plain {plain['req_per_s']} req/s;"
                      f" streamed {streamed['req_per_s']} answers/s", file=sys.stderr)
            base = results["direct"]["p50_ms"]
            for front in ENDS:
                results[front]["added_p50_ms"] = round(results[front]["p50_ms"] - base, 3)
            chat = results["chat"]["added_p50_ms"]
            for front in ENDS:  # each front's added latency against chat's
                results[front]["added_vs_chat_pct"] = (
                    round(100 * (results[front]["added_p50_ms"] - chat) / chat, 1)
                    if chat > 0 else None)
            nursery.cancel_scope.cancel()
    finally:
        for child in children:
            await child.stop()
    return results


# --- in process: the front's own cost, without sockets or other processes -------------

_FAKE_CONFIG = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 4
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
"""


async def _asgi_post(app: Any, path: str, body: bytes) -> int:
    """One POST through relay's ASGI app, in memory: its status."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8765),
             "headers": [(b"host", b"127.0.0.1:8765"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    status = 0
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def in_process(tmp: Path, n: int) -> dict[str, Any]:
    """Each front to the fake provider through the assembled relay's ASGI app, in memory,
    the fronts interleaved in rounds: relay's whole path (guard, front, dialect, engine,
    writer) with nothing else in the way. Its p50 per request, and against chat's."""
    from relay import load_config, open_relay

    config_file = tmp / "in-process.toml"
    config_file.write_text(_FAKE_CONFIG)
    requests = {front: raw("-", front, "fake/echo", False) for front in ENDS}
    bodies = {front: (req.split(b" ", 2)[1].decode(), req.partition(b"\r\n\r\n")[2])
              for front, req in requests.items()}
    times: dict[str, list[float]] = {front: [] for front in ENDS}
    async with open_relay(load_config(config_file), discover=False) as relay:
        for _ in range(ROUNDS):
            for front, (path, body) in bodies.items():
                for _ in range(max(1, n // ROUNDS)):
                    t = time.perf_counter()
                    status = await _asgi_post(relay.app, path, body)
                    times[front].append(time.perf_counter() - t)
                    if status != 200:
                        raise RuntimeError(f"{front} answered {status}")
    # (`pct` answers in ms)
    out = {front: {"p50_us": round(pct(v, 0.5) * 1e3, 1)} for front, v in times.items()}
    for front in out:
        out[front]["vs_chat_pct"] = round(100 * (out[front]["p50_us"] / out["chat"]["p50_us"]
                                                 - 1), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = trio.run(run, args, Path(tmp))
        results["in_process"] = trio.run(in_process, Path(tmp), args.requests * 4)
        print(f"in process: {results['in_process']}", file=sys.stderr)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
