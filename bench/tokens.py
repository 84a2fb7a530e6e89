"""Token budgets (SPEC L12): staying inside a provider's published limits, measured.

    python -m bench.tokens                   # the full run (burst, then 90 s steady)
    python -m bench.tokens --steady-s 30     # a shorter steady phase
    python -m bench.tokens --only shared     # only the clients whose name has "shared"
    python -m bench.tokens --keep DIR        # the relays' records kept in DIR

A fake provider (tests/fakes/fake_metered.py) publishes 100 requests, 40,000 input and 16,000
output tokens a minute (continuous buckets) on real time. Two workloads, each against six
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
- **direct**: the client talks to the provider itself;
- **3 relays shared, budgets configured**, **3 relays shared, headers only** and **3
  relays shared, neither**: three ``relay.serve`` in this process, each with its own
  config naming the same provider with ``shared = true`` (SPEC L11) and the same
  figures (and provider) as the three rows above, coordinated
  through one ``redis-server`` the bench starts on a free loopback port (and stops at the
  end; without ``redis-server`` on the PATH these rows are skipped, said so); the
  workload's requests are dealt round-robin to the three relays' URLs (so every
  6,000-token request of the burst goes to the first relay: the others see only small
  ones; the headers-only warm-up: one small request through each relay). A coordination
  server grants no slot within one lease of its own start (SPEC L11), so these wait out
  the first ``LEASE_S`` seconds of the fresh server before their first request.

``--only NAME[,NAME]`` runs the clients whose name contains one of the NAMEs (case
ignored); every client by default. Every relay has 32 lanes (a shared provider's are
counted across its three relays). The clients never retry. For each, it prints:
upstream 429s, client-visible failures, achieved input tokens a minute as a share of the
limit, the makespan against the theoretical minimum (total input / limit) and against a
perfect pacer's (one that knows every request's exact size and starts each, in order,
the moment the provider's buckets allow: a simulation of the same buckets), and p50/p99
latency. Each client has its own provider (fresh buckets); they run side by side.
"""

from __future__ import annotations

import argparse
import functools
import itertools
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

from fakes.fake_metered import Bucket, Limits, Metered, prompt_tokens, prose, serve_metered  # noqa: E402
from helpers.redis_server import REDIS, RedisServer  # noqa: E402

import relay  # noqa: E402

LIMITS = Limits(rpm=100, itpm=40_000, otpm=16_000)
LANES = 32
LEASE_S = 10.0  # the shared relays' coordination_lease_s (relay's default)
FIRST_TOKEN_S = 0.3
TOKENS_PER_S = 100.0

CONFIG = """
[server]
records = "{records}"
{server}
[providers.p]
adapter = "openai"
base_url = "{url}/v1"
{shared}
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


async def workload(urls: list[str], jobs: list[Job]) -> list[Outcome]:
    """Every job, each at its time, dealt round-robin to ``urls``."""
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(900.0),
                                 limits=limits) as client:
        outcomes = [Outcome(0.0) for _ in jobs]
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for job, outcome, url in zip(jobs, outcomes, itertools.cycle(urls)):
                nursery.start_soon(run_one, client, url, job, start, outcome)
    return outcomes


async def warm_up(urls: list[str]) -> None:
    """Three small requests (dealt round-robin): relay sees the provider's headers."""
    async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
        for i, url in zip(range(3), itertools.cycle(urls)):
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


@attrs.frozen
class Client:
    name: str
    profile: str | None  # None: the client talks to the provider itself
    headers: bool = True  # the provider sends its rate-limit headers
    relays: int = 1       # more than one: that many relays share the provider (L11)


