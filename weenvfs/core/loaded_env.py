"""Loading an environment for mounting: manifest, group indexes, composed tree.

Owns: the only I/O a mount does before it serves requests, in this order: resolving the
reference to a manifest digest (a store that cannot be reached or read fails it with one line;
node_copies.py `resolve_env`), fetching and verifying the manifest and every group index (never
file data; each index's directory graph checked to be a tree by `format.validate.check_tree`; a
mount keeps checked indexes on the node, node_copies.py; every object refused unread beyond its
kind's size limit, SPEC.md 12.1, by `Repository`), and composing them into a `Tree`. The
indexes of a multi-group environment load in parallel: each is a store round trip (or two)
before its checks, and an image converted from Docker has a group per layer. Must not: mount or
fetch chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from weenvfs.errors import UsageError
from weenvfs.format.manifest import Manifest
from weenvfs.store.base import Store
from weenvfs.store.repository import Repository

from .layer_tree import LayerTree
from .node_copies import load_index, resolve_env
from .tree import Tree

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")
MAX_PARALLEL_LOADS = 8  # index (and EROFS image) loads of one mount in flight at once


@dataclass
class LoadedEnv:
    """An environment ready to mount: where it came from and its composed tree."""

    ref: str
    store: Store
    digest: str
    manifest: Manifest
    tree: Tree
    layer: int | None = None  # the group served as an overlayfs lower layer, if any

    @property
    def serves_top(self) -> bool:
        """Whether this mount shows the environment's top group (merged, or its last layer):
        only such a mount replays the environment's hint, which covers every group."""
        return self.layer is None or self.layer == len(self.manifest.groups) - 1

    @property
    def group_names(self) -> list[str]:
        """The names of the groups this mount serves or sits on, lowest first."""
        return [group.name for group in self.manifest.groups[: len(self.tree.groups)]]


def open_environment(store: Store, ref: str, layer: int | None = None,
                     cache_dir: Path | None = None) -> LoadedEnv:
    """Resolve `ref` (`NAME[:TAG]` or a manifest digest) in `store` and load its indexes:
    all of them, composed, or with `layer` the groups up to that one (0 is the lowest), its
    group shown as an overlayfs lower layer (core/layer_tree.py). With `cache_dir`, through
    the node's checked copies (node_copies.py).

    Raises StoreUnavailable/StoreError, RefNotFound, ObjectCorrupt, FormatError or (for a
    layer the environment does not have) UsageError, each with a one-line message.
    """
    repo = Repository(store)
    digest, manifest = resolve_env(repo, ref, cache_dir)
    groups = manifest.groups
    if layer is not None:
        if not 0 <= layer < len(groups):
            raise UsageError(f"environment {ref} has groups 0 to {len(groups) - 1}, "
                             f"no group {layer}")
        groups = groups[: layer + 1]
    # Each checked to be a tree before serving (a shared directory or a cycle passes every
    # per-record check; inspect, export and verify refuse it with the same validator). A
    # group named twice is loaded once: a manifest cannot multiply what a mount holds beyond
    # its distinct indexes (each at most MAX_INDEX_SIZE, SPEC.md 12.1).
    loaded = load_all(list(dict.fromkeys(group.index for group in groups)),
                      lambda digest: load_index(repo, digest, cache_dir))
    indexes = [loaded[group.index] for group in groups]
    tree = Tree(indexes) if layer is None else LayerTree(indexes)
    env = LoadedEnv(ref, store, digest, manifest, tree, layer)
    log.info(
        "environment %s (%s): %d group(s): %s%s",
        ref, digest[:12], len(indexes), ", ".join(env.group_names),
        "" if layer is None else f"; serving group {layer} as an overlay layer",
    )
    return env


def load_all(keys: list[K], load: Callable[[K], V]) -> dict[K, V]:
    """`{key: load(key)}`, the loads run in parallel threads when there are several; the
    first failing key, in order, raises its error (as a loop over `keys` would)."""
    if len(keys) <= 1:
        return {key: load(key) for key in keys}
    with ThreadPoolExecutor(min(MAX_PARALLEL_LOADS, len(keys)),
                            thread_name_prefix="weenv-load") as pool:
        futures = [pool.submit(load, key) for key in keys]
        return {key: future.result() for key, future in zip(keys, futures, strict=True)}
