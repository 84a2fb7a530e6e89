"""Memory of many queued streaming requests (issue 7: 1,000 queued streams < 150 MB).

    python -m bench.queued [--count 1000]

Starts ``relay serve`` with a one-lane fake provider, holds its lane with one slow
request, opens COUNT streaming requests that all wait in the queue (each gets its 200
and waiting notices), and reports the daemon's RSS before, with all of them queued, and
after they were cut off — plus how long the queue took to drain back to 0 once they
left. Numbers are printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench.overhead import PY, ROOT, Child, http_request, rss_mib, start_relay

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


async def main(count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "relay.toml"
        config.write_text(CONFIG.format(records=Path(tmp) / "r.jsonl", queue_max=count + 8))
        async with trio.open_nursery() as nursery:
            child = await start_relay(nursery, [PY, "-m", "relay", "serve", "--config",
                                                str(config), "--port", "0",
                                                "--log-level", "WARNING"], "relay", None)
            try:
                idle = rss_mib(child.pid)
                holder = await open_queued(child, "fake/echo?delay_s=600")
                streams = [holder]
                t0 = time.perf_counter()
                for _ in range(count):
                    streams.append(await open_queued(child, "fake/echo"))
                while (await status(child))["queued"] < count:  # noqa: ASYNC110 - another process
                    await trio.sleep(0.1)
                opened = time.perf_counter() - t0
                queued = rss_mib(child.pid)
                t1 = time.perf_counter()
                for stream in streams[1:]:
                    await stream.aclose()
                while (await status(child))["queued"] > 0:  # noqa: ASYNC110 - another process
                    await trio.sleep(0.01)
                drained = time.perf_counter() - t1
                after = rss_mib(child.pid)
                await holder.aclose()
            finally:
                await child.stop()
            nursery.cancel_scope.cancel()
    print(f"{count} queued streaming requests (one lane held):")
    print(f"  opened and all queued in        {opened:.2f} s")
    print(f"  RSS idle                        {idle['VmRSS']:.1f} MiB")
    print(f"  RSS with {count} queued          {queued['VmRSS']:.1f} MiB   "
          f"({(queued['VmRSS'] - idle['VmRSS']) * 1024 / count:.0f} KiB each)   "
          f"target < 150 MB: {'ok' if queued['VmRSS'] < 150 else 'MISSED'}")
    print(f"  all cut off -> queue empty in   {drained * 1000:.0f} ms")
    print(f"  RSS after                       {after['VmRSS']:.1f} MiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    sys.path.insert(0, str(ROOT))
    trio.run(main, parser.parse_args().count)
