"""``benches/verify.py`` runs end to end on small checkpoints: every call it reports, warm and
cold, each verified call checked against the real digests (a mismatch fails the run), and the
``from_pretrained`` rows (stock, stock after hashlib, the patch with ``SAFELOAD_VERIFY=1``, whose
child asserts every file was verified)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import safetensors.torch
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify.py")
sys.path.insert(0, os.path.dirname(BENCH))
import verify  # noqa: E402


def test_verify_bench_rows(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for s in range(2):
        safetensors.torch.save_file({f"t{s}": torch.randn(256, 256)}, str(folder / f"m-{s}.safetensors"))
    out = tmp_path / "runs.json"
    r = subprocess.run([sys.executable, BENCH, str(folder), "--rounds", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith(f"| {folder} |")]
    assert [(row[1], row[2]) for row in rows] == [(s, h) for s in ("warm", "cold") for h in verify.VERIFIED]
    # every round printed as it ends, each call named in it
    assert r.stderr.count("# round 1") == 2 and all(h in r.stderr for h, _ in verify.HOWS)
    # --json keeps every child's figures: each way once per state in this one round
    runs = json.loads(out.read_text())["runs"]
    ways = {(x["state"], x["how"]) for x in runs}
    assert len(runs) == len(ways) == 2 * len(verify.HOWS) and {s for s, _ in ways} == {"warm", "cold"}
    assert all(x["s"] > 0 and x["peak_rss_kib"] > 0 and x["checkpoint"] == str(folder) for x in runs)


def test_verify_bench_from_pretrained(tmp_path):
    transformers = __import__("pytest").importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model_dir = tmp_path / "tiny"
    transformers.LlamaForCausalLM(config).save_pretrained(str(model_dir), max_shard_size="100KB")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, BENCH, "--from-pretrained", str(model_dir), "--rounds", "1"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith(f"| {model_dir} |")]
    assert [row[1] for row in rows] == ["warm", "cold"], r.stdout
    assert not (model_dir / "SHA256SUMS").exists()  # the sums sat beside links, in a folder since removed
