"""A shared lane: one provider's slots, queue and pacer, counted across relays (SPEC L11).

Theory of operation. The state lives on the coordination server (`shared_scripts`: the
holders with their leases, the waiters in (priority class, arrival) order, the stored
profile, the pacer); this object is one relay's view of it and keeps the contract of
`relay.capacity.lanes.Lane` (`relay.capacity.lane_api.LaneLike`):

- ``async with lane.slot(priority, client=..., weight=...)``: one `ACQUIRE` script either
  grants a slot at once, queues the request in the local lane's order — priority class,
  then turns between clients by weight (SPEC L14, `lane_scripts`), one queue across
  relays — (``queue_max`` counted globally: ``provider_queue_full`` when every
  relay's waiters together fill it) or refuses it. A queued request waits for its grant
  — a published message, or any script's reply that lists it — within its own
  ``queue_timeout_s`` (timeouts may differ per relay); the pacer's "not yet" comes back
  as a time to ask again (`PUMP`), so a free slot never idles while someone waits on
  any relay;
- a waiter that leaves (its timeout, its client gone) runs `LEAVE`, shielded and
  bounded; a grant that landed on it meanwhile is given back there and was no start;
- the body runs inside a cancel scope whose deadline is the coordinator's ``lost_at``:
  if the lease cannot be renewed in time (or the server says it was taken back), the
  body is cancelled and the ``async with`` raises ``coordination_lost`` once the body —
  the adapter's cleanup included — has exited (a scope around the ``yield`` of an
  ``asynccontextmanager``: the body runs in this task, nested inside it, so this is the
  supported shape, not a generator suspended elsewhere);
- the slot goes back (`RELEASE`) only after the body has exited, shielded and bounded; a
  release that does not reach the server (or finds the lease already expired) marks the
  ticket ``lease_expired`` — the server takes the slot back at the lease's end.

The numbers (`statistics`) are the global ones of the last reply from the server (a
renewal at least every lease / 4), with what a holder waiting for tokens here waits for
(`SharedBudget`). A reload that changes lanes, queue_max or rpm stores the new profile
for every relay (`SYNC` in ``reload`` mode); the others apply it at their next renewal.
"""

# layers: long because a shared slot's life (acquire, wait, give back, renew) is one
# protocol with the coordination server, best read in one place.

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from relay.capacity.lanes import PRIORITIES, Ticket
from relay.capacity.meter import MAX_MODELS, scope_of
from relay.vocab.errors import ConfigError, RelayError
from relay.vocab.events import LaneStatistics
from relay.vocab.profile import ModelLimits, Profile

from .budget import SharedBudget
from .coordinator import Coordinator
from .errors import capacity_error, lost_error, mismatch_problem

__all__ = ["TURN", "SharedLane"]

TURN = 1 << 20  # a weight-1 client's turn, in the scripts' integer ticks (SPEC L14)

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class _Member:
    """One request's place on the server: a waiter, then a holder."""

    member: str
    rank: int
    ticket: Ticket
    event: trio.Event = attrs.field(factory=trio.Event)
    granted: bool = False
    gone: bool = False      # the server dropped its place (its lease expired)
    on_server: bool = True  # the server may hold it: leaving must tell it
    queued: bool = False    # the server said it waits: renewals carry it from then on
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    lost: bool = False      # the server took its slot back
    task: trio.lowlevel.Task = attrs.field(factory=trio.lowlevel.current_task)  # its own
    on_queued: Callable[[], None] | None = None  # (the token queue's notices too)
    client: str = "default"  # SPEC L14: whose request it is, for turns between clients
    step: int = TURN         # ... and how far a start moves its client on (TURN / weight)


