"""One chat request, in any dialect: parse, plan, run, write, record.

A chat request's life, inside one nursery per request::

    request task ── writer: turns events into SSE or one JSON body; heartbeats; notices
     ├─ (the client leaving → cancel the request's nursery: a call from relay's server,
     │   or a watcher task on ASGI receive() under another server)
     └─ dispatcher: attempts, each lane.slot(priority) → adapter.run(call, sink)
                    └─ sends Delta/Finish/Usage … then Ended(error | None), last

The request's task is the one writer — the only code that calls ``send`` (DESIGN).
Every stop is a cancelled scope: the client leaving cancels the nursery; the attempt's
deadlines (its own timeout, the budget, the provider's run timeout, first token, stall)
are watched by the dispatcher, which cancels that attempt's scope; a drain cancels the
request's stop scope and the writer still reports ``shutting_down``. ``Ended`` comes only
once the outcome is known; the request ends only when every attempt's lane is given back
(SPEC L6, C4). A channel that closes without ``Ended`` is an internal error, never a
silent end. No cancel scope or nursery spans a ``yield`` anywhere here.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from relay.capacity.lanes import PRIORITIES
from relay.config import ClientConfig
from relay.dialects.base import ChatInput
from relay.engine.clients import price_for
from relay.engine.dispatch import Dispatcher
from relay.engine.plan import Plan, Target, make_plan
from relay.engine.stops import RequestStop
from relay.vocab.errors import RelayError
from relay.vocab.events import Call, Inbound

from .asgi import header
from .exchange import Exchange
from .info import forbidden_model
from .writers import JSONWriter, StreamWriter

__all__ = ["CHANNEL_SIZE", "Chat", "plan_for", "priority_of", "reserve_cost"]

CHANNEL_SIZE = 64


def priority_of(exchange: Exchange) -> str:
    """The request's priority (SPEC L8, L14): a configured client's default class, which
    ``X-Relay-Priority`` may lower, never raise (a higher one is the client's own);
    without ``[clients]``, the header's, as before (default ``normal``)."""
    client = exchange.relay.config.clients.get(exchange.client)
    asked = header(exchange.scope, b"x-relay-priority")
    priority = client.priority if client is not None else "normal"
    if asked is not None:
        asked = asked.strip().lower()
        if asked not in PRIORITIES:
            raise RelayError("invalid_request", f"X-Relay-Priority must be one of "
                             f"{', '.join(PRIORITIES)}, not {asked!r}")
        if client is None or PRIORITIES[asked] > PRIORITIES[priority]:
            priority = asked
    exchange.record.priority = priority
    return priority


def plan_for(exchange: Exchange, model: str, fallbacks: Any, *, costs: bool = True) -> Plan:
    """The request's plan, for its client (SPEC L14): every model it names (the body's
    ``fallbacks`` too) must be one its client may use (``forbidden_model`` 403); under a
    dollar limit every target must have a known price (`unpriced_under_limit`; ``costs``
    False: a request that costs nothing, a token count); and its per-day and per-month
    limits must not be spent (``client_limit`` 429) — before anything is queued."""
    clients = exchange.relay.clients
    client = clients.client(exchange.client)
    names = [model, *(f for f in fallbacks if isinstance(f, str))] if isinstance(
        fallbacks, list) else [model]
    refused = [name for name in names if not client.may_use(name)]
    if refused:
        raise forbidden_model(client, refused)
    plan = make_plan(exchange.relay, model, fallbacks)
    if costs and (client.usd_per_day or client.usd_per_month):
        unpriced = [t for t in plan.targets if price_for(t.provider.config, t.model) is None]
        if unpriced:
            raise unpriced_under_limit(client, unpriced)
    clients.admit(client, exchange.record.id, None)
    return plan


def unpriced_under_limit(client: ClientConfig, targets: list[Target]) -> RelayError:
    """403 ``forbidden_model``: a client with a dollar limit names a model whose price
    relay does not know. Its cost would be ``null`` (SPEC O7: never a guess), so it could
    not count against the limit; a limit that lets such requests through unbounded would
    mean nothing, and one that guessed a price would refuse or admit at random. The
    client is told which model, and how to give it a price."""
    limits = ", ".join(f"{key} ${getattr(client, key):g}" for key in (
        "usd_per_day", "usd_per_month") if getattr(client, key))
    names = ", ".join(repr(t.name) for t in targets)
    first = targets[0]
    return RelayError(
        "forbidden_model", f"client {client.name!r} has a dollar limit ({limits}) and relay "
        f"knows no price for {names}, so its cost could not count against the limit; "
        "relay refuses it rather than let it through uncounted", param="model",
        action=f"give the model a price (US dollars per million tokens): "
               f"[providers.{first.provider.name}.prices.\"{first.model}\"] input = …, "
               f"output = … (cached_input, cache_write too); or name a priced model; or "
               f"remove the dollar limits of [clients.{client.name}]")


def reserve_cost(exchange: Exchange, target: Target, call: Call) -> None:
    """Reserve the call's estimated cost against its client's dollar limits (SPEC O7);
    the request's record settles it to the real cost."""
    clients = exchange.relay.clients
    client = clients.client(exchange.client)
    if not (client.usd_per_day or client.usd_per_month):
        return
    budget = getattr(target.provider.lane, "budget", None)
    learned = budget.learned.output(call.model) if budget is not None else None
    clients.reserve_more(client, exchange.record.id,
                         clients.estimate_usd(target.provider.config, call, learned))


def inbound_of(exchange: Exchange, inbound: Inbound) -> Inbound:
    """The client's request with the headers its dialect passes to a provider that speaks
    it (``anthropic-version``, ``anthropic-beta``: SPEC A6)."""
    names: tuple[str, ...] = getattr(exchange.dialect, "passed_headers", ())
    headers = {n: v for n in names if (v := header(exchange.scope, n.encode())) is not None}
    session = next((v for n in SESSION_HEADERS
                    if (v := header(exchange.scope, n)) is not None and v), None)
    if session is not None:
        inbound = attrs.evolve(inbound, session=session[:256])
    return attrs.evolve(inbound, headers=headers) if headers else inbound


# SPEC L13: the headers a client names its conversation by (relay's own, then Codex's and
# Claude Code's), for a conversation's account; never sent upstream.
SESSION_HEADERS = (b"x-relay-session", b"session_id", b"x-claude-code-session-id",
                   b"conversation_id")


def prompt_chars(messages: list[dict[str, Any]]) -> int:
    """The conversation's size in characters, for a usage estimate (SPEC A1a)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(p.get("text") or "")) for p in content if isinstance(p, dict))
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                total += len(str(function.get("arguments") or ""))
    return total


def refuse_when_draining(exchange: Exchange) -> None:
    if exchange.relay.draining:
        raise RelayError("shutting_down", "relay is shutting down and takes no new "
                         "requests; retry when it is back", retry_after_s=5.0)


@attrs.define(eq=False)
class Chat:
    """The `Handler` of a chat request in any dialect: one plan, one dispatcher, one
    writer."""

    call: Call | None = None
    plan: Plan | None = None
    priority: str = "normal"
    dispatcher: Dispatcher | None = None

    def parse(self, exchange: Exchange, body: bytes) -> ChatInput:
        """The request in relay's terms (a dialect whose path says more overrides it)."""
        return exchange.dialect.parse(body)

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        record = exchange.record
        self.priority = priority_of(exchange)
        chat = self.parse(exchange, body)
        record.requested_model = chat.model
        record.stream = chat.stream
        refuse_when_draining(exchange)
        plan = plan_for(exchange, chat.model, chat.fallbacks)
        primary = plan.targets[0]
        record.route = plan.route.name if plan.route else None
        record.provider, record.model = primary.provider.name, primary.model
        call = Call(request_id=record.id, provider=primary.provider.name, model=primary.model,
                    messages=chat.messages, stream=chat.stream, params=chat.params,
                    responses=chat.responses,
                    inbound=inbound_of(exchange, chat.inbound))
        if len(plan.targets) == 1:
            primary.provider.adapter.check_call(call)  # a plain 400, before anything else
        reserve_cost(exchange, primary, call)
        exchange.include_usage = chat.include_usage
        exchange.prompt_chars = prompt_chars(chat.messages)
        exchange.progress_events = (
            (header(exchange.scope, b"x-relay-progress") or "").strip() == "events")
        self.call, self.plan = call, plan

    async def run(self, exchange: Exchange, nursery: trio.Nursery, stop: RequestStop
                  ) -> None:
        assert self.call is not None and self.plan is not None
        out, events = trio.open_memory_channel[Any](CHANNEL_SIZE)
        writer = (StreamWriter if self.call.stream else JSONWriter)(
            exchange, self.plan.targets[0].name)
        self.dispatcher = Dispatcher(
            exchange.relay, self.plan, self.call, self.priority, exchange.record, stop,
            self.call.stream, client_weight=exchange.relay.clients.client(
                exchange.client).weight)
        nursery.start_soon(self.dispatcher.run, nursery, out)
        try:
            await writer.pump(events)
        finally:
            events.close()  # (synchronous: no trip through the scheduler at the end)

    def settle(self, exchange: Exchange, stop: RequestStop) -> bool:
        record = exchange.record
        if stop.requested_at is not None and record.stop_requested_at is None:
            record.stop_requested_at = stop.requested_at
        releases = [a.released_at for a in record.attempts if a.released_at is not None]
        record.released_at = max(releases) if releases else None
        runs = self.dispatcher.runs if self.dispatcher is not None else []
        timeouts = [r for r in runs if r.error is not None
                    and r.error.phase == "timeout" and r.stopped_at is not None]
        if timeouts and record.stop_requested_at is None:
            record.stop_requested_at = timeouts[0].stopped_at
        return all(r.finished_at is not None for r in runs)
