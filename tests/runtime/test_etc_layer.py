"""runtime/etc_layer.py: the folder stacked over every sandbox's image (Docker's /etc/hosts)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from weenvfs.runtime import etc_layer


def test_the_layer_is_made_once_complete_and_readable(tmp_path: Path) -> None:
    old = os.umask(0o077)  # what a node's umask must not change
    try:
        layer = etc_layer.etc_layer(tmp_path)
    finally:
        os.umask(old)
    hosts = layer / "etc" / "hosts"
    assert hosts.read_bytes() == etc_layer.HOSTS
    assert b"127.0.0.1\tlocalhost\n" in etc_layer.HOSTS
    for path, mode in ((layer, 0o755), (layer / "etc", 0o755), (hosts, 0o644)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    assert etc_layer.etc_layer(tmp_path) == layer
    assert sorted(p.name for p in tmp_path.iterdir()) == [etc_layer.VERSION]  # no staging


def test_a_layer_made_meanwhile_by_another_sandbox_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = etc_layer.etc_layer(tmp_path)
    real = Path.is_file
    looks = []

    def is_file(path: Path) -> bool:  # the first look misses it: made while this one stages
        looks.append(path)
        return len(looks) > 1 and real(path)

    monkeypatch.setattr(Path, "is_file", is_file)
    assert etc_layer.etc_layer(tmp_path) == made  # its rename failed: the other one's taken
    assert len(looks) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [etc_layer.VERSION]  # staging gone
    assert (made / "etc" / "hosts").read_bytes() == etc_layer.HOSTS
