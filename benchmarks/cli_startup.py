#!/usr/bin/env python3
"""Benchmark how long `weenv` takes to parse and dispatch a command (issue 13: under 100 ms
for `weenv version` and `weenv run`), next to `python3 -c pass` and `docker version`.

Owns one measurement: wall-clock time of a fresh process, page cache warm, for `weenv
version`, `weenv run --help` (parse, dispatch, print; nothing mounted), `python3 -c pass`
(the interpreter's own floor) and, if installed, `docker version --format x` (the client
alone: the format names no field, so it does not wait for the daemon's answer to print).
Each weenv row runs twice: without PYTHONDONTWRITEBYTECODE (Python writes and then reads
.pyc files) and with it set to 1 (nothing written: what a user whose environment sets it pays
when setup.sh did not compile the project, every run recompiling every module imported).
Contenders take turns each round (measure_interleaved). Where the interpreter's folder holds an
installed `weenv` (scripts/setup.sh's native launcher, native/weenv-launch.c, or pip's
console script), `weenv version` and `weenv run --help` also run through it: the path a user
types, which for these commands execs `python -m weenvfs` after the launcher.

Must not: assert anything about the numbers; it reports them (table on stdout, JSON file).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence

from _common import (
    add_common_args,
    describe_machine,
    measure_interleaved,
    print_table,
    repeats_for,
    write_json,
)

FULL_REPEATS = 20


def _runner(argv: Sequence[str], env: dict[str, str]) -> Callable[[], None]:
    def run() -> None:
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False)

    return run


def contenders() -> dict[str, Callable[[], None]]:
    """Name -> a function that runs it once."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    no_pyc = {**env, "PYTHONDONTWRITEBYTECODE": "1"}
    weenv = [sys.executable, "-m", "weenvfs"]
    fns = {
        "weenv version": _runner([*weenv, "version"], env),
        "weenv run --help": _runner([*weenv, "run", "--help"], env),
        "weenv version (PYTHONDONTWRITEBYTECODE=1)": _runner([*weenv, "version"], no_pyc),
        "weenv run --help (PYTHONDONTWRITEBYTECODE=1)": _runner([*weenv, "run", "--help"], no_pyc),
        "python3 -c pass": _runner([sys.executable, "-c", "pass"], env),
    }
    installed = os.path.join(os.path.dirname(sys.executable), "weenv")
    if os.access(installed, os.X_OK):
        fns["installed weenv version"] = _runner([installed, "version"], env)
        fns["installed weenv run --help"] = _runner([installed, "run", "--help"], env)
    docker = shutil.which("docker")
    if docker is not None:
        fns["docker version --format x"] = _runner([docker, "version", "--format", "x"], env)
    return fns


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, FULL_REPEATS)
    args = parser.parse_args(argv)
    repeats = repeats_for(args, FULL_REPEATS)
    fns = contenders()
    for fn in fns.values():  # warm the page cache (and write .pyc where allowed)
        fn()
    timings = measure_interleaved(fns, repeats)
    floor = timings["python3 -c pass"].median
    rows = [(name, t.median * 1000, (t.median - floor) * 1000, t.spread)
            for name, t in timings.items()]
    print(describe_machine())
    print_table(f"CLI start-up, median of {repeats} (ms)",
                ["command", "median ms", "over python ms", "spread"], rows)
    results = {name: t.as_dict() for name, t in timings.items()}
    path = write_json("cli_startup", args.out, {"repeats": repeats, "quick": args.quick,
                                                "PYTHONDONTWRITEBYTECODE":
                                                os.environ.get("PYTHONDONTWRITEBYTECODE")},
                      results)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
