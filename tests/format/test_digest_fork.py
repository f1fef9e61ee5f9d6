"""Hashing in a process that forks (format/digest.py `fork_server`).

blake3 hashes a large object on a thread pool it makes at the first such hash; a child forked
after that inherits the pool without its threads and waits forever at its own first threaded
hash. The node service forks every mount daemon and hashes the indexes it keeps for them
(core/node_copies.py `preload_env`), so it hashes on one thread, and its children on many.

Real processes: a fresh interpreter (the test process's own blake3 pool must not decide the
outcome), a real fork. Without `fork_server` this case waits forever (the timeout fails it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

CASE = """
import os, sys
from weenvfs.format import digest
digest.fork_server()
data = bytes(4 << 20)  # above the size that hashes on threads
expected = digest.digest_hex(data)
pid = os.fork()
if pid == 0:
    os._exit(0 if digest.digest_hex(data) == expected else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_fork_server_s_children_hash_large_objects() -> None:
    case = subprocess.Popen([sys.executable, "-c", CASE], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = case.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(case.pid, signal.SIGKILL)  # the hung child too
        case.wait()
        pytest.fail("the forked child never finished its hash")
    assert case.returncode == 0, stderr

