"""The assembled relay: providers (config + adapter + lane + state), records, requests.

`open_relay` opens everything a relay holds for its life — each provider's adapter (HTTP
clients, later CLI pools) and relay's own service nursery (model discovery) — inside the
caller's task, and closes it all when the block ends or is cancelled (SPEC O2). The HTTP
front (`relay.front`) and the listener loop (`relay.server`) are built on top of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio

from adapters import ADAPTERS, Adapter

from .config import Config, ProviderConfig
from .errors import RelayError
from .lanes import Lane
from .records import Clock, RecordWriter

__all__ = ["Provider", "Relay", "RequestStop", "open_relay"]

logger = logging.getLogger(__name__)

DISCOVERY_TIMEOUT_S = 3.0
DISCOVERY_MIN_INTERVAL_S = 15.0


@attrs.define(eq=False)
class Provider:
    """One provider at run time."""

    config: ProviderConfig
    adapter: Adapter
    lane: Lane
    models: list[str]
    state: str = "unverified"  # unverified | connected | warning | failing (SPEC H4)
    state_reason: str | None = None
    checked_at: float | None = None
    warning: str | None = None
    discovered_at: float = -math.inf

    @property
    def name(self) -> str:
        return self.config.name

    def accepts(self, model: str) -> bool:
        """A provider whose models the file lists takes only those; others take any name
        (a discovered list may be stale, and the upstream names its own 404)."""
        return (not self.config.models_configured
                or self.adapter.listed_name(model) in self.config.models)

    async def refresh_models(self, *, force: bool = False) -> None:
        """Discover models, bounded in time; a failure keeps what was known."""
        if self.config.models_configured:
            return
        now = trio.current_time()
        if not force and now - self.discovered_at < DISCOVERY_MIN_INTERVAL_S:
            return
        self.discovered_at = now
        with trio.move_on_after(DISCOVERY_TIMEOUT_S):
            try:
                self.models = sorted(set(await self.adapter.models()))
            except RelayError as exc:
                logger.debug("model discovery for %s failed: %s", self.name, exc.message)


@attrs.define(eq=False)
class RequestStop:
    """A handle on one in-flight request, so the relay can stop it (drain)."""

    scope: trio.CancelScope
    error: RelayError | None = None
    requested_at: float | None = None

    def stop(self, error: RelayError) -> None:
        if self.error is None:
            self.error = error
            self.requested_at = trio.current_time()
        self.scope.cancel()


class Relay:
    """A running relay's state. Made by `open_relay`; its ``app`` is the ASGI front."""

    def __init__(self, config: Config, providers: dict[str, Provider],
                 records: RecordWriter, nursery: trio.Nursery) -> None:
        self.config = config
        self.providers = providers
        self.records = records
        self.clock = records.clock
        self.nursery = nursery
        self.draining = False
        self.in_flight: set[RequestStop] = set()
        self.idle = trio.Event()  # set whenever no request is in flight
        self.idle.set()
        from .front import Front

        self.app = Front(self)

    # --- model names ----------------------------------------------------------------------
    def resolve(self, model: str) -> tuple[Provider, str]:
        """``PROVIDER/MODEL`` (the model may contain '/'), or a bare model exactly one
        provider lists (SPEC A1).

        Raises:
            RelayError: ``unknown_model``, listing what exists.
        """
        name, slash, rest = model.partition("/")
        if slash:
            provider = self.providers.get(name)
            if provider is not None and rest and provider.accepts(rest):
                return provider, rest
        else:
            owners = [p for p in self.providers.values() if model in p.models]
            if len(owners) == 1:
                return owners[0], model
            if len(owners) > 1:
                names = ", ".join(f"{p.name}/{model}" for p in owners)
                raise RelayError("unknown_model", f"model {model!r} is offered by several "
                                 f"providers; name one of: {names}", param="model")
        known = ", ".join(self.known_names()) or "(none discovered yet)"
        raise RelayError(
            "unknown_model",
            f"model {model!r} is not known. Known models: {known}. Or write PROVIDER/MODEL "
            f"with one of the providers: {', '.join(self.providers)}.", param="model")

    def model_ids(self) -> list[str]:
        return [f"{p.name}/{m}" for p in self.providers.values() for m in p.models]

    def known_names(self) -> list[str]:
        return [*self.config.routes, *self.model_ids()]

    # --- in-flight requests ---------------------------------------------------------------
    def track(self, stop: RequestStop) -> None:
        self.in_flight.add(stop)
        self.idle = trio.Event() if self.idle.is_set() else self.idle

    def untrack(self, stop: RequestStop) -> None:
        self.in_flight.discard(stop)
        if not self.in_flight:
            self.idle.set()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; give in-flight ones ``grace_s``; then stop the rest through
        their normal stop path (lanes released, ``shutting_down`` written)."""
        self.draining = True
        with trio.move_on_after(grace_s):
            await self.idle.wait()
        for stop in list(self.in_flight):
            stop.stop(RelayError("shutting_down", "relay is shutting down; this request was "
                                 "stopped before it completed. Retry when relay is back.",
                                 retry_after_s=5.0))
        # Their stop paths are bounded (interrupt grace, then a kill); wait for them.
        grace = max((p.config.profile.interrupt_grace_s for p in self.providers.values()),
                    default=0.0)
        with trio.move_on_after(grace + 2.0):
            await self.idle.wait()


def _make_adapter(config: ProviderConfig) -> Adapter:
    return ADAPTERS[config.adapter](config)


@asynccontextmanager
async def open_relay(config: Config, *, discover: bool = True) -> AsyncIterator[Relay]:
    """Open a relay inside the caller's task: adapters opened, discovery started.

    Leaving the block (or cancelling it) stops discovery and closes every adapter; run
    the HTTP front with `relay.server.serve_http` inside it.
    """
    clock = Clock()
    records = RecordWriter(config.records_path, max_bytes=config.server.records_max_bytes,
                           keep=config.server.records_keep, clock=clock)
    try:
        async with AsyncExitStack() as stack:
            providers: dict[str, Provider] = {}
            for name, pconf in config.providers.items():
                adapter = await stack.enter_async_context(_make_adapter(pconf))
                lane = Lane(name, pconf.profile,
                            expected_run_s=type(adapter).typical_call_s(pconf.settings))
                providers[name] = Provider(config=pconf, adapter=adapter, lane=lane,
                                           models=list(pconf.models))
            async with trio.open_nursery() as nursery:
                relay = Relay(config, providers, records, nursery)
                if discover:
                    for provider in providers.values():
                        nursery.start_soon(_discover, provider)
                try:
                    yield relay
                finally:
                    nursery.cancel_scope.cancel()
    finally:
        records.close()


async def _discover(provider: Provider) -> None:
    try:
        await provider.refresh_models(force=True)
    except Exception:  # discovery is best effort; never take the relay down
        logger.exception("model discovery for %s crashed", provider.name)


def provider_status(provider: Provider, clock: Clock) -> dict[str, Any]:
    stats = provider.lane.statistics()
    return {
        "adapter": provider.config.adapter,
        "state": provider.state,
        "state_reason": provider.state_reason,
        "checked_at": clock.iso(provider.checked_at),
        "models": provider.models,
        "warning": provider.warning,
        "lanes": {"running": stats.running, "capacity": stats.capacity,
                  "queued": stats.queued, "queue_max": stats.queue_max},
    }
