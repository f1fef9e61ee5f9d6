"""What the mount benchmarks (mount.py, coldstart_ref.py, read.py) share: published stores
cached between runs, the real `weenv` CLI in a subprocess, mounts that are always undone,
dropping the page cache, walking a tree, and the node's mount server.

Owns: the benchmark work folder (`BENCH_DIR`, default /var/tmp/weenv-bench, or
$WEENV_BENCH_DIR): generated trees and stores built from them are kept there and reused while
their recipe (a key written next to them) is unchanged, so a run pays for a build only once.
`Mounts` mounts with `weenv mount` exactly as a user does and unmounts everything it mounted
in `close()` (`weenv umount`, then `fusermount3 -u -z` if that failed). `mount_server` runs
`weenv mountd` for the duration of a block, as a node would (Docker's daemon is resident too):
mounts this process starts, directly or through the CLI, fork from it; `forget_environments`
starts it afresh for a cold turn. `environment` sets variables of this process for a block.

Must not: time anything or print tables (the scripts and _common.py do), or kill a process
it did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weenvfs.native_programs import weenv_command
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group, open_source
from weenvfs.tools.inspect import inspect_env
from weenvfs.tools.publish import compose_env

BENCH_DIR = Path(os.environ.get("WEENV_BENCH_DIR") or "/var/tmp/weenv-bench")
CLI_TIMEOUT = 600.0
ABSENT = "weenv-bench-absent:none"  # a reference no benchmark store has (`forget_environments`)
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def weenv_argv(*args: str) -> list[str]:
    """The command line of `weenv ARGS` run with this interpreter."""
    return [sys.executable, "-m", "weenvfs", *args]


def weenv(*args: str) -> str:
    """Run `weenv ARGS` in a subprocess; its stdout, or exit with its error line."""
    done = subprocess.run(
        weenv_argv(*args), capture_output=True, text=True, timeout=CLI_TIMEOUT, check=False
    )
    if done.returncode != 0:
        sys.exit(f"weenv {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """This process's environment with `values` set for the block, as it was after it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def mount_server(folder: Path, enabled: bool = True) -> Iterator[None]:
    """`weenv mountd` with its socket in `folder` ($WEENV_MOUNTD_SOCKET of this process, so
    its mounts and the CLI it runs use it), stopped at the end of the block. With `enabled`
    False, mounts start the slow way (WEENV_MOUNTD=off) for the block instead. Either way
    the environments' shared mounts of the block are ours only (`folder`/envs as
    $WEENV_ENVS_ROOT) and are all evicted at its end: a mount kept warm would outlive the
    benchmark and the store and cache folders it deletes."""
    folder.mkdir(parents=True, exist_ok=True)
    with environment(WEENV_MOUNTD_SOCKET=str(folder / "mountd.sock"),
                     WEENV_MOUNTD="on" if enabled else "off",
                     WEENV_ENVS_ROOT=str(folder / "envs")):
        if enabled:
            weenv("mountd", "--detach")
        try:
            yield
        finally:
            try:
                evict_shared_mounts()
            finally:
                if enabled:
                    weenv("mountd", "--stop")


def forget_environments(store: str | None = None, cache: Path | None = None) -> None:
    """Evict every shared mount of the block (`evict_shared_mounts`) and start its node
    service afresh (`weenv mountd --stop`, then `--detach`), when one runs: a cold turn
    leaves nothing of an environment on the node, as the peers' do (Docker removes its
    images, containerd and the stargz snapshotter start again empty), and after each request
    the service keeps the manifest and indexes the request named in memory for its next
    children (fuse/service_preload.py), past the node cache the turn deletes: a cold run took
    its environment's index from there. With `store` (and the node cache `cache`), the new
    service is then asked for a `weenv run` of a name that store does not have: it fails,
    and the service makes that store's client ahead (as after any request naming it), as on
    a node that has used its store before. Waits until the machine is quiet again."""
    evict_shared_mounts()
    if os.environ.get("WEENV_MOUNTD") == "off" or "WEENV_MOUNTD_SOCKET" not in os.environ:
        return  # no service, or not the block's own (`mount_server`): never another's
    weenv("mountd", "--stop")
    weenv("mountd", "--detach")
    if store is not None:  # the user's `weenv`: its run goes to the service (hand_over.py)
        extra = [] if cache is None else ["--cache", str(cache)]
        subprocess.run([*weenv_command(), "run", "--store", store, *extra, ABSENT, "true"],
                       capture_output=True, timeout=CLI_TIMEOUT, check=False)
    settle()


