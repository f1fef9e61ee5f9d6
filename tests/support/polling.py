"""`wait_for`: poll a condition until it holds, for tests that wait on real processes
(sidecars, cgroups, sandboxes). A limit that is reached fails the test as a hang, never as
a timing assertion."""

from __future__ import annotations

import time
from collections.abc import Callable
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
