"""Token budgets (SPEC L12, L12a): staying inside a provider's published limits, measured.

    python -m bench.tokens                          # every scenario, one after the other
    python -m bench.tokens --scenario cache         # one (or several: cache,models)
    python -m bench.tokens --scenario classic --steady-s 30 --only shared
    python -m bench.tokens --scenario classic --one-model  # one model name, not two
    python -m bench.tokens --keep DIR               # the relays' records kept in DIR

Every scenario runs on real time against the fake provider of tests/fakes/fake_metered.py
(continuous buckets per minute, rate-limit headers, realistic 429s), answers at 100
tokens a second after 0.3 s, relays with 32 lanes, clients that never retry; each client
has its own provider (fresh buckets) and they run side by side. Each row: the 429s the
provider sent that client's requests; the requests that did not end in a whole answer
(their reasons); the false ``request_too_large`` (refused by relay though the provider
would have taken them); the makespan (first request sent to last answer read) against
an **ideal pacer**'s — a simulation of the provider's own buckets that knows the truth
(each request's size as the provider counts it, its uncached part, each model's own
limits, what another client takes) and starts each request, in order within its model,
the moment the buckets allow (`bench.token_kit.ideal`); p50/p99 latency.

- **classic** (issue 26's workload; `--only NAME[,NAME]` picks its clients): 100
  requests, 40,000 input and 16,000 output tokens a minute. *burst*: 60 requests at once
  (10 of ~6,000 tokens answered in 400, 50 of ~200 answered in 150; 30 % streamed);
  *steady*: ``--steady-s`` seconds of the same mix at twice the input limit. Clients:
  relay with the budgets configured (``rpm = 100``, ``itpm = 40000``, ``otpm = 16000``);
  relay with headers only (three small requests first); relay with neither (the
  provider sends no rate-limit header, relay has ``rpm = 100``); direct; and each relay
  row again as three relays sharing the provider through one ``redis-server`` (SPEC L11;
  skipped, said so, without ``redis-server``; their requests dealt round-robin, after the
  coordination server's first lease). The two answer lengths are two model names
  (``m-out400``, ``m-out150``) that the provider meters together, as before (relay
  keeps a budget per model: see docs/tokens.md); ``--one-model`` sends every request
  to ``m-out400`` with its answer cut by ``max_tokens`` (and the warm-up to it too).
- **cache**: a Claude-Code-like conversation through relay's Messages front
  (``/v1/messages``, adapter ``anthropic``): a 30,000-token system prompt and the history
  marked with ``cache_control`` (the system prompt and the last message), 20 turns one
  after the other, each ~2,000 tokens more (prompts from ~40,000 to ~78,000 tokens,
  95-97 % read from the provider's cache), 200-token streamed answers, ``max_tokens``
  4096; the provider: 50 requests, 30,000 input and 8,000 output tokens a minute, its
  prompt cache on (``cache_s = 300``), warmed by a direct request (the agent's earlier
  session; then the buckets are refilled, the cache kept). Clients: relay headers only,
  relay with the budgets configured, direct. The ideal pacer knows the cache: each turn
  starts when its uncached part fits.
- **models**: one provider entry, two models metered apart, ``small`` 6,000 and ``big``
  600,000 tokens a minute (headers on, nothing configured); ``--steady-s`` seconds of
  arrivals, small at twice its limit (~1,400-token prompts), big at half of its (~6,000),
  100-token answers. Clients: relay with both models' traffic mixed, relay with each
  model's alone, direct (mixed); a row per model: "neither slowed by the other" is the
  mixed row against the alone row and the ideal pacer.
- **korean 1.5** / **korean 0.5**: classic's burst and steady mixes in Hangul, which the
  provider counts at 1.5 and at 0.5 characters a token (relay's estimate, before it
  learns: a character a token), one model, answers cut by ``max_tokens``. Clients:
  relay configured, relay headers only (three small Korean requests first), direct.
- **second-client**: classic's limits; relay's traffic (classic's steady mix, one model)
  at twice the input limit for ``--steady-s`` seconds, while another client sends
  ~1,000-token requests straight to the provider on the same key, 30 % of the input
  limit, never retried. Upstream 429s: relay's requests'; the other client's in the
  row's note. Clients: relay headers only, relay with the account's figures configured,
  relay with 70 % of them configured (room left for the other tool).

Every new scenario's relay profile has ``first_starts = 2``, as relay's cloud profiles
(openai, anthropic, gemini) have. A JSON list of the rows goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import httpx
import trio

from bench import token_scenarios
from bench.token_kit import (
    CHAT,
    FIRST_TOKEN_S,
    TOKENS_PER_S,
    Job,
    Row,
    ideal,
    long_prose,
    print_rows,
    row,
    start_relay,
    workload,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakes.fake_metered import Limits, Metered, prompt_tokens, serve_metered
from helpers.redis_server import REDIS, RedisServer

LIMITS = Limits(rpm=100, itpm=40_000, otpm=16_000)
LANES = 32
LEASE_S = 10.0  # the shared relays' coordination_lease_s (relay's default)


def one(i: int, seed: int) -> tuple[str, int]:
    """The i-th request of the mix: 1 in 6 of ~6,000 tokens (answer 400), the rest ~200
    (answer 150) — in 60 of them, 10 large and 50 small, as the issue's burst."""
    large = i % 6 == 0
    return long_prose(6000 if large else 200, seed + i), 400 if large else 150


ONE_MODEL = False  # --one-model: every request to m-out400, answers cut by max_tokens


def job(at: float, content: str, out: int, stream: bool) -> Job:
    messages = [{"role": "user", "content": content}]
    body: dict[str, object] = {"model": f"p/m-out{out}", "stream": stream,
                               "messages": messages}
    if ONE_MODEL:
        body.update(model="p/m-out400", max_tokens=out)
    return Job(at, body, prompt_tokens(messages), out)


