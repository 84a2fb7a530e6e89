"""Fan-out (SPEC A4): one request to several models at once; one stop reaches them all.

``POST /relay/v1/fanout`` takes an OpenAI chat body with ``"models": [...]`` instead of
``"model"``. Every model runs as its own dispatcher — its own lane, its own attempts and
fallbacks — inside the one request nursery, so a client that leaves cancels every branch
(and every upstream call) at once, structurally.

Plain: one JSON object, ``{"object": "relay.fanout", "results": [{"model", "ok",
"response" | "error"}, …]}`` in the order asked. Streamed: SSE events tagged with their
model and index — ``{"model", "index", "chunk": <chat.completion.chunk>}`` as tokens come,
then ``{"model", "index", "done": true}`` or ``{"model", "index", "error": {…}}`` per
branch — and ``data: [DONE]`` once every branch has ended.
"""

from __future__ import annotations

import json
import time
from typing import Any

import attrs
import trio

from relay.dialects.base import Answer, dumps, merge_delta, new_choice
from relay.dialects.openai_chat import OPENAI, load_json, parse_chat_body
from relay.engine.dispatch import Dispatcher
from relay.engine.plan import Plan
from relay.engine.stops import RequestStop
from relay.vocab.errors import RelayError
from relay.vocab.events import AttemptStarted, Call, Delta, Ended, Finish, Skipped, Usage
from relay.vocab.records import Record

from .chat import CHANNEL_SIZE, plan_for, priority_of, refuse_when_draining, reserve_cost
from .exchange import Exchange
from .writers import COALESCE_MAX

__all__ = ["Fanout"]

MAX_MODELS = 16


@attrs.define(eq=False)
class _Branch:
    index: int
    name: str  # as the client asked
    plan: Plan
    record: Record
    result: dict[str, Any] | None = None


