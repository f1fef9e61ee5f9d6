"""`weenv mount --layer N`: each group as a kernel overlayfs lower layer. Stacked by the real
overlayfs, the layer mounts must give exactly the merged mount's tree (and the OCI union)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from mounts import Mounter, publish, run_weenv
from support import layers, oci_apply, trees
from support.trees import dir, file, with_parents  # noqa: A004

pytestmark = pytest.mark.requires_fuse


@contextlib.contextmanager
def overlay(target: Path, lowers: Sequence[Path]) -> Iterator[Path]:
    """A read-only kernel overlay of `lowers` (topmost first) at `target`, unmounted after."""
    target.mkdir()
    options = "lowerdir=" + ":".join(str(p) for p in lowers)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(target)],
                   check=True, capture_output=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def layer_mounts(mounter: Mounter, ref: str, store: Path, count: int) -> list[Path]:
    """Mount groups 0..count-1 of `ref` with --layer; their mount points, topmost first."""
    return [mounter.mount(ref, store, extra=["--layer", str(n)]).mountpoint
            for n in reversed(range(count))]


def test_stacked_layers_equal_the_merged_mount_and_the_oci_union(
    tmp_path: Path, mounter: Mounter
) -> None:
    tars = [layers.layer_file(tmp_path / f"l{n}.tar", *members)
            for n, members in enumerate(layers.union_layers())]
    expected = oci_apply.apply_layers(tmp_path / "expected", tars)
    ref = publish(tmp_path / "store", tars)
    merged = mounter.mount(ref, tmp_path / "store").mountpoint
    lowers = layer_mounts(mounter, ref, tmp_path / "store", len(tars))
    with overlay(tmp_path / "stack", lowers) as stack:
        trees.assert_trees_equal(expected, stack)
        trees.assert_trees_equal(merged, stack)
    # What overlayfs reads from the layer of the middle group: its whiteouts as 0/0 devices
    # (in directories with something below) and its opaque directory marked.
    mid = lowers[1]
    st = os.lstat(mid / "etc/b")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert os.getxattr(mid / "opq", "trusted.overlay.opaque") == b"y"
    assert sorted(os.listdir(mid / "opq")) == ["new"]
    assert not os.path.lexists(mid / "keep")  # only the group's own entries


def test_implied_directories_and_pointless_whiteouts(tmp_path: Path, mounter: Mounter) -> None:
    low = layers.layer_file(tmp_path / "low.tar", *with_parents([
        dir(".", mtime=5), dir("a", mode=0o700, uid=7, gid=8, mtime=123_000_000_000),
        file("a/x", b"x"),
    ]))
    # No directory entries at all: `a` and `a/b` are implied, `new` is new and holds a
    # whiteout that hides nothing (overlayfs would list it: this directory is in one layer).
    top = layers.layer_file(tmp_path / "top.tar", file("a/b/c", b"c"), file("new/f", b"f"),
                            layers.whiteout("new/ghost"), layers.whiteout("a/x"))
    expected = oci_apply.apply_layers(tmp_path / "expected", [low, top])
    ref = publish(tmp_path / "store", [low, top])
    merged = mounter.mount(ref, tmp_path / "store").mountpoint
    lowers = layer_mounts(mounter, ref, tmp_path / "store", 2)
    with overlay(tmp_path / "stack", lowers) as stack:
        trees.assert_trees_equal(expected, stack, ignore=["mtime_of_dirs"])
        trees.assert_trees_equal(merged, stack)
        a = os.stat(stack / "a")
        assert (stat.S_IMODE(a.st_mode), a.st_uid, a.st_gid) == (0o700, 7, 8)
        assert os.listdir(stack / "new") == ["f"]
        assert not os.path.lexists(stack / "a/x")
    assert not os.path.lexists(lowers[0] / "new/ghost")


def test_overlay_xattrs_of_an_image_are_not_passed_on(tmp_path: Path, mounter: Mounter) -> None:
    """An image cannot steer overlayfs: its own trusted.overlay.* xattrs never reach it."""
    low = trees.make_tree(tmp_path / "low", file("d/kept", b"k"))
    top = trees.make_tree(tmp_path / "top", dir("d", xattrs={
        "trusted.overlay.opaque": b"y", "user.note": b"n"}))
    ref = publish(tmp_path / "store", [low, top])
    lowers = layer_mounts(mounter, ref, tmp_path / "store", 2)
    assert os.listxattr(lowers[0] / "d") == ["user.note"]
    with pytest.raises(OSError) as info:
        os.getxattr(lowers[0] / "d", "trusted.overlay.opaque")
    assert info.value.errno == errno.ENODATA
    with overlay(tmp_path / "stack", lowers) as stack:
        assert os.listdir(stack / "d") == ["kept"]


def test_layer_out_of_range_is_one_line(tmp_path: Path) -> None:
    src = trees.make_tree(tmp_path / "src", file("f", b"f"))
    ref = publish(tmp_path / "store", [src])
    (tmp_path / "mnt").mkdir()
    done = run_weenv("mount", ref, str(tmp_path / "mnt"), "--store", str(tmp_path / "store"),
                     "--cache", str(tmp_path / "cache"), "--layer", "3", check=False)
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "no group 3" in done.stderr
    assert "Traceback" not in done.stderr
