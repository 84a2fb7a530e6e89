"""One strict cattrs converter: scalars of the right type only, unknown keys forbidden,
every problem reported with its path (STYLE: attrs/cattrs)."""

from __future__ import annotations

from collections.abc import Mapping
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


def structure_table(data: Any, cls: type[T], path: str, problems: list[str]) -> T | None:
    """Structure ``data`` into ``cls``; on failure add one line per problem — each naming
    its table and key — to ``problems`` and return None.

    Unknown keys and wrong types come from the converter; then every field's validator
    runs on its own, so two bad values in one table are both reported (attrs alone stops
    at the first).
    """
    if not isinstance(data, dict):
        problems.append(f"[{path}]: must be a table, got {type(data).__name__}")
        return None
    known = [a.name for a in attrs.fields(cls)]  # type: ignore[arg-type]
    extra = [key for key in data if key not in known]
    for key in extra:
        problems.append(f"[{path}] {key}: unknown key; known keys: {', '.join(known)}")
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
