"""One strict cattrs converter: scalars of the right type only, unknown keys forbidden,
every problem reported with its path (STYLE: attrs/cattrs).

An unknown key is named with the closest valid one ("did you mean") and every key the
table takes (`unknown_key`); a TOML syntax error gets its line and column, also when the
parser only says "end of document" (`toml_problem`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import attrs
import cattrs

from relay.api.adapter import Adapter

Registry = Mapping[str, "type[Adapter]"]


T = TypeVar("T")


def _strict(kind: type[T], *, allow: tuple[type, ...] = ()) -> Any:
    ok = (kind, *allow)

    def structure(value: Any, _: Any) -> T:
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {kind.__name__}, got a boolean")
        if not isinstance(value, ok):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return kind(value)  # type: ignore[call-arg]

    return structure


converter = cattrs.Converter(forbid_extra_keys=True)
converter.register_structure_hook(int, _strict(int))
converter.register_structure_hook(float, _strict(float, allow=(int,)))
converter.register_structure_hook(bool, _strict(bool))
converter.register_structure_hook(str, _strict(str))


def _describe(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, ValueError | TypeError):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'adapter'?)`` when one candidate is close to ``word``, else ""."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        close = [lowered[word.lower()]] if word.lower() in lowered else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key(path: str, key: str, valid: Sequence[str], *, more: str = "") -> str:
    """The problem line for an unknown key: its table, the closest valid key, and every
    valid key of that table (``more`` says what else a table may take)."""
    return (f"[{path}] {key}: unknown key{did_you_mean(key, valid)}; valid keys in "
            f"[{path}]: {', '.join(valid)}{more}")


def structure_table(data: Any, cls: type[T], path: str, problems: list[str], *,
                    also_valid: Sequence[str] = (), hidden: Sequence[str] = ()) -> T | None:
    """Structure ``data`` into ``cls``; on failure add one line per problem — each naming
    its table and key — to ``problems`` and return None.

    Unknown keys are named each (`unknown_key`), with every valid key of the table:
    ``also_valid`` (keys of the same table read elsewhere) and ``cls``'s fields, less the
    ``hidden`` ones (fields relay fills in itself, never the file). Wrong types come from
    the converter; then every field's validator runs on its own, so two bad values in one
    table are both reported (attrs alone stops at the first).
    """
    if not isinstance(data, dict):
        problems.append(f"[{path}]: must be a table, got {type(data).__name__}")
        return None
    known = [a.name for a in attrs.fields(cls)  # type: ignore[arg-type]
             if a.name not in hidden]
    valid = [*also_valid, *(k for k in known if k not in also_valid)]
    extra = [key for key in data if key not in known]
    for key in extra:
        problems.append(unknown_key(path, key, valid))
    try:
        with attrs.validators.disabled():
            inst = converter.structure({k: v for k, v in data.items() if k not in extra}, cls)
    except cattrs.BaseValidationError as exc:
        for line in cattrs.transform_error(exc, path=path, format_exception=_describe):
            message, _, where = line.rpartition(" @ ")
            problems.append(f"{_table_key(where)}: {message}")
        return None
    invalid = validation_problems(inst, path)
    problems.extend(invalid)
    return None if extra or invalid else inst


def validation_problems(inst: Any, path: str) -> list[str]:
    """Run each field's validator on its own; one ``[table] key: …`` line per failure."""
    out = []
    for field in attrs.fields(type(inst)):
        if field.validator is None:
            continue
        try:
            field.validator(inst, field, getattr(inst, field.name))
        except (ValueError, TypeError) as exc:
            message = str(exc).removeprefix(f"'{field.name}' ")
            out.append(f"[{path}] {field.name}: {message}")
    return out


def _table_key(dotted: str) -> str:
    """``providers.lm.profile.lanes`` → ``[providers.lm.profile] lanes``."""
    table, _, key = dotted.rpartition(".")
    return f"[{table}] {key}" if table else f"[{dotted}]"


_AT = re.compile(r" \(at (?:line (\d+), column (\d+)|end of document)\)\Z")


def toml_problem(source: str, text: str, exc: ValueError) -> str:
    """A TOML syntax error as one line: the file, line and column, what is wrong, and the
    line itself. tomllib says "(at end of document)" for an error at the very end (an
    unclosed string or table header on the last line): that is its last line's end."""
    message = str(exc)
    found = _AT.search(message)
    line = getattr(exc, "lineno", None)   # Python 3.14 keeps them as attributes
    column = getattr(exc, "colno", None)
    if found is not None:
        message = message[:found.start()]
        if found.group(1) is not None:
            line, column = int(found.group(1)), int(found.group(2))
    lines = text.splitlines() or [""]
    if not isinstance(line, int) or not isinstance(column, int):
        while len(lines) > 1 and not lines[-1].strip():
            lines.pop()
        line, column = len(lines), len(lines[-1]) + 1
    shown = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return (f"{source}: line {line}, column {column}: not valid TOML: {message}"
            + (f"; the line reads: {shown}" if shown else ""))
