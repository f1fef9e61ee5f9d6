"""WeEnv, the subject of the cold-start benchmark: its store (SeaweedFS), the family published
into it once, prefetch hints, and what a rollout harness runs (weenvfs.runtime).

Owns:
- `seaweed(folder)` / `NetnsSeaweedFS`: SeaweedFS (weenvfs.store.seaweed) with its data kept in
  a folder between runs, on 127.0.0.1 or on the server address of a shaped link (netshape.py);
  both use the same credentials, exported to this process's environment for boto3 and the
  mount daemons it starts;
- `publish_family`: every layer tar built as group `swe-LAYER:v1` (`build_group`, as `weenv
  build LAYER.tar` does) and every image composed as environment `swe-IMAGE:v1`, skipping
  groups whose layer did not change (a key file in the SeaweedFS folder);
- `record_hints`: `weenv hints record ... --tag bench-v3 --replace` of each task's scripted
  commands, once per environment; `set_hints(enabled)` points (or not) each environment's hint
  tag `latest`, the one a mount replays, at that recording;
- `mirror`: copy what one store holds and another lacks (the shaped link's store);
- `WeenvPeer`: `Environment.open` / `exec` / `close` (the Python API an RL harness uses; it
  spawns one mount daemon per environment on the node), a cold node (node cache emptied, then
  holding only `other_chunks` chunks of environments outside the benchmark: `fill_cache`),
  and the bytes fetched to get ready (`weenv stats` of each mount, plus the manifest, indexes
  and hint object every mount loads).

Must not: build layer tars (workloads.py) or time anything (coldstart.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from _mounting import forget_environments
from workloads import IMAGE_ENV, Family

from weenvfs.core.cache import ChunkCache
from weenvfs.errors import RefNotFound, StoreError, WeenvError
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.fuse.commands import read_stats
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.mounts import list_mounts
from weenvfs.store import open_store
from weenvfs.store.base import Store
from weenvfs.store.repository import Repository
from weenvfs.store.seaweed import FILE_CHUNK_MB, SeaweedFS
from weenvfs.tools.builder import BuildOptions, build_group, open_source
from weenvfs.tools.publish import compose_env

PREFIX = "swe"
HINT_TAG = "bench-v4"  # bump when the recorded commands or the hint format change
PROVENANCE = {"benchmark": "coldstart"}


def group_name(layer: str) -> str:
    return f"swe-{layer}"


def env_ref(image: str, tag: str = "v1") -> str:
    return f"swe-{image}:{tag}"


class NetnsSeaweedFS(SeaweedFS):
    """SeaweedFS run inside a network namespace (`prefix`: `ip netns exec NS`), listening on
    `ip` only."""

    def __init__(self, directory: Path, prefix: list[str], ip: str) -> None:
        super().__init__(directory)
        self._prefix, self._ip = prefix, ip

    @property
    def endpoint(self) -> str:
        return f"http://{self._ip}:{self.ports['s3']}"

    @property
    def filer_url(self) -> str:
        return f"http://{self._ip}:{self.ports['filer']}"

    def _command(self, data: Path, config: Path) -> list[str]:
        argv = super()._command(data, config)
        return [*self._prefix, *(a.replace("127.0.0.1", self._ip) for a in argv)]


def start_seaweed(folder: Path | None, like: SeaweedFS | None = None,
                  netns: tuple[list[str], str] | None = None) -> SeaweedFS:
    """SeaweedFS keeping its data in `folder` (None: a temp folder, deleted at stop; on the
    link `netns` = (prefix, ip) if given), with the credentials of `like` if given; exports
    them to os.environ."""
    if folder is not None:
        _afresh_if_stored_otherwise(folder)
    if netns is None:
        server = SeaweedFS(folder)
    else:
        assert folder is not None
        server = NetnsSeaweedFS(folder, *netns)
    if like is not None:
        server.access_key, server.secret_key = like.access_key, like.secret_key
    server.start()
    os.environ.update(server.env())
    _wait_readable(server.url(PREFIX))
    return server


def _afresh_if_stored_otherwise(folder: Path) -> None:
    """Empty a kept SeaweedFS folder whose objects were stored in other pieces than the ones
    SeaweedFS is started with now (weenvfs/store/seaweed.py FILE_CHUNK_MB: a store's reads
    depend on it); the benchmark then copies its objects in again, once."""
    stamp = folder / "weenv-pieces.json"
    want = {"file_chunk_mb": FILE_CHUNK_MB}
    with contextlib.suppress(OSError, ValueError):
        if json.loads(stamp.read_text()) == want:
            return
    if folder.exists() and any(folder.iterdir()):
        print(f"SeaweedFS data in {folder} was stored in other pieces: starting it afresh "
              "(its objects are copied in again)", flush=True)
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(want))


def _wait_readable(url: str, timeout: float = 120.0) -> None:
    """Wait until the objects of a kept folder can be read: after a restart the volume
    server reports its volumes to the master a few seconds after S3 takes writes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open_store(url) as store:
                for kind in ("tags/", "manifests/", "indexes/", "blobs/"):
                    for key in itertools.islice(store.list(kind), 1):
                        store.get_range(key, 0, 1)
            return
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _build_if_changed(repo: Repository, family: Family, folder: Path,
                      layers: Iterable[str]) -> None:
    key_file = folder / "published.json"
    try:
        done: dict[str, str] = json.loads(key_file.read_text())
    except (OSError, ValueError):
        done = {}
    for name in layers:
        layer = family.layers[name]
        if done.get(name) == layer.diff_id:
            try:
                repo.resolve_group(f"{group_name(name)}:v1")
                continue
            except RefNotFound:
                pass
        print(f"weenv: building group {group_name(name)}:v1 from {layer.tar} (once)",
              flush=True)
        source = open_source(layer.tar)
        try:
            build_group(source, repo, group_name(name), "v1", BuildOptions())
        finally:
            source.close()
        done[name] = layer.diff_id
        key_file.write_text(json.dumps(done, indent=1, sort_keys=True))


