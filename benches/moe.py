"""Mixture-of-experts loads as users run them: unmodified transformers ``from_pretrained(dir)`` on a
Qwen3-MoE-shaped checkpoint (one tensor per expert and projection on disk, fused on load into
``experts.gate_up_proj`` / ``experts.down_proj``), stock (safetensors 0.8) against
``SAFELOAD_PATCH=1`` with nothing else set, side by side in one run.

    python benches/moe.py                              # 1.78 GB (64 experts), one process and EP, 3 rounds
    python benches/moe.py --modes one --states warm    # one process, warm only
    python benches/moe.py --size small --rounds 1      # 0.14 GB, a quick look (--size tiny: 4 MB, for tests)
    python benches/moe.py --size large --json bench-out/moe.json   # 128 experts (3.4 GB), every figure kept

The checkpoint (bf16, random weights, 3 shards) is written once by transformers' own
``save_pretrained`` under ``--data`` (default ``bench-data/moe-<size>``), in ``copy0``, and copied
to ``copy1`` when expert parallelism runs. Modes: ``one``, a plain ``from_pretrained(dir)`` in one
process; ``ep``, ``from_pretrained(dir, distributed_config=DistributedConfig(ep_size=2,
tp_plan={}))`` on 2 gloo ranks (``python -m torch.distributed.run``, CPU), rank r on its own copy
(as ranks on separate nodes: no page cache shared); a run counts as its slowest rank. States:
``cold`` (every file synced and evicted with ``POSIX_FADV_DONTNEED`` before the run; the host may
still cache it) and ``warm`` (read into the page cache first).

Every measurement is a fresh process that imports torch and transformers (and applies the patch,
by the call the ``SAFELOAD_PATCH`` startup hook makes) before its clock, and, as ``benches/e2e.py``
does, reads the config and imports the model's module (~1.4 s of imports that ``from_pretrained``
would otherwise make inside the clock, the same for both variants); it times
``from_pretrained`` and, until every parameter was used, one byte of each of its pages read (0.8
hands out views of its map, read when touched), and reports peak RSS (``VmHWM``, which a fork does
not carry over, and ``ru_maxrss``), its RSS when the clock started (torch and transformers loaded)
and the kernel's ``read_bytes`` (``/proc/self/io``). Rounds interleave the variants in a shuffled
order; the table gives medians, stock / safeload ratios (> 1: safeload faster), peak RSS / model
bytes (the bar is judged on it; in brackets, the peak less the RSS at the start, over the model
bytes) and, for EP, each rank's ``read_bytes`` / its share (the dense tensors' bytes plus those of
the experts it owns, e // (E / 2) == rank), each row next to the issue's bars. Once per run, one
child per variant hashes every parameter of the loaded model (SHA-256 of its bytes) and the two
must agree; the exit status is 1 if they differ or a mode could not run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench  # noqa: E402 - page touch, RSS, worker runner
import e2e  # noqa: E402 - the workers' environment
import tp  # noqa: E402 - files_of, evict, warm; tests/support on sys.path
from tp_rank import _io_read_bytes, header  # noqa: E402

#: size -> Qwen3MoeConfig dimensions (bf16); full is 1.78 GB, 1,611 tensors
_FULL = dict(hidden_size=1024, num_hidden_layers=8, num_experts=64, moe_intermediate_size=512, num_experts_per_tok=8,
             vocab_size=32000, num_attention_heads=16, num_key_value_heads=2, head_dim=64)
SIZES: Dict[str, Dict[str, int]] = {
    "tiny": dict(_FULL, hidden_size=128, num_hidden_layers=2, num_experts=8, moe_intermediate_size=128,
                 num_experts_per_tok=2, vocab_size=4000, num_attention_heads=4, head_dim=32),
    "small": dict(_FULL, hidden_size=512, num_hidden_layers=4, num_experts=32, moe_intermediate_size=256,
                  num_experts_per_tok=4, vocab_size=16000, num_attention_heads=8),
    "full": _FULL,
    "large": dict(_FULL, num_experts=128),
}
VARIANTS: Dict[str, Optional[str]] = {"stock": None, "safeload": "1"}
RANKS = 2
#: the issue's bars: (mode, state) -> (least stock / safeload speed-up, most RSS / model, most read / share)
BARS = {("one", "cold"): (1.6, 1.5, None), ("one", "warm"): (1.6, 1.5, None),
        ("ep", "cold"): (1.3, None, 1.10), ("ep", "warm"): (1.0, None, 1.10)}
MB = 1e6
#: figures a run counts at its slowest / largest rank
PER_RUN = ("used_s", "load_s", "vmhwm", "maxrss", "rss_start")
EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


# -- the checkpoint ---------------------------------------------------------------------------------


def write_checkpoint(folder: str, size: str) -> Dict[str, Any]:
    """The model built on the meta device, given storage and ``torch.randn`` bf16 weights tensor by
    tensor (no init pass), saved by its own ``save_pretrained`` in 3 shards."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(tie_word_embeddings=False, dtype="bfloat16", **SIZES[size])
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    total = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.bfloat16) * 0.02)
            total += p.nbytes
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=int(total * 0.4))  # 2 shards of 40% and the rest
    os.rename(tmp, folder)
    return {"bytes": total, "files": len(tp.files_of(folder))}


