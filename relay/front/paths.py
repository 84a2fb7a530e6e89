"""The paths relay serves, as one table (`SERVED`): the front routes every request by
it, Quart registers its routes from it, and a path it does not hold gets a 404 that
lists it (SPEC 9).

Each entry is a path in werkzeug's rule syntax (``<name>`` one segment, ``<path:name>``
one or more — a model id may hold ``/``, SPEC A1), its methods, and its kind: a relay
route served in raw ASGI (``chat`` in the dialect `RELAY_ROUTES` gives it,
``embeddings``, ``count_tokens``, ``fanout``), ``info`` (the JSON routes programs poll,
in raw ASGI too: `relay.front.info`), or ``quart`` (the status page and relay's other own
routes, `relay.front.routes`). A request's path is matched once its percent-escapes are
decoded (the ASGI ``path``), so ``/v1/models/fake%2Fecho`` is ``/v1/models/fake/echo``.

A path no entry holds is answered here: 404 with the list, in Anthropic's shape under
``/v1/messages``, Google's under ``/v1beta``, Ollama's under ``/api/`` and OpenAI's
elsewhere, logged in one INFO line and recorded with the path as the record's
``endpoint`` — a client with the wrong base URL (``/chat/completions``, ``/v1/v1/…``) or
the wrong API (``/v1/completions``) learns what to use instead.
"""

from __future__ import annotations

import difflib
import logging
import re

import attrs
import trio

from relay.dialects.anthropic_messages import ANTHROPIC
from relay.dialects.base import Dialect
from relay.dialects.gemini_generate import GEMINI
from relay.dialects.ollama import OLLAMA
from relay.dialects.openai_chat import OPENAI
from relay.engine.engine import Engine
from relay.vocab.errors import RelayError
from relay.vocab.records import Record

from .asgi import RELAY_ROUTES, Scope, Send, send_error

__all__ = ["GEMINI_METHODS", "SERVED", "Served", "dialect_for", "gemini_method",
           "google_client", "match", "not_served", "served_list"]

logger = logging.getLogger(__name__)

_PARAM = re.compile(r"<(?:(\w+):)?(\w+)>")


@attrs.frozen
class Served:
    rule: str                  # werkzeug's syntax: "/v1/models/<path:model>"
    methods: tuple[str, ...]
    # chat | responses | stored | embeddings | count_tokens | fanout | gemini | info | quart
    # | ollama (a relay route of Ollama's API) | ollama_info (its other paths)
    kind: str
    dialect: Dialect | None = None  # a relay route's: its bodies and its errors
    pattern: re.Pattern[str] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        def part(m: re.Match[str]) -> str:
            return f"(?P<{m[2]}>[^/].*)" if m[1] == "path" else f"(?P<{m[2]}>[^/]+)"

        regex, pos = "", 0
        for m in _PARAM.finditer(self.rule):
            regex += re.escape(self.rule[pos:m.start()]) + part(m)
            pos = m.end()
        regex += re.escape(self.rule[pos:])
        object.__setattr__(self, "pattern", re.compile(regex + r"\Z"))

    @property
    def shown(self) -> str:
        """The path as a person reads it: ``/v1/models/{model}``."""
        return _PARAM.sub(lambda m: "{" + m[2] + "}", self.rule)

    @property
    def relay_route(self) -> bool:
        """Whether it is a relay route (each request of one ends in one record)."""
        return self.kind not in ("info", "quart", "ollama_info")


