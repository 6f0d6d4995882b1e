#!/usr/bin/env python3
"""Benchmark harness: safeload against safetensors 0.8 and against what the machine can do.

    python benches/bench.py                         # sample checkpoints, warm + cold, 3 rounds
    python benches/bench.py --size small --rounds 2
    python benches/bench.py model.safetensors ckpt-dir/ --no-cold --out bench-out
    python benches/bench.py --slow-fs               # sharded sample through a FUSE mount, +2 ms per read

Test and benchmark tooling of a source checkout, not part of the wheel; point it at your own
files to compare the loaders on them (``python benches/bench.py FILE... --contenders ...``). It needs the
package importable (the editable install: ``pip install -e '.[test]'``); ``benches/test_large.py``
imports its sample writers by path.

Every measurement runs in a fresh subprocess (``python benches/bench.py --worker SPEC``) so each
contender starts with an empty heap, and the contenders are interleaved in rounds so drift on a
shared machine hits them alike.  Each round runs the contenders in its own order (a shuffle seeded
by ``--seed``, recorded in results.json), and the harness sleeps ``--settle`` seconds before every
measured run: memory that one process has just freed is much faster to fault in again than fresh
memory, so a fixed order (A B C A B C) would favour whoever always follows the largest load.  A
worker times the load only (after its imports), and reports bytes, seconds, its RSS before the load
and its peak RSS as one JSON line.

Cache states: *warm* reads every file once before the first round; *cold* drops each file from
the page cache (``posix_fadvise(DONTNEED)``) in the worker right before the timed load, and
records how much of the file was still resident (``mincore``) to show the drop worked.

``--slow-fs [LATENCY_S]`` replaces both with one state, *fuse*: every dataset's directory is
mirrored through a slowfs FUSE mount (``tests/support/slowfs.c``, compiled on first use: needs a
checkout, fuse3, libfuse3-dev, pkg-config and a C compiler; made once per dataset for the whole
run in a temporary directory, unmounted at the end, also on error or Ctrl-C) that adds LATENCY_S
to every read request, and every contender reads through it.  ``--slow-fs-options`` passes more
slowfs options (e.g. ``"--max-background 128"`` for a tuned mount; kernel defaults otherwise).
FUSE drops the kernel's page cache of a file at each open (no ``keep_cache``), so every load goes
through the daemon; the files under the mount are kept warm so the added latency, not the disk,
is what is measured.

Two reference rates bound what a loader can reach on the same files:

* ``ref_copy``: ``os.preadv`` of 8 MiB chunks in N threads into ONE pre-faulted buffer (file
  sized, reused across shards): the page-cache copy limit when warm, buffered disk reads when cold.
* ``ref_odirect``: the same with ``O_DIRECT`` into a page-aligned pre-faulted buffer (cold; through
  a FUSE mount too, reported as skipped where the mount refuses O_DIRECT).

Under ``--slow-fs`` ``ref_copy`` is parallel buffered reads through the mount.

Nothing here imports torch at module level: the CLI stays light and the workers choose their own
imports.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fnmatch
import json
import mmap
import os
import platform
import random
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

GIB = float(1 << 30)
MIB = float(1 << 20)
PAGE = mmap.PAGESIZE
REF_CHUNK = 8 << 20
DATA_VERSION = 1

# -- contenders ----------------------------------------------------------------------------------

# name -> (description, applies to "single"/"sharded"/"all", cache states it runs in)
_ALL = ("warm", "cold", "fuse")
CONTENDERS: Dict[str, Tuple[str, str, Tuple[str, ...]]] = {
    "st_default": ("safetensors.torch.load_file() per file, default backend (mmap)", "all", _ALL),
    "st_get_tensors": ("safetensors safe_open(backend='pread').get_tensors()", "all", _ALL),
    "st_get_tensor_loop": ("safetensors pread: get_tensor(k) for k in keys()", "all", _ALL),
    "st_mmap_clone": ("safetensors mmap: get_tensor(k).clone()", "all", _ALL),
    "st_load_file": ("safetensors.torch.load_file(backend='pread') per shard", "sharded", _ALL),
    "st_loop": ("safetensors default backend: get_tensor(k) for k in keys() (vLLM, ltx-core)", "all", _ALL),
    "st_slices": ("safetensors backend='mmap': get_slice(k) for every key, then [...] from 4 threads (transformers 5)",
                  "all", _ALL),
    "sl_default": ("safeload.torch.load_file() per file, default backend (auto)", "all", _ALL),
    "sl_loop": ("safeload default backend: get_tensor(k) for k in keys()", "all", _ALL),
    "sl_loop_pread": ("safeload pread: get_tensor(k) for k in keys()", "all", _ALL),
    "sl_slices": ("safeload backend='mmap' (what patched transformers passes): get_slice, then [...] from 4 threads",
                  "all", _ALL),
    "sl_get_tensors": ("safeload safe_open(backend='pread').get_tensors()", "all", _ALL),
    "sl_prefetch": ("safeload prefetch() (safetensors 0.9 API), then take(k) in a random order", "all", _ALL),
    "sl_prefetch_pread": ("safeload backend='pread': prefetch(), then take(k) in a random order", "all", _ALL),
    "sl_prefetch_direct": ("safeload backend='direct': prefetch(), then take(k) in a random order", "all", _ALL),
    "sl_prefetch_iter": ("safeload prefetch(), then iterated in file order (vLLM PR #57973's `yield from loader`)",
                         "all", _ALL),
    "sl_auto": ("safeload safe_open(backend='auto').get_tensors() (backend chosen per file)", "all", _ALL),
    "sl_mmap_clone": ("safeload mmap: get_tensor(k).clone()", "all", _ALL),
    "sl_load_checkpoint": ("safeload.torch.load_checkpoint(index.json, backend='pread')", "sharded", _ALL),
    "st_load_model": ("safetensors.torch.load_model(model, file) per file, into an initialised module", "all", _ALL),
    "sl_load_model": ("safeload.torch.load_model(model, file) per file, into an initialised module", "all", _ALL),
    "ref_copy": ("reference: preadv 8 MiB x N threads into one pre-faulted buffer", "all", _ALL),
    "ref_odirect": ("reference: O_DIRECT preadv 8 MiB x N threads, aligned buffer", "all", ("cold", "fuse")),
}
BASELINE = "st_default"  # safetensors' default is the yardstick
MMAP_BASELINE = "st_mmap_clone"
REFERENCES = ("ref_copy", "ref_odirect")
# The references that bound ×limit in each cache state.
LIMIT_REFS: Dict[str, Tuple[str, ...]] = {"warm": ("ref_copy",), "cold": REFERENCES, "fuse": ("ref_copy",)}
DEFAULT_SLOW_FS_LATENCY = 0.002
# The target for --slow-fs: safeload's default backend vs both safetensors loaders.
SLOW_FS_TARGET = 5.0


# -- worker side ----------------------------------------------------------------------------------


def _rss_kib() -> int:
    """Current resident set size in KiB (VmRSS)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _vmhwm_kib() -> int:
    """Peak resident set size of this process image in KiB (VmHWM; unlike ru_maxrss it does not
    carry over the parent's peak through fork/vfork + exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _maxrss_kib() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r // 1024) if sys.platform == "darwin" else int(r)


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident_fraction(paths: Sequence[str]) -> Optional[float]:
    """Fraction of the files' pages in the page cache (mincore on a fresh, untouched map)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        resident = total = 0
        for p in paths:
            size = os.path.getsize(p)
            if size == 0:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    pages = (size + PAGE - 1) // PAGE
                    vec = (ctypes.c_ubyte * pages)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    resident += sum(1 for b in bytes(vec) if b & 1)
                    total += pages
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return resident / total if total else 1.0
    except Exception:
        return None


