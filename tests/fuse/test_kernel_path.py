"""The kernel path's own rules: the published EROFS images (every group's), their checks,
what it hides, the fallback when it cannot be used, and the path reported by `weenv stats`.

Real parts: groups built by the real builder from layer tars, `weenv mount` daemons, EROFS
and overlayfs mounts of this kernel (the test mounter cleans everything up).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from mounts import Mounter, refused_mount, run_weenv
from support import layers
from support.trees import dir, file  # noqa: A004

from weenvfs.core.cache import ChunkCache
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.kernel_image import stack_image
from weenvfs.core.loaded_env import open_environment
from weenvfs.core.reader import Reader
from weenvfs.core.stats import Stats
from weenvfs.format.chunk import decompress_object
from weenvfs.format.constants import MAX_IMAGE_SIZE
from weenvfs.format.manifest import decode_manifest, encode_manifest
from weenvfs.fuse import kernel_mount
from weenvfs.fuse.config import MountConfig
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, build_group, open_source
from weenvfs.tools.publish import compose_env

pytestmark = pytest.mark.requires_fuse


@pytest.fixture(autouse=True)
def _kernel(require_or_skip: object) -> None:
    require_or_skip(os.geteuid() == 0, "the kernel path needs root")  # type: ignore[operator]
    require_or_skip("erofs" in Path("/proc/filesystems").read_text(),  # type: ignore[operator]
                    "the kernel has no EROFS")


def _publish(tmp_path: Path) -> tuple[Path, str]:
    """A one-group environment whose layer holds a whiteout, an opaque marker and image
    xattrs in overlayfs' namespace (none of which the lowest layer may show)."""
    tar = layers.layer_file(
        tmp_path / "layer.tar",
        dir("etc"), file("etc/hostname", b"node\n"),
        file("etc/steer", b"x", xattrs={"trusted.overlay.redirect": b"/elsewhere",
                                         "user.kept": b"yes"}),
        dir("opaque"), layers.opaque("opaque"), file("opaque/inside", b"in"),
        layers.whiteout("gone"),
    )
    store_dir = tmp_path / "store"
    repo = Repository(open_store(str(store_dir), create=True))
    build_group(open_source(tar), repo, "base", "t", BuildOptions())
    digest = compose_env(repo, "env", "t", ["base:t"])
    return store_dir, digest


def test_the_lowest_group_mounts_its_published_image(tmp_path: Path, mounter: Mounter) -> None:
    store_dir, digest = _publish(tmp_path)
    repo = Repository(open_store(str(store_dir)))
    image = decode_manifest(repo.get_object("manifests", digest)).groups[0].erofs
    assert image is not None and repo.has_object("erofs", image)
    mount = mounter.mount("env:t", store_dir, extra=["--path", "kernel"])
    doc = mount.stats()
    assert doc["mount"]["path"] == "kernel" and doc["mount"]["fallback_reason"] is None
    assert doc["mount"]["neighbourhoods"] is False  # a folder store: nothing to hide
    assert (mount.cache / "erofs" / f"{image}.img").exists()  # fetched, not derived
    mp = mount.mountpoint
    assert sorted(os.listdir(mp)) == ["etc", "opaque"]  # the whiteout shows nowhere
    assert (mp / "opaque" / "inside").read_bytes() == b"in"
    assert os.listxattr(mp / "etc" / "steer") == ["user.kept"]  # overlayfs' names dropped
    assert os.listxattr(mp / "opaque") == []  # nothing below: no opaque marker either
    run_weenv("verify", "env:t", "--store", str(store_dir))


