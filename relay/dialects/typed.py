"""Typed requests: every field of a dialect's request checked for type and range, in one
place per dialect, before anything of relay reads it (issue 27; SPEC E1, A1a).

A dialect declares its request as a `Schema` — the known fields and what each must be —
and `check` walks a parsed body against it once, at the front door: a value of the wrong
type or out of range is a 400 ``invalid_request`` whose ``param`` is the field's path
(``stop``, ``tools[0].function.name``, ``messages[2].content[0].text``), naming every bad
field of the request at once. What a schema does not list passes unchecked (a field
relay does not know goes to a provider of its own dialect as the client sent it, and the
field policy refuses it elsewhere: `relay.api.fields`). Without this, a ``"stop": 5``
reached the fake adapter and came back as a 500 ``internal_error`` (a TypeError).

The specs are small, composable and data: `Num`, `Int`, `Str`, `Bool`, `Obj` (known keys,
and a spec for any other key's value), `Arr`, `OneOf`, `ANY`. ``null`` is accepted for
every field unless its spec says ``nullable=False``: OpenAI's clients send ``null`` for
"the default", and the field policy treats a null as asking for nothing.

A further dialect plugs in by declaring its own `Schema` and calling `check` first in
its ``parse`` (the property test, tests/dialects/test_typed_requests.py, walks every field of
every schema it is given; adding a dialect there is one line).

The cost: only the fields a request holds are visited, and a path is built only for a
value that fails (a chain of ``(parent, key)`` pairs until then); `bench/typed_check.py`
measures it per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relay.vocab.errors import RelayError

__all__ = ["ANY", "INT_MAX", "Arr", "Bool", "Int", "Num", "Obj", "OneOf", "Schema", "Spec",
           "Str", "check", "describe", "path_of"]

INT_MAX = 2**31 - 1
INT64 = 2**63 - 1

# A lazily built path: None (the top), or (parent, key).
Path = tuple[Any, "str | int"] | None
Problems = list[tuple[Path, str]]


def path_of(path: Path) -> str:
    """``(((None, 'tools'), 0), 'name')`` → ``tools[0].name``."""
    keys: list[str | int] = []
    while path is not None:
        path, key = path
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def describe(value: Any) -> str:
    """What a value is, in JSON's words, for a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    return "an object"


_JSON_TYPES = frozenset({str, int, float, bool, list, dict})


class Spec:
    """What a value must be; ``want`` says it in words for the message. ``plain``: the
    types a value is right by being of (a string for a plain `Str`), decided without a
    call — most of a request's values, which keeps the walk cheap."""

    __slots__ = ("nullable", "plain", "want")

    def __init__(self, want: str, *, nullable: bool = True,
                 plain: frozenset[type] = frozenset()) -> None:
        self.want = want
        self.nullable = nullable
        self.plain = plain

    def ok(self, value: Any, path: Path, problems: Problems) -> None:
        """Append ``(path, what is wrong)`` to ``problems`` for each bad part of ``value``
        (a non-null value; `run` handles null)."""
        raise NotImplementedError

    def run(self, value: Any, path: Path, problems: Problems) -> None:
        if value is None:
            if not self.nullable:
                problems.append((path, f"must be {self.want}, not null"))
            return
        self.ok(value, path, problems)

    def fail(self, value: Any, path: Path, problems: Problems) -> None:
        problems.append((path, f"must be {self.want}, not {describe(value)}"))


class AnySpec(Spec):
    __slots__ = ()

    def ok(self, value: Any, path: Path, problems: Problems) -> None:
        return None


ANY = AnySpec("anything", plain=_JSON_TYPES)


class Bool(Spec):
    __slots__ = ()

    def __init__(self, *, nullable: bool = True) -> None:
        super().__init__("true or false", nullable=nullable, plain=frozenset({bool}))

    def ok(self, value: Any, path: Path, problems: Problems) -> None:
        if value is not True and value is not False:
            self.fail(value, path, problems)


