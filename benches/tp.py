"""Tensor-parallel loads as users run them: unmodified transformers ``from_pretrained(...,
tp_plan="auto")`` on 2 gloo ranks (``python -m torch.distributed.run``, CPU), stock (safetensors
0.8) against ``SAFELOAD_PATCH=1`` with nothing else set, side by side in one run.

    python benches/tp.py                          # hidden 4096 (1.9 GB a copy), 3 rounds
    python benches/tp.py --size small --rounds 1  # hidden 1024 (0.2 GB), a quick look

States: ``cold`` and ``warm`` with each rank on its own copy of the checkpoint (as ranks on
separate nodes, or on a network filesystem: no page cache shared), and ``shared-cold`` /
``shared-warm`` with both ranks reading the same files (one node, one page cache). Cold: every
copy synced and evicted (``POSIX_FADV_DONTNEED``; the host may still cache it) before the run;
warm: read into the page cache first. Every run is a fresh ``torch.distributed.run``; each rank
imports torch and transformers before its clock (``tests/support/tp_rank.py``). Per run and
rank: seconds for ``from_pretrained`` and until every local parameter was used (one byte of each
of its pages read: 0.8 hands out views of its map, read when touched), the kernel's
``read_bytes``, safeload's own count of bytes read, peak RSS. A run counts as its slowest rank.
Rounds interleave the variants in a shuffled order; the table gives medians, stock / safeload
ratios (> 1: safeload faster) and the pages each rank's slices touch (from one spied run: the
rank's share of the file, at page granularity), against which the bytes read are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RANK_SCRIPT = os.path.join(ROOT, "tests", "support", "tp_rank.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

from tp_rank import evict, header, touched_pages  # noqa: E402

#: size -> (hidden, intermediate, layers, vocab): Llama-shaped, bf16
SIZES = {"full": (4096, 11008, 4, 16000), "small": (1024, 2816, 4, 32000)}
VARIANTS = {"stock": None, "safeload": "1"}
MB = 1e6


def write_checkpoint(folder: str, size: str, shard_bytes: int = 500 << 20) -> None:
    """A Llama checkpoint in transformers' layout (config, shards, index) with random bf16 weights,
    the shards written by safetensors 0.8; names and shapes from the model class itself."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, vocab = SIZES[size]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                      vocab_size=vocab, tie_word_embeddings=False, torch_dtype="bfloat16")
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards: List[Dict[str, Any]] = [{}]
    used = 0
    for name, shape in names.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.normal_(0, 0.02, generator=gen)
        if used and used + t.nbytes > shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += t.nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.nbytes
        shard.clear()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg.save_pretrained(folder)


