"""`weenv convert` from OCI layouts and docker-archive files, checked against `umoci unpack`.

The images are built by the tests (oci_images.py, support/layers.py); every converted
environment is exported with `weenv export` and compared entry by entry (type, mode, owner,
mtime, size, sha256, link target, device, xattrs, hardlink sets) with the rootfs that umoci,
an independent implementation, unpacks from the same image. Hostile and corrupt images must
fail with one line, a non-zero exit and no tag in the store.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import oci_images as O
import pytest
from fixtures import run_cli
from support import layers as L
from support import oci_apply, trees
from support.registry import tools_missing

from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository

# umoci 0.4 (Debian 12) cannot unpack zstd layers: those are checked against oci_apply instead.
MIXED = [O.LAYER_GZIP, O.LAYER_TAR, O.LAYER_GZIP, O.LAYER_TAR, O.LAYER_GZIP, O.LAYER_GZIP]


@pytest.fixture(autouse=True)
def _tools(require_or_skip: Callable[[object, str], None]) -> None:
    reason = tools_missing()
    require_or_skip(reason is None, reason or "")


def umoci_unpack(layout: Path, tag: str, dest: Path) -> Path:
    subprocess.run(
        ["umoci", "unpack", "--image", f"{layout}:{tag}", str(dest)],
        check=True,
        capture_output=True,
    )
    return dest / "rootfs"


def export(capsys: pytest.CaptureFixture[str], store: Path, ref: str, dest: Path) -> Path:
    rc, _, err = run_cli(["export", ref, str(dest), "--store", str(store)], capsys)
    assert rc == 0, err
    return dest


def tags(store: Path) -> list[str]:
    return sorted(LocalStore(store).list("tags/")) if store.exists() else []


def assert_refused(capsys: pytest.CaptureFixture[str], store: Path, *argv: str) -> str:
    """Run a conversion that must fail: one line on stderr, exit 1, nothing tagged."""
    rc, out, err = run_cli(["convert", *argv, "--store", str(store), "--quiet"], capsys)
    assert rc == 1, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weenv: error: "), err
    assert tags(store) == []
    return lines[0]


@pytest.fixture(scope="module")
def union(tmp_path_factory: pytest.TempPathFactory) -> tuple[O.Image, Path]:
    """The six-layer union image (mixed compressions) and umoci's rootfs of it."""
    tmp = tmp_path_factory.mktemp("union")
    image = O.write_layout(tmp / "layout", O.union_layers(), tag="v1", media_types=MIXED)
    return image, umoci_unpack(tmp / "layout", "v1", tmp / "bundle")


def test_umoci_agrees_with_the_reference_applier(union: tuple[O.Image, Path], tmp_path: Path):
    image, rootfs = union
    oracle = oci_apply.apply_layers(tmp_path / "oracle", image.tars)
    trees.assert_trees_equal(oracle, rootfs)


def test_zstd_layers_match_the_reference_applier(union, tmp_path, capsys):
    image, _ = union
    zimage = O.write_layout(tmp_path / "z", image.tars, media_types=[O.LAYER_ZSTD] * 6)
    store = tmp_path / "store"
    rc, _, err = run_cli(
        ["convert", f"oci:{zimage.layout}", "z", "--store", str(store), "--quiet"], capsys
    )
    assert rc == 0, err
    oracle = oci_apply.apply_layers(tmp_path / "oracle", image.tars)
    trees.assert_trees_equal(oracle, export(capsys, store, "z", tmp_path / "out"))


def test_oci_layout_matches_umoci(union, tmp_path, capsys):
    image, rootfs = union
    store = tmp_path / "store"
    rc, out, err = run_cli(
        ["convert", f"oci:{image.layout}:v1", "union:v1", "--store", str(store), "--json"], capsys
    )
    assert rc == 0, err
    result = json.loads(out)
    assert result["layers"] == 6 and len(result["groups"]) == 6
    assert result["source"]["manifest"] == image.manifest_digest
    assert result["source"]["config"] == image.config_digest
    assert [la["digest"] for la in result["source"]["layers"]] == image.layer_digests
    trees.assert_trees_equal(rootfs, export(capsys, store, "union:v1", tmp_path / "out"))
    _, manifest = Repository(LocalStore(store)).resolve_env("union:v1")
    config = manifest.config
    assert config.env == tuple(O.DEFAULT_CONFIG["Env"])
    assert (config.cwd, config.user) == ("/work", "1000:1000")
    assert config.entrypoint == ("/bin/sh", "-c") and config.cmd == ("echo hello",)
    assert config.labels == O.DEFAULT_CONFIG["Labels"]
    assert manifest.provenance["image"]["manifest"] == image.manifest_digest
    assert [g.name for g in manifest.groups] == [g["group"].split(":")[0] for g in result["groups"]]


