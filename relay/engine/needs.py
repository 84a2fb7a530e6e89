"""What an attempt will take from its provider's token budgets (SPEC L12, L12a): its
`Need` — relay's estimate of the input as the provider counts it (learned per model and
script, `relay.capacity.estimate.InputRatio`; for a provider that does not count cache
reads, less the part of a conversation its last answer says is cached), the output
reservation, the model's budget scope — and the conversation it belongs to."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

from relay.capacity.budget import Learned, Need, estimate_input, output_reservation
from relay.capacity.estimate import estimate_framing, script_of
from relay.capacity.meter import scope_of
from relay.vocab.events import Call

from .attempt import Run
from .providers import Provider

__all__ = ["conversation", "conversation_of", "marks_cache", "need_of", "skips_cache_reads"]


def conversation(run_: Run) -> str:
    """The attempt's conversation (`conversation_of` its call), worked out once."""
    if run_.conversation is None:
        run_.conversation = conversation_of(run_.call)
    return run_.conversation


def need_of(run_: Run, learned_from: Learned) -> Need:
    """What the attempt takes from its model's and its account's token budgets (SPEC
    L12a): relay's estimate of the input the provider counts — for a provider that does
    not count cache reads, a request that marks a prefix for the cache leaves out the
    part of its conversation the last answer says is cached, and one relay knows nothing
    of is never refused as too large — plus the output reservation."""
    call = run_.call
    provider = run_.target.provider
    provider_max = getattr(provider.config.settings, "max_tokens", None)
    learned = learned_from.output(call.model)
    raw, script, fixed = estimate_input(call), script_of(call), estimate_framing(call)
    # What this provider counted for this model's prompts in this script so far.
    ratio = provider.input_ratio
    estimate = ratio.adjust(call.model, script, raw, fixed)
    # Judged too large on the fewest the provider may count once its own counts say so;
    # until then on the learned estimate (a guess below it would send what never fits).
    least = ratio.least(call.model, script, raw, fixed) \
        if ratio.known(call.model, script) else estimate
    needed, sure = ratio.reserve(call.model, script, raw, fixed), True
    # While it waits in the queue, the answers of the requests before it teach the ratio:
    # it starts on what was learned by then (`Need.current`).
    relearn: Callable[[], int] | None = functools.partial(
        ratio.reserve, call.model, script, raw, fixed)
    if skips_cache_reads(provider) and marks_cache(call):  # (unmarked: nothing cached)
        uncached = provider.conversations.uncached(conversation(run_), estimate)
        if uncached is not None:
            needed, least = uncached, min(least, uncached)
        else:
            sure = False
        relearn = None  # (what the cache holds was judged when it queued)
    return Need(needed, output_reservation(
        call, learned, provider_max if isinstance(provider_max, int) else None),
        scope=scope_of(call.model), sure=sure, estimate=estimate, script=script,
        raw=raw, framing=fixed, least=least, relearn=relearn)


def skips_cache_reads(provider: Provider) -> bool:
    """The provider's input budget counts no cache reads (Anthropic's: ``input_tokens``
    and ``cache_creation_input_tokens``, not ``cache_read_input_tokens``; SPEC L12a).
    OpenAI and Gemini count every prompt token."""
    return provider.config.adapter == "anthropic"


def conversation_of(call: Call) -> str:
    """The conversation a call continues: the client's own marker where it sends one (its
    ``prompt_cache_key``, a session header, Messages' ``metadata.user_id``), else a digest
    of its system prompt and first message (SPEC L12a, L13)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(scope_of(call.model).encode())
    key = call.params.get("prompt_cache_key") or call.inbound.session
    body = call.inbound.body
    if not key and body is not None and isinstance(body.get("metadata"), dict):
        key = body["metadata"].get("user_id")
    if isinstance(key, str) and key:
        digest.update(b"\0key\0" + key.encode())
        return digest.hexdigest()
    firsts: dict[str, Any] = {}
    for message in call.messages:
        role = "system" if message.get("role") in ("system", "developer") else "first"
        firsts.setdefault(role, message.get("content"))
        if len(firsts) == 2:
            break
    digest.update(json.dumps(firsts, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def marks_cache(call: Call) -> bool:
    """The request marks a prefix for the provider's prompt cache (``cache_control``)."""
    body = call.inbound.body
    parts: list[Any] = [body.get("system"), body.get("messages")] if body else []
    parts.append(call.messages)
    stack = parts
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "cache_control" in item:
                return True
            stack.extend(v for v in item.values() if isinstance(v, list | dict))
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, list | dict))
    return False
