"""The coordination server's URL (SPEC L11): what relay's Redis client may be given.

What a URL may say: ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``, ``rediss://`` (TLS,
verified against the system's CAs, or ``?ssl_ca_certs=PATH``; ``?ssl_cert_reqs=none``
skips it), ``unix:///PATH[?db=N&password=…]``; ``valkey://`` and ``valkeys://`` alike; a
Sentinel-watched primary as
``redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER_NAME[/DB]`` (or
``valkey+sentinel://``; the user and password are the primary's, ``?sentinel_password=``
the Sentinels' own if they have one). No error message here quotes the URL: it may hold
a password.
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
    sentinels: tuple[tuple[str, int], ...] = ()  # where to ask for the primary's address
    master_name: str | None = None  # the name the Sentinels watch it under
    sentinel_password: str | None = attrs.field(default=None, repr=False)


def parse_url(url: str) -> CoordinationTarget:
    """Raises: ValueError, naming what is wrong but not quoting the URL."""
    try:  # (urlsplit's own message may quote the password)
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise ValueError("is not a valid URL") from None
    if parts.scheme.lower() in ("redis+sentinel", "valkey+sentinel"):
        return _sentinel_target(parts)
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
                         "valkeys://, unix://, redis+sentinel:// or valkey+sentinel://")
    if not db.isdigit():
        raise ValueError("its database (redis://HOST:PORT/DB, unix:///PATH?db=DB) must be "
                         "a number")
    context = _tls_context(query) if scheme in ("rediss", "valkeys") else None
    return CoordinationTarget(parts.hostname or "127.0.0.1", port, path,
                              username or None, password, int(db), context)


def _sentinel_target(parts: urllib.parse.SplitResult) -> CoordinationTarget:
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("each Sentinel must be HOST:PORT (redis+sentinel://HOST:PORT,"
                             "HOST:PORT/MASTER_NAME)")
        sentinels.append((host, int(port)))
    name, _, db = parts.path.strip("/").partition("/")
    if not name:
        raise ValueError("must name the primary the Sentinels watch "
                         "(redis+sentinel://HOST:PORT/MASTER_NAME[/DB])")
    if not (db or "0").isdigit():
        raise ValueError("its database (redis+sentinel://HOST:PORT/MASTER_NAME/DB) must be "
                         "a number")
    query = dict(urllib.parse.parse_qsl(parts.query))
    return CoordinationTarget(
        sentinels[0][0], sentinels[0][1], None,
        urllib.parse.unquote(username) or None,
        urllib.parse.unquote(password) or query.get("password") or None, int(db or "0"),
        sentinels=tuple(sentinels), master_name=urllib.parse.unquote(name),
        sentinel_password=query.get("sentinel_password") or None)


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
