"""Image and build sources refuse a FIFO (or any non-regular file) where a file is read.

Each run is a subprocess with a generous timeout only as a safety net: before the fix, opening a
FIFO blocked forever, and a hung test run helps nobody. No assertion is made about the time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import oci_images as O
import pytest
from support import layers as L

BASE = L.layer(L.file("etc/passwd", b"root::0:0:root:/root:/bin/sh\n"))


def weenv(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weenvfs", *argv],
        capture_output=True,
        text=True,
        timeout=int(os.environ.get("WEENV_TEST_TIMEOUT", "120")),
        stdin=subprocess.DEVNULL,
    )


def assert_one_line(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weenv: error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def fifo_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("member", ["index.json", "oci-layout", "layer"])
def test_oci_layout_fifo_is_refused(member, tmp_path):
    image = O.write_layout(tmp_path / "layout", [BASE])
    target = (
        O.blob_path(image, image.layer_digests[0]) if member == "layer" else image.layout / member
    )
    fifo_in_place_of(target)
    proc = weenv("convert", f"oci:{image.layout}:latest", "x", "--store", str(tmp_path / "s"))
    assert_one_line(proc, "not a regular file", target.name)


def test_oci_layout_symlinked_index_is_refused(tmp_path):
    image = O.write_layout(tmp_path / "layout", [BASE])
    index = image.layout / "index.json"
    os.rename(index, tmp_path / "elsewhere.json")
    index.symlink_to(tmp_path / "elsewhere.json")
    proc = weenv("convert", f"oci:{image.layout}:latest", "x", "--store", str(tmp_path / "s"))
    assert_one_line(proc, "index.json")


def test_docker_archive_fifo_is_refused(tmp_path):
    fifo = tmp_path / "image.tar"
    os.mkfifo(fifo)
    proc = weenv("convert", f"docker-archive:{fifo}", "x", "--store", str(tmp_path / "s"))
    assert_one_line(proc, "not a regular file", str(fifo))


def test_build_from_a_fifo_is_refused(tmp_path):
    fifo = tmp_path / "layer.tar"
    os.mkfifo(fifo)
    proc = weenv("build", str(fifo), "--group", "x", "--store", str(tmp_path / "s"))
    assert_one_line(proc, "not a regular file", str(fifo))
