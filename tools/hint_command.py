"""`--hint-command CMD` of `weenv compose` and `weenv convert`: record a prefetch hint at
publish time, as `ctr-remote image optimize` does.

Owns: the argument, and running `weenv run --record-hint --store URL DIGEST /bin/sh -c CMD`
in a subprocess once the environment is published: CMD runs in a sandbox of the new
environment, its reads are recorded and merged into the environment's hint `latest`, and
`weenv run` says so in one line on stderr. CMD's output goes to stderr, so that stdout stays
the command's own result (a digest, or JSON).

Must not: import the runtime (tools sit below it: the sandbox is reached through the `weenv`
command, never imported), or record anything itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from weenvfs.errors import RefNotFound, UsageError, WeenvError
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

log = logging.getLogger(__name__)


def add_hint_command_argument(p: argparse.ArgumentParser) -> None:
    """Add `--hint-command CMD` and `--hint-cache DIR`."""
    p.add_argument("--hint-command", metavar="CMD",
                   help="after publishing, run CMD (with /bin/sh -c) in a sandbox of the new "
                   "environment and publish what it read as the environment's prefetch hint "
                   "(needs root, like `weenv run`)")
    p.add_argument("--hint-cache", type=Path, metavar="DIR",
                   help="the node chunk cache the --hint-command sandbox uses (default: as "
                   "`weenv run`)")


def check_hint_command(args: argparse.Namespace) -> None:
    """Fail before anything is published when --hint-command cannot run here."""
    if args.hint_command is not None and os.geteuid() != 0:
        raise UsageError("--hint-command runs CMD in a sandbox: run as root")
    if args.hint_command is not None and not args.hint_command.strip():
        raise UsageError("--hint-command: empty command")


def record_hint(store: str, digest: str, command: str, cache: Path | None) -> None:
    """Run `command` in a sandbox of environment `digest` of `store`, recording its hint;
    WeenvError if no hint was published."""
    is_url = "://" in store or store[:5].lower() == "file:"  # as weenvfs.fuse.config.is_url
    url = store if is_url else os.path.abspath(store)
    argv = [sys.executable, "-m", "weenvfs", "run", "--record-hint", "--store", url,
            *(["--cache", str(cache.absolute())] if cache is not None else []),
            digest, "/bin/sh", "-c", command]
    log.info("recording a hint with %s", argv)
    done = subprocess.run(argv, stdout=sys.stderr.fileno(), check=False)
    if done.returncode:
        log.warning("--hint-command exited with status %d; what it read is recorded anyway",
                    done.returncode)
    with open_store(url) as opened:
        try:
            Repository(opened).get_tag("hints", digest, "latest")
        except RefNotFound:
            raise WeenvError("--hint-command: no hint was published (see the lines "
                             "above)") from None
