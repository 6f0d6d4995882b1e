"""What a save costs: safetensors 0.8's ``save_file`` against safeload's, each way in a fresh
process, rounds interleaved, medians, with peak RSS; and how close safeload comes to the disk's
own limit (plain ``os.pwrite`` of the same bytes from 1, 2 and 4 threads).

    python benches/save.py                                  # one file of 2 GiB bf16, synced, 5 rounds
    python benches/save.py --scenario all --rounds 3        # every scenario below
    python benches/save.py --scenario all --rounds 1 --gib 0.05   # a quick look

Scenarios (``--gib`` sets the size of all but ``small``):

* ``file``: 192 bf16 tensors in one file, each write synced (file and directory). 0.8's
  ``save_file`` then ``fsync``; safeload's ``save_file(fsync=True)`` with its default threads and
  with ``SAFELOAD_WRITE_THREADS`` = 1, 2, 4; the write limit: the tensors' bytes ``os.pwrite`` in
  16 MiB pieces at increasing offsets into a file ``posix_fallocate``d to size, from 1, 2 and 4
  threads, then ``fsync`` (the best of the three is the limit).
* ``small``: 20,000 small float32 tensors (55 MiB) in one file, synced: 0.8 against safeload.
* ``tmpfs``: the ``file`` state dict written under /dev/shm, not synced: 0.8 against safeload
  (run as root, the page cache is dropped before each, so no write waits on reclaiming it).
* ``checkpoint``: the ``file`` state dict as a 3-shard checkpoint, synced: 0.8 as users do it
  (``huggingface_hub.split_torch_state_dict_into_shards``, ``save_file`` per shard, ``fsync``, the
  index, then ``sha256sum model-*.safetensors > SHA256SUMS``) against safeload's
  ``save_checkpoint(manifest=True, fsync=True)``, whose ``SHA256SUMS`` must pass ``sha256sum -c``;
  beside them the write limit for the same bytes (``pwrite`` into one file, as for ``file``).
* ``save_pretrained``: unmodified transformers ``save_pretrained`` of the main job's sample
  (``bench-data/main-job-llama-main``, loaded before the clock; ``--model`` to change; 2 shards,
  ``max_shard_size="700MB"`` as it was written), synced: stock, under ``SAFELOAD_PATCH=1``, stock
  then ``sha256sum``, and patched with ``SAFELOAD_SAVE_MANIFEST=1`` (its ``SHA256SUMS`` must pass
  ``sha256sum -c``).

Each child imports torch and both libraries and builds its state dict from a fixed seed before
the clock; the clock stops when the files and their directory are synced. The output directory
(``--dir``, default ``bench-data/save`` in the repository: a real disk, not a tmpfs /tmp) is
emptied between runs. Peak RSS growth: the child's ``ru_maxrss`` after the write less that just
before it. Ratio: 0.8's median over the way's (> 1: faster than 0.8); "of limit": the write
limit's median over the way's (1.00: as fast as plain pwrite)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30
ST, SL = "0.8 save_file + fsync", "safeload save_file(fsync=True)"
PWRITE = {n: f"pwrite, {n} thread{'s' * (n > 1)}" for n in (1, 2, 4)}
#: scenario -> its ways (each one child per round) and, per way, SAFELOAD_WRITE_THREADS
WAYS: Dict[str, List[str]] = {
    "file": [ST, SL, "safeload, 1 thread", "safeload, 2 threads", "safeload, 4 threads", *PWRITE.values()],
    "small": [ST, SL],
    "tmpfs": ["0.8 save_file", "safeload save_file"],
    "checkpoint": ["0.8 per shard + sha256sum", "safeload save_checkpoint", *PWRITE.values()],
    "save_pretrained": ["stock save_pretrained", "SAFELOAD_PATCH=1", "stock + sha256sum",
                        "SAFELOAD_PATCH=1 + SAVE_MANIFEST"],
}
#: the ways that run with safeload patched in, and the one that also records the manifest
PATCHED = ("SAFELOAD_PATCH=1", "SAFELOAD_PATCH=1 + SAVE_MANIFEST")
THREADS = {"safeload, 1 thread": "1", "safeload, 2 threads": "2", "safeload, 4 threads": "4"}
LIMIT = "write limit (best pwrite)"

CHILD = r"""
import json, os, resource, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch, safetensors.torch, safeload.torch
from huggingface_hub import split_torch_state_dict_into_shards
scenario, way, out, gib = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
gen = torch.Generator().manual_seed(0)
if scenario == "save_pretrained":
    import transformers
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[5], dtype=torch.bfloat16)
    sd = model.state_dict()
    if way.startswith("SAFELOAD_PATCH=1"):
        safeload.patch()  # what the startup hook does under SAFELOAD_PATCH=1
