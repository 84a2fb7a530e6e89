"""`bench.tokens`' scenarios of SPEC L12a (issue 33): a coding agent's cached
conversation, two models with limits 100x apart, Korean text counted at two rates, a
second client on the same key. See `bench.tokens`' docstring for what each row means."""

from __future__ import annotations

import functools
import random
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.token_kit import (
    CHAT,
    FIRST_TOKEN_S,
    MESSAGES,
    TOKENS_PER_S,
    Background,
    Job,
    Outcome,
    Row,
    ideal,
    long_prose,
    row,
    start_relay,
    workload,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakes.fake_metered import (
    Limits,
    Metered,
    count_tokens,
    prompt_tokens,
    serve_metered,
)

__all__ = ["cache", "korean", "models", "second_client"]

FIRST_STARTS = "first_starts = 2"  # as relay's cloud profiles (openai, anthropic, gemini)
CLASSIC = Limits(rpm=100, itpm=40_000, otpm=16_000)
CONFIGURED = "rpm = 100\nitpm = 40000\notpm = 16000"


async def _fake(nursery: trio.Nursery, limits: Limits, **kw: Any) -> Metered:
    fake: Metered = await nursery.start(functools.partial(serve_metered, limits, **kw))
    fake.tokens_per_s, fake.first_token_s = TOKENS_PER_S, FIRST_TOKEN_S
    return fake


def _rejected(fake: Metered, before: int, models: set[str]) -> int:
    return sum(m in models for m in fake.rejected_models[before:])


async def _warm_up(base: str, model: str, text: str = "hello") -> None:
    """Three small requests: relay sees the provider's headers (and its counts)."""
    async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
        for i in range(3):
            r = await client.post(base + CHAT, json={
                "model": model, "max_tokens": 20,
                "messages": [{"role": "user", "content": f"{text} {i}"}]})
            r.raise_for_status()


# --- 1. cache: a coding agent's conversation, read from the provider's cache ---------------

CACHE_LIMITS = Limits(rpm=50, itpm=30_000, otpm=8_000)
CACHE_MODEL = "claude-out200"
TURNS = 20


def _block(text: str, marked: bool) -> list[dict[str, Any]]:
    block: dict[str, Any] = {"type": "text", "text": text}
    if marked:
        block["cache_control"] = {"type": "ephemeral"}
    return [block]


def _conversation() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The warm-up body (the agent's earlier session: a 30,000-token system prompt and
    three exchanges) and the 20 turns after it, each ~2,000 tokens more (a user message
    of ~1,800, the answer before it of 200), each marking its system prompt and its last
    message for the cache as Claude Code does."""
    system = _block(long_prose(30_000, 7), True)
    said: list[tuple[str, str]] = []  # (role, text)
    for k in range(3):
        said += [("user", long_prose(1_800, 100 + k)), ("assistant", "tok " * 200)]

    def body(upto: list[tuple[str, str]], stream: bool) -> dict[str, Any]:
        messages = [{"role": role, "content": _block(text, n == len(upto) - 1)}
                    for n, (role, text) in enumerate(upto)]
        return {"model": CACHE_MODEL, "max_tokens": 4096, "stream": stream,
                "system": system, "messages": messages}

    said.append(("user", long_prose(1_800, 200)))
    warm = body(said, False)
    turns = []
    for n in range(TURNS):
        said += [("assistant", "tok " * 200), ("user", long_prose(1_800, 300 + n))]
        turns.append(body(said, True))
    return warm, turns


def _count(body: dict[str, Any]) -> int:
    return int(prompt_tokens(body["messages"], body.get("system")))


async def cache(tmp: Path, steady_s: float, rows: list[Row]) -> None:
    warm, turns = _conversation()
    counts = [_count(warm)] + [_count(b) for b in turns]
    clients = [("relay, headers only", FIRST_STARTS),
               ("relay, budgets configured", f"{FIRST_STARTS}\nrpm = 50\nitpm = 30000\n"
                                             "otpm = 8000"),
               ("direct", None)]

    async def one(name: str, profile: str | None) -> None:
        async with trio.open_nursery() as nursery:
            fake = await _fake(nursery, CACHE_LIMITS)
            fake.cache_s = 300.0
            # The agent's earlier session: its prompt is in the provider's cache ...
            async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
                r = await client.post(fake.base_url + MESSAGES, json=warm)
                r.raise_for_status()
            # ... and the minute since has refilled the buckets (the cache is kept).
            fake.configure(CACHE_LIMITS)
            counted, read = fake.input_served, fake.cache_reads
            if profile is None:
                base, model = fake.base_url, CACHE_MODEL
            else:
                base = await start_relay(nursery, tmp, f"cache-{name}", fake,
                                         kind="anthropic", profile=profile)
                model = f"p/{CACHE_MODEL}"
            jobs = [Job(0.0, {**b, "model": model}, counts[n + 1] - counts[n], 200,
                        CACHE_MODEL, MESSAGES, after_previous=True)
                    for n, b in enumerate(turns)]
            outcomes = await workload([base], jobs)
            rows.append(row("cache", f"{TURNS} turns", name, jobs, outcomes,
                            len(fake.rejected), ideal(jobs, CACHE_LIMITS), CACHE_LIMITS,
                            note=f"read from the cache {fake.cache_reads - read:,}, "
                                 f"counted {fake.input_served - counted:,} tokens"))
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for name, profile in clients:
            nursery.start_soon(one, name, profile)
    print(f"cache: {CACHE_LIMITS.itpm:,.0f} input, {CACHE_LIMITS.otpm:,.0f} output tokens "
          f"and {CACHE_LIMITS.rpm:g} requests a minute; prompts {counts[1]:,} to "
          f"{counts[-1]:,} tokens, {sum(counts[n + 1] - counts[n] for n in range(TURNS)):,}"
          f" uncached in all; 200-token answers, streamed")


# --- 2. models: two models with limits 100x apart under one provider entry ---------------

SMALL, BIG = "small-out100", "big-out100"
MODEL_LIMITS = {SMALL: Limits(tpm=6_000), BIG: Limits(tpm=600_000)}


def _model_jobs(seconds: float, which: tuple[str, ...]) -> list[Job]:
    """``seconds`` of arrivals: ``small`` at twice its 6,000 tokens a minute (~1,400-token
    prompts), ``big`` at half its 600,000 (~6,000-token prompts), interleaved by time."""
    jobs = []
    for model, size, share in ((SMALL, 1_400, 2.0), (BIG, 6_000, 0.5)):
        if model not in which:
            continue
        per_s = share * MODEL_LIMITS[model].tpm / 60.0
        at, i = 0.0, 0
        while at < seconds:
            text = long_prose(size, (0 if model == SMALL else 500) + i)
            body = {"model": f"p/{model}", "messages": [{"role": "user", "content": text}],
                    "stream": i % 10 < 3}
            prompt = prompt_tokens(body["messages"])
            jobs.append(Job(at, body, prompt, 100, model, group=model.partition("-")[0]))
            at += (prompt + 100) / per_s
            i += 1
    return sorted(jobs, key=lambda j: j.at)


async def models(tmp: Path, steady_s: float, rows: list[Row]) -> None:
    clients = [("relay, mixed", (SMALL, BIG), FIRST_STARTS),
               ("relay, small alone", (SMALL,), FIRST_STARTS),
               ("relay, big alone", (BIG,), FIRST_STARTS),
               ("direct, mixed", (SMALL, BIG), None)]

    mixed = _model_jobs(steady_s, (SMALL, BIG))  # (made before any client starts)

    async def one(name: str, which: tuple[str, ...], profile: str | None) -> None:
        async with trio.open_nursery() as nursery:
            fake = await _fake(nursery, Limits(), models=MODEL_LIMITS)
            if profile is None:
                base = fake.base_url
            else:
                base = await start_relay(nursery, tmp, f"models-{name}", fake,
                                         profile=profile)
            jobs = [j for j in mixed if j.model in which]
            if profile is None:
                jobs = [Job(j.at, {**j.body, "model": j.model}, j.prompt, j.out, j.model,
                            group=j.group) for j in jobs]
            outcomes = await workload([base], jobs)
            times = ideal(jobs, Limits(), MODEL_LIMITS)
            for model in which:
                mine = [n for n, j in enumerate(jobs) if j.model == model]
                rows.append(row("models", model.partition("-")[0], name,
                                [jobs[n] for n in mine], [outcomes[n] for n in mine],
                                _rejected(fake, 0, {model}), [times[n] for n in mine],
                                Limits(), MODEL_LIMITS))
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for name, which, profile in clients:
            nursery.start_soon(one, name, which, profile)
    print(f"models: {SMALL} {MODEL_LIMITS[SMALL].tpm:,.0f} and {BIG} "
          f"{MODEL_LIMITS[BIG].tpm:,.0f} tokens a minute, each metered apart (headers on, "
          f"nothing configured); {steady_s:g} s of arrivals: small at 2x its limit "
          f"(~1,400-token prompts), big at 0.5x (~6,000); 100-token answers")


# --- 3. korean: Korean text, counted by the provider at 1.5 and at 0.5 characters a token ---


def hangul(tokens: int, cpt: float, seed: int) -> str:
    """Hangul words of 2-5 syllables that the fake counts as about ``tokens`` at ``cpt``
    characters a token."""
    rng = random.Random(seed)
    words, total = [], 0
    while total < tokens:
        word = "".join(chr(0xAC00 + rng.randrange(11172)) for _ in range(rng.randint(2, 5)))
        words.append(word)
        total += count_tokens(word, cpt)
    return " ".join(words)


def _korean_jobs(cpt: float, steady_s: float) -> dict[str, list[Job]]:
    """classic's burst and steady mixes in Korean: one model, answers cut by max_tokens."""
    def job(at: float, i: int, seed: int) -> Job:
        large = i % 6 == 0
        text = hangul(6000 if large else 200, cpt, seed + i)
        out = 400 if large else 150
        body = {"model": "p/m-out400", "max_tokens": out, "stream": i % 10 < 3,
                "messages": [{"role": "user", "content": text}]}
        return Job(at, body, prompt_tokens(body["messages"], cjk=cpt), out, "m-out400")

    burst = [job(0.0, i, 0) for i in range(60)]
    rate = 2 * CLASSIC.itpm / 60.0
    steady, at, i = [], 0.0, 0
    while at < steady_s:
        steady.append(job(at, i, 1000))
        at += steady[-1].prompt / rate
        i += 1
    return {"burst": burst, "steady": steady}


async def korean(tmp: Path, steady_s: float, rows: list[Row]) -> None:
    clients = [("relay, budgets configured", f"{FIRST_STARTS}\n{CONFIGURED}"),
               ("relay, headers only", FIRST_STARTS),
               ("direct", None)]

    made = {cpt: _korean_jobs(cpt, steady_s) for cpt in (1.5, 0.5)}

    async def one(cpt: float, name: str, profile: str | None) -> None:
        plans = made[cpt]
        async with trio.open_nursery() as nursery:
            fake = await _fake(nursery, CLASSIC)
            fake.cjk_chars_per_token = cpt
            if profile is None:
                base = fake.base_url
                plans = {k: [Job(j.at, {**j.body, "model": j.model}, j.prompt, j.out,
                                 j.model) for j in v] for k, v in plans.items()}
            else:
                base = await start_relay(nursery, tmp, f"korean{cpt}-{name}", fake,
                                         profile=profile)
                if "headers" in name:
                    await _warm_up(base, "p/m-out400", hangul(20, cpt, 5))
            for n, (phase, jobs) in enumerate(plans.items()):
                if n:
                    await trio.sleep(61)  # the buckets fill again
                before = len(fake.rejected)
                outcomes = await workload([base], jobs)
                rows.append(row(f"korean {cpt:g}", phase, name, jobs, outcomes,
                                len(fake.rejected) - before, ideal(jobs, CLASSIC), CLASSIC))
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for cpt in (1.5, 0.5):
            for name, profile in clients:
                nursery.start_soon(one, cpt, name, profile)
    print(f"korean: classic's limits ({CLASSIC.rpm:g} requests, {CLASSIC.itpm:,.0f} input, "
          f"{CLASSIC.otpm:,.0f} output tokens a minute); Hangul counted at 1.5 and at 0.5 "
          f"characters a token; burst: 60 requests (10 of ~6,000 tokens, 50 of ~200); "
          f"steady: {steady_s:g} s at twice the input limit; {FIRST_STARTS} in relay's "
          "profile")


# --- 4. second-client: another tool on the same key takes 30 % of the limit ---------------

OTHER = "other-out100"


def _relay_jobs(seconds: float) -> list[Job]:
    """classic's steady mix (1 in 6 of ~6,000 tokens, answer 400; the rest ~200, answer
    150) at twice the input limit for ``seconds``; one model, answers cut by max_tokens."""
    rate = 2 * CLASSIC.itpm / 60.0
    jobs, at, i = [], 0.0, 0
    while at < seconds:
        large = i % 6 == 0
        out = 400 if large else 150
        body = {"model": "p/m-out400", "max_tokens": out, "stream": i % 10 < 3,
                "messages": [{"role": "user", "content": long_prose(6000 if large else 200,
                                                                    2000 + i)}]}
        jobs.append(Job(at, body, prompt_tokens(body["messages"]), out, "m-out400"))
        at += jobs[-1].prompt / rate
        i += 1
    return jobs


async def second_client(tmp: Path, steady_s: float, rows: list[Row]) -> None:
    clients = [("relay, headers only", FIRST_STARTS),
               ("relay, budgets configured (the account's figures)",
                f"{FIRST_STARTS}\n{CONFIGURED}"),
               ("relay, budgets configured (70 %: room left)",
                f"{FIRST_STARTS}\nrpm = 70\nitpm = 28000\notpm = 11200")]
    other_text = long_prose(1_000, 77)
    other_prompt = prompt_tokens([{"role": "user", "content": other_text}])
    period = (other_prompt + 100) / (0.3 * CLASSIC.itpm / 60.0)

    async def other(base: str, stop: trio.Event, outcomes: list[Outcome]) -> None:
        """30 % of the input limit, straight to the provider, never retried."""
        async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
            start = trio.current_time()
            n = 0
            while not stop.is_set():
                with trio.move_on_at(start + n * period):
                    await stop.wait()
                if stop.is_set():
                    break
                outcome = Outcome(sent=trio.current_time())
                try:
                    r = await client.post(base + CHAT, json={
                        "model": OTHER, "messages": [{"role": "user",
                                                      "content": other_text}]})
                    outcome.status, outcome.ok = r.status_code, r.status_code == 200
                except httpx.HTTPError:
                    outcome.ok = False
                outcomes.append(outcome)
                n += 1

    made = _relay_jobs(steady_s)

    async def one(name: str, profile: str) -> None:
        async with trio.open_nursery() as nursery:
            fake = await _fake(nursery, CLASSIC)
            base = await start_relay(nursery, tmp, f"second-{name[:30]}", fake,
                                     profile=profile)
            if "headers" in name:
                await _warm_up(base, "p/m-out400")
            jobs = made
            stop, theirs = trio.Event(), list[Outcome]()
            before = len(fake.rejected)
            nursery.start_soon(other, fake.base_url, stop, theirs)
            outcomes = await workload([base], jobs)
            stop.set()
            background = [Background(n * period, other_prompt, 100, OTHER)
                          for n in range(int(2000 / period))]
            ours = _rejected(fake, before, {"m-out400"})
            rows.append(row("second-client", f"{steady_s:g} s", name, jobs, outcomes, ours,
                            ideal(jobs, CLASSIC, background=background), CLASSIC,
                            note=f"the other client's: {_rejected(fake, before, {OTHER})} "
                                 f"of {len(theirs)}"))
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for name, profile in clients:
            nursery.start_soon(one, name, profile)
    print(f"second-client: classic's limits; relay's traffic at twice the input limit for "
          f"{steady_s:g} s (classic's mix); another client sends ~{other_prompt:,}-token "
          f"requests straight to the provider every {period:.1f} s (30 % of the input "
          "limit) on the same key, never retried; its 429s are counted apart (upstream "
          "429s: relay's requests'; the note: the other client's)")
