"""benches/e2e.py end to end: unmodified transformers and diffusers ``from_pretrained``, and the
weight readers of vLLM and ltx-core, stock and with ``SAFELOAD_PATCH=1``, in fresh processes. In a
smoke run (``--benchmark-disable``, CI) the models are tiny and every state runs once; the checks
are that every run loaded, that each variant's weights are byte-identical to stock's, and that the
patched runs really were patched. Client cases run where this interpreter imports the client (the
clients' virtualenv, docs/benchmarks.md) and skip elsewhere. For figures, run
``python benches/e2e.py`` itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

import slowfs  # noqa: E402

VLLM_KINDS = "vllm-default,vllm-eager,vllm-prefetch,vllm-multithread"


def _e2e(tmp_path: Path, *args: str) -> Dict[str, Any]:
    """Runs benches/e2e.py with ``args``; its JSON result, after checking it exited 0."""
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, os.path.join(HERE, "e2e.py"), "--out", str(out), *args],
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    print(p.stdout)
    return json.loads(out.read_text())


@pytest.mark.parametrize(("module", "libs"), [("transformers", "transformers"), ("diffusers", "diffusers"),
                                              ("vllm", VLLM_KINDS), ("ltx_core", "ltx")])
def test_e2e_loads(module: str, libs: str, tiny: bool, tmp_path: Path) -> None:
    pytest.importorskip(module)
    states = "warm,cold" + ("" if slowfs.fuse_unavailable() else ",fuse,hf-mount")
    size, rounds = ("tiny", 1) if tiny else ("small", 1)
    data = os.environ.get("SAFELOAD_BENCH_DATA", str(tmp_path / "data"))
    result = _e2e(tmp_path, "--size", size, "--rounds", str(rounds), "--libs", libs, "--states", states,
                  "--data-dir", data, "--python", sys.executable)
    assert result["identical"] == {lib: True for lib in libs.split(",")}
    assert result["skipped"] == {}
    runs = result["runs"]
    assert runs and all("error" not in r for r in runs), [r.get("error") for r in runs]
    assert {r["patched"] for r in runs if r["variant"] == "patch"} == {True}
    assert {r["patched"] for r in runs if r["variant"] == "stock"} == {False}


def test_e2e_skips_missing_client(tmp_path: Path) -> None:
    """A client its interpreter cannot run is reported as skipped, with the reason; the run goes on."""
    missing = str(tmp_path / "no-such-python")
    result = _e2e(tmp_path, "--libs", "vllm-default,ltx", "--states", "warm", "--python", missing,
                  "--data-dir", str(tmp_path / "data"))
    assert set(result["skipped"]) == {"vllm-default", "ltx"}
    assert all(missing in why for why in result["skipped"].values()), result["skipped"]
    assert result["runs"] == []


def test_e2e_against_another_build(tmp_path: Path) -> None:
    """``--against NAME=DIR`` runs the build whose package is in DIR as one more patched variant in
    the same rounds: its workers import that package (here a copy of this one, so the weights must
    be identical), the others their own."""
    pytest.importorskip("transformers")
    import shutil

    import safeload

    own = os.path.dirname(os.path.dirname(os.path.abspath(safeload.__file__)))
    other = tmp_path / "other"
    shutil.copytree(os.path.join(own, "safeload"), other / "safeload",
                    ignore=shutil.ignore_patterns("__pycache__"))
    result = _e2e(tmp_path, "--size", "tiny", "--rounds", "1", "--libs", "transformers", "--states", "warm",
                  "--variants", "stock,patch", "--against", f"copy={other}", "--data-dir", str(tmp_path / "data"))
    assert result["identical"] == {"transformers": True}
    runs = {r["variant"]: r for r in result["runs"]}
    assert set(runs) == {"stock", "patch", "patch@copy"}
    assert runs["patch@copy"]["patched"] and runs["patch@copy"]["package"] == str(other)
    assert runs["patch"]["package"] == own
    assert "vs_stock" in result["rows"][0]["patch@copy"]
    with pytest.raises(AssertionError, match="expected NAME=DIR"):
        _e2e(tmp_path, "--libs", "transformers", "--states", "warm", "--against", f"copy={tmp_path}")
