#!/usr/bin/env python3
"""Cold read rates through a slowfs FUSE mount (tests/support/slowfs.c), for the I/O policy sweep.

For each set of mount knobs, mounts the file's directory through slowfs, then reads the whole file
cold, ``--repeat`` times per mode, and prints the median rate with what the daemon saw (read
requests, their largest size, the most in flight at once):

- ``buffered``: THREADS threads pread CHUNK-byte pieces (taken in file order from a shared counter)
  of one shared fd into reused buffers: the page cache and the kernel's readahead are in the path.
- ``direct``: the same with O_DIRECT into reused page-aligned (mmap'd) buffers.
- ``safeload``: ``safeload.safe_open(path, "pt").get_tensors()`` with safeload's defaults (its
  ``f.stats`` are printed), or ``--threads``/``--chunk`` when ``--safeload-tuned`` is given.

Cold means: before every run the mount file's and the source file's page cache are dropped with
``posix_fadvise(DONTNEED)`` (``--warm-source`` keeps the source cached, so that only the FUSE
path and the injected latency count), and the file is opened afresh (slowfs drops the kernel's
cache on open unless ``--keep-cache``).

    python benches/fuse_probe.py                                   # 0.4 GiB sample, --latency 0.002
    python benches/fuse_probe.py --mount "" --mount "--max-background 128" --threads 16 --chunk 4MiB
    python benches/fuse_probe.py FILE.safetensors --modes buffered,direct --mount "--latency 0.005 --max-read 262144"

Each ``--mount`` is one mount's slowfs options (see tests/support/slowfs.c); ``--latency`` is
added to each unless it sets its own. Needs /dev/fuse, fuse3, libfuse3-dev, pkg-config and a C
compiler (see ``tests/support/slowfs.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SLOWFS = os.path.join(HERE, "..", "tests", "support", "slowfs.py")


def parse_bytes(s: str) -> int:
    s = s.strip()
    for suffix, mult in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def load_slowfs(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("slowfs_probe_impl", os.path.abspath(path))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_sample(directory: str, size: int) -> str:
    """A valid safetensors file of ~size bytes: 4 MiB U8 tensors of random bytes."""
    path = os.path.join(directory, "probe.safetensors")
    piece = 4 << 20
    n = max(1, size // piece)
    header: Dict[str, Any] = {}
    for i in range(n):
        header[f"t{i:04d}"] = {"dtype": "U8", "shape": [piece], "data_offsets": [i * piece, (i + 1) * piece]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    block = os.urandom(piece)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for i in range(n):
            f.write(block[i % 7:] + block[: i % 7])  # distinct pieces without n x urandom
    return path


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_parallel(path: str, threads: int, chunk: int, direct: bool) -> float:
    """Seconds to read the whole file with ``threads`` threads of ``chunk``-byte preads."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        size = os.fstat(fd).st_size
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        lock = threading.Lock()
        next_off = [0]
        errors: List[BaseException] = []

        def worker() -> None:
            buf = mmap.mmap(-1, chunk)  # page-aligned, reused: no fresh-memory faults in the timing
            try:
                while True:
                    with lock:
                        off = next_off[0]
                        next_off[0] = off + chunk
                    if off >= size:
                        return
                    want = min(chunk, size - off)
                    view = memoryview(buf)[: want if not direct else chunk]
                    got = os.preadv(fd, [view], off)
                    if got < want:
                        raise OSError(f"short read at {off}: {got} of {want}")
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        pool = [threading.Thread(target=worker) for _ in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return seconds
    finally:
        os.close(fd)


def read_safeload(path: str, threads: Optional[int], chunk: Optional[int]) -> Dict[str, Any]:
    import safeload

    t0 = time.perf_counter()
    with safeload.safe_open(path, "pt", threads=threads, chunk_bytes=chunk) as f:
        tensors = f.get_tensors()
        s = f.stats
    seconds = time.perf_counter() - t0
    del tensors
    return {"seconds": seconds, "backend": s.backend, "threads": s.threads, "chunk_bytes": s.chunk_bytes,
            "storage": s.storage, "bytes_read": s.bytes_read}


def daemon_stats(mp: Any) -> Dict[str, int]:
    try:
        return mp.stats()
    except (AttributeError, OSError):
        return {}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", help="file to read (default: a generated ~SIZE safetensors sample)")
    p.add_argument("--size", type=parse_bytes, default=parse_bytes("0.4GiB"), help="sample size (default 0.4GiB)")
    p.add_argument("--modes", default="buffered,direct,safeload", help="comma list of buffered, direct, safeload")
    p.add_argument("--direct", dest="modes", action="store_const", const="direct", help="same as --modes direct")
    p.add_argument("--buffered", dest="modes", action="store_const", const="buffered", help="same as --modes buffered")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--chunk", type=parse_bytes, default=4 << 20, help="bytes per pread (default 4MiB)")
    p.add_argument("--safeload-tuned", action="store_true", help="pass --threads/--chunk to safeload too")
    p.add_argument("--latency", type=float, default=0.002, help="slowfs --latency for every mount (default 0.002)")
    p.add_argument("--mount", action="append", default=None, metavar="OPTIONS",
                   help='slowfs options of one mount, e.g. "--max-background 128" (repeatable; default: "" and '
                   '"--max-background 128")')
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warm-source", action="store_true", help="do not evict the source file between runs")
    p.add_argument("--read-ahead-kb", type=int, default=None, help="write the mount's bdi read_ahead_kb (root)")
    p.add_argument("--slowfs", default=DEFAULT_SLOWFS, help="slowfs module offering mounted() (default tests/support/slowfs.py)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    slowfs = load_slowfs(args.slowfs)
    why = slowfs.fuse_unavailable()
    if why:
        print(f"no FUSE mount possible: {why}", file=sys.stderr)
        return 2
    modes = [m for m in args.modes.split(",") if m]
    mounts = args.mount if args.mount is not None else ["", "--max-background 128"]
    tmp = tempfile.mkdtemp(prefix="fuse-probe-")
    results = []
    try:
        if args.file:
            src = os.path.abspath(args.file)
        else:
            os.mkdir(os.path.join(tmp, "src"))
            src = make_sample(os.path.join(tmp, "src"), args.size)
        size = os.path.getsize(src)
        print(f"# {src}: {size / 2**30:.3f} GiB, {args.threads} threads x {args.chunk >> 10} KiB, "
              f"median of {args.repeat}, source {'warm' if args.warm_source else 'cold'}")
        print(f"{'mount options':40} {'mode':9} {'GiB/s':>6}  runs                 daemon / safeload")
        for opts in mounts:
            options = shlex.split(opts)
            if "--latency" not in options and args.latency:
                options = ["--latency", repr(args.latency), *options]
            mnt = os.path.join(tmp, "mnt")
            with slowfs.mounted(os.path.dirname(src), mnt, *options) as mp:
                path = os.path.join(mp, os.path.basename(src))
                conn = getattr(mp, "connection", lambda: None)()
                if args.read_ahead_kb is not None:
                    dev = os.stat(mp).st_dev
                    with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as f:
                        f.write(str(args.read_ahead_kb))
                for mode in modes:
                    rates, extra = [], {}
                    before = daemon_stats(mp)  # also resets the daemon's peaks
                    for _ in range(args.repeat):
                        if not args.warm_source:
                            evict(src)
                        evict(path)
                        try:
                            if mode == "safeload":
                                r = read_safeload(path, args.threads if args.safeload_tuned else None,
                                                  args.chunk if args.safeload_tuned else None)
                                seconds = r.pop("seconds")
                                extra = r
                            else:
                                seconds = read_parallel(path, args.threads, args.chunk, mode == "direct")
                        except OSError as e:
                            extra = {"error": str(e)}
                            break
                        rates.append(size / seconds / 2**30)
                    after = daemon_stats(mp)
                    if after:
                        n = max(1, len(rates))
                        extra.update({"reads/run": (after["reads"] - before["reads"]) // n,
                                      "req_max_kib": after["size_max"] >> 10, "inflight_max": after["inflight_max"]})
                    if conn and "max_background" not in extra:
                        with open(os.path.join(conn, "max_background")) as f:
                            extra["max_background"] = int(f.read())
                    med = statistics.median(rates) if rates else float("nan")
                    runs = " ".join(f"{r:.2f}" for r in rates)
                    shown = {k: v for k, v in extra.items() if k not in ("bytes_read", "storage")}
                    print(f"{' '.join(options):40} {mode:9} {med:6.2f}  {runs:20} {shown}", flush=True)
                    results.append({"mount": options, "mode": mode, "median_gib_s": med, "runs": rates, **extra})
    finally:
        for name in ("mnt", "src/probe.safetensors", "src"):
            path = os.path.join(tmp, name)
            if os.path.isdir(path):
                os.rmdir(path)  # never a recursive delete under a possible mount
            elif os.path.exists(path):
                os.unlink(path)
        os.rmdir(tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file": src, "size": size, "threads": args.threads, "chunk": args.chunk, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
