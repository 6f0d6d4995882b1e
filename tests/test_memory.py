"""Memory a container can predict (safeload's `src/read/memory.rs`): ``SAFELOAD_MEMORY_LIMIT`` and a
cgroup limit (a fixture tree under ``_testing.set_cgroup_root``) on real loads, each in a fresh process
(both are read once per process). Checked: a load into owned memory that cannot fit raises a
clear MemoryError before reading anything; ``auto`` loads the same file mapped, with 0.8's
tensors; the pool keeps at most a quarter of what is left; and nothing changes without a limit.
The cgroup parser itself is tested on fixture trees in ``cargo test`` (v1, v2, nested, ``max``,
missing files, a limit below use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import safetensors.torch as st_torch

MIB = 1 << 20


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """A 96 MiB file written by safetensors 0.8 (six 16 MiB tensors)."""
    path = tmp_path_factory.mktemp("mem") / "big.safetensors"
    gen = torch.Generator().manual_seed(0)
    st_torch.save_file({f"t{i}": torch.randn(4 * MIB, generator=gen) for i in range(6)}, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, so that the tests can evict them (dirty ones stay cached)
    finally:
        os.close(fd)
    return str(path)


def run(script: str, **env: str) -> dict:
    """Runs ``script`` in a fresh interpreter with ``env`` added; it prints one JSON line. Cold
    files larger than 1 MiB are read uncached by ``auto`` there, unless they cannot fit."""
    full = dict(os.environ)
    full.pop("SAFELOAD_MEMORY_LIMIT", None)
    full["SAFELOAD_DIRECT_ABOVE"] = str(MIB)
    full.update(env)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=full,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


LOAD = """
import json, sys
import torch
import safetensors.torch as st_torch
import safeload, safeload.torch
path = sys.argv[1] if len(sys.argv) > 1 else {path!r}
{setup}
out = {{"info": safeload.memory_info()}}
with safeload.safe_open(path, "pt", backend="pread") as f:
    try:
        f.get_tensors()
        out["pread"] = "ok"
    except MemoryError as e:
        out["pread"] = str(e)
    out["pread_bytes_read"] = f.stats.bytes_read
import os
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: auto would read it uncached
os.close(fd)
with safeload.safe_open(path, "pt") as f:
    out["auto_backend"] = f.backend
got = safeload.torch.load_file(path)
ref = st_torch.load_file(path)
out["auto_equal"] = sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
print(json.dumps(out))
"""


def check_refused(out: dict, path: str, why: str) -> None:
    message = out["pread"]
    assert message != "ok"
    for words in (path, "needs", "available", "mmap", "iter_checkpoint", why):
        assert words in message, (words, message)
    assert out["pread_bytes_read"] == 0  # refused before reading
    assert out["auto_backend"] == "mmap" and out["auto_equal"]


def test_memory_limit_refuses_what_cannot_fit(big_file):
    out = run(LOAD.format(path=big_file, setup=""), SAFELOAD_MEMORY_LIMIT="64MiB")
    assert out["info"]["user"] is not None and out["info"]["user"] <= 64 * MIB
    check_refused(out, big_file, "SAFELOAD_MEMORY_LIMIT")


def test_without_a_limit_nothing_changes(big_file):
    out = run(LOAD.format(path=big_file, setup=""))
    assert out["info"]["user"] is None
    assert out["pread"] == "ok" and out["auto_equal"]
    assert out["auto_backend"] == "direct"  # the cold large file, when it fits


@pytest.mark.usefixtures("testing")  # the child calls _testing.set_cgroup_root
def test_cgroup_limit_from_a_fixture_tree(big_file, tmp_path):
    root = tmp_path / "root"
    cg = root / "sys/fs/cgroup/pod/ctr"
    cg.mkdir(parents=True)
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("0::/pod/ctr\n")
    (root / "proc/self/mountinfo").write_text("30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    (cg / "memory.max").write_text(f"{80 * MIB}\n")
    (cg / "memory.current").write_text(f"{20 * MIB}\n")
    (cg / "memory.stat").write_text(f"anon 1\ninactive_file {4 * MIB}\n")
    setup = f"safeload._safeload._testing.set_cgroup_root({str(root)!r})"
    out = run(LOAD.format(path=big_file, setup=setup))
    assert out["info"]["container"] == 64 * MIB  # 80 MiB less (20 - 4) MiB in use
    check_refused(out, big_file, "cgroup")


def test_pool_keeps_at_most_its_share(big_file):
    """Under a 64 MiB limit the pool keeps at most a quarter of what is left; freed memory is
    reused, and release_memory() gives it all back."""
    script = """
    import json, safeload
    path = {path!r}
    sizes = []
    for _ in range(5):
        with safeload.safe_open(path, "pt", backend="pread") as f:
            t = f.get_tensor("t0")  # 16 MiB into owned memory, freed below
        del t
        info = safeload.memory_info()
        sizes.append((safeload.pooled_bytes(), info["pool_limit"]))
    released = safeload.release_memory()
    print(json.dumps({{"sizes": sizes, "after": safeload.pooled_bytes(), "released": released}}))
    """
    out = run(script.format(path=big_file), SAFELOAD_MEMORY_LIMIT="64MiB",
              SAFELOAD_READAHEAD_BYTES="0")
    for pooled, limit in out["sizes"]:
        assert limit <= 16 * MIB and pooled <= limit
    assert out["after"] == 0
    unlimited = run(script.format(path=big_file), SAFELOAD_READAHEAD_BYTES="0")
    assert any(pooled >= 16 * MIB for pooled, _ in unlimited["sizes"])  # pooled when it fits
