"""`weenv mount` refuses a mount point that does not exist (saying so) or that has files
(they would be hidden) unless `--nonempty`; checked by the parent before any daemon starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mounts import publish

from weenvfs.cli import main
from weenvfs.fuse import daemon

pytestmark = pytest.mark.usefixtures("requires_fuse")


def test_missing_mount_point_says_it_does_not_exist(tmp_path: Path, capsys) -> None:
    code = main(["mount", "e:t", str(tmp_path / "nope"), "--store", str(tmp_path)])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_non_empty_mount_point_is_refused(tmp_path: Path, capsys) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    (mp / "precious").write_text("x")
    code = main(["mount", "e:t", str(mp), "--store", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "is not empty" in err and "--nonempty" in err
    assert not daemon.is_mounted(mp)


@pytest.mark.parametrize(("value", "says"), [("/layers/0", "a mount names its group"),
                                             ("0=relative", "expected [N=]DIR")])
def test_a_bad_pages_through_is_one_line(tmp_path: Path, capsys, value: str, says: str) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    code = main(["mount", "e:t", str(mp), "--store", str(tmp_path), "--pages-through", value])
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.count("\n") == 1, err
    assert not daemon.is_mounted(mp)


def test_nonempty_flag_mounts_over_files(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello").write_text("hello\n")
    ref = publish(tmp_path / "store", [src])
    mp = tmp_path / "over"
    mp.mkdir()
    (mp / "precious").write_text("x")
    mounter.mount(ref, tmp_path / "store", mountpoint=mp, extra=["--nonempty"])
    assert sorted(p.name for p in mp.iterdir()) == ["hello"]


def test_a_store_whose_name_is_not_utf8_mounts(tmp_path: Path, mounter) -> None:
    """The node notes what each reference resolved to, keyed by the store as given: a folder
    named in bytes that are not UTF-8 (a surrogate escape in Python) is a key like any."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello").write_text("hello\n")
    ref = publish(tmp_path / "store", [src])
    odd = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"store-\xfe")))
    odd.symlink_to(tmp_path / "store")
    mount = mounter.mount(ref, odd)
    assert (mount.mountpoint / "hello").read_text() == "hello\n"
