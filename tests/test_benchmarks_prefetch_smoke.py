"""Smoke test of benchmarks/prefetch.py: `--quick` on the local store runs end to end (record a
hint, build the hint-ordered layout, the four contenders) and writes its JSON. Must not:
assert anything about timings; the numbers only have to exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "prefetch.py"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900, check=False, env=env)


def test_help_shows_examples() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    assert "examples:" in done.stdout and "--quick" in done.stdout


@pytest.mark.requires_fuse
def test_quick_local_run_writes_json(tmp_path: Path) -> None:
    env = dict(os.environ, WEENV_BENCH_DIR=str(tmp_path / "bench"))
    done = _run("--quick", "--stores", "local", "--out", str(tmp_path / "out"), env=env)
    assert done.returncode == 0, done.stderr
    document = json.loads((tmp_path / "out" / "prefetch.json").read_text())
    assert document["params"]["repeats"] == 1 and document["params"]["profile"] == "python"
    local = document["results"]["stores"]["local"]
    assert set(local) == {"no hint", "hint", "hint + layout", "cached"}
    assert local["hint"]["runs"][0]["hint_chunks"] > 0
    assert local["cached"]["runs"][0]["bytes_fetched"] == 0
    hints = document["results"]["hints"]
    laid, plain = hints["hint-python-laid:bench"], hints["hint-python:bench"]
    assert laid["ranged_requests"] <= plain["ranged_requests"]
