"""The coordination server's URL (SPEC L11): what relay's Redis client may be given.

What a URL may say: ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``, ``rediss://`` (TLS,
verified against the system's CAs, or ``?ssl_ca_certs=PATH``; ``?ssl_cert_reqs=none``
skips it), ``unix:///PATH[?db=N&password=…]``; ``valkey://`` and ``valkeys://`` alike. No
error message here quotes the URL: it may hold a password.
"""

from __future__ import annotations

import ssl
import urllib.parse

import attrs

__all__ = ["CoordinationTarget", "parse_url"]


@attrs.frozen
class CoordinationTarget:
    host: str
    port: int
    path: str | None  # a unix socket's
    username: str | None
    password: str | None = attrs.field(repr=False)  # never shown
    db: int = 0
    ssl_context: ssl.SSLContext | None = attrs.field(default=None, eq=False)  # TLS (rediss://)


def parse_url(url: str) -> CoordinationTarget:
    """Raises: ValueError, naming what is wrong but not quoting the URL."""
    try:  # (urlsplit's own message may quote the password)
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise ValueError("is not a valid URL") from None
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError("its port must be a number from 1 to 65535") from None
    scheme = parts.scheme.lower()
    query = dict(urllib.parse.parse_qsl(parts.query))
    username = urllib.parse.unquote(parts.username) if parts.username else None
    password = (urllib.parse.unquote(parts.password) if parts.password
                else query.get("password")) or None  # (redis://:@host: no password)
    if scheme == "unix":
        db = query.get("db", "0")
        path: str | None = parts.path
    elif scheme in ("redis", "rediss", "valkey", "valkeys"):
        db, path = parts.path.strip("/") or "0", None
    else:
        raise ValueError("must start with redis://, rediss:// (TLS), valkey://, "
                         "valkeys:// or unix://")
    if not db.isdigit():
        raise ValueError("its database (redis://HOST:PORT/DB, unix:///PATH?db=DB) must be "
                         "a number")
    context = _tls_context(query) if scheme in ("rediss", "valkeys") else None
    return CoordinationTarget(parts.hostname or "127.0.0.1", port, path,
                              username or None, password, int(db), context)


def _tls_context(query: dict[str, str]) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=query.get("ssl_ca_certs"))
        if query.get("ssl_cert_reqs", "required").lower() == "none":
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if "ssl_certfile" in query:
            context.load_cert_chain(query["ssl_certfile"], query.get("ssl_keyfile"))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"its TLS files (ssl_ca_certs, ssl_certfile, ssl_keyfile) cannot "
                         f"be used: "
                         f"{exc.strerror or exc}") from exc
    return context
