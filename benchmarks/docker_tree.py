"""One tree as a Docker image in a registry, and a cold `docker pull` + `docker run` of it:
the Docker column of benchmarks/prefetch.py (and any benchmark that compares one
environment with the same tree under Docker).

Owns:
- `push_tree`: the tree as a one-layer image (a pax tar made by oci_layers.py, gzip'd, an
  OCI layout copied with skopeo) in a `docker_peer.Registry`, done once per registry folder
  and tree (a key file next to the registry's data says what it holds).
- `ColdDockerRun`: before each run every image of our dockerd is removed and the page cache
  dropped; the timed part is `docker pull` + `docker run --rm --network none IMAGE CMD...`;
  the registry's bytes sent over the run are reported with it.

Must not: start or stop daemons (the caller owns the Dockerd and Registry), or remove an
image or container of a daemon it was not given.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import timed
from _mounting import can_drop_caches, drop_caches
from docker_peer import Dockerd, Registry, RegistryMeter
from oci_layers import Blob, gzip_layer, subtree, write_layer, write_oci_layout
from workloads import IMAGE_ENV


def push_tree(tree: Path, key: dict[str, Any], registry: Registry, name: str,
              work: Path) -> int:
    """Make `registry` hold `tree` as image `name:latest` (one layer), unless it already
    does for this `key` (what identifies the tree's content); returns the gzip'd layer's
    size. `work` is scratch space for the layer files (kept there for the next run)."""
    stamp = registry.root / f"pushed-{name}.json"
    try:
        known = json.loads(stamp.read_text())
        if known["key"] == key:
            return int(known["size"])
    except (OSError, ValueError, KeyError):
        pass
    print(f"docker: pushing {tree} as {name} to the registry (once)", flush=True)
    work.mkdir(parents=True, exist_ok=True)
    tar, gz = work / f"{name}.tar", work / f"{name}.tar.gz"
    diff_id, _ = write_layer(tree, subtree(tree), tar)
    digest, size = gzip_layer(tar, gz)
    tar.unlink()
    layout = work / "oci"
    write_oci_layout(layout, {name: [Blob(gz, digest, size, diff_id)]}, IMAGE_ENV,
                     ["/bin/sh"])
    try:
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--format",
                        "v2s2", f"oci:{layout}:{name}",
                        f"docker://{registry.host}/{name}:latest"],
                       check=True, capture_output=True)
    finally:
        shutil.rmtree(layout, ignore_errors=True)
        gz.unlink(missing_ok=True)
    stamp.write_text(json.dumps({"key": key, "size": size}, sort_keys=True))
    return size


class ColdDockerRun:
    """`run()`: a cold `docker pull HOST/NAME:latest` + `docker run --rm` of `argv`."""

    def __init__(self, dockerd: Dockerd, registry: Registry, host: str, name: str,
                 argv: Sequence[str]) -> None:
        self.dockerd = dockerd
        self.meter = RegistryMeter(registry)
        self.ref = f"{host}/{name}:latest"
        self.argv = list(argv)

    def make_cold(self) -> None:
        """No image left on the daemon (ours: this benchmark's own data root), no page cache."""
        self.dockerd.remove_images()
        if can_drop_caches():
            drop_caches()

    def run(self) -> tuple[float, dict[str, Any]]:
        """Time pull + run from a cold daemon; (seconds, {"bytes_fetched": registry bytes})."""
        self.make_cold()
        self.meter.begin()

        def pull_and_run() -> None:
            self.dockerd.docker("pull", "-q", self.ref)
            self.dockerd.docker("run", "--rm", "--network", "none", self.ref, *self.argv)

        seconds, _ = timed(pull_and_run)
        return seconds, {"bytes_fetched": self.meter.read(())["bytes"]}
