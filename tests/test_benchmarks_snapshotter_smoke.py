"""Smoke test of WeEnv under containerd as a benchmark contender (benchmarks/snapshotter_peer.py):
on the minbase sample, published into a store of the test's own and pushed with `weenv
push`, containerd, `weenv snapshotter` and the mount server start, two cold `weenv pull` +
`ctr run --snapshotter weenv` runs succeed, without a hint and with the command's hint (recorded
once: the second replays it, and the environment's `latest` tag is gone again afterwards),
each fetches again (the node cache was emptied in between), and afterwards nothing of theirs
is mounted or running.

Owns: proving the contender works end to end. Must not: assert anything about timings; the
numbers only have to exist. Needs what tests/snapshotter needs (root, containerd, runc,
docker-registry, FUSE; all in scripts/debian-packages.txt): without it, it skips, or fails
with WEENVFS_TEST_STRICT=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support.leftovers import mounted_below, processes_naming

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"

WHY_NOT = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
from snapshotter_peer import snapshotter_unavailable
print(snapshotter_unavailable() or "")
"""

SCRIPT = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from _mounting import published
from docker_peer import Registry
from snapshotter_peer import ColdSnapshotterRun, SnapshotterPeer
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.sample import sample_tree

work = Path(sys.argv[2])
tree = sample_tree(None, "minbase", progress=False)
pub = published("minbase", tree)  # in $WEENV_BENCH_DIR: the test's folder
argv = ["/bin/sh", "-c", "test -s /etc/debian_version && ls /usr/bin >/dev/null"]
registry = Registry(work / "registry").start()
peer = SnapshotterPeer(work / "peer", pub.store)
out = {"stored_bytes": pub.stored_bytes, "runs": []}
try:
    peer.start()
    ref = peer.push(registry, pub.ref, "minbase-weenv")
    out["hint"] = hint = peer.recorded_hint(pub.ref, argv)
    for run in (ColdSnapshotterRun(peer, registry, ref, argv, pub.ref),
                ColdSnapshotterRun(peer, registry, ref, argv, pub.ref, hint)):
        seconds, detail = run.run()
        out["runs"].append({"seconds": seconds, "label": run.label, **detail})
    with open_store(str(pub.store)) as store:
        digest, _ = Repository(store).resolve_env(pub.ref)
        out["hint_tags"] = [key.rsplit("/", 1)[1] for key in store.list(f"tags/hints/{digest}/")]
finally:
    peer.stop()
    registry.stop()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_snapshotter_peer_cold_pull_and_run(
    tmp_path: Path, require_or_skip: Callable[[object, str], None]
) -> None:
    done = subprocess.run([sys.executable, "-c", WHY_NOT], capture_output=True, text=True,
                          check=True)
    why = done.stdout.strip()
    require_or_skip(not why, f"weenv snapshotter peer cannot run: {why}")
    work = tmp_path / "snap"
    env = {**os.environ, "WEENV_BENCH_DIR": str(tmp_path / "bench")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(BENCH), str(work)],
                          capture_output=True, text=True, timeout=900, check=False, cwd=REPO,
                          env=env)
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(done.stdout.splitlines()[-1])
        assert [run["hints_replayed"] for run in results["runs"]] == [[], [results["hint"]]]
        assert len({run["label"] for run in results["runs"]}) == 2
        assert results["hint_tags"] == ["bench-snapshotter"]  # no `latest` left behind
        for run in results["runs"]:
            assert run["seconds"] > 0
            # One group, one lazy mount; each cold run fetched part of the image, not all.
            assert run["mounts"] == 1
            assert 0 < run["chunk_bytes"] < results["stored_bytes"]
            assert run["metadata_bytes"] > 0
            # The registry held marker layers only: manifest, config and a few KiB of blobs.
            assert 0 < run["registry_bytes"] < 1_000_000
            assert run["bytes_fetched"] == (run["registry_bytes"] + run["chunk_bytes"]
                                            + run["metadata_bytes"])
    finally:
        assert mounted_below(work) == []
        assert processes_naming(work) == []
