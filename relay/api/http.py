"""The one module that imports httpx: client construction and transport-error mapping.

Every upstream client is built here, the same way (notes/trio-stack.md Q3):
- explicit timeouts: connect and pool bounded, *read unbounded*, because relay's own
  cancel scopes (run timeout, attempt budget, stall limits) own the answer's deadlines;
- ``trust_env=False``: an ``HTTP_PROXY`` in the environment must not capture loopback
  traffic; a proxy is used only when the provider names one (``proxy``);
- no hidden retries (transport retries 0, SPEC F6), no redirects.

Adapters use the client only as ``async with client.stream(...)``: a bare
``send(stream=True)`` leaks a pool slot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import httpx

from relay.vocab.errors import RelayError

__all__ = ["AsyncClient", "HTTPSettings", "Response", "get_json", "make_client",
           "post_json", "transport_errors"]

AsyncClient = httpx.AsyncClient
Response = httpx.Response


@attrs.frozen(kw_only=True)
class HTTPSettings:
    """Settings every HTTP adapter takes (SPEC 9)."""

    base_url: str | None = None
    api_key_env: str | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    proxy: str | None = None
    connect_timeout_s: float = 10.0


def make_client(settings: HTTPSettings, *, max_connections: int = 64) -> httpx.AsyncClient:
    """A client for one provider (one pool, so lanes map to connections)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=settings.connect_timeout_s, read=None, write=30.0,
                              pool=10.0),
        transport=httpx.AsyncHTTPTransport(
            retries=0, proxy=settings.proxy,
            limits=httpx.Limits(max_connections=max_connections,
                                # All of them: httpcore 1.0.9 counts every pooled
                                # connection, busy or not, against this limit, and
                                # closes idle ones past it (encode/httpcore#1000).
                                max_keepalive_connections=max_connections)),
        trust_env=False,
        follow_redirects=False,
    )


@contextmanager
def transport_errors(provider: str, what: str = "request") -> Iterator[None]:
    """Translate httpx's failures to ``upstream_unavailable``, chained ``from`` them."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise RelayError("upstream_unavailable",
                         f"provider {provider!r} did not answer the {what} in time "
                         f"({type(exc).__name__}: {exc or 'timed out'})",
                         provider=provider) from exc
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise RelayError("upstream_unavailable",
                         f"provider {provider!r} could not be reached or dropped the "
                         f"connection during the {what} ({type(exc).__name__}: {exc})",
                         provider=provider) from exc


def get_json(url: str, *, token: str | None = None, timeout_s: float = 10.0) -> Any:
    """A blocking GET for the command line (never used inside the event loop)."""
    return _blocking("GET", url, None, token, timeout_s)


def post_json(url: str, body: Any = None, *, token: str | None = None,
              timeout_s: float = 60.0) -> Any:
    """A blocking POST for the command line (never used inside the event loop)."""
    return _blocking("POST", url, body, token, timeout_s)


def _blocking(method: str, url: str, body: Any, token: str | None, timeout_s: float) -> Any:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        try:
            resp = client.request(method, url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise OSError(f"cannot reach relay at {url}: {exc}") from exc
    try:
        return resp.status_code, resp.json()
    except json.JSONDecodeError:
        return resp.status_code, {"error": {"message": resp.text}}
