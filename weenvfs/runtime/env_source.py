"""What a resolved environment is to a sandbox (`EnvSource`): where to mount it from and how to
run it. A module of its own, light to import, so that a process can ask the node service for
a resolution (node_resolve.py) before it loads the sandbox's modules (environment.py).

Must not: import the rest of the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvSource:
    """A resolved environment: where to mount it from and how to run it."""

    ref: str
    digest: str
    store_url: str
    cache_dir: Path
    env: tuple[str, ...] = ()  # the manifest's runtime config, as in format/manifest.py
    cwd: str = "/"
    user: str = ""
    command: tuple[str, ...] = ()  # entrypoint + cmd
    groups: tuple[str, ...] = ()  # the groups' index digests, lowest first
    # The hint tag it records into through a recording mount (recording.py); None: none.
    record_tag: str | None = None
    # A recording by default, which the node service may publish after the run ends (no
    # caller reads the hint next; an explicit recording is published before `destroy` returns).
    publish_later: bool = False
    entrypoint: tuple[str, ...] = ()  # the leading part of `command`

    def run_argv(self, args: Sequence[str], entrypoint: str | None = None) -> list[str]:
        """What `weenv run` runs, as `docker run`: the entrypoint followed by `args`, or by
        the environment's cmd when there are none; `entrypoint` given (`--entrypoint`)
        replaces the environment's ("": none) and its cmd."""
        if entrypoint is not None:
            return [entrypoint, *args] if entrypoint else list(args)
        if args:
            return [*self.entrypoint, *args]
        return list(self.command)
