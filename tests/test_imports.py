"""Neither the Python package nor the Rust crate has an import circle, file against file. Python
imports made inside functions count too (a lazy import hides a circle from Python, not from a
reader); in the crate, a file uses another when it names it by a ``crate::``, ``super::`` or
``self::`` path (groups in braces included), test modules and comments left out. Each layer of
``src/`` uses only the layers beneath it."""

from __future__ import annotations

import ast
import pathlib
import re
import sys
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
#: (and of their own), never those after it. ``error``, ``redact`` and ``platform`` sit beneath
#: them all.
LAYERS = ["format", "storage", "read", "checkpoint", "py"]

#: A use of another module: ``crate::a::b``, ``super::b`` (``super::super::``), ``self::b``, with
#: an optional group ``::{x, y::z}`` (one level of nested braces inside it).
_USE = re.compile(r"\b(crate|super(?:::super)*|self)((?:::\w+)*)(?:::\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\})?")


def _module(path: pathlib.Path) -> str:
    """The module a file is: ``src/read/source/ranges.rs`` -> ``read::source::ranges``,
    ``src/read/source/mod.rs`` -> ``read::source``."""
    parts = list(path.relative_to(CRATE).with_suffix("").parts)
    if parts[-1] == "mod":
        parts.pop()
    return "::".join(parts)


def crate_graph() -> Dict[str, Set[str]]:
    """Every file of the crate (as its module) and the files it uses, as a reader sees them: each
    ``crate::``, ``super::`` or ``self::`` path (groups in braces included) names the file of its
    longest prefix that is one (``crate::storage::remote::Object`` names ``storage/remote/mod.rs``;
    ``super::config::is_true`` in ``storage/remote/tls.rs`` names ``storage/remote/config.rs``).
    ``lib.rs`` is left out (it declares the modules)."""
    files = {_module(p): p for p in CRATE.rglob("*.rs")}
    files.pop("lib", None)
    edges: Dict[str, Set[str]] = {}
    for node, path in files.items():
        here = node.split("::")
        used: Set[str] = set()
        for head, tail, group in _USE.findall(_code(path.read_text())):
            if head == "crate":
                base: List[str] = []
            elif head == "self":
                base = here
            else:
                base = here[: max(0, len(here) - head.count("super"))]
            prefix = base + [s for s in tail.split("::") if s]
            paths = [prefix]
            if group:
                paths = [prefix + [s for s in item.split("{")[0].split("::") if s.strip() and s.strip() != "self"]
                         for item in group.split(",") if item.strip()]
            for segments in paths:
                segments = [s.strip() for s in segments]
                for k in range(len(segments), 0, -1):
                    if "::".join(segments[:k]) in files:
                        used.add("::".join(segments[:k]))
                        break
        edges[node] = used - {node}
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
    assert "storage::place" in edges["storage::remote::listing"]
    # File against file: super:: paths and groups in braces count.
    assert {"storage::remote::config", "storage::remote::connector"} <= edges["storage::remote::store"]
    assert "py::handle" in edges["py::handle::slices"]


def test_the_crate_check_fails_on_a_circle(tmp_path, monkeypatch) -> None:
    """A circle like the two storage/ had (a store's module reaching into its client's for a
    constant its client takes from it) is found, file against file, and so is a use upward."""
    crate = tmp_path / "src"
    (crate / "storage" / "remote").mkdir(parents=True)
    (crate / "lib.rs").write_text("mod storage;\n")
    (crate / "error.rs").write_text("pub fn cleaned() -> String { crate::storage::redacted() }\n")
    (crate / "storage" / "mod.rs").write_text("pub mod remote;\npub fn redacted() -> String { String::new() }\n")
    (crate / "storage" / "remote" / "mod.rs").write_text("mod connector;\nmod store;\n")
    (crate / "storage" / "remote" / "store.rs").write_text(
        "use super::connector::Connector;\npub const MAX_RETRIES: usize = 5;\n")
    (crate / "storage" / "remote" / "connector.rs").write_text(
        "pub struct Connector;\nconst TRIES: usize = super::store::MAX_RETRIES + 1;\n")
    monkeypatch.setattr(sys.modules[__name__], "CRATE", crate)
    edges = crate_graph()
    assert cycles(edges) == [["storage::remote::connector", "storage::remote::store", "storage::remote::connector"]]
    assert ("error", "storage") in [(a, b) for a, b in _upward(edges)]


#: The one module beneath the layers that names some of theirs: the error type wraps the header's
#: and the manifest's errors (it calls nothing of theirs).
ERROR_NAMES = {"format::header", "format::digest"}


def _upward(edges: Dict[str, Set[str]]) -> List[tuple]:
    """Uses of a module in a higher layer (beneath the layers counts as lowest)."""
    return sorted((a, b) for a, used in edges.items() for b in used
                  if _layer(a) >= 0 and _layer(b) > _layer(a) or _layer(a) == -1 and _layer(b) >= 0)


def test_each_layer_uses_only_the_layers_beneath_it() -> None:
    upward = _upward(crate_graph())
    assert [(a, b) for a, b in upward if not (a == "error" and b in ERROR_NAMES)] == []


def test_no_import_circles_in_the_crate() -> None:
    assert cycles(crate_graph()) == []
