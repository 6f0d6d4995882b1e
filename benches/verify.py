"""What ``verify=`` costs on the calls users make, with their default arguments: ``load_file``,
``load_checkpoint`` and a ``safe_open`` + ``get_tensor`` loop (what ``from_pretrained`` runs),
each with and without ``verify=`` (and ``load_checkpoint`` with the verified record of an
unchanged file, ``verify_cache=``), beside the ways users check today and the machine's limits:
one thread reading each file and hashing it (8 MiB reads, hashlib: the cold limit), hashlib over
each file then safetensors 0.8's ``load_file`` (the old way), and hashlib over the warm files
(one core's SHA-256). Fresh processes, interleaved, each first in turn, warm and cold, medians,
peak RSS, every round kept (``--json``). Each load is timed until every tensor is used (one byte
of every page read, ``bench.touch``): a lazy map's reads are paid inside its own clock, not left
to run on into the next child's.

    python benches/verify.py CHECKPOINT... [--rounds 3] [--json OUT]
    python benches/verify.py --from-pretrained MODEL_DIR [--rounds 3]

Each CHECKPOINT is a .safetensors file or a folder of shards (`bench.py`'s samples:
bench-data/full/llama/model.safetensors, bench-data/full/sharded). ``--from-pretrained`` times an
unmodified transformers ``from_pretrained`` of a model folder (``e2e.py``'s sample): stock, stock
after hashlib over its files, and ``SAFELOAD_PATCH=1 SAFELOAD_VERIFY=1`` against a ``SHA256SUMS``
beside hard links to the files (so both read the same pages). Cold rounds drop the files' pages
with POSIX_FADV_DONTNEED (the host may still cache them: cold figures vary).

Bars (issue 69): cold, each verified call >= 0.9x the one-thread read and hash and >= 1.3x
hashlib-then-0.8; warm >= 0.87x min(the same call unverified, one core's SHA-256), in rates; a
verified ``from_pretrained`` >= 1.3x stock + hashlib."""

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

#: (how, the same call unverified or None): every call the table reports.
HOWS: Tuple[Tuple[str, Optional[str]], ...] = (
    ("load_file", None),
    ("load_file, verify=", "load_file"),
    ("load_checkpoint", None),
    ("load_checkpoint, verify=", "load_checkpoint"),
    ("load_checkpoint, verify= + record", "load_checkpoint"),
    ("get_tensor loop", None),
    ("get_tensor loop, verify=", "get_tensor loop"),
    ("read then hash, one thread", None),
    ("hashlib, then 0.8 load_file", None),
    ("hashlib", None),
)
VERIFIED = [h for h, plain in HOWS if plain]

PRELUDE = r"""
import hashlib, json, os, resource, sys, time
sys.path.insert(0, os.environ["VERIFY_BENCHES"])
from bench import touch  # one byte of every page: a lazy map's faults are paid, as a user's first use would
def settle(files, cold):
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while os.read(fd, 64 << 20):
                pass
        os.close(fd)
def sha(f):
    with open(f, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
def report(t, n):
    print(json.dumps({"s": time.perf_counter() - t, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "n": n}))
"""

CHILD = PRELUDE + r"""
import torch, safeload, safeload.torch, safetensors.torch
how, target, cold, pins, record = sys.argv[1], sys.argv[2], sys.argv[3] == "1", json.loads(sys.argv[4]), sys.argv[5]
files = [os.path.join(target, n) for n in sorted(pins)] if os.path.isdir(target) else [target]
pin = lambda f: {os.path.basename(f): pins[os.path.basename(f)]}
settle(files, cold)
t = time.perf_counter()
sd = {}
if how == "load_file":
    for f in files:
        sd.update(safeload.torch.load_file(f))
elif how == "load_file, verify=":
    for f in files:
        sd.update(safeload.torch.load_file(f, verify=pin(f)))
elif how == "load_checkpoint":
    sd = safeload.torch.load_checkpoint(target)
elif how == "load_checkpoint, verify=":
    sd = safeload.torch.load_checkpoint(target, verify=pins)
elif how == "load_checkpoint, verify= + record":
    sd, stats = safeload.torch.load_checkpoint(target, verify=pins, verify_cache=record, return_stats=True)
    assert stats.recorded_files == len(files), stats
elif how in ("get_tensor loop", "get_tensor loop, verify="):
    for f in files:
        with safeload.safe_open(f, "pt", verify=pin(f) if how.endswith("verify=") else None) as h:
            sd.update((k, h.get_tensor(k)) for k in h.keys())
elif how == "read then hash, one thread":
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
        assert h.hexdigest() == pins[os.path.basename(f)]
elif how == "hashlib, then 0.8 load_file":
    for f in files:
        assert sha(f) == pins[os.path.basename(f)]
    for f in files:
        sd.update(safetensors.torch.load_file(f))
elif how == "hashlib":
    for f in files:
        assert sha(f) == pins[os.path.basename(f)]
else:
    raise SystemExit(f"unknown way {how!r}")
for v in sd.values():
    touch(v)
report(t, len(sd))
"""

