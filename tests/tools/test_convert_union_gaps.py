"""`weenv convert` on the union corners closed by issue 14, checked against the reference
applier (support/oci_apply.py) entry by entry, hardlink sets included.

- a whiteout in the same layer as a hardlink to a lower layer's file, hiding one of the names
  the hardlink made this group copy up (before or after the link in the tar);
- markers under a directory the same layer makes opaque, in either order;
- a directory that a layer only marks opaque keeps the lower directory's attributes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import oci_images as O
import pytest
from support import layers as L
from support import oci_apply, trees

from weenvfs.cli import main

T0 = 1_600_000_000_000_000_000


def convert_and_export(tmp: Path, tars: list[bytes], capsys: pytest.CaptureFixture[str],
                       *group_args: str) -> Path:
    image = O.write_layout(tmp / "layout", tars, tag="v1")
    store = str(tmp / "store")
    rc = main(["convert", f"oci:{image.layout}:v1", "gaps:v1", "--store", store, "--quiet",
               *group_args])
    assert rc == 0, capsys.readouterr().err
    rc = main(["export", "gaps:v1", str(tmp / "out"), "--store", store])
    assert rc == 0, capsys.readouterr().err
    return tmp / "out"


def base_with_a_hardlink_pair() -> bytes:
    return L.layer(*L.with_parents([
        L.dir(".", mtime=T0),
        L.dir("d", mode=0o750, uid=7, mtime=T0 + 1),
        L.file("d/a", b"shared", mode=0o640, uid=1000, mtime=T0 + 2),
        L.hardlink("d/b", "d/a"),
        L.hardlink("e", "d/a"),
    ]))


@pytest.mark.parametrize("whiteout_first", [False, True])
@pytest.mark.parametrize("grouping", [(), ("--group", "all=0-")])
def test_whiteout_of_a_copied_up_name_hides_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], whiteout_first: bool,
    grouping: tuple[str, ...],
) -> None:
    link, wh = L.hardlink("c", "d/a"), L.whiteout("d/b")
    upper = L.layer(*([wh, link] if whiteout_first else [link, wh]))
    tars = [base_with_a_hardlink_pair(), upper]
    expected = oci_apply.apply_layers(tmp_path / "expected", tars)
    assert not (expected / "d/b").exists() and (expected / "c").stat().st_nlink == 3
    trees.assert_trees_equal(expected, convert_and_export(tmp_path, tars, capsys, *grouping))


def base_tree() -> bytes:
    return L.layer(*L.with_parents([
        L.dir(".", mtime=T0),
        L.dir("d", mode=0o750, uid=7, gid=8, mtime=T0 + 1, xattrs={"user.d": b"low"}),
        L.dir("d/c", mode=0o700, uid=9, mtime=T0 + 2),
        L.file("d/c/x", b"x", mtime=T0 + 3),
        L.file("d/c/y", b"y", mtime=T0 + 4),
        L.file("d/e", b"e", mtime=T0 + 5),
    ]))


#: Pairs of markers in one layer, each applied in both tar orders (SPEC.md 7.1: the
#: directories on a marker's path belong to its layer, as an entry's parents do).
MARKER_PAIRS = {
    "opaque dir and a whiteout under it": (L.opaque("d"), L.whiteout("d/c/x")),
    "whiteout of a dir and a whiteout under it": (L.whiteout("d"), L.whiteout("d/c/x")),
    "opaque dir and an opaque dir under it": (L.opaque("d"), L.opaque("d/c")),
    "whiteout under a dir no layer has": (L.whiteout("n/m/x"), L.whiteout("d/e")),
}


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("pair", sorted(MARKER_PAIRS))
def test_markers_under_markers_of_the_same_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pair: str, reverse: bool
) -> None:
    first, second = MARKER_PAIRS[pair]
    tars = [base_tree(), L.layer(*([second, first] if reverse else [first, second]))]
    expected = oci_apply.apply_layers(tmp_path / "expected", tars)
    # The rule, on the oracle: the marker's directory exists in the layer, fresh (0755
    # root, mtime 0) where the layer removed what was there, and empty of lower entries.
    marked = expected / ("n/m" if pair.startswith("whiteout under a dir no") else "d/c")
    st = marked.lstat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_mtime_ns) == (0o755, 0, 0), pair
    assert list(marked.iterdir()) == []
    trees.assert_trees_equal(expected, convert_and_export(tmp_path, tars, capsys))
    shutil.rmtree(tmp_path / "out")
    squashed = convert_and_export(tmp_path, tars, capsys, "--group", "all=0-")
    trees.assert_trees_equal(expected, squashed)


@pytest.mark.parametrize("grouping", [(), ("--group", "all=0-")])
def test_a_dir_only_marked_opaque_keeps_the_lower_attributes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], grouping: tuple[str, ...]
) -> None:
    tars = [base_tree(), L.layer(L.opaque("d"), L.opaque("d/c"))]
    expected = oci_apply.apply_layers(tmp_path / "expected", tars)
    st = (expected / "d").lstat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime_ns) == (0o750, 7, 8, T0 + 1)
    trees.assert_trees_equal(expected, convert_and_export(tmp_path, tars, capsys, *grouping))
