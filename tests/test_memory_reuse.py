"""Freed destination memory is kept for the next load (issue 12): reused for a similar size, never
while a tensor still points into it, and given back to the OS when idle or on request."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

import safeload

from conftest import raw_bytes

MIB = 1 << 20


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse") / "big.safetensors"
    g = torch.Generator().manual_seed(5)
    save_file({"a": torch.randn(3 * MIB, generator=g), "b": torch.randint(0, 255, (5 * MIB,), dtype=torch.uint8,
                                                                          generator=g)}, str(path))
    return str(path)


def _load(path):
    with safeload.safe_open(path, "pt", backend="pread") as f:
        return f.get_tensors()


def test_second_load_reuses_freed_memory_with_correct_bytes(big_file):
    safeload.release_memory()
    want = st_load_file(big_file)
    first = _load(big_file)
    ptrs = {k: t.untyped_storage().data_ptr() for k, t in first.items()}
    del first
    assert safeload.pooled_bytes() >= 17 * MIB  # 12 MiB + 5 MiB went to the pool, not the OS
    second = _load(big_file)
    assert {t.untyped_storage().data_ptr() for t in second.values()} & set(ptrs.values())
    for k in want:
        assert raw_bytes(second[k]) == raw_bytes(want[k]), k


def test_live_tensors_memory_is_never_reused(big_file):
    safeload.release_memory()
    keep = _load(big_file)
    before = {k: raw_bytes(t) for k, t in keep.items()}
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in keep.values()]
    other = _load(big_file)
    for t in other.values():
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert all(hi <= a or lo >= b for a, b in spans)
    for t in other.values():
        t.zero_()
    assert {k: raw_bytes(t) for k, t in keep.items()} == before


def test_release_gives_memory_back(big_file):
    tensors = _load(big_file)
    del tensors
    assert safeload.pooled_bytes() > 0
    assert safeload.release_memory() >= 17 * MIB
    assert safeload.pooled_bytes() == 0


IDLE_SCRIPT = textwrap.dedent("""
    import sys, time, torch, safeload
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    path = sys.argv[1]
    base = rss()
    with safeload.safe_open(path, "pt", backend="pread") as f:
        t = f.get_tensors()
    loaded = rss()
    del t
    held = safeload.pooled_bytes()
    # The reaper runs every idle/2 s and unmaps after it empties the pool: wait for both (up to
    # 60 s, not a fixed time); the assertions below say whether they happened.
    deadline = time.monotonic() + 60
    while (safeload.pooled_bytes() or rss() - base >= 4 << 20) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(held, safeload.pooled_bytes(), loaded - base, rss() - base)
""")


@pytest.mark.parametrize("env,expect_held", [({"SAFELOAD_POOL_IDLE_S": "0.2"}, True),
                                             ({"SAFELOAD_POOL_BYTES": "0"}, False)])
def test_idle_pool_returns_to_the_os(big_file, env, expect_held):
    out = subprocess.run([sys.executable, "-c", IDLE_SCRIPT, big_file], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    held, after, loaded_growth, final_growth = map(int, out.stdout.split())
    assert (held >= 17 * MIB) == expect_held
    assert after == 0
    assert loaded_growth >= 17 * MIB
    assert final_growth < 4 * MIB  # RSS back at the baseline
