"""core/tree.py without a mount: inode numbers, attributes, names, union, xattrs, access.

Groups are built by the real builder (tools/builder.py) from trees declared with
tests/support (a directory for one group, OCI layer tars for the union cases) into a local
store, then loaded through the real `open_environment`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from support import layers, trees
from support.trees import chardev, dir, file, hardlink, sparse, symlink  # noqa: A004

from weenvfs.core.loaded_env import open_environment
from weenvfs.core.tree import (
    BLOCK_SIZE,
    ROOT_INODE,
    Attr,
    Tree,
    make_inode,
    may_access,
    split_inode,
)
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, build_group, open_source
from weenvfs.tools.chunker import ChunkOptions
from weenvfs.tools.publish import compose_env

MIB = 1 << 20
OPTIONS = BuildOptions(chunk=ChunkOptions(chunk_size=64 << 10, batch_threshold=4 << 10))


def build_env(tmp: Path, sources: list[Path]) -> Tree:
    """Build one group per source (a directory or a tar), compose them, load the tree."""
    store = open_store(str(tmp / "store"), create=True)
    repo = Repository(store)
    names = []
    for n, source in enumerate(sources):
        build_group(open_source(source), repo, f"g{n}", "t", OPTIONS)
        names.append(f"g{n}:t")
    compose_env(repo, "env", "t", names)
    return open_environment(store, "env:t").tree


def tree_of(tmp: Path, *entries: trees.Spec) -> Tree:
    return build_env(tmp, [trees.make_tree(tmp / "src", *entries)])


def layered(tmp: Path, *groups: list[trees.Spec]) -> Tree:
    paths = []
    for n, members in enumerate(groups):
        path = tmp / f"layer{n}.tar"
        path.write_bytes(layers.layer(*members))
        paths.append(path)
    return build_env(tmp, paths)


def resolve(tree: Tree, path: str) -> Attr:
    attr = tree.attr(ROOT_INODE)
    for part in path.encode().split(b"/"):
        attr = tree.lookup(attr.inode, part)
    return attr


def names(tree: Tree, path: str = "") -> list[bytes]:
    inode = resolve(tree, path).inode if path else ROOT_INODE
    return [name for name, _ in tree.children(inode)]


def test_inode_numbers_round_trip() -> None:
    for group, ino in [(0, 1), (3, 0xFFFFFFFD), (127, 12345)]:
        inode = make_inode(group, ino)
        assert inode > ROOT_INODE
        assert split_inode(inode) == (group, ino)


def test_attributes_match_the_source(tmp_path: Path) -> None:
    tree = tree_of(
        tmp_path,
        dir(".", 0o755, mtime=1_700_000_000_000_000_001),
        file("a/f", b"hello", mode=0o640, uid=1000, gid=50, mtime=1_650_000_000_999_999_999),
        symlink("a/l", "../x/y"),
        chardev("dev/c", 1, 5),
        file("big", bytes(range(256)) * 1024),
    )
    f = resolve(tree, "a/f")
    assert stat.S_ISREG(f.mode) and stat.S_IMODE(f.mode) == 0o640
    assert (f.uid, f.gid, f.size, f.nlink) == (1000, 50, 5, 1)
    assert f.mtime_ns == 1_650_000_000_999_999_999
    assert f.blocks == 1
    link = resolve(tree, "a/l")
    assert stat.S_ISLNK(link.mode) and link.size == len(b"../x/y")
    assert tree.readlink(link.inode) == b"../x/y"
    dev = resolve(tree, "dev/c")
    assert stat.S_ISCHR(dev.mode) and dev.rdev == os.makedev(1, 5)
    root = tree.attr(ROOT_INODE)
    assert root.inode == ROOT_INODE and root.mtime_ns == 1_700_000_000_000_000_001
    assert root.nlink == 2 + 2  # a/ and dev/ (one group: the index's exact count)
    assert resolve(tree, "big").blocks == 256 * 1024 // 512
    assert BLOCK_SIZE >= 128 * 1024


def test_lookup_errors(tmp_path: Path) -> None:
    tree = tree_of(tmp_path, file("f", b"x"), symlink("l", "f"))
    with pytest.raises(FileNotFoundError):
        tree.lookup(ROOT_INODE, b"missing")
    f = resolve(tree, "f")
    with pytest.raises(NotADirectoryError):
        tree.lookup(f.inode, b"x")
    with pytest.raises(NotADirectoryError):
        tree.children(f.inode)
    with pytest.raises(FileNotFoundError):
        tree.attr(make_inode(9, 1))  # no such group
    with pytest.raises(OSError) as info:
        tree.readlink(f.inode)
    assert info.value.errno == errno.EINVAL
    with pytest.raises(IsADirectoryError):
        tree.file(ROOT_INODE)
    with pytest.raises(OSError) as info:
        tree.file(resolve(tree, "l").inode)
    assert info.value.errno == errno.EINVAL


def test_dot_and_dotdot(tmp_path: Path) -> None:
    tree = tree_of(tmp_path, file("a/b/c", b""))
    a, b = resolve(tree, "a"), resolve(tree, "a/b")
    assert tree.lookup(b.inode, b".") == b
    assert tree.lookup(b.inode, b"..") == a
    assert tree.lookup(ROOT_INODE, b"..").inode == ROOT_INODE


def test_hardlinks_share_an_inode_and_numbers_are_stable(tmp_path: Path) -> None:
    entries = [file("h/a", b"shared", mode=0o600), hardlink("h/b", "h/a"), dir("o"),
               hardlink("o/c", "h/a"), file("h/other", b"shared")]
    tree = tree_of(tmp_path / "one", *entries)
    a, b, c = (resolve(tree, p) for p in ("h/a", "h/b", "o/c"))
    assert a.inode == b.inode == c.inode and a.nlink == 3
    assert resolve(tree, "h/other").inode != a.inode
    again = tree_of(tmp_path / "two", *entries)
    assert resolve(again, "o/c").inode == c.inode
    assert names(again, "h") == names(tree, "h") == [b"a", b"b", b"other"]


def test_nlink_counts_the_names_upper_groups_leave_visible(tmp_path: Path) -> None:
    low = [file("h/a", b"shared"), hardlink("h/b", "h/a"), hardlink("h/c", "h/a"),
           file("x", b"x"), hardlink("y", "x")]
    tree = layered(tmp_path, low, [layers.whiteout("h/b"), file("y", b"new y")])
    assert resolve(tree, "h/a").nlink == resolve(tree, "h/c").nlink == 2
    assert resolve(tree, "x").nlink == 1 and resolve(tree, "y").nlink == 1


def test_a_dir_only_marked_opaque_shows_the_lower_attributes(tmp_path: Path) -> None:
    low = [dir("d", mode=0o750, uid=7, gid=8, mtime=5_000_000_000), file("d/x", b"x"),
           dir("d/s")]
    tree = layered(tmp_path, low, [layers.opaque("d")])
    d = resolve(tree, "d")
    assert (stat.S_IMODE(d.mode), d.uid, d.gid, d.mtime_ns) == (0o750, 7, 8, 5_000_000_000)
    assert names(tree, "d") == [] and d.nlink == 2  # its own group's count: no lower s/


def test_sparse_blocks_count_stored_data_only(tmp_path: Path) -> None:
    tree = tree_of(tmp_path, sparse("s", 4 * MIB, {0: b"head", 3 * MIB: b"x" * 100}))
    s = resolve(tree, "s")
    assert s.size == 4 * MIB
    # Two 64 KiB chunks hold data; every other chunk is a hole.
    assert s.blocks == 2 * (64 << 10) // 512


def test_xattrs(tmp_path: Path) -> None:
    tree = tree_of(tmp_path, file("f", b"", xattrs={"user.b": b"2", "user.a": b"",
                                                    "trusted.t": b"\x00"}))
    f = resolve(tree, "f")
    assert tree.xattrs(f.inode) == [(b"trusted.t", b"\x00"), (b"user.a", b""), (b"user.b", b"2")]
    assert tree.getxattr(f.inode, b"user.b") == b"2"
    with pytest.raises(OSError) as info:
        tree.getxattr(f.inode, b"user.none")
    assert info.value.errno == errno.ENODATA


def test_union_whiteouts_opaque_and_merged_dirs(tmp_path: Path) -> None:
    tree = layered(
        tmp_path,
        [dir("."), file("etc/a", b"low"), file("etc/b", b"low"), file("keep/x", b"1"),
         file("opq/old", b"old"), file("gone/y", b"y"), file("dir2file/z", b"z")],
        [dir("."), file("etc/a", b"mid"), layers.whiteout("etc/b"), layers.whiteout("gone"),
         file("dir2file", b"now a file"), dir("opq"), layers.opaque("opq"),
         file("opq/new", b"new")],
        [dir("."), file("etc/c", b"top"), dir("keep", mode=0o700)],
    )
    assert names(tree) == [b"dir2file", b"etc", b"keep", b"opq"]
    assert names(tree, "etc") == [b"a", b"c"]
    assert names(tree, "opq") == [b"new"]
    assert stat.S_ISREG(resolve(tree, "dir2file").mode)
    keep = resolve(tree, "keep")
    assert stat.S_IMODE(keep.mode) == 0o700  # the upper directory's attributes win
    assert keep.nlink == 1  # merged from two groups: unknown, as overlayfs reports
    with pytest.raises(FileNotFoundError):
        resolve(tree, "etc/b")
    with pytest.raises(FileNotFoundError):
        resolve(tree, "gone")
    index, ino = tree.file(resolve(tree, "etc/a").inode)
    assert index is tree.groups[1]


def test_listings_equal_the_composed_tree(tmp_path: Path) -> None:
    # Directories of one layer are listed straight from their index (core/tree.py); merged
    # ones through ComposedTree. Either way the listing is the union's.
    tree = layered(
        tmp_path,
        [dir("."), file("solo/x", b"1"), layers.whiteout("solo/gone"), dir("solo/sub"),
         file("solo/sub/f", b"2"), file("both/low", b"3"), layers.whiteout("both/hidden")],
        [dir("."), file("both/hidden", b"4"), file("up/only", b"5"), dir("both/deep"),
         layers.whiteout("up/nothing")],
        [dir("."), file("both/top", b"6"), layers.whiteout("both/low")],
    )
    seen = 0
    for path, entry in tree.composed.walk():
        if not entry.is_dir:
            continue
        inode = resolve(tree, path.decode()).inode if path else ROOT_INODE
        union = tree.composed.entries(entry)
        expected = [(name, make_inode(e.group, e.inode)) for name, e in union]
        assert list(tree.children(inode)) == expected, path
        seen += 1
    assert seen == 6  # root, solo, solo/sub, both, both/deep, up
    assert names(tree, "solo") == [b"sub", b"x"]
    assert names(tree, "both") == [b"deep", b"hidden", b"top"]


def test_usage(tmp_path: Path) -> None:
    tree = tree_of(tmp_path, file("a", b"x" * 5000), sparse("s", MIB, {0: b"1"}))
    usage = tree.usage()
    assert usage.inodes == tree.groups[0].inode_count
    assert 5000 < usage.data_bytes < MIB


@pytest.mark.parametrize(
    ("mode", "uid", "gid", "caller", "groups", "want", "allowed"),
    [
        (0o640, 1000, 50, 1000, {1000}, os.R_OK | os.W_OK, True),
        (0o640, 1000, 50, 1001, {50}, os.R_OK, True),
        (0o640, 1000, 50, 1001, {50}, os.W_OK, False),
        (0o064, 1000, 50, 1000, {50}, os.R_OK, False),  # owner bits only, not group or other
        (0o644, 1000, 50, 2000, {7}, os.R_OK, True),
        (0o000, 1000, 50, 0, {0}, os.R_OK | os.W_OK, True),  # root reads anything
        (0o644, 1000, 50, 0, {0}, os.X_OK, False),  # but executes only with an x bit
        (0o744, 1000, 50, 0, {0}, os.X_OK, True),
        (stat.S_IFDIR | 0o700, 1000, 50, 0, {0}, os.X_OK, True),
        (0o755, 1000, 50, 5, set(), os.F_OK, True),
    ],
)
def test_may_access(mode: int, uid: int, gid: int, caller: int, groups: set[int], want: int,
                    allowed: bool) -> None:
    attr = Attr(2, mode if mode & stat.S_IFMT(mode) else stat.S_IFREG | mode, 1, uid, gid, 0,
                0, 0, 0)
    assert may_access(attr, want, caller, groups) is allowed
