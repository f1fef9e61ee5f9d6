"""`daemon.is_mounted` reads /proc/self/mounts, where the kernel escapes spaces, tabs,
newlines and backslashes of a mount point as octal; `mount_points` reads it once for a
caller that asks about many mount points (`mounts.list_mounts`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from weenvfs.fuse import daemon

pytestmark = pytest.mark.usefixtures("requires_fuse")  # root, and mounts that work


@pytest.mark.parametrize("name", ["plain", "a space", "tab\there", "back\\slash"])
def test_is_mounted_sees_a_mount_point_the_kernel_escapes(tmp_path: Path, name: str) -> None:
    mp = tmp_path / name
    other = tmp_path / "not-mounted"
    mp.mkdir()
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "weenv-test", str(mp)], check=True)
    try:
        points = daemon.mount_points()
        assert points is not None and daemon.is_mounted(mp, points)
        assert daemon.is_mounted(mp) and not daemon.is_mounted(other, points)
    finally:
        subprocess.run(["umount", str(mp)], check=True)
    assert not daemon.is_mounted(mp)
    assert daemon.is_mounted(mp, points)  # a snapshot answers as of when it was taken
