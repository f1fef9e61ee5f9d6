"""`weenv mount --layer N`: each group as a kernel overlayfs lower layer. Stacked by the real
overlayfs, the layer mounts must give exactly the merged mount's tree (and the OCI union):
for hand-made layers covering every union rule, and for random stacks of three layers
(seeded; files, directories, symlinks, hardlinks, whiteouts and opaque directories over
each other, implied parents, markers under markers of the same layer; 80 seeds passed when
this was written, 12 run here, `WEENV_RANDOM_STACKS=N` runs N)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import random
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from mounts import Mounter, publish, run_weenv
from support import layers, oci_apply, trees
from support.trees import dir, file, hardlink, symlink, with_parents  # noqa: A004

pytestmark = [pytest.mark.requires_fuse, pytest.mark.usefixtures("both_paths")]


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


# -- random stacks ---------------------------------------------------------------------------

NAMES = ("a", "b", "c", "d")


def _visible(root: Path) -> dict[str, str]:
    """Every path under `root` (relative, str) and its kind: dir, reg or other."""
    kinds = {}
    for path in root.rglob("*"):
        st = path.lstat()
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "reg" if stat.S_ISREG(st.st_mode) \
            else "other"
        kinds[str(path.relative_to(root))] = kind
    return kinds


class _Layer:
    """One random layer under construction: an entry per path, consistent within the layer."""

    def __init__(self, rng: random.Random, below: dict[str, str]) -> None:
        self.rng, self.below = rng, below
        self.members: list[trees.Spec] = []
        self.kinds: dict[str, str] = {}  # paths of this layer, implied parents as dirs
        self.hidden: set[str] = set()  # whited out here: nothing at or under them
        self.files: list[str] = []
        self.declared: set[str] = set()  # directories this layer declares

    def _free(self, path: str, kind: str) -> bool:
        if path in self.kinds or any(path == h or path.startswith(h + "/") for h in self.hidden):
            return False
        parents = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
        if any(self.kinds.get(p, "dir") != "dir" for p in parents):
            return False
        # A parent this layer only implies must not be a lower non-directory (the reference
        # applier refuses to create below a lower symlink).
        if any(p not in self.declared and self.below.get(p, "dir") != "dir" for p in parents):
            return False
        return kind == "dir" or not any(k.startswith(path + "/") for k in self.kinds)

    def _take(self, path: str, kind: str) -> None:
        parts = path.split("/")
        for i in range(1, len(parts)):
            self.kinds.setdefault("/".join(parts[:i]), "dir")
        self.kinds[path] = kind

    def _path(self) -> str:
        return "/".join(self.rng.choice(NAMES) for _ in range(self.rng.randint(1, 3)))

    def add_random(self) -> None:
        rng, op = self.rng, self.rng.random()
        meta = {"uid": rng.choice([0, 1000]), "mtime": rng.randrange(1, 2_000_000_000)}
        if op < 0.3:
            path = self._path()
            if self._free(path, "reg"):
                self._take(path, "reg")
                self.files.append(path)
                self.members.append(file(path, rng.randbytes(rng.randrange(0, 3000)),
                                         mode=rng.choice([0o644, 0o755, 0o600]), **meta,
                                         xattrs={"user.k": b"v"} if rng.random() < 0.2 else None))
        elif op < 0.45:
            path = self._path()
            if self._free(path, "dir"):
                self._take(path, "dir")
                self.declared.add(path)
                self.members.append(dir(path, mode=rng.choice([0o755, 0o700, 0o750]), **meta))
        elif op < 0.55:
            path = self._path()
            if self._free(path, "lnk"):
                self._take(path, "lnk")
                self.members.append(symlink(path, rng.choice(["a", "../b/c", "/d"]), **meta))
        elif op < 0.6 and self.files:
            path = self._path()
            if self._free(path, "reg"):
                self._take(path, "reg")
                self.members.append(hardlink(path, rng.choice(self.files)))
        elif op < 0.85 and self.below:
            path = rng.choice(sorted(self.below))
            # Below a directory this layer makes opaque too: the marker's directory belongs
            # to the layer and stays, empty (format/SPEC.md 7.1).
            if self._free(path, "wh") and not any(k.startswith(path + "/") for k in self.kinds):
                parts = path.split("/")
                for i in range(1, len(parts)):
                    self.kinds.setdefault("/".join(parts[:i]), "dir")
                self.hidden.add(path)
                self.members.append(layers.whiteout(path))
        elif self.below:
            dirs = sorted(p for p, k in self.below.items() if k == "dir")
            if dirs:
                path = rng.choice(dirs)
                # A directory this layer only implies so far (a parent of its entries or
                # markers) may still be declared and made opaque: what it holds stays.
                implied_here = self.kinds.get(path) == "dir" and path not in self.declared
                if implied_here or self._free(path, "dir"):
                    self._take(path, "dir")
                    self.declared.add(path)
                    self.members += [dir(path, mode=0o711, **meta), layers.opaque(path)]


@pytest.mark.parametrize("seed", range(int(os.environ.get("WEENV_RANDOM_STACKS", "12"))))
def test_random_stacks_equal_the_merged_mount(tmp_path: Path, mounter: Mounter,
                                              seed: int) -> None:
    rng = random.Random(seed)
    applied = tmp_path / "applied"
    applied.mkdir()
    tars = []
    for n in range(3):
        layer = _Layer(rng, _visible(applied))
        for _ in range(rng.randint(4, 14)):
            layer.add_random()
        tars.append(layers.layer_file(tmp_path / f"l{n}.tar", *layer.members))
        oci_apply.apply_layer(applied, tars[-1].read_bytes())
    ref = publish(tmp_path / "store", tars)
    merged = mounter.mount(ref, tmp_path / "store").mountpoint
    trees.assert_trees_equal(applied, merged, ignore=["root"])
    lowers = layer_mounts(mounter, ref, tmp_path / "store", len(tars))
    with overlay(tmp_path / "stack", lowers) as stack:
        assert trees.compare_snapshots(_lone_links(merged), _lone_links(stack)) == []


def _lone_links(root: Path) -> dict[bytes, trees.Entry]:
    """`root`'s snapshot, a file whose only visible name is its own counting as unlinked.
    A layer mount cannot know the groups above it, so it reports its record's nlink even
    where an upper group hid the other names (as overlayfs does for a lower file; SPEC.md
    7.2): every other difference in hardlink sets still counts."""
    shot = trees.snapshot(root)
    return {rel: dataclasses.replace(e, links=None) if e.links == (rel,) else e
            for rel, e in shot.items()}