@pytest.mark.requires_fuse
def test_mounted_environment_matches_umoci(union, tmp_path, capsys):
    image, rootfs = union
    store = tmp_path / "store"
    rc, _, err = run_cli(
        ["convert", f"oci:{image.layout}:v1", "mnt:v1", "--store", str(store), "--group",
         "base=0-2", "--group", "top=3-", "--quiet"],
        capsys,
    )
    assert rc == 0, err
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    rc, _, err = run_cli(
        ["mount", "mnt:v1", str(mountpoint), "--store", str(store), "--cache",
         str(tmp_path / "cache")],
        capsys,
    )
    assert rc == 0, err
    try:
        trees.assert_trees_equal(rootfs, mountpoint)
    finally:
        rc, _, err = run_cli(["umount", str(mountpoint)], capsys)
        assert rc == 0, err


def test_squashed_groups_match_umoci(union, tmp_path, capsys):
    image, rootfs = union
    store = tmp_path / "store"
    rc, out, err = run_cli(
        ["convert", f"oci:{image.layout}:v1", "union:squashed", "--store", str(store), "--group",
         "base=0-1", "--group", "mid=2-3", "--group", "task=4-", "--json"],
        capsys,
    )
    assert rc == 0, err
    groups = json.loads(out)["groups"]
    assert [(g["group"].split(":")[0], g["layers"]) for g in groups] == [
        ("base", [0, 1]),
        ("mid", [2, 3]),
        ("task", [4, 5]),
    ]
    trees.assert_trees_equal(rootfs, export(capsys, store, "union:squashed", tmp_path / "out"))
    # One group for everything gives the same tree, with no whiteout left anywhere.
    rc, out, err = run_cli(
        ["convert", f"oci:{image.layout}:v1", "union:flat", "--store", str(store), "--group",
         "all:v1=0-", "--quiet"],
        capsys,
    )
    assert rc == 0, err
    trees.assert_trees_equal(rootfs, export(capsys, store, "union:flat", tmp_path / "flat"))
    assert "tags/groups/all/v1" in tags(store)


