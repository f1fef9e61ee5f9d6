"""`wait_for`: poll a condition until it holds, for tests that wait on real processes
(sidecars, cgroups, sandboxes). A limit that is reached fails the test as a hang, never as
a timing assertion."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0) -> Any:
    """Poll `condition` until it returns something truthy (returned); fail after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)
