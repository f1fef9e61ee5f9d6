"""Content digests: BLAKE3-256, written as 64 lowercase hex characters.

Chunk ids are the digest of the chunk's plaintext (so dedup does not depend on the zstd level);
every other object is named by the digest of its stored bytes.
"""

from __future__ import annotations

import os
import re

import blake3

from .errors import DigestMismatch, FormatError

_HEX = re.compile(r"[0-9a-f]{64}")
# Above this size hashing uses blake3's own threads (it releases the GIL either way). Chunks
# (1 MiB by default) hash on one thread: on a node whose cores the workload and the store
# keep busy, waking the pool for one chunk costs more than it saves (0.41 ms against 0.29 ms
# per chunk), and the README's first run was ~2% faster (docs/design-notes.md).
_THREADED_HASH_MIN = 2 << 20
# blake3's threads come from a pool made at the first threaded hash. A process that forks
# must never make it: a forked child inherits the pool without its threads, and its first
# threaded hash waits forever. `fork_server()` keeps such a process to one thread (its
# children, after the fork, may use threads again).
_threads_allowed = True


def fork_server() -> None:
    """Hash on one thread in this process from now on (see `_threads_allowed`)."""
    global _threads_allowed
    _threads_allowed = False


def _allow_threads() -> None:
    global _threads_allowed
    _threads_allowed = True


os.register_at_fork(after_in_child=_allow_threads)


def digest_bytes(data: bytes | memoryview) -> bytes:
    """The raw 32-byte BLAKE3-256 digest of `data`."""
    big = len(data) >= _THREADED_HASH_MIN and _threads_allowed
    threads = blake3.blake3.AUTO if big else 1
    return blake3.blake3(data, max_threads=threads).digest()


def digest_hex(data: bytes | memoryview) -> str:
    """The BLAKE3-256 digest of `data` as 64 hex characters (an object name)."""
    return digest_bytes(data).hex()


def check_digest(text: str, what: str = "digest") -> str:
    """Return `text` if it is a well-formed digest, else raise `FormatError` naming `what`."""
    if not isinstance(text, str) or not _HEX.fullmatch(text):
        raise FormatError(what, f"not a 64-character lowercase hex BLAKE3 digest: {text!r:.80}")
    return text


def verify_digest(data: bytes | memoryview, expected: str, what: str) -> None:
    """Raise `DigestMismatch` unless `data` hashes to the hex digest `expected`."""
    actual = digest_hex(data)
    if actual != expected:
        raise DigestMismatch(what, expected, actual)


def short(digest: str | bytes) -> str:
    """The first 12 hex characters, the form used in logs and messages."""
    return (digest.hex() if isinstance(digest, bytes) else digest)[:12]
