"""Environments started side by side, as a rollout harness starts them: figures 1, 2 and 4 of
the cold-start benchmark (benchmarks/coldstart.py).

Owns:
- the `Peer` protocol both systems implement (docker_peer.DockerPeer, weenv_peer.WeenvPeer):
  `start(image)` (setup: the environment exists and takes commands), `exec`, `stop`,
  `reset_cold()` (nothing of the environments left on the node), and a `Meter` that counts
  the bytes moved from the server;
- `run_batch`: N environments started at the same instant from N threads; each times its
  setup, its first command (time-to-ready ends when it exits), optionally the rest of its
  scripted task and a think time, and its teardown; the bytes moved are read once every
  environment is ready, before any is torn down;
- `ready_rounds`: figure 1 and 2 for one N: cold node (everything removed, page cache
  dropped) and warm node (another task of the family ran before: its lower layers or
  chunks are on the node), contenders in turns, the first one rotating each round;
- `rl_rounds`: figure 4: a simulated rollout iteration of K environments, each running the
  task's commands and `think` seconds, then torn down; and `ideal_task`, the time the
  task's commands take in an environment that is already running and cached.

Must not: start servers or build workloads (coldstart.py, workloads.py), or print tables.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Protocol

from _mounting import drop_caches
from workloads import Family

Argv = tuple[str, ...]


class Peer(Protocol):
    """One system under test, as the harness drives it."""

    name: str

    def prepare(self) -> None: ...
    def reset_cold(self) -> None: ...
    def start(self, image: str) -> Any: ...
    def exec(self, handle: Any, argv: Sequence[str]) -> None: ...
    def stop(self, handle: Any) -> None: ...


class Meter(Protocol):
    """Bytes moved from the server to the node since `begin()`."""

    def begin(self) -> None: ...
    def read(self, envs: Sequence[tuple[str, Any]]) -> dict[str, Any]: ...


@dataclass
class EnvRun:
    """One environment of a batch; times in seconds from the batch's start."""

    image: str
    started: float = float("nan")  # setup done: the environment takes commands
    ready: float = float("nan")  # the first command exited
    done: float = float("nan")  # the whole scripted task (and think time) done
    stopped: float = float("nan")  # torn down


@dataclass
class Batch:
    """What one batch of environments measured."""

    envs: list[EnvRun]
    all_ready: float  # the last environment's time-to-ready
    wall: float  # start to the last teardown
    moved: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"all_ready_s": self.all_ready, "wall_s": self.wall, "moved": self.moved,
                "median_ready_s": statistics.median(e.ready for e in self.envs),
                "median_started_s": statistics.median(e.started for e in self.envs),
                "envs": [asdict(e) for e in self.envs]}


def run_batch(peer: Peer, family: Family, images: Sequence[str], meter: Meter | None = None,
              *, full: bool = False, think: float = 0.0) -> Batch:
    """Start an environment of each image at once; see the module docstring."""
    n = len(images)
    runs = [EnvRun(image) for image in images]
    handles: list[Any] = [None] * n
    ready = [threading.Event() for _ in images]
    release = threading.Event()
    go = threading.Barrier(n + 1)
    t0 = [0.0]

    def clock() -> float:
        return time.perf_counter() - t0[0]

    def worker(i: int) -> None:
        run, image = runs[i], images[i]
        commands = family.task_commands(_task_number(image))
        try:
            go.wait()
            handles[i] = peer.start(image)
            run.started = clock()
            peer.exec(handles[i], commands[0])
            run.ready = clock()
            ready[i].set()
            if full:
                for argv in commands[1:]:
                    peer.exec(handles[i], argv)
                time.sleep(think)  # the agent thinks; the environment waits
                run.done = clock()
            release.wait()
        finally:
            ready[i].set()
            if handles[i] is not None:
                peer.stop(handles[i])
                run.stopped = clock()

    if meter is not None:
        meter.begin()
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(worker, i) for i in range(n)]
        moved: dict[str, Any] = {}
        try:
            t0[0] = time.perf_counter()
            go.wait()
            for event in ready:
                event.wait()
            if meter is not None:
                moved = meter.read([(images[i], h) for i, h in enumerate(handles) if h])
        except BaseException:
            go.abort()  # Ctrl-C: workers still at the start line leave, the others stop
            raise
        finally:
            release.set()
        for future in futures:
            future.result()
    wall = max(r.stopped for r in runs)
    return Batch(runs, max(r.ready for r in runs), wall, moved)


def _task_number(image: str) -> int:
    return int(image.removeprefix("task-")) if image.startswith("task-") else 0


