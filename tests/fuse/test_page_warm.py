"""Reading a hint's files into the page cache through the mount (core/page_warm.py), with the
real CLI, the session's node service and real kernel-path mounts: after the replay, reading
the hinted files costs the mount's data device nothing (they come from the page cache), an
un-hinted file still does; chunks the replay could not fetch are never fetched on demand by
the warm-up; a hint cannot make it open anything outside the mount."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from hint_mounts import (
    CHUNK,
    WAIT,
    publish_hint,
    publish_varied_env,
    published_hint,
    wait_for_state,
)
from mounts import Mount, Mounter, run_weenv
from support.polling import wait_for

from weenvfs.core.cache import ChunkCache
from weenvfs.core.node_hints import publish_run
from weenvfs.core.page_warm import PageWarmer, open_beneath, resident_sample
from weenvfs.format.hints import Hint, HintFile, HintRecord
from weenvfs.format.index import GroupIndex
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

pytestmark = pytest.mark.requires_fuse

HINTED = ["etc/s003", "lib/big1", "etc/s040", "etc/s041", "lib/big4"]


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    return publish_varied_env(tmp_path)


def warmed(mount: Mount) -> dict[str, Any]:
    """The stats once the page-cache warm-up has ended (a hang guard, not a timing)."""

    def done() -> dict[str, Any] | None:
        stats = mount.stats()
        pages = stats["hints"].get("pages")
        return stats if pages and pages["seconds"] is not None else None

    return wait_for(done, "the end of the page-cache warm-up", WAIT, interval=0.05)


def device_reads(mount: Mount) -> int:
    return int(mount.stats()["fetch"]["reads"])


def _after_the_replay(hint: Hint, indexes: list[GroupIndex], roots: dict[int, Path],
                      cache: ChunkCache) -> PageWarmer:
    """A warm-up of `hint` as if its replay had fetched all it will (nothing is waited for)."""
    done = threading.Event()
    done.set()
    return PageWarmer(hint, indexes, roots, cache, done)


def test_hinted_files_are_read_into_the_page_cache(env, mounter: Mounter) -> None:
    if mounter.path == "fuse":
        pytest.skip("the page-cache warm-up is the kernel path's")
    store, contents = env
    publish_hint(store, "env:t", HINTED, files=True)
    mount = mounter.mount("env:t", store)
    stats = warmed(mount)
    assert stats["mount"]["path"] == "kernel"
    pages = stats["hints"]["pages"]
    assert pages["files"] == pages["files_read"] == len(HINTED) and pages["skipped"] == 0
    assert pages["bytes_read"] >= sum(len(contents[p]) for p in HINTED)
    warm_up_reads = before = device_reads(mount)
    for path in HINTED:
        assert (mount.mountpoint / path).read_bytes() == contents[path], path
    # The pages came from the page cache: reading the same files cold costs what the
    # warm-up's own reads did, and without the warm-up every one of them comes back. Up to
    # half is allowed: the kernel may drop a file's pages between the warm-up and this read
    # (seen in full CI runs, never alone: one read once, a whole file's six once).
    assert device_reads(mount) - before <= warm_up_reads // 2 and warm_up_reads > 2
    before = device_reads(mount)
    assert (mount.mountpoint / "lib/big2").read_bytes() == contents["lib/big2"]
    assert device_reads(mount) > before  # the measure can tell: an un-hinted file is read


def test_a_hint_of_chunks_only_warms_no_page(env, mounter: Mounter) -> None:
    store, contents = env
    publish_hint(store, "env:t", HINTED)  # version 1: no file records
    mount = mounter.mount("env:t", store)
    stats = wait_for_state(mount, "done")
    assert stats["hints"]["pages"] is None
    assert (mount.mountpoint / HINTED[1]).read_bytes() == contents[HINTED[1]]


def test_missing_chunks_are_skipped_not_fetched(env, mounter: Mounter, tmp_path: Path) -> None:
    """With the replay over and nothing cached, the warm-up reads nothing: a read would make
    the mount fetch on demand what the replay could not."""
    if mounter.path == "fuse":
        pytest.skip("the page-cache warm-up is the kernel path's")
    store, _ = env
    publish_hint(store, "env:t", HINTED, files=True)
    mount = mounter.mount("env:t", store, extra=["--hint", "none"])
    hint, indexes = published_hint(store)
    warmer = _after_the_replay(hint, indexes, {0: mount.mountpoint},
                               ChunkCache(tmp_path / "empty"))
    before = device_reads(mount)
    result = warmer.run()
    assert result["files"] == len(HINTED) and result["files_read"] == 0
    assert result["files_resident"] == 0  # opened and asked, but nothing is in memory
    assert result["skipped"] >= len(HINTED) and result["bytes_read"] == 0
    assert device_reads(mount) == before


def test_the_warm_up_reads_no_chunk_beyond_the_hinted_ones(env, mounter: Mounter) -> None:
    """A file read in its first chunk only (the hint says so): the warm-up's read of that
    chunk must not make the kernel read ahead into the next one, a read the mount would have
    to wait for the store for (the reference workload's hint runs had ~5 such misses before
    the warm-up turned the kernel's read-ahead off for its files)."""
    if mounter.path == "fuse":
        pytest.skip("the page-cache warm-up is the kernel path's")
    store, contents = env
    with open_store(str(store)) as opened:
        repo = Repository(opened)
        digest, manifest = repo.resolve_env("env:t")
        indexes = [repo.get_index(g.index) for g in manifest.groups]
        index = indexes[-1]
        ino = index.resolve(b"lib/big3")
        top = len(indexes) - 1
        # lib/big1's chunks too, without a file record: chunks enough to fetch that a
        # process replays (core/replay_choice.py); the warm-up reads big3 alone.
        other = [HintRecord(top, n, 1) for n in index.file_chunks(index.resolve(b"lib/big1"))]
        publish_run(repo, digest, manifest, indexes,
                    [HintRecord(top, index.file_chunks(ino)[0], 0), *other], "latest",
                    files=[HintFile(top, ino, 0)])
    mount = mounter.mount("env:t", store)
    stats = warmed(mount)
    pages = stats["hints"]["pages"]
    assert pages["files_read"] == 1 and pages["bytes_read"] == CHUNK
    assert stats["fetch"]["cache_misses"] == 0
    assert (mount.mountpoint / "lib/big3").read_bytes() == contents["lib/big3"]


def test_open_beneath_stays_in_the_folder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "dir").mkdir(parents=True)
    (root / "dir" / "f").write_bytes(b"data")
    (root / "link").symlink_to("/etc")
    (root / "dir" / "up").symlink_to("../dir/f")
    folder = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = open_beneath(folder, b"dir/f")
        assert os.read(fd, 10) == b"data"
        os.close(fd)
        for path, code in ((b"link/passwd", errno.ELOOP), (b"dir/up", errno.ELOOP),
                           (b"../root/dir/f", errno.EXDEV), (b"/etc/passwd", errno.EXDEV)):
            with pytest.raises(OSError) as caught:
                os.close(open_beneath(folder, path))
            assert caught.value.errno == code, path
    finally:
        os.close(folder)


