"""A slow, faulty FUSE filesystem for safeload's tests and benchmark: builds and mounts slowfs.c.

``slowfs.c`` (next to this file; its header comment documents every option and what it does to
the kernel) is a libfuse3 read-only mirror of a directory, multi-threaded so that the daemon is
never the limit. This module compiles it once into ``target/slowfs/<source hash>/slowfs`` (or
``$SLOWFS_CACHE``) with ``cc $(pkg-config --cflags --libs fuse3)`` and mounts it::

    with mounted("src_dir", "mnt", "--latency", "0.002", "--max-background", "128") as m:
        open(os.path.join(m, "model.safetensors"), "rb").read()
        print(m.stats())   # {'reads': ..., 'bytes': ..., 'inflight_max': ..., ...}

Command line (foreground until ``fusermount3 -u MOUNTPOINT`` or Ctrl-C)::

    python tests/support/slowfs.py SRC MOUNTPOINT [--latency 0.002] [--bandwidth BYTES_PER_S]
        [--eio NAME:OFFSET] [--short-reads] [--shrink NAME:SIZE:AFTER] [--max-background N] ...
    python tests/support/slowfs.py --build        # prints the binary's path

Needs /dev/fuse, fusermount3 (Debian: fuse3), a C compiler, pkg-config and libfuse3-dev.
Imported by tests (tests/conftest.py puts this directory on sys.path) and by
``safeload.bench --slow-fs`` (by path, from a checkout).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "slowfs.c")
REPO = os.path.dirname(os.path.dirname(HERE))
STATS_FILE = ".slowfs-stats"
RELEASE_FILE = ".slowfs-release"
RELEASE_ALL_FILE = ".slowfs-release-all"

_built: Dict[str, str] = {}  # source hash -> binary path


class BuildError(RuntimeError):
    pass


def _cache_dir() -> str:
    if os.environ.get("SLOWFS_CACHE"):
        return os.environ["SLOWFS_CACHE"]
    target = os.path.join(REPO, "target")
    if os.access(REPO, os.W_OK) and (not os.path.exists(target) or os.access(target, os.W_OK)):
        return os.path.join(target, "slowfs")
    return os.path.join(tempfile.gettempdir(), f"slowfs-{os.getuid()}")


def build() -> str:
    """The path of the compiled daemon, compiling it first if this source was never built."""
    with open(SOURCE, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src).hexdigest()[:16]
    if key in _built:
        return _built[key]
    out_dir = os.path.join(_cache_dir(), key)
    binary = os.path.join(out_dir, "slowfs")
    if not os.access(binary, os.X_OK):
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes build once
            if not os.access(binary, os.X_OK):
                _compile(binary)
    _built[key] = binary
    return binary


def _compile(binary: str) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise BuildError("no C compiler (apt-get install gcc)")
    if not shutil.which("pkg-config"):
        raise BuildError("pkg-config is not installed (apt-get install pkg-config libfuse3-dev)")
    flags = []
    for what in ("--modversion", "--cflags", "--libs"):
        r = subprocess.run(["pkg-config", what, "fuse3"], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"libfuse3 development files missing (apt-get install libfuse3-dev): {r.stderr.strip()}")
        flags.append(r.stdout.split())
    version = tuple(int(x) for x in (flags[0][0].split(".") + ["0"])[:2])
    use = ["-DFUSE_USE_VERSION=312"] if version >= (3, 12) else ["-DFUSE_USE_VERSION=32"]
    tmp = f"{binary}.{os.getpid()}.tmp"
    cmd = [cc, "-O2", "-Wall", "-std=gnu11", *use, *flags[1], "-o", tmp, SOURCE, *flags[2], "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed:\n{r.stderr}")
    os.replace(tmp, binary)


_unavailable: Optional[str] = None
_checked = False


def fuse_unavailable() -> Optional[str]:
    """Why a slowfs mount cannot be made here, or None."""
    global _unavailable, _checked
    if not _checked:
        _checked = True
        if not os.path.exists("/dev/fuse"):
            _unavailable = "/dev/fuse is missing"
        elif not os.access("/dev/fuse", os.R_OK | os.W_OK) and not _fusermount():
            _unavailable = "/dev/fuse is not accessible and fusermount3 is not installed (apt-get install fuse3)"
        elif not _fusermount():
            _unavailable = "fusermount3 is not installed (apt-get install fuse3)"
        else:
            try:
                build()
            except (BuildError, OSError) as e:
                _unavailable = f"cannot build tests/support/slowfs.c: {e}"
    return _unavailable


def _fusermount() -> Optional[str]:
    return shutil.which("fusermount3") or shutil.which("fusermount")


class MountPoint(str):
    """The mount point (a str), with the daemon's counters."""

    def stats(self) -> Dict[str, int]:
        """Counters since the mount: reads, bytes, errors; and peaks since the previous call:
        inflight_max (read requests in flight at once), size_max and size_min (request bytes)."""
        with open(os.path.join(self, STATS_FILE)) as f:
            line = f.read()
        return {k: int(v) for k, v in (kv.split("=") for kv in line.split())}

    def release(self, everything: bool = False) -> None:
        """``--hold-after``: lets the read requests held now go on (later ones are held again),
        or, with ``everything``, ends the holding."""
        with open(os.path.join(self, RELEASE_ALL_FILE if everything else RELEASE_FILE), "rb", buffering=0) as f:
            f.read(16)

    def connection(self) -> Optional[str]:
        """The mount's /sys/fs/fuse/connections/N directory, when fusectl is mounted and visible."""
        dev = os.stat(self).st_dev
        path = f"/sys/fs/fuse/connections/{(os.major(dev) << 20) | os.minor(dev)}"
        return path if os.path.isdir(path) else None