def evict_shared_mounts() -> None:
    """`weenv mounts evict --all --force`: every shared mount of $WEENV_ENVS_ROOT (inside
    `mount_server`, the block's own, so this never touches the node's other mounts)."""
    subprocess.run([sys.executable, "-m", "weenvfs", "mounts", "evict", "--all", "--force",
                    "--quiet"], check=True, capture_output=True, timeout=600)


def can_drop_caches() -> bool:
    """Whether this process may drop the kernel's page cache (root, writable /proc/sys)."""
    return os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    """`sync; echo 3 > /proc/sys/vm/drop_caches`: page cache, dentries and inodes."""
    os.sync()
    DROP_CACHES.write_text("3\n")


def settle(busy_below: float = 0.15, window: float = 0.2, longest: float = 15.0) -> float:
    """Wait until the machine is quiet: two windows in a row in which the CPUs were busy
    (all but idle and iowait, /proc/stat) less than `busy_below` of the time, at most
    `longest` seconds; the seconds waited. Before each contender of a round, so that none
    starts while the one before still works in the background (a peer's daemon fetching the
    rest of an image, a hint being packed)."""
    start = time.monotonic()
    quiet = 0
    while quiet < 2 and time.monotonic() - start < longest:
        before = _cpu_times()
        time.sleep(window)
        after = _cpu_times()
        total = sum(after) - sum(before)
        idle = (after[3] + after[4]) - (before[3] + before[4])
        quiet = quiet + 1 if total > 0 and (total - idle) / total < busy_below else 0
    return time.monotonic() - start


def _cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _fresh(path: Path, key: dict[str, Any]) -> bool:
    """Whether `path` was completed from the recipe `key` (its `.key` file says so)."""
    stamp = path.with_name(path.name + ".key")
    try:
        return path.exists() and json.loads(stamp.read_text()) == key
    except (OSError, ValueError):
        return False


def _stamp(path: Path, key: dict[str, Any]) -> None:
    path.with_name(path.name + ".key").write_text(json.dumps(key, sort_keys=True))


