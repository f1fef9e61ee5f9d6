"""Real mounts: the mounted tree equals its source, union semantics, reads, EROFS, lifecycle.

Every environment is built by the real builder into a local store and mounted by the real
`weenv mount` (a daemon); the `mounter` fixture unmounts and stops everything.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import stat
import subprocess
from pathlib import Path

import pytest
from mounts import Mounter, publish, run_weenv
from support import layers, oci_apply, trees
from support.trees import dir, file, sparse, symlink  # noqa: A004

from weenvfs.fuse import daemon

pytestmark = [pytest.mark.requires_fuse, pytest.mark.usefixtures("both_paths")]

KIB = 1 << 10


def test_hostile_tree_mounts_exactly(tmp_path: Path, mounter: Mounter, both_paths: str) -> None:
    src = trees.hostile_tree(tmp_path / "src")
    ref = publish(tmp_path / "store", [src])
    mount = mounter.mount(ref, tmp_path / "store")
    assert mount.stats()["mount"]["path"] == both_paths
    trees.assert_trees_equal(src, mount.mountpoint)
    st = os.stat(mount.mountpoint / "big.bin")
    if both_paths == "fuse":  # EROFS reports its block size and the blocks it maps
        assert st.st_blksize >= 128 * KIB
        assert st.st_blocks == -(-st.st_size // 512)
        sparse_st = os.stat(mount.mountpoint / "sparse.img")
        assert sparse_st.st_blocks * 512 < sparse_st.st_size // 2  # holes are not counted
        assert os.stat(mount.mountpoint).st_ino == 1
    hard = {os.stat(mount.mountpoint / p).st_ino for p in ("hard/a", "hard/b", "other/c")}
    assert len(hard) == 1
    fs = os.statvfs(mount.mountpoint)
    assert fs.f_namemax == 255 and fs.f_blocks > 0
    assert fs.f_files > 0 or both_paths == "kernel"  # EROFS reports no inode count
    assert fs.f_flag & os.ST_RDONLY
    # Other users get in (allow_other) and the kernel applies the modes (default_permissions).
    assert read_as_nobody(mount.mountpoint, "owned/nobody") == (0, "n")
    assert read_as_nobody(mount.mountpoint, "private/secret")[0] != 0
    assert read_as_nobody(mount.mountpoint, "bin/noperm")[0] != 0


def read_as_nobody(mountpoint: Path, path: str) -> tuple[int, str]:
    """(exit status, output) of `cat` run as nobody on `path` below the mount; the path is
    reached through an open descriptor because the test's own folders are private to root."""
    fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        done = subprocess.run(["cat", f"/proc/self/fd/{fd}/{path}"], pass_fds=(fd,),
                              user=65534, group=65534, extra_groups=[], capture_output=True,
                              text=True, timeout=60, check=False)
    finally:
        os.close(fd)
    return done.returncode, done.stdout


def test_three_groups_equal_the_oci_union(tmp_path: Path, mounter: Mounter) -> None:
    tars = [layers.layer_file(tmp_path / f"l{n}.tar", *members)
            for n, members in enumerate(layers.union_layers())]
    expected = oci_apply.apply_layers(tmp_path / "expected", tars)
    ref = publish(tmp_path / "store", tars)
    mount = mounter.mount(ref, tmp_path / "store")
    trees.assert_trees_equal(expected, mount.mountpoint)
    assert sorted(os.listdir(mount.mountpoint / "opq")) == ["new"]
    assert not os.path.lexists(mount.mountpoint / "etc/link")


