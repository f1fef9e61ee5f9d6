"""Build hook: a wheel carries the native programs.

Everything else is declared in pyproject.toml. A wheel (or a `pip install` from the source
tree) compiles with the system's C compiler, into the package's `weenvfs/_native/`, where
the code looks for them (weenvfs/native_programs.py): native/weenv-devserve.c, the kernel
path's device server, native/weenv-cgroup-view.c, the private cgroup view crun runs in
on a hybrid cgroup host, and native/weenv-standby.c, the init of a sandbox started ahead of a
warm run (runtime/standby.py); the wheel is then tagged for this platform. Without a compiler the
build goes on without them and says so: mounts then serve their data devices from Python
(`weenv stats` reports why), and crun runs through unshare, sh and umount. An editable
install (scripts/setup.sh) builds nothing here: setup.sh compiles them next to the venv's
python instead (and the native `weenv` launcher, which only such an install has).
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

# Each program: its source, and what it is without it (for the warning).
PROGRAMS = {"weenv-devserve": "mounts will serve their data devices from Python",
            "weenv-cgroup-view": "crun will run through unshare, sh and umount",
            "weenv-standby": "every weenv run will start its sandbox itself"}
SOURCE = Path("native") / "weenv-devserve.c"  # the wheel is native when this one builds
FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def _compiler() -> str | None:
    """The C compiler: $CC, else the one Python was built with, else cc or gcc on PATH."""
    named = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "").split(" ")[0]
    for candidate in (named, "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _extra_arguments(source: Path) -> list[str]:
    """What a program needs besides the common flags, as scripts/setup.sh builds it: the
    standby init is static; the device server's fetching (zstd, BLAKE3) is what
    native/decode-flags.sh prints (nothing where they are missing: it then leaves every
    fetch to the daemon)."""
    if source.name == "weenv-standby.c":
        return ["-static"]  # it runs inside the sandbox's image, whatever its C library
    if source != SOURCE:
        return []
    done = subprocess.run(["bash", str(Path("native") / "decode-flags.sh")],
                          capture_output=True, text=True, check=False)
    return done.stdout.split() if done.returncode == 0 else []


class BuildWithServer(build_py):
    """build_py, then the native programs into the build folder (not for editable installs)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        compiler = _compiler()
        for name, without in PROGRAMS.items():
            source = Path("native") / f"{name}.c"
            if source.is_file():
                self._build(compiler, source, Path("weenvfs") / "_native" / name, without)

    def _build(self, compiler: str | None, source: Path, name: Path, without: str) -> None:
        target = Path(self.build_lib) / name
        if compiler is None:
            print(f"warning: no C compiler: {name} is not built; {without}")
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([compiler, *FLAGS, "-o", str(target), str(source),
                               *_extra_arguments(source)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"warning: {compiler} could not build {name} ({done.stderr.strip()}); "
                  f"{without}")
            target.unlink(missing_ok=True)
            return
        target.chmod(0o755)


class PlatformWhenNative(Distribution):
    """A distribution whose wheel is tagged for this platform: it carries the server (asked
    before anything is built, so decided by whether there is a compiler and the source)."""

    def has_ext_modules(self) -> bool:
        return (SOURCE.is_file() and _compiler() is not None) or super().has_ext_modules()


setup(cmdclass={"build_py": BuildWithServer}, distclass=PlatformWhenNative)