def files_of(folder: str) -> List[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def warm(folder: str) -> None:
    for path in files_of(folder):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def run(model: str, patch: Any, spy: bool = False) -> List[Dict[str, Any]]:
    """One torch.distributed.run of 2 ranks; each rank's record."""
    env = {k: v for k, v in os.environ.items() if k not in ("SAFELOAD_PATCH", "SAFELOAD_BACKEND")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    if patch is not None:
        env["SAFELOAD_PATCH"] = patch
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               RANK_SCRIPT, model, out] + (["--spy"] if spy else [])
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(r.stdout[-3000:] + r.stderr[-3000:])
        got = [json.load(open(os.path.join(out, f"rank{k}.json"))) for k in range(2)]
    if patch is not None and not spy and not any(g["reads"] for g in got):
        raise RuntimeError("SAFELOAD_PATCH=1 read nothing through safeload: is the startup hook "
                           "installed (python -m safeload patch-install)?")
    return got


def page_shares(model: str) -> List[Dict[str, int]]:
    """Per rank: bytes of the pages its slices touch, and of the files' headers (one spied run)."""
    shares = []
    for got in run(model, "1", spy=True):
        pages: Dict[str, set] = {}
        known: Dict[str, Any] = {}
        for a in got["asked"]:
            path = a["path"]
            known.setdefault(path, header(path))
            pages.setdefault(path, set()).update(touched_pages(path, a["name"], a["key"], known=known[path]))
        shares.append({"pages": sum(len(p) for p in pages.values()) * 4096,
                       "headers": sum(h[0] for h in known.values())})
    return shares


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--states", default="cold,warm,shared-cold,shared-warm")
    ap.add_argument("--data-dir", default=os.path.join(ROOT, "bench-data", "tp"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "tp.json"))
    args = ap.parse_args(argv)

    base = os.path.join(args.data_dir, args.size)
    copies = [os.path.join(base, f"copy{k}") for k in range(2)]
    for c in copies:
        if not os.path.exists(os.path.join(c, "model.safetensors.index.json")):
            print(f"writing {c} ...", file=sys.stderr)
            write_checkpoint(c, args.size)
    size = sum(os.path.getsize(p) for p in files_of(copies[0]))
    own = os.path.join(base, "copy{rank}")
    for c in copies:
        warm(c)
    shares = page_shares(own)
    states = args.states.split(",")
    runs: Dict[tuple, List[Dict[str, Any]]] = {}
    rng = random.Random(0)
    for rnd in range(args.rounds):
        for state in states:
            order = list(VARIANTS)
            rng.shuffle(order)
            for variant in order:
                model = copies[0] if state.startswith("shared") else own
                for c in (copies[:1] if state.startswith("shared") else copies):
                    (evict if state.endswith("cold") else warm)(c)
                time.sleep(0.5)
                got = run(model, VARIANTS[variant])
                runs.setdefault((state, variant), []).append(got)
                slow = max(g["used_s"] for g in got)
                per_rank = " ".join(f"{g['io_read_bytes'] / MB:7.1f}" for g in got)
                print(f"round {rnd + 1} {state:11s} {variant:8s} until used {slow:6.2f} s  read/rank "
                      f"{per_rank} MB", file=sys.stderr)
    table = summarize(runs, shares, size)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"size": args.size, "bytes": size, "shares": shares, "rows": table,
                   "runs": {f"{s}/{v}": r for (s, v), r in runs.items()}}, f, indent=1)
    print(render(table, shares, size, args))
    return 0


def summarize(runs: Dict[tuple, List[Dict[str, Any]]], shares: List[Dict[str, int]], size: int) -> List[Dict[str, Any]]:
    def med(vals: List[float]) -> float:
        return statistics.median(vals)

    rows = []
    for (state, variant), got in runs.items():
        rows.append({
            "state": state, "variant": variant,
            "used_s": med([max(g["used_s"] for g in r) for r in got]),
            "load_s": med([max(g["load_s"] for g in r) for r in got]),
            "kernel_mb": [med([r[k]["io_read_bytes"] for r in got]) / MB for k in range(2)],
            "own_mb": [med([sum(x["bytes_read"] for x in r[k]["reads"]) for r in got]) / MB for k in range(2)],
            "peak_rss_mb": med([max(g["peak_rss"] for g in r) for r in got]) / MB,
        })
    return rows


def render(rows: List[Dict[str, Any]], shares: List[Dict[str, int]], size: int, args: Any) -> str:
    by = {(r["state"], r["variant"]): r for r in rows}
    need = [(s["pages"] + s["headers"]) / MB for s in shares]
    lines = [f"# Tensor-parallel from_pretrained, 2 ranks ({args.size}: {size / MB:,.0f} MB a copy; "
             f"medians of {args.rounds})", "",
             f"Pages each rank's slices touch, plus headers: {need[0]:,.1f} / {need[1]:,.1f} MB.", "",
             "| state | stock until used (s) | safeload until used (s) | ratio | from_pretrained stock / "
             "safeload (s) | ratio | kernel MB/rank stock | kernel MB/rank safeload (x pages) | safeload's own MB/rank "
             "| peak RSS MB stock / safeload |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for state in dict.fromkeys(r["state"] for r in rows):
        a, b = by.get((state, "stock")), by.get((state, "safeload"))
        if not a or not b:
            continue
        ks = " / ".join(f"{m:,.0f}" for m in a["kernel_mb"])
        kb = " / ".join(f"{m:,.0f} ({m / n:.2f}x)" for m, n in zip(b["kernel_mb"], need))
        own = " / ".join(f"{m:,.0f}" for m in b["own_mb"])
        lines.append(f"| {state} | {a['used_s']:.2f} | {b['used_s']:.2f} | {a['used_s'] / b['used_s']:.2f}x | "
                     f"{a['load_s']:.2f} / {b['load_s']:.2f} | {a['load_s'] / b['load_s']:.2f}x | {ks} | {kb} | "
                     f"{own} | {a['peak_rss_mb']:,.0f} / {b['peak_rss_mb']:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
