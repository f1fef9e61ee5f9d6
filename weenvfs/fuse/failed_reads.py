"""The device reads a mount daemon failed, to tell the kernel's retries of one from new reads.

The native device server (native_devices.py) forwards the reads it cannot answer with the
asking task's id; when the daemon fails one (EIO at the deadline), the kernel reads the page
the reader waits for once more from the same task before the reader's read(2) or page fault
returns. `FailedReads` lets such a retry continue the first read's wait instead of starting
a deadline of its own (docs/design-notes.md).

Owns: the per-task record of failed reads and the count of a task's finished reads
(/proc/TID/task/TID/io `syscr`). Must not: answer reads or fetch (native_devices.py, core/).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

# How long after a task's read failed a read of the same bytes by that task may be the
# kernel's retry of it (`FailedReads`): the kernel retries at once, milliseconds later.
RETRY_WINDOW = 1.0
# How long the count of a task's finished reads may take to read (`reads_done`): /proc waits
# for a task in the middle of an exec, which may itself wait for this process's answer.
_PROC_WAIT = 0.2


@dataclass(frozen=True)
class Retry:
    """A read that may be the kernel's retry of one this process failed: the failure's errno,
    when (trio's clock) the deadline of the wait it continues runs out, and how many read
    system calls the task had finished then (None: not known)."""

    error: int
    ends: float
    reads_done: int | None


def _syscr(tid: int) -> int | None:
    try:
        with open(f"/proc/{tid}/task/{tid}/io", "rb") as f:
            for line in f:
                if line.startswith(b"syscr:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


async def reads_done(tid: int) -> int | None:
    """How many read system calls task `tid` has finished (its own `syscr`, counted as each
    one ends), or None when that cannot be read (soon enough)."""
    if not tid:
        return None
    with trio.move_on_after(_PROC_WAIT):
        return await trio.to_thread.run_sync(_syscr, tid, abandon_on_cancel=True)
    return None


class FailedReads:
    """The device reads this process failed, to tell the kernel's retries of one from new reads.

    The kernel answers a failed read of a file's pages by reading the page the reader waits
    for once more, at once and from the same task, before the reader's read(2) or page fault
    returns: filemap_update_page calls `read_folio` once on a folio a failed read-ahead left
    not up to date, and filemap_fault up to twice more (the fault is retried after the first,
    the per-VMA lock's attempt once more before that). Those reads are the same reader's
    wait, not new ones: each gets what is left of the deadline the first failed read started
    (`Retry.ends`), nothing when that read waited the whole deadline. Without this, a read of
    data the store does not serve waited two deadlines on the kernel path, a page fault
    three (docs/design-notes.md).

    A retry is a read of the task whose read failed at most RETRY_WINDOW ago that overlaps
    the failed one, while that task has finished no read system call since (`reads_done`:
    the reader's own next read(2) is a new read with a deadline of its own); a retry that
    fails is remembered as the same wait. A task's read of other bytes forgets its
    failures."""

    def __init__(self) -> None:
        # task -> (trio time of the failure, device, start, end, its Retry)
        self._by_task: dict[int, list[tuple[float, int, int, int, Retry]]] = {}

    def failed(self, pid: int, dev: int, offset: int, size: int, retry: Retry) -> None:
        """Task `pid`'s read of device `dev`'s [offset, offset + size) failed; `retry` is
        what a retry of it gets. Call before answering it."""
        if not pid:
            return  # a task the kernel could not name (in another pid namespace)
        now = trio.current_time()
        for task in [t for t, records in self._by_task.items()
                     if now - records[-1][0] > RETRY_WINDOW]:
            del self._by_task[task]
        self._by_task.setdefault(pid, []).append((now, dev, offset, offset + max(size, 1),
                                                  retry))

    def retry_of(self, pid: int, dev: int, offset: int, size: int) -> Retry | None:
        """The `Retry` of task `pid`'s read of `dev`'s [offset, offset + size) when it
        overlaps a read of that task's that failed at most RETRY_WINDOW ago (the caller then
        checks `reads_done`), else None; either way the task's failures are forgotten."""
        records = self._by_task.pop(pid, None) if pid else None
        now = trio.current_time()
        for when, d, start, stop, retry in records or ():
            if d == dev and now - when <= RETRY_WINDOW and start < offset + max(size, 1) \
                    and offset < stop:
                return retry
        return None
