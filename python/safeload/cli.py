"""The ``safeload`` command: ``inspect``, ``verify``, ``patch-install``.

Also reachable as ``python -m safeload``.  Subcommands import what they need lazily, so
``safeload --help`` does not import torch.  Exit status: 0 success, 1 a file failed (or could
not be read), 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

PTH_NAME = "safeload_autopatch.pth"  # = safeload.patch.PTH_NAME (not imported: --help stays cheap)

# name -> one-line help
COMMANDS = {
    "inspect": "print a file's metadata and tensor table (name, dtype, shape, offsets, bytes)",
    "verify": "fully validate files: header rules, every tensor read, pread and mmap reads agree",
    "patch-install": "install the SAFELOAD_PATCH=1 startup hook (.pth) into site-packages",
}

_VERIFY_DESCRIPTION = """\
Fully validates each FILE: opens it (every header rule is checked), reads every tensor with
the parallel pread backend, and compares each tensor byte for byte against a second read
through mmap. Prints one line per file:

  OK path (N tensors, X GiB, pread, R GiB/s)     R: the pread read rate
  FAIL path: message

Exit status: 0 when every file is OK, 1 when any file fails, 2 on usage errors."""

_PATCH_INSTALL_DESCRIPTION = f"""\
Writes {PTH_NAME} into site-packages (or --target). Python runs it at every start; it costs
one environment lookup unless SAFELOAD_PATCH is set, and with SAFELOAD_PATCH=1 it calls
safeload.patch(), so that safetensors.safe_open, safetensors.torch.load_file / load /
load_model and safetensors.numpy.load_file (and every name imported from them, e.g. in
transformers) read through safeload. SAFELOAD_PATCH=<backend> (auto, pread, direct, mmap) also
forces that backend. Wheels install this hook already; use this command for editable or
development installs. --remove deletes it."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="safeload",
        description="safeload: a parallel, strict safetensors reader.",
        epilog="`safeload COMMAND --help` describes each command; benchmarks are benches/bench.py "
        "FILE... in a source checkout. "
        "Exit status: 0 success, 1 a file failed, 2 usage error.",
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    ins = sub.add_parser("inspect", help=COMMANDS["inspect"], description=COMMANDS["inspect"]
                         + ". Reads only the header.")
    ins.add_argument("file", help="a .safetensors file")
    ins.add_argument("--json", action="store_true",
                     help="print one JSON object (path, file_bytes, data_start, metadata, tensor_count, "
                          "data_bytes, tensors: [{name, dtype, shape, begin, end, bytes}]) instead of a table")
    ver = sub.add_parser("verify", help=COMMANDS["verify"], description=_VERIFY_DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    ver.add_argument("files", nargs="+", metavar="FILE", help="a .safetensors file")
    ver.add_argument("--threads", type=int, default=None, help="pread worker threads (default: automatic)")
    pin = sub.add_parser("patch-install", help=COMMANDS["patch-install"], description=_PATCH_INSTALL_DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    pin.add_argument("--target", metavar="DIR", default=None,
                     help="directory to write to (default: this interpreter's site-packages)")
    pin.add_argument("--remove", action="store_true", help="remove the hook instead of installing it")
    return p


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def inspect_file(path: str, as_json: bool = False, out: Any = None) -> int:
    from ._open import safe_open
    from ._safeload import redact

    out = out or sys.stdout
    with safe_open(path, "np", backend="pread") as f:
        h = f._handle
        rows: List[Dict[str, Any]] = [
            {"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "begin": i.begin, "end": i.end, "bytes": i.nbytes}
            for i in h.infos()
        ]
        info = {
            "path": redact(os.fspath(path)),  # a URL without its user info and tokens
            # The header's rule (tensors cover the data exactly) gives it, for a URL too.
            "file_bytes": h.data_start + max((r["end"] for r in rows), default=0),
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


# -- verify ---------------------------------------------------------------------------------

#: Tensors are read (pread) and compared in batches of about this many bytes, so that verifying
#: a file larger than memory holds at most one batch.
VERIFY_BATCH_BYTES = 1 << 30


def verify_file(path: str, threads: Optional[int] = None) -> str:
    """Verifies one file; returns its ``OK ...`` line, raises on any failure."""
    from ._safeload import Checkpoint, Handle, SafetensorError, redact

    if os.path.isdir(path):
        raise SafetensorError("is a directory")
    primary = Checkpoint([path], "pread", threads=threads)
    mirror = Handle(path, "mmap")
    try:
        infos = primary.infos()
        names = [i.name for i in infos]
        if mirror.offset_keys() != names or mirror.infos() != infos:
            raise SafetensorError("pread and mmap handles disagree on the header")
        total = 0
        for batch in primary.batches(max_bytes=VERIFY_BATCH_BYTES):
            items, _ = primary.read(batch)
            for name, code, shape, data in items:
                _, m_code, m_shape, m_data = mirror.read(name)
                if (m_code, list(m_shape)) != (code, list(shape)):
                    raise SafetensorError(f"tensor {name!r}: pread and mmap disagree on dtype/shape")
                if data != m_data:  # byte for byte, in the reader
                    raise SafetensorError(f"tensor {name!r}: pread and mmap bytes differ")
                total += len(data)
                del data, m_data
            del items
        stats = primary.stats()
    finally:
        primary.close()
        mirror.close()
    shown = redact(os.fspath(path))  # a URL without its user info and tokens
    return f"OK {shown} ({len(infos)} tensors, {total / 2**30:.3f} GiB, {stats.backend}, {stats.gib_per_s:.2f} GiB/s)"


def verify_files(paths: Sequence[str], threads: Optional[int] = None, out: Any = None) -> int:
    from ._safeload import redact

    out = out or sys.stdout
    failed = 0
    for path in paths:
        try:
            line = verify_file(path, threads=threads)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest still run
            failed += 1
            message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            line = f"FAIL {redact(os.fspath(path))}: {message or type(exc).__name__}"
        out.write(line + "\n")
        out.flush()
    return 1 if failed else 0


def patch_install(target: Optional[str], remove: bool, out: Any = None) -> int:
    from .patch import install_hook, uninstall_hook

    out = out or sys.stdout
    if remove:
        removed = uninstall_hook(target)
        out.write(f"removed {removed}\n" if removed else "no startup hook installed\n")
        return 0
    path = install_hook(target)
    out.write(f"wrote {path}\nset SAFELOAD_PATCH=1 to route safetensors through safeload\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(f"safeload {__version__}")
        return 0
    try:
        if args.command == "inspect":
            from ._safeload import SafetensorError, redact

            try:
                return inspect_file(args.file, as_json=args.json)
            except BrokenPipeError:
                raise
            except (OSError, SafetensorError) as exc:
                message = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                print(f"safeload inspect: {redact(args.file)}: {message}", file=sys.stderr)
                return 1
        if args.command == "verify":
            if args.threads is not None and args.threads < 1:
                parser.error("--threads must be at least 1")
            return verify_files(args.files, threads=args.threads)
        if args.command == "patch-install":
            return patch_install(args.target, args.remove)
    except BrokenPipeError:  # `safeload inspect f | head`
        sys.stderr.close()
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
