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


#: The crate's layers, lowest first: a layer's modules may use those of the layers before it
#: (and of their own), never those after it. ``error`` and ``platform`` sit beneath them all.
LAYERS = ["format", "storage", "read", "checkpoint", "py"]


def crate_graph() -> Dict[str, Set[str]]:
    """Modules of the crate and the modules each names. A layer's file or folder is one node
    (``read::source``, ``format::header``); ``platform`` is one node; ``py``'s files and folders
    are ``py::name``. Uses are ``crate::layer::module`` paths (and ``super::``/``crate::py::``
    within ``py``)."""
    files: Dict[str, List[pathlib.Path]] = {}
    for path in CRATE.rglob("*.rs"):
        parts = path.relative_to(CRATE).with_suffix("").parts
        if parts[0] in LAYERS and len(parts) > 1 and parts[1] != "mod":
            node = f"{parts[0]}::{parts[1]}"
        else:
            node = parts[0]
        files.setdefault(node, []).append(path)
    edges: Dict[str, Set[str]] = {}
    for node, paths in files.items():
        text = "".join(_code(p.read_text()) for p in paths)
        used = set()
        for first, second in re.findall(r"\bcrate::(\w+)(?:::(\w+))?", text):
            if f"{first}::{second}" in files:
                used.add(f"{first}::{second}")
            elif first in files:
                used.add(first)
        if node.startswith("py::"):
            used |= {"py::" + m for m in re.findall(r"\b(?:super|crate::py)::(\w+)", text)
                     if "py::" + m in files}
        if node.startswith("checkpoint::") or node == "checkpoint":
            used |= {"checkpoint::" + m for m in re.findall(r"\bsuper::(\w+)", text)
                     if "checkpoint::" + m in files}
        edges[node] = used - {node, "lib"}
    edges.pop("lib", None)
    return edges


def _layer(node: str) -> int:
    """The layer of a node: -1 beneath them all (error, platform), else its index in LAYERS."""
    head = node.split("::")[0]
    return LAYERS.index(head) if head in LAYERS else -1


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
    assert "platform" in edges["read::strategy"] and "read::readahead" in edges["py::handle"]
    # The checkpoint's rule asks a place; a store's place (remote/listing.rs) is storage's own.
    assert "storage::place" in edges["checkpoint::files"]
    assert "storage::place" in edges["storage::remote"]


#: The one module beneath the layers that names some of theirs: the error type wraps the header's
#: and the manifest's errors and redacts every message (it calls nothing else of theirs).
ERROR_NAMES = {"format::header", "format::digest", "storage::redact"}


def test_each_layer_uses_only_the_layers_beneath_it() -> None:
    edges = crate_graph()
    upward = sorted((a, b) for a, used in edges.items() for b in used
                    if _layer(a) >= 0 and _layer(b) > _layer(a) or _layer(a) == -1 and _layer(b) >= 0)
    assert [(a, b) for a, b in upward if not (a == "error" and b in ERROR_NAMES)] == []


def test_no_import_circles_in_the_crate() -> None:
    assert cycles(crate_graph()) == []
