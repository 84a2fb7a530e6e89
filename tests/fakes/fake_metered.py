"""A fake cloud provider that meters tokens like the real ones (SPEC L12), on loopback.

It serves OpenAI's ``POST /v1/chat/completions`` (plain and streamed) and Anthropic's
``POST /v1/messages`` (plain and streamed), and enforces request, input, output and total
token limits per minute with *continuous* buckets: each holds at most its limit and
refills at limit / 60 per second. A request is admitted when a request and its input
tokens are free (and the output bucket is not in debt); its input leaves at once, and
its output reservation too — its ``max_tokens``, else the answer's length — as OpenAI and
Anthropic document it (Anthropic: output "estimated based on max_tokens at the beginning
of each request"), set right to what it produced at the end of the answer. A request
that does not fit gets a realistic 429 — OpenAI-shaped on the OpenAI path ("Rate limit
reached … Please try again in 7.5s."), Anthropic-shaped on the Messages path — with
``retry-after``. Every answer, 200 or 429, stream or not, carries both header families
(``x-ratelimit-*`` and ``anthropic-ratelimit-*``) unless ``send_headers`` is off; then it
sends no rate-limit header at all, not even ``retry-after`` (the body still says when).

Time is `trio.current_time()`: virtual in tests on a `MockClock`, real in `bench/tokens.py`.
Anthropic's resets are RFC 3339 wall-clock times: the wall clock of now plus the
(virtual or real) seconds to the reset.

Its tokenizer is not a real one, but counts English and code within 4-11 % of OpenAI's
``o200k_base`` (bench/estimate.py): a word is a token and one more for every 7 letters
after its first, a CJK character a token, each punctuation character a token, spaces
free; a message costs 4 more, a prompt 3 (what
relay's estimate is measured against in docs/tokens.md). An answer is ``out`` tokens of
"tok" (``out`` from the model name, ``…-out300``, else `Metered.answer_tokens`), cut at
the request's ``max_tokens``, produced at ``tokens_per_s`` after ``first_token_s``.

Metering as each provider meters (SPEC L12a): ``configure(models=…)`` gives models their
own buckets (OpenAI meters each model; the headers describe the answering model's);
``cjk_chars_per_token`` counts CJK text at a set rate; ``cache_s`` turns on Anthropic's
prompt cache (a conversation's earlier prompt is read from it, reported as
``cache_read_input_tokens`` and not counted in the input budget).

It counts what happened: ``answered``, ``rejected`` (its 429s, with their times, and
``rejected_models``), the peak of requests in progress at once, and the tokens it served
(``cache_reads`` apart).
"""

from __future__ import annotations

import datetime
import json
import math
import random
import re
import time
from typing import Any

import attrs
import trio

from fakes.fake_http import Exchange, FakeServer, serve_fake

__all__ = ["Bucket", "Limits", "Metered", "count_tokens", "prompt_tokens", "prose",
           "serve_metered"]

_PIECE = re.compile(r"\w+|[^\w\s]")
_OUT = re.compile(r"out(\d+)")


def count_tokens(text: str, cjk: float = 1.0) -> int:
    """The fake's own token count of ``text`` (see the module docstring); ``cjk``: the
    characters of CJK text (Hangul, Kana, Han) a token holds."""
    return sum(1 if not (p[0].isalnum() or p[0] == "_") else
               math.ceil(len(p) / cjk) if ord(p[0]) >= 0x2E80 else 1 + (len(p) - 1) // 7
               for p in _PIECE.findall(text))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_tokens(messages: list[dict[str, Any]], system: Any = None,
                  cjk: float = 1.0) -> int:
    total = 3 + sum(4 + count_tokens(_text_of(m.get("content")), cjk) for m in messages)
    if system:
        total += 4 + count_tokens(_text_of(system), cjk)
    return total


WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but",
    "have", "an", "they", "you", "were", "her", "she", "there", "been", "one", "all", "we",
    "their", "has", "would", "when", "if", "more", "no", "out", "so", "said", "what", "up",
    "its", "about", "into", "than", "them", "can", "only", "other", "new", "some", "could",
    "time", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such",
    "like", "our", "over", "man", "me", "even", "most", "made", "after", "also", "did",
    "many", "before", "must", "through", "back", "years", "where", "much", "your", "way",
    "well", "down", "should", "because", "each", "just", "those", "people", "request",
    "provider", "minute", "budget", "stream", "answer", "tokens", "relay", "waiting",
    "limited", "conversation", "summarise", "repository", "function", "parameters",
    "configuration",
)


