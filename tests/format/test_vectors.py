"""Golden vectors (format/vectors/): the committed bytes are what the codec reads and writes.

- every file's digest and size equal vectors.json, and `generate.py --check` passes (in
  process and as the documented command), so the files are exactly the generator's output;
- decode, re-encode, compare byte for byte: raw index == encode_index(tree the generator
  builds) == encode_index(tree decoded from the raw index); the stored object decodes to the raw;
- every expected entry (inode number, metadata, xattrs, content digest) and read (verified
  through blob frames) of vectors.json, and the composed tree of `env`;
- manifests and hints decode, re-encode canonically and bind to each other.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
from format_support import VECTORS_DIR, exercise, read_file, tree_from_index

from weenvfs.format import constants as C
from weenvfs.format.chunk import decode_chunk, decompress_object
from weenvfs.format.compose import ComposedTree
from weenvfs.format.digest import digest_hex
from weenvfs.format.hints import decode_hint, encode_hint
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import encode_index
from weenvfs.format.manifest import decode_manifest, encode_manifest

_TYPE = {
    stat.S_IFDIR: "dir",
    stat.S_IFREG: "reg",
    stat.S_IFLNK: "lnk",
    stat.S_IFCHR: "chr",
    stat.S_IFBLK: "blk",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "sock",
}


def _groups(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(v["name"], g) for v in doc["vectors"] for g in v["groups"]]


def _listed_files(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for vector in doc["vectors"]:
        out[vector["manifest"]["file"]] = vector["manifest"]
        out[vector["hint"]["file"]] = vector["hint"]
        if "packed_hint" in vector:
            out[vector["packed_hint"]["file"]] = vector["packed_hint"]
            out[vector["packed_hint"]["pack"]["file"]] = vector["packed_hint"]["pack"]
        for g in vector["groups"]:
            for key in ("index_object", "index_raw", "blob"):
                if g[key] is not None:
                    out[g[key]["file"]] = g[key]
    out[doc["erofs"]["image"]["file"]] = doc["erofs"]["image"]  # SPEC.md section 15
    return out


def test_vectors_cover_the_brief(vectors_doc: dict[str, Any]) -> None:
    names = [v["name"] for v in vectors_doc["vectors"]]
    assert names == ["minimal", "files", "env"]
    assert len(next(v for v in vectors_doc["vectors"] if v["name"] == "env")["groups"]) == 3


def test_every_file_is_listed_with_its_digest(
    vectors_doc: dict[str, Any], vector_files: dict[str, bytes]
) -> None:
    listed = _listed_files(vectors_doc)
    assert set(listed) == set(vector_files) - {"vectors.json"}
    for name, info in listed.items():
        assert digest_hex(vector_files[name]) == info["digest"], name
        assert len(vector_files[name]) == info["size"], name


def test_generator_check_passes_in_process(generator: ModuleType) -> None:
    assert generator.main(["--check"]) == 0


def test_generator_check_passes_as_a_command() -> None:
    result = subprocess.run(
        [sys.executable, str(VECTORS_DIR / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generator_is_deterministic(generator: ModuleType) -> None:
    assert generator.build_all() == generator.build_all()


def test_generator_check_reports_differences(generator: ModuleType, tmp_path: Any) -> None:
    assert generator.main(["--out", str(tmp_path)]) == 0
    assert generator.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "files.index.bin").write_bytes(b"changed")
    (tmp_path / "stray.bin").write_bytes(b"")
    assert generator.main(["--check", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("vector", ["minimal", "files", "env"])
def test_raw_index_is_what_the_writer_makes(
    vector: str, generator: ModuleType, vectors_doc: dict[str, Any], vector_files: dict[str, bytes]
) -> None:
    spec = generator.VECTORS[vector]
    for (name, entries), info in zip(
        spec.groups, _vector(vectors_doc, vector)["groups"], strict=True
    ):
        assert info["name"] == name
        raw = vector_files[info["index_raw"]["file"]]
        group = generator.build_group(entries, spec.chunk_size)
        assert encode_index(group.root, spec.chunk_size) == raw
        stored = vector_files[info["index_object"]["file"]]
        assert decompress_object(stored, "index", 1 << 32) == raw
        assert GroupIndex.from_object(stored).raw == raw


@pytest.mark.parametrize("vector", ["minimal", "files", "env"])
def test_decode_then_reencode_byte_for_byte(
    vector: str, vectors_doc: dict[str, Any], vector_files: dict[str, bytes]
) -> None:
    v = _vector(vectors_doc, vector)
    for info in v["groups"]:
        raw = vector_files[info["index_raw"]["file"]]
        index = GroupIndex(raw)
        assert exercise(index) == len(info["entries"])
        assert encode_index(tree_from_index(index), v["chunk_size"]) == raw


def _vector(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in doc["vectors"] if v["name"] == name)


@pytest.mark.parametrize("vector", ["minimal", "files", "env"])
def test_expected_entries(
    vector: str, vectors_doc: dict[str, Any], vector_files: dict[str, bytes]
) -> None:
    v = _vector(vectors_doc, vector)
    blobs = {g["blob"]["digest"]: vector_files[g["blob"]["file"]] for g in v["groups"] if g["blob"]}
    for info in v["groups"]:
        index = GroupIndex.from_object(vector_files[info["index_object"]["file"]])
        assert index.chunk_size == v["chunk_size"]
        assert index.inode_count == len({e["inode"] for e in info["entries"]})
        walked = [path for path, _ in index.walk()]
        assert walked == [bytes.fromhex(e["path_hex"]) for e in info["entries"]]
        for e in info["entries"]:
            _check_entry(index, e, blobs)


def _check_entry(index: GroupIndex, e: dict[str, Any], blobs: dict[str, bytes]) -> None:
    path = bytes.fromhex(e["path_hex"])
    ino = index.resolve(path)
    assert ino == e["inode"], e["path"]
    rec = index.inode(ino)
    assert _TYPE[stat.S_IFMT(rec.mode)] == e["type"]
    observed = (rec.mode, rec.uid, rec.gid, rec.nlink, rec.mtime_ns, rec.rdev)
    assert observed == (e["mode"], e["uid"], e["gid"], e["nlink"], e["mtime_ns"], e["rdev"])
    assert (rec.whiteout, rec.opaque, rec.implied) == (e["whiteout"], e["opaque"], e["implied"])
    assert {k.hex(): v.hex() for k, v in index.xattrs(ino)} == e["xattrs_hex"]
    if e["type"] == "lnk":
        assert index.readlink(ino).hex() == e["target_hex"]
        assert rec.size == e["size"]
    if e["type"] == "reg":
        assert rec.size == e["size"]
        data = read_file(index, ino, blobs, 0, rec.size)
        assert digest_hex(data) == e["content_blake3"]


@pytest.mark.parametrize("vector", ["files", "env"])
def test_expected_reads(
    vector: str, vectors_doc: dict[str, Any], vector_files: dict[str, bytes]
) -> None:
    v = _vector(vectors_doc, vector)
    assert v["reads"]
    blobs = {g["blob"]["digest"]: vector_files[g["blob"]["file"]] for g in v["groups"] if g["blob"]}
    for r in v["reads"]:
        info = v["groups"][r["group"]]
        index = GroupIndex.from_object(vector_files[info["index_object"]["file"]])
        ino = index.resolve(bytes.fromhex(r["path_hex"]))
        assert ino is not None
        data = read_file(index, ino, blobs, r["offset"], r["length"])
        assert data.hex() == r["data_hex"], r


def test_files_vector_has_what_the_spec_promises(
    vectors_doc: dict[str, Any], vector_files: dict[str, bytes]
) -> None:
    info = _vector(vectors_doc, "files")["groups"][0]
    index = GroupIndex(vector_files[info["index_raw"]["file"]])
    h = index.header
    assert (h.feature_compat, h.feature_incompat) == (1, 1)
    chunks = [index.chunk(n) for n in range(h.chunk_count)]
    assert sum(c.zero for c in chunks) == 1
    big, copy = index.resolve(b"big.bin"), index.resolve(b"big-copy.bin")
    assert len(index.file_chunks(big)) == 4
    assert index.file_chunks(big) == index.file_chunks(copy)  # one run of records, shared
    batched = [ino for ino, _ in index.file_digests()]
    assert len(batched) == 7 and len({index.file_chunks(i)[0] for i in batched}) == 1
    assert len({e["type"] for e in info["entries"]}) == 7
    assert any(len(bytes.fromhex(e["path_hex"]).rsplit(b"/")[-1]) == 255 for e in info["entries"])


def test_env_composes_as_spec_section_7_3(
    vectors_doc: dict[str, Any], vector_files: dict[str, bytes]
) -> None:
    v = _vector(vectors_doc, "env")
    groups = [GroupIndex.from_object(vector_files[g["index_object"]["file"]]) for g in v["groups"]]
    tree = ComposedTree(groups)
    got = [
        (path.hex(), entry.group, _TYPE[stat.S_IFMT(groups[entry.group].inode(entry.inode).mode)])
        for path, entry in tree.walk()
    ]
    assert got == [(c["path_hex"], c["group"], c["type"]) for c in v["composed"]]


@pytest.mark.parametrize("vector", ["minimal", "files", "env"])
def test_manifest_and_hint(
    vector: str, vectors_doc: dict[str, Any], vector_files: dict[str, bytes]
) -> None:
    v = _vector(vectors_doc, vector)
    data = vector_files[v["manifest"]["file"]]
    manifest = decode_manifest(data)
    assert encode_manifest(manifest) == data
    assert [g.index for g in manifest.groups] == [g["index_object"]["digest"] for g in v["groups"]]
    assert [g.name for g in manifest.groups] == [g["name"] for g in v["groups"]]
    hint = decode_hint(vector_files[v["hint"]["file"]])
    assert hint.manifest == v["manifest"]["digest"] == v["hint"]["manifest"]
    assert [list(r) for r in hint.records] == v["hint"]["records"]
    for r in hint.records:  # every record names a chunk that exists
        info = v["groups"][r.group]
        index = GroupIndex(vector_files[info["index_raw"]["file"]])
        index.chunk(r.chunk)


def test_packed_hint(vectors_doc: dict[str, Any], vector_files: dict[str, bytes]) -> None:
    """SPEC.md 9.1, version 3: the env vector's records again, with a pack holding each
    distinct stored chunk once, in record order; every frame decodes to its chunk."""
    v = _vector(vectors_doc, "env")
    raw_hint = vector_files[v["packed_hint"]["file"]]
    hint = decode_hint(raw_hint)
    plain = decode_hint(vector_files[v["hint"]["file"]])
    assert hint.records == plain.records and hint.manifest == plain.manifest
    assert decompress_object(raw_hint, "hint", C.MAX_HINT_SIZE)[8:10] == b"\x03\x00"
    assert decompress_object(encode_hint(hint), "hint", C.MAX_HINT_SIZE) == \
        decompress_object(raw_hint, "hint", C.MAX_HINT_SIZE)  # canonical
    pack = vector_files[v["packed_hint"]["pack"]["file"]]
    assert hint.pack is not None and hint.pack.blob == digest_hex(pack)
    assert hint.pack.size == len(pack) and list(hint.pack.lengths) == v["packed_hint"]["lengths"]
    seen = set()
    for r, length, offset in zip(hint.records, hint.pack.lengths, hint.pack.offsets(),
                                 strict=True):
        chunk = GroupIndex(vector_files[v["groups"][r.group]["index_raw"]["file"]]).chunk(r.chunk)
        if chunk.zero or chunk.digest in seen:
            assert length == 0
            continue
        seen.add(chunk.digest)
        decode_chunk(pack[offset:offset + length], chunk.digest, chunk.ulen)
