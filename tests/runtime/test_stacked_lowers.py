"""Sandboxes over a stack of per-group mounts (runtime/lowers.py): environments that share
groups share those groups' mounts; whiteouts and opaque directories of upper groups work in
the sandbox as in the merged mount; `--lower merged` still gives one mount per environment."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from rt_support import EnvRef, run_weenv
from support import layers
from support.polling import wait_for
from support.trees import dir, file  # noqa: A004

from weenvfs.errors import UsageError, WeenvError
from weenvfs.format.refs import object_key
from weenvfs.fuse import daemon
from weenvfs.runtime import mounts
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.lowers import MAX_LAYERS, acquire_lowers, plan_lowers, release_lowers
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group, open_source


def task_env(make_env: Callable[..., EnvRef], store: Path, tmp_path: Path, n: int) -> EnvRef:
    """An environment of the minbase group plus a task group of its own: a new file, a
    whiteout of /etc/debian_version and an opaque /usr/share/doc (minbase's docs hidden)
    whose parents the tar only implies (they keep minbase's attributes)."""
    tar = layers.layer_file(
        tmp_path / f"task{n}.tar", dir("work"), file("work/task", f"task {n}\n".encode()),
        layers.whiteout("etc/debian_version"), dir("usr/share/doc", mode=0o700),
        layers.opaque("usr/share/doc"), file("usr/share/doc/only", b"o"))
    group = f"task{n}-{uuid.uuid4().hex[:8]}"
    with open_store(str(store)) as opened:
        build_group(open_source(tar), Repository(opened), group, "t")
    return make_env(name=group, groups=["minbase:t", f"{group}:t"])


def test_environments_share_the_mounts_of_their_common_groups(
    make_env: Callable[..., EnvRef], minbase_store: Path, tmp_path: Path
) -> None:
    tasks = [task_env(make_env, minbase_store, tmp_path, n) for n in range(2)]
    assert tasks[0].keys[1] == tasks[1].keys[1] and tasks[0].keys[0] != tasks[1].keys[0]
    with Environment.open(tasks[0].ref, store=tasks[0].store, cache=tasks[0].cache) as a, \
         Environment.open(tasks[1].ref, store=tasks[1].store, cache=tasks[1].cache) as b:
        lower_a, lower_b = a.sandbox.lowers, b.sandbox.lowers
        assert len(lower_a) == 2 and lower_a[1] == lower_b[1] and lower_a[0] != lower_b[0]
        for n, env in enumerate((a, b)):
            assert env.read_file("/work/task") == f"task {n}\n".encode()
            assert env.exec(["test", "-e", "/etc/debian_version"]).exit_code == 1
            assert env.exec(["ls", "-A", "/usr/share/doc"]).stdout == b"only\n"
            shown = env.exec(["stat", "-c", "%a %u", "/usr", "/usr/share", "/usr/share/doc"])
            assert shown.stdout == b"755 0\n755 0\n700 0\n"
            assert env.exec(["test", "-x", "/bin/sh"]).ok  # from the shared group
        # Deleting a file of the shared group and writing into it stays in one sandbox.
        assert a.exec("rm /etc/hostname && echo mine > /etc/motd").ok
        assert b.exec(["test", "-e", "/etc/hostname"]).ok
        assert b.exec(["cat", "/etc/motd"]).stdout != b"mine\n"
        a.reset()
        assert a.exec(["test", "-e", "/etc/hostname"]).ok
    for key in {*tasks[0].keys, *tasks[1].keys}:
        assert not daemon.is_mounted(Path(f"/run/weenv/envs/{key}/root"))


def test_merged_lower_is_one_mount_of_the_environment(
    make_env: Callable[..., EnvRef], minbase_store: Path, tmp_path: Path
) -> None:
    task = task_env(make_env, minbase_store, tmp_path, 0)
    done = run_weenv("run", task.ref, "--store", str(task.store), "--cache", str(task.cache),
                     "--lower", "merged", "--", "sh", "-c",
                     "cat /work/task; ls -A /usr/share/doc; test ! -e /etc/debian_version")
    assert done.stdout.splitlines()[:2] == [b"task 0", b"only"]
    with Environment.open(task.ref, store=task.store, cache=task.cache, lower="merged") as env:
        assert env.sandbox.lowers == [Path(f"/run/weenv/envs/{task.digest}/root")]
        assert env.exec(["test", "-e", "/etc/debian_version"]).exit_code == 1


def test_an_unknown_lower_mode_is_one_line(env_ref: EnvRef) -> None:
    done = run_weenv("run", env_ref.ref, "--store", str(env_ref.store), "--lower", "flat",
                     "--", "true", check=False)
    assert done.returncode == 2 and b"--lower" in done.stderr and b"Traceback" not in done.stderr
    with pytest.raises(UsageError, match="--lower"):
        Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache, lower="flat")


def test_plan_keys_a_mount_by_the_groups_below_it_and_where_it_serves_from() -> None:
    base, py, task1, task2 = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)
    cache = Path("/var/cache/weenv/chunks")
    one = plan_lowers("e" * 64, [base, py, task1], "layers", "s3://b/weenv", cache)
    two = plan_lowers("f" * 64, [base, py, task2], "layers", "s3://b/weenv", cache)
    assert [m.layer for m in one] == [2, 1, 0]  # topmost first, as lowerdir lists them
    assert [m.key for m in one][1:] == [m.key for m in two][1:] and one[0].key != two[0].key
    # The same group on another base, another store or another cache is another mount.
    assert plan_lowers("e" * 64, [py], "layers", "s3://b/weenv", cache)[0].key != one[1].key
    assert plan_lowers("e" * 64, [base], "layers", "s3://other", cache)[0].key != one[2].key
    assert plan_lowers("e" * 64, [base], "layers", "s3://b/weenv", Path("/c"))[0].key \
        != one[2].key
    merged = plan_lowers("e" * 64, [base, py, task1], "merged", "s3://b/weenv", cache)
    assert [(m.key, m.layer) for m in merged] == [("e" * 64, None)]
    deep = plan_lowers("e" * 64, [f"{n:064x}" for n in range(MAX_LAYERS + 1)], "layers",
                       "s3://b/weenv", cache)
    assert [(m.key, m.layer) for m in deep] == [("e" * 64, None)]
    with pytest.raises(UsageError, match="--lower"):
        plan_lowers("e" * 64, [base], "flat", "s3://b/weenv", cache)


