"""The one pipeline that makes a group's objects: stage and chunk the file data a tree takes
in, encode the tree's index, store the blobs and then the index (write order).

Building (builder.py: sources into a `GroupTree`, then tagged) and converting
(convert_group.py: OCI layers over lower groups, tagged by convert once the manifest is
stored) both go through `stage_and_store`. Blob files live in a locked staging folder
(staging.py) removed however the pipeline ends; one left by a killed process is removed
first.

Must not: read sources, decide what the tree holds, or tag anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from weenvfs.format.index_writer import Node, encode_index_object
from weenvfs.store.repository import Repository

from .chunker import Chunker, ChunkOptions, ChunkStats, DedupTable
from .layout import LayoutOrder
from .progress import Progress
from .publish import Published, store_group
from .staging import remove_stale, staging_dir
from .tree import TreeCounts

log = logging.getLogger(__name__)


class RootedTree(Protocol):
    """A tree being built (GroupTree, StackedTree): its root node once complete."""

    @property
    def root(self) -> Node: ...


@dataclass(kw_only=True)
class GroupOutcome:
    """What storing one group did, as build and convert both report it: its index and how
    much of it was new. Their results extend it (builder.BuildResult,
    convert_group.StoredGroup)."""

    index_digest: str
    counts: TreeCounts
    stats: ChunkStats
    blobs_new: int
    blobs_uploaded: int
    bytes_uploaded: int
    index_size: int


@dataclass
class StagedGroup:
    """A group's objects, stored (not tagged)."""

    index_object: bytes
    stored: Published
    stats: ChunkStats
    blobs_new: int

    def outcome(self, counts: TreeCounts) -> dict[str, Any]:
        """The `GroupOutcome` fields of this group (its tree's `counts`), for a result that
        extends it."""
        return {"index_digest": self.stored.index_digest, "counts": counts,
                "stats": self.stats, "blobs_new": self.blobs_new,
                "blobs_uploaded": self.stored.blobs_uploaded,
                "bytes_uploaded": self.stored.bytes_uploaded,
                "index_size": len(self.index_object)}


def stage_and_store(
    tree: RootedTree,
    feed: Callable[[Chunker], None],
    repo: Repository,
    chunk: ChunkOptions,
    table: DedupTable,
    progress: Progress,
    *,
    kind: str,
    tmp_dir: Path | None = None,
    layout: LayoutOrder | None = None,
    count_bytes: bool = False,
) -> StagedGroup:
    """Have `feed(chunker)` fill `tree` and hand its files' data to the chunker (dedup
    against `table`, data in `layout` order), then store the blobs and the index encoded
    from `tree`. `kind` names the staging folder (staging.KINDS); with `count_bytes` the
    bytes chunked go to `progress.update`."""
    for stale in remove_stale(tmp_dir):
        log.info("removed %s, the staging of a process that died (%d bytes)", stale.path,
                 stale.size)
    with staging_dir(tmp_dir, kind) as workdir:
        chunker = Chunker(chunk, workdir, table, progress.update if count_bytes else None,
                          layout)
        try:
            feed(chunker)
            blobs = chunker.finish()
        finally:
            chunker.close()
        index_object = encode_index_object(tree.root, chunk.chunk_size)
        stored = store_group(repo, blobs, index_object, progress)
    return StagedGroup(index_object, stored, chunker.stats, len(blobs))
