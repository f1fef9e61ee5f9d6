"""WeEnv images that meet other images under real containerd 1.6 (the `node` fixture: its own
store, registry, `weenv snapshotter` and containerd): two images on the same lower group
share one group mount and the node's chunk cache; a mixed image, an ordinary gzip tar layer
over a WeEnv group, runs with the tar's files, whiteouts and opaque folder applied; the
snapshotter's metrics endpoint counts its calls and layers and the node's fetches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import layers, pushed
from support.containerd import Node

from weenvfs.format.oci_layer import KEY_STORE
from weenvfs.fuse.commands import read_stats

pytestmark = pytest.mark.usefixtures("containerd_requirements")

BIG_FILE = "/usr/bin/perl"  # 3.7 MiB of the minbase group that no shell start-up reads


def _fetched(row: dict[str, object]) -> int:
    return int(read_stats(Path(str(row["mountpoint"])))["fetch"]["bytes_fetched"])


def test_two_images_share_group_mounts_and_the_node_cache(node: Node) -> None:
    # `one` is the minbase group; `two` is minbase + a task group: one lower group in common.
    one, two = node.push("one", "s1"), node.push("two", "s2")
    node.pull(one)
    node.pull(two)
    # Three snapshots (the two images' layers differ: each marker names its environment),
    # two group mounts: the minbase group is one mount that both images' snapshots hold.
    assert len(node.snapshots()) == 3
    rows = {row["layer"]: row for row in node.group_mounts()}
    assert sorted(rows) == [0, 1], rows
    assert len(rows[0]["holders"]) == 2 and len(rows[1]["holders"]) == 1, rows
    assert rows[0]["data_path"] == rows[1]["data_path"]

    before = _fetched(rows[0])
    read = ("/bin/sh", "-c", f"cat {BIG_FILE} > /dev/null && test -s {BIG_FILE}")
    assert node.run(one, "t-one", *read) == 0
    first = _fetched(rows[0])
    assert first - before > 1 << 20  # the file's chunks came from the store
    assert node.run(two, "t-two", *read) == 0
    assert _fetched(rows[0]) == first  # the second image found them on the node
    assert {row["key"]: row["pid"] for row in node.group_mounts()} == {
        row["key"]: row["pid"] for row in rows.values()}  # the same mounts, no new daemon

    # The shared mount stays while one image holds it, and goes with the last.
    node.ctr("images", "rm", "--sync", one)
    rows = {row["layer"]: row for row in node.group_mounts()}
    assert sorted(rows) == [0, 1] and len(rows[0]["holders"]) == 1, rows
    assert node.run(two, "t-two-again", "/bin/sh", "-c", "test -x /bin/ls") == 0
    node.remove_image(two)


# The tar layer above the WeEnv group: a new file, a replaced file (new owner and mode), a
# whiteout, an opaque folder with one new file in it, a new symlink.
UPPER = (
    layers.file("srv/from-tar.txt", b"written by the tar layer\n"),
    layers.file("etc/issue", b"the tar layer wins\n", mode=0o600, uid=1000, gid=1000),
    layers.whiteout("etc/debian_version"),
    layers.opaque("usr/share/doc"),
    layers.file("usr/share/doc/only-this", b"alone\n"),
    layers.symlink("srv/link", "from-tar.txt"),
)
# One exit code per check, so that a failure names it (ctr drops short tasks' output).
CHECKS = " && ".join(f"{{ {test} || exit {code}; }}" for code, test in enumerate([
    'test "$(cat /srv/from-tar.txt)" = "written by the tar layer"',
    'test "$(cat /etc/issue)" = "the tar layer wins"',
    'test "$(stat -c %u:%g:%a /etc/issue)" = 1000:1000:600',
    "test ! -e /etc/debian_version",
    'test "$(ls -A /usr/share/doc)" = only-this',
    'test "$(readlink /srv/link)" = from-tar.txt && test -s /srv/link',
    "test -x /bin/ls && test -s /etc/passwd && test ! -e /.weenv",  # the group is there
], start=10)) + " && exit 0"


@pytest.mark.parametrize("how", ["labels", "markers"])
def test_a_tar_layer_over_a_weenv_group(node: Node, how: str) -> None:
    image = pushed.assemble([*pushed.weenv_layers(node.store, "one:v1"),
                             pushed.tar_layer(*layers.with_parents(list(UPPER)))])
    ref = pushed.push(image, f"{node.registry.host}/mixed:{how}")
    if how == "labels":
        result = json.loads(node.pull(ref, "--json").stdout)
        assert result["weenv_layers"] == [0]  # the tar layer is left to `ctr images pull`
        assert result["recorded_by"] == "ctr"
    else:
        node.ctr("images", "pull", "--plain-http", "--snapshotter", "weenv", ref)
    assert len(node.snapshots()) == 2
    assert [row["layer"] for row in node.group_mounts()] == [0]
    assert node.run(ref, f"t-mixed-{how}", "/bin/sh", "-c", CHECKS) == 0
    # The group's own files are untouched by the layer above it.
    [row] = node.group_mounts()
    group = Path(row["mountpoint"])
    assert (group / "etc/debian_version").exists()
    assert (group / "etc/issue").read_bytes() != b"the tar layer wins\n"
    node.remove_image(ref)


def _delta(before: dict[Any, float], after: dict[Any, float], name: str,
           **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_calls_layers_and_the_node_fetches(node: Node) -> None:
    """The snapshotter's endpoint (`--metrics`, with `--node-metrics`): its calls, snapshots
    and WeEnv layers, and the fetches of the node's mounts, moved by what the test did."""
    before = node.scrape()
    ref = node.push("two", "m")
    node.pull(ref)
    held = node.scrape()
    assert _delta(before, held, "weenv_snapshotter_weenv_layers_total", via="labels") == 2
    assert _delta(before, held, "weenv_snapshotter_calls_total", method="Prepare",
                  code="ALREADY_EXISTS") >= 2
    assert held[("weenv_snapshotter_snapshots", (("kind", "committed"), ("weenv", "true")))] == 2
    assert held[("weenv_snapshotter_group_mounts", ())] == 2
    assert sum(v for (name, _), v in held.items() if name == "weenv_mounts") == 2
    assert held[("weenv_snapshotter_call_seconds_count", (("method", "Prepare"),))] >= 2

    read = "cat /usr/lib/*/libapt-pkg.so.6.0.0 > /dev/null"  # read by no other test here
    assert node.run(ref, "t-metrics", "/bin/sh", "-c", read) == 0
    ran = node.scrape()
    assert _delta(held, ran, "weenv_fetched_bytes_total") > 1 << 18  # compressed: 460 KB
    assert _delta(held, ran, "weenv_served_bytes_total") > 1 << 20
    assert _delta(held, ran, "weenv_reads_total") > 0

    refused = pushed.push(pushed.assemble([pushed.marker_layer(
        {**pushed.weenv_layers(node.store, "one:v1")[0][0].annotations,
         KEY_STORE: "http://192.0.2.1/weenv"})]), f"{node.registry.host}/refused:m")
    assert node.pull(refused, check=False).returncode == 1
    node.remove_image(ref)
    after = node.scrape()
    assert _delta(ran, after, "weenv_snapshotter_refused_layers_total") == 1
    assert _delta(ran, after, "weenv_snapshotter_calls_total", method="Prepare",
                  code="FAILED_PRECONDITION") == 1
    assert _delta(ran, after, "weenv_snapshotter_calls_total", method="Remove", code="OK") >= 2
    assert after[("weenv_snapshotter_group_mounts", ())] == 0
    # The node's counters keep what the unmounted mounts did (their exit reports).
    assert _delta(held, after, "weenv_fetched_bytes_total") == _delta(
        held, ran, "weenv_fetched_bytes_total")