def publish_family(family: Family, url: str, folder: Path, images: Sequence[str]) -> None:
    """Groups for every layer (built only when their layer changed) and environments for
    `images`."""
    with open_store(url, create=True) as store:
        repo = Repository(store)
        needed = dict.fromkeys(layer for image in images for layer in family.image(image))
        _build_if_changed(repo, family, folder, needed)
        config = RuntimeConfig(env=tuple(IMAGE_ENV), cwd="/")
        for image in images:
            groups = [f"{group_name(layer)}:v1" for layer in family.image(image)]
            compose_env(repo, f"swe-{image}", "v1", groups, config, PROVENANCE)


def _weenv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weenvfs", *args], capture_output=True,
                          text=True, errors="replace", check=False)


def record_hints(family: Family, url: str, images: Iterable[str], work: Path) -> None:
    """Record each image's hint (its task's commands in a chroot of its mount), unless the
    store has one already."""
    with open_store(url) as store:
        repo = Repository(store)
        todo = [i for i in images if _hint_digest(repo, i) is None]
    for image in todo:
        if image.startswith("task-"):
            commands = family.task_commands(int(image.removeprefix("task-")))
        else:  # the reference tree has no repository: its first command only
            commands = [family.ready_command(image)]
        script = "; ".join(" ".join(_quote(a) for a in argv) for argv in commands)
        print(f"weenv: recording the hint of {env_ref(image)} (once)", flush=True)
        done = _weenv("hints", "record", env_ref(image), "--store", url, "--tag", HINT_TAG,
                      "--replace", "--cache", str(work / "hint-cache"), "--",
                      "/bin/sh", "-c", f"( {script} ) > /dev/null")
        shutil.rmtree(work / "hint-cache", ignore_errors=True)
        if done.returncode != 0:
            raise RuntimeError(f"weenv hints record {image} failed: {done.stderr.strip()}")


def _quote(arg: str) -> str:
    return arg if arg.replace("/", "").replace("-", "").replace(".", "").isalnum() \
        else "'" + arg.replace("'", "'\\''") + "'"


def _hint_digest(repo: Repository, image: str) -> str | None:
    digest, _ = repo.resolve_env(env_ref(image))
    try:
        return repo.get_tag("hints", digest, HINT_TAG)
    except RefNotFound:
        return None


def point_hint_tag(repo: Repository, env_digest: str, hint: str | None,
                   tag: str = "latest") -> None:
    """Point hint tag `tag` of environment `env_digest` at hint `hint`, or remove it (None:
    a mount then finds no hint under that tag)."""
    if hint is not None:
        repo.set_tag("hints", env_digest, tag, hint)
    else:
        with contextlib.suppress(RefNotFound):
            repo.delete_tag("hints", env_digest, tag)


def set_hints(url: str, images: Iterable[str], enabled: bool) -> None:
    """Point the hint tag `latest` of each image's environment at its recording, or remove
    it (a mount then replays no hint)."""
    with open_store(url) as store:
        repo = Repository(store)
        for image in images:
            digest, _ = repo.resolve_env(env_ref(image))
            point_hint_tag(repo, digest, _hint_digest(repo, image) if enabled else None)


def mirror(src_url: str, dst_url: str) -> int:
    """Copy every object of `src` that `dst` lacks, and every tag; returns bytes copied."""
    copied = 0
    with open_store(src_url) as src, open_store(dst_url, create=True) as dst:
        have = set(dst.list())
        for key in src.list():
            if key.startswith("tags/") or key not in have:
                data = src.get(key)
                dst.put(key, data)
                copied += len(data)
    return copied


def store_bytes(url: str) -> dict[str, int]:
    """Every object's size, by key."""
    with open_store(url) as store:
        return {key: store.size(key) for key in store.list()}


def _layer_meta_bytes(store: Store, repo: Repository, image: str, hints: bool) -> list[int]:
    """What the mount of each group of `image` as an overlay layer loads besides chunks: the
    manifest, the indexes of that group and those below it, and for the top one the hint
    (the last is also what a merged mount of `image` loads)."""
    digest, manifest = repo.resolve_env(env_ref(image))
    sizes = [store.size(f"indexes/{g.index}") for g in manifest.groups]
    out = [store.size(f"manifests/{digest}") + sum(sizes[: n + 1]) for n in range(len(sizes))]
    hint = _hint_digest(repo, image) if hints else None
    if hint is not None:
        out[-1] += store.size(f"hints/{hint}")
    return out