def test_lowers_already_up_are_taken_and_given_back_when_another_cannot_be_mounted(
        warm_root: Path, make_env: Callable[..., EnvRef], minbase_store: Path,
        tmp_path: Path) -> None:
    """A warm node: the shared group's mount is up (another task ran), so a sandbox takes it
    at once (lowers.py, `mounts.acquire_mounted`) and mounts only its own group; when that
    mount fails, the mount it took is given back: all or nothing."""
    first, second = (task_env(make_env, minbase_store, tmp_path, 100 + n) for n in range(2))
    with Environment.open(first.ref, store=first.store, cache=first.cache) as env:
        assert env.exec(["cat", "/work/task"]).stdout == b"task 100\n"
    [shared] = [m for m in mounts.list_mounts() if m.key == first.keys[1]]
    assert shared.mounted and not shared.holders  # kept warm, idle
    with Environment.open(second.ref, store=second.store, cache=second.cache) as env:
        assert env.exec(["cat", "/work/task"]).stdout == b"task 101\n"
        held = {m.key: m.holders for m in mounts.list_mounts()}
        assert held[second.keys[1]] == (env.sandbox.id,) == held[second.keys[0]]
    # A third task whose own group cannot be mounted (its index is gone from the store):
    # the shared mount, taken first, is given back by `acquire_lowers` itself (a sandbox's
    # teardown would give it back too; here there is none).
    third = task_env(make_env, minbase_store, tmp_path, 102)
    with open_store(str(third.store)) as store:
        digest, manifest = Repository(store).resolve_env(third.ref)
        store.delete(object_key("indexes", manifest.groups[-1].index))
        url = store.url
    planned = plan_lowers(digest, [g.index for g in manifest.groups], "layers", url,
                          third.cache)
    assert [m.key for m in planned] == list(third.keys)
    with pytest.raises(WeenvError):
        acquire_lowers(planned, "weenv-test-lowers", env=digest, store_url=url,
                       cache_dir=third.cache)
    assert {m.key: m.holders for m in mounts.list_mounts()}[third.keys[1]] == ()
    with pytest.raises(WeenvError):  # and a sandbox of it fails the same way
        Environment.open(third.ref, store=third.store, cache=third.cache)


def test_a_mount_table_read_before_an_eviction_takes_nothing(
        warm_root: Path, env_ref: EnvRef, caplog: pytest.LogCaptureFixture) -> None:
    """`acquire_lowers` reads the node's mount table once for every lower
    (`mounts.acquire_mounted(..., mounted=)`), before it takes each mount's lock: a mount
    evicted in between is not taken (nor taken for dead), and one still up is."""
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache) as env:
        assert env.exec(["true"]).exit_code == 0
    key = env_ref.keys[-1]
    table = daemon.mount_points()
    assert table is not None and daemon.is_mounted(mounts.mountpoint(key), table)
    taken = mounts.acquire_mounted(key, "weenv-test-table", mounted=table)
    assert taken == mounts.mountpoint(key)
    mounts.release(key, "weenv-test-table")
    assert mounts.evict(key, force=True)
    with caplog.at_level("WARNING"):
        assert mounts.acquire_mounted(key, "weenv-test-table", mounted=table) is None
    assert "dead" not in caplog.text
    assert key not in {m.key: m.holders for m in mounts.list_mounts() if m.holders}


def test_a_lower_another_sandbox_is_mounting_does_not_hold_up_the_own_groups_mount(
        warm_root: Path, make_env: Callable[..., EnvRef], minbase_store: Path,
        tmp_path: Path) -> None:
    """Sandboxes of tasks on the same groups opened at once: the first one mounts the shared
    groups, holding their locks meanwhile. The others start the mount of their own group
    at once and wait for the shared ones beside it (`acquire_mounted` passes over a mount
    the table does not list without taking its lock), not before it."""
    task = task_env(make_env, minbase_store, tmp_path, 200)
    with open_store(str(task.store)) as store:
        digest, manifest = Repository(store).resolve_env(task.ref)
        url = store.url
    planned = plan_lowers(digest, [g.index for g in manifest.groups], "layers", url,
                          task.cache)
    own, shared = (mounts.mountpoint(m.key) for m in planned)
    taken: list[list[Path]] = []
    worker = threading.Thread(target=lambda: taken.append(acquire_lowers(
        planned, "weenv-test-early", env=digest, store_url=url, cache_dir=task.cache)))
    try:
        with mounts.locked(planned[1].key):  # another sandbox is mounting the shared group
            worker.start()
            wait_for(lambda: daemon.is_mounted(own), "the own group's mount", timeout=60)
            assert daemon.is_mounted(own) and not daemon.is_mounted(shared)
            assert worker.is_alive()  # waiting for the shared group's lock
        worker.join(60)
        assert taken == [[own, shared]]
    finally:
        if worker.ident is not None:
            worker.join(60)
        release_lowers([m.key for m in planned], "weenv-test-early")
