"""The core of the node side: everything a mount does, without FUSE.

Modules: `tree` (composed tree: lookup, readdir, attributes), `reader` (file offset -> chunk
pieces), `fetcher` (chunks from the store: coalescing, priorities, retries, deadline),
`cache` (the node-local chunk cache shared by every mount; `chunk_locks`, its cross-process
fetch locks), `stats` (counters the fetcher keeps), `warm` (a hint replay of its own:
`weenv cache warm`), `commands` (`weenv cache stats|prune|warm`).

May import the format, the store and trio; never pyfuse3 (the fuse package is the adapter).
This package imports nothing on its own, so `import weenvfs.core.cache` stays cheap.
"""
