"""Which OCI runtime a sandbox uses: crun where it is installed, else runc.

crun starts a sandbox ~10 ms sooner and runs each exec ~3x faster than runc (crun.py says
why), so it is the default; runc stays the fallback and can be asked for. `$WEENV_RUNTIME`
(`crun` or `runc`) picks one for new sandboxes; an unknown name, or a runtime that is not
installed, is an error, not a silent fallback. A sandbox keeps the runtime that made it (its
state records the name), so changing the default or installing crun never strands a running
sandbox: `launcher_named` gives it back its own. Uninstalling that runtime does not strand it
either: its launcher can still tell whether it runs and remove it (launcher.py); only what
runs the runtime's program (exec) fails, naming the package to install.

Owns: `default_launcher`, `launcher_named`, `installed_launchers`. Must not: drive a runtime
(launcher.py, crun.py).
"""

from __future__ import annotations

import os
import shutil

from weenvfs.errors import UsageError

from .crun import CrunLauncher
from .launcher import Launcher, RuncLauncher

RUNTIME_ENV = "WEENV_RUNTIME"
LAUNCHERS: dict[str, type[Launcher]] = {"crun": CrunLauncher, "runc": RuncLauncher}
PREFERENCE = ("crun", "runc")


def default_launcher() -> Launcher:
    """The launcher for a new sandbox: $WEENV_RUNTIME's, else the first installed of
    PREFERENCE (runc's, with its own "not found" error, when neither is)."""
    chosen = os.environ.get(RUNTIME_ENV, "").strip()
    if chosen:
        launcher = launcher_named(chosen)
        launcher.check_installed()
        return launcher
    for name in PREFERENCE:
        if shutil.which(name):
            return launcher_named(name)
    launcher = RuncLauncher()
    launcher.check_installed()  # raises: runc not found (install the Debian package runc)
    return launcher


def launcher_named(name: str) -> Launcher:
    """The launcher of runtime `name` (UsageError for an unknown one), installed or not (see
    the module)."""
    try:
        kind = LAUNCHERS[name]
    except KeyError:
        raise UsageError(f"unknown OCI runtime {name!r} in ${RUNTIME_ENV} "
                         f"(known: {', '.join(sorted(LAUNCHERS))})") from None
    return kind()


def installed_launchers() -> list[Launcher]:
    """A launcher of every runtime installed here (for gc: containers of either)."""
    return [launcher_named(name) for name in PREFERENCE if shutil.which(name)]
