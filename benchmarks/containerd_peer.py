"""containerd with one remote snapshotter, as a peer of the cold-start benchmark: what the
eStargz peer (stargz_peer.py) and the weenv snapshotter peer (snapshotter_peer.py) share.

Owns:
- `ContainerdPeer`: Debian's `containerd` (its own root, state, sockets and config under one
  folder; no CRI plugin; it listens on unix sockets only) with a snapshotter daemon as the
  proxy snapshot plugin `PLUGIN` on a socket of its own. A subclass starts and stops that
  daemon (`_start_snapshotter`, `_stop_snapshotter`) and names the folders it keeps
  (`SNAPSHOTTER_PARTS`). `reset_cold()` stops both, unmounts whatever is still mounted under
  the folder (and the kernel path's device mounts of weenv mounts there), wipes their data
  (content store, snapshots, the snapshotter's folders) and starts them again: nothing of an
  earlier round is left. `stop()` does the same, minus the restart. Containers, images and
  tasks live in namespace `weenv-bench`.
- `ctr()`, `run()`: the `ctr` client against that containerd; `ctr run` gives the container a
  network namespace of its own with nothing in it, as `docker run --network none` does.

Must not: start or stop a registry, or touch a daemon, mount or container it did not make
(daemons are stopped by pid, mounts found under its own folder or named after one there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path

from docker_peer import _stop

NAMESPACE = "weenv-bench"
START_TIMEOUT = 60.0
CLI_TIMEOUT = 1800.0
CONTAINERD_CONFIG = """\
version = 2
root = "{root}"
state = "{state}"
# The CRI plugin would start a streaming server on TCP; ctr needs none of it.
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[proxy_plugins.{plugin}]
  type = "snapshot"
  address = "{plugin_socket}"
