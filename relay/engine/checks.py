"""Connection checks and provider state (SPEC H1-H4, L7).

A check is a real request: a short prompt ("reply with ok") through the whole path —
queue, lane, adapter — queued as ``interactive`` (so it waits at the head of the queue
but never stops running work) and bounded by the provider's own profile. It is recorded
like any request (route ``(check)``).

What a check's outcome does to the provider's state (seed 000: a failed check once erased
a working connection, and every capacity error told the user to check again):

    answered                          → connected; the model list refreshed
    quota notice, rate limit          → connected, with a warning; models kept
    capacity (queue full or timeout)  → nothing changes: busy is not broken
    timeouts, cut answers             → nothing changes but the warning: slow is not broken
    auth, unreachable, not installed,
    refused, broken answers           → failing, with the reason and what to do

`serve_checks` runs the optional checks — at start-up (``[server] check_on_start``) and
every ``check_interval_s`` per provider — and never while all of a provider's lanes are
busy, while the provider's previous check still runs, or while relay drains (a check
asked for then is answered ``busy``/``shutting_down`` without running). Each check has
its own record id, and a check cancelled from outside is recorded ``shutting_down``.
"""

from __future__ import annotations

import logging
import math
import secrets
from typing import Any

import attrs
import trio

from relay.capacity.lanes import Lane
from relay.engine.dispatch import Dispatcher
from relay.engine.engine import Engine
from relay.engine.plan import Plan, Target
from relay.engine.providers import Provider
from relay.engine.stops import RequestStop
from relay.vocab.errors import RelayError
from relay.vocab.events import Call, Delta, Ended
from relay.vocab.records import Record

__all__ = ["CHECK_PROMPT", "CheckResult", "check_provider", "serve_checks"]

logger = logging.getLogger(__name__)

CHECK_PROMPT = "This is a connection check. Reply with the single word: ok"
_CONNECTED_WITH_WARNING = frozenset({"quota_exhausted", "rate_limited"})
_FAILING = frozenset({
    "auth_required", "upstream_unavailable", "upstream_error", "bad_upstream_response",
    "rejected", "unsupported", "context_too_long", "internal_error", "unknown_model",
    "invalid_request",
})
BUSY_RETRY_S = 30.0  # a scheduled check skipped because the lanes are busy: try again then


@attrs.frozen
class CheckResult:
    provider: str
    ok: bool
    outcome: str  # answered | busy | failed
    reason: str | None
    message: str
    answer: str | None
    duration_ms: float

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _check_model(provider: Provider) -> str:
    if provider.config.check_model:
        return provider.config.check_model
    if provider.models:
        return provider.models[0]
    return "default"


async def check_provider(relay: Engine, provider: Provider) -> CheckResult:
    """Run one connection check and apply its outcome to the provider's state. A
    provider with several accounts (SPEC L13) is checked on each, one after the other: an
    account that answers comes back into the choice, one that fails leaves it, and the
    provider is connected while one answers."""
    started = trio.current_time()
    if not provider.models and not provider.config.check_model:
        try:
            with trio.move_on_after(10):
                provider.models = await provider.list_models()
        except RelayError as exc:
            return _apply(provider, started, None, exc)
    lane = provider.lane
    accounts = [a.name for a in lane.accounts] if isinstance(lane, Lane) else []
    if len(accounts) < 2:
        text, error = await _check_once(relay, provider, frozenset(), "")
        if error is None:
            with trio.move_on_after(10):
                await provider.refresh_models(force=True)
        return _apply(provider, started, text, error)
    outcomes = []
    for name in accounts:
        outcomes.append((name, *await _check_once(relay, provider,
                                                  frozenset(accounts) - {name}, name)))
    said = "; ".join(f"account {name}: " + ("answered" if error is None else
                                            f"{error.reason} ({error.message})")
                     for name, _, error in outcomes)
    answered = [(text, error) for _, text, error in outcomes if error is None]
    if answered:
        with trio.move_on_after(10):
            await provider.refresh_models(force=True)
        result = _apply(provider, started, answered[0][0], None)
        failed = [name for name, _, error in outcomes if error is not None]
        provider.warning = (f"{said} — the accounts that answered serve"
                            if failed else None)
        return attrs.evolve(result, message=f"{result.message}: {said}")
    result = _apply(provider, started, None, outcomes[0][2])
    return attrs.evolve(result, message=said)


