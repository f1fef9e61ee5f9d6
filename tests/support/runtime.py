"""Helpers for the runtime tests: what the node holds for sandboxes, and a forced clean-up.

Owns: `NodeSnapshot` (sandbox folders, runc and crun containers, cgroups under /weenv, mounts under
/run/weenv, upper dirs, env folders, processes inside sandbox cgroups, and loop devices of
--disk uppers), `leaks(before,
after)` and `force_cleanup(ids)`, which removes sandboxes a failed test left (through the
real `Sandbox.destroy` and `weenv sandbox gc`), plus `run_weenv` for CLI tests,
`sample_store` (a sample tree built as a group), `controller` (a process holding a
sandbox, for kill -9 tests) and `gc_over_an_orphan` (gc's report on an orphan a test made).

Must not: touch anything that was there before the test began.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from weenvfs.errors import UsageError
from weenvfs.runtime import cgroups, mounts, sandbox, sandbox_state
from weenvfs.runtime.crun import CRUN_ROOT
from weenvfs.runtime.launcher import RUNC_ROOT

CLI_TIMEOUT = 120.0


def run_weenv(
    *args: str, check: bool = True, timeout: float = CLI_TIMEOUT, input: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`python -m weenvfs ARGS` in a subprocess."""
    done = subprocess.run(
        [sys.executable, "-m", "weenvfs", *args],
        capture_output=True,
        timeout=timeout,
        check=False,
        input=input,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"weenv {' '.join(args)} failed ({done.returncode}):\n"
            f"{done.stderr.decode(errors='replace')}"
        )
    return done


