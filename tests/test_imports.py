"""Neither the Python package nor the Rust crate has an import circle, file against file. Python
imports made inside functions count too (a lazy import hides a circle from Python, not from a
reader); in the crate, a file uses another when it names it by a ``crate::``, ``super::``,
``self::`` or bare child-module path (groups in braces included, re-exports followed to the file a
name comes from), test modules and comments left out (see ``crate_graph``). Each layer of
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

#: A path into another module: ``crate::a::b``, ``super::b`` (``super::super::``), ``self::b``, or
#: a bare ``child::b`` (``child`` a module the file declares), with an optional group
#: ``::{x, y::z}`` (one level of nested braces inside it).
_USE = re.compile(r"(?<![:\w])(crate|super(?:::super)*|self|\w+)((?:::\w+)*)(?:::\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\})?")
#: A module the file declares (``mod x;``, ``pub(crate) mod x;``), and a re-export.
_MOD = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.M)
_REEXPORT = re.compile(r"^\s*pub(?:\([^)]*\))?\s+use\s+([^;]*);", re.M)
#: ``platform/mod.rs`` declares ``mod os;`` with a ``#[path]`` per platform: ``os::`` names each.
_PATHED = {"platform::os": ["platform::linux", "platform::macos", "platform::windows"]}


def _module(path: pathlib.Path) -> str:
    """The module a file is: ``src/read/source/ranges.rs`` -> ``read::source::ranges``,
    ``src/read/source/mod.rs`` -> ``read::source``."""
    parts = list(path.relative_to(CRATE).with_suffix("").parts)
    if parts[-1] == "mod":
        parts.pop()
    return "::".join(parts)


def _paths(node: str, text: str, children: Set[str]) -> List[List[str]]:
    """Every module path in ``text`` (code of module ``node``, which declares the modules
    ``children``), from the crate's root: each ``crate::``, ``super::``, ``self::`` or bare child
    path, a group in braces as one per item."""
    here = node.split("::")
    found: List[List[str]] = []
    for head, tail, group in _USE.findall(text):
        if not tail and not group:
            continue
        if head == "crate":
            base: List[str] = []
        elif head == "self":
            base = here
        elif head.startswith("super"):
            base = here[: max(0, len(here) - head.count("super"))]
        elif head in children:
            base = here + [head]
        else:
            continue  # a local name, a type, an external crate
        prefix = base + [s for s in tail.split("::") if s]
        if not group:
            found.append(prefix)
            continue
        for item in group.split(","):
            segments = [s.strip() for s in item.split("{")[0].split("::")]
            if item.strip():
                found.append(prefix + [s.split(" as ")[0].strip() for s in segments if s and s != "self"])
    return found


def crate_graph() -> Dict[str, Set[str]]:
    """Every file of the crate (as its module) and the files it uses, as a reader sees them: each
    path names the file of its longest prefix that is one (``crate::storage::remote::Object``
    names ``storage/remote/mod.rs``; ``super::config::is_true`` in ``storage/remote/tls.rs`` names
    ``storage/remote/config.rs``; ``pieces::cut`` in ``storage/write/mod.rs``, which declares
    ``mod pieces;``, names ``storage/write/pieces.rs``). A ``pub use`` is its folder's table of
    contents: a name it re-exports names the file the name comes from (``super::Session`` in a
    child of ``storage/write/mod.rs`` names ``storage/write/session.rs``), and the re-export is not
    itself a use (the file's own code naming that name is). One type's ``impl`` split across a folder's files is one type: method calls are
    not paths. ``lib.rs`` is left out (it declares the modules)."""
    files = {_module(p): p for p in CRATE.rglob("*.rs")}
    files.pop("lib", None)
    codes = {node: _code(path.read_text()) for node, path in files.items()}

    def resolve(segments: List[str]) -> tuple:
        """The file a path names, and the rest of the path inside it."""
        for k in range(len(segments), 0, -1):
            name = "::".join(segments[:k])
            if name in files or name in _PATHED:
                return name, segments[k:]
        return None, []

    exported: Dict[str, Dict[str, List[str]]] = {}
    for node, code in codes.items():
        exported[node] = {}
        for clause in _REEXPORT.findall(code):
            for segments in _paths(node, clause, set(_MOD.findall(code))):
                exported[node][segments[-1]] = segments

    def targets(segments: List[str]) -> List[str]:
        name, rest = resolve(segments)
        for _ in range(8):  # follow re-exports (a chain is short; a loop is not followed for ever)
            if name is None or not rest or rest[0] not in exported.get(name, {}):
                break
            name, rest = resolve(exported[name][rest[0]] + rest[1:])
        return _PATHED.get(name, [name]) if name else []

    edges: Dict[str, Set[str]] = {}
    for node, code in codes.items():
        body = _REEXPORT.sub("", code)
        children = set(_MOD.findall(code))
        used = _paths(node, body, children)
        # A name a re-export brings into scope that the file itself uses is a use too.
        used += [segments for name, segments in exported[node].items()
                 if re.search(rf"(?<![:\w]){re.escape(name)}\b", body)]
        edges[node] = {t for segments in used for t in targets(segments)} - {node}
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
    assert "py::handle" in edges["py::handle::reads"]
    # A bare path into a child module the file declares, and the files `os::` stands for.
    assert "storage::write::pieces" in edges["storage::write"]
    assert {"platform::linux", "platform::macos", "platform::windows"} <= edges["platform"]
    # A re-exported name names the file it comes from; the re-export itself is no use.
    assert "storage::write::session" not in edges["storage::write"]
    assert "platform::kinds" in edges["storage::location"] and "platform" in edges["storage::location"]


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


def test_the_crate_check_fails_on_a_circle_with_a_child(tmp_path, monkeypatch) -> None:
    """A folder's front file that uses a child by a bare path (``pieces::cut``) while the child
    uses what the front file defines (``super::WriteOptions``) is a circle; a child using a name
    the front file only re-exports from a sibling is not."""
    crate = tmp_path / "src"
    (crate / "storage" / "write").mkdir(parents=True)
    (crate / "lib.rs").write_text("mod storage;\n")
    (crate / "storage" / "mod.rs").write_text("pub mod write;\n")
    write = crate / "storage" / "write"
    (write / "mod.rs").write_text(
        "mod pieces;\nmod session;\npub use session::Session;\n"
        "pub struct WriteOptions;\npub fn write() { pieces::cut(); }\n")
    (write / "session.rs").write_text("pub struct Session;\n")
    (write / "pieces.rs").write_text("use super::Session;\npub fn cut() {}\n")
    monkeypatch.setattr(sys.modules[__name__], "CRATE", crate)
    assert cycles(crate_graph()) == []
    assert crate_graph()["storage::write::pieces"] == {"storage::write::session"}
    assert crate_graph()["storage::write"] == {"storage::write::pieces"}
    (write / "mod.rs").write_text(  # the front file using the name it re-exports uses its file
        "mod pieces;\nmod session;\npub use session::Session;\n"
        "pub struct WriteOptions;\npub fn write() -> Session { pieces::cut(); Session }\n")
    assert crate_graph()["storage::write"] == {"storage::write::pieces", "storage::write::session"}
    (write / "pieces.rs").write_text("use super::{Session, WriteOptions};\npub fn cut() {}\n")
    assert cycles(crate_graph()) == [["storage::write", "storage::write::pieces", "storage::write"]]


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


def _counts():
    """`.ci/counts.py` as a module (its checks of where code may name a kind of storage)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ci_counts", ROOT / ".ci" / "counts.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nothing_above_the_storage_layer_names_a_kind_of_storage(tmp_path) -> None:
    """The reader reads through storage's `Reader` whatever holds the bytes (issue 69): no
    `Backing::File` / `Backing::Remote`, no store's object, outside src/storage/; and the check
    finds one where it is."""
    counts = _counts()
    assert counts.storage_kinds(ROOT) == []
    crate = tmp_path / "src"
    (crate / "read").mkdir(parents=True)
    (crate / "storage").mkdir()
    (crate / "storage" / "backing.rs").write_text("pub enum Backing { File(File), Remote(Object) }\n")
    (crate / "read" / "engine.rs").write_text(
        "fn read(b: &Backing) {\n    // Backing::Remote in a comment is no use\n"
        "    match b {\n        Backing::File(f) => f,\n"
        "        Backing::Remote(o) => return read_remote(o),\n    }\n}\n")
    assert counts.storage_kinds(tmp_path) == ["src/read/engine.rs:4", "src/read/engine.rs:5"]
