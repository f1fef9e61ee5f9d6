"""WeEnv images under real containerd 1.6: `weenv push` to a real registry, `weenv pull` (labels)
and `ctr images pull` (markers) through `weenv snapshotter`, `ctr run`, removal, restart.

The containerd, registry and snapshotter of the module's `node` fixture (conftest.py) are
shared by the tests, which run in order and each remove what they pulled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import trees
from support.containerd import Node

from weenvfs.fuse.commands import read_stats
from weenvfs.runtime import mounts
from weenvfs.snapshotter.pull import Containerd

pytestmark = pytest.mark.usefixtures("containerd_requirements")


def _group_mounts(node: Node) -> dict[int, Path]:
    """position -> mount point of this module's mounted group mounts."""
    out = {}
    for m in mounts.list_mounts():
        if m.mounted and m.layer is not None and any(
                h.startswith("snapshotter-") for h in m.holders):
            out[m.layer] = m.mountpoint
    return out


def test_pull_run_export_equal_and_removal_leaves_nothing(node: Node, tmp_path: Path) -> None:
    ref = node.push("two", "a")
    done = node.pull(ref, "--json")
    result = json.loads(done.stdout)
    assert result["weenv_layers"] == [0, 1]  # both prepared through their labels
    assert result["recorded_by"] == "weenv"  # no ordinary layer: no `ctr images pull`
    assert len(node.snapshots()) == 2
    # The image's config came through: its command checks cwd and env.
    assert node.run(ref, "t-two") == 0
    assert node.run(ref, "t-two-no", "/bin/sh", "-c", 'test "$TASK" = 2') == 1
    assert node.run(ref, "t-two-motd", "/bin/sh", "-c",
                'test "$(cat /etc/motd)" = "a task environment"') == 0
    # Only what was read was fetched: a shell and a few files, not the 100 MiB group.
    stats = {pos: read_stats(mp) for pos, mp in _group_mounts(node).items()}
    assert set(stats) == {0, 1}
    fetched = sum(s["fetch"]["bytes_fetched"] for s in stats.values())
    assert 0 < fetched < 20 << 20, stats
    # The root file system is the environment's, metadata and all: a view of the image's
    # chain through containerd, mounted as containerd would mount it.
    # (`ctr images mount` of containerd 1.6 ignores --snapshotter; a view under our own
    # lease, so that containerd's garbage collector leaves it while we look.)
    view = tmp_path / "view"
    view.mkdir()
    containerd = Containerd(node.socket, "default", "weenv", plain_http=True)
    containerd.lease = containerd.create_lease()
    try:
        answer = containerd.call("View", key="v-two", parent=result["chain_ids"][-1])
        [mount] = answer.mounts  # type: ignore[attr-defined]
        subprocess.run(["mount", "-t", mount.type, mount.source, str(view), "-o",
                        ",".join(mount.options)], check=True)
        try:
            node.weenv("export", "two:v1", str(tmp_path / "export"), "--store",
                       str(node.store))
            trees.assert_trees_equal(tmp_path / "export", view, ignore=["root"])
        finally:
            subprocess.run(["umount", str(view)], check=True)
            containerd.call("Remove", key="v-two")
    finally:
        containerd.delete_lease(containerd.lease, sync=False)
        containerd.close()
    node.remove_image(ref)


def test_ctr_pull_reads_the_markers(node: Node) -> None:
    ref = node.push("one", "b")
    node.ctr("images", "pull", "--plain-http", "--snapshotter", "weenv", ref)
    log = (node.tmp / "snapshotter.log").read_text()
    assert "committed as" in log and "(from its marker)" in log
    assert node.run(ref, "t-one", "/bin/sh", "-c", "test -x /bin/ls && test ! -e /.weenv") == 0
    node.remove_image(ref)


def _content_labels(node: Node, namespace: str) -> dict[str, dict[str, str]]:
    """digest -> labels of the content store of `namespace` (`ctr content ls`)."""
    out = {}
    for line in node.ctr("-n", namespace, "content", "ls").stdout.splitlines()[1:]:
        digest, *_, labels = line.split("\t")
        out[digest] = dict(kv.split("=", 1) for kv in labels.split(",") if "=" in kv)
    return out


def test_the_direct_record_is_what_ctr_images_pull_writes(node: Node) -> None:
    """An image of WeEnv layers only is recorded by `weenv pull` itself (image_record.py):
    its image record, manifest and config, with their labels, as `ctr images pull` of the
    same image leaves them (here through the markers, in another namespace); only the layer
    blobs, whose snapshots are present, are not fetched. A second pull (the content there
    already) keeps the record as it is."""
    ref = node.push("two", "rec")
    result = json.loads(node.pull(ref, "--json").stdout)
    assert result["recorded_by"] == "weenv" and result["weenv_layers"] == [0, 1]
    node.ctr("-n", "other", "images", "pull", "--plain-http", "--snapshotter", "weenv", ref)
    try:
        images = {ns: [line.split()[:3] for line in node.ctr(
            "-n", ns, "images", "ls").stdout.splitlines()[1:]] for ns in ("default", "other")}
        assert images["default"] == images["other"] == [[ref, images["other"][0][1],
                                                          images["other"][0][2]]]
        ours, ctrs = _content_labels(node, "default"), _content_labels(node, "other")
        manifest = images["other"][0][2]
        config = ctrs[manifest]["containerd.io/gc.ref.content.config"]
        for digest in (manifest, config):
            assert ours[digest] == ctrs[digest], digest
        layers = {v for k, v in ctrs[manifest].items() if ".content.l." in k}
        assert len(layers) == 2 and not layers & set(ours)
        assert set(ctrs) == {manifest, config} | layers
        again = json.loads(node.pull(ref, "--json").stdout)
        assert again["present"] == [0, 1] and again["recorded_by"] == "weenv"
        assert _content_labels(node, "default") == ours
        assert node.run(ref, "t-rec", "/bin/sh", "-c", "test -s /work/task.txt") == 0
    finally:
        node.ctr("-n", "other", "images", "rm", "--sync", ref, check=False)
    node.remove_image(ref)


