"""DESIGN.md's import layering, checked on the source with ``ast`` (nothing is imported).

    fusion core  <-  compress  <-  executor  <-  fusion.coordinator / worker / cli / launch
    scheduler depends only on the core types; the executor imports neither the scheduler
    nor the application; only testbeds imports testbeds.

Every ``import``/``from ... import`` anywhere in a file counts (inside functions too, and
under ``if TYPE_CHECKING:``), except for the scheduler's torch rule, which is about what
runs at import time: there only module-level imports count (class bodies, ``try`` and
``if`` blocks included), and those under ``if TYPE_CHECKING:`` are fine. Dynamic imports
(``importlib.import_module("...")``) are not seen.

No two modules of ``fusion``, ``executor``, ``scheduler``, ``compress`` and ``testbeds``
import each other, directly or round a longer loop. There an import inside a function
counts (it only hides the loop), one under ``if TYPE_CHECKING:`` does not (it never runs);
a module depends on the modules it names (``from a import b`` names ``a.b`` when that is a
module, else ``a``), not on the parent packages Python initialises on the way.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fusion", "executor", "scheduler", "compress", "testbeds")
APP = ("fusion.coordinator", "fusion.cli", "fusion.worker", "fusion.launch")


@dataclass(frozen=True)
class Import:
    """One imported module name, as written in a source file."""

    path: str
    """File, relative to the repository root."""
    line: int
    module: str
    """Absolute dotted name (relative imports resolved)."""
    at_import_time: bool
    """At module level (not in a function) and not under ``if TYPE_CHECKING:``."""
    type_checking: bool = False
    """Under ``if TYPE_CHECKING:`` (never runs)."""
    member: bool = False
    """``a.b`` of ``from a import b``: a module, or a name defined in ``a``."""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path) -> Iterator[Import]:
    """Every module an import statement in ``path`` names (``from a import b`` gives ``a`` and ``a.b``)."""
    rel = str(path.relative_to(REPO_ROOT))
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")
        if node.level > 1:
            base = base[: -(node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def visit(node: ast.AST, at_import_time: bool, type_checking: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(rel, node.lineno, alias.name, at_import_time, type_checking)
            return
        if isinstance(node, ast.ImportFrom):
            base = resolve(node)
            yield Import(rel, node.lineno, base, at_import_time, type_checking)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(rel, node.lineno, f"{base}.{alias.name}", at_import_time, type_checking, member=True)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            at_import_time = False
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, False, True)
            for child in node.orelse:
                yield from visit(child, at_import_time, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, at_import_time, type_checking)

    yield from visit(tree, True, False)


def layer(path: Path) -> str:
    """``core``, ``app`` (coordinator/worker/cli/launch) or the top-level package name."""
    name = module_name(path)
    top = name.split(".")[0]
    if top != "fusion":
        return top
    return "app" if any(name == a or name.startswith(a + ".") for a in APP) else "core"


def names(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


ALL_IMPORTS = [imp for path in source_files() for imp in imports_of(path)]
LAYER_OF = {str(p.relative_to(REPO_ROOT)): layer(p) for p in source_files()}

#: Forbidden imports per layer (dotted-name prefixes), from DESIGN.md's layering.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core": ("executor", "scheduler", "compress", "testbeds", *APP),
    "compress": ("executor", "scheduler", "testbeds", "grpc", *APP),
    "scheduler": ("executor", "compress", "testbeds", "grpc", *APP),
    "executor": ("testbeds", "scheduler", *APP),
}


def module_graph(paths: list[Path]) -> dict[tuple[str, str], Import]:
    """The import edges between the modules of ``paths``: (importer, imported) -> the first
    import statement that makes it (``if TYPE_CHECKING:`` imports left out)."""
    known = {module_name(p) for p in paths}
    edges: dict[tuple[str, str], Import] = {}
    for path in paths:
        src = module_name(path)
        found = [i for i in imports_of(path) if not i.type_checking]
        from_with_names = {(i.line, i.module.rpartition(".")[0]) for i in found if i.member}
        for imp in found:
            if imp.member:  # ``from a import b``: the module ``a.b``, else ``a`` itself
                dst = imp.module if imp.module in known else imp.module.rpartition(".")[0]
            elif (imp.line, imp.module) in from_with_names:
                continue  # its names decide
            else:
                dst = imp.module
            while dst and dst not in known:
                dst = dst.rpartition(".")[0]
            if dst and dst != src:
                edges.setdefault((src, dst), imp)
    return edges


def cycles(edges: dict[tuple[str, str], Import]) -> list[tuple[list[str], list[Import]]]:
    """Each group of modules that import each other, with one loop through it (the imports that close it)."""
    graph = nx.DiGraph(list(edges))
    out = []
    for group in sorted(nx.strongly_connected_components(graph), key=sorted):
        if len(group) > 1:
            out.append((sorted(group), [edges[(a, b)] for a, b in nx.find_cycle(graph.subgraph(group))]))
    return out


def report(found: list[Import]) -> list[str]:
    """``file:line: module``, one per import statement (the shortest matching name)."""
    first: dict[tuple[str, int], Import] = {}
    for imp in sorted(found, key=lambda i: len(i.module)):
        first.setdefault((imp.path, imp.line), imp)
    return [str(first[k]) for k in sorted(first)]


def violations(layer_name: str, prefixes: tuple[str, ...], *, at_import_time_only: bool = False) -> list[str]:
    return report(
        [
            imp
            for imp in ALL_IMPORTS
            if LAYER_OF[imp.path] == layer_name
            and names(imp.module, prefixes)
            and (imp.at_import_time or not at_import_time_only)
        ]
    )


# ----------------------------------------------------------------- the checker itself


def test_sources_are_found() -> None:
    layers = set(LAYER_OF.values())
    assert {"core", "app", "executor", "scheduler", "compress", "testbeds"} <= layers, layers
    assert LAYER_OF["fusion/graph/ir.py"] == "core"
    assert LAYER_OF["fusion/coordinator/store.py"] == "app"
    assert LAYER_OF["fusion/worker.py"] == "app"
    assert LAYER_OF["fusion/launch/executors.py"] == "app"


def test_checker_sees_every_kind_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "scheduler" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "scheduler" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    src = pkg / "mod.py"
    src.write_text(
        "from __future__ import annotations\n"
        "import typing\n"
        "from typing import TYPE_CHECKING\n"
        "import torch.fx as fx\n"  # 4
        "from . import sibling\n"  # 5
        "from ..plan import Plan\n"  # 6
        "if TYPE_CHECKING:\n"
        "    import torch\n"  # 8
        "else:\n"
        "    import grpc\n"  # 10
        "try:\n"
        "    import numpy\n"  # 12
        "except ImportError:\n"
        "    pass\n"
        "class C:\n"
        "    import executor.runtime\n"  # 16
        "    def f(self):\n"
        "        import compress.topk\n"  # 18
        "if typing.TYPE_CHECKING:\n"
        "    from fusion import coordinator\n"  # 20
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    got = {(i.line, i.module, i.at_import_time) for i in imports_of(src)}
    assert (4, "torch.fx", True) in got
    assert (5, "scheduler.sub.sibling", True) in got
    assert (6, "scheduler.plan", True) in got and (6, "scheduler.plan.Plan", True) in got
    assert (8, "torch", False) in got
    assert (10, "grpc", True) in got
    assert (12, "numpy", True) in got
    assert (16, "executor.runtime", True) in got
    assert (18, "compress.topk", False) in got
    assert (20, "fusion.coordinator", False) in got
    assert {i.line for i in imports_of(src) if i.type_checking} == {8, 20}


def test_cycle_checker_counts_function_imports_and_skips_type_checking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "compress"
    pkg.mkdir()
    files = {
        "__init__.py": "from compress import a\n",  # a module: no edge to the package itself
        "a.py": "def f():\n    from compress.b import g\n",  # a loop hidden in a function
        "b.py": "from compress import a\ng = 1\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from compress.d import x\n",
        "d.py": "from compress.c import y\n",  # closed only under TYPE_CHECKING: no loop
        "e.py": "from compress import REGISTRY\n",  # a name of the package: an edge to it
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    edges = module_graph(sorted(pkg.glob("*.py")))
    assert set(edges) == {
        ("compress", "compress.a"),
        ("compress.a", "compress.b"),
        ("compress.b", "compress.a"),
        ("compress.d", "compress.c"),
        ("compress.e", "compress"),
    }
    assert [group for group, _ in cycles(edges)] == [["compress.a", "compress.b"]]


# ----------------------------------------------------------------- the rules


@pytest.mark.parametrize("layer_name", sorted(FORBIDDEN))
def test_layer_imports(layer_name: str) -> None:
    bad = violations(layer_name, FORBIDDEN[layer_name])
    assert not bad, (
        f"{layer_name} must not import {', '.join(FORBIDDEN[layer_name])} (DESIGN.md layering):\n" + "\n".join(bad)
    )


def test_scheduler_does_not_import_torch_at_module_level() -> None:
    bad = violations("scheduler", ("torch",), at_import_time_only=True)
    assert not bad, "scheduler must import torch only inside functions (or under TYPE_CHECKING):\n" + "\n".join(bad)


def test_only_testbeds_imports_testbeds() -> None:
    bad = report([i for i in ALL_IMPORTS if LAYER_OF[i.path] != "testbeds" and names(i.module, ("testbeds",))])
    assert not bad, "nothing outside testbeds/ may import testbeds:\n" + "\n".join(bad)


def test_importing_the_scheduler_does_not_load_torch() -> None:
    """The same rule end to end: what the scheduler's imports pull in transitively."""
    code = (
        "import sys, scheduler.plan, scheduler.baselines; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", f"importing scheduler loaded torch: {out.stdout.strip()[:300]}"


def test_no_module_import_cycles() -> None:
    found = cycles(module_graph(source_files()))
    text = [f"{', '.join(group)}: " + " -> ".join(str(i) for i in loop) for group, loop in found]
    assert not found, "modules that import each other (move what they share to a third):\n" + "\n".join(text)
