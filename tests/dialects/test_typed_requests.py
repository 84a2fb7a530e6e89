"""Typed requests (issue 27): every field of every front, with wrong types and edge values,
to every adapter kind, through the assembled relay — a 4xx naming the field, never a 5xx,
a hang or a leaked lane.

One relay serves every adapter kind for the whole module (the fake; ``openai``,
``anthropic`` and ``gemini`` adapters in front of this suite's fake upstreams; the three
CLI-tool adapters with the fake CLI programs as real subprocesses), running in a thread
of its own (its own ``trio.run``), so that Hypothesis drives plain synchronous tests
against it and every example reuses it. After each test its lanes must be idle, and
after the module no tool process may outlive it (`cli_procs.open_cli_relay`).

The fields come from the dialects' own schemas (`relay.dialects.schemas`): every field
and the fields nested in them (``tools[0].function.name``, ``messages[0].content``), so
a field added to a schema is swept here at once. `FRONTS` lists the fronts; a further
dialect is one more line there (its path, with ``{model}`` where the model goes in the
path, a minimal body, its schema, the kinds it is sent to).

- `test_every_field_with_a_wrong_type`: each field with a value of a JSON type its spec
  does not take, to every kind: a 400 ``invalid_request`` naming that field's path,
  in the front's own shape (every schema field is reached, nothing is sampled);
- `test_wrong_types_and_edge_values`: Hypothesis draws a front, a kind, a field and a
  value (strings for numbers, numbers for strings, null, nested objects, huge and
  negative numbers, empty arrays, booleans; ``derandomize``: the same examples each run)
  and the answer must be a 2xx, or a 4xx naming the field — never a 5xx, an in-band
  ``internal_error``, or a hang.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import serve_fake_anthropic
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import serve_fake_gemini
from fakes.upstream import serve_fake_upstream
from helpers.assembled import lane_idle
from helpers.cli_procs import open_cli_relay
from helpers.cloud_helpers import every_kind_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay import Served
from relay.api.fields import CHAT_FIELDS, OWN_FIELDS
from relay.dialects.schemas import (
    CHAT_SCHEMA,
    EMBEDDINGS_SCHEMA,
    GEMINI_SCHEMA,
    MESSAGES_SCHEMA,
    OLLAMA_CHAT_SCHEMA,
    OLLAMA_EMBED_SCHEMA,
    OLLAMA_GENERATE_SCHEMA,
    RESPONSES_SCHEMA,
    SCHEMAS,
)
from relay.dialects.typed import ANY, Arr, Bool, Num, Obj, OneOf, Schema, Spec, Str

MODEL = {"fake": "fake/echo", "openai": "up/m1", "anthropic": "ant/claude-x",
         "gemini": "gem/g", "claude-cli": "claude/ok", "codex-cli": "codex/ok",
         "gemini-cli": "gemini/ok"}
KINDS = tuple(MODEL)
HI = [{"role": "user", "content": "hi"}]
GEMINI_HI = [{"role": "user", "parts": [{"text": "hi"}]}]


@attrs.frozen
class Front:
    name: str
    path: str                     # "{model}" where the model goes in the path
    body: dict[str, Any]          # the smallest valid body, without the model
    schema: Schema
    kinds: tuple[str, ...] = KINDS
    models: dict[str, str] = attrs.field(factory=dict)   # a kind's own model here


FRONTS = [
    Front("chat", "/v1/chat/completions", {"messages": HI}, CHAT_SCHEMA),
    Front("messages", "/v1/messages", {"max_tokens": 16, "messages": HI}, MESSAGES_SCHEMA),
    Front("count_tokens", "/v1/messages/count_tokens", {"messages": HI}, MESSAGES_SCHEMA,
          ("gemini",)),
    Front("responses", "/v1/responses", {"input": "hi"}, RESPONSES_SCHEMA),
    Front("embeddings", "/v1/embeddings", {"input": "hi"}, EMBEDDINGS_SCHEMA, ("gemini",),
          {"gemini": "gemb/text-embedding-test"}),
    # (a system instruction already there: a part the skeleton makes holds no kind)
    Front("gemini", "/v1beta/models/{model}:generateContent", {
        "contents": GEMINI_HI, "systemInstruction": {"parts": [{"text": "be brief"}]}},
        GEMINI_SCHEMA),
    # Ollama's API (SPEC A10): answered whole, so that an answer is one JSON body
    Front("ollama", "/api/chat", {"messages": HI, "stream": False}, OLLAMA_CHAT_SCHEMA),
    Front("ollama_generate", "/api/generate", {"prompt": "hi", "stream": False},
          OLLAMA_GENERATE_SCHEMA),
    Front("ollama_embed", "/api/embed", {"input": "hi"}, OLLAMA_EMBED_SCHEMA, ("gemini",),
          {"gemini": "gemb/text-embedding-test"}),
]
# The fake Gemini API's embedding model, as a provider of its own.
EMBEDDER = """
[providers.gemb]
adapter = "gemini"
base_url = "{url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
models = ["text-embedding-test"]
[providers.gemb.profile]
rpm = 0
"""


# --- the fields, from the schemas ---------------------------------------------------------

Key = str | int


def _paths(spec: Spec, keys: tuple[Key, ...], depth: int) -> Iterator[tuple[tuple[Key, ...], Spec]]:
    """Every field inside ``spec`` (objects' keys, arrays' first item), ``depth`` levels."""
    if depth == 0:
        return
    options = spec.specs if isinstance(spec, OneOf) else (spec,)
    for option in options:
        if isinstance(option, Obj):
            for key, child in option.fields.items():
                yield (*keys, key), child
                yield from _paths(child, (*keys, key), depth - 1)
        elif isinstance(option, Arr) and option.item is not ANY:
            yield from _paths(option.item, (*keys, 0), depth)


def fields_of(schema: Schema) -> list[tuple[tuple[Key, ...], Spec]]:
    out: list[tuple[tuple[Key, ...], Spec]] = []
    for name, spec in schema.fields.items():
        out.append(((name,), spec))
        out += _paths(spec, (name,), 2)
    return out


def path_text(keys: tuple[Key, ...]) -> str:
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def skeleton(spec: Spec) -> Any:
    """A small valid value of ``spec`` (to hold a nested field being tried)."""
    if isinstance(spec, OneOf):
        return skeleton(next(s for s in spec.specs if isinstance(s, Obj | Arr)))
    if isinstance(spec, Obj):
        return {k: skeleton(spec.fields.get(k, ANY)) for k in spec.required}
    if isinstance(spec, Arr):
        return [skeleton(spec.item)] if spec.item is not ANY else []
    if isinstance(spec, Str):
        return sorted(spec.choices)[0] if spec.choices else "x"
    if isinstance(spec, Num):
        return spec.lo if spec.lo is not None and spec.lo > 0 else 1
    if isinstance(spec, Bool):
        return False
    return "x"


def put(body: dict[str, Any], keys: tuple[Key, ...], value: Any, schema: Schema) -> None:
    """Set ``keys`` in ``body`` to ``value``, making what holds it from the schema."""
    spec: Spec = ANY
    holder: Any = body
    for i, key in enumerate(keys[:-1]):
        spec = schema.fields[str(key)] if i == 0 else _child(spec, key)
        if isinstance(key, int):
            while len(holder) <= key:
                holder.append(skeleton(spec))
            if not isinstance(holder[key], dict | list):
                holder[key] = skeleton(spec)
            holder = holder[key]
        else:
            current = holder.get(key)
            wanted = list if isinstance(keys[i + 1], int) else dict
            if not isinstance(current, wanted):
                holder[key] = [] if wanted is list else skeleton(_option(spec, dict))
            holder = holder[key]
    last = keys[-1]
    if isinstance(last, int):
        while len(holder) <= last:
            holder.append(None)
    holder[last] = value


def _option(spec: Spec, kind: type) -> Spec:
    if isinstance(spec, OneOf):
        for option in spec.specs:
            if (kind is dict and isinstance(option, Obj)) or (
                    kind is list and isinstance(option, Arr)):
                return option
    return spec


def _child(spec: Spec, key: Key) -> Spec:
    if isinstance(key, int):
        arr = _option(spec, list)
        return arr.item if isinstance(arr, Arr) else ANY
    obj = _option(spec, dict)
    return obj.fields.get(key, obj.rest) if isinstance(obj, Obj) else ANY


def wrong_for(spec: Spec) -> Any:
    """A value of a JSON type ``spec`` does not take."""
    takes = {type(s) for s in (spec.specs if isinstance(spec, OneOf) else (spec,))}
    for value, kind in (("a-string", Str), (12345, Num), (True, Bool), ({"x": 1}, Obj),
                        ([1, 2], Arr)):
        if kind not in takes:
            return value
    raise AssertionError(f"{spec.want}: takes every type")


# --- the relay, in a thread of its own ---------------------------------------------------------

class Stage:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.served: Served | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.stop: trio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:   # handed to the test's thread
            self.failed = exc
            self.ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.stop = trio.Event()
        async with trio.open_nursery() as nursery:
            up = await nursery.start(serve_fake_upstream)
            ant = await nursery.start(serve_fake_anthropic)
            gem = await nursery.start(serve_fake_gemini)
            text = every_kind_config(up.url, ant.url, gem.url, self.root / "fake-cli.jsonl",
                                     extra=EMBEDDER.format(url=gem.url))
            async with open_cli_relay(text, self.root) as served:
                self.served = served
                self.ready.set()
                await self.stop.wait()
            nursery.cancel_scope.cancel()

    def idle(self) -> bool:
        served = self.served
        assert served is not None and self.token is not None

        async def settled() -> bool:
            with trio.move_on_after(10):   # requests end (and write records) first
                await served.relay.idle.wait()
            return lane_idle(served)

        return bool(trio.from_thread.run(settled, trio_token=self.token))

    def close(self) -> None:
        if self.token is not None and self.stop is not None:
            trio.from_thread.run_sync(self.stop.set, trio_token=self.token)
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the relay's thread did not end"
        if self.failed is not None:
            raise self.failed


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stage, httpx.Client]]:
    root = tmp_path_factory.mktemp("typed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
        mp.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)
        mp.setenv("XDG_STATE_HOME", str(root / "state"))
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
            mp.delenv(var, raising=False)
        st_ = Stage(root)
        st_.thread.start()
        assert st_.ready.wait(30), "the relay did not start"
        if st_.failed is not None:
            raise st_.failed
        with httpx.Client(trust_env=False, timeout=20) as client:
            try:
                yield st_, client
            finally:
                st_.close()


# --- sending, and what an answer must be --------------------------------------------------

def send(stage: tuple[Stage, httpx.Client], front: Front, kind: str,
         keys: tuple[Key, ...], value: Any) -> httpx.Response:
    st_, client = stage
    assert st_.served is not None
    model = front.models.get(kind, MODEL[kind])
    body = json.loads(json.dumps(front.body))
    path = front.path
    if "{model}" in path:
        path = path.replace("{model}", model)
    else:
        body["model"] = model
    put(body, keys, value, front.schema)
    return client.post(st_.served.url + path, json=body)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    """The E1 fields in any front's shape: OpenAI's (``param`` and ``code`` in the
    error), Anthropic's (a ``relay`` object inside), Google's (``{"error": {"code": 400,
    "message", "status", "details", "relay": {"reason", "param", …}}}``: its ``code`` is
    the HTTP status, so the reason and the path come from ``relay`` only), Ollama's
    (``{"error": "…", "relay": {…}}``)."""
    body = resp.json()
    if isinstance(body, dict) and isinstance(body.get("error"), str):   # Ollama's shape
        relay = body.get("relay") or {}
        return {"param": relay.get("param"), "reason": relay.get("reason"),
                "message": body["error"]}
    error = body.get("error", body) if isinstance(body, dict) else {}
    relay = error.get("relay") or {}
    if "status" in error:   # Google's shape
        return {"param": relay.get("param"), "reason": relay.get("reason"),
                "message": error.get("message", "")}
    return {"param": error.get("param", relay.get("param")),
            "reason": relay.get("reason") or error.get("code"),
            "message": error.get("message", "")}


def names(param: str | None, field: str) -> bool:
    """Whether ``param`` names ``field``: itself, something inside it, or what holds it."""
    for named in (param or "").split(", "):
        if named and (named == field or named.startswith((f"{field}.", f"{field}["))
                      or field.startswith((f"{named}.", f"{named}["))):
            return True
    return False


def judge(resp: httpx.Response, field: str, where: Any) -> None:
    assert resp.status_code < 500, (where, resp.status_code, resp.text[:2000])
    assert "internal_error" not in resp.text, (where, resp.text[:2000])
    if resp.status_code < 400:
        return
    error = error_of(resp)
    if field.split(".")[0].split("[")[0] in ("model", "fallbacks"):
        return   # names a model: unknown_model lists what exists
    if error["reason"] == "rejected":
        return   # the provider's own 4xx, in its words (it saw the value)
    assert names(error["param"], field), (where, error)


# --- the tests --------------------------------------------------------------------------------

def test_the_schemas_know_every_field_of_the_policy() -> None:
    """Every chat-level field the field policy knows, and every Messages and Gemini field
    of its own, is typed (a field added there without a type fails here)."""
    assert set(CHAT_FIELDS) <= set(CHAT_SCHEMA.fields)
    own = {name.split(".")[0] for name in OWN_FIELDS["anthropic"]} - {"content"}
    assert own <= set(MESSAGES_SCHEMA.fields), own - set(MESSAGES_SCHEMA.fields)
    for name in OWN_FIELDS["gemini"]:   # down to generationConfig.x and tools.x
        top, _, inner = name.partition(".")
        spec: Spec = GEMINI_SCHEMA.fields.get(top, ANY)
        if inner and top != "contents":   # (contents.thought: a part's, read by its kind)
            spec = _child(_child(spec, 0), inner) if top == "tools" else _child(spec, inner)
        assert spec is not ANY, name
    assert {f.schema.name for f in FRONTS} == set(SCHEMAS)


@pytest.mark.parametrize("front", FRONTS, ids=[f.name for f in FRONTS])
def test_every_field_with_a_wrong_type(stage: Any, front: Front) -> None:
    sent = 0
    for keys, spec in fields_of(front.schema):
        field = path_text(keys)
        value = wrong_for(spec)
        for kind in front.kinds:
            resp = send(stage, front, kind, keys, value)
            where = (front.name, kind, field, value)
            assert resp.status_code == 400, (where, resp.text[:2000])
            error = error_of(resp)
            assert error["reason"] == "invalid_request", (where, error)
            assert names(error["param"], field), (where, error)
            sent += 1
    assert sent >= len(front.schema.fields)
    assert stage[0].idle(), "a lane is still taken"


def test_stop_5_names_stop(stage: Any) -> None:
    """The issue's case: a 500 ``internal_error`` from the fake adapter before."""
    resp = send(stage, FRONTS[0], "fake", ("stop",), 5)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "stop"), error
    assert error["relay"]["phase"] == "request"


