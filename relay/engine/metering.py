"""An attempt's side of the token budgets (SPEC L12): what it takes from its provider's
budgets, what the answer said of the provider's limits, and the settlement.

The dispatcher calls these around the adapter, inside the attempt's lane slot:

- `slot`: the lane's slot with the attempt's `Need` (estimated input plus its output
  reservation), leaving at once while the provider is held when the plan has a fallback
  (F2); the answer's rate-limit headers reach the lane through the attempt's sink;
- `run`: the adapter's run; an error answer's limits (a 429's hold) reach the lane
  *before* the slot is given back (the next start must already see the hold), and the
  reservation is settled to the usage the provider reported, or to relay's estimate of
  what was sent and read (marked so), or to nothing for an error answer;
- `wait_out`: whether a 429 that set a hold is waited out on the same target (a stream
  whose 200 is already out never ends in a 429 it could have waited out).

A shared lane (SPEC L11) keeps its budgets on the coordination server (`_shared_slot`).
The request's client and weight (SPEC L14: turns between clients inside a class) go to
either lane: a shared lane's queue on the server takes the same turns across relays.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import attrs
import trio

from relay.api.adapter import Adapter
from relay.capacity.budget import (
    Learned,
    Need,
    Reservation,
    bounded_hold,
)
from relay.capacity.lane_api import LaneLike
from relay.capacity.lanes import Lane, Ticket
from relay.capacity.meter import scope_of
from relay.shared.accounts import SharedAccounts
from relay.shared.budget import SharedBudget
from relay.shared.lane import SharedLane
from relay.vocab.errors import RelayError
from relay.vocab.limits import RateLimits
from relay.vocab.records import Record

from .attempt import Delivered, Run
from .needs import conversation, need_of, skips_cache_reads
from .plan import Plan, Target
from .providers import Provider

__all__ = ["Attempting", "count_wait", "run", "slot", "wait_out"]

logger = logging.getLogger("relay.dispatch")


class Attempting(Protocol):
    """What metering reads of the request whose attempts it meters (the dispatcher)."""

    priority: str
    client: str            # SPEC L14: the client whose request it is (its name)
    client_weight: float   # ... and its weight in turns between clients
    plan: Plan
    record: Record
    stream: bool
    runs: list[Run]

    @property
    def heartbeat_s(self) -> float:
        """How soon a queued stream's headers go out (``[server] heartbeat_s``)."""


def slot(dispatcher: Attempting, run_: Run, on_queued: Callable[[], None]
         ) -> AbstractAsyncContextManager[Ticket]:
    """The attempt's lane slot, with its need when the lane keeps token budgets. It
    leaves at once while the provider is held when the plan has a later target; a
    connection check may pass a hold (it is how a lifted limit shows)."""
    lane, priority = run_.target.provider.lane, dispatcher.priority
    run_.has_fallback = run_.target is not dispatcher.plan.targets[-1]
    if isinstance(lane, SharedLane | SharedAccounts):
        return _shared_slot(lane, run_, priority, on_queued,
                            probe=dispatcher.record.route == "(check)",
                            client=dispatcher.client, weight=dispatcher.client_weight)
    if not isinstance(lane, Lane):
        return lane.slot(priority, on_queued=on_queued)
    prefer = None
    if len(lane.accounts) > 1:  # SPEC L13: its conversation's account, if one served it
        prefer = run_.target.provider.affinity.get(conversation(run_))
    return lane.slot(priority, client=dispatcher.client, weight=dispatcher.client_weight,
                     on_queued=on_queued, need=need_of(run_, lane.budget.learned),
                     leave_if_held=run_.has_fallback,
                     probe=dispatcher.record.route == "(check)", prefer=prefer,
                     avoid=run_.avoid)


