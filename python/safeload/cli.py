"""The ``safeload`` command: ``safeload bench ...`` and ``safeload inspect FILE``.

Also reachable as ``python -m safeload``.  Subcommands import what they need lazily, so
``safeload --help`` does not import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

# name -> one-line help; "verify" is reserved for a later release.
COMMANDS = {
    "bench": "benchmark safeload against safetensors (see `safeload bench --help`)",
    "inspect": "print a file's metadata and tensor table (name, dtype, shape, offsets, bytes)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="safeload", description="safeload: a parallel, strict safetensors reader.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("bench", help=COMMANDS["bench"], add_help=False)
    ins = sub.add_parser("inspect", help=COMMANDS["inspect"], description=COMMANDS["inspect"])
    ins.add_argument("file", help="a .safetensors file")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def inspect_file(path: str, as_json: bool = False, out: Any = None) -> int:
    from ._open import safe_open

    out = out or sys.stdout
    with safe_open(path, "np", backend="pread") as f:
        h = f._handle
        rows: List[Dict[str, Any]] = [
            {"name": n, "dtype": d, "shape": list(s), "begin": b, "end": e, "bytes": e - b} for n, d, s, b, e in h.infos()
        ]
        info = {
            "path": os.fspath(path),
            "file_bytes": os.path.getsize(path),
            "data_start": h.data_start,
            "metadata": f.metadata(),
            "tensor_count": len(rows),
            "data_bytes": sum(r["bytes"] for r in rows),
            "tensors": rows,
        }
    if as_json:
        json.dump(info, out, indent=1)
        out.write("\n")
        return 0
    out.write(f"{info['path']}: {info['tensor_count']} tensors, {_human(info['data_bytes'])} of data, "
              f"header {info['data_start']} bytes, file {_human(info['file_bytes'])}\n")
    meta = info["metadata"]
    if meta:
        out.write("metadata:\n")
        for k, v in meta.items():
            out.write(f"  {k}: {v}\n")
    else:
        out.write("metadata: none\n")
    if not rows:
        return 0
    table = [("name", "dtype", "shape", "begin", "end", "bytes")]
    table += [(r["name"], r["dtype"], "[" + ", ".join(map(str, r["shape"])) + "]", str(r["begin"]), str(r["end"]), str(r["bytes"]))
              for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    right = (False, False, False, True, True, True)
    for i, row in enumerate(table):
        cells = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)]
        out.write("  ".join(cells).rstrip() + "\n")
        if i == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `bench` owns its arguments (and its --help): hand everything after it over untouched.
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:], prog="safeload bench")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(f"safeload {__version__}")
        return 0
    if args.command == "inspect":
        try:
            return inspect_file(args.file, as_json=args.json)
        except BrokenPipeError:  # `safeload inspect f | head`
            sys.stderr.close()
            return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
