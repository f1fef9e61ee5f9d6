"""Where WeEnv's native programs are (native/*.c: the data-device server, the cgroup view crun
runs in): next to this Python's interpreter, where scripts/setup.sh installs them; in the
package's `_native` folder, where a wheel carries them (setup.py); else on the PATH. And the
`weenv` command a user runs (setup.sh's native launcher, or pip's script), for the demo and
the benchmarks, which drive the CLI as users do.

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


def weenv_command() -> list[str]:
    """`weenv` as a user runs it: the installed command next to this interpreter (setup.sh's
    native launcher, which hands `weenv run` and `pull` to the node service), else this
    interpreter's module (never another installation's `weenv` on the PATH)."""
    script = Path(sys.executable).parent / "weenv"
    return [str(script)] if script.exists() else [sys.executable, "-m", "weenvfs"]
