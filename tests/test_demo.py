"""`weenv demo`, what the README's `make demo` runs: the sample published to a local folder
store, mounted cold, the command run in it, the report printed, everything unmounted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.requires_fuse


def test_demo_runs_the_sample_cold_and_reports(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "weenvfs", "demo", "--json", "--quiet",
                           "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["environment"] == "demo/python:latest"
    assert report["command_output"].startswith("hello from 3.")
    assert report["command_output"].endswith("in weenv")
    # Lazy: the command read a small part of the image, and only that was fetched.
    assert 0 < report["bytes_fetched"] < 0.15 * report["image_bytes"]
    assert report["time_to_ready_s"] > 0
    with open("/proc/self/mounts") as mounts:
        assert str(workdir) not in mounts.read()  # unmounted at the end
