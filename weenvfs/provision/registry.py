"""How the runtime and the CLI hand sandboxes to the node's provisioner sidecar.

Owns: the spool folder (default /run/weenv/provision, or $WEENV_PROVISION_DIR):
    sandboxes/<sandbox_id>.json   one registration each (written atomically; removed on
                                  unregister); the sidecar rescans the folder every tick
    sidecar.pid                   the running sidecar's pid, flock-held while it lives
    status.json                   current figures, rewritten atomically every tick
    sidecar.log                   stderr of a sidecar started in the background
and the calls on it: `register` (applies the initial limits at once, so the sandbox is limited
from its first instant, then hands it over), `unregister` (optionally waiting until the
sidecar let go of the sandbox, its run then being in the history), `registrations`,
`running_pid`, `ensure_sidecar` / `start_sidecar` / `stop_sidecar`, `read_status`.
Must not: decide limits (policy.py) or watch cgroups (sidecar.py). A folder rather than a
socket: registrations survive a sidecar restart and need no live peer. A sidecar that says
so in its status (`"wake": "SIGUSR1"`) is signalled after each change, so that it takes the
change at once instead of at its next tick.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .cgroup_detect import detect_driver
from .cgroup_driver import MIB, CgroupDriver, CgroupLimits, ProvisionError
from .history import History, history_dir
from .policy import PolicyConfig, initial_limits

log = logging.getLogger(__name__)

DEFAULT_SPOOL = Path("/run/weenv/provision")
SPOOL_ENV = "WEENV_PROVISION_DIR"
DEFAULT_MEM = 512 * MIB  # first limits of an environment never seen on this node
DEFAULT_CPU = 1000
WAKE_SIGNALS = {"SIGUSR1": signal.SIGUSR1}  # what a sidecar's status may offer as "wake"
_SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class AlreadyRunning(ProvisionError):
    """A provisioner already runs on this node."""


def spool_dir(spool: Path | str | None = None) -> Path:
    """The spool folder: `spool`, else $WEENV_PROVISION_DIR, else /run/weenv/provision."""
    if spool is not None:
        return Path(spool)
    return Path(os.environ.get(SPOOL_ENV) or DEFAULT_SPOOL)


def node_config(driver_version: int, base: PolicyConfig | None = None) -> PolicyConfig:
    """The policy config for a driver: on v1 the hard limit is the elastic one (tasks wait)."""
    config = base or PolicyConfig()
    return replace(config, mem_max_over_high=1.0) if driver_version == 1 else config


def write_json_atomic(path: Path, data: object) -> None:
    """Write JSON to `path` through a temporary file and rename (readers see old or new)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Registration:
    """One sandbox under the provisioner."""

    sandbox_id: str
    cgroups: tuple[str, ...]
    env: str
    initial: CgroupLimits
    registered: float  # wall-clock time.time()
    mem_ceiling: int = 0  # 0: the node budget
    cpu_ceiling: int = 0

    def to_json(self) -> dict[str, object]:
        """The registration file's content."""
        return {
            "sandbox_id": self.sandbox_id,
            "cgroups": list(self.cgroups),
            "env": self.env,
            "initial": self.initial.to_json(),
            "registered": self.registered,
            "mem_ceiling": self.mem_ceiling,
            "cpu_ceiling": self.cpu_ceiling,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Registration:
        """Parse a registration file; ValueError if malformed."""
        try:
            return cls(
                sandbox_id=str(data["sandbox_id"]),
                cgroups=tuple(str(p) for p in data["cgroups"]),  # type: ignore[attr-defined]
                env=str(data["env"]),
                initial=CgroupLimits.from_json(data["initial"]),  # type: ignore[arg-type]
                registered=float(data["registered"]),  # type: ignore[arg-type]
                mem_ceiling=int(data.get("mem_ceiling", 0)),  # type: ignore[call-overload]
                cpu_ceiling=int(data.get("cpu_ceiling", 0)),  # type: ignore[call-overload]
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"malformed registration: {error}") from None


def _sandbox_file(spool: Path, sandbox_id: str) -> Path:
    if not _SANDBOX_ID.fullmatch(sandbox_id):
        raise ProvisionError(f"invalid sandbox id {sandbox_id!r} (letters, digits, ._:-)")
    return spool / "sandboxes" / f"{sandbox_id}.json"


def register(
    sandbox_id: str,
    cgroups: Sequence[str],
    env: str,
    initial: CgroupLimits | None = None,
    *,
    spool: Path | str | None = None,
    driver: CgroupDriver | None = None,
    history: History | None = None,
    config: PolicyConfig | None = None,
    mem_ceiling: int = 0,
    cpu_ceiling: int = 0,
    start: bool = False,
    memory: int | None = None,
    cpu_millis: int | None = None,
) -> Registration:
    """Put a sandbox under the node's provisioner; returns its registration.

    `cgroups` are the sandbox's cgroup directories (or one name relative to the hierarchy
    roots); `env` identifies the environment (its manifest digest), whose earlier runs on this
    node (in `history`, default `history_dir()`) seed the initial limits unless `initial` is
    given (else 512 MiB and one core); `memory` (bytes of the elastic limit) and `cpu_millis`
    override one side of the seed. The initial limits are written to the cgroup before this
    returns. `start=True` starts the sidecar if none runs.
    """
    folder = spool_dir(spool)
    path = _sandbox_file(folder, sandbox_id)
    driver = driver or detect_driver()
    cgroup = driver.resolve(cgroups)
    if not driver.exists(cgroup):
        raise ProvisionError(f"cgroup {cgroup.name} does not exist ({driver.describe()})")
    config = node_config(driver.version, config)
    if initial is None:
        seeded = (history or History(history_dir())).seed(env, config)
        seeded = seeded or initial_limits(config, DEFAULT_MEM, DEFAULT_CPU)
        initial = initial_limits(config, memory or seeded.mem_high, cpu_millis or seeded.cpu_millis)
    driver.apply(cgroup, initial)
    registration = Registration(
        sandbox_id, tuple(cgroup.paths()), env, initial, time.time(), mem_ceiling, cpu_ceiling
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, registration.to_json())
    log.info("registered sandbox %s (%s) with %s", sandbox_id, cgroup.name, initial)
    if start:
        ensure_sidecar(folder)
    wake_sidecar(folder)
    return registration


def unregister(sandbox_id: str, *, spool: Path | str | None = None, wait: float = 0.0) -> bool:
    """Take a sandbox from the provisioner (it records the run); False if it was not there.

    With `wait` > 0 and a sidecar running, return only once the sidecar no longer watches the
    sandbox (its run is in the history then, and no limit write of it is still coming), or
    after `wait` seconds (logged)."""
    folder = spool_dir(spool)
    try:
        _sandbox_file(folder, sandbox_id).unlink()
    except FileNotFoundError:
        return False
    wake_sidecar(folder)
    if wait > 0:
        _await_release(folder, sandbox_id, wait)
    return True


def _await_release(folder: Path, sandbox_id: str, timeout: float) -> None:
    """Wait until the running sidecar's status no longer lists `sandbox_id`."""
    deadline = time.monotonic() + timeout
    while running_pid(folder) is not None:
        try:
            status = json.loads((folder / "status.json").read_text(encoding="utf-8"))
            watched = status["sandboxes"]
        except (OSError, ValueError, KeyError, TypeError):
            watched = {}  # no status yet: the sidecar has not seen the sandbox either
        if sandbox_id not in watched:
            return
        if time.monotonic() > deadline:
            log.info("the provisioner still watches %s after %g s; going on", sandbox_id, timeout)
            return
        time.sleep(0.005)


def wake_sidecar(spool: Path | str | None = None) -> bool:
    """Ask the running sidecar to take registration changes now rather than at its next
    tick, if its status offers a wake-up signal; returns whether it was signalled."""
    folder = spool_dir(spool)
    try:
        status = json.loads((folder / "status.json").read_text(encoding="utf-8"))
        pid, signum = int(status["pid"]), WAKE_SIGNALS[status["wake"]]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    # The pid must be the lock holder's: a stale status may name a reused pid.
    if running_pid(folder) != pid:
        return False
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def registrations(spool: Path | str | None = None) -> dict[str, Registration]:
    """Every registration in the spool; malformed files are logged and skipped."""
    folder = spool_dir(spool) / "sandboxes"
    found: dict[str, Registration] = {}
    try:
        entries = sorted(folder.glob("*.json"))
    except OSError:
        return found
    for path in entries:
        try:
            reg = Registration.from_json(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            continue  # unregistered while we listed
        except (OSError, ValueError) as error:
            log.warning("skipping malformed registration %s: %s", path, error)
            continue
        found[reg.sandbox_id] = reg
    return found


# --- the sidecar process ------------------------------------------------------------------


@contextlib.contextmanager
def pid_lock(spool: Path) -> Iterator[None]:
    """Hold the node's sidecar lock (pidfile with our pid) for the block; AlreadyRunning."""
    spool.mkdir(parents=True, exist_ok=True)
    with open(spool / "sidecar.pid", "a+") as handle:
        for attempt in range(10):
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if attempt == 9:
                    handle.seek(0)
                    raise AlreadyRunning(
                        f"a provisioner already runs (pid {handle.read().strip()})"
                    ) from None
                time.sleep(0.05)  # someone may be probing the lock for a moment
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)


def running_pid(spool: Path | str | None = None) -> int | None:
    """The running sidecar's pid, or None."""
    path = spool_dir(spool) / "sidecar.pid"
    try:
        with open(path) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                text = handle.read().strip()
                return int(text) if text.isdigit() else None
            return None
    except FileNotFoundError:
        return None


def start_sidecar(spool: Path | str | None = None, args: Sequence[str] = ()) -> int:
    """Start `weenv provision run --foreground` in the background; its pid once it runs."""
    folder = spool_dir(spool)
    folder.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "weenvfs",
        "provision",
        "run",
        "--foreground",
        "--spool",
        str(folder),
        *args,
    ]
    with open(folder / "sidecar.log", "ab") as out:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        pid = running_pid(folder)
        if pid == process.pid:
            return pid
        if process.poll() is not None:
            if pid is not None:
                return pid  # another process started one meanwhile: ours stepped aside
            tail = (folder / "sidecar.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise ProvisionError(f"the provisioner exited at once: {' | '.join(tail)}")
        time.sleep(0.05)
    process.terminate()
    raise ProvisionError(f"the provisioner did not start within 30 s (see {folder}/sidecar.log)")


def ensure_sidecar(spool: Path | str | None = None, args: Sequence[str] = ()) -> int:
    """The running sidecar's pid, starting one if none runs."""
    return running_pid(spool) or start_sidecar(spool, args)


def stop_sidecar(spool: Path | str | None = None, timeout: float = 10.0) -> int | None:
    """SIGTERM the running sidecar and wait until it let go of its lock; its pid or None."""
    pid = running_pid(spool)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running_pid(spool) == pid:
        if time.monotonic() > deadline:
            raise ProvisionError(f"the provisioner (pid {pid}) did not stop in {timeout:g} s")
        time.sleep(0.05)
    return pid


def read_status(spool: Path | str | None = None) -> dict[str, object]:
    """The sidecar's last status (see sidecar.py); ProvisionError if none is running."""
    folder = spool_dir(spool)
    if running_pid(folder) is None:
        raise ProvisionError(f"no provisioner is running (spool {folder})")
    try:
        data = json.loads((folder / "status.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ProvisionError(f"cannot read {folder}/status.json: {error}") from None
    if not isinstance(data, dict):
        raise ProvisionError(f"{folder}/status.json is not an object")
    return data
