"""Holders of copies of our mounts: processes in mount namespaces of their own, made by
util-linux `unshare` while the mounts are up (as `ip netns exec` or a service with private
mounts would), and ended by the `holders` fixture's owner."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.polling import wait_for


class Holder:
    """A process in a mount namespace of its own, made now: it holds a copy of every mount
    that is up (with `propagation` "private" no later umount of ours reaches it); with
    `cwd`, it works in that folder of its copy (a copy in use)."""

    def __init__(self, propagation: str, cwd: Path | None = None) -> None:
        workdir = ["--wd", str(cwd)] if cwd is not None else []
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", propagation, *workdir, "sleep", "300"])
        ours = os.stat("/proc/self/ns/mnt").st_ino
        wait_for(lambda: self._namespace() not in (None, ours), "the holder's namespace", 10)

    def _namespace(self) -> int | None:
        try:
            return os.stat(f"/proc/{self.proc.pid}/ns/mnt").st_ino
        except OSError:
            return None

    def mounts_under(self, *folders: Path) -> list[str]:
        """Mount points the holder's namespace shows under `folders`."""
        table = Path(f"/proc/{self.proc.pid}/mountinfo").read_text()
        points = [line.split(" ")[4] for line in table.splitlines()]
        return [p for p in points if any(p.startswith(str(f)) for f in folders)]

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    try:
        yield made
    finally:
        for holder in made:
            holder.end()
