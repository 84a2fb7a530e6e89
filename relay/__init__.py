"""relay: a local OpenAI-API daemon with honest traffic control.

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

import trio

from .config import Config, load_config, parse_config
from .core import Relay, open_relay
from .errors import ConfigError, RelayError
from .server import Served, serve_http

__all__ = ["Config", "ConfigError", "Relay", "RelayError", "Served", "load_config",
           "open_relay", "parse_config", "serve"]

__version__ = "0.1.0"


async def serve(
    config: Config, *, port: int | None = None,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[Served] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a relay and its HTTP front until cancelled (or ``shutdown`` is set: drain).

    ``task_status.started`` gets a `Served` with the bound URLs and the `Relay`.
    ``port`` overrides the config's (0: any free port); the host is the config's, whose
    safety rules were checked when it was loaded.
    """
    async with open_relay(config) as relay:
        await serve_http(relay, port=port, shutdown=shutdown,
                         task_status=task_status)
