"""``benches/bench.py FILE...``: the benchmark on a user's own file (what ``safeload bench`` was).

One warm round of two contenders in fresh processes; the rows, the byte counts and the
equality check come from the file itself, not from the samples."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import safetensors.numpy

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")


def test_bench_on_a_users_file(tmp_path):
    path = str(tmp_path / "mine.safetensors")
    tensors = {"big": np.arange(1 << 18, dtype=np.float32), "odd": np.ones((3, 5), dtype=np.int16),
               "empty": np.zeros((0, 2), dtype=np.float16)}
    safetensors.numpy.save_file(tensors, path)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, BENCH, path, "--rounds", "1", "--no-cold", "--settle", "0",
                        "--contenders", "sl_auto,sl_get_tensors,st_default", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((out / "results.json").read_text())
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
