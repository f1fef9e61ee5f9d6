"""A server process of ours on this machine, for tests, benchmarks and `weenv dev`: SeaweedFS
(store/seaweed.py) and the Docker registry (tools/registry_server.py) are built on it.

Owns: `free_ports` (loopback ports free a moment ago), `parent_death_signal` (the child dies
with us), and `LocalServer`, their common base: a folder (a new temp folder, deleted at stop,
or a given one, kept), `_popen` (stdin closed, output appended to a log, a session of its own,
SIGTERM when the starting thread ends), `stop` (SIGTERM, SIGKILL after a grace period, reap,
remove a temp folder) and `with`.

Must not: know what the server serves (the subclasses write its config, start and wait for
it), or signal a process it did not start.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGTERM when its parent dies, so a killed test
    run leaks no server (Linux prctl). libc is loaded here, in the parent: the child, forked
    from a process with threads, must only make the one call."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LocalServer:
    """One server process in `directory` (None: a new temp folder named `temp_prefix...`,
    removed at stop). Subclasses implement `start()`, which calls `_popen`."""

    def __init__(self, directory: Path | str | None, temp_prefix: str) -> None:
        self._temp = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix=temp_prefix)).absolute()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def is_temp(self) -> bool:
        """Whether the folder is a temp folder, deleted at stop."""
        return self._temp

    def start(self) -> Self:
        """Start the server; return when it serves."""
        raise NotImplementedError

    def _popen(self, argv: Sequence[str], log: Path, **options: Any) -> None:
        """Start `argv` as this server's process, its output appended to `log`."""
        log_file = open(log, "ab")  # noqa: SIM115 - owned by the child
        try:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in a terminal reaches us, not the server
                preexec_fn=parent_death_signal(), **options,
            )
        finally:
            log_file.close()

    def stop(self, grace: float = 10.0) -> None:
        """End the server: SIGTERM and `grace` seconds before SIGKILL (0: SIGKILL at once);
        then remove the folder if it is a temp folder."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._reap()
        if self._temp:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _reap(self) -> None:
        """Kill the process if it still runs, and wait for it."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self.process = None

    def __enter__(self) -> Self:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
