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
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from . import redact
from .config import Config, ProviderConfig, load_config
from .errors import ConfigError, RelayError
from .lanes import Lane
from .records import Clock, RecordWriter

if TYPE_CHECKING:
    from adapters import Adapter

__all__ = ["ConfigError", "Provider", "Relay", "RequestStop", "open_relay"]

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
    """A handle on one in-flight request, so the relay can stop it (a drain): every
    dispatcher of the request (a fan-out has several) runs inside a scope made here."""

    error: RelayError | None = None
    requested_at: float | None = None
    scopes: list[trio.CancelScope] = attrs.field(factory=list)

    def open_scope(self) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self.error is not None:
            scope.cancel()
        self.scopes.append(scope)
        return scope

    def stop(self, error: RelayError) -> None:
        if self.error is None:
            self.error = error
            self.requested_at = trio.current_time()
        for scope in self.scopes:
            scope.cancel()


class Relay:
    """A running relay's state. Made by `open_relay`; its ``app`` is the ASGI front."""

    def __init__(self, config: Config, providers: dict[str, Provider],
                 records: RecordWriter, nursery: trio.Nursery) -> None:
        self.config = config
        self.providers = providers
        self.records = records
        self.clock = records.clock
        self.nursery = nursery
        self._holders: dict[int, trio.Event] = {}   # adapter → what closes it
        self._uses: dict[int, int] = {}             # adapter → attempts running on it
        self._retiring: dict[int, trio.Event] = {}  # replaced, closed when unused
        self.draining = False
        self.in_flight: set[RequestStop] = set()
        self.idle = trio.Event()  # set whenever no request is in flight
        self.idle.set()
        self.reloaded = trio.Event()  # set (and replaced) on every reload
        self._reload_lock = trio.Lock()
        from .metrics import Metrics

        self.metrics = Metrics(self)  # GET /metrics; counts every record as it is written
        records.observers.append(self.metrics.observe)
        from .front import Front

        self.app = Front(self)

    # --- providers and their adapters ------------------------------------------------------
    async def open_provider(self, config: ProviderConfig) -> Provider:
        adapter = await self._open_adapter(config)
        lane = Lane(config.name, config.profile,
                    expected_run_s=type(adapter).typical_call_s(config.settings))
        return Provider(config=config, adapter=adapter, lane=lane, models=list(config.models))

    async def _open_adapter(self, config: ProviderConfig) -> Adapter:
        """Each adapter lives in a task of relay's own nursery, so whatever it holds (an
        HTTP pool, warm CLI processes with a nursery of their own) is opened and closed by
        one task; it is closed when relay stops or the adapter is retired."""
        from adapters import ADAPTERS  # the registry; imported late: adapters import relay

        adapter = ADAPTERS[config.adapter](config)
        retire = trio.Event()
        await self.nursery.start(_hold_adapter, adapter, retire)
        self._holders[id(adapter)] = retire
        return adapter

    # An adapter replaced by a reload is closed once its last running attempt has ended
    # (not when its lane is idle, which under steady load may never happen).
    def adapter_enter(self, adapter: Adapter) -> None:
        self._uses[id(adapter)] = self._uses.get(id(adapter), 0) + 1

    def adapter_exit(self, adapter: Adapter) -> None:
        left = self._uses[id(adapter)] = self._uses[id(adapter)] - 1
        if left == 0:
            del self._uses[id(adapter)]
            retire = self._retiring.pop(id(adapter), None)
            if retire is not None:
                retire.set()

    def _retire(self, adapter: Adapter) -> None:
        retire = self._holders.pop(id(adapter))
        if self._uses.get(id(adapter), 0) == 0:
            retire.set()
        else:
            self._retiring[id(adapter)] = retire

    # --- reload (SPEC L10) --------------------------------------------------------------------
    async def reload(self, config: Config | None = None) -> list[str]:
        """Apply a new config in place: lane counts and timeouts change without touching
        running work (waiting requests keep their order), providers come and go (a removed
        one's running requests finish), routes are replaced. Without ``config`` the file
        the current one came from is read again.

        New adapters are opened first; only then is anything changed, in one synchronous
        step, so a reload is applied whole or not at all.

        Returns:
            what changed, one line each.

        Raises:
            ConfigError: the new config is invalid; nothing changed.
        """
        async with self._reload_lock:
            if config is None:
                config = load_config(self.config.source,
                                     server_overrides=self.config.server_overrides)
            # 1. Open what the new config needs (the only awaits), shielded and bounded:
            # a client that leaves mid-reload must not leave it half done.
            fresh: dict[str, Adapter] = {}
            try:
                with trio.CancelScope(shield=True), trio.fail_after(30):
                    for name, pconf in config.providers.items():
                        current = self.providers.get(name)
                        if current is None or _needs_new_adapter(current.config, pconf):
                            fresh[name] = await self._open_adapter(pconf)
            except BaseException:
                for adapter in fresh.values():
                    self._retire(adapter)
                raise
            # 2. Apply it all at once.
            changes = self._apply(config, fresh)
            logger.info("config reloaded from %s: %s", config.source,
                        "; ".join(changes) or "no changes")
            return changes

    def _apply(self, config: Config, fresh: dict[str, Adapter]) -> list[str]:
        changes: list[str] = []
        providers: dict[str, Provider] = {}
        for name, pconf in config.providers.items():
            current = self.providers.get(name)
            if current is None:
                lane = Lane(name, pconf.profile,
                            expected_run_s=type(fresh[name]).typical_call_s(pconf.settings))
                providers[name] = Provider(config=pconf, adapter=fresh[name], lane=lane,
                                           models=list(pconf.models))
                changes.append(f"provider {name}: added")
                self.nursery.start_soon(_discover, providers[name])
                continue
            old = current.config
            if name in fresh:
                self._retire(current.adapter)
                current.adapter = fresh[name]
                changes.append(f"provider {name}: adapter reopened with the new settings "
                               "(requests running on the old one finish on it)")
            if old.profile != pconf.profile:
                a, b = old.profile, pconf.profile
                changes.append(f"provider {name}: profile changed (lanes {a.lanes}→"
                               f"{b.lanes}, queue_max {a.queue_max}→{b.queue_max}, "
                               f"queue_timeout_s {a.queue_timeout_s:g}→"
                               f"{b.queue_timeout_s:g}, run_timeout_s {a.run_timeout_s:g}→"
                               f"{b.run_timeout_s:g}, rpm {a.rpm:g}→{b.rpm:g})")
                current.lane.update_profile(pconf.profile)
            if pconf.models_configured:
                current.models = list(pconf.models)
            current.config = pconf
            providers[name] = current
        for name, gone in self.providers.items():
            if name not in providers:
                self._retire(gone.adapter)
                changes.append(f"provider {name}: removed (its running requests finish)")
        if dict(config.routes) != dict(self.config.routes):
            changes.append(f"routes: {', '.join(config.routes) or '(none)'}")
        old_server, new_server = self.config.server, config.server
        for key in ("host", "port", "records", "records_max_bytes", "records_keep"):
            if getattr(old_server, key) != getattr(new_server, key):
                changes.append(f"[server] {key}: takes effect at the next restart")
        if old_server != new_server:
            changes.append("[server]: the other settings apply to new requests")
        self.providers = providers
        self.config = config
        redact.install(self.records, config.secrets())  # SPEC E1: new keys are redacted too
        self.app.configure()
        self.reloaded.set()
        self.reloaded = trio.Event()
        return changes

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
        # (+5 s: a CLI tool's kill and reap after its grace.)
        with trio.move_on_after(grace + 5.0):
            await self.idle.wait()


