"""`run_weenv_measured`: the `weenv` CLI in a subprocess, with the peak resident memory of that
process (its `ru_maxrss`, from `wait4`), for tests that bound what hostile input may make a
command allocate. A resource bound, not a timing assertion.

Must not: measure anything but the one process it started (children it waits for are not
counted, so a daemon's memory is read from /proc by the mount tests instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass

MIB = 1 << 20
# A weenv command that reads one object of each kind and refuses the rest stays far below this
# (about 60-120 MiB: the interpreter, boto3 where it is used, the limits' worth of data);
# reading a 512 MiB object or gigabytes whole would pass it.
MEMORY_BOUND = 300 * MIB


@dataclass(frozen=True)
class Measured:
    """How one `weenv` run ended and its peak resident memory in bytes."""

    returncode: int
    stdout: str
    stderr: str
    maxrss: int


def run_weenv_measured(
    *argv: str, env: Mapping[str, str] | None = None, timeout: float = 300.0
) -> Measured:
    """`python -m weenvfs ARGV` to completion; output through files (no pipe to deadlock on).
    Killed after `timeout` seconds (a hang guard: the test then fails on its exit status)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weenvfs", *argv],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            env=None if env is None else {**os.environ, **env},
        )
        guard = threading.Timer(timeout, proc.kill)
        guard.start()
        try:
            # wait4, not Popen.wait: only wait4 gives this one process's resource usage.
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            guard.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Measured(
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            usage.ru_maxrss * 1024,  # kilobytes on Linux
        )
