"""Where a mount's hint replay runs, decided as the mount starts: in a process of the node
service (fetching on a core of its own, and reading the hinted files into the page cache), or
in the mount daemon, which then fetches only what is missing.

Owns: `node_new` (a node that never started these groups: ask for a process at once) and
`choose`, once the hint is found, from what the node already holds: the hinted chunks not in
the node cache (stored bytes), and on the kernel path the hinted pages a warm-up would read
that are not in the page cache (the files of the groups the mount serves itself, always cold
in a mount being made; those of the groups read through other mounts, sampled:
`page_warm.resident_sample`).

A replay process earns its cost (a fork, the environment and the hint loaded again, a request
that waits in the service's queue behind the mounts it forks) only when there is real work
for it; on a warm node, 32 environments started at once each had 1 of its ~220 hinted chunks
to fetch (the task group's own) and every lower group's pages resident, and the requests
alone kept each daemon waiting 84-354 ms (median) for the service (docs/design-notes.md).

Must not: fetch anything, ask the node service, or know FUSE (fuse/mount_replay.py does).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from weenvfs.format.index import GroupIndex

from .cache import ChunkCache
from .chunk_plan import ChunkLoc
from .node_hints import FoundHint
from .page_warm import hinted_ranges, resident_sample
from .prefetch import hint_locs

# Missing hinted chunks the daemon fetches itself: a few (its fetcher prefetches two
# requests at a time, a replay process four) of at most one replay request's worth of stored
# bytes (prefetch.REQUEST_BYTES); a warm start's is its task group's one chunk, 0.1-0.5 MB.
FETCH_HERE_CHUNKS = 4
FETCH_HERE_BYTES = 4 << 20
# Bytes of cold hinted pages that do not need a warm-up: each is a read the kernel sends the
# device server, ~1 ms per MB with the chunks cached (the reference workload's 77 MB cost
# ~0.09 s more without its warm-up: docs/design-notes.md).
PAGES_HERE_BYTES = 8 << 20
RESIDENT_SAMPLE = 8  # first-read files per lower mount looked at in the page cache


@dataclass(frozen=True)
class ReplayChoice:
    """Where the replay runs and why (shown by `weenv stats` under `hints.choice`)."""

    process: bool  # True: a process of the node service; False: the mount daemon
    missing_chunks: int | None  # hinted chunks not in the node cache (None: not looked at)
    missing_bytes: int | None  # their stored bytes
    why: str

    def as_dict(self) -> dict[str, object]:
        return {"chosen": "process" if self.process else "mount daemon",
                "missing_chunks": self.missing_chunks, "missing_bytes": self.missing_bytes,
                "why": self.why}


def node_new(first: Sequence[ChunkLoc], cache: ChunkCache) -> bool:
    """Whether this node has not started a sandbox of the environment's groups: none of the
    chunks of its identity files (`first`: core/identity_files.py, what every sandbox's build
    reads) is cached. Such a mount asks for a replay process before it knows its hint, as
    on a cold node it has a hint's worth to fetch: looking the hint up first put the README's
    cold hinted run 30-40 ms later (docs/design-notes.md). False when there are none."""
    return bool(first) and not any(cache.contains(loc.digest) for loc in first)


def choose(found: FoundHint, indexes: Sequence[GroupIndex], cache: ChunkCache, *,
           fetch_all: bool = False, own_groups: Collection[int] = (),
           page_roots: Mapping[int, Path] | None = None) -> ReplayChoice:
    """Where to replay `found` for a mount of `indexes`: in a process when it fetches
    everything (`fetch_all`), when more than FETCH_HERE_CHUNKS hinted chunks or more than
    FETCH_HERE_BYTES of them are missing from `cache`, or, with `page_roots` (the kernel
    path: its warm-up reads through those mounts), when more than PAGES_HERE_BYTES of the
    hinted pages of `own_groups` (the groups this mount serves) are to be read or a lower
    mount's hinted pages are not resident; else in the daemon."""
    missing = [loc for loc in hint_locs(found.hint.records, indexes)
               if not cache.contains(loc.digest)]
    count, stored = len(missing), sum(loc.clen for loc in missing)

    def choice(process: bool, why: str) -> ReplayChoice:
        return ReplayChoice(process, count, stored, why)

    if fetch_all:
        return choice(True, "fetching every chunk")
    if count > FETCH_HERE_CHUNKS or stored > FETCH_HERE_BYTES:
        return choice(True, f"{count} hinted chunks ({stored} bytes) to fetch")
    if page_roots is not None:
        cold = _own_page_bytes(found, indexes, set(own_groups), PAGES_HERE_BYTES)
        if cold > PAGES_HERE_BYTES:
            return choice(True, f"over {PAGES_HERE_BYTES} bytes of hinted pages to read")
        lower = {g: root for g, root in page_roots.items() if g not in own_groups}
        if not resident_sample(found.hint, indexes, lower, RESIDENT_SAMPLE):
            return choice(True, "the lower mounts' hinted pages are not resident")
    return choice(False, f"{count} hinted chunk(s) to fetch, the hinted pages resident or few")


def _own_page_bytes(found: FoundHint, indexes: Sequence[GroupIndex], own: set[int],
                    enough: int) -> int:
    """The bytes a warm-up would read of the hinted files of the groups in `own`, counted
    until they exceed `enough`."""
    hinted = {(r.group, r.chunk) for r in found.hint.records if r.group in own}
    total = 0
    for file in found.hint.files:
        if file.group in own:
            index = indexes[file.group]
            total += sum(end - start for start, end, _ in
                         hinted_ranges(index, file.group, file.inode, hinted))
            if total > enough:
                break
    return total
