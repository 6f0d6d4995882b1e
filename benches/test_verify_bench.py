"""``benches/verify.py`` runs end to end on a small checkpoint: a warm and a cold row, each of
its three loads run (the verified one checks the real digests, so a mismatch fails the run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import safetensors.torch
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify.py")


def test_verify_bench_rows(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for s in range(2):
        safetensors.torch.save_file({f"t{s}": torch.randn(256, 256)}, str(folder / f"m-{s}.safetensors"))
    out = tmp_path / "runs.json"
    r = subprocess.run([sys.executable, BENCH, str(folder), "--rounds", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith(f"| {folder} |")]
    assert [row.split(" | ")[1] for row in rows] == ["warm", "cold"], r.stdout
    # --json keeps every child's figures: each way once per state in this one round
    runs = json.loads(out.read_text())["runs"]
    ways = {(x["state"], x["how"]) for x in runs}
    assert len(runs) == len(ways) == 2 * 7 and {s for s, _ in ways} == {"warm", "cold"}
    assert all(x["s"] > 0 and x["peak_rss_kib"] > 0 and x["checkpoint"] == str(folder) for x in runs)
