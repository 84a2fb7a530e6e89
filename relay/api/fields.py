"""The field policy (SPEC A1a) as data: what each adapter kind does with each request field.

Every field a client may send is, for the provider that serves it, one `Treatment`:

- ``PASSED``: the client speaks the provider's own dialect (OpenAI chat → the ``openai``
  adapter, Messages → the ``anthropic`` adapter): the request goes through unchanged;
- ``TRANSLATED``: into the provider's own terms by its adapter, field by field (or
  honoured by relay itself: ``stream_options``);
- ``ADVISORY``: a hint the provider cannot honour (sampling, effort, accounting): dropped
  and reported — ``X-Relay-Ignored-Fields`` and the record's ``ignored_fields`` — or, with
  the provider's ``strict_fields = true``, refused;
- ``NEUTRAL``: a value that asks for nothing (``tools: []``, ``n: 1``, a null): accepted,
  and not sent where it would mean nothing;
- ``REFUSED``: a field whose meaning the answer would silently lose: a 400
  ``unsupported`` naming it — one 400 naming every refused field of the request at once.

Tools on a kind without tool calls (its column refuses ``tools``: the fake, every CLI
tool as a plain answerer): tools only *offered* (no tool call required: ``tool_choice``
absent, ``auto`` or ``none``) are advisory — a model may always answer in text, so
nothing the client asked for is lost — and ``tool_choice``, ``parallel_tool_calls`` and
the tools' own nested fields (Messages' ``tools.defer_loading``, …) follow them into
the drop as neutral; a tool call *required* (``tool_choice`` ``required``/``any``, a
named tool, a named ``function_call``) is refused, with the tools (`tool_call_required`).

The rows. relay's one internal request is OpenAI's chat shape, so every dialect's fields
end in one of two places: a chat-level param (`CHAT_FIELDS`; a Messages
``stop_sequences`` becomes ``stop``, a Responses ``max_output_tokens`` ``max_tokens``, and
the report names the client's field through `relay.vocab.events.Inbound.names`), or a
field of the dialect's own with no chat-level equivalent (`OWN_FIELDS`, by dialect:
Messages' ``thinking``, ``context_management``, …), which never reaches a provider of
another dialect. Fields relay reads itself (``model``, ``messages``, ``stream``,
``fallbacks``, …) are `RELAY_FIELDS`. A value that asks for nothing is neutral for
whoever serves it (`FieldInfo.neutral`).

The columns. Each adapter kind declares its own `Column` (``Adapter.fields``): the
dialect it speaks natively, a `Rule` for every chat-level field, what it does with a
chat-level field this table does not know (``openai`` passes it; the others refuse it),
and overrides of the own fields' treatment by a provider of another dialect
(`FieldInfo.elsewhere`). `admit` sorts one call by a column. A dialect is extended by
adding its own fields to `OWN_FIELDS` (and its relay fields to `RELAY_FIELDS`); the
test that walks every field of every dialect through every adapter kind
(tests/adapters/test_field_policy.py) fails on a field without a treatment.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from relay.vocab.errors import RelayError
from relay.vocab.events import Call

# layers: long because the policy is one table read whole: its rows (every dialect's own
# fields among them), the columns, and the sort of one call by a column.

__all__ = ["ACCOUNTING", "ADVISORY", "CHAT_FIELDS", "EFFORT", "LIMITS", "NEUTRAL",
           "OLLAMA_OPTIONS", "OUTPUT", "OWN_FIELDS", "PASSED", "REFUSED", "RELAY_FIELDS",
           "SAMPLING", "TOOLS", "TRANSLATED", "Admitted", "Column", "FieldInfo", "Rule",
           "Treatment", "admit", "column", "refusal_of", "tool_call_required"]


class Treatment(enum.Enum):
    PASSED = "passed"
    TRANSLATED = "translated"
    ADVISORY = "advisory"
    NEUTRAL = "neutral"
    REFUSED = "refused"


PASSED, TRANSLATED = Treatment.PASSED, Treatment.TRANSLATED
ADVISORY, NEUTRAL, REFUSED = Treatment.ADVISORY, Treatment.NEUTRAL, Treatment.REFUSED

# (the field's value, every chat-level param of the call) → whether it asks for nothing
Neutral = Callable[[Any, Mapping[str, Any]], bool]


def _is(*values: Any) -> Neutral:
    return lambda value, params: any(type(value) is type(v) and value == v for v in values)


def _without(key: str, *values: Any) -> Neutral:
    """Neutral without ``key`` (tools): any value when ``values`` is empty, else those."""
    return lambda value, params: not params.get(key) and (
        not values or any(value == v for v in values))


@attrs.frozen
class FieldInfo:
    """One row: a field, what it asks for, when its value asks for nothing, and (for a
    dialect's own fields) its treatment by a provider of another dialect."""

    what: str
    neutral: Neutral | None = None
    elsewhere: Treatment = REFUSED


@attrs.frozen
class Rule:
    """A column's treatment of one field; ``neutral`` adds values that ask this kind for
    nothing (Gemini calls tools in parallel anyway: ``parallel_tool_calls: true``)."""

    treatment: Treatment
    neutral: Neutral | None = None


# --- the rows -------------------------------------------------------------------------------

# OpenAI chat's request fields: relay's internal request. Grouped as the columns use them.
SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed")
EFFORT = ("reasoning_effort", "verbosity")
ACCOUNTING = ("user", "metadata", "safety_identifier", "store", "service_tier",
              "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
              "prediction")
LIMITS = ("max_tokens", "max_completion_tokens")
TOOLS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
OUTPUT = ("stop", "n", "logprobs", "top_logprobs", "logit_bias", "response_format",
          "modalities", "audio", "web_search_options", "moderation")

# Ollama's options (SPEC A10) that have no chat-level field: how a local model is loaded
# and sampled. The ones that have (temperature, top_p, top_k, seed, num_predict, stop, the
# penalties) become chat-level params.
OLLAMA_OPTIONS = {name: f"a local model's {what}" for name, what in (
    ("num_ctx", "context window"), ("num_keep", "kept prompt tokens"),
    ("num_batch", "batch size"), ("num_gpu", "layers on the GPU"), ("main_gpu", "GPU"),
    ("num_thread", "CPU threads"), ("numa", "NUMA placement"), ("low_vram", "low-VRAM mode"),
    ("f16_kv", "half-float cache"), ("logits_all", "logits"), ("vocab_only", "vocabulary"),
    ("use_mmap", "memory mapping"), ("use_mlock", "memory lock"),
    ("embedding_only", "embedding-only load"), ("min_p", "min-p sampling"),
    ("typical_p", "typical sampling"), ("tfs_z", "tail-free sampling"),
    ("repeat_last_n", "repeat window"), ("repeat_penalty", "repeat penalty"),
    ("mirostat", "Mirostat sampling"), ("mirostat_tau", "Mirostat target"),
    ("mirostat_eta", "Mirostat rate"), ("penalize_newline", "newline penalty"))}

CHAT_FIELDS: dict[str, FieldInfo] = {
    "temperature": FieldInfo("sampling temperature"),
    "top_p": FieldInfo("nucleus sampling"),
    "top_k": FieldInfo("top-k sampling (vLLM, llama.cpp; Messages' top_k)"),
    "presence_penalty": FieldInfo("a penalty on tokens present", _is(0, 0.0)),
    "frequency_penalty": FieldInfo("a penalty on frequent tokens", _is(0, 0.0)),
    "seed": FieldInfo("best-effort deterministic sampling"),
    "reasoning_effort": FieldInfo("how hard a reasoning model thinks"),
    "verbosity": FieldInfo("how long the answer should be"),
    "user": FieldInfo("an end-user id for abuse monitoring"),
    "metadata": FieldInfo("tags stored with the completion", _is({})),
    "safety_identifier": FieldInfo("an end-user id for abuse monitoring"),
    "store": FieldInfo("store the completion at the provider", _is(False)),
    "service_tier": FieldInfo("the provider's processing tier"),
    "prompt_cache_key": FieldInfo("a prompt-cache routing key"),
    "prompt_cache_retention": FieldInfo("how long the prompt cache lives"),
    "prompt_cache_options": FieldInfo("prompt-cache options"),
    "prediction": FieldInfo("predicted output, for latency"),
    "max_tokens": FieldInfo("a bound on the answer's length"),
    "max_completion_tokens": FieldInfo("a bound on the answer's length"),
    "stream_options": FieldInfo("stream options (include_usage: relay honours it)"),
    "tools": FieldInfo("tool definitions", _is([])),
    "tool_choice": FieldInfo("how tools are chosen", _without("tools", "auto", "none")),
    "parallel_tool_calls": FieldInfo("tool calls at once", _without("tools")),
    "functions": FieldInfo("tool definitions (deprecated form)", _is([])),
    "function_call": FieldInfo("how functions are chosen (deprecated form)",
                               _without("functions", "auto", "none")),
    "stop": FieldInfo("stop sequences", _is([])),
    "n": FieldInfo("how many answers", _is(1)),
    "logprobs": FieldInfo("token log probabilities", _is(False)),
    "top_logprobs": FieldInfo("alternatives per token", _is(0)),
    "logit_bias": FieldInfo("biases on given tokens", _is({})),
    "response_format": FieldInfo("a JSON answer or schema", _is({"type": "text"})),
    "modalities": FieldInfo("output kinds", _is(["text"])),
    "audio": FieldInfo("an audio answer"),
    "web_search_options": FieldInfo("the provider's own web search"),
    "moderation": FieldInfo("the provider's moderation of the answer"),
}

# Each dialect's own fields (no chat-level equivalent), with their treatment by a
# provider of another dialect; nested ones by a dotted name.
OWN_FIELDS: dict[str, dict[str, FieldInfo]] = {
    "anthropic": {
        "thinking": FieldInfo("extended thinking", _is({"type": "disabled"}), ADVISORY),
        "content.thinking": FieldInfo("thinking blocks passed back", None, ADVISORY),
        "content.redacted_thinking": FieldInfo("redacted thinking passed back", None,
                                               ADVISORY),
        "cache_control": FieldInfo("prompt-cache markers", None, ADVISORY),
        "context_management": FieldInfo("server-side context edits", None, ADVISORY),
        "output_config.effort": FieldInfo("how hard the model works", None, ADVISORY),
        "service_tier": FieldInfo("Anthropic's capacity tier", None, ADVISORY),
        "inference_geo": FieldInfo("where the model runs", None, ADVISORY),
        "speed": FieldInfo("fast output mode", None, ADVISORY),
        "diagnostics": FieldInfo("prompt-cache diagnostics", None, ADVISORY),
        "user_profile_id": FieldInfo("whom the request is made for", None, ADVISORY),
        "workspace_id": FieldInfo("the Anthropic workspace", None, ADVISORY),
        "tools.defer_loading": FieldInfo("tools loaded on demand", None, ADVISORY),
        "tools.eager_input_streaming": FieldInfo("tool input streamed early", None,
                                                 ADVISORY),
        "tools.input_examples": FieldInfo("example tool inputs", None, ADVISORY),
        "tools.allowed_callers": FieldInfo("who may call a tool", None, REFUSED),
        "container": FieldInfo("a code-execution container", None, REFUSED),
        "mcp_servers": FieldInfo("MCP servers Anthropic connects to", None, REFUSED),
    },
    "gemini": {  # SPEC A9 (relay.dialects.gemini_generate)
        "generationConfig.thinkingConfig": FieldInfo("how much the model thinks", None,
                                                     ADVISORY),
        "generationConfig.responseModalities": FieldInfo(
            "output kinds", lambda value, params: value in (["TEXT"], ["text"]), REFUSED),
        "generationConfig.mediaResolution": FieldInfo("how finely media are read", None,
                                                      ADVISORY),
        "contents.thought": FieldInfo("thought parts passed back", None, ADVISORY),
        "contents.thoughtSignature": FieldInfo("thought signatures passed back", None,
                                               ADVISORY),
        "safetySettings": FieldInfo("Gemini's safety filter thresholds", None, ADVISORY),
        "labels": FieldInfo("billing labels", None, ADVISORY),
        "serviceTier": FieldInfo("Gemini's processing tier", None, ADVISORY),
        "cachedContent": FieldInfo("a context cache stored at Google", None, REFUSED),
        "tools.googleSearch": FieldInfo("Google Search grounding", None, REFUSED),
        "tools.codeExecution": FieldInfo("code run by Google", None, REFUSED),
        "tools.urlContext": FieldInfo("pages fetched by Google", None, REFUSED),
    },
    "ollama": {  # SPEC A10 (relay.dialects.ollama); no provider speaks it
        "think": FieldInfo("the model's thinking, on or off", _is(False), ADVISORY),
        "keep_alive": FieldInfo("how long the model stays loaded", None, ADVISORY),
        "messages.thinking": FieldInfo("thinking passed back", None, ADVISORY),
        "template": FieldInfo("the model's prompt template", _is(""), ADVISORY),
        "raw": FieldInfo("the prompt without the model's template", _is(False), ADVISORY),
        "context": FieldInfo("an earlier answer's token context", _is([]), ADVISORY),
        "suffix": FieldInfo("the text after the answer (fill-in-the-middle)", _is(""),
                            REFUSED),
        **{f"options.{name}": FieldInfo(what, None, ADVISORY)
           for name, what in OLLAMA_OPTIONS.items()},
    },
}

# What relay reads itself, per dialect: never a provider's business.
RELAY_FIELDS: dict[str, frozenset[str]] = {
    "openai": frozenset({"model", "messages", "stream", "fallbacks"}),
    "anthropic": frozenset({"model", "messages", "system", "stream", "fallbacks"}),
}


# --- the columns ----------------------------------------------------------------------------

@attrs.frozen
class Column:
    """One adapter kind's treatment of every field (see the module docstring)."""

    speaks: str | None
    rules: Mapping[str, Rule]
    unknown: Treatment
    own: Mapping[tuple[str, str], Treatment] = attrs.field(factory=dict)

    def offered_only(self, params: Mapping[str, Any]) -> bool:
        """Whether this kind (without tool calls) drops the call's tools as advisory: they
        are only offered, no tool call is required (the module docstring)."""
        rule = self.rules.get("tools")
        return rule is not None and rule.treatment is REFUSED and \
            not tool_call_required(params)

    def treat(self, name: str, value: Any, params: Mapping[str, Any]) -> Treatment:
        """A chat-level param's treatment, its value considered."""
        info = CHAT_FIELDS.get(name)
        rule = self.rules.get(name) if info is not None else None
        if value is None or (info is not None and info.neutral is not None
                             and info.neutral(value, params)) or (
                rule is not None and rule.neutral is not None and rule.neutral(value, params)):
            return NEUTRAL
        if name in _TOOL_GROUP and self.offered_only(params):
            return ADVISORY if name in _DEFINITIONS else NEUTRAL
        return rule.treatment if rule is not None else self.unknown

    def treat_own(self, dialect: str, name: str, value: Any,
                  params: Mapping[str, Any]) -> Treatment:
        """A dialect's own field's treatment by this kind (which does not speak it)."""
        info = OWN_FIELDS.get(dialect, {}).get(name)
        if value is None or (info is not None and info.neutral is not None
                             and info.neutral(value, params)):
            return NEUTRAL
        if name.startswith("tools.") and self.offered_only(params):
            return NEUTRAL  # dropped with the tools it belongs to
        own = self.own.get((dialect, name))
        if own is not None:
            return own
        return info.elsewhere if info is not None else REFUSED


# Tool definitions, and the fields that only say how they are used.
_DEFINITIONS = frozenset({"tools", "functions"})
_TOOL_GROUP = frozenset(TOOLS)


def tool_call_required(params: Mapping[str, Any]) -> bool:
    """Whether a chat-level request requires a tool call (not only offers tools):
    ``tool_choice`` ``required`` (Messages' ``any``, Responses' ``required``), a named
    tool, ``allowed_tools`` in ``required`` mode, or a named ``function_call``."""
    choice = params.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") == "allowed_tools":
            allowed = choice.get("allowed_tools")
            mode = allowed.get("mode") if isinstance(allowed, dict) else choice.get("mode")
            return mode == "required"
        return True
    if choice in ("required", "any"):
        return True
    return isinstance(params.get("function_call"), dict)


def column(*, speaks: str | None = None, unknown: Treatment = REFUSED,
           passed: Iterable[str] = (), translated: Iterable[str] = (),
           advisory: Iterable[str] = (), refused: Iterable[str] = (),
           rules: Mapping[str, Rule] | None = None,
           own: Mapping[tuple[str, str], Treatment] | None = None) -> Column:
    """A column from groups of field names (a name in two groups is a mistake)."""
    out: dict[str, Rule] = {}
    groups = [(PASSED, passed), (TRANSLATED, translated), (ADVISORY, advisory),
              (REFUSED, refused)]
    for treatment, names in groups:
        for name in names:
            if name in out:
                raise ValueError(f"field {name!r} is in two groups of one column")
            out[name] = Rule(treatment)
    for name, rule in (rules or {}).items():
        if name in out:
            raise ValueError(f"field {name!r} has a group and a rule")
        out[name] = rule
    return Column(speaks=speaks, rules=out, unknown=unknown, own=dict(own or {}))


# --- sorting one call -----------------------------------------------------------------------

@attrs.frozen
class Admitted:
    """A call as one provider takes it: ``call`` holds only the fields it honours, and
    ``ignored`` names (as the client does) the advisory fields it dropped, in order."""

    call: Call
    ignored: tuple[str, ...] = ()


def admit(policy: Column, call: Call, *, provider: str, kind: str,
          strict: bool = False) -> Admitted:
    """Sort ``call``'s fields by ``policy``.

    Raises:
        RelayError: ``unsupported`` naming every refused field at once (the advisory
            ones too when ``strict``).
    """
    inbound = call.inbound
    if policy.speaks == inbound.dialect:
        return Admitted(call)  # the client speaks the provider's dialect: all passed
    ignored: list[str] = []
    refused: list[str] = []

    def drop(name: str, treatment: Treatment) -> None:
        if treatment is REFUSED or (treatment is ADVISORY and strict):
            if name not in refused:
                refused.append(name)
        elif treatment is ADVISORY and name not in ignored:
            ignored.append(name)

    kept: dict[str, Any] = {}
    for name, value in call.params.items():
        treatment = policy.treat(name, value, call.params)
        if treatment in (PASSED, TRANSLATED):
            kept[name] = value
        else:
            drop(inbound.names.get(name, name), treatment)
    for name, value in inbound.own.items():
        treatment = policy.treat_own(inbound.dialect, name, value, call.params)
        if treatment not in (PASSED, TRANSLATED):  # the adapter reads a translated one
            drop(name, treatment)
    if refused:
        raise _refusal(refused, provider, kind, strict=strict)
    # Nothing of the client's own request goes on to a provider of another dialect.
    sorted_call = attrs.evolve(call, params=kept, inbound=attrs.evolve(
        inbound, body=None, headers={}))
    return Admitted(sorted_call, tuple(ignored))


def _refusal(names: list[str], provider: str, kind: str, *, strict: bool) -> RelayError:
    """One refusal naming every refused field (``param``: their top-level fields, joined
    by ``, ``)."""
    fields = ", ".join(repr(n) for n in names)
    what = f"the request field {fields}" if len(names) == 1 else f"the request fields {fields}"
    it = "it" if len(names) == 1 else "them"
    if strict:
        why = (f"provider {provider!r} ({kind}) has strict_fields = true and cannot "
               f"honour {what}; remove {it}, or choose another provider")
    else:
        why = (f"provider {provider!r} ({kind}) cannot honour {what}; remove {it} or "
               "choose another provider")
    if any(n in _DEFINITIONS or n.startswith("tool") for n in names):
        why += (" (tools only offered are dropped on a provider without tool calls; a "
                "tool call required by tool_choice is refused)")
    params = list(dict.fromkeys(_param(n) for n in names))
    return RelayError("unsupported", why, provider=provider, param=", ".join(params))


def refusal_of(errors: Iterable[RelayError]) -> RelayError:
    """Several refusals of one request as one: every field named (SPEC A1a). One error
    is itself; ``unsupported`` wins over ``invalid_request`` for the reason."""
    errors = list(errors)
    if len(errors) == 1:
        return errors[0]
    first = errors[0]
    params = list(dict.fromkeys(p for e in errors if e.param for p in e.param.split(", ")))
    reason = "unsupported" if any(e.reason == "unsupported" for e in errors) else first.reason
    return RelayError(reason, "; ".join(dict.fromkeys(e.message for e in errors)),
                      provider=first.provider, param=", ".join(params) or None)


def _param(name: str) -> str:
    """The top-level field a (possibly nested) field name lives in."""
    head = name.partition(".")[0]
    return "messages" if head == "content" else head
