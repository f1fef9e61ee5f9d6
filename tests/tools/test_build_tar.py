"""Building groups from tar layers: exact metadata, whiteouts, squashing, hostile members.

Layers come from `support.layers`; the expected result of applying layers comes from the
independent oracle `support.oci_apply`, compared through the composed tree of the built
indexes (`format.compose.ComposedTree`).
"""

from __future__ import annotations

import io
import lzma
import tarfile
from pathlib import Path

import pytest
from support import layers, oci_apply, trees
from support.layers import dir, file, hardlink, opaque, symlink, whiteout  # noqa: A004

from weenvfs.errors import SourceError
from weenvfs.format import constants as C
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, BuildResult, build_group
from weenvfs.tools.chunker import ChunkOptions
from weenvfs.tools.entries import Entry, Kind, normalize_path
from weenvfs.tools.source_tar import TarSource
from weenvfs.tools.tree import GroupTree

ROOT = dir(".", 0o755, mtime=1_700_000_000_000_000_001)


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def build_tars(repo: Repository, paths: list[Path], group: str = "g") -> BuildResult:
    sources = [TarSource(p) for p in paths]
    try:
        return build_group(sources, repo, group, "latest", BuildOptions(ChunkOptions()))
    finally:
        for s in sources:
            s.close()


@pytest.mark.parametrize("compress", ["plain", "gzip", "zstd", "xz"])
def test_hostile_entries_from_a_tar_match_the_tree(
    tmp_path, repo, compress, index_snapshot, assert_same
):
    entries = trees.hostile_entries()
    data = layers.layer(*trees.with_parents(entries))
    data = {
        "plain": data,
        "gzip": layers.gzip(data),
        "zstd": layers.zstd(data),
        "xz": lzma.compress(data),
    }[compress]
    result = build_tars(repo, [write(tmp_path, "l.tar", data)])
    expected = trees.snapshot(trees.make_tree(tmp_path / "tree", *entries))
    assert_same(expected, index_snapshot([repo.get_index(result.index_digest)]))


def test_whiteouts_and_opaque_become_markers(tmp_path, repo):
    data = layers.layer(
        ROOT,
        dir("a"),
        whiteout("a/gone"),
        dir("b"),
        opaque("b"),
        file("b/kept", b"k"),
        whiteout("top"),
    )
    result = build_tars(repo, [write(tmp_path, "l.tar", data)])
    index = repo.get_index(result.index_digest)
    gone = index.inode(index.resolve(b"a/gone"))
    assert gone.whiteout and not index.inode(index.resolve(b"a")).opaque
    assert index.inode(index.resolve(b"top")).whiteout
    b = index.inode(index.resolve(b"b"))
    assert b.opaque and index.resolve(b"b/kept") is not None
    assert index.resolve(b"b/.wh..wh..opq") is None
    assert (result.counts.whiteouts, result.counts.opaque_dirs) == (2, 1)


def _three_layers(cross_layer_link: bool = False) -> list[bytes]:
    """Layers listing every directory they change, as Docker's do: a group that does not
    list a directory gives it default metadata, which would hide a lower group's."""
    extra = [hardlink("h3", "keep/h")] if cross_layer_link else []
    return [
        layers.layer(
            ROOT,
            dir("etc"),
            file("etc/a", b"a1"),
            file("etc/b", b"b1"),
            dir("d"),
            dir("d/sub"),
            file("d/sub/x", b"x"),
            file("d/y", b"y"),
            file("f", b"file"),
            dir("keep"),
            file("keep/h", b"hard"),
            dir("wd"),
            file("wd/1", b"1"),
            symlink("ln", "etc/a"),
        ),
        layers.layer(
            ROOT,
            dir("etc", 0o700, mtime=5),
            whiteout("etc/a"),
            file("etc/c", b"c2"),
            opaque("d"),
            dir("d"),
            file("d/new", b"n"),
            dir("f"),
            file("f/inside", b"i"),
            file("h2", b"linked"),
            hardlink("keep/h2", "h2"),
            whiteout("wd"),
            dir("keep"),
        ),
        layers.layer(
            ROOT,
            dir("etc", 0o711),
            file("etc/a", b"a3"),
            dir("d"),
            file("d/sub", b"now a file"),
            whiteout("f"),
            file("wd", b"wd is a file now"),
            whiteout("ln"),
            file("etc/c", b"c3 replaces c2"),
            *extra,
        ),
    ]


def test_squashed_layers_match_the_oci_oracle(tmp_path, repo, index_snapshot, assert_same):
    tars = _three_layers(cross_layer_link=True)
    paths = [write(tmp_path, f"l{i}.tar", t) for i, t in enumerate(tars)]
    result = build_tars(repo, paths)
    oracle = oci_apply.apply_layers(tmp_path / "oracle", tars)
    assert_same(trees.snapshot(oracle), index_snapshot([repo.get_index(result.index_digest)]))