def checkpoint(data: str, size: str, copies: int) -> List[str]:
    """``copies`` folders holding the checkpoint, written (in a child, so that this process stays
    small) or copied when missing."""
    folders = [os.path.join(data, f"copy{k}") for k in range(copies)]
    for k, folder in enumerate(folders):
        if os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
            continue
        os.makedirs(data, exist_ok=True)
        print(f"writing {folder} ...", file=sys.stderr, flush=True)
        if k == 0:
            got = bench.run_worker({"write": folder, "size": size}, script=__file__, env=e2e._env(None))
            if "error" in got:
                raise SystemExit(f"writing the checkpoint failed: {got['error']}")
        else:
            shutil.rmtree(folder + ".tmp", ignore_errors=True)
            shutil.copytree(folders[0], folder + ".tmp")
            os.rename(folder + ".tmp", folder)
    return folders


def shares(folder: str) -> Dict[str, Any]:
    """The model's bytes, and per EP rank the bytes of the dense tensors plus its own experts'."""
    sizes: Dict[str, int] = {}
    for path in tp.files_of(folder):
        sizes.update((k, e["data_offsets"][1] - e["data_offsets"][0]) for k, e in header(path)[1].items())
    owner = {k: int(m.group(1)) for k in sizes for m in [EXPERT.search(k)] if m}
    experts = max(owner.values()) + 1
    dense = sum(n for k, n in sizes.items() if k not in owner)
    own = [sum(n for k, n in sizes.items() if owner.get(k, -1) // (experts // RANKS) == r) for r in range(RANKS)]
    return {"model": sum(sizes.values()), "dense": dense, "ranks": [dense + b for b in own], "tensors": len(sizes),
            "experts": experts}


# -- the child --------------------------------------------------------------------------------------


def _local(t: Any) -> Any:
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def digest(state: Dict[str, Any]) -> Dict[str, str]:
    """Parameter name -> "dtype shape sha256" of its bytes."""
    import torch

    out = {}
    for name, value in state.items():
        t = _local(value).contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        out[name] = f"{t.dtype} {tuple(t.shape)} {hashlib.sha256(raw).hexdigest()}"
    return out


def load(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One timed ``from_pretrained`` (a rank's, under torch.distributed.run, for ``ep``)."""
    if os.environ.get("SAFELOAD_PATCH"):
        import importlib

        importlib.import_module("safeload.patch")._autopatch()  # what the startup hook runs
    import safetensors
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    kwargs: Dict[str, Any] = {}
    rank = int(os.environ.get("RANK", "0"))
    if spec["mode"] == "ep":
        kwargs["distributed_config"] = transformers.DistributedConfig(ep_size=RANKS, tp_plan={})
    folder = spec["dir"].replace("{rank}", str(rank))
    # Before the clock, as benches/e2e.py's prepare: the config, and the model's module imported
    # (~1.4 s of imports inside from_pretrained, the same for both variants: no loader's work).
    config = transformers.AutoConfig.from_pretrained(folder)
    AutoModelForCausalLM._model_mapping[type(config)]  # noqa: B018 - imports the model class
    rss0 = bench._rss_kib() * 1024
    io0 = _io_read_bytes()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    t_load = time.perf_counter() - t0
    state = model.state_dict()
    for value in state.values():
        bench.touch(_local(value))
    t_used = time.perf_counter() - t0
    io = _io_read_bytes() - io0
    out = {"rank": rank, "load_s": t_load, "used_s": t_used, "io_read_bytes": io, "rss_start": rss0,
           "vmhwm": bench._vmhwm_kib() * 1024, "maxrss": bench._maxrss_kib() * 1024,
           "patched": safetensors.safe_open.__module__.startswith("safeload"),
           "params": len(state), "param_bytes": sum(_local(v).nbytes for v in state.values()),
           "dtypes": sorted({str(v.dtype) for v in state.values()})}
    if spec.get("digest"):
        out["digest"] = digest(state)
    if spec["mode"] == "ep":
        _report(spec, out)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return out


def _report(spec: Dict[str, Any], result: Dict[str, Any]) -> None:
    """A rank's record, in ``OUT/rank{R}.json`` (the launcher's output mixes the ranks')."""
    with open(os.path.join(spec["out"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(result, f)


def worker(arg: str) -> int:
    spec = json.loads(arg)
    try:
        result = write_checkpoint(spec["write"], spec["size"]) if "write" in spec else load(spec)
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback

        result = {"error": f"rank {os.environ.get('RANK', '0')}: {traceback.format_exc()}"}
        sys.stderr.write(result["error"])
        if spec.get("mode") == "ep":
            _report(spec, result)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(1 if "error" in result else 0)  # skip freeing gigabytes of tensors on the way out


# -- the parent -------------------------------------------------------------------------------------


def measure(spec: Dict[str, Any], patch: Optional[str]) -> List[Dict[str, Any]]:
    """One fresh load (one process, or one torch.distributed.run of 2 ranks); each rank's record."""
    env = e2e._env(patch)
    if spec["mode"] == "one":
        got = [bench.run_worker(spec, script=__file__, env=env)]
    else:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
                   os.path.abspath(__file__), "--worker", json.dumps(dict(spec, out=out))]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            got = [json.load(open(p)) for k in range(RANKS) for p in [os.path.join(out, f"rank{k}.json")]
                   if os.path.exists(p)]
            if r.returncode and not any("error" in g for g in got) or len(got) < RANKS:
                tail = (r.stdout[-3000:] + r.stderr[-6000:]).strip()
                got.append({"error": f"torch.distributed.run exited {r.returncode}:\n{tail}"})
    for g in got:
        if "error" in g:
            raise RuntimeError(g["error"])
        if g["patched"] != (patch is not None):
            raise RuntimeError(f"SAFELOAD_PATCH={patch}: safetensors.safe_open is "
                               f"{'' if g['patched'] else 'not '}safeload's")
    return got


def check_digests(folder: str) -> Dict[str, Any]:
    """One warm single-process load per variant, every parameter hashed; the variants must agree."""
    tp.warm(folder)
    got = {v: measure({"mode": "one", "dir": folder, "digest": True}, patch)[0]["digest"]
           for v, patch in VARIANTS.items()}
    a, b = got["stock"], got["safeload"]
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return {"params": len(a), "equal": not differ, "differ": differ}


def prepare(state: str, folders: List[str]) -> None:
    for folder in folders:
        (tp.evict if state == "cold" else tp.warm)(folder)
    time.sleep(0.5)


def summarize(runs: List[Dict[str, Any]], share: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Medians per (mode, state, variant); a run's time and peak RSS are its slowest / largest rank's."""
    med = statistics.median
    rows = []
    order = {k: n for n, k in enumerate(("one", "ep", "cold", "warm", *VARIANTS))}
    for key in sorted({(r["mode"], r["state"], r["variant"]) for r in runs}, key=lambda k: [order[x] for x in k]):
        got = [r["ranks"] for r in runs if (r["mode"], r["state"], r["variant"]) == key]
        need = share["ranks"] if key[0] == "ep" else [share["model"]]
        read = [med([g[k]["io_read_bytes"] for g in got]) for k in range(len(need))]
        rows.append({"mode": key[0], "state": key[1], "variant": key[2], "runs": len(got),
                     **{f: med([max(x[f] for x in g) for g in got]) for f in PER_RUN},
                     "read_bytes": read, "read_per_share": [b / n for b, n in zip(read, need)]})
    by = {(r["mode"], r["state"], r["variant"]): r for r in rows}
    for r in rows:
        stock = by.get((r["mode"], r["state"], "stock"))
        r["speedup"] = stock["used_s"] / r["used_s"] if stock and r["variant"] != "stock" else None
        r["rss_per_model"] = r["vmhwm"] / share["model"]
        r["added_per_model"] = (r["vmhwm"] - r["rss_start"]) / share["model"]
    return rows


def _bar(row: Dict[str, Any]) -> str:
    speed, rss, read = BARS[(row["mode"], row["state"])]
    said = []
    if row["speedup"] is not None:
        said.append(f"speed >= {speed}x: {'met' if row['speedup'] >= speed else 'MISSED'}")
    if rss is not None:
        said.append(f"RSS <= {rss}x model: {'met' if row['rss_per_model'] <= rss else 'MISSED'}")
    if read is not None:
        said.append(f"read <= {read:.2f}x share: {'met' if max(row['read_per_share']) <= read else 'MISSED'}")
    return "; ".join(said)


def render(rows: List[Dict[str, Any]], share: Dict[str, Any], args: Any) -> str:
    lines = [f"# MoE from_pretrained ({args.size}: {share['model'] / MB:,.0f} MB, {share['tensors']:,} tensors, "
             f"{share['experts']} experts; medians of {args.rounds})", "",
             "EP shares (dense + own experts) per rank: "
             + " / ".join(f"{b / MB:,.1f}" for b in share["ranks"]) + " MB; one process: the whole model.", "",
             "| mode | state | variant | until used (s) | from_pretrained (s) | stock / safeload | peak RSS MB (VmHWM) "
             "| RSS / model (above start) | kernel read MB (per rank) | read / share (per rank) | bars |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"**{r['speedup']:.2f}x**" if r["speedup"] is not None else "-"
        reads = " / ".join(f"{b / MB:,.0f}" for b in r["read_bytes"])
        per = " / ".join(f"{x:.2f}x" for x in r["read_per_share"])
        rss = f"{r['rss_per_model']:.2f}x ({r['added_per_model']:.2f}x)"
        lines.append(f"| {r['mode']} | {r['state']} | {r['variant']} | {r['used_s']:.2f} | {r['load_s']:.2f} | {ratio} "
                     f"| {r['vmhwm'] / MB:,.0f} | {rss} | {reads} | {per} | {_bar(r)} |")
    return "\n".join(lines)


def _figures(got: List[Dict[str, Any]]) -> str:
    slowest = {f: max(g[f] for g in got) for f in PER_RUN}
    return (f"until used {slowest['used_s']:6.2f} s (from_pretrained {slowest['load_s']:6.2f})  peak RSS "
            f"{slowest['vmhwm'] / MB:7,.0f} MB  read/rank " + " ".join(f"{g['io_read_bytes'] / MB:7,.1f}" for g in got)
            + " MB")


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="full")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="one,ep", help="comma-separated: one, ep")
    ap.add_argument("--states", default="cold,warm", help="comma-separated: cold, warm")
    ap.add_argument("--data", default=None, help="the checkpoint's folder (default bench-data/moe-<size>)")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    modes, states = args.modes.split(","), args.states.split(",")
    if set(modes) - {"one", "ep"} or set(states) - {"cold", "warm"}:
        ap.error("--modes takes one,ep and --states cold,warm")

    folders = checkpoint(args.data or os.path.join(ROOT, "bench-data", f"moe-{args.size}"), args.size,
                         RANKS if "ep" in modes else 1)
    share = shares(folders[0])
    correct = check_digests(folders[0])
    print(f"correctness: {correct['params']} parameters hashed, stock and safeload "
          + ("agree" if correct["equal"] else f"DIFFER in {len(correct['differ'])}: {correct['differ'][:5]}"),
          flush=True)
    runs: List[Dict[str, Any]] = []
    errors: List[Dict[str, Any]] = []
    rng = random.Random(0)
    for rnd in range(args.rounds):
        for mode in modes:
            for state in states:
                order = list(VARIANTS)
                rng.shuffle(order)
                for variant in order:
                    spec = {"mode": mode, "dir": os.path.join(os.path.dirname(folders[0]), "copy{rank}")}
                    prepare(state, folders if mode == "ep" else folders[:1])
                    try:
                        got = measure(spec, VARIANTS[variant])
                    except RuntimeError as e:
                        got = [{"error": str(e)}]
                    run = {"round": rnd + 1, "mode": mode, "state": state, "variant": variant, "ranks": got}
                    (errors if "error" in got[0] else runs).append(run)
                    said = f"FAILED:\n{got[0]['error']}" if "error" in got[0] else _figures(got)
                    print(f"round {rnd + 1} {mode:3s} {state:4s} {variant:8s} {said}", flush=True)
    rows = summarize(runs, share)
    print()
    print(render(rows, share, args))
    if errors:
        print(f"\n{len(errors)} runs failed (kept under 'errors' in --json; each error above): "
              + ", ".join(f"round {e['round']} {e['mode']} {e['state']} {e['variant']}" for e in errors))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "config": SIZES[args.size], "share": share, "correctness": correct,
                       "rows": rows, "runs": runs, "errors": errors}, f, indent=1)
    return 0 if correct["equal"] and not errors else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2]))
    sys.exit(main())
