"""A fake cloud provider with several accounts (SPEC L13): `fake_metered`'s buckets, one
set per API key, as a provider meters each key's organisation apart.

Every key (``Authorization: Bearer K`` or ``x-api-key: K``) gets its own buckets of the
configured limits (and models' own, as `Metered.configure` sets them); ``revoked`` keys
are answered 401 in the path's shape (OpenAI's ``invalid_api_key``, Anthropic's
``authentication_error``), as a provider answers a key that was revoked. It counts, per
key, the requests it answered (``served``) and its 429s (``refused``), and which key
answered each conversation (``conversations``: the first message's text → keys in order).
"""

from __future__ import annotations

import collections
import contextvars
from typing import Any

import attrs
import trio

from fakes.fake_http import Exchange, serve_fake
from fakes.fake_metered import Bucket, Limits, Metered

__all__ = ["KeyedMetered", "serve_keyed"]

_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("key", default="")


def key_of(headers: dict[str, str]) -> str:
    bearer = headers.get("authorization", "")
    return bearer.removeprefix("Bearer ").strip() or headers.get("x-api-key", "")


class KeyedMetered(Metered):
    """See the module docstring."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.keyed: dict[str, tuple[dict[str, Bucket], dict[str, dict[str, Bucket]]]] = {}
        self.revoked: set[str] = set()
        self.served: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()
        self.unauthorized: collections.Counter[str] = collections.Counter()
        self.conversations: dict[str, list[str]] = {}

    def configure(self, limits: Limits, *, send_headers: bool = True,
                  models: dict[str, Limits] | None = None) -> None:
        super().configure(limits, send_headers=send_headers, models=models)
        self.keyed.clear()

    def _buckets_of(self, model: str) -> dict[str, Bucket]:
        key = _KEY.get()
        if key not in self.keyed:
            self.keyed[key] = (
                {k: Bucket(v) for k, v in attrs.asdict(self.limits).items() if v},
                {m: {k: Bucket(v) for k, v in attrs.asdict(lim).items() if v}
                 for m, lim in self.model_limits.items()})
        shared, models = self.keyed[key]
        return models.get(model, shared)

    async def respond(self, ex: Exchange) -> None:
        key = key_of(ex.request.headers)
        _KEY.set(key)  # (this task's own: every request is served by a task of its own)
        if key in self.revoked:
            self.unauthorized[key] += 1
            self.notify()
            if ex.path.endswith("/messages"):
                await ex.send_json(401, {"type": "error", "error": {
                    "type": "authentication_error", "message": "invalid x-api-key"}})
            else:
                await ex.send_json(401, {"error": {
                    "message": "Incorrect API key provided. You can find your API key at "
                               "https://platform.openai.com/account/api-keys.",
                    "type": "invalid_request_error", "param": None,
                    "code": "invalid_api_key"}})
            return
        await super().respond(ex)

    async def _reject(self, ex: Exchange, t: float, wait: float, which: str, prompt: int,
                      model: str, anthropic: bool) -> None:
        self.refused[_KEY.get()] += 1
        await super()._reject(ex, t, wait, which, prompt, model, anthropic)

    def _served(self, ex: Exchange) -> None:
        key = _KEY.get()
        self.served[key] += 1
        body = ex.json if isinstance(ex.json, dict) else {}
        messages = body.get("messages") or [{}]
        first = str(messages[0].get("content"))
        self.conversations.setdefault(first, []).append(key)

    async def _whole(self, ex: Exchange, *args: Any) -> None:
        self._served(ex)
        await super()._whole(ex, *args)

    async def _stream(self, ex: Exchange, *args: Any) -> None:
        self._served(ex)
        await super()._stream(ex, *args)


async def serve_keyed(limits: Limits, *, send_headers: bool = True,
                      models: dict[str, Limits] | None = None,
                      task_status: trio.TaskStatus[KeyedMetered] = trio.TASK_STATUS_IGNORED
                      ) -> None:
    """Serve a `KeyedMetered` with ``limits`` per key on 127.0.0.1 until cancelled."""
    async with trio.open_nursery() as nursery:
        server: KeyedMetered = await nursery.start(serve_fake, KeyedMetered)
        server.configure(limits, send_headers=send_headers, models=models)
        task_status.started(server)
