"""`wait_for`: poll a condition until it holds, for tests that wait on real processes
(sidecars, cgroups, sandboxes); `read_or_error`: read a file that may hang. A limit that is
reached fails the test as a hang, never as a timing assertion."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0, *,
             not_yet: tuple[type[BaseException], ...] = (), interval: float = 0.02) -> Any:
    """Poll `condition` until it returns something truthy (returned); fail after `timeout`
    seconds. An exception of a type in `not_yet` counts as "not yet" (a server starting)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = condition()
        except not_yet as error:
            value, last = None, error
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f" (last error: {last})" if last is not None else ""
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}{detail}")
        time.sleep(interval)


def read_or_error(path: Path, guard: float) -> bytes | OSError:
    """The file's bytes, or the OSError reading it raised; fails the test if the read is
    still running after `guard` seconds (left in a daemon thread: a test's teardown, which
    stops the mount, frees it)."""
    outcome: list[bytes | OSError] = []

    def run() -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                outcome.append(f.read())
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(guard)
    if not outcome:
        pytest.fail(f"reading {path} hung (still running after {guard:g} s)")
    return outcome[0]
