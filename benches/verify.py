"""What ``verify=`` costs: a load with and without it, with the verified record of an unchanged
file (``verify_cache=``), a ``get_tensor`` loop over ``safe_open`` (what ``from_pretrained`` runs)
with and without it, and the way users check today (hashlib over each file, then the load), side
by side in fresh processes, interleaved, warm and cold, medians, with peak RSS; and hashlib over
the largest file alone (the least a hash costs on one core).

    python benches/verify.py CHECKPOINT... [--rounds 3] [--json OUT]   # OUT: every child, round by round

Each CHECKPOINT is a .safetensors file or a folder of shards (`bench.py`'s samples:
bench-data/full/sharded, bench-data/full/llama/model.safetensors). Cold rounds drop the files'
pages with POSIX_FADV_DONTNEED (the host may still cache them: cold figures vary)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

HOWS = ("load", "verify=", "verify= + record", "get_tensor loop", "get_tensor loop, verify=",
        "hashlib, then load", "hashlib, largest file")

CHILD = r"""
import hashlib, json, os, resource, sys, time
import torch, safeload.torch
how, target, cold, pins, record = sys.argv[1], sys.argv[2], sys.argv[3] == "1", json.loads(sys.argv[4]), sys.argv[5]
files = [os.path.join(target, n) for n in pins] if os.path.isdir(target) else [target]
for f in files:
    fd = os.open(f, os.O_RDONLY)
    if cold:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    else:
        while os.read(fd, 64 << 20):
            pass
    os.close(fd)
t = time.perf_counter()
def loop(verify):
    out = {}
    for f in files:
        with safeload.safe_open(f, "pt", backend="pread", verify=verify and {os.path.basename(f): pins[os.path.basename(f)]}) as h:
            out.update((k, h.get_tensor(k)) for k in h.keys())
    return out
if how == "load":
    sd = safeload.torch.load_checkpoint(target, backend="pread")
elif how == "verify=":
    sd = safeload.torch.load_checkpoint(target, backend="pread", verify=pins)
elif how == "verify= + record":
    sd, stats = safeload.torch.load_checkpoint(target, backend="pread", verify=pins, verify_cache=record, return_stats=True)
    assert stats.recorded_files == len(files), stats
elif how == "get_tensor loop":
    sd = loop(False)
elif how == "get_tensor loop, verify=":
    sd = loop(True)
elif how == "hashlib, largest file":
    f = max(files, key=os.path.getsize)
    with open(f, "rb") as fh:
        assert hashlib.file_digest(fh, "sha256").hexdigest() == pins[os.path.basename(f)]
    sd = {}
else:
    for f in files:
        with open(f, "rb") as fh:
            assert hashlib.file_digest(fh, "sha256").hexdigest() == pins[os.path.basename(f)]
    sd = safeload.torch.load_checkpoint(target, backend="pread")
seconds = time.perf_counter() - t
print(json.dumps({"s": seconds, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "n": len(sd)}))
"""


def _files(target: str) -> List[str]:
    if os.path.isdir(target):
        return sorted(os.path.join(target, n) for n in os.listdir(target) if n.endswith(".safetensors"))
    return [target]


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def run(targets: List[str], rounds: int, record: str, runs: Optional[List[Dict]] = None) -> List[str]:
    """The table's lines: one row per checkpoint and cache state. Each child's figures are also
    appended to ``runs`` when given (a median hides a slow round; ``--json`` keeps them)."""
    res: Dict[Tuple[str, bool, str], List[Tuple[float, int]]] = {}
    for target in targets:
        pins = json.dumps({os.path.basename(f): _sha(f) for f in _files(target)})
        # The record learns the files once, before the clock (what an earlier load leaves).
        subprocess.run([sys.executable, "-c", "import json, sys, safeload.torch; "
                        "safeload.torch.load_checkpoint(sys.argv[1], verify=json.loads(sys.argv[2]), "
                        "verify_cache=sys.argv[3])", target, pins, record], check=True)
        for r in range(rounds):
            for cold in (False, True):
                k = r % len(HOWS)
                for how in HOWS[k:] + HOWS[:k]:  # each first in turn
                    out = subprocess.run([sys.executable, "-c", CHILD, how, target, "1" if cold else "0", pins,
                                          record], capture_output=True, text=True, check=True)
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    res.setdefault((target, cold, how), []).append((got["s"], got["rss"]))
                    if runs is not None:
                        runs.append({"checkpoint": target, "state": "cold" if cold else "warm", "how": how,
                                     "round": r, "s": got["s"], "peak_rss_kib": got["rss"]})
    lines = ["| checkpoint | state | load s | `verify=` s | ratio | / max(load, hashlib largest) "
             "| + record s | ratio | loop s | loop `verify=` s | ratio | hashlib, then load s | that / `verify=` "
             "| peak RSS load / `verify=` / loop / loop `verify=` MiB |", "|---" * 14 + "|"]
    for target in targets:
        for cold in (False, True):
            m = {h: statistics.median(x[0] for x in res[(target, cold, h)]) for h in HOWS}
            rss = {h: statistics.median(x[1] for x in res[(target, cold, h)]) / 1024 for h in HOWS}
            floor = max(m["load"], m["hashlib, largest file"])
            v, rec, lo, lv, hl = (m["verify="], m["verify= + record"], m["get_tensor loop"],
                                  m["get_tensor loop, verify="], m["hashlib, then load"])
            lines.append(f"| {target} | {'cold' if cold else 'warm'} | {m['load']:.3f} | {v:.3f} | "
                         f"{v / m['load']:.2f} | {v / floor:.2f} | {rec:.3f} | {rec / m['load']:.2f} | {lo:.3f} | "
                         f"{lv:.3f} | {lv / lo:.2f} | {hl:.3f} | {hl / v:.2f} | {rss['load']:.0f} / "
                         f"{rss['verify=']:.0f} / {rss['get_tensor loop']:.0f} / {rss['get_tensor loop, verify=']:.0f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="OUT", help="also write every child's figures here, round by round")
    args = p.parse_args()
    runs: List[Dict] = []
    with tempfile.TemporaryDirectory() as record:
        print("\n".join(run(args.checkpoints, args.rounds, record, runs)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "cores": os.cpu_count(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