def test_docker_archive_legacy_and_compressed(union, tmp_path, capsys):
    image, rootfs = union
    archive = tmp_path / "image.tar"
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{image.layout}:v1", f"docker-archive:{archive}:app:v1"],
        check=True,
        capture_output=True,
    )
    store = tmp_path / "store"
    rc, out, err = run_cli(
        ["convert", f"docker-archive:{archive}", "arch:v1", "--store", str(store), "--json"], capsys
    )
    assert rc == 0, err
    layers = json.loads(out)["source"]["layers"]
    assert [la["diff_id"] for la in layers] == image.diff_ids
    trees.assert_trees_equal(rootfs, export(capsys, store, "arch:v1", tmp_path / "out"))
    # The same archive gzip-compressed, the image picked by its RepoTag: every group reused.
    packed = tmp_path / "image.tar.gz"
    with open(archive, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    rc, out, err = run_cli(
        ["convert", f"docker-archive:{packed}:app:v1", "arch:v2", "--store", str(store), "--json"],
        capsys,
    )
    assert rc == 0, err
    assert all(g["reused"] for g in json.loads(out)["groups"])
    trees.assert_trees_equal(rootfs, export(capsys, store, "arch:v2", tmp_path / "out2"))


def test_docker_archive_oci_style(union, tmp_path, capsys):
    image, rootfs = union
    layout = tmp_path / "layout"
    shutil.copytree(image.layout, layout)
    archive = O.docker_save_archive(
        O.Image(
            layout,
            "v1",
            image.manifest_digest,
            image.config_digest,
            image.layer_digests,
            image.diff_ids,
            image.tars,
        ),
        tmp_path / "save.tar",
        "app:v1",
    )
    store = tmp_path / "store"
    rc, out, err = run_cli(
        ["convert", f"docker-archive:{archive}:app:v1", "save:v1", "--store", str(store), "--json"],
        capsys,
    )
    assert rc == 0, err
    assert json.loads(out)["source"]["manifest"] == image.manifest_digest
    trees.assert_trees_equal(rootfs, export(capsys, store, "save:v1", tmp_path / "out"))


def test_second_image_reuses_shared_layers(union, tmp_path, capsys):
    image, _ = union
    store = tmp_path / "store"
    rc, _, err = run_cli(
        ["convert", f"oci:{image.layout}:v1", "task-1234", "--store", str(store), "--quiet"], capsys
    )
    assert rc == 0, err
    task = L.layer(L.dir("work", uid=1000, gid=1000), L.file("work/task.py", b"print(1235)\n"))
    other = O.write_layout(tmp_path / "other", [*image.tars[:5], task], tag="v2")
    umoci = umoci_unpack(tmp_path / "other", "v2", tmp_path / "bundle")
    rc, out, err = run_cli(
        ["convert", f"oci:{other.layout}:v2", "task-1235", "--store", str(store), "--json"], capsys
    )
    assert rc == 0, err
    result = json.loads(out)
    assert [g["reused"] for g in result["groups"]] == [True] * 5 + [False]
    assert result["bytes_uploaded"] < 200
    trees.assert_trees_equal(umoci, export(capsys, store, "task-1235", tmp_path / "out"))


def test_named_group_dedups_against_its_previous_version(tmp_path, capsys):
    big = bytes(range(256)) * 4096 * 3  # 3 MiB
    base = L.layer(*L.with_parents([L.file("usr/lib/big.so", big)]))
    v1 = O.write_layout(tmp_path / "a", [base, L.layer(L.file("task", b"one"))], tag="v1")
    v2 = O.write_layout(tmp_path / "b", [base, L.layer(L.file("task", b"two"))], tag="v2")
    store = tmp_path / "store"
    for image, tag in ((v1, "v1"), (v2, "v2")):
        rc, out, err = run_cli(
            ["convert", f"oci:{image.layout}:{tag}", f"t:{tag}", "--store", str(store), "--group",
             "all:stable=0-", "--json"],
            capsys,
        )
        assert rc == 0, err
    assert json.loads(out)["bytes_uploaded"] < 1000  # the 3 MiB are reused, not uploaded


def test_empty_layer_and_dedup_with(tmp_path, capsys):
    image = O.write_layout(tmp_path / "layout", [L.layer(L.file("a", b"a" * 100)), L.layer()])
    store = tmp_path / "store"
    rc, out, err = run_cli(
        ["convert", f"oci:{image.layout}", "e:v1", "--store", str(store), "--json"], capsys
    )
    assert rc == 0, err
    out_dir = export(capsys, store, "e:v1", tmp_path / "out")
    assert sorted(p.name for p in out_dir.iterdir()) == ["a"]
    line = assert_refused(
        capsys, tmp_path / "s2", f"oci:{image.layout}", "e", "--dedup-with", "nothing:here"
    )
    assert "--dedup-with nothing:here: no such environment or group" in line
    rc, out, err = run_cli(
        ["convert", f"oci:{image.layout}", "f", "--store", str(store), "--dedup-with", "e:v1",
         "--no-reuse", "--json"],
        capsys,
    )
    assert rc == 0, err
    result = json.loads(out)
    assert not any(g["reused"] for g in result["groups"]) and result["bytes_uploaded"] == 0


def test_group_specs_are_validated(union, tmp_path, capsys):
    image, _ = union
    store = tmp_path / "store"
    for specs, message in [
        (["a=0-2", "b=4-"], "layers 3-3 are in no group"),
        (["a=0-2", "b=2-"], "overlaps layer 2"),
        (["a=0-2"], "layers 3-5 are in no group"),
        (["a=0-9"], "only 6 layers"),
        (["a=0-2", "a=3-"], "used twice"),
    ]:
        argv = [f"oci:{image.layout}:v1", "bad", "--store", str(store), "--quiet"]
        for spec in specs:
            argv += ["--group", spec]
        rc, _, err = run_cli(["convert", *argv], capsys)
        assert rc == 2 and message in err, err
    assert tags(store) == []


def test_platform_selection(tmp_path, capsys):
    layout = tmp_path / "multi"
    _, images = O.write_index_layout(
        layout,
        {
            "amd64": [L.layer(L.file("arch", b"amd64"))],
            "arm64": [L.layer(L.file("arch", b"arm64"))],
        },
        tag="multi",
    )
    store = tmp_path / "store"
    for arch in ("amd64", "arm64"):
        rc, out, err = run_cli(
            ["convert", f"oci:{layout}:multi", f"m:{arch}", "--store", str(store), "--platform",
             f"linux/{arch}", "--json"],
            capsys,
        )
        assert rc == 0, err
        assert json.loads(out)["source"]["manifest"] == images[arch].manifest_digest
        out_dir = export(capsys, store, f"m:{arch}", tmp_path / arch)
        assert (out_dir / "arch").read_bytes() == arch.encode()
    line = assert_refused(
        capsys, tmp_path / "s2", f"oci:{layout}:multi", "m", "--platform", "linux/s390x"
    )
    assert "no image for platform linux/s390x (available: linux/amd64, linux/arm64)" in line


# -- hostile and corrupt images ----------------------------------------------------------------

BASE = L.layer(*L.with_parents([L.file("etc/hostname", b"box\n"), L.dir("sub")]))
REFUSED = sorted(set(L.hostile_layers()) - {"absolute"})


@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize("grouping", ["per-layer", "squashed"])
def test_hostile_layers_are_refused(case, grouping, tmp_path, capsys):
    image = O.write_layout(tmp_path / "layout", [BASE, *L.hostile_layers()[case]])
    argv = [f"oci:{image.layout}:latest", "hostile"]
    if grouping == "squashed":
        argv += ["--group", "all=0-"]
    line = assert_refused(capsys, tmp_path / "store", *argv)
    assert "refusing entry" in line, line


@pytest.mark.parametrize("grouping", [[], ["--group", "a=0-1", "--group", "b=2-"]])
def test_hardlinks_to_lower_layers(grouping, tmp_path, capsys):
    """A hardlink to a file of a lower layer shares the inode with all its visible names."""
    tars = [
        L.layer(
            L.dir("."),
            L.dir("d"),
            L.file("d/a", b"inode", mode=0o751, uid=3),
            L.hardlink("d/b", "d/a"),
            L.hardlink("c", "d/a"),
            L.file("lone", b"alone"),
        ),
        L.layer(L.file("x", b"unrelated")),
        L.layer(
            L.whiteout("c"), L.dir("e"), L.hardlink("e/new", "d/b"), L.hardlink("lone2", "lone")
        ),
        L.layer(L.hardlink("e/newer", "e/new")),
    ]
    image = O.write_layout(tmp_path / "layout", tars)
    store = tmp_path / "store"
    rc, _, err = run_cli(
        ["convert", f"oci:{image.layout}", "links", "--store", str(store), "--quiet", *grouping],
        capsys,
    )
    assert rc == 0, err
    oracle = oci_apply.apply_layers(tmp_path / "oracle", tars)
    out = export(capsys, store, "links", tmp_path / "out")
    trees.assert_trees_equal(oracle, out)
    assert trees.snapshot(out)[b"d/a"].links == (b"d/a", b"d/b", b"e/new", b"e/newer")


def test_absolute_member_names_stay_inside(tmp_path, capsys):
    image = O.write_layout(tmp_path / "layout", [BASE, *L.hostile_layers()["absolute"]])
    store = tmp_path / "store"
    rc, _, err = run_cli(
        ["convert", f"oci:{image.layout}:latest", "abs", "--store", str(store), "--quiet"], capsys
    )
    assert rc == 0, err
    out = export(capsys, store, "abs", tmp_path / "out")
    assert (out / "etc/passwd").read_bytes().startswith(b"root::0:0")


def _image(tmp_path: Path) -> O.Image:
    return O.write_layout(tmp_path / "layout", [BASE, L.layer(L.file("x", b"x" * 5000))])


def test_layer_digest_mismatch(tmp_path, capsys):
    image = _image(tmp_path)
    blob = O.blob_path(image, image.layer_digests[1])
    data = bytearray(L.layer(L.file("x", b"y" * 5000)))  # same size, other content
    blob.write_bytes(L.gzip(bytes(data))[: blob.stat().st_size].ljust(blob.stat().st_size, b"\0"))
    line = assert_refused(capsys, tmp_path / "store", f"oci:{image.layout}:latest", "bad")
    assert "layer 1" in line and ("digest mismatch" in line or "corrupt" in line), line


def test_flipped_byte_in_a_plain_layer(tmp_path, capsys):
    image = O.write_layout(
        tmp_path / "layout",
        [BASE, L.layer(L.file("x", b"x" * 5000))],
        media_types=[O.LAYER_TAR, O.LAYER_TAR],
    )
    blob = O.blob_path(image, image.layer_digests[1])
    data = bytearray(blob.read_bytes())
    data[600] ^= 0x01  # inside the file data: the tar still parses
    blob.write_bytes(bytes(data))
    line = assert_refused(capsys, tmp_path / "store", f"oci:{image.layout}:latest", "bad")
    assert "layer 1" in line and "digest mismatch" in line, line


def test_truncated_layer(tmp_path, capsys):
    image = _image(tmp_path)
    blob = O.blob_path(image, image.layer_digests[1])
    blob.write_bytes(blob.read_bytes()[:-20])
    line = assert_refused(capsys, tmp_path / "store", f"oci:{image.layout}:latest", "bad")
    assert image.layer_digests[1] in line and "truncated" in line, line
    # A descriptor that lies about the size as well: the stream ends early all the same.
    image = O.rewrite_manifest(image, lambda m: m["layers"][1].update(size=blob.stat().st_size))
    line = assert_refused(capsys, tmp_path / "store", f"oci:{image.layout}:latest", "bad")
    assert "layer 1" in line, line


def test_diff_id_mismatch(tmp_path, capsys):
    image = O.write_layout(tmp_path / "layout", [BASE], config={})
    cfg_path = O.blob_path(image, image.config_digest)
    cfg = json.loads(cfg_path.read_bytes())
    cfg["rootfs"]["diff_ids"] = ["sha256:" + "0" * 64]
    data = json.dumps(cfg).encode()
    digest = O.put_blob(image.layout, data)
    O.rewrite_manifest(image, lambda m: m["config"].update(digest=digest, size=len(data)))
    line = assert_refused(capsys, tmp_path / "store", f"oci:{image.layout}:latest", "bad")
    assert "diff_id mismatch" in line, line


def test_a_size_the_manifest_cannot_hold_is_refused_before_anything_is_built(tmp_path, capsys):
    # The provenance records each layer's size; canonical JSON holds integers up to 2^53 - 1.
    image = O.rewrite_manifest(_image(tmp_path), lambda m: m["layers"][0].update(size=2**53))
    line = assert_refused(capsys, tmp_path / "store", f"oci:{image.layout}:latest", "bad")
    assert "provenance.image.layers[0].size: integer 9007199254740992 is outside" in line, line
    assert not list((tmp_path / "store").glob("*/*")), "nothing may be uploaded"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.update(mediaType=O.OCI_INDEX), "media type mismatch"),
        (lambda m: m.update(mediaType=O.OCI_CONFIG), "media type mismatch"),
        (
            lambda m: m["config"].update(mediaType="application/vnd.oci.empty.v1+json"),
            "not a container image",
        ),
        (
            lambda m: m["layers"][0].update(
                mediaType="application/vnd.oci.image.layer.v1.tar+bzip2"
            ),
            "unsupported layer media type",
        ),
        (
            lambda m: m["layers"][0].update(mediaType=O.LAYER_ZSTD),
            "says zstd, but the data is gzip",
        ),
        (lambda m: m.update(schemaVersion=1), "schema 1"),
    ],
)
def test_wrong_media_types(change, message, tmp_path, capsys):
    image = O.rewrite_manifest(_image(tmp_path), change)
    line = assert_refused(capsys, tmp_path / "store", f"oci:{image.layout}:latest", "bad")
    assert message in line, line


def test_index_entry_with_the_wrong_media_type(tmp_path, capsys):
    image = _image(tmp_path)
    index = json.loads((image.layout / "index.json").read_text())
    index["manifests"][0]["mediaType"] = O.OCI_INDEX  # the blob is a manifest
    (image.layout / "index.json").write_text(json.dumps(index))
    line = assert_refused(capsys, tmp_path / "store", f"oci:{image.layout}:latest", "bad")
    assert "media type mismatch" in line, line


def test_unknown_sources_and_tags(tmp_path, capsys):
    image = _image(tmp_path)
    line = assert_refused(capsys, tmp_path / "s", f"oci:{image.layout}:nope", "bad")
    assert "no image tagged 'nope' (tags: latest)" in line
    line = assert_refused(capsys, tmp_path / "s", f"oci:{tmp_path / 'missing'}", "bad")
    assert "not a directory" in line
    rc, _, err = run_cli(["convert", "ftp://x/y", "bad", "--store", str(tmp_path / "s")], capsys)
    assert rc == 2 and "unknown image source" in err
    assert not (tmp_path / "s").exists()
