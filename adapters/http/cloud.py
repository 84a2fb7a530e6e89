"""What the cloud adapters with their own wire format (``anthropic``, ``gemini``) share.

- `CloudAdapter`: a key from the environment (refused up front, as ``auth_required``,
  when the variable is unset), one pooled client per provider, GET-JSON for model
  discovery; streams are read by `HTTPAdapter.read_sse` (adapters/http/base.py), the one SSE
  reader of every HTTP adapter;
- content-part helpers both translations use (data: URLs, JSON tool arguments).

Completeness (SPEC E4) is decided in `read_sse`: the adapter's handler says which event
is the final one (Anthropic's ``message_stop``, Gemini's last ``finishReason``). A body
that ends before it — cleanly or by a dropped connection — is ``stream_cut``; a
connection that drops after it is a complete answer.
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

from relay.vocab.errors import RelayError, excerpt

from .base import HTTPAdapter

__all__ = ["CloudAdapter", "data_url", "json_args", "obj", "stop_sequences", "tool_calls"]

MAX_MODEL_PAGES = 20  # model discovery follows at most this many pages


def data_url(url: str) -> tuple[str, str] | None:
    """``(media type, base64 data)`` of a ``data:…;base64,…`` URL, else None."""
    if not url.startswith("data:"):
        return None
    head, comma, data = url[5:].partition(",")
    media, _, encoding = head.partition(";")
    if not comma or encoding.lower() != "base64" or not media:
        return None
    return media, data


def json_args(arguments: Any, where: str) -> dict[str, Any]:
    """A tool call's ``function.arguments`` (a JSON string, OpenAI's shape) as an object.

    Raises:
        RelayError: ``invalid_request`` naming the message when it is not a JSON object.
    """
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or arguments == "":
        return {}
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise RelayError("invalid_request", f"{where}.function.arguments must be a JSON "
                         f"object (as a string), not {str(arguments)[:80]!r}",
                         param="messages")
    return value


def obj(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else an empty one (for optional sub-objects)."""
    return value if isinstance(value, dict) else {}


def tool_calls(message: dict[str, Any], where: str) -> list[tuple[str | None, str, Any, Any]]:
    """An assistant message's ``tool_calls`` as ``(id, name, arguments, the call)``.

    Raises:
        RelayError: ``invalid_request`` naming the message when they are malformed.
    """
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise RelayError("invalid_request", f"{where}.tool_calls must be a list",
                         param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RelayError("invalid_request", f"{where}.tool_calls[{j}] needs a function "
                             "with a name", param="messages")
        call_id = call.get("id")
        out.append((call_id if isinstance(call_id, str) else None, fn["name"],
                    json_args(fn.get("arguments"), f"{where}.tool_calls[{j}]"), call))
    return out


def stop_sequences(stop: Any) -> list[str]:
    """OpenAI's ``stop`` (a string or a list of strings) as a list.

    Raises:
        RelayError: ``invalid_request`` naming ``stop``.
    """
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise RelayError("invalid_request", "'stop' must be a string or a list of strings",
                     param="stop")


class CloudAdapter(HTTPAdapter):
    """An HTTP adapter whose provider takes a key from the environment."""

    default_base_url: ClassVar[str]
    default_key_env: ClassVar[str]

    def __init__(self, provider: Any) -> None:
        super().__init__(provider)
        self.base_url = (self.settings.base_url or self.default_base_url).rstrip("/")
        self.key_env = self.key_env_for(self.settings)
        key = os.environ.get(self.key_env) or ""
        self.headers: dict[str, str] = {"user-agent": "relay", **self.key_headers(key)}
        self.headers.update(self.settings.headers)
        self.key_missing = not key

    def key_headers(self, key: str) -> dict[str, str]:
        """The headers that carry the key (never logged, never recorded)."""
        raise NotImplementedError

    # --- what the kind declares -------------------------------------------------------------
    @classmethod
    def key_env_for(cls, settings: Any) -> str:
        return settings.api_key_env or cls.default_key_env

    @classmethod
    def describe_settings(cls, settings: Any) -> str:
        base = settings.base_url or cls.default_base_url
        proxy = f", proxy {settings.proxy}" if settings.proxy else ""
        return f"base_url {base}, key from {settings.api_key_env or cls.default_key_env}{proxy}"

    @classmethod
    def settings_problems(cls, settings: Any) -> list[tuple[str, str]]:
        url = settings.base_url or ""
        if url and not url.startswith(("http://", "https://")):
            return [("base_url", f"must start with http:// or https://: {url!r}")]
        return []

    # --- requests (the pooled client and its life are HTTPAdapter's) ---------------------
    def unreadable(self, what: str, text: str) -> RelayError:
        return RelayError("bad_upstream_response", f"provider {self.name!r} sent {what} relay "
                          f"cannot read: {excerpt(text, 300)!r}", provider=self.name,
                          upstream_message=text)

    async def get_json(self, url: str, what: str) -> Any:
        """GET a JSON document (a model list page), bounded like an answer.

        Raises:
            RelayError: the mapped upstream failure, or ``bad_upstream_response``.
        """
        text = await self.get_text(url, what)
        try:
            return json.loads(text)
        except ValueError as exc:
            raise self.unreadable(f"a {what}", text) from exc