"""


def mounts_under(folder: Path) -> list[str]:
    """Mount points at or below `folder`, deepest first (from /proc/self/mountinfo), then
    those of run folders named after one of them (weenv's kernel path keeps a mount's data
    devices in /run/weenv/kernel/<the mount point, %-quoted>/devices)."""
    prefix = str(folder.resolve())
    quoted = urllib.parse.quote(prefix + "/", safe="")
    below, named = set(), set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # field 5 is the mount point, with space, tab, newline and backslash octal-escaped
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            below.add(point)
        elif quoted in point:
            named.add(point)
    return sorted(below, key=len, reverse=True) + sorted(named, key=len, reverse=True)


class ContainerdPeer:
    """containerd + a proxy snapshotter under `folder`: `start()`, `ctr()`, `run()`,
    `reset_cold()`, `stop()`. Subclasses provide the snapshotter."""

    PLUGIN = ""  # the proxy plugin's name in containerd (`ctr run --snapshotter PLUGIN`)
    SNAPSHOTTER_PARTS: tuple[str, ...] = ()  # folders under `folder` the snapshotter keeps

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.socket = folder / "containerd.sock"
        self.plugin_socket = folder / f"{self.PLUGIN}.sock"
        self.containerd: subprocess.Popen[bytes] | None = None
        self._count = 0

    # -- the daemons --------------------------------------------------------------------------

    def _spawn(self, argv: Sequence[str], log_name: str,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.folder / log_name, "ab")  # noqa: SIM115 - the child owns it
        try:
            return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        finally:
            log.close()

    def _wait_for(self, what: str, proc: subprocess.Popen[bytes], log_name: str,
                  ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.folder / log_name).read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{what} did not start: {tail}")
            time.sleep(0.05)

    def _start_snapshotter(self) -> None:
        """Start the snapshotter daemon; return once it listens on `plugin_socket`."""
        raise NotImplementedError

    def _stop_snapshotter(self) -> None:
        """Stop the snapshotter daemon (by pid) and release what it holds."""
        raise NotImplementedError

    def start(self) -> ContainerdPeer:
        """Start the snapshotter, then containerd (which connects to it on first use)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._start_snapshotter()
        config = self.folder / "containerd.toml"
        config.write_text(CONTAINERD_CONFIG.format(
            root=self.folder / "root", state=self.folder / "state", socket=self.socket,
            opt=self.folder / "opt", plugin=self.PLUGIN, plugin_socket=self.plugin_socket))
        self.containerd = self._spawn(["containerd", "--config", str(config)],
                                      "containerd.log")

        def answers() -> bool:
            return subprocess.run(["ctr", "--address", str(self.socket), "version"],
                                  capture_output=True, check=False).returncode == 0

        self._wait_for("containerd", self.containerd, "containerd.log", answers)
        return self

    def _remove_containers(self) -> None:
        """Kill and delete every task and container of our namespace (a failed run's)."""
        for name in self.ctr("containers", "list", "--quiet").split():
            subprocess.run(self._argv("ctr", "tasks", "kill", "--signal", "SIGKILL", name),
                           capture_output=True, check=False)
            subprocess.run(self._argv("ctr", "tasks", "delete", "--force", name),
                           capture_output=True, check=False)
            subprocess.run(self._argv("ctr", "containers", "delete", name),
                           capture_output=True, check=False)

    def stop(self) -> None:
        """Stop containerd and the snapshotter (ours, by pid) and unmount everything mounted
        under the folder."""
        if self.containerd is not None:
            if self.containerd.poll() is None:
                # best effort: stopping anyway, and the unmount pass below still runs
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    self._remove_containers()
            _stop(self.containerd, 30.0)
            self.containerd = None
        self._stop_snapshotter()
        for point in mounts_under(self.folder):
            done = subprocess.run(["umount", point], capture_output=True, check=False)
            if done.returncode != 0:  # a FUSE layer whose daemon is gone: detach it
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        _remove_namespace_cgroups()

    def reset_cold(self) -> None:
        """Stop, wipe every image, snapshot and cached layer, start again."""
        self.stop()
        for part in ("root", "state", "opt", *self.SNAPSHOTTER_PARTS):
            shutil.rmtree(self.folder / part, ignore_errors=True)
        self.start()

    # -- the clients --------------------------------------------------------------------------

    def _argv(self, tool: str, *args: str) -> list[str]:
        return [tool, "--address", str(self.socket), "--namespace", NAMESPACE, *args]

    def _run(self, tool: str, *args: str) -> str:
        done = subprocess.run(self._argv(tool, *args), capture_output=True, check=False,
                              timeout=CLI_TIMEOUT)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}): "
                               f"{done.stderr.decode(errors='replace').strip()[-1000:]}")
        return done.stdout.decode(errors="replace")

    def ctr(self, *args: str) -> str:
        """Run `ctr ARGS` against our containerd; its stdout, or RuntimeError."""
        return self._run("ctr", *args)

    def run(self, ref: str, argv: Sequence[str], snapshotter: str | None = None) -> str:
        """`ctr run --rm [--snapshotter S] REF ID ARGV...`; the workload's stdout."""
        self._count += 1
        name = f"weenv-bench-{os.getpid()}-{self._count}"
        extra = ["--snapshotter", snapshotter] if snapshotter else []
        return self.ctr("run", "--rm", *extra, ref, name, *argv)


def containerd_unavailable() -> str | None:
    """Why containerd cannot run here, or None."""
    for command in ("containerd", "ctr", "containerd-shim-runc-v2"):
        if shutil.which(command) is None:
            return f"{command} not installed (Debian package containerd)"
    if shutil.which("runc") is None:
        return "runc not installed (Debian package runc)"
    if os.geteuid() != 0:
        return "containerd needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (the snapshotter mounts layers with FUSE)"
    return None


def _remove_namespace_cgroups() -> None:
    """containerd's runtime puts a task in cgroup /NAMESPACE/ID and removes only ID: remove
    the namespace's parent too, in every hierarchy, once it is empty (rmdir refuses else)."""
    for hierarchy in Path("/sys/fs/cgroup").glob("*/"):
        with contextlib.suppress(OSError):
            (hierarchy / NAMESPACE).rmdir()