#: from_pretrained: stock, stock after hashlib, the patch with SAFELOAD_VERIFY=1 (a SHA256SUMS).
PRETRAINED = ("stock", "hashlib, then stock", "SAFELOAD_PATCH=1", "SAFELOAD_PATCH=1 SAFELOAD_VERIFY=1")

PRETRAINED_CHILD = PRELUDE + r"""
import torch, transformers
how, folder, cold = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if os.environ.get("SAFELOAD_PATCH"):
    import importlib, safetensors
    # What the startup hook runs (idempotent when it ran already): an editable install has no hook.
    importlib.import_module("safeload.patch")._autopatch()
    assert safetensors.safe_open.__module__.startswith("safeload"), "SAFELOAD_PATCH=1 did not patch"
files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
sums = dict(reversed(line.split()) for line in open(os.path.join(folder, "SHA256SUMS")))
config = transformers.AutoConfig.from_pretrained(folder)
# The model's module imported before the clock (from_pretrained imports it first; Llama's pulls
# in torch._dynamo, 0.7-1.0 s here, which no variant's reads can overlap).
transformers.AutoModelForCausalLM._model_mapping[type(config)]  # as e2e.prepare does
verified = []
if how.endswith("VERIFY=1"):
    import logging
    class Count(logging.Handler):
        def emit(self, record):
            verified.append(record.getMessage()) if record.getMessage().startswith("verified ") else None
    logging.getLogger("safeload").addHandler(Count())
    logging.getLogger("safeload").setLevel(logging.INFO)
settle(files, cold)
t = time.perf_counter()
if how == "hashlib, then stock":
    for f in files:
        assert sha(f) == sums[os.path.basename(f)]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
for p in model.parameters():
    touch(p)
assert len(verified) == (len(files) if how.endswith("VERIFY=1") else 0), verified
report(t, sum(1 for _ in model.parameters()))
"""


