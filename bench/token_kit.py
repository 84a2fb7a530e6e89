"""The parts `bench.tokens`' scenarios share: a job, its outcome, a workload sent on real
time, the ideal pacer (a simulation of the fake provider's own buckets), a relay started
in this process, a row of the table.

The ideal pacer knows the truth: every request's size as the provider counts it (its
uncached part where the provider reads the rest from its cache), each model's own limits,
and what another client on the same key takes. It starts each request, in order within
its model, the moment the provider's buckets allow, and its answer ends
``first_token_s + out / tokens_per_s`` later, as the fake's does.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakes.fake_metered import Bucket, Limits, Metered, prose  # noqa: E402

import relay  # noqa: E402

__all__ = ["FIRST_TOKEN_S", "TOKENS_PER_S", "Background", "Job", "Outcome", "Row", "ideal",
           "long_prose", "print_rows", "row", "start_relay", "workload"]

FIRST_TOKEN_S = 0.3
TOKENS_PER_S = 100.0
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"

CONFIG = """
[server]
records = "{records}"
{server}
[providers.p]
adapter = "{kind}"
base_url = "{url}/v1"
{key}
{shared}
[providers.p.profile]
lanes = {lanes}
queue_max = 1000
queue_timeout_s = 900
run_timeout_s = 900
{profile}
{extra}
"""


@attrs.frozen
class Job:
    """One request: sent ``at`` seconds after the workload's start (or, ``after_previous``,
    once the one before it has ended: a conversation's next turn)."""

    at: float
    body: dict[str, Any] = attrs.field(hash=False)
    prompt: int              # the input the provider counts (its uncached part)
    out: int                 # the answer's tokens
    model: str = "m"         # the provider's model (its own buckets when it has some)
    path: str = CHAT
    group: str = ""          # the row it is counted in ("" : the workload's only one)
    after_previous: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@attrs.define
class Outcome:
    sent: float = 0.0
    ended: float = 0.0
    ok: bool = False
    status: int = 0
    reason: str = ""  # the error's reason, when relay said one


def _reason(text: str) -> str:
    for reason in ("request_too_large", "rate_limited", "provider_queue_timeout",
                   "upstream_error", "quota_exhausted"):
        if reason in text:
            return reason
    return ""


async def run_one(client: httpx.AsyncClient, base: str, job: Job, outcome: Outcome) -> None:
    outcome.sent = trio.current_time()
    url = base + job.path
    try:
        if job.stream:
            async with client.stream("POST", url, json=job.body) as r:
                outcome.status = r.status_code
                text = "".join([piece async for piece in r.aiter_text()])
                done = "data: [DONE]" in text or "message_stop" in text
                outcome.ok = (r.status_code == 200 and done and '"error"' not in text)
        else:
            r = await client.post(url, json=job.body)
            outcome.status = r.status_code
            text = r.text
            outcome.ok = r.status_code == 200 and ('"choices"' in text or '"content"' in text)
        if not outcome.ok:
            outcome.reason = _reason(text)
    except httpx.HTTPError as exc:
        outcome.ok, outcome.reason = False, type(exc).__name__
    outcome.ended = trio.current_time()


async def workload(bases: list[str], jobs: list[Job]) -> list[Outcome]:
    """Every job, each at its time (a turn once the one before it has ended), dealt
    round-robin to ``bases`` (a relay's or the provider's URL, without the path)."""
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(900.0),
                                 limits=limits) as client:
        outcomes = [Outcome() for _ in jobs]
        start = trio.current_time()
        ended = [trio.Event() for _ in jobs]

        async def one(n: int, job: Job, base: str) -> None:
            await trio.sleep_until(start + job.at)
            if job.after_previous and n:
                await ended[n - 1].wait()
            try:
                await run_one(client, base, job, outcomes[n])
            finally:
                ended[n].set()

        async with trio.open_nursery() as nursery:
            for n, (job, base) in enumerate(zip(jobs, itertools.cycle(bases), strict=False)):
                nursery.start_soon(one, n, job, base)
    return outcomes