def _is_mounted(mountpoint: str) -> bool:
    real = os.path.realpath(mountpoint)
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == real for line in f)
    except OSError:
        return os.path.ismount(mountpoint)


def unmount(mountpoint: str) -> None:
    """Unmounts, lazily when a plain unmount fails (busy)."""
    tool = _fusermount() or "fusermount3"
    for args in (["-u"], ["-u", "-z"]):
        if not _is_mounted(mountpoint):
            return
        subprocess.run([tool, *args, mountpoint], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if _is_mounted(mountpoint) and os.geteuid() == 0:
        subprocess.run(["umount", "-l", mountpoint], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def mounted(source: str, mountpoint: str, *options: str, timeout: float = 15.0) -> Iterator[MountPoint]:
    """Mounts ``source`` at ``mountpoint`` (created if missing) with slowfs ``options``; yields the
    mount point; unmounts and stops the daemon on exit, also on error or KeyboardInterrupt."""
    binary = build()
    os.makedirs(mountpoint, exist_ok=True)
    if _is_mounted(mountpoint):
        raise RuntimeError(f"{mountpoint} is already a mount point")
    # The daemon's stderr goes to a file: a pipe nobody drains would fill and stall it.
    log = tempfile.TemporaryFile()

    def output() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")

    proc = subprocess.Popen([binary, source, mountpoint, *options], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        while not _is_mounted(mountpoint):
            if proc.poll() is not None:
                raise RuntimeError(f"slowfs exited with {proc.returncode}: {output()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"slowfs did not mount within {timeout:g} s: {output()}")
            time.sleep(0.02)
        yield MountPoint(mountpoint)
    finally:
        if "--hold-after" in options and _is_mounted(mountpoint):
            try:  # requests still held would keep the daemon from exiting
                MountPoint(mountpoint).release(everything=True)
            except OSError:
                pass
        unmount(mountpoint)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            unmount(mountpoint)
        log.close()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--build"]:
        print(build())
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    binary = build()
    os.execv(binary, [binary, *argv])
    return 1


if __name__ == "__main__":
    sys.exit(main())
