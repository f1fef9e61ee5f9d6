"""Copies of our mounts in other mount namespaces (mount_copies.py): a namespace made while a
mount is up (`unshare -m`, `ip netns exec`) holds a copy that, on a host whose root mount is
private, no umount of ours reaches. Removing the folder we unmounted detaches the copies, so
the kernel releases the mount's devices and its daemon exits; where the folder is a user's
and stays, the error of the daemon that cannot exit names who holds the copy.

Real parts: `weenv mount` daemons (kernel path: EROFS layers, overlayfs, the device folder),
tmpfs mounts, and holder namespaces made by util-linux `unshare`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from mounts import Mounter
from support import layers
from support.namespaces import Holder
from support.trees import dir, file  # noqa: A004

from weenvfs.errors import WeenvError
from weenvfs.fuse import daemon
from weenvfs.fuse.mount_copies import holders_elsewhere, remove_mount_folder
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, build_group, open_source
from weenvfs.tools.publish import compose_env

pytestmark = pytest.mark.requires_fuse


@pytest.fixture(autouse=True)
def _root(require_or_skip: object) -> None:
    require_or_skip(os.geteuid() == 0, "mounts and namespaces need root")  # type: ignore[operator]


def _two_groups(tmp_path: Path) -> tuple[Path, str]:
    low = layers.layer_file(tmp_path / "low.tar", dir("etc"), file("etc/hostname", b"low\n"))
    high = layers.layer_file(tmp_path / "high.tar", dir("work"), file("work/task", b"t\n"))
    store_dir = tmp_path / "store"
    repo = Repository(open_store(str(store_dir), create=True))
    build_group(open_source(low), repo, "low", "t", BuildOptions())
    build_group(open_source(high), repo, "high", "t", BuildOptions())
    compose_env(repo, "two", "t", ["low:t", "high:t"])
    return store_dir, "two:t"


def test_holders_elsewhere_names_a_copy_until_its_folder_is_removed(
        tmp_path: Path, holders: list[Holder]) -> None:
    folder = tmp_path / "a b\nc"  # escaped in the mount tables
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "weenv-test", str(folder)], check=True)
    try:
        assert holders_elsewhere([folder]) == []  # ours only
        holders.append(Holder("private"))
        subprocess.run(["umount", str(folder)], check=True)
        assert holders_elsewhere([folder]) == [(holders[0].proc.pid, "sleep")]
        remove_mount_folder(folder)
        assert not folder.exists() and holders_elsewhere([folder]) == []
        assert holders[0].mounts_under(tmp_path) == []
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


@pytest.mark.parametrize(("path", "propagation"),
                         [("kernel", "private"), ("kernel", "slave"), ("fuse", "private")])
def test_removing_the_mount_point_releases_every_copy_and_the_daemon_exits(
        tmp_path: Path, mounter: Mounter, holders: list[Holder], path: str,
        propagation: str) -> None:
    """A merged mount, on the kernel path an overlay at the mount point over private EROFS
    layers on a device folder, each copied into the holder's namespace (on the FUSE path the
    tree's one FUSE mount). The unmount that removes the mount point returns once the daemon
    exited (its layer and device folders went with their mounts), and the holder keeps none
    of it. (Before: the daemon waited for a release that never came; the unmount failed
    after its timeout.)"""
    store_dir, ref = _two_groups(tmp_path)
    mount = mounter.mount(ref, store_dir, extra=["--path", path])
    assert mount.stats()["mount"]["path"] == path
    assert (mount.mountpoint / "work" / "task").read_bytes() == b"t\n"
    private = daemon.kernel_dir(mount.mountpoint)
    holders.append(Holder(propagation))
    assert holders[0].mounts_under(mount.mountpoint, private) != []
    assert daemon.unmount(mount.mountpoint, remove=True, timeout=20) == mount.pid
    assert not daemon.process_alive(mount.pid)
    assert holders[0].mounts_under(mount.mountpoint, private) == []
    assert not mount.mountpoint.exists() and not private.exists()


def test_a_daemon_held_by_a_copy_of_a_users_mount_point_names_the_holder(
        tmp_path: Path, mounter: Mounter, holders: list[Holder]) -> None:
    """A user's mount point is never removed, so the copy stays: the unmount's error says
    who holds it, and the daemon serves the copy until its holder ends, then exits."""
    store_dir, ref = _two_groups(tmp_path)
    mount = mounter.mount(ref, store_dir, extra=["--path", "kernel", "--layer", "0"])
    holders.append(Holder("private"))
    holder = holders[0].proc.pid
    told = (rf"mount daemon {mount.pid} still runs: other mount namespaces hold a copy of "
            rf".*\(pid {holder} \(sleep\)\)")
    with pytest.raises(WeenvError, match=told):
        daemon.unmount(mount.mountpoint)  # told after HELD_CHECK, not after the timeout
    assert mount.mountpoint.is_dir() and daemon.process_alive(mount.pid)
    holders.pop().end()
    daemon.wait_exit(mount.pid, 20)