def burst() -> list[Job]:
    return [job(0.0, *one(i, 0), stream=i % 10 < 3) for i in range(60)]


def steady(seconds: float) -> list[Job]:
    """Arrivals at twice the input limit, evenly spaced by their own size."""
    rate = 2 * LIMITS.itpm / 60.0  # input tokens a second
    jobs, at, i = [], 0.0, 0
    while at < seconds:
        jobs.append(job(at, *one(i, 1000), stream=i % 10 < 3))
        at += jobs[-1].prompt / rate
        i += 1
    return jobs


async def warm_up(urls: list[str]) -> None:
    """Three small requests (dealt round-robin): relay sees the provider's headers."""
    async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
        for i, url in zip(range(3), itertools.cycle(urls), strict=False):
            model = "p/m-out400" if ONE_MODEL else "p/m-out20"
            r = await client.post(url + CHAT, json={"model": model, "max_tokens": 20,
                                                    "messages": [{"role": "user",
                                                                  "content": f"hello {i}"}]})
            r.raise_for_status()


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
            urls = [fake.base_url]
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
                urls.append(await start_relay(nursery, tmp, f"{name}.{n}", fake,
                                              profile=client.profile, lanes=LANES,
                                              server=server, shared=shared))
            if client.relays > 1:
                # A coordination server grants nothing within one lease of its own start
                # (SPEC L11's quiet period): a start-up cost, not the workload's.
                await trio.sleep_until(quiet_until)
            if "headers" in name:
                await warm_up(urls)
        for n, (workload_name, plan) in enumerate(jobs.items()):
            if n:
                await trio.sleep(61)  # the buckets fill again before the next workload
            before = len(fake.rejected)
            outcomes = await workload(urls, plan)
            rows.append(row("classic", workload_name, name, plan, outcomes,
                            len(fake.rejected) - before, ideal(plan, LIMITS), LIMITS))
        nursery.cancel_scope.cancel()


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


async def classic(tmp: Path, steady_s: float, rows: list[Row], only: str | None) -> None:
    clients = chosen(only)
    if REDIS is None and any(c.relays > 1 for c in clients):
        print("redis-server (or valkey-server) is not on the PATH: the shared rows ("
              + "; ".join(c.name for c in clients if c.relays > 1) + ") are skipped "
              "(apt-get install redis-server)", file=sys.stderr)
        clients = [c for c in clients if c.relays == 1]
        if not clients:
            return
    jobs = {"burst": burst(), "steady": steady(steady_s)}
    redis = None
    if any(c.relays > 1 for c in clients):
        assert REDIS is not None
        redis = RedisServer(REDIS, tmp / "redis")
        redis.start()
    quiet_until = trio.current_time() + LEASE_S + 0.5
    try:
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(one_client, client, jobs, rows, tmp, redis, quiet_until)
    finally:
        if redis is not None:
            redis.stop()
    total = {k: sum(j.prompt for j in v) for k, v in jobs.items()}
    print(f"classic: {LIMITS.rpm:g} requests, {LIMITS.itpm:,.0f} input and "
          f"{LIMITS.otpm:,.0f} output tokens a minute; {LANES} lanes; answers at "
          f"{TOKENS_PER_S:g} tokens/s after {FIRST_TOKEN_S:g} s; burst: 60 requests "
          f"({total['burst']:,} input tokens); steady: {len(jobs['steady'])} requests "
          f"({total['steady']:,} input tokens) over {steady_s:g} s")


Scenario = Callable[[Path, float, list[Row]], Awaitable[None]]
SCENARIOS: dict[str, Scenario | None] = {
    "cache": token_scenarios.cache,
    "models": token_scenarios.models,
    "korean": token_scenarios.korean,
    "second-client": token_scenarios.second_client,
    "classic": None,  # (takes --only)
}


async def main(scenarios: list[str], steady_s: float, only: str | None,
               keep: str | None) -> None:
    logging.getLogger("relay").setLevel(logging.WARNING)
    os.environ.setdefault("FAKE_METERED_KEY", "sk-fake-metered")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(keep or scratch)
        for name in scenarios:
            began, before = time.monotonic(), len(rows)
            run = SCENARIOS[name]
            if run is None:
                await classic(tmp, steady_s, rows, only)
            else:
                await run(tmp, steady_s, rows)
            print(f"({name}: {time.monotonic() - began:.0f} s)")
            print_rows(rows[before:])
            print(flush=True)
    print(json.dumps([attrs.asdict(r) for r in rows]), file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--scenario", default="all", metavar="NAME[,NAME]",
                        help="which: " + ", ".join(SCENARIOS) + ", or all (the default)")
    parser.add_argument("--steady-s", type=float, default=90.0)
    parser.add_argument("--only", metavar="NAME[,NAME]",
                        help="classic: run only the clients whose name contains one of "
                        "these (case ignored), e.g. 'shared' or 'direct,headers only'")
    parser.add_argument("--one-model", action="store_true",
                        help="classic: every request names one model (m-out400), the "
                        "answers cut by max_tokens, instead of two models the provider "
                        "meters together")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the relays' records (<client>.jsonl) in DIR")
    args = parser.parse_args()
    picked = list(SCENARIOS) if args.scenario == "all" else [
        s.strip() for s in args.scenario.split(",") if s.strip()]
    unknown = [s for s in picked if s not in SCENARIOS]
    if unknown:
        parser.error(f"--scenario: no {', '.join(unknown)}; the scenarios: "
                     + ", ".join(SCENARIOS) + ", all")
    ONE_MODEL = args.one_model
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    trio.run(main, picked, args.steady_s, args.only, args.keep)
