"""Errors of the node side and the build side.

Every class's docstring reads as its message. `WeenvError` carries the exit code the CLI uses;
`main()` prints `str(error)` on one line without a traceback. Raise these in the core and the
tools; translate them only at the FUSE boundary (errno) and in `main()` (exit code).
"""

from __future__ import annotations

from typing import ClassVar


class WeenvError(Exception):
    """weenv failed."""

    exit_code = 1

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class Terminated(KeyboardInterrupt):
    """A signal other than SIGINT (SIGTERM, SIGHUP) stops a command: `finally` blocks run as
    for Ctrl-C, and `main()` exits with 128 + `signum`, as a shell reports a death by it."""

    # Why this process sent itself a signal (signum -> what to say instead of "terminated by
    # SIG..."): the node service's command whose `weenv run` went away.
    reasons: ClassVar[dict[int, str]] = {}

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.why = Terminated.reasons.get(signum)


class UsageError(WeenvError):
    """Invalid arguments."""

    exit_code = 2


class StoreError(WeenvError):
    """The store failed."""


class ObjectMissing(StoreError):
    """An object is missing from the store."""

    def __init__(self, key: str, store: str = "") -> None:
        where = f" in {store}" if store else ""
        super().__init__(f"object {key!r} is missing{where}")
        self.key = key


class StoreUnavailable(StoreError):
    """The store cannot be reached."""

    def __init__(self, message: str | None = None, *, temporary: bool = True) -> None:
        super().__init__(message)
        self.temporary = temporary


class ObjectCorrupt(StoreError):
    """An object's bytes do not match its digest."""


class ObjectTooLarge(StoreError):
    """An object is larger than a reader of its kind reads (SPEC.md 12.1); refused unread."""

    def __init__(self, key: str, store: str, limit: int, size: int | None = None) -> None:
        has = f"is {size} bytes" if size is not None else "is larger than that"
        super().__init__(f"object {key!r} in {store} {has}: refused, the limit is {limit}")
        self.key = key
        self.limit = limit
        self.size = size


class RefNotFound(WeenvError):
    """No such environment or group."""


class SourceError(WeenvError):
    """The build source is invalid."""


class ChunkUnavailable(WeenvError):
    """A chunk could not be fetched from the store in time."""

    def __init__(self, digest: str, reason: str) -> None:
        super().__init__(f"chunk {digest[:12]} is unavailable: {reason}")
        self.digest = digest
        self.reason = reason


class ChunkCorrupt(ChunkUnavailable):
    """A chunk's bytes in the store do not match its digest."""

    def __init__(self, digest: str, reason: str) -> None:
        WeenvError.__init__(self, f"chunk {digest[:12]} is corrupt in the store: {reason}")
        self.digest = digest
        self.reason = reason
