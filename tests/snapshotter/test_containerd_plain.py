"""What a client without WeEnv gets from `weenv push` (docs/containerd.md, "Without WeEnv"):
real containerd 1.6 pulling with its own overlayfs snapshotter, next to the `node` fixture's
weenv snapshotter.

- the default image (marker layers) pulls, and its root file system is the markers only:
  `ctr run` fails at once, runc naming the command it cannot find;
- an image pushed with `--layers full` pulls and runs there as any image does (its files
  are the environment's, compared with `weenv export`), and the same image still runs
  lazily through the weenv snapshotter, its layers never unpacked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import trees
from support.containerd import Node

pytestmark = pytest.mark.usefixtures("containerd_requirements")


def _plain_pull(node: Node, ref: str) -> None:
    """`ctr images pull` for containerd's default snapshotter (overlayfs)."""
    node.ctr("images", "pull", "--plain-http", ref, timeout=600)


def _root_fs(node: Node, ref: str, target: Path) -> Path:
    """The image's root file system in overlayfs, mounted read-only at `target`."""
    target.mkdir()
    node.ctr("images", "mount", ref, str(target))
    return target


def _remove_plain(node: Node, ref: str, target: Path | None = None) -> None:
    if target is not None:
        node.ctr("images", "unmount", "--rm", str(target))
    node.ctr("images", "rm", "--sync", ref)
    assert node.ctr("snapshots", "ls").stdout.splitlines()[1:] == []
    assert node.our_mounts() == []


def test_the_default_image_pulls_but_does_not_run(node: Node, tmp_path: Path) -> None:
    ref = node.push("two", "plain-marker")
    _plain_pull(node, ref)
    root = _root_fs(node, ref, tmp_path / "root")
    try:
        assert sorted(os.listdir(root)) == [".weenv"]
        assert sorted(os.listdir(root / ".weenv")) == ["layer-0.json", "layer-1.json"]
        marker = json.loads((root / ".weenv" / "layer-1.json").read_bytes())
        assert marker["manifest"] == node.envs["two"] and marker["position"] == 1
    finally:
        node.ctr("images", "unmount", "--rm", str(root))
    # The image's command (/bin/sh of the environment) is not there: the task never starts.
    done = node.ctr("run", "--rm", ref, "t-plain-marker", check=False)
    assert done.returncode != 0
    assert 'exec: "/bin/sh": stat /bin/sh: no such file or directory' in done.stderr
    _remove_plain(node, ref)


def test_a_full_image_runs_without_weenv_and_lazily_with_it(node: Node, tmp_path: Path) -> None:
    ref = node.push("two", "plain-full", "--layers", "full")
    _plain_pull(node, ref)
    # The image's own command checks its cwd, env and a file of the task group.
    assert node.ctr("run", "--rm", ref, "t-plain-full", check=False).returncode == 0
    node.weenv("export", "two:v1", str(tmp_path / "export"), "--store", str(node.store))
    root = _root_fs(node, ref, tmp_path / "root")
    try:
        # (The root folder's own mtime is when containerd unpacked the top layer.)
        trees.assert_trees_equal(tmp_path / "export", root, ignore=["root"])
    finally:
        _remove_plain(node, ref, root)

    # A WeEnv node takes the same image's groups through the annotations, lazily.
    result = json.loads(node.pull(ref, "--json").stdout)
    assert result["weenv_layers"] == [0, 1]
    assert node.run(ref, "t-full-weenv") == 0
    assert sorted(row["layer"] for row in node.group_mounts()) == [0, 1]
    node.remove_image(ref)
