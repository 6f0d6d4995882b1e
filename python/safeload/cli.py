"""The ``safeload`` command: ``inspect``, ``verify``, ``hash``, ``patch-install``.

Also reachable as ``python -m safeload``.  Subcommands import what they need lazily, so
``safeload --help`` does not import torch.  Exit status: 0 success, 1 a file failed (or could
not be read), 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

PTH_NAME = "safeload_autopatch.pth"  # = safeload.patch.PTH_NAME (not imported: --help stays cheap)

# name -> one-line help
COMMANDS = {
    "inspect": "print a file's metadata and tensor table (name, dtype, shape, offsets, bytes)",
    "verify": "fully validate files: header rules, every tensor read, pread and mmap reads agree, SHA-256 digests",
    "hash": "print a sha256sum-compatible manifest of .safetensors files, hashed with the parallel reader",
    "patch-install": "install the SAFELOAD_PATCH=1 startup hook (.pth) into site-packages",
}

_VERIFY_DESCRIPTION = """\
Fully validates each FILE: opens it (every header rule is checked), reads every tensor with
the parallel pread backend, and compares each tensor byte for byte against a second read
through mmap. With --manifest or --sha256, the SHA-256 of each file is computed in that same
read (every byte of the file, header included) and checked. Prints one line per file:

  OK path (N tensors, X GiB, pread, R GiB/s)     R: the pread read rate
  OK path (..., R GiB/s, sha256 matches the manifest M)
  FAIL path: message

