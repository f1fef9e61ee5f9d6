"""Tests of the test-support code itself: trees, snapshots, layer tarballs, the OCI oracle.

These need root (chown, mknod, trusted.* xattrs); without it they fail loudly, not skip.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from weenvfs.errors import SourceError
from weenvfs.tools import sample

from . import layers, oci_apply, trees
from .trees import dir, file, hardlink, symlink  # noqa: A004


def test_running_as_root() -> None:
    assert os.geteuid() == 0, "the support tests create devices and owners: run them as root"


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    return trees.hostile_tree(tmp_path / "hostile")


def _copy(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def test_hostile_tree_has_what_it_promises(hostile: Path) -> None:
    snap = trees.snapshot(hostile)
    types = {e.type for e in snap.values()}
    assert types >= {"reg", "dir", "lnk", "chr", "blk", "fifo"}
    assert snap[b"\xff\xfe/\xc3\x28"].type == "reg"
    assert snap[b"names/new\nline"].type == "reg"
    assert max(len(p.rsplit(b"/", 1)[-1]) for p in snap) == 255
    assert max(p.count(b"/") for p in snap) >= 60
    assert snap[b"hard/a"].links == (b"hard/a", b"hard/b", b"other/c")
    assert snap[b"bin/suid"].mode == 0o4755 and snap[b"tmp"].mode == 0o1777
    assert snap[b"owned/big-ids"].uid == 1_234_567
    assert snap[b"."].mtime_ns == 1_700_000_000_000_000_001
    assert snap[b"xattr/cap"].xattrs == {b"security.capability": trees.CAP_NET_BIND_SERVICE}
    assert snap[b"xattr/f"].xattrs[b"user.binary"] == bytes(range(256))
    assert snap[b"dev/nvme"].rdev == os.makedev(259, 65_536)
    assert snap[b"links/dangling"].target == b"does/not/exist"
    sparse = os.stat(hostile / "sparse.img")
    assert sparse.st_size == 10 << 20 and sparse.st_blocks * 512 < 1 << 20  # real holes
    assert snap[b"big.bin"].size == (3 << 20) + 17


def test_copy_compares_equal(hostile: Path, tmp_path: Path) -> None:
    copy = _copy(hostile, tmp_path / "copy")
    assert trees.compare_trees(hostile, copy) == []
    trees.assert_trees_equal(hostile, copy)


def test_tar_roundtrip_compares_equal(hostile: Path, tmp_path: Path) -> None:
    out = tmp_path / "untarred"
    out.mkdir()
    tar = ["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-C"]
    packed = subprocess.run(
        [*tar, str(hostile), "-cf", "-", "."], check=True, stdout=subprocess.PIPE
    ).stdout
    subprocess.run([*tar, str(out), "-xpf", "-"], input=packed, check=True)
    assert trees.compare_trees(hostile, out) == []


def _restore_mtime(path: Path, st: os.stat_result) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


MUTATIONS = {
    "mode": (b"names/with space", lambda p: os.chmod(p, 0o600), "mode 0o644 != 0o600"),
    "uid": (b"owned/nobody", lambda p: os.chown(p, 4242, -1), "uid 65534 != 4242"),
    "mtime": (
        b"empty",
        lambda p: os.utime(p, ns=(0, 1_600_000_000_123_456_788)),
        "mtime_ns 1600000000123456789 != 1600000000123456788",
    ),
    "xattr": (b"xattr/f", lambda p: os.setxattr(p, "user.comment", b"hellO"), "xattrs"),
    "content": (b"big.bin", lambda p: _flip_byte(p, 2_000_000), "sha256"),
    "symlink_mtime": (
        b"links/rel",
        lambda p: os.utime(p, ns=(0, 5), follow_symlinks=False),
        "mtime_ns 1600000000123456789 != 5",
    ),
    "dir_mode": (b"private", lambda p: os.chmod(p, 0o750), "mode 0o700 != 0o750"),
}


def _flip_byte(path: Path, offset: int) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    _restore_mtime(path, st)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_one_mutation_gives_one_difference(hostile: Path, tmp_path: Path, name: str) -> None:
    rel, mutate, expected = MUTATIONS[name]
    copy = _copy(hostile, tmp_path / "copy")
    mutate(copy / os.fsdecode(rel))
    diffs = trees.compare_trees(hostile, copy)
    assert len(diffs) == 1, diffs
    assert diffs[0].startswith(repr(rel)) and expected in diffs[0]


def test_breaking_a_hardlink_and_missing_paths_are_reported(hostile: Path, tmp_path: Path) -> None:
    copy = _copy(hostile, tmp_path / "copy")
    parent = os.stat(copy / "other")
    os.unlink(copy / "other/c")
    _restore_mtime(copy / "other", parent)
    diffs = trees.compare_trees(hostile, copy)
    assert diffs == [
        "b'hard/a': links (b'hard/a', b'hard/b', b'other/c') != (b'hard/a', b'hard/b')",
        "b'hard/b': links (b'hard/a', b'hard/b', b'other/c') != (b'hard/a', b'hard/b')",
        "b'other/c': only in a (reg)",
    ]
    with pytest.raises(AssertionError, match="3 difference"):
        trees.assert_trees_equal(hostile, copy)


def test_ignore_and_exclude(hostile: Path, tmp_path: Path) -> None:
    copy = _copy(hostile, tmp_path / "copy")
    os.utime(copy, ns=(0, 0))
    os.chmod(copy, 0o700)
    os.utime(copy / "small", ns=(0, 0))
    os.chmod(copy / "names/--", 0o600)
    assert len(trees.compare_trees(hostile, copy)) == 4
    assert (
        trees.compare_trees(hostile, copy, ignore={"root", "mtime_of_dirs"}, exclude=["names"])
        == []
    )
    assert trees.compare_trees(hostile, copy, ignore={"mode", "mtime_ns"}) == []
    with pytest.raises(ValueError, match="unknown ignore"):
        trees.snapshot(hostile, ignore={"mtimes"})


def test_make_tree_refuses_escaping_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="escapes"):
        trees.make_tree(tmp_path / "t", file("a/../../x", b""))
    assert not (tmp_path / "x").exists()


# --- layers and the OCI oracle --------------------------------------------------------------


def _expect(tmp_path: Path, name: str, *entries: trees.Spec) -> Path:
    return trees.make_tree(tmp_path / name, *entries)


def _apply(tmp_path: Path, *layer_list: bytes) -> Path:
    return oci_apply.apply_layers(tmp_path / "applied", layer_list)


def test_layer_preserves_every_attribute_of_the_hostile_tree(hostile: Path, tmp_path: Path) -> None:
    tar = layers.layer(*trees.with_parents(trees.hostile_entries()))
    for packed in (tar, layers.gzip(tar), layers.zstd(tar)):
        out = oci_apply.apply_layers(tmp_path / f"applied-{len(packed)}", [packed])
        trees.assert_trees_equal(hostile, out)


def test_layer_writes_nanosecond_mtime_and_xattrs_as_pax_records() -> None:
    tar = layers.layer(
        file("f", b"x", mtime=1_600_000_000_000_000_007, xattrs={"user.v": b"\xff\x00"})
    )
    with tarfile.open(fileobj=io.BytesIO(tar), errors="surrogateescape") as t:
        info = t.getmember("f")
    assert info.pax_headers["mtime"] == "1600000000.000000007"
    assert info.pax_headers["SCHILY.xattr.user.v"].encode("utf-8", "surrogateescape") == b"\xff\x00"


def test_whiteouts_and_opaque_directories(tmp_path: Path) -> None:
    base = layers.layer(
        dir("a"),
        dir("a/b"),
        dir("a/b/c"),
        file("a/b/c/bar", b"bar"),
        file("a/keep", b"k"),
        dir("etc"),
        file("etc/app.conf", b"v1"),
        file("etc/other", b"o"),
        dir("bin"),
        file("bin/tool", b"v1"),
        dir("gone"),
        file("gone/deep", b"d"),
    )
    # The opaque marker comes after the new children: it must still only hide lower ones.
    top = layers.layer(
        dir("a"),
        dir("a/b"),
        dir("a/b/c"),
        file("a/b/c/foo", b"foo"),
        layers.opaque("a"),
        layers.whiteout("etc/app.conf"),
        layers.whiteout("gone"),
        file("bin/tool", b"v2", mode=0o755),
        layers.whiteout("never/existed"),
    )
    applied = _apply(tmp_path, base, top)
    expected = _expect(
        tmp_path,
        "expected",
        dir("a"),
        dir("a/b"),
        dir("a/b/c"),
        file("a/b/c/foo", b"foo"),
        dir("etc"),
        file("etc/other", b"o"),
        dir("bin"),
        file("bin/tool", b"v2", mode=0o755),
        # A marker's missing parent belongs to its layer, fresh (SPEC.md 7.1, as Docker's and
        # containerd's appliers create it): the whiteout of a name that never existed leaves
        # its folder.
        dir("never", mode=0o755, mtime=0),
    )
    # etc and bin are not listed by the top layer: they keep the base layer's mtime.
    trees.assert_trees_equal(expected, applied, ignore={"root"})


def test_whiteout_applies_to_lower_layers_only(tmp_path: Path) -> None:
    base = layers.layer(dir("d"), file("d/old", b"old"), file("d/f", b"lower"))
    top = layers.layer(
        dir("d"),
        file("d/f", b"upper"),
        layers.whiteout("d/f"),
        file("d/new", b"n"),
        layers.whiteout("d/new"),
        layers.opaque("d"),
    )
    applied = _apply(tmp_path, base, top)
    expected = _expect(tmp_path, "expected", dir("d"), file("d/f", b"upper"), file("d/new", b"n"))
    trees.assert_trees_equal(expected, applied, ignore={"root"})


def test_whiteout_then_recreate_hides_the_lower_subtree(tmp_path: Path) -> None:
    base = layers.layer(dir("x"), file("x/lower", b"l"))
    top = layers.layer(dir("x", mode=0o700), file("x/upper", b"u"), layers.whiteout("x"))
    applied = _apply(tmp_path, base, top)
    expected = _expect(tmp_path, "expected", dir("x", mode=0o700), file("x/upper", b"u"))
    trees.assert_trees_equal(expected, applied, ignore={"root"})


def test_replacing_types_and_hardlinks_across_layers(tmp_path: Path) -> None:
    base = layers.layer(
        dir("d"),
        file("d/f", b"x"),
        file("was_file", b"f"),
        dir("was_dir"),
        file("was_dir/child", b"c"),
        file("shared", b"s"),
    )
    top = layers.layer(
        dir("was_file", mode=0o750),
        file("was_dir", b"now a file"),
        symlink("d/f", "../shared"),
        hardlink("link_to_lower", "shared"),
        hardlink("d/second", "shared"),
    )
    applied = _apply(tmp_path, base, top)
    expected = _expect(
        tmp_path,
        "expected",
        dir("d"),
        symlink("d/f", "../shared"),
        dir("was_file", mode=0o750),
        file("was_dir", b"now a file"),
        file("shared", b"s"),
        hardlink("link_to_lower", "shared"),
        hardlink("d/second", "shared"),
    )
    trees.assert_trees_equal(expected, applied, ignore={"root"})


def test_unlisted_parents_are_created_deterministically(tmp_path: Path) -> None:
    applied = _apply(tmp_path, layers.layer(file("p/q/r", b"r")))
    snap = trees.snapshot(applied)
    assert snap[b"p"].mode == 0o755 and snap[b"p"].mtime_ns == 0
    assert snap[b"p/q"].uid == 0 and snap[b"p/q"].mtime_ns == 0


@pytest.mark.parametrize("case", sorted(layers.hostile_layers()))
def test_hostile_layers_are_refused(tmp_path: Path, case: str) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    with pytest.raises(oci_apply.LayerRefused):
        oci_apply.apply_layers(tmp_path / "root", layers.hostile_layers()[case])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "root"]
    assert outside.read_bytes() == b"keep"
    assert not Path("/escape").exists() and not (tmp_path / "x").exists()


def test_hostile_layers_are_well_formed_tar() -> None:
    # The hostile tarballs themselves are well-formed: GNU tar lists every member.
    for case, layer_list in layers.hostile_layers().items():
        for tar in layer_list:
            listing = subprocess.run(
                ["tar", "-tf", "-"],
                input=tar,
                check=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            assert listing.stdout, case


def test_gnu_tar_reads_what_layer_writes(tmp_path: Path, hostile: Path) -> None:
    tar = layers.layer(*trees.with_parents(trees.hostile_entries()))
    out = tmp_path / "gnu"
    out.mkdir()
    # stderr: GNU tar warns that it ignores `hdrcharset` (it keeps the raw bytes anyway).
    subprocess.run(
        ["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-xpf", "-", "-C", str(out)],
        input=tar,
        check=True,
        stderr=subprocess.PIPE,
    )
    assert trees.compare_trees(hostile, out) == []


# --- the sample-tree builder's pure parts (building itself is exercised by benchmarks) ------


def test_debian_mirror_from_apt_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sample.MIRROR_ENV, raising=False)
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    assert sample.debian_mirror(apt) == sample.DEFAULT_MIRROR
    (apt / "sources.list.d/a.sources").write_text(
        "Types: deb\nURIs: http://m.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nEnabled: no\nURIs: http://disabled.example/debian\n\n"
        "Types: deb-src deb\n# comment: x\nURIs: http://mirror.example/debian/\n"
    )
    (apt / "sources.list.d/z.list.disabled").write_text("deb http://z.example/debian x main\n")
    assert sample.debian_mirror(apt) == "http://mirror.example/debian"
    (apt / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main\n"
    )
    assert sample.debian_mirror(apt) == "http://one.example/debian"
    monkeypatch.setenv(sample.MIRROR_ENV, "http://env.example/debian/")
    assert sample.debian_mirror(apt) == "http://env.example/debian"


def test_tree_stats_counts_regular_files(hostile: Path) -> None:
    snap = trees.snapshot(hostile)
    regular = [e for e in snap.values() if e.type == "reg"]
    # Hardlinked names count once each, as `find -type f` would.
    assert sample.tree_stats(hostile) == (len(regular), sum(e.size or 0 for e in regular))


def test_unknown_sample_profile_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="unknown sample profile 'nope'"):
        sample.sample_tree(tmp_path, "nope")
    assert not any(tmp_path.iterdir())