@asynccontextmanager
async def _shared_slot(lanes: SharedLane | SharedAccounts, run_: Run, priority: str,
                       on_queued: Callable[[], None], *, probe: bool,
                       client: str = "default", weight: float = 1.0
                       ) -> AsyncIterator[Ticket]:
    """A shared lane's slot, then the attempt's need from the budgets every relay sharing
    the provider keeps on the coordination server (`SharedBudget`); with accounts (SPEC
    L13), the slot of the account that can start it soonest (its conversation's account
    preferred), then that account's. Clients take turns in each queue (L14)."""
    need = need_of(run_, lanes.tokens.learned)
    held = (lanes.slot(priority, client=client, weight=weight, on_queued=on_queued,
                       avoid=run_.avoid, probe=probe,
                       prefer=run_.target.provider.affinity.get(conversation(run_)))
            if isinstance(lanes, SharedAccounts)
            else lanes.slot(priority, client=client, weight=weight, on_queued=on_queued))
    async with held as ticket:
        need = need.current()  # (the estimate learned while it waited for the slot)
        lane = (lanes.lane_for(ticket.account_name) if isinstance(lanes, SharedAccounts)
                else lanes)
        # An account held by a 429 this relay had not heard of when it won the slot
        # (another relay's): the request leaves it for another account (a move, L13).
        run_.account = ticket.account_name
        run_.record.account = ticket.account_name or None
        leave = run_.has_fallback or (isinstance(lanes, SharedAccounts) and bool(
            lanes.others(run_.avoid | {ticket.account_name})))
        deadline = ticket.queued_at + lane.profile.queue_timeout_s
        waited, held_by, kinds = await lane.tokens.take(need, deadline=deadline,
                                                        probe=probe, leave_if_held=leave)
        # SPEC L12a: its model's too, once this relay has heard of the model (its headers,
        # a 429 naming it, its configured figures): from then on what any relay sharing
        # the provider heard of it (a provider that sends no headers costs no second
        # call to the server).
        model = lane.model_tokens(need.scope)
        if model is not None:
            try:
                more, model_held, ticket.model_kinds = await model.take(
                    need, deadline=deadline, probe=probe, leave_if_held=leave)
            except BaseException:  # the account's share goes back: nothing started
                await _shielded(functools.partial(lane.tokens.settle, need, 0, 0, kinds),
                                lane)
                raise
            waited, held_by = waited + more, held_by or model_held
        ticket.reservation = Reservation(need, trio.current_time(), kinds=kinds)
        ticket.token_wait_s, ticket.held_by = waited, held_by
        run_.sink.on_limits = functools.partial(_shared_limits_seen, lane,
                                                ticket.reservation, run_.target.provider,
                                                lane.tokens.member_here(), need.scope)
        yield ticket


def _shared_limits_seen(lane: SharedLane, own: Reservation, provider: Provider,
                        member: str, scope: str, limits: RateLimits) -> None:
    """Move the shared budgets to an answer's headers (in the background): they are
    the answering model's (SPEC L12a; the provider's when it has no name), read against
    the grant of the answering request (its upstream start)."""
    said_unusable(provider, limits)
    began = trio.current_time() - own.at
    budget = lane.model_tokens(scope, create=bool(limits.windows)) or lane.tokens
    budget.seen_soon(limits, began_s_ago=began, member=member)


def _shared_seen(lane: SharedLane, scope: str, limits: RateLimits | None
                 ) -> list[tuple[SharedBudget, RateLimits | None]]:
    """Where an error answer's figures go on a shared lane: its windows to its model's
    budgets, its hold to its model's when the 429 named it, else to the provider's."""
    if limits is None:
        return [(lane.tokens, None)]
    model = lane.model_tokens(scope, create=bool(limits.windows) or limits.names_model)
    if model is None:
        return [(lane.tokens, limits)]
    if limits.names_model or not limits.hold_s:
        return [(model, limits)]
    return [(model, attrs.evolve(limits, hold_s=None)),
            (lane.tokens, RateLimits(hold_s=limits.hold_s, cause=limits.cause))]


async def _shielded(fn: Callable[[], Any], lane: SharedLane) -> None:
    """A call to the coordination server that must happen even when the request was
    cancelled: shielded, with the server's own deadline; a failure is logged."""
    # (noqa, ASYNC912: ``fn`` is a call to the server: it awaits its answer.)
    with trio.CancelScope(shield=True,  # noqa: ASYNC912
                          deadline=trio.current_time() + lane.tokens.command_timeout_s):
        try:
            await fn()
        except RelayError as exc:
            logger.warning("shared token budget of %s not updated: %s", lane.name,
                           exc.message)


def _limits_seen(lane: Lane, ticket: Ticket, provider: Provider, scope: str,
                 limits: RateLimits) -> None:
    """A 200's rate-limit headers for model ``scope`` at the ticket's account (an attempt
    begun after a hold began: it has lifted), read against the moment it started upstream
    (SPEC L12a, L13)."""
    said_unusable(provider, limits)
    own = ticket.reservation
    lane.observe(limits, scope=scope, started_at=own.at if own is not None else None,
                 ok=True, own=own, account=ticket.account)


