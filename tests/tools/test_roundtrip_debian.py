"""The foundation's proof on a real root filesystem: the debootstrap minbase sample (built once
into the sample cache by weenvfs.tools.sample) -> weenv build -> weenv export -> compared with
the source entry by entry: path, type, mode, owner, mtime, size, content hash, symlink target,
hardlink grouping, xattrs and device numbers. Then verify, and a rebuild that reuses all."""

from __future__ import annotations

import json
from pathlib import Path

from support import trees

from weenvfs.cli import main
from weenvfs.tools import sample


def _weenv(capsys, *args: str) -> str:  # type: ignore[no-untyped-def]
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_debian_minbase_round_trip(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source = sample.sample_tree(None, "minbase", progress=False)
    store = str(tmp_path / "store")
    built = json.loads(
        _weenv(capsys, "build", str(source), "--store", store, "--group", "debian:min", "--json")
    )
    assert built["bytes_new"] > 0
    _weenv(capsys, "compose", "debian-env:min", "--group", "debian:min", "--store", store)
    _weenv(capsys, "export", "debian-env:min", str(tmp_path / "out"), "--store", store)
    trees.assert_trees_equal(source, tmp_path / "out")
    _weenv(capsys, "verify", "debian-env:min", "--store", store)
    again = json.loads(
        _weenv(capsys, "build", str(source), "--store", store, "--group", "debian:min", "--json")
    )
    assert again["index"] == built["index"] and again["bytes_new"] == 0
