"""A scripted memory and CPU load for the provisioner tests and benchmark (stdlib only).

Run as a script: `python load_child.py [--join FILE ...] [--script "CMD; CMD; ..."]`.
`--join` writes the process's pid into each FILE first (a cgroup's cgroup.procs), so all of
its memory is charged to that cgroup. Commands come from --script, else from stdin, one per
line; each prints `start CMD T` when it begins and `ok CMD T` when it is done (T is
time.monotonic(), the same clock as the sidecar's), so a test can follow the phases:
  mem MIB SECONDS   grow or shrink resident memory to MIB in 4 MiB blocks (every page
                    touched), spread evenly over SECONDS
  cpu SECONDS       spin one core for SECONDS
  sleep SECONDS     stay idle
  exit              end (also at the end of the script or of stdin)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable

BLOCK = 4 << 20
PAGE = 4096


def _touched_block() -> bytearray:
    block = bytearray(BLOCK)
    for offset in range(0, BLOCK, PAGE):
        block[offset] = 1
    return block


def set_memory(blocks: list[bytearray], mib: float, seconds: float) -> None:
    """Grow or shrink `blocks` to `mib` MiB, evenly over `seconds`."""
    target = int(mib * (1 << 20)) // BLOCK
    steps = abs(target - len(blocks))
    pause = seconds / steps if steps else 0.0
    while len(blocks) != target:
        if len(blocks) < target:
            blocks.append(_touched_block())
        else:
            blocks.pop()
        if pause:
            time.sleep(pause)


def spin(seconds: float) -> None:
    """Burn one core for `seconds`."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for _ in range(10_000):
            x += 1


def run(commands: Iterable[str]) -> None:
    blocks: list[bytearray] = []
    for line in commands:
        words = line.split()
        if not words:
            continue
        print(f"start {line.strip()} {time.monotonic():.6f}", flush=True)
        if words[0] == "exit":
            break
        if words[0] == "mem":
            set_memory(blocks, float(words[1]), float(words[2]))
        elif words[0] == "cpu":
            spin(float(words[1]))
        elif words[0] == "sleep":
            time.sleep(float(words[1]))
        else:
            raise SystemExit(f"unknown command {line!r}")
        print(f"ok {line.strip()} {time.monotonic():.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--join", action="append", default=[])
    parser.add_argument("--script")
    args = parser.parse_args()
    for path in args.join:
        with open(path, "w") as handle:
            handle.write(str(os.getpid()))
    print(f"ready {time.monotonic():.6f}", flush=True)
    run(args.script.split(";") if args.script else sys.stdin)


if __name__ == "__main__":
    main()