@asynccontextmanager
async def open_relay(config: Config, *, discover: bool = True) -> AsyncIterator[Relay]:
    """Open a relay inside the caller's task: adapters opened, discovery and checks
    started.

    Leaving the block (or cancelling it) stops relay's services and closes every adapter;
    run the HTTP front with `relay.server.serve_http` inside it. (An async context
    manager owning a nursery, used by one task: trio's supported shape.)
    """
    clock = Clock()
    records = RecordWriter(config.records_path, max_bytes=config.server.records_max_bytes,
                           keep=config.server.records_keep, clock=clock)
    redact.install(records, config.secrets())  # SPEC E1 (keyed by this relay's writer)
    try:
        async with trio.open_nursery() as nursery:
            relay = Relay(config, {}, records, nursery)
            for name, pconf in config.providers.items():
                relay.providers[name] = await relay.open_provider(pconf)
            if discover:
                for provider in relay.providers.values():
                    nursery.start_soon(_discover, provider)
            from .checks import serve_checks

            nursery.start_soon(serve_checks, relay)
            try:
                yield relay
            finally:
                nursery.cancel_scope.cancel()
    finally:
        records.close()
        redact.uninstall(records)


def _needs_new_adapter(old: ProviderConfig, new: ProviderConfig) -> bool:
    """Adapters size what they hold (pools, warm processes) and their stop grace from the
    profile: a change there, as in the settings, needs a new adapter."""
    return ((old.adapter, old.settings, old.profile.lanes, old.profile.interrupt_grace_s,
             old.max_upstream_bytes)
            != (new.adapter, new.settings, new.profile.lanes, new.profile.interrupt_grace_s,
                new.max_upstream_bytes))


async def _hold_adapter(adapter: Adapter, retire: trio.Event,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with adapter:
        task_status.started()
        await retire.wait()


async def _discover(provider: Provider) -> None:
    try:
        await provider.refresh_models(force=True)
    except Exception:  # discovery is best effort; never take the relay down
        logger.exception("model discovery for %s crashed", provider.name)


def provider_status(provider: Provider, clock: Clock) -> dict[str, Any]:
    stats = provider.lane.statistics()
    return redact.redact_obj({  # SPEC E1: the status page is an exit too
        "adapter": provider.config.adapter,
        "state": provider.state,
        "state_reason": provider.state_reason,
        "checked_at": clock.iso(provider.checked_at),
        "models": provider.models,
        "warning": provider.warning,
        "lanes": {"running": stats.running, "capacity": stats.capacity,
                  "queued": stats.queued, "queue_max": stats.queue_max},
    })
