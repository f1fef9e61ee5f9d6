"""crun run from a sealed copy in memory, so that it does not copy itself at every call.

Against CVE-2019-5736 (a container process that opens the runtime's /proc/PID/exe and writes
through it to the host's binary), crun first checks whether its own executable is a memfd
sealed against every change (`F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE`);
if not, it makes a read-only handle of itself (a bind mount of /proc/self/exe in /tmp,
remounted read-only, opened and detached again; or a sealed copy) and executes itself again
from it: a second exec of a binary that links ten libraries, and three mount calls, on every
`run`, `exec` and `delete` (~1.7 ms a call on this node, docs/design-notes.md). crun accepts
a sealed memfd as already safe (its `is_self_cloned`: "an admin could bind-mount a sealed
memfd to /usr/bin/crun"), so this process makes that copy once (`sealed_copy`) and starts
crun from it (`/proc/self/fd/N`, the descriptor passed to the child): the same protection,
made once per process instead of once per call.

The copy is named by the binary's identity (device, inode, size, mtime): an upgraded crun
gets a new copy, and the old one stays open (another thread may be starting crun from it;
an upgrade within one process's life is rare). Any failure (no memfd, no sealing, a binary
that changed while copied) answers None and crun runs from its path as before, copying
itself as it always did. Threads share the copies (a lock makes each once).

Owns: `sealed_copy`, `SEALS`. Must not: run crun (crun.py does).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading

log = logging.getLogger(__name__)

# What crun requires of a memfd to run from it without copying itself (all four seals).
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
# This process's copies, by the identity of the binary each was made from.
_copies: dict[tuple[int, int, int, int], int] = {}
_lock = threading.Lock()


def _new_lock() -> None:
    """In a child just forked: a lock of its own (another thread may have held the parent's)."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)


def sealed_copy(binary: str) -> int | None:
    """A memfd holding `binary`'s bytes with SEALS set (close-on-exec: a child gets it only
    when passed), made on the first call for this binary in this process; None if it cannot
    be made."""
    try:
        source = os.open(binary, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        log.debug("no sealed copy of %s: %s", binary, error)
        return None
    try:
        with _lock:
            before = os.fstat(source)
            identity = (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)
            if identity in _copies:
                return _copies[identity]
            copy = _copy(source, before.st_size)
            after = os.fstat(source)
            if copy is not None and identity != (after.st_dev, after.st_ino, after.st_size,
                                                 after.st_mtime_ns):
                os.close(copy)  # changed while copied: a torn copy must never run
                copy = None
            if copy is not None:
                _copies[identity] = copy
    finally:
        os.close(source)
    if copy is None:
        log.debug("no sealed copy of %s", binary)
    return copy


def _copy(source: int, size: int) -> int | None:
    """A sealed memfd with the `size` bytes of `source`, or None."""
    try:
        copy = os.memfd_create("weenv-crun", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        sent = 0
        while sent < size:
            done = os.sendfile(copy, source, sent, size - sent)
            if done == 0:
                raise OSError("the binary is shorter than it was")
            sent += done
        fcntl.fcntl(copy, fcntl.F_ADD_SEALS, SEALS)
        if fcntl.fcntl(copy, fcntl.F_GET_SEALS) != SEALS:
            raise OSError("the copy's seals are not the ones crun checks")
        return copy
    except OSError:
        os.close(copy)
        return None
