"""The package's import graph: no import circles, and imports point down the layers.

Every module under ``src/orbitrl`` is parsed with ``ast`` (nothing is imported). Its edges
are its ``import`` and ``from ... import`` statements that name orbitrl modules, at module
level and inside functions alike (a function-level import is a circle just the same, only
a later one), relative imports resolved. ``from orbitrl.x import name`` is an edge to the
submodule ``orbitrl.x.name`` when there is one, else to ``orbitrl.x`` (for a package, its
``__init__.py``: edges into a package's ``__init__`` count). The parent packages' own
``__init__`` files, which Python runs first, are not counted as edges of every import: each
would otherwise form a circle with the submodules its ``__init__`` re-exports.

Imports under ``if TYPE_CHECKING:`` are not edges: they never run, so they cannot form a
circle at run time (``engine/sampler.py`` names ``engine/sequence.py``'s ``SamplingParams``
that way, for annotations only). Dynamic imports (``importlib.import_module``, the
``"pkg.module:name"`` paths of plugins, the CLI's command modules) are not seen.

Checked: (a) no circle among modules; (b) the layering below (lowest first): an edge from a
module to one of a higher layer fails. A top-level module (``errors``, ``cli``) or
subpackage (``rl``) is a unit; ``__init__`` is the root package's ``__init__.py`` (the
``orbitrl.load_model`` facade). Imports within a layer are free as long as they make no
circle. docs/architecture.md ("Layers") lists the same order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "orbitrl"

LAYERS = [
    ["errors", "_quiet", "workpool"],  # nothing of orbitrl
    ["config", "plugins"],
    ["ledger", "data"],
    ["model", "rewards"],
    ["train", "observe", "envs"],
    ["distributed", "engine"],
    ["rl"],
    ["evals"],
    ["__init__", "cli", "__main__", "commands"],
]


# ---- the walker ---------------------------------------------------------------------------

def module_files(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``src/package`` (a package is
    its ``__init__.py``)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, in a function) for every import statement that runs (not under
    ``if TYPE_CHECKING:``; its ``else:`` does run)."""
    def walk(node, in_func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    yield from visit(stmt, in_func)
                continue
            yield from visit(child, in_func)

    def visit(node, in_func):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_func
        yield from walk(node, in_func or isinstance(node, (ast.FunctionDef,
                                                           ast.AsyncFunctionDef)))
    yield from walk(tree, False)


def _owner(name: str, modules) -> str | None:
    """The module a dotted name lives in: itself, or its longest known prefix."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(src: Path, package: str):
    """{module: [(target module, line, in a function)]} restricted to ``package``."""
    modules = module_files(src, package)
    edges: dict[str, list[tuple[str, int, bool]]] = {}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        out = []
        for node, in_func in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                if node.level:  # relative: from the module's package, level - 1 up
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                         for a in node.names]
            for name in names:
                if name.split(".")[0] != package:
                    continue
                target = _owner(name, modules)
                if target is not None and target != mod:
                    out.append((target, node.lineno, in_func))
        edges[mod] = out
    return edges


def find_cycle(edges) -> list[str] | None:
    """One circle as a path [a, b, ..., a], or None (iterative depth-first search)."""
    graph = {m: sorted({t for t, _, _ in out}) for m, out in edges.items()}
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(graph[root])]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(graph.get(nxt, ())))
    return None


def unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _where(edges, a: str, b: str) -> str:
    hits = [f"line {ln}{' in a function' if f else ''}" for t, ln, f in edges[a] if t == b]
    return f"{a} -> {b} ({', '.join(hits)})"


@pytest.fixture(scope="module")
def edges():
    return import_edges(SRC, PACKAGE)


# ---- the package ---------------------------------------------------------------------------

def test_no_import_cycle(edges):
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + "\n  " + "\n  ".join(
        _where(edges, a, b) for a, b in zip(cycle, cycle[1:]))


def test_every_unit_has_one_layer(edges):
    named = [u for layer in LAYERS for u in layer]
    assert len(named) == len(set(named)), "a unit is in two layers"
    units = {unit(m) for m in edges}
    assert not units - set(named), f"put these in LAYERS: {sorted(units - set(named))}"
    assert not set(named) - units, f"LAYERS names what is gone: {sorted(set(named) - units)}"


def test_imports_point_down_the_layers(edges):
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    up = [f"{_where(edges, m, t)}: layer {level[unit(m)]} ({unit(m)}) imports layer "
          f"{level[unit(t)]} ({unit(t)})"
          for m in sorted(edges) for t in sorted({t for t, _, _ in edges[m]})
          if level[unit(t)] > level[unit(m)]]
    assert not up, "imports up the layers:\n  " + "\n  ".join(up)


def test_the_walker_sees_the_imports(edges):
    """Not vacuous: known edges are found, module level and in a function."""
    assert ("orbitrl.rl.alignment", False) in {(t, f) for t, _, f in
                                               edges["orbitrl.rl.trainer"]}
    assert "orbitrl.evals.run" in {t for t, _, f in edges["orbitrl.evals.cli"] if f}
    assert "orbitrl.engine.sequence" not in {t for t, _, _ in edges["orbitrl.engine.sampler"]}
    assert "orbitrl.model" in {t for t, _, _ in edges["orbitrl.rl.policy"]}  # a package


def test_every_function_level_import_says_why():
    """An import inside a function stays there only for an optional dependency, a real
    start-up cost or a circle, and says which in a trailing comment on its line (e.g.
    ``# optional: triton``, ``# start-up: kept off --help``); any other import belongs at
    the top of its module. The comment may sit on any line of the statement."""
    bare = []
    for mod, path in module_files(SRC, PACKAGE).items():
        text = path.read_text()
        lines = text.splitlines()
        for node, in_func in _imports(ast.parse(text, str(path))):
            if in_func and not any("#" in lines[i - 1]
                                   for i in range(node.lineno, node.end_lineno + 1)):
                bare.append(f"{path.relative_to(SRC)}:{node.lineno}: "
                            f"{lines[node.lineno - 1].strip()}")
    assert not bare, ("function-level imports without a '# why' comment (move them to the "
                      "top of the module, or say why they stay):\n  " + "\n  ".join(bare))


# ---- the walker on a made-up package -------------------------------------------------------

def test_walker_rules(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nimport typing\n"
                "from pkg.sub import b, name_in_init\n"
                "if TYPE_CHECKING:\n    from pkg import c\nelse:\n    import pkg.d\n"
                "if typing.TYPE_CHECKING:\n    import pkg.c\n",
        "c.py": "def f():\n    from .sub.b import x\n",
        "d.py": "import os\nimport pkg.sub.b as bb\n",
        "sub/__init__.py": "from . import b\nname_in_init = 1\n",
        "sub/b.py": "from .. import c\nfrom ..c import f\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    got = {m: sorted((t, f) for t, _, f in out) for m, out in import_edges(tmp_path,
                                                                            "pkg").items()}
    assert got == {
        "pkg": [],
        "pkg.a": [("pkg.d", False), ("pkg.sub", False), ("pkg.sub.b", False)],
        "pkg.c": [("pkg.sub.b", True)],
        "pkg.d": [("pkg.sub.b", False)],
        "pkg.sub": [("pkg.sub.b", False)],
        "pkg.sub.b": [("pkg.c", False), ("pkg.c", False)],
    }
    cycle = find_cycle(import_edges(tmp_path, "pkg"))
    assert cycle in (["pkg.c", "pkg.sub.b", "pkg.c"], ["pkg.sub.b", "pkg.c", "pkg.sub.b"])