def test_random_reads_equal_an_in_memory_copy(tmp_path: Path, mounter: Mounter) -> None:
    rng = random.Random(5)
    contents = {
        "big": rng.randbytes(300 * KIB + 7),
        "exact": rng.randbytes(64 * KIB),
        **{f"small/{n:02d}": rng.randbytes(rng.randrange(1, 3000)) for n in range(30)},
    }
    specs = [file(path, data) for path, data in contents.items()]
    specs.append(sparse("sparse", 400 * KIB, {100: b"a" * 5000, 300 * KIB: b"b" * 10}))
    src = trees.make_tree(tmp_path / "src", *specs)
    contents["sparse"] = (src / "sparse").read_bytes()
    ref = publish(tmp_path / "store", [src], chunk_size=16 * KIB, batch_threshold=4 * KIB)
    mount = mounter.mount(ref, tmp_path / "store")
    for path, data in contents.items():
        size = len(data)
        fd = os.open(mount.mountpoint / path, os.O_RDONLY)
        try:
            cases = [(0, size + 100), (size, 10), (size + 4096, 1)]
            cases += [(k * 16 * KIB - 3, 6) for k in range(1, size // (16 * KIB) + 1)]
            cases += [(rng.randrange(size + 100), rng.randrange(1, 70 * KIB)) for _ in range(40)]
            for offset, length in cases:
                got = os.pread(fd, length, offset)
                assert got == data[offset : offset + length], (path, offset, length)
        finally:
            os.close(fd)
    with open(mount.mountpoint / "big", "rb") as f:  # mmap-style whole reads too
        assert f.read() == contents["big"]


def test_every_write_fails_with_erofs(tmp_path: Path, mounter: Mounter) -> None:
    src = trees.make_tree(tmp_path / "src", file("d/f", b"data", mode=0o666), dir("e"))
    mount = mounter.mount(publish(tmp_path / "store", [src]), tmp_path / "store")
    mp = mount.mountpoint
    attempts = {
        "open for writing": lambda: os.open(mp / "d/f", os.O_WRONLY),
        "open for append": lambda: os.open(mp / "d/f", os.O_RDONLY | os.O_APPEND | os.O_RDWR),
        "create": lambda: os.open(mp / "d/new", os.O_CREAT | os.O_WRONLY, 0o644),
        "truncate": lambda: os.truncate(mp / "d/f", 0),
        "mkdir": lambda: os.mkdir(mp / "d/sub"),
        "rmdir": lambda: os.rmdir(mp / "e"),
        "unlink": lambda: os.unlink(mp / "d/f"),
        "rename": lambda: os.rename(mp / "d/f", mp / "d/g"),
        "symlink": lambda: os.symlink("x", mp / "d/l"),
        "link": lambda: os.link(mp / "d/f", mp / "d/h"),
        "mknod": lambda: os.mkfifo(mp / "d/p"),
        "chmod": lambda: os.chmod(mp / "d/f", 0o600),
        "chown": lambda: os.chown(mp / "d/f", 1, 1),
        "utime": lambda: os.utime(mp / "d/f", (1, 1)),
        "setxattr": lambda: os.setxattr(mp / "d/f", "user.x", b"1"),
        "removexattr": lambda: os.removexattr(mp / "d/f", "user.x"),
    }
    for what, attempt in attempts.items():
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS, what
    assert not os.access(mp / "d/f", os.W_OK) and os.access(mp / "d/f", os.R_OK)
    assert (mp / "d/f").read_bytes() == b"data"


def test_stats_umount_and_pid_file(tmp_path: Path, mounter: Mounter) -> None:
    src = trees.make_tree(tmp_path / "src", file("f", b"x" * 100_000))
    ref = publish(tmp_path / "store", [src])
    mount = mounter.mount(ref, tmp_path / "store")
    assert (mount.mountpoint / "f").read_bytes() == b"x" * 100_000
    stats = mount.stats()
    assert stats["mount"]["ref"] == ref and stats["mount"]["pid"] == mount.pid
    assert stats["fetch"]["chunks_fetched"] >= 1
    assert "user.weenv.stats" not in os.listxattr(mount.mountpoint)
    human = run_weenv("stats", str(mount.mountpoint)).stdout
    assert "fetch.chunks_fetched" in human
    with open(mount.mountpoint / "f", "rb"):  # busy: refused, once said, with the way out
        busy = run_weenv("umount", str(mount.mountpoint), check=False)
    assert busy.returncode == 1 and busy.stderr.count("cannot unmount") == 1, busy.stderr
    assert "Device or resource busy" in busy.stderr and "--lazy" in busy.stderr
    run_weenv("umount", str(mount.mountpoint))
    assert not daemon.process_alive(mount.pid)
    assert daemon.read_pid_file(mount.mountpoint) is None
    assert not os.path.ismount(mount.mountpoint)
    assert "unmounted" in mount.log_text()


def test_sigterm_unmounts_cleanly(tmp_path: Path, mounter: Mounter) -> None:
    src = trees.make_tree(tmp_path / "src", file("f", b"1"))
    mount = mounter.mount(publish(tmp_path / "store", [src]), tmp_path / "store")
    os.kill(mount.pid, signal.SIGTERM)
    daemon.wait_exit(mount.pid, 30)
    assert not os.path.ismount(mount.mountpoint)
    assert daemon.read_pid_file(mount.mountpoint) is None


def test_mount_failures_are_one_line(tmp_path: Path, mounter: Mounter) -> None:
    src = trees.make_tree(tmp_path / "src", file("f", b"1"))
    ref = publish(tmp_path / "store", [src])
    mounted = mounter.mount(ref, tmp_path / "store")
    mp = tmp_path / "mp"
    mp.mkdir()
    cases = [
        (["mount", ref, str(mp), "--store", str(tmp_path / "nowhere")], "nowhere"),
        (["mount", "nosuch:tag", str(mp), "--store", str(tmp_path / "store")], "nosuch"),
        (["mount", ref, str(tmp_path / "src/f"), "--store", str(tmp_path / "store")],
         "not a directory"),
        (["umount", str(mp)], "not mounted"),
        (["mount", ref, str(mounted.mountpoint), "--store", str(tmp_path / "store")],
         "already a mount"),
        (["stats", str(mp)], "not a weenv mount"),
    ]
    for args, fragment in cases:
        done = run_weenv("--log-file", str(tmp_path / "fail.log"), *args, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1, (args, done.stderr)
        assert fragment in lines[0] and lines[0].startswith("weenv: error:"), lines
        assert not os.path.ismount(mp)


def test_file_types_through_the_mount(tmp_path: Path, mounter: Mounter) -> None:
    src = trees.make_tree(tmp_path / "src", file("f", b"abc", mode=0o4755),
                          symlink("l", "f"), trees.fifo("p"), trees.chardev("c", 1, 3))
    mount = mounter.mount(publish(tmp_path / "store", [src]), tmp_path / "store")
    mp = mount.mountpoint
    assert stat.S_IMODE(os.stat(mp / "f").st_mode) == 0o4755
    assert os.readlink(mp / "l") == "f" and (mp / "l").read_bytes() == b"abc"
    assert stat.S_ISFIFO(os.lstat(mp / "p").st_mode)
    assert os.lstat(mp / "c").st_rdev == os.makedev(1, 3)
    with os.scandir(mp) as it:
        kinds = {e.name: e.is_dir() for e in it}
    assert kinds == {"f": False, "l": False, "p": False, "c": False}
