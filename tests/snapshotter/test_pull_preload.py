"""What the node service imports ahead for `weenv pull` (cli.PULL_MODULES): a pull runs in a
child forked from the service, so whatever the child still imports is paid by every pull."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import importlib, json, os, sys, threading
    from weenvfs import cli
    for name in cli.PULL_MODULES:
        importlib.import_module(name)
    threads = (threading.active_count(), len(os.listdir("/proc/self/task")))
    before = set(sys.modules)
    import grpc
    grpc.insecure_channel("unix:/nonexistent/weenv-test.sock").close()
    late = sorted(n for n in set(sys.modules) - before if n.split(".")[0] == "grpc")
    print(json.dumps({"threads": threads, "late": late}))
""")


def test_the_pull_modules_leave_nothing_of_grpc_to_import_and_start_no_thread() -> None:
    # grpc imports its channel module at the first channel (~8 ms of a pull's child); and the
    # service forks after importing these, so they must start no thread.
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          check=True, timeout=60)
    found = json.loads(done.stdout)
    assert found["late"] == []
    assert found["threads"] == [1, 1]