class Num(Spec):
    """A number (not a boolean) from ``lo`` to ``hi``; ``whole``: an integer (``2.0``
    is not one: the providers' own APIs refuse it)."""

    __slots__ = ("hi", "lo", "whole")

    def __init__(self, lo: float | None = None, hi: float | None = None, *,
                 whole: bool = False, nullable: bool = True) -> None:
        kind = "a whole number" if whole else "a number"
        if lo is not None and hi is not None:
            want = f"{kind} from {_num(lo)} to {_num(hi)}"
        elif lo is not None:
            want = f"{kind} of at least {_num(lo)}"
        else:
            want = kind
        super().__init__(want, nullable=nullable)
        self.lo, self.hi, self.whole = lo, hi, whole

    def ok(self, value: Any, path: Path, problems: Problems) -> None:
        kind = type(value)
        if kind is bool or not (kind is int or (kind is float and not self.whole)):
            self.fail(value, path, problems)
        elif (self.lo is not None and value < self.lo) or (
                self.hi is not None and value > self.hi):
            problems.append((path, f"must be {self.want}, not {value!r}"))


def Int(lo: float | None = None, hi: float | None = None,
        *, nullable: bool = True) -> Num:
    """A whole number from ``lo`` to ``hi``."""
    return Num(lo, hi, whole=True, nullable=nullable)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class Str(Spec):
    """A string; ``choices``: one of them; ``nonempty``: not ``""``."""

    __slots__ = ("choices", "nonempty")

    def __init__(self, choices: tuple[str, ...] = (), *, nonempty: bool = False,
                 nullable: bool = True) -> None:
        if choices:
            want = "one of " + ", ".join(repr(c) for c in choices)
        else:
            want = "a non-empty string" if nonempty else "a string"
        super().__init__(want, nullable=nullable, plain=frozenset(
            () if choices or nonempty else (str,)))
        self.choices = frozenset(choices)
        self.nonempty = nonempty

    def ok(self, value: Any, path: Path, problems: Problems) -> None:
        if type(value) is not str:
            self.fail(value, path, problems)
        elif (self.choices and value not in self.choices) or (self.nonempty and not value):
            problems.append((path, f"must be {self.want}, not {value!r}"))


class Arr(Spec):
    """An array of ``item`` with at least ``min_len`` entries."""

    __slots__ = ("item", "min_len")

    def __init__(self, item: Spec = ANY, *, min_len: int = 0, want: str = "",
                 nullable: bool = True) -> None:
        if not want:
            want = "an array" if item is ANY else f"an array of {_plural(item.want)}"
            if min_len:
                want = "a non-empty " + want.removeprefix("an ")
        super().__init__(want, nullable=nullable, plain=frozenset(
            (list,) if item is ANY and not min_len else ()))
        self.item, self.min_len = item, min_len

    def ok(self, value: Any, path: Path, problems: Problems) -> None:
        if type(value) is not list:
            self.fail(value, path, problems)
            return
        if len(value) < self.min_len:
            problems.append((path, f"must be {self.want}, not an empty array"))
        item = self.item
        if item is ANY:
            return
        plain = item.plain
        for i, entry in enumerate(value):
            if type(entry) not in plain:
                if entry is None:  # an entry of an array is never null, whatever its spec
                    problems.append(((path, i), f"must be {item.want}, not null"))
                else:
                    item.run(entry, (path, i), problems)


def _plural(want: str) -> str:
    for article in ("a ", "an "):
        if want.startswith(article):
            rest = want[len(article):]
            head, sep, tail = rest.partition(" ")
            return (head + "s" + sep + tail) if head in ("string", "object", "number") \
                else rest
    return want


