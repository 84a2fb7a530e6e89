"""The one module that imports httpx: client construction and transport-error mapping.

Every upstream client is built here, the same way (notes/trio-stack.md Q3):
- explicit timeouts: connect and pool bounded, *read unbounded*, because relay's own
  cancel scopes (run timeout, attempt budget, stall limits) own the answer's deadlines;
- ``trust_env=False``: an ``HTTP_PROXY`` in the environment must not capture loopback
  traffic; a proxy is used only when the provider names one (``proxy``);
- no hidden retries (transport retries 0, SPEC F6), no redirects.

Adapters use the client only as ``async with client.stream(...)``: a bare
``send(stream=True)`` leaks a pool slot.

Bodies are read through `UpstreamBody`, never ``aread()``/``aiter_lines()`` (SPEC O5):
relay decompresses them itself, in bounded pieces, so a body is measured *after*
decompression and reading stops at the bound — a 1 MB gzip body that inflates to 1 GB
never exists in memory (httpx would inflate each network chunk whole). `read_answer`
refuses a body over ``max_upstream_bytes``; `read_error_text` keeps the head of an error
body and says how much it read. Only ``gzip`` and ``deflate`` are asked for and decoded.
"""

from __future__ import annotations

import errno
import functools
import json
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import httpx

from relay.api.inflate import Inflate
from relay.api.pool import LeanPool
from relay.vocab.errors import RelayError, cut_marker

__all__ = ["ERROR_BODY_MAX_BYTES", "PIECE_BYTES", "AsyncClient", "HTTPSettings", "Response",
           "UpstreamBody", "get_json", "make_client", "post_json", "read_answer",
           "read_error_text", "transport_errors", "upstream_url"]

PIECE_BYTES = 64 * 1024  # the most a decoded piece of a body holds
# An error body is read up to this (or max_upstream_bytes, if smaller): relay shows at
# most 64 KiB of the provider's words (SPEC E1), but a JSON body must be whole to be read
# and its words may be escaped several times over; no real error body comes near it.
ERROR_BODY_MAX_BYTES = 1024 * 1024

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
    transport = httpx.AsyncHTTPTransport(
        retries=0, proxy=settings.proxy,
        limits=httpx.Limits(max_connections=max_connections,
                            # All of them: httpcore 1.0.9 counts every pooled
                            # connection, busy or not, against this limit, and
                            # closes idle ones past it (encode/httpcore#1000).
                            max_keepalive_connections=max_connections))
    LeanPool.install(transport)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=settings.connect_timeout_s, read=None, write=30.0,
                              pool=10.0),
        transport=transport,
        trust_env=False,
        follow_redirects=False,
        # What `UpstreamBody` decodes (with brotli or zstandard installed, httpx would
        # ask for those too).
        headers={"accept-encoding": "gzip, deflate"},
    )
    client._cookies = _NoCookies()  # (the property's setter would copy it into a plain jar)
    return client


class _NoCookies(httpx.Cookies):
    """A jar that keeps nothing: relay sends no upstream's cookies back. One client
    serves every caller of a provider, so a cookie set in one caller's answer must not
    ride along on another's request; and reading ``Set-Cookie`` the stdlib way cost
    ~0.1 ms per request (issue 16's profile)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        pass


@functools.lru_cache(maxsize=256)
def upstream_url(url: str) -> httpx.URL:
    """``url`` parsed once (an adapter's few URLs, reused by every request)."""
    return httpx.URL(url)


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


class UpstreamBody:
    """The decoded body of an open httpx response, in pieces of at most `PIECE_BYTES`.

    Transport failures are mapped as `transport_errors` maps them; a body that cannot
    be decoded, or has an encoding relay did not ask for, is ``bad_upstream_response``.
    ``read`` counts the decoded bytes handed out so far.
    """

    def __init__(self, resp: httpx.Response, provider: str, what: str = "answer") -> None:
        self.provider = provider
        self.what = what
        self.read = 0
        self._raw: AsyncIterator[bytes] = resp.aiter_raw()
        self._ended = False
        codings = [c.strip().lower() for c in resp.headers.get("content-encoding", "")
                   .split(",") if c.strip() and c.strip().lower() != "identity"]
        if len(codings) > 1 or (codings and codings[0] not in ("gzip", "x-gzip",
                                                                "deflate")):
            raise RelayError("bad_upstream_response", f"provider {provider!r} sent its "
                             f"{what} with content-encoding {', '.join(codings)!r}; relay "
                             "asks for gzip or deflate only", provider=provider)
        self._inflate = Inflate(codings[0]) if codings else None

    async def piece(self, most: int = PIECE_BYTES) -> bytes | None:
        """The next decoded bytes (at most ``most``), or None at the end of the body."""
        while True:
            if self._inflate is not None:
                out = self._take(most)
                if out:
                    self.read += len(out)
                    return out
            if self._ended:
                return None
            with transport_errors(self.provider, self.what):
                chunk = await anext(self._raw, None)
            if chunk is None:
                self._ended = True
                continue  # whatever zlib still holds comes out first
            if self._inflate is None:
                self.read += len(chunk)
                return chunk
            self._inflate.feed(chunk)

    def _take(self, most: int) -> bytes:
        assert self._inflate is not None
        try:
            return self._inflate.take(most)
        except zlib.error as exc:
            raise RelayError("bad_upstream_response", f"provider {self.provider!r} sent a "
                             f"{self._inflate.encoding} {self.what} relay cannot decode "
                             f"({exc})", provider=self.provider) from exc

    async def drain(self) -> None:
        """Read the rest of the body without decoding it (so the pooled connection can be
        reused); the caller bounds it in time."""
        with transport_errors(self.provider, self.what):
            async for _ in self._raw:
                pass
        self._ended = True


async def read_answer(resp: httpx.Response, provider: str, limit: int,
                      what: str = "answer") -> str:
    """The whole body as text, read through `UpstreamBody`.

    Raises:
        RelayError: ``bad_upstream_response`` naming ``max_upstream_bytes`` when the
            body, decompressed, is larger than ``limit`` (reading stops there); the
            mapped transport failure.
    """
    body = UpstreamBody(resp, provider, what)
    # Pieces in a list, joined once at the end: a growing bytearray may be copied on
    # realloc, and then two copies of the body exist at once.
    pieces: list[bytes] = []
    size = 0
    while (piece := await body.piece(min(PIECE_BYTES, limit + 1 - size))) is not None:
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            raise RelayError(
                "bad_upstream_response",
                f"provider {provider!r} sent a {what} larger than max_upstream_bytes "
                f"({limit} bytes, counted after decompression); relay stopped reading it "
                f"there. Raise [server] max_upstream_bytes if answers this large are "
                "expected.", provider=provider)
    data = b"".join(pieces)
    pieces.clear()
    return data.decode("utf-8", "replace")


async def read_error_text(resp: httpx.Response, provider: str, limit: int) -> str:
    """An error body as text: whole up to ``limit`` decoded bytes; beyond, its head and
    ``… [≥ N bytes]`` (N: the bytes read), and the rest is never read.

    A body that breaks off or cannot be decoded keeps what was read (the status already
    says what went wrong), so this never raises a relay error of its own.
    """
    data = bytearray()
    try:
        body = UpstreamBody(resp, provider, "error answer")
        while (piece := await body.piece(min(PIECE_BYTES, limit + 1 - len(data)))) is not None:
            data += piece
            if len(data) > limit:
                head = bytes(data[:limit]).decode("utf-8", "ignore")
                return head + cut_marker(len(data), at_bound=True)
    except RelayError:
        pass
    return data.decode("utf-8", "replace")


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
