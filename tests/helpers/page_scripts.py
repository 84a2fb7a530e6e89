"""Scripts the WebDriver runs on the status page: a provider card's field, read or compared."""

from __future__ import annotations


def card(provider: str, field: str) -> str:
    """A script returning a field's text on a provider's card (null when not shown)."""
    return (f"const e = document.querySelector('[data-provider=\"{provider}\"] "
            f"[data-field=\"{field}\"]'); return e ? e.textContent : null;")


def card_is(provider: str, field: str) -> str:
    """A script: is the field's text ``arguments[0]``?"""
    return card(provider, field).replace("return e ? e.textContent : null;",
                                         "return !!e && e.textContent === arguments[0];")