class FetchMeter:
    """Bytes the mounts of a batch fetched (chunks, manifest, indexes, hint)."""

    def __init__(self, peer: WeenvPeer) -> None:
        self.peer = peer
        self.before: dict[str, int] = {}

    def begin(self) -> None:
        """What the shared mounts already on the node (kept warm by the node service since
        an earlier batch) have fetched so far: the batch counts only what it adds."""
        self.before = {}
        for mount in list_mounts():
            with contextlib.suppress(WeenvError, OSError, KeyError, ValueError):
                stats = read_stats(str(mount.mountpoint))
                self.before[str(mount.mountpoint)] = int(stats["fetch"]["bytes_fetched"])

    def read(self, envs: Sequence[tuple[str, Environment]]) -> dict[str, Any]:
        return self.peer.fetched(envs, self.before)


OTHER_CHUNK_BYTES = 100_000  # what each of `fill_cache`'s chunk files says it holds


def fill_cache(cache: Path, chunks: int) -> None:
    """Put `chunks` chunk files of no environment of the benchmark into node cache `cache`,
    least recently used (an hour old): what a node that ran other environments holds. Sparse
    files (OTHER_CHUNK_BYTES each as the cache counts them, nothing on disk) under names no
    index names, so no mount ever reads one; they count against the cache's bound and in
    every scan of it, as real ones do."""
    if not chunks:
        return
    node_cache = ChunkCache(cache)  # its layout: where a chunk's file goes
    then = time.time() - 3600
    for n in range(chunks):
        path = node_cache.path(hashlib.sha256(b"other environment chunk %d" % n).digest())
        path.parent.mkdir(exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(OTHER_CHUNK_BYTES)
            os.utime(f.fileno(), (then, then))


class WeenvPeer:
    """WeEnv through its Python API (`Environment`), node cache `cache` (holding
    `other_chunks` chunks of other environments at each turn's start), with or without
    replaying hints, sandboxes over a mount per group or one merged mount (`lower`)."""

    def __init__(self, url: str, cache: Path, images: Sequence[str], hints: bool,
                 lower: str = "layers", other_chunks: int = 0) -> None:
        self.url, self.cache, self.hints, self.lower = url, cache, hints, lower
        self.other_chunks = other_chunks
        self.name = "weenv + hints" if hints else "weenv"
        with open_store(url) as store:
            repo = Repository(store)
            self.layer_meta = {i: _layer_meta_bytes(store, repo, i, hints) for i in images}
        self.images = list(images)

    def prepare(self) -> None:
        """Make mounts replay the recorded hints (or none): called before each turn."""
        set_hints(self.url, self.images, self.hints)

    def reset_cold(self) -> None:
        """Unmount the shared mounts the node service keeps warm after their last sandbox,
        start the service afresh (what it keeps in memory of the environments), then empty
        the node cache (but for `other_chunks` chunks of no environment here)."""
        forget_environments(self.url, self.cache)
        shutil.rmtree(self.cache, ignore_errors=True)
        fill_cache(self.cache, self.other_chunks)

    def start(self, image: str) -> Environment:
        # No first-run recording: the hints of this peer are the ones `prepare` sets (none,
        # or recorded beforehand), and a recording run would stand on a private mount.
        return Environment.open(env_ref(image), store=self.url, cache=self.cache,
                                lower=self.lower, record_hint=False)

    def exec(self, env: Environment, argv: Sequence[str]) -> None:
        result = env.exec(list(argv), timeout=900)
        if not result.ok:
            raise RuntimeError(f"{' '.join(argv)} failed in {env.id} ({result.exit_code}): "
                               f"{result.stderr.decode(errors='replace')[-800:]}")

    def stop(self, env: Environment) -> None:
        env.close()

    def fetched(self, envs: Sequence[tuple[str, Environment]],
                before: dict[str, int] | None = None) -> dict[str, Any]:
        """Bytes fetched by the mounts of `envs` ((image, env) pairs) so far; a mount in
        `before` (mount point -> bytes fetched then) counts only what it fetched since, and
        not the metadata it loaded when it was made."""
        before = before or {}
        seen: dict[str, str] = {}  # every mount of the batch (shared ones once)
        for image, env in envs:
            for mountpoint in env.sandbox.lowers:
                seen.setdefault(str(mountpoint), image)
        chunks = meta = 0
        for mountpoint, image in seen.items():
            stats = read_stats(mountpoint)
            chunks += int(stats["fetch"]["bytes_fetched"]) - before.get(mountpoint, 0)
            if mountpoint in before:
                continue
            layer = stats["mount"].get("layer")
            # A merged mount loads what the mount of the top group does.
            meta += self.layer_meta[image][-1 if layer is None else layer]
        return {"bytes": chunks + meta, "chunk_bytes": chunks, "metadata_bytes": meta,
                "mounts": len(seen)}