def _prefaulted(size: int) -> mmap.mmap:
    size = max(PAGE, -(-size // PAGE) * PAGE)
    buf = mmap.mmap(-1, size)
    zero = bytes(min(size, REF_CHUNK))
    for off in range(0, size, len(zero)):
        n = min(len(zero), size - off)
        buf[off : off + n] = zero[:n]
    return buf


def _ref_read(files: Sequence[str], threads: int, direct: bool) -> Tuple[float, int, Dict[str, Any]]:
    """preadv of every file in REF_CHUNK pieces by `threads` threads into one reused buffer."""
    sizes = [os.path.getsize(f) for f in files]
    buf = _prefaulted(max(sizes) if sizes else 0)
    view = memoryview(buf)
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    if direct and not getattr(os, "O_DIRECT", 0):
        return 0.0, 0, {"skipped": "O_DIRECT is not available on this platform"}
    lock = threading.Lock()
    errors: List[BaseException] = []

    start = time.perf_counter()
    try:
        fds = [os.open(f, flags) for f in files]
    except OSError as e:
        return 0.0, 0, {"skipped": f"O_DIRECT open failed: {e}"}
    work = iter([(fd, off, min(REF_CHUNK, size - off)) for fd, size in zip(fds, sizes) for off in range(0, size, REF_CHUNK)])
    done = [0]

    def run() -> None:
        total = 0
        try:
            while True:
                with lock:
                    item = next(work, None)
                if item is None:
                    break
                fd, off, n = item
                want = -(-n // PAGE) * PAGE if direct else n  # O_DIRECT: whole pages (EOF stops it)
                got = 0
                while got < n:
                    r = os.preadv(fd, [view[off + got : off + want]], off + got)
                    if r <= 0:
                        break
                    got += r
                total += min(got, n)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            errors.append(e)
        with lock:
            done[0] += total

    pool = [threading.Thread(target=run) for _ in range(max(1, threads))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    for fd in fds:
        os.close(fd)
    if errors:
        e = errors[0]
        if direct and isinstance(e, OSError) and e.errno == 22:
            return 0.0, 0, {"skipped": f"O_DIRECT read gave EINVAL: {e}"}
        raise e
    return elapsed, done[0], {}


def _loader(name: str, spec: Dict[str, Any], meta: Dict[str, Any]) -> Callable[[], Dict[str, Any]]:
    """The timed call of a loader contender (its imports already done)."""
    files: List[str] = spec["files"]
    threads, chunk = spec.get("threads"), spec.get("chunk_bytes")
    import safetensors
    import safetensors.torch
    import torch  # noqa: F401

    import safeload
    import safeload.torch

    if name in ("st_default", "sl_default"):
        load_file = safetensors.torch.load_file if name == "st_default" else safeload.torch.load_file

        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                out.update(load_file(f))
            return out
    elif name == "st_get_tensors":
        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                with safetensors.safe_open(f, "pt", backend="pread") as h:
                    out.update(h.get_tensors())
            return out
    elif name == "st_get_tensor_loop":
        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                with safetensors.safe_open(f, "pt", backend="pread") as h:
                    for k in h.keys():
                        out[k] = h.get_tensor(k)
            return out
    elif name == "st_mmap_clone":
        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                with safetensors.safe_open(f, "pt", backend="mmap") as h:
                    for k in h.keys():
                        out[k] = h.get_tensor(k).clone()
            return out
    elif name == "st_load_file":
        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                out.update(safetensors.torch.load_file(f, backend="pread"))
            return out
    elif name in ("st_loop", "sl_loop", "sl_loop_pread"):
        opener = safetensors.safe_open if name == "st_loop" else safeload.safe_open
        kwargs = {"backend": "pread"} if name == "sl_loop_pread" else {}

        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                with opener(f, "pt", **kwargs) as h:
                    for k in h.keys():
                        out[k] = h.get_tensor(k)
            return out
    elif name in ("st_slices", "sl_slices"):
        opener = safetensors.safe_open if name == "st_slices" else safeload.safe_open

        def run() -> Dict[str, Any]:
            from concurrent.futures import ThreadPoolExecutor

            out: Dict[str, Any] = {}
            for f in files:
                with opener(f, "pt", backend="mmap") as h:
                    slices = {k: h.get_slice(k) for k in h.keys()}
                    with ThreadPoolExecutor(4) as pool:
                        out.update(zip(slices, pool.map(lambda s: s[...], slices.values())))
            return out
    elif name in ("sl_prefetch", "sl_prefetch_pread", "sl_prefetch_direct"):
        import random

        backend = {"sl_prefetch_pread": "pread", "sl_prefetch_direct": "direct"}.get(name, "auto")
        # The caller's order is its own (a model's modules), known before the clock starts: the
        # loader is timed, not the shuffle (10-15 ms of Python for 20,000 names on 2 cores).
        orders = {}
        for f in files:
            with safeload.safe_open(f, "pt", backend="pread") as h:
                orders[f] = h.offset_keys()
            random.Random(0).shuffle(orders[f])

        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                with safeload.safe_open(f, "pt", backend=backend, threads=threads, chunk_bytes=chunk) as h:
                    with h.prefetch(threads=threads) as loader:
                        for k in orders[f]:
                            out[k] = loader.take(k)
            return out
    elif name == "sl_prefetch_iter":
        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                with safeload.safe_open(f, "pt", threads=threads, chunk_bytes=chunk) as h:
                    with h.prefetch(threads=threads) as loader:
                        out.update(loader)
            return out
    elif name == "sl_get_tensors":
        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                with safeload.safe_open(f, "pt", backend="pread", threads=threads, chunk_bytes=chunk) as h:
                    out.update(h.get_tensors())
            return out
    elif name == "sl_auto":
        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            used = []
            for f in files:
                with safeload.safe_open(f, "pt", backend="auto", threads=threads, chunk_bytes=chunk) as h:
                    out.update(h.get_tensors())
                    used.append(h.backend)
            meta["backend"] = ",".join(sorted(set(used)))
            return out
    elif name == "sl_mmap_clone":
        def run() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for f in files:
                with safeload.safe_open(f, "pt", backend="mmap") as h:
                    for k in h.keys():
                        out[k] = h.get_tensor(k).clone()
            return out
    elif name == "sl_load_checkpoint":
        target = spec.get("index") or files

        def run() -> Dict[str, Any]:
            return safeload.torch.load_checkpoint(target, backend="pread", threads=threads, chunk_bytes=chunk)
    elif name in ("st_load_model", "sl_load_model"):
        load_model = safetensors.torch.load_model if name == "st_load_model" else safeload.torch.load_model
        model = _initialised_module(files)  # before the clock, as a model built from its config

        def run() -> Dict[str, Any]:
            for f in files:
                load_model(model, f, strict=False)
            return dict(model.state_dict())
    else:
        raise SystemExit(f"unknown contender {name!r}")
    return run


def _initialised_module(files: Sequence[str]) -> Any:
    """A module with one parameter per tensor of ``files`` (nested by the names' dots), every page of
    its memory written, as a model's ``__init__`` leaves it: what ``load_model`` loads into."""
    import safetensors
    import torch

    from safeload._frameworks import torch_dtype

    root = torch.nn.Module()
    for f in files:
        with safetensors.safe_open(f, "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                *path, leaf = k.split(".")
                mod = root
                for part in path:
                    if not hasattr(mod, part):
                        mod.add_module(part, torch.nn.Module())
                    mod = getattr(mod, part)
                t = torch.empty(s.get_shape(), dtype=torch_dtype(s.get_dtype(), k))
                if t.numel():
                    t.view(-1).view(torch.uint8).fill_(1)
                mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


#: Tensors of up to this many pages are touched a byte at a time from Python; larger ones with
#: one strided torch sum (about 6 us a call whatever the size, which 20,000 small tensors would
#: pay 120 ms of: more than the load of the 0.13 GiB small sample itself).
_BYTEWISE_PAGES = 32
_read_byte = ctypes.c_uint8.from_address


def touch(t: Any) -> None:
    """Reads one byte of every page a CPU tensor's bytes lie on, its first and last byte
    included: a lazy map pays its page faults here, as a user's first use would."""
    n = t.nbytes
    if not n:
        return
    if n > _BYTEWISE_PAGES * PAGE or not t.is_cpu or not t.is_contiguous():
        import torch

        flat = t.detach().reshape(-1).view(torch.uint8)
        flat[::PAGE].sum()
        flat[-1].item()
        return
    start = t.data_ptr()
    for at in range(start, start + n, PAGE):
        _ = _read_byte(at).value
    _ = _read_byte(start + n - 1).value


def _touch(result: Dict[str, Any]) -> None:
    """Reads one byte of every page of every tensor."""
    for t in result.values():
        touch(t)


def _worker_measure(spec: Dict[str, Any]) -> Dict[str, Any]:
    name = spec["contender"]
    files: List[str] = spec["files"]
    out: Dict[str, Any] = {"contender": name}
    meta: Dict[str, Any] = {}
    run = None if name in REFERENCES else _loader(name, spec, meta)
    if spec.get("cold"):
        for f in files:
            _drop_cache(f)
        out["resident_before"] = _resident_fraction(files)
    if spec.get("fuse"):
        try:
            from safeload import _safeload

            kinds = set()
            for f in files:
                h = _safeload.Handle(f)
                kinds.add(h.storage)
                h.close()
            out["fs_kind"] = ",".join(sorted(kinds))
        except Exception as e:  # noqa: BLE001 - informational only
            out["fs_kind"] = f"? ({type(e).__name__}: {e})"
    out["rss_before_kib"] = _rss_kib()
    out["maxrss_before_kib"] = _maxrss_kib()
    if run is None:
        seconds, nbytes, extra = _ref_read(files, spec["ref_threads"], direct=(name == "ref_odirect"))
        out.update(extra)
    else:
        start = time.perf_counter()
        result = run()
        _touch(result)  # lazy maps pay their reads here, as a user's first use would
        seconds = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in result.values())
        out["tensors"] = len(result)
    out["seconds"] = seconds
    out["bytes"] = nbytes
    out["peak_rss_kib"] = _maxrss_kib()
    out["vmhwm_kib"] = _vmhwm_kib()
    out.update(meta)
    return out


def _as_bytes(t: Any) -> Any:
    import torch

    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _worker_verify(spec: Dict[str, Any]) -> Dict[str, Any]:
    """safeload's loader (get_tensors, load_checkpoint for shards) vs safetensors' pread loader."""
    import safetensors
    import torch

    import safeload
    import safeload.torch

    files: List[str] = spec["files"]
    ref: Dict[str, Any] = {}
    for f in files:
        with safetensors.safe_open(f, "pt", backend="pread") as h:
            ref.update(h.get_tensors())
    if spec.get("index") or len(files) > 1:
        mine = safeload.torch.load_checkpoint(spec.get("index") or files, backend="pread")
        how = "load_checkpoint"
    else:
        with safeload.safe_open(files[0], "pt", backend="pread") as h:
            mine = h.get_tensors()
        how = "get_tensors"
    bad: List[str] = []
    if set(mine) != set(ref):
        bad.append(f"key sets differ: {len(set(mine) ^ set(ref))} names")
    for k in sorted(set(mine) & set(ref)):
        a, b = mine[k], ref[k]
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape) or not torch.equal(_as_bytes(a), _as_bytes(b)):
            bad.append(k)
    return {"equal": not bad, "how": how, "tensors": len(ref), "mismatches": bad[:10], "mismatch_count": len(bad)}


def _worker_openkeys(spec: Dict[str, Any]) -> Dict[str, Any]:
    """open()+keys() in process: both libraries, default backends, median of many iterations."""
    import safetensors

    import safeload

    path = spec["files"][0]
    budget = float(spec.get("budget_s", 1.5))
    out: Dict[str, Any] = {"file": path}
    for lib, opener in (("safetensors", safetensors.safe_open), ("safeload", safeload.safe_open)):
        for _ in range(2):
            with opener(path, "pt") as h:
                h.keys()
        times: List[float] = []
        deadline = time.perf_counter() + budget
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 500):
            t0 = time.perf_counter()
            with opener(path, "pt") as h:
                n = len(h.keys())
            times.append(time.perf_counter() - t0)
        out[lib] = {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "iterations": len(times), "keys": n}
    return out


def worker_main(arg: str) -> int:
    spec = json.loads(arg)
    mode = spec.get("mode", "measure")
    try:
        if mode == "measure":
            result = _worker_measure(spec)
        elif mode == "verify":
            result = _worker_verify(spec)
        elif mode == "openkeys":
            result = _worker_openkeys(spec)
        elif mode == "generate":
            generate_sample(spec["dir"], spec["size"], spec["name"], _log)
            result = {"ok": True}
        else:
            raise SystemExit(f"unknown worker mode {mode!r}")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip freeing gigabytes of tensors on the way out


# -- sample data --------------------------------------------------------------------------------


@dataclass
class Dataset:
    name: str
    files: List[str]
    index: Optional[str] = None
    sharded: bool = False
    note: str = ""
    tensor_count: int = 0
    mountpoint: Optional[str] = None  # set when the files are read through a slowfs mount

    @property
    def nbytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)


def _llama_specs(size: str) -> List[Tuple[str, Tuple[int, ...], str]]:
    hidden, inter, layers, vocab = (2048, 5632, 24, 32000) if size == "full" else (576, 1536, 24, 32000)
    return _llama_like(hidden, inter, layers, vocab)


def _llama_like(hidden: int, inter: int, layers: int, vocab: int) -> List[Tuple[str, Tuple[int, ...], str]]:
    specs: List[Tuple[str, Tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "bf16")]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (hidden,), "bf16")]
        specs += [(p + f"self_attn.{x}_proj.weight", (hidden, hidden), "bf16") for x in "qkvo"]
        specs += [(p + "post_attention_layernorm.weight", (hidden,), "bf16")]
        specs += [(p + "mlp.gate_proj.weight", (inter, hidden), "bf16"), (p + "mlp.up_proj.weight", (inter, hidden), "bf16")]
        specs += [(p + "mlp.down_proj.weight", (hidden, inter), "bf16")]
    specs += [("model.norm.weight", (hidden,), "bf16"), ("lm_head.weight", (vocab, hidden), "bf16")]
    return specs