def said_unusable(provider: Provider, limits: RateLimits | None) -> None:
    """Log a figure the provider sent that relay ignored (not finite, negative or
    unparseable: SPEC L12a), once per provider and header."""
    for figure in limits.ignored if limits is not None else ():
        header = figure.partition(":")[0]
        if header not in provider.ignored_figures:
            provider.ignored_figures.add(header)
            logger.warning("provider %s sent a figure relay cannot use, ignored: %s (not a "
                           "finite, non-negative number; said once per header)",
                           provider.name, figure)


def bound_error(exc: RelayError, provider: Provider, max_hold_s: float) -> None:
    """An error answer's figures as relay keeps them: unusable ones logged, and its
    Retry-After no longer than the hold it sets (SPEC L12a)."""
    said_unusable(provider, exc.limits)
    limits = exc.limits
    if limits is not None and limits.hold_s and exc.retry_after_s is not None:
        exc.retry_after_s = min(exc.retry_after_s,
                                bounded_hold(limits, max_hold_s, exc.reason)[0])


async def run(adapter: Adapter, lane: LaneLike, ticket: Ticket, run_: Run,
              record: Record) -> None:
    """``adapter.run`` for the attempt, with its limits observed and its reservation
    settled before the slot is given back."""
    count_wait(ticket, record)
    if isinstance(lane, SharedLane | SharedAccounts) and ticket.reservation is not None:
        await _run_shared(adapter, lane, ticket, run_, record)
        return
    if not isinstance(lane, Lane):
        await adapter.run(run_.call, run_.sink)
        return
    scope = scope_of(run_.call.model)
    run_.sink.on_limits = functools.partial(_limits_seen, lane, ticket,
                                            run_.target.provider, scope)
    try:
        await adapter.run(run_.call, run_.sink)
    except RelayError as exc:
        bound_error(exc, run_.target.provider, lane.profile.max_hold_s)
        # a hold stops the next start (on its account: SPEC L13)
        own = ticket.reservation
        lane.observe(exc.limits, reason=exc.reason, own=own, scope=scope,
                     started_at=own.at if own is not None else ticket.started_at,
                     account=ticket.account)
        settle(lane, ticket, run_, record, exc)
        raise
    finally:
        settle(lane, ticket, run_, record, None)  # (done already after an error)


async def _run_shared(adapter: Adapter, lanes: SharedLane | SharedAccounts, ticket: Ticket,
                      run_: Run, record: Record) -> None:
    """`run` on a shared lane (its account's, SPEC L13): the hold and the settlement go
    to the server; a hold said here leaves the account out of this relay's next choices,
    and the conversation's next turn prefers the account that answered it."""
    error: RelayError | None = None
    name = ticket.account_name
    lane = lanes.lane_for(name) if isinstance(lanes, SharedAccounts) else lanes
    try:
        await adapter.run(run_.call, run_.sink)
        if isinstance(lanes, SharedAccounts) and run_.sink.usage is not None:
            run_.target.provider.served(conversation(run_), name)
    except RelayError as exc:
        error = exc
        if isinstance(lanes, SharedAccounts):
            lanes.said(name, exc)
        bound_error(exc, run_.target.provider, lane.profile.max_hold_s)
        now = trio.current_time()
        grant = ticket.reservation  # (its upstream start: the answering grant, L12a)
        began = now - (grant.at if grant is not None else now)
        for budget, limits in _shared_seen(lane, scope_of(run_.call.model), exc.limits):
            await _shielded(functools.partial(budget.seen, limits, reason=exc.reason,
                                              began_s_ago=began,
                                              member=lane.tokens.member_here()), lane)
        raise
    finally:
        reservation = ticket.reservation
        if reservation is not None and not reservation.settled:
            used_in, used_out = used_of(run_, reservation, error)
            reservation.settled = True
            usage = run_.sink.usage
            reported = usage is not None and usage.prompt_tokens is not None
            learn(lane.tokens.learned, run_, error, reservation.need)
            note(record, reservation, used_in, used_out,
                 not reported and not (error is not None and used_in == used_out == 0))
            await _shielded(functools.partial(lane.tokens.settle, reservation.need,
                                              used_in, used_out, reservation.kinds), lane)
            model = lane.model_tokens(reservation.need.scope)
            if model is not None and ticket.model_kinds is not None:
                await _shielded(functools.partial(model.settle, reservation.need, used_in,
                                                  used_out, ticket.model_kinds), lane)


