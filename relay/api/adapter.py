"""The adapter contract: what an adapter kind declares and what an instance does.

An adapter kind is one class: its ``kind`` (the registry key), its ``Settings`` (an attrs
class of the keys its providers take beyond the common ones), its `Capabilities`, and its
own recommended profile, longest call and typical call (SPEC L2, L3: there is no global
default). An instance serves one provider:

- ``async with adapter:`` opens what it holds for its life (an HTTP client, a pool of
  warm processes) inside relay's own nursery;
- ``admit(call)`` sorts the call's fields by the kind's column of the field policy
  (``fields``, `relay.api.fields`, SPEC A1a) and its own checks (``check_request``):
  it refuses, before anything is queued, a field it cannot honour (``unsupported``),
  drops the advisory ones and says which (never dropping one silently), and returns the
  call as the kind takes it; ``check_call(call)`` is the same, for its refusals only;
- ``run(call, events)`` sends `relay.vocab.events` to ``events`` and returns when the
  answer is complete, or raises `RelayError`. Every await in it is cancellable, and a
  cancel closes the upstream (HTTP: by leaving ``async with client.stream``; CLI:
  interrupt, grace, kill). It runs inside its lane's slot, so the slot is released only
  after it returns.

Beyond chat, a kind may declare (in its `Capabilities`, which the front asks before it
calls anything) that it makes embeddings — ``check_embed(call)`` then ``embed(call)``,
SPEC A8 — or counts tokens with the provider's own counter — ``count_tokens(call)``,
SPEC A6. Both answer whole, under the same rules as ``run``: cancellable, `RelayError`
on failure. A kind that does not declare them is never asked; the defaults here only
make a wrong call loud.

This module, `relay.api.http` and `relay.api.body` are the adapter API: with the vocabulary
(`relay.vocab`), they are all of relay an adapter may import.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, ClassVar
from urllib.parse import urlsplit

import attrs

from relay.vocab.events import Call, EventSink
from relay.vocab.profile import Profile, ProviderConfig

from .fields import Admitted, Column, admit, column

__all__ = ["Adapter", "Admitted", "Capabilities", "EmbedCall", "Embeddings"]


@attrs.frozen(kw_only=True)
class Capabilities:
    """What an adapter kind can do beyond plain chat, so the dialects ask instead of
    catching failures.

    tools: takes tool definitions and answers with tool calls. prefill: can continue
    from an assistant prefill (the provider's ``prefill`` key may still turn it off).
    embeddings: ``POST /v1/embeddings`` (SPEC A8). count_tokens: the provider's own token
    counter (SPEC A6). responses: can take an OpenAI Responses request as it is (SPEC A7).
    vision: takes image parts. thinking: its models may think (reasoning text, an effort).
    context_tokens: the context window its usual models hold (0: relay does not know).
    The last three are what Ollama's ``/api/show`` lists (SPEC A10).

    A kind declares its own; an instance may narrow them from its settings (the
    ``openai`` adapter's ``responses`` key), so the front asks the instance.
    """

    tools: bool = False
    prefill: bool = False
    embeddings: bool = False
    count_tokens: bool = False
    responses: bool = False
    vision: bool = False
    thinking: bool = False
    context_tokens: int = 0


@attrs.frozen(kw_only=True)
class EmbedCall:
    """One embeddings request, as an adapter sees it (SPEC A8).

    ``inputs`` holds one entry per vector wanted, in order: a text, or a list of token
    ids (OpenAI's token-array input). ``params`` holds the request's other fields as the
    client sent them (``dimensions``, ``user``, a server's own ``input_type``, …), except
    ``encoding_format``: relay asks every provider for floats and encodes the answer for
    the client itself.
    """

    request_id: str
    provider: str
    model: str
    inputs: list[str] | list[list[int]]
    params: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class Embeddings:
    """An embeddings answer: one vector per input, in the inputs' order; the prompt
    tokens the provider reported (None when it reports none); and the request fields the
    adapter dropped as advisory (they asked for nothing it could do), for the
    ``X-Relay-Ignored-Fields`` header."""

    vectors: list[list[float]]
    prompt_tokens: int | None = None
    ignored: tuple[str, ...] = ()


class Adapter:
    kind: ClassVar[str]
    Settings: ClassVar[type[Any]]
    capabilities: Capabilities = Capabilities()  # the kind's; an instance may set its own
    # This kind's column of the field policy (SPEC A1a): every kind declares its own (a
    # kind that does not refuses every field).
    fields: ClassVar[Column] = column()

    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider
        self.name = provider.name
        self.settings = provider.settings

    # --- what the kind declares (used by config validation) -----------------------------
    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile | None:
        """This kind's own profile for these settings, or None (then the file must give
        every field)."""
        return None

    @classmethod
    def max_call_s(cls, settings: Any) -> float:
        """The longest a legitimate call may take; ``run_timeout_s`` may not be shorter."""
        return 0.0

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        return 10.0

    @classmethod
    def describe_settings(cls, settings: Any) -> str:
        """One line for ``relay config check`` (never a secret)."""
        return ""

    @classmethod
    def settings_problems(cls, settings: Any) -> list[tuple[str, str]]:
        """(key, what is wrong) for settings that are well typed but still wrong."""
        return []

    @classmethod
    def secret_envs(cls, settings: Any) -> list[str]:
        """The environment variables that hold this provider's secrets (its key)."""
        return []

    @classmethod
    def secret_values(cls, settings: Any) -> list[str]:
        """Secret values the settings hold (SPEC E1): every value of a ``headers`` or
        ``env`` table, the ``proxy`` URL and its password."""
        values: list[str] = []
        for table in ("headers", "env"):
            values += [str(v) for v in (getattr(settings, table, None) or {}).values()]
        proxy = getattr(settings, "proxy", None)
        if proxy:
            values.append(proxy)
            password = urlsplit(proxy).password
            if password:
                values.append(password)
        return values

    # --- an instance's life -----------------------------------------------------------------
    async def __aenter__(self) -> Adapter:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def admit(self, call: Call) -> Admitted:
        """``call`` as this provider takes it: sorted by the field policy (advisory fields
        dropped and named; refused under the provider's ``strict_fields``), then checked
        by `check_request`.

        Raises:
            RelayError: ``unsupported`` (or ``invalid_request``) naming the field.
        """
        admitted = admit(self.fields, call, provider=self.name, kind=self.kind,
                         strict=self.provider.strict_fields)
        self.check_request(admitted.call)
        return admitted

    def check_call(self, call: Call) -> None:
        """Raise ``unsupported`` for a field this kind cannot honour (`admit`'s refusals)."""
        self.admit(call)

    def check_request(self, call: Call) -> None:
        """The kind's own checks of an admitted call: what it cannot translate (a content
        part, a role). Pure; raises `RelayError`."""

    def listed_name(self, model: str) -> str:
        """The name under which ``model`` would be listed (the fake strips its options)."""
        return model

    async def run(self, call: Call, events: EventSink) -> None:
        raise NotImplementedError

    # --- beyond chat: only called when `capabilities` says so -------------------------------
    def check_embed(self, call: EmbedCall) -> None:
        """Raise ``unsupported`` (or ``invalid_request``) for an embeddings request this
        kind cannot send, before anything is queued."""

    async def embed(self, call: EmbedCall) -> Embeddings:
        """The vectors for ``call.inputs`` (``capabilities.embeddings``)."""
        raise NotImplementedError(f"the {self.kind!r} adapter makes no embeddings")

    async def count_tokens(self, call: Call) -> int:
        """The input tokens ``call`` would take, by the provider's own counter
        (``capabilities.count_tokens``); never an estimate."""
        raise NotImplementedError(f"the {self.kind!r} adapter has no token counter")

    async def models(self) -> list[str]:
        """Discover the provider's models (may raise `RelayError`)."""
        return list(self.provider.models)