def _clear(path: Path) -> None:
    path.with_name(path.name + ".key").unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def generated_tree(dirs: int, files_per_dir: int, file_bytes: int = 200) -> Path:
    """A tree of `dirs` folders of `files_per_dir` small files each (distinct contents, so no
    file deduplicates away), built once under BENCH_DIR/trees."""
    path = BENCH_DIR / "trees" / f"gen-{dirs}x{files_per_dir}x{file_bytes}"
    key = {"dirs": dirs, "files_per_dir": files_per_dir, "file_bytes": file_bytes, "v": 1}
    if _fresh(path, key):
        return path
    _clear(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for d in range(dirs):
        sub = tmp / f"d{d // 100:02d}" / f"dir{d:04d}"
        sub.mkdir(parents=True)
        for f in range(files_per_dir):
            line = b"file %d of directory %d\n" % (f, d)
            data = (line * (file_bytes // len(line) + 1))[:file_bytes]
            (sub / f"file{f:03d}.txt").write_bytes(data)
    tmp.rename(path)
    _stamp(path, key)
    return path


@dataclass(frozen=True)
class Published:
    """An environment published from one tree into a cached local store."""

    store: Path
    ref: str
    image_bytes: int  # bytes of file data in the composed tree
    stored_bytes: int  # bytes in the store: chunk frames plus indexes
    entries: int  # entries of the composed tree


def published(name: str, tree: Path) -> Published:
    """Tree `tree` built as group `<name>-tree` and composed as environment `<name>:bench` in
    the store BENCH_DIR/stores/<name>, built once and reused while the tree's top-level
    modification time and path are unchanged."""
    store_dir = BENCH_DIR / "stores" / name
    st = tree.stat()
    # v2: manifests name the lowest group's published EROFS image (SPEC 15.9).
    key = {"tree": str(tree), "mtime_ns": st.st_mtime_ns, "v": 2}
    if not _fresh(store_dir, key):
        _clear(store_dir)
        print(f"building {name} from {tree} (once; kept in {store_dir})", flush=True)
        repo = Repository(open_store(str(store_dir), create=True))
        try:
            build_group(open_source(tree), repo, f"{name}-tree", "bench")
            compose_env(repo, name, "bench", [f"{name}-tree:bench"])
        finally:
            repo.store.close()
        _stamp(store_dir, key)
    ref = f"{name}:bench"
    repo = Repository(open_store(str(store_dir)))
    try:
        _, report = inspect_env(repo, ref)
    finally:
        repo.store.close()
    size = report["size"]
    return Published(
        store_dir, ref, int(size["file_bytes"]), int(size["stored_bytes"]), int(size["entries"])
    )


def is_mounted(mountpoint: Path) -> bool:
    """Whether something is mounted at `mountpoint` (per /proc/self/mounts)."""
    target = os.fsencode(os.path.abspath(mountpoint))
    with open("/proc/self/mounts", "rb") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


class Mounts:
    """Mounts made with the real `weenv mount`; `close()` (call it in `finally`) undoes all."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.mountpoints: list[Path] = []

    def mount(
        self, pub: Published, mountpoint: Path, cache: Path, *extra: str,
        store: str | None = None,
    ) -> float:
        """`weenv mount` `pub` at `mountpoint` with node cache `cache` (from `store`, a copy of
        `pub`'s, if given), then `stat` the mount point; return the wall-clock seconds of both
        (mount to first `stat /`)."""
        mountpoint.mkdir(parents=True, exist_ok=True)
        log_file = self.work / "mount.log"
        argv = weenv_argv(
            "--log-file", str(log_file), "mount", pub.ref, str(mountpoint),
            "--store", store or str(pub.store), "--cache", str(cache), *extra,
        )
        self.mountpoints.append(mountpoint)
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CLI_TIMEOUT)
        if done.returncode == 0:
            os.stat(mountpoint)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"weenv mount failed ({done.returncode}): {done.stderr.strip()}")
        return seconds

    def unmount(self, mountpoint: Path) -> None:
        """Unmount `mountpoint` (waiting for its daemon); lazily if a plain unmount fails."""
        if not is_mounted(mountpoint):
            return
        done = subprocess.run(
            weenv_argv("umount", str(mountpoint)), capture_output=True, timeout=CLI_TIMEOUT
        )
        if done.returncode != 0 and is_mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)

    def close(self) -> None:
        """Unmount every mount this object made."""
        for mountpoint in reversed(self.mountpoints):
            self.unmount(mountpoint)
        self.mountpoints.clear()


def walk_stat(root: Path) -> int:
    """`find ROOT -exec stat`: lstat every entry below `root` (not following symlinks) and
    list every directory; return the number of entries."""
    count = 0
    stack = [os.fsencode(root)]
    while stack:
        top = stack.pop()
        with os.scandir(top) as it:
            for entry in it:
                st = os.lstat(entry.path)
                count += 1
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
    return count


def copy_tree(src: Path, dst: Path) -> None:
    """`cp -a SRC DST` (hardlinks, xattrs, modes, times kept)."""
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
