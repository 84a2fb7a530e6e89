"""relay: a local daemon that relays AI requests — OpenAI chat and Responses, Anthropic
Messages, Gemini, embeddings — to cloud APIs, local servers and command-line AI tools,
with honest traffic control.

Embedding (SPEC O2)::

    config = relay.load_config("profiles.toml")
    async with trio.open_nursery() as nursery:
        served = await nursery.start(relay.serve, config)   # listening now
        print(served.url)
        ...
        nursery.cancel_scope.cancel()   # in-flight requests stop; every lane is released

`open_relay` gives the assembled relay without an HTTP listener (its ``app`` is an ASGI
app), for programs that serve it themselves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.assembly.relay import Relay, open_relay
    from relay.assembly.server import Served, serve, serve_http
    from relay.config import Config
    from relay.vocab.errors import ConfigError, RelayError

__all__ = ["Config", "ConfigError", "Relay", "RelayError", "Served", "load_config",
           "open_relay", "parse_config", "serve", "serve_http"]


def __getattr__(name: str) -> Any:
    """The names above, each imported the first time it is asked for: ``import relay``
    (and so every command line, ``relay usage`` included) does not import the daemon."""
    if name in ("Relay", "open_relay"):
        from relay.assembly import relay as assembled
        value = getattr(assembled, name)
    elif name in ("Served", "serve", "serve_http"):
        from relay.assembly import server
        value = getattr(server, name)
    elif name == "Config":
        from relay.config import Config
        value = Config
    elif name in ("ConfigError", "RelayError"):
        from relay.vocab import errors
        value = getattr(errors, name)
    else:
        raise AttributeError(f"module 'relay' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"


def load_config(path: str | os.PathLike[str] | None = None, *,
                server_overrides: dict[str, Any] | None = None) -> Config:
    """Read and validate a config file against relay's adapters (`relay.config.load_config`;
    default: ``./profiles.toml`` if present, else the packaged default).

    Raises:
        ConfigError: listing every problem, each with file, table and key.
    """
    from relay import config as _config
    from relay.adapters import ADAPTERS
    return _config.load_config(path, ADAPTERS, server_overrides=server_overrides)


def parse_config(text: str, *, source: str = "<config>", base_dir: Path | None = None,
                 **options: Any) -> Config:
    """Validate config text against relay's adapters (`relay.config.parse_config`)."""
    from relay import config as _config
    from relay.adapters import ADAPTERS
    return _config.parse_config(text, ADAPTERS, source=source, base_dir=base_dir, **options)
