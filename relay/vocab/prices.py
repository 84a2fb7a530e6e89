"""What a request cost (SPEC O7): prices per million tokens, and a record's usage priced.

The packaged table (``relay/prices.toml``, dated in its header) holds the list prices of
the current OpenAI, Anthropic and Gemini models; a provider's
``[providers.NAME.prices."MODEL"]`` overrides it (`ProviderConfig.prices`). A model is
looked up by its exact name, then without a date suffix (``-20250514``, ``-2024-08-06``),
then by the longest entry its name starts with, followed by ``-``, ``.`` or ``@``
(`lookup`). A usage is priced apart by kind (`cost_of`): ``prompt_tokens`` counts every
prompt token, cache reads and writes included; the reads are priced at ``cached_input``,
the writes at ``cache_write``, the rest at ``input``, the completion at ``output``. A
price that is needed and not known gives None — never a guess.
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["FREE", "PACKAGED_PRICES", "Price", "cost_of", "lookup", "packaged"]

PACKAGED_PRICES = Path(__file__).parent.parent / "prices.toml"

_DATE = re.compile(r"[-@](?:\d{8}|\d{4}-\d{2}-\d{2})$")


def _price(inst: object, attr: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value >= 0:  # (NaN too)
        raise ValueError(f"must be a number of dollars per million tokens >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class Price:
    """US dollars per million tokens; None: not known."""

    input: float | None = attrs.field(default=None, validator=_price)
    cached_input: float | None = attrs.field(default=None, validator=_price)
    cache_write: float | None = attrs.field(default=None, validator=_price)
    output: float | None = attrs.field(default=None, validator=_price)

    def over(self, base: Price | None) -> Price:
        """This price, with what it leaves unknown taken from ``base``."""
        if base is None:
            return self
        return Price(**{f.name: getattr(base, f.name) if getattr(self, f.name) is None
                        else getattr(self, f.name) for f in attrs.fields(Price)})


FREE = Price(input=0.0, cached_input=0.0, cache_write=0.0, output=0.0)  # a subscription


@functools.cache
def packaged() -> Mapping[str, Price]:
    """The packaged table, read once."""
    data = tomllib.loads(PACKAGED_PRICES.read_text(encoding="utf-8"))
    return {model: Price(**figures) for model, figures in data.items()}


def lookup(table: Mapping[str, Price], model: str) -> Price | None:
    """``model``'s price in ``table``: exact, then without a date suffix, then the longest
    entry it starts with at a boundary (``-``, ``.``, ``@``); None when none matches."""
    if model in table:
        return table[model]
    bare = _DATE.sub("", model)
    if bare in table:
        return table[bare]
    best: str | None = None
    for name in table:
        if (len(name) < len(bare) and bare.startswith(name) and bare[len(name)] in "-.@"
                and (best is None or len(name) > len(best))):
            best = name
    return table[best] if best is not None else None


def cost_of(usage: Mapping[str, Any] | None, price: Price | None) -> float | None:
    """What ``usage`` (a record's) cost at ``price``, in US dollars rounded to 1e-6; None
    when the usage or a price it needs is not known."""
    if usage is None or price is None:
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if prompt is None and completion is None:
        return None
    read = usage.get("cache_read_tokens") or 0
    written = usage.get("cache_write_tokens") or 0
    plain = max(0, (prompt or 0) - read - written)
    total = 0.0
    for tokens, per_million in ((plain, price.input), (read, price.cached_input),
                                (written, price.cache_write), (completion or 0, price.output)):
        if tokens:
            if per_million is None:
                return None
            total += tokens * per_million
    return round(total / 1_000_000, 6)
