"""The assembled relay: the engine with its HTTP front, opened inside the caller's task.

`open_relay` opens everything a relay holds for its life — the records file, each
provider's adapter (HTTP clients, CLI pools), relay's own service nursery (model
discovery, interval checks) — and closes it all when the block ends or is cancelled
(SPEC O2). `relay.assembly.server.serve_http` serves ``relay.app`` on top of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from relay.adapters import ADAPTERS
from relay.config import Config
from relay.engine import providers
from relay.engine.checks import serve_checks
from relay.engine.engine import Engine, Registry
from relay.front.app import Front
from relay.front.metrics import Metrics
from relay.vocab import redact
from relay.vocab.records import Clock, RecordWriter

__all__ = ["Relay", "open_relay"]


class Relay(Engine):
    """A running relay: the `Engine`, its ``metrics`` and its ASGI front ``app``."""

    def __init__(self, config: Config, registry: Registry, records: RecordWriter,
                 nursery: trio.Nursery) -> None:
        super().__init__(config, registry, records, nursery)
        self.metrics = Metrics(self)  # GET /metrics; counts every record as it is written
        records.observers.append(self.metrics.observe)
        self.app = Front(self, self.metrics)


@asynccontextmanager
async def open_relay(config: Config, *, discover: bool = True,
                     registry: Registry = ADAPTERS) -> AsyncIterator[Relay]:
    """Open a relay inside the caller's task: adapters opened, discovery and checks
    started.

    Leaving the block (or cancelling it) stops relay's services and closes every adapter.
    (An async context manager owning a nursery, used by one task: trio's supported shape.)
    """
    clock = Clock()
    records = RecordWriter(config.records_path, max_bytes=config.server.records_max_bytes,
                           keep=config.server.records_keep, clock=clock)
    redact.install(records, config.secrets())  # SPEC E1 (keyed by this relay's writer)
    relay: Relay | None = None
    try:
        async with trio.open_nursery() as nursery:
            relay = Relay(config, registry, records, nursery)
            await relay.open_providers()
            if discover:
                for provider in relay.providers.values():
                    nursery.start_soon(providers.discover, provider)
            nursery.start_soon(serve_checks, relay)
            nursery.start_soon(records.serve_retries)  # a failing records file (SPEC O5)
            if relay.usage is not None:
                nursery.start_soon(relay.usage.serve)  # the usage database (SPEC O7)
            try:
                yield relay
            finally:
                nursery.cancel_scope.cancel()
    finally:
        records.close()
        try:
            if relay is not None and relay.usage is not None:
                # What the records writer wrote last, into the database (shielded).
                await relay.usage.close(config.server.drain_grace_s)
        finally:
            redact.uninstall(records)
