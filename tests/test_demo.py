"""`weenv demo`, what the README's `make demo` runs: the sample published to a local folder
store, then `weenv run` of one command in it on a cold node (the first run, which records the
environment's hint), on a cold node again (replaying it) and warm; the report printed, and
every mount of the demo evicted at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.requires_fuse


def test_demo_runs_the_sample_cold_then_warm_and_reports(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "weenvfs", "demo", "--json", "--quiet",
                           "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["environment"] == "demo/python:latest"
    assert report["command_output"].startswith("hello from 3.")
    assert report["command_output"].endswith("in weenv")
    assert report["hint_recorded"] is True  # the first run recorded it, the service published
    # Lazy: the command read a small part of the image, and only that was fetched.
    assert 0 < report["bytes_fetched"] < 0.15 * report["image_bytes"]
    assert report["first_run_s"] > 0 and report["time_to_ready_s"] > 0 and report["warm_s"] > 0
    with open("/proc/self/mounts") as mounts:
        assert str(workdir) not in mounts.read()  # every mount of the demo evicted at the end
    listed = subprocess.run([sys.executable, "-m", "weenvfs", "mounts", "--json"],
                            env={**os.environ, "WEENV_ENVS_ROOT": str(workdir / "envs")},
                            capture_output=True, text=True, check=True)
    assert json.loads(listed.stdout) == []


def test_demo_as_another_user_says_it_needs_root(tmp_path: Path) -> None:
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                           sys.executable, "-m", "weenvfs", "demo", "--workdir",
                           str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "run it as root" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
