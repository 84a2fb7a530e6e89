#!/usr/bin/env python3
"""A minimal fake of the three vendor APIs the real CLI tools call, for
``test_cli_adapters_real.py`` (stdlib only: it runs as a subprocess inside a network
namespace that has only loopback, beside the tools).

- Anthropic Messages (``claude``): ``POST /v1/messages`` (SSE or whole), ``POST
  /v1/messages/count_tokens``, ``HEAD /api/hello``;
- OpenAI Responses (``codex``): ``POST /v1/responses`` (SSE);
- Gemini (``gemini``): ``POST /v1beta/models/M:generateContent``,
  ``:streamGenerateContent?alt=sse``, ``:countTokens``.

The answer is ``Hello from the fake <API> server (FAKE-<API>-OK).`` in a few deltas. A
request whose text contains ``SLOW`` is answered with one delta every 0.2 s for 60 s (for
stop tests). ``FAIL401`` gets a 401 and ``FAIL429`` a 429 quota error, each in its API's
own error shape. Every request is appended to ``--log`` as one JSON line (method, path, body),
so a test can see what a tool sent. ``--port-file`` receives the bound port once listening.

Usage: ``fake_apis.py --port-file F --log L`` (port 0: any free port).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SLOW_DELTA_S = 0.2
SLOW_DELTAS = 300
_LOCK = threading.Lock()


def _pieces(marker: str, api: str, slow: bool) -> list[str]:
    if slow:
        return [f"tick{i} " for i in range(SLOW_DELTAS)]
    return ["Hello ", "from the fake ", f"{api} server ", f"({marker})."]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-apis/1"
    log_path: Path

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    # --- plumbing -----------------------------------------------------------------------
    def _body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        with _LOCK, open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"method": self.command, "path": self.path,
                                "headers": {k.lower(): v for k, v in self.headers.items()
                                            if k.lower() != "authorization"},
                                "body": body}) + "\n")
        return body

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _sse_start(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event(self, name: str | None, obj: Any) -> None:
        head = f"event: {name}\n" if name else ""
        self.wfile.write(f"{head}data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self._body()
        if self.path.startswith("/v1/models"):
            self._json(200, {"data": [], "object": "list"})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        body = self._body()
        text = json.dumps(body)
        slow = "SLOW" in text
        path = self.path.split("?")[0]
        try:
            for status in (401, 429):
                if f"FAIL{status}" in text and not path.endswith(("count_tokens",
                                                                  ":countTokens")):
                    self._error(path, status)
                    return
            if path == "/v1/messages/count_tokens":
                self._json(200, {"input_tokens": 10})
            elif path == "/v1/messages":
                self._anthropic(body, slow)
            elif path == "/v1/responses":
                self._responses(body, slow)
            elif path.endswith(":countTokens"):
                self._json(200, {"totalTokens": 10})
            elif path.endswith(":streamGenerateContent"):
                self._gemini_stream(slow)
            elif path.endswith(":generateContent"):
                self._gemini_whole(body)
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})
        except (BrokenPipeError, ConnectionResetError):
            return  # the tool went away mid-answer: that is what stop tests do

    def _error(self, path: str, status: int) -> None:
        if status == 401:
            message = "FAKE-AUTH: invalid x-api-key"
        else:
            message = "FAKE-QUOTA: You have exceeded your usage quota for this billing period."
        if path.startswith("/v1beta/"):
            self._json(status, {"error": {"code": status, "message": message, "status":
                                          "UNAUTHENTICATED" if status == 401
                                          else "RESOURCE_EXHAUSTED"}})
        elif path == "/v1/messages":
            self._json(status, {"type": "error", "error": {
                "type": "authentication_error" if status == 401 else "rate_limit_error",
                "message": message}})
        else:
            self._json(status, {"error": {"message": message, "type": "invalid_request_error"
                                          if status == 401 else "insufficient_quota",
                                          "code": "invalid_api_key" if status == 401
                                          else "insufficient_quota", "param": None}})

    # --- Anthropic Messages -------------------------------------------------------------
    def _anthropic(self, body: Any, slow: bool) -> None:
        model = body.get("model", "claude") if isinstance(body, dict) else "claude"
        pieces = _pieces("FAKE-ANT-OK", "Anthropic", slow)
        usage = {"input_tokens": 10, "output_tokens": len(pieces),
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        message = {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {**usage, "output_tokens": 1}}
        if not (isinstance(body, dict) and body.get("stream")):
            message.update(content=[{"type": "text", "text": "".join(pieces)}],
                           stop_reason="end_turn", usage=usage)
            self._json(200, message)
            return
        self._sse_start()
        self._event("message_start", {"type": "message_start", "message": message})
        self._event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
        for i, piece in enumerate(pieces):
            if slow and i:
                time.sleep(SLOW_DELTA_S)
            self._event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta",
                                                          "text": piece}})
        self._event("content_block_stop", {"type": "content_block_stop", "index": 0})
        self._event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": "end_turn",
                                                "stop_sequence": None},
                                      "usage": {"output_tokens": len(pieces)}})
        self._event("message_stop", {"type": "message_stop"})

    # --- OpenAI Responses ---------------------------------------------------------------
    def _responses(self, body: Any, slow: bool) -> None:
        model = body.get("model", "gpt") if isinstance(body, dict) else "gpt"
        pieces = _pieces("FAKE-OAI-OK", "OpenAI", slow)
        created = int(time.time())
        base = {"id": "resp_fake", "object": "response", "created_at": created,
                "model": model, "status": "in_progress", "output": []}
        self._sse_start()
        seq = 0

        def ev(obj: dict[str, Any]) -> None:
            nonlocal seq
            obj["sequence_number"] = seq
            seq += 1
            self._event(obj["type"], obj)

        ev({"type": "response.created", "response": base})
        ev({"type": "response.in_progress", "response": base})
        item = {"id": "msg_fake", "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        ev({"type": "response.output_item.added", "output_index": 0, "item": item})
        ev({"type": "response.content_part.added", "item_id": "msg_fake", "output_index": 0,
            "content_index": 0, "part": {"type": "output_text", "text": "",
                                         "annotations": []}})
        for i, piece in enumerate(pieces):
            if slow and i:
                time.sleep(SLOW_DELTA_S)
            ev({"type": "response.output_text.delta", "item_id": "msg_fake",
                "output_index": 0, "content_index": 0, "delta": piece})
        text = "".join(pieces)
        part = {"type": "output_text", "text": text, "annotations": []}
        ev({"type": "response.output_text.done", "item_id": "msg_fake", "output_index": 0,
            "content_index": 0, "text": text})
        ev({"type": "response.content_part.done", "item_id": "msg_fake", "output_index": 0,
            "content_index": 0, "part": part})
        done_item = {**item, "status": "completed", "content": [part]}
        ev({"type": "response.output_item.done", "output_index": 0, "item": done_item})
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": len(pieces),
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": 10 + len(pieces)}
        ev({"type": "response.completed",
            "response": {**base, "status": "completed", "output": [done_item],
                         "usage": usage}})

    # --- Gemini -------------------------------------------------------------------------
    def _gemini_chunk(self, text: str, finish: bool, n: int) -> dict[str, Any]:
        cand: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"},
                                "index": 0}
        if finish:
            cand["finishReason"] = "STOP"
        return {"candidates": [cand], "modelVersion": "fake-gemini",
                "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": n,
                                  "totalTokenCount": 10 + n}}

    def _gemini_stream(self, slow: bool) -> None:
        pieces = _pieces("FAKE-GEM-OK", "Gemini", slow)
        self._sse_start()
        for i, piece in enumerate(pieces):
            if slow and i:
                time.sleep(SLOW_DELTA_S)
            self._event(None, self._gemini_chunk(piece, i == len(pieces) - 1, i + 1))

    def _gemini_whole(self, body: Any) -> None:
        # The router's classifier asks for JSON; -m skips it, but answer it anyway.
        config = body.get("generationConfig", {}) if isinstance(body, dict) else {}
        if config.get("responseMimeType") == "application/json":
            text = json.dumps({"reasoning": "fake", "model_choice": "flash"})
        else:
            text = "".join(_pieces("FAKE-GEM-OK", "Gemini", False))
        self._json(200, self._gemini_chunk(text, True, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    Handler.log_path = Path(args.log)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.replace(args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
