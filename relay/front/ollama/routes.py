"""Ollama's paths (SPEC A10): every request under ``/api/``, and ``/`` on
``[server] ollama_port``, answered in Ollama's shapes.

==========================================  ===============================================
``GET /`` (on ``ollama_port``; HEAD too)     ``Ollama is running`` (what apps probe)
``GET /api/version``                        `VERSION`
``GET /api/tags``                           every route and provider/model (those the
                                            client may use: SPEC L14)
``POST /api/show``                          one of them: its capabilities (the adapter's,
                                            `relay.api.adapter.Capabilities`) and context
                                            length
``GET /api/ps``                             the models with requests running or queued now
``POST /api/chat``, ``/api/generate``         chat (`relay.front.ollama.handlers`)
``POST /api/embed``, ``/api/embeddings``      embeddings
``/api/pull``, ``push``, ``create``,           an Ollama-shaped 400: relay relays requests and
``copy``, ``delete``, ``blobs/…``              stores no models
==========================================  ===============================================

The model lists are polled answers (never recorded, as ``/v1/models``); the chat and
embeddings requests are relay routes, each one `Exchange` (record, lanes, stops,
disconnects) in the Ollama dialect. A name a client sends with ``:latest`` appended is
the name without it unless something is known by the longer one (`resolve_name`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from relay.config import ClientConfig
from relay.dialects.ollama import OLLAMA, OllamaDialect
from relay.dialects.openai_chat import load_json
from relay.engine.engine import Engine
from relay.engine.plan import make_plan
from relay.vocab.errors import RelayError

from ..asgi import Receive, Scope, Send, send_error, send_json
from ..exchange import Exchange
from ..info import client_of, find_model, refresh_models
from .handlers import OllamaChat, OllamaEmbed, resolve_name

__all__ = ["VERSION", "serve_ollama"]

logger = logging.getLogger(__name__)

# The Ollama version relay answers as: at or above what the newest Ollama clients gate
# on (VS Code's Ollama provider refuses below 0.6.4; apps turn on `think`, tool calls
# and `/api/show` capabilities by version), and a release whose API relay serves.
VERSION = "0.12.0"
# The context length `/api/show` reports when the adapter kind does not know its models'
# (the fake, the CLI tools): what most current models hold at least.
DEFAULT_CONTEXT = 32768
_STORED = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete")
_EPOCH = "1970-01-01T00:00:00Z"  # relay stores no model: it has no modification time


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _details(family: str) -> dict[str, Any]:
    return {"parent_model": "", "format": "relay", "family": family, "families": [family],
            "parameter_size": "", "quantization_level": ""}


def _entry(name: str, family: str) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": _EPOCH, "size": 0,
            "digest": _digest(name), "details": _details(family)}


async def _tags(relay: Engine, client: ClientConfig) -> dict[str, Any]:
    """Every route (a pattern route by its pattern) and provider/model the client may
    use."""
    await refresh_models(relay)
    models = [_entry(route, "relay") for route in relay.config.routes]
    models += [_entry(ident, relay.providers[ident.partition("/")[0]].config.adapter)
               for ident in relay.model_ids()]
    return {"models": [m for m in models if client.may_use(m["name"])]}


async def _ps(relay: Engine, client: ClientConfig) -> dict[str, Any]:
    """The models with requests in flight (running, queued or stopping), once each;
    those the client may use."""
    seen: dict[str, dict[str, Any]] = {}
    for provider in relay.providers.values():
        for request in provider.requests(relay.clock):
            name = request.get("route") or f"{provider.name}/{request['model']}"
            if name not in seen and client.may_use(name):
                seen[name] = {**_entry(name, provider.config.adapter), "size_vram": 0,
                              "expires_at": _EPOCH, "context_length": _context(provider)}
    return {"models": list(seen.values())}


def _context(provider: Any) -> int:
    return int(provider.adapter.capabilities.context_tokens) or DEFAULT_CONTEXT


async def _show(relay: Engine, client: ClientConfig,
                body: bytes) -> dict[str, Any] | RelayError:
    data = load_json(body)
    name = (data.get("model") or data.get("name")) if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        return RelayError("invalid_request", "'model' is required: a name /api/tags lists",
                          param="model")
    await refresh_models(relay)
    name = resolve_name(relay, name)
    found = await find_model(relay, client, name)
    if isinstance(found, RelayError):
        return found
    provider = make_plan(relay, name, None).targets[0].provider
    can = provider.adapter.capabilities
    capabilities = ["completion"] + [word for word, able in (
        ("tools", can.tools), ("vision", can.vision), ("embedding", can.embeddings),
        ("thinking", can.thinking)) if able]
    kind = provider.config.adapter
    return {"modelfile": f"# {name}: served through relay by provider {provider.name} "
                         f"({kind})\n",
            "parameters": "", "template": "", "license": "", "modified_at": _EPOCH,
            "details": _details(kind),
            "model_info": {"general.architecture": "relay", "general.basename": name,
                           "relay.context_length": _context(provider)},
            "capabilities": capabilities}


async def _version(relay: Engine, client: ClientConfig) -> dict[str, Any]:
    return {"version": VERSION}


_GETS: dict[str, Callable[[Engine, ClientConfig], Any]] = {"/api/tags": _tags, "/api/ps": _ps,
                                              "/api/version": _version}


async def serve_ollama(relay: Engine, scope: Scope, receive: Receive, send: Send,
                       body: bytes, refused: Callable[[Scope, RelayError], None]) -> None:
    """Answer one request on Ollama's paths (see the module docstring); ``refused``
    records a relay route's request refused before its exchange."""
    path, method = scope["path"], scope["method"]
    if path == "/":
        await _root(send, head=method == "HEAD")
        return
    if path in _STORED or path.startswith("/api/blobs/"):
        await serve_stored(send, path)
        return
    handler: Any = None
    wanted = "POST"
    if path in ("/api/chat", "/api/generate"):
        handler = OllamaChat()
    elif path in ("/api/embed", "/api/embeddings"):
        handler = OllamaEmbed(old=path == "/api/embeddings")
    elif path in _GETS or path == "/api/show":
        wanted = "GET" if path in _GETS else "POST"
    if method != wanted and not (method == "HEAD" and wanted == "GET"):
        error = RelayError("invalid_request", f"use {wanted} for {path}", status=405)
        if handler is not None:
            refused(scope, error)
        await send_error(send, error, OLLAMA)
        return
    if handler is not None:
        dialect = OllamaDialect(generate=path == "/api/generate")
        await Exchange(relay, scope, receive, send, dialect).serve(body, handler)
        return
    await _answer(relay, scope, send, body)


