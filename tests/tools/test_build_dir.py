"""Building groups from directories: exact metadata, determinism, dedup, holes, batching.

Every check reads the published objects back through the format codec (ranged GETs,
`decode_chunk`, `file_spans`) and compares with `support.trees` snapshots.
"""

from __future__ import annotations

import io
import os
import random
import socket
from pathlib import Path

import pytest
from support import trees
from support.trees import dir, file, hardlink, sparse  # noqa: A004

from weenvfs.errors import SourceError
from weenvfs.format import constants as C
from weenvfs.format.index import GroupIndex
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, BuildResult, build_group
from weenvfs.tools.chunker import Chunker, ChunkOptions, DedupTable
from weenvfs.tools.entries import DataStream, Entry, Kind
from weenvfs.tools.source_dir import DirSource, data_extents
from weenvfs.tools.tree import GroupTree

MIB = 1 << 20


def build(repo: Repository, root: Path, group: str = "g", **chunk: int) -> BuildResult:
    name, _, tag = group.partition(":")
    options = BuildOptions(ChunkOptions(**chunk))
    return build_group(DirSource(root), repo, name, tag or "latest", options)


def index_of(repo: Repository, result: BuildResult) -> GroupIndex:
    return repo.get_index(result.index_digest)


def test_hostile_tree_round_trips_exactly(tmp_path, repo, index_snapshot, assert_same):
    src = trees.hostile_tree(tmp_path / "src")
    result = build(repo, src)
    assert_same(trees.snapshot(src), index_snapshot([index_of(repo, result)]))
    assert result.counts.hardlinks == 2
    assert result.counts.devices == 5 and result.counts.fifos == 1
    assert repo.get_tag("groups", "g", "latest") == result.index_digest


def test_hardlinks_share_one_inode(tmp_path, repo):
    src = trees.make_tree(
        tmp_path / "src", file("a", b"x" * 100), hardlink("b", "a"), dir("d"), hardlink("d/c", "a")
    )
    index = index_of(repo, build(repo, src))
    inos = {index.resolve(p) for p in (b"a", b"b", b"d/c")}
    assert len(inos) == 1
    assert index.inode(inos.pop()).nlink == 3


def test_sparse_file_holes_become_zero_chunks(tmp_path, repo, read_file):
    size = 10 * MIB
    src = trees.make_tree(
        tmp_path / "src", sparse("s", size, {0: b"head", 4 * MIB + 5: b"mid", size - 1: b"!"})
    )
    result = build(repo, src)
    index = index_of(repo, result)
    ino = index.resolve(b"s")
    zero = [index.chunk(n).zero for n in index.file_chunks(ino)]
    assert zero == [False, True, True, True, False, True, True, True, True, False]
    assert result.stats.chunks_zero == 7 and result.stats.bytes_zero == 7 * MIB
    assert result.stats.chunks_new == 3
    assert (
        read_file(index, ino)
        == trees.sparse("s", size, {0: b"head", 4 * MIB + 5: b"mid", size - 1: b"!"}).content()
    )


def test_data_extents_finds_holes(tmp_path):
    path = tmp_path / "s"
    trees.make_tree(tmp_path, sparse("s", 8 * MIB, {3 * MIB: b"x" * 10}))
    fd = os.open(path, os.O_RDONLY)
    try:
        extents = data_extents(fd, 8 * MIB)
    finally:
        os.close(fd)
    if extents is None or os.stat(path).st_blocks * 512 >= 8 * MIB:
        pytest.fail(f"{tmp_path} does not keep holes; cannot test SEEK_DATA here")
    assert len(extents) == 1
    start, end = extents[0]
    assert start <= 3 * MIB < 3 * MIB + 10 <= end <= 4 * MIB


