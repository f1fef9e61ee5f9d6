"""Helpers of the provisioner tests (fixtures using them are in conftest.py).

- `LoadProcess`: tests/provision/load_child.py, joined to a cgroup from its first
  instruction, following a script of memory and CPU demand.
- `V1Cgroups`: sandbox cgroups on the real v1 hierarchy under one `weenv-test-<pid>-<hex>`
  parent, and the load processes started in them; `cleanup()` kills those processes (by
  their Popen objects) and removes every cgroup.
- `V2Folder`: a folder laid out as a cgroup2 hierarchy, files written by `V2Folder.set`;
  `FolderV2Driver` for a sidecar whose threads write while its loop reads.
- `SidecarThread`: `Sidecar.run()` under trio in a thread, stopped and joined on exit.
- `read_events` (waiting: `support.polling.wait_for`).
Nothing here asserts timings: waits have generous deadlines that only turn a hang into a
failure.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio
from support.polling import wait_for

from weenvfs.provision.cgroup_driver import Cgroup, Write, read_mounts, remove_dirs
from weenvfs.provision.cgroup_v1 import CgroupV1Driver
from weenvfs.provision.cgroup_v2 import CgroupV2Driver
from weenvfs.provision.sidecar import Sidecar, SidecarConfig

LOAD_CHILD = Path(__file__).resolve().parent / "load_child.py"
MIB = 1 << 20


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event of a sidecar event log."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- cgroup v1 ------------------------------------------------------------------------------


def v1_unavailable_reason() -> str | None:
    """Why the real cgroup v1 memory/cpu/cpuacct hierarchies cannot be used, or None."""
    if os.geteuid() != 0:
        return "not root"
    roots = read_mounts().v1
    missing = [name for name in ("memory", "cpu", "cpuacct") if name not in roots]
    if missing:
        return f"cgroup v1 controllers not mounted: {missing}"
    for root in roots.values():
        if not os.access(root, os.W_OK):
            return f"{root} is not writable"
    return None


class LoadProcess:
    """load_child.py in a cgroup; reads its `start`/`ok` lines."""

    def __init__(self, cgroup: Cgroup, script: str | None = None) -> None:
        command = [sys.executable, str(LOAD_CHILD)]
        for path in sorted({str(d / "cgroup.procs") for d in cgroup.dirs.values()}):
            command += ["--join", path]
        if script is not None:
            command += ["--script", script]
        self.popen = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.lines: list[str] = []
        self.expect("ready")

    @property
    def pid(self) -> int:
        return self.popen.pid

    def send(self, command: str) -> None:
        """Send one command line."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()

    def expect(self, prefix: str, timeout: float = 60.0) -> float:
        """Wait for the next line starting with `prefix`; its monotonic timestamp."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.popen.stdout, selectors.EVENT_READ)
            while True:
                if time.monotonic() > deadline or not selector.select(deadline - time.monotonic()):
                    pytest.fail(f"load process: no {prefix!r} line in {timeout:g} s: {self.lines}")
                line = self.popen.stdout.readline()
                if not line:
                    pytest.fail(f"load process exited ({self.popen.poll()}) before {prefix!r}")
                self.lines.append(line.strip())
                if line.startswith(prefix):
                    return float(line.split()[-1])

    def run(self, command: str, timeout: float = 60.0) -> tuple[float, float]:
        """Send `command` and wait until it is done: (start, end) monotonic timestamps."""
        self.send(command)
        return self.expect(f"start {command}", timeout), self.expect(f"ok {command}", timeout)

    def kill(self) -> None:
        """Kill and reap the process (ours, by its Popen)."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()


