"""Token budgets (SPEC L12): staying inside a provider's published limits, measured.

    python -m bench.tokens                   # the full run (burst, then 90 s steady)
    python -m bench.tokens --steady-s 30     # a shorter steady phase

A fake provider (tests/fake_metered.py) publishes 100 requests, 40,000 input and 16,000
output tokens a minute (continuous buckets) on real time. Two workloads, each against four
clients, all in one run:

- **burst**: 60 requests at once — 10 of about 6,000 tokens, 50 of about 200; 30 %
  streamed; answers of 400 and 150 tokens;
- **steady**: ``--steady-s`` seconds (90 by default) of arrivals at twice the input limit
  (the same mix, evenly spaced), then until every request has ended;

and the clients:

- **relay, budgets configured**: ``rpm = 100``, ``itpm = 40000``, ``otpm = 16000``;
- **relay, headers only**: nothing configured; three small requests first show relay the
  provider's rate-limit headers;
- **relay, neither**: the provider sends no rate-limit header at all (its 429s still say
  "try again in …" in their body), relay has only ``rpm = 100``;
- **direct**: the client talks to the provider itself.

Every relay has 32 lanes. The clients never retry. For each, it prints: upstream 429s,
client-visible failures, achieved input tokens a minute as a share of the limit, the
makespan against the theoretical minimum (total input / limit) and against a perfect
pacer's (one that knows every request's exact size and starts each, in order, the moment
the provider's buckets allow: a simulation of the same buckets), and p50/p99 latency.
Each client has its own provider (fresh buckets); the four run side by side.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fake_metered import Bucket, Limits, Metered, prompt_tokens, prose, serve_metered  # noqa: E402

import relay  # noqa: E402

LIMITS = Limits(rpm=100, itpm=40_000, otpm=16_000)
LANES = 32
FIRST_TOKEN_S = 0.3
TOKENS_PER_S = 100.0

CONFIG = """
[server]
records = "{records}"
[providers.p]
adapter = "openai"
base_url = "{url}/v1"
[providers.p.profile]
lanes = {lanes}
queue_max = 1000
queue_timeout_s = 900
run_timeout_s = 900
{profile}
"""


@attrs.frozen
class Job:
    at: float        # seconds after the workload's start
    content: str
    out: int
    stream: bool

    @property
    def body(self) -> dict[str, Any]:
        return {"model": f"p/m-out{self.out}", "stream": self.stream,
                "messages": [{"role": "user", "content": self.content}]}


@attrs.define
class Outcome:
    sent: float
    ended: float = 0.0
    ok: bool = False
    status: int = 0


def one(i: int, seed: int) -> tuple[str, int]:
    """The i-th request of the mix: 1 in 6 of ~6,000 tokens (answer 400), the rest ~200
    (answer 150) — in 60 of them, 10 large and 50 small, as the issue's burst."""
    large = i % 6 == 0
    return prose(6000 if large else 200, seed + i), 400 if large else 150


def burst() -> list[Job]:
    return [Job(0.0, *one(i, 0), stream=i % 10 < 3) for i in range(60)]


def steady(seconds: float) -> list[Job]:
    """Arrivals at twice the input limit, evenly spaced by their own size."""
    rate = 2 * LIMITS.itpm / 60.0  # input tokens a second
    jobs, at, i = [], 0.0, 0
    while at < seconds:
        text, answer = one(i, 1000)
        jobs.append(Job(at, text, answer, i % 10 < 3))
        at += prompt_tokens([{"role": "user", "content": text}]) / rate
        i += 1
    return jobs


def perfect_pacer(jobs: list[Job]) -> float:
    """The makespan of a pacer that knows every request's exact size and starts each, in
    order, the moment the provider's buckets allow (the same buckets, simulated)."""
    buckets = {k: Bucket(v) for k, v in attrs.asdict(LIMITS).items() if v}
    for b in buckets.values():
        b.now(0.0)
    t, end, pending = 0.0, 0.0, []  # pending: (done_at, out)
    step = 0.01
    for job in jobs:
        prompt = prompt_tokens([{"role": "user", "content": job.content}])
        t = max(t, job.at)
        while True:
            for done in [p for p in pending if p[0] <= t]:
                pending.remove(done)
                buckets["otpm"].now(done[0])
                buckets["otpm"].level -= done[1]
            if (buckets["rpm"].now(t) >= 1 and buckets["itpm"].now(t) >= prompt
                    and buckets["otpm"].now(t) > 0):
                break
            t += step
        buckets["rpm"].level -= 1
        buckets["itpm"].level -= prompt
        done_at = t + FIRST_TOKEN_S + job.out / TOKENS_PER_S
        pending.append((done_at, job.out))
        end = max(end, done_at)
    return end


async def run_one(client: httpx.AsyncClient, url: str, job: Job, start: float,
                  outcome: Outcome) -> None:
    await trio.sleep_until(start + job.at)
    outcome.sent = trio.current_time()
    try:
        if job.stream:
            async with client.stream("POST", url, json=job.body) as r:
                outcome.status = r.status_code
                text = "".join([piece async for piece in r.aiter_text()])
                outcome.ok = (r.status_code == 200 and "data: [DONE]" in text
                              and '"error"' not in text)
        else:
            r = await client.post(url, json=job.body)
            outcome.status = r.status_code
            outcome.ok = r.status_code == 200 and "choices" in r.json()
    except httpx.HTTPError:
        outcome.ok = False
    outcome.ended = trio.current_time()


