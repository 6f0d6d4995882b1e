"""Large checkpoints in fresh processes: the 2.5 GiB Llama-shaped sample and 20k small tensors.

Every load runs in its own ``python -c`` child that imports torch, safetensors and safeload
before the clock starts (``import torch`` alone costs 1-2 s), times the load call, then times a
touch of every page of the result (a lazy mmap load pays its reads there), and reports its peak
RSS (``resource.getrusage``). *warm*: the file is read once by the parent first; *cold*: the child
drops it from the page cache (``posix_fadvise(DONTNEED)``) right before the clock starts.

Contenders: safeload's default backend and ``backend="pread"``; safetensors 0.8's default
(mmap), ``backend="pread"`` and mmap + ``clone()`` of every tensor; the *fresh-memory limit*
(8 MiB ``preadv`` by 2 threads into anonymous memory never touched before: what any loader that
copies into new memory pays here); and a second safeload load in the same process as the first.

Samples are written once with ``benches/bench.py``'s writers under ``bench-data/full``
(``SAFELOAD_BENCH_DATA`` to move it); ``SAFELOAD_BENCH_ROUNDS`` (default 1) repeats every child,
interleaved, and keeps medians. Results also go to ``bench-out/test_large.json``. With
``--benchmark-disable`` the samples are a few MiB in a temporary directory and one child runs
every contender, so the code paths stay tested in CI. Nothing here asserts a speed: the
terminal summary shows each ratio next to its target.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest

# The harness (benches/bench.py: sample writers, _prewarm, _worker_env) by path: benches/ is no package.
_spec = importlib.util.spec_from_file_location("safeload_bench", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py"))
sl_bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sl_bench  # dataclasses look their module up there
_spec.loader.exec_module(sl_bench)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = float(1 << 30)
CHUNK = 8 << 20
LIMIT_THREADS = 2

CONTENDERS = ("st_default", "st_pread", "st_mmap_clone", "sl_default", "sl_pread", "limit")

CHILD = r'''
import gc, json, mmap, os, resource, sys, threading, time

spec = json.loads(sys.argv[1])
import torch
import safetensors, safetensors.torch
import safeload, safeload.torch


def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def runner(name, path):
    if name == "st_default":
        return lambda: safetensors.torch.load_file(path)
    if name == "st_pread":
        return lambda: safetensors.torch.load_file(path, backend="pread")
    if name == "st_mmap_clone":
        def run():
            with safetensors.safe_open(path, "pt") as f:
                return {k: f.get_tensor(k).clone() for k in f.keys()}
        return run
    if name == "sl_default":
        return lambda: safeload.torch.load_file(path)
    if name == "sl_pread":
        return lambda: safeload.torch.load_file(path, backend="pread")
    if name == "limit":
        def run():  # 8 MiB preads by 2 threads into anonymous memory never touched before
            size = os.path.getsize(path)
            buf = mmap.mmap(-1, max(size, 1))
            view = memoryview(buf)
            fd = os.open(path, os.O_RDONLY)
            todo = iter(range(0, size, spec["chunk"]))
            lock = threading.Lock()

            def work():
                while True:
                    with lock:
                        off = next(todo, None)
                    if off is None:
                        return
                    end = min(off + spec["chunk"], size)
                    while off < end:
                        off += os.preadv(fd, [view[off:end]], off)

            pool = [threading.Thread(target=work) for _ in range(spec["threads"])]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            os.close(fd)
            view.release()
            return {"buffer": torch.frombuffer(buf, dtype=torch.uint8, count=size) if size else torch.empty(0)}
        return run
    raise SystemExit("unknown contender " + name)


def touch(result):
    for t in result.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def one(run_spec):
    path, name = run_spec["path"], run_spec["contender"]
    run = runner(name, path)
    if run_spec["cold"]:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    out = {"contender": name, "rss_before_kib": rss_kib()}
    t0 = time.perf_counter()
    result = run()
    t1 = time.perf_counter()
    touch(result)
    t2 = time.perf_counter()
    out.update(seconds=t1 - t0, touch_seconds=t2 - t1, tensors=len(result),
               bytes=sum(t.numel() * t.element_size() for t in result.values()),
               peak_rss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    if run_spec.get("again"):  # the same checkpoint again in the same process
        del result
        gc.collect()
        t0 = time.perf_counter()
        result = run()
        out["second_seconds"] = time.perf_counter() - t0
    del result
    gc.collect()
    return out


for r in spec["runs"]:
    print(json.dumps(one(r)), flush=True)
'''


@pytest.fixture(scope="module")
def samples(tiny: bool, tmp_path_factory: Any) -> Dict[str, Tuple[str, int, int]]:
    """name -> (path, tensor count, data bytes) for "llama" and "small"."""
    if tiny:
        d = str(tmp_path_factory.mktemp("large"))
        tiles = sl_bench._tiles()
        specs = {"llama": sl_bench._llama_like(64, 160, 2, 256), "small": sl_bench._small_specs("small")[:300]}
        out = {}
        for i, (name, sp) in enumerate(specs.items()):
            path = os.path.join(d, f"{name}.safetensors")
            sl_bench._save(sp, path, tiles, seed0=1 + 100000 * i)
            out[name] = (path, len(sp), sum(sl_bench._spec_bytes(s) for s in sp))
        return out
    data_dir = os.environ.get("SAFELOAD_BENCH_DATA") or os.path.join(REPO, "bench-data")
    out = {}
    for ds in sl_bench.prepare_samples(data_dir, "full", ["llama", "small"], sl_bench._log):
        specs = sl_bench._llama_specs("full") if ds.name == "llama" else sl_bench._small_specs("full")
        out[ds.name] = (ds.files[0], len(specs), sum(sl_bench._spec_bytes(s) for s in specs))
    return out


def _children(runs: List[Dict[str, Any]], tiny: bool) -> List[Dict[str, Any]]:
    """Runs each run in a fresh child (a single child for all of them in a smoke run)."""
    groups = [runs] if tiny else [[r] for r in runs]
    results = []
    for group in groups:
        spec = {"runs": group, "chunk": CHUNK, "threads": LIMIT_THREADS}
        p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                           timeout=900, env=sl_bench._worker_env())
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        assert p.returncode == 0 and len(lines) == len(group), p.stdout[-2000:] + p.stderr[-4000:]
        results += lines
    return results


def _measure(path: str, states: List[str], tiny: bool) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """state -> contender -> medians over the rounds."""
    rounds = 1 if tiny else max(1, int(os.environ.get("SAFELOAD_BENCH_ROUNDS", "1")))
    raw: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for state in states:
        for r in range(rounds):
            if state == "warm":
                sl_bench._prewarm([path])
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[: r % len(CONTENDERS)]  # rotate per round
            runs = [{"path": path, "contender": c, "cold": state == "cold", "again": c in ("sl_default", "sl_pread")} for c in order]
            for res in _children(runs, tiny):
                raw.setdefault(state, {}).setdefault(res["contender"], []).append(res)
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for state, by in raw.items():
        for c, results in by.items():
            med = {k: statistics.median(x[k] for x in results) for k in results[0] if isinstance(results[0][k], (int, float))}
            out.setdefault(state, {})[c] = med
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def _report(name: str, size: int, res: Dict[str, Dict[str, Dict[str, Any]]], lines: List[str]) -> Dict[str, Any]:
    lines.append(f"{name} ({size / GIB:.2f} GiB)")
    lines.append(f"  {'state':<5} {'contender':<14} {'load s':>8} {'GiB/s':>7} {'+touch s':>9} "
                 f"{'RSS before MiB':>15} {'peak RSS MiB':>13}")
    for state, by in res.items():
        for c in CONTENDERS:
            m = by[c]
            lines.append(f"  {state:<5} {c:<14} {m['seconds']:>8.3f} {size / GIB / m['seconds']:>7.2f} "
                         f"{m['seconds'] + m['touch_seconds']:>9.3f} {m['rss_before_kib'] / 1024:>15.0f} "
                         f"{m['peak_rss_kib'] / 1024:>13.0f}")
    ratios: Dict[str, Any] = {}

    def row(what: str, value: Optional[float], target: Optional[float]) -> None:
        ratios[what] = value
        verdict = "" if target is None or value is None else ("ok" if value >= target else "BELOW TARGET")
        shown = "n/a" if value is None else f"{value:.2f}x"
        lines.append(f"  {what:<62} {shown:>8}  {'' if target is None else f'target >= {target:.2f}x':<16} {verdict}")

    for state, by in res.items():
        sl, st = by["sl_default"], by["st_default"]
        target = 1.0 if name == "small" else 0.95
        row(f"{state}: default load vs safetensors default (load call)", _ratio(st["seconds"], sl["seconds"]),
            target if state == "warm" or name == "llama" else None)
        row(f"{state}: default load vs safetensors default (load + touch)",
            _ratio(st["seconds"] + st["touch_seconds"], sl["seconds"] + sl["touch_seconds"]), None)
        row(f"{state}: default load vs safetensors mmap + clone",
            _ratio(by["st_mmap_clone"]["seconds"], sl["seconds"]), None)
        row(f"{state}: pread vs safetensors pread", _ratio(by["st_pread"]["seconds"], by["sl_pread"]["seconds"]), None)
        row(f"{state}: pread vs fresh-memory limit ({LIMIT_THREADS} threads x 8 MiB preads)",
            _ratio(by["limit"]["seconds"], by["sl_pread"]["seconds"]), 0.9 if state == "warm" else None)
        row(f"{state}: second load vs first, same process (default)", _ratio(sl["seconds"], sl.get("second_seconds")),
            None)
        pr = by["sl_pread"]  # owned memory: the second load reuses the first one's freed pages
        row(f"{state}: second load vs first, same process (pread)", _ratio(pr["seconds"], pr.get("second_seconds")),
            2.0 if state == "warm" else None)
    return ratios


def _save_json(key: str, value: Any) -> None:
    out_dir = os.path.join(REPO, "bench-out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "test_large.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[key] = value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


@pytest.mark.parametrize("name", ["llama", "small"])
def test_large_fresh_processes(name, samples, tiny, large_rows):
    path, count, nbytes = samples[name]
    res = _measure(path, ["warm", "cold"], tiny)
    for state, by in res.items():
        for c, m in by.items():
            expect = (1, os.path.getsize(path)) if c == "limit" else (count, nbytes)
            assert (m["tensors"], m["bytes"]) == expect, (state, c, m)
    if tiny:
        return
    ratios = _report(name, nbytes, res, large_rows)
    _save_json(name, {"path": path, "bytes": nbytes, "results": res, "ratios": ratios})
