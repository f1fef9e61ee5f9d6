"""start_weight.py's pure parts: where a weight can be asked for, and writing it back. The
weights a real sandbox gets are checked in test_sandbox.py and test_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from weenvfs.errors import WeenvError
from weenvfs.runtime import start_weight
from weenvfs.runtime.launcher import CgroupSpec

V1_CPU = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n"
V1_MEMORY = "cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,memory 0 0\n"


def _mounts(tmp_path: Path, text: str) -> str:
    path = tmp_path / "mounts"
    path.write_text("proc /proc proc rw 0 0\n" + text)
    return str(path)


def test_a_v1_cpu_hierarchy_gets_the_highest_shares_beside_the_limits(tmp_path: Path) -> None:
    spec = CgroupSpec("/weenv/a", {"cpu": {"quota": 50000, "period": 100000},
                                   "pids": {"limit": 9}})
    out = start_weight.boosted(spec, _mounts(tmp_path, V1_MEMORY + V1_CPU))
    assert out.resources == {"cpu": {"quota": 50000, "period": 100000, "shares": 262144},
                             "pids": {"limit": 9}}
    assert spec.resources["cpu"] == {"quota": 50000, "period": 100000}  # not changed
    assert out.path == "/weenv/a"


def test_no_weight_is_asked_for_without_a_cpu_controller(tmp_path: Path) -> None:
    spec = CgroupSpec("/weenv/a", {})
    assert start_weight.boosted(spec, _mounts(tmp_path, V1_MEMORY)) is spec


def test_shares_the_hook_set_are_kept(tmp_path: Path) -> None:
    spec = CgroupSpec("/weenv/a", {"cpu": {"shares": 512}})
    assert start_weight.boosted(spec, _mounts(tmp_path, V1_CPU)) is spec


def test_v2_only_where_the_weenv_cgroup_hands_cpu_on(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    (root / "weenv").mkdir(parents=True)
    mounts = _mounts(tmp_path, f"cgroup2 {root} cgroup2 rw,nosuid 0 0\n")
    assert not start_weight.can_weigh(mounts, root)  # no subtree_control yet: first sandbox
    (root / "weenv" / "cgroup.subtree_control").write_text("memory pids\n")
    assert not start_weight.can_weigh(mounts, root)
    (root / "weenv" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    assert start_weight.can_weigh(mounts, root)
    # A cgroup2 mount elsewhere (a hybrid node's /sys/fs/cgroup/unified) is not where the
    # runtime puts a sandbox's controllers.
    assert not start_weight.can_weigh(
        _mounts(tmp_path, f"cgroup2 {tmp_path} cgroup2 rw 0 0\n"), root)


def test_settle_writes_the_default_in_the_file_the_hierarchy_has(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    (v1 / "cpu.shares").write_text("262144\n")
    (v2 / "cpu.weight").write_text("10000\n")
    monkeypatch.setattr(start_weight, "cgroup_dirs", lambda path: [v1, v2, tmp_path / "gone"])
    start_weight.settle("/weenv/a")
    assert (v1 / "cpu.shares").read_text() == "1024\n"
    assert (v2 / "cpu.weight").read_text() == "100\n"
    assert sorted(p.name for p in v1.iterdir()) == ["cpu.shares"]  # nothing made


def test_a_weight_that_cannot_be_written_back_fails_the_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cpu.shares").mkdir()  # a write fails as a cgroup file refusing it would
    monkeypatch.setattr(start_weight, "cgroup_dirs", lambda path: [tmp_path])
    with pytest.raises(WeenvError, match="could not set the CPU weight of cgroup /weenv/a"):
        start_weight.settle("/weenv/a")