@pytest.mark.parametrize("split", [[1, 1, 1], [2, 1], [1, 2]])
def test_groups_compose_like_layers(tmp_path, repo, split, index_snapshot, assert_same):
    """Squashed groups stacked by ComposedTree give the oracle's tree: markers left for lower
    groups must hide exactly what the layers hid."""
    tars = _three_layers()
    paths = [write(tmp_path, f"l{i}.tar", t) for i, t in enumerate(tars)]
    indexes, start = [], 0
    for n, count in enumerate(split):
        result = build_tars(repo, paths[start : start + count], f"g{n}")
        indexes.append(repo.get_index(result.index_digest))
        start += count
    oracle = oci_apply.apply_layers(tmp_path / "oracle", tars)
    assert_same(trees.snapshot(oracle), index_snapshot(indexes))


def test_marker_after_entries_of_its_own_layer(tmp_path, repo, index_snapshot, assert_same):
    tars = [
        layers.layer(ROOT, dir("d"), file("d/old", b"o"), dir("e"), file("e/old", b"o")),
        # Markers after the layer's own entries still hide only what lower layers had.
        layers.layer(
            ROOT,
            dir("d"),
            file("d/new", b"n"),
            opaque("d"),
            dir("e"),
            file("e/n", b"n"),
            whiteout("e"),
        ),
    ]
    paths = [write(tmp_path, f"l{i}.tar", t) for i, t in enumerate(tars)]
    for split in ([2], [1, 1]):
        indexes, start = [], 0
        for n, count in enumerate(split):
            result = build_tars(repo, paths[start : start + count], f"s{len(split)}-{n}")
            indexes.append(repo.get_index(result.index_digest))
            start += count
        oracle = oci_apply.apply_layers(tmp_path / f"oracle{len(split)}", tars)
        assert_same(trees.snapshot(oracle), index_snapshot(indexes))


def test_duplicate_paths_later_wins_and_implied_dirs(tmp_path, repo, read_file):
    data = layers.layer(
        file("x/y/f", b"first"), file("x/y/f", b"second"), symlink("s", "a"), file("s", b"file now")
    )
    result = build_tars(repo, [write(tmp_path, "l.tar", data)])
    index = repo.get_index(result.index_digest)
    assert read_file(index, index.resolve(b"x/y/f")) == b"second"
    assert index.inode(index.resolve(b"s")).is_reg
    for path in (b"x", b"x/y"):
        rec = index.inode(index.resolve(path))
        assert (rec.mode & 0o7777, rec.uid, rec.gid, rec.mtime_ns) == (0o755, 0, 0, 0)


def test_gnu_long_names_devices_and_hardlinks(tmp_path, repo, read_file):
    buf = io.BytesIO()
    long = "d/" + "n" * 200 + "/" + "f" * 150
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind in (("d", tarfile.DIRTYPE), ("d/" + "n" * 200, tarfile.DIRTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = kind, 0o755, 7
            tar.addfile(info)
        info = tarfile.TarInfo(long)
        info.size, info.mtime = 5, 9
        tar.addfile(info, io.BytesIO(b"hello"))
        link = tarfile.TarInfo("./other")
        link.type, link.linkname = tarfile.LNKTYPE, "./" + long
        tar.addfile(link)
        dev = tarfile.TarInfo("/null")
        dev.type, dev.devmajor, dev.devminor, dev.mode = tarfile.CHRTYPE, 1, 3, 0o666
        tar.addfile(dev)
    result = build_tars(repo, [write(tmp_path, "gnu.tar", buf.getvalue())])
    index = repo.get_index(result.index_digest)
    ino = index.resolve(long.encode())
    assert index.resolve(b"other") == ino and index.inode(ino).nlink == 2
    assert read_file(index, ino) == b"hello" and index.inode(ino).mtime_ns == 9 * 10**9
    assert index.inode(index.resolve(b"null")).rdev == (1 << 8) | 3


def test_stdin_tar(tmp_path, repo, monkeypatch, index_snapshot, assert_same):
    entries = [ROOT, file("a", b"a" * 100_000), dir("d"), file("d/b", b"b")]
    data = layers.zstd(layers.layer(*entries))

    class Stdin:
        buffer = io.BufferedReader(io.BytesIO(data))

    monkeypatch.setattr("sys.stdin", Stdin)
    result = build_tars(repo, [Path("-")])
    expected = trees.snapshot(trees.make_tree(tmp_path / "t", *entries))
    assert_same(expected, index_snapshot([repo.get_index(result.index_digest)]))


# -- refusals -----------------------------------------------------------------------------

# The oracle refuses absolute member names; WeEnv follows Docker and reads '/etc/x' as etc/x.
DOCKER_ACCEPTS = {"absolute"}


@pytest.mark.parametrize("case", sorted(set(layers.hostile_layers()) - DOCKER_ACCEPTS))
def test_hostile_layers_are_refused(tmp_path, repo, case, store_state):
    tars = layers.hostile_layers()[case]
    paths = [write(tmp_path, f"l{i}.tar", t) for i, t in enumerate(tars)]
    work = tmp_path / "work"
    work.mkdir()
    sources = [TarSource(p) for p in paths]
    with pytest.raises(SourceError) as info:
        build_group(sources, repo, "g", "latest", BuildOptions(tmp_dir=work))
    message = str(info.value)
    assert "\n" not in message and message.startswith("refusing entry")
    assert store_state() == {"tags": [], "indexes": []}
    assert list(work.iterdir()) == []


def test_absolute_names_are_read_as_relative(tmp_path, repo, read_file):
    tars = layers.hostile_layers()["absolute"]
    result = build_tars(repo, [write(tmp_path, "l.tar", tars[0])])
    index = repo.get_index(result.index_digest)
    assert read_file(index, index.resolve(b"etc/passwd")).startswith(b"root:")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"./etc/x", b"etc/x"),
        (b"/etc/x", b"etc/x"),
        (b"a/./b//c/", b"a/b/c"),
        (b"a/../b", b"b"),
        (b"./", b""),
        (b"/", b""),
    ],
)
def test_normalize_path(raw, expected):
    assert normalize_path(raw) == expected