def used_of(run_: Run, reservation: Reservation, error: RelayError | None
            ) -> tuple[int, int]:
    """What the attempt used: the reported usage; nothing for an error answer; else what
    was sent and read, estimated."""
    usage = run_.sink.usage
    if usage is not None and usage.prompt_tokens is not None:
        counted = usage.prompt_tokens
        if skips_cache_reads(run_.target.provider):
            counted = max(0, counted - (usage.cache_read_tokens or 0))
        return counted, usage.completion_tokens or 0
    if error is not None and (error.upstream_status is not None
                              or error.reason == "upstream_unavailable"):
        return 0, 0
    return reservation.need.input, -(-run_.sink.read_chars // 4)


def note(record: Record, reservation: Reservation, used_in: int, used_out: int,
         estimated: bool) -> None:
    record.tokens_reserved = ((record.tokens_reserved or 0) + reservation.need.input
                              + reservation.need.output)
    record.tokens_used = (record.tokens_used or 0) + used_in + used_out
    record.tokens_estimated |= estimated


def settle(lane: Lane, ticket: Ticket, run_: Run, record: Record,
           error: RelayError | None) -> None:
    """Settle the attempt's reservation: to the usage the provider reported; else an
    error answer (a status, or nothing reached) used nothing; else relay's estimate of
    what was sent and read (a stopped request included), marked estimated."""
    reservation = ticket.reservation
    if reservation is None or reservation.settled:
        return
    usage = run_.sink.usage
    used_in, used_out = used_of(run_, reservation, error)
    reported = usage is not None and usage.prompt_tokens is not None
    learn(lane.budget.learned, run_, error, reservation.need)
    if error is None and usage is not None and len(lane.accounts) > 1:
        # SPEC L13: its conversation's next turn prefers the account that served it.
        run_.target.provider.served(conversation(run_), ticket.account_name)
    estimated = not reported and not (error is not None and used_in == used_out == 0)
    lane.settle(ticket, used_in, used_out)
    note(record, reservation, used_in, used_out, estimated)


def learn(learned: Learned, run_: Run, error: RelayError | None,
          need: Need | None = None) -> None:
    """A whole answer's reported length, for the next output reservations; and what it
    said of the provider's prompt cache, for the conversation's next turn."""
    usage = run_.sink.usage
    if error is not None or usage is None or usage.prompt_tokens is None:
        return
    if need is not None and skips_cache_reads(run_.target.provider):
        run_.target.provider.conversations.saw(
            conversation(run_), need.estimate, usage.prompt_tokens,
            (usage.cache_read_tokens or 0) + (usage.cache_write_tokens or 0))
    if usage.completion_tokens is not None and run_.sink.complete:
        learned.learn(run_.call.model, usage.completion_tokens)
        if need is not None and need.script:  # (the raw estimate, the whole prompt)
            provider = run_.target.provider
            provider.input_ratio.learn(run_.call.model, need.script, need.raw,
                                       usage.prompt_tokens, need.framing)


def count_wait(ticket: Ticket, record: Record) -> None:
    """The attempt's wait for tokens, and the hold that delayed it, into the record."""
    if ticket.reservation is not None or ticket.token_wait_s:
        record.token_wait_ms = round((record.token_wait_ms or 0.0)
                                     + ticket.token_wait_s * 1000, 3)
    if ticket.held_by is not None:
        record.held_by = ticket.held_by


def wait_out(dispatcher: Attempting, target: Target, error: RelayError | None,
             sent: Delivered) -> bool:
    """Whether a 429 that set a hold is waited out on the same target: the last target,
    nothing of the answer sent, and a stream whose headers are out (it was queued, or
    has had a heartbeat) — a client that has its 200 cannot be told 429 any more."""
    limits = error.limits if error is not None else None
    if (error is None or error.reason != "rate_limited" or limits is None or not limits.hold_s
            or sent.any or not dispatcher.stream or target is not dispatcher.plan.targets[-1]):
        return False
    record = dispatcher.record
    headers_out = (any(r.queued_at is not None for r in dispatcher.runs)
                   or trio.current_time() - record.started_at
                   >= dispatcher.heartbeat_s)
    if not headers_out or limits.hold_s > target.provider.config.profile.queue_timeout_s:
        return False
    logger.info("hold_waited_out request=%s target=%s: the provider said wait %g s; the "
                "request queues again behind its hold", record.id, target.name,
                limits.hold_s)
    return True
