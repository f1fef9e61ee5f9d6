"""Hint-ordered layout (tools/layout.py + the chunker): hinted chunks and small files go into
their own blob(s), in hint order; the tree is unchanged; rebuilds are deterministic and upload
nothing new; `weenv build --hint` end to end. Reads go through the format codec
(conftest's `index_snapshot`)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import oci_images as O
import pytest
from support import layers as L
from support import trees
from support.trees import file

from weenvfs.cli import main
from weenvfs.format.hints import Hint, HintRecord, encode_hint
from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import GroupRef, Manifest, encode_manifest
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, BuildResult, build_group
from weenvfs.tools.chunker import ChunkOptions
from weenvfs.tools.layout import LayoutOrder, layout_order, load_layout_order
from weenvfs.tools.source_dir import DirSource

CHUNK = 16 << 10
OPTIONS = BuildOptions(ChunkOptions(chunk_size=CHUNK, batch_threshold=2 << 10, workers=2))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    rng = random.Random(3)
    specs = [file(f"big{n}", rng.randbytes(3 * CHUNK + 100 * n)) for n in range(6)]
    specs += [file(f"s/{n:03d}", rng.randbytes(rng.randrange(10, 1500))) for n in range(60)]
    specs.append(file("s/copy", b"same bytes" * 10))
    specs.append(file("s/copy2", b"same bytes" * 10))
    return trees.make_tree(tmp_path / "src", *specs)


def build(repo: Repository, root: Path, name: str, order: LayoutOrder | None = None,
          **options: object) -> tuple[BuildResult, GroupIndex]:
    opts = dataclasses.replace(OPTIONS, layout=order, **options)
    result = build_group(DirSource(root), repo, name, "t", opts)
    return result, repo.get_index(result.index_digest)


def env_of(repo: Repository, name: str, index_digest: str) -> str:
    return repo.put_object("manifests", encode_manifest(Manifest((GroupRef(name, index_digest),))))


def chunks_of(index: GroupIndex, path: bytes) -> list[int]:
    ino = index.resolve(path)
    assert ino is not None
    return list(index.file_chunks(ino))


def hint_for(index: GroupIndex, manifest: str, paths: list[bytes]) -> Hint:
    seen: dict[int, None] = {}
    for path in paths:
        seen.update(dict.fromkeys(chunks_of(index, path)))
    return Hint(manifest, tuple(HintRecord(0, c, t) for t, c in enumerate(seen)))


ACCESS = [b"big4", b"s/030", b"big1", b"s/005", b"s/copy"]


def test_layout_order_ranks_chunks_and_small_files(repo: Repository, tree: Path) -> None:
    _, index = build(repo, tree, "plain")
    hint = hint_for(index, "ab" * 32, ACCESS)
    order = layout_order(hint, [index])
    big4 = [index.chunk(c).digest for c in chunks_of(index, b"big4")]
    assert [order.chunks[d] for d in big4] == [0, 1, 2, 3]  # 3 chunks + 400 bytes
    small = dict(index.file_digests())
    batch = chunks_of(index, b"s/030")[0]
    same_batch = [ino for ino, _ in index.file_digests() if chunks_of_ino(index, ino) == batch]
    assert {order.files[small[ino]] for ino in same_batch} == {4}  # the whole batch, rank 4
    assert layout_order(Hint("ab" * 32, (HintRecord(1, 0, 0), HintRecord(0, 10**6, 0))),
                        [index]) == LayoutOrder()  # records naming no chunk are skipped


def chunks_of_ino(index: GroupIndex, ino: int) -> int:
    return index.file_chunks(ino)[0]


def test_hinted_data_comes_first_in_its_own_blob(repo, tree, index_snapshot, assert_same):
    _, plain = build(repo, tree, "plain")
    order = layout_order(hint_for(plain, "ab" * 32, ACCESS), [plain])
    result, laid = build(repo, tree, "laid", order)
    assert_same(index_snapshot([plain]), index_snapshot([laid]))
    hinted = [c for path in ACCESS for c in chunks_of(laid, path)]
    hinted = list(dict.fromkeys(hinted))
    blobs = {laid.chunk(c).blob for c in hinted}
    assert len(blobs) == 1  # one blob of its own ...
    others = {laid.chunk(c).blob for c in range(laid.header.chunk_count)} - blobs
    assert others  # ... not shared with the rest
    offsets = [laid.chunk(c).offset for c in hinted]
    assert offsets == sorted(offsets) and offsets[0] == 0  # in access order, from the start
    ends = [laid.chunk(c).offset + laid.chunk(c).clen for c in hinted]
    assert all(a == b for a, b in zip(ends, offsets[1:], strict=False))  # contiguous
    assert chunks_of(laid, b"s/copy2") == chunks_of(laid, b"s/copy")  # same file, one copy
    assert result.stats.files_reused == 1


def test_hinted_chunks_are_rewritten_even_when_an_earlier_index_has_them(repo, tree) -> None:
    _, plain = build(repo, tree, "g")
    order = layout_order(hint_for(plain, "ab" * 32, ACCESS), [plain])
    result, laid = build(repo, tree, "g", order)  # dedups against plain, its previous version
    hinted = {laid.chunk(c).blob for path in ACCESS for c in chunks_of(laid, path)}
    assert len(hinted) == 1 and hinted.isdisjoint(plain.blob_digests())
    assert result.stats.chunks_new == len(layout_chunks(laid, ACCESS))
    assert result.stats.chunks_reused > 0
    # The same build again: identical frames in identical order, nothing new is uploaded.
    again, same = build(repo, tree, "g", order)
    assert again.index_digest == result.index_digest and again.bytes_uploaded == 0


def layout_chunks(index: GroupIndex, paths: list[bytes]) -> set[int]:
    return {c for path in paths for c in chunks_of(index, path)}


def test_layout_builds_are_deterministic(repo, tree, tmp_path) -> None:
    _, plain = build(repo, tree, "plain")
    order = layout_order(hint_for(plain, "ab" * 32, ACCESS), [plain])
    first, _ = build(repo, tree, "a", order, dedup_previous=False)
    second, _ = build(repo, tree, "b", order, dedup_previous=False)
    assert first.index_digest == second.index_digest


def test_build_cli_takes_a_hint_by_environment_and_by_digest(repo, tree, capsys) -> None:
    _, plain = build(repo, tree, "plain")
    manifest = env_of(repo, "plain", repo.resolve_group("plain:t")[0])
    repo.set_tag("envs", "env", "t", manifest)
    hint = hint_for(plain, manifest, ACCESS)
    hint_digest = repo.put_object("hints", encode_hint(hint))
    repo.set_tag("hints", manifest, "latest", hint_digest)
    store = str(repo.store.root)
    for ref in ("env:t", hint_digest):
        assert load_layout_order(repo, ref) == layout_order(hint, [plain])
        args = ["build", str(tree), "--store", store, "--group", f"laid-{ref[:3]}:t",
                "--hint", ref, "--chunk-size", str(CHUNK), "--batch-threshold", "2048",
                "--json", "--quiet"]
        assert main(args) == 0
        laid = repo.resolve_group(f"laid-{ref[:3]}:t")[1]
        assert len({laid.chunk(c).blob for c in layout_chunks(laid, ACCESS)}) == 1
    capsys.readouterr()
    assert main(["build", str(tree), "--store", store, "--group", "x:t", "--hint", "nope:t",
                 "--quiet"]) == 1
    assert "no environment nope:t" in capsys.readouterr().err


def test_convert_takes_a_hint(repo, tmp_path, capsys) -> None:
    rng = random.Random(4)
    files = [file(f"opt/f{n}", rng.randbytes(2 * CHUNK + n)) for n in range(5)]
    files += [file(f"etc/c{n}", rng.randbytes(300 + n)) for n in range(20)]
    image = O.write_layout(tmp_path / "layout", [L.layer(*files)])
    store = str(repo.store.root)
    common = ["--store", store, "--chunk-size", str(CHUNK), "--batch-threshold", "2048",
              "--quiet"]
    assert main(["convert", f"oci:{image.layout}", "img:t", *common]) == 0
    digest, manifest = repo.resolve_env("img:t")
    index = repo.get_index(manifest.groups[0].index)
    access = [b"opt/f3", b"etc/c7", b"opt/f0"]
    hint = hint_for(index, digest, access)
    repo.set_tag("hints", digest, "latest", repo.put_object("hints", encode_hint(hint)))
    assert main(["convert", f"oci:{image.layout}", "img2:t", *common, "--hint", "img:t"]) == 0
    _, manifest2 = repo.resolve_env("img2:t")
    laid = repo.get_index(manifest2.groups[0].index)
    hinted = list(dict.fromkeys(c for path in access for c in chunks_of(laid, path)))
    assert len({laid.chunk(c).blob for c in hinted}) == 1
    offsets = [laid.chunk(c).offset for c in hinted]
    assert offsets == sorted(offsets) and offsets[0] == 0
    capsys.readouterr()
