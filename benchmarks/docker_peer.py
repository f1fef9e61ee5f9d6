"""Docker, the peer of the cold-start benchmark: a dockerd and a docker-registry that this
process starts and stops, the family's images pushed once, and what a rollout harness runs.

Owns:
- `Dockerd`: Debian's `dockerd --bridge=none --iptables=false --ip-masq=false` with its own
  data root, exec root, socket and pidfile under one folder (storage driver overlay2), plus
  `--insecure-registry` for the shaped link's subnet (a plain-HTTP registry off loopback
  needs it; 127.0.0.0/8 is insecure by default). Containers run with `--network none`.
  Stopped by its pid (SIGTERM, then SIGKILL): never any other dockerd.
- `Registry`: Debian's `docker-registry serve` as `weenv dev registry` runs it
  (tools/registry_server.py), on 127.0.0.1 (or on an address inside a network namespace:
  netshape.py), its storage in a folder kept between runs. `bytes_sent()`
  is the wchar of its /proc/PID/io: every byte it wrote to a socket (sendfile included), so
  the difference over a pull is what the clients pulled, HTTP headers included.
- `DockerPeer`: the harness side of a rollout (`docker pull`, `run -d --network none`, `exec`,
  `rm -f`) and a cold node (every container and image removed).
- `push_family`: the family's images (oci_layers.py layout, gzip layers) copied to the
  registry with skopeo, once per registry folder (a key file lists what it holds).

Must not: build trees (workloads.py), time anything (coldstart.py), or touch a daemon,
container or image it did not make.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oci_layers import Blob, gzip_layer, write_oci_layout
from workloads import IMAGE_ENV, Family

from weenvfs.tools.registry_server import RegistryServer

DOCKER = "/usr/bin/docker"  # Debian's client (another `docker` may come first on PATH)
DOCKERD = "/usr/sbin/dockerd"
REPO_PREFIX = "swe-"
NAME_PREFIX = "swe-bench-"  # containers this benchmark runs
START_TIMEOUT = 60.0


def docker_unavailable() -> str | None:
    """Why Docker cannot be measured here, or None."""
    for path, package in ((DOCKER, "docker.io"), (DOCKERD, "docker.io"),
                          (shutil.which("docker-registry"), "docker-registry"),
                          (shutil.which("skopeo"), "skopeo")):
        if not path or not os.access(path, os.X_OK):
            return f"{path or package} not installed (Debian package {package})"
    if os.geteuid() != 0:
        return "dockerd needs root"
    return None


def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM `proc` (ours), SIGKILL after `grace` seconds, and reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


class Dockerd:
    """One dockerd of ours under `folder`; `start()`, then `env()` for the client; `stop()`."""

    def __init__(self, folder: Path, insecure: Sequence[str] = ()) -> None:
        self.folder = folder
        self.insecure = tuple(insecure)
        self.socket = folder / "docker.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """The environment of a docker client talking to this daemon (classic builder)."""
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}

    def start(self) -> Dockerd:
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [DOCKERD, "--bridge=none", "--iptables=false", "--ip-masq=false",
                "--storage-driver=overlay2", f"--data-root={self.folder / 'data'}",
                f"--exec-root={self.folder / 'exec'}", f"--host=unix://{self.socket}",
                f"--pidfile={self.folder / 'docker.pid'}"]
        argv += [f"--insecure-registry={r}" for r in self.insecure]
        log = open(self.folder / "dockerd.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            done = subprocess.run([DOCKER, "version", "--format", "{{.Server.Version}}"],
                                  env=self.env(), capture_output=True, text=True, check=False)
            if done.returncode == 0:
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.folder / "dockerd.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"dockerd did not start: {tail}")
            time.sleep(0.2)

    def docker(self, *args: str, input: bytes | None = None, timeout: float = 1800) -> str:
        """Run `docker ARGS` against this daemon; its stdout, or RuntimeError with its
        stderr."""
        done = subprocess.run([DOCKER, *args], env=self.env(), capture_output=True,
                              input=input, check=False, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({done.returncode}): "
                               f"{done.stderr.decode(errors='replace').strip()[-1000:]}")
        return done.stdout.decode(errors="replace")

    def remove_images(self) -> None:
        """Every image of this daemon removed (no container may use one)."""
        images = sorted(set(self.docker("images", "-aq").split()))
        if images:
            self.docker("rmi", "-f", *images)
        self.docker("image", "prune", "-af")

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc, 30.0)
            self.proc = None


class Registry(RegistryServer):
    """The registry of `weenv dev registry` (tools/registry_server.py) storing in `root`, kept
    between runs, listening on `ip`:free port (inside network namespace `netns` if given)."""

    def __init__(self, root: Path, ip: str = "127.0.0.1", netns: str | None = None) -> None:
        super().__init__(root)
        self.ip, self.netns = ip, netns

    @property
    def root(self) -> Path:
        return self.directory

    def _command(self, config: Path) -> list[str]:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [*prefix, *super()._command(config)]

    def bytes_sent(self) -> int:
        """Bytes the registry has written (to sockets, and its few log lines)."""
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
        raise RuntimeError("no wchar in /proc/PID/io")

    def stored_bytes(self) -> int:
        """Bytes under the registry's storage folder (blobs, manifests, links)."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.data):
            total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
        return total