A FILE may be what `safeload hash` takes: a file, a directory or an index.json (its shards), a
URL. --manifest M takes the digests from M, in the format `sha256sum` writes (`safeload hash`
writes it too): each file is looked up by the name `safeload hash` gives it (relative to the
directory or the index's folder; a file as given), else by M's names read relative to M's
folder, so `safeload hash X > M && safeload verify --manifest M X` holds wherever M is kept.
With no FILE, every file M names (relative to its folder) is verified; a file that M does not
name fails. --sha256 HEX checks the one FILE against HEX.
With neither, a file whose SHA-256 the source knows is checked against it, as verify=True
checks: a Hugging Face cache file against its blob name, a Hub URL against the digest the Hub
reports, a file with a SHA256SUMS beside it against its line there.

Exit status: 0 when every file is OK, 1 when any file fails (or the manifest cannot be read),
2 on usage errors."""

_HASH_DESCRIPTION = """\
Prints the SHA-256 of each .safetensors file as `sha256sum` does (`<64 hex>  <name>` per
line), every byte read once with the parallel reader, in rounds of at most 1 GiB (a file
larger than memory hashes), several files side by side. A directory or an index.json stands
for its shards, found as load_checkpoint finds them and named relative to that directory (the
index's folder); a file is named as given. So

  safeload hash DIR > DIR/SHA256SUMS
  (cd DIR && sha256sum -c SHA256SUMS)        # or: safeload verify --manifest DIR/SHA256SUMS

Exit status: 0 when every file was hashed, 1 when one could not be (its error on stderr; the
others are still printed), 2 on usage errors."""

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
    ver.add_argument("files", nargs="*", metavar="FILE", help="a .safetensors file")
    ver.add_argument("--threads", type=int, default=None, help="pread worker threads (default: automatic)")
    pins = ver.add_mutually_exclusive_group()
    pins.add_argument("--manifest", metavar="M", default=None,
                      help="check each file's SHA-256 against the sha256sum manifest M (names relative to M's folder; "
                           "with no FILE, every file M names)")
    pins.add_argument("--sha256", metavar="HEX", default=None,
                      help="check the one FILE's SHA-256 against HEX (64 hex digits, optionally after sha256:)")
    hsh = sub.add_parser("hash", help=COMMANDS["hash"], description=_HASH_DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    hsh.add_argument("paths", nargs="+", metavar="FILE_OR_DIR",
                     help="a .safetensors file, a checkpoint directory or its index.json")
    hsh.add_argument("--threads", type=int, default=None, help="reader threads (default: automatic)")
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


#: A file's expected SHA-256 (64 hex digits) and where that expectation came from (for messages:
#: "the manifest M", "--sha256").
Expected = Tuple[str, str]


def verify_file(path: str, threads: Optional[int] = None, expected: Optional[Expected] = None) -> str:
    """Verifies one file (and its SHA-256 against ``expected``, computed in the same read);
    returns its ``OK ...`` line, raises on any failure."""
    from ._safeload import Checkpoint, Handle, SafetensorError, redact

    if os.path.isdir(path):
        raise SafetensorError("is a directory")
    primary = Checkpoint([path], "pread", threads=threads, hash=expected is not None)
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
        checked = ""
        if expected is not None:
            digest, source = expected
            actual = primary.digests()[0]
            if actual != digest:
                raise SafetensorError(f"SHA-256 mismatch: expected {digest} ({source}), got {actual}")
            checked = f", sha256 matches {source}"
    finally:
        primary.close()
        mirror.close()
    shown = redact(os.fspath(path))  # a URL without its user info and tokens
    return (f"OK {shown} ({len(infos)} tensors, {total / 2**30:.3f} GiB, {stats.backend}, "
            f"{stats.gib_per_s:.2f} GiB/s{checked})")


def manifest_expectations(manifest: str) -> Tuple[Dict[str, Expected], Dict[str, Tuple[str, Expected]]]:
    """The digests ``manifest`` holds, by name as written ({name: (digest, "the manifest M")}), and
    by the file each name resolves to against the manifest's folder ({real path: (path as shown,
    expected)}). Raises when it cannot be read or a line is malformed."""
    from ._safeload import read_manifest

    folder = os.path.dirname(manifest)
    source = f"the manifest {manifest}"
    by_name: Dict[str, Expected] = {}
    by_file: Dict[str, Tuple[str, Expected]] = {}
    for name, digest in read_manifest(manifest):
        by_name[name] = (digest, source)
        path = os.path.join(folder, name)
        by_file[os.path.realpath(path)] = (path, (digest, source))
    return by_name, by_file


def verify_files(paths: Sequence[str], threads: Optional[int] = None, out: Any = None,
                 manifest: Optional[str] = None, sha256: Optional[str] = None) -> int:
    """Verifies each file (against ``manifest``'s or ``sha256``'s digest when given), one line per
    file; with a manifest and no paths, every file it names. A path is what ``safeload hash`` takes:
    a file, a directory or an index (its shards), a URL; with a manifest, each file is looked up by
    the name ``safeload hash`` gives it (relative to the checkpoint's root), else by the file the
    manifest's own names resolve to against its folder. Returns the exit status."""
    from ._safeload import SafetensorError, known_digest, redact

    out = out or sys.stdout
    by_name: Dict[str, Expected] = {}
    by_file: Dict[str, Tuple[str, Expected]] = {}
    if manifest is not None:
        try:
            by_name, by_file = manifest_expectations(manifest)
        except (OSError, SafetensorError) as exc:
            print(f"safeload verify: {_message(exc)}", file=sys.stderr)
            return 1
    targets: List[Tuple[str, str]] = [(shown, shown) for shown, _ in by_file.values()] if not paths else []
    failed = 0
    for path in paths:
        try:
            targets += hash_targets(path)
        except (OSError, SafetensorError) as exc:
            failed += 1
            out.write(f"FAIL {redact(os.fspath(path))}: {_message(exc)}\n")
    for path, name in targets:
        try:
            expected = (sha256, "--sha256") if sha256 is not None else None
            if manifest is not None:
                expected = by_name.get(redact(name)) or by_file.get(os.path.realpath(path), (None, None))[1]
                if expected is None:
                    raise SafetensorError(f"not in the manifest {manifest} (no line names this file)")
            elif expected is None and not os.path.isdir(path):
                expected = known_digest(path)  # what verify=True would check: None when nothing is known
            line = verify_file(path, threads=threads, expected=expected)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest still run
            failed += 1
            line = f"FAIL {redact(os.fspath(path))}: {_message(exc)}"
        out.write(line + "\n")
        out.flush()
    return 1 if failed else 0


def _message(exc: BaseException) -> str:
    message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return message or type(exc).__name__


# -- hash -----------------------------------------------------------------------------------


def hash_targets(path: str) -> List[Tuple[str, str]]:
    """The files ``safeload hash`` reads for ``path`` and the names it prints: a directory's, an
    index's or a prefix's shards named relative to the checkpoint's root (that directory, the
    index's folder), a file (or an object) as given."""
    from ._safeload import checkpoint_files

    if os.path.isfile(path) and not path.endswith(".json"):
        return [(path, path)]  # a file named as given, whatever its name
    return checkpoint_files(path)


def hash_files(paths: Sequence[str], threads: Optional[int] = None, out: Any = None) -> int:
    """Prints a sha256sum manifest of ``paths`` (see ``safeload hash --help``); returns the exit status."""
    from ._safeload import SafetensorError, manifest_line, redact
    from ._safeload import hash_files as digests_of

    out = out or sys.stdout
    failed = 0
    targets: List[Tuple[str, str]] = []
    for path in paths:
        try:
            targets += hash_targets(path)
        except (OSError, SafetensorError) as exc:
            failed += 1
            print(f"safeload hash: {redact(path)}: {_message(exc)}", file=sys.stderr)

    def digests(files: List[str]) -> List[str]:
        return digests_of(files, max_bytes=VERIFY_BATCH_BYTES, threads=threads)

    try:  # every file in one pool of readers
        found: List[Optional[str]] = list(digests([f for f, _ in targets]))
    except (OSError, SafetensorError):  # one failed: each alone, so that the others still print
        found = []
        for file, _ in targets:
            try:
                found += digests([file])
            except (OSError, SafetensorError) as exc:
                failed += 1
                found.append(None)
                print(f"safeload hash: {_message(exc)}", file=sys.stderr)
    for (_, name), digest in zip(targets, found):
        if digest is not None:  # a URL without its user info and tokens
            out.write(manifest_line(digest, redact(name)) + "\n")
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


def _pins(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Dict[str, Optional[str]]:
    """verify's digest options, checked: --sha256 (normalized) with one FILE, or --manifest."""
    from ._safeload import SafetensorError, parse_digest

    if not args.files and args.manifest is None:
        parser.error("the following arguments are required: FILE (or --manifest)")
    sha256 = args.sha256
    if sha256 is not None:
        if len(args.files) != 1:
            parser.error("--sha256 checks one FILE")
        try:
            sha256 = parse_digest(sha256)
        except SafetensorError as exc:
            parser.error(f"--sha256: {exc}")
    return {"manifest": args.manifest, "sha256": sha256}


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
        if args.command in ("verify", "hash") and args.threads is not None and args.threads < 1:
            parser.error("--threads must be at least 1")
        if args.command == "verify":
            return verify_files(args.files, threads=args.threads, **_pins(parser, args))
        if args.command == "hash":
            return hash_files(args.paths, threads=args.threads)
        if args.command == "patch-install":
            return patch_install(args.target, args.remove)
    except BrokenPipeError:  # `safeload inspect f | head`
        sys.stderr.close()
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
