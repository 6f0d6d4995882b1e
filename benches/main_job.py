#!/usr/bin/env python3
"""The main job: safeload against safetensors 0.8 on a built-in sample, side by side, in about two
minutes on 2 cores.

    python benches/main_job.py            # ~1 GiB sample, warm, cold and saved, 3 rounds: table + chart
    python benches/main_job.py --full     # the full benchmark: benches/bench.py [options], then benches/e2e.py

The sample is a Llama-shaped causal LM with random bf16 weights (~1 GiB in 2 shards), written once
with transformers' own ``save_pretrained`` under ``--data-dir``. Four ways users load it, each
with safetensors 0.8 and with safeload:

- ``load_file``: ``safetensors.torch.load_file(shard)`` for each shard, the default backend (0.8:
  a map that copies nothing; safeload: ``"auto"``);
- ``pread``: ``safe_open(shard, "pt", backend="pread").get_tensors()``;
- ``get_tensor loop``: ``for k in f.keys(): f.get_tensor(k)``, the default backend (vLLM's and
  ltx-core's loop);
- ``from_pretrained``: transformers' ``AutoModelForCausalLM.from_pretrained``, unmodified: stock
  against ``SAFELOAD_PATCH=1`` (the patch the startup hook applies);
- ``MoE from_pretrained``: the same, of a second sample, a Qwen3-MoE-shaped model (one tensor per
  expert on disk, fused by transformers at load; ``benches/moe.py`` writes it, ~0.2 GiB);

and one way users save it: ``save_file`` of each shard's tensors (read into memory first) with
``metadata={"format": "pt"}``, as ``save_pretrained`` calls it, timed until the files and their
folder are synced (0.8's ``save_file`` then ``fsync``; safeload's ``save_file(fsync=True)``);

and the machine's limit for each cache state (``benches/bench.py``'s references: parallel
``preadv`` into one pre-faulted buffer, and O_DIRECT when cold). Warm: the files are in the page
cache. Cold: each measurement evicts them first (``POSIX_FADV_DONTNEED``; the host may still
cache them, so cold figures vary).

Every measurement is a fresh process: this one imports torch, safetensors, safeload and
transformers once and forks a child per measurement (before the clock: the imports, the model
class, the patch; the clock stops once one byte of every page of every tensor has been read).
Rounds interleave the contenders in a shuffled order; the table gives medians, safeload / 0.8
ratios (> 1: safeload faster), the fraction of the machine's limit, and each child's peak RSS. A
child before the first round checks that every safeload result equals 0.8's, byte for byte.
Output: the table on the terminal (a progress bar on stderr while it runs), and
``main-job.md``, ``main-job.json`` and the chart, ``main-job.png`` and ``main-job.svg`` (drawn with
matplotlib), under ``--out``: per job, warm and cold apart, safeload / 0.8 and each side's share of
the machine's limit.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import select
import signal
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402 - benches/bench.py: loaders, page-cache, RSS and reference helpers
import e2e  # noqa: E402 - benches/e2e.py: the model and its from_pretrained

GIB = float(1 << 30)
STATES = ("warm", "cold", "save")
#: job -> (what it does, safetensors 0.8's contender, safeload's contender)
JOBS: Dict[str, Tuple[str, str, str]] = {
    "load_file": ("load_file(shard) for each shard, default backend", "st_default", "sl_default"),
    "pread": ("safe_open(backend='pread').get_tensors()", "st_get_tensors", "sl_get_tensors"),
    "get_tensor loop": ("for k in keys(): get_tensor(k), default backend", "st_loop", "sl_loop"),
    "from_pretrained": ("transformers from_pretrained, unmodified: stock vs SAFELOAD_PATCH=1",
                        "fp_stock", "fp_patch"),
    "MoE from_pretrained": ("the same of a Qwen3-MoE sample, its experts fused at load", "moe_stock", "moe_patch"),
}
#: the MoE sample's size (benches/moe.py) for each size of the main sample
MOE_SIZES = {"main": "small", "small": "tiny", "tiny": "tiny"}
#: the save row: the sample's shards written back, each synced before the clock stops
SAVE_JOBS: Dict[str, Tuple[str, str, str]] = {
    "save_file": ("save_file(shard, metadata) for each shard, synced: 0.8 then fsync, safeload fsync=True",
                  "st_save", "sl_save"),
}
#: the jobs of each state
JOBS_OF = {"warm": JOBS, "cold": JOBS, "save": SAVE_JOBS}
#: the machine's limit: warm, copies from the page cache; cold, reads from the disk; save, parallel
#: pwrite of the same bytes into preallocated files, then fsync (1, 2 or 4 threads: the best)
LIMITS = {"warm": ("ref_copy",), "cold": ("ref_copy", "ref_odirect"), "save": ("ref_write1", "ref_write2", "ref_write4")}
CHILD_TIMEOUT_S = 600.0


# -- children --------------------------------------------------------------------------------------


def _reset_peak_rss() -> None:
    """Peak RSS from now on (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(jobs: List[Tuple[str, List[Any]]], threads: int) -> None:
    """The machine's write limit: each file's tensors (``jobs``: path, tensors) pwritten in 16 MiB
    pieces from ``threads`` threads into a file preallocated to their size, then fsync."""
    from concurrent.futures import ThreadPoolExecutor

    fds, pieces = [], []
    for path, tensors in jobs:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fds.append(fd)
        os.posix_fallocate(fd, 0, max(1, sum(t.nbytes for t in tensors)))
        at = 0
        for t in tensors:
            b = memoryview(t.reshape(-1).view(__import__("torch").uint8).numpy())
            pieces += [(fd, at + i, b[i:i + (16 << 20)]) for i in range(0, len(b), 16 << 20)]
            at += len(b)

    def put(piece: Tuple[int, int, Any]) -> None:
        fd, at, b = piece
        while len(b):
            n = os.pwrite(fd, b, at)
            at, b = at + n, b[n:]

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(put, pieces))
    for fd in fds:
        os.fsync(fd)
        os.close(fd)


