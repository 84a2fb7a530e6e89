"""A shared provider's accounts (SPEC L13 with L11): one shared lane per account.

Theory of operation. Each account of a provider with ``shared = true`` has its slots,
queue, pacer and token budgets on the coordination server: a `SharedLane` named
``PROVIDER#ACCOUNT`` there (its keys ``{prefix:PROVIDER#ACCOUNT}:…``), with its own
`SharedBudget` and models' budgets, built from the account's profile (its ``lanes``,
``rpm``, ``tpm``… over the provider's). Relays that list the same accounts share them
account by account, so what runs on one key is counted across every relay, and every
relay must agree on each account's lanes, queue_max and rpm (as for one shared lane).

The choice (`SharedAccounts.slot`). A request queues on every account it may use at once
and takes the first grant: so it starts on the account that can start it soonest, and no
account's slot idles while a request that may use it waits anywhere. The accounts are
asked one after another, best first (the most free slots the last replies counted, then
the shortest queue), each only once the one before has queued it — a request that can
start at once costs one call, as on one lane. A grant that comes while another is taken
(on this relay, in the same tick) is handed back as no start (`LEAVE`: the pacer forgets
it, the next waiter there is granted); a waiter cancelled as its grant lands gives it
back the same way (`SharedLane`). The request leaves out:

- the accounts that failed it (``avoid``: a 429, a usage window, a refused key moved it
  here: `relay.engine.metering.moves`);
- the accounts this relay knows are out (a refused key, a server that does not answer:
  30 s, doubling, as `relay.capacity.account` keeps it) or held (a 429's or a usage
  window's hold: from this relay's own answers at once, from any relay's at the next
  renewal, when each account's budgets are read) — unless every account it may use is;
- for the first ``affinity_wait_s`` of its wait, every account but its conversation's
  (``prefer``: the account that answered its last turn), when that one is in the choice.

The winner's slot is held for the body with `SharedLane.hold` in the request's own task,
inside that lease's scope; its ticket names the account (``Ticket.shared_account``), so
the account's adapter runs it, its budgets take and settle it, and its failure moves the
request to another account.

Numbers (`statistics`): running and capacity summed over the accounts; queued the
longest account queue (a waiting request is queued on every account it may use).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from relay.capacity.account import Account
from relay.capacity.budget import Learned
from relay.capacity.lanes import Ticket
from relay.vocab.errors import RelayError
from relay.vocab.events import LaneStatistics
from relay.vocab.profile import ModelLimits, Profile

from .budget import SharedBudget
from .coordinator import Coordinator
from .errors import capacity_error
from .lane import SharedLane, _Member

__all__ = ["SharedAccounts"]

logger = logging.getLogger(__name__)

SEPARATOR = "#"  # PROVIDER#ACCOUNT: account names are letters, digits, '-' and '_'


@attrs.define(eq=False)
class _Race:
    """One request's grants across the accounts (see the module docstring)."""

    on_queued: Callable[[], None] | None
    client: str = "default"  # SPEC L14: its turn in each account's queue
    weight: float = 1.0
    nursery: trio.Nursery | None = None
    winner: tuple[str, _Member] | None = None
    surplus: list[tuple[SharedLane, _Member]] = attrs.field(factory=list)
    errors: list[RelayError] = attrs.field(factory=list)
    told: bool = False  # the request's own on_queued has been called

    def queued(self, event: trio.Event) -> None:
        """One account queued it (during the race), or — once it has won — its winner
        waits for tokens (the request's waiting notices begin)."""
        if self.winner is None:
            event.set()
        else:
            self.tell()

    def tell(self) -> None:
        if not self.told:
            self.told = True
            if self.on_queued is not None:
                self.on_queued()


