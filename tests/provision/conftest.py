"""Fixtures of the provisioner tests (helpers in provision_support.py).

- `v1` / `v1_cgroups`: the machine's real cgroup v1 hierarchy (skips with a reason, or fails
  under WEENVFS_TEST_STRICT=1, when it is not writable); every cgroup a test makes is removed
  in teardown, after the processes the test started in it are killed.
- `v2_folder`: a cgroup2-shaped folder under tmp_path.
- `sidecar_config`: SidecarConfig with a private spool, event log and history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from provision_support import V1Cgroups, V2Folder, v1_unavailable_reason

from weenvfs.provision.cgroup_driver import read_mounts
from weenvfs.provision.cgroup_v1 import CgroupV1Driver
from weenvfs.provision.sidecar import SidecarConfig


@pytest.fixture
def v1(require_or_skip: Callable[[object, str], None]) -> CgroupV1Driver:
    """The machine's real cgroup v1 driver."""
    reason = v1_unavailable_reason()
    require_or_skip(reason is None, f"cgroup v1 unusable: {reason}")
    return CgroupV1Driver(read_mounts().v1)


@pytest.fixture
def v1_cgroups(v1: CgroupV1Driver) -> Iterator[V1Cgroups]:
    """A factory of real v1 sandbox cgroups, all removed (processes killed) afterwards."""
    cgroups = V1Cgroups(v1)
    try:
        yield cgroups
    finally:
        cgroups.cleanup()


@pytest.fixture
def v2_folder(tmp_path: Path) -> V2Folder:
    """A cgroup2-shaped folder under tmp_path."""
    root = tmp_path / "cgroup2"
    root.mkdir()
    return V2Folder(root)


@pytest.fixture
def sidecar_config(tmp_path: Path) -> Callable[..., SidecarConfig]:
    """SidecarConfig factory with a private spool, event log and history under tmp_path."""

    def make(**overrides: Any) -> SidecarConfig:
        values: dict[str, Any] = {
            "spool": tmp_path / "spool",
            "interval": 0.05,
            "node_memory": 8 << 30,
            "node_cpus": 2.0,
            "event_log": tmp_path / "events.jsonl",
            "history_dir": tmp_path / "history",
        }
        values.update(overrides)
        return SidecarConfig(**values)

    return make
