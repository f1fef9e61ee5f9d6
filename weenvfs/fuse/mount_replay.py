"""A mount's hint replay, from looking the hint up to running it where core/replay_choice.py
says.

Owns: `MountReplay`. `start` (first thing in a mount) looks the hint up in a thread of its
own, chooses where the replay runs and, for a process, asks the node service for one
(replay_process.py), all while the mount's image is made; `run` (beside the mount's server)
then reads that process's reports, or runs this process's `Prefetcher` over the hint found:
the few missing chunks of a warm node, or the whole replay when the service runs no more
replays (or none runs). `progress` is the mount's `hints` statistics, with the choice.

Why the lookup comes before the request: asked for first, a replay process ran for every
hinted mount, and on a warm node started 32 at once it had 1 of ~220 chunks to fetch per
mount, while each daemon waited 84-354 ms (median) on its request in the service's queue
before it could make its image (docs/design-notes.md). The lookup itself is two store GETs
and ~4 ms of CPU, off the daemon's path in this thread. But a node new to the environment's
groups (`replay_choice.node_new`) asks first, as before, once one listing of the hint tags
(`node_hints.may_have_hint`) says there is a hint: there the replay has everything to fetch,
and waiting for the lookup started it later (the README's cold hinted run 30-40 ms slower),
while asking without the listing started a replay process for a first run with no hint. It
asks from the same thread: made before the image, as it was, the requests of 32 cold starts
at once waited in the service's queue again (their median open 1.73 s against 1.22-1.58 s).
The mount of a group under the environment's top replays nothing (that group's environment
is replayed by the top's mount).

Must not: decide where the replay runs (replay_choice.py), fetch, or warm pages itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import trio

from weenvfs.core.chunk_plan import ChunkLoc
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.loaded_env import LoadedEnv
from weenvfs.core.node_hints import NO_HINT, FoundHint, env_hint_lookup, may_have_hint
from weenvfs.core.prefetch import Prefetcher
from weenvfs.core.replay_choice import ReplayChoice, choose, node_new

from . import replay_process
from .config import MountConfig

log = logging.getLogger(__name__)


class MountReplay:
    """The hint replay of one mount of `env` (`pages`: on the kernel path, where a replay
    process also reads the hinted files into the page cache)."""

    def __init__(self, env: LoadedEnv, config: MountConfig, fetcher: Fetcher, *,
                 pages: bool, first: Sequence[ChunkLoc] = ()) -> None:
        self.env = env
        self.config = config
        self.fetcher = fetcher
        self.pages = pages
        self.first = first  # the identity files' chunks (replay_choice.node_new)
        self.prefetcher = Prefetcher(env.tree.groups, fetcher, fetch_all=config.fetch_all)
        self.replayer: Prefetcher | replay_process.ReplayProcess = self.prefetcher
        self.choice: ReplayChoice | None = None
        self.where = "mount daemon"
        self._found: FoundHint | None = None
        self._fd: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def hinted(self) -> bool:
        """Whether this mount replays a hint at all: the top group's (or a whole
        environment's) mount, with a `--hint` other than `none`."""
        return self.env.serves_top and self.config.hint != NO_HINT

    def start(self) -> None:
        """Look the hint up, choose, and ask for a replay process if chosen, in a thread."""
        if self.hinted:
            self._thread = threading.Thread(target=self._prepare, name="hint-lookup",
                                            daemon=True)
            self._thread.start()

    def _prepare(self) -> None:
        try:
            if node_new(self.first, self.fetcher.cache):
                # One listing (none where the node knows the hint) says whether there is a
                # hint to ask a process for: a first run has none to replay.
                if not may_have_hint(self.env, self.config.hint, self.config.cache_dir):
                    log.info("no hint for %s", self.env.ref)
                    return
                self.choice = ReplayChoice(True, None, None, "a node new to these groups")
                log.info("hint replay asked of the node service at once: %s", self.choice.why)
                self._fd = replay_process.launch(self.env, self.config, pages=self.pages)
                if self._fd is not None:
                    return
            self._found = env_hint_lookup(self.env, self.config.hint)()
            if self._found is None:
                return
            if self.choice is not None:  # asked for at once, and declined: replay here
                return
            own = (range(len(self.env.tree.groups)) if self.env.layer is None
                   else (self.env.layer,))
            self.choice = choose(self._found, self.env.tree.groups, self.fetcher.cache,
                                 fetch_all=self.config.fetch_all, own_groups=own,
                                 page_roots=self.config.page_roots if self.pages else None)
            log.info("hint replay in the %s: %s", "node service" if self.choice.process
                     else "mount daemon", self.choice.why)
            if self.choice.process:
                self._fd = replay_process.launch(self.env, self.config, pages=self.pages)
        except Exception as error:  # advisory work: a hint found is replayed here
            log.warning("hint replay set-up: %s", error)

    async def run(self) -> None:
        """Replay where `start` chose, once it has (or only fetch everything, with
        `fetch_all` and no hint); never raises into the mount."""
        if self._thread is None:
            self._log_unhinted()
            await self.prefetcher.run(lambda: None)
            return
        await trio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)
        if self._fd is not None:
            self.where = "process"
            self.replayer = replay_process.ReplayProcess(self._fd, self.fetcher)
            await self.replayer.run()
            return
        found = self._found
        await self.prefetcher.run(lambda: found)

    def _log_unhinted(self) -> None:
        if not self.env.serves_top:
            log.info("group %s is not the top of %s: its hint is replayed by that group's "
                     "mount", self.env.layer, self.env.ref)
        else:
            log.info("no hint for %s (--hint none)", self.env.ref)

    def progress(self) -> dict[str, Any]:
        """What `weenv stats` shows under `hints`: the replayer's progress, and where the
        replay was chosen to run, why, and where it runs (`choice`: None until chosen, or
        with no hint; `where` is the mount daemon when the node service declined)."""
        doc = self.replayer.progress()
        doc["choice"] = None if self.choice is None else {**self.choice.as_dict(),
                                                          "where": self.where}
        return doc
