"""Fixtures of the snapshotter tests (tests/snapshotter/conftest.py re-exports them): real
containerd, a real registry, `weenv snapshotter`.

- `node` (module): a store holding the Debian minbase sample as group `minbase:t` plus a small
  task group over it, composed into two environments (`one` = minbase, `two` = minbase +
  task); a registry (Debian docker-registry, tests/support/registry.py); a snapshotter
  (`python -m weenvfs snapshotter`, its own socket, root and chunk cache under the module's
  tmp folder, its metrics and the node's on 127.0.0.1, any free port: `Node.scrape()`);
  containerd 1.6 with its own root, state, config and sockets there too, and the
  snapshotter as proxy plugin `weenv`. Every process is stopped by its pid; containerd's
  leftover mounts under its own root are unmounted, and the group mounts of this module's
  cache are evicted.
- `Node.ctr(...)`, `Node.weenv(...)`: run `ctr` against that containerd / the CLI.

Tests that use `node` need root, containerd, ctr, runc, docker-registry and FUSE (the
`containerd_requirements` fixture): without them they skip with the reason
(WEENVFS_TEST_STRICT=1 turns the skip into a failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import trees
from support.registry import run_registry
from support.runtime import runtime_unavailable, sample_store
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.runtime import mounts
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group, open_source
from weenvfs.tools.publish import compose_env
from weenvfs.tools.registry_server import RegistryServer

STARTUP_TIMEOUT = 60.0  # seconds for containerd or the snapshotter to answer
CONFIG = """\
version = 2
root = "{root}/root"
state = "{root}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{root}/containerd.sock"
[ttrpc]
  address = "{root}/containerd.sock.ttrpc"
[debug]
  address = "{root}/debug.sock"
[proxy_plugins]
  [proxy_plugins.weenv]
    type = "snapshot"
    address = "{snapshotter}"