@pytest.mark.parametrize(
    "raw", [b"../x", b"/etc/../../x", b"a/../../x", b"a\0b", b"x/" + b"n" * (C.MAX_NAME + 1)]
)
def test_normalize_path_refuses(raw):
    with pytest.raises(SourceError, match="refusing entry"):
        normalize_path(raw)


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (file(".wh..wh.plnk"), "unsupported whiteout"),
        (file(".wh."), "whiteout of ''"),
        (file("d/.wh..."), "whiteout of '..'"),
    ],
)
def test_bad_whiteout_names(tmp_path, member, reason):
    path = write(tmp_path, "l.tar", layers.layer(dir("d"), member))
    source = TarSource(path)
    try:
        with pytest.raises(SourceError, match=reason):
            list(source.entries())
    finally:
        source.close()


def test_tree_refuses_traversal_and_unseen_links():
    tree = GroupTree()
    tree.add(Entry(b"a", Kind.SYMLINK, mode=0o777, target=b"/"))
    with pytest.raises(SourceError, match="symlink traversal"):
        tree.add(Entry(b"a/x", Kind.REG))
    with pytest.raises(SourceError, match="not seen before"):
        tree.add(Entry(b"h", Kind.HARDLINK, target=b"nowhere"))
    tree.add(Entry(b"d", Kind.DIR, mode=0o755))
    with pytest.raises(SourceError, match="is a directory"):
        tree.add(Entry(b"h", Kind.HARDLINK, target=b"d"))


@pytest.mark.parametrize(
    "data",
    [b"", b"not a tar at all" * 100, layers.gzip(b"x" * 10000)[:50]],
    ids=["empty", "garbage", "truncated-gzip"],
)
def test_unreadable_tar_is_one_line(tmp_path, repo, data, store_state):
    path = write(tmp_path, "bad.tar", data)
    with pytest.raises(SourceError) as info:
        build_tars(repo, [path])
    assert "\n" not in str(info.value)
    assert store_state() == {"tags": [], "indexes": []}


def test_truncated_member_data(tmp_path, repo, store_state):
    data = layers.layer(file("a", b"q" * 300_000))
    path = write(tmp_path, "cut.tar", data[:200_000])
    with pytest.raises(SourceError, match="refusing entry 'a'"):
        build_tars(repo, [path])
    assert store_state() == {"tags": [], "indexes": []}


def test_pre_1970_times_as_docker_applies_them_and_empty_xattrs_kept(tmp_path, repo):
    """An mtime before 1970 is 1970 (Docker's layer apply takes it so); an empty xattr record
    is an empty xattr (Docker drops it; a tree with one round-trips here: the hostile tree)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, mtime, pax in (("old", -315619200, {}), ("older-ns", 0, {"mtime": "-1.5"}),
                                 ("x", 5, {"SCHILY.xattr.user.empty": "",
                                           "SCHILY.xattr.user.kept": "v"})):
            info = tarfile.TarInfo(name)
            info.mtime, info.pax_headers = mtime, pax
            tar.addfile(info, io.BytesIO(b""))
    index = repo.get_index(build_tars(repo, [write(tmp_path, "t.tar", buf.getvalue())])
                           .index_digest)
    for name in (b"old", b"older-ns"):
        assert index.inode(index.resolve(name)).mtime_ns == 0
    x = index.resolve(b"x")
    assert index.inode(x).mtime_ns == 5 * 10**9
    assert dict(index.xattrs(x)) == {b"user.empty": b"", b"user.kept": b"v"}
