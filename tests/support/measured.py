"""`run_weenv_measured`: the `weenv` CLI in a subprocess, with the peak resident memory of that
process (its `ru_maxrss`), for tests that bound what hostile input may make a command
allocate. A resource bound, not a timing assertion.

Linux counts in a process's `ru_maxrss` the resident size of the process it was forked from
(exec records the old address space's peak), so a child forked by pytest would report
pytest's own hundreds of MB. The command is therefore forked by a small launcher (a bare
interpreter), which reports the command's `wait4` usage.

Must not: measure anything but the one command (children it waits for are not counted, so a
daemon's memory is read from /proc by the mount tests instead).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
# A weenv command that reads one object of each kind and refuses the rest stays far below this
# (about 40-100 MiB: the interpreter, boto3 where it is used, the limits' worth of data);
# reading a 320 MiB object or gigabytes whole would pass it.
MEMORY_BOUND = 300 * MIB

# Forks and execs the command (argv[2:]), waits for it, writes {"status", "maxrss"} (maxrss in
# KiB) to the file argv[1] and exits with the command's exit code.
_LAUNCHER = """
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as out:
    json.dump({"status": os.waitstatus_to_exitcode(status), "maxrss": usage.ru_maxrss}, out)
"""


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
    Killed, with its launcher, after `timeout` seconds (a hang guard)."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "out", "w+b") as out, \
            open(Path(tmp) / "err", "w+b") as err:
        report = Path(tmp) / "usage.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(report), "-m", "weenvfs", *argv],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
            env=None if env is None else {**os.environ, **env},
        )
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the launcher and weenv
            proc.wait()
            raise
        usage = json.loads(report.read_text())
        out.seek(0)
        err.seek(0)
        return Measured(
            usage["status"],
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            usage["maxrss"] * 1024,  # kilobytes on Linux
        )