"""


def unavailable() -> str | None:
    """Why containerd cannot run here, or None."""
    for tool, package in (("containerd", "containerd"), ("ctr", "containerd"),
                          ("containerd-shim-runc-v2", "containerd"),
                          ("docker-registry", "docker-registry")):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian package {package})"
    return runtime_unavailable()


@pytest.fixture
def containerd_requirements(requires_fuse: None,
                             require_or_skip: Callable[[object, str], None]) -> None:
    reason = unavailable()
    require_or_skip(reason is None, reason or "")


@dataclass
class Node:
    """Everything one module's tests run against."""

    tmp: Path
    store: Path
    registry: RegistryServer
    cache: Path
    snap_socket: Path
    snap_root: Path
    ctd_root: Path
    envs: dict[str, str]  # name -> manifest digest
    snapshotter: subprocess.Popen[bytes] | None = None
    containerd: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.ctd_root / "containerd.sock"

    def ctr(self, *args: str, check: bool = True, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["ctr", "-a", str(self.socket), *args], capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)}: {done.stderr or done.stdout}")
        return done

    def weenv(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "weenvfs", *args], capture_output=True,
                              text=True, timeout=300)
        if check and done.returncode != 0:
            raise AssertionError(f"weenv {' '.join(args)}: {done.stderr}")
        return done

    def start_snapshotter(self) -> None:
        log = open(self.tmp / "snapshotter.log", "ab")  # noqa: SIM115 - the child keeps it
        self.snapshotter = subprocess.Popen(
            [sys.executable, "-m", "weenvfs", "-v", "snapshotter", "--store", str(self.store),
             "--socket", str(self.snap_socket), "--root", str(self.snap_root),
             "--cache", str(self.cache), "--metrics", "127.0.0.1:0", "--node-metrics"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_for(lambda: self.snap_socket.exists(), self.snapshotter, "the snapshotter")

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The snapshotter's metrics now: (sample name, sorted labels) -> value."""
        address = (self.snap_socket.parent / (self.snap_socket.name + ".metrics")).read_text()
        with urllib.request.urlopen(f"http://{address.strip()}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop_snapshotter(self) -> None:
        _stop(self.snapshotter)
        self.snapshotter = None

    def start_containerd(self) -> None:
        config = self.ctd_root / "config.toml"
        config.write_text(CONFIG.format(root=self.ctd_root, snapshotter=self.snap_socket))
        log = open(self.tmp / "containerd.log", "ab")  # noqa: SIM115
        self.containerd = subprocess.Popen(["containerd", "--config", str(config)],
                                           stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_for(lambda: self.ctr("version", check=False).returncode == 0, self.containerd,
                  "containerd")

    def snapshots(self) -> list[str]:
        """Keys of the snapshots containerd knows in the weenv snapshotter."""
        out = self.ctr("snapshots", "--snapshotter", "weenv", "ls").stdout.splitlines()[1:]
        return [line.split()[0] for line in out if line.strip()]

    def leases(self) -> list[str]:
        """IDs of containerd's leases."""
        return self.ctr("leases", "ls", "-q").stdout.split()

    def content(self) -> set[str]:
        """Digests of containerd's content store."""
        return set(self.ctr("content", "ls", "-q").stdout.split())

    def our_mounts(self) -> list[str]:
        """Mount points of this module's group mounts and containerd's root still mounted."""
        found = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4]
            if point.startswith((str(self.ctd_root), str(self.snap_root))):
                found.append(point)
        keys = {m.key for m in mounts.list_mounts() if m.mounted
                and _cache_of(m.key) == str(self.cache)}
        return found + sorted(keys)

    def group_mounts(self) -> list[dict[str, Any]]:
        """The rows of `weenv mounts --json` of this node's mounted group mounts (those of its
        chunk cache)."""
        rows = json.loads(self.weenv("mounts", "--json").stdout)
        return [r for r in rows if r["mounted"] and _cache_of(r["key"]) == str(self.cache)]

    def push(self, env: str, tag: str, *extra: str) -> str:
        """`weenv push` environment `env` (its v1) as `<registry>/<env>:<tag>`; the ref."""
        ref = f"{self.registry.host}/{env}:{tag}"
        done = self.weenv("push", f"{env}:v1", ref, "--store", str(self.store), "--insecure",
                          "--json", *extra)
        assert json.loads(done.stdout)["manifest"] == self.envs[env]
        return ref

    def pull(self, ref: str, *extra: str, check: bool = True
             ) -> subprocess.CompletedProcess[str]:
        """`weenv pull` of `ref` into this containerd."""
        return self.weenv("pull", ref, "--insecure", "--containerd-socket", str(self.socket),
                          *extra, check=check)

    def run(self, ref: str, name: str, *command: str) -> int:
        """`ctr run --rm` of `ref` with the weenv snapshotter; the container's exit code.
        (Exit codes, not output: ctr 1.6 `run` sometimes ends before the output of a short
        task is copied.)"""
        return self.ctr("run", "--rm", "--snapshotter", "weenv", ref, name, *command,
                        check=False).returncode

    def remove_image(self, ref: str) -> None:
        """`ctr images rm --sync`; then nothing of it is left: no snapshot, mount or
        folder."""
        self.ctr("images", "rm", "--sync", ref)
        assert self.snapshots() == []
        assert self.our_mounts() == []
        assert list((self.snap_root / "snapshots").iterdir()) == []


def _cache_of(key: str) -> str | None:
    info = mounts.env_dir(key) / "mount.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(info.read_text()).get("cache")
    return None


def _wait_for(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if ready():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer within {STARTUP_TIMEOUT} s")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _task_group(root: Path) -> Path:
    """A small tree for the task group: a new file, a changed file, a whiteout's target."""
    return trees.make_tree(
        root, trees.dir("work"), trees.file("work/task.txt", b"the task\n" * 1000),
        trees.file("etc/motd", b"a task environment\n"))


def _publish(tmp: Path) -> tuple[Path, dict[str, str]]:
    store = sample_store(tmp, "minbase", "minbase")
    with open_store(str(store)) as opened:
        repo = Repository(opened)
        build_group(open_source(_task_group(tmp / "task")), repo, "task", "t")
        config = RuntimeConfig(env=("PATH=/usr/sbin:/usr/bin:/sbin:/bin", "TASK=1"),
                               # Exits 0 only in the task's cwd with the task's env.
                               cwd="/work", cmd=("/bin/sh", "-c",
                                                 'test "$TASK" = 1 && test -s task.txt'))
        one = compose_env(repo, "one", "v1", ["minbase:t"], None, {})
        two = compose_env(repo, "two", "v1", ["minbase:t", "task:t"], config, {})
    return store, {"one": one, "two": two}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    if unavailable() is not None:
        pytest.skip(unavailable() or "")
    tmp = tmp_path_factory.mktemp("ctd")
    store, envs = _publish(tmp)
    # Short paths: unix sockets take 107 bytes at most.
    short = Path(os.environ.get("TMPDIR", "/tmp")) / f"weenv-ctd-{os.getpid()}-{tmp.name}"
    short.mkdir()
    with run_registry(tmp / "registry") as registry:
        n = Node(tmp, store, registry, tmp / "cache", short / "snap.sock", tmp / "snaproot",
                 short / "ctd", envs)
        n.ctd_root.mkdir()
        try:
            n.start_snapshotter()
            n.start_containerd()
            yield n
        finally:
            _stop(n.containerd)
            n.stop_snapshotter()
            _release_everything(n)
            shutil.rmtree(short, ignore_errors=True)


def _release_everything(n: Node) -> None:
    """After containerd stopped: unmount what it left under its root, evict our mounts."""
    for point in sorted((p for p in n.our_mounts() if p.startswith("/")), reverse=True):
        subprocess.run(["umount", "-l", point], check=False)
    for mount in mounts.list_mounts():
        if _cache_of(mount.key) == str(n.cache):
            with contextlib.suppress(Exception):
                mounts.evict(mount.key, force=True)