def test_a_group_whose_mount_never_comes_is_skipped_alone(env, mounter: Mounter, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if mounter.path == "fuse":
        pytest.skip("the page-cache warm-up is the kernel path's")
    store, contents = env
    publish_hint(store, "env:t", HINTED, files=True)
    mount = mounter.mount("env:t", store)
    warmed(mount)  # the mount's own replay has cached the chunks
    hint, indexes = published_hint(store)
    # A file record of a second group, whose folder is no mount: its files are skipped, the
    # first group's are read.
    monkeypatch.setattr("weenvfs.core.page_warm.MOUNT_WAIT", 0.05)
    (tmp_path / "not-a-mount").mkdir()
    hint = hint._replace(files=(*hint.files, hint.files[0]._replace(group=1)))
    warmer = _after_the_replay(hint, [*indexes, indexes[0]],
                               {0: mount.mountpoint, 1: tmp_path / "not-a-mount"},
                               ChunkCache(mount.cache))
    result = warmer.run()
    assert result["files"] == len(HINTED) + 1 and result["skipped"] == 1
    # The mount's own warm-up read them: in the page cache already, read again at most one
    # (the kernel may reclaim a page meanwhile; see above).
    assert result["files_read"] + result["files_resident"] == len(HINTED)
    assert result["files_resident"] >= len(HINTED) - 1
    assert (mount.mountpoint / HINTED[0]).read_bytes() == contents[HINTED[0]]


def _warmer_of(mount: Mount, store: Path) -> PageWarmer:
    """A second warm-up of `mount`'s hint (its chunks cached by the mount's replay)."""
    hint, indexes = published_hint(store)
    return _after_the_replay(hint, indexes, {0: mount.mountpoint}, ChunkCache(mount.cache))


def _warmed_mount(env: tuple[Path, dict[str, bytes]], mounter: Mounter
                  ) -> tuple[Path, dict[str, bytes], Mount]:
    """`env`'s store and contents, and a kernel-path mount of it whose replay of a hint of
    HINTED (with files) has ended (skips the test on the FUSE tree)."""
    if mounter.path == "fuse":
        pytest.skip("the page-cache warm-up is the kernel path's")
    store, contents = env
    publish_hint(store, "env:t", HINTED, files=True)
    mount = mounter.mount("env:t", store)
    warmed(mount)
    return store, contents, mount


def _drop_pages(path: Path) -> None:
    """Have the kernel drop `path`'s pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_ranges_already_in_the_page_cache_are_not_read_again(env, mounter: Mounter) -> None:
    """A warm-up through a mount whose pages are resident (a group mount kept warm by the
    environments that share it) reads nothing; a file whose pages the kernel dropped is read
    again, alone."""
    store, contents, mount = _warmed_mount(env, mounter)
    before = device_reads(mount)
    again = _warmer_of(mount, store).run()
    assert again["bytes_read"] == 0 and again["files_resident"] == len(HINTED)
    assert again["bytes_resident"] >= sum(len(contents[p]) for p in HINTED)
    assert device_reads(mount) == before
    dropped = HINTED[1]  # lib/big1: several chunks, read whole by the hint
    _drop_pages(mount.mountpoint / dropped)
    third = _warmer_of(mount, store).run()
    assert third["files_read"] == 1 and third["files_resident"] == len(HINTED) - 1
    assert third["bytes_read"] == len(contents[dropped])
    assert device_reads(mount) > before
    assert (mount.mountpoint / dropped).read_bytes() == contents[dropped]


def test_a_warm_up_never_keeps_its_mount_busy(env, mounter: Mounter, tmp_path: Path) -> None:
    """`weenv umount` just after `weenv mount`, while the replay still reads through the mount,
    unmounts (the warm-up reads through a detached clone), and the warm-up then stops."""
    store, _, mount = _warmed_mount(env, mounter)
    for path in HINTED:
        _drop_pages(mount.mountpoint / path)
    hint, indexes = published_hint(store)
    # A cache without the hinted chunks, and a replay that is never done: the warm-up opens
    # the mount and waits for its first file's chunks for as long as the mount is there.
    warmer = PageWarmer(hint, indexes, {0: mount.mountpoint}, ChunkCache(tmp_path / "empty"),
                        threading.Event())
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(warmer.run()), daemon=True)
    thread.start()
    wait_for(lambda: warmer._opened or None, "the warm-up to open the mount", WAIT)
    done = run_weenv("umount", str(mount.mountpoint), check=False)
    assert done.returncode == 0, done.stderr
    assert not os.path.ismount(mount.mountpoint)
    thread.join(WAIT)
    assert not thread.is_alive() and result["files_read"] == 0


def test_resident_sample_tells_a_warm_mount_from_a_cold_one(env, mounter: Mounter) -> None:
    """What a mount's replay choice asks of a lower group's mount (core/replay_choice.py):
    its warm-up has read the hinted files, so they are resident; one of the first files
    dropped, and they are not; a file past the sample is not looked at."""
    store, contents, mount = _warmed_mount(env, mounter)
    hint, indexes = published_hint(store)
    roots = {0: mount.mountpoint}
    assert resident_sample(hint, indexes, roots, sample=2)
    _drop_pages(mount.mountpoint / HINTED[-1])  # the last file: outside a sample of two
    assert resident_sample(hint, indexes, roots, sample=2)
    _drop_pages(mount.mountpoint / HINTED[1])
    assert not resident_sample(hint, indexes, roots, sample=2)
    assert resident_sample(hint, indexes, {}, sample=2)  # no file of a group looked at
    assert (mount.mountpoint / HINTED[1]).read_bytes() == contents[HINTED[1]]
    assert resident_sample(hint, indexes, roots, sample=2)
