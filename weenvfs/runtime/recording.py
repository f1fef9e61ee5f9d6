"""Hints by default: whether a sandbox records its environment's prefetch hint, and what it
published.

An environment's first run records what it reads and publishes it as the environment's hint
(tag `latest`) when it ends; later runs replay it (the mount of the top group does,
lowers.py). Owns:
- `decide`: record or not, from the caller's wish (None: only when the environment has no
  hint yet, unless $WEENV_RECORD_HINTS=off turns the default off on this node; True: always,
  merged into the existing hint; False: never) and the store (a store that cannot be written
  is said once per process at INFO, and the run goes on unrecorded; a forced recording fails
  instead);
- `recording_key`: the key of the private, merged mount a recording sandbox reads through
  (mounts.py). One per environment, store and chunk cache: sandboxes of that environment that
  start while it records join it, and the hint is published when the last of them ends;
- `outcome_line`: the one line that tells the user a hint was published (or, for a recording
  by default, that the node service publishes it: the run does not wait for the publish,
  mounts.py `_publish_later`; an explicit recording, whose caller reads the hint next, does).

Why a mount of its own (docs/design-notes.md, "Hints by default"): the shared group mounts
may be warm, and a warm mount never sees the reads the page cache answers, so recording there
would miss the base groups; they are shared with other environments too, whose reads would
mix in. A fresh merged mount sees every first read of this environment, on both data paths.

Must not: mount (mounts.py), record or publish (core/node_hints.py, fuse/mount.py do).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weenvfs.errors import StoreError, UsageError
from weenvfs.switches import switched_off

if TYPE_CHECKING:
    from weenvfs.store.base import Store

log = logging.getLogger(__name__)

HINT_TAG = "latest"  # the tag a first run publishes and later runs replay (the default)
SWITCH_ENV = "WEENV_RECORD_HINTS"  # "off": no recording unless asked for (node-wide)
_READ_ONLY_SAID: set[str] = set()  # store URLs already reported read-only by this process


def decide(store: Store, digest: str, manifest: Any, wish: bool | None,
           cache_dir: Path | None = None) -> bool:
    """Whether a sandbox of environment `digest` (its `Manifest`) records its hint (see the
    module doc). With the node's `cache_dir`, an environment known there to have a hint
    costs no store request (core/node_copies.py `known_hinted`)."""
    if wish is False:
        return False
    if wish is None and switched_off(SWITCH_ENV):
        return False
    # Imported here: lowers.py imports this module, and `weenv run` parses its arguments
    # without the store and the core (tests/test_cli_dispatch.py).
    from weenvfs.core.node_copies import known_hinted, remember_hinted
    from weenvfs.core.node_hints import has_hint
    from weenvfs.fuse import writable_stores
    from weenvfs.store.repository import Repository

    if wish is None:
        if cache_dir is not None and known_hinted(cache_dir, digest):
            return False
        if has_hint(Repository(store), digest, manifest, HINT_TAG):
            if cache_dir is not None:
                remember_hinted(cache_dir, digest)
            return False
    if not writable_stores.known_writable(store):
        try:
            store.check(write=True)
        except StoreError as error:
            if wish:
                raise UsageError(f"cannot record a hint: {error}") from None
            if store.url not in _READ_ONLY_SAID:
                _READ_ONLY_SAID.add(store.url)
                log.info("store %s cannot be written (%s): runs are not recorded as hints",
                         store.url, error)
            return False
        writable_stores.remember(store)
    log.info("environment %s has no hint yet: this run records one", digest[:12])
    return True


def recording_key(digest: str, store_url: str, cache_dir: Path, tag: str = HINT_TAG) -> str:
    """The key (mounts.py) of the mount that records environment `digest`'s hint `tag` (a
    run recording `latest` and `weenv convert` recording the seed do not share one)."""
    import hashlib  # here: OpenSSL's loading is ~3 ms of an API client's import

    extra = b"" if tag == HINT_TAG else b"\n" + tag.encode()
    return hashlib.sha256(b"weenv hint recording\n%s\n%s\n%s%s" % (
        digest.encode(), store_url.encode(), bytes(cache_dir.absolute()), extra)).hexdigest()


def outcome_line(ref: str, outcome: dict[str, Any]) -> str | None:
    """What to tell the user about a recording mount's outcome (its result file, or the
    `pending` one of a recording the node service publishes after the run), or None when
    nothing was published."""
    if outcome.get("pending"):
        return (f"weenv: recorded what this run read as the prefetch hint of {ref} "
                f"({str(outcome.get('manifest'))[:12]}:{outcome.get('tag') or HINT_TAG}); "
                "the node service publishes it now and later runs replay it")
    if outcome.get("error"):
        return f"weenv: the hint recorded for {ref} was not published: {outcome['error']}"
    if not outcome.get("hint"):
        return None
    return (f"weenv: recorded what this run read ({outcome.get('recorded', 0)} chunks) and "
            f"published it as the prefetch hint of {ref} ({str(outcome['manifest'])[:12]}:"
            f"{outcome.get('tag', HINT_TAG)}); later runs replay it")
