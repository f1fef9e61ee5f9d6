"""Packing the hint a recording mount published, in a process of its own.

Owns: `launch`, which starts `weenv hints pack ENV --tag TAG --if-hint DIGEST` (core/
hint_pack.py) for the hint the mount just published: forked by the node service when one
runs (its imports are loaded), else as a detached child. Packing encodes and uploads the
hinted chunks (tens of MB for the reference workload, about half a second of CPU), which the
run that recorded must not wait for: its `weenv run` ends when the mount's daemon exits. The
command packs only while the tag still points at that hint, so a newer run's hint is never
replaced by an older one's pack. $WEENV_HINT_PACK=off turns it off (the tests do, but for
those of packing itself: a pack moving the tag would race their checks).

Must not: pack anything itself, or wait for the packing process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from weenvfs.core.loaded_env import LoadedEnv
from weenvfs.switches import switched_off

from . import mountd
from .config import MountConfig

log = logging.getLogger(__name__)

SWITCH_ENV = "WEENV_HINT_PACK"  # "off": a recording mount does not pack what it published


def enabled() -> bool:
    """Whether recording mounts pack the hints they publish."""
    return not switched_off(SWITCH_ENV)


def launch(env: LoadedEnv, config: MountConfig, hint_digest: str) -> bool:
    """Start packing the hint `hint_digest` that `config.record_tag` of `env` points at;
    True if a process was started."""
    assert config.record_tag is not None
    if not enabled():
        return False
    argv = [*mountd.log_args(), "hints", "pack", env.digest,
            "--store", env.store.url, "--cache", str(config.cache_dir.absolute()),
            "--tag", config.record_tag, "--if-hint", hint_digest]
    read_fd, write_fd = os.pipe()
    try:
        if mountd.launch(argv, write_fd, 2, start=False):
            log.info("packing hint %s in a process of the node service", hint_digest[:12])
            return True
    except OSError as error:
        log.info("the node service cannot pack the hint: %s", error)
    finally:
        os.close(write_fd)
        os.close(read_fd)
    try:
        subprocess.Popen([sys.executable, "-m", "weenvfs", *argv], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True)
    except OSError as error:
        log.warning("cannot start packing hint %s: %s", hint_digest[:12], error)
        return False
    log.info("packing hint %s in a process of its own", hint_digest[:12])
    return True