def long_prose(tokens: int, seed: int) -> str:
    """The fake's `prose` of about ``tokens``, made in pieces of 250 (`prose` recounts its
    whole text at each word; the count of words joined by spaces is the sum of theirs)."""
    pieces = [prose(250, seed * 1_000 + k) for k in range(tokens // 250)]
    if tokens % 250:
        pieces.append(prose(tokens % 250, seed * 1_000 + tokens // 250))
    return " ".join(pieces)


# --- the ideal pacer ------------------------------------------------------------------------


@attrs.frozen
class Background:
    """Another client's request on the same key, sent at ``at`` whatever the buckets say
    (the provider answers it when it fits, else gives it a 429: it takes nothing)."""

    at: float
    prompt: int
    out: int
    model: str = "m"


def _buckets(limits: Limits) -> dict[str, Bucket]:
    made = {k: Bucket(v) for k, v in attrs.asdict(limits).items() if v}
    for bucket in made.values():
        bucket.now(0.0)
    return made


def _fits(buckets: dict[str, Bucket], t: float, prompt: int) -> bool:
    for key, need in (("rpm", 1.0), ("itpm", prompt), ("tpm", prompt), ("otpm", 1e-9)):
        bucket = buckets.get(key)
        if bucket is not None and bucket.now(t) < min(need, bucket.limit):
            return False
    return True


def _take(buckets: dict[str, Bucket], t: float, **amounts: float) -> None:
    for key, amount in amounts.items():
        bucket = buckets.get(key)
        if bucket is not None:
            bucket.now(t)
            bucket.level -= amount


def ideal(jobs: list[Job], limits: Limits, models: dict[str, Limits] | None = None,
          background: Sequence[Background] = (),
          step: float = 0.01) -> list[tuple[float, float]]:
    """Each job's (start, end) under the ideal pacer (see the module docstring): the
    models with their own limits are simulated apart (they share no bucket)."""
    models = models or {}
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(jobs)
    shared = [m for m in {j.model for j in jobs} if m not in models]
    groups = [[m] for m in {j.model for j in jobs} if m in models] + [shared]
    for names in groups:
        if not names:
            continue
        buckets = _buckets(models.get(names[0], limits) if names[0] in models else limits)
        others = sorted((b for b in background if b.model in names or (
            b.model not in models and names == shared)), key=lambda b: b.at)
        pending: list[tuple[float, float]] = []  # (done at, out)
        t, last_end = 0.0, 0.0
        for n, job in enumerate(jobs):
            if job.model not in names:
                continue
            t = max(t, job.at, last_end if job.after_previous else 0.0)
            while True:
                for done in sorted(p for p in pending if p[0] <= t):
                    pending.remove(done)
                    _take(buckets, done[0], otpm=done[1], tpm=done[1])
                while others and others[0].at <= t:
                    other = others.pop(0)
                    if _fits(buckets, other.at, other.prompt):
                        _take(buckets, other.at, rpm=1, itpm=other.prompt, tpm=other.prompt)
                        pending.append((other.at + FIRST_TOKEN_S + other.out / TOKENS_PER_S,
                                        other.out))
                if _fits(buckets, t, job.prompt):
                    break
                t += step
            _take(buckets, t, rpm=1, itpm=job.prompt, tpm=job.prompt)
            end = t + FIRST_TOKEN_S + job.out / TOKENS_PER_S
            pending.append((end, job.out))
            times[n] = (t, end)
            last_end = end
    return times


# --- a relay -------------------------------------------------------------------------------


async def start_relay(nursery: trio.Nursery, tmp: Path, name: str, fake: Metered, *,
                      kind: str = "openai", profile: str = "", extra: str = "",
                      lanes: int = 32, server: str = "", shared: str = "") -> str:
    """A `relay.serve` in front of ``fake`` (provider ``p``), its records in
    ``tmp/name.jsonl``; its base URL."""
    key = 'api_key_env = "FAKE_METERED_KEY"' if kind == "anthropic" else ""
    text = CONFIG.format(records=tmp / f"{name}.jsonl", url=fake.base_url, kind=kind,
                         key=key, lanes=lanes, profile=profile, extra=extra,
                         server=server, shared=shared)
    config = relay.parse_config(text, source=f"{name}.toml", base_dir=tmp)
    served = await nursery.start(functools.partial(relay.serve, config, port=0))
    return str(served.url)


# --- a row --------------------------------------------------------------------------------


@attrs.define
class Row:
    scenario: str
    workload: str
    client: str
    rejected: int           # the 429s the provider sent this client's requests
    failures: int           # requests that did not end in a whole answer
    false_too_large: int    # refused request_too_large, though the provider would take it
    makespan: float
    pacer: float            # the ideal pacer's makespan of the same requests
    p50: float
    p99: float
    note: str = ""
    reasons: dict[str, int] = attrs.Factory(dict)  # the failures' reasons


def _largest(limits: Limits) -> float:
    return min((v for k, v in attrs.asdict(limits).items() if k in ("itpm", "tpm") and v),
               default=math.inf)


def row(scenario: str, workload_name: str, client: str, jobs: list[Job],
        outcomes: list[Outcome], rejected: int, times: list[tuple[float, float]],
        limits: Limits, models: dict[str, Limits] | None = None, note: str = "") -> Row:
    """A row of ``jobs`` (one group's): ``times``, the ideal pacer's for the same jobs."""
    start = min(o.sent for o in outcomes)
    makespan = max(o.ended for o in outcomes) - start
    pacer = max(e for _, e in times) - min(j.at for j in jobs)
    latencies = sorted(o.ended - o.sent for o in outcomes)
    models = models or {}
    false_too_large = sum(
        o.reason == "request_too_large" and j.prompt <= _largest(models.get(j.model, limits))
        for j, o in zip(jobs, outcomes, strict=True))
    reasons: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            key = o.reason or str(o.status)
            reasons[key] = reasons.get(key, 0) + 1
    return Row(scenario, workload_name, client, rejected, sum(not o.ok for o in outcomes),
               false_too_large, makespan, pacer, statistics.median(latencies),
               latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], note,
               reasons)


def print_rows(rows: list[Row]) -> None:
    print("| scenario | workload | client | upstream 429s | client failures | false "
          "request_too_large | makespan vs ideal pacer | p50 | p99 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        failures = str(r.failures)
        if r.reasons:
            failures += " (" + ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items())) + ")"
        rejected = f"{r.rejected}" + (f"; {r.note}" if r.note else "")
        print(f"| {r.scenario} | {r.workload} | {r.client} | {rejected} | {failures} | "
              f"{r.false_too_large} | {r.makespan:.1f} s, {r.makespan / r.pacer:.2f}x of "
              f"{r.pacer:.1f} s | {r.p50:.1f} s | {r.p99:.1f} s |")
