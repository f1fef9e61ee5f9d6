"""`weenv convert` on the union corners closed by issue 14, checked against the reference
applier (support/oci_apply.py) entry by entry, hardlink sets included.

- a whiteout in the same layer as a hardlink to a lower layer's file, hiding one of the names
  the hardlink made this group copy up (before or after the link in the tar);
- markers under a directory the same layer makes opaque, in either order;
- a directory that a layer only marks opaque keeps the lower directory's attributes.
"""

from __future__ import annotations

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
