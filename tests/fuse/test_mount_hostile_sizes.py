"""Oversized objects behind a real mount (issue 16 item 5), on both data paths.

A chunk record with clen 0xFFFFFFFF against a blob that really is 5 GiB made the daemon
allocate 6 GB+ and be OOM-killed (every reader then got ENOTCONN). The record is now refused
where it is decoded: a read of that file is EIO, the other files read right, and the daemon's
peak resident memory (VmHWM) stays within a few hundred MB. A 5 GB manifest makes the mount
fail with one line, none of it read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
from pathlib import Path

import pytest
from mounts import Mounter, publish, refused_mount
from support import trees
from support.measured import MEMORY_BOUND
from support.trees import file

from weenvfs.format import constants as C
from weenvfs.format.chunk import compress_object
from weenvfs.format.manifest import GroupRef, Manifest, encode_manifest
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository

pytestmark = [pytest.mark.requires_fuse]

GIB = 1 << 30
KIB = 1 << 10


def _peak_resident(pid: int) -> int:
    """VmHWM of process `pid` in bytes: its peak resident memory so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def _children(pid: int, name: str) -> list[int]:
    """The pids of process `pid`'s children named `name`."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{child}/comm").read_text().strip() == name:
                    found.append(int(child))
    return found


def _huge_frame_env(store_dir: Path, ref: str, victim: bytes) -> str:
    """Publish `bad:t`: `ref`'s group with `victim`'s one chunk record at offset 0 with clen
    0xFFFFFFFF, its blob file extended (sparse) to 5 GiB."""
    with LocalStore(store_dir) as store:
        repo = Repository(store)
        name, _, tag = ref.partition(":")
        (group,) = repo.get_manifest(repo.get_tag("envs", name, tag)).groups
        index = repo.get_index(group.index)
        ino = index.resolve(victim)
        assert ino is not None
        (n,) = index.file_chunks(ino)
        raw = bytearray(index.raw)
        at = index.header.chunk_offset + n * C.CHUNK.size + 40  # offset, then clen
        raw[at : at + 12] = (0).to_bytes(8, "little") + C.MAX_U32.to_bytes(4, "little")
        os.truncate(store.root / "blobs" / index.blob_digest(index.chunk(n).blob), 5 * GIB)
        patched = repo.put_object("indexes", compress_object(bytes(raw)))
        manifest = encode_manifest(Manifest((GroupRef("g", patched),)))
        repo.set_tag("envs", "bad", "t", repo.put_object("manifests", manifest))
    return "bad:t"


@pytest.mark.usefixtures("both_paths")
def test_a_4gib_frame_is_eio_and_the_daemon_stays_small(tmp_path: Path, mounter: Mounter) -> None:
    rng = random.Random(3)
    contents = {"victim": rng.randbytes(60 * KIB), "other": rng.randbytes(200 * KIB)}
    src = trees.make_tree(tmp_path / "src", *(file(p, d) for p, d in contents.items()))
    ref = publish(tmp_path / "store", [src], chunk_size=64 * KIB, batch_threshold=1 * KIB)
    bad = _huge_frame_env(tmp_path / "store", ref, b"victim")
    mount = mounter.mount(bad, tmp_path / "store")
    mount.expect_log_lines(f"clen: {C.MAX_U32} exceeds")
    mp = mount.mountpoint
    for _ in range(2):
        with pytest.raises(OSError) as info:
            (mp / "victim").read_bytes()
        assert info.value.errno == errno.EIO
        assert (mp / "other").read_bytes() == contents["other"]
    assert mount.log_lines(f"clen: {C.MAX_U32} exceeds")
    peak = _peak_resident(mount.pid)
    assert peak < MEMORY_BOUND, f"the mount daemon reached {peak >> 20} MiB resident"
    # The kernel path's native device server reads frames itself: it must refuse the record
    # as the daemon does, before reading 4 GiB for it (it once did, for ~50 s of CPU).
    for pid in _children(mount.pid, "weenv-devserve"):
        peak = _peak_resident(pid)
        assert peak < MEMORY_BOUND, f"the device server reached {peak >> 20} MiB resident"


def test_a_5gb_manifest_is_not_mounted(tmp_path: Path) -> None:
    src = trees.make_tree(tmp_path / "src", file("f", b"1"))
    ref = publish(tmp_path / "store", [src])
    with LocalStore(tmp_path / "store") as store:
        repo = Repository(store)
        digest = repo.get_tag("envs", *ref.split(":"))
        os.truncate(store.root / "manifests" / digest, 5 * GIB)
    line = refused_mount(ref, tmp_path / "store", tmp_path)
    assert f"is {5 * GIB} bytes: refused, the limit is {C.MAX_MANIFEST_SIZE}" in line
