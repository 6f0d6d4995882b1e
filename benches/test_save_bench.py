"""``benches/save.py`` runs end to end at a tiny size: every scenario (save_pretrained on a tiny
model), every way, the write limit as the best pwrite, and safeload's manifests passing
``sha256sum -c`` (the run fails otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "save.py")


def test_save_bench_rows(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(BENCH))
    import e2e

    e2e.build_model("transformers", "tiny", str(tmp_path / "model"))
    out = tmp_path / "save.json"
    r = subprocess.run([sys.executable, BENCH, "--scenario", "all", "--rounds", "1", "--gib", "0.01",
                        "--dir", str(tmp_path / "w"), "--model", str(tmp_path / "model"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())["scenarios"]
    assert set(got) == {"file", "small", "tmpfs", "checkpoint", "save_pretrained"}
    assert len(got["file"]["rows"]) == 9 and got["file"]["rows"][-1]["of_limit"] == 1.0
    # the checkpoint beside the write limit for the same bytes: 2 ways, 3 pwrite, the limit
    assert len(got["checkpoint"]["rows"]) == 6 and got["checkpoint"]["rows"][-1]["way"] == "write limit (best pwrite)"
    assert all(f"| {row['way']} |" in r.stdout for s in got.values() for row in s["rows"])