def _measure_save(contender: str, files: List[str], out_dir: str) -> Dict[str, Any]:
    """One timed save of the sample's shards (read into memory before the clock) into ``out_dir``."""
    import shutil

    import safetensors.torch

    import safeload.torch

    shards = [(os.path.join(out_dir, os.path.basename(f)), {k: v.clone() for k, v in safetensors.torch.load_file(f).items()})
              for f in files]
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    _reset_peak_rss()
    start = time.perf_counter()
    if contender == "st_save":
        for path, sd in shards:
            safetensors.torch.save_file(sd, path, metadata={"format": "pt"})
            _fsync(path)
    elif contender == "sl_save":
        for path, sd in shards:
            safeload.torch.save_file(sd, path, metadata={"format": "pt"}, fsync=True)
    else:
        _pwrite_all([(path, list(sd.values())) for path, sd in shards], int(contender[len("ref_write"):]))
    _fsync(out_dir)
    seconds = time.perf_counter() - start
    nbytes = sum(t.nbytes for _, sd in shards for t in sd.values())
    return {"seconds": seconds, "bytes": nbytes, "peak_rss_kib": bench._vmhwm_kib()}


def _measure(contender: str, state: str, files: List[str], from_pretrained: Callable[[], Any],
             threads: int) -> Dict[str, Any]:
    """One timed load (or, in the save state, save) in this (forked) process."""
    if state == "save":
        return _measure_save(contender, files, os.path.join(os.path.dirname(os.path.dirname(files[0])), "main-job-save"))
    out: Dict[str, Any] = {}
    if contender in ("fp_patch", "moe_patch"):
        import importlib

        os.environ["SAFELOAD_PATCH"] = "1"
        importlib.import_module("safeload.patch")._autopatch()  # what the startup hook runs
    run = None
    if contender.startswith(("st_", "sl_")):
        run = bench._loader(contender, {"files": files}, out)
    if state == "cold":
        for f in files:
            bench._drop_cache(f)
        out["resident_before"] = bench._resident_fraction(files)
    _reset_peak_rss()
    start = time.perf_counter()
    if contender.startswith("ref_"):
        seconds, nbytes, extra = bench._ref_read(files, threads, direct=contender == "ref_odirect")
        if "skipped" in extra:  # O_DIRECT refused here (tmpfs, say): no limit from it
            return dict(out, **extra)
    else:
        if contender.startswith(("fp_", "moe_")):
            result = from_pretrained()  # the model's weights, every page read (e2e.prepare)
        else:
            assert run is not None
            result = run()
            bench._touch(result)
        seconds = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in result.values())
    out.update(seconds=seconds, bytes=nbytes, peak_rss_kib=bench._vmhwm_kib())
    return out


