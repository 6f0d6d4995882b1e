"""benches/main_job.py end to end (README's first command): a tiny sample in a smoke run
(``--benchmark-disable``, CI), the small one otherwise, one round. Checks that every contender
loaded in both cache states, that safeload's tensors (and the patched model's weights) equal
safetensors 0.8's, and that the table, the JSON and the SVG chart are written and agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


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
    assert result["meta"]["verify"] == {"sl_default": True, "sl_get_tensors": True, "sl_loop": True, "fp_patch": True}
    runs = result["runs"]
    assert all("error" not in r for r in runs), [r["error"] for r in runs if "error" in r]
    jobs = {(r["state"], r["job"]) for r in result["rows"] if r["safetensors"] and r["safeload"]}
    assert jobs == {(s, j) for s in ("warm", "cold") for j in ("load_file", "pread", "get_tensor loop", "from_pretrained")}
    shards = [os.path.join(result["meta"]["sample"], n) for n in os.listdir(result["meta"]["sample"])
              if n.endswith(".safetensors")]
    data_bytes = 0
    for f in shards:  # each file's data area: its size less the 8-byte length and the header
        with open(f, "rb") as fh:
            data_bytes += os.path.getsize(f) - 8 - int.from_bytes(fh.read(8), "little")
    loads = [r for r in runs if not r["contender"].startswith("ref_")]
    assert {r["bytes"] for r in loads} == {data_bytes}  # every tensor of every shard, each time
    table = (out / "main-job.md").read_text()
    assert table in p.stdout and table.count("\n| warm |") == 4 and table.count("\n| cold |") == 4
    svg = ET.parse(out / "main-job.svg").getroot()
    labels = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "warm · from_pretrained" in labels and "cold · get_tensor loop" in labels
