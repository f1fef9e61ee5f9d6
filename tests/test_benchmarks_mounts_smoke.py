"""Smoke test of the mount benchmarks (benchmarks/mount.py, read.py, coldstart_ref.py): they
show examples in --help, and mount.py and read.py's throughput and cold-s3 parts run end to
end on tiny inputs, write their JSON and leave nothing mounted.

Owns: proving those scripts and benchmarks/_mounting.py work. Must not: assert anything about
timings; the numbers only have to exist. coldstart_ref.py needs a debootstrapped sample tree
and is only checked for --help here (its --quick run takes about a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from weenvfs.fuse import node_socket

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


def _run(script: str, *args: str, work: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if work is not None:
        env["WEENV_BENCH_DIR"] = str(work)  # trees and stores go here, not /var/tmp
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )


def _mounted_below(path: Path) -> list[str]:
    prefix = os.fsencode(str(path))
    with open("/proc/self/mounts", "rb") as f:
        return [line.decode() for line in f if line.split()[1].startswith(prefix)]


@pytest.mark.parametrize("script", ["mount.py", "read.py", "coldstart_ref.py"])
def test_help_shows_examples(script: str) -> None:
    done = _run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert "examples:" in done.stdout and "--quick" in done.stdout


FORGET = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from _mounting import forget_environments, mount_server
folder = Path(sys.argv[2])
with mount_server(folder):
    pid_file = folder / "mountd.sock.pid"
    before = pid_file.read_text().strip()
    forget_environments()
    print(before, pid_file.read_text().strip())
"""


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a detached service that stopped may be
    a zombie for a moment, until init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.requires_fuse
def test_a_cold_turn_starts_the_blocks_node_service_afresh(tmp_path: Path) -> None:
    """`forget_environments` (a cold turn of coldstart_ref.py and coldstart.py) leaves no
    environment in the node service's memory: the block's service is stopped and another
    started behind the same socket, which the block then stops in turn."""
    done = subprocess.run([sys.executable, "-c", FORGET, str(BENCH), str(tmp_path / "mountd")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    before, after = (int(pid) for pid in done.stdout.split())
    assert before != after
    assert not _running(before) and not _running(after)


@pytest.mark.requires_fuse
def test_mount_quick_run_writes_table_and_json(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    done = _run("mount.py", "--quick", "--small", "100", "--large", "300", "--out", str(out),
                work=work)
    assert done.returncode == 0, done.stderr
    assert "mount to first stat /" in done.stdout and "budget" in done.stdout
    document = json.loads((out / "mount.json").read_text())
    results = document["results"]
    assert results["small"]["files"] < results["large"]["files"]
    assert len(results["large"]["mount_to_stat"]["samples_s"]) == 1
    assert results["ratio_large_over_small"] > 0
    assert _mounted_below(work) == []


def _read_quick(part: str, tmp_path: Path, require_or_skip: Callable[[object, str], None]
                ) -> tuple[dict[str, Any], Path]:
    """`read.py --quick --only PART` on an 8 MiB file: its results and its benchmark folder."""
    require_or_skip(os.access("/proc/sys/vm/drop_caches", os.W_OK),
                    "needs root to drop the page cache")
    out, work = tmp_path / "out", tmp_path / "work"
    node_service = Path(node_socket.socket_path())  # the one this process would use
    there = node_service.exists()
    done = _run("read.py", "--quick", "--only", part, "--size-mb", "8", "--out", str(out),
                work=work)
    assert done.returncode == 0, done.stderr
    # Its mounts went to a node service of its own, stopped at its end: not this node's.
    assert node_service.exists() == there
    return json.loads((out / "read.json").read_text())["results"], work


@pytest.mark.requires_fuse
def test_read_quick_throughput_run(
    tmp_path: Path, require_or_skip: Callable[[object, str], None]
) -> None:
    results, work = _read_quick("throughput", tmp_path, require_or_skip)
    throughput = results["throughput"]
    assert throughput["bytes"] == 8 << 20
    assert set(throughput["contenders"]) == {
        f"{who}, page cache {state}"
        for who in ("weenv", "local disk") for state in ("cold", "warm")
    }
    assert throughput["fraction_of_local_cold"] > 0
    assert _mounted_below(work) == []


@pytest.mark.requires_fuse
def test_read_quick_cold_s3_run(
    tmp_path: Path, require_or_skip: Callable[[object, str], None]
) -> None:
    """The cold read from SeaweedFS against a plain GET: both rows, the bytes the mount
    fetched (the whole file: nothing was cached), nothing left mounted or running."""
    results, work = _read_quick("cold-s3", tmp_path, require_or_skip)
    cold = results["cold_s3"]
    assert set(cold["contenders"]) == {"weenv mount + read, node cache empty",
                                       "plain GET of the blobs"}
    assert cold["fetched"]["bytes"] >= 8 << 20 and cold["fetched"]["plain_bytes"] >= 8 << 20
    assert cold["time_ratio_weenv_over_plain"] > 0
    assert _mounted_below(work) == []
    assert str(work) not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                           text=True, check=True).stdout