async def workload(url: str, jobs: list[Job]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(900.0),
                                 limits=limits) as client:
        outcomes = [Outcome(0.0) for _ in jobs]
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for job, outcome in zip(jobs, outcomes, strict=True):
                nursery.start_soon(run_one, client, url, job, start, outcome)
    return outcomes


async def warm_up(url: str) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
        for i in range(3):
            r = await client.post(url, json={"model": "p/m-out20", "messages": [
                {"role": "user", "content": f"hello {i}"}]})
            r.raise_for_status()


@attrs.define
class Row:
    client: str
    workload: str
    rejected: int
    failures: int
    share: float
    makespan: float
    minimum: float
    pacer: float
    p50: float
    p99: float


def row(client: str, name: str, jobs: list[Job], fake: Metered, before: tuple[int, int],
        outcomes: list[Outcome]) -> Row:
    rejected = len(fake.rejected) - before[0]
    served = fake.input_served - before[1]
    start = min(o.sent for o in outcomes)
    makespan = max(o.ended for o in outcomes) - start
    total = sum(prompt_tokens([{"role": "user", "content": j.content}]) for j in jobs)
    latencies = sorted(o.ended - o.sent for o in outcomes)
    return Row(client, name, rejected, sum(not o.ok for o in outcomes),
               served / makespan * 60 / LIMITS.itpm, makespan, total / LIMITS.itpm * 60,
               perfect_pacer(jobs), statistics.median(latencies),
               latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))])


async def one_client(name: str, profile: str | None, headers: bool, jobs: dict[str, list[Job]],
                     rows: list[Row], tmp: Path) -> None:
    async with trio.open_nursery() as nursery:
        fake: Metered = await nursery.start(functools.partial(
            serve_metered, LIMITS, send_headers=headers))
        fake.tokens_per_s, fake.first_token_s = TOKENS_PER_S, FIRST_TOKEN_S
        if profile is None:  # (the provider ignores the "p/" of the model's name)
            url = f"{fake.base_url}/v1/chat/completions"
        else:
            text = CONFIG.format(records=tmp / f"{name}.jsonl", url=fake.base_url,
                                 lanes=LANES, profile=profile)
            config = relay.parse_config(text, source=f"{name}.toml", base_dir=tmp)
            served = await nursery.start(functools.partial(relay.serve, config, port=0))
            url = f"{served.url}/v1/chat/completions"
            if "headers" in name:
                await warm_up(url)
        for n, (workload_name, plan) in enumerate(jobs.items()):
            if n:
                await trio.sleep(61)  # the buckets fill again before the next workload
            before = (len(fake.rejected), fake.input_served)
            outcomes = await workload(url, plan)
            rows.append(row(name, workload_name, plan, fake, before, outcomes))
        nursery.cancel_scope.cancel()


def print_table(rows: list[Row]) -> None:
    print("| workload | client | upstream 429s | client failures | input tokens/min "
          "(share of limit) | makespan | vs tokens/limit | vs perfect pacer | p50 | p99 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.workload, r.client)):
        print(f"| {r.workload} | {r.client} | {r.rejected} | {r.failures} | "
              f"{r.share * LIMITS.itpm:,.0f} ({r.share:.0%}) | {r.makespan:.1f} s | "
              f"{r.makespan / r.minimum:.2f}x of {r.minimum:.1f} s | "
              f"{r.makespan / r.pacer:.2f}x of {r.pacer:.1f} s | {r.p50:.1f} s | "
              f"{r.p99:.1f} s |")


async def main(steady_s: float) -> None:
    logging.getLogger("relay").setLevel(logging.WARNING)
    jobs = {"burst": burst(), "steady": steady(steady_s)}
    clients: list[tuple[str, str | None, bool]] = [
        ("relay, budgets configured", "rpm = 100\nitpm = 40000\notpm = 16000", True),
        ("relay, headers only", "", True),
        ("relay, neither", "rpm = 100", False),
        ("direct", None, True),
    ]
    rows: list[Row] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            for name, profile, headers in clients:
                nursery.start_soon(one_client, name, profile, headers, jobs, rows, Path(tmp))
    total = {k: sum(prompt_tokens([{"role": "user", "content": j.content}]) for j in v)
             for k, v in jobs.items()}
    print(f"limits: {LIMITS.rpm:g} requests, {LIMITS.itpm:,.0f} input and "
          f"{LIMITS.otpm:,.0f} output tokens a minute; {LANES} lanes; answers at "
          f"{TOKENS_PER_S:g} tokens/s after {FIRST_TOKEN_S:g} s; burst: 60 requests "
          f"({total['burst']:,} input tokens); steady: {len(jobs['steady'])} requests "
          f"({total['steady']:,} input tokens) over {steady_s:g} s")
    print_table(rows)
    print(f"({time.monotonic() - began:.0f} s in all)")
    print(json.dumps([attrs.asdict(r) for r in rows]), file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steady-s", type=float, default=90.0)
    args = parser.parse_args()
    trio.run(main, args.steady_s)
