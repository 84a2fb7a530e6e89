"""Memory of many queued streaming requests, and the cost of granting the next waiter.

    python -m bench.queued [--count 1000]

Starts ``relay serve`` with a one-lane fake provider, holds its lane with one slow
request, opens COUNT streaming requests that all wait in the queue (each gets its 200
and waiting notices), and reports the daemon's RSS before, with all of them queued, and
after they were cut off; how long the first waiter took to get its answer once the lane
was freed (granting the next waiter); how long the queue took to drain back to 0 once
they left. Numbers are printed, not asserted; `bench.overhead` runs it for 100 and
10,000 waiters (issue 16: < 300 MB, and a grant that stays O(log n)).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.overhead import PY, ROOT, Child, http_request, rss_mib, start_relay

OPEN_WINDOW = 16  # requests opened and not yet seen queued, at most

CONFIG = """
[server]
records = "{records}"
heartbeat_s = 15
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 1
queue_max = {queue_max}
queue_timeout_s = 600
run_timeout_s = 600
"""


async def status(child: Child) -> dict[str, int]:
    host, _, port = child.url.removeprefix("http://").partition(":")  # type: ignore[union-attr]
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(http_request("GET", f"{host}:{port}", "/relay/v1/status"))
        data = b""
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and b"content-length" in head.lower():
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
    lanes: dict[str, int] = json.loads(body)["providers"]["fake"]["lanes"]
    return lanes


async def open_queued(child: Child, model: str) -> trio.SocketStream:
    host, _, port = child.url.removeprefix("http://").partition(":")  # type: ignore[union-attr]
    stream = await trio.open_tcp_stream(host, int(port))
    body = json.dumps({"model": model, "stream": True,
                       "messages": [{"role": "user", "content": "wait"}]}).encode()
    await stream.send_all(http_request("POST", f"{host}:{port}", "/v1/chat/completions",
                                       body))
    return stream


def raise_file_limit() -> int:
    """As many open files as the hard limit allows (the relay child inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def _until(stream: trio.SocketStream, marker: bytes, timeout_s: float) -> bool:
    """Read ``stream`` until ``marker`` arrives (True) or ``timeout_s`` passes (False)."""
    seen = b""
    with trio.move_on_after(timeout_s):
        while marker not in seen:
            data = await stream.receive_some(65536)
            if not data:
                return False
            seen = seen[-len(marker):] + data
        return True
    return False


async def queue_up(child: Child, count: int, nursery: trio.Nursery) -> dict[str, Any]:
    """One held lane, ``count`` streamed requests queued behind it, each getting its
    waiting notices; then the lane is freed: how long until the first waiter's answer
    flows (granting the next waiter), and RSS with all of them queued."""
    holder = await open_queued(child, "fake/echo?delay_s=600")
    streams = [holder]
    t0 = time.perf_counter()
    try:
        # Each waits for its first waiting notice (sent as it queues) before the next
        # opens, a few at a time: faster than relay takes them, the listen queue would
        # overflow and the kernel would drop connections (a 1 s SYN retry each).
        window = trio.Semaphore(OPEN_WINDOW)
        first_notices = 0
        while len(streams) < count + 1:
            await window.acquire()
            streams.append(await open_queued(child, "fake/echo"))

            async def notice(stream: trio.SocketStream) -> None:
                nonlocal first_notices
                try:
                    got = await _until(stream, b": waiting", 30.0)
                    first_notices += got  # (not `+= await`: it would read before)
                finally:
                    window.release()

            nursery.start_soon(notice, streams[-1])
        for _ in range(OPEN_WINDOW):  # every first notice is in
            await window.acquire()
        while (await status(child))["queued"] < count:  # noqa: ASYNC110 - another process
            await trio.sleep(0.1)
        opened = time.perf_counter() - t0
        # Every waiter gets a notice at least every 2 s: the first one queued has had
        # another one since (its first was read above).
        notices = first_notices == count and await _until(streams[1], b": waiting", 5.0)
        queued_rss = rss_mib(child.pid)
        freed_at = time.perf_counter()
        await holder.aclose()
        granted = await _until(streams[1], b"data: {", 10.0)
        grant_s = time.perf_counter() - freed_at
    finally:
        for stream in streams:
            await stream.aclose()
    t1 = time.perf_counter()
    while (await status(child))["queued"] > 0:  # noqa: ASYNC110 - another process
        await trio.sleep(0.01)
    return {"count": count, "opened_s": opened, "notices": notices, "granted": granted,
            "grant_ms": 1000 * grant_s, "rss_queued": queued_rss,
            "drained_s": time.perf_counter() - t1}


async def start_queue_relay(nursery: trio.Nursery, tmp: Path, queue_max: int) -> Child:
    config = tmp / "queued.toml"
    config.write_text(CONFIG.format(records=tmp / "queued.jsonl", queue_max=queue_max))
    return await start_relay(nursery, [PY, "-m", "relay", "serve", "--config", str(config),
                                       "--port", "0", "--log-level", "WARNING"],
                             "relay (queue)", None)


async def main(count: int) -> None:
    raise_file_limit()
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            child = await start_queue_relay(nursery, Path(tmp), count + 8)
            try:
                idle = rss_mib(child.pid)
                out = await queue_up(child, count, nursery)
                after = rss_mib(child.pid)
            finally:
                await child.stop()
            nursery.cancel_scope.cancel()
    queued = out["rss_queued"]
    print(f"{count} queued streaming requests (one lane held):")
    print(f"  opened and all queued in        {out['opened_s']:.2f} s")
    print(f"  RSS idle                        {idle['VmRSS']:.1f} MiB")
    print(f"  RSS with {count} queued          {queued['VmRSS']:.1f} MiB   "
          f"({(queued['VmRSS'] - idle['VmRSS']) * 1024 / count:.0f} KiB each)   "
          f"waiting notices flowing: {out['notices']}")
    print(f"  lane freed -> first waiter's answer  {out['grant_ms']:.1f} ms")
    print(f"  all cut off -> queue empty in   {out['drained_s'] * 1000:.0f} ms")
    print(f"  RSS after                       {after['VmRSS']:.1f} MiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    sys.path.insert(0, str(ROOT))
    trio.run(main, parser.parse_args().count)
