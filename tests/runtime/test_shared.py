"""One mount per environment, shared: 16 sandboxes at once, one fetch per chunk, keep-warm,
and the Python API (sync and trio) with several environments at once in one process."""

from __future__ import annotations

import json
import stat
import threading
import time
import traceback
from pathlib import Path

import pytest
import trio
from rt_support import EnvRef, run_weenv
from support.mount_server import mount_server

from weenvfs.fuse import daemon
from weenvfs.runtime import gc, mounts, sandbox
from weenvfs.runtime.environment import AsyncEnvironment, Environment, open_many
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

SANDBOXES = 16


def _files_and_chunks(env: EnvRef, folder: bytes) -> tuple[list[str], set[bytes]]:
    """Regular files directly in `folder` of the environment, and their distinct non-zero
    chunk digests (what reading them all must fetch, each exactly once)."""
    with open_store(str(env.store)) as store:
        repo = Repository(store)
        _, manifest = repo.resolve_env(env.digest)
        index = repo.get_index(manifest.groups[0].index)
    files, digests = [], set()
    folder_ino = index.resolve(folder)
    assert folder_ino is not None
    for name, ino in index.entries(folder_ino):
        if not stat.S_ISREG(index.inode(ino).mode):
            continue
        files.append("/" + (folder + b"/" + name).decode())
        for n in index.file_chunks(ino):
            record = index.chunk(n)
            if not record.zero:
                digests.add(record.digest)
    return files, digests


