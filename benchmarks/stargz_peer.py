"""eStargz, the lazy-pulling peer users would pick instead of WeEnv: containerd with the stargz
snapshotter, started and stopped by this process, and a cold pull + run of one image.

Owns:
- `StargzPeer`: Debian's `containerd` (its own root, state, sockets and config under one
  folder; no CRI plugin; it listens on unix sockets only) with the stargz snapshotter daemon
  as a proxy snapshot plugin named `stargz` on a socket of its own. The daemon is
  scripts/bench-peers.sh's build of benchmarks/stargz_grpc/main.go (Debian ships the library,
  not the daemon). `reset_cold()` stops both, unmounts whatever is still mounted under the
  folder, wipes their data (content store, snapshots, the snapshotter's layer cache) and
  starts them again: nothing of an earlier round is left. `stop()` does the same, minus the
  restart. Containers, images and tasks live in namespace `weenv-bench`.
- `StargzPeer.convert`: an image of our registry to eStargz with Debian's `ctr-remote`
  (`image optimize --oci --no-optimize`: no workload recorded, as the issue measured "no
  optimization"; `optimize=True` records the workload's file accesses and prioritizes them),
  pushed back to the registry as `NAME-esgz` (or `NAME-esgz-opt`), once per registry folder.
- `ColdStargzRun` (`ctr-remote image rpull --plain-http` + `ctr run --rm --snapshotter
  stargz`) and `ColdContainerdRun` (`ctr image pull --plain-http` + `ctr run --rm`, the
  overlayfs snapshotter, the original gzip image): `run()` makes the peer cold, drops the page
  cache and times pull + run of the workload; the registry's bytes sent are reported with it.
  `ctr run` gives the container a network namespace of its own with nothing in it, as
  `docker run --network none` does.

Must not: start or stop the registry (the caller owns it), touch a daemon, mount or container
it did not make (daemons are stopped by pid, mounts found under its own folder), or download
anything (bench-peers.sh built the daemon offline).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import timed
from _mounting import can_drop_caches, drop_caches
from docker_peer import Registry, RegistryMeter, _stop

BENCH_CACHE = Path(os.environ.get("WEENV_BENCH_CACHE") or "/var/cache/weenv-bench")
STARGZ_GRPC = BENCH_CACHE / "bin" / "stargz-grpc"  # built by scripts/bench-peers.sh
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
[proxy_plugins.stargz]
  type = "snapshot"
  address = "{stargz_socket}"
"""


def stargz_unavailable() -> str | None:
    """Why the eStargz peer cannot run here, or None (`scripts/setup.sh --bench` installs it)."""
    for command, package in (("containerd", "containerd"), ("ctr", "containerd"),
                             ("ctr-remote", "stargz-snapshotter"),
                             ("docker-registry", "docker-registry"), ("skopeo", "skopeo")):
        if shutil.which(command) is None:
            return f"{command} not installed (Debian package {package}; scripts/setup.sh --bench)"
    if not os.access(STARGZ_GRPC, os.X_OK):
        return f"{STARGZ_GRPC} not built (scripts/bench-peers.sh builds it)"
    if os.geteuid() != 0:
        return "containerd needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (the stargz snapshotter mounts layers with FUSE)"
    return None


