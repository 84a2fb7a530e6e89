"""The one module that imports httpx: the upstream client, and transport-error mapping.

Every upstream client is built here, the same way (notes/trio-stack.md Q3):
- explicit timeouts: connect and pool bounded, *read unbounded*, because relay's own
  cancel scopes (run timeout, attempt budget, stall limits) own the answer's deadlines;
- no proxy from the environment (an ``HTTP_PROXY`` must not capture loopback traffic);
  a proxy is used only when the provider names one (``proxy``);
- no hidden retries (transport retries 0, SPEC F6), no redirects, no cookies kept.

`UpstreamClient` sends each request to a connection pool directly — relay's own
`DirectPool` of httpcore HTTP/1.1 connections, or, for a ``proxy``, the httpcore proxy
pool httpx builds — without httpx's request and response models around it: relay uses
none of what they add (auth flows, redirects, cookies, decoding: `relay.api.body`
decodes). Its failures are mapped to httpx's exceptions (a body's by `transport_errors`
itself), so `transport_errors` has one tree to map. Adapters use it only as
``async with client.stream(...)``: leaving the block closes the response, and an
unfinished one closes its connection (a stop closes the upstream).
"""

from __future__ import annotations

import errno
import functools
import json
import socket
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import attrs
import httpcore
import httpx

from relay.api.pool import CorkedBackend, DirectPool
from relay.vocab.errors import RelayError

__all__ = ["ERROR_BODY_MAX_BYTES", "HTTPSettings", "Response", "UpstreamClient", "get_json",
           "make_client", "post_json", "transport_errors", "upstream_url"]

# An error body is read up to this (or max_upstream_bytes, if smaller): relay shows at
# most 64 KiB of the provider's words (SPEC E1), but a JSON body must be whole to be read
# and its words may be escaped several times over; no real error body comes near it.
ERROR_BODY_MAX_BYTES = 1024 * 1024


@attrs.frozen(kw_only=True)
class HTTPSettings:
    """Settings every HTTP adapter takes (SPEC 9)."""

    base_url: str | None = None
    api_key_env: str | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    proxy: str | None = None
    connect_timeout_s: float = 10.0


def make_client(settings: HTTPSettings, *, max_connections: int = 64) -> UpstreamClient:
    """A client for one provider (one pool, so lanes map to connections)."""
    timeouts = {"connect": settings.connect_timeout_s, "read": None, "write": 30.0,
                "pool": 10.0}
    if settings.proxy is None:
        pool: Any = DirectPool(max_connections=max_connections, keepalive_expiry=5.0,
                               ssl_context=httpx.create_ssl_context,
                               network_backend=CorkedBackend())
        return UpstreamClient(pool, timeouts)
    transport = httpx.AsyncHTTPTransport(  # httpx builds the proxy's pool (HTTP or SOCKS)
        retries=0, proxy=settings.proxy,
        limits=httpx.Limits(max_connections=max_connections,
                            # All of them: httpcore 1.0.9 counts every pooled
                            # connection, busy or not, against this limit, and
                            # closes idle ones past it (encode/httpcore#1000).
                            max_keepalive_connections=max_connections))
    return UpstreamClient(transport._pool, timeouts)


@attrs.frozen
class Target:
    """An upstream URL, parsed once (an adapter's few URLs, reused by every request)."""

    text: str
    url: httpcore.URL
    host: bytes  # the Host header


@functools.lru_cache(maxsize=256)
def upstream_url(url: str) -> Target:
    """``url`` parsed as httpx parses it (``httpx.InvalidURL`` when it cannot be)."""
    parsed = httpx.URL(url)
    return Target(url, httpcore.URL(scheme=parsed.raw_scheme, host=parsed.raw_host,
                                    port=parsed.port, target=parsed.raw_path), parsed.netloc)


# httpcore's exceptions as httpx's, most specific first (httpx's own table, in order).
_MAPPED: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout), (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout), (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError), (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError), (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError))
_HTTPCORE_ERRORS = tuple(own for own, _ in _MAPPED)


class _as_httpx:  # (named as a function: it is used as ``with _as_httpx(...)``)
    """httpcore's failures as httpx's, naming the request when it is known. A class, not
    a generator context manager: `transport_errors` enters one for every piece of every
    body it reads."""

    __slots__ = ("_method", "_target")

    def __init__(self, method: str | None = None, target: Target | None = None) -> None:
        self._method = method
        self._target = target

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None or not isinstance(exc, _HTTPCORE_ERRORS):
            return  # (a stop, trio.Cancelled, passes through)
        mapped = next(theirs for own, theirs in _MAPPED if isinstance(exc, own))
        request = (httpx.Request(self._method, self._target.text)
                   if self._method is not None and self._target is not None else None)
        raise mapped(str(exc), request=request) from exc


def _encoded(value: str) -> bytes:
    # A value from the client's request came in as latin-1: it goes out as it came.
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode()