class V1Cgroups:
    """Creates sandbox cgroups under one test parent and starts load processes in them."""

    def __init__(self, driver: CgroupV1Driver) -> None:
        self.driver = driver
        self.parent = f"weenv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.made: list[Cgroup] = []
        self.processes: list[LoadProcess] = []

    def make(self, name: str) -> Cgroup:
        cgroup = self.driver.create(f"{self.parent}/{name}")
        self.made.append(cgroup)
        return cgroup

    def load(self, cgroup: Cgroup, script: str | None = None) -> LoadProcess:
        process = LoadProcess(cgroup, script)
        self.processes.append(process)
        return process

    def cleanup(self) -> None:
        for process in self.processes:
            process.kill()
        for cgroup in reversed(self.made):
            self.driver.remove(cgroup)
        remove_dirs([root / self.parent for root in self.driver.roots.values()])


# --- cgroup v2 as a folder ----------------------------------------------------------------


class FolderV2Driver(CgroupV2Driver):
    """The v2 driver on a folder: writes go through rename, as a cgroupfs write is atomic
    (a reader never sees a half-written value) and a plain file's truncate + write is not."""

    def _write(self, path: Path, value: str, usage: int, clamped: bool = False) -> Write:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(value)
        os.replace(tmp, path)
        return Write(path.name, value, usage, clamped)


class V2Folder:
    """A folder with the files of cgroup2 sandboxes, and their driver."""

    DEFAULTS = {
        "memory.current": "104857600",
        "memory.high": "max",
        "memory.max": "max",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.stat": "anon 90000000\nfile 10000000\ninactive_file 4194304\n",
        "memory.pressure": (
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        ),
        "cpu.max": "max 100000",
        "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\nnr_periods 0\n"
        "nr_throttled 0\nthrottled_usec 0\n",
        "cpu.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        "cgroup.procs": "",
    }

    def __init__(self, root: Path) -> None:
        self.root = root
        self.driver = CgroupV2Driver(root)
        # For a sidecar reading while its threads write (see FolderV2Driver).
        self.threaded_driver = FolderV2Driver(root)

    def make(self, name: str, **files: str) -> Cgroup:
        """A sandbox folder with the default files, `files` (dots as underscores) on top."""
        cgroup = self.driver.create(name)
        self.set(cgroup, **{k.replace(".", "_"): v for k, v in self.DEFAULTS.items()})
        self.set(cgroup, **files)
        return cgroup

    def set(self, cgroup: Cgroup, **files: str) -> None:
        """Write files, named with underscores for dots: memory_current='123'."""
        for key, value in files.items():
            path = cgroup.dirs["unified"] / key.replace("_", ".", 1)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(value)
            os.replace(tmp, path)  # atomic, as the kernel's files are

    def get(self, cgroup: Cgroup, name: str) -> str:
        return (cgroup.dirs["unified"] / name).read_text().strip()


# --- the sidecar in a thread ----------------------------------------------------------------


class SidecarThread:
    """`Sidecar.run()` in its own thread and trio loop, for synchronous tests."""

    def __init__(self, config: SidecarConfig, driver: Any) -> None:
        self.config = config
        self.driver = driver
        self.sidecar: Sidecar | None = None
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=self._main, name="sidecar", daemon=True)

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as error:  # re-raised in the test's thread
            self.error = error
        finally:
            self._started.set()

    async def _run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self.sidecar = Sidecar(self.config, self.driver)
        self._started.set()
        await self.sidecar.run()

    def __enter__(self) -> SidecarThread:
        self._thread.start()
        self._started.wait(30)
        if self.error is not None:
            raise self.error
        return self

    def ticks(self) -> int:
        return 0 if self.sidecar is None else self.sidecar.ticks

    def wait_ticks(self, count: int) -> None:
        """Wait until `count` more ticks have run."""
        target = self.ticks() + count
        wait_for(lambda: self.ticks() >= target or self.error, f"{count} sidecar ticks")
        if self.error is not None:
            raise self.error

    def __exit__(self, *exc: object) -> None:
        if self._token is not None and self._thread.is_alive() and self.sidecar is not None:
            trio.from_thread.run_sync(self.sidecar.stop, trio_token=self._token)
        self._thread.join(30)
        if self._thread.is_alive():
            pytest.fail("the sidecar did not stop within 30 s")
        if self.error is not None and exc[0] is None:
            raise self.error
