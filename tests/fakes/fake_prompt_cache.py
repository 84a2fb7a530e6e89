"""Anthropic's prompt cache, played by the fake Anthropic server (SPEC L12a).

A `PromptCache` is the fake's ``decide`` hook: it reads each Messages request's prompt in
Anthropic's cache order (``tools``, then ``system``, then ``messages``, block by block),
finds its ``cache_control`` markers, and answers with the usage Anthropic would report:

- the longest marked prefix seen before (by this model, within its lifetime: 5 minutes,
  or an hour for ``"ttl": "1h"``; a read renews it) is read from the cache:
  ``cache_read_input_tokens``;
- the rest up to the last marker is written to it: ``cache_creation_input_tokens``;
- what follows the last marker is ``input_tokens``.

A block costs one token per word of its text (a tool: of its JSON), so a test can say
exactly what it expects. The markers themselves are not part of what is cached (moving a
marker does not change the prefix). Every request's markers are kept, by where they were
(``system[0]``, ``messages[1].content[0]``, ``tools[0]``), in `PromptCache.marked`::

    fake = await nursery.start(serve_fake_anthropic)
    cache = PromptCache()
    fake.decide = cache.decide
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import trio

from fakes.fake_anthropic import Script

__all__ = ["PromptCache", "tokens_of"]

LIFETIME_S = {"5m": 300.0, "1h": 3600.0}


def tokens_of(block: Any) -> int:
    """A block's cost: the words of its text (a string block, a text block, a tool
    result's texts), else of its JSON."""
    if isinstance(block, str):
        return len(block.split())
    if not isinstance(block, dict):
        return 0
    plain = _plain(block)
    if isinstance(plain.get("text"), str):
        return len(plain["text"].split())
    return len(json.dumps(plain, sort_keys=True).split())


def _blocks(req: dict[str, Any]) -> list[tuple[str, Any]]:
    """The prompt's blocks in Anthropic's cache order, each with where it is."""
    out: list[tuple[str, Any]] = [(f"tools[{i}]", t) for i, t in
                                  enumerate(req.get("tools") or ())]
    system = req.get("system")
    if isinstance(system, str):
        out.append(("system", system))
    else:
        out += [(f"system[{i}]", b) for i, b in enumerate(system or ())]
    for i, message in enumerate(req.get("messages") or ()):
        content = message.get("content")
        if isinstance(content, str):
            out.append((f"messages[{i}].content", content))
            continue
        for j, block in enumerate(content or ()):
            out.append((f"messages[{i}].content[{j}]", block))
            # A tool result's own blocks may be marked too.
            if isinstance(block, dict) and isinstance(block.get("content"), list):
                for k, inner in enumerate(block["content"]):
                    if isinstance(inner, dict) and inner.get("cache_control"):
                        out.append((f"messages[{i}].content[{j}].content[{k}]", inner))
    return out


def _plain(value: Any) -> Any:
    """``value`` without its ``cache_control`` markers, at any depth."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _marker(block: Any) -> dict[str, Any] | None:
    marker = block.get("cache_control") if isinstance(block, dict) else None
    return marker if isinstance(marker, dict) else None


@attrs.define
class PromptCache:
    """The cache's entries (a prefix's key → when it expires) and what it saw."""

    base: Script = attrs.field(factory=Script)
    now: Callable[[], float] = trio.current_time
    entries: dict[str, float] = attrs.field(factory=dict)
    marked: list[list[str]] = attrs.field(factory=list)
    usages: list[dict[str, int]] = attrs.field(factory=list)

    def usage(self, req: dict[str, Any]) -> dict[str, int]:
        """What Anthropic would report for ``req``'s prompt (and remember it)."""
        blocks = _blocks(req)
        self.marked.append([where for where, block in blocks if _marker(block)])
        tops = [(where, block) for where, block in blocks if where.count(".content[") < 2]
        costs = [tokens_of(block) for _, block in tops]
        now = self.now()
        read_end = write_end = 0   # blocks read from the cache; up to the last marker
        keys: list[tuple[str, float]] = []
        plain: list[Any] = []
        for n, (where, block) in enumerate(tops, start=1):
            plain.append(_plain(block))
            inner = [b for w, b in blocks if w.startswith(where + ".content[")]
            markers = [m for m in (_marker(block), *map(_marker, inner)) if m]
            if not markers:
                continue
            key = json.dumps([req.get("model"), plain], sort_keys=True)
            if self.entries.get(key, -1.0) > now:
                read_end = n
            keys.append((key, LIFETIME_S.get(str(markers[-1].get("ttl") or "5m"), 300.0)))
            write_end = n
        for key, life in keys:   # written, or read: alive for another lifetime
            self.entries[key] = now + life
        usage = {"input_tokens": sum(costs[write_end:]),
                 "cache_creation_input_tokens": sum(costs[read_end:write_end]),
                 "cache_read_input_tokens": sum(costs[:read_end]),
                 "output_tokens": int(self.base.usage.get("output_tokens", 5))}
        self.usages.append(usage)
        return usage

    def decide(self, req: Any) -> Script | None:
        """The fake's hook: the base script, with the usage the cache makes."""
        if not isinstance(req, dict):
            return None
        return attrs.evolve(self.base, usage=self.usage(req))
