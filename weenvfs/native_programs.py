"""Where WeEnv's native programs are (native/*.c: the data-device server, the cgroup view crun
runs in): next to this Python's interpreter, where scripts/setup.sh installs them; in the
package's `_native` folder, where a wheel carries them (setup.py); else on the PATH.

Must not: import anything but the standard library (every room that runs one uses this).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

PACKAGED = Path(__file__).resolve().parent / "_native"  # a wheel's (setup.py)


def find(name: str, path: str | None = None) -> str | None:
    """The executable native program `name`, or None where it is not installed (`path`: the
    PATH to search last, default $PATH)."""
    places = (Path(sys.executable).parent / name, PACKAGED / name)
    found = next((str(p) for p in places if os.access(p, os.X_OK)), None)
    return found or shutil.which(name, path=path)
