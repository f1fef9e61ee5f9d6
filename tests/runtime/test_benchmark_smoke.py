"""Smoke test of benchmarks/runtime.py: it runs end to end (--quick) and writes its JSON.

Asserts nothing about timings; the numbers only have to exist. `node_clean` (conftest) checks
that the benchmark left no sandbox, mount or cgroup behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
SCRIPT = REPO / "benchmarks" / "runtime.py"


def test_quick_run_writes_table_and_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "weenv create + true" in done.stdout and "docker run --rm" in done.stdout
    results = json.loads((tmp_path / "runtime.json").read_text())["results"]
    assert set(results["ready"]["create_and_true"]) >= {"weenv create + true", "bwrap true"}
    assert [r["upper"] for r in results["reset"]] == ["disk", "tmpfs"]
    assert results["reset"][0]["reset"]["median_s"] > 0
    assert results["docker"]


def test_help_shows_examples() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "examples:" in done.stdout
