"""Smoke test of benchmarks/build.py: it runs end to end on a tiny tree and writes its JSON.

Owns: proving the benchmark script and benchmarks/_common.py work (arguments, both
contenders, the synthetic index, the table and the JSON layout). Must not: assert anything
about timings; the numbers only have to exist.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "build.py"


def _tiny_tree(root: Path) -> Path:
    tree = root / "tree"
    for d in range(3):
        sub = tree / f"dir{d}" / "sub"
        sub.mkdir(parents=True)
        for f in range(5):
            (sub / f"file{f}.txt").write_bytes(b"line %d of a small file\n" % f * (f + 1) * 20)
    (tree / "big.bin").write_bytes(os.urandom(200_000) * 2)  # past the batch threshold
    (tree / "link").symlink_to("dir0/sub/file0.txt")
    return tree


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_help_shows_examples() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    assert "examples:" in done.stdout and "--quick" in done.stdout


def test_quick_run_writes_table_and_json(
    tmp_path: Path, require_or_skip: Callable[[object, str], None]
) -> None:
    require_or_skip(shutil.which("zstd"), "zstd not installed (Debian package zstd)")
    tree = _tiny_tree(tmp_path)
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    done = _run(
        "--quick",
        "--out",
        str(out),
        "--tree",
        str(tree),
        "--entries",
        "1500",
        "--lookups",
        "2000",
        "--work",
        str(work),
    )
    assert done.returncode == 0, done.stderr
    assert "time ratio" in done.stdout and "GroupIndex" in done.stdout
    document = json.loads((out / "build.json").read_text())
    assert document["benchmark"] == "build"
    assert "benchmarks/build.py" in document["command"]
    assert document["params"]["repeats"] == 1
    assert document["machine"]["cpu_count"] >= 1
    [build] = document["results"]["builds"]
    assert build["tree"] == str(tree)
    assert build["files"] == 16
    assert build["bytes"] == sum(
        p.stat().st_size for p in tree.rglob("*") if p.is_file() and not p.is_symlink()
    )
    assert len(build["weenv_build"]["samples_s"]) == 1
    assert build["tar_zstd_bytes"] > 0 and build["stored_bytes"] > 0
    assert build["rebuild_bytes_uploaded"] == 0  # the no-change rebuild deduplicated all
    index = document["results"]["index"]
    assert index["files"] == 1500
    assert index["index"]["entries"] > 1500  # the files plus their directories
    for op in ("load", "resolve", "lookup"):
        assert index[f"{op}_ratio_index_over_dict"] > 0
    assert list(work.iterdir()) == []  # scratch stores and .tar.zst files are removed