def test_16_sandboxes_share_one_mount_and_one_fetch_per_chunk(env_ref: EnvRef) -> None:
    files, chunks = _files_and_chunks(env_ref, b"usr/bin")
    assert len(files) > 20 and chunks
    envs = open_many([env_ref.ref] * SANDBOXES, store=env_ref.store, cache=env_ref.cache)
    try:
        mp = env_ref.mountpoint()
        assert {tuple(e.sandbox.lowers) for e in envs} == {(mp,)}
        with open("/proc/self/mounts") as f:
            assert sum(line.split()[1] == str(mp) for line in f) == 1
        listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)
        ours = [m for m in listed["mounts"] if m["key"] == env_ref.keys[0]]
        assert len(ours) == 1 and len(ours[0]["holders"]) == SANDBOXES
        results: list[bytes] = [b""] * SANDBOXES

        def read_all(i: int) -> None:
            done = envs[i].exec(["sh", "-c", 'cat "$@" | md5sum', "-", *files])
            assert done.ok, done.stderr
            results[i] = done.stdout

        threads = [threading.Thread(target=read_all, args=(i,)) for i in range(SANDBOXES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(results)) == 1 and results[0]  # every sandbox read the same bytes
        stats = json.loads(run_weenv("stats", "--json", str(mp)).stdout)
        assert stats["mount"]["manifest"] == env_ref.digest
        # One fetch per chunk: every chunk fetched is in the (fresh) cache exactly once, and
        # the chunks of the files read are among them. The shells and libraries the
        # sandboxes ran were fetched too, so the count is more than the files' chunks.
        cached = {p.name for p in env_ref.cache.glob("??/*") if len(p.name) == 64}
        assert stats["fetch"]["chunks_fetched"] == len(cached)
        assert {d.hex() for d in chunks} <= cached
        assert stats["fetch"]["errors"] == {}
    finally:
        for env in envs:
            env.close()
    assert not daemon.is_mounted(env_ref.mountpoint())


def test_several_environments_at_once_from_threads(make_env: object) -> None:
    refs = [make_env() for _ in range(2)]  # type: ignore[operator]
    outcome: dict[str, bytes] = {}
    failures: list[str] = []

    def episode(n: int) -> None:
        ref = refs[n % 2]
        try:
            with Environment.open(ref.ref, store=ref.store, cache=ref.cache) as env:
                env.write_file("/root/n", str(n))
                env.reset()
                env.write_file("/root/n", f"{n}!")
                outcome[f"{n}"] = env.exec(["cat", "/root/n"]).stdout
        except Exception:  # reported by the assertion below, with its traceback
            failures.append(traceback.format_exc())

    threads = [threading.Thread(target=episode, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, "\n".join(failures)
    assert outcome == {f"{n}": f"{n}!".encode() for n in range(6)}


def test_sandboxes_whose_mount_forks_from_a_mount_server(
        env_ref: EnvRef, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `weenv mountd` on the node, the shared mount is forked from it: the sandboxes work
    the same, and closing the last one unmounts and ends that daemon (node_clean checks the
    rest)."""
    with mount_server(tmp_path / "mountd.sock", monkeypatch) as server:
        envs = open_many([env_ref.ref] * 2, store=env_ref.store, cache=env_ref.cache)
        try:
            mp = env_ref.mountpoint()
            record = daemon.read_pid_file(mp)
            assert record is not None
            title = Path(f"/proc/{record['pid']}/cmdline").read_bytes()
            assert b"mountd" not in title and str(mp).encode() in title
            envs[0].write_file("/root/mine", "0")
            assert envs[1].exec(["cat", "/etc/debian_version"]).exit_code == 0
            assert envs[1].exec(["test", "-e", "/root/mine"]).exit_code == 1
        finally:
            for env in envs:
                env.close()
        assert not daemon.is_mounted(mp)
        assert not daemon.process_alive(record["pid"])
        assert daemon.process_alive(server)


def test_async_environments_run_concurrently(make_env: object) -> None:
    refs = [make_env() for _ in range(2)]  # type: ignore[operator]
    seen: dict[int, tuple[bytes, bytes, int]] = {}

    async def episode(n: int) -> None:
        ref = refs[n % 2]
        async with await AsyncEnvironment.open(ref.ref, store=ref.store, cache=ref.cache) as env:
            await env.write_file("/tmp/task", f"task {n}\n")
            done = await env.exec(["cat", "/tmp/task"])
            assert await env.read_file("/tmp/task") == done.stdout
            slow = await env.exec(["sleep", "30"], timeout=0.5)
            await env.reset()
            missing = await env.exec(["test", "-e", "/tmp/task"])
            hostname = (await env.exec(["hostname"])).stdout
            seen[n] = (done.stdout, hostname, missing.exit_code)
            assert slow.timed_out

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(episode, n)

    trio.run(main)
    assert sorted(seen) == [0, 1, 2, 3]
    for n, (task, hostname, missing) in seen.items():
        assert task == f"task {n}\n".encode() and missing == 1 and hostname.startswith(b"weenv-")


def test_keep_warm_keeps_the_mount_until_it_expires(env_ref: EnvRef,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a node service a release starts the keep-warm timer (with one, the service
    # expires warm mounts itself).
    monkeypatch.setenv("WEENV_MOUNTD", "off")
    mp = env_ref.mountpoint()
    with Environment.open(
        env_ref.ref, store=env_ref.store, cache=env_ref.cache, keep_warm=600
    ) as env:
        first = env.id
    info = json.loads((mp.parent / "mount.json").read_text())
    try:
        assert daemon.is_mounted(mp) and not (mp.parent / "holders" / first).exists()
        assert daemon.process_alive(info["timer_pid"])
        assert env_ref.keys[0] not in gc.collect(mounts_only=True).mounts  # still warm
        with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache) as env:
            assert env.sandbox.lowers == [mp]  # the warm mount was reused
            assert env.exec(["true"]).ok
        # The second sandbox asked for no keep-warm: its release unmounted at once.
        assert not daemon.is_mounted(mp)
        assert _gone(info["timer_pid"])
    finally:
        mounts.expire(env_ref.keys[0], sandbox.exists, now=float("inf"))


def test_expired_keep_warm_is_unmounted_by_gc(env_ref: EnvRef,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a node service a release starts the keep-warm timer (with one, the service
    # expires warm mounts itself).
    monkeypatch.setenv("WEENV_MOUNTD", "off")
    mp = env_ref.mountpoint()
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache, keep_warm=600):
        pass
    timer = json.loads((mp.parent / "mount.json").read_text())["timer_pid"]
    try:
        assert mounts.expire(env_ref.keys[0], sandbox.exists, now=time.time() + 601)
        assert not daemon.is_mounted(mp) and not mp.parent.exists()
        assert _gone(timer)
    finally:
        mounts.expire(env_ref.keys[0], sandbox.exists, now=float("inf"))


def _gone(pid: int, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while daemon.process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_keep_warm_timer_unmounts_by_itself(env_ref: EnvRef,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a node service a release starts the keep-warm timer (with one, the service
    # expires warm mounts itself).
    monkeypatch.setenv("WEENV_MOUNTD", "off")
    mp = env_ref.mountpoint()
    try:
        with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache, keep_warm=2):
            pass
        timer = json.loads((mp.parent / "mount.json").read_text())["timer_pid"]
        assert _gone(timer, 60.0)  # the timer ran `weenv sandbox gc --mounts-only` and ended
        assert not daemon.is_mounted(mp) and not mp.parent.exists()
    finally:
        mounts.expire(env_ref.keys[0], sandbox.exists, now=float("inf"))


def test_a_release_by_a_non_holder_leaves_a_warm_mount_alone(env_ref: EnvRef) -> None:
    """A sandbox whose build stopped before it took the mount releases it in its teardown:
    that must not unmount what another sandbox left warm."""
    mp = env_ref.mountpoint()
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache,
                          keep_warm=600):
        pass
    try:
        mounts.release(env_ref.keys[0], "weenv-never-held")
        assert daemon.is_mounted(mp)
        assert json.loads((mp.parent / "mount.json").read_text())["warm_until"] > time.time()
    finally:
        mounts.expire(env_ref.keys[0], sandbox.exists, now=float("inf"))
