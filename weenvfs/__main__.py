"""`python -m weenvfs`: the same entry point as the `weenv` console script."""

from __future__ import annotations

import sys

from weenvfs.entry import main

if __name__ == "__main__":
    sys.exit(main())