class Response:
    """An upstream answer: ``status_code``, ``headers`` (by lower-case name, repeated
    ones joined with ", "), and its body as ``aiter_raw()`` (undecoded)."""

    __slots__ = ("_method", "_response", "_target", "headers", "status_code")

    def __init__(self, response: httpcore.Response, method: str, target: Target) -> None:
        self._response = response
        self._method = method
        self._target = target
        self.status_code = response.status
        headers: dict[str, str] = {}
        for name, value in response.headers:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        self.headers: Mapping[str, str] = headers

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """httpcore's own iterator (its failures are mapped by `transport_errors`)."""
        stream = self._response.stream
        assert isinstance(stream, AsyncIterable)
        return aiter(stream)

    async def aclose(self) -> None:
        with _as_httpx(self._method, self._target):
            await self._response.aclose()


class UpstreamClient:
    """One provider's client: requests straight to its httpcore pool."""

    def __init__(self, pool: httpcore.AsyncConnectionPool, timeouts: dict[str, float | None]
                 ) -> None:
        self._pool = pool
        self._extensions = {"timeout": timeouts}

    def stream(self, method: str, url: str | Target, *, json: Any = None,
               headers: Mapping[str, str] | None = None) -> _Exchange:
        """``async with client.stream(...) as response``: the request, its answer open."""
        target = url if isinstance(url, Target) else upstream_url(url)
        sent = {"host": target.host, "accept": b"*/*", "accept-encoding": b"gzip, deflate",
                "connection": b"keep-alive", "user-agent": b"relay"}
        for name, value in (headers or {}).items():
            sent[name.lower()] = _encoded(value)
        content = b""
        if json is not None:  # as httpx encodes it
            content = _json_bytes(json).encode()
            sent.setdefault("content-type", b"application/json")  # a provider's own wins
            sent["content-length"] = str(len(content)).encode()
        request = httpcore.Request(method.encode(), target.url,
                                   headers=[(k.encode(), v) for k, v in sent.items()],
                                   content=content, extensions=self._extensions)
        return _Exchange(self._pool, request, method, target)

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()


_json_bytes = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"),
                                allow_nan=False)


class _Exchange:
    def __init__(self, pool: httpcore.AsyncConnectionPool, request: httpcore.Request,
                 method: str, target: Target) -> None:
        self._pool = pool
        self._request = request
        self._method = method
        self._target = target
        self._response: Response | None = None

    async def __aenter__(self) -> Response:
        with _as_httpx(self._method, self._target):
            answer = await self._pool.handle_async_request(self._request)
        self._response = Response(answer, self._method, self._target)
        return self._response

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._response is not None
        await self._response.aclose()  # closes the connection when the body is unfinished


@contextmanager
def transport_errors(provider: str, what: str = "request", *,
                     unreachable: str | None = None) -> Iterator[None]:
    """Translate every httpx failure to a relay error, chained ``from`` it.

    Timeouts and transport failures are ``upstream_unavailable``; a body httpx cannot
    decode is ``bad_upstream_response``. The mapping covers httpx's whole exception tree
    (a test walks it): an unmapped one would surface as a bare 500.

    Each says what to do next (``action``), true to its cause: nothing listening on the
    address (``unreachable``, the adapter's own advice, or: start the server or fix
    ``base_url``), a name that does not resolve, a connection that was dropped.
    """
    # long because it is one exhaustive mapping of httpx's exception tree, most specific
    # first, where a test can check that nothing falls through.
    try:
        with _as_httpx():  # a body's failures come from httpcore's own iterator
            yield
    except httpx.ConnectError as exc:
        said, action = _connect_failure(provider, exc, unreachable)
        raise RelayError("upstream_unavailable",
                         f"provider {provider!r} could not be reached for the {what}: "
                         f"{said} ({type(exc).__name__}: {exc})",
                         provider=provider, action=action) from exc
    except httpx.TimeoutException as exc:
        where = _address(exc)
        if isinstance(exc, httpx.ConnectTimeout):
            said = f"{where or 'its address'} did not accept a connection in time"
            action = (f"check that {where or 'the server'} is up and reachable from this "
                      f"machine (network, VPN, firewall), or fix base_url in "
                      f"[providers.{provider}]")
        elif isinstance(exc, httpx.PoolTimeout):
            said = "every connection relay keeps to it stayed busy"
            action = ("retry; if it keeps happening, the provider is answering slowly — "
                      f"lower lanes in [providers.{provider}.profile]")
        else:
            said = "it stopped answering"
            action = (f"retry; if it keeps happening, check the provider's server at "
                      f"{where or 'its address'} (it may be overloaded or hung)")
        raise RelayError("upstream_unavailable",
                         f"provider {provider!r} did not answer the {what} in time: {said} "
                         f"({type(exc).__name__}: {exc or 'timed out'})",
                         provider=provider, action=action) from exc
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
        raise RelayError("upstream_unavailable",
                         f"provider {provider!r} could not be sent the {what} "
                         f"({type(exc).__name__}: {exc}); check its base_url",
                         provider=provider,
                         action=f"fix base_url in [providers.{provider}] (http://HOST:PORT/"
                                "PATH or https://…), then reload relay") from exc
    except httpx.ProxyError as exc:
        raise RelayError("upstream_unavailable",
                         f"provider {provider!r} could not be reached through its proxy "
                         f"for the {what} ({type(exc).__name__}: {exc})",
                         provider=provider,
                         action=f"check the proxy set in [providers.{provider}] proxy (is "
                                "it running, does it allow this host?)") from exc
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise RelayError("upstream_unavailable",
                         f"provider {provider!r} could not be reached or dropped the "
                         f"connection during the {what} ({type(exc).__name__}: {exc})",
                         provider=provider,
                         action="retry; if it keeps happening, check the provider's server "
                                "(it may have crashed or restarted) and its logs") from exc
    except (httpx.DecodingError, httpx.TooManyRedirects) as exc:
        raise RelayError("bad_upstream_response",
                         f"provider {provider!r} sent a {what} relay cannot read "
                         f"({type(exc).__name__}: {exc})", provider=provider) from exc
    except httpx.HTTPStatusError as exc:
        raise RelayError("upstream_error", f"provider {provider!r} answered the {what} "
                         f"with an error ({exc})", provider=provider) from exc
    except httpx.HTTPError as exc:
        raise RelayError("upstream_unavailable",
                         f"provider {provider!r} could not be sent the {what} "
                         f"({type(exc).__name__}: {exc}); check its base_url",
                         provider=provider,
                         action=f"check base_url in [providers.{provider}]") from exc
    except httpx.CookieConflict as exc:
        raise RelayError("internal_error", f"relay mishandled a cookie of provider "
                         f"{provider!r} ({exc})", provider=provider) from exc