class SharedLane:
    """A provider's lane shared through the coordination server. See the module
    docstring."""

    shared = True

    def __init__(self, name: str, profile: Profile, coordinator: Coordinator, *,
                 expected_run_s: float = 10.0,
                 limits: Mapping[str, ModelLimits] | None = None) -> None:
        self.name = name
        self._local = profile  # this relay's own: the timeouts are its own
        self._stored = (profile.lanes, profile.queue_max, profile.rpm)  # every relay's
        self._coord = coordinator
        self._keys = coordinator.keys(name)
        self.epoch = ""
        self.problem: str | None = None  # a profile mismatch found after start
        self._waiters: dict[str, _Member] = {}
        self._holders: dict[str, _Member] = {}
        self._leaving = 0  # members telling the server they leave or release (wait_idle)
        self._running = 0
        self._queued = 0
        self._pump_at = math.inf
        self._pumping = False
        self._avg_run_s = expected_run_s
        self._idle = trio.Event()
        self._idle.set()
        coordinator.add(self)
        self.tokens = self.budget = SharedBudget(  # SPEC L12: on the server too
            name, coordinator, profile=lambda: self._local, holder=self._holder_here)
        # SPEC L12a: each model's budgets and hold, on the server too (`model_tokens`).
        self._limits = {scope_of(m): f for m, f in (limits or {}).items()}
        self._models: dict[str, SharedBudget] = {}

    def model_tokens(self, scope: str, *, create: bool = False) -> SharedBudget | None:
        """Model ``scope``'s shared budgets (SPEC L12a): kept on the server under the
        provider's name and the model's, made here once this relay has heard of them (a
        header or a 429 naming the model, or its configured figures); None before.
        At most `MAX_MODELS` a lane (the least recently used forgotten here first: its
        keys stay on the server, and come back with its next header)."""
        budget = self._models.pop(scope, None)
        if budget is None:
            if not scope or not (create or scope in self._limits):
                return None
            figures = self._limits.get(scope, ModelLimits())
            budget = SharedBudget(
                f"{self.name}@{scope}", self._coord, holder=self._holder_here,
                profile=lambda: attrs.evolve(self._local, tpm=figures.tpm,
                                             itpm=figures.itpm, otpm=figures.otpm))
            if len(self._models) >= MAX_MODELS:
                del self._models[next(iter(self._models))]
        self._models[scope] = budget  # (most recently used last)
        return budget

    def model_budgets(self) -> dict[str, SharedBudget]:
        """The models' shared budgets this relay knows (for the status)."""
        return dict(sorted(self._models.items()))

    def _holder_here(self) -> _Member | None:
        """The slot the calling task holds (`SharedBudget.take` runs inside it)."""
        task = trio.lowlevel.current_task()
        return next((m for m in self._holders.values() if m.task is task), None)

    # --- what the relay reads -----------------------------------------------------------
    @property
    def profile(self) -> Profile:
        lanes, queue_max, rpm = self._stored
        return attrs.evolve(self._local, lanes=lanes, queue_max=queue_max, rpm=rpm)

    @property
    def held_here(self) -> int:
        return len(self._holders)

    def statistics(self) -> LaneStatistics:
        lanes, queue_max, _ = self._stored
        return LaneStatistics(running=max(self._running, len(self._holders)),
                              capacity=lanes, queued=self._queued, queue_max=queue_max,
                              waiting_for=self.tokens.waiting_for())

    async def refresh_figures(self) -> None:
        """Running and queued as the server counts them now (a status read:
        `relay.shared.figures`).

        Raises:
            RelayError: ``coordination_unavailable``.
        """
        if not self._coord.available:
            await trio.lowlevel.checkpoint()
            return
        reply = await self._coord.call("COUNTS", self._keys, [], provider=self.name)
        self._running, self._queued = int(reply[0]), int(reply[1])

    def estimate_wait_s(self) -> float:
        lanes, _, rpm = self._stored
        pace = 60.0 / rpm if rpm > 0 else 0.0
        if self._running < lanes and self._queued == 0:
            return pace
        return max(pace, self._avg_run_s * (self._queued + 1) / max(1, lanes))

    def update_profile(self, profile: Profile) -> None:
        """A reload: the timeouts apply here at once; new lanes, queue_max or rpm are
        stored for every relay (and applied here when the server has them)."""
        self._local = profile
        if (profile.lanes, profile.queue_max, profile.rpm) != self._stored:
            self._coord.start_soon(self._store_profile)

    async def wait_idle(self) -> None:
        await trio.lowlevel.checkpoint()
        while self._holders or self._waiters or self._leaving:
            await self._idle.wait()

    async def claim_check(self, interval_s: float) -> bool:
        return await self._coord.claim_check(self.name, interval_s)

    # --- the slot -------------------------------------------------------------------------
    @asynccontextmanager
    async def slot(self, priority: str = "normal", *, client: str = "default",
                   weight: float = 1.0, on_queued: Callable[[], None] | None = None
                   ) -> AsyncIterator[Ticket]:
        """Hold one slot, counted across relays, for the body of the ``async with``.

        Args:
            priority: ``interactive``, ``normal`` or ``background``.
            client: who asks (SPEC L14): inside a class, clients take turns, whichever
                relay their requests are on.
            weight: the client's share of the turns; positive and finite.
            on_queued: called (synchronously) when the request has to wait.

        Raises:
            RelayError: ``provider_queue_full``, ``provider_queue_timeout``,
                ``coordination_unavailable``; ``coordination_lost`` after the body when
                the lease could not be kept.
        """
        m = await self.acquire(priority, client=client, weight=weight, on_queued=on_queued)
        async with self.hold(m) as ticket:
            yield ticket

    # SPEC L13 with L11: a request queued on several accounts' lanes at once takes the
    # first grant (`relay.shared.accounts`): `slot` in its two halves, and the give-back
    # of a grant it will not use.
    async def acquire(self, priority: str = "normal", *, client: str = "default",
                      weight: float = 1.0, on_queued: Callable[[], None] | None = None
                      ) -> _Member:
        """A grant of one slot, to hold with `hold` (in the task that runs the body) or
        give back with `hand_back`. Raises as `slot` does."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"a client's weight must be positive and finite, not {weight!r}")
        return await self._acquire(priority, on_queued, client, max(1, round(TURN / weight)))

    async def hand_back(self, m: _Member) -> None:
        """A grant `acquire` made that is not used: given back as no start (`LEAVE`),
        shielded and bounded."""
        self._holders.pop(m.member, None)
        with trio.CancelScope(shield=True,
                              deadline=trio.current_time() + self._coord.command_timeout_s):
            await self._give_back("LEAVE", m)
        self._maybe_idle()

    @asynccontextmanager
    async def hold(self, m: _Member) -> AsyncIterator[Ticket]:
        """Hold the slot `acquire` granted for the body of the ``async with``, inside
        its lease's scope; given back after the body. Raises as `slot` does."""
        m.task = trio.lowlevel.current_task()  # (its token budgets find it by its task)
        try:
            with m.scope:
                yield m.ticket
        finally:
            self._holders.pop(m.member, None)
            ok = False
            # Shielded with a deadline: the slot must go back even when the request was
            # cancelled, and a server that does not answer must not hold the request.
            with trio.CancelScope(shield=True,
                                  deadline=trio.current_time() + self._coord.command_timeout_s):
                ok = await self._give_back("RELEASE", m) == "released"
            now = trio.current_time()
            m.ticket.released_at = now
            m.ticket.lease_expired = m.lost or not ok  # (lost: the server took it back)
            if m.ticket.started_at is not None:
                self._avg_run_s += 0.2 * ((now - m.ticket.started_at) - self._avg_run_s)
            self._maybe_idle()
        if m.scope.cancelled_caught:
            raise self._lost_error(m)

    async def _acquire(self, priority: str, on_queued: Callable[[], None] | None,
                       client: str, step: int) -> _Member:
        rank = PRIORITIES.get(priority)
        if rank is None:
            raise ValueError(f"unknown priority {priority!r}; one of {', '.join(PRIORITIES)}")
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.problem is not None:
            raise self._coord.unavailable(self.name, self.problem)
        if not self._coord.available:
            raise self._coord.unavailable(self.name)
        now = trio.current_time()
        m = _Member(self._coord.new_member(), rank, Ticket(priority=priority, queued_at=now),
                    on_queued=on_queued, client=client, step=step)
        self._waiters[m.member] = m  # before the call: a grant may be published at once
        self._busy()
        try:
            status = await self._call("ACQUIRE", m.member, rank, client, step)
            if status == "stale":  # the server's state was made anew: register first
                await self.sync()
                status = await self._call("ACQUIRE", m.member, rank, client, step)
            if status == "full":
                m.on_server = False
                raise self._capacity_error("provider_queue_full")
            if status == "stale":
                raise self._coord.unavailable(self.name, "its state was lost and is being "
                                              "rebuilt")
            if status != "granted" and not m.granted:
                m.queued = True
                if on_queued is not None:
                    on_queued()
                await self._wait(m, now + self._local.queue_timeout_s)
        except BaseException:
            self._waiters.pop(m.member, None)
            if m.on_server:
                with trio.CancelScope(shield=True, deadline=trio.current_time()
                                      + self._coord.command_timeout_s):
                    await self._give_back("LEAVE", m)
            self._maybe_idle()
            raise
        self._waiters.pop(m.member, None)
        m.granted = True
        m.ticket.started_at = trio.current_time()
        m.scope.deadline = self._coord.lost_at
        self._holders[m.member] = m
        return m

    async def _wait(self, m: _Member, timeout_at: float) -> None:
        # (noqa, ASYNC912: a waiter granted before the loop runs has nothing to await.)
        with trio.move_on_at(timeout_at):  # noqa: ASYNC912
            while not m.granted:
                if m.gone:
                    raise self._lost_error(m, waiting=True)
                now = trio.current_time()
                wake_at = self._coord.lost_at
                if now >= wake_at:  # where a holder stops; a waiter holds nothing the
                    # server could give twice: a late renewal is asked for, not a failure
                    wake_at = self._coord.renewed_at + self._coord.lease_s
                    if not self._coord.available or now >= wake_at:
                        raise self._coord.unavailable(self.name, None if not self._coord.available
                                                      else "no renewal within a lease")
                    self._coord.renew_soon()
                if now >= self._pump_at and not self._pumping:
                    self._pump_at = math.inf
                    self._pumping = True
                    try:
                        await self._call("PUMP")
                    finally:
                        self._pumping = False
                    continue
                event = m.event = trio.Event()
                with trio.move_on_at(min(self._pump_at, wake_at)):
                    await event.wait()
        if not m.granted:
            # Its queue timeout: leave (bounded; a grant that landed meanwhile goes back).
            waited = trio.current_time() - m.ticket.queued_at
            self._waiters.pop(m.member, None)
            with trio.move_on_after(self._coord.command_timeout_s):
                await self._give_back("LEAVE", m)
            m.on_server = False  # told, or its lease ends the place
            raise self._capacity_error("provider_queue_timeout", waited_s=waited)

    async def _give_back(self, script: str, m: _Member) -> str | None:
        """`LEAVE` or `RELEASE`; None when the server could not be told (its lease
        then ends the place or the slot)."""
        if not m.on_server:
            return "left"
        # Until the server has heard it, the renewal loop tries again (a ghost waiter at
        # the head of the queue would be granted a slot that idles for a lease).
        self._coord.orphans[m.member] = (self, script, trio.current_time())
        self._leaving += 1  # still this relay's business until the server has heard it
        try:
            status = await self._call(script, m.member)
        except RelayError:
            return None
        finally:
            self._leaving -= 1
        self._coord.orphans.pop(m.member, None)
        m.on_server = False
        return status if status != "stale" else "released"  # the state it was in is gone

    async def retry_give_back(self, script: str, member: str) -> None:
        """A `LEAVE` or `RELEASE` that did not reach the server, again.

        Raises:
            RelayError: ``coordination_unavailable``.
        """
        await self._call(script, member)

    async def _call(self, script: str, *extra: Any) -> str:
        reply = await self._coord.call(script, self._keys, self._args(*extra),
                                       provider=self.name)
        self._apply(reply)
        return str(reply[0])

    def _args(self, *extra: Any, profile: Profile | None = None) -> list[Any]:
        lanes, queue_max, rpm = (self._stored if profile is None else
                                 (profile.lanes, profile.queue_max, profile.rpm))
        c = self._coord
        return [c.instance, c.relay_id, int(c.lease_s * 1000), self.epoch, lanes, queue_max,
                repr(float(rpm)), c.channel_prefix, self.name, *extra]

    def _apply(self, reply: list[Any]) -> None:
        if reply[0] in ("stale", "mismatch"):
            return
        self._running, self._queued = int(reply[1]), int(reply[2])
        wait = int(reply[3])
        if wait >= 0:
            self.pump_hint(wait)
        for member in reply[4]:
            self._coord.granted(str(member))

    # --- what the coordinator tells it --------------------------------------------------
    def woken(self, member: str) -> bool:
        m = self._waiters.get(member) or self._holders.get(member)  # (a holder: tokens)
        if m is None:
            return False
        m.granted = True
        m.event.set()
        return True

    def pump_hint(self, ms: int) -> None:
        """Ask the server again in ``ms`` (the pacer or the quiet period holds a free
        slot back): the head waiter here wakes then."""
        self._pump_at = min(self._pump_at, trio.current_time() + ms / 1000)
        for m in self._waiters.values():
            m.event.set()

    def renewed(self, lost_at: float) -> None:
        for m in self._holders.values():
            m.scope.deadline = lost_at

    async def sync(self, *, at_start: bool = False, mode: str | None = None) -> None:
        """Renew (or first register, or re-register) this relay's slots and places.

        Raises:
            RelayError: ``coordination_unavailable``.
            ConfigError: at start, the stored profile differs from this relay's.
        """
        holders = list(self._holders)
        # Only waiters the server has queued: one whose ACQUIRE is still on its way would
        # be reported gone (or, after a lost state, queued twice).
        waiters = [(name, m.rank, m.client, m.step) for name, m in self._waiters.items()
                   if m.queued]
        mode = mode or ("start" if not self.epoch else "renew")
        args = [mode, len(holders), *holders, len(waiters),
                *(x for four in waiters for x in four)]
        reply = await self._coord.call(
            "SYNC", self._keys,
            self._args(*args, profile=self._local if mode == "reload" else None),
            provider=self.name)
        if reply[0] == "mismatch":
            self._mismatch(reply, at_start)
            return
        self._apply(reply)
        epoch, lanes, queue_max, rpm, set_by, _pver, lost, woken, gone, reclaimed = reply[5:]
        if self.epoch and epoch != self.epoch:
            logger.warning("shared lane %s: the coordination server lost its state (a "
                           "restart or a failover?); %d slot(s) and %d place(s) of this "
                           "relay registered again, no new grant for one lease", self.name,
                           len(holders), len(waiters))
        self.epoch = str(epoch)
        self.problem = None
        stored = (int(lanes), int(queue_max), float(rpm))
        if stored != self._stored:
            a = self._stored
            logger.info("shared lane %s: profile changed by relay %s: lanes %d→%d, "
                        "queue_max %d→%d, rpm %g→%g (applied in place)", self.name, set_by,
                        a[0], stored[0], a[1], stored[1], a[2], stored[2])
            self._stored = stored
        for member in lost:
            m = self._holders.get(str(member))
            if m is not None:
                m.lost = True
                m.scope.cancel()
        for member in woken:
            self.woken(str(member))
        for member in gone:
            m = self._waiters.get(str(member))
            if m is not None:
                m.gone = True
                m.on_server = False
                m.event.set()
        if int(reclaimed):
            logger.info("shared lane %s: %d slot(s) whose lease had expired were taken back",
                        self.name, int(reclaimed))
        await self.tokens.refresh()  # (what the status shows of the budgets: SPEC L12)
        for budget in list(self._models.values()):
            await budget.refresh()

    def _mismatch(self, reply: list[Any], at_start: bool) -> None:
        problem = mismatch_problem(self.name, self._stored, reply[1:5], self._coord)
        if at_start:
            raise ConfigError([problem])
        if self.problem is None:
            logger.error("%s; this relay does not use it until they agree", problem)
        self.problem = problem

    async def _store_profile(self) -> None:
        try:
            await self.sync(mode="reload")
        except RelayError as exc:
            logger.warning("shared lane %s: the reloaded profile could not be stored (%s); "
                           "it is kept here and stored at the next renewal", self.name,
                           exc.message)

    # --- helpers --------------------------------------------------------------------------
    def _busy(self) -> None:
        if self._idle.is_set():
            self._idle = trio.Event()

    def _maybe_idle(self) -> None:
        if not self._holders and not self._waiters and not self._leaving:
            self._idle.set()

    def _lost_error(self, m: _Member, *, waiting: bool = False) -> RelayError:
        return lost_error(self.name, self._coord, taken_back=m.lost or waiting,
                          waiting=waiting)

    def _capacity_error(self, reason: str, waited_s: float | None = None) -> RelayError:
        return capacity_error(self.name, reason, self.statistics(),
                              max(1.0, self.estimate_wait_s()), waited_s)
