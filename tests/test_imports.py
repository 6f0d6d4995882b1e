"""Neither the Python package nor the Rust crate has an import circle. Python imports made inside
functions count too (a lazy import hides a circle from Python, not from a reader); in the crate,
a module uses another when it names ``crate::other`` (``super::other`` between the binding's
modules), test modules left out."""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "safeload"
CRATE = ROOT / "src"


def _imports(path: pathlib.Path) -> Set[str]:
    """The package modules ``path`` imports (relative imports and ``safeload.*``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import a, b
                found.update(alias.name for alias in node.names)
            elif node.level == 0 and node.module and node.module.startswith("safeload."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("safeload."):
                    found.add(alias.name.split(".")[1])
    return found


def graph() -> Dict[str, Set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name}
            for name, path in modules.items() if name != "__init__"}


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Import circles, each as the path around it (every circle the depth-first walk closes)."""
    found: List[List[str]] = []
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def _code(text: str) -> str:
    """Rust source without its test module and comments (doc links name modules too)."""
    at = text.find("#[cfg(test)]\nmod tests")
    text = text if at < 0 else text[:at]
    return re.sub(r"//.*", "", text)


def crate_graph() -> Dict[str, Set[str]]:
    """Modules of the crate (``platform`` and ``py`` each one node, ``py``'s files and folders as
    ``py::name``) and the modules each names (``crate::py::name`` too, as a folder's files do)."""
    files: Dict[str, List[pathlib.Path]] = {}
    for path in CRATE.rglob("*.rs"):
        rel = path.relative_to(CRATE).with_suffix("")
        parts = rel.parts
        if parts[0] == "py" and len(parts) > 2:
            node = "py::" + parts[1]
        elif parts[0] == "py" and parts[-1] != "mod":
            node = "py::" + parts[-1]
        else:
            node = parts[0]
        files.setdefault(node, []).append(path)
    top = {n for n in files if "::" not in n}
    edges: Dict[str, Set[str]] = {}
    for node, paths in files.items():
        text = "".join(_code(p.read_text()) for p in paths)
        used = {m for m in re.findall(r"\bcrate::(\w+)", text) if m in top}
        if node.startswith("py::"):
            used |= {"py::" + m for m in re.findall(r"\b(?:super|crate::py)::(\w+)", text)
                     if "py::" + m in files}
            used.discard("py")
        edges[node] = used - {node, "lib"}
    edges.pop("lib", None)
    return edges


def test_the_finder_sees_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_imports() -> None:
    # _open imports _mps at the top and its docstring says so; a function-level import counts too.
    edges = graph()
    assert "_mps" in edges["_open"]
    assert "_safeload" not in edges  # the extension module has no source here


def test_no_import_circles_in_the_package() -> None:
    assert cycles(graph()) == []


def test_the_crate_graph_sees_uses() -> None:
    edges = crate_graph()
    assert "platform" in edges["strategy"] and "readahead" in edges["py::handle"]


def test_no_import_circles_in_the_crate() -> None:
    assert cycles(crate_graph()) == []
