#!/usr/bin/env python3
"""Benchmark the provisioner: packing density in simulation, and a real run on cgroup v1.

Owns two measurements (issue 8; explained in docs/provisioner.md):
1. Simulation: the documented `agentic-coding` trace (200 sandboxes of 20 environments, seed
   1; also seeds 2 and 3 unless --quick) on a 32 GiB, 16-core node under static-peak,
   static-mean and elastic limits. Budget: elastic packs 1.5x or more the environments per
   node of static-peak, with zero OOM kills.
2. Real run: 8 sandboxes (4 with --quick) on this machine's cgroup v1 hierarchy, each a
   process following a script (memory ramp, a staggered 200 MiB spike, idle, a CPU burst),
   under the sidecar at its default 250 ms tick and default policy. Measured: OOM kills,
   reaction time from a spike's start to the decision raising the limit (budget: 2 ticks)
   and to the write done, every limit write against the usage just before it, and packing:
   the sum of each sandbox's peak usage (what peak-sized static limits reserve) over the
   largest sum of elastic limits at any tick.
Plots (with matplotlib) go to docs/provisioner-sim.png and docs/provisioner-real.png.

Must not: assert anything about the numbers; it reports them (table on stdout, JSON file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import trio
from _common import compile_project, describe_machine, print_table, write_json

from weenvfs.provision import registry
from weenvfs.provision.cgroup_driver import MIB, Cgroup, CgroupLimits, read_mounts, remove_dirs
from weenvfs.provision.cgroup_v1 import CgroupV1Driver
from weenvfs.provision.history import History
from weenvfs.provision.sidecar import Sidecar, SidecarConfig
from weenvfs.provision.simulator import Node, SimResult, compare
from weenvfs.provision.trace import generate_agentic

NAME = "provision"
REPO = Path(__file__).resolve().parent.parent
LOAD_CHILD = REPO / "tests" / "provision" / "load_child.py"
DOCS = REPO / "docs"
GIB = 1 << 30
NODE = Node(memory=32 * GIB, cpu=16_000)
INTERVAL = 0.25
STAGGER = 3.0  # seconds between two sandboxes' spikes in the real run


# --- 1. simulation ---------------------------------------------------------------------------


def simulation(seeds: list[int], sandboxes: int, envs: int) -> dict[str, Any]:
    """The three policies on the agentic trace, per seed; timelines of the first seed."""
    runs: dict[str, Any] = {}
    timelines: dict[str, list[tuple[float, int, int, int]]] = {}
    for seed in seeds:
        trace = generate_agentic(sandboxes, envs, seed)
        results = compare(trace, NODE, timeline_every=5.0 if seed == seeds[0] else 0.0)
        by_policy = {r.policy: r for r in results}
        if seed == seeds[0]:
            timelines = {r.policy: r.timeline for r in results}
        runs[str(seed)] = {p: r.to_json() for p, r in by_policy.items()}
        runs[str(seed)]["density_ratio"] = _density_ratio(by_policy)
    return {"runs": runs, "timelines": timelines}


def _density_ratio(by_policy: dict[str, SimResult]) -> float | None:
    elastic, peak = by_policy["elastic"], by_policy["static-peak"]
    if elastic.oom_kills or peak.oom_kills or not peak.density:
        return None  # only counted at zero OOM kills
    return elastic.density / peak.density


# --- 2. real run --------------------------------------------------------------------------------


def _script(i: int, count: int, pause: float) -> str:
    """Sandbox i's load script: staggered, so the spikes of different sandboxes do not meet."""
    offset = STAGGER * i
    tail = STAGGER * (count - 1 - i) + 3 * pause
    steps = [
        f"sleep {offset}",
        "mem 48 1",
        f"sleep {pause}",
        "mem 200 0.5",
        f"sleep {pause}",
        "mem 40 0",
        "sleep 1",
        "cpu 1.5",
        f"sleep {tail}",
    ]
    return "; ".join(steps)


class _SidecarThread:
    def __init__(self, sidecar_config: SidecarConfig, driver: CgroupV1Driver) -> None:
        self.sidecar = Sidecar(sidecar_config, driver)
        self.token: trio.lowlevel.TrioToken | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=trio.run, args=(self._run,), daemon=True)

    async def _run(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.ready.set()
        await self.sidecar.run()

    def __enter__(self) -> _SidecarThread:
        self.thread.start()
        self.ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self.sidecar.stop, trio_token=self.token)
        self.thread.join(30)


