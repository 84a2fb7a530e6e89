"""What a waiting notice costs: N streamed requests queued on one lane (a fake provider,
its one lane held), each getting its waiting notice every 2 s; relay's CPU over a few
seconds of that steady state, per notice sent.

    python -m bench.notices [--count 2000] [--seconds 4]

The 10,000-waiter figure of issue 16 is bounded by this: 10,000 waiters are 5,000 notices
a second, so a notice must cost well under 200 us of relay CPU for one core to keep up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench.overhead import ROOT, cpu_seconds
from bench.queued import open_queued, raise_file_limit, start_queue_relay, status


async def _drain(stream: trio.SocketStream) -> None:
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def main(count: int, seconds: float) -> None:
    raise_file_limit()
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            child = await start_queue_relay(nursery, Path(tmp), count + 8)
            holder = await open_queued(child, "fake/echo?delay_s=600")
            streams = [holder]
            for i in range(count):
                streams.append(await open_queued(child, "fake/echo"))
                nursery.start_soon(_drain, streams[-1])
                if i % 50 == 49:  # not faster than relay takes them (the listen queue)
                    while (await status(child))["queued"] < i - 50:  # noqa: ASYNC110
                        await trio.sleep(0.02)
            while (await status(child))["queued"] < count:  # noqa: ASYNC110
                await trio.sleep(0.05)
            await trio.sleep(2.5)  # every waiter past its first notice
            cpu0, t0 = cpu_seconds(child.pid), time.perf_counter()
            await trio.sleep(seconds)
            cpu1, t1 = cpu_seconds(child.pid), time.perf_counter()
            for stream in streams:
                await stream.aclose()
            await child.stop()
            nursery.cancel_scope.cancel()
    notices = count / 2 * (t1 - t0)
    print(f"{count} queued streams, {notices / (t1 - t0):.0f} waiting notices a second: "
          f"relay at {100 * (cpu1 - cpu0) / (t1 - t0):.0f}% of a core, "
          f"{1e6 * (cpu1 - cpu0) / notices:.0f} us of CPU per notice")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    trio.run(main, args.count, args.seconds)
