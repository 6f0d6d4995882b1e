"""benches/main_job.py end to end (README's first command): a tiny sample in a smoke run
(``--benchmark-disable``, CI), the small one otherwise, one round. Checks that every contender
loaded in both cache states, that safeload's tensors (and the patched model's weights) equal
safetensors 0.8's, and that the table, the JSON and the chart (PNG and SVG) are written and agree.
The chart alone, from made-up rows shaped like a real run's, is checked without measuring anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SVG_TEXT = "{http://www.w3.org/2000/svg}text"
JOB_NAMES = ("load_file", "pread", "get_tensor loop", "from_pretrained", "MoE from_pretrained")


def main_job() -> Any:
    """benches/main_job.py as a module (it imports benches/bench.py and e2e.py beside it)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import main_job

    return main_job


def svg_texts(path: Any) -> List[str]:
    """The SVG's text elements (the chart keeps text as text; each line of a multi-line text is its
    own element)."""
    root = ET.parse(path).getroot()
    return ["".join(t.itertext()) for t in root.iter(SVG_TEXT)]


def assert_png(path: Any) -> None:
    from matplotlib import image  # the main job draws with matplotlib: a missing one fails, not skips

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(str(path))
    assert pixels.ndim == 3 and pixels.shape[0] > 400 and pixels.shape[1] > 800, pixels.shape
    assert pixels.min() < pixels.max()  # something is drawn


def side(gibs: float) -> Dict[str, float]:
    return {"gibs": gibs, "seconds": 1.0 / gibs, "peak_rss_gib": 1.0, "runs": 1}


def row(state: str, job: str, st: Optional[float], sl: Optional[float], limit: Optional[float]) -> Dict[str, Any]:
    """A row as main_job.summarize writes it."""
    return {"state": state, "job": job, "safetensors": side(st) if st else None, "safeload": side(sl) if sl else None,
            "limit_gibs": limit, "ratio": sl / st if st and sl else None,
            "of_limit": sl / limit if sl and limit else None}


def test_chart_shows_ratios_and_shares_of_the_limit_per_state(tmp_path):
    """Rows shaped like issue 53's run: warm maps at 80-90 GiB/s past a 10 GiB/s copy limit, cold
    rows near 1 GiB/s, one cold side that failed, a ratio below 1."""
    mj = main_job()
    rows = [row("warm", "load_file", 79.0, 89.0, 10.0), row("warm", "pread", 4.0, 9.0, 10.0),
            row("warm", "get_tensor loop", 2.5, 8.5, 10.0), row("warm", "from_pretrained", 3.0, 6.0, 10.0),
            row("warm", "MoE from_pretrained", 0.2, 0.7, 10.0),
            row("cold", "load_file", 0.9, 1.3, 1.6), row("cold", "pread", 1.2, 1.0, 1.6),
            row("cold", "get_tensor loop", 0.8, 1.4, 1.6), row("cold", "from_pretrained", None, 1.1, 1.6),
            row("cold", "MoE from_pretrained", 0.2, 0.6, 1.6),
            row("save", "save_file", 0.3, 0.42, 0.45)]
    paths = mj.write_chart(rows, "safeload vs safetensors 0.8: test rows", str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["main-job.png", "main-job.svg"]
    assert_png(tmp_path / "main-job.png")
    texts = svg_texts(tmp_path / "main-job.svg")
    for state, limit in (("warm", 10.0), ("cold", 1.6), ("save", 0.45)):
        assert mj.ratio_title(state) in texts and mj.share_title(state, limit) in texts
    assert "Warm (files in the page cache): safeload / 0.8" in texts
    assert "Cold: each side as % of the machine's limit (1.60 GiB/s)" in texts
    assert all(texts.count(job) == 2 for job in JOB_NAMES), texts  # the y labels, once per state
    assert texts.count("save_file") == 1 and "1.40\u00d7" in texts  # the save row: its own job
    assert {"1.13\u00d7", "2.25\u00d7", "0.83\u00d7", "1.75\u00d7"} <= set(texts)  # ratios, below 1 included
    assert "81% \u00b7 1.3 GiB/s" in texts and "no result" in texts  # a cold share; the failed side says so
    assert "off the scale: 890% \u00b7 89.0 GiB/s \u2192" in texts  # a warm map past the axis: its value printed
    assert {"safetensors 0.8", "safeload", "the machine's limit"} <= set(texts)  # the legend
    assert "safeload vs safetensors 0.8: test rows" in texts


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the main job forks its measurements")
def test_main_job_writes_table_json_and_chart(tiny, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    data = os.environ.get("SAFELOAD_BENCH_DATA", str(tmp_path / "data"))
    p = subprocess.run([sys.executable, os.path.join(HERE, "main_job.py"), "--size", "tiny" if tiny else "small",
                        "--rounds", "1", "--settle", "0", "--data-dir", data, "--out", str(out)],
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    result = json.loads((out / "main-job.json").read_text())
    assert result["meta"]["verify"] == {"sl_default": True, "sl_get_tensors": True, "sl_loop": True, "fp_patch": True,
                                        "moe_patch": True}
    runs = result["runs"]
    assert all("error" not in r for r in runs), [r["error"] for r in runs if "error" in r]
    jobs = {(r["state"], r["job"]) for r in result["rows"] if r["safetensors"] and r["safeload"]}
    assert jobs == {(s, j) for s in ("warm", "cold") for j in JOB_NAMES} | {("save", "save_file")}
    shards = [os.path.join(result["meta"]["sample"], n) for n in os.listdir(result["meta"]["sample"])
              if n.endswith(".safetensors")]
    data_bytes = 0
    for f in shards:  # each file's data area: its size less the 8-byte length and the header
        with open(f, "rb") as fh:
            data_bytes += os.path.getsize(f) - 8 - int.from_bytes(fh.read(8), "little")
    loads = [r for r in runs if not r["contender"].startswith(("ref_", "moe_")) or r["state"] == "save"]
    assert {r["bytes"] for r in loads} == {data_bytes}  # every tensor of every shard, each time (saves too)
    moe_bytes = {r["bytes"] for r in runs if r["contender"].startswith("moe_")}
    assert len(moe_bytes) == 1 and moe_bytes.pop() > 0  # stock and patched: the same parameters
    table = (out / "main-job.md").read_text()
    assert table in p.stdout and table.count("\n| warm |") == 5 and table.count("\n| cold |") == 5
    assert table.count("\n| save | save_file |") == 1
    assert_png(out / "main-job.png")
    texts = svg_texts(out / "main-job.svg")
    assert all(job in texts for job in JOB_NAMES), texts
    mj = main_job()
    limits = {r["state"]: r["limit_gibs"] for r in result["rows"]}
    for state in ("warm", "cold", "save"):
        assert mj.ratio_title(state) in texts and mj.share_title(state, limits[state]) in texts
    for r in result["rows"]:  # every ratio of the table is on the chart
        assert f"{r['ratio']:.2f}\u00d7" in texts
