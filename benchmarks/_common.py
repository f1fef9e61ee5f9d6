"""Small helpers shared by every script in benchmarks/: timing, tables, JSON, machine info.

Owns: the conventions every benchmark follows (DESIGN.md: the competitor runs in the same
run, results are ratios, not absolute times, because the machine is shared and noisy):
- `Timing`, `timed`, `measure`, `measure_interleaved` (contenders take turns each round):
  repeats summarized as the median and the spread ((max - min) / median), every sample
  kept for the JSON; `paired_ratio` compares two contenders round by round;
- `add_common_args`: `--quick` (fewer repeats, smaller inputs: a smoke run), `--repeats N`,
  `--out DIR` (where `<name>.json` goes; default benchmarks/results/);
- `print_table` (plain aligned text on stdout), `write_json` (the run's parameters, the exact
  command and `machine_info()` next to the results);
- `compile_project`: the project's compiled modules up to date before anything is timed, as
  scripts/setup.sh leaves them.

Must not: know what any benchmark measures, or import weenvfs (scripts do that themselves).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

RESULTS_DIR = Path(__file__).resolve().parent / "results"
T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """Wall-clock samples (seconds) of one measurement, repeated."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.05 means the repeats agree within 5% of the median."""
        med = self.median
        return (max(self.samples) - min(self.samples)) / med if med > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: median, spread and every sample."""
        return {
            "median_s": self.median,
            "spread": self.spread,
            "samples_s": list(self.samples),
        }


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run `fn` once; return (seconds of wall clock, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure(fn: Callable[[], object], repeats: int) -> Timing:
    """Run `fn` `repeats` times and keep each run's wall-clock time."""
    return Timing(tuple(timed(fn)[0] for _ in range(max(1, repeats))))


def measure_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """Time every function of `fns` once per round, `repeats` rounds, rotating which goes
    first, so that a change in the machine's load hits every contender alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(max(1, repeats)):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(timed(fns[name])[0])
    return {name: Timing(tuple(values)) for name, values in samples.items()}


def paired_ratio(mine: Timing, theirs: Timing) -> float:
    """The median over rounds of mine[i] / theirs[i]: both ran in the same round, close in
    time, so this cancels slow drift in the machine's load better than a ratio of medians."""
    pairs = [ratio(a, b) for a, b in zip(mine.samples, theirs.samples, strict=True)]
    return statistics.median(pairs)


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, or NaN when the denominator is zero (printed as 'n/a')."""
    return numerator / denominator if denominator else float("nan")


def add_common_args(parser: argparse.ArgumentParser, full_repeats: int) -> None:
    """Add --quick, --repeats and --out with the shared meaning (see `repeats_for`)."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a fast smoke run: 1 repeat and small inputs (numbers are not for publishing)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        metavar="N",
        help=f"repeats of each measurement (default {full_repeats}, 1 with --quick)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR,
        metavar="DIR",
        help=f"folder for the JSON results (default {RESULTS_DIR})",
    )


def repeats_for(args: argparse.Namespace, full_repeats: int) -> int:
    """The number of repeats: --repeats if given, else 1 with --quick, else `full_repeats`."""
    if args.repeats is not None:
        return max(1, args.repeats)
    return 1 if args.quick else full_repeats


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPUs, kernel, Python, memory, load at the start."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "memory_bytes": _mem_total(),
    }
    with contextlib.suppress(OSError):  # not every platform has a load average
        info["loadavg_1m"] = os.getloadavg()[0]
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def command_line() -> str:
    """The command that started this process, as one would type it."""
    exe = sys.executable
    if exe.startswith(os.getcwd() + os.sep):
        exe = os.path.relpath(exe)  # '.venv/bin/python' reads better than an absolute path
    return shlex.join([exe, *sys.argv])


def compile_project() -> None:
    """Compile the project's modules whose compiled files are missing or stale, as
    scripts/setup.sh does. Where PYTHONDONTWRITEBYTECODE is set (our machines) Python never
    writes them itself, so in a checkout changed since setup.sh ran, every Python process a
    benchmark starts (the Python API's contender, `weenv mount`) recompiled each changed
    module it imports: `from weenvfs.runtime import Environment` took 0.15 s instead of 0.08
    s in the benchmark clone (2026-12-05). Users get compiled files from setup.sh or pip."""
    root = Path(__file__).resolve().parent.parent
    folders = [str(root / name) for name in ("weenvfs", "format", "tools")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *folders],
                   stdout=subprocess.DEVNULL, check=False)


def describe_machine(info: dict[str, Any] | None = None) -> str:
    """One line for the top of a benchmark's output: CPUs, memory, load, kernel, Python."""
    m = info or machine_info()
    memory = f"{m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else "? GiB"
    load = f", load {m['loadavg_1m']:.1f}" if "loadavg_1m" in m else ""
    return (
        f"machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {memory}{load}, "
        f"Linux {m['kernel']}, Python {m['python']}"
    )


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print `rows` under `headers` as aligned columns (numbers right-aligned)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for raw, row in zip(rows, cells, strict=True):
        parts = [
            c.rjust(w) if isinstance(v, int | float) else c.ljust(w)
            for v, c, w in zip(raw, row, widths, strict=True)
        ]
        print("  ".join(parts).rstrip())
    sys.stdout.flush()


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def write_json(name: str, out_dir: Path, params: dict[str, Any], results: Any) -> Path:
    """Write `<out_dir>/<name>.json` with the command, parameters, machine and results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    document = {
        "benchmark": name,
        "command": command_line(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "params": params,
        "machine": machine_info(),
        "results": results,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
