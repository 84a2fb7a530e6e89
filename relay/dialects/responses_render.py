"""The OpenAI Responses dialect, answers: relay's `Answer` and stream events rendered as
a Response object and Responses' streamed events, in order, each with its
``sequence_number`` (SPEC A7). `relay.dialects.openai_responses` parses the requests.

A streamed answer goes::

    response.created, response.in_progress
    per output item, in order:
      response.output_item.added
      text:       response.content_part.added, response.output_text.delta …,
                  response.output_text.done, response.content_part.done
      a function: response.function_call_arguments.delta …, ….done
      a custom tool (translated): response.custom_tool_call_input.delta …, ….done
      reasoning:  response.reasoning_text.delta …, ….done
      response.output_item.done
    response.completed | response.incomplete (cut off: max_output_tokens, content_filter)

A failure once the stream has begun is ``response.failed``, its ``response.error`` the
E1 error object (``code`` the reason, ``relay`` its fields), and the stream ends.

Where the provider speaks Responses itself, its own events and objects come through as
they are (``responses_event`` / ``responses_body`` in a delta's extra fields): renumbered,
the response's id, model and ``previous_response_id`` relay's, everything else — item
ids, reasoning with its encrypted content, hosted tools' items — untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from relay.dialects.base import Answer, dumps
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Usage

from .responses_custom import StringValue, custom_input

__all__ = ["ResponsesRender", "ResponsesStream", "new_response_id"]

# relay's finish_reason → (status, incomplete_details.reason)
_STATUS: dict[str, tuple[str, str | None]] = {
    "stop": ("completed", None), "tool_calls": ("completed", None),
    "function_call": ("completed", None), "length": ("incomplete", "max_output_tokens"),
    "content_filter": ("incomplete", "content_filter"),
}


def new_response_id(request_id: str) -> str:
    return f"resp_{request_id}"


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    inp, out = usage.prompt_tokens or 0, usage.completion_tokens or 0
    # input_tokens counts the cached ones too (SPEC L12a).
    return {"input_tokens": inp,
            "input_tokens_details": {"cached_tokens": usage.cache_read_tokens or 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens if usage.total_tokens is not None
            else inp + out}


class ResponsesRender:
    """Response objects, stream encoders and error bodies. ``custom``, ``namespaced`` and
    ``echo`` come from the request (`relay.dialects.openai_responses.ResponsesTurn`)."""

    def __init__(self, on_final: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.on_final = on_final
        self.custom: set[str] = set()
        self.namespaced: dict[str, tuple[str, str]] = {}
        self.echo: dict[str, Any] = {"store": True}

    def error_body(self, error: RelayError) -> dict[str, Any]:
        return error.body()

    # --- the response object ---------------------------------------------------------------
    def response(self, rid: str, created: int, model: str, *, status: str,
                 output: list[dict[str, Any]], usage: Usage | None = None,
                 incomplete: str | None = None,
                 error: RelayError | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": created, "status": status,
                "background": False,
                "error": error.body()["error"] if error is not None else None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "model": model, "output": output, "usage": _usage(usage),
                "max_tool_calls": None, "service_tier": "default", **self.echo}

    def passed(self, upstream: dict[str, Any], rid: str, model: str) -> dict[str, Any]:
        """A response object from a provider that speaks Responses, as relay's."""
        return {**upstream, "id": rid, "model": model,
                "previous_response_id": self.echo.get("previous_response_id"),
                "store": self.echo.get("store", True)}

    def final(self, response: dict[str, Any]) -> None:
        if self.on_final is not None and response.get("status") in ("completed",
                                                                    "incomplete"):
            self.on_final(response)

    def tool_item(self, rid: str, k: int, call: dict[str, Any]) -> dict[str, Any]:
        fn = call.get("function") or {}
        chat_name = str(fn.get("name") or "")
        namespace, name = self.namespaced.get(chat_name, (None, chat_name))
        call_id = call.get("id") or f"call_{rid[5:]}_{k}"
        args = fn.get("arguments") or ""
        args = args if isinstance(args, str) else json.dumps(args)
        item: dict[str, Any]
        if chat_name in self.custom:
            item = {"id": f"ctc_{rid[5:]}_{k}", "type": "custom_tool_call",
                    "status": "completed", "call_id": call_id, "name": name,
                    "input": custom_input(args)}
        else:
            item = {"id": f"fc_{rid[5:]}_{k}", "type": "function_call",
                    "status": "completed", "call_id": call_id, "name": name,
                    "arguments": args}
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def render(self, answer: Answer) -> dict[str, Any]:
        rid = new_response_id(answer.id)
        choice = answer.choices.get(0) or {"message": {}, "finish_reason": "stop"}
        message = choice["message"]
        if isinstance(message.get("responses_body"), dict):
            out = self.passed(message["responses_body"], rid, answer.model)
            self.final(out)
            return out
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append({"id": f"rs_{answer.id}", "type": "reasoning", "summary": [],
                           "content": [{"type": "reasoning_text",
                                        "text": message["reasoning_content"]}]})
        if message.get("content"):
            output.append({"id": f"msg_{answer.id}", "type": "message",
                           "status": "completed", "role": "assistant", "content": [
                               {"type": "output_text", "text": message["content"],
                                "annotations": [], "logprobs": []}]})
        for k, call in enumerate(message.get("tool_calls") or ()):
            output.append(self.tool_item(rid, k, call))
        status, incomplete = _STATUS.get(choice.get("finish_reason") or "stop",
                                         ("completed", None))
        out = self.response(rid, answer.created, answer.model, status=status,
                            output=output, usage=answer.usage, incomplete=incomplete)
        self.final(out)
        return out

    def encoder(self, request_id: str, created: int, include_usage: bool) -> ResponsesStream:
        return ResponsesStream(self, new_response_id(request_id), created)


