"""posjax's modules import one another without a circle, and posjax/training/ stays small.

Every module under posjax/ is parsed with ``ast`` (nothing is imported): each ``import`` and
``from ... import`` of a posjax module, at module level or inside a function (or under
``if TYPE_CHECKING:``), relative ones resolved, is an edge. ``from package import name`` is an
edge to ``package.name`` when that is a module, else to the package (a package's own import of
its parents, which Python makes for any submodule, is no edge: a package's ``__init__`` may
import its submodules). A circle is printed as the modules along it. A function-level import may still keep an optional heavy dependency out of a
module's start-up; it may not hide a circle.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "posjax"
MAX_TRAINING_MODULES = 20


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    """{dotted name: file} of every module and package under posjax/."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name a relative import of ``name`` (``level`` dots) in ``module`` means."""
    if level == 0:
        return name or ""
    base = module.split(".")
    base = base[:len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([name] if name else []))


def _owner(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The longest known module that ``name`` is or lies in (``posjax.a.b.func`` -> ``posjax.a.b``)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def imports(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The posjax modules ``module`` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            # ``from pkg import mod``: pkg.mod where that is a module, else a name in pkg.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "posjax":
                continue
            owner = _owner(target, known)
            if owner is not None and owner != module:
                out.add(owner)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``edges`` as [a, b, ..., a], or None (depth-first, three colours)."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checker_finds_a_circle_and_resolves_relative_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert _resolve("posjax.training.trainer", False, 1, "hosts") == "posjax.training.hosts"
    assert _resolve("posjax.training", True, 1, "hosts") == "posjax.training.hosts"
    assert _resolve("posjax.training.checkpointing.resume", False, 2, None) == "posjax.training"


def test_every_import_the_checker_sees_is_a_posjax_module():
    edges = graph()
    assert "posjax.training.trainer" in edges
    assert "posjax.training.run_setup" in edges["posjax.training.trainer"]
    assert all(target in edges for targets in edges.values() for target in targets)


def test_posjax_imports_no_circle():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_training_has_at_most_20_top_level_modules():
    names = sorted(p.name for p in (PACKAGE / "training").glob("*.py") if p.name != "__init__.py")
    assert len(names) <= MAX_TRAINING_MODULES, (len(names), names)
