"""Retrying wrapper: any store, with temporary failures retried.

Owns: the retry policy (exponential backoff with full jitter, bounded by attempts and by total
time) and its counters. Retries only `StoreUnavailable(temporary=True)`; a missing object, a
permanent failure or a bad key is raised at once. Must not: change what a call returns, or
catch anything else. Safe to retry every method because puts are atomic and idempotent.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from weenvfs.errors import ObjectCorrupt, StoreUnavailable
from weenvfs.format.errors import DigestMismatch
from weenvfs.store.base import Store

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying a call that failed temporarily.

    Attempt n (1-based) that fails sleeps a uniformly random time in
    `[0, min(max_delay, base_delay * 2 ** (n - 1))]` ("full jitter", so many clients retrying
    at once spread out). It gives up after `max_attempts` calls in all, or when the next sleep
    would end more than `max_elapsed` seconds after the first call started.
    """

    max_attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    max_elapsed: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if min(self.base_delay, self.max_delay, self.max_elapsed) < 0:
            raise ValueError("retry delays and max_elapsed must not be negative")

    def backoff_cap(self, attempt: int) -> float:
        """The longest sleep after failed attempt number `attempt` (1-based)."""
        # min() before the power would overflow for large attempt numbers.
        return min(self.max_delay, self.base_delay * 2.0 ** min(attempt - 1, 64))

    def delay(self, attempt: int, fraction: float) -> float:
        """The sleep after failed attempt `attempt`, for a random `fraction` in [0, 1)."""
        return self.backoff_cap(attempt) * fraction


class RetryingStore(Store):
    """`inner`, with temporary failures retried according to `policy`.

    `sleep`, `clock` and `rand` (a uniform float in [0, 1)) are injectable so tests run
    without waiting. Counters (`retries`, `give_ups`) are totals over all threads.
    """

    def __init__(
        self,
        inner: Store,
        policy: RetryPolicy | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()
        self._sleep = sleep
        self._clock = clock
        self._rand = rand
        self._lock = threading.Lock()
        self.retries = 0
        self.give_ups = 0

    @property
    def url(self) -> str:
        """The inner store's URL."""
        return self.inner.url

    @property
    def read_only(self) -> bool:  # type: ignore[override]
        """Whether the inner store is read-only."""
        return self.inner.read_only

    @property
    def cheap_requests(self) -> bool:  # type: ignore[override]
        """Whether the inner store's requests cost about a local disk read."""
        return self.inner.cheap_requests

    def local_file(self, key: str) -> str | None:
        """The inner store's file of `key` (a read of it has nothing to retry)."""
        return self.inner.local_file(key)

    def writer_identity(self) -> str | None:
        """The inner store's."""
        return self.inner.writer_identity()

    def _run(self, what: str, call: Callable[[], T]) -> T:
        """Call `call` until it succeeds, fails permanently or the policy gives up."""
        start = self._clock()
        attempt = 1
        while True:
            try:
                return call()
            except StoreUnavailable as e:
                self._before_retry(what, attempt, start, e)
            attempt += 1

    def _before_retry(self, what: str, attempt: int, start: float, err: StoreUnavailable) -> None:
        """Sleep before the next attempt, or re-raise `err` if it must not be retried."""
        if not err.temporary:
            raise err
        delay = self.policy.delay(attempt, self._rand())
        elapsed = self._clock() - start
        if attempt >= self.policy.max_attempts or elapsed + delay > self.policy.max_elapsed:
            with self._lock:
                self.give_ups += 1
            # Debug only: the error itself is raised and reported by the caller.
            log.debug("store %s: %s gave up after %d attempts: %s", self.url, what, attempt, err)
            raise err
        with self._lock:
            self.retries += 1
        log.info(
            "store %s: %s failed (%s), retry %d/%d in %.2f s",
            self.url, what, err, attempt, self.policy.max_attempts - 1, delay,
        )
        self._sleep(delay)

    def get(self, key: str, limit: int | None = None) -> bytes:
        """See `Store.get`."""
        return self._run(f"get {key}", lambda: self.inner.get(key, limit))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """See `Store.get_range`."""
        return self._run(
            f"get_range {key} {offset}+{length}",
            lambda: self.inner.get_range(key, offset, length),
        )

    def put(self, key: str, data: bytes) -> None:
        """See `Store.put`."""
        self._run(f"put {key}", lambda: self.inner.put(key, data))

    def put_file(self, key: str, path: Path | str) -> None:
        """See `Store.put_file`."""
        self._run(f"put_file {key}", lambda: self.inner.put_file(key, path))

    def exists(self, key: str) -> bool:
        """See `Store.exists`."""
        return self._run(f"exists {key}", lambda: self.inner.exists(key))

    def size(self, key: str) -> int:
        """See `Store.size`."""
        return self._run(f"size {key}", lambda: self.inner.size(key))

    def delete(self, key: str) -> None:
        """See `Store.delete`."""
        self._run(f"delete {key}", lambda: self.inner.delete(key))

    def check(self, write: bool = False) -> None:
        """See `Store.check`."""
        self._run("check", lambda: self.inner.check(write))

    def list(self, prefix: str = "") -> Iterator[str]:
        """See `Store.list`. A listing that fails midway restarts and resumes after the last
        key already yielded (keys come in ascending order), so none is repeated or lost. The
        policy's budget starts afresh whenever a try made progress, so a long listing is not
        given up for blips spread over its whole length."""
        start = self._clock()
        attempt = 1
        last: str | None = None
        while True:
            resumed_from = last
            try:
                for key in self.inner.list(prefix):
                    if last is None or key > last:
                        last = key
                        yield key
                return
            except StoreUnavailable as e:
                if last != resumed_from:
                    start, attempt = self._clock(), 1
                self._before_retry(f"list {prefix!r}", attempt, start, e)
            attempt += 1

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()


# Reads of one object before a digest mismatch counts as corruption of the stored object.
CORRUPT_ATTEMPTS = 3


def read_verified(
    read: Callable[[], T], verify: Callable[[T], object], what: str,
    attempts: int = CORRUPT_ATTEMPTS,
) -> T:
    """Return `read()` once `verify(data)` accepts it; the retry rule for checksums.

    Bytes can be damaged on the way in ways no transport check catches (a proxy, a CDN edge,
    memory), so a mismatch is first treated as temporary: the object is read again, up to
    `attempts` reads in all. If every read fails verification, the stored object itself is
    corrupt: ObjectCorrupt. `verify` signals a mismatch with ObjectCorrupt or DigestMismatch;
    anything else it raises, and every error of `read` (already retried by RetryingStore for
    transport failures), propagates at once. Repository and the fetcher wrap their
    get-and-verify in this, e.g.
    `read_verified(lambda: store.get(key), lambda d: verify_digest(d, digest, key), key)`.
    """
    for attempt in range(1, attempts + 1):
        data = read()
        try:
            verify(data)
            return data
        except (ObjectCorrupt, DigestMismatch) as e:
            if attempt == attempts:
                raise ObjectCorrupt(f"{what}: {e} (in each of {attempts} reads)") from None
            log.info("%s: %s; reading again (%d/%d)", what, e, attempt, attempts - 1)
    raise AssertionError("unreachable")
