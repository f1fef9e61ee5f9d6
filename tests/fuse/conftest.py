"""Fixtures for real mounts (helpers in mounts.py).

`mounter`: mount with `mounter.mount(...)`; in teardown everything is unmounted
(`fusermount3 -u -z`), the daemons the test started are stopped, and unexpected WARNING/ERROR
lines in their logs fail the test.

`both_paths`: runs a test once per data path, `kernel` (EROFS images over lazily served data
devices) and `fuse` (the tree over FUSE), by setting `mounter.path`; a module opts in with
`pytestmark = pytest.mark.usefixtures("both_paths")`. The kernel run needs root and EROFS
(a skip that CI turns into a failure).

`native_server`: the kernel path with the installed native device server (root, EROFS,
`weenv-devserve`; skips that CI turns into failures); a module opts in as for `both_paths`.
`varied_env`: a folder store with environment env:t of varied files (tests/fuse/hint_mounts.py).

`holders`: processes in mount namespaces of their own (support/namespaces.py), ended after
the test.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hint_mounts import publish_varied_env
from mounts import Mounter
from support.namespaces import holders  # noqa: F401  (pytest finds fixtures by name)


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


@pytest.fixture(params=["kernel", "fuse"])
def both_paths(request: pytest.FixtureRequest, mounter: Mounter,
               require_or_skip: Callable[[object, str], None]) -> str:
    """The data path this run of the test mounts with (see the module docstring)."""
    if request.param == "kernel":
        require_or_skip(os.geteuid() == 0, "the kernel path needs root")
        filesystems = Path("/proc/filesystems").read_text()
        require_or_skip("erofs" in filesystems, "the kernel has no EROFS")
    mounter.path = request.param
    return str(request.param)


@pytest.fixture
def native_server(require_or_skip: Callable[[object, str], None]) -> None:
    """Skip (a failure in CI) unless the kernel path can run with the native device server."""
    from weenvfs.fuse.native_devices import HELPER, choose_server

    require_or_skip(os.geteuid() == 0, "the kernel path needs root")
    require_or_skip("erofs" in Path("/proc/filesystems").read_text(), "the kernel has no EROFS")
    require_or_skip(choose_server()[0] is not None,
                    f"{HELPER} is not installed (scripts/setup.sh builds it)")


@pytest.fixture
def varied_env(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Environment env:t of varied files in a folder store: 80 small ones batched in 64 KiB
    chunks, 6 of six chunks each (tests/fuse/hint_mounts.py); the store and the contents."""
    return publish_varied_env(tmp_path)
