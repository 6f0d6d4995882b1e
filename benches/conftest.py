"""pytest-benchmark suite: every case runs for safetensors 0.8 and for safeload in the same run.

    pytest benches/                                   # the real thing (test_large.py writes 2.7 GiB of samples)
    pytest benches/test_pt.py --benchmark-autosave    # saved under .benchmarks/ for pytest-benchmark compare
    pytest benches/ --benchmark-disable               # smoke run: tiny sizes, each case once (CI)

``test_pt.py`` follows safetensors' own ``bindings/python/benches/test_pt.py`` (GPT-2 and LoRA
shapes, ``load_file`` with each backend, ``save_file``) with every case parametrised over
``lib`` and both libraries' cases in one pytest-benchmark group, so the table shows each pair side
by side. ``test_large.py`` times the 2.5 GiB Llama-shaped sample and 20k small tensors in fresh
processes. At the end of a real run the terminal summary prints safetensors/safeload ratios.

Sizes shrink to a few MiB when benchmarks are disabled (``--benchmark-disable``) or
``SAFELOAD_BENCH_TINY=1``, so CI runs every code path in seconds.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, List

import pytest

LIBS = ("safetensors", "safeload")

# group -> lib -> median seconds (test_pt.py); report lines of test_large.py
_PAIRS: Dict[str, Dict[str, float]] = {}
_LARGE: List[str] = []


def pytest_generate_tests(metafunc: Any) -> None:
    if "lib" in metafunc.fixturenames:
        metafunc.parametrize("lib", LIBS)


@pytest.fixture(scope="session")
def tiny(pytestconfig: Any) -> bool:
    """True for a smoke run: benchmarks disabled or SAFELOAD_BENCH_TINY=1."""
    disabled = bool(pytestconfig.getoption("benchmark_disable", default=False))
    return disabled or os.environ.get("SAFELOAD_BENCH_TINY", "") not in ("", "0")


@pytest.fixture
def lib_torch(lib: str) -> Any:
    """``safetensors.torch`` or ``safeload.torch``."""
    return importlib.import_module(f"{lib}.torch")


@pytest.fixture
def record_pair(benchmark: Any, lib: str) -> Any:
    """Call after ``benchmark(...)``: files the median under the benchmark's group for the ratio table."""

    def record() -> None:
        stats = getattr(benchmark, "stats", None)
        if stats is None or not benchmark.group:  # --benchmark-disable: nothing was timed
            return
        _PAIRS.setdefault(benchmark.group, {})[lib] = stats.stats.median

    return record


@pytest.fixture(scope="session")
def large_rows() -> List[str]:
    """test_large.py appends its report lines for the terminal summary."""
    return _LARGE


def pytest_terminal_summary(terminalreporter: Any) -> None:
    tr = terminalreporter
    pairs = {g: v for g, v in _PAIRS.items() if all(lib in v for lib in LIBS)}
    if pairs:
        tr.section("safeload vs safetensors 0.8 (test_pt.py medians; ratio > 1: safeload faster)")
        width = max(len(g) for g in pairs)
        tr.write_line(f"{'group':<{width}}  {'safetensors':>12}  {'safeload':>12}  {'ratio':>6}")
        for group in sorted(pairs):
            st, sl = pairs[group]["safetensors"], pairs[group]["safeload"]
            tr.write_line(f"{group:<{width}}  {st * 1e3:>10.2f}ms  {sl * 1e3:>10.2f}ms  {st / sl:>6.2f}")
    if _LARGE:
        tr.section("fresh processes (test_large.py; ratio > 1: safeload faster)")
        for line in _LARGE:
            tr.write_line(line.rstrip())
