"""What the node service prepares for its next children after answering a request
(fuse/mountd.py): the store client of the request's store (`prebuild_clients`) and the
manifest and indexes of the environment it names (`preload_envs`), which the children it
forks next take over instead of making or loading their own. Both are optimisations: a
failure is logged, never the server's.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any

from .service_forks import argv_env

log = logging.getLogger(__name__)


def prebuild_clients(request: dict[str, Any]) -> bool:
    """After answering: make the store client of the request's `--store` URL for the next
    children that open it (store.prebuild_client: about 20 ms each of them saves; a mount,
    its replay and the resolution before it open the same store one after the other).
    Whether it made one."""
    from weenvfs.store import prebuild_client

    argv, env = argv_env(request)
    value = option_value(argv, "--store")
    if value is None:
        return False
    try:
        if prebuild_client(value, env):
            log.info("made the client of %s ahead for the next requests", value)
            return True
    except Exception as error:  # an optimisation: never the server's failure
        log.warning("cannot make a client of %s ahead: %s", value, error)
    return False


def preload_envs(request: dict[str, Any]) -> bool:
    """After answering: keep the manifest and indexes of the environment a request names in
    memory for the next children (core/node_copies.py `preload_env`: the mounts and replays
    of environments on the same groups then load none of them). The environment is any
    argument that is a manifest digest with a node copy in the request's `--cache` folder,
    or a reference the last mount of the request's `--store` resolved to one (`weenv mount
    NAME:TAG`: node_copies.py `last_resolved`). Whether it kept any."""
    from weenvfs.core.node_copies import last_resolved, preload_env

    argv, _ = argv_env(request)
    cache = option_value(argv, "--cache")
    if cache is None or not os.path.isabs(cache):
        return False
    store = option_value(argv, "--store")
    loaded = 0
    try:
        for argument in dict.fromkeys(argv):
            noted = None if store is None else last_resolved(Path(cache), store, argument)
            loaded += preload_env(Path(cache), noted or argument)
    except Exception as error:  # an optimisation: never the server's failure
        log.warning("cannot keep the indexes of a request in memory: %s", error)
    if loaded:
        gc.freeze()  # as at the start: the children's collections never copy them
        log.info("kept %d manifest(s) and index(es) of %s in memory for the next requests",
                 loaded, cache)
    return bool(loaded)


def option_value(argv: list[str], flag: str) -> str | None:
    """The value of the first `flag` in `argv`: weenv's own (its options come first; a
    `weenv run`'s sandbox command after them may name anything)."""
    return next((v for f, v in zip(argv, argv[1:], strict=False) if f == flag), None)
