"""WeEnv images under real containerd 1.6: `weenv push` to a real registry, `weenv pull` (labels)
and `ctr images pull` (markers) through `weenv snapshotter`, `ctr run`, removal, restart.

The containerd, registry and snapshotter of the module's `node` fixture (conftest.py) are
shared by the tests, which run in order and each remove what they pulled.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support import trees
from support.containerd import Node

from weenvfs.fuse.commands import read_stats
from weenvfs.runtime import mounts

pytestmark = pytest.mark.usefixtures("containerd_requirements")


def _push(node: Node, env: str, tag: str, *extra: str) -> str:
    ref = f"{node.registry.host}/{env}:{tag}"
    done = node.weenv("push", f"{env}:v1", ref, "--store", str(node.store), "--insecure",
                      "--json", *extra)
    assert json.loads(done.stdout)["manifest"] == node.envs[env]
    return ref


def _remove(node: Node, ref: str) -> None:
    node.ctr("images", "rm", "--sync", ref)
    assert node.snapshots() == []
    assert node.our_mounts() == []
    assert list((node.snap_root / "snapshots").iterdir()) == []


def _group_mounts(node: Node) -> dict[int, Path]:
    """position -> mount point of this module's mounted group mounts."""
    out = {}
    for m in mounts.list_mounts():
        if m.mounted and m.layer is not None and any(
                h.startswith("snapshotter-") for h in m.holders):
            out[m.layer] = m.mountpoint
    return out


def test_pull_run_export_equal_and_removal_leaves_nothing(node: Node, tmp_path: Path) -> None:
    ref = _push(node, "two", "a")
    done = node.weenv("pull", ref, "--insecure", "--containerd-socket", str(node.socket),
                      "--json")
    result = json.loads(done.stdout)
    assert result["weenv_layers"] == [0, 1]  # both prepared through their labels
    assert len(node.snapshots()) == 2
    # The image's config came through: cwd, env, cmd of the environment.
    run = node.ctr("run", "--rm", "--snapshotter", "weenv", ref, "t-two")
    assert run.stdout.strip() == "1000"
    run = node.ctr("run", "--rm", "--snapshotter", "weenv", ref, "t-two-env", "/bin/sh", "-c",
                   "echo $TASK; pwd; cat /etc/motd")
    assert run.stdout.split("\n")[:3] == ["1", "/work", "a task environment"]
    # Only what was read was fetched: a shell and a few files, not the 100 MiB group.
    stats = {pos: read_stats(mp) for pos, mp in _group_mounts(node).items()}
    assert set(stats) == {0, 1}
    fetched = sum(s["fetch"]["bytes_fetched"] for s in stats.values())
    assert 0 < fetched < 20 << 20, stats
    # The root file system is the environment's, metadata and all: a view of the image's
    # chain through containerd, mounted as containerd would mount it.
    view = tmp_path / "view"
    view.mkdir()
    snaps = ["snapshots", "--snapshotter", "weenv"]
    node.ctr(*snaps, "view", "--mounts", "v-two", result["chain_ids"][-1])
    command = node.ctr(*snaps, "mounts", str(view), "v-two").stdout.split()
    subprocess.run(command, check=True)
    try:
        node.weenv("export", "two:v1", str(tmp_path / "export"), "--store", str(node.store))
        trees.assert_trees_equal(tmp_path / "export", view, ignore=["root"])
    finally:
        subprocess.run(["umount", str(view)], check=True)
        node.ctr(*snaps, "rm", "v-two", check=False)  # gone already when ctr's lease ended
    _remove(node, ref)


def test_ctr_pull_reads_the_markers(node: Node) -> None:
    ref = _push(node, "one", "b")
    node.ctr("images", "pull", "--plain-http", "--snapshotter", "weenv", ref)
    log = (node.tmp / "snapshotter.log").read_text()
    assert "committed as" in log and "(from its marker)" in log
    run = node.ctr("run", "--rm", "--snapshotter", "weenv", ref, "t-one", "/bin/ls", "/")
    assert "bin" in run.stdout.split()
    assert ".weenv" not in run.stdout.split()
    _remove(node, ref)


def test_restart_with_a_container_running(node: Node) -> None:
    ref = _push(node, "two", "c")
    node.weenv("pull", ref, "--insecure", "--containerd-socket", str(node.socket))
    node.ctr("run", "-d", "--snapshotter", "weenv", ref, "t-long", "/bin/sleep", "600")
    try:
        node.stop_snapshotter()
        node.start_snapshotter()
        # The running container keeps reading its files; a new one starts.
        done = node.ctr("tasks", "exec", "--exec-id", "e1", "t-long", "/bin/cat", "/etc/motd")
        assert done.stdout == "a task environment\n"
        run = node.ctr("run", "--rm", "--snapshotter", "weenv", ref, "t-next", "/bin/true")
        assert run.returncode == 0
        assert "2 WeEnv mounts restored" in (node.tmp / "snapshotter.log").read_text()
    finally:
        node.ctr("tasks", "kill", "-s", "SIGKILL", "t-long", check=False)
        _wait_task_gone(node, "t-long")
        node.ctr("containers", "rm", "t-long", check=False)
    _remove(node, ref)


def _wait_task_gone(node: Node, name: str) -> None:
    for _ in range(200):
        if node.ctr("tasks", "rm", "-f", name, check=False).returncode == 0:
            return
        if name not in node.ctr("tasks", "ls").stdout:
            return
        subprocess.run(["sleep", "0.05"], check=True)


def test_a_store_the_snapshotter_does_not_serve_is_refused(node: Node, tmp_path: Path) -> None:
    ref = _push(node, "one", "d", "--store-url", "http://192.0.2.1/elsewhere")
    done = node.weenv("pull", ref, "--insecure", "--containerd-socket", str(node.socket),
                      check=False)
    assert done.returncode == 1
    assert "which this snapshotter does not serve" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = node.ctr("images", "pull", "--plain-http", "--snapshotter", "weenv", ref,
                    check=False)
    assert done.returncode != 0
    assert "does not serve" in done.stderr
    node.ctr("images", "rm", "--sync", ref, check=False)
    assert node.our_mounts() == []