elif scenario == "small":
    shapes = ((64,), (256,), (8, 64), (32, 64))
    sd = {f"t.{i}": torch.randn(shapes[i % 4], generator=gen) for i in range(20000)}
else:  # 192 equal bf16 tensors (rows x 1024) totalling about gib
    rows = max(1, round(gib * (1 << 30) / 2 / 192 / 1024))
    # random bits (some NaN patterns among them: a writer copies bytes), 10x faster to make than normal_
    sd = {f"layers.{i // 8}.w{i % 8}": torch.empty(rows * 2048, dtype=torch.uint8).random_(generator=gen)
          .view(torch.bfloat16).view(rows, 1024) for i in range(192)}
total = sum(t.nbytes for t in sd.values())
# Equal tensors, 192 of them: 64 + 1/2 tensors a shard makes exactly 3 shards.
per = next(iter(sd.values())).nbytes
max_shard = 64 * per + per // 2
path = os.path.join(out, "model.safetensors")

def sync(*paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

if way.startswith("pwrite"):  # the pieces (views of the tensors' memory) are ready before the clock
    threads, pieces, off = int(way.split()[1]), [], 0
    for t in sd.values():
        b = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        pieces += [(off + s, b[s:s + (16 << 20)]) for s in range(0, len(b), 16 << 20)]
        off += len(b)

    def put(piece):
        at, b = piece
        while len(b):  # pwrite may write less than asked
            n = os.pwrite(fd, b, at)
            at, b = at + n, b[n:]

base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if way == "0.8 save_file + fsync":
    safetensors.torch.save_file(sd, path)
    sync(path, out)
elif way.startswith("safeload save_file(fsync=True)") or way.startswith("safeload, "):
    safeload.torch.save_file(sd, path, fsync=True)
elif way == "0.8 save_file":  # tmpfs: nothing synced
    safetensors.torch.save_file(sd, path)
elif way == "safeload save_file":
    safeload.torch.save_file(sd, path)
elif way.startswith("pwrite"):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.posix_fallocate(fd, 0, total)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(put, pieces))  # taken in order: increasing offsets
    os.fsync(fd)
    os.close(fd)
    sync(out)
elif way == "0.8 per shard + sha256sum":
    split = split_torch_state_dict_into_shards(sd, max_shard_size=max_shard)
    for name, keys in split.filename_to_tensors.items():
        p = os.path.join(out, name)
        safetensors.torch.save_file({k: sd[k] for k in keys}, p, metadata={"format": "pt"})
        sync(p)
    index = os.path.join(out, "model.safetensors.index.json")
    with open(index, "w") as f:  # what save_pretrained writes beside the shards (safeload writes it too)
        json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
    subprocess.run("sha256sum model-*.safetensors > SHA256SUMS", shell=True, cwd=out, check=True)
    sync(index, os.path.join(out, "SHA256SUMS"), out)
elif scenario == "save_pretrained":
    model.save_pretrained(out, max_shard_size="700MB")
    if way == "stock + sha256sum":
        subprocess.run("sha256sum *.safetensors > SHA256SUMS", shell=True, cwd=out, check=True)
    sync(*(os.path.join(out, n) for n in os.listdir(out)), out)
elif way == "safeload save_checkpoint":
    safeload.torch.save_checkpoint(sd, out, max_shard_size=max_shard, metadata={"format": "pt"},
                                   manifest=True, fsync=True)
else:
    raise SystemExit(f"unknown way {way!r}")
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
assert scenario != "checkpoint" or way.startswith("pwrite") or len(shards) == 3, shards
print(json.dumps({"s": seconds, "rss_growth_kib": peak - base, "bytes": total, "files": shards}))
"""


def _fs_type(path: str) -> str:
    """The filesystem type of the mount ``path`` lies on (the longest mount point above it)."""
    path, best = os.path.realpath(path), ("", "?")
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, kind = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, kind)
    return best[1]


def _empty(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)


def _free_memory() -> None:
    """Drops the page cache (root only; else nothing), so that a tmpfs write does not wait on
    reclaiming it: without this, tmpfs rounds here took 0.8 s or 1.7-3 s by the memory's state."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass


def _child(scenario: str, way: str, out: str, gib: float, model: str) -> Dict:
    """One way, once, in a fresh process (the output folder emptied first, off the clock)."""
    _empty(out)
    if scenario == "tmpfs":
        _free_memory()
    env = {k: v for k, v in os.environ.items() if k not in ("SAFELOAD_WRITE_THREADS", "SAFELOAD_PATCH",
                                                             "SAFELOAD_SAVE_MANIFEST")}
    if way in THREADS:
        env["SAFELOAD_WRITE_THREADS"] = THREADS[way]
    if way == PATCHED[1]:
        env["SAFELOAD_SAVE_MANIFEST"] = "1"
    r = subprocess.run([sys.executable, "-c", CHILD, scenario, way, out, str(gib), model], capture_output=True,
                       text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{scenario} / {way} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if way in ("safeload save_checkpoint", PATCHED[1]):  # its manifest must check, off the clock
        c = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
        if c.returncode != 0 or c.stdout.count(": OK") != len(got["files"]):
            raise RuntimeError(f"sha256sum -c SHA256SUMS failed in {out}:\n{c.stdout}{c.stderr}")
    return got


def run(scenario: str, rounds: int, gib: float, folder: str, model: str) -> Dict:
    """Every way of ``scenario``, ``rounds`` times, interleaved (each first in turn); the raw runs."""
    ways = WAYS[scenario]
    if scenario == "tmpfs":
        folder = os.path.join("/dev/shm", f"safeload-bench-save-{os.getpid()}")
        free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
        if free < gib * GIB * 1.1:
            raise SystemExit(f"/dev/shm has {free / GIB:.2f} GiB free, the tmpfs scenario needs {gib * 1.1:.2f}")
    elif _fs_type(folder) == "tmpfs":
        raise SystemExit(f"{folder} is on a tmpfs: synced writes would not reach a disk; pass --dir")
    out = os.path.join(folder, scenario)
    runs: Dict[str, List[Dict]] = {w: [] for w in ways}
    try:
        for r in range(rounds):
            k = r % len(ways)
            for way in ways[k:] + ways[:k]:
                got = _child(scenario, way, out, gib, model)
                runs[way].append(got)
                print(f"{scenario} round {r + 1}/{rounds}  {way:32s} {got['s']:8.3f} s  "
                      f"+{got['rss_growth_kib'] / 1024:7.1f} MiB RSS", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if scenario == "tmpfs":
            shutil.rmtree(folder, ignore_errors=True)
    return runs


def summarize(scenario: str, runs: Dict[str, List[Dict]]) -> List[Dict]:
    """One row per way (medians), plus the write limit for ``file`` and ``checkpoint``; ratios
    against 0.8 and the limit."""
    rows = []
    for way, got in runs.items():
        rows.append({"way": way, "s": statistics.median(g["s"] for g in got), "bytes": got[0]["bytes"],
                     "rss_mib": statistics.median(g["rss_growth_kib"] for g in got) / 1024})
    limit: Optional[Dict] = None
    if scenario in ("file", "checkpoint"):
        limit = dict(min((r for r in rows if r["way"] in PWRITE.values()), key=lambda r: r["s"]), way=LIMIT)
        rows.append(limit)
    st = rows[0]["s"]  # the first way is always 0.8's
    for r in rows:
        r["gib_s"] = r["bytes"] / GIB / r["s"]
        r["ratio"] = st / r["s"]
        r["of_limit"] = limit["s"] / r["s"] if limit else None
    return rows


def render(scenario: str, rows: List[Dict], rounds: int) -> str:
    size = rows[0]["bytes"] / GIB
    lines = [f"### {scenario}: {size:.3f} GiB of tensor bytes, medians of {rounds}", "",
             "| way | median s | GiB/s | ratio (vs 0.8) | of limit | peak RSS growth MiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        of = f"{r['of_limit']:.2f}" if r["of_limit"] is not None else "-"
        lines.append(f"| {r['way']} | {r['s']:.3f} | {r['gib_s']:.2f} | {r['ratio']:.2f}x | {of} | "
                     f"{r['rss_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=[*WAYS, "all"], default="file")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gib", type=float, default=2.0, help="size of the file, tmpfs and checkpoint state dicts")
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench-data", "save"),
                    help="where synced writes go (a disk, not a tmpfs)")
    ap.add_argument("--model", default=os.path.join(ROOT, "bench-data", "main-job-llama-main"),
                    help="save_pretrained: the model to load and save (written by benches/main_job.py)")
    ap.add_argument("--json", metavar="OUT", help="also write the rows and every run here")
    args = ap.parse_args(argv)

    scenarios = list(WAYS) if args.scenario == "all" else [args.scenario]
    if args.scenario == "all" and not os.path.isdir(args.model):
        print(f"save_pretrained left out: no model at {args.model} (benches/main_job.py writes it)", file=sys.stderr)
        scenarios.remove("save_pretrained")
    os.makedirs(args.dir, exist_ok=True)
    report: Dict[str, Tuple] = {}
    for scenario in scenarios:
        if scenario == "save_pretrained" and not os.path.isdir(args.model):
            raise SystemExit(f"{args.model}: no model to save; run benches/main_job.py once (it writes it)")
        runs = run(scenario, args.rounds, args.gib, args.dir, args.model)
        report[scenario] = (summarize(scenario, runs), runs)
    for scenario, (rows, _) in report.items():
        print(render(scenario, rows, args.rounds) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "rounds": args.rounds, "cores": os.cpu_count(),
                       "scenarios": {s: {"rows": rows, "runs": runs} for s, (rows, runs) in report.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
