"""Build hook: a wheel carries the kernel path's native device server.

Everything else is declared in pyproject.toml. A wheel (or a `pip install` from the source
tree) compiles native/weenv-devserve.c with the system's C compiler into the package as
`weenvfs/_native/weenv-devserve`, where mounts look for it (fuse/native_devices.py
`choose_server`); the wheel is then tagged for this platform. Without a compiler the build
goes on without it, says so, and mounts serve their data devices from Python (`weenv stats`
reports why). An editable install (scripts/setup.sh) builds nothing here: setup.sh compiles
the server next to the venv's python instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

SOURCE = Path("native") / "weenv-devserve.c"
TARGET = Path("weenvfs") / "_native" / "weenv-devserve"
FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def _compiler() -> str | None:
    """The C compiler: $CC, else the one Python was built with, else cc or gcc on PATH."""
    named = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "").split(" ")[0]
    for candidate in (named, "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


class BuildWithServer(build_py):
    """build_py, then the native server into the build folder (not for editable installs)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False) or not SOURCE.is_file():
            return
        compiler = _compiler()
        target = Path(self.build_lib) / TARGET
        if compiler is None:
            print(f"warning: no C compiler: {TARGET} is not built; mounts will serve their "
                  "data devices from Python")
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([compiler, *FLAGS, "-o", str(target), str(SOURCE)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"warning: {compiler} could not build {TARGET} ({done.stderr.strip()}); "
                  "mounts will serve their data devices from Python")
            target.unlink(missing_ok=True)
            return
        target.chmod(0o755)


class PlatformWhenNative(Distribution):
    """A distribution whose wheel is tagged for this platform: it carries the server (asked
    before anything is built, so decided by whether there is a compiler and the source)."""

    def has_ext_modules(self) -> bool:
        return (SOURCE.is_file() and _compiler() is not None) or super().has_ext_modules()


setup(cmdclass={"build_py": BuildWithServer}, distclass=PlatformWhenNative)
