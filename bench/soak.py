"""Soak: continuous mixed traffic through the assembled relay, 1 request in 17 cut off.

    python -m bench.soak --minutes 10          # the seed's 10 minutes (SPEC C5)
    python -m bench.soak --seconds 60          # what CI runs (tests/assembly/test_soak.py)

Traffic: streamed and plain, all three priorities, three providers with small lane
counts so queues form — the fake provider, a fake OpenAI-compatible upstream behind the
``openai`` adapter, and a tight one whose run timeout some requests exceed — with
upstream failures and cut streams mixed in. One request in 17 is cut off by its client at
a random point: while queued, before the first byte, or mid-stream.

At the end it checks, and exits non-zero if any fails: 0 running and 0 queued on every
provider; no upstream response left active, and every upstream connection closed once
relay has stopped; exactly one record per request that reached relay, and every stopped
request that ran has both its stop and its release time; no task, file descriptor or
child process left over (counted before and after).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakes.upstream import FakeUpstream, Script, serve_fake_upstream  # noqa: E402

import relay  # noqa: E402

CONFIG = """
[server]
records = "{records}"
records_max_bytes = 1073741824   # one file: every record is counted at the end
heartbeat_s = 1
write_timeout_s = 2
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 2
queue_max = 16
queue_timeout_s = 3
run_timeout_s = 5
interrupt_grace_s = 1
[providers.up]
adapter = "openai"
base_url = "{url}"
[providers.up.profile]
lanes = 2
queue_max = 16
queue_timeout_s = 3
run_timeout_s = 5
[providers.tight]
adapter = "fake"
models = ["echo"]
[providers.tight.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 1
run_timeout_s = 0.4
"""

# (weight, model)
MIX: list[tuple[int, str]] = [
    (20, "fake/echo?chunks=8&chunk_delay_s=0.01"),
    (10, "fake/echo?delay_s=0.05"),
    (20, "up/ok"),
    (10, "up/slow"),
    (4, "up/fail"),
    (4, "up/cut"),
    (4, "fake/echo?fail=upstream_error"),
    (4, "tight/echo?delay_s=1&ignore_stop_s=0.1"),   # run timeout, slow to stop
    (6, "tight/echo?chunks=3"),
]
CUT_ONE_IN = 17


@attrs.define
class Tally:
    sent: int = 0
    cut: Counter[str] = attrs.field(factory=Counter)
    statuses: Counter[str] = attrs.field(factory=Counter)
    errors: list[str] = attrs.field(factory=list)


def scripts(up: FakeUpstream) -> None:
    up.scripts["ok"] = Script(chunks=["a", "b", "c"])
    up.scripts["slow"] = Script(chunks=["s"] * 10, chunk_delay_s=0.03)
    up.scripts["fail"] = Script(status=503)
    up.scripts["cut"] = Script(chunks=["x", "y", "z"], cut_after=2)


async def one_request(url: str, rng: random.Random, tally: Tally) -> None:
    weights = [w for w, _ in MIX]
    model = rng.choices([m for _, m in MIX], weights)[0]
    stream = rng.random() < 0.6
    priority = rng.choice(["interactive", "normal", "normal", "background"])
    cut = rng.randrange(CUT_ONE_IN) == 0
    where = rng.choice(["queued", "before_first_byte", "mid_stream"]) if cut else None
    body = json.dumps({"model": model, "stream": stream,
                       "messages": [{"role": "user", "content": "soak"}]}).encode()
    host, _, port = url.removeprefix("http://").partition(":")
    stream_ = await trio.open_tcp_stream(host, int(port))
    tally.sent += 1
    try:
        await stream_.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\nX-Relay-Priority: "
            + priority.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)
        if where == "queued":
            await trio.sleep(rng.uniform(0, 0.01))
            tally.cut[where] += 1
            return
        if where == "before_first_byte":
            with trio.move_on_after(rng.uniform(0.005, 0.05)):
                await stream_.receive_some(1)
            tally.cut[where] += 1
            return
        seen = b""
        with trio.fail_after(30):
            while True:
                chunk = await stream_.receive_some(65536)
                if not chunk:
                    break
                seen += chunk
                if where == "mid_stream" and b"data:" in seen:
                    tally.cut[where] += 1
                    return
        status = seen.split(b" ", 2)[1].decode() if seen.startswith(b"HTTP/1.1") else "?"
        tally.statuses[status] += 1
        if status == "500" or status == "?":
            tally.errors.append(f"{model}: {seen[:300]!r}")
    except trio.TooSlowError:
        tally.errors.append(f"{model}: no answer within 30 s (a hang)")
    except (trio.BrokenResourceError, OSError) as exc:
        tally.errors.append(f"{model}: connection failed: {exc!r}")
    finally:
        await stream_.aclose()


def task_names() -> Counter[str]:
    """Tasks alive now, but trio's own short-lived finalizers of abandoned async
    generators (httpx's, see pyproject's filterwarnings), which come and go by GC."""
    names: Counter[str] = Counter()

    def walk(task: trio.lowlevel.Task) -> None:
        if "asyncgen" not in task.name:
            names[task.name] += 1
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)
    walk(trio.lowlevel.current_root_task())
    return names


def count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def count_children() -> int:
    me = str(os.getpid())
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += fields[1] == me
    return total


async def soak(duration_s: float, *, concurrency: int = 12, seed: int = 17,
               quiet: bool = False) -> dict[str, Any]:
    """Run the soak; return its report (``problems`` empty when it passed)."""
    rng = random.Random(seed)
    tally = Tally()
    problems: list[str] = []
    fds_before, children_before = count_fds(), count_children()
    with tempfile.TemporaryDirectory() as tmp:
        records_path = Path(tmp) / "records.jsonl"
        tasks_before = task_names()
        async with trio.open_nursery() as outer:
            up: FakeUpstream = await outer.start(serve_fake_upstream)
            scripts(up)
            config = relay.parse_config(CONFIG.format(records=records_path, url=up.url),
                                        source="soak.toml")
            async with trio.open_nursery() as server:
                served = await server.start(functools.partial(relay.serve, config, port=0))
                deadline = trio.current_time() + duration_s
                last_report = trio.current_time()

                async def client() -> None:
                    while trio.current_time() < deadline:
                        await one_request(served.url, rng, tally)

                async with trio.open_nursery() as clients:
                    for _ in range(concurrency):
                        clients.start_soon(client)
                    while trio.current_time() < deadline:
                        await trio.sleep(min(10.0, max(0.0, deadline - trio.current_time())))
                        if not quiet and trio.current_time() - last_report >= 10:
                            last_report = trio.current_time()
                            print(f"  {tally.sent} requests, {sum(tally.cut.values())} cut",
                                  flush=True)
                # Quiescence: every stop path is bounded (grace, kill): wait for it.
                with trio.move_on_after(10):
                    for provider in served.relay.providers.values():
                        await provider.lane.wait_idle()
                lanes = {n: attrs.asdict(p.lane.statistics())
                         for n, p in served.relay.providers.items()}
                for name, s in lanes.items():
                    if s["running"] or s["queued"]:
                        problems.append(f"lane {name} not idle: {s}")
                with trio.move_on_after(5):
                    await up.wait_no_active_responses()
                if up.active_responses():
                    problems.append(f"{up.active_responses()} upstream responses still active")
                server.cancel_scope.cancel()
            with trio.move_on_after(5):
                await up.wait_all_closed()
            if up.open_connections:
                problems.append(f"{up.open_connections} upstream connections left open")
            outer.cancel_scope.cancel()
        tasks_after = task_names()
        recs = [json.loads(line) for line in records_path.read_text().splitlines() if line]
    if tasks_after - tasks_before:
        problems.append(f"tasks left over: {dict(tasks_after - tasks_before)}")
    fds_after, children_after = count_fds(), count_children()
    if fds_after > fds_before:
        problems.append(f"file descriptors: {fds_before} before, {fds_after} after")
    if children_after > children_before:
        problems.append(f"child processes: {children_before} before, {children_after} after")
    ids = Counter(r["id"] for r in recs)
    if any(n > 1 for n in ids.values()):
        problems.append("a request has more than one record")
    # A request cut while its bytes were in flight may never have reached relay; every
    # other one has exactly one record.
    if not tally.sent - tally.cut["queued"] <= len(recs) <= tally.sent:
        problems.append(f"{len(recs)} records for {tally.sent} requests")
    for r in recs:
        if r["stop_requested_at"] and r["run_ms"] is not None and not r["released_at"]:
            problems.append(f"record {r['id']}: stopped after it ran, no release time")
        if r["status"] == 500:
            problems.append(f"record {r['id']}: internal error")
    problems += tally.errors[:10]
    return {"requests": tally.sent, "cut": dict(tally.cut), "answers": dict(tally.statuses),
            "records": len(recs), "reasons": dict(Counter(str(r["reason"]) for r in recs)),
            "lanes": lanes, "duration_s": duration_s, "problems": problems}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=12)
    args = parser.parse_args()
    duration = args.minutes * 60 if args.minutes is not None else args.seconds
    print(f"soak: {duration:g} s, concurrency {args.concurrency}, 1 in {CUT_ONE_IN} cut off")
    report = trio.run(functools.partial(soak, duration, concurrency=args.concurrency))
    print(json.dumps(report, indent=2))
    print("PASS" if not report["problems"] else "FAIL")
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