async def one_client(client: Client, jobs: dict[str, list[Job]], rows: list[Row], tmp: Path,
                     redis: RedisServer | None, quiet_until: float) -> None:
    name = client.name
    async with trio.open_nursery() as nursery:
        fake: Metered = await nursery.start(functools.partial(
            serve_metered, LIMITS, send_headers=client.headers))
        fake.tokens_per_s, fake.first_token_s = TOKENS_PER_S, FIRST_TOKEN_S
        if client.profile is None:  # (the provider ignores the "p/" of the model's name)
            urls = [f"{fake.base_url}/v1/chat/completions"]
        else:
            urls = []
            for n in range(client.relays):
                server, shared = "", ""
                if client.relays > 1:
                    assert redis is not None
                    prefix = "".join(c for c in name if c.isalnum())  # its own keys
                    server = (f'coordination_url = "{redis.url}"\nrelay_id = "r{n}"\n'
                              f'coordination_prefix = "{prefix}"\n'
                              f"coordination_lease_s = {LEASE_S}")
                    shared = "shared = true"
                text = CONFIG.format(records=tmp / f"{name}.{n}.jsonl", url=fake.base_url,
                                     lanes=LANES, profile=client.profile, server=server,
                                     shared=shared)
                config = relay.parse_config(text, source=f"{name}.{n}.toml", base_dir=tmp)
                served = await nursery.start(functools.partial(relay.serve, config, port=0))
                urls.append(f"{served.url}/v1/chat/completions")
            if client.relays > 1:
                # A coordination server grants nothing within one lease of its own start
                # (SPEC L11's quiet period): a start-up cost, not the workload's.
                await trio.sleep_until(quiet_until)
            if "headers" in name:
                await warm_up(urls)
        for n, (workload_name, plan) in enumerate(jobs.items()):
            if n:
                await trio.sleep(61)  # the buckets fill again before the next workload
            before = (len(fake.rejected), fake.input_served)
            outcomes = await workload(urls, plan)
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


CONFIGURED = "rpm = 100\nitpm = 40000\notpm = 16000"
CLIENTS = [
    Client("relay, budgets configured", CONFIGURED),
    Client("relay, headers only", ""),
    Client("relay, neither", "rpm = 100", headers=False),
    Client("direct", None),
    Client("3 relays shared, budgets configured", CONFIGURED, relays=3),
    Client("3 relays shared, headers only", "", relays=3),
    Client("3 relays shared, neither", "rpm = 100", headers=False, relays=3),
]


def chosen(only: str | None) -> list[Client]:
    if not only:
        return CLIENTS
    names = [n.strip().lower() for n in only.split(",") if n.strip()]
    picked = [c for c in CLIENTS if any(n in c.name.lower() for n in names)]
    if not picked:
        raise SystemExit(f"--only {only}: no client's name contains it; the clients: "
                         + "; ".join(c.name for c in CLIENTS))
    return picked


async def main(steady_s: float, only: str | None, keep: str | None) -> None:
    logging.getLogger("relay").setLevel(logging.WARNING)
    clients = chosen(only)
    if REDIS is None and any(c.relays > 1 for c in clients):
        print("redis-server (or valkey-server) is not on the PATH: the shared rows ("
              + "; ".join(c.name for c in clients if c.relays > 1) + ") are skipped "
              "(apt-get install redis-server)", file=sys.stderr)
        clients = [c for c in clients if c.relays == 1]
        if not clients:
            return
    jobs = {"burst": burst(), "steady": steady(steady_s)}
    rows: list[Row] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or scratch
        redis = None
        if any(c.relays > 1 for c in clients):
            assert REDIS is not None
            redis = RedisServer(REDIS, Path(tmp) / "redis")
            redis.start()
        quiet_until = trio.current_time() + LEASE_S + 0.5
        try:
            async with trio.open_nursery() as nursery:
                for client in clients:
                    nursery.start_soon(one_client, client, jobs, rows, Path(tmp), redis,
                                       quiet_until)
        finally:
            if redis is not None:
                redis.stop()
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
    parser.add_argument("--only", metavar="NAME[,NAME]",
                        help="run only the clients whose name contains one of these "
                        "(case ignored), e.g. 'shared' or 'direct,headers only'")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the relays' records (<client>.<n>.jsonl) in DIR")
    args = parser.parse_args()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    trio.run(main, args.steady_s, args.only, args.keep)
