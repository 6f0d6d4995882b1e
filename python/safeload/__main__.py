"""``python -m safeload COMMAND ...``: the ``safeload`` command line (see ``safeload.cli``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
