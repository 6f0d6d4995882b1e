#!/usr/bin/env python3
"""The shape of the code, as issue 53 asks for it, for a checkout (default: this one):

    python .ci/counts.py [ROOT]

Code lines per language (not blank, not only a comment), the longest file and function of each
(functions outside Rust test modules; Python docstrings not counted), the files at the top of
src/, the places outside the storage layer (src/storage/) that ask whether bytes are remote
or a path is a URL or name a kind of storage (a `Backing` variant, a store's object: issue 69;
any is an error, exit status 1), and the places outside the read plan (src/read/strategy.rs) and the code that
executes it (src/read/source/: maps or reads as the plan says) that choose how to read: compare a
strategy or backend, or call the plan's rules themselves instead of asking the checkpoint's plan
(and, in the Python package, compare backend names)."""

from __future__ import annotations

import pathlib
import re
import sys


def rust_code(text: str) -> str:
    """Rust without its test module."""
    at = text.find("#[cfg(test)]\nmod tests")
    return text if at < 0 else text[:at]


def code_lines(text: str, comment: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith(comment))


def functions(root: pathlib.Path) -> list:
    """(lines, name, path) of every function, as .ci/long-functions.py measures them."""
    import subprocess

    here = pathlib.Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, str(here / "long-functions.py"), str(root), "0"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    return [(int(r[0]), r[1], r[2]) for r in rows if len(r) >= 3]


#: Naming a kind of storage: a `Backing` variant (matched or made), a store's object, a read of
#: one. Above src/storage/ code asks a backing what it can do and reads through its `Reader`.
STORAGE_KIND = re.compile(r"\bBacking::(File|Remote)\b|\bremote::Object\b|\bObject::|\bread_remote\b")


def storage_kinds(root: pathlib.Path) -> list:
    """`src/FILE:LINE` of every line outside src/storage/ that names a kind of storage (tests'
    modules included: they make their backings through what storage offers, `Backing::from`)."""
    found = []
    for f in sorted((root / "src").rglob("*.rs")):
        rel = f.relative_to(root / "src")
        if rel.parts[0] == "storage":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if STORAGE_KIND.search(line) and not line.strip().startswith("//"):
                found.append(f"src/{rel.as_posix()}:{i}")
    return found


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    rust = sorted((root / "src").rglob("*.rs"))
    py = sorted((root / "python" / "safeload").glob("*.py"))
    every = functions(root)
    for name, files, comment, ext in (("Rust", rust, "//", ".rs"), ("Python", py, "#", ".py")):
        sizes = [(code_lines(rust_code(f.read_text()) if name == "Rust" else f.read_text(), comment), f)
                 for f in files]
        fns = [f for f in every if f[2].split(":")[0].endswith(ext)]
        longest = max(fns)
        print(f"{name}: {sum(n for n, _ in sizes)} code lines in {len(files)} files; longest file "
              f"{max(sizes)[1].relative_to(root)} ({max(sizes)[0]}); longest function {longest[1]} "
              f"{longest[2]} ({longest[0]} lines); over 80 lines: {sum(1 for f in fns if f[0] > 80)}")
    top = sorted(p.name for p in (root / "src").iterdir())
    print(f"top of src/: {len(top)} entries: {' '.join(top)}")
    asks = []
    for f in rust:
        rel = f.relative_to(root / "src")
        if rel.parts[0] in ("storage", "remote") or rel.name in ("backing.rs", "redact.rs"):
            continue
        for i, line in enumerate(rust_code(f.read_text()).splitlines(), 1):
            if re.search(r"\bis_remote\(|\bis_url\(", line) and "fn is_" not in line and not line.strip().startswith("//"):
                asks.append(f"src/{rel}:{i}")
    print(f"outside the storage layer, asking remote / URL: {len(asks)}: {' '.join(asks)}")
    kinds = storage_kinds(root)
    print(f"outside the storage layer, naming a kind of storage: {len(kinds)}: {' '.join(kinds)}")
    choosing = re.compile(r"[!=]= *(Strategy|Backend)::|(Strategy|Backend)::\w+(\(\w*\))? *=>|matches!\(.*(Strategy|Backend)::"
                          r"|\b(choose|for_purpose|populate_ahead|resolve_measured)\(|Mode::ahead\(")
    chooses = []
    for f in rust:
        rel = f.relative_to(root / "src")
        # (before issue 53's layers, the plan and its executor were src/strategy.rs, src/source/)
        if rel.as_posix() in ("read/strategy.rs", "strategy.rs") or rel.parts[0] == "source" \
                or rel.parts[:2] == ("read", "source"):
            continue
        for i, line in enumerate(rust_code(f.read_text()).splitlines(), 1):
            if choosing.search(line) and not line.strip().startswith("//"):
                chooses.append(f"src/{rel}:{i}")
    names = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](auto|mmap|pread|direct)["']""")
    for f in py:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if names.search(line) and not line.strip().startswith("#"):
                chooses.append(f"{f.relative_to(root)}:{i}")
    print(f"outside the read plan and its executor, choosing how to read: {len(chooses)}: {' '.join(chooses)}")
    return 1 if asks or kinds else 0


if __name__ == "__main__":
    sys.exit(main())
