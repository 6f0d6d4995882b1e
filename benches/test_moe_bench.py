"""``benches/moe.py`` end to end at its tiny size (a Qwen3-MoE-shaped checkpoint of a few MB written
by ``save_pretrained``): one warm round of the single-process mode, stock and ``SAFELOAD_PATCH=1``
each loaded in a fresh process, the two variants' parameters hashed and equal (the run fails
otherwise), and the table has a row for each. Nothing here asserts a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe.py")


def test_moe_bench_rows(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, BENCH, "--size", "tiny", "--rounds", "1", "--modes", "one", "--states", "warm",
                        "--data", str(tmp_path / "data"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stock and safeload agree" in r.stdout, r.stdout
    got = json.loads(out.read_text())
    assert got["correctness"]["equal"] and got["correctness"]["params"] > 0
    assert got["share"]["tensors"] > got["correctness"]["params"]  # per-expert tensors on disk, fused on load
    assert sorted((x["mode"], x["state"], x["variant"]) for x in got["runs"]) == [
        ("one", "warm", "safeload"), ("one", "warm", "stock")]
    assert [x["ranks"][0]["patched"] for x in sorted(got["runs"], key=lambda x: x["variant"])] == [True, False]
    for variant in ("stock", "safeload"):
        assert f"| one | warm | {variant} |" in r.stdout, r.stdout