def _small_specs(size: str) -> List[Tuple[str, Tuple[int, ...], str]]:
    count = 20000 if size == "full" else 2000
    rng = random.Random(1234)
    specs = []
    for i in range(count):
        n = rng.randint(1, 4096)
        dtype = ("f32", "f16", "bf16", "i64", "u8")[rng.randrange(5)]
        cols = rng.choice([d for d in (1, 2, 4, 8, 16, 32, 64) if n % d == 0])
        shape = (n,) if cols == 1 else (n // cols, cols)
        specs.append((f"block.{i // 100}.param_{i % 100}.{dtype}", shape, dtype))
    return specs


def _sharded_specs(size: str) -> List[Tuple[str, Tuple[int, ...], str]]:
    return _llama_like(1024, 2816, 12, 32000) if size == "full" else _llama_like(320, 896, 12, 8000)


def _tiles() -> Dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    n = 1 << 20  # one MiB of bytes per dtype
    return {
        "f32": torch.randn(n // 4, generator=g).view(torch.uint8),
        "f16": torch.randn(n // 2, generator=g).half().view(torch.uint8),
        "bf16": torch.randn(n // 2, generator=g).bfloat16().view(torch.uint8),
        "i64": torch.randint(-(1 << 40), 1 << 40, (n // 8,), generator=g).view(torch.uint8),
        "u8": torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8),
    }


def _make_tensor(shape: Tuple[int, ...], dtype: str, seed: int, tiles: Dict[str, Any]) -> Any:
    """A tensor filled by repeating a random 1 MiB tile from a per-tensor offset (cheap, not slow randn)."""
    import torch

    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i64": torch.int64, "u8": torch.uint8}[dtype]
    t = torch.empty(shape, dtype=tdt)
    flat = t.view(-1).view(torch.uint8)
    tile = tiles[dtype]
    size, n = tile.numel(), flat.numel()
    pos, s = 0, (seed * 7919 * 64) % size  # multiple of 64: element aligned for every dtype
    while pos < n:
        k = min(size - s, n - pos)
        flat[pos : pos + k].copy_(tile[s : s + k])
        pos += k
        s = 0
    return t


def _save(specs: Sequence[Tuple[str, Tuple[int, ...], str]], path: str, tiles: Dict[str, Any], seed0: int) -> None:
    from safetensors.torch import save_file

    tensors = {name: _make_tensor(shape, dt, seed0 + i, tiles) for i, (name, shape, dt) in enumerate(specs)}
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def _manifest_ok(d: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(d, "manifest.json"), encoding="utf-8") as f:
            m = json.load(f)
        if m.get("version") != DATA_VERSION:
            return None
        for rel, size in m["files"].items():
            if os.path.getsize(os.path.join(d, rel)) != size:
                return None
        return m
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def _write_manifest(d: str, files: Sequence[str], extra: Dict[str, Any]) -> None:
    m = {"version": DATA_VERSION, "files": {os.path.relpath(f, d): os.path.getsize(f) for f in files}}
    m.update(extra)
    with open(os.path.join(d, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(m, f, indent=1)


def generate_sample(d: str, size: str, name: str, log: Callable[[str], None]) -> None:
    """Writes one sample dataset into directory d (run in a worker: it imports torch)."""
    tiles = _tiles()
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    if name in ("llama", "small"):
        specs = _llama_specs(size) if name == "llama" else _small_specs(size)
        path = os.path.join(d, "model.safetensors")
        log(f"writing {name} sample ({len(specs)} tensors) to {path} ...")
        _save(specs, path, tiles, seed0=1 if name == "llama" else 100000)
        files, extra = [path], {"tensors": len(specs)}
    elif name == "sharded":
        specs = _sharded_specs(size)
        sizes = [_spec_bytes(s) for s in specs]
        total, acc = sum(sizes), 0
        shards: List[List[Tuple[str, Tuple[int, ...], str]]] = [[]]
        for spec, nb in zip(specs, sizes):
            if acc >= total * len(shards) / 3 and len(shards) < 3:
                shards.append([])
            shards[-1].append(spec)
            acc += nb
        files, weight_map, seed = [], {}, 200000
        for i, group in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            path = os.path.join(d, fname)
            log(f"writing sharded sample shard {i + 1}/{len(shards)} ({len(group)} tensors) to {path} ...")
            _save(group, path, tiles, seed0=seed)
            seed += len(group)
            files.append(path)
            weight_map.update({n: fname for n, _, _ in group})
        index = os.path.join(d, "model.safetensors.index.json")
        with open(index, "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        extra = {"tensors": len(specs), "index": os.path.basename(index)}
    else:
        raise SystemExit(f"unknown dataset {name!r} (choose from llama, small, sharded)")
    os.sync()  # no dirty pages: DONTNEED must be able to drop every page
    _write_manifest(d, files, extra)
    log(f"  wrote {sum(os.path.getsize(f) for f in files) / GIB:.2f} GiB in {time.perf_counter() - t0:.1f} s")


def prepare_samples(data_dir: str, size: str, names: Sequence[str], log: Callable[[str], None]) -> List[Dataset]:
    """The sample checkpoints under data_dir/size/NAME/, written (in a worker, so this process
    never imports torch and stays small) unless present with matching sizes."""
    out: List[Dataset] = []
    base = os.path.abspath(os.path.join(data_dir, size))
    for name in names:
        if name not in ("llama", "small", "sharded"):
            raise SystemExit(f"unknown dataset {name!r} (choose from llama, small, sharded)")
        d = os.path.join(base, name)
        m = _manifest_ok(d)
        if m is None:
            res = run_worker({"mode": "generate", "dir": d, "size": size, "name": name}, stderr_through=True)
            m = _manifest_ok(d)
            if m is None:
                raise SystemExit(f"could not write the {name} sample: {res.get('error', res)}")
        else:
            log(f"reusing {d}")
        files = sorted(os.path.join(d, rel) for rel in m["files"])
        index = os.path.join(d, m["index"]) if m.get("index") else None
        out.append(Dataset(name, files, index=index, sharded=bool(index), tensor_count=m.get("tensors", 0)))
    return out


def _spec_bytes(spec: Tuple[str, Tuple[int, ...], str]) -> int:
    n = 1
    for d in spec[1]:
        n *= d
    return n * {"f32": 4, "f16": 2, "bf16": 2, "i64": 8, "u8": 1}[spec[2]]


def datasets_from_paths(paths: Sequence[str]) -> List[Dataset]:
    from safeload._safeload import Checkpoint

    out = []
    for p in paths:
        opened = Checkpoint(p)
        files = [os.path.abspath(f) for f in opened.paths]
        opened.close()
        index = None
        if os.path.isdir(p):
            idx = sorted(f for f in os.listdir(p) if f.endswith(".safetensors.index.json"))
            index = os.path.join(p, idx[0]) if idx else None
        elif p.endswith(".json"):
            index = p
        name = os.path.basename(os.path.normpath(p)) or p
        out.append(Dataset(name, files, index=os.path.abspath(index) if index else None, sharded=len(files) > 1 or index is not None))
    return out


# -- parent side ----------------------------------------------------------------------------------


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def _worker_env(own_safeload: bool = True) -> Dict[str, str]:
    """The environment of every worker: no SAFELOAD_BACKEND or _PATCH, and with ``own_safeload``
    the same safeload as this process (its package's parent directory first on PYTHONPATH, found
    without importing it)."""
    import importlib.util

    env = dict(os.environ)
    env.pop("SAFELOAD_BACKEND", None)  # contenders name their backend; "auto" must mean auto
    env.pop("SAFELOAD_PATCH", None)  # safetensors contenders must stay safetensors
    spec = importlib.util.find_spec("safeload") if own_safeload else None
    if spec is not None and spec.submodule_search_locations:
        pkg_parent = os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
        env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_worker(spec: Dict[str, Any], timeout: float = 1800.0, stderr_through: bool = False,
               script: Optional[str] = None, env: Optional[Dict[str, str]] = None,
               python: Optional[str] = None) -> Dict[str, Any]:
    """Runs ``script --worker SPEC`` (this file by default) in a fresh ``python`` (default: this
    interpreter) with ``env`` (default :func:`_worker_env`); returns the last JSON line it printed,
    or ``{"error": ...}``."""
    cmd = [python or sys.executable, os.path.abspath(script or __file__), "--worker", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if stderr_through else subprocess.PIPE,
                           text=True, timeout=timeout, env=env if env is not None else _worker_env())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    tail = (p.stderr or p.stdout or "").strip().splitlines()[-5:]
    return {"error": f"worker exited {p.returncode}: " + " | ".join(tail)}


def _prewarm(files: Sequence[str]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(REF_CHUNK):
                pass


def _select(names: Sequence[str], patterns: Optional[str]) -> List[str]:
    if not patterns:
        return list(names)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    unknown = [p for p in pats if not any(fnmatch.fnmatch(n, p) for n in names)]
    if unknown:  # a typo must not silently drop a contender from the table
        raise SystemExit(f"--contenders: {', '.join(unknown)} match no contender; known: {', '.join(names)}")
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in pats)]


def _applies(contender: str, ds: Dataset, state: str) -> bool:
    _, scope, states = CONTENDERS[contender]
    return state in states and (scope == "all" or (scope == "sharded" and ds.sharded))


@dataclass
class Summary:
    dataset: str
    state: str
    contender: str
    runs: int
    median_gibs: Optional[float] = None
    min_gibs: Optional[float] = None
    max_gibs: Optional[float] = None
    median_s: Optional[float] = None
    median_peak_rss_mib: Optional[float] = None
    median_rss_before_mib: Optional[float] = None
    vs_baseline: Optional[float] = None
    vs_st_mmap: Optional[float] = None
    vs_limit: Optional[float] = None
    resident_before_max: Optional[float] = None
    note: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)


def summarize(runs: List[Dict[str, Any]]) -> List[Summary]:
    groups: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["dataset"], r["state"], r["contender"]), []).append(r)
    out: List[Summary] = []
    for (ds, state, c), rs in groups.items():
        good = [r for r in rs if "error" not in r and "skipped" not in r and r.get("seconds", 0) > 0]
        s = Summary(ds, state, c, len(good))
        if not good:
            why = next((r.get("skipped") or r.get("error") for r in rs if r.get("skipped") or r.get("error")), "no runs")
            s.note = str(why)
            out.append(s)
            continue
        rates = [r["bytes"] / r["seconds"] / GIB for r in good]
        s.median_gibs, s.min_gibs, s.max_gibs = statistics.median(rates), min(rates), max(rates)
        s.median_s = statistics.median(r["seconds"] for r in good)
        s.median_peak_rss_mib = statistics.median(r["peak_rss_kib"] / 1024 for r in good)
        s.median_rss_before_mib = statistics.median(r["rss_before_kib"] / 1024 for r in good)
        used = sorted({r["backend"] for r in good if r.get("backend")})
        if used:
            s.extra["backend"] = ",".join(used)
        kinds = sorted({r["fs_kind"] for r in good if r.get("fs_kind")})
        if kinds:
            s.extra["fs_kind"] = ",".join(kinds)
        hwm = [r.get("vmhwm_kib", -1) for r in good]
        if all(h > 0 for h in hwm):
            s.extra["median_vmhwm_mib"] = statistics.median(h / 1024 for h in hwm)
        res = [r["resident_before"] for r in good if r.get("resident_before") is not None]
        s.resident_before_max = max(res) if res else None
        errs = [r for r in rs if "error" in r]
        if errs:
            s.note = f"{len(errs)} failed run(s): {errs[0]['error']}"
        out.append(s)
    by_key = {(s.dataset, s.state, s.contender): s for s in out}
    for s in out:
        base = by_key.get((s.dataset, s.state, BASELINE))
        if s.median_gibs and base and base.median_gibs:
            s.vs_baseline = s.median_gibs / base.median_gibs
        mbase = by_key.get((s.dataset, s.state, MMAP_BASELINE))
        if s.median_gibs and mbase and mbase.median_gibs:
            s.vs_st_mmap = s.median_gibs / mbase.median_gibs
        refs = [by_key.get((s.dataset, s.state, r)) for r in LIMIT_REFS.get(s.state, ("ref_copy",))]
        limits = [r.median_gibs for r in refs if r and r.median_gibs]
        if s.median_gibs and limits:
            s.vs_limit = s.median_gibs / max(limits)
    return out


def _fmt(v: Optional[float], spec: str, suffix: str = "") -> str:
    return "–" if v is None else f"{v:{spec}}{suffix}"


def render_markdown(result: Dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        "# safeload benchmark",
        "",
        f"- {env['platform']}, {env['cpus']} CPUs, {env['mem_gib']:.1f} GiB RAM; Python {env['python']}, torch {env['torch']}, "
        f"safetensors {env['safetensors']}, safeload {env['safeload']}",
        f"- threads N = {env['threads']} (safeload default {env['default_threads']}), chunk_bytes = {env['chunk_bytes']}, "
        f"rounds = {result['rounds']}, sample size = {result['size']}, seed = {result.get('seed', 0)}, "
        f"settle = {result.get('settle_s', 0):g} s",
        "- rate = tensor bytes (file bytes for references) / wall time of the load only, in a fresh subprocess; "
        "min–max over rounds; RSS = the worker's peak (ru_maxrss), whole process incl. torch",
    ]
    sf = result.get("slow_fs")
    if sf:
        lines.append(f"- **slow FS**: every file read through a slowfs FUSE mount of the dataset's directory, "
                     f"+{sf['latency_s'] * 1e3:g} ms per read request, options `{sf.get('options') or 'kernel defaults'}`; cache state `fuse` (FUSE drops the page cache at "
                     "each open; the files under the mount are warm)")
    lines += [
        "",
        "## Datasets",
        "",
        "| dataset | files | tensors | size | byte-equal vs safetensors |",
        "|---|---:|---:|---:|---|",
    ]
    for d in result["datasets"]:
        v = d.get("verify") or {}
        if "error" in v:
            eq = f"error: {v['error']}"
        elif v:
            eq = (f"yes ({v['how']}, {v['tensors']} tensors)" if v["equal"]
                  else f"**NO** ({v['mismatch_count']} differ: {', '.join(v['mismatches'][:3])})")
        else:
            eq = "not checked"
        lines.append(f"| {d['name']} | {len(d['files'])} | {d.get('tensors') or '–'} | {d['bytes'] / GIB:.3f} GiB | {eq} |")
    lines += [
        "",
        "## Load rate",
        "",
        "Ratio columns (median rate of the row ÷ median rate of, in the same dataset and cache state):",
        "",
        f"- **×st** ÷ `{BASELINE}` (safetensors 0.8's default: load_file, mmap; every contender's time "
        "includes reading one byte of every page of the result)",
        f"- **×st_mmap** ÷ `{MMAP_BASELINE}` (safetensors mmap: get_tensor(k).clone())",
        "- **×limit** ÷ the machine's limit: " + "; ".join(
            {"warm": "`ref_copy` = warm page-cache copy limit (warm)",
             "cold": "the best of `ref_copy` and `ref_odirect` = best cold read (cold)",
             "fuse": "`ref_copy` = parallel buffered reads through the mount (fuse)"}[st]
            for st in (result.get("states") or ["warm", "cold"]) if st in ("warm", "cold", "fuse")),
        "",
        "| dataset | cache | contender | median GiB/s | min–max GiB/s | median s | peak RSS MiB | RSS before MiB | ×st | ×st_mmap | ×limit |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["summary"]:
        if s["median_gibs"] is None:
            lines.append(f"| {s['dataset']} | {s['state']} | {s['contender']} | – | – | – | – | – | – | – | – |")
            continue
        lines.append(
            f"| {s['dataset']} | {s['state']} | {s['contender']} | {s['median_gibs']:.2f} | "
            f"{s['min_gibs']:.2f}–{s['max_gibs']:.2f} | {s['median_s']:.3f} | {s['median_peak_rss_mib']:.0f} | "
            f"{s['median_rss_before_mib']:.0f} | {_fmt(s['vs_baseline'], '.2f', '×')} | "
            f"{_fmt(s.get('vs_st_mmap'), '.2f', '×')} | {_fmt(s['vs_limit'], '.2f', '×')} |"
        )
    ok = [o for o in result["open_keys"] if "error" not in o]
    if ok:
        lines += [
            "",
            "## open() + keys() (in process, default backends, median of many)",
            "",
            "| dataset | keys | safetensors ms | safeload ms | safeload / safetensors |",
            "|---|---:|---:|---:|---:|",
        ]
        for o in ok:
            a, b = o["safetensors"]["median_ms"], o["safeload"]["median_ms"]
            lines.append(f"| {o['dataset']} | {o['safeload']['keys']} | {a:.3f} | {b:.3f} | {b / a:.2f}× |")
    notes = list(result["notes"])
    for s in result["summary"]:
        if s["note"]:
            notes.append(f"{s['dataset']}/{s['state']}/{s['contender']}: {s['note']}")
    cold_res = [s["resident_before_max"] for s in result["summary"] if s["state"] == "cold" and s["resident_before_max"] is not None]
    if cold_res:
        notes.append(f"cold runs: at most {max(cold_res) * 100:.1f}% of a dataset's pages were in the page cache right "
                     "before a cold load (mincore after posix_fadvise DONTNEED); a VM's host cache may still serve 'cold' reads")
    for s in result["summary"]:
        if s["extra"].get("backend"):
            notes.append(f"{s['dataset']}/{s['state']}/{s['contender']}: backend used: {s['extra']['backend']}")
    kinds = sorted({s["extra"]["fs_kind"] for s in result["summary"] if s["extra"].get("fs_kind")})
    if kinds:
        notes.append(f"fuse runs: safeload's residency() saw the files as filesystem kind {', '.join(kinds)}")
    if sf:
        for s in result["summary"]:
            if s["state"] == "fuse" and s["contender"] == "sl_auto" and s["median_gibs"]:
                a, b = s["vs_baseline"], s.get("vs_st_mmap")
                met = a is not None and b is not None and a >= SLOW_FS_TARGET and b >= SLOW_FS_TARGET
                notes.append(
                    f"issue target on {s['dataset']} (safeload default backend >= {SLOW_FS_TARGET:g}× both "
                    f"`{BASELINE}` and `{MMAP_BASELINE}` through the slow FS; stated for the full-size ~0.4 GiB sharded "
                    f"sample): ×st {_fmt(a, '.2f', '×')}, ×st_mmap {_fmt(b, '.2f', '×')}: "
                    f"**{'met' if met else 'not met'}**" + ("" if result["size"] == "full" else f" (sample size {result['size']})"))
    orders = result.get("orders") or []
    if orders:
        notes.append(f"order: each round runs its contenders in its own order, a shuffle seeded by --seed "
                     f"{result.get('seed', 0)} (different from the state's earlier rounds where possible; every round's "
                     "order is in results.json `orders`), because memory one process just freed is much faster to fault in "
                     "than fresh memory and a fixed order favours whoever follows the largest load")
        notes.append(f"settle: the harness sleeps {result.get('settle_s', 0):g} s before every measured run (--settle)")
    inflated = [s for s in result["summary"] if s["median_peak_rss_mib"] and s["extra"].get("median_vmhwm_mib")
                and s["median_peak_rss_mib"] > 1.05 * s["extra"]["median_vmhwm_mib"] + 8]
    if inflated:
        notes.append("ru_maxrss exceeds VmHWM (this process image's own peak) for "
                     + ", ".join(f"{s['dataset']}/{s['state']}/{s['contender']}" for s in inflated)
                     + ": the kernel carries the parent's peak across exec; see results.json for VmHWM")
    for c in sorted({s["contender"] for s in result["summary"]}):
        notes.append(f"`{c}`: {CONTENDERS[c][0]}")
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(result: Dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written (pip install matplotlib)"
    rows = [s for s in result["summary"] if s["median_gibs"] is not None]
    groups = sorted({(s["dataset"], s["state"]) for s in rows}, key=lambda g: (g[0], ("warm", "cold", "fuse").index(g[1])))
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 2.2 + 0.35 * max(len(rows) // max(len(groups), 1), 1) * len(groups)),
                             squeeze=False)
    for ax, (ds, state) in zip(axes[:, 0], groups):
        sub = [s for s in rows if s["dataset"] == ds and s["state"] == state]
        names = [s["contender"] for s in sub]
        med = [s["median_gibs"] for s in sub]
        err = [[m - s["min_gibs"] for m, s in zip(med, sub)], [s["max_gibs"] - m for m, s in zip(med, sub)]]
        colors = ["tab:green" if n.startswith("sl_") else "tab:gray" if n.startswith("ref_") else "tab:blue" for n in names]
        ax.barh(names, med, xerr=err, color=colors)
        ax.invert_yaxis()
        ax.set_title(f"{ds} ({state})", fontsize=10)
        ax.set_xlabel("GiB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def _environment(threads: int, chunk_bytes: Optional[int]) -> Dict[str, Any]:
    import safeload
    from safeload import _safeload

    def version(mod: str) -> str:
        try:
            from importlib.metadata import version as v

            return v(mod)
        except Exception:
            return "?"

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        mem = 0.0
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_gib": mem,
        "python": platform.python_version(),
        "torch": version("torch"),
        "safetensors": version("safetensors"),
        "safeload": safeload.__version__,
        "threads": threads,
        "default_threads": _safeload.DEFAULT_THREADS,
        "chunk_bytes": chunk_bytes if chunk_bytes else _safeload.DEFAULT_CHUNK_BYTES,
        "harness_maxrss_mib": _maxrss_kib() / 1024,
    }


def _mount_root(ds: Dataset) -> str:
    """The directory the slow-FS mount mirrors: the one holding the dataset's files (and index)."""
    paths = [os.path.realpath(f) for f in ds.files] + ([os.path.realpath(ds.index)] if ds.index else [])
    root = os.path.commonpath(paths)
    return root if os.path.isdir(root) else os.path.dirname(root)


def _load_slowfs() -> Any:
    """tests/support/slowfs.py of this checkout (or $SLOWFS_MODULE): slowfs is test support."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("SLOWFS_MODULE", ""), os.path.join(here, "..", "tests", "support", "slowfs.py")]
    for path in candidates:
        if path and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("slowfs", path)
            if spec and spec.loader:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module
    raise SystemExit("--slow-fs needs tests/support/slowfs.py next to benches/ (or SLOWFS_MODULE set to its path)")


@contextlib.contextmanager
def _slow_mounts(datasets: Sequence[Dataset], latency: float, log: Callable[[str], None],
                 options: Sequence[str] = ()) -> Any:
    """Mounts each dataset's directory through slowfs (once, for the whole run) and yields the
    datasets with every path rewritten to go through its mount; unmounts on exit, also on error,
    Ctrl-C (KeyboardInterrupt) or SIGTERM/SIGHUP (turned into KeyboardInterrupt meanwhile)."""
    slowfs = _load_slowfs()
    why = slowfs.fuse_unavailable()
    if why:
        raise SystemExit(f"--slow-fs: no FUSE mount possible here: {why}")

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            saved[sig] = signal.signal(sig, interrupt)
        except (ValueError, OSError):  # not the main thread
            pass
    tmp = tempfile.mkdtemp(prefix="safeload-bench-slowfs-")
    try:
        with contextlib.ExitStack() as stack:
            out: List[Dataset] = []
            for i, ds in enumerate(datasets):
                root = _mount_root(ds)
                mp = os.path.join(tmp, f"{i}-{ds.name}")
                log(f"mounting {root} at {mp} through slowfs (+{latency * 1e3:g} ms per read request"
                    + (f", {' '.join(options)})" if options else ")"))
                stack.enter_context(slowfs.mounted(root, mp, "--latency", repr(latency), *options))

                def moved(f: str, root: str = root, mp: str = mp) -> str:
                    return os.path.join(mp, os.path.relpath(os.path.realpath(f), root))

                out.append(Dataset(ds.name, [moved(f) for f in ds.files], index=moved(ds.index) if ds.index else None,
                                   sharded=ds.sharded, note=f"through slowfs mount {mp} of {root}",
                                   tensor_count=ds.tensor_count, mountpoint=mp))
            yield out
            log("unmounting slowfs")
    finally:
        # rmdir, never a recursive delete: a mount that failed to go away must not be walked into
        for d in [os.path.join(tmp, n) for n in os.listdir(tmp)] + [tmp]:
            try:
                os.rmdir(d)
            except OSError as e:
                log(f"could not remove {d}: {e}")
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _round_order(active: Sequence[str], seed: int, ds: str, state: str, rnd: int, seen: List[Tuple[str, ...]]) -> List[str]:
    """This round's contender order: a shuffle seeded by (seed, dataset, state, round), redrawn
    (a bounded number of times) while it repeats an earlier round's order of the same state."""
    rng = random.Random(f"{seed}:{ds}:{state}:{rnd}")
    order = list(active)
    for _ in range(100):
        rng.shuffle(order)
        if tuple(order) not in seen:
            break
    seen.append(tuple(order))
    return order


def build_parser(prog: str = "benches/bench.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Benchmark safeload against safetensors 0.8 and the machine's copy/read limits.")
    p.add_argument("files", nargs="*", help="checkpoints to bench (a .safetensors file, a directory, or an index.json); "
                   "default: sample checkpoints written to --data-dir")
    p.add_argument("--size", choices=("full", "small"), default="full", help="sample size (small: ~10x smaller, for quick runs)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cache state (default 3)")
    p.add_argument("--datasets", default=None, help="samples to run: llama,small,sharded (default: all three; "
                   "'sharded' alone with --slow-fs, the ~0.4 GiB sharded checkpoint the slow-FS target names)")
    p.add_argument("--contenders", default=None, help="comma list of contender names or globs (e.g. 'sl_*,st_get_tensors,ref_*'); "
                   "known: " + ", ".join(CONTENDERS))
    p.add_argument("--threads", type=int, default=None, help="safeload threads and reference threads (default: safeload's default)")
    p.add_argument("--chunk-bytes", type=int, default=None, help="safeload chunk_bytes (references always use 8 MiB)")
    p.add_argument("--data-dir", default="bench-data", help="where sample checkpoints live (default ./bench-data)")
    p.add_argument("--cold", dest="cold", action="store_true", default=True, help="also run cold-cache rounds (default)")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="warm cache only")
    p.add_argument("--slow-fs", type=float, nargs="?", const=DEFAULT_SLOW_FS_LATENCY, default=None, metavar="LATENCY_S",
                   help="read every file through a slowfs FUSE mount (tests/support/slowfs.c) of its dataset's directory that adds "
                   f"LATENCY_S per read request (default {DEFAULT_SLOW_FS_LATENCY:g}); replaces the warm/cold states with "
                   "one state, 'fuse' (put file arguments before the flag or write --slow-fs=LATENCY_S)")
    p.add_argument("--slow-fs-options", default="", metavar="OPTIONS",
                   help='more slowfs options for --slow-fs, e.g. "--max-background 128" (default: kernel defaults)')
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round contender order shuffle (default 0)")
    p.add_argument("--settle", type=float, default=1.0, metavar="SECONDS",
                   help="sleep before every measured run so freed memory settles (default 1.0)")
    p.add_argument("--no-verify", dest="verify", action="store_false", default=True, help="skip the byte-equality check")
    p.add_argument("--out", default=None, help="directory for results.md and results.json")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart (needs matplotlib)")
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "benches/bench.py") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        return worker_main(argv[1])
    try:
        return _main(build_parser(prog).parse_args(argv))
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP under --slow-fs: mounts are gone by now
        _log(f"interrupted{f' ({e})' if str(e) else ''}: no results written")
        return 130


def _main(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")

    from safeload import _safeload

    threads = args.threads or _safeload.DEFAULT_THREADS
    contenders = _select(list(CONTENDERS), args.contenders)
    if not contenders:
        raise SystemExit(f"--contenders {args.contenders!r} matches none of: {', '.join(CONTENDERS)}")
    t_start = time.perf_counter()
    if args.files:
        datasets = datasets_from_paths(args.files)
    else:
        default = "sharded" if args.slow_fs is not None else "llama,small,sharded"
        names = [n.strip() for n in (args.datasets or default).split(",") if n.strip()]
        datasets = prepare_samples(args.data_dir, args.size, names, _log)
    if args.slow_fs is not None:
        if args.slow_fs < 0:
            raise SystemExit("--slow-fs latency must be >= 0")
        states = ["fuse"]
    else:
        states = ["warm"] + (["cold"] if args.cold else [])
    notes: List[str] = []
    runs: List[Dict[str, Any]] = []
    orders: List[Dict[str, Any]] = []
    open_keys: List[Dict[str, Any]] = []
    ds_info: List[Dict[str, Any]] = []
    base_spec = {"threads": args.threads, "chunk_bytes": args.chunk_bytes, "ref_threads": threads}

    with contextlib.ExitStack() as stack:
        if args.slow_fs is not None:
            for ds in datasets:  # the daemon reads these: keep them warm so the mount's latency is what counts
                _prewarm(ds.files + ([ds.index] if ds.index else []))
            targets = stack.enter_context(_slow_mounts(datasets, args.slow_fs, _log, shlex.split(args.slow_fs_options)))
        else:
            targets = datasets
        for src, ds in zip(datasets, targets):
            info: Dict[str, Any] = {"name": ds.name, "files": src.files, "index": src.index, "bytes": src.nbytes,
                                    "tensors": ds.tensor_count}
            if ds is not src:
                info["read_through"] = {"files": ds.files, "index": ds.index, "mount_of": _mount_root(src),
                                        "latency_s": args.slow_fs, "options": args.slow_fs_options}
            ds_info.append(info)
            _log(f"== {ds.name}: {len(ds.files)} file(s), {src.nbytes / GIB:.3f} GiB" + (f" ({ds.note})" if ds.note else ""))
            spec0 = dict(base_spec, files=ds.files, index=ds.index)
            if args.verify:
                _log("   byte-equality check ...")
                info["verify"] = run_worker(dict(spec0, mode="verify"))
                if info["verify"].get("tensors"):
                    info["tensors"] = info["verify"]["tensors"]
                if "error" not in info["verify"] and not info["verify"].get("equal"):
                    _log(f"   !! safeload differs from safetensors: {info['verify']}")
            ok = run_worker(dict(spec0, mode="openkeys"))
            ok["dataset"] = ds.name
            open_keys.append(ok)
            for state in states:
                active = [c for c in contenders if _applies(c, ds, state)]
                if not active:
                    continue
                if state == "warm":
                    _prewarm(ds.files)
                seen: List[Tuple[str, ...]] = []
                for r in range(args.rounds):
                    order = _round_order(active, args.seed, ds.name, state, r, seen)
                    orders.append({"dataset": ds.name, "state": state, "round": r, "order": order})
                    _log(f"   {state} r{r} order: {' '.join(order)}")
                    for pos, c in enumerate(order):
                        if args.settle > 0:
                            time.sleep(args.settle)
                        if ds.mountpoint and not os.path.ismount(ds.mountpoint):
                            raise SystemExit(f"the slowfs mount {ds.mountpoint} went away (its daemon died?): stopping")
                        res = run_worker(dict(spec0, mode="measure", contender=c, cold=(state == "cold"),
                                              fuse=(state == "fuse")))
                        res.update(dataset=ds.name, state=state, round=r, position=pos, contender=c)
                        runs.append(res)
                        if "error" in res or "skipped" in res:
                            _log(f"   {state} r{r} {c:<20} {res.get('error') or res.get('skipped')}")
                        else:
                            _log(f"   {state} r{r} {c:<20} {res['bytes'] / res['seconds'] / GIB:7.2f} GiB/s  "
                                 f"{res['seconds']:.3f} s  peak RSS {res['peak_rss_kib'] / 1024:.0f} MiB"
                                 + (f"  backend {res['backend']}" if res.get("backend") else ""))
    summary = [s.__dict__ for s in summarize(runs)]
    order = {c: i for i, c in enumerate(CONTENDERS)}
    ds_order = {d.name: i for i, d in enumerate(datasets)}
    state_order = {"warm": 0, "cold": 1, "fuse": 2}
    summary.sort(key=lambda s: (ds_order.get(s["dataset"], 0), state_order.get(s["state"], 9), order.get(s["contender"], 99)))
    result: Dict[str, Any] = {
        "environment": _environment(threads, args.chunk_bytes),
        "size": "files" if args.files else args.size,
        "rounds": args.rounds,
        "seed": args.seed,
        "settle_s": args.settle,
        "slow_fs": {"latency_s": args.slow_fs, "options": args.slow_fs_options,
                    "fuse_state": "page cache dropped by FUSE at each open"}
        if args.slow_fs is not None else None,
        "states": states,
        "orders": orders,
        "datasets": ds_info,
        "summary": summary,
        "open_keys": open_keys,
        "runs": runs,
        "notes": notes,
        "elapsed_s": time.perf_counter() - t_start,
    }
    for o in open_keys:
        if "error" in o:
            notes.append(f"open()+keys() on {o['dataset']} failed: {o['error']}")
    md = render_markdown(result)
    sys.stdout.write(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
            f.write(md)
        with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        _log(f"wrote {os.path.join(args.out, 'results.md')} and results.json")
    if args.plot:
        msg = plot(result, args.plot)
        _log(msg or f"wrote {args.plot}")
    _log(f"total {time.perf_counter() - t_start:.0f} s")
    bad = [d for d in ds_info if d.get("verify") and not d["verify"].get("equal")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
