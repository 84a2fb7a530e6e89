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
from typing import Any

from relay import config as _config
from relay.adapters import ADAPTERS
from relay.assembly.relay import Relay, open_relay
from relay.assembly.server import Served, serve, serve_http
from relay.config import Config
from relay.vocab.errors import ConfigError, RelayError

__all__ = ["Config", "ConfigError", "Relay", "RelayError", "Served", "load_config",
           "open_relay", "parse_config", "serve", "serve_http"]

__version__ = "0.1.0"


def load_config(path: str | os.PathLike[str] | None = None, *,
                server_overrides: dict[str, Any] | None = None) -> Config:
    """Read and validate a config file against relay's adapters (`relay.config.load_config`;
    default: ``./profiles.toml`` if present, else the packaged default).

    Raises:
        ConfigError: listing every problem, each with file, table and key.
    """
    return _config.load_config(path, ADAPTERS, server_overrides=server_overrides)


def parse_config(text: str, *, source: str = "<config>", base_dir: Path | None = None,
                 **options: Any) -> Config:
    """Validate config text against relay's adapters (`relay.config.parse_config`)."""
    return _config.parse_config(text, ADAPTERS, source=source, base_dir=base_dir, **options)
