"""The kernel path of a mount: EROFS metadata images over lazily served data devices.

Owns, inside the daemon process (mount.py hands over when `kernel_unavailable` says yes):
1. the layers: the group served (`--layer N`), or every group of a merged mount, each as a
   `LayerTree` over the groups below it, its EROFS image (core/kernel_image.py: derived,
   cached per stack, verified before it is mounted) and its data device
   (core/device_layout.py, core/device_reader.py);
2. one FUSE folder of those devices, mounted under the run folder, never where users look,
   and answered by the native server (native_devices.py) where it is installed, else by
   pyfuse3 in this process (device_ops.py);
3. the kernel mounts, from a worker thread while the FUSE loop answers the device opens they
   cause: each image with `-o device=<its device file>` (file-backed EROFS: no loop device),
   directly at the mount point for one layer, else at private folders stacked read-only by
   overlayfs at the mount point (topmost first, as overlay2 stacks layers);
4. the end: SIGTERM, or the kernel dropping the last EROFS superblock (released devices with
   the mount point gone), unmounts what is left, lazily when busy, and keeps serving devices
   until the kernel has released them, so no reader of a detached tree ever sees EIO from a
   vanished daemon.

Why: with metadata in the kernel, lookups, opens, readlinks and readdirs never reach Python;
this process sees only reads of data not yet in the EROFS page cache (DESIGN.md).
Must not: decide what a layer looks like (core/layer_tree.py) or encode EROFS (format/).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from weenvfs.core.device_reader import DeviceReader
from weenvfs.core.kernel_image import (
    DeviceLayout,
    cached_image,
    cached_layout,
    derive_image,
    fetch_group_image,
    stack_key,
)
from weenvfs.core.loaded_env import MAX_PARALLEL_LOADS, LoadedEnv
from weenvfs.core.reader import Reader
from weenvfs.core.tree import FormatError
from weenvfs.errors import StoreError, WeenvError
from weenvfs.switches import switched_off

from . import daemon, syscalls
from .config import MountConfig
from .device_ops import DeviceOperations, PyfuseDevices
from .mount_copies import remove_mount_folder
from .native_devices import NativeDevices

log = logging.getLogger(__name__)

# Overlay options must fit one page; the runtime mounts deeper stacks merged (FUSE tree).
MAX_OVERLAY_LAYERS = 64
# File-backed EROFS mounts (an image file as the source, `device=` a file) came in 6.12.
MIN_KERNEL = (6, 12)
# "off": mount only images this node derived from the indexes, never the bytes a publisher
# stored as a group's image (SPEC.md 15.9): the image is checked against its digest, not
# against the index, so with it the kernel's EROFS parser reads metadata the publisher chose
# (docs/security.md, "Published EROFS images"). Costs each cold group mount its derivation.
PUBLISHED_SWITCH = "WEENV_PUBLISHED_IMAGES"


@dataclass
class KernelLayer:
    """One group as the kernel path serves it."""

    position: int  # the group's position in the environment (0 is the lowest)
    image: Path
    device_name: bytes
    reader: DeviceReader


def kernel_unavailable(env: LoadedEnv, config: MountConfig) -> str | None:
    """Why this mount cannot take the kernel path here, or None when it can."""
    if config.path == "fuse":
        return "the FUSE tree path was asked for (--path fuse)"
    if os.geteuid() != 0:
        return "not root: mounting EROFS needs CAP_SYS_ADMIN"
    release = os.uname().release.split("-")[0].split(".")
    with contextlib.suppress(ValueError):
        if tuple(int(part) for part in release[:2]) < MIN_KERNEL:
            return f"kernel {os.uname().release} mounts no EROFS image files (6.12 or newer)"
    filesystems = _filesystems()
    if "erofs" not in filesystems:
        return "the kernel has no EROFS (modprobe erofs, or CONFIG_EROFS_FS)"
    features = Path("/sys/fs/erofs/features")
    for feature in ("chunked_file", "device_table"):
        if features.is_dir() and not (features / feature).exists():
            return f"the kernel's EROFS lacks {feature}"
    layers = 1 if env.layer is not None else len(env.tree.groups)
    if layers > 1 and "overlay" not in filesystems:
        return "the kernel has no overlayfs to stack the groups"
    if layers > MAX_OVERLAY_LAYERS:
        return f"{layers} groups: more than {MAX_OVERLAY_LAYERS} overlay layers"
    return None


def _filesystems() -> set[str]:
    try:
        text = Path("/proc/filesystems").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in text.splitlines() if line.split()}


def prepare_layers(env: LoadedEnv, config: MountConfig, reader: Reader) -> list[KernelLayer]:
    """Every layer of this mount, lowest first, with its image fetched, built or verified.
    With $WEENV_PUBLISHED_IMAGES off, every image is derived from the indexes (see
    PUBLISHED_SWITCH)."""
    groups = env.tree.groups
    positions: list[int] = [env.layer] if env.layer is not None else list(range(len(groups)))
    published_ok = not switched_off(PUBLISHED_SWITCH)  # a bad value fails the mount here
    if not published_ok:
        log.info("deriving every EROFS image from the indexes: %s is off", PUBLISHED_SWITCH)

    # One pool: every group's published image (a store round trip that needs no layout) is
    # fetched while the layouts are computed (each ~20-30 ms of a cold mount of the
    # reference image), the groups in parallel (a Docker image has a group per layer). The
    # fetches are queued first and wait on nothing, so a layout waiting on its group's
    # fetch never holds the only free thread.
    workers = min(2 * len(positions), 2 * MAX_PARALLEL_LOADS)
    with ThreadPoolExecutor(workers, thread_name_prefix="weenv-image") as pool:
        published = {position: pool.submit(_published_image, env, config, position)
                     for position in positions if published_ok}

        def prepare(position: int) -> KernelLayer:
            started = time.monotonic()
            layout = cached_layout(config.cache_dir, env.manifest.groups[position].index,
                                   groups[position])
            fetch = published.get(position)
            image = ((fetch.result() if fetch is not None else None)
                     or _derived_image(env, config, position, layout))
            log.info("group %d: EROFS image %s ready in %.0f ms (%d files on a %d MiB device)",
                     position, image.name[:12], (time.monotonic() - started) * 1000,
                     layout.files, layout.size >> 20)
            return KernelLayer(position, image, b"g%d" % position,
                               DeviceReader(layout, reader, position))

        prepared = [pool.submit(prepare, position) for position in positions]
        # The first failing group, lowest first, raises its error.
        return [future.result() for future in prepared]


def _published_image(env: LoadedEnv, config: MountConfig, position: int) -> Path | None:
    """The verified published image of group `position` when the manifest names one and the
    store has it (SPEC.md 15.9: every group's over the groups below it), else None (then
    `_derived_image`)."""
    ref = env.manifest.groups[position]
    if ref.erofs is None:
        return None
    published = ref.erofs
    try:
        return cached_image(config.cache_dir, published,
                            lambda: fetch_group_image(env.store, published))
    except (StoreError, FormatError) as error:
        log.warning("cannot use the published EROFS image of group %s (%s): deriving it",
                    ref.name, error)
        return None


def _derived_image(env: LoadedEnv, config: MountConfig, position: int,
                   layout: DeviceLayout) -> Path:
    """The image of group `position` derived here from the index (kernel_image.py)."""
    digests = [group.index for group in env.manifest.groups[: position + 1]]
    return cached_image(config.cache_dir, stack_key(digests),
                        lambda: derive_image(env.tree, position, layout))


class KernelMounts:
    """The kernel mounts of one daemon: made in `mount_all`, undone in `unmount_all`."""

    def __init__(self, config: MountConfig, layers: list[KernelLayer]) -> None:
        self.config = config
        self.layers = layers
        self.base = daemon.kernel_dir(config.mountpoint)
        self.device_dir = self.base / "devices"
        self.mounted: list[Path] = []  # in mount order; undone in reverse

    def layer_dir(self, layer: KernelLayer) -> Path:
        if len(self.layers) == 1:
            return self.config.mountpoint
        return self.base / "layers" / str(layer.position)

    def mount_all(self) -> None:
        """Mount every image on its device, then the overlay (blocking: run in a thread)."""
        for layer in self.layers:
            target = self.layer_dir(layer)
            target.mkdir(parents=True, exist_ok=True)
            device = self.device_dir / layer.device_name.decode()
            syscalls.mount(layer.image, target, "erofs", f"device={device}")
            self.mounted.append(target)
        if len(self.layers) > 1:
            lower = ":".join(str(self.layer_dir(layer)) for layer in reversed(self.layers))
            syscalls.mount("overlay", self.config.mountpoint, "overlay", f"lowerdir={lower}")
            self.mounted.append(self.config.mountpoint)

    def unmount_all(self) -> None:
        """Undo every kernel mount, lazily where busy (a detached tree keeps its devices).
        Each private layer folder goes with its mount: copies other mount namespaces made
        of it go too (mount_copies.py), else they would keep its device forever."""
        for target in reversed(self.mounted):
            try:
                syscalls.umount(target)
            except OSError as error:
                if error.errno != errno.EBUSY:
                    log.warning("%s", error)
                log.info("%s is busy: detaching it", target)
                with contextlib.suppress(OSError):
                    syscalls.umount(target, detach=True)
            if target != self.config.mountpoint:
                remove_mount_folder(target)
        self.mounted.clear()

    def still_mounted(self) -> bool:
        """Whether the mount point still shows this mount."""
        return daemon.is_mounted(self.config.mountpoint)

    def remove_folders(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.base / "layers")
        with contextlib.suppress(OSError):
            self.device_dir.rmdir()
        with contextlib.suppress(OSError):
            self.base.rmdir()


async def serve_kernel(
    layers: list[KernelLayer], config: MountConfig, run: Callable[..., Awaitable[None]],
    document: Callable[[], dict[str, Any]], ready: Callable[[], None],
    helper: str | None = None,
) -> None:
    """Serve `layers`' devices and mount them; return once everything is unmounted and the
    kernel released the devices.

    `run(announce, stop, main)` is mount.py's main loop (fetcher, prefetch, signals) around
    `main`, the device folder's server: `announce` mounts the kernel side and then calls
    `ready`; `stop` (on SIGTERM/SIGINT) unmounts. The devices are served by the native server
    `helper` (native_devices.py), or by pyfuse3 (device_ops.py) when it is None."""
    mounts = KernelMounts(config, layers)
    mounts.device_dir.mkdir(parents=True, exist_ok=True)

    mounting = [True]  # while mount_all runs, a device release is its own doing

    def released() -> None:
        # The kernel dropped every superblock that held our devices. Once the mount point is
        # gone too (unmounted by anyone, or by `stop`), nothing can reach this process.
        if not mounting[0] and not mounts.still_mounted():
            log.info("%s is unmounted and its devices released: stopping", config.mountpoint)
            server.terminate()

    devices = {layer.device_name: layer.reader for layer in layers}
    server = _device_server(devices, mounts, document, released, helper)

    async def announce() -> None:
        try:
            await trio.to_thread.run_sync(mounts.mount_all)
        except OSError as error:
            mounting[0] = False
            await trio.to_thread.run_sync(mounts.unmount_all)
            raise WeenvError(f"{error.strerror or error} (kernel path; `--path fuse` "
                             "serves the tree over FUSE instead)") from None
        mounting[0] = False
        log.info("mounted at %s (kernel path: %d EROFS layer(s))", config.mountpoint,
                 len(layers))
        ready()

    async def stop() -> None:
        await trio.to_thread.run_sync(mounts.unmount_all)
        if server.open_handles == 0:
            server.terminate()
        else:
            log.info("waiting for the kernel to release the devices of detached mounts")

    try:
        await run(announce, stop, server.main)
    finally:
        await trio.to_thread.run_sync(mounts.unmount_all)
        await trio.to_thread.run_sync(server.close)
        mounts.remove_folders()
    if server.failure is not None:
        raise WeenvError(server.failure)


def _device_server(devices: dict[bytes, DeviceReader], mounts: KernelMounts,
                   document: Callable[[], dict[str, Any]], released: Callable[[], None],
                   helper: str | None) -> NativeDevices | PyfuseDevices:
    """The device folder, mounted and served: natively by `helper`, else by pyfuse3."""
    server: NativeDevices | PyfuseDevices
    if helper is not None:
        server = NativeDevices(devices, helper, document, released)
    else:
        server = PyfuseDevices(DeviceOperations(devices, document, released))
    try:
        server.mount(mounts.device_dir)
    except OSError as error:
        mounts.remove_folders()
        raise WeenvError(f"cannot mount the data devices at {mounts.device_dir}: "
                         f"{error.strerror or error}") from None
    return server
