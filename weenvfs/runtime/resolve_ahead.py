"""Resolving `weenv run`'s reference ahead: from this node's last answer, while the store is
asked.

A warm `weenv run NAME:TAG` from an S3 store waited for one GET of the tag (~5 ms of its
~30 ms of fixed cost, docs/benchmarks.md) before anything else could start, although on a
node that ran the environment before the answer is nearly always the one it got last time
(core/node_copies.py `note_resolved`, `last_resolved`). `resolved_ahead` gives that
environment's source at once, so that the sandbox is made from it (its mounts, overlay and
spec) while a thread asks the store; `Ahead.confirm` then waits for the store's answer, which
decides: the same environment, and the run goes on; another one (the tag moved), and the
caller starts over with it; an error (the tag is gone, the store is down), and the run fails
with it, as it would have without the guess. Nothing runs in a sandbox before `confirm`.

No guess (a first resolution on this node, a guess whose manifest cannot be had) or a
resolution the node service makes for this process (node_resolve.py): resolved before
`resolved_ahead` yields, as `resolve_source` does, and `confirm` returns that source.

Must not: start a sandbox (commands.py does, after `confirm`), or keep the store open past
the block.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from weenvfs.fuse.config import default_cache_dir

from . import node_resolve
from .environment import resolve_source, source_of
from .sandbox import EnvSource

log = logging.getLogger(__name__)


class _Answer:
    """The store's resolution of a reference (digest, manifest), made in a thread."""

    def __init__(self, opened: Any, ref: str, cache_dir: Path) -> None:
        self._result: tuple[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._resolve, args=(opened, ref, cache_dir),
                                        name="resolve", daemon=True)
        self._thread.start()

    def _resolve(self, opened: Any, ref: str, cache_dir: Path) -> None:
        from weenvfs.core.node_copies import resolve_env
        from weenvfs.store.repository import Repository

        try:
            self._result = resolve_env(Repository(opened), ref, cache_dir)
        except BaseException as error:  # raised again by `wait`, in the caller's thread
            self._error = error

    def wait(self) -> tuple[str, Any]:
        """The answer (its error raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def done(self) -> bool:
        """Whether the thread has ended."""
        return not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the thread to end."""
        self._thread.join()


class Ahead:
    """A source to build on now (`source`) and the store's word on it (`confirm`)."""

    def __init__(self, source: EnvSource, make: Any = None, answer: _Answer | None = None
                 ) -> None:
        self.source = source
        self._make = make  # digest, manifest -> the source of another environment
        self._answer = answer
        self._confirmed: EnvSource | None = None if answer is not None else source

    def confirm(self) -> EnvSource:
        """The source the store names now: `source` itself when it agrees with the guess;
        the resolution's own error if it failed. (Only inside the block.)"""
        if self._confirmed is None:
            assert self._answer is not None and self._make is not None
            digest, manifest = self._answer.wait()
            if digest == self.source.digest:
                self._confirmed = self.source
            else:
                log.info("%s names %s now, not %s: starting over", self.source.ref,
                         digest[:12], self.source.digest[:12])
                self._confirmed = self._make(digest, manifest)
        return self._confirmed


@contextmanager
def resolved_ahead(ref: str, store: str | Path, cache: str | Path | None,
                   record_hint: bool | None, *, record_tag: str) -> Iterator[Ahead]:
    """`ref` in `store` resolved as `resolve_source` does, ahead where this node resolved it
    before (see the module). The caller builds on `Ahead.source` and calls `confirm`, inside
    the block, before it runs anything there."""
    store = str(store)
    cache_dir = Path(cache).absolute() if cache is not None else default_cache_dir()
    if node_resolve.worth_asking(store):
        yield Ahead(resolve_source(ref, store, cache_dir, record_hint, record_tag=record_tag))
        return
    from weenvfs.core.node_copies import last_resolved, load_manifest, note_resolved
    from weenvfs.store import open_store
    from weenvfs.store.repository import Repository

    opened = open_store(store)
    answer: _Answer | None = None
    try:

        def make(digest: str, manifest: Any) -> EnvSource:
            note_resolved(cache_dir, store, ref, digest)
            return source_of(ref, digest, manifest, opened, cache_dir, record_hint, record_tag)

        guess = last_resolved(cache_dir, store, ref)
        answer = _Answer(opened, ref, cache_dir)
        guessed = None
        if guess is not None:
            try:
                manifest = load_manifest(Repository(opened), guess, cache_dir)
                guessed = source_of(ref, guess, manifest, opened, cache_dir, record_hint,
                                    record_tag)
            except Exception as error:  # noqa: BLE001 - the store's answer decides instead
                log.info("no head start from %s for %s: %s", guess[:12], ref, error)
        if guessed is None:
            yield Ahead(make(*answer.wait()))
        else:
            yield Ahead(guessed, make, answer)
    finally:
        if answer is None or answer.done():
            opened.close()
        else:  # abandoned while the store answers (an error, Ctrl-C): closed once it has
            threading.Thread(target=_close_after, args=(answer, opened), daemon=True).start()


def _close_after(answer: _Answer, opened: Any) -> None:
    answer.join()
    opened.close()
