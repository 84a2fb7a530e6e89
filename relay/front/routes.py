"""The routes Quart serves: the status page, the recent requests, metrics, checks and
reload.

Each is registered from its entry in the table of `relay.front.paths` (``@route(path)``
takes the entry's rule and methods, and a path the table does not hold fails here, at
start-up), so the paths relay routes by and the paths its 404 lists are one list. The
routes programs poll (health, models, status) are raw ASGI (`relay.front.info`), so
Quart is imported only when one of these is first asked for (`relay.front.app`).

Quart's own 60 s response and body timeouts are off (notes/trio-stack.md: they cut long
responses silently); relay owns its deadlines. Every error here is an E1 body too.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from relay.engine.checks import check_provider
from relay.engine.engine import Engine
from relay.shared import figures
from relay.usage.report import DEFAULT_BY, answer, parse_by, parse_since, window
from relay.vocab.errors import ConfigError, RelayError

from .metrics import CONTENT_TYPE, Metrics
from .paths import SERVED
from .status_page import page_response

__all__ = ["make_quart_app"]

_View = TypeVar("_View", bound=Callable[..., Awaitable[Response]])


def _error(error: RelayError) -> Response:
    response = Response(_json(error.body()), status=error.status,
                        content_type="application/json")
    for key, value in error.headers():
        response.headers[key.decode()] = value.decode()
    return response


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def make_quart_app(relay: Engine, metrics_: Metrics) -> QuartTrio:
    # long because it is the table of the plain routes, each a few lines, closed over the
    # relay they serve.
    app = QuartTrio("relay")
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = None  # the guard limits bodies
    table = {entry.rule: entry for entry in SERVED if entry.kind == "quart"}

    def route(rule: str) -> Callable[[_View], _View]:
        return app.route(rule, methods=list(table[rule].methods))

    @route("/")
    async def status_page() -> Response:
        return page_response()

    @route("/relay/v1/requests")
    async def recent_requests() -> Response:
        """The last records, newest first (``?limit=N``, at most 200): the status page's."""
        limit = request.args.get("limit", "50")
        # ASCII digits only: str.isdigit() is true for '²', which int() refuses.
        if not (limit.isascii() and limit.isdigit()):
            return _error(RelayError("invalid_request", "limit must be a whole number",
                                     param="limit"))
        digits = limit.lstrip("0")
        count = 200 if len(digits) > 3 else min(int(digits or "0"), 200)
        recent = relay.records.recent[-count:] if count else []
        return Response(_json({"requests": recent[::-1]}), content_type="application/json")

    @route("/relay/v1/usage")
    async def usage() -> Response:
        """Usage from the database (SPEC O7): ``?since=`` (default today) and ``?by=``
        as `relay usage` reads them; its JSON answer. The status page's panel."""
        store = relay.usage
        if store is None:
            return _error(RelayError("invalid_request", "relay keeps no records ([server] "
                                     "records is off), so it keeps no usage", status=404))
        try:
            since = parse_since(request.args.get("since", "today"))
            by = parse_by(request.args.get("by", DEFAULT_BY))
        except ValueError as exc:
            return _error(RelayError("invalid_request", str(exc)))
        start, end = window(since)
        try:
            rows = await store.query(start, end, by)
        except (sqlite3.Error, OSError) as exc:
            return _error(RelayError("internal_error", f"the usage database {store.path} "
                                     f"cannot be read: {exc}", status=503))
        return Response(_json(answer(rows, start, end, by, f"database {store.path}")),
                        content_type="application/json")

    @route("/metrics")
    async def metrics() -> Response:
        await figures.refresh(p.lane for p in relay.providers.values())  # (SPEC L11)
        return Response(metrics_.render(), content_type=CONTENT_TYPE)

    @route("/relay/v1/providers/<name>/check")
    async def check(name: str) -> Response:
        provider = relay.providers.get(name)
        if provider is None:
            return _error(RelayError("invalid_request", f"no provider is named {name!r}; "
                                     f"known: {', '.join(relay.providers)}", status=404))
        result = await check_provider(relay, provider)
        body = {**result.as_dict(), "status": provider.status(relay.clock)}
        return Response(_json(body), content_type="application/json")

    @route("/relay/v1/reload")
    async def reload() -> Response:
        try:
            changes = await relay.reload()
        except ConfigError as exc:
            error = RelayError("invalid_request", "the config file has problems; nothing was "
                               "changed:\n  " + "\n  ".join(exc.problems))
            response = _error(error)
            return response
        return Response(_json({"ok": True, "source": relay.config.source,
                               "changes": changes}), content_type="application/json")

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        if code >= 500:
            return _error(RelayError("internal_error", exc.description or "internal error"))
        return _error(RelayError("invalid_request", f"{exc.name}: no route "
                                 "here answers this request" if code in (404, 405)
                                 else f"{exc.name}: {exc.description}", status=code))

    @app.errorhandler(Exception)
    async def crashed(exc: Exception) -> Response:
        app.logger.error("route crashed", exc_info=exc)
        return _error(RelayError("internal_error", f"relay failed unexpectedly "
                                 f"({type(exc).__name__}); see its log"))

    return app
