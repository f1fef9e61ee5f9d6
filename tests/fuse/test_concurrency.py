"""32 concurrent readers over 4 mounts sharing one node cache: every byte correct, every chunk
fetched from the store exactly once across the four daemons (their `weenv stats` summed)."""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mounts import Mount, Mounter, publish
from support import trees
from support.trees import file

from weenvfs.store import open_store
from weenvfs.store.repository import Repository

pytestmark = pytest.mark.requires_fuse

KIB = 1 << 10
READERS = 32
MOUNTS = 4


def distinct_chunks(store_dir: Path, ref: str) -> set[bytes]:
    """Digests of every stored (non-zero) chunk the environment's files use."""
    with open_store(str(store_dir)) as store:
        repo = Repository(store)
        _, manifest = repo.resolve_env(ref)
        found = set()
        for group in manifest.groups:
            index = repo.get_index(group.index)
            for _, ino in index.walk():
                if index.inode(ino).is_reg:
                    for n in index.file_chunks(ino):
                        if not index.chunk(n).zero:
                            found.add(index.chunk(n).digest)
    return found


def test_readers_share_one_fetch_per_chunk(tmp_path: Path, mounter: Mounter) -> None:
    rng = random.Random(3)
    contents = {f"data/big{n:02d}": rng.randbytes(512 * KIB + n) for n in range(16)}
    contents.update({f"data/small{n:03d}": rng.randbytes(rng.randrange(1, 6000))
                     for n in range(120)})
    src = trees.make_tree(tmp_path / "src", *(file(p, d) for p, d in contents.items()))
    ref = publish(tmp_path / "store", [src], chunk_size=64 * KIB, batch_threshold=8 * KIB)
    cache = tmp_path / "shared-cache"
    mounts = [mounter.mount(ref, tmp_path / "store", cache=cache) for _ in range(MOUNTS)]
    digests = {path: hashlib.sha256(data).hexdigest() for path, data in contents.items()}

    def reader(n: int) -> list[str]:
        mount: Mount = mounts[n % MOUNTS]
        order = sorted(contents)
        random.Random(n).shuffle(order)
        wrong = []
        for path in order:
            data = (mount.mountpoint / path).read_bytes()
            if hashlib.sha256(data).hexdigest() != digests[path]:
                wrong.append(f"reader {n}: {path}")
        return wrong

    with ThreadPoolExecutor(READERS) as pool:
        wrong = [w for result in pool.map(reader, range(READERS)) for w in result]
    assert wrong == []
    stats = [m.stats()["fetch"] for m in mounts]
    fetched = sum(s["chunks_fetched"] for s in stats)
    expected = distinct_chunks(tmp_path / "store", ref)
    assert fetched == len(expected), stats
    assert sum(s["errors"].get(k, 0) for s in stats for k in s["errors"]) == 0
