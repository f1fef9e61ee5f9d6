"""The native device server fetching chunks itself from a local folder store's blob files
(native/weenv-devserve.c "Frame sources", fuse/native_devices.py `_send_sources`): the right
bytes, cached as the cache caches them (trusted by the next process), counted in the mount's
stats; a frame that does not verify is never served (EIO, as the daemon's fetcher answers);
a chunk another process is fetching is left to the daemon, which waits for it; the blob
files handed over serve after the store moves; a cache without user xattrs fetches nothing
here. (Neighbourhoods from S3 as sources: tests/store/test_mount_faults.py.)

Real parts: `weenv mount` daemons on the kernel path, the installed server built with zstd
and BLAKE3 (scripts/setup.sh; CI fails rather than skip without them).
"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import threading
from pathlib import Path

import blake3
import pytest
from mounts import Mounter, run_weenv
from support.polling import wait_for

from weenvfs.core.cache import TRUST_XATTR, current_boot_id
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

pytestmark = [pytest.mark.requires_fuse, pytest.mark.usefixtures("native_server")]

KERNEL = ["--path", "kernel", "--hint", "none"]
WAIT = 30.0


def _frame(store: Path, path: str, k: int = 0) -> tuple[Path, int, int, str]:
    """(blob file, frame offset, frame length, chunk digest hex) of chunk `k` of `path`."""
    with open_store(str(store)) as opened:
        repo = Repository(opened)
        _, manifest = repo.resolve_env("env:t")
        index = repo.get_index(manifest.groups[-1].index)
        ino = index.resolve(path.encode())
        assert ino is not None
        rec = index.chunk(index.file_chunks(ino)[k])
        return store / "blobs" / index.blob_digest(rec.blob), rec.offset, rec.clen, rec.digest.hex()


def _cached(cache: Path, digest: str) -> Path:
    return cache / digest[:2] / digest


def _small(contents: dict[str, bytes]) -> list[str]:
    """The files of one (batch) chunk each: reading them queues no read-ahead in the daemon
    (whose fetches would hold chunk locks the server then leaves to it)."""
    return sorted(path for path in contents if path.startswith("etc/"))


def _cached_files(cache: Path) -> list[Path]:
    return [p for p in cache.glob("[0-9a-f][0-9a-f]/*") if len(p.name) == 64]


def test_a_folder_store_s_chunks_are_fetched_by_the_server(varied_env, mounter: Mounter) -> None:
    store, contents = varied_env
    mount = mounter.mount("env:t", store, extra=KERNEL)
    for path in _small(contents):
        assert (mount.mountpoint / path).read_bytes() == contents[path], path
    stats = mount.stats()
    native, fetch = stats["mount"]["native_server"], stats["fetch"]
    assert native["fetches"] is True and native["fetches_reason"] is None, native
    # Every miss was fetched by the server: none came back to the daemon.
    assert native["forwarded"] == 0, native
    assert native["fetched_chunks"] > 0
    # Counted in the mount's stats as the daemon's own fetches are.
    assert fetch["chunks_fetched"] == fetch["cache_misses"] == native["fetched_chunks"]
    assert fetch["requests"] == native["fetched_chunks"] and fetch["bytes_fetched"] > 0
    assert fetch["read_waits"]["count"] == native["fetched_chunks"]
    # Cached as the cache caches a chunk: named by its digest, marked verified in this boot.
    files = _cached_files(mount.cache)
    assert len(files) == native["fetched_chunks"]
    for cached in files:
        assert blake3.blake3(cached.read_bytes()).hexdigest() == cached.name
        assert os.getxattr(cached, TRUST_XATTR) == current_boot_id()
    # Files of several chunks: the server and the daemon's read-ahead fetch them side by
    # side (each chunk once: its lock), the right bytes either way.
    for path in sorted(contents):
        assert (mount.mountpoint / path).read_bytes() == contents[path], path
    fetch = mount.stats()["fetch"]
    assert fetch["chunks_fetched"] == len(_cached_files(mount.cache))
    assert not list((mount.cache / "tmp").iterdir())
    assert not list((mount.cache / "locks").iterdir())


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_frame_that_does_not_verify_is_never_served(varied_env, mounter: Mounter,
                                                      where: str) -> None:
    """A frame whose header declares another size (refused before decompressing) or whose
    bytes decode to other bytes (the random data is stored in raw blocks: a flipped byte
    decodes, to a plaintext whose BLAKE3 differs): the read fails with EIO, nothing is
    cached, the chunk is reported corrupt once, and the other files read right."""
    store, contents = varied_env
    blob, offset, clen, digest = _frame(store, "lib/big3", 1)
    data = bytearray(blob.read_bytes())
    data[offset + (5 if where == "header" else clen // 2)] ^= 0x5A
    blob.write_bytes(bytes(data))
    mount = mounter.mount("env:t", store, extra=KERNEL)
    mount.expect_log_lines(digest[:12])
    for _ in range(2):
        with pytest.raises(OSError) as info:
            (mount.mountpoint / "lib/big3").read_bytes()
        assert info.value.errno == errno.EIO
    assert not _cached(mount.cache, digest).exists()
    for path in sorted(contents):
        if path != "lib/big3":
            assert (mount.mountpoint / path).read_bytes() == contents[path], path
    lines = mount.log_lines(digest[:12])
    assert len(lines) == 1 and "corrupt" in lines[0], lines
    stats = mount.stats()
    assert stats["mount"]["native_server"]["forwarded"] >= 1
    assert stats["fetch"]["errors"].get("corrupt", 0) >= 1, stats["fetch"]


def test_a_chunk_another_process_fetches_is_left_to_the_daemon(
        varied_env, mounter: Mounter) -> None:
    """The server takes a chunk's cross-process fetch lock without waiting; held elsewhere,
    the read goes to the daemon, which waits for the holder as its fetcher does, then
    fetches the chunk itself once the holder let go without caching it."""
    store, contents = varied_env
    _, _, _, digest = _frame(store, "lib/big1", 0)
    mount = mounter.mount("env:t", store, extra=KERNEL)
    lock_path = mount.cache / "locks" / digest
    holder = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX)
    outcome: list[bytes | OSError] = []

    def read() -> None:
        try:
            outcome.append((mount.mountpoint / "lib/big1").read_bytes())
        except OSError as error:
            outcome.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        wait_for(lambda: mount.stats()["mount"]["native_server"]["forwarded"] >= 1,
                 "the read of the locked chunk reaches the daemon", WAIT)
        assert not outcome, "the read did not wait for the lock's holder"
        assert not _cached(mount.cache, digest).exists()
    finally:
        os.unlink(lock_path)  # as a holder lets go (core/chunk_locks.py)
        os.close(holder)
        reader.join(WAIT)
    assert outcome == [contents["lib/big1"]]
    assert blake3.blake3(_cached(mount.cache, digest).read_bytes()).hexdigest() == digest


def test_blob_files_handed_over_serve_after_the_store_moves(varied_env, mounter: Mounter,
                                                            tmp_path: Path) -> None:
    """The daemon opens a folder store's blob files once, when it mounts, and the server
    reads them through those descriptors: a store moved (or its blobs deleted) afterwards
    still serves what the server fetches, verified as ever (what the daemon fetches needs
    the store where it was). A blob that was missing when the daemon
    mounted is the daemon's to fetch (tests/fuse/test_mount_faults_local.py: EIO, then the
    bytes once it is back)."""
    store, contents = varied_env
    mount = mounter.mount("env:t", store, extra=KERNEL)
    store.rename(tmp_path / "moved")
    try:
        for path in _small(contents):
            assert (mount.mountpoint / path).read_bytes() == contents[path], path
        assert mount.stats()["mount"]["native_server"]["forwarded"] == 0
    finally:
        (tmp_path / "moved").rename(store)


def test_a_cache_without_xattrs_leaves_fetching_to_the_daemon(varied_env, mounter: Mounter,
                                                               tmp_path: Path) -> None:
    """A node cache on a file system without user xattrs (ramfs) cannot carry the trust
    marker the server's cache files need: its first write is refused, and from then on it
    leaves every fetch to the daemon (which verifies each chunk in every process, as the
    cache does there); `weenv stats` says why."""
    store, contents = varied_env
    cache = tmp_path / "ramfs-cache"
    cache.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(cache)], check=True)
    try:
        mount = mounter.mount("env:t", store, cache=cache, extra=KERNEL)
        for path in sorted(contents):
            assert (mount.mountpoint / path).read_bytes() == contents[path], path
        native = mount.stats()["mount"]["native_server"]
        assert native["fetches"] is False and "xattrs" in native["fetches_reason"], native
        assert native["fetched_chunks"] == 0 and native["forwarded"] > 0, native
        run_weenv("umount", str(mount.mountpoint))
    finally:
        if subprocess.run(["umount", str(cache)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(cache)], check=False)


def test_a_neighbourhood_handed_over_is_kept_as_a_mapping_of_its_memfd() -> None:
    """What `_share_frames` returns to the fetcher: the memfd's bytes, mapped read-only and
    still readable once the descriptor is closed (the stash keeps it instead of its copy)."""
    from weenvfs.fuse.native_devices import _mapped, _memfd

    data = os.urandom(3 << 20)
    fd = _memfd("weenv-test-frames", [data])
    mapping = _mapped(fd, len(data))
    os.close(fd)
    assert mapping is not None and mapping[:] == data and len(mapping) == len(data)
    with pytest.raises(TypeError):
        mapping[0] = 0  # read-only: nothing here can change what the server serves
    mapping.close()
