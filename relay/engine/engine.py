"""The engine: a relay's providers, routes, records and in-flight requests, without HTTP.

`Engine` owns what a running relay knows — the config, each `Provider` (adapter handle,
lane, state), the records writer, the set of in-flight requests (for a drain) — and the
operations on it: resolve a model name, reload a config in place (SPEC L10), drain
(SPEC O3). It is given the adapter registry and a nursery of relay's own (where adapters
live) by the assembly (`relay.assembly.relay.open_relay`), which adds the HTTP front.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from relay.api.adapter import Adapter
from relay.capacity.lane_api import LaneLike
from relay.capacity.lanes import Lane
from relay.config import Config, load_config
from relay.shared.accounts import SharedAccounts
from relay.shared.client_limits import SharedClientLimits
from relay.shared.coordinator import Coordinator
from relay.shared.lane import SharedLane
from relay.usage.store import UsageStore
from relay.vocab import redact
from relay.vocab.errors import ConfigError, RelayError
from relay.vocab.profile import ProviderConfig
from relay.vocab.records import RecordWriter

from .clients import Clients
from .providers import AdapterHandle, Provider, discover
from .response_store import ResponseStore
from .stops import RequestStop

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

Registry = Mapping[str, "type[Adapter]"]


class Engine:
    """A running relay's state and operations. See the module docstring."""

    SETTLE_S = 0.05      # a config file must stay unchanged this long to be read (reload)
    SETTLE_MAX_S = 2.0   # ... and a file that keeps changing longer is refused

    def __init__(self, config: Config, registry: Registry, records: RecordWriter,
                 nursery: trio.Nursery) -> None:
        self.config = config
        self.registry = registry
        self.providers: dict[str, Provider] = {}
        self.records = records
        self.clock = records.clock
        self.nursery = nursery
        self.draining = False
        self.in_flight: set[RequestStop] = set()
        self.idle = trio.Event()  # set whenever no request is in flight
        self.idle.set()
        self.reloaded = trio.Event()  # set (and replaced) on every reload
        self._reload_lock = trio.Lock()
        self._signal_reload_waiting = False  # a SIGHUP's reload waits for the lock
        self.responses = ResponseStore()  # /v1/responses' store (SPEC A7): in memory only
        # SPEC L11: the shared lanes' server, when any provider is shared.
        self.coordinator: Coordinator | None = None
        # SPEC O7: the usage database beside the records (None: records are off).
        self.usage = (UsageStore(config.records_path) if config.records_path is not None
                      else None)
        records.relay_id = config.relay_id
        # SPEC L14, O7: each record's cost, each client's spend (seeded from this month's
        # records: a restart does not reset a client's limits) and per-minute gate.
        self.clients = Clients(lambda: self.config, records.clock)
        records.completers.append(self.clients.complete)
        seeded = self.clients.seed(records.path, config.server.records_keep)
        if seeded:
            logger.info("clients' spend this month read from %d records in %s", seeded,
                        records.path)

    # --- providers and their adapters ------------------------------------------------------
    async def open_providers(self) -> None:
        """Open every provider's adapter; with a shared provider, connect to the
        coordination server and register its lane there first.

        Raises:
            ConfigError: a shared provider's lanes, queue_max or rpm differ from what the
                relays already sharing it agreed on (SPEC L11).
        """
        url = self.config.coordination_url()
        limited = any(c.minute_limited or c.spend_limited
                      for c in self.config.clients.values())
        if (self.config.shared_providers or limited) and url:
            server = self.config.server
            self.coordinator = Coordinator(url, prefix=server.coordination_prefix,
                                           lease_s=server.coordination_lease_s,
                                           relay_id=self.config.relay_id)
            # SPEC L14 with L11: clients' limits held across relays on the same server.
            self.clients.shared = SharedClientLimits(self.coordinator)
            self.clients.relay_id = self.config.relay_id
        for name, pconf in self.config.providers.items():
            self.providers[name] = self._provider(pconf, await self._open_adapter(pconf))
        if self.coordinator is not None:
            await self.nursery.start(self.coordinator.serve)

    def _provider(self, config: ProviderConfig, handle: AdapterHandle) -> Provider:
        expected = type(handle.adapter).typical_call_s(config.settings)
        lane: LaneLike
        if config.shared and self.coordinator is not None:
            # SPEC L11 (with L13: each account's lane, queue, pacer and budgets on the
            # coordination server, `relay.shared.accounts`).
            lane = (SharedAccounts(config.name, config.profile, self.coordinator,
                                   config.account_profiles(), expected_run_s=expected,
                                   limits=config.limits) if config.accounts else
                    SharedLane(config.name, config.profile, self.coordinator,
                               expected_run_s=expected, limits=config.limits))
        else:
            if config.shared:
                logger.warning("provider %s: shared = true takes effect at the next "
                               "restart (relay started without a coordination server)",
                               config.name)
            lane = Lane(config.name, config.profile, expected_run_s=expected,
                        limits=config.limits, accounts=config.account_profiles())
        return Provider(config=config, handle=handle, lane=lane, models=list(config.models))

    async def _open_adapter(self, config: ProviderConfig) -> AdapterHandle:
        """Each adapter lives in a task of relay's own nursery (`AdapterHandle.hold`):
        one per account (SPEC L13: its key, base URL, CLI login; its pool or warm
        processes), the first also the provider's."""
        kind = self.registry[config.adapter]
        accounts = {a.name: kind(attrs.evolve(config, settings=a.settings, profile=a.profile))
                    for a in config.accounts}
        first = next(iter(accounts.values())) if accounts else kind(config)
        handle = AdapterHandle(first, accounts=accounts)
        await self.nursery.start(handle.hold)
        return handle

    # --- reload (SPEC L10) --------------------------------------------------------------------
    async def reload(self, config: Config | None = None) -> list[str]:
        """Apply a new config in place: lane counts and timeouts change without touching
        running work (waiting requests keep their order), providers come and go (a removed
        one's running requests finish), routes are replaced. Without ``config`` the file
        the current one came from is read again.

        New adapters are opened first; only then is anything changed, in one synchronous
        step (the provider set is a new dict swapped in whole, with no checkpoint between
        its parts), so a reload is applied whole or not at all, and a status built
        between two checkpoints sees the old set or the new one. The file is read only
        once it has stayed unchanged for ``SETTLE_S`` (`_read_config`), and a config with
        no provider is refused: issue 29's status with no providers was a file read while
        it was being rewritten in place.

        Returns:
            what changed, one line each.

        Raises:
            ConfigError: the new config is invalid; nothing changed.
        """
        async with self._reload_lock:
            return await self._reload_locked(config)

    async def reload_from_file(self) -> list[str] | None:
        """A reload a signal asked for (SIGHUP): `reload` from the file, except that while
        one such reload waits its turn, more signals are covered by it (it reads the file
        as it is when its turn comes), so a burst of 100 SIGHUPs is two reloads, not 100.

        Returns:
            what changed, or None when a waiting reload covers this one.

        Raises:
            ConfigError: the file is invalid; nothing changed.
        """
        if self._signal_reload_waiting:
            return None
        self._signal_reload_waiting = True
        started = False
        try:
            async with self._reload_lock:
                self._signal_reload_waiting, started = False, True
                return await self._reload_locked(None)
        finally:
            if not started:  # cancelled while waiting: the next signal must not be lost
                self._signal_reload_waiting = False

    async def _read_config(self) -> Config:
        """The config file, read only when it has not changed for ``SETTLE_S`` before and
        while it was read (its inode, size, mtime and ctime the same).

        Issue 29: a SIGHUP that read the file while a script rewrote it in place (truncate,
        then write) found it empty — a valid config with no providers — and relay served
        none until the next good reload. A file rewritten in place is half written for a
        moment; a writer that pauses longer than ``SETTLE_S`` in the middle can still be
        caught (an empty result is refused by `_reload_locked`); writing a temporary file
        and renaming it over the config, as most editors do, is never caught.

        Raises:
            ConfigError: the file is invalid, or kept changing for ``SETTLE_MAX_S``.
        """
        path = Path(self.config.source)
        with trio.move_on_after(self.SETTLE_MAX_S):
            while True:
                before = _identity(path)
                await trio.sleep(self.SETTLE_S)
                config = load_config(path, self.registry,
                                     server_overrides=self.config.server_overrides)
                if _identity(path) == before:
                    return config
        raise ConfigError([f"{path}: it kept changing for {self.SETTLE_MAX_S:g} s while "
                           "relay read it; nothing changed. Reload again once it is "
                           "saved."])

    async def _reload_locked(self, config: Config | None) -> list[str]:
        if config is None:
            config = await self._read_config()
        if not config.providers and self.providers:
            raise ConfigError([f"{config.source}: no provider is configured; a reload "
                               "never leaves relay with none (a file read while it is "
                               "being rewritten looks like this). Nothing changed; "
                               "restart relay to run it without providers."])
        # 1. Open what the new config needs (the only awaits), shielded and bounded:
        # a client that leaves mid-reload must not leave it half done.
        fresh: dict[str, AdapterHandle] = {}
        try:
            # (noqa, ASYNC912: a reload that opens no new adapter has nothing to await.)
            with trio.CancelScope(shield=True), trio.fail_after(30):  # noqa: ASYNC912
                for name, pconf in config.providers.items():
                    current = self.providers.get(name)
                    if current is None or _needs_new_adapter(current.config, pconf):
                        fresh[name] = await self._open_adapter(pconf)
        except BaseException:
            for handle in fresh.values():
                handle.retire()
            raise
        # 2. Apply it all at once.
        changes = self._apply(config, fresh)
        logger.info("config reloaded from %s: %s", config.source,
                    "; ".join(changes) or "no changes")
        return changes

    def _apply(self, config: Config, fresh: dict[str, AdapterHandle]) -> list[str]:
        changes: list[str] = []
        providers: dict[str, Provider] = {}
        for name, pconf in config.providers.items():
            current = self.providers.get(name)
            if current is None:
                providers[name] = self._provider(pconf, fresh[name])
                changes.append(f"provider {name}: added")
                self.nursery.start_soon(discover, providers[name])
                continue
            old = current.config
            if name in fresh:
                current.handle.retire()
                current.handle = fresh[name]
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
            if isinstance(current.lane, Lane | SharedAccounts) and (
                    old.limits != pconf.limits or old.accounts != pconf.accounts):
                changes.append(f"provider {name}: models' limits or accounts changed")
                current.lane.update_profile(pconf.profile, pconf.limits,
                                            pconf.account_profiles())
            if pconf.shared != old.shared:
                changes.append(f"provider {name}: shared takes effect at the next restart")
            if pconf.models_configured:
                current.models = list(pconf.models)
            current.config = pconf
            providers[name] = current
        for name, gone in self.providers.items():
            if name not in providers:
                gone.handle.retire()
                if (coordinator := self.coordinator) is not None:
                    for each in _shared_lanes(gone.lane):
                        self.nursery.start_soon(coordinator.forget_when_idle, each)
                changes.append(f"provider {name}: removed (its running and queued requests "
                               "finish)")
        if dict(config.routes) != dict(self.config.routes):
            changes.append(f"routes: {', '.join(config.routes) or '(none)'}")
        old_server, new_server = self.config.server, config.server
        for key in ("host", "port", "records", "records_max_bytes", "records_keep",
                    "coordination_url", "coordination_url_env", "relay_id",
                    "coordination_prefix", "coordination_lease_s"):
            if getattr(old_server, key) != getattr(new_server, key):
                changes.append(f"[server] {key}: takes effect at the next restart")
        if old_server != new_server:
            changes.append("[server]: the other settings apply to new requests")
        self.providers = providers
        self.config = config
        redact.install(self.records, config.secrets())  # SPEC E1: new keys are redacted too
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
                                 f"providers; name one of: {names}", param="model",
                                 action=f"name the provider: one of {names}")
        known = ", ".join(self.known_names()) or "(none discovered yet)"
        provider = self.providers.get(name) if slash else None
        if provider is not None and rest:   # a provider whose file lists its models
            action = (f"use one of {provider.name}'s models ({', '.join(provider.models)}), "
                      f"or add {rest!r} to models in [providers.{provider.name}]")
        elif slash and rest:
            action = (f"{name!r} is no provider here: use one of "
                      f"{', '.join(self.providers) or '(none)'}, or add [providers.{name}] "
                      "to the config")
        else:
            action = ("use a name GET /v1/models lists: a route name, PROVIDER/MODEL, or a "
                      "bare model name that one provider lists")
        raise RelayError(
            "unknown_model",
            f"model {model!r} is not known. Known models: {known}. Or write PROVIDER/MODEL "
            f"with one of the providers: {', '.join(self.providers)}.", param="model",
            action=action)

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


def _shared_lanes(lane: LaneLike) -> list[SharedLane]:
    """A provider's lanes on the coordination server (one per account: SPEC L13)."""
    if isinstance(lane, SharedAccounts):
        return list(lane.lanes.values())
    return [lane] if isinstance(lane, SharedLane) else []


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    """What changes when a file is written or replaced (None: it cannot be read)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _needs_new_adapter(old: ProviderConfig, new: ProviderConfig) -> bool:
    """Adapters size what they hold (pools, warm processes) and their stop grace from the
    profile: a change there, as in the settings, needs a new adapter."""
    def sizes(c: ProviderConfig) -> tuple[Any, ...]:
        return (c.adapter, c.settings, c.profile.lanes, c.profile.interrupt_grace_s,
                c.max_upstream_bytes, c.secret_env,
                tuple((a.name, a.settings, a.profile.lanes) for a in c.accounts))
    return sizes(old) != sizes(new)