def real_run(count: int, work: Path, pause: float) -> dict[str, Any]:
    """8 scripted sandboxes under the sidecar on real cgroup v1; figures from its event log."""
    driver = CgroupV1Driver(read_mounts().v1)
    parent = f"weenv-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    config = SidecarConfig(
        spool=work / "spool",
        interval=INTERVAL,
        node_memory=8 * GIB,
        node_cpus=os.cpu_count() or 1,
        event_log=work / "events.jsonl",
        log_every_tick=True,
        history_dir=None,
    )
    cgroups: list[Cgroup] = []
    processes: list[subprocess.Popen[str]] = []
    try:
        for i in range(count):
            cgroups.append(driver.create(f"{parent}/sb{i}"))
            registry.register(
                f"sb{i}",
                cgroups[-1].paths(),
                "bench-env",
                CgroupLimits(64 * MIB, 64 * MIB, 200),
                spool=config.spool,
                driver=driver,
                history=History(None),
            )
        with _SidecarThread(config, driver):
            time.sleep(2 * INTERVAL)
            for i, cgroup in enumerate(cgroups):
                script = _script(i, count, pause)
                joins = [
                    a
                    for d in sorted({str(p) for p in cgroup.dirs.values()})
                    for a in ("--join", f"{d}/cgroup.procs")
                ]
                processes.append(
                    subprocess.Popen(
                        [sys.executable, str(LOAD_CHILD), *joins, "--script", script],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            outputs = [p.communicate(timeout=300)[0] for p in processes]
            time.sleep(2 * INTERVAL)
        final = [driver.read(c) for c in cgroups]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for cgroup in cgroups:
            driver.remove(cgroup)
        remove_dirs([root / parent for root in driver.roots.values()])
    events = [json.loads(line) for line in config.event_log.read_text().splitlines()]
    return _analyse(events, outputs, final, [p.returncode for p in processes])


def _phase_starts(output: str, command: str) -> list[float]:
    return [
        float(line.split()[-1])
        for line in output.splitlines()
        if line.startswith(f"start {command}")
    ]


def _reaction(
    events: list[dict[str, Any]], sandbox: str, start: float, field: str
) -> dict[str, float] | None:
    """Ticks from `start` to the first decision raising `field`, and to its write done."""
    for e in events:
        if (
            e["event"] == "decision"
            and e["sandbox"] == sandbox
            and e["t"] > start
            and e["new"][field] > e["old"][field]
        ):
            done = next(
                (
                    w["t"]
                    for w in events
                    if w["event"] == "write" and w["sandbox"] == sandbox and w["t"] >= e["t"]
                ),
                None,
            )
            return {
                "decision_ticks": (e["t"] - start) / INTERVAL,
                "written_ticks": None if done is None else (done - start) / INTERVAL,
            }
    return None


def _analyse(
    events: list[dict[str, Any]], outputs: list[str], final: list[Any], codes: list[int | None]
) -> dict[str, Any]:
    mem, cpu = [], []
    for i, output in enumerate(outputs):
        for start in _phase_starts(output, "mem 200"):
            mem.append(_reaction(events, f"sb{i}", start, "mem_high"))
        for start in _phase_starts(output, "cpu 1.5"):
            cpu.append(_reaction(events, f"sb{i}", start, "cpu_millis"))
    samples = [e for e in events if e["event"] == "sample"]
    peaks: dict[str, int] = {}
    per_tick: dict[int, int] = {}
    for e in samples:
        peaks[e["sandbox"]] = max(peaks.get(e["sandbox"], 0), e["sample"]["mem_usage"])
        per_tick[e["tick"]] = per_tick.get(e["tick"], 0) + e["limits"]["mem_high"]
    writes = [
        (int(v), u)
        for e in events
        if e["event"] == "write"
        for f, v, u, _ in e["writes"]
        if f == "memory.limit_in_bytes"
    ]
    return {
        "sandboxes": len(outputs),
        "exit_codes": codes,
        "oom_kills": sum(s.oom_kills for s in final),
        "limit_hits": sum(s.mem_limit_hits for s in final),
        "held_samples": sum(1 for e in samples if e["sample"]["held"]),
        "mem_reaction": mem,
        "cpu_reaction": cpu,
        "limit_writes": len(writes),
        "writes_below_usage_plus_guard": sum(1 for v, u in writes if v < u + 8 * MIB),
        "sum_of_peaks": sum(peaks.values()),
        "max_sum_of_elastic_limits": max(per_tick.values(), default=0),
        "series": _series(samples),
    }


def _series(samples: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Per sandbox: [t, usage MiB, limit MiB, cpu quota millicores] each tick (for plots)."""
    t0 = samples[0]["t"] if samples else 0.0
    series: dict[str, list[list[float]]] = {}
    for e in samples:
        series.setdefault(e["sandbox"], []).append(
            [
                round(e["t"] - t0, 3),
                e["sample"]["mem_usage"] / MIB,
                e["limits"]["mem_high"] / MIB,
                e["limits"]["cpu_millis"],
            ]
        )
    return series


# --- report -----------------------------------------------------------------------------------


def _worst(reactions: list[dict[str, float] | None], key: str) -> float | None:
    values = [r[key] for r in reactions if r is not None and r[key] is not None]
    return None if not values or None in reactions else max(values)


def report(sim: dict[str, Any], real: dict[str, Any] | None) -> None:
    """Print the tables."""
    rows = []
    for seed, by_policy in sim["runs"].items():
        for policy in ("static-peak", "static-mean", "elastic"):
            r = by_policy[policy]
            thr = r["cpu_throttled_s"] / r["cpu_demand_s"] if r["cpu_demand_s"] else 0.0
            rows.append(
                [
                    seed,
                    policy,
                    r["density"],
                    r["oom_kills"],
                    r["completed"],
                    r["makespan"],
                    r["stretch"],
                    thr,
                    r["slack_frac"],
                ]
            )
    print_table(
        f"simulation: agentic-coding trace on a {NODE.memory // GIB} GiB, "
        f"{NODE.cpu // 1000}-core node",
        [
            "seed",
            "policy",
            "envs/node",
            "OOM kills",
            "done",
            "makespan s",
            "stretch",
            "throttled",
            "slack",
        ],
        rows,
    )
    budget = [
        [
            "sim: envs/node elastic / static-peak (0 OOM)",
            ">= 1.5",
            ", ".join(
                f"{v['density_ratio']:.2f}" if v["density_ratio"] else "kills"
                for v in sim["runs"].values()
            ),
        ]
    ]
    if real is not None:
        mem_dec, cpu_dec = (
            _worst(real["mem_reaction"], "decision_ticks"),
            _worst(real["cpu_reaction"], "decision_ticks"),
        )
        packing = real["sum_of_peaks"] / max(1, real["max_sum_of_elastic_limits"])
        budget += [
            ["real: OOM kills", "0", real["oom_kills"]],
            ["real: spike -> raised memory limit, worst", "<= 2 ticks", mem_dec],
            [
                "real: spike -> limit written, worst",
                "",
                _worst(real["mem_reaction"], "written_ticks"),
            ],
            ["real: CPU burst -> raised quota, worst", "<= 2 ticks", cpu_dec],
            [
                "real: limit writes below usage + guard",
                "0",
                f"{real['writes_below_usage_plus_guard']} of {real['limit_writes']}",
            ],
            ["real: sum of peaks / max sum of elastic limits (info)", "", packing],
        ]
    print_table("budgets (DESIGN.md: provisioner)", ["what", "budget", "measured"], budget)


def plot(sim: dict[str, Any], real: dict[str, Any] | None) -> list[Path]:
    """PNG plots into docs/, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return []
    written = []
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for policy, points in sim["timelines"].items():
        if policy == "static-mean" or not points:
            continue
        t = [p[0] / 60 for p in points]
        top.plot(t, [p[1] for p in points], label=policy)
        bottom.plot(t, [p[2] / GIB for p in points], label=f"{policy}: reserved")
        bottom.plot(t, [p[3] / GIB for p in points], "--", label=f"{policy}: used")
    top.set_ylabel("sandboxes running")
    top.legend()
    bottom.set_ylabel("memory, GiB")
    bottom.set_xlabel("minutes (simulated, seed 1)")
    bottom.legend(fontsize="small")
    fig.suptitle("200 agentic-coding sandboxes on a 32 GiB, 16-core node")
    written.append(_save(fig, "provisioner-sim.png"))
    if real is not None:
        fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        for name in list(real["series"])[:3]:
            points = real["series"][name]
            t = [p[0] for p in points]
            line = axes[0].plot(t, [p[1] for p in points], label=f"{name} usage")[0]
            axes[0].plot(
                t, [p[2] for p in points], "--", color=line.get_color(), label=f"{name} limit"
            )
            axes[1].plot(t, [p[3] for p in points], color=line.get_color(), label=name)
        axes[0].set_ylabel("memory, MiB")
        axes[0].legend(fontsize="small", ncol=3)
        axes[1].set_ylabel("CPU quota, millicores")
        axes[1].set_xlabel("seconds (real cgroup v1, 250 ms ticks)")
        fig.suptitle("real run: usage and elastic limits of three of the sandboxes")
        written.append(_save(fig, "provisioner-real.png"))
    return written


def _save(fig: Any, name: str) -> Path:
    path = DOCS / name
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small trace, 4 real sandboxes")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-real", action="store_true", help="skip the real cgroup run")
    parser.add_argument(
        "--real-sandboxes", type=int, metavar="N", help="sandboxes of the real run (8; 4 quick)"
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write docs/*.png")
    args = parser.parse_args()
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    seeds, sandboxes, envs = ([1], 40, 8) if args.quick else ([1, 2, 3], 200, 20)
    sim = simulation(seeds, sandboxes, envs)
    real = None
    if not args.no_real:
        with tempfile.TemporaryDirectory(prefix="weenv-bench-provision-") as work:
            count = args.real_sandboxes or (4 if args.quick else 8)
            real = real_run(count, Path(work), 1.0 if args.quick else 2.0)
    report(sim, real)
    plots = [] if args.no_plots or args.quick else plot(sim, real)
    params = {
        "quick": args.quick,
        "seeds": seeds,
        "sandboxes": sandboxes,
        "envs": envs,
        "node": NODE.__dict__,
        "interval": INTERVAL,
        "stagger_s": STAGGER,
    }
    results = {
        "simulation": sim["runs"],
        "real": None if real is None else {k: v for k, v in real.items() if k != "series"},
    }
    path = write_json(NAME, args.out, params, results)
    print(f"\nwrote {path}" + "".join(f"\nwrote {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
