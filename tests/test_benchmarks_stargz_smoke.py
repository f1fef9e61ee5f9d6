"""Smoke test of the eStargz peer (benchmarks/stargz_peer.py): on the minbase sample, our
containerd and stargz snapshotter start, the image is converted to eStargz and pushed, a cold
lazy pull + run and a cold overlayfs pull + run both succeed, and afterwards nothing of
theirs is mounted or running.

Owns: proving the peer works end to end. Must not: assert anything about timings; the numbers
only have to exist. The peer is installed by `scripts/setup.sh --test` (make test, CI) and
`--bench`; without it this test skips, and fails in strict mode (CI).
"""

from __future__ import annotations

import json
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
from stargz_peer import stargz_unavailable
print(stargz_unavailable() or "")
"""

SCRIPT = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from docker_peer import Registry
from docker_tree import push_tree
from stargz_peer import ColdContainerdRun, ColdStargzRun, StargzPeer
from weenvfs.tools.sample import sample_tree

work = Path(sys.argv[2])
tree = sample_tree(None, "minbase", progress=False)
key = {"tree": str(tree), "mtime_ns": tree.stat().st_mtime_ns}
argv = ["/bin/sh", "-c", "test -s /etc/debian_version && ls /usr/bin >/dev/null"]
registry = Registry(work / "registry").start()
peer = StargzPeer(work / "peer")
out = {}
try:
    push_tree(tree, key, registry, "minbase", work / "layers")
    peer.start()
    esgz = peer.convert(registry, "minbase", key)
    out["again"] = peer.convert(registry, "minbase", key)  # the stamp: no second conversion
    for run in (ColdStargzRun(peer, registry, esgz, argv),
                ColdContainerdRun(peer, registry, "minbase", argv)):
        seconds, detail = run.run()
        out[run.label] = {"seconds": seconds, **detail}
    out["image_bytes"] = registry.stored_bytes()
finally:
    peer.stop()
    registry.stop()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_stargz_peer_lazy_and_overlayfs_runs(
    tmp_path: Path, require_or_skip: Callable[[object, str], None]
) -> None:
    done = subprocess.run([sys.executable, "-c", WHY_NOT], capture_output=True, text=True,
                          check=True)
    why = done.stdout.strip()
    require_or_skip(not why, f"eStargz peer not installed: {why}")
    work = tmp_path / "stargz"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(BENCH), str(work)],
                          capture_output=True, text=True, timeout=900, check=False, cwd=REPO)
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(done.stdout.splitlines()[-1])
        assert results["again"] == "minbase-esgz"
        lazy = results["eStargz (containerd + stargz, lazy)"]
        full = results["containerd pull + run (overlayfs)"]
        assert lazy["seconds"] > 0 and full["seconds"] > 0
        # A full pull moves every layer; the lazy one fetched something, not the whole image.
        assert 0 < lazy["bytes_fetched"] < results["image_bytes"]
        assert full["bytes_fetched"] > lazy["bytes_fetched"]
    finally:
        assert mounted_below(work) == []
        assert processes_naming(work) == []
