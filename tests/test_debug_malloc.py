"""The reader under CPython's debug allocator (PYTHONMALLOC=debug): buffer-protocol objects,
tensors outliving handles and errors raised from Rust leave the allocator's checks silent."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_core_tests_pass_under_debug_allocator():
    env = dict(os.environ, PYTHONMALLOC="debug", PYTHONFAULTHANDLER="1")
    # The timing-bound tests (Ctrl-C within 0.5 s, RSS over 1,000 cycles) are left out: the debug
    # allocator slows Python down and pads every block, which says nothing about safeload.
    files = ["test_engine.py", "test_malformed.py", "test_robustness.py", "test_slices.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files,
         "-k", "not ctrl_c and not thousand_cycles"],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