class SharedAccounts:
    """A shared provider's accounts, each a shared lane. See the module docstring."""

    shared = True

    def __init__(self, name: str, profile: Profile, coordinator: Coordinator,
                 accounts: Sequence[tuple[str, Profile]], *, expected_run_s: float = 10.0,
                 limits: Mapping[str, ModelLimits] | None = None) -> None:
        self.name = name
        self._profile = profile
        self._coord = coordinator
        self.lanes: dict[str, SharedLane] = {}
        self.accounts: list[Account] = []  # this relay's view of each: out, and why
        learned = Learned()  # how long each model answers: one for every account
        for account, own in accounts:
            lane = SharedLane(f"{name}{SEPARATOR}{account}", own, coordinator,
                              expected_run_s=expected_run_s, limits=limits)
            lane.tokens.learned = learned
            self.lanes[account] = lane
            self.accounts.append(Account(account, own, trio.current_time))
        self._held_until: dict[str, float] = {}  # a hold this relay's own answer said
        self.started: dict[str, int] = dict.fromkeys(self.lanes, 0)  # starts made here

    # --- what the relay reads (`relay.capacity.lane_api.LaneLike`) -----------------------
    @property
    def profile(self) -> Profile:
        return attrs.evolve(self._profile, lanes=sum(
            lane.profile.lanes for lane in self.lanes.values()))

    @property
    def tokens(self) -> SharedBudget:
        """The first account's budgets (the provider's ``budgets`` in the status, as a
        local lane's first account's; each account's are in ``accounts``)."""
        return self._first.tokens

    budget = tokens

    def model_budgets(self) -> dict[str, SharedBudget]:
        return self._first.model_budgets()

    @property
    def _first(self) -> SharedLane:
        return next(iter(self.lanes.values()))

    @property
    def held_here(self) -> int:
        return sum(lane.held_here for lane in self.lanes.values())

    def statistics(self) -> LaneStatistics:
        each = [lane.statistics() for lane in self.lanes.values()]
        waiting = [s.waiting_for for s in each if s.waiting_for is not None]
        return LaneStatistics(running=sum(s.running for s in each),
                              capacity=sum(s.capacity for s in each),
                              queued=max(s.queued for s in each),
                              queue_max=self._profile.queue_max,
                              waiting_for=waiting[0] if waiting else None)

    def estimate_wait_s(self) -> float:
        return min(lane.estimate_wait_s() for lane in self.lanes.values())

    def lane_for(self, account: str) -> SharedLane:
        """The shared lane of ``account`` (the first for an unknown name)."""
        return self.lanes.get(account) or self._first

    def account(self, name: str) -> Account | None:
        return next((a for a in self.accounts if a.name == name), None)

    def update_profile(self, profile: Profile,
                       limits: Mapping[str, ModelLimits] | None = None,
                       accounts: Sequence[tuple[str, Profile]] | None = None) -> None:
        """A reload (SPEC L10): each account's new figures are stored for every relay
        (`SharedLane.update_profile`); an account added or removed takes effect at the
        next restart."""
        self._profile = profile
        for name, own in accounts or ():
            lane = self.lanes.get(name)
            if lane is None:
                logger.warning("shared provider %s: account %s is added at the next "
                               "restart", self.name, name)
                continue
            lane.update_profile(own)
            found = self.account(name)
            if found is not None:
                found.profile = own

    async def wait_idle(self) -> None:
        for lane in self.lanes.values():
            await lane.wait_idle()

    async def claim_check(self, interval_s: float) -> bool:
        return await self._coord.claim_check(self.name, interval_s)

    async def refresh_figures(self) -> None:
        """Every account's running and queued as the server counts them now.

        Raises:
            RelayError: ``coordination_unavailable``.
        """
        for lane in self.lanes.values():
            await lane.refresh_figures()

    # --- an account's state (SPEC L13: `relay.engine.providers.Provider.observe`) -------
    def account_failed(self, account: Account, reason: str, message: str) -> None:
        account.failed(reason, message, trio.current_time())

    def account_answered(self, account: Account) -> None:
        account.answered()

    def others(self, avoid: frozenset[str]) -> list[Account]:
        """The accounts a request that failed on ``avoid`` may still move to."""
        now = trio.current_time()
        return [a for a in self.accounts if a.name not in avoid and a.usable(now)]

    def said(self, account: str, error: RelayError) -> None:
        """An answer of ``account`` on this relay set a hold (a 429, a usage window): its
        next choices leave it out until then (every relay hears it at its renewal)."""
        limits = error.limits
        if limits is not None and limits.hold_s:
            self._held_until[account] = trio.current_time() + limits.hold_s

    def hold_left(self, account: str, now: float) -> float:
        """How long ``account`` holds every start, as this relay knows it."""
        left = self._held_until.get(account, -math.inf) - now
        status = self.lanes[account].tokens.status(lambda _t: None)
        hold = status.get("hold") if status is not None else None
        if hold is not None:
            left = max(left, float(hold["left_s"]))
        return max(0.0, left)

    # --- the slot -----------------------------------------------------------------------
    @asynccontextmanager
    async def slot(self, priority: str = "normal", *, client: str = "default",
                   weight: float = 1.0, on_queued: Callable[[], None] | None = None,
                   prefer: str | None = None, avoid: frozenset[str] = frozenset(),
                   probe: bool = False) -> AsyncIterator[Ticket]:
        """Hold one slot of the account that can start the request soonest, for the body
        of the ``async with``; the ticket names the account.

        Raises:
            RelayError: ``provider_queue_full`` (every account's queue is full),
                ``provider_queue_timeout``, ``coordination_unavailable``;
                ``coordination_lost`` after the body when the lease could not be kept.
        """
        name, m = await self._race(priority, _Race(on_queued, client, weight), prefer,
                                   avoid, probe)
        async with self.lanes[name].hold(m) as ticket:
            ticket.shared_account = name
            self.started[name] += 1
            yield ticket

    def _order(self, prefer: str | None, avoid: frozenset[str], probe: bool,
               now: float) -> tuple[list[str], bool]:
        """The accounts to ask, best first, and whether the first is the conversation's
        (asked alone for ``affinity_wait_s``)."""
        left = [a for a in self.accounts if a.name not in avoid] or list(self.accounts)
        if not probe:
            left = [a for a in left if a.usable(now)] or left
            left = [a for a in left if self.hold_left(a.name, now) <= 0] or left

        def room(account: Account) -> tuple[int, int]:
            stats = self.lanes[account.name].statistics()
            return (stats.running - stats.capacity, stats.queued)

        names = [a.name for a in sorted(left, key=room)]
        if prefer in names and len(names) > 1:
            names.remove(prefer)
            return [prefer, *names], True
        return names, False

    async def _race(self, priority: str, race: _Race, prefer: str | None,
                    avoid: frozenset[str], probe: bool) -> tuple[str, _Member]:
        now = trio.current_time()
        names, preferred = self._order(prefer, avoid, probe, now)
        deadline = now + self._profile.queue_timeout_s
        try:
            with trio.move_on_at(deadline):
                async with trio.open_nursery() as nursery:
                    race.nursery = nursery
                    nursery.start_soon(self._ask_in_turn, race, names, priority,
                                       now + self._profile.affinity_wait_s
                                       if preferred else now)
        except BaseException:
            await self._give_back(race, keep=None)
            raise
        if race.winner is not None:
            await self._give_back(race, keep=race.winner[1])
            return race.winner
        raise self._failure(race, trio.current_time() - now)

    async def _ask_in_turn(self, race: _Race, names: list[str], priority: str,
                           others_at: float) -> None:
        """Queue the request on each account in turn, each once the one before has
        queued it (the others only from ``others_at``: its conversation's account
        first)."""
        assert race.nursery is not None
        for i, name in enumerate(names):
            queued = trio.Event()
            race.nursery.start_soon(self._ask, race, name, priority, queued)
            await queued.wait()
            if i == 0 and len(names) > 1 and trio.current_time() < others_at:
                race.tell()  # it waits for its conversation's account
                await trio.sleep_until(others_at)
        race.tell()  # queued on every account it may use

    async def _ask(self, race: _Race, name: str, priority: str, queued: trio.Event) -> None:
        lane = self.lanes[name]
        try:
            m = await lane.acquire(priority, client=race.client, weight=race.weight,
                                   on_queued=lambda: race.queued(queued))
        except RelayError as exc:  # (this account cannot take it: the others may)
            race.errors.append(exc)
            queued.set()
            return
        if race.winner is None:
            race.winner = (name, m)
            assert race.nursery is not None
            race.nursery.cancel_scope.cancel()  # the other accounts' places are left
        else:
            race.surplus.append((lane, m))
        queued.set()

    async def _give_back(self, race: _Race, keep: _Member | None) -> None:
        """Every grant the request will not use, handed back as no start."""
        grants = list(race.surplus)
        if race.winner is not None and race.winner[1] is not keep:
            grants.append((self.lanes[race.winner[0]], race.winner[1]))
        for lane, m in grants:
            await lane.hand_back(m)  # (shielded and bounded)

    def _failure(self, race: _Race, waited_s: float) -> RelayError:
        """No account granted a slot: the server's unavailability first, then a full
        queue on every account, else the queue timeout, with the provider's numbers."""
        reasons = [e.reason for e in race.errors]
        for error in race.errors:
            if error.reason not in ("provider_queue_full", "provider_queue_timeout"):
                return error
        stats = self.statistics()
        retry = max(1.0, self.estimate_wait_s())
        if reasons and all(r == "provider_queue_full" for r in reasons):
            return capacity_error(self.name, "provider_queue_full", stats, retry, None)
        return capacity_error(self.name, "provider_queue_timeout", stats, retry, waited_s)