def _verify(files: List[str], from_pretrained: Callable[[], Any], moe: Callable[[], Any]) -> Dict[str, Any]:
    """Every safeload contender's tensors against 0.8's, byte for byte; the patched models' weights
    against the stock models'."""
    import torch

    def same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
        return set(a) == set(b) and all(
            a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            and torch.equal(bench._as_bytes(a[k]), bench._as_bytes(b[k])) for k in a)

    ref = bench._loader("st_get_tensors", {"files": files}, {})()
    out = {c: same(bench._loader(c, {"files": files}, {})(), ref) for _, _, c in JOBS.values() if c.startswith("sl_")}
    import safeload

    for contender, load in (("fp_patch", from_pretrained), ("moe_patch", moe)):
        stock = {k: v.clone() for k, v in load().items()}
        with safeload.patched():
            out[contender] = same(load(), stock)
    return out


def in_child(work: Callable[[], Dict[str, Any]], timeout: float = CHILD_TIMEOUT_S) -> Dict[str, Any]:
    """``work()`` in a forked child; its result (or ``{"error": ...}``) comes back as JSON."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        try:
            result = work()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = {"error": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(result).encode())
        os.close(w)
        os._exit(0)  # skip freeing gigabytes of tensors on the way out
    os.close(w)
    chunks: List[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return {"error": f"timed out after {timeout:.0f} s"}
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if not chunks:
        return {"error": f"the child died (wait status {status})"}
    return json.loads(b"".join(chunks))


# -- the run ---------------------------------------------------------------------------------------


def ensure_sample(data_dir: str, size: str, kind: str = "llama") -> str:
    """The sample model's directory (``kind`` "llama" or "moe"), written (in a child) when missing."""
    path = os.path.join(data_dir, f"main-job-{kind}-{size}")
    if not os.path.isdir(path):
        os.makedirs(data_dir, exist_ok=True)
        bench._log(f"writing the {kind} sample ({size}) to {path} ...")
        if kind == "moe":
            import moe

            res = in_child(lambda: (moe.write_checkpoint(path, MOE_SIZES[size]), {"ok": True})[1])
        else:
            res = in_child(lambda: (e2e.build_model("transformers", size, path), {"ok": True})[1])
        if "error" in res:
            raise SystemExit(f"writing the sample failed: {res['error']}")
    return path


