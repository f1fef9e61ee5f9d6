"""The `weenv provision` commands: run, status, stop, simulate, trace generate|record.

Owns: argument parsing and output of those commands; translating ProvisionError into the
CLI's one-line WeenvError. Must not: implement the sidecar, policy or simulator.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from weenvfs.cli import add_command
from weenvfs.cli_args import print_json
from weenvfs.errors import UsageError, WeenvError
from weenvfs.units import short_size, size_arg

from .cgroup_detect import detect_driver
from .cgroup_driver import ProvisionError
from .history import history_dir
from .policy import PolicyConfig
from .registry import read_status, spool_dir, start_sidecar, stop_sidecar
from .simulator import POLICIES, Node, compare
from .trace import AGENTIC_DOC, generate_agentic, load_trace, save_trace, trace_from_events

GIB = 1 << 30


def _policy(args: argparse.Namespace) -> PolicyConfig:
    overrides = {}
    for item in args.set or ():
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set wants NAME=VALUE, got {item!r}")
        overrides[name.strip()] = value.strip()
    try:
        return PolicyConfig().with_overrides(overrides)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _add_policy_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        metavar="NAME=VALUE",
        help="override a policy parameter, e.g. mem_calm=5 or mem_floor=128M (repeatable)",
    )
    parser.add_argument("--node-memory", type=size_arg, metavar="SIZE", help="memory budget")
    parser.add_argument("--node-cpus", type=float, metavar="N", help="CPU cores of the node")


def _spool_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spool",
        type=Path,
        metavar="DIR",
        help="spool folder (default: $WEENV_PROVISION_DIR, else /run/weenv/provision)",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `provision` and its subcommands."""
    group = add_command(
        subparsers,
        "provision",
        help="size sandboxes' CPU and memory from what they use",
        description="The node's provisioner: elastic cgroup limits, status and a simulator.",
        examples=[
            "weenv provision run",
            "weenv provision status",
            "weenv provision simulate trace.json",
        ],
        func=None,
    )
    commands = group.add_subparsers(title="provision commands", metavar="COMMAND")
    _register_run(commands)
    _register_status(commands)
    _register_simulate(commands)
    _register_trace(commands)


def _register_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = add_command(
        commands,
        "run",
        help="start the node's provisioner sidecar",
        description=(
            "Watch every sandbox registered in the spool folder (and each --cgroup) and set\n"
            "its limits every tick: grow at once under pressure, shrink slowly when calm.\n"
            "Without --foreground it starts in the background and prints its pid."
        ),
        examples=[
            "weenv provision run",
            "weenv provision run --foreground --cgroup /sys/fs/cgroup/memory/weenv/sb1",
            "weenv provision run --interval 0.5 --node-memory 20G --event-log /tmp/ev.jsonl",
        ],
        func=_cmd_run,
    )
    run.add_argument("--cgroup", action="append", metavar="PATH", help="also watch this cgroup")
    run.add_argument("--interval", type=float, default=0.25, help="tick in seconds (0.25)")
    run.add_argument("--event-log", type=Path, metavar="FILE", help="JSON-lines decisions")
    run.add_argument(
        "--log-every-tick", action="store_true", help="also log every sample (for traces)"
    )
    run.add_argument(
        "--history",
        type=Path,
        metavar="DIR",
        help="usage history per environment (default: $WEENV_PROVISION_HISTORY, else "
        "/var/lib/weenv/provision/history)",
    )
    run.add_argument("--foreground", action="store_true", help="run in this process")
    _add_policy_options(run)
    _spool_option(run)
    stop = add_command(
        commands,
        "stop",
        help="stop the node's provisioner",
        description="Send SIGTERM to the running sidecar and wait until it has stopped.",
        examples=["weenv provision stop"],
        func=_cmd_stop,
    )
    _spool_option(stop)