def _mounts_under(folder: Path) -> list[str]:
    """Mount points at or below `folder`, deepest first (from /proc/self/mountinfo)."""
    prefix = str(folder.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # field 5 is the mount point, with space, tab, newline and backslash octal-escaped
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return sorted(set(found), key=len, reverse=True)


class StargzPeer:
    """containerd + the stargz snapshotter of ours under `folder`: `start()`, `ctr()`,
    `reset_cold()`, `stop()`."""

    def __init__(self, folder: Path, snapshotter_args: Sequence[str] = ()) -> None:
        self.folder = folder
        self.socket = folder / "containerd.sock"
        self.stargz_socket = folder / "stargz.sock"
        self.snapshotter_args = list(snapshotter_args)
        self.containerd: subprocess.Popen[bytes] | None = None
        self.stargz: subprocess.Popen[bytes] | None = None
        self._count = 0

    # -- the daemons --------------------------------------------------------------------------

    def _spawn(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.folder / log_name, "ab")  # noqa: SIM115 - the child owns it
        try:
            return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def _wait_for(self, what: str, proc: subprocess.Popen[bytes], log_name: str,
                  ready: Any) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.folder / log_name).read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{what} did not start: {tail}")
            time.sleep(0.05)

    def start(self) -> StargzPeer:
        """Start the snapshotter, then containerd (which connects to it on first use)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stargz = self._spawn([str(STARGZ_GRPC), "-address", str(self.stargz_socket),
                                   "-root", str(self.folder / "stargz"),
                                   *self.snapshotter_args], "stargz.log")
        self._wait_for("the stargz snapshotter", self.stargz, "stargz.log",
                       self.stargz_socket.exists)
        config = self.folder / "containerd.toml"
        config.write_text(CONTAINERD_CONFIG.format(
            root=self.folder / "root", state=self.folder / "state", socket=self.socket,
            opt=self.folder / "opt", stargz_socket=self.stargz_socket))
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
        """Stop both daemons (ours, by pid) and unmount everything mounted under the folder."""
        if self.containerd is not None:
            if self.containerd.poll() is None:
                # best effort: stopping anyway, and the unmount pass below still runs
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    self._remove_containers()
            _stop(self.containerd, 30.0)
            self.containerd = None
        if self.stargz is not None:
            _stop(self.stargz, 30.0)
            self.stargz = None
        for point in _mounts_under(self.folder):
            done = subprocess.run(["umount", point], capture_output=True, check=False)
            if done.returncode != 0:  # a FUSE layer whose daemon is gone: detach it
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)

    def reset_cold(self) -> None:
        """Stop, wipe every image, snapshot and cached layer, start again."""
        self.stop()
        for part in ("root", "state", "stargz", "opt"):
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

    def ctr_remote(self, *args: str) -> str:
        """Run `ctr-remote ARGS` (ctr plus the stargz commands) against our containerd."""
        return self._run("ctr-remote", *args)

    def run(self, ref: str, argv: Sequence[str], snapshotter: str | None = None) -> str:
        """`ctr run --rm [--snapshotter S] REF ID ARGV...`; the workload's stdout."""
        self._count += 1
        name = f"weenv-bench-{os.getpid()}-{self._count}"
        extra = ["--snapshotter", snapshotter] if snapshotter else []
        return self.ctr("run", "--rm", *extra, ref, name, *argv)

    # -- eStargz images -----------------------------------------------------------------------

    def convert(self, registry: Registry, name: str, key: dict[str, Any],
                optimize_argv: Sequence[str] | None = None) -> str:
        """Make `registry` hold `NAME:latest` converted to eStargz as `NAME-esgz:latest`
        (`NAME-esgz-opt` with `optimize_argv`: the workload's accesses recorded first),
        unless it already does for `key`; returns the eStargz image's name."""
        target = f"{name}-esgz-opt" if optimize_argv else f"{name}-esgz"
        stamp = registry.root / f"converted-{target}.json"
        try:
            if json.loads(stamp.read_text()) == key:
                return target
        except (OSError, ValueError):
            pass
        print(f"stargz: converting {name} to eStargz as {target} (once)", flush=True)
        src, dst = f"{registry.host}/{name}:latest", f"{registry.host}/{target}:latest"
        self.ctr("image", "pull", "--plain-http", src)
        if optimize_argv:
            # ctr-remote runs the workload once in the image and puts what it read first
            how = ["--entrypoint", json.dumps([optimize_argv[0]]),
                   "--args", json.dumps(list(optimize_argv[1:]))]
        else:
            how = ["--no-optimize"]
        self.ctr_remote("image", "optimize", "--oci", *how, src, dst)
        self.ctr("image", "push", "--plain-http", dst)
        stamp.write_text(json.dumps(key, sort_keys=True))
        self.reset_cold()
        return target


class ColdStargzRun:
    """`run()`: a cold `ctr-remote image rpull --plain-http` (layers mounted lazily) +
    `ctr run --rm --snapshotter stargz` of `argv`."""

    label = "eStargz (containerd + stargz, lazy)"

    def __init__(self, peer: StargzPeer, registry: Registry, name: str,
                 argv: Sequence[str]) -> None:
        self.peer, self.meter = peer, RegistryMeter(registry)
        self.ref = f"{registry.host}/{name}:latest"
        self.argv = list(argv)

    def pull_and_run(self) -> None:
        self.peer.ctr_remote("image", "rpull", "--plain-http", self.ref)
        self.peer.run(self.ref, self.argv, snapshotter="stargz")

    def run(self) -> tuple[float, dict[str, Any]]:
        """Time pull + run from a cold peer; (seconds, {"bytes_fetched": registry bytes})."""
        self.peer.reset_cold()
        if can_drop_caches():
            drop_caches()
        self.meter.begin()
        seconds, _ = timed(self.pull_and_run)
        return seconds, {"bytes_fetched": self.meter.read(())["bytes"]}


class ColdContainerdRun(ColdStargzRun):
    """`run()`: a cold `ctr image pull --plain-http` (every layer fetched and unpacked by the
    overlayfs snapshotter) + `ctr run --rm` of `argv`."""

    label = "containerd pull + run (overlayfs)"

    def pull_and_run(self) -> None:
        self.peer.ctr("image", "pull", "--plain-http", self.ref)
        self.peer.run(self.ref, self.argv)