async def _check_once(relay: Engine, provider: Provider, avoid: frozenset[str],
                      account: str) -> tuple[str | None, RelayError | None]:
    """One check request through the whole path (``avoid``: the accounts it must not
    use); its record written; its answer's text, or its error."""
    # long because a check is one pass through the whole path (model, plan, dispatcher,
    # record) and reads best in that order.
    started = trio.current_time()
    model = _check_model(provider)
    # A unique id: two checks of one provider can start in the same millisecond (a
    # scheduled one and one asked for), and ids built from the time collided.
    suffix = f"-{account}" if account else ""
    record = Record(id=f"check-{provider.name}{suffix}-{secrets.token_hex(6)}",
                    started_at=started, route="(check)", provider=provider.name,
                    model=model, priority="interactive")
    if relay.draining:
        # No new work while relay drains: the drain has stopped (or is about to stop)
        # what it tracks, and a check tracked after that would run unstopped.
        refused = RelayError("shutting_down", "relay is shutting down; the check was not "
                             "run", retry_after_s=5.0)
        record.status, record.reason, record.phase = (refused.status, refused.reason,
                                                      refused.phase)
        relay.records.write(record)
        await trio.lowlevel.checkpoint()
        return None, refused
    call = Call(request_id=record.id, provider=provider.name, model=model,
                messages=[{"role": "user", "content": CHECK_PROMPT}], stream=False)
    plan = Plan([Target(provider, model, "primary")])
    stop = RequestStop()
    out, events = trio.open_memory_channel[Any](64)
    dispatcher = Dispatcher(relay, plan, call, "interactive", record, stop, stream=False,
                            avoid=avoid)
    text = ""
    error: RelayError | None = None
    ended = False
    relay.track(stop)  # no await since the draining test above: a drain will stop it
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dispatcher.run, nursery, out)
            async with events:
                async for event in events:
                    if isinstance(event, Delta) and event.content:
                        text += event.content
                    elif isinstance(event, Ended):
                        error = event.error
                        ended = True
    finally:
        relay.untrack(stop)
        if error is not None:
            record.status, record.reason, record.phase = error.status, error.reason, error.phase
        elif not ended:
            # Cancelled from outside (relay closing): never recorded as answered.
            record.status, record.reason, record.phase = 503, "shutting_down", "shutdown"
            if record.stop_requested_at is None:
                record.stop_requested_at = trio.current_time()
        releases = [a.released_at for a in record.attempts if a.released_at is not None]
        record.released_at = max(releases) if releases else None
        relay.records.write(record)
    return text, error


def _apply(provider: Provider, started: float, text: str | None,
           error: RelayError | None) -> CheckResult:
    now = trio.current_time()
    duration = round((now - started) * 1000, 1)
    if error is None:
        provider.state, provider.state_reason, provider.warning = "connected", None, None
        provider.checked_at = now
        return CheckResult(provider.name, True, "answered", None,
                           f"answered in {duration / 1000:.1f} s", text, duration)
    said = error.message + (f" — {error.action}" if error.action and error.action not in
                            error.message else "")
    if error.phase == "capacity" or error.reason == "shutting_down":
        # Busy is not broken (H2): the verified state and the models stay as they were.
        return CheckResult(provider.name, False, "busy", error.reason, error.message, None,
                           duration)
    provider.checked_at = now
    if error.reason in _CONNECTED_WITH_WARNING:
        provider.state, provider.state_reason = "connected", None   # H3
        provider.warning = said
        return CheckResult(provider.name, True, "answered", error.reason, said, None,
                           duration)
    if error.reason in _FAILING:
        provider.state, provider.state_reason, provider.warning = "failing", error.reason, said
        return CheckResult(provider.name, False, "failed", error.reason, said, None, duration)
    provider.warning = f"the last check did not complete: {said}"   # slow is not broken
    return CheckResult(provider.name, False, "failed", error.reason, said, None, duration)


async def serve_checks(relay: Engine) -> None:
    """The optional checks: at start-up and every ``check_interval_s``; runs until
    cancelled. A provider whose lanes are all busy is skipped and tried again later; none
    starts while relay drains.

    The next check of a provider is due ``check_interval_s`` after its last one started,
    and never while that one still runs: a check slower than its interval is followed by
    the next one ``check_interval_s`` after it ended. (An overdue check used to leave
    the loop waking at once — 55,000 times a second — until the running one ended.)
    """
    due: dict[str, float] = {}
    start = trio.current_time()
    running: dict[str, trio.Event] = {}  # provider → set when its check has ended
    while True:
        now = trio.current_time()
        for name, provider in relay.providers.items():
            interval = provider.config.check_interval_s
            if name not in due:
                if relay.config.server.check_on_start or interval is not None:
                    due[name] = start if now - start < 1.0 else now
                elif interval is None:
                    continue
            if name in running or now < due.get(name, math.inf) or relay.draining:
                continue
            stats = provider.lane.statistics()
            if stats.running >= stats.capacity:
                due[name] = now + min(BUSY_RETRY_S, interval or BUSY_RETRY_S)
                continue
            due[name] = now + interval if interval is not None else math.inf
            running[name] = trio.Event()
            relay.nursery.start_soon(_scheduled_check, relay, provider, running, due)
        for name in list(due):
            if name not in relay.providers:
                del due[name]
        # A running check's due time counts only once it has ended (its event wakes us).
        wake = min((t for name, t in due.items() if name not in running), default=math.inf)
        if relay.draining:
            wake = math.inf
        await _wait_for_change(relay, [*running.values()],
                               min(wake, trio.current_time() + 60.0))


async def _wait_for_change(relay: Engine, ended: list[trio.Event], deadline: float) -> None:
    """Until ``deadline``, a reload, or the end of one of the running checks."""
    with trio.move_on_at(deadline):
        async with trio.open_nursery() as nursery:
            async def first(event: trio.Event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(first, relay.reloaded)
            for event in ended:
                nursery.start_soon(first, event)


async def _scheduled_check(relay: Engine, provider: Provider, running: dict[str, trio.Event],
                           due: dict[str, float]) -> None:
    try:
        interval = provider.config.check_interval_s
        # SPEC L11: one relay runs a shared provider's interval check per interval.
        if interval is not None and not await provider.lane.claim_check(interval):
            logger.debug("check %s: skipped, another relay runs it this interval",
                         provider.name)
            return
        result = await check_provider(relay, provider)
        logger.info("check %s: %s (%s)", provider.name, result.outcome, result.message)
    except Exception:
        logger.exception("the scheduled check of %s crashed", provider.name)
    finally:
        now = trio.current_time()
        interval = provider.config.check_interval_s
        if interval is not None and due.get(provider.name, math.inf) < now:
            due[provider.name] = now + interval   # it ran past its next start: not at once
        ended = running.pop(provider.name, None)
        if ended is not None:
            ended.set()
