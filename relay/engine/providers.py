"""Providers at run time, and the lifetime of their adapters.

A `Provider` is one config entry brought to life: its adapter (behind an `AdapterHandle`),
its lane, its state (SPEC H4) and its models. The handle is the adapter's lifecycle as an
object rather than bookkeeping keyed by ``id()``::

    open ──retire()──▶ retiring ──last attempt leaves──▶ closed
      └───────────────(no attempt inside)──────────────────┘

An attempt *enters* the handle before it queues for a lane slot and leaves it after its
adapter scope has exited, so a handle counts every attempt that may still run on it,
queued ones included. A reload that replaces or removes a provider retires its handle;
the adapter is closed once no attempt is inside — a removed provider's queued requests
finish on it first, and no request ever starts on a closed adapter.

A provider's state (SPEC H4) is set by connection checks (`relay.engine.checks`, with
rules of their own) and kept honest by real traffic (H5: `Provider.observe`, told each
attempt's outcome by the dispatcher)::

    answered                              → connected, its warning cleared
    quota_exhausted, rate_limited         → connected, with a warning
    auth_required, upstream_unavailable   → failing, with that reason (logged out; a
                                             server that does not answer; not installed)
    anything else                         → nothing changes (H2): 5xx, timeouts, capacity,
                                             client stops, refusals of one request's content

Its attempts in flight (queued, running, stopping) are listed in the status
(`Provider.track`), held weakly: a finished request's attempt needs no unregistering.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Any, Protocol

import attrs
import trio

from relay.api.adapter import Adapter
from relay.capacity.estimate import InputRatio
from relay.capacity.lane_api import LaneLike
from relay.capacity.lanes import PRIORITIES, Lane
from relay.capacity.meter import Conversations, scope_of
from relay.shared.accounts import SharedAccounts
from relay.vocab import redact
from relay.vocab.errors import RelayError
from relay.vocab.profile import ProviderConfig
from relay.vocab.records import Attempt, Clock, Record

__all__ = ["AdapterHandle", "Provider"]

logger = logging.getLogger(__name__)

DISCOVERY_TIMEOUT_S = 3.0
DISCOVERY_MIN_INTERVAL_S = 15.0
MAX_LISTED_REQUESTS = 100  # attempts in flight listed per provider in the status
AFFINITY_MAX = 4096  # conversations whose account is remembered (SPEC L13)

# SPEC H5: what a real request's outcome does to its provider's state (module docstring).
TRAFFIC_WARNS = frozenset({"quota_exhausted", "rate_limited"})
TRAFFIC_FAILS = frozenset({"auth_required", "upstream_unavailable"})


class InFlight(Protocol):
    """What the status reads of one attempt in flight (`relay.engine.attempt.Run`)."""

    record: Attempt
    running_since: float | None
    stopped_at: float | None
    finished_at: float | None


@attrs.define(eq=False)
class AdapterHandle:
    """One opened adapter and the attempts inside it. See the module docstring."""

    adapter: Adapter  # the provider's (its first account's, SPEC L13)
    # SPEC L13: each account's own adapter, by account name (none: the provider is one).
    accounts: dict[str, Adapter] = attrs.field(factory=dict)
    _close: trio.Event = attrs.field(factory=trio.Event)  # set: its holder task closes it
    attempts: int = 0
    retiring: bool = False

    @property
    def closed(self) -> bool:
        return self._close.is_set()

    def use(self) -> AdapterHandle:
        """Hold the adapter open for one attempt (queue wait and run): ``with
        handle.use() as adapter``. (The handle is its own context manager: no generator
        and frame held by every attempt, queued ones too.)"""
        return self

    def __enter__(self) -> Adapter:
        if self.closed:  # its provider was removed by a reload after the plan was made
            raise RelayError("unknown_model", f"provider {self.adapter.name!r} was removed "
                             "from relay's config", provider=self.adapter.name,
                             action="use a model of a provider that is still configured "
                             "(GET /v1/models lists them)")
        self.attempts += 1
        return self.adapter

    def __exit__(self, *exc_info: object) -> None:
        self.attempts -= 1
        if self.retiring and self.attempts == 0:
            self._close.set()

    def retire(self) -> None:
        """No new attempt will enter; close the adapter once the last one has left."""
        self.retiring = True
        if self.attempts == 0:
            self._close.set()

    async def hold(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                   ) -> None:
        """The adapter's life, as one task of relay's own nursery: whatever it holds (an
        HTTP pool, warm CLI processes with a nursery of their own) is opened and closed by
        this task — when it is retired and empty, or when relay stops."""
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.adapter)
            for adapter in self.accounts.values():
                if adapter is not self.adapter:
                    await stack.enter_async_context(adapter)
            task_status.started()
            await self._close.wait()

    def for_account(self, name: str) -> Adapter:
        """The adapter of account ``name`` (the provider's own for ``""``)."""
        return self.accounts.get(name, self.adapter)


@attrs.define(eq=False)
class Provider:
    """One provider at run time."""

    config: ProviderConfig
    handle: AdapterHandle
    lane: LaneLike
    models: list[str]
    state: str = "unverified"  # unverified | connected | warning | failing (SPEC H4)
    state_reason: str | None = None
    checked_at: float | None = None
    warning: str | None = None
    discovered_at: float = -math.inf
    seen_at: float | None = None  # when real traffic last set the state (H5)
    # The headers whose unusable figures were logged (SPEC L12a: once per provider).
    ignored_figures: set[str] = attrs.field(factory=set)
    # SPEC L12a: each conversation's prompt cache as its last answer said.
    conversations: Conversations = attrs.field(
        factory=lambda: Conversations(trio.current_time))
    # SPEC L12: what the provider counts of relay's estimate, per model and script.
    input_ratio: InputRatio = attrs.field(factory=InputRatio)
    # SPEC L13: the account that last served each conversation (least recent first).
    affinity: dict[str, str] = attrs.field(factory=dict)
    # Attempts in flight → (request id, route, priority, client); see `track`.
    _in_flight: weakref.WeakKeyDictionary[InFlight, tuple[str, str | None, str, str]] = (
        attrs.field(factory=weakref.WeakKeyDictionary))

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def adapter(self) -> Adapter:
        """The current adapter (an attempt holds it through `AdapterHandle.use`)."""
        return self.handle.adapter

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
        # (noqa, ASYNC912: the await is inside a try that only catches RelayError.)
        with trio.move_on_after(DISCOVERY_TIMEOUT_S):  # noqa: ASYNC912
            try:
                self.models = await self.list_models()
            except RelayError as exc:
                logger.debug("model discovery for %s failed: %s", self.name, exc.message)

    async def list_models(self) -> list[str]:
        """The provider's models, from the first account that answers (SPEC L13: one
        whose key is refused does not hide them)."""
        adapters = list(self.handle.accounts.values()) or [self.handle.adapter]
        for adapter in adapters[:-1]:
            try:
                return sorted(set(await adapter.models()))
            except RelayError as exc:
                logger.debug("model discovery for %s failed on one account: %s",
                             self.name, exc.message)
        return sorted(set(await adapters[-1].models()))

    def served(self, conversation: str, account: str) -> None:
        """SPEC L13: ``account`` answered ``conversation``: its next turn prefers it."""
        self.affinity.pop(conversation, None)
        while len(self.affinity) >= AFFINITY_MAX:
            del self.affinity[next(iter(self.affinity))]
        self.affinity[conversation] = account

    def observe(self, error: RelayError | None, account: str | None = None) -> None:
        """SPEC H5: one attempt of a real request has ended (``error`` None: answered);
        its outcome keeps the state honest (the module docstring has the table). A
        check's own attempt comes here too; the check then applies its own rules.

        With several accounts (SPEC L13) an account that failed leaves the choice a while
        (`relay.capacity.account`); the provider is failing only when every one is out,
        else connected with a warning naming the account."""
        lane = self.lane
        if (account is not None and isinstance(lane, Lane | SharedAccounts)
                and len(lane.accounts) > 1
                and (found := lane.account(account)) is not None):
            if error is None:
                lane.account_answered(found)
            elif error.reason in TRAFFIC_FAILS:
                lane.account_failed(found, error.reason, error.message)
            now = trio.current_time()
            out = [a for a in lane.accounts if not a.usable(now)]
            if error is None or (error.reason in TRAFFIC_FAILS
                                 and len(out) < len(lane.accounts)):
                # Connected while an account serves; the warning names those that are out.
                self.state, self.state_reason, self.seen_at = "connected", None, now
                self.warning = "; ".join(
                    f"account {a.name!r}: {a.out_message} — it is out of the choice for "
                    "a while; the other accounts serve" for a in out) or None
                return
        if error is None:
            self.state, self.state_reason, self.warning = "connected", None, None
        elif error.reason in TRAFFIC_WARNS or error.reason in TRAFFIC_FAILS:
            failing = error.reason in TRAFFIC_FAILS
            self.state = "failing" if failing else "connected"
            self.state_reason = error.reason if failing else None
            self.warning = error.message + (f" — {error.action}" if error.action else "")
        else:
            return  # busy, slow, stopped or refused is not broken (H2)
        self.seen_at = trio.current_time()

    def track(self, attempt: InFlight, request: Record, priority: str) -> None:
        """List ``attempt`` (of ``request``) in the status while it is in flight: from
        before it queues until its lane slot is back (its ``finished_at``)."""
        self._in_flight[attempt] = (request.id, request.route, priority, request.client)

    def requests(self, clock: Clock) -> list[dict[str, Any]]:
        """The attempts in flight here: running ones (and stopping ones: timed out, their
        cleanup still holding the slot) by start, then the queued ones in queue order. A
        queued one is ``held`` while the provider holds every start (SPEC L12: it said
        wait)."""
        now = trio.current_time()
        lane = self.lane if isinstance(self.lane, Lane) else None  # (shared: its server)
        listed: list[tuple[tuple[int, int, float], dict[str, Any]]] = []
        for run, (request_id, route, priority, client) in list(self._in_flight.items()):
            if run.finished_at is not None:
                continue
            started, running = run.record.started, run.running_since
            held = (lane is not None and running is None  # (every account's: L13)
                    and lane.hold_left(scope=scope_of(run.record.model or "")) > 0)
            state = ("stopping" if run.stopped_at is not None else
                     "running" if running is not None else "held" if held else "queued")
            order = (int(running is None), PRIORITIES.get(priority, 1), running or started)
            listed.append((order, {
                "id": request_id, "model": run.record.model, "route": route,
                "priority": priority, "client": client, "state": state,
                "account": run.record.account,  # SPEC L13 (None: no accounts, or queued)
                "since": clock.iso(started),
                "queued_s": round((running if running is not None else now) - started, 3),
                "running_s": round(now - running, 3) if running is not None else None,
            }))
        listed.sort(key=lambda item: item[0])
        return [entry for _, entry in listed[:MAX_LISTED_REQUESTS]]

    def ps(self, clock: Clock) -> list[dict[str, Any]]:
        """This provider's lines of the status's ``requests`` (`relay ps`): what runs and
        waits here now, each with its client (SPEC L14: its name, never its token) and
        how long it has been in its present state."""
        lines: list[dict[str, Any]] = redact.redact_obj([
            {"provider": self.name, "account": entry["account"], "model": entry["model"],
             "client": entry["client"],
             "priority": entry["priority"], "state": entry["state"],
             "for_s": entry["running_s"] if entry["running_s"] is not None
             else entry["queued_s"]}
            for entry in self.requests(clock)])
        return lines

    def status(self, clock: Clock) -> dict[str, Any]:
        """This provider's entry in ``GET /relay/v1/status`` (SPEC A3, 9)."""
        stats = self.lane.statistics()
        return redact.redact_obj({  # SPEC E1: the status page is an exit too
            "adapter": self.config.adapter,
            "state": self.state,
            "state_reason": self.state_reason,
            "checked_at": clock.iso(self.checked_at),
            "seen_at": clock.iso(self.seen_at),
            "models": self.models,
            "warning": self.warning,
            # A shared lane's running and queued are every relay's (SPEC L11); held_here
            # is this relay's part.
            "lanes": {"running": stats.running, "capacity": stats.capacity,
                      "queued": stats.queued, "queue_max": stats.queue_max,
                      "shared": self.lane.shared, "held_here": self.lane.held_here},
            "requests": self.requests(clock),
            # SPEC L12: each budget (limit, remaining, configured or the provider's
            # header, and when), the tokens used per minute, the hold and its cause.
            "budgets": self.budgets(clock),
            # SPEC L13: each account's lanes, budgets, hold and state (none: one).
            **({"accounts": self.accounts(clock)} if self.config.accounts else {}),
        })

    def accounts(self, clock: Clock) -> list[dict[str, Any]]:
        """Each account's entry (SPEC L13): its state, lanes, starts and budgets."""
        lane = self.lane
        if isinstance(lane, SharedAccounts):
            return self._shared_accounts(lane, clock)
        if not isinstance(lane, Lane):
            return [{"name": a.name} for a in self.config.accounts]
        now = trio.current_time()
        listed = []
        for account in lane.accounts:
            entry = account.status(clock.iso, now)
            for model, figures in entry["budgets"].get("models", {}).items():
                figures["estimate"] = self.input_ratio.status(model)
            listed.append(entry)
        return listed

    def _shared_accounts(self, lane: SharedAccounts, clock: Clock) -> list[dict[str, Any]]:
        """Each account of a shared provider (SPEC L13 with L11): its running, queued and
        capacity every relay's (``held_here`` this relay's part), its state as this relay
        knows it, the starts made here, its budgets as the server has them."""
        now = trio.current_time()
        listed = []
        for account in lane.accounts:
            own = lane.lanes[account.name]
            stats = own.statistics()
            budgets = own.tokens.status(clock.iso) or {"budgets": {}, "hold": None}
            budgets["models"] = {scope: found for scope, b in own.model_budgets().items()
                                 if (found := b.status(clock.iso)) is not None}
            out = now < account.out_until
            state = "out" if out else "held" if lane.hold_left(account.name, now) else "ok"
            listed.append({
                "name": account.name, "state": state,
                "state_reason": account.out_reason if out else None,
                "out_until": clock.iso(account.out_until) if out else None,
                "warning": account.out_message if out else None,
                "running": stats.running, "capacity": stats.capacity,
                "queued": stats.queued, "held_here": own.held_here, "shared": True,
                "started": lane.started.get(account.name, 0), "rpm": own.profile.rpm,
                "budgets": budgets})
        return listed

    def budgets(self, clock: Clock | None = None) -> dict[str, Any] | None:
        """The provider's token budgets and hold (None: a shared lane, which has none
        here)."""
        budget = getattr(self.lane, "budget", None)
        if budget is None:
            return None
        status: dict[str, Any] = budget.status(clock.iso if clock is not None
                                               else lambda t: None)
        models = getattr(self.lane, "model_budgets", None)  # a shared lane's (L11)
        if status is not None and models is not None:
            iso = clock.iso if clock is not None else (lambda t: None)
            status["models"] = {scope: found for scope, b in models().items()
                                if (found := b.status(iso)) is not None}
        # What the provider counted of relay's estimate, by model and script (L12).
        for model, figures in (status or {}).get("models", {}).items():
            figures["estimate"] = self.input_ratio.status(model)
        return status


async def discover(provider: Provider) -> None:
    try:
        await provider.refresh_models(force=True)
    except Exception:  # discovery is best effort; never take the relay down
        logger.exception("model discovery for %s crashed", provider.name)
