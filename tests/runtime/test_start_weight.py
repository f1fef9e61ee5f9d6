"""start_weight.py's pure parts: where a weight can be asked for, and writing it back. The
weights a real sandbox gets are checked in test_sandbox.py and test_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from weenvfs.errors import WeenvError
from weenvfs.runtime import start_weight
from weenvfs.runtime.launcher import CgroupSpec
from weenvfs.runtime.start_weight import Boost

V1_CPU = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n"
V1_MEMORY = "cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,memory 0 0\n"


def _mounts(tmp_path: Path, text: str) -> str:
    path = tmp_path / "mounts"
    path.write_text("proc /proc proc rw 0 0\n" + text)
    return str(path)


def test_a_v1_cpu_hierarchy_gets_the_highest_shares_beside_the_limits(tmp_path: Path) -> None:
    spec = CgroupSpec("/weenv/a", {"cpu": {"quota": 50000, "period": 100000},
                                   "pids": {"limit": 9}})
    out = start_weight.boost(spec, _mounts(tmp_path, V1_MEMORY + V1_CPU))
    assert out is not None
    assert out.spec.resources == {"cpu": {"quota": 50000, "period": 100000, "shares": 262144},
                                  "pids": {"limit": 9}}
    assert spec.resources["cpu"] == {"quota": 50000, "period": 100000}  # not changed
    assert out.spec.path == "/weenv/a"
    # The default goes back into the cpu hierarchy's file of that cgroup, and nowhere else.
    assert out.weight_file == Path("/sys/fs/cgroup/cpu,cpuacct/weenv/a/cpu.shares")
    assert out.default == 1024


def test_no_weight_is_asked_for_without_a_cpu_controller(tmp_path: Path) -> None:
    spec = CgroupSpec("/weenv/a", {})
    assert start_weight.boost(spec, _mounts(tmp_path, V1_MEMORY)) is None


def test_shares_the_hook_set_are_kept(tmp_path: Path) -> None:
    spec = CgroupSpec("/weenv/a", {"cpu": {"shares": 512}})
    assert start_weight.boost(spec, _mounts(tmp_path, V1_CPU)) is None


def test_v2_only_where_the_weenv_cgroup_hands_cpu_on(tmp_path: Path) -> None:
    spec = CgroupSpec("/weenv/a", {})
    root = tmp_path / "unified"
    (root / "weenv").mkdir(parents=True)
    mounts = _mounts(tmp_path, f"cgroup2 {root} cgroup2 rw,nosuid 0 0\n")
    assert start_weight.boost(spec, mounts, root) is None  # no subtree_control: first sandbox
    (root / "weenv" / "cgroup.subtree_control").write_text("memory pids\n")
    assert start_weight.boost(spec, mounts, root) is None
    (root / "weenv" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    out = start_weight.boost(spec, mounts, root)
    assert out is not None and out.spec.resources == {"cpu": {"shares": 262144}}
    assert (out.weight_file, out.default) == (root / "weenv" / "a" / "cpu.weight", 100)
    # A cgroup2 mount elsewhere (a hybrid node's /sys/fs/cgroup/unified) is not where the
    # runtime puts a sandbox's controllers.
    assert start_weight.boost(
        spec, _mounts(tmp_path, f"cgroup2 {tmp_path} cgroup2 rw 0 0\n"), root) is None


def _boost(weight_file: Path, default: int) -> Boost:
    return Boost(CgroupSpec("/weenv/a", {"cpu": {"shares": 262144}}), weight_file, default)


def test_settle_writes_the_default_in_the_file_the_hierarchy_has(tmp_path: Path) -> None:
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    (v1 / "cpu.shares").write_text("262144\n")
    (v2 / "cpu.weight").write_text("10000\n")
    start_weight.settle(_boost(v1 / "cpu.shares", 1024))
    start_weight.settle(_boost(v2 / "cpu.weight", 100))
    start_weight.settle(_boost(tmp_path / "gone" / "cpu.shares", 1024))  # the init died
    assert (v1 / "cpu.shares").read_text() == "1024\n"
    assert (v2 / "cpu.weight").read_text() == "100\n"
    assert sorted(p.name for p in v1.iterdir()) == ["cpu.shares"]  # nothing made
    assert not (tmp_path / "gone").exists()


def test_a_weight_that_cannot_be_written_back_fails_the_start(tmp_path: Path) -> None:
    (tmp_path / "cpu.shares").mkdir()  # a write fails as a cgroup file refusing it would
    with pytest.raises(WeenvError, match="could not set the CPU weight of cgroup /weenv/a"):
        start_weight.settle(_boost(tmp_path / "cpu.shares", 1024))
