"""What the node service (mountd.py) loads for the children it forks, a step at a time
between requests once its socket listens: the fuse and store modules, the S3 backend's model
and the CLI's parsers first (what mount daemons run), then the modules of the other commands
the CLI names, then a `gc.freeze` of all of it.

Why steps, after listening: a client that finds no service starts one and waits for it to
answer; loading everything first (~450 ms of CPU on the reference node) made that first run
wait for all of it. Now the starter waits for the socket only, a command forked before the
last step loads what it lacks itself (as a process without a service would), and a mount
daemon is forked once the steps it needs for its store are taken (`take_for_daemons`): an
environment's layers are as many daemons, which would each load them again.

Owns: `Preload`, `preload_steps`, PRELOAD. Must not: accept requests or fork (mountd.py).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A step of `Preload`: what it is (for the log), what it does, and which mount daemons need
# it: ALL_DAEMONS, those of one store scheme ("s3"), or none ("").
PreloadStep = tuple[str, Callable[[], object], str]
ALL_DAEMONS = "*"
# By store URL scheme (https: http's), cheapest first: a daemon waits for the steps before
# its own.
STORE_MODULES = {"file": "weenvfs.store.local", "http": "weenvfs.store.http",
                 "s3": "weenvfs.store.s3"}
# What `weenv mount --foreground` needs whatever its store (trio and pyfuse3, the largest
# imports of these, go before them as steps of their own; then STORE_MODULES).
PRELOAD = ("weenvfs.fuse.commands", "weenvfs.fuse.mount", "weenvfs.fuse.kernel_mount",
           "weenvfs.core.node_hints", "setproctitle")


class Preload:
    """The steps left (see the module), taken one at a time by the server's loop. A step
    that fails is logged, never the server's failure: the children that need it fail in
    their own way, with their own message."""

    def __init__(self, steps: list[PreloadStep]) -> None:
        self._steps = list(steps)
        self._took = 0.0

    @property
    def pending(self) -> bool:
        """Whether steps are left."""
        return bool(self._steps)

    def take_for_daemons(self, store: str | None) -> None:
        """Take now every step left up to the last one a mount daemon of `store` (its URL;
        None: not known, every daemon's step) needs."""
        scheme = None if store is None else store.split("://")[0] if "://" in store else "file"
        scheme = "http" if scheme == "https" else scheme

        def needed(by: str) -> bool:
            return by == ALL_DAEMONS or (by != "" and scheme in (by, None))

        while any(needed(by) for _, _, by in self._steps):
            self.step()

    def step(self) -> None:
        """Take the next step (nothing when none is left)."""
        if not self._steps:
            return
        what, action, _ = self._steps.pop(0)
        started = time.monotonic()
        try:
            action()
        except Exception as error:  # noqa: BLE001 - a child that needs it fails on its own
            log.warning("mount server: preloading (%s) failed: %s", what, error)
        self._took += time.monotonic() - started
        if not self._steps:
            log.info("mount server preloaded its children's code in %.0f ms", self._took * 1000)


def preload_steps(preload: tuple[str, ...] = (), prepare: Callable[[], None] | None = None
                  ) -> list[PreloadStep]:
    """The steps of `Preload`: first what mount daemons need (`prepare`: the CLI's parsers;
    trio and pyfuse3, the largest imports, as steps of their own; the fuse modules; each
    store backend, the S3 one with its model), then the `preload` modules (the other
    commands the CLI names), then the freeze of everything loaded (gc.freeze: made for fork
    servers, so no forked child traverses, and copies on write, these objects in a
    collection of its own)."""
    import functools
    import importlib

    from weenvfs.store import warm_up

    def load(name: str, by: str) -> PreloadStep:
        return f"import {name}", functools.partial(importlib.import_module, name), by

    firsts = [load(name, ALL_DAEMONS) for name in ("trio", "pyfuse3", *PRELOAD)]
    stores = [load(name, scheme) for scheme, name in STORE_MODULES.items()]
    listed = {step[0] for step in (*firsts, *stores)}
    others = [load(name, "") for name in dict.fromkeys(preload) if f"import {name}" not in listed]
    return [*([] if prepare is None else [("prepare", prepare, ALL_DAEMONS)]), *firsts,
            *stores, ("the S3 model", warm_up, "s3"), *others, ("freeze", _freeze, "")]


def _freeze() -> None:
    """Keep everything loaded so far out of the collector (see `preload_steps`)."""
    gc.collect()
    gc.freeze()
