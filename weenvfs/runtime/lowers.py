"""Which shared mounts make a sandbox's read-only lower, and taking them all at once.

Two ways, chosen per sandbox (`--lower`, `SandboxOptions.lower`):

- `layers` (the default): one mount per group (`weenv mount --layer N`, core/layer_tree.py),
  stacked by the sandbox's own overlayfs as Docker's overlay2 stacks layers. The mount of
  group N is keyed by the index digests of groups 0..N (and the store and chunk cache it
  serves from), so every environment built on the same groups shares those mounts, and with
  them the kernel's inodes, dentries and page cache: 32 task environments on one Python and
  packages group read numpy once, through one daemon, where merged mounts read it 32 times
  through 32 daemons. The hint of an environment is replayed by the mount of its top group.
- `merged`: one mount of the whole environment, keyed by its manifest digest (the groups are
  composed inside the daemon; one daemon and one overlay layer per environment).

A stack deeper than MAX_LAYERS is mounted merged: overlayfs takes its options in one page.

A sandbox that records its environment's hint (recording.py) reads through neither: it takes
the environment's recording mount, merged and private to that environment, which publishes the
hint when its last holder releases it.

Must not: serve mounts (fuse/), keep reference counts (mounts.py) or mount the overlay
(sandbox.py, rootfs.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError
from weenvfs.fuse import daemon

from . import mounts
from .lower_modes import LOWER_MODES
from .recording import recording_key

log = logging.getLogger(__name__)

# Mount points are ~86 bytes (/run/weenv/envs/<64 hex>/root): 32 of them and the upper and
# work paths fit the 4 KiB the kernel takes for overlay options.
MAX_LAYERS = 32


@dataclass(frozen=True)
class LowerMount:
    """One shared mount of a sandbox's lower: its key (mounts.py) and what it serves."""

    key: str
    layer: int | None  # the group it serves as an overlay layer; None: the merged environment
    record: str | None = None  # records what is read, published as this hint tag (recording.py)


def plan_lowers(
    digest: str, groups: Sequence[str], mode: str, store_url: str, cache_dir: Path,
    *, record: str | None = None,
) -> list[LowerMount]:
    """The mounts for environment `digest` whose groups have index digests `groups` (lowest
    first), served from `store_url` through `cache_dir`; topmost first, as overlayfs'
    `lowerdir` lists them. With `record` (a hint tag), the environment's recording mount
    alone."""
    if mode not in LOWER_MODES:
        raise UsageError(f"--lower must be one of {', '.join(LOWER_MODES)}, not {mode!r}")
    if record:
        return [LowerMount(recording_key(digest, store_url, cache_dir, record), None,
                           record=record)]
    if mode == "merged" or not groups:
        return [LowerMount(digest, None)]
    if len(groups) > MAX_LAYERS:
        log.info("environment %s has %d groups (over %d): mounting it merged", digest[:12],
                 len(groups), MAX_LAYERS)
        return [LowerMount(digest, None)]
    keys = layer_keys(groups, store_url, cache_dir)
    return [LowerMount(key, position) for position, key in enumerate(keys)][::-1]


def layer_keys(groups: Sequence[str], store_url: str, cache_dir: Path) -> list[str]:
    """The mount key of each group of `groups` (index digests, lowest first) as an overlay
    layer served from `store_url` through `cache_dir`: group N's key is the digest of the
    groups 0..N, so every environment (or containerd image) on the same groups shares it."""
    stack = hashlib.sha256(b"weenv layer stack\n%s\n%s" % (
        store_url.encode(), bytes(cache_dir.absolute())))
    keys = []
    for index in groups:
        stack.update(b"\n" + index.encode())
        keys.append(stack.hexdigest())
    return keys


