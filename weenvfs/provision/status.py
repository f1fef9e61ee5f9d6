"""What the sidecar tells the outside: its JSON-lines event log and its status file.

Owns: `EventLog` (append-only, one JSON object per line, with monotonic and wall-clock times,
rotated to `.1` past 64 MiB), `Watched` (what the sidecar knows of one sandbox besides the
policy's state) and `status_document` (the content of status.json, which `weenv provision
status` reads). Must not: decide anything or touch cgroups.

Events: start, stop, register, unregister, gone (its cgroup vanished; with the run's
summary), decision (every change of limits, with its reasons and inputs), write (the files
written, each with the usage read just before it), write-error, read-error, squeeze, node
(over-committed or not), and with --log-every-tick sample (every reading, for traces).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .cgroup_driver import Cgroup, CgroupLimits, Sample
from .history import RunStats
from .policy import SandboxState

EVENT_LOG_MAX = 64 << 20  # rotate to events.jsonl.1 past this size


class EventLog:
    """Append-only JSON lines: one object per event, with monotonic and wall-clock times."""

    def __init__(self, path: Path, max_bytes: int = EVENT_LOG_MAX) -> None:
        self.path = path
        self.max_bytes = max_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the sidecar

    def write(self, event: str, **fields: object) -> None:
        """Append one event."""
        record = {"event": event, "t": round(time.monotonic(), 6), "wall": round(time.time(), 3)}
        record.update(fields)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._file.tell() > self.max_bytes:
            self._file.close()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        """Close the file."""
        self._file.close()


@dataclass
class Watched:
    """One sandbox the sidecar watches."""

    sandbox_id: str
    cgroup: Cgroup
    env: str
    registered: float
    stats: RunStats = field(default_factory=RunStats)
    applied: CgroupLimits | None = None  # last limits written successfully
    errors: int = 0  # reads that failed
    write_errors: int = 0
    last_sample: Sample | None = None
    reasons: tuple[str, ...] = ()
    squeezed: bool = False


def status_document(
    driver: str,
    interval: float,
    ticks: int,
    now: float,
    node: Mapping[str, object],
    watched: Mapping[str, Watched],
    states: Mapping[str, SandboxState],
) -> dict[str, object]:
    """The status file's content: the node's budgets and every sandbox's figures."""
    sandboxes = {}
    for key, w in watched.items():
        sample, state = w.last_sample, states[key]
        sandboxes[key] = {
            "env": w.env,
            "cgroup": w.cgroup.name,
            "mem_usage": None if sample is None else sample.mem_usage,
            "mem_peak": round(state.mem_peak),
            "cpu_peak": round(state.cpu_peak),
            "oom_kills": None if sample is None else sample.oom_kills,
            "held": None if sample is None else sample.held,
            "limits": state.limits.to_json(),
            "applied": w.applied == state.limits,
            "reasons": list(w.reasons),
            "squeezed": w.squeezed,
            "read_errors": w.errors,
            "write_errors": w.write_errors,
        }
    return {
        "pid": os.getpid(),
        "wall": time.time(),
        "monotonic": now,
        "ticks": ticks,
        "interval": interval,
        "driver": driver,
        "node": dict(node),
        "sandboxes": sandboxes,
    }
