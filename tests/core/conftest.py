"""Fixtures for the core tests (no FUSE): a LocalStore-backed repository, groups built by the
real builder (tools/builder.py) from declarative entries, environments composed of them and
opened as a mount opens them, raw blobs of chosen chunks, and a chunk cache in the test's
tmp_path.

Shared by the cache/fetcher tests and the tree/reader tests; add fixtures, do not change what
existing ones return.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest
from support import layers
from support.trees import Spec, dir, file, sparse, symlink  # noqa: A004

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import ChunkLoc, chunk_loc
from weenvfs.core.loaded_env import LoadedEnv, open_environment
from weenvfs.format.chunk import encode_chunk
from weenvfs.format.digest import digest_bytes
from weenvfs.format.index import GroupIndex, file_spans
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools import builder
from weenvfs.tools.chunker import ChunkOptions
from weenvfs.tools.publish import compose_env
from weenvfs.tools.source_tar import TarSource

# Small sizes so a few KiB of test data spans several chunks and a batch chunk.
TEST_CHUNK_SIZE = 16 << 10
TEST_BATCH_THRESHOLD = 4 << 10


@dataclass
class BuiltGroup:
    """A group published in `repo` under `name:tag`, with the content of its regular files."""

    repo: Repository
    name: str
    tag: str
    index_digest: str
    index: GroupIndex
    files: dict[bytes, bytes]  # path (no leading '/') -> content, regular files only

    @property
    def ref(self) -> str:
        """`NAME:TAG`, as environments name their groups."""
        return f"{self.name}:{self.tag}"

    def ino(self, path: bytes) -> int:
        """The group inode of `path`."""
        ino = self.index.resolve(path)
        assert ino is not None, path
        return ino

    def locs(self, path: bytes) -> list[ChunkLoc]:
        """The chunk locations of regular file `path`, in file order."""
        return [chunk_loc(self.index, n) for n in self.index.file_chunks(self.ino(path))]

    def spans(self, path: bytes, offset: int, length: int) -> list[tuple[ChunkLoc, int, int]]:
        """What `Fetcher.read` needs for bytes [offset, offset + length) of file `path`."""
        found = file_spans(self.index, self.ino(path), offset, length)
        return [(chunk_loc(self.index, s.chunk), s.start, s.end) for s in found]


BuildGroup = Callable[..., BuiltGroup]
OpenEnv = Callable[..., LoadedEnv]


def _pattern(seed: int, size: int) -> bytes:
    """`size` incompressible bytes, a function of `seed` (every chunk gets its own digest)."""
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


def small_group_specs() -> list[Spec]:
    """Declarations of a small but varied tree: batched small files, a multi-chunk file, a
    sparse file (holes become zero chunks), a symlink, an empty file."""
    return [
        dir("etc"),
        file("etc/hostname", b"weenv\n"),
        file("etc/os-release", b"NAME=WeEnv\nVERSION=1\n" * 20),
        file("empty", b""),
        file("big", _pattern(1, 5 * TEST_CHUNK_SIZE + 1234)),
        file("medium", _pattern(2, TEST_CHUNK_SIZE - 100)),
        sparse("holes", 4 * TEST_CHUNK_SIZE, {TEST_CHUNK_SIZE + 10: b"data" * 100}),
        symlink("link", "etc/hostname"),
        dir("usr/lib", mode=0o755),
        file("usr/lib/libx.so", _pattern(3, 3 * TEST_CHUNK_SIZE), mode=0o755),
    ]


@pytest.fixture
def local_store(tmp_path: Path) -> LocalStore:
    """An empty writable LocalStore under tmp_path/store."""
    return LocalStore(tmp_path / "store", create=True)


@pytest.fixture
def repo(local_store: LocalStore) -> Repository:
    """A Repository over `local_store`."""
    return Repository(local_store)


@pytest.fixture
def build_group(tmp_path: Path) -> BuildGroup:
    """`build_group(repo, specs, name="g", tag="latest", chunk_size=..., batch_threshold=...,
    max_blob_size=...)`: publish one group built by tools/builder.py from `specs` (one layer:
    a list of `support.trees.Spec`, OCI whiteout markers from `support.layers` allowed; or
    several layers: a list of such lists, lowest first) and return a `BuiltGroup`."""
    counter = iter(range(1 << 30))

    def build(
        repo: Repository,
        specs: Sequence[Spec] | Sequence[Sequence[Spec]],
        name: str = "g",
        tag: str = "latest",
        *,
        chunk_size: int = TEST_CHUNK_SIZE,
        batch_threshold: int = TEST_BATCH_THRESHOLD,
        max_blob_size: int = 64 << 20,
    ) -> BuiltGroup:
        layer_list = [specs] if specs and isinstance(specs[0], Spec) else list(specs)
        sources = []
        for entries in layer_list:
            path = tmp_path / f"layer-{next(counter)}.tar"
            path.write_bytes(layers.layer(*entries))
            sources.append(TarSource(path))
        options = builder.BuildOptions(
            chunk=ChunkOptions(
                chunk_size=chunk_size,
                batch_threshold=batch_threshold,
                max_blob_size=max_blob_size,
                workers=1,
            ),
            tmp_dir=tmp_path,
        )
        try:
            result = builder.build_group(sources, repo, name, tag, options)
        finally:
            for source in sources:
                source.close()
        index = repo.get_index(result.index_digest)
        files: dict[bytes, bytes] = {}
        for entries in layer_list:
            for spec in entries:
                if spec.kind in ("reg", "sparse"):
                    files[spec.path] = spec.content()
        files = {p: c for p, c in files.items() if _is_reg(index, p)}
        return BuiltGroup(repo, name, tag, result.index_digest, index, files)

    return build


def _is_reg(index: GroupIndex, path: bytes) -> bool:
    ino = index.resolve(path)
    return ino is not None and stat.S_ISREG(index.inode(ino).mode)


@pytest.fixture
def open_env(repo: Repository) -> OpenEnv:
    """`open_env(*groups, name="env", tag="t")`: compose BuiltGroups (lowest first) into
    environment `name:tag` in `repo` and open it as a mount does (`open_environment`)."""

    def open_(*groups: BuiltGroup, name: str = "env", tag: str = "t") -> LoadedEnv:
        compose_env(repo, name, tag, [g.ref for g in groups])
        return open_environment(repo.store, f"{name}:{tag}")

    return open_


@pytest.fixture
def small_group(repo: Repository, build_group: BuildGroup) -> BuiltGroup:
    """`small_group_specs()` published as group `small:latest` in `repo`."""
    return build_group(repo, small_group_specs(), "small")


@pytest.fixture
def put_blob(repo: Repository) -> Callable[[Sequence[bytes]], list[ChunkLoc]]:
    """`put_blob(plains)`: store one blob made of one zstd frame per plaintext, in order, and
    return their ChunkLocs (frames are adjacent: chunk k+1 starts where chunk k ends)."""

    def put(plains: Sequence[bytes]) -> list[ChunkLoc]:
        frames = [encode_chunk(p) for p in plains]
        blob = repo.put_object("blobs", b"".join(frames))
        locs, offset = [], 0
        for plain, frame in zip(plains, frames, strict=True):
            locs.append(ChunkLoc(digest_bytes(plain), blob, offset, len(frame), len(plain)))
            offset += len(frame)
        return locs

    return put


@pytest.fixture
def pattern() -> Callable[[int, int], bytes]:
    """`pattern(seed, size)`: deterministic bytes, distinct per seed and per 4 KiB."""
    return _pattern


@pytest.fixture
def chunk_cache(tmp_path: Path) -> ChunkCache:
    """An empty ChunkCache under tmp_path/cache with a 64 MiB bound."""
    return ChunkCache(tmp_path / "cache", 64 << 20)
