"""relay's memory against a hostile upstream (SPEC O5: bounded by construction).

    python -m bench.hostile [--plain-mib 256] [--gzip-mib 1024] [--sse-mib 256]
                            [--error-mib 5]

Starts the hostile upstream (``tests/fakes/hostile_upstream.py``) in this process and
``python -m relay serve --config FILE --port 0`` as a subprocess, exactly as users start
it, with the default ``max_upstream_bytes`` (32 MiB). Then, one case at a time:

- a plain, valid 256 MiB JSON answer (sent lazily, in 64 KiB writes);
- a 1 MB gzip body that inflates to 1 GiB (``content-encoding: gzip``);
- a 256 MiB SSE ``data:`` line with no line end;
- a 401 whose 5 MiB body is its message repeated (the client gets both ``message`` and
  ``upstream_message``, each cut at 64 KiB).

Each case gets a fresh relay (memory a case freed would hide the next case's), warmed
up by one small request. Reported: relay's RSS before, its peak RSS during the case
(VmHWM, reset to the current RSS first through ``/proc/PID/clear_refs``; where that is
refused, the growth is measured from the warm relay's VmHWM instead), the growth, the
client's error body size, how much the upstream put on the wire before relay stopped
taking it, and the wall time.
Limits: growth under 64 MiB, error body under 160 KiB; the exit code is 1 if any is
broken. The client reads at most 2 MiB of any answer, so a relay that breaks the bound
cannot take the bench down with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.overhead import PY, ROOT, Child, rss_mib, start_relay

sys.path.insert(0, str(ROOT / "tests"))
from fakes.hostile_upstream import Hostile, MiB, Plan, gzip_answer, serve_hostile

GROWTH_LIMIT_MIB = 64.0
BODY_LIMIT = 160 * 1024
READ_AT_MOST = 2 * MiB

CONFIG = """
[server]
records = "{records}"
[providers.up]
adapter = "openai"
base_url = "{url}"
models = ["warm", "plain", "gzip", "sse", "error"]
[providers.up.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 30
run_timeout_s = 300
"""


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0, own processes)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


async def ask(client: httpx.AsyncClient, url: str, model: str, stream: bool
              ) -> tuple[int, int, bytes]:
    """POST a chat request; (status, body bytes read, the first `READ_AT_MOST` of them)."""
    body = {"model": f"up/{model}", "messages": [{"role": "user", "content": "hi"}],
            "stream": stream}
    read, head = 0, b""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for piece in r.aiter_bytes():
            read += len(piece)
            head = (head + piece)[:READ_AT_MOST]
            if read > READ_AT_MOST:
                break
    return r.status_code, read, head


async def run_case(client: httpx.AsyncClient, relay: Child, up: Hostile, model: str,
                   stream: bool) -> dict[str, Any]:
    assert relay.url is not None
    status, _, _ = await ask(client, relay.url, "warm", False)  # warm-up: pools, imports
    assert status == 200, status
    before = rss_mib(relay.pid)
    reset = reset_peak(relay.pid)
    base = before["VmRSS"] if reset else before["VmHWM"]
    closed = sum(c.closed_at is not None for c in up.connections)
    started = time.perf_counter()
    status, read, head = await ask(client, relay.url, model, stream)
    wall = time.perf_counter() - started
    after = rss_mib(relay.pid)
    with trio.move_on_after(5):  # relay closed the connection it stopped reading
        await up.wait_until(lambda: sum(c.closed_at is not None for c in up.connections)
                            > closed)
    reason = ""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        reason = json.loads(head)["error"]["code"]
    return {"status": status, "reason": reason, "rss_before": before["VmRSS"],
            "peak": after["VmHWM"], "growth": after["VmHWM"] - base, "body": read,
            "wire": up.sent.get(model, 0), "wall_s": wall, "peak_reset": reset}


async def bench(args: argparse.Namespace) -> int:
    up_ref: list[Hostile] = []
    plans = {"warm": Plan("separators"), "plain": Plan("huge", size=args.plain_mib * MiB),
             "gzip": Plan("gzip_bomb", size=args.gzip_mib * MiB),
             "sse": Plan("sse_unterminated", size=args.sse_mib * MiB),
             "error": Plan("echo_401", size=args.error_mib * MiB)}
    print(f"compressing {args.gzip_mib} MiB for the gzip case …", flush=True)
    compressed = await trio.to_thread.run_sync(gzip_answer, args.gzip_mib * MiB)
    cases = [("plain", f"{args.plain_mib} MiB plain JSON answer", False),
             ("gzip", f"{len(compressed) / 1e6:.1f} MB gzip → {args.gzip_mib} MiB", False),
             ("sse", f"{args.sse_mib} MiB SSE line, no line end", True),
             ("error", f"{args.error_mib} MiB 401 error body", False)]
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="relay-hostile-") as tmp:
        async with trio.open_nursery() as nursery:
            up_ref.append(await nursery.start(serve_hostile))
            up = up_ref[0]
            up.plans.update(plans)
            config = Path(tmp) / "profiles.toml"
            config.write_text(CONFIG.format(records=Path(tmp) / "records.jsonl",
                                            url=up.url))
            cmd = [PY, "-m", "relay", "serve", "--config", str(config), "--port", "0"]
            async with httpx.AsyncClient(trust_env=False,
                                         timeout=httpx.Timeout(120.0)) as client:
                for model, label, stream in cases:
                    print(f"  {label} …", flush=True)
                    relay = await start_relay(nursery, cmd, "relay serve", None)
                    try:
                        rows.append((label, await run_case(client, relay, up, model,
                                                           stream)))
                    finally:
                        await relay.stop()
            nursery.cancel_scope.cancel()
    return report(rows)


def report(rows: list[tuple[str, dict[str, Any]]]) -> int:
    print()
    print(f"{'case':<34} {'answer':<28} {'RSS before':>10} {'peak':>8} {'growth':>8} "
          f"{'error body':>11} {'on the wire':>12} {'time':>6}")
    ok = True
    for label, r in rows:
        good = r["growth"] < GROWTH_LIMIT_MIB and r["body"] < BODY_LIMIT
        ok = ok and good
        answer = f"{r['status']} {r['reason']}"
        print(f"{label:<34} {answer:<28} {r['rss_before']:>7.1f} MiB {r['peak']:>4.1f} MiB "
              f"{r['growth']:>4.1f} MiB {r['body'] / 1024:>7.1f} KiB "
              f"{r['wire'] / MiB:>8.1f} MiB {r['wall_s']:>5.2f}s {'ok' if good else 'OVER'}")
    how = ("VmHWM during the case - VmRSS before" if all(r["peak_reset"] for _, r in rows)
           else "VmHWM - the warm relay's VmHWM")
    print(f"\nlimits: growth < {GROWTH_LIMIT_MIB:g} MiB ({how}), client's error body < "
          f"{BODY_LIMIT // 1024} KiB: {'all within' if ok else 'BROKEN'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plain-mib", type=int, default=256)
    parser.add_argument("--gzip-mib", type=int, default=1024)
    parser.add_argument("--sse-mib", type=int, default=256)
    parser.add_argument("--error-mib", type=int, default=5)
    args = parser.parse_args(argv)
    return trio.run(bench, args)


if __name__ == "__main__":
    sys.exit(main())