SERVED: tuple[Served, ...] = (
    *(Served(path, ("POST",), "responses" if path == "/v1/responses" else "chat", dialect)
      for path, dialect in RELAY_ROUTES.items()),
    Served("/v1/responses/<path:response>", ("GET", "DELETE"), "stored", OPENAI),
    Served("/v1/messages/count_tokens", ("POST",), "count_tokens", ANTHROPIC),
    Served("/v1/embeddings", ("POST",), "embeddings", OPENAI),
    # Google's Gemini API (SPEC A9): the model list, a model, and its methods
    # (``{model}:generateContent``, …): `relay.front.gemini`.
    Served("/v1beta/models", ("GET",), "gemini", GEMINI),
    Served("/v1beta/models/<path:model>", ("GET", "POST"), "gemini", GEMINI),
    Served("/v1/models", ("GET",), "info"),
    Served("/v1/models/<path:model>", ("GET",), "info"),
    Served("/relay/v1/fanout", ("POST",), "fanout", OPENAI),
    Served("/relay/v1/status", ("GET",), "info"),
    Served("/relay/v1/requests", ("GET",), "quart"),
    Served("/relay/v1/usage", ("GET",), "quart"),
    Served("/relay/v1/providers/<name>/check", ("POST",), "quart"),
    Served("/relay/v1/reload", ("POST",), "quart"),
    Served("/metrics", ("GET",), "quart"),
    Served("/healthz", ("GET",), "info"),
    Served("/", ("GET",), "quart"),
    # Ollama's API (SPEC A10): `relay.front.ollama` (and ``/`` on [server] ollama_port)
    *(Served(f"/api/{name}", ("POST",), "ollama", OLLAMA)
      for name in ("chat", "generate", "embed", "embeddings")),
    *(Served(f"/api/{name}", ("GET",), "ollama_info", OLLAMA)
      for name in ("tags", "ps", "version")),
    Served("/api/show", ("POST",), "ollama_info", OLLAMA),
    *(Served(f"/api/{name}", ("POST",), "ollama_info", OLLAMA)
      for name in ("pull", "push", "create", "copy")),
    Served("/api/delete", ("DELETE",), "ollama_info", OLLAMA),
    Served("/api/blobs/<digest>", ("HEAD", "POST"), "ollama_info", OLLAMA),
)


_EXACT = {entry.rule: entry for entry in SERVED if "<" not in entry.rule}
_PATTERNS = [entry for entry in SERVED if "<" in entry.rule]


def match(path: str) -> Served | None:
    """The entry serving ``path`` (decoded), whatever the method, or None."""
    entry = _EXACT.get(path)  # every request asks (the guard, the front): keep it cheap
    if entry is not None:
        return entry
    for entry in _PATTERNS:
        if entry.pattern.match(path):
            return entry
    return None


def dialect_for(path: str) -> Dialect:
    """The dialect of every answer on ``path``, errors included: a relay route's own;
    Anthropic's anywhere under ``/v1/messages``; Google's anywhere under ``/v1beta``;
    Ollama's anywhere under ``/api/``; OpenAI's elsewhere."""
    entry = match(path)
    if entry is not None and entry.dialect is not None:
        return entry.dialect
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path == "/v1beta" or path.startswith("/v1beta/") or gemini_method(path):
        return GEMINI
    if path.startswith("/api/"):
        return OLLAMA
    return OPENAI


GEMINI_METHODS = ("generateContent", "streamGenerateContent", "countTokens",
                  "embedContent", "batchEmbedContents")


def gemini_method(path: str) -> bool:
    """Whether ``path`` is a Gemini model's method under ``/v1/models`` (Google's v1,
    which its newer SDKs use by default): ``/v1/models/{model}:generateContent``."""
    return path.startswith("/v1/models/") and path.rpartition(":")[2] in GEMINI_METHODS


def google_client(scope: Scope) -> bool:
    """Whether the request comes from a Google client (SPEC A9): its key in
    ``x-goog-api-key`` or ``?key=``, or its SDK named in ``x-goog-api-client``. An
    OpenAI client sends none of them; to it ``GET /v1/models`` stays OpenAI's list."""
    for key, _ in scope["headers"]:
        if key in (b"x-goog-api-key", b"x-goog-api-client"):
            return True
    query = scope.get("query_string") or b""
    return query.startswith(b"key=") or b"&key=" in query


def served_list() -> str:
    return ", ".join(f"{'|'.join(e.methods)} {e.shown}" for e in SERVED)


def _suggestion(path: str) -> str | None:
    shown = [e.shown for e in SERVED]
    # The usual slips: a base URL without /v1, or with it twice.
    for guess in (f"/v1{path}", path.removeprefix("/v1")):
        if guess != path and match(guess) is not None and guess != "/":
            return guess
    close = difflib.get_close_matches(path, shown, n=1, cutoff=0.75)
    return close[0] if close else None


async def not_served(relay: Engine, scope: Scope, send: Send) -> None:
    """Answer a request for a path relay does not serve (see the module docstring)."""
    path, method = scope["path"], scope["method"]
    guess = _suggestion(path)
    hint = f" Did you mean {guess}?" if guess else ""
    error = RelayError("invalid_request", f"relay does not serve {method} {path}.{hint} "
                       f"The paths it serves: {served_list()}", status=404)
    now = trio.current_time()
    relay.records.write(Record(id=scope["relay.request_id"], started_at=now, endpoint=path,
                               status=error.status, reason=error.reason, phase=error.phase))
    logger.info("not_served request=%s %s %s: 404%s", scope["relay.request_id"], method,
                path, f" (did you mean {guess}?)" if guess else "")
    await send_error(send, error, dialect_for(path))
