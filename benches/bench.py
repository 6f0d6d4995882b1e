#!/usr/bin/env python3
"""Runs safeload's benchmark harness from a checkout: ``python benches/bench.py [options]``.

Same as ``python -m safeload bench``; see ``python benches/bench.py --help``.  Needs the
extension built (``maturin develop``), e.g. the editable install in .venv.
"""

import os
import sys

try:
    from safeload.bench import main
except ImportError:  # not installed: use the package in this checkout (python/safeload)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from safeload.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="benches/bench.py"))
