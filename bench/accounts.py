"""Accounts (SPEC L13): a provider with two or four keys, each metered apart, on real time.

    python -m bench.accounts                    # every row (about 5 minutes)
    python -m bench.accounts --steady-s 30      # a shorter steady load
    python -m bench.accounts --accounts 2       # two keys only

The fake provider (`tests/fakes/fake_accounts.py`) meters each key apart: 100 requests,
40,000 input and 16,000 output tokens a minute, answers at 100 tokens/s after 0.3 s — the
issue's. Each row runs on a fake of its own, against a relay with N accounts (one key
each; 32 lanes each), budgets configured per account or learned from the headers:

- burst: the 60 mixed requests of `bench.tokens` (10 of ~6,000 tokens, 50 of ~200) at once;
- steady: arrivals at twice one account's input limit for ``--steady-s`` seconds, with a
  conversation of 20 turns (each sent when the one before has ended) among them, and — in
  the "revoked" rows — one account's key revoked a third of the way in (it answers 401
  from then on).

Printed per row: the provider's 429s, the client failures, the makespan against an ideal
pacer that knows every account's buckets (it starts each request, in order, the moment
some account's buckets allow it), and the share of the conversation's turns on its most
used account. Targets (issue 34): 0 429s, 0 failures, makespan <= 1.15x the ideal's, the
conversation 100 % on one account.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import os
import statistics
import sys
import tempfile
from pathlib import Path

import attrs
import httpx
import trio

from bench import token_kit
from bench import tokens as bench_tokens
from bench.token_kit import Job, Row, workload
from bench.tokens import LIMITS, burst, steady

sys.path.insert(0, str(token_kit.ROOT / "tests"))

from fakes.fake_accounts import KeyedMetered, serve_keyed
from fakes.fake_metered import Bucket, Limits, prompt_tokens

import relay

LANES = 32  # each account's
CONVERSATION = "A conversation that stays on its account."

CONFIG = """
[server]
records = "{records}"
[providers.p]
adapter = "openai"
base_url = "{url}/v1"
{accounts}
[providers.p.profile]
lanes = {lanes}
queue_max = 1000
queue_timeout_s = 900
run_timeout_s = 900
{profile}
"""


def keys(n: int) -> dict[str, str]:
    return {f"BENCH_ACCOUNT_KEY_{i}": f"sk-bench-account-{i}" for i in range(n)}


def ideal(jobs: list[Job], limits: Limits, accounts: int, revoked: tuple[float, int] | None
          = None, step: float = 0.01) -> list[tuple[float, float]]:
    """Each job's (start, end) under a pacer that knows every account's buckets: in the
    order they become ready (a conversation's turn once the one before it has ended),
    each starts the moment some account's buckets allow it (a revoked account is not
    used from its revocation on)."""
    buckets = [{k: Bucket(v) for k, v in attrs.asdict(limits).items() if v}
               for _ in range(accounts)]
    for own in buckets:
        for bucket in own.values():
            bucket.now(0.0)
    pending: list[tuple[float, float, int]] = []  # (done at, out, account)
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(jobs)
    ready = [(job.at, n) for n, job in enumerate(jobs) if not job.after_previous]
    heapq.heapify(ready)
    t = 0.0
    while ready:
        at, n = heapq.heappop(ready)
        job = jobs[n]
        t = max(t, at)
        while True:
            for done in sorted(p for p in pending if p[0] <= t):
                pending.remove(done)
                for key in ("otpm", "tpm"):
                    if key in buckets[done[2]]:
                        buckets[done[2]][key].now(done[0])
                        buckets[done[2]][key].level -= done[1]
            usable = [i for i in range(accounts)
                      if revoked is None or t < revoked[0] or i != revoked[1]]
            fits = [i for i in usable if token_kit._fits(buckets[i], t, job.prompt)]
            if fits:
                break
            t += step
        account = max(fits, key=lambda i: buckets[i]["itpm"].now(t))
        token_kit._take(buckets[account], t, rpm=1, itpm=job.prompt, tpm=job.prompt)
        end = t + token_kit.FIRST_TOKEN_S + job.out / token_kit.TOKENS_PER_S
        pending.append((end, job.out, account))
        times[n] = (t, end)
        if n + 1 < len(jobs) and jobs[n + 1].after_previous:
            heapq.heappush(ready, (end, n + 1))
    return times


def conversation(start: float, turns: int = 20, gap: float = 0.0) -> list[Job]:
    """A conversation's turns: the first at ``start``, each next once the one before has
    ended; the history grows each turn."""
    jobs = []
    for turn in range(turns):
        messages = [{"role": "user", "content": CONVERSATION}]
        for i in range(turn):
            messages += [{"role": "assistant", "content": f"answer {i} " * 20},
                         {"role": "user", "content": f"question {i + 1} " * 20}]
        body = {"model": "p/m-out50", "max_tokens": 50, "messages": messages}
        jobs.append(Job(start + gap * turn if turn == 0 else 0.0, body,
                        prompt_tokens(messages), 50, after_previous=turn > 0))
    return jobs


def steady_with_conversation(seconds: float) -> list[Job]:
    """`bench.tokens`' steady load, a conversation's 20 turns threaded through it (each
    turn sent once the one before has ended, the first at the start)."""
    load = steady(seconds)
    turns = conversation(0.0)
    # The workload sends a job at its ``at`` and, after_previous, once the job before it
    # in the list has ended: the turns go first in the list, one after the other.
    return [*turns, *load]


@attrs.define
class Result:
    row: Row
    share: float | None  # the conversation's turns on its most used account


async def one_row(name: str, n: int, profile: str, plan: list[Job], tmp: Path,
                  revoke_at: float | None, results: list[Result]) -> None:
    async with trio.open_nursery() as nursery:
        fake: KeyedMetered = await nursery.start(functools.partial(serve_keyed, LIMITS))
        fake.tokens_per_s, fake.first_token_s = token_kit.TOKENS_PER_S, token_kit.FIRST_TOKEN_S
        accounts = "".join(f'[[providers.p.accounts]]\nname = "k{i}"\napi_key_env = "{env}"\n'
                           for i, env in enumerate(keys(n)))
        text = CONFIG.format(records=tmp / f"{name}.jsonl".replace(" ", "_"),
                             url=fake.base_url, accounts=accounts, lanes=LANES,
                             profile=profile)
        config = relay.parse_config(text, source=f"{name}.toml", base_dir=tmp)
        served = await nursery.start(functools.partial(relay.serve, config, port=0))
        if revoke_at is not None:
            async def revoke() -> None:
                await trio.sleep(revoke_at)
                fake.revoked.add(keys(n)["BENCH_ACCOUNT_KEY_0"])
            nursery.start_soon(revoke)
        outcomes = await workload([str(served.url)], plan)
        revoked = (revoke_at, 0) if revoke_at is not None else None
        times = ideal(plan, LIMITS, n, revoked)
        row = token_kit.row("accounts", name, f"{n} accounts", plan, outcomes,
                            sum(fake.refused.values()), times, LIMITS)
        used = fake.conversations.get(CONVERSATION, [])
        share = (max(used.count(k) for k in set(used)) / len(used)) if used else None
        results.append(Result(row, share))
        nursery.cancel_scope.cancel()


async def direct_burst(n: int, results: list[Result]) -> None:
    """The burst sent straight to the provider, each request with the next key in turn
    (no pacing: a client that rotates keys blindly)."""
    plan = burst()
    async with trio.open_nursery() as nursery:
        fake: KeyedMetered = await nursery.start(functools.partial(serve_keyed, LIMITS))
        fake.tokens_per_s, fake.first_token_s = token_kit.TOKENS_PER_S, token_kit.FIRST_TOKEN_S
        outcomes = [token_kit.Outcome() for _ in plan]
        secrets = list(keys(n).values())
        async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(900.0),
                                     limits=httpx.Limits(max_connections=500)) as client:
            async def one(i: int, job: Job) -> None:
                body = {**job.body, "model": str(job.body["model"]).removeprefix("p/")}
                outcome = outcomes[i]
                outcome.sent = trio.current_time()
                r = await client.post(fake.base_url + token_kit.CHAT, json=body, headers={
                    "authorization": f"Bearer {secrets[i % n]}"})
                if job.stream:  # (the fake streams; read it whole)
                    await r.aread()
                outcome.status = r.status_code
                outcome.ok = r.status_code == 200
                outcome.ended = trio.current_time()
            async with trio.open_nursery() as sending:
                for i, job in enumerate(plan):
                    sending.start_soon(one, i, job)
        row = token_kit.row("accounts", "burst, direct (keys in turn)", f"{n} accounts",
                            plan, outcomes, sum(fake.refused.values()),
                            ideal(plan, LIMITS, n), LIMITS)
        results.append(Result(row, None))
        nursery.cancel_scope.cancel()


async def main(counts: list[int], steady_s: float, only: str | None,
               keep: str | None) -> None:
    bench_tokens.ONE_MODEL = True  # one model: the fake meters every request together
    configured = "rpm = 100\nitpm = 40000\notpm = 16000"
    rows: list[tuple[str, int, str, list[Job], float | None]] = []
    for n in counts:
        for how, profile in (("configured", configured), ("headers", "")):
            rows.append((f"burst, {how}", n, profile, burst(), None))
            rows.append((f"steady, {how}", n, profile, steady_with_conversation(steady_s),
                         None))
        rows.append(("steady, headers, revoked", n, "", steady_with_conversation(steady_s),
                     steady_s / 3))
    if only:
        rows = [r for r in rows if any(w.strip() in r[0] for w in only.split(","))]
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        if keep:
            tmp = keep
        for env, key in keys(max(counts)).items():
            os.environ[env] = key
        # A burst's makespan is a few seconds: each runs alone (first a client that
        # sends it straight to the provider, dealing the keys round-robin: the floor of
        # what this process can send and the fake answer); the steady rows together.
        for n in counts:
            await direct_burst(n, results)
        for name, n, profile, plan, revoke_at in rows:
            if name.startswith("burst"):
                await one_row(name, n, profile, plan, Path(tmp), revoke_at, results)
        async with trio.open_nursery() as nursery:
            for name, n, profile, plan, revoke_at in rows:
                if not name.startswith("burst"):
                    nursery.start_soon(one_row, name, n, profile, plan, Path(tmp),
                                       revoke_at, results)
    results.sort(key=lambda r: (r.row.client, r.row.workload))
    print(f"accounts: each key {LIMITS.rpm:g} requests, {LIMITS.itpm:,.0f} input and "
          f"{LIMITS.otpm:,.0f} output tokens a minute; {LANES} lanes an account; steady "
          f"{steady_s:g} s at twice one key's input limit, a 20-turn conversation in it")
    print("| accounts | workload | upstream 429s | client failures | makespan vs ideal "
          "pacer | p50 | p99 | conversation on one account |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        r = result.row
        share = f"{100 * result.share:.0f} %" if result.share is not None else "-"
        reasons = (" (" + ", ".join(f"{k} {v}" for k, v in r.reasons.items()) + ")"
                   if r.reasons else "")
        print(f"| {r.client} | {r.workload} | {r.rejected} | {r.failures}{reasons} | "
              f"{r.makespan:.1f} s vs {r.pacer:.1f} s = {r.makespan / r.pacer:.2f}x | "
              f"{r.p50:.2f} s | {r.p99:.2f} s | {share} |")
    worst = max(r.row.makespan / r.row.pacer for r in results)
    print(f"worst makespan ratio {worst:.2f}x; median "
          f"{statistics.median(r.row.makespan / r.row.pacer for r in results):.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accounts", default="2,4", help="account counts (default 2,4)")
    parser.add_argument("--steady-s", type=float, default=90.0)
    parser.add_argument("--only", help="rows whose workload contains one of these words "
                        "(comma-separated: burst, steady, revoked, configured, headers)")
    parser.add_argument("--keep", help="keep the relays' records in this folder")
    args = parser.parse_args()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    trio.run(main, [int(n) for n in args.accounts.split(",")], args.steady_s, args.only,
             args.keep)
