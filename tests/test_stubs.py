"""The hand-written stubs of the Rust module match it (mypy.stubtest, as pydantic-core does)."""

import subprocess
import sys


def test_stubtest_finds_no_differences():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "safeload._safeload"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
