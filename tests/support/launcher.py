"""`build_launcher(folder)`: native/weenv-launch.c compiled for this test run's interpreter and
code folders, as scripts/setup.sh builds `.venv/bin/weenv` (tests/conftest.py's `launcher`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from weenvfs.fuse import node_socket

SOURCE = Path(__file__).resolve().parents[2] / "native" / "weenv-launch.c"


def _literal(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def build_launcher(folder: Path) -> Path | None:
    """The launcher built into `folder`, or None without gcc."""
    compiler = shutil.which("gcc")  # as scripts/setup.sh builds it
    if compiler is None:
        return None
    target = folder / "weenv"
    subprocess.run(
        [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
         f"-DWEENV_PYTHON={_literal(sys.executable)}",
         f"-DWEENV_PACKAGE={_literal(node_socket.PACKAGE)}",
         f"-DWEENV_CODE_DIRS={_literal(':'.join(node_socket._code_folders()))}",
         "-o", str(target), str(SOURCE)], check=True, capture_output=True)
    return target