def acquire_lowers(
    planned: Sequence[LowerMount], holder: str, *, env: str, store_url: str, cache_dir: Path,
) -> list[Path]:
    """Take every mount of `planned` for `holder` (those the node's mount table lists first,
    one after another; then the others in parallel: each one missing starts a daemon, and
    one that another sandbox is mounting is waited for there); their mount points in the
    same order. All or nothing: on an error, the mounts already taken are released
    and the first error is raised. An interrupt (Ctrl-C reaches this thread, not the
    workers) stops the daemons still starting before the mounts taken are released and it
    is raised."""
    up: dict[str, Path] = {}
    try:
        table = daemon.mount_points()  # read once for them all (mounts.acquire_mounted)
        for mount in planned:
            taken = mounts.acquire_mounted(mount.key, holder, mounted=table)
            if taken is not None:
                up[mount.key] = taken
        missing = [m for m in planned if m.key not in up]
        if missing:  # (`_mount_missing` releases what it took itself when it fails)
            paths = _mount_missing(missing, planned, holder, env=env, store_url=store_url,
                                   cache_dir=cache_dir)
            up.update(zip((m.key for m in missing), paths, strict=True))
    except BaseException:
        release_lowers(list(up), holder)
        raise
    return [up[m.key] for m in planned]


def _mount_missing(
    missing: Sequence[LowerMount], planned: Sequence[LowerMount], holder: str, *, env: str,
    store_url: str, cache_dir: Path,
) -> list[Path]:
    """`acquire_lowers`' mounts that were not up, taken in parallel (all or nothing: those
    taken here are released on an error, which is raised)."""
    cancel = threading.Event()
    # The top layer replays the environment's hint; through the other layers' mounts it
    # reads their hinted files into the page cache too (core/page_warm.py).
    layers = {m.layer: mounts.mountpoint(m.key) for m in planned if m.layer is not None}
    top = max(layers, default=None)

    def take(mount: LowerMount) -> Path:
        roots = ({g: root for g, root in layers.items() if g != top}
                 if mount.layer is not None and mount.layer == top else None)
        with daemon.cancelled_by(cancel):
            return mounts.acquire(mount.key, holder, store_url=store_url, cache_dir=cache_dir,
                                  env=env, layer=mount.layer, record=mount.record,
                                  page_roots=roots)

    interrupted: BaseException | None = None
    with ThreadPoolExecutor(max_workers=len(missing), thread_name_prefix="lower") as pool:
        futures = [pool.submit(take, mount) for mount in missing]
        try:
            wait(futures)
        except BaseException as error:  # Ctrl-C or SIGTERM, which only this thread sees
            interrupted = error
            cancel.set()  # the workers stop the daemons they start, then end
            _settle(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if interrupted is not None or errors:
        taken = [m.key for m, f in zip(missing, futures, strict=True) if f.exception() is None]
        release_lowers(taken, holder)
        raise interrupted or errors[0]
    return [f.result() for f in futures]


def _settle(futures: Sequence[Future[Path]]) -> None:
    """Wait for every one of `futures` to end; further interrupts only wait again (the
    workers are stopping what they started, and must be let finish)."""
    while True:
        try:
            wait(futures)
            return
        except KeyboardInterrupt:
            continue


def release_lowers(
    keys: Sequence[str], holder: str, keep_warm: float | None = None, *,
    publish_later: bool = False, root: Path | None = None,
    is_live: Callable[[str], bool] | None = None,
) -> list[dict[str, Any]]:
    """Drop `holder` from every mount of `keys` in folder of shared mounts `root` (default:
    this process's; see `mounts.release`: `keep_warm` None is the node's policy;
    `publish_later` leaves a recording mount to the node service; `is_live` tells the other
    holders' stale files apart), then
    evict what is over the node's bounds once for all of them (`mounts.evict_over_bounds`:
    by the node service when it runs); what the recording mounts this ended published (their
    result documents, or `pending` ones)."""
    outcomes = []
    for key in keys:
        outcome = mounts.release(key, holder, keep_warm, evict=False, is_live=is_live,
                                 publish_later=publish_later, root=root)
        if outcome is not None:
            outcomes.append(outcome)
    if keys:
        mounts.evict_over_bounds()
    return outcomes
