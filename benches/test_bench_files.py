"""``benches/bench.py FILE...``: the benchmark on a user's own file (what ``safeload bench`` was).

One warm round of two contenders in fresh processes; the rows, the byte counts and the
equality check come from the file itself, not from the samples."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

import safeload.torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")


def _one_warm_round(path, contenders, out):
    """bench.py on ``path``: one warm round of ``contenders``; its results.json."""
    r = subprocess.run([sys.executable, BENCH, path, "--rounds", "1", "--no-cold", "--settle", "0",
                        "--contenders", contenders, "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "results.json").read_text())


def test_bench_on_a_users_file(tmp_path):
    path = str(tmp_path / "mine.safetensors")
    tensors = {"big": np.arange(1 << 18, dtype=np.float32), "odd": np.ones((3, 5), dtype=np.int16),
               "empty": np.zeros((0, 2), dtype=np.float16)}
    safetensors.numpy.save_file(tensors, path)
    out = tmp_path / "out"
    result = _one_warm_round(path, "sl_auto,sl_get_tensors,st_default", out)
    (ds,) = result["datasets"]
    assert ds["files"] == [path] and ds["tensors"] == len(tensors) and ds["verify"]["equal"]
    nbytes = sum(t.nbytes for t in tensors.values())
    runs = {run["contender"]: run for run in result["runs"]}
    assert set(runs) == {"sl_auto", "sl_get_tensors", "st_default"}
    for name, run in runs.items():
        assert run["state"] == "warm" and run["tensors"] == len(tensors), name
        assert run["bytes"] == nbytes, name
    assert runs["sl_auto"]["backend"] in ("mmap", "pread", "direct")
    summary = {row["contender"]: row for row in result["summary"]}
    assert set(summary) == set(runs) and all(row["runs"] == 1 for row in summary.values())
    assert "| mine.safetensors |" in (out / "results.md").read_text()
    r = subprocess.run([sys.executable, BENCH, path, "--contenders", "sl_pread"], capture_output=True, text=True)
    assert r.returncode != 0 and "sl_pread" in r.stderr and "match no contender" in r.stderr


def test_load_model_contenders_fill_a_module_shaped_like_the_file(tmp_path):
    """``st_load_model`` / ``sl_load_model`` build a module with a parameter per tensor (nested by
    the names' dots) before the clock; each load fills all of it (every tensor, every byte)."""
    path = str(tmp_path / "model.safetensors")
    tensors = {"layers.0.weight": np.arange(1 << 16, dtype=np.float32).reshape(256, 256),
               "layers.0.bias": np.ones(256, dtype=np.float16), "layers.1.steps": np.arange(7, dtype=np.int64),
               "head": np.zeros((0, 3), dtype=np.float32)}
    safetensors.numpy.save_file(tensors, path)
    result = _one_warm_round(path, "st_load_model,sl_load_model", tmp_path / "out")
    runs = {run["contender"]: run for run in result["runs"]}
    assert set(runs) == {"st_load_model", "sl_load_model"}
    for name, run in runs.items():
        assert (run["tensors"], run["bytes"]) == (len(tensors), sum(t.nbytes for t in tensors.values())), name
    # The module matches the file exactly (strict loads find nothing missing or unexpected), starts
    # with other bytes than the file's, and both loaders leave it holding the file's tensors.
    sys.path.insert(0, os.path.dirname(BENCH))
    import bench

    for load_model in (safetensors.torch.load_model, safeload.torch.load_model):
        module = bench._initialised_module([path])
        state = module.state_dict()
        assert not torch.equal(state["layers.0.weight"], torch.from_numpy(tensors["layers.0.weight"]))
        missing, unexpected = load_model(module, path, strict=True)
        assert (list(missing), list(unexpected)) == ([], [])
        for k, v in tensors.items():
            assert torch.equal(module.state_dict()[k], torch.from_numpy(v)), (load_model, k)


def _present_pages(address, pages):
    """Which of the ``pages`` pages from ``address`` are mapped in (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(address, pages * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return {i for i in range(pages) if vec[i] & 1}


def test_touch_reads_every_page_a_tensor_lies_on(tmp_path):
    """``bench.touch``, which every contender's time includes (a lazy map's first use): the
    pages each tensor's bytes lie on become present, small tensors (a byte at a time) and large
    ones (a strided sum), unaligned starts and ends included; no page besides."""
    import ctypes

    sys.path.insert(0, os.path.dirname(BENCH))
    import bench

    page, pages = mmap.PAGESIZE, 128
    buf = mmap.mmap(-1, pages * page)  # anonymous and never touched: no page is present
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert _present_pages(address, pages) == set()
    # (offset, bytes): inside one page, across a page boundary, several pages from mid-page,
    # large (past the bytewise limit) ending one byte into a page, empty; gaps left between.
    spans = [(10, 1), (2 * page - 3, 7), (5 * page + 100, 3 * page), (20 * page + 8, 80 * page + 1),
             (110 * page, 0)]
    tensors = [torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=o) if n else torch.empty(0)
               for o, n in spans]
    bench._touch(dict(enumerate(tensors)))
    expected = {p for o, n in spans if n for p in range(o // page, (o + n - 1) // page + 1)}
    assert _present_pages(address, pages) == expected
    del tensors