async def _answer(relay: Engine, scope: Scope, send: Send, body: bytes) -> None:
    path = scope["path"]
    try:
        client = client_of(relay, scope)
        answer = await (_show(relay, client, body) if path == "/api/show"
                        else _GETS[path](relay, client))
    except RelayError as exc:
        answer = exc
    except Exception as exc:  # a bug: still an Ollama-shaped error, never a bare 500
        logger.error("%s crashed", path, exc_info=exc)
        answer = RelayError("internal_error", f"relay failed unexpectedly "
                            f"({type(exc).__name__}); see its log")
    if isinstance(answer, RelayError):
        await send_error(send, answer, OLLAMA)
    else:
        await send_json(send, 200, answer)


async def serve_stored(send: Send, path: str) -> None:
    """``/api/pull`` and the other calls that manage local weights."""
    verb = path.removeprefix("/api/").partition("/")[0]
    await send_error(send, RelayError(
        "unsupported", f"relay relays requests to providers and does not store models, so "
        f"it cannot {verb} one (/api/{verb}). Use a name GET /api/tags lists: a route, or "
        "PROVIDER/MODEL of a configured provider"), OLLAMA)


async def _root(send: Send, *, head: bool) -> None:
    text = b"Ollama is running"
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(text)).encode())]})
    await send({"type": "http.response.body", "body": b"" if head else text})
