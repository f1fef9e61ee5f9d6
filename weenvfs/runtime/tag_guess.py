"""A warm `weenv run` starts its sandbox from the digest its tag resolved to last time on this
node, while the store confirms the tag.

Every `weenv run NAME:TAG` asks the store what the tag names: one round trip (~5 ms from
SeaweedFS on 127.0.0.1, more from a remote store) on the critical path of a warm run whose
whole fixed cost is ~20-40 ms, though a tag rarely moves between two runs. So when the node
noted what this store argument and reference resolved to before (core/node_copies.py
`note_resolved`), its manifest's node copy is intact, and whether the run records a hint can
be decided without the store, `start` returns that environment at once and asks the store in
a thread; the run mounts and creates its sandbox meanwhile, and `Guess.confirm` is called
before the command starts. A tag that moved (or a store error) is known before anything ran:
the caller discards the sandbox and resolves again as without a guess (or fails with the
store's error, as without a guess). The command never runs in an environment the store did
not name at the time of the run.

No guess (the normal resolution) for a process that would have asked the node service to
resolve (node_resolve.py: a remote store whose client this process has not loaded, ~0.35 s;
the service's own fork of a run has it), a first run of the reference on this node, a store given
as a relative folder (the note is kept per store argument, and the same words name another
folder from another working folder), a run that may record a hint and does not know yet
(recording.decide asks the store whether a hint exists), or WEENV_TAG_GUESS=off.

Owns: whether to guess, the guess, its confirmation. Must not: create or remove sandboxes
(runtime/commands.py does, around `confirm`), or note a resolution the store did not give.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from weenvfs.core import node_copies
from weenvfs.fuse.config import is_url
from weenvfs.store import open_store
from weenvfs.store.base import Store
from weenvfs.store.repository import Repository
from weenvfs.switches import switched_off

from . import node_resolve, recording
from .env_source import EnvSource

log = logging.getLogger(__name__)

SWITCH = "WEENV_TAG_GUESS"  # off: every run resolves its tag before it starts


class Guess:
    """An environment taken from the node's last resolution; `confirm` says if it holds."""

    def __init__(self, source: EnvSource, store: Store, store_arg: str) -> None:
        self.source = source
        self._store_arg = store_arg
        self._answer: str | BaseException | None = None
        self._thread = threading.Thread(target=self._ask, args=(store,),
                                        name="weenv-tag-check", daemon=True)
        self._thread.start()

    def _ask(self, store: Store) -> None:
        try:
            with store:
                self._answer = node_copies.resolve_digest(Repository(store), self.source.ref)
        except BaseException as error:  # noqa: BLE001 - raised in the caller's thread
            self._answer = error

    def confirm(self) -> bool:
        """Whether the store's tag names the guessed environment (else the node's note is
        the store's answer now); the store's error if it could not say, as resolving would
        have raised it."""
        self._thread.join()
        if isinstance(self._answer, BaseException):
            raise self._answer
        if self._answer == self.source.digest:
            return True
        node_copies.note_resolved(self.source.cache_dir, self._store_arg, self.source.ref,
                                  str(self._answer))
        return False


def start(ref: str, store: str | Path, cache_dir: Path,
          record_hint: bool | None) -> Guess | None:
    """A `Guess` for `ref` in `store` (asking the store already), or None: resolve as usual
    (see the module)."""
    store_arg = str(store)
    if (switched_off(SWITCH) or record_hint or node_resolve.worth_asking(store_arg)
            or not (is_url(store_arg) or os.path.isabs(store_arg))):
        return None
    digest = node_copies.last_resolved(cache_dir, store_arg, ref)
    if digest is None:
        return None
    if record_hint is None and not (switched_off(recording.SWITCH_ENV)
                                    or node_copies.known_hinted(cache_dir, digest)):
        return None
    manifest = node_copies.node_manifest(cache_dir, digest)
    if manifest is None:
        return None
    opened = open_store(store_arg)
    source = EnvSource.from_manifest(ref, digest, opened.url, cache_dir, manifest)
    log.info("%s: starting environment %s, which it named last, while the store confirms it",
             ref, digest[:12])
    return Guess(source, opened, store_arg)
