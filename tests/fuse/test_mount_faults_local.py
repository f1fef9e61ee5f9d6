"""Faults behind a real mount: a corrupt chunk, an unreachable store, `kill -9` of the daemon
mid-fetch, and a cache bound smaller than the workload."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import signal
import threading
from pathlib import Path

import pytest
from mounts import Mounter, publish, run_weenv
from support import trees
from support.polling import wait_for
from support.trees import file

from weenvfs.fuse import daemon
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

pytestmark = [pytest.mark.requires_fuse, pytest.mark.usefixtures("both_paths")]

KIB = 1 << 10
MIB = 1 << 20
WAIT = 30.0  # seconds any condition below may take to come true before the test fails


def file_chunk(store_dir: Path, ref: str, path: str, k: int) -> tuple[Path, int, int, str]:
    """(blob file, frame offset, frame length, chunk digest hex) of chunk `k` of `path`."""
    with open_store(str(store_dir)) as store:
        repo = Repository(store)
        _, manifest = repo.resolve_env(ref)
        index = repo.get_index(manifest.groups[-1].index)
        ino = index.resolve(path.encode())
        assert ino is not None
        rec = index.chunk(index.file_chunks(ino)[k])
        blob = index.blob_digest(rec.blob)
    return store_dir / "blobs" / blob, rec.offset, rec.clen, rec.digest.hex()


def read_errno(path: Path) -> int:
    with pytest.raises(OSError) as info:
        path.read_bytes()
    return info.value.errno


def random_tree(tmp: Path, sizes: dict[str, int], seed: int = 1) -> dict[str, bytes]:
    rng = random.Random(seed)
    contents = {path: rng.randbytes(size) for path, size in sizes.items()}
    trees.make_tree(tmp, *(file(p, d) for p, d in contents.items()))
    return contents


def test_corrupt_chunk_is_eio_for_its_files_only(tmp_path: Path, mounter: Mounter) -> None:
    contents = random_tree(tmp_path / "src", {"victim": 256 * KIB, "other": 256 * KIB,
                                              "small": 100})
    ref = publish(tmp_path / "store", [tmp_path / "src"], chunk_size=64 * KIB,
                  batch_threshold=1 * KIB)
    blob, offset, clen, digest = file_chunk(tmp_path / "store", ref, "victim", 1)
    data = bytearray(blob.read_bytes())
    data[offset + clen // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    mount = mounter.mount(ref, tmp_path / "store")
    mount.expect_log_lines(digest[:12])
    mp = mount.mountpoint
    for _ in range(3):
        assert read_errno(mp / "victim") == errno.EIO
    with open(mp / "victim", "rb") as f:  # the good first chunk still reads
        assert f.read(64 * KIB) == contents["victim"][: 64 * KIB]
    assert (mp / "other").read_bytes() == contents["other"]
    assert (mp / "small").read_bytes() == contents["small"]
    lines = mount.log_lines(digest[:12])
    assert len(lines) == 1 and "corrupt" in lines[0], lines


def test_unreachable_store_is_eio_then_recovers(tmp_path: Path, mounter: Mounter) -> None:
    """The store's blobs are away from the mount on (its metadata is read at mount time; a
    blob file the mount could open is read by the kernel path's native server through the
    descriptor it was handed: tests/fuse/test_native_fetch.py), then come back."""
    contents = random_tree(tmp_path / "src", {"a": 200 * KIB, "b": 3000})
    ref = publish(tmp_path / "store", [tmp_path / "src"], chunk_size=64 * KIB)
    blobs, away = tmp_path / "store" / "blobs", tmp_path / "blobs-away"
    blobs.rename(away)
    try:
        mount = mounter.mount(ref, tmp_path / "store", extra=["--deadline", "2"])
        mount.expect_log_lines(r"chunk [0-9a-f]{12} is unavailable")
        assert read_errno(mount.mountpoint / "a") == errno.EIO
        assert read_errno(mount.mountpoint / "b") == errno.EIO
    finally:
        away.rename(blobs)
    assert (mount.mountpoint / "a").read_bytes() == contents["a"]
    assert (mount.mountpoint / "b").read_bytes() == contents["b"]
    errors = mount.stats()["fetch"]["errors"]
    assert sum(errors.values()) >= 2, errors


def _cached_chunks(cache: Path) -> list[Path]:
    return [p for p in cache.glob("[0-9a-f][0-9a-f]/*") if len(p.name) == 64]


def test_kill_9_mid_fetch_then_remount_reads_correctly(tmp_path: Path,
                                                       mounter: Mounter) -> None:
    contents = random_tree(tmp_path / "src", {"huge": 64 * MIB, "mid": 3 * MIB + 5,
                                              "tiny": 10})
    ref = publish(tmp_path / "store", [tmp_path / "src"])
    mount = mounter.mount(ref, tmp_path / "store")
    outcome: list[BaseException | bytes] = []

    def read_huge() -> None:
        try:
            outcome.append((mount.mountpoint / "huge").read_bytes())
        except OSError as error:
            outcome.append(error)

    reader = threading.Thread(target=read_huge)
    reader.start()
    try:
        wait_for(lambda: _cached_chunks(mount.cache) or outcome, "a chunk is cached", WAIT)
        os.kill(mount.pid, signal.SIGSTOP)  # freeze it mid-fetch, then kill it there
        assert not outcome, "the read finished before the daemon could be killed"
        os.kill(mount.pid, signal.SIGKILL)
    finally:
        reader.join(WAIT)
    assert isinstance(outcome[0], OSError), outcome[0]
    wait_for(lambda: not daemon.process_alive(mount.pid), "the daemon is gone", WAIT)
    run_weenv("umount", "--lazy", str(mount.mountpoint))  # fusermount3 -u -z of the stale mount
    assert not daemon.is_mounted(mount.mountpoint)
    again = mounter.mount(ref, tmp_path / "store", mountpoint=mount.mountpoint,
                          cache=mount.cache)
    for path, data in contents.items():
        got = (again.mountpoint / path).read_bytes()
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), path
    stats = again.stats()["fetch"]
    assert stats["cache_hits"] >= 1 and not stats["errors"], stats


def cache_bytes(cache: Path) -> int:
    total = 0
    for path in _cached_chunks(cache):
        with contextlib.suppress(FileNotFoundError):  # evicted while we looked
            total += path.stat().st_size
    return total


def test_cache_bound_is_respected(tmp_path: Path, mounter: Mounter) -> None:
    sizes = {f"f{n:02d}": 400 * KIB for n in range(24)}  # ~9.4 MiB of distinct data
    contents = random_tree(tmp_path / "src", sizes)
    ref = publish(tmp_path / "store", [tmp_path / "src"], chunk_size=64 * KIB)
    bound = 2 * MIB
    mount = mounter.mount(ref, tmp_path / "store", extra=["--cache-size", str(bound)])
    for path, data in contents.items():
        assert (mount.mountpoint / path).read_bytes() == data
    wait_for(lambda: cache_bytes(mount.cache) <= bound, f"the cache is under {bound}", WAIT)
    # Everything still reads (evicted chunks are fetched again) and stays bounded.
    for path, data in reversed(contents.items()):
        with open(mount.mountpoint / path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert f.read() == data
    wait_for(lambda: cache_bytes(mount.cache) <= bound, f"the cache is under {bound}", WAIT)
