"""scripts/check_requirements.py: the install list covers every command the project runs.

The README's `make test` failed on a fresh machine because a test ran Docker, which only the
benchmark setup installed; CI passed on a machine that had it by hand. These tests pin the
check that now runs first in .ci/run.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_requirements.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_requirements", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _load()


def test_list_names_docker_and_setup_installs_every_listed_package() -> None:
    listed = check.read_list()
    assert "docker" in listed["docker.io"] and "dockerd" in listed["docker.io"]
    assert "mkfs.erofs" in listed["erofs-utils"]
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "scripts/debian-packages.txt" in setup
    assert "BENCH_DEBIAN_PACKAGES" not in setup  # no second list that only --bench installs


def test_scan_finds_commands_in_which_calls_and_argv_lists(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(
        'shutil.which("skopeo")\nsubprocess.run(["dockerd", "--bridge=none"])\n'
        'x = "docker"\n')
    assert check.commands_used(tmp_path) == {"skopeo", "dockerd"}


def test_an_unlisted_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("dpkg-query") is None or shutil.which("dockerd") is None:
        pytest.skip("needs dpkg and docker.io installed (scripts/setup.sh installs docker.io)")
    lines = [line for line in check.LIST.read_text().splitlines()
             if not line.startswith("docker.io")]
    short = tmp_path / "list.txt"
    short.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(check, "LIST", short)
    monkeypatch.setattr(check.read_list, "__defaults__", (short,))
    found = check.problems()
    assert any("dockerd comes from Debian package docker.io" in line for line in found), found


def test_this_machine_passes_the_check() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "every command the project runs is installed and listed" in done.stdout


def test_a_bench_package_serves_benchmarks_only(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/bench-packages.txt (what `setup.sh --bench` adds) covers a command only while
    benchmarks/ alone runs it: a test that runs it would fail in CI, which installs only
    scripts/debian-packages.txt."""
    if shutil.which("dpkg-query") is None or shutil.which("dockerd") is None:
        pytest.skip("needs dpkg and docker.io installed (scripts/setup.sh installs docker.io)")
    lines = [line for line in check.LIST.read_text().splitlines()
             if not line.startswith("docker.io")]
    short = tmp_path / "list.txt"
    short.write_text("\n".join(lines) + "\n")
    bench = tmp_path / "bench.txt"
    bench.write_text("docker.io  dockerd\n")
    monkeypatch.setattr(check, "LIST", short)
    monkeypatch.setattr(check.read_list, "__defaults__", (short,))
    monkeypatch.setattr(check, "BENCH_LIST", bench)
    root = tmp_path / "repo"
    for folder in check.SCANNED:
        (root / folder).mkdir(parents=True)
    (root / "benchmarks" / "b.py").write_text('subprocess.run(["dockerd", "--bridge=none"])\n')
    assert not [line for line in check.problems(root) if "dockerd" in line]
    (root / "tests" / "t.py").write_text('shutil.which("dockerd")\n')
    found = check.problems(root)
    assert any("dockerd comes from Debian package docker.io" in line
               and "bench-packages.txt serves benchmarks/ only" in line for line in found), found


def test_setup_bench_runs_the_bench_peers_script() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "bash scripts/bench-peers.sh" in setup
    # make test and CI install the peer too: its smoke test is part of the suite (a fresh
    # machine skipped it while the peers came only with --bench).
    assert "--test) PEERS=yes" in setup
    assert "bash scripts/setup.sh --test" in (REPO / "Makefile").read_text()
    assert "bash scripts/setup.sh --test" in (REPO / ".ci" / "run").read_text()
    peers = (REPO / "scripts" / "bench-peers.sh").read_text()
    assert "scripts/bench-packages.txt" in peers
    assert set(check.read_list(check.BENCH_LIST)).isdisjoint(check.read_list())


def test_setup_has_help_and_refuses_unknown_options() -> None:
    setup = REPO / "scripts" / "setup.sh"
    shown = subprocess.run(["bash", str(setup), "--help"], capture_output=True, text=True,
                           check=False, timeout=30)
    assert shown.returncode == 0 and "--test" in shown.stdout and "examples:" in shown.stdout
    refused = subprocess.run(["bash", str(setup), "--tset"], capture_output=True, text=True,
                             check=False, timeout=30)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "setup: unknown option --tset (--test: with the eStargz peer; --bench: that and "
        "matplotlib)"]