def prose(tokens: int, seed: int = 0) -> str:
    """English-like text of about ``tokens`` of the fake's tokens."""
    rng = random.Random(seed)
    words: list[str] = []
    total = 0  # (spaces are free: the text's count is its words' sum)
    while total < tokens:
        words.append(rng.choice(WORDS) + ("." if rng.random() < 0.07 else ""))
        total += count_tokens(words[-1])
    return " ".join(words)


@attrs.frozen
class Limits:
    """Per minute; 0 = not metered."""

    rpm: float = 0.0
    itpm: float = 0.0
    otpm: float = 0.0
    tpm: float = 0.0


@attrs.define
class Bucket:
    limit: float
    level: float = 0.0
    at: float | None = None

    def now(self, t: float) -> float:
        if self.at is None:
            self.level = self.limit
        else:
            self.level = min(self.limit, self.level + (t - self.at) * self.limit / 60.0)
        self.at = t
        return self.level

    def wait_s(self, t: float, need: float) -> float:
        level = self.now(t)
        return 0.0 if level >= need else (need - level) * 60.0 / self.limit

    def reset_s(self, t: float) -> float:
        """Seconds until it is whole again."""
        return max(0.0, (self.limit - self.now(t)) * 60.0 / self.limit)


def _go(seconds: float) -> str:
    """OpenAI's reset format: ``1m30s``, ``2.1s``, ``250ms``."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.1f}s" if minutes else f"{rest:.2f}s"


class Metered(FakeServer):
    """See the module docstring. Set ``limits``, ``send_headers`` and the pace before
    the first request (`serve_metered` takes them)."""

    limits = Limits()
    model_limits: dict[str, Limits] = {}  # (set per instance by configure)
    send_headers = True
    cjk_chars_per_token = 1.0
    # Anthropic's prompt cache: a conversation (its system prompt and first message) seen
    # within ``cache_s`` is read from the cache up to the length of its last prompt; cache
    # reads leave no tokens in the input and token buckets (as Anthropic counts them).
    cache_s = 0.0
    answer_tokens = 100
    tokens_per_s = 500.0
    first_token_s = 0.2

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.buckets: dict[str, Bucket] = {}
        self.answered = 0
        self.rejected: list[float] = []  # when each 429 was sent
        self.active = 0
        self.peak = 0
        self.input_served = 0
        self.output_served = 0
        self.prompts: list[int] = []  # the input tokens of every admitted request
        self.per_model: dict[str, dict[str, Bucket]] = {}
        self.rejected_models: list[str] = []  # the model of each 429
        self.cached: dict[str, tuple[float, int]] = {}  # conversation → (when, prompt)
        self.cache_reads = 0

    def configure(self, limits: Limits, *, send_headers: bool = True,
                  models: dict[str, Limits] | None = None) -> None:
        """``models``: models metered on their own buckets (the rest share ``limits``'),
        as OpenAI meters each model and its headers describe the answering model's."""
        self.limits, self.send_headers = limits, send_headers
        self.buckets = {k: Bucket(v) for k, v in attrs.asdict(limits).items() if v}
        self.model_limits = dict(models or {})
        self.per_model = {m: {k: Bucket(v) for k, v in attrs.asdict(lim).items() if v}
                          for m, lim in self.model_limits.items()}

    def _buckets_of(self, model: str) -> dict[str, Bucket]:
        return self.per_model.get(model, self.buckets)

    # --- the buckets ---------------------------------------------------------------------------
    def _wait_s(self, t: float, prompt: int, model: str = "") -> tuple[float, str]:
        waits = []
        buckets = self._buckets_of(model)
        for key, need in (("rpm", 1), ("itpm", prompt), ("tpm", prompt), ("otpm", 1e-9)):
            bucket = buckets.get(key)
            if bucket is not None:
                waits.append((bucket.wait_s(t, min(need, bucket.limit)), key))
        return max(waits, default=(0.0, ""))

    def _take(self, key: str, amount: float, t: float, model: str = "") -> None:
        bucket = self._buckets_of(model).get(key)
        if bucket is not None:
            bucket.now(t)
            bucket.level -= amount

    def headers(self, t: float, model: str = "") -> dict[str, str]:
        if not self.send_headers:
            return {}
        out: dict[str, str] = {}
        wall = time.time()

        def rfc3339(seconds: float) -> str:
            when = datetime.datetime.fromtimestamp(wall + seconds, datetime.UTC)
            return when.isoformat(timespec="seconds").replace("+00:00", "Z")

        for key, openai, anthropic in (("rpm", "requests", "requests"),
                                       ("tpm", "tokens", "tokens"),
                                       ("itpm", None, "input-tokens"),
                                       ("otpm", None, "output-tokens")):
            bucket = self._buckets_of(model).get(key)
            if bucket is None:
                continue
            level, reset = max(0, math.floor(bucket.now(t))), bucket.reset_s(t)
            if openai:
                out[f"x-ratelimit-limit-{openai}"] = f"{bucket.limit:g}"
                out[f"x-ratelimit-remaining-{openai}"] = str(level)
                out[f"x-ratelimit-reset-{openai}"] = _go(reset)
            out[f"anthropic-ratelimit-{anthropic}-limit"] = f"{bucket.limit:g}"
            out[f"anthropic-ratelimit-{anthropic}-remaining"] = str(level)
            out[f"anthropic-ratelimit-{anthropic}-reset"] = rfc3339(reset)
        return out

    # --- answering ------------------------------------------------------------------------------
    async def respond(self, ex: Exchange) -> None:
        body = ex.json if isinstance(ex.json, dict) else {}
        anthropic = ex.path.endswith("/messages")
        if ex.method != "POST" or not (anthropic or ex.path.endswith("/chat/completions")):
            await ex.send_json(404, {"error": {"message": f"no {ex.path} here"}})
            return
        model = str(body.get("model", "m"))
        messages = body.get("messages") or []
        prompt = prompt_tokens(messages, body.get("system"), self.cjk_chars_per_token)
        t = trio.current_time()
        read = self._cache_read(body, messages, prompt, t) if anthropic else 0
        counted = prompt - read  # what the input and token buckets count
        wait, which = self._wait_s(t, counted, model)
        if wait > 0:
            await self._reject(ex, t, wait, which, counted, model, anthropic)
            return
        self._take("rpm", 1, t, model)
        self._take("itpm", counted, t, model)
        self._take("tpm", counted, t, model)
        self.prompts.append(counted)
        self.input_served += counted
        self.cache_reads += read
        if self.cache_s:
            self.cached[self._conversation(body, messages)] = (t, prompt)
        match = _OUT.search(model)
        out = int(match[1]) if match else self.answer_tokens
        cap = body.get("max_tokens") or body.get("max_completion_tokens")
        if isinstance(cap, int) and cap > 0:
            out = min(out, cap)
        reserved = cap if isinstance(cap, int) and cap > 0 else out
        self._take("otpm", reserved, t, model)  # the output reservation, at admission
        self._take("tpm", reserved, t, model)
        self.active += 1
        self.peak = max(self.peak, self.active)
        # A coding agent marks its whole prompt for the cache: what was not read from it
        # is written to it (all but the last token, so input_tokens is never 0).
        usage = ({"input_tokens": 1, "cache_read_input_tokens": read,
                  "cache_creation_input_tokens": counted - 1}
                 if self.cache_s and anthropic else {"input_tokens": prompt})
        try:
            if body.get("stream"):
                await self._stream(ex, model, prompt, out, anthropic, usage)
            else:
                await trio.sleep(self.first_token_s + out / self.tokens_per_s)
                await self._whole(ex, model, prompt, out, anthropic, usage)
            self.answered += 1
        finally:
            self.active -= 1
            done = trio.current_time()
            self._take("otpm", out - reserved, done, model)  # set right to what it produced
            self._take("tpm", out - reserved, done, model)
            self.output_served += out
            self.notify()

    def _conversation(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> str:
        first = messages[0].get("content") if messages else None
        return json.dumps([body.get("model"), body.get("system"), first], default=str)

    def _cache_read(self, body: dict[str, Any], messages: list[dict[str, Any]],
                    prompt: int, t: float) -> int:
        """The prompt tokens read from the cache: the conversation's last prompt, when
        it was seen within ``cache_s`` (Anthropic: a prefix cached at its last turn)."""
        seen = self.cached.get(self._conversation(body, messages)) if self.cache_s else None
        if seen is None or t - seen[0] > self.cache_s:
            return 0
        return min(seen[1], prompt - 1)

    async def _reject(self, ex: Exchange, t: float, wait: float, which: str, prompt: int,
                      model: str, anthropic: bool) -> None:
        self.rejected.append(t)
        self.rejected_models.append(model)
        self.notify()
        bucket = self._buckets_of(model)[which]
        headers = self.headers(t, model)
        if self.send_headers:
            headers["retry-after"] = str(max(1, math.ceil(wait)))
        names = {"rpm": ("requests per min (RPM)", "requests per minute"),
                 "itpm": ("input tokens per min (ITPM)", "input tokens per minute"),
                 "otpm": ("output tokens per min (OTPM)", "output tokens per minute"),
                 "tpm": ("tokens per min (TPM)", "tokens per minute")}[which]
        used = math.ceil(bucket.limit - bucket.now(t))
        if anthropic:
            body: dict[str, Any] = {"type": "error", "error": {
                "type": "rate_limit_error",
                "message": f"This request would exceed the rate limit for your "
                           f"organization of {bucket.limit:,.0f} {names[1]}. For details, "
                           "refer to: https://docs.claude.com/en/api/rate-limits."},
                "request_id": "req_fake_metered"}
        else:
            body = {"error": {
                "message": f"Rate limit reached for {model} in organization org-fake on "
                           f"{names[0]}: Limit {bucket.limit:,.0f}, Used {used:,}, "
                           f"Requested {prompt if which != 'rpm' else 1:,}. Please try "
                           f"again in {_go(wait)}. Visit https://platform.openai.com/"
                           "account/rate-limits to learn more.",
                "type": "tokens" if which != "rpm" else "requests", "param": None,
                "code": "rate_limit_exceeded"}}
        await ex.send_json(429, body, headers)

    async def _whole(self, ex: Exchange, model: str, prompt: int, out: int,
                     anthropic: bool, usage: dict[str, int]) -> None:
        text = "tok " * out
        headers = self.headers(trio.current_time(), model)
        if anthropic:
            await ex.send_json(200, {
                "id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": {**usage, "output_tokens": out}}, headers)
            return
        await ex.send_json(200, {
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                      "total_tokens": prompt + out}}, headers)

    async def _stream(self, ex: Exchange, model: str, prompt: int, out: int,
                      anthropic: bool, usage: dict[str, int]) -> None:
        await ex.start_sse(self.headers(trio.current_time(), model))
        await trio.sleep(self.first_token_s)
        pieces = max(1, min(out, 10))
        per = [out // pieces + (1 if i < out % pieces else 0) for i in range(pieces)]

        async def send(name: str | None, data: Any) -> None:
            head = f"event: {name}\n" if name else ""
            await ex.send_raw(f"{head}data: {json.dumps(data)}\n\n".encode())

        if anthropic:
            await send("message_start", {"type": "message_start", "message": {
                "id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None,
                "usage": {**usage, "output_tokens": 1}}})
            await send("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
        for n in per:
            await trio.sleep(n / self.tokens_per_s)
            if anthropic:
                await send("content_block_delta", {
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": "tok " * n}})
            else:
                await send(None, {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                                  "model": model, "choices": [{
                                      "index": 0, "delta": {"content": "tok " * n},
                                      "finish_reason": None}]})
        if anthropic:
            await send("content_block_stop", {"type": "content_block_stop", "index": 0})
            await send("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": "end_turn"},
                                         "usage": {"output_tokens": out}})
            await send("message_stop", {"type": "message_stop"})
        else:
            await send(None, {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                              "model": model, "choices": [{"index": 0, "delta": {},
                                                           "finish_reason": "stop"}]})
            await send(None, {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                              "model": model, "choices": [],
                              "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                                        "total_tokens": prompt + out}})
            await ex.send_raw(b"data: [DONE]\n\n")
        await ex.end()


async def serve_metered(limits: Limits, *, send_headers: bool = True,
                        models: dict[str, Limits] | None = None,
                        task_status: trio.TaskStatus[Metered] = trio.TASK_STATUS_IGNORED
                        ) -> None:
    """Serve a `Metered` with ``limits`` (and ``models``' own) on 127.0.0.1 (a free port)
    until cancelled."""
    async with trio.open_nursery() as nursery:
        server: Metered = await nursery.start(serve_fake, Metered)
        server.configure(limits, send_headers=send_headers, models=models)
        task_status.started(server)