def test_the_published_image_is_fetched_while_the_layout_is_computed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold mount's two set-up steps of a group do not wait for each other: the layout's
    computation sees the image's fetch start (sequential steps would never, and fail here)."""
    store_dir, digest = _publish(tmp_path)
    fetching = threading.Event()
    real_fetch, real_layout = kernel_mount.fetch_group_image, kernel_mount.cached_layout

    def fetch(store: Any, image: str) -> bytes:
        fetching.set()
        return real_fetch(store, image)

    def layout(*args: Any) -> Any:
        assert fetching.wait(10), "the image's fetch did not start beside the layout"
        return real_layout(*args)

    monkeypatch.setattr(kernel_mount, "fetch_group_image", fetch)
    monkeypatch.setattr(kernel_mount, "cached_layout", layout)
    cache = tmp_path / "cache"
    with open_store(str(store_dir)) as store:
        env = open_environment(store, digest)
        config = MountConfig(tmp_path / "mp", cache, 1 << 30, 10.0)
        reader = Reader(env.tree, Fetcher(store, ChunkCache(cache), Stats()))
        [layer] = kernel_mount.prepare_layers(env, config, reader)
    assert layer.image == cache / "erofs" / f"{env.manifest.groups[0].erofs}.img"


def test_a_corrupt_published_image_is_never_mounted(tmp_path: Path, mounter: Mounter) -> None:
    store_dir, digest = _publish(tmp_path)
    repo = Repository(open_store(str(store_dir)))
    image = decode_manifest(repo.get_object("manifests", digest)).groups[0].erofs
    assert image is not None
    (store_dir / "erofs" / image).write_bytes(b"not an image")
    done = run_weenv("verify", "env:t", "--store", str(store_dir), check=False)
    assert done.returncode != 0 and "erofs/" in done.stdout + done.stderr
    mount = mounter.mount("env:t", store_dir, extra=["--path", "kernel"])
    mount.expect_log_lines("cannot use the published EROFS image")
    assert mount.log_lines("cannot use the published EROFS image of group base")
    assert not (mount.cache / "erofs" / f"{image}.img").exists()
    assert (mount.mountpoint / "etc" / "hostname").read_bytes() == b"node\n"


def test_a_damaged_cached_image_is_made_again(tmp_path: Path, mounter: Mounter) -> None:
    store_dir, _ = _publish(tmp_path)
    first = mounter.mount("env:t", store_dir, extra=["--path", "kernel"])
    run_weenv("umount", str(first.mountpoint))
    [cached] = (first.cache / "erofs").glob("*.img")
    cached.write_bytes(cached.read_bytes()[:-4096] + bytes(4096))
    again = mounter.mount("env:t", store_dir, cache=first.cache, extra=["--path", "kernel"])
    again.expect_log_lines("does not match its digest")
    assert again.log_lines("does not match its digest")
    assert (again.mountpoint / "opaque" / "inside").read_bytes() == b"in"


def test_an_image_that_cannot_be_kept_fails_the_mount_in_one_line(tmp_path: Path) -> None:
    """A node cache that cannot keep the images fails the mount with one line naming it
    (not a traceback, not an exception group from the daemon's event loop), and nothing
    stays mounted."""
    store_dir, _ = _publish(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "erofs").write_bytes(b"")  # the node's image folder cannot be made
    line = refused_mount("env:t", store_dir, tmp_path)
    assert "erofs" in line
    assert not any(str(tmp_path) in mount for mount in Path("/proc/self/mounts").read_text()
                   .splitlines())


def test_path_fuse_is_reported(tmp_path: Path, mounter: Mounter) -> None:
    store_dir, _ = _publish(tmp_path)
    mount = mounter.mount("env:t", store_dir, extra=["--path", "fuse"])
    doc = mount.stats()
    assert doc["mount"]["path"] == "fuse"
    assert "--path fuse" in doc["mount"]["fallback_reason"]


def _publish_two(tmp_path: Path) -> tuple[Path, str]:
    """Two groups: the upper one hides a lower file, makes a folder opaque and implies one."""
    low = layers.layer_file(tmp_path / "low.tar", dir("etc"), file("etc/hostname", b"low\n"),
                            file("etc/gone", b"x"), dir("cfg"), file("cfg/old", b"old"),
                            dir("usr/lib", mode=0o750))
    high = layers.layer_file(tmp_path / "high.tar", layers.whiteout("etc/gone"),
                             dir("cfg"), layers.opaque("cfg"), file("cfg/new", b"new"),
                             file("usr/lib/libz.so", b"z"))
    store_dir = tmp_path / "store"
    repo = Repository(open_store(str(store_dir), create=True))
    build_group(open_source(low), repo, "low", "t", BuildOptions())
    build_group(open_source(high), repo, "high", "t", BuildOptions())
    return store_dir, compose_env(repo, "two", "t", ["low:t", "high:t"])