def test_restart_with_a_container_running(node: Node) -> None:
    ref = node.push("two", "c")
    node.pull(ref)
    node.ctr("run", "-d", "--snapshotter", "weenv", ref, "t-long", "/bin/sleep", "600")
    try:
        node.stop_snapshotter()
        node.start_snapshotter()
        _wait_reconnected(node)
        # The running container keeps reading its files; a new one starts.
        done = node.ctr("tasks", "exec", "--exec-id", "e1", "t-long", "/bin/sh", "-c",
                        'test "$(cat /etc/motd)" = "a task environment"', check=False)
        assert done.returncode == 0
        assert node.run(ref, "t-next", "/bin/sh", "-c", "test -s /work/task.txt") == 0
        assert "2 WeEnv mounts restored" in (node.tmp / "snapshotter.log").read_text()
    finally:
        node.ctr("tasks", "kill", "-s", "SIGKILL", "t-long", check=False)
        _wait_task_gone(node, "t-long")
        node.ctr("containers", "rm", "t-long", check=False)
    node.remove_image(ref)


def _wait_reconnected(node: Node) -> None:
    """Until containerd dials the restarted snapshotter again: its proxy plugin backs off up
    to 3 s between attempts and fails calls with `unavailable` meanwhile."""
    for _ in range(300):
        if node.ctr("snapshots", "--snapshotter", "weenv", "ls", check=False).returncode == 0:
            return
        subprocess.run(["sleep", "0.05"], check=True)
    raise AssertionError("containerd did not reconnect to the snapshotter")


def _wait_task_gone(node: Node, name: str) -> None:
    for _ in range(200):
        if node.ctr("tasks", "rm", "-f", name, check=False).returncode == 0:
            return
        if name not in node.ctr("tasks", "ls").stdout:
            return
        subprocess.run(["sleep", "0.05"], check=True)


def test_pull_is_carried_out_by_the_node_service(node: Node, tmp_path: Path) -> None:
    """`weenv pull` is handed to the node service (entry.HAND_OVER, weenvfs/hand_over.py),
    whose process has grpc: it works from a process that cannot even import grpc, with that
    process's output and exit status; switched off (WEENV_NODE_RUN=off), that process runs
    it itself, and here cannot."""
    no_grpc = tmp_path / "no-grpc"
    no_grpc.mkdir()
    (no_grpc / "grpc.py").write_text("raise ImportError('grpc cannot be imported here')\n")
    ref = node.push("one", "handed")
    argv = [sys.executable, "-m", "weenvfs", "pull", ref, "--insecure", "--containerd-socket",
            str(node.socket), "--json"]
    env = {**os.environ, "PYTHONPATH": str(no_grpc)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["weenv_layers"] == [0]
    node.ctr("images", "rm", "--sync", ref)
    off = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False,
                         env={**env, "WEENV_NODE_RUN": "off"})
    assert off.returncode != 0
    assert "grpc cannot be imported here" in off.stderr
    assert node.snapshots() == []
    bad = subprocess.run([*argv[:-1], "--no-such-option"], capture_output=True, text=True,
                         env=env, timeout=300, check=False)
    assert bad.returncode == 2
    assert "unrecognized arguments: --no-such-option" in bad.stderr


def test_the_native_launcher_hands_a_pull_to_the_node_service(
        node: Node, launcher: Path) -> None:
    """`weenv pull` through the `weenv` of a setup.sh install (native/weenv-launch.c): no
    Python of its own, the node service pulls, with the launcher's output and status."""
    ref = node.push("one", "native")
    done = subprocess.run([str(launcher), "pull", ref, "--insecure", "--containerd-socket",
                           str(node.socket), "--json"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["weenv_layers"] == [0]
    assert node.run(ref, "t-native", "/bin/sh", "-c", "test -x /bin/ls") == 0
    bad = subprocess.run([str(launcher), "pull", ref, "--no-such-option"], capture_output=True,
                         text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr
    node.remove_image(ref)


def test_a_store_the_snapshotter_does_not_serve_is_refused(node: Node, tmp_path: Path) -> None:
    ref = node.push("one", "d", "--store-url", "http://192.0.2.1/elsewhere")
    done = node.pull(ref, check=False)
    assert done.returncode == 1
    assert "which this snapshotter does not serve" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = node.ctr("images", "pull", "--plain-http", "--snapshotter", "weenv", ref,
                    check=False)
    assert done.returncode != 0
    assert "does not serve" in done.stderr
    node.ctr("images", "rm", "--sync", ref, check=False)
    assert node.our_mounts() == []
