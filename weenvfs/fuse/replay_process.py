"""A mount's hint replay in a process of its own, forked by the node service.

Owns: asking the node service to run `weenv cache warm ENV ...` for the mount (core/warm.py
says why a process of its own: the replay's CPU work then no longer holds up the daemon's
answers to the kernel), reading its JSON-line reports while the mount serves, and showing
them as the mount's `hints` statistics. The chunks the replay brings in are recorded in the
mount's `Stats` as prefetched (so hint hits and waste count as for an in-process replay) and
its store counters are added to the mount's (`Stats.add_other`). While it runs the
fetcher's neighbourhood prefetch is paused, as during an in-process replay.

`launch` returns None when no node service runs it (WEENV_MOUNTD=off, no server): the mount
then replays in-process (core/prefetch.py). Unmounting closes the report pipe, and the
replay stops at its next report (EPIPE). Must not: fetch anything itself.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import trio

from weenvfs.core.fetcher import Fetcher
from weenvfs.core.loaded_env import LoadedEnv

from . import mountd
from .config import MountConfig

log = logging.getLogger(__name__)

MAX_LINE = 8 << 20  # a report names at most every chunk of an environment once


def launch(env: LoadedEnv, config: MountConfig, pages: bool = False) -> int | None:
    """Have the node service start the replay of `env`'s hint (a mount asks once it has found
    the hint and chosen a process for it: mount_replay.py); the read end of its report
    pipe, or None: no node
    service, or the service runs as many replays as it takes already (`mountd.MAX_REPLAYS`:
    on a node starting many environments at once each mount daemon replays its own).
    With `pages` (the kernel path), the replay also reads the hint's files through this
    mount into the page cache (core/page_warm.py): those of every group for a merged
    mount, of its own group for a layer, and those of the groups `config.page_roots`
    names through their mounts."""
    argv = [*mountd.log_args(), "cache", "warm", env.digest,
            "--store", env.store.url, "--cache", str(config.cache_dir), "--hint", config.hint,
            *(["--all"] if config.fetch_all else [])]
    if pages:
        layer = "" if env.layer is None else f"{env.layer}="
        argv += ["--pages-through", f"{layer}{config.mountpoint.absolute()}"]
        for group, root in sorted(config.page_roots.items()):
            argv += ["--pages-through", f"{group}={root}"]
    read_fd, write_fd = os.pipe()
    try:
        launched = mountd.launch(argv, write_fd, 2, start=False, kind=mountd.REPLAY)
    except OSError as error:
        log.info("hint replay in this process: %s", error)
        launched = False
    finally:
        os.close(write_fd)
    if not launched:
        os.close(read_fd)
        return None
    log.info("hint replay of %s runs in a process of the node service", env.digest[:12])
    return read_fd


class ReplayProcess:
    """The reports of a `weenv cache warm` process replaying a mount's hint (`launch`)."""

    def __init__(self, read_fd: int, fetcher: Fetcher) -> None:
        self.read_fd = read_fd
        self.fetcher = fetcher
        self.progress_doc: dict[str, Any] = {"state": "starting", "hint": None, "source": None,
                                             "chunks": 0, "bytes": 0, "chunks_done": 0,
                                             "chunks_missing": 0, "replay_s": None,
                                             "partial": False}
        self._digests: set[bytes] = set()
        # Its page-cache warm-up reads chunks through this mount before its next report
        # names them: such a read is a hit (Stats.record_demand_use).
        fetcher.stats.prefetch_elsewhere = True
        self._neighbours = fetcher.neighbours
        # Until the replay is over, or says it replays the seed (core/prefetch.py says why).
        fetcher.neighbours = None

    async def run(self) -> None:
        """Read reports until the replay ends (or the mount does: cancelled)."""
        stream = trio.lowlevel.FdStream(self.read_fd)
        buffer = b""
        try:
            async with stream:
                while True:
                    data = await stream.receive_some(1 << 16)
                    if not data:
                        break
                    buffer += data
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        self._apply(line)
                    if len(buffer) > MAX_LINE:
                        raise ValueError("report line too long")
        except (OSError, ValueError) as error:
            log.warning("hint replay reports stopped: %s", error)
        finally:
            self.fetcher.neighbours = self._neighbours
        if self.progress_doc["state"] not in ("done", "no hint"):
            log.warning("the hint replay process ended early (state %s); reads fetch on "
                        "demand", self.progress_doc["state"])
            self.progress_doc["state"] = "failed"

    def _apply(self, raw: bytes) -> None:
        try:
            line = json.loads(raw)
            hints, fetch, fetched = line["hints"], line["fetch"], line["fetched"]
            if not isinstance(hints, dict) or not isinstance(fetch, dict):
                raise TypeError("not objects")
            for hex_digest, nbytes in fetched:
                digest = bytes.fromhex(hex_digest)
                self._digests.add(digest)
                self.fetcher.stats.record_prefetched(digest, int(nbytes))
        except (ValueError, KeyError, TypeError) as error:
            log.warning("ignoring a malformed hint replay report: %s", error)
            return
        self.progress_doc = hints
        self.fetcher.stats.add_other(fetch)
        if line.get("done") or hints.get("partial") is True:
            self.fetcher.neighbours = self._neighbours

    def progress(self) -> dict[str, Any]:
        """What `weenv stats` shows under `hints` (as `Prefetcher.progress`, computed here:
        waste is the replay's chunks no read of this mount used so far)."""
        return {**self.progress_doc, "waste": self.fetcher.stats.unused_prefetched(self._digests),
                "replayer": "separate process"}
