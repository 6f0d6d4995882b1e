"""One rank of an unmodified tensor-parallel ``from_pretrained`` (transformers' ``tp_plan="auto"``,
or with ``--ep N`` expert parallelism: ``DistributedConfig(ep_size=N, tp_plan={})``), run under ``python -m torch.distributed.run --nproc-per-node N`` on the CPU (gloo), as users load.

It writes ``OUT/rank{R}.json`` with what this rank did: seconds for ``from_pretrained`` and until
every local parameter was used (one byte of each of their pages read, since 0.8 hands out views
of its map that are read only when touched), the kernel's ``read_bytes`` (``/proc/self/io``), peak
RSS, safeload's own count of bytes read per file (from its DEBUG log's close records), and, with
``--spy``, every ``get_slice(k)[key]`` asked (file, tensor, key), so a test can work out the pages
the rank's slices touch, and the pages of each file in the page cache after the load (``mincore``). With ``--params`` it saves the local parameters and the logits of a fixed
input to ``OUT/rank{R}.pt``, for comparing variants. Stock or safeload is the environment's choice
(``SAFELOAD_PATCH=1``); nothing here differs between them but the spy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import time


def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def evict(folder) -> None:
    """Every ``*.safetensors`` of ``folder`` synced (dirty pages cannot be dropped) and dropped
    from the page cache (``POSIX_FADV_DONTNEED``): the next load reads it cold."""
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_ranks(python: str, env: dict, model: str, out, *flags: str) -> list:
    """This script on 2 gloo ranks (``--params`` and ``flags``) under ``python -m
    torch.distributed.run``; each rank's record. For tests: a failed run is an AssertionError with
    its output."""
    import subprocess

    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.abspath(__file__), model, str(out), "--params", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    records = []
    for k in range(2):
        with open(os.path.join(out, f"rank{k}.json")) as f:
            records.append(json.load(f))
    return records


def _key_repr(key):
    """A slicing key as JSON: a list of [start, stop, step] / int / "..." per index."""
    items = key if isinstance(key, tuple) else (key,)
    out = []
    for k in items:
        if k is Ellipsis:
            out.append("...")
        elif isinstance(k, slice):
            out.append([k.start, k.stop, k.step])
        else:
            out.append(int(k))
    return out


def header(path: str):
    """(data start, {name: entry}) of a safetensors file, read with json alone."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(n))
    entries.pop("__metadata__", None)
    return 8 + n, entries


_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
          "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def resident_pages(path: str, page: int = 4096) -> set:
    """The file's pages (numbers) in the page cache now: ``mincore`` on a fresh map, never touched."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), "mmap failed"
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(addr, size, vec) == 0, "mincore failed"
            return {k for k, b in enumerate(bytes(vec)) if b & 1}
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def touched_pages(path: str, name: str, key, page: int = 4096, known=None) -> set:
    """The file's pages (numbers) that ``get_slice(name)[key]`` needs, ``key`` as ``_key_repr``
    writes it: worked out from the header and the key alone, row by row."""
    import itertools

    start, entries = known if known is not None else header(path)
    entry = entries[name]
    shape, size = entry["shape"], _SIZES[entry["dtype"]]
    base = start + entry["data_offsets"][0]
    dims = []
    for k in key:
        if k == "...":
            dims.extend((0, n) for n in shape[len(dims):len(shape) - (len(key) - 1 - key.index(k))])
        elif isinstance(k, list):
            lo, hi, step = k
            assert step in (None, 1), "steps are not used by transformers' sharding"
            n = shape[len(dims)]
            dims.append((max(0, min(lo or 0, n)), max(0, min(n if hi is None else hi, n))))
        else:
            dims.append((k, k + 1))
    dims.extend((0, n) for n in shape[len(dims):])
    strides = [size] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    pages = set()
    if not shape:
        return set(range(base // page, (base + size - 1) // page + 1))
    if any(hi <= lo for lo, hi in dims):
        return pages
    last_lo, last_hi = dims[-1]
    for index in itertools.product(*(range(lo, hi) for lo, hi in dims[:-1])):
        at = base + sum(i * s for i, s in zip(index, strides)) + last_lo * size
        end = at + (last_hi - last_lo) * size
        pages.update(range(at // page, (end - 1) // page + 1))
    return pages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="the checkpoint's folder; '{rank}' in it is this rank's number")
    ap.add_argument("out")
    ap.add_argument("--spy", action="store_true", help="record the slices asked (safeload only)")
    ap.add_argument("--params", action="store_true", help="save local parameters and logits")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ep", type=int, default=0,
                    help="expert parallelism over this many ranks (DistributedConfig(ep_size=N, tp_plan={})) "
                         "instead of tp_plan='auto'")
    args = ap.parse_args()

    import torch
    import torch.distributed  # noqa: F401
    from transformers import AutoModelForCausalLM

    reads = []
    fused = []

    class _Keep(logging.Handler):
        def emit(self, record):
            if getattr(record, "safeload_fused", None) is not None:
                fused.append(record.safeload_fused)
            got = getattr(record, "safeload_read", None)
            if got is not None and got.get("what") == "close":
                reads.append({"path": str(got["path"]), "bytes_read": int(got["bytes_read"] or 0),
                              "backend": got["backend"]})

    log = logging.getLogger("safeload")
    log.addHandler(_Keep())
    log.setLevel(logging.DEBUG)
    log.propagate = False

    asked = []
    if args.spy:
        import safeload._open as opened

        real = opened.SafeSlice.__getitem__

        def spy(self, key):
            asked.append({"path": os.fspath(self._owner._handle.path), "name": self._name,
                          "key": _key_repr(key)})
            return real(self, key)

        opened.SafeSlice.__getitem__ = spy

    model_dir = args.model.replace("{rank}", os.environ.get("RANK", "0"))
    io0 = _io_read_bytes()
    t0 = time.perf_counter()
    if args.ep:
        from transformers import DistributedConfig

        parallel = {"distributed_config": DistributedConfig(ep_size=args.ep, tp_plan={})}
    else:
        parallel = {"tp_plan": "auto"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype), **parallel)
    t_load = time.perf_counter() - t0
    # Use every local parameter: one byte of each page (a view of a map is read when touched).
    total = 0
    for p in model.state_dict().values():
        local = p.to_local() if hasattr(p, "to_local") else p
        flat = local.detach().reshape(-1).view(torch.uint8) if local.is_contiguous() else \
            local.detach().contiguous().reshape(-1).view(torch.uint8)
        total += int(flat[::4096].sum()) if flat.numel() else 0
    t_used = time.perf_counter() - t0
    io = _io_read_bytes() - io0
    resident = {r["path"]: sorted(resident_pages(r["path"])) for r in reads} if args.spy else {}
    rank = torch.distributed.get_rank()
    os.makedirs(args.out, exist_ok=True)
    if args.params:
        with torch.no_grad():
            logits = model(torch.arange(16)[None] % model.config.vocab_size).logits
        params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().contiguous().clone()
                  for n, p in model.state_dict().items()}
        torch.save({"params": params, "logits": logits.to_local() if hasattr(logits, "to_local") else logits},
                   os.path.join(args.out, f"rank{rank}.pt"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "load_s": t_load, "used_s": t_used, "io_read_bytes": io,
                   "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "reads": reads, "fused": fused, "asked": asked, "resident": resident, "checksum": total}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