def warm_software(extra: Sequence[Sequence[str]] = ()) -> None:
    """After a cache drop, read the node's own software back (a node keeps its daemons and
    tools warm; only the environments' data should be cold)."""
    argvs = [[sys.executable, "-c", "import weenvfs.cli, weenvfs.fuse.commands, "
              "weenvfs.fuse.mount, weenvfs.runtime.environment"],
             ["runc", "--version"], *extra]
    for argv in argvs:
        subprocess.run(list(argv), capture_output=True, check=False)


@dataclass
class Contender:
    """A peer with its meter, as one column of the figures."""

    peer: Peer
    meter: Meter | None


def _turn(c: Contender, family: Family, scenario: str,
          warm_extra: Sequence[Sequence[str]]) -> None:
    """Bring the node into `scenario` for contender `c`: cold (nothing of the family on the
    node, page cache dropped) or warm (task 0 ran before: the lower layers are cached)."""
    c.peer.prepare()
    c.peer.reset_cold()
    if scenario == "warm":
        run_batch(c.peer, family, ["task-0"], full=True)
    else:
        drop_caches()
        warm_software(warm_extra)


def _measure(c: Contender, family: Family, scenario: str, images: Sequence[str],
             warm_extra: Sequence[Sequence[str]], rl_think: float | None = None) -> Batch:
    """One turn: the node brought into `scenario`, then the batch (an RL iteration when
    `rl_think` is given, else time-to-ready with the bytes moved)."""
    _turn(c, family, scenario, warm_extra)
    if rl_think is None:
        return run_batch(c.peer, family, images, c.meter)
    return run_batch(c.peer, family, images, None, full=True, think=rl_think)


class Log:
    """A log function that remembers the last error it was told about."""

    def __init__(self, write: Callable[[str], None] = print) -> None:
        self.write = write
        self.last = ""

    def __call__(self, message: str) -> None:
        self.write(message)


def _attempt(log: Log, what: str, fn: Callable[[], Batch]) -> Batch | None:
    """`fn()`, or None after logging why it failed: a contender that fails one batch (e.g.
    a mount daemon that does not start in time under load) is a result, not the end of
    the run."""
    try:
        return fn()
    except Exception as error:  # reported in the results, with the run going on
        log.last = f"{type(error).__name__}: {str(error)[-600:]}"
        log(f"  {what} FAILED: {log.last}")
        return None


def ready_rounds(contenders: dict[str, Contender], family: Family, images: Sequence[str],
                 repeats: int, scenarios: Sequence[str] = ("cold", "warm"),
                 warm_extra: Sequence[Sequence[str]] = (),
                 log: Log | None = None) -> dict[str, Any]:
    """Figure 1 and 2 for one environment of each of `images` at once:
    {scenario: {contender: [batch dicts, or {"error": why}]}}."""
    log = log or Log()
    out: dict[str, Any] = {}
    names = list(contenders)
    for scenario in scenarios:
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                what = f"{scenario:4} N={len(images):<2} {name:14}"
                batch = _attempt(log, what, partial(
                    _measure, contenders[name], family, scenario, images, warm_extra))
                samples[name].append(batch.as_dict() if batch else {"error": log.last})
                if batch:
                    log(f"  {what} all ready {batch.all_ready:6.2f} s, "
                        f"moved {batch.moved.get('bytes', 0) / 1e6:7.1f} MB")
        out[scenario] = samples
    return out


def ideal_task(peer: Peer, family: Family) -> float:
    """Seconds the scripted commands of task 1 take in a running environment whose data is
    cached (run twice; the second run is timed)."""
    handle = peer.start("task-1")
    try:
        for _ in range(2):
            start = time.perf_counter()
            for argv in family.task_commands(1):
                peer.exec(handle, argv)
            seconds = time.perf_counter() - start
    finally:
        peer.stop(handle)
    return seconds


def rl_rounds(contenders: dict[str, Contender], family: Family, k: int, think: float,
              repeats: int, warm_extra: Sequence[Sequence[str]] = (),
              log: Log | None = None) -> dict[str, Any]:
    """Figure 4: {scenario: {contender: [batch dicts or errors]}} for iterations of K
    environments."""
    log = log or Log()
    images = [f"task-{i}" for i in range(1, k + 1)]
    out: dict[str, Any] = {}
    for scenario in ("cold", "warm"):
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
        names = list(contenders)
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                what = f"RL {scenario:4} K={k:<2} {name:14}"
                batch = _attempt(log, what, partial(
                    _measure, contenders[name], family, scenario, images, warm_extra,
                    rl_think=think))
                samples[name].append(batch.as_dict() if batch else {"error": log.last})
                if batch:
                    log(f"  {what} iteration {batch.wall:6.2f} s")
        out[scenario] = samples
    return out
