"""Concurrency slots of the fetcher: `DemandLimiter` (a capacity limiter for demand store
calls that tells prefetch when demand is waiting), `Handoff` (a slot taken before a thread
call and released when that thread really ends, even if abandoned), and `NoLock` (stands in
for a cache lock when the cache cannot lock).

Must not: call the store or the cache (fetcher.py does).
"""

from __future__ import annotations

import trio


class DemandLimiter:
    """A CapacityLimiter for demand store calls that knows whether demand is queued, so that
    prefetch can yield while it is."""

    def __init__(self, total: int) -> None:
        self._inner = trio.CapacityLimiter(total)
        self.queued = 0
        self._idle = trio.Event()
        self._idle.set()

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        try:
            self._inner.acquire_on_behalf_of_nowait(borrower)
            return
        except trio.WouldBlock:
            pass
        self.queued += 1
        if self.queued == 1:
            self._idle = trio.Event()
        try:
            await self._inner.acquire_on_behalf_of(borrower)
        finally:
            self.queued -= 1
            if self.queued == 0:
                self._idle.set()

    def release_on_behalf_of(self, borrower: object) -> None:
        self._inner.release_on_behalf_of(borrower)

    async def wait_idle(self) -> None:
        """Return once no demand call is waiting for a slot."""
        while self.queued:
            await self._idle.wait()


class NoLock:
    """Stands in for a ChunkLock when the cache cannot lock."""

    def release(self) -> None:
        pass


class Handoff:
    """Takes a limiter slot before a `to_thread.run_sync` call and hands it to that call, which
    releases it when its thread really ends (even if abandoned). If the call never started a
    thread, `release_if_unused` gives the slot back."""

    def __init__(self, limiter: DemandLimiter | trio.CapacityLimiter) -> None:
        self._limiter = limiter
        self._used = False

    async def acquire(self) -> None:
        await self._limiter.acquire_on_behalf_of(self)

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self._used = True  # already held: trio's placeholder borrows our slot

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(self)

    def release_if_unused(self) -> None:
        if not self._used:
            self._used = True
            self._limiter.release_on_behalf_of(self)
