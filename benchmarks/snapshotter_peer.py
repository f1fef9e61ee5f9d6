"""WeEnv under containerd, a contender of the cold-start benchmark: containerd with `weenv
snapshotter` as its proxy plugin (docs/containerd.md), the environment pushed with `weenv
push`, and a cold `weenv pull` + `ctr run` of it, the user path of docs/containerd.md.

Owns:
- `SnapshotterPeer`: containerd_peer.py's containerd with `weenv snapshotter --store STORE`
  as the proxy plugin `weenv`, and the node's mount server the snapshotter's group mounts
  fork from (`weenv mountd`, in the foreground: a node keeps it running). Everything of theirs
  is under the peer's folder, named in the environment of the weenv processes it starts
  (never in this process's): the snapshotter's root, the node chunk cache, the shared mounts
  ($WEENV_ENVS_ROOT) and the mount server's socket ($WEENV_MOUNTD_SOCKET); their metrics
  endpoints are off. `stop()` also evicts the group mounts (`weenv mounts evict --all
  --force`) and stops the mount server; `reset_cold()` then wipes all of it and containerd's
  data (images, content, snapshots, leases) and starts everything again.
- `SnapshotterPeer.push`: `weenv push ENV HOST/NAME:latest --store STORE --insecure` (marker
  layers: a few KiB in the registry, the data stays in the store), each run.
- `ColdSnapshotterRun.run()`: a cold peer, the page cache dropped, the weenv software read
  back (as for the other weenv contenders: a node keeps it warm, as it keeps containerd), then
  timed: `weenv pull REF --insecure --containerd-socket S --namespace weenv-bench` (the
  installed `weenv`, as for the README's runs) + `ctr run
  --rm --snapshotter weenv REF ID ARGV...`. Without a hint (a first pull anywhere), or with
  the workload's hint (`SnapshotterPeer.recorded_hint`, kept under HINT_TAG) as the
  environment's `latest`, as after a first run or `weenv hints record` anywhere: the top
  group's mount replays it (docs/containerd.md); the tag is removed again afterwards. Bytes
  fetched: what the registry sent (manifest, config, marker blobs), what the group mounts
  fetched from the store (their `weenv stats`: chunk data) and the metadata those mounts
  load whole (the manifest and the groups' indexes and published EROFS images, by their
  sizes in the store).

Must not: start or stop the registry or the store (the caller owns them), or touch a daemon,
mount or container it did not make (processes are stopped by pid, mounts are those of its
own folder).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import timed
from _mounting import can_drop_caches, drop_caches, weenv_argv
from containerd_peer import NAMESPACE, ContainerdPeer, containerd_unavailable
from docker_peer import Registry, RegistryMeter, _stop
from weenv_peer import point_hint_tag

from weenvfs.errors import RefNotFound
from weenvfs.native_programs import weenv_command
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

CLI_TIMEOUT = 900.0
HINT_TAG = "bench-snapshotter"  # where the workload's hint is kept in the store between runs
# What `weenv pull` imports, read back after the cache drop (the mount daemons fork from the
# mount server, which has its modules loaded already).
PULL_MODULES = ("weenvfs.cli, weenvfs.snapshotter.commands, weenvfs.snapshotter.pull, "
                "weenvfs.tools.image_transports, weenvfs.tools.registry_auth, grpc, requests")


LABEL = "weenv snapshotter (containerd + weenv, lazy)"
HINTED_LABEL = "weenv snapshotter, hint (containerd + weenv, lazy)"


def snapshotter_unavailable() -> str | None:
    """Why the weenv snapshotter peer cannot run here, or None."""
    try:
        import grpc  # noqa: F401 - weenv snapshotter serves with it
    except ImportError:
        return "grpcio not installed (the project's dependencies: scripts/setup.sh)"
    return containerd_unavailable()


class SnapshotterPeer(ContainerdPeer):
    """containerd + `weenv snapshotter` + the node's mount server under `folder`, serving
    the groups of the store `store`."""

    PLUGIN = "weenv"
    SNAPSHOTTER_PARTS = ("snapshotter", "cache", "envs", "mountd")

    def __init__(self, folder: Path, store: Path) -> None:
        super().__init__(folder)
        self.store = store
        self.mountd: subprocess.Popen[bytes] | None = None
        self.snapshotter: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """The environment of the weenv processes of this peer (the node's own mounts and
        mount server untouched)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEENV_")}
        env.update({"WEENV_ENVS_ROOT": str(self.folder / "envs"),
                    "WEENV_MOUNTD_SOCKET": str(self.folder / "mountd" / "mountd.sock"),
                    "WEENV_MOUNTD": "on"})
        return env

    def weenv(self, *args: str) -> str:
        """`weenv ARGS` in this peer's environment, with the installed `weenv` (as users
        run it: the native launcher hands a `pull` to the node service); its stdout, or
        RuntimeError."""
        done = subprocess.run([*weenv_command(), *args], env=self.env(), capture_output=True,
                              text=True, timeout=CLI_TIMEOUT, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"weenv {' '.join(args[:2])} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-1500:]}")
        return done.stdout

    def _answers(self, *args: str) -> bool:
        return subprocess.run(weenv_argv(*args), env=self.env(), capture_output=True,
                              check=False).returncode == 0

    def _start_snapshotter(self) -> None:
        (self.folder / "mountd").mkdir(parents=True, exist_ok=True)
        self.mountd = self._spawn(weenv_argv("mountd", "--metrics", "off"), "mountd.log",
                                  self.env())
        self._wait_for("the mount server", self.mountd, "mountd.log",
                       lambda: self._answers("mountd", "--check"))
        self.snapshotter = self._spawn(
            weenv_argv("-v", "snapshotter", "--store", str(self.store),
                       "--socket", str(self.plugin_socket),
                       "--root", str(self.folder / "snapshotter"),
                       "--cache", str(self.folder / "cache"), "--metrics", "off"),
            "snapshotter.log", self.env())
        self._wait_for("weenv snapshotter", self.snapshotter, "snapshotter.log",
                       self.plugin_socket.exists)

    def _stop_snapshotter(self) -> None:
        if self.snapshotter is not None:
            _stop(self.snapshotter, 30.0)
            self.snapshotter = None
        if self.mountd is not None:
            # The group mounts outlive the snapshotter (they are the node's): unmount them
            # while their mount server still runs, then stop it.
            evict = subprocess.run(weenv_argv("mounts", "evict", "--all", "--force",
                                              "--quiet"), env=self.env(),
                                   capture_output=True, text=True, check=False,
                                   timeout=CLI_TIMEOUT)
            if evict.returncode != 0:  # the unmount pass of stop() still detaches them
                print(f"weenv snapshotter peer: evict failed: {evict.stderr.strip()}",
                      file=sys.stderr, flush=True)
            _stop(self.mountd, 30.0)
            self.mountd = None

    # -- the image and what its run fetched ---------------------------------------------------

    def push(self, registry: Registry, env_ref: str, name: str) -> str:
        """`weenv push` environment `env_ref` of our store as `NAME:latest`; its reference."""
        ref = f"{registry.host}/{name}:latest"
        print(f"weenv: pushing {env_ref} to the registry as {name}", flush=True)
        self.weenv("push", env_ref, ref, "--store", str(self.store), "--insecure", "--json")
        return ref

    def recorded_hint(self, env_ref: str, argv: Sequence[str]) -> str:
        """The digest of the hint of `argv` in environment `env_ref` of the store: recorded
        once with `weenv hints record` (a sandbox of the environment: the same reads), in
        this peer's environment (its mount goes with the next `reset_cold`), and kept under
        HINT_TAG."""
        with open_store(str(self.store)) as opened:
            repo = Repository(opened)
            digest, _ = repo.resolve_env(env_ref)
            with contextlib.suppress(RefNotFound):
                return repo.get_tag("hints", digest, HINT_TAG)
        print(f"recording the hint of {env_ref} for the weenv snapshotter (once)", flush=True)
        self.weenv("hints", "record", "--replace", "--store", str(self.store), "--cache",
                   str(self.folder / "cache"), "--tag", HINT_TAG, env_ref, *argv)
        with open_store(str(self.store)) as opened:
            return Repository(opened).get_tag("hints", digest, HINT_TAG)

    def pull_and_run(self, ref: str, argv: Sequence[str]) -> None:
        """`weenv pull REF` into our containerd, then `ctr run --rm --snapshotter weenv`."""
        self.weenv("pull", ref, "--insecure", "--containerd-socket", str(self.socket),
                   "--namespace", NAMESPACE)
        self.run(ref, argv, snapshotter=self.PLUGIN)

    def fetched(self) -> dict[str, Any]:
        """What this peer's group mounts fetched from the store: chunk bytes (`weenv stats`)
        and the metadata they loaded whole (manifest, indexes, published EROFS images)."""
        rows = [r for r in json.loads(self.weenv("mounts", "--json")) if r["mounted"]]
        chunks, paths, layers, hints = 0, set(), {}, set()
        for row in rows:
            stats = json.loads(self.weenv("stats", "--json", row["mountpoint"]))
            chunks += int(stats["fetch"]["bytes_fetched"])
            paths.add(stats["mount"].get("path", "fuse"))
            layers.setdefault(row["env"], set()).add(row["layer"])
            if stats.get("hints", {}).get("hint"):
                hints.add(stats["hints"]["hint"])
        return {"chunk_bytes": chunks, "metadata_bytes": self._metadata_bytes(layers),
                "mounts": len(rows), "paths": sorted(paths), "hints_replayed": sorted(hints)}

    def _metadata_bytes(self, layers: dict[str, set[int]]) -> int:
        total = 0
        with open_store(str(self.store)) as store:
            repo = Repository(store)
            for digest, positions in layers.items():
                groups = repo.get_manifest(digest).groups
                total += store.size(f"manifests/{digest}")
                # a layer mount loads the indexes of its group and those below it
                for g in groups[: max(positions) + 1]:
                    total += store.size(f"indexes/{g.index}")
                total += sum(store.size(f"erofs/{groups[p].erofs}") for p in positions
                             if groups[p].erofs)
        return total


