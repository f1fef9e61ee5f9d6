"""Per-environment usage history kept on the node, to seed a new sandbox's limits.

Owns: `RunStats` (accumulates one sandbox's usage while it runs), `RunSummary` (what is kept of
a finished run), and `History` (a folder of one JSON file per environment, rewritten
atomically under a lock; or memory only, for the simulator). A new sandbox of an environment
starts at the largest start-up peak of its recent runs plus headroom: start-up is what the
first seconds need, and the policy grows within a tick if the task needs more later.
Must not: decide limits beyond that seed (policy.py does).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .cgroup_driver import CgroupLimits, Sample
from .policy import PolicyConfig, initial_limits, quantize

log = logging.getLogger(__name__)

DEFAULT_HISTORY_DIR = Path("/var/lib/weenv/provision/history")
HISTORY_ENV = "WEENV_PROVISION_HISTORY"
START_WINDOW = 30.0  # seconds counted as a run's start-up
KEEP_RUNS = 20
SEED_RUNS = 5
_SAFE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class RunSummary:
    """One finished run of an environment (bytes, millicores, seconds)."""

    mem_peak: int
    mem_start_peak: int
    mem_mean: int
    cpu_peak: int
    cpu_start_peak: int
    cpu_mean: int
    duration: float
    oom_kills: int
    ended: float  # wall-clock time.time()

    @classmethod
    def from_json(cls, data: dict[str, object]) -> RunSummary:
        """Parse one run; ValueError if a field is missing or ill-typed."""
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})  # type: ignore[arg-type]
        except KeyError as error:
            raise ValueError(f"run summary misses {error}") from None


class RunStats:
    """Accumulates one sandbox's usage, sample by sample (time-weighted means)."""

    def __init__(self, start_window: float = START_WINDOW) -> None:
        self.start_window = start_window
        self.first: Sample | None = None
        self.last: Sample | None = None
        self.mem_peak = self.mem_start_peak = 0
        self.cpu_peak = self.cpu_start_peak = 0
        self.mem_area = 0.0
        self.last_mem = 0

    def add(self, sample: Sample) -> None:
        """Count one sample."""
        self.add_usage(sample, sample.mem_usage)

    def add_usage(self, sample: Sample, mem_usage: int) -> None:
        """Count one sample whose memory use is `mem_usage` (the simulator's demand)."""
        if self.first is None:
            self.first = sample
        early = sample.time - self.first.time <= self.start_window
        self.mem_peak = max(self.mem_peak, mem_usage)
        if early:
            self.mem_start_peak = max(self.mem_start_peak, mem_usage)
        last = self.last
        if last is not None and sample.time > last.time:
            dt = sample.time - last.time
            self.mem_area += (mem_usage + self.last_mem) / 2 * dt
            rate = round((sample.cpu_usage_us - last.cpu_usage_us) / dt / 1e3)
            self.cpu_peak = max(self.cpu_peak, rate)
            if early:
                self.cpu_start_peak = max(self.cpu_start_peak, rate)
        self.last = sample
        self.last_mem = mem_usage

    @property
    def duration(self) -> float:
        """Seconds between the first and the last sample."""
        return 0.0 if self.first is None or self.last is None else self.last.time - self.first.time

    def summary(self) -> RunSummary | None:
        """The run so far, or None before two samples."""
        if self.first is None or self.last is None or self.duration <= 0:
            return None
        first, last, duration = self.first, self.last, self.duration
        return RunSummary(
            mem_peak=self.mem_peak,
            mem_start_peak=self.mem_start_peak,
            mem_mean=round(self.mem_area / duration),
            cpu_peak=self.cpu_peak,
            cpu_start_peak=self.cpu_start_peak,
            cpu_mean=round((last.cpu_usage_us - first.cpu_usage_us) / duration / 1e3),
            duration=round(duration, 3),
            oom_kills=last.oom_kills - first.oom_kills,
            ended=time.time(),
        )


def history_dir(path: Path | str | None = None) -> Path:
    """The node's history folder: `path`, else $WEENV_PROVISION_HISTORY, else the default.

    The runtime (seeding a new sandbox) and the sidecar (recording a finished one) must agree
    on it without talking to each other, as they do on the spool folder."""
    if path is not None:
        return Path(path)
    return Path(os.environ.get(HISTORY_ENV) or DEFAULT_HISTORY_DIR)


def _file_name(env: str) -> str:
    if _SAFE.fullmatch(env) and not env.startswith("."):
        return env + ".json"
    return hashlib.sha256(env.encode()).hexdigest() + ".json"


class History:
    """Runs per environment: in `root` (one JSON file each) or, with root None, in memory."""

    def __init__(self, root: Path | str | None, *, keep: int = KEEP_RUNS) -> None:
        self.root = None if root is None else Path(root)
        self.keep = keep
        self._memory: dict[str, list[RunSummary]] = {}

    def runs(self, env: str) -> list[RunSummary]:
        """Recorded runs of `env`, oldest first (an unreadable file counts as none, logged)."""
        if self.root is None:
            return list(self._memory.get(env, []))
        path = self.root / _file_name(env)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return [RunSummary.from_json(item) for item in data["runs"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("ignoring unreadable history %s: %s", path, error)
            return []

    def record(self, env: str, run: RunSummary) -> None:
        """Append one run of `env`, keeping the last `keep`."""
        if self.root is None:
            self._memory[env] = (self._memory.get(env, []) + [run])[-self.keep :]
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / _file_name(env)
        # One writer at a time per node: the sidecar normally, tests and tools sometimes.
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            runs = (self.runs(env) + [run])[-self.keep :]
            body = {"env": env, "runs": [asdict(r) for r in runs]}
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body, indent=1), encoding="utf-8")
            os.replace(tmp, path)

    def seed(self, env: str, config: PolicyConfig, *, runs: int = SEED_RUNS) -> CgroupLimits | None:
        """Initial limits from the last `runs` runs of `env`, or None without history."""
        recent = self.runs(env)[-runs:]
        if not recent:
            return None
        mem = max(r.mem_start_peak for r in recent) * (1 + config.mem_headroom)
        cpu = max(r.cpu_start_peak for r in recent) * (1 + config.cpu_headroom)
        return initial_limits(
            config,
            max(config.mem_floor, quantize(mem, config.mem_quantum)),
            max(config.cpu_floor, quantize(cpu, config.cpu_quantum)),
        )