def _files(target: str) -> List[str]:
    if os.path.isdir(target):
        return sorted(os.path.join(target, n) for n in os.listdir(target) if n.endswith(".safetensors"))
    return [target]


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _child(code: str, args: List[str], env: Optional[Dict[str, str]] = None) -> Dict:
    env = dict(os.environ if env is None else env, VERIFY_BENCHES=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(xs: List[float]) -> float:
    return statistics.median(xs)


def run(targets: List[str], rounds: int, record: str, runs: Optional[List[Dict]] = None) -> List[str]:
    """The table's lines: one row per checkpoint, cache state and verified call. Each child's
    figures are also appended to ``runs`` when given (a median hides a slow round; ``--json``
    keeps them); every round is printed as it finishes."""
    hows = [h for h, _ in HOWS]
    res: Dict[Tuple[str, bool, str], List[Tuple[float, int]]] = {}
    for target in targets:
        pins = json.dumps({os.path.basename(f): _sha(f) for f in _files(target)})
        # The record learns the files once, before the clock (what an earlier load leaves).
        subprocess.run([sys.executable, "-c", "import json, sys, safeload.torch; "
                        "safeload.torch.load_checkpoint(sys.argv[1], verify=json.loads(sys.argv[2]), "
                        "verify_cache=sys.argv[3])", target, pins, record], check=True)
        for r in range(rounds):
            for cold in (False, True):
                k = r % len(hows)
                for how in hows[k:] + hows[:k]:  # each first in turn
                    got = _child(CHILD, [how, target, "1" if cold else "0", pins, record])
                    res.setdefault((target, cold, how), []).append((got["s"], got["rss"]))
                    if runs is not None:
                        runs.append({"checkpoint": target, "state": "cold" if cold else "warm", "how": how,
                                     "round": r, "s": got["s"], "peak_rss_kib": got["rss"]})
                print(f"# round {r + 1} {'cold' if cold else 'warm'} {target}: " + ", ".join(
                    f"{h} {res[(target, cold, h)][-1][0]:.3f}s" for h in hows), file=sys.stderr, flush=True)
    lines = ["| checkpoint | state | call | verified s | unverified s | limit s | vs limit | old way s | vs old way "
             "| bars met | peak RSS verified / unverified MiB |", "|---" * 11 + "|"]
    for target in targets:
        for cold in (False, True):
            m = {h: _median([x[0] for x in res[(target, cold, h)]]) for h in hows}
            rss = {h: _median([x[1] for x in res[(target, cold, h)]]) / 1024 for h in hows}
            old = m["hashlib, then 0.8 load_file"]
            for how, plain in HOWS:
                if not plain:
                    continue
                v = m[how]
                if cold:  # rates: the limit's time over the call's
                    limit = m["read then hash, one thread"]
                    met = limit / v >= 0.9 and old / v >= 1.3
                else:
                    limit = max(m[plain], m["hashlib"])
                    met = limit / v >= 0.87
                lines.append(f"| {target} | {'cold' if cold else 'warm'} | {how} | {v:.3f} | {m[plain]:.3f} | "
                             f"{limit:.3f} | {limit / v:.2f}x | {old:.3f} | {old / v:.2f}x | "
                             f"{'yes' if met else 'NO'} | {rss[how]:.0f} / {rss[plain]:.0f} |")
    return lines


def run_pretrained(folder: str, rounds: int, runs: Optional[List[Dict]] = None) -> List[str]:
    """``from_pretrained`` rows: the model's files hard-linked into a temporary folder beside a
    ``SHA256SUMS`` (what ``SAFELOAD_VERIFY=1`` checks against)."""
    res: Dict[Tuple[bool, str], List[Tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(folder))) as tmp:
        for name in os.listdir(folder):
            os.link(os.path.join(folder, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "SHA256SUMS"), "w") as f:
            f.writelines(f"{_sha(p)}  {os.path.basename(p)}\n" for p in _files(tmp))
        base = {k: v for k, v in os.environ.items() if not k.startswith("SAFELOAD_")}
        base["HF_HUB_OFFLINE"] = "1"
        for r in range(rounds):
            for cold in (False, True):
                k = r % len(PRETRAINED)
                for how in PRETRAINED[k:] + PRETRAINED[:k]:
                    env = dict(base)
                    env.update(kv.split("=") for kv in how.split() if kv.startswith("SAFELOAD_"))
                    got = _child(PRETRAINED_CHILD, [how, tmp, "1" if cold else "0"], env)
                    res.setdefault((cold, how), []).append((got["s"], got["rss"]))
                    if runs is not None:
                        runs.append({"checkpoint": folder, "state": "cold" if cold else "warm", "how": how,
                                     "round": r, "s": got["s"], "peak_rss_kib": got["rss"]})
                print(f"# round {r + 1} {'cold' if cold else 'warm'} from_pretrained: " + ", ".join(
                    f"{h} {res[(cold, h)][-1][0]:.3f}s" for h in PRETRAINED), file=sys.stderr, flush=True)
    lines = ["| from_pretrained | state | " + " | ".join(f"{h} s" for h in PRETRAINED)
             + " | stock + hashlib / verified (bar 1.3x) | peak RSS " + " / ".join(PRETRAINED) + " MiB |",
             "|---" * (len(PRETRAINED) + 4) + "|"]
    for cold in (False, True):
        m = {h: _median([x[0] for x in res[(cold, h)]]) for h in PRETRAINED}
        rss = {h: _median([x[1] for x in res[(cold, h)]]) / 1024 for h in PRETRAINED}
        ratio = m["hashlib, then stock"] / m[PRETRAINED[-1]]
        lines.append(f"| {folder} | {'cold' if cold else 'warm'} | " + " | ".join(f"{m[h]:.3f}" for h in PRETRAINED)
                     + f" | {ratio:.2f}x{'' if ratio >= 1.3 else ' (NO)'} | "
                     + " / ".join(f"{rss[h]:.0f}" for h in PRETRAINED) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="*")
    p.add_argument("--from-pretrained", metavar="MODEL_DIR", help="also time from_pretrained of this model folder")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="OUT", help="also write every child's figures here, round by round")
    args = p.parse_args()
    if not args.checkpoints and not args.from_pretrained:
        p.error("name a checkpoint or --from-pretrained MODEL_DIR")
    runs: List[Dict] = []
    if args.checkpoints:
        with tempfile.TemporaryDirectory() as record:
            print("\n".join(run(args.checkpoints, args.rounds, record, runs)), flush=True)
    if args.from_pretrained:
        print("\n".join(run_pretrained(args.from_pretrained, args.rounds, runs)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "cores": os.cpu_count(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
