"""The pages a `weenv run`'s process writes, written ahead in the node service's spare.

A command the node service forks shares the service's memory copy-on-write: each page of it
the command writes is copied at its first write, a page fault of ~5 us on the machines
measured (Python's reference counts write to every object the code touches). A warm `weenv
run` takes ~900 of them on its critical path (docs/design-notes.md, "Standby sandboxes").
The spare (service_forks.py `fork_spare`) is forked ahead, while the node is idle; this
module lets it take those faults then, and only for the pages a run is likely to write:

- `learn_if_due()`, in a run's process once its client has the exit status: the pages of its
  private writable mappings that are now its own (pagemap's "exclusively mapped" bit: copied
  at a write, or new), as address ranges in PAGES_FILE (written whole, then renamed). Only
  when the file is LEARN_EVERY seconds old, missing or another service's, and never in a
  process that wrote pages ahead itself: its own pages would then include every page
  written ahead, and the set could only grow.
- `prefault_if_learned()`, in the spare before it waits for a request: unless the file is
  due to be learned again (its run learns instead), `madvise(MADV_POPULATE_WRITE)` over each
  range that lies within one of its own private writable mappings (faults the pages in as a
  write would, copying them, without changing a byte), at most MAX_PAGES.

Memory layouts agree because every run's process and every spare is a fork of the same
service process: the file starts with a token the service drew at start-up (a service
started again has another layout, and ignores the last one's file). An odd file costs at
most some needless copies: the ranges are checked against the spare's mappings, the content
of memory never changes, and any error leaves the spare as it was (nothing here may fail a
run).

Measured: warm `weenv run ... /bin/true` 18.2 against 24.0 ms (docs/design-notes.md).

Must not: write a page's content, touch a shared mapping, or run anywhere but in a process
the service forked (the service itself must keep its memory shared).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import os
import re
import time
from pathlib import Path

from weenvfs.core.node_files import write_atomically

from .node_socket import socket_path

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL: nothing is done
# A pagemap entry's top byte: bit 7 the page is present, bit 0 this process alone maps it.
_OWN = bytes(1 if flags & 0x81 == 0x81 else 0 for flags in range(256))
_RUNS = re.compile(b"\x01+")
READ_PAGES = 1 << 16  # pagemap entries read at once
LEARN_EVERY = 60.0  # seconds: a run's process learns again once the file is this old
MAX_PAGES = 8192  # 32 MiB of 4 KiB pages at most written ahead (a run writes ~1,000)
# Where the service's children keep the ranges (fixed when the service imports this module:
# a run's process takes its client's environment, the socket's variable included).
PAGES_FILE = socket_path() + ".pages"
SERVICE = os.urandom(8)  # drawn where the service imports this: its forks inherit it
_prefaulted = False  # this process wrote pages ahead (`prefault_if_learned`): it never learns

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _private_writable() -> list[tuple[int, int]]:
    """(start, end) of this process's private writable mappings, ascending."""
    spans = []
    with open("/proc/self/maps", "rb") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) >= 2 and fields[1][:2] == b"rw" and fields[1][3:4] == b"p":
                start, end = fields[0].split(b"-")
                spans.append((int(start, 16), int(end, 16)))
    return spans


def _own_pages(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges (start address, pages) of `spans` whose pages this process alone maps.
    (The flags are the top byte of each 8-byte pagemap entry: sliced out and matched at C
    speed, so a mapping of a million pages costs milliseconds, not a Python loop each.)"""
    ranges: list[tuple[int, int]] = []
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        for start, end in spans:
            first = start // PAGE
            for at in range(first, end // PAGE, READ_PAGES):
                count = min(READ_PAGES, end // PAGE - at)
                flags = os.pread(fd, 8 * count, 8 * at)[7::8].translate(_OWN)
                ranges.extend(((at + run.start()) * PAGE, run.end() - run.start())
                              for run in _RUNS.finditer(flags))
    finally:
        os.close(fd)
    return ranges


def prefault_if_learned() -> int:
    """In the spare: fault in the ranges of PAGES_FILE (`prefault`) unless the file is due
    to be learned again (the run this spare becomes then learns it); how many pages."""
    global _prefaulted
    ranges = _ranges(PAGES_FILE, young_only=True)
    if ranges is None:
        return 0
    _prefaulted = True
    return _populate(ranges)


def learn_if_due() -> bool:
    """In a run's process after its answer: `learn(PAGES_FILE)` when due (missing,
    LEARN_EVERY seconds old or another service's) and this process wrote no pages ahead;
    whether it did."""
    return (not _prefaulted and _ranges(PAGES_FILE, young_only=True) is None
            and learn(PAGES_FILE))


def learn(path: str) -> bool:
    """Write the ranges of pages this process alone maps to `path`; whether it did."""
    ranges = _own_pages(_private_writable())
    data = SERVICE + array.array("Q", [value for pair in ranges for value in pair]).tobytes()
    try:
        write_atomically(Path(path), data)
    except OSError:
        return False
    return True


def forget() -> None:
    """Remove PAGES_FILE (the service, as it ends)."""
    with contextlib.suppress(OSError):
        os.unlink(PAGES_FILE)


def read_ranges(path: str) -> list[tuple[int, int]]:
    """The ranges `learn` wrote to `path` in a fork of this service (none if there is no
    such file, or another service wrote it)."""
    return _ranges(path) or []


def _ranges(path: str, young_only: bool = False) -> list[tuple[int, int]] | None:
    """`read_ranges`, or None where it has none; with `young_only` also None for a file
    LEARN_EVERY seconds old (one open: the spare and every run's end ask)."""
    try:
        with open(path, "rb") as source:
            if young_only and time.time() - os.fstat(source.fileno()).st_mtime >= LEARN_EVERY:
                return None
            data = source.read(len(SERVICE) + 16 * MAX_PAGES)
    except OSError:
        return None
    if data[:len(SERVICE)] != SERVICE:
        return None
    data = data[len(SERVICE):]
    values = array.array("Q")
    values.frombytes(data[: len(data) - len(data) % 16])
    return list(zip(values[::2], values[1::2], strict=True))


def prefault(path: str) -> int:
    """Fault in, as writes would, the pages of `path`'s ranges that lie in this process's
    private writable mappings; how many pages (at most MAX_PAGES)."""
    return _populate(read_ranges(path))


def _populate(ranges: list[tuple[int, int]]) -> int:
    spans = _private_writable()
    starts = [start for start, _ in spans]
    done = 0
    for address, pages in ranges:
        at = bisect.bisect_right(starts, address) - 1
        if at < 0 or address % PAGE or pages <= 0:
            continue
        end = min(address + pages * PAGE, spans[at][1])
        pages = min((end - address) // PAGE, MAX_PAGES - done)
        if pages <= 0:
            continue
        if _libc.madvise(address, pages * PAGE, MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: a kernel without it
                return done
            continue  # a range gone or changed since (ENOMEM, EFAULT): the next one
        done += pages
        if done >= MAX_PAGES:
            break
    return done
