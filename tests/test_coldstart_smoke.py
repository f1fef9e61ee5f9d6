"""Smoke test of benchmarks/coldstart.py: the WeEnv side and the workload builder, end to end.

Owns: proving that the cold-start benchmark runs: the workload family built from a tiny tree
(host binaries, layer tars made by tree diffs, a whiteout), published into a real SeaweedFS,
hints recorded, environments started through weenvfs.runtime for every figure (time-to-ready
cold and warm, N = 1 and 2; update cost; RL iteration), the table and the JSON. Also that the
OCI image layout the Docker peer pushes holds the same layers (diff_ids and gzip digests).
Docker itself is not needed: the run is `--peers weenv` (Docker's side needs dockerd and a
registry, minutes per cold pull; `benchmarks/coldstart.py --quick` covers it).

Must not: assert anything about timings; the numbers only have to exist. It needs root, FUSE,
runc and catatonit like the runtime tests: skipped with the reason otherwise, failed instead
under WEENVFS_TEST_STRICT=1 / WEENVFS_TEST_FUSE=1 (CI).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "coldstart.py"



def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the cold-start benchmark needs root (sandboxes, drop_caches)"
    for tool, package in (("runc", "runc"), ("catatonit", "catatonit"), ("ldd", "libc-bin")):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian package {package})"
    return None


@pytest.fixture
def bench_dir(tmp_path: Path, require_or_skip: Callable[[object, str], None]) -> Path:
    """A benchmark folder of this test's own (WEENV_BENCH_DIR), once root and the tools
    are there."""
    reason = _unavailable()
    require_or_skip(reason is None, reason or "")
    return tmp_path / "bench"


def _run(bench_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WEENV_BENCH_DIR": str(bench_dir)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_help_shows_examples() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "examples:" in done.stdout and "--smoke" in done.stdout


@pytest.mark.requires_fuse
@pytest.mark.slow
def test_smoke_run_weenv_side(bench_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(bench_dir, "--quick", "--smoke", "--peers", "weenv", "--no-plots",
                "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "figures 1-2: time-to-ready" in done.stdout
    results = json.loads((out / "coldstart.json").read_text())["results"]

    ready = results["ready"]["loopback"]
    assert set(ready) == {"1", "2"}
    for scenario in ("cold", "warm"):
        for contender in ("weenv", "weenv + hints"):
            (batch,) = ready["2"][scenario][contender]
            assert "error" not in batch, batch
            assert len(batch["envs"]) == 2
            # A mount per group: base, python and packages shared, and each task's own.
            assert batch["all_ready_s"] > 0 and batch["moved"]["mounts"] == 3 + 2
    cold = ready["1"]["cold"]["weenv"][0]["moved"]
    assert cold["chunk_bytes"] > 0 and cold["metadata_bytes"] > 0

    (update,) = results["update"]["runs"]["weenv"]
    assert update["bytes_uploaded"] > 0 and update["objects_written"] >= 1 + 2
    rl = results["rl"]["runs"]["2"]
    assert all("error" not in b for sc in rl.values() for bs in sc.values() for b in bs)
    assert results["summary"]["budgets"]["task"]["weenv"]["bytes_fraction_of_image"] > 0


@pytest.mark.slow
def test_family_layers_and_oci_layout(bench_dir: Path, tmp_path: Path) -> None:
    """The tiny family's layers: a whiteout where a file was removed, and an OCI layout whose
    images list exactly those layers (what Docker pulls is what WeEnv serves)."""
    code = f"""
import json, sys
sys.path.insert(0, {str(REPO / "benchmarks")!r})
from pathlib import Path
from oci_layers import write_oci_layout
from docker_peer import image_blobs
from workloads import build_family, IMAGE_ENV
family = build_family(2, smoke=True, root=Path({str(bench_dir / "family")!r}))
write_oci_layout(Path({str(tmp_path / "oci")!r}),
                 {{"task-1": image_blobs(family, "task-1")}}, IMAGE_ENV, ["/bin/sh"])
print(json.dumps({{n: [l.diff_id, l.whiteouts] for n, l in family.layers.items()}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ,
                                                         "WEENV_BENCH_DIR": str(bench_dir)})
    assert done.returncode == 0, done.stderr
    layers = json.loads(done.stdout)
    assert layers["python"][1] == 1  # /etc/motd removed
    assert all(w == 0 for name, (_, w) in layers.items() if name != "python")

    oci = tmp_path / "oci"
    (entry,) = json.loads((oci / "index.json").read_text())["manifests"]
    manifest = json.loads(_blob(oci, entry["digest"]))
    config = json.loads(_blob(oci, manifest["config"]["digest"]))
    names = ["base", "python", "packages", "task-1"]
    assert config["rootfs"]["diff_ids"] == [layers[n][0] for n in names]
    for layer in manifest["layers"]:
        data = _blob(oci, layer["digest"])
        assert len(data) == layer["size"]
        assert "sha256:" + hashlib.sha256(data).hexdigest() == layer["digest"]


def _blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()
