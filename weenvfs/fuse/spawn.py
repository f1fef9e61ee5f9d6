"""Starting a mount daemon: `spawn`, through the node's mount server when one answers, else
with `setsid --fork`.

Owns only that choice. It lives apart from daemon.py (which starts a daemon either way and
waits for it) and mountd.py (the server, itself started by daemon.py), so that imports point
one way: mountd -> daemon; this module -> both.
Must not: start processes or talk to the server itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from . import daemon, mountd


def spawn(args: Sequence[str], log_file: Path, timeout: float = daemon.SPAWN_TIMEOUT,
          use_server: bool = True) -> int:
    """Start `python -m weenvfs <args> --ready-fd N` as a daemon; return its pid once ready.

    The node's mount server (mountd.py) forks the daemon from its warm interpreter when it
    can; when none answers, it is started first (`mountd.start_server`: root, or the user's
    own socket; WEENV_MOUNTD=off opts out); otherwise, or with `use_server` False (how the
    server itself starts), `setsid --fork` starts a new interpreter (`daemon.start`, which
    raises WeenvError with the daemon's own error line, or naming the log file).
    """
    return daemon.start(args, log_file, timeout, mountd.launch if use_server else None)