def test_gemini_stop_5_names_stop(stage: Any) -> None:
    """The same on the Gemini front, in Google's shape: the path in ``relay.param`` (what
    `error_of` reads) and in the BadRequest detail."""
    gemini = next(f for f in FRONTS if f.name == "gemini")
    resp = send(stage, gemini, "fake", ("generationConfig", "stopSequences"), 5)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["status"]) == (400, "INVALID_ARGUMENT"), error
    relay = error["relay"]
    assert (relay["reason"], relay["param"], relay["phase"]) == (
        "invalid_request", "generationConfig.stopSequences", "request"), relay
    violations = [v["field"] for d in error["details"] for v in d.get("fieldViolations", ())]
    assert violations == ["generationConfig.stopSequences"], error


EDGES = st.one_of(
    st.none(), st.booleans(), st.text(max_size=4),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, 1e308, -1e308, 0.5, "",
                     "auto", "required", "none", "text", "user", [], {}, [None], [[]],
                     {"type": "function"}, {"type": "text", "text": 5}]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.none() | st.integers() | st.text(max_size=2),
                    max_size=2),
    st.just({"a": {"b": [1, {"c": None}]}}),
)
TARGETS = [(front, keys) for front in FRONTS for keys, _ in fields_of(front.schema)]


@settings(max_examples=int(os.environ.get("RELAY_TYPED_EXAMPLES", "600")), deadline=None,
          derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_wrong_types_and_edge_values(stage: Any, data: st.DataObject) -> None:
    front, keys = data.draw(st.sampled_from(TARGETS), label="field")
    kind = data.draw(st.sampled_from(front.kinds), label="kind")
    value = data.draw(EDGES, label="value")
    resp = send(stage, front, kind, keys, value)
    judge(resp, path_text(keys), (front.name, kind, path_text(keys), value))


def test_lanes_idle_after_the_examples(stage: Any) -> None:
    assert stage[0].idle(), "a lane is still taken after the examples"
