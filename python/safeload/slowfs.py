"""A slow, faulty FUSE filesystem for tests and benchmarks.

Mirrors a directory read-only and, per read request, adds a latency and a bandwidth cap, and can
inject faults: EIO at a byte offset of a file, short reads, a file that shrinks once a given
number of bytes has been read from it.

    python -m safeload.slowfs SRC MOUNTPOINT [--latency 0.002] [--bandwidth BYTES_PER_S]
        [--eio NAME:OFFSET] [--short-reads] [--shrink NAME:SIZE:AFTER_BYTES]

Runs in the foreground until unmounted (``fusermount -u MOUNTPOINT``). ``mounted()`` below does
all of that for tests. Needs /dev/fuse, libfuse2 and the ``fusepy`` package.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, Iterator, Optional, Tuple


def fuse_unavailable() -> Optional[str]:
    """Why a FUSE mount cannot be made here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount") is None and shutil.which("fusermount3") is None:
        return "fusermount is not installed (apt-get install fuse3)"
    try:
        import fuse  # noqa: F401  (fusepy)
    except (ImportError, OSError, EnvironmentError) as e:
        return f"fusepy/libfuse2 unavailable: {e}"
    return None


def _make_fs(source: str, latency: float, bandwidth: float, eio: Dict[str, int], short_reads: bool,
             shrink: Dict[str, Tuple[int, int]]):
    from fuse import FuseOSError, Operations

    class SlowFS(Operations):
        def __init__(self) -> None:
            self.root = os.path.realpath(source)
            self.read_bytes: Dict[str, int] = {}
            self.lock = threading.Lock()
            self.requests = 0

        def _full(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _size(self, name: str, real: int) -> int:
            if name in shrink:
                size, after = shrink[name]
                if self.read_bytes.get(name, 0) >= after:
                    return min(real, size)
            return real

        def getattr(self, path, fh=None):
            st = os.lstat(self._full(path))
            attrs = {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")}
            if stat.S_ISREG(st.st_mode):
                attrs["st_size"] = self._size(path.lstrip("/"), st.st_size)
                attrs["st_mode"] = stat.S_IFREG | 0o444
            return attrs

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._full(path))

        def open(self, path, flags):
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise FuseOSError(errno.EROFS)
            return os.open(self._full(path), os.O_RDONLY)

        def read(self, path, size, offset, fh):
            name = path.lstrip("/")
            with self.lock:
                self.requests += 1
            delay = latency + (size / bandwidth if bandwidth else 0.0)
            if delay:
                time.sleep(delay)
            if name in eio and offset <= eio[name] < offset + size:
                raise FuseOSError(errno.EIO)
            real = os.fstat(fh).st_size
            end = min(offset + size, self._size(name, real))
            if end <= offset:
                return b""
            if short_reads and end - offset > 4096:
                end = offset + (end - offset) // 2
            data = os.pread(fh, end - offset, offset)
            with self.lock:
                self.read_bytes[name] = self.read_bytes.get(name, 0) + len(data)
            return data

        def release(self, path, fh):
            os.close(fh)
            return 0

        def statfs(self, path):
            st = os.statvfs(self.root)
            return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    return SlowFS()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every read request")
    parser.add_argument("--bandwidth", type=float, default=0.0, help="bytes per second per request (0: no cap)")
    parser.add_argument("--eio", action="append", default=[], metavar="NAME:OFFSET")
    parser.add_argument("--short-reads", action="store_true", help="return half of what is asked")
    parser.add_argument("--shrink", action="append", default=[], metavar="NAME:SIZE:AFTER")
    args = parser.parse_args(argv)
    from fuse import FUSE

    eio = {n: int(o) for n, o in (e.rsplit(":", 1) for e in args.eio)}
    shrink = {}
    for spec in args.shrink:
        name, size, after = spec.rsplit(":", 2)
        shrink[name] = (int(size), int(after))
    fs = _make_fs(args.source, args.latency, args.bandwidth, eio, args.short_reads, shrink)
    FUSE(fs, args.mountpoint, foreground=True, nothreads=False, ro=True, max_read=1 << 20)


@contextlib.contextmanager
def mounted(source: str, mountpoint: str, *options: str) -> Iterator[str]:
    """Mounts ``source`` at ``mountpoint`` with slowfs ``options``; unmounts on exit."""
    os.makedirs(mountpoint, exist_ok=True)
    # The daemon's stderr goes to a file: a pipe nobody drains would fill and stall the daemon.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "safeload.slowfs", source, mountpoint, *options],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.time() + 15
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"slowfs exited: {log.read().decode(errors='replace')}")
            if time.time() > deadline:
                raise RuntimeError("slowfs did not mount within 15 s")
            time.sleep(0.05)
        yield mountpoint
    finally:
        tool = shutil.which("fusermount") or shutil.which("fusermount3") or "fusermount"
        subprocess.run([tool, "-u", "-z", mountpoint], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


if __name__ == "__main__":
    main()
