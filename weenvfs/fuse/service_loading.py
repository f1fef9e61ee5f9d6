"""What the node service (mountd.py) loads for the children it forks, a step at a time
between requests once its socket listens: the CLI's parsers and the runtime's modules (what
a handed-over `weenv run` runs), then what mount daemons run (the fuse modules, each store
backend, the S3 one with its model), then the modules of commands rarely asked for. What
each step loaded is frozen at once (gc.freeze: made for fork servers, so that no child,
whenever it was forked, traverses and copies on write these objects in a collection of its
own: a mount daemon lives for hours).

Why steps, after listening: a client that finds no service starts one and waits for it to
answer; loading everything first (~450 ms of CPU on the reference node) made that first run
wait for all of it. Now the starter waits for the socket only, and each request's child is
forked once the steps it needs are taken (`Preload.take_for`), not before: the children
would each load what they lack again, and many of them start together (an environment's
layers are as many mount daemons; N environments started at once, as many commands).

Owns: `Preload`, `preload_steps`, PRELOAD. Must not: accept requests or fork (mountd.py).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A step of `Preload`: what it is (for the log), what it does, and which children need it:
# COMMANDS (and so every child: those steps come first), DAEMONS (every mount daemon), the
# daemons of one store scheme ("s3"), or none in particular ("").
PreloadStep = tuple[str, Callable[[], object], str]
COMMANDS, DAEMONS = "commands", "daemons"
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

    def take_for(self, store: str | None, daemon: bool) -> None:
        """Take now every step left up to the last one the child of a request needs: a
        command's (`daemon` False: the runtime's modules), or a mount daemon's for `store`
        (its URL; None: not known, every store's)."""
        from weenvfs.store import url_scheme

        scheme = None if store is None else url_scheme(store)
        scheme = "http" if scheme == "https" else scheme

        def needed(by: str) -> bool:
            if not daemon:
                return by == COMMANDS
            return by in (COMMANDS, DAEMONS, scheme) or (scheme is None and by in STORE_MODULES)

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
        # Only what this step made is young: collecting then freezing costs that much.
        gc.collect()
        gc.freeze()
        self._took += time.monotonic() - started
        if not self._steps:
            log.info("mount server preloaded its children's code in %.0f ms", self._took * 1000)


def preload_steps(preload: tuple[str, ...] = (), prepare: Callable[[], None] | None = None,
                  later: tuple[str, ...] = ()) -> list[PreloadStep]:
    """The steps of `Preload`: what the commands it forks need (`prepare`: the CLI's
    parsers, then the `preload` modules: the runtime's), what mount daemons need (trio and
    pyfuse3, the largest imports, as steps of their own, PRELOAD, each store backend, the S3
    one with its model), and the `later` modules (commands rarely asked for)."""
    import functools
    import importlib

    from weenvfs.store import warm_up

    groups = [(preload, COMMANDS), (("trio", "pyfuse3", *PRELOAD), DAEMONS),
              *(((name,), scheme) for scheme, name in STORE_MODULES.items()), (later, "")]
    steps: list[PreloadStep] = [] if prepare is None else [("prepare", prepare, COMMANDS)]
    for names, by in groups:
        for name in names:
            if all(f"import {name}" != taken for taken, _, _ in steps):
                steps.append((f"import {name}", functools.partial(importlib.import_module,
                                                                   name), by))
        if by == "s3":
            steps.append(("the S3 model", warm_up, by))
    return steps
