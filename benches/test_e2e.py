"""benches/e2e.py end to end: unmodified transformers and diffusers ``from_pretrained``, stock and
with ``SAFELOAD_PATCH=1``, in fresh processes. In a smoke run (``--benchmark-disable``, CI) the
models are tiny and every state runs once; the checks are that every run loaded, that each
variant's weights are byte-identical to stock's, and that the patched runs really were patched.
For figures, run ``python benches/e2e.py`` itself (README, Benchmarks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

import slowfs  # noqa: E402


@pytest.mark.parametrize("library", ["transformers", "diffusers"])
def test_e2e_from_pretrained(library, tiny, tmp_path):
    lib = library  # "lib" is conftest's safetensors/safeload parameter
    pytest.importorskip(lib)
    states = "warm,cold" + ("" if slowfs.fuse_unavailable() else ",fuse,hf-mount")
    size, rounds = ("tiny", 1) if tiny else ("small", 1)
    out = tmp_path / "e2e.json"
    data = os.environ.get("SAFELOAD_BENCH_DATA", str(tmp_path / "data"))
    p = subprocess.run([sys.executable, os.path.join(HERE, "e2e.py"), "--size", size, "--rounds", str(rounds),
                        "--libs", lib, "--states", states, "--data-dir", data, "--out", str(out)],
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["identical"] == {lib: True}
    runs = result["runs"]
    assert runs and all("error" not in r for r in runs), [r.get("error") for r in runs]
    assert {r["patched"] for r in runs if r["variant"] == "patch"} == {True}
    assert {r["patched"] for r in runs if r["variant"] == "stock"} == {False}
    print(p.stdout)