def summarize(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per state and job: medians of GiB/s, seconds and peak RSS of each side, the ratio
    safeload / 0.8 and safeload's share of the state's limit."""
    def med(state: str, contender: str) -> Optional[Dict[str, float]]:
        ok = [r for r in runs if r["state"] == state and r["contender"] == contender and "seconds" in r]
        if not ok:
            return None
        return {"gibs": statistics.median(r["bytes"] / r["seconds"] / GIB for r in ok),
                "seconds": statistics.median(r["seconds"] for r in ok),
                "peak_rss_gib": statistics.median(r["peak_rss_kib"] for r in ok) * 1024 / GIB,
                "runs": len(ok)}

    rows = []
    for state in STATES:
        limits = [m["gibs"] for m in (med(state, c) for c in LIMITS[state]) if m]
        limit = max(limits) if limits else None
        for job, (_, st, sl) in JOBS_OF[state].items():
            a, b = med(state, st), med(state, sl)
            if not a and not b:
                continue
            rows.append({"state": state, "job": job, "safetensors": a, "safeload": b, "limit_gibs": limit,
                         "ratio": b["gibs"] / a["gibs"] if a and b else None,
                         "of_limit": b["gibs"] / limit if b and limit else None})
    return rows


def render(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    def side(m: Optional[Dict[str, float]]) -> str:
        return f"{m['gibs']:.2f} GiB/s ({m['seconds']:.2f} s, {m['peak_rss_gib']:.2f} GiB)" if m else "-"

    lines = [f"## safeload vs safetensors 0.8: {meta['sample_gib']:.2f} GiB sample, medians of {meta['rounds']} rounds",
             "", "GiB/s (seconds, peak RSS); ratio > 1: safeload faster. The limit is the machine's copy limit "
             "(warm: page cache to memory; cold: the disk, buffered or O_DIRECT): a map copies nothing, so a "
             "warm map's figures can pass it.", "",
             "| state | job | safetensors 0.8 | safeload | safeload / 0.8 | safeload / limit |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"**{r['ratio']:.2f}x**" if r["ratio"] else "-"
        of_limit = f"{r['of_limit']:.2f} (limit {r['limit_gibs']:.2f} GiB/s)" if r["of_limit"] else "-"
        lines.append(f"| {r['state']} | {r['job']} | {side(r['safetensors'])} | {side(r['safeload'])} | {ratio} | {of_limit} |")
    lines += ["", "Jobs: " + "; ".join(f"`{j}`: {d}" for j, (d, _, _) in {**JOBS, **SAVE_JOBS}.items()) + ".",
              "Tensors equal to 0.8's: " + ", ".join(f"{k} {v if k == 'error' else 'yes' if v else 'NO'}"
                                                    for k, v in meta["verify"].items()),
              f"Cold: resident before the load at most {meta['resident_before_max']:.0%} (after the eviction)."
              if meta.get("resident_before_max") is not None else "",
              f"{meta['measurements']} measurements, {meta['elapsed_s']:.0f} s.", ""]
    return "\n".join(lines)


#: the chart's colours: 0.8 grey, safeload blue, the machine's limit red and dashed
COLORS = {"safetensors": "#9aa0a6", "safeload": "#1a73e8", "limit": "#d93025"}
STATE_NAMES = {"warm": "Warm (files in the page cache)", "cold": "Cold (evicted before each load)",
               "save": "Save (written and synced)"}
#: the share-of-limit axis ends here; a longer bar (a warm map, which copies nothing) is cut at the edge
SHARE_AXIS_MAX = 1.5
CHART_FILES = ("main-job.png", "main-job.svg")


def ratio_title(state: str) -> str:
    return f"{STATE_NAMES[state]}: safeload / 0.8"


def share_title(state: str, limit_gibs: Optional[float]) -> str:
    limit = f"{limit_gibs:.2f} GiB/s" if limit_gibs else "not measured"
    return f"{state.capitalize()}: each side as % of the machine's limit ({limit})"


def _ratio_panel(ax: Any, state: str, jobs: List[str], by_key: Dict[Tuple[str, str], Dict[str, Any]],
                 fold: float) -> None:
    """safeload / 0.8 per job: a bar from 1 to the ratio on a log axis from 1 / ``fold`` to ``fold``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log")
    ax.set_xlim(1 / fold, fold)
    ax.xaxis.set_major_locator(FixedLocator([t for t in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1, 1.5, 2, 3, 4, 8, 16)
                                             if 1 / fold <= t <= fold and (fold <= 4 or t not in (3 / 4, 1.5, 3))]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}\u00d7"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.axvline(1.0, color="black", linewidth=1)
    for i, job in enumerate(jobs):
        q = by_key.get((state, job), {}).get("ratio")
        if not q:
            ax.text(1.0, i, "  no result", va="center", fontsize=9, color="dimgray")
            continue
        ax.barh(i, abs(q - 1), left=min(q, 1.0), height=0.6, color=COLORS["safeload" if q >= 1 else "safetensors"])
        ax.text(q * 1.04 if q >= 1 else q / 1.04, i, f"{q:.2f}\u00d7", va="center", ha="left" if q >= 1 else "right",
                fontsize=10, fontweight="bold")
    ax.set_title(ratio_title(state), fontsize=11, loc="left")
    ax.set_xlabel("safeload / 0.8, log scale (> 1\u00d7: safeload faster)")
    ax.grid(axis="x", color="#e0e0e0", linewidth=0.8)
    ax.set_axisbelow(True)


def _share_panel(ax: Any, state: str, jobs: List[str], by_key: Dict[Tuple[str, str], Dict[str, Any]],
                 share_max: float) -> None:
    """Each side's rate over the state's machine limit, 0 to ``share_max``; a longer bar is broken
    at the edge, its label saying where it would end."""
    from matplotlib.ticker import PercentFormatter

    limit = next((by_key[(state, j)]["limit_gibs"] for j in jobs if (state, j) in by_key), None)
    ax.set_xlim(0, share_max)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.axvline(1.0, color=COLORS["limit"], linestyle="--", linewidth=1.5)
    for i, job in enumerate(jobs):
        r = by_key.get((state, job))
        for y, who in ((i - 0.2, "safetensors"), (i + 0.2, "safeload")):
            if not r or not r[who]:
                ax.text(0.01, y, "no result", va="center", fontsize=8, color="dimgray")
                continue
            if not limit:
                continue  # the panel says so
            v = r[who]["gibs"] / limit
            cut = v > share_max
            ax.barh(y, min(v, share_max), height=0.38, color=COLORS[who])
            label = f"{v:.0%} \u00b7 {r[who]['gibs']:.1f} GiB/s"
            if cut:  # a white gap near the end breaks the bar
                ax.barh(y, 0.012 * share_max, left=0.955 * share_max, height=0.42, color="white")
                label = f"off the scale: {label} \u2192"
            inside = min(v, share_max) > 0.55 * share_max
            ax.text((0.94 if cut else 0.99) * min(v, share_max) if inside else v + 0.01 * share_max, y, label,
                    va="center", ha="right" if inside else "left", fontsize=8.5, color="white" if inside else "black",
                    fontweight="bold" if inside else None)
    if not limit:
        ax.text(0.5, 0.5, "the machine's limit was not measured", transform=ax.transAxes, ha="center",
                va="center", color="dimgray")
    ax.set_title(share_title(state, limit), fontsize=11, loc="left")
    ax.set_xlabel("rate / the machine's limit (100%: the dashed line)")
    ax.grid(axis="x", color="#e0e0e0", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.tick_params(axis="y", left=False)


def chart(rows: List[Dict[str, Any]], title: str) -> Any:
    """The chart of ``rows`` (a matplotlib ``Figure``, no pyplot state): one row of panels per cache
    state. Left: safeload / 0.8 per job on a log axis around 1 (a bar right of 1: safeload faster).
    Right: each side's rate as a share of that state's machine limit, the limit a dashed line at 100%.
    Ratios and shares, not GiB/s: a warm map's tens of GiB/s would flatten every cold bar. Below:
    the legend, what the limit is, and what each job does."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    states = [s for s in STATES if any(r["state"] == s for r in rows)]
    jobs_of = {s: [j for j in JOBS_OF[s] if any(r["job"] == j and r["state"] == s for r in rows)] for s in states}
    by_key = {(r["state"], r["job"]): r for r in rows}
    # both states share each axis: the longest ratio bar leaves room for its label; shares end at
    # SHARE_AXIS_MAX, or sooner when every bar is shorter
    fold = max([2.0] + [max(r["ratio"], 1 / r["ratio"]) ** 1.45 for r in rows if r["ratio"]])
    shares = [r[who]["gibs"] / r["limit_gibs"] for r in rows for who in ("safetensors", "safeload")
              if r[who] and r["limit_gibs"]]
    share_max = min(SHARE_AXIS_MAX, max([1.15] + [v * 1.3 for v in shares]))
    notes = ["The machine's limit: warm, parallel preadv copying from the page cache; cold, parallel preadv "
             "from the disk, buffered or O_DIRECT, the faster; save, parallel pwrite of the same bytes into "
             "preallocated files, then fsync (the best of 1, 2 and 4 threads).",
             "A map copies nothing, so a warm map can pass the limit: its bar is broken at the axis's end "
             "and its label says where it would end."]
    notes += [f"{j}: {d}" for j, (d, _, _) in {**JOBS, **SAVE_JOBS}.items() if any(j in js for js in jobs_of.values())]

    panels_h, key_h = 0.6 + 2.3 * max(len(states), 1), 0.45 + 0.19 * len(notes)  # inches
    fig = Figure(figsize=(12.5, panels_h + key_h), layout="constrained")
    FigureCanvasAgg(fig)
    top, key = fig.subfigures(2, 1, height_ratios=(panels_h, key_h))
    axes = top.subplots(max(len(states), 1), 2, squeeze=False, gridspec_kw={"width_ratios": (1, 1.25)})
    top.suptitle(title, fontsize=13, fontweight="bold")
    for (ax_ratio, ax_share), state in zip(axes, states):
        jobs = jobs_of[state]
        _ratio_panel(ax_ratio, state, jobs, by_key, fold)
        _share_panel(ax_share, state, jobs, by_key, share_max)
        ax_ratio.set_yticks(range(len(jobs)), jobs, fontsize=10)
        ax_share.set_yticks(range(len(jobs)), [])
        for ax in (ax_ratio, ax_share):
            ax.set_ylim(len(jobs) - 0.5, -0.5)  # the first job on top
    key.legend(handles=[Patch(color=COLORS["safetensors"], label="safetensors 0.8"),
                        Patch(color=COLORS["safeload"], label="safeload"),
                        Line2D([], [], color=COLORS["limit"], linestyle="--", label="the machine's limit"),
                        Line2D([], [], color="black", label="1\u00d7: as fast as 0.8")],
               loc="upper center", ncol=4, frameon=False, fontsize=10)
    key.text(0.01, 1 - 0.42 / key_h, "\n".join(notes), ha="left", va="top", fontsize=8.5, color="dimgray",
             linespacing=1.4)
    return fig


def write_chart(rows: List[Dict[str, Any]], title: str, out_dir: str) -> List[str]:
    """``chart(rows, title)`` as PNG and SVG (its text kept as text: searchable, and tests read it)
    under ``out_dir``; the paths written."""
    import matplotlib

    fig = chart(rows, title)
    paths = [os.path.join(out_dir, name) for name in CHART_FILES]
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "main-job"}):
        for path in paths:
            fig.savefig(path, dpi=150, facecolor="white", bbox_inches="tight", pad_inches=0.15,
                        metadata={"Date": None} if path.endswith(".svg") else None)
    return paths


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    try:
        import matplotlib  # noqa: F401 - the chart: checked before minutes of measuring, not after
    except ImportError:
        raise SystemExit("the main job's chart needs matplotlib: pip install matplotlib") from None
    import torch  # noqa: F401 - imported once, here, before any clock: every child inherits it
    import safetensors.torch  # noqa: F401
    import tqdm

    import safeload.torch  # noqa: F401
    from safeload import _safeload

    model_dir = ensure_sample(args.data_dir, args.size)
    files = sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    from_pretrained = e2e.prepare("transformers", model_dir)  # the imports, the config, the class
    moe_dir = ensure_sample(args.data_dir, args.size, "moe")
    moe_files = sorted(os.path.join(moe_dir, n) for n in os.listdir(moe_dir) if n.endswith(".safetensors"))
    moe_from_pretrained = e2e.prepare("transformers", moe_dir)
    import transformers

    transformers.logging.disable_progress_bar()  # one bar here, ours
    threads = _safeload.DEFAULT_THREADS
    bench._log(f"sample: {len(files)} shards, {sum(os.path.getsize(f) for f in files) / GIB:.2f} GiB; "
               "checking that safeload's tensors equal 0.8's ...")
    verify = in_child(lambda: _verify(files, from_pretrained, moe_from_pretrained))
    plan = []
    for state in STATES:
        contenders = [c for _, st, sl in JOBS_OF[state].values() for c in (st, sl)] + list(LIMITS[state])
        plan += [(state, rnd, c) for rnd in range(args.rounds)
                 for c in random.Random(f"{args.seed}/{state}/{rnd}").sample(contenders, len(contenders))]
    runs: List[Dict[str, Any]] = []
    with tqdm.tqdm(total=len(plan), desc="measuring", unit="load", file=sys.stderr, leave=False) as bar:
        for state, rnd, contender in plan:
            # the MoE job reads its own sample; the rest (and the limits) the main one
            job_files, job_load = (moe_files, moe_from_pretrained) if contender.startswith("moe_") else \
                (files, from_pretrained)
            if state == "warm":
                bench._prewarm(job_files)
            if args.settle > 0:
                time.sleep(args.settle)
            bar.set_postfix_str(f"{state} r{rnd} {contender}")
            res = in_child(functools.partial(_measure, contender, state, job_files, job_load, threads))
            res.update(state=state, round=rnd, contender=contender)
            if "error" in res:
                tqdm.tqdm.write(f"{state} r{rnd} {contender}: {res['error']}", file=sys.stderr)
            runs.append(res)
            bar.update()
    rows = summarize(runs)
    cold = [r["resident_before"] for r in runs if r.get("resident_before") is not None]
    meta = {"sample": model_dir, "sample_gib": sum(os.path.getsize(f) for f in files) / GIB, "rounds": args.rounds,
            "seed": args.seed, "threads": threads, "verify": verify, "measurements": len(runs),
            "resident_before_max": max(cold) if cold else None, "elapsed_s": time.perf_counter() - t0,
            "environment": bench._environment(threads, None)}
    text = render(rows, meta)
    sys.stdout.write(text)
    os.makedirs(args.out, exist_ok=True)
    charts = write_chart(rows, f"safeload vs safetensors 0.8: {meta['sample_gib']:.2f} GiB sample, medians of "
                         f"{args.rounds} round{'s' if args.rounds > 1 else ''}", args.out)
    with open(os.path.join(args.out, "main-job.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(args.out, "main-job.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows, "runs": runs}, f, indent=1)
    bench._log(f"wrote {', '.join(os.path.basename(c) for c in charts)}, main-job.md and main-job.json in {args.out}")
    failed = [r for r in runs if "error" in r]
    return 1 if failed or "error" in verify or not all(verify.values()) else 0


def full(rest: Sequence[str]) -> int:
    """The full benchmark: every loader on every sample (bench.py, given ``rest``), then
    transformers' and diffusers' from_pretrained in every storage state (e2e.py)."""
    import subprocess

    codes = [subprocess.call([sys.executable, os.path.join(HERE, "bench.py"), *rest]),
             subprocess.call([sys.executable, os.path.join(HERE, "e2e.py")])]
    return max(codes)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--full"]:
        return full(argv[1:])
    p = argparse.ArgumentParser(prog="benches/main_job.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="run the full benchmark instead (first argument)")
    p.add_argument("--size", choices=("main", "small", "tiny"), default="main",
                   help="sample: main ~1 GiB (default), small ~0.26 GiB, tiny (a smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=0.2, metavar="SECONDS", help="pause before each measurement")
    p.add_argument("--data-dir", default="bench-data")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    if args.full:
        raise SystemExit("--full goes first: python benches/main_job.py --full [bench.py options]")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if not hasattr(os, "fork"):
        raise SystemExit("the main job forks a fresh process per measurement: Linux or macOS")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