class Obj(Spec):
    """An object: ``fields`` the known keys' specs (``required``: keys that must be
    there), ``rest`` the spec of any other key's value (`ANY`: unchecked)."""

    __slots__ = ("fields", "required", "rest")

    def __init__(self, fields: Mapping[str, Spec] | None = None, *, rest: Spec = ANY,
                 required: tuple[str, ...] = (), want: str = "an object",
                 nullable: bool = True) -> None:
        super().__init__(want, nullable=nullable, plain=frozenset(
            (dict,) if not fields and rest is ANY and not required else ()))
        self.fields = dict(fields or {})
        self.rest = rest
        self.required = required

    def ok(self, value: Any, path: Path, problems: Problems) -> None:
        if type(value) is not dict:
            self.fail(value, path, problems)
            return
        for key in self.required:
            if key not in value:
                problems.append(((path, key), "is required"))
        fields, rest = self.fields, self.rest
        for key, entry in value.items():   # a request's objects hold few keys
            spec = fields.get(key, rest)
            if type(entry) not in spec.plain:
                spec.run(entry, (path, key), problems)


class OneOf(Spec):
    """Any one of ``specs``, chosen by the value's JSON type (the first that takes the
    type decides, so a wrong *part* is named where it is, not as "one of …")."""

    __slots__ = ("specs",)

    def __init__(self, *specs: Spec, want: str = "", nullable: bool = True) -> None:
        # plain: the plain types of the option that decides each type (the first)
        deciding: dict[str, Spec] = {}
        for spec in specs:
            deciding.setdefault(_SPEC_KINDS.get(type(spec), "any"), spec)
        super().__init__(want or " or ".join(s.want for s in specs), nullable=nullable,
                         plain=frozenset().union(*(s.plain for s in deciding.values())))
        self.specs = specs

    def ok(self, value: Any, path: Path, problems: Problems) -> None:
        kind = _json_kind(value)
        for spec in self.specs:
            if _takes(spec, kind):
                spec.ok(value, path, problems)
                return
        self.fail(value, path, problems)


_KINDS: dict[type, str] = {bool: "bool", int: "num", float: "num", str: "str", list: "arr",
                           dict: "obj"}
_SPEC_KINDS: dict[type, str] = {Bool: "bool", Num: "num", Str: "str", Arr: "arr", Obj: "obj"}


def _json_kind(value: Any) -> str:
    return _KINDS.get(type(value), "other")


def _takes(spec: Spec, kind: str) -> bool:
    return _SPEC_KINDS.get(type(spec)) == kind or isinstance(spec, AnySpec)


class Schema:
    """A dialect's request: its top-level fields' specs (``required`` ones must be
    there and not null); other keys pass unchecked."""

    __slots__ = ("fields", "name", "required")

    def __init__(self, name: str, fields: Mapping[str, Spec],
                 required: tuple[str, ...] = ()) -> None:
        self.name = name
        self.fields = dict(fields)
        self.required = required


def check(data: dict[str, Any], schema: Schema) -> None:
    """Check ``data`` (a request body, already a JSON object) against ``schema``.

    Raises:
        RelayError: ``invalid_request`` naming every bad field (``param``: their paths,
            joined by ``, ``).
    """
    problems: Problems = []
    fields = schema.fields
    for key, value in data.items():   # visit what the request holds
        spec = fields.get(key)
        if spec is not None and value is not None and type(value) not in spec.plain:
            spec.ok(value, (None, key), problems)
    for key in schema.required:
        if data.get(key) is None:
            problems.append(((None, key), f"is required: {fields[key].want}"))
    if problems:
        raise _invalid(problems)


def _invalid(problems: Problems) -> RelayError:
    paths = list(dict.fromkeys(path_of(path) for path, _ in problems))
    said = "; ".join(f"'{path_of(path)}' {what}" for path, what in problems[:20])
    if len(problems) > 20:
        said += f"; and {len(problems) - 20} more"
    return RelayError("invalid_request", said, param=", ".join(paths[:20]))
