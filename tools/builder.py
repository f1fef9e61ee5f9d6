"""Building one layer group: sources -> tree + chunks -> index -> published and tagged.

Owns: `build_group`, the whole build of one group, and `open_source` (a directory, a tar
file, or '-' for a tar on stdin). It seeds dedup from the group's previous versions (the tag
being replaced and the newest other tags of the name, dedup_sources.py) and from any
`dedup_with` references, applies one or more layer sources in
order into one tree (OCI semantics, see tree.py), chunks the data as it streams past,
encodes the index, and publishes in the spec's order, through the pipeline convert uses too
(group_pipeline.py: staging, chunking, storing). Nothing is tagged unless all of it is
stored.

Must not: parse arguments or print (build_commands.py), or know the store's key layout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weenvfs.errors import ObjectMissing, SourceError
from weenvfs.format.digest import short
from weenvfs.format.refs import check_name, check_tag
from weenvfs.store.repository import Repository

from .chunker import Chunker, ChunkOptions, DedupTable
from .dedup_sources import recent_versions
from .entries import Source
from .group_pipeline import GroupOutcome, stage_and_store
from .layout import LayoutOrder
from .progress import Progress
from .publish import tag_group
from .source_dir import DirSource
from .source_tar import TarSource
from .tree import GroupTree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildOptions:
    """Options of one build besides the sources and the target."""

    chunk: ChunkOptions = field(default_factory=ChunkOptions)
    # reuse chunks of the version `name:tag` points at now and of the newest other versions
    # of the same name (dedup_sources.py: every tag of it, bounded)
    dedup_previous: bool = True
    dedup_with: tuple[str, ...] = ()  # more group references to reuse chunks from
    tmp_dir: Path | None = None  # where blob files are staged (default: the system's)
    layout: LayoutOrder | None = None  # hinted data first, in hint order (layout.py)


@dataclass(kw_only=True)
class BuildResult(GroupOutcome):
    """What a build produced and how much of it was new."""

    name: str
    tag: str
    previous: str | None
    dedup_sources: list[str] = field(default_factory=list)  # `ref@digest12` seeded from

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (the CLI's --json output)."""
        return {
            "group": f"{self.name}:{self.tag}",
            "index": self.index_digest,
            "previous": self.previous,
            "counts": self.counts.as_dict(),
            **self.stats.as_dict(),
            "blobs_new": self.blobs_new,
            "blobs_uploaded": self.blobs_uploaded,
            "bytes_uploaded": self.bytes_uploaded,
            "index_size": self.index_size,
            "dedup_sources": list(self.dedup_sources),
        }


def open_source(spec: str | Path) -> Source:
    """A directory, a tar file (plain, gzip, bzip2, xz or zstd) or '-' for a tar on stdin."""
    text = str(spec)
    if text != "-" and os.path.isdir(text):
        return DirSource(text)
    if text != "-" and not os.path.exists(text):
        raise SourceError(f"source {text} does not exist")
    return TarSource(text)


def _dedup_table(
    repo: Repository, name: str, tag: str, options: BuildOptions
) -> tuple[DedupTable, str | None, list[str]]:
    """The table of chunks to reuse, the digest `name:tag` points at now (or None), and the
    references the table was seeded from (`name:tag@digest12`, for the report)."""
    table, previous, used = DedupTable(), None, []
    if options.dedup_previous:
        for version_tag, digest in recent_versions(repo, name, tag):
            try:
                index = repo.get_index(digest)
            except ObjectMissing:
                log.warning(
                    "not deduplicating against %s:%s: index %s is missing",
                    name,
                    version_tag,
                    short(digest),
                )
                continue
            if version_tag == tag:
                previous = digest
            table.add_index(index)
            used.append(f"{name}:{version_tag}@{short(digest)}")
        if not used:
            log.info("no earlier version of group %s to dedup against", name)
    for ref in options.dedup_with:
        digest, index = repo.resolve_group(ref)
        table.add_index(index)
        used.append(f"{ref}@{short(digest)}")
    log.info("dedup against %s", ", ".join(used) or "nothing")
    return table, previous, used


def build_group(
    sources: Source | Sequence[Source],
    repo: Repository,
    name: str,
    tag: str,
    options: BuildOptions | None = None,
    progress: Progress | None = None,
) -> BuildResult:
    """Build the group `name:tag` from `sources` (one source, or layers lowest first),
    publish it and return what happened. Raises SourceError for a bad source, StoreError
    for store failures; in both cases nothing is tagged and temp files are removed."""
    check_name(name, "group name")
    check_tag(tag)
    options = options or BuildOptions()
    progress = progress or Progress.quiet()
    layers = list(sources) if isinstance(sources, Sequence) else [sources]
    table, previous, dedup_sources = _dedup_table(repo, name, tag, options)
    tree = GroupTree()
    staged = stage_and_store(
        tree, lambda chunker: _read_layers(layers, tree, chunker, progress), repo,
        options.chunk, table, progress, kind="build", tmp_dir=options.tmp_dir,
        layout=options.layout, count_bytes=True,
    )
    tag_group(repo, name, tag, staged.stored)
    return BuildResult(name=name, tag=tag, previous=previous, dedup_sources=dedup_sources,
                       **staged.outcome(tree.counts()))


def _read_layers(layers: list[Source], tree: GroupTree, chunker: Chunker,
                 progress: Progress) -> None:
    for source in layers:
        tree.begin_layer()
        entries = source.entries()
        total = source.total_bytes if len(layers) == 1 else None
        progress.begin(f"reading {source.label}", total)
        for entry in entries:
            node = tree.add(entry)
            if node is not None:
                chunker.add_file(node, entry)
        progress.end()
