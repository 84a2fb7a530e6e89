"""The architecture, held as data: relay's layers, and imports that point only downward.

Every module of relay (and of the adapters, installed as ``relay.adapters``) belongs to
one layer; a module may import its own layer and the ones below it, never one above.
Every import counts — module level, function level and ``TYPE_CHECKING`` alike — so no
cycle can be dodged by importing late. docs/architecture.md draws the same table.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module belongs to the first layer one of whose prefixes it starts with.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("relay.vocab",)),
    ("adapter API", ("relay.api",)),
    ("adapter machinery", ("relay.adapters.limits",)),
    ("HTTP adapters", ("relay.adapters.http",)),
    ("CLI adapters", ("relay.adapters.cli",)),
    ("adapter registry", ("relay.adapters",)),
    ("config", ("relay.config",)),
    ("usage", ("relay.usage",)),
    ("Redis client", ("relay.redis",)),
    ("capacity", ("relay.capacity",)),
    ("shared capacity", ("relay.shared",)),
    ("request path", ("relay.engine",)),
    ("dialects", ("relay.dialects",)),
    ("front", ("relay.front",)),
    ("assembly", ("relay.assembly", "relay.__main__", "relay")),
]
_ADAPTER_BASE = {"vocabulary", "adapter API", "adapter machinery"}
# Layers that must not reach everything below them.
ONLY: dict[str, set[str]] = {
    "adapter machinery": {"vocabulary", "adapter machinery"},
    # the two rooms of adapters stand side by side: neither imports the other
    "HTTP adapters": _ADAPTER_BASE | {"HTTP adapters"},
    "CLI adapters": _ADAPTER_BASE | {"CLI adapters"},
    "adapter registry": _ADAPTER_BASE | {"adapter registry"},  # kinds by name, not import
    "Redis client": {"vocabulary", "adapter API", "config", "Redis client"},
    "capacity": {"vocabulary", "capacity"},  # counted on trio's clock; no I/O, no server
    "shared capacity": {"vocabulary", "adapter API", "config", "Redis client", "capacity",
                        "shared capacity"},
    "dialects": {"vocabulary", "dialects"},  # pure: parse and render, no engine, no I/O
    "usage": {"vocabulary", "usage"},  # the usage database: SQLite and the records' files
}
# A product folder holds at most this many modules (__init__ included): past it, the
# folder has become two rooms.
ROOM_MAX = 16


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((ROOT / "relay").rglob("*.py")):
        rel = path.relative_to(ROOT / "relay")
        if rel.parts[0] == "adapters":
            continue  # the link to adapters/, read below under its own name
        parts = ["relay", *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        parts = ["relay", "adapters", *path.relative_to(ROOT / "adapters").with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _targets(module: str, path: Path, node: ast.AST) -> list[tuple[int, str]]:
    """(line, imported module) for one import statement."""
    if isinstance(node, ast.Import):
        return [(node.lineno, alias.name) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = _package(module, path).split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    # `from pkg import sub` may name a submodule: count it as that module.
    return [(node.lineno, f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target)
            for a in node.names]


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """Every import in the file, wherever it stands (function level and
    ``TYPE_CHECKING`` included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [t for node in ast.walk(tree) for t in _targets(module, path, node)]


MODULES = _modules()


def test_every_module_is_in_a_layer() -> None:
    assert len(MODULES) > 30
    for module in MODULES:
        layer_of(module)


def test_imports_point_only_downward() -> None:
    bad = []
    for module, path in MODULES.items():
        mine = layer_of(module)
        name = LAYERS[mine][0]
        for line, target in _imports(module, path):
            if target != "relay" and not target.startswith("relay."):
                continue
            theirs = layer_of(target)
            allowed = ONLY.get(name)
            upward = theirs > mine
            outside = allowed is not None and LAYERS[theirs][0] not in allowed
            if upward or outside:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} ({name}) imports "
                           f"{target} ({LAYERS[theirs][0]})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_modules() -> None:
    """Within a layer too, ``TYPE_CHECKING`` imports included: two modules that name each
    other's types are one tangle (the shared vocabulary moves down, or one side takes a
    protocol)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for _, target in _imports(module, path):
            if target in graph and target != module:
                graph[module].add(target)
    # A package's __init__ importing its own submodules is the one allowed loop shape.
    for module in graph:
        graph[module] = {t for t in graph[module] if not t.startswith(module + ".")}
    tangles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert not tangles, "import cycles: " + "; ".join(" ↔ ".join(c) for c in tangles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components: every module of one component reaches every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: set[str] = set()
            while True:
                top = stack.pop()
                component.add(top)
                if top == node:
                    break
            found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_importlib_only_in_the_adapter_registry() -> None:
    """Modules are imported by name (``importlib.import_module``) in one place only: the
    registry, which loads an adapter kind the first time it is looked up."""
    users = [m for m, p in MODULES.items() if any(t == "importlib" for _, t in _imports(m, p))]
    assert users == ["relay.adapters"]


def test_only_the_adapter_api_imports_httpx() -> None:
    users = [m for m, p in MODULES.items()
             if any(t == "httpx" or t.startswith("httpx.") for _, t in _imports(m, p))]
    assert users == ["relay.api.http"]


def test_dialects_do_no_io() -> None:
    io = {"trio", "httpx", "socket", "subprocess", "hypercorn", "quart", "quart_trio"}
    for module, path in MODULES.items():
        if layer_of(module) == layer_of("relay.dialects"):
            used = {t.partition(".")[0] for _, t in _imports(module, path)}
            assert not used & io, f"{module} imports {sorted(used & io)}"


def test_no_room_is_crowded() -> None:
    """Each product folder is one room of the architecture, small enough to read whole."""
    folders: dict[Path, int] = {}
    for path in MODULES.values():
        folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = [f"{d.relative_to(ROOT)} ({n} modules)" for d, n in folders.items()
               if n > ROOM_MAX]
    assert not crowded, f"over {ROOM_MAX} modules: " + ", ".join(crowded)


@pytest.mark.parametrize("limit", [400])
def test_modules_stay_small(limit: int) -> None:
    """~400 lines a module (SPEC's "small and pleasant to read"); a longer one says why
    in a ``# layers: long because …`` line."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in MODULES.values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit
            and "# layers: long because" not in p.read_text(encoding="utf-8")]
    assert not long, "over the limit: " + ", ".join(long)


def test_functions_stay_small() -> None:
    """~60 lines a function; a longer one says why in a ``# long because …`` comment
    inside it (a lifecycle whose nesting is the invariant reads best whole)."""
    long = []
    for path in MODULES.values():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                body = lines[node.lineno - 1:node.end_lineno]
                if len(body) > 60 and not any("# long because" in line for line in body):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({len(body)} lines)")
    assert not long, "over ~60 lines without a reason: " + ", ".join(long)


def test_adapters_are_installed_under_relays_name() -> None:
    """``relay.adapters`` imports; a top-level ``adapters`` does not (relay claims no
    global package name another PyPI project uses)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import relay.adapters, importlib.util, sys; "
            "print(importlib.util.find_spec('adapters') is None)")
    done = subprocess.run([sys.executable, "-c", code], cwd="/", env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
