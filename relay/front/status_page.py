"""The status page at ``GET /``: one self-contained HTML file (``status.html``).

No build step and no external assets: the page's CSS and script are inline and it
fetches ``/relay/v1/status`` and ``/relay/v1/requests`` from its own origin every 2 s;
its "check" buttons post to ``/relay/v1/providers/NAME/check``. Every text it shows is
set through ``textContent``, never parsed as HTML (model names and error messages come
from providers). As a second fence, the response forbids every script but the page's
own (a fresh CSP nonce per response), all loads from elsewhere, and framing.

The guard lets the page's own requests through: a same-origin POST carries
``Origin: http://HOST:PORT`` equal to its ``Host`` (relay.front), and the page itself
needs no token (it holds no data); with a token configured the page asks for it and
sends it as a bearer token.
"""

from __future__ import annotations

import functools
import secrets
from importlib.resources import files

from quart import Response

__all__ = ["page_response"]


@functools.cache
def _template() -> str:
    return files("relay").joinpath("status.html").read_text(encoding="utf-8")


def page_response() -> Response:
    nonce = secrets.token_urlsafe(16)
    html = _template().replace("{{nonce}}", nonce)
    response = Response(html, content_type="text/html; charset=utf-8")
    response.headers["Content-Security-Policy"] = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'")
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-store"
    return response
