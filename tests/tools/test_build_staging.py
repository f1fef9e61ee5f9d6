"""A killed `weenv build` leaves a staging folder; the next build and `weenv gc` find it and
remove it, and gc lists (dry run) and removes stale temp files of a directory store.

Builds run as subprocesses with TMPDIR pointing at a folder of the test's own, so no other
process's staging is ever looked at.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from fixtures import age, run_weenv

from weenvfs.store.base import TEMP_PREFIX
from weenvfs.store.local import LocalStore

HOUR = 3600.0


def stagings(tmpdir: Path) -> list[Path]:
    return sorted(p for p in tmpdir.iterdir() if p.name.startswith("weenv-build-"))


def killed_build(tmpdir: Path, store: Path) -> Path:
    """Start a build reading a tar from a pipe, let it stage some data, SIGKILL it."""
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weenvfs",
            "build",
            "-",
            "--group",
            "g:killed",
            "--store",
            str(store),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        assert proc.stdin is not None
        info = tarfile.TarInfo("big")
        info.size = 64 << 20
        proc.stdin.write(info.tobuf(format=tarfile.PAX_FORMAT))
        proc.stdin.write(os.urandom(8 << 20))
        proc.stdin.flush()
        for _ in range(1200):  # wait (bounded) until the build has created its staging
            if stagings(tmpdir) and proc.poll() is None:
                break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
    found = stagings(tmpdir)
    assert len(found) == 1, found
    return found[0]


def test_the_next_build_removes_a_killed_builds_staging(tmp_path):
    tmpdir, store = tmp_path / "tmp", tmp_path / "store"
    tmpdir.mkdir()
    left = killed_build(tmpdir, store)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a" * 1000)
    proc = run_weenv(tmpdir, "build", str(src), "--group", "g:ok", "--store", str(store))
    assert proc.returncode == 0, proc.stderr
    assert not left.exists()
    assert stagings(tmpdir) == []


def test_gc_lists_and_removes_a_killed_builds_staging(tmp_path):
    tmpdir, store = tmp_path / "tmp", tmp_path / "store"
    tmpdir.mkdir()
    left = killed_build(tmpdir, store)
    LocalStore(store, create=True).close()
    dry = run_weenv(tmpdir, "gc", "--store", str(store), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert str(left) in dry.stdout and left.exists()
    js = run_weenv(tmpdir, "gc", "--store", str(store), "--json")
    assert [s["path"] for s in json.loads(js.stdout)["stale_staging"]] == [str(left)]
    done = run_weenv(tmpdir, "gc", "--store", str(store), "--delete")
    assert done.returncode == 0, done.stderr
    assert str(left) in done.stdout and not left.exists()


def test_a_running_builds_staging_is_kept(tmp_path):
    tmpdir, store = tmp_path / "tmp", tmp_path / "store"
    tmpdir.mkdir()
    LocalStore(store, create=True).close()
    mine = tmpdir / f"weenv-build-{os.getpid()}-abc"  # our pid is alive
    mine.mkdir()
    done = run_weenv(tmpdir, "gc", "--store", str(store), "--delete")
    assert done.returncode == 0, done.stderr
    assert mine.exists()


def test_gc_dry_run_lists_stale_temp_objects(tmp_path):
    tmpdir, root = tmp_path / "tmp", tmp_path / "store"
    tmpdir.mkdir()
    LocalStore(root, create=True).close()
    (root / "blobs").mkdir(exist_ok=True)
    old = root / "blobs" / (TEMP_PREFIX + "crashed")
    old.write_bytes(b"half a blob")
    age(old, 2 * HOUR)
    young = root / "blobs" / (TEMP_PREFIX + "writing")
    young.write_bytes(b"in progress")
    dry = run_weenv(tmpdir, "gc", "--store", str(root))
    assert dry.returncode == 0, dry.stderr
    assert old.name in dry.stdout and young.name not in dry.stdout
    assert old.exists()
    done = run_weenv(tmpdir, "gc", "--store", str(root), "--delete")
    assert done.returncode == 0, done.stderr
    assert not old.exists() and young.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("kind", ["convert", "pull", "archive"])
def test_a_dead_conversions_staging_is_removed_by_the_next_conversion_and_gc(tmp_path, kind):
    """Blobs (`convert`), registry downloads (`pull`) and a decompressed archive (`archive`)
    of a conversion that died."""
    import oci_images as O
    from support import layers as L

    tmpdir, store = tmp_path / "tmp", tmp_path / "store"
    tmpdir.mkdir()
    LocalStore(store, create=True).close()
    dead = tmpdir / f"weenv-{kind}-{_dead_pid()}-abc"
    dead.mkdir()
    (dead / "blob").write_bytes(b"x" * 5000)
    dry = run_weenv(tmpdir, "gc", "--store", str(store))
    assert str(dead) in dry.stdout and dead.exists()
    image = O.write_layout(tmp_path / "layout", [L.layer(L.file("a", b"a"))])
    proc = run_weenv(tmpdir, "convert", f"oci:{image.layout}:latest", "e", "--store", str(store))
    assert proc.returncode == 0, proc.stderr
    assert not dead.exists()
    assert not [p for p in tmpdir.iterdir() if p.name.startswith("weenv-")]


def test_a_compressed_archive_is_decompressed_into_a_locked_staging(tmp_path):
    """The `weenv-archive-<pid>-*` folder lives while its source is open (kept by every
    sweep: its owner is alive and holds the lock) and goes when the source is closed."""
    import oci_images as O
    from support import layers as L

    from weenvfs.tools.docker_archive import DockerArchiveSource
    from weenvfs.tools.image_source import SourceOptions
    from weenvfs.tools.staging import remove_stale

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    image = O.write_layout(tmp_path / "layout", [L.layer(L.file("a", b"a"))])
    archive = O.docker_save_archive(image, tmp_path / "save.tar")
    packed = tmp_path / "save.tar.gz"
    packed.write_bytes(gzip.compress(archive.read_bytes()))
    source = DockerArchiveSource(packed, None, SourceOptions(tmp_dir=str(tmpdir)))
    try:
        (staging,) = tmpdir.iterdir()
        assert staging.name.startswith(f"weenv-archive-{os.getpid()}-")
        assert (staging / "archive.tar").stat().st_size == archive.stat().st_size
        assert remove_stale(tmpdir, grace=0) == [] and staging.exists()
    finally:
        source.close()
    assert not staging.exists()


def test_old_unlocked_stagings_of_every_kind_go_after_the_grace_period(tmp_path):
    """Folders named before stagings carried a pid (tempfile's 8 random characters)."""
    from weenvfs.tools.staging import stale_stagings

    names = [f"weenv-{kind}-abcd1234" for kind in ("build", "convert", "pull", "archive")]
    for name in names:
        (tmp_path / name).mkdir()
        age(tmp_path / name, 2 * HOUR)
    (tmp_path / "weenv-other-abcd1234").mkdir()  # not a staging: never touched
    age(tmp_path / "weenv-other-abcd1234", 2 * HOUR)
    assert sorted(s.path.name for s in stale_stagings(tmp_path)) == sorted(names)


@pytest.mark.parametrize("source", ["oci", "docker-archive"])
def test_a_tmp_dir_that_cannot_hold_stagings_is_bad_input(tmp_path, capsys, source):
    """`convert --tmp-dir` that is absent or a file: one line naming the option, exit 2,
    before anything is staged or stored (was an internal error from mkdtemp, exit 70)."""
    import oci_images as O
    from fixtures import assert_one_line_error, run_cli
    from support import layers as L

    image = O.write_layout(tmp_path / "layout", [L.layer(L.file("a", b"a"))])
    ref = (f"oci:{image.layout}:latest" if source == "oci"
           else f"docker-archive:{O.docker_save_archive(image, tmp_path / 'save.tar')}")
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    store = tmp_path / "store"
    for tmp_dir, problem in ((tmp_path / "nowhere" / "dir", "no such directory"),
                             (a_file, "not a directory")):
        argv = ["convert", ref, "e", "--store", str(store), "--tmp-dir", str(tmp_dir), "--quiet"]
        code, _, err = run_cli(argv, capsys)
        line = assert_one_line_error(code, err)
        assert code == 2 and line == f"weenv: error: --tmp-dir {tmp_dir}: {problem}", line
    assert not store.exists() and a_file.read_bytes() == b"x"


def test_a_staging_folder_that_cannot_be_made_is_one_line(tmp_path):
    """The API (BuildOptions.tmp_dir, no CLI check): a WeenvError naming the folder."""
    from weenvfs.errors import WeenvError
    from weenvfs.tools.staging import staging_dir

    failing = staging_dir(tmp_path / "nowhere", "build")
    with pytest.raises(WeenvError, match="cannot create a staging folder in .*nowhere"):
        failing.__enter__()
