"""Calls that answer whole — an embedding, a token count — through a provider's lane
(SPEC A6, A8).

Theory of operation. A chat request (`relay.engine.dispatch`) streams, falls back and
continues; these calls do none of that: one attempt is ::

    handle.use() ─▶ lane.slot(priority) ─▶ run-timeout scope ─▶ work(adapter) ─▶ result

and the caller gets the result or a `RelayError`. What they share with chat is
everything around the call: the adapter is held from before the queue until the slot is
back (a reload retires it only then), the priority queue and its capacity errors, the
route's attempt timeout and budget, the provider's run timeout, same-target retries
after a Retry-After that fits (SPEC F3, F4), the stop handle a drain cancels, and the
record (attempts, queue and run time, when the lane was given back).

Every stop is a cancelled scope: the client leaving cancels the request's nursery
around `run_whole`; a drain cancels the scope `RequestStop.open_scope` gives; a deadline
is a ``move_on_at`` around the attempt. An HTTP adapter's cleanup is leaving its
``async with client.stream`` (the upstream connection closes), so an attempt is over
when its scope is, and the lane slot goes back at once.

Only the primary target is tried: a fallback answers with another model's vectors,
which cannot be compared with the first model's, or with another tokenizer's count. A
route's fallbacks do not apply here (the front refuses a body's own ``fallbacks``).

A token count is a metadata call with its own rate limits upstream, sent by clients
(Claude Code) beside a running message; ``lane=False`` runs it outside the lane, so it
never waits behind a ten-minute answer, bounded by the same deadlines.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from relay.api.adapter import Adapter
from relay.capacity.lanes import Ticket
from relay.vocab.errors import RelayError
from relay.vocab.records import Attempt, Record

from .gate import Gate
from .plan import RETRY_ON, Plan, Target
from .stops import RequestStop

__all__ = ["run_whole"]

logger = logging.getLogger("relay.dispatch")  # beside the chat attempts' lines

T = TypeVar("T")


async def run_whole(plan: Plan, record: Record, stop: RequestStop, priority: str,
                    work: Callable[[Adapter], Awaitable[T]], *, lane: bool = True,
                    gate: Gate | None = None) -> T:
    """Run ``work`` on the plan's primary target and return what it returns.

    Args:
        plan: the resolved request; only its primary target is used.
        record: the request's record; attempts, queue and run times go into it.
        stop: the request's stop handle (a drain cancels it).
        priority: the lane priority (SPEC L8).
        work: the adapter call, given the adapter the attempt holds.
        lane: take a slot in the provider's lane (False: a metadata call, see above).
        gate: the client's gate (SPEC L14), passed before the lane.

    Raises:
        RelayError: the attempt's failure, ``shutting_down`` when a drain stopped it.
    """
    target = plan.targets[0]
    route = plan.route
    budget = route.total_budget_s() if route else None
    deadline = record.started_at + budget if budget is not None else math.inf
    with stop.open_scope():
        for attempt_no in range(1 + plan.retries):
            try:
                return await _attempt(plan, target, record, priority, work, lane, deadline,
                                      gate)
            except RelayError as exc:
                wait = exc.retry_after_s or 0.0
                if (exc.reason not in RETRY_ON or attempt_no == plan.retries
                        or wait > target.provider.config.profile.queue_timeout_s
                        or trio.current_time() + wait >= deadline):
                    raise
            await trio.sleep(wait)
    raise stop.error or RelayError("shutting_down", "the request was stopped before it "
                                   "finished", provider=target.provider.name)


async def _attempt(plan: Plan, target: Target, record: Record, priority: str,
                   work: Callable[[Adapter], Awaitable[T]], use_lane: bool,
                   budget_deadline: float, gate: Gate | None) -> T:
    provider = target.provider
    started = trio.current_time()
    attempt = Attempt(provider=provider.name, model=target.model, role=target.role,
                      started=started)
    record.attempts.append(attempt)
    own = plan.timeout_for(target)
    own_deadline = started + own if own is not None else math.inf
    queued_at: float | None = None
    ticket: Ticket | None = None
    ran: tuple[float, float] | None = None  # when work started and ended
    failure: str | None = "stopped"  # unless it ends otherwise: stopped from outside

    def queued() -> None:
        nonlocal queued_at
        queued_at = trio.current_time()

    try:
        with provider.handle.use() as adapter, trio.move_on_at(
                min(own_deadline, budget_deadline)) as bounded:
            slot: contextlib.AbstractAsyncContextManager[Ticket | None] = (
                provider.lane.slot(priority, on_queued=queued) if use_lane
                else contextlib.nullcontext(None))
            async with _passing(gate if use_lane else None, target, queued), slot as ticket:
                begun = trio.current_time()
                limit = provider.config.profile.run_timeout_s
                try:
                    with trio.move_on_at(begun + limit) as run_scope:
                        result = await work(adapter)
                finally:
                    ran = (begun, trio.current_time())
                if not run_scope.cancelled_caught:
                    failure = None
                    return result
                raise RelayError("run_timeout", f"provider {provider.name!r} did not finish "
                                 f"within its run timeout of {limit:g} s ([providers."
                                 f"{provider.name}.profile] run_timeout_s); it was stopped",
                                 provider=provider.name)
        assert bounded.cancelled_caught
        if own_deadline <= budget_deadline:
            raise RelayError("attempt_timeout", f"{target.name} did not answer within its "
                             f"attempt timeout of {own:g} s; it was stopped",
                             provider=provider.name)
        raise RelayError("budget_exhausted", f"route {plan.route.name if plan.route else ''!r}"
                         f" ran out of its budget while {target.name} was answering; it was "
                         "stopped", provider=provider.name)
    except RelayError as exc:
        failure = exc.reason
        raise
    except Exception as exc:
        logger.exception("adapter %s crashed on request %s", provider.name, record.id)
        failure = "internal_error"
        raise RelayError("internal_error", f"the {provider.config.adapter!r} adapter failed "
                         f"unexpectedly ({type(exc).__name__}); see relay's log for request "
                         f"{record.id}", provider=provider.name) from exc
    finally:
        _account(record, attempt, ticket, queued_at, ran, failure)


def _passing(gate: Gate | None, target: Target, queued: Callable[[], None]
             ) -> contextlib.AbstractAsyncContextManager[Any]:
    """The client's gate (SPEC L14), passed before the lane, within the lane's queue
    timeout; nothing without one."""
    if gate is None:
        return contextlib.nullcontext()
    timeout = target.provider.config.profile.queue_timeout_s
    return gate.enter(0, trio.current_time() + timeout, queued)


def _account(record: Record, attempt: Attempt, ticket: Ticket | None,
             queued_at: float | None, ran: tuple[float, float] | None,
             failure: str | None) -> None:
    """One attempt's times and outcome into the record (synchronous: it runs in a
    ``finally``, cancelled or not)."""
    now = trio.current_time()
    attempt.duration_ms = round((now - attempt.started) * 1000, 3)
    attempt.ok = failure is None
    attempt.failure = failure
    queue_s: float | None = None
    if ticket is not None:
        queue_s = ticket.queue_s
        attempt.released_at = ticket.released_at
    elif queued_at is not None:  # it waited and never got a slot: queue time all the same
        queue_s = now - queued_at
    if queue_s is not None:
        record.queue_ms = round((record.queue_ms or 0.0) + queue_s * 1000, 3)
    if ran is not None:
        record.run_ms = round((record.run_ms or 0.0) + (ran[1] - ran[0]) * 1000, 3)
    record.provider, record.model = attempt.provider, attempt.model
    logger.info("attempt_completed request=%s target=%s/%s role=%s ok=%s failure=%s "
                "duration_ms=%s", record.id, attempt.provider, attempt.model, attempt.role,
                str(attempt.ok).lower(), failure, attempt.duration_ms)
