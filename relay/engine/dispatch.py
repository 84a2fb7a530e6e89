"""Attempts: one request's targets, tried in order inside one time budget (SPEC F1-F8).

Theory of operation. A request resolves to a `Plan`: a route (or a bare target) gives an
ordered list of targets — the primary, then the fallbacks — each ``provider/model``, each
tried at most ``1 + retries`` times and never returned to once left (F3). The
`Dispatcher` runs the plan as one task of the request's nursery and starts every attempt
as a task of its own in that nursery::

    dispatcher ── attempt 1: lane.slot → run-timeout scope → adapter.run(call, sink)
               ├─ attempt 2 (a fallback): started while attempt 1 may still be cleaning up
               └─ … then Ended(error | None) to the writer, once the outcome is known

The dispatcher watches each attempt's deadlines itself — its own timeout, the route's
budget, the provider's run timeout, time to first token, stalls — and at the first to pass
it cancels the attempt, closes its sink (so a late result is never used, F5) and decides
at once: retry, fall back, or fail. A cancelled attempt's cleanup (an interrupt grace, a
kill) goes on beside the next attempt, holding its own lane until it ends; the request ends
only when every attempt has (its record's ``released_at`` is the last release).

What may fall back is decided by the error's reason (`FALLBACK_ON`, F2); what may be
retried on the same target by `RETRY_ON` (never after a timeout or a 4xx), and only
after a Retry-After that fits what bounds the request (F4). Once part of a streamed
answer has reached the client, the next attempt must continue from it (an assistant
prefill) on a provider that can (``prefill``); otherwise the stream ends with an in-band
error — never as a complete answer (F8); once every choice has its finish, a failure ends it.

Nothing is counted before it has happened: the sink counts an event as sent once the
writer has it (a hand-over a timeout cancels is not sent; the dispatcher lets a half-done
one settle before it reads what was); an attempt is recorded once the writer knows it
begins; queue time is recorded however the wait ended; lane notices are never dropped.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import trio

from relay.api import eager
from relay.vocab.errors import RelayError, untraced
from relay.vocab.events import AttemptStarted, Call, Ended
from relay.vocab.records import Attempt, Record

from . import metering
from .attempt import AttemptSink, Changes, Delivered, Run, check_response
from .engine import Engine
from .notices import LaneNotices
from .plan import FALLBACK_ON, RETRY_ON, Plan, Target, moves
from .stops import RequestStop

__all__ = ["Dispatcher"]

logger = logging.getLogger("relay.dispatch")

# --- the dispatcher -------------------------------------------------------------------------

class Dispatcher:
    def __init__(self, relay: Engine, plan: Plan, call: Call, priority: str,
                 record: Record, stop: RequestStop, stream: bool, *,
                 client_weight: float = 1.0, avoid: frozenset[str] = frozenset()) -> None:
        self.relay, self.plan, self.base_call, self.priority = relay, plan, call, priority
        # SPEC L14: whose request it is (the record's client), and its weight in turns
        # inside a priority class of a lane's queue ("default": relay without [clients]).
        self.client, self.client_weight = record.client, client_weight
        self.record, self.stop, self.stream = record, stop, stream
        self.avoid = avoid  # SPEC L13: accounts it must not use (a check of one account)
        self.runs: list[Run] = []
        self.notices: LaneNotices | None = None  # made when it runs (it needs the nursery)

    @property
    def heartbeat_s(self) -> float:
        return self.relay.config.server.heartbeat_s

    async def run(self, nursery: trio.Nursery, out: trio.MemorySendChannel[Any]) -> None:
        """Try the plan's targets; send the writer its events and, last, `Ended`."""
        self.notices = LaneNotices(nursery, out)
        try:
            with self.stop.open_scope():
                error = await self._try_all(nursery, out)
                await eager.send(out, Ended(error))
                return
            # Stopped from outside (a drain): stop every attempt; the writer still
            # reports it, and the request ends when their cleanups have.
            for run in self.runs:
                run.sink.closed = True
                run.scope.cancel()
                LaneNotices.drop(run)
            await eager.send(out, Ended(self.stop.error))
        finally:
            out.close()  # (synchronous: no trip through the scheduler at the end)

    async def _try_all(self, nursery: trio.Nursery,
                       out: trio.MemorySendChannel[Any]) -> RelayError | None:
        route = self.plan.route
        budget = route.total_budget_s() if route else None
        deadline = self.record.started_at + budget if budget is not None else math.inf
        original: RelayError | None = None   # the failure that broke a streamed answer
        last: RelayError | None = None
        sent = Delivered()                   # what has reached the client so far
        for target in self.plan.targets:
            call = self._call_for(target, sent)
            if call is None:                 # cannot continue the text already sent
                self._skip(target, RelayError(
                    "unsupported", f"{target.name} cannot continue a partly sent answer "
                    "(its provider has prefill off)", provider=target.provider.name))
                continue
            try:
                admitted = target.provider.adapter.admit(call)  # the field policy (A1a)
            except RelayError as exc:        # skipped, recorded as unsupported (F2)
                self._skip(target, exc)
                last = last or untraced(exc)
                continue
            call = admitted.call
            for attempt_no in range(1 + self.plan.retries):
                if trio.current_time() >= deadline:
                    return self._final(RelayError(
                        "budget_exhausted", f"route {route.name if route else ''!r} used "
                        f"its whole budget of {budget:g} s before {target.name} could be "
                        "tried", provider=target.provider.name,
                        action=self.plan.timeout_action("budget_exhausted", target)), original)
                # The writer hears of the attempt first; only then is it counted (the
                # record, the log): a request stopped before it began shows no attempt.
                await eager.send(out, AttemptStarted(target.name, sent.any, admitted.ignored))
                self._note_fallback(target, attempt_no, last)
                run = await self._attempt_on(nursery, out, target, call, sent, deadline,
                                             admitted.ignored)
                if run.error is None:
                    return None
                last = run.error
                if sent.any and original is None:
                    original = run.error
                if run.error.reason not in RETRY_ON or attempt_no == self.plan.retries:
                    break
                wait = run.error.retry_after_s or 0.0
                if not self._retry_fits(target, wait, deadline):
                    logger.info("retry_skipped request=%s target=%s: its Retry-After of "
                                "%g s does not fit what bounds the request",
                                self.record.id, target.name, wait)
                    break                     # fall back at once, or fail with it
                if (retry := self._call_for(target, sent)) is None:
                    break
                call = attrs.evolve(retry, params=call.params, inbound=call.inbound)
                await trio.sleep(wait)
            assert last is not None
            if last.reason not in FALLBACK_ON:
                break
        return self._final(last, original)

    def _note_fallback(self, target: Target, attempt_no: int, last: RelayError | None
                       ) -> None:
        if self.record.attempts:
            self.record.fallback_triggered |= target.role == "fallback"
            if attempt_no == 0 and target.role == "fallback":
                previous = self.record.attempts[-1]
                logger.info("fallback_triggered request=%s from=%s/%s to=%s reason=%s",
                            self.record.id, previous.provider, previous.model, target.name,
                            last.reason if last else None)

    def _retry_fits(self, target: Target, wait: float, deadline: float) -> bool:
        """F4: the wait before a retry is time spent waiting for the provider, so it must
        fit inside what bounds the request — the route's budget, and the provider's own
        longest wait (``queue_timeout_s``), which bounds it when the route sets no
        timeouts. A wait that does not fit is not slept: the error (and its Retry-After)
        goes to the next target or to the client."""
        if wait > target.provider.config.profile.queue_timeout_s:
            return False
        return trio.current_time() + wait < deadline

    def _call_for(self, target: Target, sent: Delivered) -> Call | None:
        """The call for ``target``: the request as sent, or — when part of a streamed
        answer has reached the client — continued from it, if the provider can."""
        base = attrs.evolve(self.base_call, provider=target.provider.name, model=target.model)
        if not sent.any:
            return base
        if sent.other_output or not target.provider.config.prefill or not sent.text:
            return None
        return attrs.evolve(base, messages=[*base.messages,
                                            {"role": "assistant", "content": sent.text}])

    def _skip(self, target: Target, exc: RelayError) -> None:
        now = trio.current_time()
        self.record.attempts.append(Attempt(
            provider=target.provider.name, model=target.model, role=target.role, ok=False,
            started=now, duration_ms=0.0, failure="unsupported"))
        logger.info("attempt_completed request=%s target=%s role=%s ok=false "
                    "failure=unsupported (%s)", self.record.id, target.name, target.role,
                    exc.message)

    def _final(self, error: RelayError | None, original: RelayError | None) -> RelayError | None:
        if error is None:
            return None
        # A continuation the fallback refused: the client sees the failure that mattered.
        if original is not None and error is not original and error.reason not in FALLBACK_ON:
            error = original
        tried = self.record.attempts
        if len(tried) > 1:
            summary = "; ".join(f"{a.role} {a.provider}/{a.model}"
                                + (f" (account {a.account})" if a.account else "")
                                + f": {a.failure or 'ok'}" for a in tried)
            error = error.with_message(f"{error.message} (attempts: {summary})")
        return error

    async def _attempt_on(self, nursery: trio.Nursery, out: trio.MemorySendChannel[Any],
                          target: Target, call: Call, sent: Delivered, deadline: float,
                          ignored: tuple[str, ...]) -> Run:
        """An attempt on ``target``; a failure of its account's moves to another account
        of the provider at once (SPEC L13: a same-target retry, F3) while one is left and
        time is; a 429 that set a hold is waited out once when it must be (L12)."""
        run = await self._attempt(nursery, out, target, call, sent, deadline, self.avoid)
        while (avoid := moves(target, run.error, run.account, run.avoid, deadline,
                              self.record.id)) is not None:
            if (moved := self._call_for(target, sent)) is None:
                break
            call = attrs.evolve(moved, params=call.params, inbound=call.inbound)
            await eager.send(out, AttemptStarted(target.name, sent.any, ignored))
            run = await self._attempt(nursery, out, target, call, sent, deadline, avoid)
        if metering.wait_out(self, target, run.error, sent):  # (once: L12)
            await eager.send(out, AttemptStarted(target.name, False, ignored))
            run = await self._attempt(nursery, out, target, call, sent, deadline, run.avoid)
        return run

    async def _attempt(self, nursery: trio.Nursery, out: trio.MemorySendChannel[Any],
                       target: Target, call: Call, sent: Delivered,
                       budget_deadline: float, avoid: frozenset[str] = frozenset()) -> Run:
        now = trio.current_time()
        record = Attempt(provider=target.provider.name, model=target.model, role=target.role,
                         started=now)
        self.record.attempts.append(record)
        self.record.provider, self.record.model = target.provider.name, target.model
        sink = AttemptSink(out, wake=(changes := Changes()).poke)  # shared: not a cycle
        sink.pieces, sink.other_output = [sent.text], sent.other_output
        run = Run(target, call, sink, record, changes, avoid=avoid)
        self.runs.append(run)
        target.provider.track(run, self.record, self.priority)  # listed in the status
        own = self.plan.timeout_for(target)
        own_deadline = now + own if own is not None else math.inf
        nursery.start_soon(self._run_attempt, run)

        while run.finished_at is None:
            when, reason = self._next_limit(run, sink, own_deadline, budget_deadline)
            changed = run.changed
            if when == math.inf:  # nothing bounds it yet (it waits for its lane slot)
                await changed.wait()
            else:
                with trio.move_on_at(when):
                    await changed.wait()
            if run.finished_at is None and trio.current_time() >= when and self._expired(
                    run, reason):
                run.left = True
                run.error = self.plan.timeout_error(reason, run.target, own)
                run.record.failure = run.error.reason
                run.stopped_at = when
                run.scope.cancel()          # its cleanup goes on beside what comes next
                sink.closed = True
                LaneNotices.drop(run)
                # A hand-over the cancel caught half done completes or is void within a
                # tick; only then is it known what reached the client.
                await sink.settle()
                break
        if (run.error is not None and self.stream and sink.complete
                and run.record.failure != "stopped"):
            # The client already has the whole answer and its finish; what failed is the
            # tail (usage, [DONE], the connection's end). Continuing it, or an error after
            # a finish, would break an answer that is complete: it ends here.
            self._accept(run)
        if self.stream:  # a plain answer reaches the client only at the end
            sent.text, sent.other_output = sink.text, sink.other_output
        self._log(run)
        # SPEC H5: real traffic keeps the state honest (its account's too: L13)
        target.provider.observe(run.error, run.account)
        return run

    def _next_limit(self, run: Run, sink: AttemptSink, own_deadline: float,
                    budget_deadline: float) -> tuple[float, str]:
        """The attempt's nearest deadline, and its reason. Token limits need tokens: they
        apply to streamed answers only (a plain answer's first token is its last)."""
        limits = [(own_deadline, "attempt_timeout"), (budget_deadline, "budget_exhausted"),
                  (run.run_deadline, "run_timeout")]
        route = self.plan.route
        if route is not None and run.running_since is not None and self.stream:
            if route.first_token_timeout_s is not None and sink.first_token_at is None:
                limits.append((run.running_since + route.first_token_timeout_s,
                               "first_token_timeout"))
            # No stall while relay waits for the client: the sink wakes us after.
            if (route.stall_timeout_s is not None and sink.last_token_at is not None
                    and not sink.blocked):
                limits.append((sink.last_token_at + route.stall_timeout_s, "stall_timeout"))
        return min(limits)

    def _accept(self, run: Run) -> None:
        assert run.error is not None
        logger.info("attempt_answered request=%s target=%s: the client had the whole answer "
                    "and its finish before %s (%s); the answer ends there", self.record.id,
                    run.target.name, run.error.reason, run.error.message)
        run.left = True
        run.error = None
        run.record.ok, run.record.failure = True, None

    def _expired(self, run: Run, reason: str) -> bool:
        # Progress may have pushed a stall deadline on while we slept, or the sink may
        # be waiting for the client: look again.
        if reason == "stall_timeout":
            route = self.plan.route
            last = run.sink.last_token_at
            assert route is not None and route.stall_timeout_s is not None
            return (last is not None and not run.sink.blocked
                    and trio.current_time() >= last + route.stall_timeout_s)
        return True

    async def _run_attempt(self, run: Run) -> None:
        """One attempt's task: lane slot, run-timeout scope, adapter. Its outcome is
        written into ``run``; the dispatcher may have moved on long before it ends."""
        # long because the nesting is the invariant: handle, lane slot, adapter scope, then
        # the release and the outcome, read in one place (SPEC L6, C4).
        provider = run.target.provider
        notices = self.notices
        assert notices is not None
        ticket = None
        error: RelayError | None = None
        finished = False  # False at the end: it was stopped (request gone, drain, timeout)
        try:
            # The attempt holds its adapter from before it queues until its lane slot is
            # back: a reload that retires the adapter closes it only after that.
            handle = provider.handle
            with run.scope, handle.use():
                gate = self.relay.clients.gate(self.client)  # SPEC L14: its gate first
                async with gate.enter_call(run.call, provider.config.profile.queue_timeout_s,
                                           lambda: notices.queued(run, gate.statistics),
                                           self.record, lambda: run.sink.usage), \
                        metering.slot(self, run, lambda: notices.queued(run)) as ticket:
                    notices.drop(run)  # it waits no more
                    # SPEC L13: the account its slot is on runs it, with that one's adapter.
                    run.account = ticket.account_name
                    run.record.account = self.record.account = ticket.account_name or None
                    adapter = handle.for_account(ticket.account_name)
                    self.record.queue_ms = round((self.record.queue_ms or 0.0)
                                                 + ticket.queue_s * 1000, 3)
                    # The run timeout is one of the deadlines the dispatcher watches: at
                    # it, the dispatcher names the failure and cancels ``run.scope``.
                    run.run_deadline = (trio.current_time()
                                        + provider.config.profile.run_timeout_s)
                    await notices.started(run)
                    run.running_since = trio.current_time()
                    run.poke()
                    await metering.run(adapter, provider.lane, ticket, run, self.record)
                    if not run.sink.complete:
                        raise RelayError("stream_cut", f"provider {provider.name!r} ended "
                                         "its answer before it was complete",
                                         provider=provider.name)
                    check_response(run, self.stream)
                    finished = True
        except RelayError as exc:
            error = untraced(exc)  # kept as data: a traceback would hold this frame
        except Exception as exc:
            logger.exception("adapter %s crashed on request %s", provider.name,
                             self.record.id)
            error = RelayError("internal_error", f"the {provider.config.adapter!r} adapter "
                               f"failed unexpectedly ({type(exc).__name__}); see relay's log "
                               f"for request {self.record.id}", provider=provider.name)
        finally:
            now = trio.current_time()
            LaneNotices.drop(run)
            attempt = run.record
            attempt.duration_ms = round((now - attempt.started) * 1000, 3)
            if ticket is None and run.queued_at is not None:
                # It waited and never got a slot (a queue timeout, its own timeout, the
                # client gone): that wait is queue time all the same (seed 000).
                self.record.queue_ms = round((self.record.queue_ms or 0.0)
                                             + (now - run.queued_at) * 1000, 3)
            if ticket is not None and ticket.released_at is not None:
                attempt.released_at = ticket.released_at
                attempt.lease_expired = ticket.lease_expired  # a shared slot (SPEC L11)
                if ticket.started_at is not None:  # summed over the attempts
                    self.record.run_ms = round((self.record.run_ms or 0.0) + (
                        ticket.released_at - ticket.started_at) * 1000, 3)
            if not run.left:        # the dispatcher has not decided for it
                if error is None and not finished:
                    # Stopped from outside: the client left, or a drain. Not a failure of
                    # the provider's: the record says "stopped".
                    run.error = self.stop.error or RelayError(
                        "shutting_down", "the request was stopped before it finished",
                        provider=provider.name)
                    attempt.failure = "stopped"
                else:
                    run.error = error
                    attempt.failure = error.reason if error else None
                attempt.ok = run.error is None
            run.sink.closed = True
            run.finished_at = now
            run.poke()

    def _log(self, run: Run) -> None:
        a = run.record
        logger.info("attempt_completed request=%s target=%s role=%s ok=%s failure=%s "
                    "duration_ms=%s", self.record.id, run.target.name, a.role,
                    str(run.error is None).lower(), run.error.reason if run.error else None,
                    round((trio.current_time() - a.started) * 1000, 1))