class _Item:
    """An output item being streamed."""

    def __init__(self, kind: str, index: int, item: dict[str, Any]) -> None:
        self.kind = kind          # text | reasoning | function | custom
        self.index = index        # its output_index
        self.item = item
        self.text: list[str] = []  # text, reasoning, function arguments, custom input
        self.args: list[str] = []  # a custom tool's raw arguments
        self.custom = StringValue() if kind == "custom" else None


class ResponsesStream:
    """The streamed events of one response (the module docstring)."""

    def __init__(self, render: ResponsesRender, rid: str, created: int) -> None:
        self.r = render
        self.id = rid
        self.created = created
        self.seq = 0
        self.started = False
        self.model = ""
        self.begin("")

    def begin(self, model: str) -> None:
        self.model = model
        self.output: list[dict[str, Any]] = []
        self.current: _Item | None = None
        self.tools: dict[int, _Item] = {}
        self.count = 0
        self.status: tuple[str, str | None] = ("completed", None)
        self.usage: Usage | None = None
        self.raw = False
        self.held = b""  # a passed-through final event, sent with the stream's last write

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(obj) + b"\n\n"

    def _response(self, status: str, error: RelayError | None = None) -> dict[str, Any]:
        incomplete = self.status[1]
        return self.r.response(self.id, self.created, self.model, status=status,
                               output=list(self.output), usage=self.usage,
                               incomplete=incomplete if status == "incomplete" else None,
                               error=error)

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        skeleton = self._response("in_progress")
        return (self._event("response.created", response=skeleton)
                + self._event("response.in_progress", response=skeleton))

    # --- items ------------------------------------------------------------------------
    def _open(self, kind: str, item: dict[str, Any]) -> tuple[_Item, bytes]:
        out = self._close()
        self.current = _Item(kind, len(self.output), item)
        out += self._event("response.output_item.added", output_index=self.current.index,
                           item=item)
        if kind == "text":
            out += self._event("response.content_part.added", item_id=item["id"],
                               output_index=self.current.index, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})
        return self.current, out

    def _close(self) -> bytes:
        cur, self.current = self.current, None
        if cur is None:
            return b""
        item, at = cur.item, {"item_id": cur.item["id"], "output_index": cur.index}
        text = "".join(cur.text)
        out = b""
        if cur.kind == "text":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += self._event("response.output_text.done", **at, content_index=0,
                               text=text, logprobs=[])
            out += self._event("response.content_part.done", **at, content_index=0,
                               part=part)
            item.update(status="completed", content=[part])
        elif cur.kind == "reasoning":
            out += self._event("response.reasoning_text.done", **at, content_index=0,
                               text=text)
            item.update(content=[{"type": "reasoning_text", "text": text}])
        elif cur.kind == "function":
            out += self._event("response.function_call_arguments.done", **at,
                               name=item["name"], arguments=text)
            item.update(status="completed", arguments=text)
        else:
            whole = custom_input("".join(cur.args))
            if whole.startswith(text) and len(whole) > len(text):
                out += self._event("response.custom_tool_call_input.delta", **at,
                                   delta=whole[len(text):])
            out += self._event("response.custom_tool_call_input.done", **at, input=whole)
            item.update(status="completed", input=whole)
        self.output.append(item)
        return out + self._event("response.output_item.done", output_index=cur.index,
                                 item=item)

    def _tool(self, call: dict[str, Any]) -> bytes:
        k = int(call.get("index", 0))
        out = b""
        cur = self.tools.get(k)
        if cur is None or cur is not self.current:
            item = self.r.tool_item(self.id, self.count, call)
            self.count += 1
            kind = "custom" if item["type"] == "custom_tool_call" else "function"
            item.update(status="in_progress", **({"input": ""} if kind == "custom"
                                                 else {"arguments": ""}))
            cur, out = self._open(kind, item)
            self.tools[k] = cur
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, dict | list):
            args = json.dumps(args)
        if not isinstance(args, str) or not args:
            return out
        at = {"item_id": cur.item["id"], "output_index": cur.index}
        if cur.custom is not None:
            cur.args.append(args)
            piece = cur.custom.feed(args)
            if piece:
                cur.text.append(piece)
                out += self._event("response.custom_tool_call_input.delta", **at,
                                   delta=piece)
        else:
            cur.text.append(args)
            out += self._event("response.function_call_arguments.delta", **at, delta=args)
        return out

    # --- the encoder protocol ---------------------------------------------------------
    def delta(self, event: Delta) -> bytes:
        extra = event.extra or {}
        raw = extra.get("responses_event")
        if isinstance(raw, dict):
            return self._passed(raw)
        if event.index != 0:
            return b""  # a response has one answer
        out = self._start()
        reasoning = extra.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            cur = self.current
            if cur is None or cur.kind != "reasoning":
                cur, more = self._open("reasoning", {
                    "id": f"rs_{self.id[5:]}_{len(self.output)}", "type": "reasoning",
                    "summary": [], "content": []})
                out += more
            cur.text.append(reasoning)
            out += self._event("response.reasoning_text.delta", item_id=cur.item["id"],
                               output_index=cur.index, content_index=0, delta=reasoning)
        if event.content:
            cur = self.current
            if cur is None or cur.kind != "text":
                cur, more = self._open("text", {
                    "id": f"msg_{self.id[5:]}_{len(self.output)}", "type": "message",
                    "status": "in_progress", "role": "assistant", "content": []})
                out += more
            cur.text.append(event.content)
            out += self._event("response.output_text.delta", item_id=cur.item["id"],
                               output_index=cur.index, content_index=0,
                               delta=event.content, logprobs=[])
        for call in event.tool_calls or ():
            out += self._tool(call)
        return out

    def finish(self, event: Finish) -> bytes:
        if event.index != 0 or self.raw:
            return b""
        self.status = _STATUS.get(event.reason, ("completed", None))
        return self._start() + self._close()

    def set_usage(self, usage: Usage) -> None:
        self.usage = usage

    def done(self) -> bytes:
        if self.raw:
            # The provider's own response.completed, held back until now: a client that
            # hangs up once it has it (Codex does) has then had the whole answer.
            return self.held
        out = self._start() + self._close()
        status = self.status[0]
        response = self._response(status)
        self.r.final(response)  # stored before the client has its last byte
        return out + self._event(f"response.{status}", response=response)

    def error(self, error: RelayError) -> bytes:
        out = self._start() + self._close()
        return out + self._event("response.failed", response=self._response("failed", error))

    def _passed(self, event: dict[str, Any]) -> bytes:
        """One event of a provider that speaks Responses, renumbered, as relay's."""
        self.raw = self.started = True
        fields = {k: v for k, v in event.items() if k not in ("type", "sequence_number")}
        kind = str(event.get("type") or "")
        if isinstance(fields.get("response"), dict):
            fields["response"] = self.r.passed(fields["response"], self.id, self.model)
            if kind in ("response.completed", "response.incomplete"):
                self.r.final(fields["response"])
                self.held = self._event(kind, **fields)
                return b""
        return self._event(kind, **fields)
