"""The package imports one way, read from the source by ``ast`` (no module is imported): no import cycle, no private
name imported across files, every import from a layer to one below it (or within its own part), and function-level
jstd imports only where they defer a third-party package.

The layers, bottom to top (docs/architecture.md draws them):

    kernels → core → nn → models → {vision, run, sharding} → families → {io, viewer} → {generate, collect, interventions, sae} → aot →
    jstd (the face) → cli

A part may import its own modules and any part of a lower layer; parts of one layer do not import each other,
except where ``SIDEWAYS`` allows it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jstd"

LAYERS = (
    ("jstd.kernels",),
    ("jstd.core",),
    ("jstd.nn",),  # the layers every family assembles, the model they compose (CausalLM), the Model protocol
    ("jstd.models",),  # the text families' declarations (and Family, what a declaration is)
    ("jstd.vision", "jstd.run", "jstd.sharding"),
    ("jstd.families",),
    ("jstd.io", "jstd.viewer"),  # files in and out: models; pages (the viewer imports nothing else of jstd)
    ("jstd.generate", "jstd.collect", "jstd.interventions", "jstd.sae"),
    ("jstd.circuits",),  # attribution graphs: transcoder sets, jstd.attribute, pruning, the frontend JSON (on sae)
    ("jstd.aot",),  # compiles the tools' programs for TPU slices and GPUs; imported by the CLI, not the face
    ("jstd",),
    ("jstd.cli",),
)
SIDEWAYS: set[tuple[str, str]] = set()  # (importer's part, imported part) within one layer
MAX_FUNCTION_LEVEL = 8


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


class Import:
    """One import of a package module by another: where it is, what it names, whether it is inside a function."""

    def __init__(self, importer: str, target: str, name: str | None, line: int, in_function: bool):
        self.importer, self.target, self.name, self.line, self.in_function = importer, target, name, line, in_function

    def __repr__(self):
        what = f"{self.target}:{self.name}" if self.name else self.target
        return f"{self.importer}:{self.line} -> {what}"


def imports(mods: dict[str, Path], package: str) -> list[Import]:
    """Every import of one of ``mods`` by another, function-level ones included; relative imports resolved."""
    def known(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    out = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                named = [(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base, a.name) for a in node.names]
            else:
                continue
            for target, name in named:
                if target.split(".")[0] != package:
                    continue
                resolved = known(target)
                if resolved and resolved != module:
                    name = None if resolved == target and name == target.rpartition(".")[2] else name
                    out.append(Import(module, resolved, name, node.lineno, id(node) in inner))
    return out


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.target)
        graph.setdefault(e.target, set())
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def part_of(module: str) -> tuple[int, str]:
    """(layer, part) of a module: the longest part name it lies in."""
    best = None
    for rank, parts in enumerate(LAYERS):
        for part in parts:
            if (module == part or module.startswith(part + ".")) and (best is None or len(part) > len(best[1])):
                best = (rank, part)
    assert best is not None, f"{module} lies in no layer: add it to LAYERS in tests/test_layering.py"
    return best


def upward(edges: list[Import]) -> list[str]:
    """The imports that go to a higher layer, or sideways to another part of the same layer."""
    bad = []
    for e in edges:
        (a, pa), (b, pb) = part_of(e.importer), part_of(e.target)
        if b > a or (a == b and pa != pb and (pa, pb) not in SIDEWAYS):
            bad.append(f"{e!r} ({pa} imports {pb})")
    return bad


def private(edges: list[Import]) -> list[Import]:
    return [e for e in edges if e.name and e.name.startswith("_") and not e.name.startswith("__")]


def private_reach(mods: dict[str, Path], package: str) -> list[str]:
    """``alias._name`` where ``alias`` is a package module imported by name (``from jstd.kernels import
    gated_delta as _gd`` then ``_gd._prepare``): a private name reached across files without importing it."""
    out = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in mods})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in mods})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                out.append(f"{module}:{node.lineno} -> {aliases[node.value.id]}.{node.attr}")
    return out


def top_level_imports(path: Path) -> set[str]:
    """The top-level packages a module imports at module level (what importing it pulls in)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def undeferred(edges: list[Import], mods: dict[str, Path], package: str) -> list[Import]:
    """Function-level package imports that defer nothing: the imported module pulls in no third-party module the
    importer does not already import at its top."""
    out = []
    for e in edges:
        if not e.in_function:
            continue
        theirs = {m for m in top_level_imports(mods[e.target]) if m.split(".")[0] != package}
        if not theirs - top_level_imports(mods[e.importer]):
            out.append(e)
    return out


@pytest.fixture(scope="module")
def graph():
    mods = modules(PACKAGE)
    return mods, imports(mods, "jstd")


def test_no_import_cycle(graph):
    assert cycles(graph[1]) == []


def test_no_private_name_imported_across_files(graph):
    assert private(graph[1]) == []
    assert private_reach(graph[0], "jstd") == []


def test_layers_import_downward(graph):
    assert upward(graph[1]) == []


def test_function_level_imports_are_few_and_defer_a_package(graph):
    mods, edges = graph
    inner = [e for e in edges if e.in_function]
    assert len(inner) <= MAX_FUNCTION_LEVEL, inner
    assert undeferred(edges, mods, "jstd") == []


def test_the_checks_find_what_is_planted(tmp_path):
    """The checker on a small package with one of each fault: a cycle, a private import, an upward import and a
    function-level import that defers nothing."""
    root = tmp_path / "jstd"
    (root / "core").mkdir(parents=True)
    (root / "kernels").mkdir()
    for f in ("__init__.py", "core/__init__.py", "kernels/__init__.py"):
        (root / f).write_text("")
    (root / "core" / "a.py").write_text("from jstd.core.b import thing\nfrom jstd.core.b import _hidden\n")
    (root / "core" / "b.py").write_text("import numpy\nfrom . import a\n_hidden = thing = 1\n")
    (root / "kernels" / "k.py").write_text("from jstd.core.b import thing\nfrom jstd.core import b as _b\n\n"
                                           "def f():\n    from jstd.core import a\n    return _b._hidden\n")
    mods = modules(root)
    edges = imports(mods, "jstd")
    assert cycles(edges) == [["jstd.core.a", "jstd.core.b"]]
    assert [e.name for e in private(edges)] == ["_hidden"]
    assert private_reach(mods, "jstd") == ["jstd.kernels.k:6 -> jstd.core.b._hidden"]
    assert any("jstd.kernels.k" in line and "jstd.core" in line for line in upward(edges))
    assert [e.target for e in undeferred(edges, mods, "jstd")] == ["jstd.core.a"]


def test_moved_modules_still_import_every_name():
    """Every module that moved (the layers to ``jstd.nn``, ``base`` and ``causal_lm`` split) still imports under its
    old name, with every public name of the modules it moved to, as the same objects."""
    import importlib

    from jstd.models import MOVED_MODULES

    for old, new in MOVED_MODULES.items():
        served = importlib.import_module(old)
        for module in map(importlib.import_module, new):
            names = [n for n in vars(module) if not n.startswith("_")]
            assert names and all(getattr(served, n) is getattr(module, n) for n in names), (old, module.__name__)
    from jstd.models.base import Family, Model, param  # noqa: F401  (the spellings earlier code used)
    from jstd.models.causal_lm import CausalLM, TextFamily  # noqa: F401
    from jstd.models.stack import Stack

    assert Stack.__module__ == "jstd.nn.stack"