@attrs.define(eq=False)
class Fanout:
    """The `Handler` of a fan-out request (see the module docstring): one dispatcher per
    model, all under the exchange's one nursery and stop handle."""

    branches: list[_Branch] = attrs.field(factory=list)
    base_call: Call | None = None
    priority: str = "normal"
    stream: bool = False

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        raw = load_json(body)  # finite numbers, bounded nesting (SPEC A1)
        models = raw.get("models") if isinstance(raw, dict) else None
        if (not isinstance(models, list) or not models or len(models) > MAX_MODELS
                or not all(isinstance(m, str) and m for m in models)):
            raise RelayError("invalid_request", f"'models' must be a list of 1 to "
                             f"{MAX_MODELS} model names", param="models")
        if len(set(models)) != len(models):
            raise RelayError("invalid_request", "'models' names a model twice",
                             param="models")
        raw = {k: v for k, v in raw.items() if k != "models"}
        raw["model"] = models[0]
        data = parse_chat_body(json.dumps(raw).encode())
        self.priority = priority_of(exchange)
        refuse_when_draining(exchange)
        record = exchange.record
        self.stream = record.stream = bool(data.get("stream", False))
        record.route = "(fanout)"
        record.model = record.requested_model = ",".join(models)
        params = {k: v for k, v in data.items()
                  if k not in ("model", "messages", "stream", "fallbacks")}
        for i, name in enumerate(models):
            plan = plan_for(exchange, name, data.get("fallbacks"))
            target = plan.targets[0]
            call = Call(request_id=f"{record.id}.{i}", provider=target.provider.name,
                        model=target.model, messages=data["messages"],
                        stream=self.stream, params=params)
            if len(plan.targets) == 1:
                target.provider.adapter.check_call(call)
            reserve_cost(exchange, target, call)
            branch_record = Record(id=call.request_id, started_at=record.started_at,
                                   priority=self.priority, stream=self.stream,
                                   client=exchange.client)
            self.branches.append(_Branch(i, name, plan, branch_record))
        self.base_call = Call(request_id=record.id, provider="", model="",
                              messages=data["messages"], stream=self.stream, params=params)

    async def run(self, exchange: Exchange, nursery: trio.Nursery, stop: RequestStop
                  ) -> None:
        send_bytes, recv_bytes = trio.open_memory_channel[bytes](CHANNEL_SIZE)
        async with send_bytes:
            for branch in self.branches:
                nursery.start_soon(self._branch, exchange, nursery, branch, stop,
                                   send_bytes.clone())
        if self.stream:
            await self._stream_out(exchange, recv_bytes)
        else:
            async with recv_bytes:
                async for _ in recv_bytes:
                    pass  # every branch has ended when the channel closes
            results = [b.result for b in self.branches]
            await exchange.send_json(200, {"object": "relay.fanout", "results": results})

    def settle(self, exchange: Exchange, stop: RequestStop) -> bool:
        """A fan-out's record is written at its real end (False: never early)."""
        record = exchange.record
        if stop.requested_at is not None and record.stop_requested_at is None:
            record.stop_requested_at = stop.requested_at
        record.attempts = [a for b in self.branches for a in b.record.attempts]
        record.fallback_triggered = any(b.record.fallback_triggered for b in self.branches)
        record.skipped_events = [e for b in self.branches for e in b.record.skipped_events]
        # SPEC O7: its usage is its branches' together, its cost theirs at each one's price.
        used = [b.record for b in self.branches if b.record.usage]
        if used:
            record.usage = {key: sum(r.usage.get(key) or 0 for r in used if r.usage)
                            for key in ("prompt_tokens", "completion_tokens", "total_tokens",
                                        "cache_read_tokens", "cache_write_tokens")}
            costs = [exchange.relay.clients.cost(r) for r in used]
            record.cost_usd = (None if any(c is None for c in costs)
                               else round(sum(c or 0.0 for c in costs), 6))
        # The branches wait side by side: the request waited as long as its longest wait
        # (a branch that left while queued included); run time is the lanes' time, summed.
        waits = [b.record.queue_ms for b in self.branches if b.record.queue_ms is not None]
        runs = [b.record.run_ms for b in self.branches if b.record.run_ms is not None]
        record.queue_ms = max(waits) if waits else None
        record.run_ms = round(sum(runs), 3) if runs else None
        releases = [a.released_at for a in record.attempts if a.released_at is not None]
        record.released_at = max(releases) if releases else None
        return False

    async def _branch(self, exchange: Exchange, nursery: trio.Nursery, branch: _Branch,
                      stop: RequestStop, out: trio.MemorySendChannel[bytes]) -> None:
        """One model: its own dispatcher; its events folded into tagged SSE events (or,
        for a plain request, into one result)."""
        events_out, events = trio.open_memory_channel[Any](CHANNEL_SIZE)
        target = branch.plan.targets[0]
        assert self.base_call is not None
        call = attrs.evolve(self.base_call, request_id=branch.record.id,
                            provider=target.provider.name, model=target.model)
        dispatcher = Dispatcher(exchange.relay, branch.plan, call, self.priority,
                                branch.record, stop, self.stream,
                                client_weight=exchange.relay.clients.client(
                                    exchange.client).weight)
        nursery.start_soon(dispatcher.run, nursery, events_out)
        tag = {"model": branch.name, "index": branch.index}
        choices: dict[int, dict[str, Any]] = {}
        usage: Usage | None = None
        model = target.name
        created = int(time.time())
        async with out, events:
            async for event in events:
                if isinstance(event, AttemptStarted):
                    model = event.model
                    if not event.continues:
                        choices.clear()
                        usage = None
                elif isinstance(event, Delta | Finish):
                    if isinstance(event, Delta):
                        merge_delta(choices.setdefault(event.index, new_choice(event.index)),
                                    event)
                    else:
                        choices.setdefault(event.index, new_choice(event.index))[
                            "finish_reason"] = event.reason
                    if self.stream:
                        await out.send(_event({**tag, "chunk": _chunk(
                            branch.record.id, created, model, event)}))
                elif isinstance(event, Usage):
                    usage = event
                    branch.record.usage = event.as_dict()
                elif isinstance(event, Skipped):
                    branch.record.skipped_events.append(event.detail)
                elif isinstance(event, Ended):
                    error = event.error
                    if error is not None:
                        branch.record.status, branch.record.reason = error.status, error.reason
                        branch.result = {**tag, "ok": False, "error": error.body()["error"]}
                    else:
                        answer = Answer(id=branch.record.id, created=created, model=model,
                                        choices=choices, usage=usage)
                        branch.result = {**tag, "ok": True, "response": OPENAI.render(answer)}
                    if self.stream:
                        final = ({**tag, "error": branch.result["error"]} if error
                                 else {**tag, "done": True,
                                       "usage": usage.as_dict() if usage else None})
                        await out.send(_event(final))
                    return

    async def _stream_out(self, exchange: Exchange,
                          chunks: trio.MemoryReceiveChannel[bytes]) -> None:
        """The branches' events as one SSE stream: the exchange's bounded writes (a reader
        that takes nothing is dropped, SPEC C3), heartbeats, and the chunks that are ready
        together coalesced into one send, as chat streams do."""
        heartbeat_s = exchange.server.heartbeat_s
        await exchange.start_stream()
        async with chunks:
            while True:
                data = None
                # (noqa, ASYNC912: receive() is awaited; only EndOfChannel is caught.)
                with trio.move_on_after(heartbeat_s):  # noqa: ASYNC912
                    try:
                        data = await chunks.receive()
                    except trio.EndOfChannel:
                        break
                if data is None:
                    data = b": keepalive\n\n"
                else:
                    batch = [data]
                    while len(batch) < COALESCE_MAX:
                        try:
                            batch.append(chunks.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    data = b"".join(batch)
                await exchange.write(data)
        await exchange.write(b"data: [DONE]\n\n", more=False)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def _chunk(rid: str, created: int, model: str, event: Delta | Finish) -> dict[str, Any]:
    if isinstance(event, Finish):
        delta: dict[str, Any] = {}
        finish: str | None = event.reason
    else:
        delta = {k: v for k, v in (("content", event.content),
                                   ("tool_calls", event.tool_calls)) if v is not None}
        delta.update(event.extra or {})
        finish = None
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [{"index": event.index, "delta": delta,
                                         "finish_reason": finish}]}
