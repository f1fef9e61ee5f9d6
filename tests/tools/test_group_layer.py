"""Full layers (`weenv push --layers full`, tools/group_layer.py): each group as an ordinary
gzip tar layer. Applied in order by the independent OCI applier (tests/support/oci_apply.py)
they give exactly the tree the same layers give (whiteouts, opaque folders, hardlinks, xattrs,
devices, set-id bits, nanosecond mtimes, names that are not UTF-8); their digests are what
the blob and its uncompressed tar hash to; the same group gives the same bytes.

Needs root (owners, device nodes, trusted.* xattrs), as the export tests do.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import tarfile
from pathlib import Path
from typing import Any

from fixtures import base_specs, mid_specs, publish_env, socket, standard_env, top_specs
from support import layers, oci_apply, trees
from support.trees import file, with_parents

from weenvfs.format.oci_layer import from_labels
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group
from weenvfs.tools.group_layer import write_group_layer
from weenvfs.tools.publish import compose_env
from weenvfs.tools.push import LAYER_TAR_GZIP, full_layers
from weenvfs.tools.reader import ChunkReader, load_group
from weenvfs.tools.source_dir import DirSource
from weenvfs.tools.source_tar import TarSource


def _full(repo: Repository, store: LocalStore, env: str, folder: Path) -> list[Any]:
    digest, manifest = repo.resolve_env(env)
    folder.mkdir()
    return full_layers(manifest, digest, store.url, repo, folder)


def test_full_layers_compose_like_the_layers_they_came_from(
        repo: Repository, store: LocalStore, tmp_path: Path) -> None:
    digest = standard_env(repo)
    full = _full(repo, store, "py-env", tmp_path / "spool")
    tars = []
    for position, (blob, diff_id) in enumerate(full):
        data = blob.path.read_bytes()
        assert blob.media_type == LAYER_TAR_GZIP and blob.size == len(data)
        assert blob.digest == "sha256:" + hashlib.sha256(data).hexdigest()
        assert diff_id == "sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest()
        ref = from_labels(blob.annotations)  # the group is still named for WeEnv nodes
        assert ref is not None and (ref.position, ref.manifest) == (position, digest)
        tars.append(data)
    applied = oci_apply.apply_layers(tmp_path / "applied", tars)
    expected = oci_apply.apply_layers(
        tmp_path / "expected",
        [layers.layer(*with_parents(s)) for s in (base_specs(), mid_specs(), top_specs())])
    trees.assert_trees_equal(expected, applied)
    # Markers only where the groups had them: whiteouts and opaque folders, no others.
    names = _names(tars[-1])
    assert any(n.rpartition("/")[2].startswith(".wh.") for n in names)
    # Deterministic: the same group, the same blob.
    again = _full(repo, store, "py-env", tmp_path / "again")
    assert [b.digest for b, _ in again] == [b.digest for b, _ in full]


def test_built_layers_without_their_parents(
        repo: Repository, store: LocalStore, tmp_path: Path) -> None:
    """Groups built from layers that do not list their parents: the directories they imply
    are left out again, so they come out as the original layers would leave them."""
    originals = [layers.layer(*specs) for specs in (base_specs(), mid_specs(), top_specs())]
    for n, tar in enumerate(originals):
        (tmp_path / f"layer{n}.tar").write_bytes(tar)
        build_group(TarSource(tmp_path / f"layer{n}.tar"), repo, f"layer{n}", "latest")
    compose_env(repo, "layered", "latest", ["layer0", "layer1", "layer2"])
    full = _full(repo, store, "layered", tmp_path / "spool")
    applied = oci_apply.apply_layers(tmp_path / "applied", [b.path for b, _ in full])
    trees.assert_trees_equal(oci_apply.apply_layers(tmp_path / "expected", originals), applied)


def test_a_hostile_tree_round_trips(repo: Repository, store: LocalStore, tmp_path: Path) -> None:
    source = trees.hostile_tree(tmp_path / "hostile")
    build_group(DirSource(source), repo, "hostile", "latest")
    compose_env(repo, "hostile-env", "latest", ["hostile"])
    [(blob, _)] = _full(repo, store, "hostile-env", tmp_path / "spool")
    trees.assert_trees_equal(source, oci_apply.apply_layers(tmp_path / "applied", [blob.path]))


def test_sockets_are_left_out(repo: Repository, store: LocalStore, tmp_path: Path,
                              assert_logs: Any) -> None:
    publish_env(repo, "sock", [("g", [socket("run/sock"), file("run/kept", b"kept")])])
    index = load_group(repo, repo.resolve_env("sock")[1].groups[0].index).index
    with assert_logs("1 sockets left out", count=1, level=logging.WARNING):
        spooled = write_group_layer(index, ChunkReader(store), tmp_path / "layer.tar.gz")
    assert spooled.skipped_sockets == 1
    names = _names(spooled.path.read_bytes())
    assert "run/kept" in names and "run/sock" not in names


def _names(blob: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as tar:
        return tar.getnames()
