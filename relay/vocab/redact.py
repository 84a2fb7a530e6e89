"""Secrets never leave relay: one redactor, applied at every exit (SPEC E1).

Every configured secret of at least `MIN_SECRET_LEN` characters — each provider's key
(from its ``api_key_env``), relay's own token, the values of ``headers``, ``proxy`` and
CLI ``env`` tables — becomes `MARK` wherever relay lets text out: the error serializer
(`relay.errors`), every log line (a record factory runs `RedactingFilter` on each record
as it is made, exception text included: a Gemini key in a URL), the record writer and
the status. Redaction happens once, before any cut, so a cut never leaves half a secret
behind. An upstream that echoes the ``Authorization`` header in its 401 body is the case
this exists for.

Secrets are installed per owner (a running relay; a reload replaces its set) and the
active set is the union of every owner's; `uninstall` removes an owner's. This module
imports nothing of relay's (the vocabulary layer uses it).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["MARK", "MIN_SECRET_LEN", "RedactingFilter", "active", "head", "install",
           "redact", "redact_obj", "uninstall"]

MIN_SECRET_LEN = 8  # shorter values ("0", "true") would redact ordinary words
MARK = "[redacted]"

T = TypeVar("T")

_lock = threading.Lock()
_owners: dict[int, frozenset[str]] = {}
_secrets: frozenset[str] = frozenset()
_pattern: re.Pattern[str] | None = None


def install(owner: object, secrets: Iterable[str]) -> None:
    """Set ``owner``'s secrets (replacing its previous set) and make sure every log
    record is redacted from now on."""
    keep = frozenset(s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_LEN)
    with _lock:
        _owners[id(owner)] = keep
        _rebuild()
    _install_log_factory()


def uninstall(owner: object) -> None:
    """Forget ``owner``'s secrets (a relay that has closed)."""
    with _lock:
        _owners.pop(id(owner), None)
        _rebuild()


def active() -> frozenset[str]:
    """Every secret being redacted now."""
    return _secrets


def _rebuild() -> None:
    global _secrets, _pattern
    _secrets = frozenset().union(*_owners.values())
    # Longest first: a secret that contains another is replaced whole.
    ordered = sorted(_secrets, key=len, reverse=True)
    _pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None


def redact(text: str) -> str:
    """``text`` with every active secret replaced by `MARK`."""
    pattern = _pattern
    if pattern is None or not text:
        return text
    return pattern.sub(MARK, text)


def head(text: str, n: int) -> str:
    """The first ``n`` characters of ``text`` redacted — before the cut, so a secret
    that straddles it does not leave its first half behind."""
    if _pattern is None:
        return text[:n]
    longest = max(map(len, _secrets))
    return redact(text[:n + longest])[:n]


def redact_obj(obj: T) -> T:
    """A JSON-like value (dicts, lists, tuples, strings) with every string redacted —
    keys included. Other values are returned as they are."""
    if _pattern is None:
        return obj
    return _walk(obj)  # type: ignore[no-any-return]


def _walk(obj: Any) -> Any:
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {_walk(k): _walk(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_walk(v) for v in obj)
    return obj


class RedactingFilter(logging.Filter):
    """Redacts a log record in place: its message (formatted with its args), its
    exception text and its stack. Idempotent; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _pattern is None:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it when it emits
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            # Formatted now (as Formatter.format would) so the text that is written is
            # the redacted one: exception messages carry URLs, headers, bodies.
            record.exc_text = _FORMATTER.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FORMATTER = logging.Formatter()
_FILTER = RedactingFilter()
_factory_installed = False


def _install_log_factory() -> None:
    """Every record, from any logger to any handler (relay's, hypercorn's, an embedding
    program's, pytest's), passes `RedactingFilter` as it is made: a filter on handlers
    would miss the handlers added later, and one on loggers misses their children."""
    global _factory_installed
    with _lock:
        if _factory_installed:
            return
        _factory_installed = True
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            _FILTER.filter(record)
            return record

        logging.setLogRecordFactory(factory)