def _register_status(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = add_command(
        commands,
        "status",
        help="show the sidecar's current figures",
        description="Show each watched sandbox's usage and limits, from the sidecar's status.",
        examples=["weenv provision status", "weenv provision status --json"],
        func=_cmd_status,
    )
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    _spool_option(status)


def _register_simulate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    simulate = add_command(
        commands,
        "simulate",
        help="run policies over a demand trace on a simulated node",
        description=(
            "Run static-peak, static-mean and elastic limits over the same demand trace and\n"
            "report packing density (sandboxes per node), OOM kills, throttling and slack."
        ),
        examples=[
            "weenv provision trace generate -o trace.json && weenv provision simulate trace.json",
            "weenv provision simulate trace.json --node-memory 64G --node-cpus 32 --json",
            "weenv provision simulate trace.json --policy elastic --set mem_headroom=0.1",
        ],
        func=_cmd_simulate,
    )
    simulate.add_argument("trace", type=Path, metavar="TRACE")
    simulate.add_argument("--json", action="store_true", help="print the results as JSON")
    simulate.add_argument(
        "--policy", action="append", choices=POLICIES, help="policies to run (default: all)"
    )
    simulate.add_argument(
        "--admit-z", type=float, default=3.0, help="elastic admission burst reserve (3.0)"
    )
    _add_policy_options(simulate)


def _register_trace(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    trace = add_command(
        commands,
        "trace",
        help="make demand traces for the simulator",
        description="Generate a documented synthetic trace, or record one from an event log.",
        examples=["weenv provision trace generate -o trace.json"],
        func=None,
    )
    sub = trace.add_subparsers(title="trace commands", metavar="COMMAND")
    generate = add_command(
        sub,
        "generate",
        help="write a synthetic demand trace",
        description="Write a synthetic demand trace.\n\n" + AGENTIC_DOC,
        examples=[
            "weenv provision trace generate -o trace.json",
            "weenv provision trace generate --sandboxes 50 --envs 5 --seed 7 -o small.json",
        ],
        func=_cmd_generate,
    )
    generate.add_argument("--kind", choices=["agentic-coding"], default="agentic-coding")
    generate.add_argument("--sandboxes", type=int, default=200)
    generate.add_argument("--envs", type=int, default=20)
    generate.add_argument("--seed", type=int, default=1)
    generate.add_argument("-o", "--output", type=Path, required=True, metavar="FILE")
    record = add_command(
        sub,
        "record",
        help="turn a sidecar event log into a trace",
        description="Make a trace from the `sample` events of `provision run --log-every-tick`.",
        examples=["weenv provision trace record /tmp/ev.jsonl -o recorded.json"],
        func=_cmd_record,
    )
    record.add_argument("event_log", type=Path, metavar="EVENT_LOG")
    record.add_argument("-o", "--output", type=Path, required=True, metavar="FILE")


# --- handlers ---------------------------------------------------------------------------------


def _fail(error: ProvisionError) -> WeenvError:
    failure = WeenvError(str(error))
    failure.exit_code = error.exit_code
    return failure


def _cmd_run(args: argparse.Namespace) -> int:
    from .sidecar import SidecarConfig, run_sidecar  # imports trio: only when running

    spool = spool_dir(args.spool)
    if args.interval <= 0:
        raise UsageError("--interval must be positive")
    policy = _policy(args)
    if not args.foreground:
        try:
            pid = start_sidecar(spool, _forwarded(args))
        except ProvisionError as error:
            raise _fail(error) from None
        print(f"provisioner started (pid {pid}), spool {spool}")
        return 0
    config = SidecarConfig(
        spool=spool,
        interval=args.interval,
        cgroups=tuple(args.cgroup or ()),
        node_memory=args.node_memory,
        node_cpus=args.node_cpus,
        event_log=args.event_log,
        log_every_tick=args.log_every_tick,
        history_dir=history_dir(args.history),
        policy=policy,
    )
    try:
        run_sidecar(config, detect_driver())
    except ProvisionError as error:
        raise _fail(error) from None
    return 0


def _forwarded(args: argparse.Namespace) -> list[str]:
    """`provision run` options to hand to the background sidecar (spool and mode aside)."""
    out = ["--interval", str(args.interval), "--history", str(history_dir(args.history))]
    out += [f"--cgroup={path}" for path in args.cgroup or ()]
    out += [f"--set={item}" for item in args.set or ()]
    if args.event_log is not None:
        out += ["--event-log", str(args.event_log.absolute())]
    if args.log_every_tick:
        out.append("--log-every-tick")
    if args.node_memory is not None:
        out += ["--node-memory", str(args.node_memory)]
    if args.node_cpus is not None:
        out += ["--node-cpus", str(args.node_cpus)]
    return out + ["-v"] * min(getattr(args, "verbose", 0) or 0, 3)


def _cmd_stop(args: argparse.Namespace) -> int:
    try:
        pid = stop_sidecar(args.spool)
    except ProvisionError as error:
        raise _fail(error) from None
    print("no provisioner was running" if pid is None else f"provisioner (pid {pid}) stopped")
    return 0


def _cpu_budget(node: dict[str, Any]) -> str:
    """`8.00 quota cores (2 CPUs x 4 overcommit)`: quotas may add up to more than the
    node's CPUs (policy cpu_overcommit), so show both."""
    budget = node.get("cpu_budget", 0) / 1000
    cpus = os.cpu_count() or 1
    return f"{budget:.2f} quota cores ({cpus} CPUs x {budget / cpus:g} overcommit)"


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        status = read_status(args.spool)
    except ProvisionError as error:
        raise _fail(error) from None
    if args.json:
        print_json(status)
        return 0
    node: dict[str, Any] = status.get("node", {})  # type: ignore[assignment]
    age = time.time() - float(status.get("wall", 0))  # type: ignore[arg-type]
    stale = f" (stale: last tick {age:.0f} s ago)" if age > 10 * float(status["interval"]) else ""  # type: ignore[arg-type]
    print(
        f"provisioner pid {status['pid']}, {status['driver']}, tick {status['interval']} s, "
        f"{status['ticks']} ticks{stale}"
    )
    print(
        f"node: memory {short_size(node.get('mem_granted'))} of "
        f"{short_size(node.get('mem_budget'))}, "
        f"cpu {node.get('cpu_granted', 0) / 1000:.2f} of {_cpu_budget(node)} granted"
        f"{' OVER-COMMITTED' if node.get('overcommitted') else ''}"
    )
    rows = [("SANDBOX", "USAGE", "HIGH", "MAX", "CPU", "STATE")]
    sandboxes: dict[str, Any] = status.get("sandboxes", {})  # type: ignore[assignment]
    for key, info in sorted(sandboxes.items()):
        limits = info["limits"]
        state = "squeezed" if info["squeezed"] else ("held" if info["held"] else "ok")
        if not info["applied"]:
            state += ",writing"
        rows.append(
            (
                key,
                short_size(info["mem_usage"]),
                short_size(limits["mem_high"]),
                short_size(limits["mem_max"]),
                f"{limits['cpu_millis'] / 1000:.2f}",
                state,
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args.trace)
    except ProvisionError as error:
        raise _fail(error) from None
    node = Node(
        memory=args.node_memory or 32 * GIB,
        cpu=round((args.node_cpus or 16) * 1000),
        admit_z=args.admit_z,
    )
    policies = tuple(args.policy or POLICIES)
    results = compare(trace, node, _policy(args), policies=policies)
    if args.json:
        body = {
            "trace": str(args.trace),
            "sandboxes": len(trace.sandboxes),
            "node": node.__dict__,
            "results": [r.to_json() for r in results],
        }
        print_json(body)
        return 0
    print(format_results(results, node))
    return 0


def format_results(results: list[Any], node: Node) -> str:
    """The simulator's table (also used by benchmarks/provision.py)."""
    lines = [
        f"node: {node.memory / GIB:g} GiB, {node.cpu / 1000:g} cores",
        "policy        per-node  ooms  done  makespan  stretch  held s  throttled  slack",
    ]
    for r in results:
        throttled = r.cpu_throttled_s / r.cpu_demand_s if r.cpu_demand_s else 0.0
        lines.append(
            f"{r.policy:<12} {r.density:9.1f} {r.oom_kills:5d} {r.completed:5d} "
            f"{r.makespan:8.0f}s {r.stretch:7.2f} {r.mem_held_s:7.0f} {throttled:9.1%} "
            f"{r.slack_frac:6.1%}"
        )
    return "\n".join(lines)


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.sandboxes < 1 or args.envs < 1:
        raise UsageError("--sandboxes and --envs must be at least 1")
    trace = generate_agentic(args.sandboxes, args.envs, args.seed)
    save_trace(trace, args.output)
    print(f"wrote {args.output}: {len(trace.sandboxes)} sandboxes, {args.envs} environments")
    return 0


def _cmd_record(args: argparse.Namespace) -> int:
    try:
        trace = trace_from_events(args.event_log)
    except OSError as error:
        raise UsageError(f"cannot read {args.event_log}: {error.strerror}") from None
    if not trace.sandboxes:
        raise UsageError(f"{args.event_log} has no sample events (run with --log-every-tick)")
    save_trace(trace, args.output)
    print(f"wrote {args.output}: {len(trace.sandboxes)} sandboxes")
    return 0
