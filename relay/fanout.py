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
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .dispatch import AttemptStarted, Dispatcher, Ended, Plan, make_plan
from .errors import RelayError
from .events import Call, Delta, Finish, Skipped, Usage
from .front import CHANNEL_SIZE, ChatRequest
from .openai_api import OPENAI, load_json, parse_chat_body
from .records import Record
from .writers import Answer, dumps, merge_delta, new_choice

if TYPE_CHECKING:
    from .core import RequestStop

__all__ = ["FanoutRequest"]

MAX_MODELS = 16


@attrs.define(eq=False)
class _Branch:
    index: int
    name: str  # as the client asked
    plan: Plan
    record: Record
    result: dict[str, Any] | None = None


class FanoutRequest(ChatRequest):
    """A chat request run against several models at once (see the module docstring)."""

    def _prepare(self, body: bytes) -> tuple[Call, Plan, str]:
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
        priority = super()._priority()
        if self.relay.draining:
            raise RelayError("shutting_down", "relay is shutting down and takes no new "
                             "requests; retry when it is back", retry_after_s=5.0)
        self.record.priority = priority
        self.record.stream = bool(data.get("stream", False))
        self.record.route = "(fanout)"
        self.record.model = ",".join(models)
        params = {k: v for k, v in data.items()
                  if k not in ("model", "messages", "stream", "fallbacks")}
        self.branches = []
        for i, name in enumerate(models):
            plan = make_plan(self.relay, name, data.get("fallbacks"))
            target = plan.targets[0]
            call = Call(request_id=f"{self.record.id}.{i}", provider=target.provider.name,
                        model=target.model, messages=data["messages"],
                        stream=self.record.stream, params=params)
            if len(plan.targets) == 1:
                target.provider.adapter.check_call(call)
            record = Record(id=call.request_id, started_at=self.record.started_at,
                            priority=priority, stream=self.record.stream)
            self.branches.append(_Branch(i, name, plan, record))
        self.base_call = Call(request_id=self.record.id, provider="", model="",
                              messages=data["messages"], stream=self.record.stream,
                              params=params)
        return self.base_call, self.branches[0].plan, priority

    async def _run(self, call: Call, plan: Plan, priority: str) -> None:
        from .core import RequestStop

        stop = RequestStop()
        self.relay.track(stop)
        send_bytes, recv_bytes = trio.open_memory_channel[bytes](CHANNEL_SIZE)
        try:
            async with trio.open_nursery() as nursery:
                watcher = trio.CancelScope()
                nursery.start_soon(self._watch_disconnect, nursery.cancel_scope, watcher)
                async with send_bytes:
                    for branch in self.branches:
                        nursery.start_soon(self._branch, nursery, branch, priority, stop,
                                           send_bytes.clone())
                if call.stream:
                    await self._stream_out(recv_bytes)
                else:
                    async with recv_bytes:
                        async for _ in recv_bytes:
                            pass  # every branch has ended when the channel closes
                    results = [b.result for b in self.branches]
                    await self.send_json(200, {"object": "relay.fanout", "results": results})
                watcher.cancel()
        finally:
            self.relay.untrack(stop)
            self._merge_records(stop)
        if self.client_gone:
            self.record.status, self.record.reason, self.record.phase = (
                499, "client_disconnected", "stop")

    def _merge_records(self, stop: RequestStop) -> None:
        record = self.record
        for branch in self.branches:
            record.attempts.extend(branch.record.attempts)
            record.fallback_triggered |= branch.record.fallback_triggered
            if branch.record.skipped_events:
                record.skipped_events.extend(branch.record.skipped_events)
        releases = [a.released_at for a in record.attempts if a.released_at is not None]
        record.released_at = max(releases) if releases else None
        if stop.requested_at is not None and record.stop_requested_at is None:
            record.stop_requested_at = stop.requested_at

    async def _branch(self, nursery: trio.Nursery, branch: _Branch, priority: str,
                      stop: RequestStop, out: trio.MemorySendChannel[bytes]) -> None:
        """One model: its own dispatcher; its events folded into tagged SSE events (or,
        for a plain request, into one result)."""
        events_out, events = trio.open_memory_channel[Any](CHANNEL_SIZE)
        target = branch.plan.targets[0]
        call = attrs.evolve(self.base_call, request_id=branch.record.id,
                            provider=target.provider.name, model=target.model)
        dispatcher = Dispatcher(self.relay, branch.plan, call, priority, branch.record,
                                stop, self.record.stream)
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
                    if self.record.stream:
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
                    if self.record.stream:
                        final = ({**tag, "error": branch.result["error"]} if error
                                 else {**tag, "done": True,
                                       "usage": usage.as_dict() if usage else None})
                        await out.send(_event(final))
                    return

    async def _stream_out(self, chunks: trio.MemoryReceiveChannel[bytes]) -> None:
        heartbeat_s = self.server.heartbeat_s
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache")]})
        self.headers_sent = True
        async with chunks:
            while True:
                data = None
                with trio.move_on_after(heartbeat_s):
                    try:
                        data = await chunks.receive()
                    except trio.EndOfChannel:
                        break
                if data is None:
                    data = b": keepalive\n\n"
                else:
                    batch = [data]
                    while True:
                        try:
                            batch.append(chunks.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    data = b"".join(batch)
                await self.send({"type": "http.response.body", "body": data,
                                 "more_body": True})
        await self.send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                         "more_body": False})


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