@contextlib.contextmanager
def started_run(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` (a `weenv run` whose command prints `started` first) started, with its stdout
    and stderr piped, once that line is out; killed at the end if it still runs."""
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline() == b"started\n"
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def owned_by(pid: int) -> list[str]:
    """Ids of the sandboxes process `pid` owns (a detached one, `sandbox create`d, has no
    owner; one removed meanwhile is skipped)."""
    found = []
    for sandbox_id in sandbox_state.list_ids():
        try:
            owner = sandbox.Sandbox.load(sandbox_id).state.get("owner")
        except UsageError:
            continue
        if owner is not None and owner.get("pid") == pid:
            found.append(sandbox_id)
    return found


def _names(folder: Path) -> set[str]:
    try:
        return {p.name for p in folder.iterdir()}
    except FileNotFoundError:
        return set()


def _weenv_mounts() -> set[str]:
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
        targets = {line.split()[1] for line in f if len(line.split()) > 1}
    return {t for t in targets if t.startswith("/run/weenv/")}


def loop_devices() -> set[str]:
    """Backing files of the loop devices that hold sandboxes' upper layers (--disk)."""
    found = set()
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            name = backing.read_text().strip().removesuffix(" (deleted)")
            if name.startswith(f"{sandbox.UPPERS_ROOT}/"):
                found.add(name)
    return found


def _sandbox_cgroups() -> set[str]:
    found = set()
    for parent in cgroups.cgroup_dirs(f"/{cgroups.CGROUP_PARENT}"):
        found |= {str(p) for p in parent.iterdir() if p.is_dir()}
    return found


def _sandbox_processes(cgroup_dirs: set[str]) -> set[tuple[int, str]]:
    """(pid, sandbox id) of every process in a sandbox cgroup."""
    pids: set[tuple[int, str]] = set()
    for folder in cgroup_dirs:
        with contextlib.suppress(OSError, ValueError):
            text = (Path(folder) / "cgroup.procs").read_text()
            pids |= {(int(x), Path(folder).name) for x in text.split()}
    return pids


@dataclass(frozen=True)
class NodeSnapshot:
    """Everything sandboxes leave on a node."""

    sandboxes: frozenset[str]
    containers: frozenset[str]
    cgroups: frozenset[str]
    mounts: frozenset[str]
    uppers: frozenset[str]
    envs: frozenset[str]
    processes: frozenset[tuple[int, str]]
    loops: frozenset[str]

    @classmethod
    def take(cls) -> NodeSnapshot:
        groups = _sandbox_cgroups()
        return cls(
            frozenset(_names(sandbox.SANDBOXES_ROOT)),
            frozenset(_names(RUNC_ROOT) | _names(CRUN_ROOT)),
            frozenset(groups),
            frozenset(_weenv_mounts()),
            frozenset(_names(sandbox.UPPERS_ROOT)),
            frozenset(_names(mounts.ENVS_ROOT)),
            frozenset(_sandbox_processes(groups)),
            frozenset(loop_devices()),
        )


def _digest_of(sandbox_id: str) -> str | None:
    """The environment digest in a sandbox's state, or None without a state."""
    try:
        state = json.loads((sandbox.SANDBOXES_ROOT / sandbox_id / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return str(state.get("env", {}).get("digest"))


def _sandbox_id(kind: str, item: object) -> str:
    """The sandbox a sandbox item (not an environment's) belongs to."""
    if kind == "processes":
        return str(item[1])  # type: ignore[index]
    text = str(item)
    if kind == "cgroups":
        return Path(text).name
    if kind == "mounts":
        return Path(text).parts[4]  # /run/weenv/sandboxes/ID/rootfs
    if kind == "loops":  # UPPERS_ROOT/ID/disk.img
        return Path(text).parent.name
    if kind == "uppers" and text.startswith(".trash-"):
        return text[len(".trash-") :].rsplit("-", 1)[0]
    return text


def _ours(kind: str, item: object, digests: set[str]) -> bool:
    """Whether a new item belongs to this test: its environment is one of the test's, or it
    has no sandbox state any more (a sandbox's state outlives everything else it has, so a
    leftover without a state is a leak, whoever made it). Other users of the node (other
    sandboxes running meanwhile) are left out."""
    if kind == "envs":
        return str(item) in digests
    parts = Path(str(item)).parts
    if kind == "mounts" and parts[3] == "envs":  # /run/weenv/envs/DIGEST/root
        return parts[4] in digests
    if kind == "mounts" and parts[3] == "kernel":  # /run/weenv/kernel/<quoted mp>/devices
        served = Path(urllib.parse.unquote(parts[4])).parts
        return served[:4] == ("/", "run", "weenv", "envs") and served[4] in digests
    if kind == "mounts" and parts[3] != "sandboxes":  # another area's
        return False
    sandbox_id = _sandbox_id(kind, item)
    digest = _digest_of(sandbox_id)
    if digest is None and kind == "sandboxes":
        digest = _settled_digest(sandbox_id)
    return digest is None or digest in digests


def _settled_digest(sandbox_id: str, wait: float = 3.0) -> str | None:
    """The digest of a sandbox folder seen without a state: another job's sandbox may be
    between its folder and its first state (create) or between its state and the folder's
    removal (destroy); everything else of a sandbox lives while its state does. None only if
    the folder stays stateless for `wait` seconds (a leak); "" once it is gone."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if not (sandbox.SANDBOXES_ROOT / sandbox_id).exists():
            return ""
        digest = _digest_of(sandbox_id)
        if digest is not None:
            return digest
    return None


def leaks(before: NodeSnapshot, after: NodeSnapshot, digests: set[str]) -> dict[str, list[object]]:
    """What `after` has that `before` had not and belongs to this test, by kind."""
    found: dict[str, list[object]] = {}
    for kind in ("sandboxes", "containers", "cgroups", "mounts", "uppers", "envs", "processes",
                 "loops"):
        new = [
            item
            for item in getattr(after, kind) - getattr(before, kind)
            if _ours(kind, item, digests)
        ]
        if new:
            found[kind] = sorted(new, key=str)
    return found


def force_cleanup(before: NodeSnapshot, digests: set[str]) -> None:
    """Remove this test's leftovers: its sandboxes (the real teardown), then upper dirs and
    environment mounts of its environments."""
    for sandbox_id in sorted(set(_names(sandbox.SANDBOXES_ROOT)) - before.sandboxes):
        if _digest_of(sandbox_id) not in digests:
            continue
        try:
            sandbox.Sandbox.load(sandbox_id).destroy(keep_upper=False)
        except Exception as error:  # keep cleaning; the leak report says what is left
            print(f"cleanup of {sandbox_id} failed: {error}", file=sys.stderr)
    for digest in sorted(digests & (set(_names(mounts.ENVS_ROOT)) - before.envs)):
        mounts.expire(digest, sandbox.exists, now=float("inf"))


def pid_visible(pid: int) -> bool:
    """Whether `pid` still exists (zombies included) on the host."""
    return os.path.exists(f"/proc/{pid}")


@dataclass(frozen=True)
class EnvRef:
    """An environment published for one test."""

    ref: str
    store: Path
    digest: str
    cache: Path
    keys: tuple[str, ...] = ()  # the shared mounts its sandboxes use (lowers.py), topmost first

    def mountpoint(self) -> Path:
        """The topmost shared mount of its sandboxes (with one group, the only one)."""
        return mounts.mountpoint(self.keys[0])


def compose_and_record(store: Path, name: str, group: str, cache: Path,
                       test_digests: set[str], *extra: str) -> tuple[str, str]:
    """`weenv compose NAME --group GROUP --store STORE --hint-cache CACHE EXTRA...`, which
    records a hint after publishing (the seed, or --hint-command's); (its digest, its
    stderr) once it succeeded and printed nothing but the digest. The environment and its
    recording mount go into `test_digests` (the node must be clean of them after)."""
    from weenvfs.runtime.recording import recording_key
    from weenvfs.store import open_store

    done = subprocess.run(
        [sys.executable, "-m", "weenvfs", "compose", name, "--group", group, "--store",
         str(store), "--hint-cache", str(cache), *extra],
        capture_output=True, timeout=300, check=False)
    digest = done.stdout.decode().strip()
    if len(digest) == 64:
        with open_store(str(store)) as opened:
            test_digests.update({digest, *(recording_key(digest, opened.url, cache, tag)
                                           for tag in ("latest", "seed"))})
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines() == [digest]  # stdout stays the digest
    return digest, done.stderr.decode()


def runtime_unavailable() -> str | None:
    """Why sandboxes cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "sandboxes need root"
    for tool, package in (("runc", "runc"), ("catatonit", "catatonit")):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian package {package})"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlayfs"
    return None


def sample_store(folder: Path, profile: str, group: str) -> Path:
    """A LocalStore at `folder/store` holding group `GROUP:t` built from the cached sample
    tree `profile` (tools/sample.py) with the real builder."""
    from weenvfs.store import open_store
    from weenvfs.store.repository import Repository
    from weenvfs.tools.builder import build_group, open_source
    from weenvfs.tools.sample import sample_tree

    tree = sample_tree(None, profile, progress=False)
    path = folder / "store"
    store = open_store(str(path), create=True)
    try:
        build_group(open_source(tree), Repository(store), group, "t")
    finally:
        store.close()
    return path


# A process that opens a sandbox, prints its id and sleeps: what a test kills with -9 to leave
# an orphan for `weenv sandbox gc`. Arguments: REF STORE CACHE ELASTIC(0/1) [COMMAND].
CONTROLLER = """
import sys, time
from weenvfs.runtime.environment import Environment
env = Environment.open(sys.argv[1], store=sys.argv[2], cache=sys.argv[3],
                       elastic=sys.argv[4] == "1")
if len(sys.argv) > 5:
    env.exec(sys.argv[5])
print(env.id, flush=True)
time.sleep(1000)
"""


@contextlib.contextmanager
def controller(env: EnvRef, *, elastic: bool = False,
               command: str | None = None) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run CONTROLLER for `env` (running `command` in its sandbox first); yields the process
    and its sandbox id. The process is killed at the end if the test has not."""
    child = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, env.ref, str(env.store), str(env.cache),
         "1" if elastic else "0", *([command] if command else [])],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        yield child, child.stdout.readline().decode().strip()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


ORPHAN_TRIES = 3


def gc_over_an_orphan(make_orphan: Callable[[], str]) -> tuple[str, dict[str, list[str]]]:
    """`weenv sandbox gc --json` run once `make_orphan()` has left an orphaned sandbox (its
    id); that id and gc's report. The node service's housekeeping removes orphans too (after
    any sandbox's release, and every minute), so it may take this one before gc does; the
    orphan is then made again, up to ORPHAN_TRIES times. A gc that removes it without saying
    so is taken for that race every time, and fails here."""
    for _ in range(ORPHAN_TRIES):
        sandbox_id = make_orphan()
        report = json.loads(run_weenv("sandbox", "gc", "--json").stdout)
        if sandbox_id in report["sandboxes"] or sandbox_state.exists(sandbox_id):
            return sandbox_id, report
    raise AssertionError(
        f"gc never reported an orphan in {ORPHAN_TRIES} tries (gone before it ran each time)"
    )
