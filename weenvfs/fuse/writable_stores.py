"""Which remote stores this node wrote to lately. A first run decides whether to record its
environment's hint by probing the store with a write (runtime/recording.py `decide`: a HEAD,
a PUT and a DELETE, 14 ms of a cold README run's critical path on loopback SeaweedFS), and
every first run of a new environment on the same store asked the same question again.

A store some process of this node (this user's) probed writable within WRITABLE_TTL seconds
with the same credentials and configuration (`Store.writer_identity`: a digest of the URL and
the environment's AWS settings) is taken as writable without asking. A store without an
identity is always asked: a directory store's probe is a local file whose permissions may
change from one run to the next, and credentials given to one store object are not the
node's. A memo that turns out wrong costs a run's recording, never its data: the recording
mount cannot publish the hint, logs it, and forgets the memo (`forget`).

The memos are empty files in a `writable` folder beside the node service's socket
(node_socket.py), so a private service (tests, benchmarks, $WEENV_MOUNTD_SOCKET) keeps its
own.

Must not: probe the store (its caller does) or decide anything about hints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from weenvfs.store import Store

from . import node_socket

log = logging.getLogger(__name__)

# How long a successful write probe speaks for its store. Credentials are revoked, or a bucket
# made read-only, rarely; when it happens within this time, one run's hint goes unpublished.
WRITABLE_TTL = 600.0
FOLDER = "writable"


def _memo(store: Store) -> Path | None:
    """The memo file of `store`, or None for a store that has none."""
    identity = store.writer_identity()
    if identity is None:
        return None
    return Path(node_socket.socket_path()).parent / FOLDER / identity[:40]


def known_writable(store: Store) -> bool:
    """Whether a process of this node probed `store` writable in the last WRITABLE_TTL
    seconds with the same credentials."""
    path = _memo(store)
    if path is None:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and 0 <= time.time() - st.st_mtime < WRITABLE_TTL


def remember(store: Store) -> None:
    """Note that `store` just took a write probe (a failure to note it is only logged)."""
    path = _memo(store)
    if path is None:
        return
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.touch(mode=0o600)
        os.utime(path)  # an existing memo starts its time again
    except OSError as error:
        log.debug("cannot note that %s is writable: %s", store.url, error)


def forget(store: Store) -> None:
    """Drop `store`'s memo (a write it promised failed)."""
    path = _memo(store)
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()
