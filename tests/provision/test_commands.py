"""The `weenv provision` commands, called in-process through weenvfs.cli.main."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from provision_support import SidecarThread, V2Folder
from support.polling import wait_for

from weenvfs.cli import main
from weenvfs.provision import registry
from weenvfs.provision.cgroup_driver import MIB, CgroupLimits, ProvisionError
from weenvfs.provision.history import History
from weenvfs.provision.sidecar import SidecarConfig


def test_generate_then_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    assert (
        main(
            [
                "provision",
                "trace",
                "generate",
                "--sandboxes",
                "6",
                "--envs",
                "2",
                "--seed",
                "4",
                "-o",
                str(trace),
            ]
        )
        == 0
    )
    assert "6 sandboxes, 2 environments" in capsys.readouterr().out
    args = ["provision", "simulate", str(trace), "--node-memory", "8G", "--node-cpus", "4"]
    assert main([*args, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in body["results"]] == ["static-peak", "static-mean", "elastic"]
    assert body["node"]["memory"] == 8 << 30 and body["sandboxes"] == 6
    assert main([*args, "--policy", "elastic", "--set", "mem_headroom=0.1"]) == 0
    table = capsys.readouterr().out
    assert "elastic" in table and "static-peak" not in table and "per-node" in table


def test_usage_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    main(["provision", "trace", "generate", "--sandboxes", "1", "-o", str(trace)])
    capsys.readouterr()
    assert main(["provision", "simulate", str(trace), "--set", "bogus=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "weenv: error: unknown policy parameter 'bogus' (see docs/provisioner.md)"
    )
    assert main(["provision", "simulate", str(tmp_path / "missing.json")]) == 1
    assert "cannot read trace" in capsys.readouterr().err
    assert main(["provision", "status", "--spool", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("weenv: error: no provisioner is running") and err.count("\n") == 1


def test_status_shows_the_sidecars_figures(
    v2_folder: V2Folder,
    sidecar_config: Callable[..., SidecarConfig],
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = sidecar_config()
    v2_folder.make("weenv-a")
    registry.register(
        "a",
        ["weenv-a"],
        "env",
        CgroupLimits(200 * MIB, 250 * MIB, 1500),
        spool=config.spool,
        driver=v2_folder.driver,
        history=History(None),
    )
    with (
        registry.pid_lock(config.spool),
        SidecarThread(config, v2_folder.threaded_driver) as thread,
    ):
        thread.wait_ticks(2)
        assert main(["provision", "status", "--spool", str(config.spool)]) == 0
        out = capsys.readouterr().out
        assert main(["provision", "status", "--json", "--spool", str(config.spool)]) == 0
        status: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert f"provisioner pid {os.getpid()}, cgroup v2" in out
    [row] = [line for line in out.splitlines() if line.startswith("a ")]
    assert row.split() == ["a", "100M", "200M", "250M", "1.50", "ok"]
    assert status["sandboxes"]["a"]["mem_usage"] == 100 * MIB


def test_run_in_the_background_then_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], require_or_skip: Callable[..., None]
) -> None:
    require_or_skip(os.geteuid() == 0, "the sidecar needs root for cgroups")
    spool = tmp_path / "spool"
    args = [
        "--spool",
        str(spool),
        "--history",
        str(tmp_path / "h"),
        "--interval",
        "0.05",
        "--set",
        "mem_calm=2",
        "--node-memory",
        "2G",
        "--node-cpus",
        "1",
    ]
    assert main(["provision", "run", *args]) == 0
    pid = registry.running_pid(spool)
    assert pid is not None and f"(pid {pid})" in capsys.readouterr().out
    try:
        status = wait_for(lambda: _status(spool), "the background sidecar's status")
        assert status["node"]["mem_budget"] == 2 << 30 and status["node"]["cpu_budget"] == 4000
        assert main(["provision", "run", *args, "--foreground"]) == 1  # one per node
        assert "already runs" in capsys.readouterr().err
        assert main(["provision", "stop", "--spool", str(spool)]) == 0
        assert f"(pid {pid}) stopped" in capsys.readouterr().out
    finally:
        if registry.running_pid(spool) == pid:
            os.kill(pid, signal.SIGKILL)
    start = json.loads((spool / "events.jsonl").read_text().splitlines()[0])
    assert start["policy"]["mem_calm"] == 2.0


def _status(spool: Path) -> dict[str, Any] | None:
    try:
        return registry.read_status(spool)
    except ProvisionError:
        return None


def test_record_a_trace_from_an_event_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.jsonl"
    sample = {"time": 1.0, "mem_usage": MIB, "cpu_usage_us": 0}
    later = {"time": 2.0, "mem_usage": 2 * MIB, "cpu_usage_us": 1000}
    log.write_text(
        "".join(
            json.dumps({"event": "sample", "sandbox": "s", "sample": x}) + "\n"
            for x in (sample, later)
        )
    )
    assert main(["provision", "trace", "record", str(log), "-o", str(tmp_path / "t.json")]) == 0
    assert "1 sandboxes" in capsys.readouterr().out
    log.write_text('{"event": "start"}\n')
    assert main(["provision", "trace", "record", str(log), "-o", str(tmp_path / "u.json")]) == 2


def test_status_shows_the_quota_budget_next_to_the_cpus() -> None:
    import os

    from weenvfs.provision.commands import _cpu_budget

    cpus = os.cpu_count() or 1
    text = _cpu_budget({"cpu_budget": cpus * 4000})
    assert text == f"{cpus * 4:.2f} quota cores ({cpus} CPUs x 4 overcommit)"
