"""The cross-built abi3 wheels of `.ci/wheels` (in dist/, or $SAFELOAD_WHEELS): the macOS
extensions are Mach-O libraries of the right CPU that import no Linux-only symbol, the Windows
one is a PE x86-64 DLL importing the stable ABI's python3.dll. The binaries' headers and symbol
tables are read here, with no tool. No wheel has the test-only helpers (cargo feature `testing`).
`.ci/run` builds every wheel before the tests; a wheel that was not built is skipped, saying so."""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

DIST = Path(os.environ.get("SAFELOAD_WHEELS") or Path(__file__).resolve().parent.parent / "dist")

# What the Rust std, libc and the core call on Linux only: glibc's errno, its 64-bit aliases,
# the page-cache and huge-page calls macOS lacks. (mincore, preadv, fcntl exist on macOS.)
LINUX_ONLY = {
    "__errno_location",
    "posix_fadvise",
    "posix_fadvise64",
    "fstatfs64",
    "statfs64",
    "open64",
    "openat64",
    "pread64",
    "preadv64",
    "preadv2",
    "mmap64",
    "fstat64",
    "lseek64",
    "sched_getaffinity",
    "gnu_get_libc_version",
    "__cxa_thread_atexit_impl",
    "memfd_create",
    "statx",
    "mremap",
    "getrandom",
}

# The functions of `safeload._safeload._testing` (src/py/testing.rs, cargo feature `testing`) as
# pyo3 names them to Python: NUL-terminated (PyMethodDef.ml_name), which no Rust string or
# mangled symbol is, so a wheel built without the feature has none of them.
TESTING_ONLY = [b"convert_bytes\0", b"parse_ring\0", b"residency\0", b"set_cgroup_root\0", b"readahead_bytes\0"]
LINUX_TAG = "manylinux*_x86_64"  # manylinux2014 (maturin names it twice, in either order)

MH_MAGIC_64 = 0xFEEDFACF
CPU_ARM64 = 0x0100000C
CPU_X86_64 = 0x01000007
MH_DYLIB, MH_BUNDLE = 6, 8
LC_SYMTAB, LC_LOAD_DYLIB = 0x2, 0xC
N_STAB, N_TYPE, N_EXT, N_UNDF = 0xE0, 0x0E, 0x01, 0x0


def wheel(tag: str) -> Path:
    found = sorted(DIST.glob(f"safeload-*-cp39-abi3-*{tag}.whl"))
    if not found:
        pytest.skip(f"no *{tag}.whl in {DIST}: build it with `bash .ci/wheels` (.ci/run does)")
    return found[-1]


def extension(whl: Path, suffix: str) -> bytes:
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.startswith("safeload/_safeload") and n.endswith(suffix)]
        assert names == [f"safeload/_safeload{suffix}"], z.namelist()
        return z.read(names[0])


def macho(data: bytes) -> Tuple[int, int, Set[str], Set[str], List[str]]:
    """(cputype, filetype, undefined external symbols, defined ones, load dylibs) of a thin
    64-bit little-endian Mach-O file."""
    magic, cputype, _sub, filetype, ncmds, _size, _flags, _res = struct.unpack_from("<IiiIIIII", data)
    assert magic == MH_MAGIC_64, f"not a 64-bit Mach-O file (magic {magic:#x})"
    undefined: Set[str] = set()
    defined: Set[str] = set()
    dylibs: List[str] = []
    at = 32
    for _ in range(ncmds):
        cmd, cmdsize = struct.unpack_from("<II", data, at)
        if cmd == LC_SYMTAB:
            symoff, nsyms, stroff, _strsize = struct.unpack_from("<IIII", data, at + 8)
            for i in range(nsyms):
                strx, ntype, _sect, _desc, _value = struct.unpack_from("<IBBHQ", data, symoff + 16 * i)
                if ntype & N_STAB or not ntype & N_EXT:
                    continue
                end = data.index(b"\0", stroff + strx)
                name = data[stroff + strx : end].decode()
                (undefined if ntype & N_TYPE == N_UNDF else defined).add(name)
        elif cmd == LC_LOAD_DYLIB:
            (name_off,) = struct.unpack_from("<I", data, at + 8)
            dylibs.append(data[at + name_off : data.index(b"\0", at + name_off)].decode())
        at += cmdsize
    return cputype, filetype, undefined, defined, dylibs


