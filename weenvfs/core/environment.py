"""Loading an environment for mounting: store check, manifest, group indexes, composed tree.

Owns: the only I/O a mount does before it serves requests, in this order: `store.check()`
(fail fast with one line if the store cannot be reached), resolving the reference to a manifest
digest, fetching and verifying the manifest and every group index (never file data), and
composing them into a `Tree`. Must not: mount, fetch chunks or cache anything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from weenvfs.format.manifest import Manifest
from weenvfs.store.base import Store
from weenvfs.store.repository import Repository

from .tree import Tree

log = logging.getLogger(__name__)


@dataclass
class Environment:
    """An environment ready to mount: where it came from and its composed tree."""

    ref: str
    store: Store
    digest: str
    manifest: Manifest
    tree: Tree

    @property
    def group_names(self) -> list[str]:
        """The names of the groups, lowest first."""
        return [group.name for group in self.manifest.groups]


def open_environment(store: Store, ref: str) -> Environment:
    """Check `store`, resolve `ref` (`NAME[:TAG]` or a manifest digest) and load its indexes.

    Raises StoreUnavailable/StoreError, RefNotFound, ObjectCorrupt or FormatError, each with
    a one-line message.
    """
    store.check()
    repo = Repository(store)
    digest, manifest = repo.resolve_env(ref)
    indexes = [repo.get_index(group.index) for group in manifest.groups]
    env = Environment(ref, store, digest, manifest, Tree(indexes))
    log.info(
        "environment %s (%s): %d group(s): %s",
        ref, digest[:12], len(indexes), ", ".join(env.group_names),
    )
    return env
