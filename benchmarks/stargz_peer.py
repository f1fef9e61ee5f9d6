"""eStargz, the lazy-pulling peer users would pick instead of WeEnv: containerd with the stargz
snapshotter, started and stopped by this process, and a cold pull + run of one image.

Owns:
- `StargzPeer`: containerd_peer.py's containerd with the stargz snapshotter daemon as the
  proxy snapshot plugin `stargz` on a socket of its own. The daemon is scripts/bench-peers.sh's
  build of benchmarks/stargz_grpc/main.go (Debian ships the library, not the daemon).
  `reset_cold()` wipes its layer cache too.
- `StargzPeer.convert`: an image of our registry to eStargz with Debian's `ctr-remote`
  (`image optimize --oci --no-optimize`: no workload recorded, as the issue measured "no
  optimization"; `optimize=True` records the workload's file accesses and prioritizes them),
  pushed back to the registry as `NAME-esgz` (or `NAME-esgz-opt`), once per registry folder.
- `ColdStargzRun` (`ctr-remote image rpull --plain-http` + `ctr run --rm --snapshotter
  stargz`) and `ColdContainerdRun` (`ctr image pull --plain-http` + `ctr run --rm`, the
  overlayfs snapshotter, the original gzip image): `run()` makes the peer cold, drops the page
  cache and times pull + run of the workload; the registry's bytes sent are reported with it.

Must not: start or stop the registry (the caller owns it), touch a daemon, mount or container
it did not make (daemons are stopped by pid, mounts found under its own folder), or download
anything (bench-peers.sh built the daemon offline).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import timed
from _mounting import can_drop_caches, drop_caches
from containerd_peer import ContainerdPeer, containerd_unavailable
from docker_peer import Registry, RegistryMeter, _stop

BENCH_CACHE = Path(os.environ.get("WEENV_BENCH_CACHE") or "/var/cache/weenv-bench")
STARGZ_GRPC = BENCH_CACHE / "bin" / "stargz-grpc"  # built by scripts/bench-peers.sh


def stargz_unavailable() -> str | None:
    """Why the eStargz peer cannot run here, or None (`scripts/setup.sh --bench` installs it)."""
    for command, package in (("containerd", "containerd"), ("ctr", "containerd"),
                             ("ctr-remote", "stargz-snapshotter"),
                             ("docker-registry", "docker-registry"), ("skopeo", "skopeo")):
        if shutil.which(command) is None:
            return f"{command} not installed (Debian package {package}; scripts/setup.sh --bench)"
    if not os.access(STARGZ_GRPC, os.X_OK):
        return f"{STARGZ_GRPC} not built (scripts/bench-peers.sh builds it)"
    return containerd_unavailable()


class StargzPeer(ContainerdPeer):
    """containerd + the stargz snapshotter of ours under `folder`: `start()`, `ctr()`,
    `ctr_remote()`, `convert()`, `reset_cold()`, `stop()`."""

    PLUGIN = "stargz"
    SNAPSHOTTER_PARTS = ("stargz",)

    def __init__(self, folder: Path, snapshotter_args: Sequence[str] = ()) -> None:
        super().__init__(folder)
        self.stargz_socket = self.plugin_socket
        self.snapshotter_args = list(snapshotter_args)
        self.stargz: subprocess.Popen[bytes] | None = None

    def _start_snapshotter(self) -> None:
        self.stargz = self._spawn([str(STARGZ_GRPC), "-address", str(self.stargz_socket),
                                   "-root", str(self.folder / "stargz"),
                                   *self.snapshotter_args], "stargz.log")
        self._wait_for("the stargz snapshotter", self.stargz, "stargz.log",
                       self.stargz_socket.exists)

    def _stop_snapshotter(self) -> None:
        if self.stargz is not None:
            _stop(self.stargz, 30.0)
            self.stargz = None

    def ctr_remote(self, *args: str) -> str:
        """Run `ctr-remote ARGS` (ctr plus the stargz commands) against our containerd."""
        return self._run("ctr-remote", *args)

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
