"""Figure 3 of the cold-start benchmark: the cost of updating one shared component for N task
environments (benchmarks/coldstart.py runs it).

The update: the packages layer is rebuilt with requests bumped (workloads.py `packages-v2`),
plus a stamp file unique to each repeat, so that nothing of the new layer is in the registry
or the store from an earlier repeat (every repeat is a real update, not a re-push). Then:
- Docker: what a Dockerfile-based pipeline does: `docker build` of the packages image
  (`FROM swe-python:v1`, `ADD packages.tar /`: the rebuilt layer), `docker push`; then for
  each of the N tasks `docker build` (`FROM` the new packages image, `ADD task-K.tar /`) and
  `docker push`. Before the first repeat, the same pipeline ran once for the current version
  (`v1d` images, untimed, kept in the registry), so the task layers exist in the registry as
  they would in production and only what really changed is uploaded.
- WeEnv: `build_group` of the rebuilt layer as `swe-packages:v2-RUN`, deduplicated against
  `swe-packages:v1`, then `compose_env` of the N task environments on it (the API a release
  script calls; the same as `weenv build` + N x `weenv compose`).
Bytes uploaded = growth of the registry's storage folder / of the store's objects; time =
wall clock of the whole republish.

Must not: start servers, or remove images and objects it did not create.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from docker_peer import DockerPeer, Registry
from weenv_peer import env_ref, group_name, store_bytes
from workloads import IMAGE_ENV, Family

from weenvfs.format.manifest import RuntimeConfig
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, build_group, open_source
from weenvfs.tools.publish import compose_env

STAMP = "usr/share/doc/swe-packages/BUILD"


def stamped_layer(family: Family, run: str, out: Path) -> Path:
    """The packages-v2 layer tar plus a stamp file naming `run`, at `out`."""
    shutil.copyfile(family.layers["packages-v2"].tar, out)
    with tempfile.TemporaryDirectory() as tmp:
        stamp = Path(tmp) / STAMP
        stamp.parent.mkdir(parents=True)
        stamp.write_text(f"packages rebuilt by run {run}\n")
        subprocess.run(["tar", "--append", f"--file={out}", f"--directory={tmp}",
                        "--numeric-owner", "--format=pax", f"./{STAMP}"], check=True)
    return out


def _dockerfile_build(peer: DockerPeer, ctx: Path, base: str, tar: Path, tag: str) -> None:
    """`docker build` of `FROM base` + `ADD tar /` tagged `tag` (context: a hardlink)."""
    shutil.rmtree(ctx, ignore_errors=True)
    ctx.mkdir(parents=True)
    os.link(tar, ctx / tar.name)
    (ctx / "Dockerfile").write_text(f"FROM {base}\nADD {tar.name} /\n")
    peer.docker("build", "-q", "-t", tag, str(ctx))
    shutil.rmtree(ctx, ignore_errors=True)


def _docker_pipeline(peer: DockerPeer, family: Family, packages_tar: Path, tag: str,
                     n: int, work: Path) -> dict[str, float]:
    """Build and push the packages image and N task images as `tag`; the seconds of each
    part."""
    start = time.perf_counter()
    packages = peer.ref("packages", tag)
    _dockerfile_build(peer, work / "ctx", peer.ref("python"), packages_tar, packages)
    peer.docker("push", "-q", packages)
    middle = time.perf_counter()
    for k in range(1, n + 1):
        task = peer.ref(f"task-{k}", tag)
        _dockerfile_build(peer, work / "ctx", packages, family.layers[f"task-{k}"].tar, task)
        peer.docker("push", "-q", task)
    end = time.perf_counter()
    return {"packages_s": middle - start, "tasks_s": end - middle, "total_s": end - start}


def _docker_cleanup(peer: DockerPeer, tag: str, n: int) -> None:
    refs = [peer.ref("packages", tag)] + [peer.ref(f"task-{k}", tag) for k in range(1, n + 1)]
    present = [r for r in refs if peer.docker("images", "-q", r).strip()]
    if present:
        peer.docker("rmi", *present)


def seed_docker(peer: DockerPeer, registry: Registry, family: Family, n: int,
                work: Path) -> None:
    """Once per registry folder: the current version built by the Docker pipeline (`v1d`)."""
    marker = registry.root / f"seeded-v1d-{n}"
    peer.docker("pull", "-q", peer.ref("python"))  # the layers' registry digests, as in CI
    if marker.exists():
        return
    print(f"docker: building and pushing the current version of {n} task images (once)",
          flush=True)
    _docker_pipeline(peer, family, family.layers["packages"].tar, "v1d", n, work)
    _docker_cleanup(peer, "v1d", n)
    marker.touch()


def update_docker(peer: DockerPeer, registry: Registry, family: Family, n: int, run: str,
                  tar: Path, work: Path) -> dict[str, Any]:
    """One Docker republish of the N task images on the stamped layer `tar`."""
    before = registry.stored_bytes()
    times = _docker_pipeline(peer, family, tar, f"v2-{run}", n, work)
    uploaded = registry.stored_bytes() - before
    _docker_cleanup(peer, f"v2-{run}", n)
    return {**times, "bytes_uploaded": uploaded}


def update_weenv(url: str, family: Family, n: int, run: str, tar: Path) -> dict[str, Any]:
    """One WeEnv republish: the rebuilt group, then N environment manifests on it."""
    before = store_bytes(url)
    tag = f"v2-{run}"
    config = RuntimeConfig(env=tuple(IMAGE_ENV), cwd="/")
    with open_store(url) as store:
        repo = Repository(store)
        start = time.perf_counter()
        source = open_source(tar)
        try:
            result = build_group(source, repo, group_name("packages"), tag,
                                 BuildOptions(dedup_with=(f"{group_name('packages')}:v1",)))
        finally:
            source.close()
        middle = time.perf_counter()
        for k in range(1, n + 1):
            groups = [f"{group_name(layer)}:v1" for layer in family.image(f"task-{k}")]
            groups[family.image(f"task-{k}").index("packages")] = f"swe-packages:{tag}"
            compose_env(repo, env_ref(f"task-{k}").split(":")[0], tag, groups, config,
                        {"benchmark": "coldstart", "update": run})
        end = time.perf_counter()
    after = store_bytes(url)
    new = {k: v for k, v in after.items() if before.get(k) != v}
    return {"packages_s": middle - start, "tasks_s": end - middle, "total_s": end - start,
            "bytes_uploaded": sum(new.values()), "objects_written": len(new),
            "builder_bytes_uploaded": result.bytes_uploaded, "index_bytes": result.index_size}