def pe_imports(data: bytes) -> Tuple[int, List[str], List[str]]:
    """(machine, imported DLL names, exported names) of a PE32+ image."""
    assert data[:2] == b"MZ", "no DOS header"
    (pe,) = struct.unpack_from("<I", data, 0x3C)
    assert data[pe : pe + 4] == b"PE\0\0", "no PE signature"
    machine, nsections, _t, _p, _n, opt_size, _c = struct.unpack_from("<HHIIIHH", data, pe + 4)
    opt = pe + 24
    (opt_magic,) = struct.unpack_from("<H", data, opt)
    assert opt_magic == 0x20B, "not PE32+"
    export_rva, _export_size, import_rva, _import_size = struct.unpack_from("<IIII", data, opt + 112)
    sections = []
    for i in range(nsections):
        s = opt + opt_size + 40 * i
        vsize, vaddr, rawsize, rawptr = struct.unpack_from("<IIII", data, s + 8)
        sections.append((vaddr, max(vsize, rawsize), rawptr))

    def offset(rva: int) -> int:
        for vaddr, size, rawptr in sections:
            if vaddr <= rva < vaddr + size:
                return rva - vaddr + rawptr
        raise AssertionError(f"RVA {rva:#x} in no section")

    dlls = []
    at = offset(import_rva)
    while True:
        _ilt, _ts, _fwd, name_rva, iat = struct.unpack_from("<IIIII", data, at)
        if name_rva == 0 and iat == 0:
            break
        n = offset(name_rva)
        dlls.append(data[n : data.index(b"\0", n)].decode())
        at += 20
    exports = []
    if export_rva:
        e = offset(export_rva)
        # IMAGE_EXPORT_DIRECTORY: NumberOfNames at 24, AddressOfNames at 32.
        (nnames,) = struct.unpack_from("<I", data, e + 24)
        (names_rva,) = struct.unpack_from("<I", data, e + 32)
        for i in range(nnames):
            (name_rva,) = struct.unpack_from("<I", data, offset(names_rva) + 4 * i)
            n = offset(name_rva)
            exports.append(data[n : data.index(b"\0", n)].decode())
    return machine, dlls, exports


def strip(sym: str) -> str:
    """Mach-O C symbols carry a leading underscore."""
    return sym[1:] if sym.startswith("_") else sym


@pytest.mark.parametrize("tag, cpu", [("macosx_11_0_arm64", CPU_ARM64), ("macosx_10_12_x86_64", CPU_X86_64)])
def test_macos_extension_is_macho_without_linux_symbols(tag: str, cpu: int) -> None:
    cputype, filetype, undefined, defined, dylibs = macho(extension(wheel(tag), ".abi3.so"))
    assert cputype == cpu, f"cputype {cputype:#x}, want {cpu:#x}"
    assert filetype in (MH_DYLIB, MH_BUNDLE), filetype
    assert "_PyInit__safeload" in defined
    plain = {strip(s) for s in undefined}
    assert not plain & LINUX_ONLY, sorted(plain & LINUX_ONLY)
    assert not {s for s in plain if s.endswith("64") and s[:-2] in {"open", "pread", "fstat", "lseek", "mmap"}}
    # The platform seam's macOS calls are there (F_NOCACHE/F_RDADVISE go through fcntl).
    assert {"mincore", "fcntl", "preadv"} <= plain, sorted(plain)
    # abi3: Python's symbols are looked up at load time, no libpython is linked.
    assert "PyModule_Create2" in plain
    assert all("python" not in d.lower() for d in dylibs), dylibs
    assert all(d.startswith("/usr/lib/") or d.startswith("/System/") for d in dylibs), dylibs


def test_windows_extension_imports_the_stable_abi() -> None:
    machine, dlls, exports = pe_imports(extension(wheel("win_amd64"), ".pyd"))
    assert machine == 0x8664, f"machine {machine:#x}"
    assert "PyInit__safeload" in exports, exports
    lower = [d.lower() for d in dlls]
    assert "python3.dll" in lower, dlls
    assert not [d for d in lower if d.startswith("python3") and d != "python3.dll"], dlls


def test_wheels_are_abi3_for_three_oses() -> None:
    wheels = sorted(p.name for p in DIST.glob("safeload-*.whl")) if DIST.is_dir() else []
    if not wheels:
        pytest.skip(f"no wheels in {DIST}: build them with `bash .ci/wheels`")
    for name in wheels:
        assert "-cp39-abi3-" in name, name
        with zipfile.ZipFile(DIST / name) as z:
            files = z.namelist()
        assert "safeload/_frameworks.py" in files and "safeload_autopatch.pth" in files, name
        assert not [f for f in files if "cpython-" in f], f"a version-specific extension in {name}"


@pytest.mark.parametrize(
    "tag, suffix",
    [(LINUX_TAG, ".abi3.so"), ("macosx_11_0_arm64", ".abi3.so"), ("macosx_10_12_x86_64", ".abi3.so"),
     ("win_amd64", ".pyd")],
)
def test_wheels_leave_out_the_test_helpers(tag: str, suffix: str) -> None:
    data = extension(wheel(tag), suffix)
    assert b"memory_info\0" in data  # a function every build has, named as the helpers would be
    assert not [name for name in TESTING_ONLY if name in data]


# Loads the extension alone (not the installed package, which has the helpers), as a user's
# `import safeload` would, and lists what it offers.
LIST_NAMES = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("safeload._safeload", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps({"module": sorted(vars(module)), "Handle": sorted(vars(module.Handle)),
                  "Bytes": sorted(vars(module.Bytes))}))
"""


def test_linux_wheel_imports_without_the_test_helpers(tmp_path: Path) -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the Linux wheel is for x86_64 Linux")
    so = tmp_path / "_safeload.abi3.so"
    so.write_bytes(extension(wheel(LINUX_TAG), ".abi3.so"))
    proc = subprocess.run([sys.executable, "-c", LIST_NAMES, str(so)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = json.loads(proc.stdout)
    assert {"Handle", "Bytes", "memory_info"} <= set(names["module"]), names["module"]
    assert "_testing" not in names["module"]
    assert "readahead_bytes" not in names["Handle"]
    assert "address" not in names["Bytes"]