class RegistryMeter:
    """Bytes the registry sent since `begin()` (what `docker pull` moved)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.base = 0

    def begin(self) -> None:
        self.base = self.registry.bytes_sent()

    def read(self, envs: Sequence[tuple[str, str]]) -> dict[str, Any]:
        return {"bytes": self.registry.bytes_sent() - self.base}


class DockerPeer:
    """The harness side: what an RL framework runs against the Docker daemon."""

    name = "docker"

    def __init__(self, dockerd: Dockerd, registry_host: str, tag: str = "v1") -> None:
        self.dockerd = dockerd
        self.env = dockerd.env()
        self.registry_host = registry_host
        self.tag = tag
        self._count = 0
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Nothing to set up before a turn."""

    def ref(self, image: str, tag: str | None = None) -> str:
        return f"{self.registry_host}/{REPO_PREFIX}{image}:{tag or self.tag}"

    def docker(self, *args: str, input: bytes | None = None) -> str:
        """Run `docker ARGS`; its stdout, or RuntimeError with its stderr."""
        return self.dockerd.docker(*args, input=input)

    def start(self, image: str) -> str:
        """`docker pull` then `docker run -d --network none IMAGE sleep infinity`: the
        container a rollout then runs commands in; returns its name."""
        ref = self.ref(image)
        self.docker("pull", "-q", ref)
        with self._lock:
            self._count += 1
            name = f"{NAME_PREFIX}{os.getpid()}-{self._count}"
        self.docker("run", "-d", "--network", "none", "--name", name, ref,
                    "sleep", "infinity")
        return name

    def exec(self, name: str, argv: Sequence[str]) -> None:
        self.docker("exec", name, *argv)

    def stop(self, name: str) -> None:
        self.docker("rm", "-f", name)

    def containers(self) -> list[str]:
        return self.docker("ps", "-aq", "--filter", f"name={NAME_PREFIX}").split()

    def reset_cold(self) -> None:
        """Remove our containers, every image and the build cache: nothing local is left."""
        ids = self.containers()
        if ids:
            self.docker("rm", "-f", *ids)
        self.dockerd.remove_images()
        self.docker("builder", "prune", "-af")

    def forget(self, images: Sequence[str]) -> None:
        """Remove the tags of `images` (their own layers go, shared ones stay)."""
        refs = [self.ref(i) for i in images]
        present = [r for r in refs if self.docker("images", "-q", r).strip()]
        if present:
            self.docker("rmi", *present)


# -- the family in the registry -----------------------------------------------------------------


def _blob(family: Family, layer: str) -> Blob:
    """Layer `layer` of the family in gzip form (made once, kept next to its tar)."""
    info = family.layers[layer]
    gz = info.tar.with_name(info.tar.name + ".gz")
    meta = gz.with_name(gz.name + ".json")
    try:
        known = json.loads(meta.read_text())
        if known["diff_id"] == info.diff_id and gz.exists():
            return Blob(gz, known["digest"], known["size"], info.diff_id)
    except (OSError, ValueError, KeyError):
        pass
    digest, size = gzip_layer(info.tar, gz)
    meta.write_text(json.dumps({"diff_id": info.diff_id, "digest": digest, "size": size}))
    return Blob(gz, digest, size, info.diff_id)


def image_blobs(family: Family, image: str) -> list[Blob]:
    """The gzip layers of image `image`, lowest first."""
    return [_blob(family, layer) for layer in family.image(image)]


def push_family(family: Family, registry: Registry, images: Sequence[str],
                tag: str = "v1") -> dict[str, Any]:
    """Copy `images` of the family to the registry as `swe-IMAGE:TAG` (skopeo, from an OCI
    layout), skipping those the registry folder already holds with the same layers."""
    key_file = registry.root / "pushed.json"
    try:
        pushed: dict[str, Any] = json.loads(key_file.read_text())
    except (OSError, ValueError):
        pushed = {}
    wanted = {i: [b.digest for b in image_blobs(family, i)] for i in images}
    todo = [i for i in images if pushed.get(f"{i}:{tag}") != wanted[i]]
    if todo:
        print(f"docker: pushing {len(todo)} image(s) to the registry (once)", flush=True)
        layout = family.root / "oci"
        write_oci_layout(layout, {i: image_blobs(family, i) for i in todo}, IMAGE_ENV,
                         ["/bin/bash"])
        for image in todo:
            subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                            "--format", "v2s2", f"oci:{layout}:{image}",
                            f"docker://{registry.host}/{REPO_PREFIX}{image}:{tag}"],
                           check=True, capture_output=True)
            pushed[f"{image}:{tag}"] = wanted[image]
            key_file.write_text(json.dumps(pushed, indent=1, sort_keys=True))
        shutil.rmtree(layout, ignore_errors=True)
    return {i: sum(b.size for b in image_blobs(family, i)) for i in images}