class _RecordingFile(io.BytesIO):
    """A file that remembers which byte ranges were read (to prove holes are skipped)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.read_ranges: list[tuple[int, int]] = []

    def read(self, n: int | None = -1) -> bytes:  # type: ignore[override]
        start = self.tell()
        data = super().read(n)
        self.read_ranges.append((start, start + len(data)))
        return data


def test_chunker_never_reads_holes(tmp_path):
    data = bytearray(6 * MIB)
    data[2 * MIB : 2 * MIB + 3] = b"abc"
    recorder = _RecordingFile(bytes(data))
    entry = Entry(
        b"f",
        Kind.REG,
        size=len(data),
        open_data=lambda: DataStream(recorder, [(2 * MIB, 2 * MIB + 4096)]),
    )
    tree = GroupTree()
    node = tree.add(entry)
    chunker = Chunker(ChunkOptions(), tmp_path)
    try:
        chunker.add_file(node, entry)
        blobs = chunker.finish()
    finally:
        chunker.close()
    assert [c.blob is None for c in node.chunks] == [True, True, False, True, True, True]
    assert recorder.read_ranges and all(
        s >= 2 * MIB and e <= 3 * MIB for s, e in recorder.read_ranges if e > s
    )
    assert len(blobs) == 1 and blobs[0].chunks == 1


def _payload_tree(root: Path, big: bytes, smalls: list[bytes]) -> Path:
    return trees.make_tree(
        root,
        file("big.bin", big),
        dir("small"),
        *(file(f"small/f{i:03d}", d) for i, d in enumerate(smalls)),
    )


@pytest.fixture
def payload() -> tuple[bytes, list[bytes]]:
    rng = random.Random(7)
    return rng.randbytes(5 * MIB), [rng.randbytes(rng.randrange(1, 3000)) for _ in range(150)]


def test_same_input_gives_identical_index_and_blobs(tmp_path, payload):
    src = _payload_tree(tmp_path / "src", *payload)
    outs = []
    for n, workers in enumerate((1, 6)):
        store = LocalStore(tmp_path / f"store{n}", create=True)
        repo = Repository(store)
        opts = BuildOptions(ChunkOptions(workers=workers, max_blob_size=2 * MIB))
        result = build_group(DirSource(src), repo, "g", "latest", opts)
        blobs = {k: store.get(k) for k in store.list("blobs/")}
        outs.append((result.index_digest, blobs))
    assert outs[0][0] == outs[1][0]
    assert outs[0][1] == outs[1][1]
    assert len(outs[0][1]) >= 3  # rolled over at 2 MiB


def test_one_changed_byte_uploads_one_chunk(tmp_path, repo, store, payload, read_file):
    big, smalls = payload
    first = build(repo, _payload_tree(tmp_path / "v1", big, smalls))
    assert first.stats.chunks_new == 5 + 1  # five 1 MiB chunks and one batch
    changed = bytearray(big)
    changed[3 * MIB + 12345] ^= 0x01
    blobs_before = set(store.list("blobs/"))
    second = build(repo, _payload_tree(tmp_path / "v2", bytes(changed), smalls))
    assert second.previous == first.index_digest
    s = second.stats
    assert (s.chunks_new, s.bytes_new) == (1, MIB)
    assert (s.chunks_reused, s.files_reused) == (4 + 1, len(smalls))
    assert second.blobs_uploaded == 1
    assert len(set(store.list("blobs/")) - blobs_before) == 1
    index = index_of(repo, second)
    assert read_file(index, index.resolve(b"big.bin")) == bytes(changed)
    # The new index lists the old blob (reused chunks) and the new one.
    assert len(index.blob_digests()) == 2


def test_one_changed_small_file_uploads_one_small_batch(tmp_path, repo, payload, read_file):
    big, smalls = payload
    build(repo, _payload_tree(tmp_path / "v1", big, smalls))
    smalls2 = list(smalls)
    smalls2[42] = b"a different small file"
    second = build(repo, _payload_tree(tmp_path / "v2", big, smalls2))
    s = second.stats
    assert (s.chunks_new, s.bytes_new) == (1, len(smalls2[42]))
    assert s.files_reused == len(smalls) - 1
    assert second.blobs_uploaded == 1
    index = index_of(repo, second)
    for i in (41, 42, 43):
        assert read_file(index, index.resolve(b"small/f%03d" % i)) == smalls2[i]


def test_unchanged_rebuild_is_the_same_index_and_uploads_nothing(tmp_path, repo, payload):
    src = _payload_tree(tmp_path / "src", *payload)
    first = build(repo, src)
    second = build(repo, src)
    assert second.index_digest == first.index_digest
    assert (second.stats.chunks_new, second.blobs_new, second.blobs_uploaded) == (0, 0, 0)


def test_dedup_with_another_group_and_without_previous(tmp_path, repo, payload):
    src = _payload_tree(tmp_path / "src", *payload)
    build(repo, src, "base")
    other = build_group(
        DirSource(src), repo, "other", "v1", BuildOptions(dedup_with=("base:latest",))
    )
    assert other.stats.chunks_new == 0 and other.blobs_uploaded == 0
    fresh = build_group(DirSource(src), repo, "base", "latest", BuildOptions(dedup_previous=False))
    assert fresh.previous is None and fresh.stats.chunks_new == 6


def test_batches_close_at_chunk_size(tmp_path, repo, read_file):
    rng = random.Random(3)
    smalls = [rng.randbytes(rng.randrange(100, 1000)) for _ in range(60)]
    src = trees.make_tree(tmp_path / "src", *(file(f"f{i:02d}", d) for i, d in enumerate(smalls)))
    result = build(repo, src, chunk_size=4096, batch_threshold=1024)
    index = index_of(repo, result)
    batches = {index.file_chunks(index.resolve(b"f%02d" % i))[0] for i in range(60)}
    assert len(batches) == result.stats.chunks_new > 1
    assert all(index.chunk(n).ulen <= 4096 for n in batches)
    for i, data in enumerate(smalls):
        assert read_file(index, index.resolve(b"f%02d" % i)) == data


def test_file_at_threshold_is_chunked_not_batched(tmp_path, repo):
    src = trees.make_tree(
        tmp_path / "src",
        file("a", b"a" * C.DEFAULT_BATCH_THRESHOLD),
        file("b", b"b" * (C.DEFAULT_BATCH_THRESHOLD - 1)),
    )
    index = index_of(repo, build(repo, src))
    digests = dict(index.file_digests())
    assert index.resolve(b"b") in digests and index.resolve(b"a") not in digests


def test_empty_tree_stores_no_blob(tmp_path, repo, store):
    src = trees.make_tree(tmp_path / "src", dir(".", 0o700, uid=5, mtime=42), file("empty"))
    result = build(repo, src)
    assert result.blobs_new == 0 and list(store.list("blobs/")) == []
    root = index_of(repo, result).inode(0)
    assert (root.mode & 0o7777, root.uid, root.mtime_ns) == (0o700, 5, 42)


def test_sockets_are_skipped_with_a_warning(tmp_path, repo, assert_logs):
    src = trees.make_tree(tmp_path / "src", file("a", b"x"))
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(src / "sock"))
        with assert_logs("skipping socket sock", count=1):
            result = build(repo, src)
    finally:
        sock.close()
    assert index_of(repo, result).resolve(b"sock") is None


def test_source_that_is_not_a_directory(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(SourceError, match="not a directory"):
        DirSource(tmp_path / "f")


def test_file_that_shrinks_while_reading_fails_the_build(tmp_path, repo, store, store_state):
    src = trees.make_tree(tmp_path / "src", file("big", b"z" * (2 * MIB)))
    source = DirSource(src)
    entries = list(source.entries())
    os.truncate(src / "big", MIB)

    class Frozen:
        label, total_bytes = "frozen", None

        def entries(self):
            return iter(entries)

        def close(self) -> None:
            pass

    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(SourceError, match="changed while reading"):
        build_group(Frozen(), repo, "g", "latest", BuildOptions(tmp_dir=work))
    assert store_state() == {"tags": [], "indexes": []}
    assert list(work.iterdir()) == []


def test_reused_blob_gone_is_refused(tmp_path, repo, store, payload, store_state):
    src = _payload_tree(tmp_path / "src", *payload)
    build(repo, src, "base")
    for key in list(store.list("blobs/")):
        store.delete(key)
    with pytest.raises(Exception, match="reused blob .* is missing"):
        build_group(DirSource(src), repo, "other", "latest", BuildOptions(dedup_with=("base",)))
    assert [t for t in store_state()["tags"] if "other" in t] == []


def test_dedup_table_from_index(tmp_path, repo, payload):
    result = build(repo, _payload_tree(tmp_path / "src", *payload))
    table = DedupTable()
    table.add_index(index_of(repo, result))
    assert len(table.chunks) == 6
    assert len(table.files) == len(set(payload[1]))