def _address(exc: httpx.HTTPError) -> str | None:
    """``host:port`` of the request that failed, if httpx kept it."""
    try:
        url = exc.request.url
    except RuntimeError:  # raised outside a request
        return None
    port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    host = f"[{url.host}]" if ":" in url.host else url.host
    return f"{host}:{port}" if port else host


def _causes(exc: BaseException) -> list[BaseException]:
    """Every exception behind ``exc``: its causes, and the leaves of exception groups."""
    out: list[BaseException] = []
    todo = [exc.__cause__ or exc.__context__]
    while todo:
        cause = todo.pop()
        if cause is None or any(cause is seen for seen in out):
            continue
        out.append(cause)
        if isinstance(cause, BaseExceptionGroup):
            todo += cause.exceptions
        todo.append(cause.__cause__ or cause.__context__)
    return out


_NO_SUCH_ADDRESS = frozenset({errno.EADDRNOTAVAIL, errno.ENETUNREACH, errno.EAFNOSUPPORT})


def _connect_failure(provider: str, exc: httpx.ConnectError,
                     unreachable: str | None) -> tuple[str, str]:
    """What a failed connect means, and what to do about it."""
    where = _address(exc) or "its address"
    causes = _causes(exc)
    leaves = [c for c in causes if not isinstance(c, BaseExceptionGroup)]
    os_errors = [c for c in leaves if isinstance(c, OSError) and c.errno is not None]
    # localhost is tried on ::1 and 127.0.0.1; an address family this machine lacks is
    # no sign that something listens on the other one.
    if any(isinstance(c, ConnectionRefusedError) for c in os_errors) and all(
            isinstance(c, ConnectionRefusedError) or c.errno in _NO_SUCH_ADDRESS
            for c in os_errors):
        host = where.rpartition(":")[0].strip("[]")
        local = host in ("localhost", "::1") or host.startswith("127.")
        action = unreachable or (
            f"start the provider's server at {where}, or fix base_url in "
            f"[providers.{provider}]" if local else
            f"check that the server at {where} is up and that nothing between this machine "
            f"and it refuses the connection, or fix base_url in [providers.{provider}]")
        return f"nothing listens on {where} — {action}", action
    if any(isinstance(c, socket.gaierror) for c in leaves):
        host = where.rpartition(":")[0] or where
        return (f"the host name {host} could not be resolved",
                f"check the host name in base_url in [providers.{provider}], and this "
                "machine's network and DNS")
    if any(isinstance(c, ssl.SSLError) for c in leaves):
        return (f"the TLS handshake with {where} failed",
                f"check that base_url in [providers.{provider}] uses https:// only for a "
                "server that speaks TLS, and that its certificate is valid")
    return (f"no connection to {where} could be made",
            f"check that {where} is up and reachable from this machine (network, VPN, "
            f"firewall), or fix base_url in [providers.{provider}]")



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