def test_every_group_mounts_its_published_image(tmp_path: Path, mounter: Mounter) -> None:
    """compose publishes the upper group's image over the lower one (SPEC.md 15.9) as a node
    would derive it, and the layer mount fetches it instead of deriving it."""
    store_dir, digest = _publish_two(tmp_path)
    repo = Repository(open_store(str(store_dir)))
    groups = decode_manifest(repo.get_object("manifests", digest)).groups
    assert all(g.erofs is not None and repo.has_object("erofs", g.erofs) for g in groups)
    indexes = [repo.get_index(g.index) for g in groups]
    published = decompress_object(repo.get_object("erofs", groups[1].erofs), "erofs",
                                  MAX_IMAGE_SIZE)
    assert published == stack_image(indexes, 1)
    mount = mounter.mount("two:t", store_dir, extra=["--path", "kernel", "--layer", "1"])
    images = sorted(p.name for p in (mount.cache / "erofs").glob("*.img"))
    assert images == [f"{groups[1].erofs}.img"]  # fetched; nothing derived on the node
    mp = mount.mountpoint
    gone = os.lstat(mp / "etc" / "gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0  # the whiteout shows
    assert os.getxattr(mp / "cfg", "trusted.overlay.opaque") == b"y"
    assert os.stat(mp / "usr" / "lib").st_mode & 0o7777 == 0o750  # implied: the lower's
    run_weenv("verify", "two:t", "--store", str(store_dir))


def test_with_published_images_off_the_node_derives_every_image(
        tmp_path: Path, mounter: Mounter, monkeypatch: pytest.MonkeyPatch) -> None:
    """$WEENV_PUBLISHED_IMAGES=off: the kernel only ever parses images this node derived
    from the indexes (docs/security.md), byte for byte the ones the publisher stored."""
    store_dir, digest = _publish_two(tmp_path)
    repo = Repository(open_store(str(store_dir)))
    groups = decode_manifest(repo.get_object("manifests", digest)).groups
    monkeypatch.setenv(kernel_mount.PUBLISHED_SWITCH, "off")
    mount = mounter.mount("two:t", store_dir, extra=["--path", "kernel", "--layer", "1"])
    assert mount.log_lines("deriving every EROFS image from the indexes")
    images = sorted((mount.cache / "erofs").glob("*.img"))
    assert len(images) == 1 and images[0].name != f"{groups[1].erofs}.img"  # derived
    published = decompress_object(repo.get_object("erofs", groups[1].erofs), "erofs",
                                  MAX_IMAGE_SIZE)
    assert images[0].read_bytes() == published
    gone = os.lstat(mount.mountpoint / "etc" / "gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0


def test_a_bad_published_images_switch_fails_the_mount_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_dir, _ = _publish(tmp_path)
    monkeypatch.setenv(kernel_mount.PUBLISHED_SWITCH, "of")
    message = refused_mount("env:t", store_dir, tmp_path)
    assert kernel_mount.PUBLISHED_SWITCH in message


def test_verify_refuses_an_upper_image_of_another_stack(tmp_path: Path) -> None:
    store_dir, digest = _publish_two(tmp_path)
    repo = Repository(open_store(str(store_dir)))
    manifest = decode_manifest(repo.get_object("manifests", digest))
    # The lower group's own image named for the upper group: a valid image, the wrong one.
    wrong = dataclasses.replace(manifest, groups=(
        manifest.groups[0], dataclasses.replace(manifest.groups[1],
                                                erofs=manifest.groups[0].erofs)))
    repo.set_tag("envs", "two", "wrong", repo.put_object("manifests", encode_manifest(wrong)))
    done = run_weenv("verify", "two:wrong", "--store", str(store_dir), check=False)
    assert done.returncode != 0
    assert "is not the one its index (and the groups below it) give" in done.stdout + done.stderr
