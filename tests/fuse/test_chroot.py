"""Real programs from a mount: the debootstrap sample trees (tools/sample.py, built once into
the sample cache) are built into groups with the real builder, mounted, compared with their
source, and run with chroot: a shell, and Python with its shared libraries mmap'ed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from mounts import Mounter, publish
from support import trees

from weenvfs.tools import sample

pytestmark = pytest.mark.requires_fuse


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A store holding the `minbase` and `python` samples as environments of one group each."""
    store = tmp_path_factory.mktemp("samples") / "store"
    sources = {}
    for profile in ("minbase", "python"):
        sources[profile] = sample.sample_tree(None, profile, progress=False)
        publish(store, [sources[profile]], env=f"{profile}:t")
    return store, sources


def chroot(mountpoint: Path, *command: str) -> subprocess.CompletedProcess[str]:
    chroot = shutil.which("chroot", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    assert chroot is not None, "chroot(8) not found (Debian package coreutils)"
    return subprocess.run([chroot, str(mountpoint), *command], capture_output=True,
                          text=True, timeout=120, check=False, env={"PATH": "/usr/bin:/bin"})


def test_minbase_mounts_exactly_and_runs_a_shell(
    samples: tuple[Path, dict[str, Path]], mounter: Mounter
) -> None:
    store, sources = samples
    mount = mounter.mount("minbase:t", store)
    done = chroot(mount.mountpoint, "/bin/sh", "-c", "ls /; echo ok")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "ok", done.stderr
    assert "usr" in done.stdout.split()
    trees.assert_trees_equal(sources["minbase"], mount.mountpoint)


def test_python_runs_from_the_mount(
    samples: tuple[Path, dict[str, Path]], mounter: Mounter
) -> None:
    store, _ = samples
    mount = mounter.mount("python:t", store)
    code = (
        "import json, sqlite3, ssl, hashlib, decimal, ctypes; "
        "print(json.dumps([sqlite3.sqlite_version_info[0], hashlib.sha256(b'x').hexdigest()]))"
    )
    done = chroot(mount.mountpoint, "/usr/bin/python3", "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        '[3, "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"]'
    )
    fetch = mount.stats()["fetch"]
    assert 0 < fetch["bytes_decompressed"] < sum(
        f.stat().st_size for f in (mount.mountpoint / "usr/lib").rglob("*") if f.is_file()
    )
