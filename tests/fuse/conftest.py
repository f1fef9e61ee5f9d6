"""Fixtures for real mounts (helpers in mounts.py).

`mounter`: mount with `mounter.mount(...)`; in teardown everything is unmounted
(`fusermount3 -u -z`), the daemons the test started are stopped, and unexpected WARNING/ERROR
lines in their logs fail the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mounts import Mounter


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator[Mounter]:
    """Mount with `mounter.mount(...)`; everything is unmounted and stopped afterwards."""
    m = Mounter(tmp_path)
    problems: list[str] = []
    try:
        yield m
    finally:
        problems = m.close()
    if problems:
        pytest.fail("unexpected daemon log lines:\n" + "\n".join(problems), pytrace=False)
