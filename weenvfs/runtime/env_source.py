"""What a resolved environment is to a sandbox (`EnvSource`): where to mount it from and how to
run it. A module of its own, light to import, so that a process can ask the node service for
a resolution (node_resolve.py) before it loads the sandbox's modules (environment.py).

Must not: import the rest of the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    @classmethod
    def from_manifest(cls, ref: str, digest: str, store_url: str, cache_dir: Path,
                      manifest: Any, record_tag: str | None = None,
                      publish_later: bool = False) -> EnvSource:
        """Environment `digest` (its verified format.manifest.Manifest: the runtime does not
        import the format) as `ref` in the store at `store_url`."""
        config = manifest.config
        return cls(ref, digest, store_url, cache_dir, tuple(config.env), config.cwd,
                   config.user, (*config.entrypoint, *config.cmd),
                   tuple(g.index for g in manifest.groups), record_tag, publish_later,
                   tuple(config.entrypoint))

    def run_argv(self, args: Sequence[str], entrypoint: str | None = None) -> list[str]:
        """What `weenv run` runs, as `docker run`: the entrypoint followed by `args`, or by
        the environment's cmd when there are none; `entrypoint` given (`--entrypoint`)
        replaces the environment's ("": none) and its cmd."""
        if entrypoint is not None:
            return [entrypoint, *args] if entrypoint else list(args)
        if args:
            return [*self.entrypoint, *args]
        return list(self.command)