class ColdSnapshotterRun:
    """`run()`: a cold `weenv pull` (each WeEnv layer its group's lazy mount) + `ctr run --rm
    --snapshotter weenv` of `argv` of environment `env_ref` of the peer's store; with `hint`
    that hint is the environment's `latest` while it runs, else it has none."""

    def __init__(self, peer: SnapshotterPeer, registry: Registry, ref: str,
                 argv: Sequence[str], env_ref: str, hint: str | None = None) -> None:
        self.peer, self.meter = peer, RegistryMeter(registry)
        self.ref, self.argv, self.env_ref, self.hint = ref, list(argv), env_ref, hint
        self.label = HINTED_LABEL if hint else LABEL

    def _set_latest(self, hint: str | None) -> None:
        with open_store(str(self.peer.store)) as store:
            repo = Repository(store)
            point_hint_tag(repo, repo.resolve_env(self.env_ref)[0], hint)

    def make_cold(self) -> None:
        """Nothing of an earlier run left, the page cache dropped, the weenv software read
        back (a node keeps it warm)."""
        self.peer.reset_cold()
        if can_drop_caches():
            drop_caches()
        subprocess.run([sys.executable, "-c", f"import {PULL_MODULES}"], check=True)

    def run(self) -> tuple[float, dict[str, Any]]:
        """Time pull + run from a cold node; (seconds, {"bytes_fetched": registry bytes +
        store bytes, and their parts})."""
        self._set_latest(self.hint)
        try:
            self.make_cold()
            self.meter.begin()
            seconds, _ = timed(lambda: self.peer.pull_and_run(self.ref, self.argv))
            registry = self.meter.read(())["bytes"]
            store = self.peer.fetched()
        finally:
            if self.hint is not None:
                self._set_latest(None)
        total = registry + store["chunk_bytes"] + store["metadata_bytes"]
        return seconds, {"bytes_fetched": total, "registry_bytes": registry, **store}

