"""WeEnv layers of containerd images: recognised, checked, and mounted as shared group mounts.

A layer names its group (format/oci_layer.py) in the snapshot labels containerd passes
(`containerd.io/snapshot/weenv/*`, copied from the layer's annotations by its unpacker) or in
the marker file its blob unpacks to. The group is mounted exactly as a sandbox's lower
(runtime/lowers.py, runtime/mounts.py): group N of the environment, keyed by the index
digests of groups 0..N, the store and the node cache, so every image, sandbox and
environment on the same groups shares one mount, its daemon, its page cache and the node's
chunk cache. Each snapshot is one holder of that mount, anchored to its snapshot folder, so
`weenv sandbox gc` never drops it and a removed snapshot's holder goes with it.

Refused, with one line naming why: a store URL that is not one of the snapshotter's own
(`--store`; hostile images must not point the node at other hosts or paths), a manifest the
store lacks or that fails its digest, a position or index digest the manifest contradicts.

Owns: `Groups` (check a reference, mount its group for a snapshot, release it). Must not:
keep snapshot records (state.py) or speak gRPC (service.py).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weenvfs.errors import ObjectMissing, StoreError, WeenvError
from weenvfs.format.errors import FormatError
from weenvfs.format.oci_layer import LayerRef
from weenvfs.runtime import mounts, sandbox
from weenvfs.runtime.lowers import layer_keys
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

log = logging.getLogger(__name__)


class LayerRefused(WeenvError):
    """A WeEnv layer this snapshotter will not mount."""


@dataclass(frozen=True)
class WeenvLayer:
    """A checked reference: group `position` of manifest `manifest`, mount `key`."""

    store: str
    manifest: str
    position: int
    index: str
    key: str
    cache: str

    def to_json(self) -> dict[str, Any]:
        return {"store": self.store, "manifest": self.manifest, "position": self.position,
                "index": self.index, "key": self.key, "cache": self.cache}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeenvLayer:
        return cls(str(data["store"]), str(data["manifest"]), int(data["position"]),
                   str(data["index"]), str(data["key"]), str(data["cache"]))


class Groups:
    """Mounts the groups of WeEnv layers from the stores this snapshotter serves."""

    def __init__(self, stores: list[str], cache_dir: Path, root: Path,
                 keep_warm: float | None = None) -> None:
        self.stores: dict[str, str] = {}
        for url in stores:
            with open_store(url) as store:
                self.stores[store.url] = url
        self.cache_dir = cache_dir.absolute()
        self.keep_warm = keep_warm
        # Holder ids name the root too: two snapshotters (tests, a second node root) must not
        # share a holder file on one mount.
        self._tag = hashlib.sha256(bytes(root.absolute())).hexdigest()[:12]

    def check(self, ref: LayerRef) -> WeenvLayer:
        """`ref` checked against its store (LayerRefused with the reason)."""
        if ref.store not in self.stores:
            raise LayerRefused(f"WeEnv layer names store {ref.store!r:.200}, which this "
                               "snapshotter does not serve (its --store options)")
        try:
            with open_store(self.stores[ref.store]) as store:
                manifest = Repository(store).get_manifest(ref.manifest)
        except ObjectMissing:
            raise LayerRefused(f"WeEnv layer: no environment manifest {ref.manifest[:12]} in "
                               f"{ref.store}") from None
        except (StoreError, FormatError) as error:
            raise LayerRefused(f"WeEnv layer: manifest {ref.manifest[:12]} in {ref.store}: "
                               f"{error}") from None
        groups = [g.index for g in manifest.groups]
        if ref.position >= len(groups) or groups[ref.position] != ref.index:
            raise LayerRefused(
                f"WeEnv layer: manifest {ref.manifest[:12]} has no group {ref.index[:12]} at "
                f"position {ref.position}")
        key = layer_keys(groups[: ref.position + 1], ref.store, self.cache_dir)[-1]
        return WeenvLayer(ref.store, ref.manifest, ref.position, ref.index, key,
                          str(self.cache_dir))

    def holder(self, snapshot_id: int) -> str:
        return f"snapshotter-{self._tag}-{snapshot_id}"

    def acquire(self, layer: WeenvLayer, snapshot_id: int, anchor: Path) -> Path:
        """Take the group's shared mount for snapshot `snapshot_id` (mounting it when no
        one has); its mount point. Raises LayerRefused when it cannot be mounted."""
        try:
            return mounts.acquire(layer.key, self.holder(snapshot_id),
                                  store_url=layer.store,
                                  cache_dir=Path(layer.cache),
                                  env=layer.manifest, layer=layer.position, anchor=anchor)
        except WeenvError as error:
            raise LayerRefused(f"WeEnv layer {layer.position} of {layer.manifest[:12]}: "
                               f"mount failed: {error}") from None

    def release(self, layer: WeenvLayer, snapshot_id: int) -> None:
        """Drop snapshot `snapshot_id`'s hold on the group's mount (the node's keep-warm
        policy, or `keep_warm`, decides when it is unmounted)."""
        mounts.release(layer.key, self.holder(snapshot_id), self.keep_warm,
                       is_live=sandbox.exists)

    @staticmethod
    def mountpoint(layer: WeenvLayer) -> Path:
        return mounts.mountpoint(layer.key)
