"""Warm shared mounts: a released mount stays mounted (idle) for the next sandbox, idle mounts
are bounded (least recently used evicted first, never one with a holder), and `weenv mounts`
lists and evicts them.

Each test keeps its shared mounts in a folder of its own ($WEENV_ENVS_ROOT), so the bounds it
sets never evict the idle mounts of other jobs on the node, and removes them at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rt_support import EnvRef, run_weenv
from support.namespaces import Holder
from support.polling import wait_for

from weenvfs.fuse import daemon
from weenvfs.runtime import mounts
from weenvfs.runtime.environment import Environment


def _use(env: EnvRef) -> Path:
    """Run one sandbox of `env` (merged: one mount, keyed by its digest); its mount point."""
    with Environment.open(env.ref, store=env.store, cache=env.cache, lower="merged") as box:
        assert box.exec(["true"]).ok
        return box.sandbox.lowers[0]


def test_a_released_mount_stays_warm_and_serves_the_next_sandbox(
        warm_root: Path, make_env: Callable[..., EnvRef]) -> None:
    env = make_env()
    mp = _use(env)
    assert mp == mounts.mountpoint(env.digest) and daemon.is_mounted(mp)
    [info] = mounts.list_mounts()
    assert info.idle and info.idle_since is not None and info.warm_until is not None
    assert info.warm_until - info.idle_since == pytest.approx(600)
    pid = info.pid
    assert pid is not None and daemon.process_alive(pid)
    assert _use(env) == mp  # the same mount, the same daemon: nothing was mounted again
    [again] = mounts.list_mounts()
    assert again.pid == pid and again.idle


def test_a_release_drops_stale_holders_it_meets_and_stops_at_a_live_one(
        warm_root: Path, make_env: Callable[..., EnvRef]) -> None:
    """A holder file whose sandbox is gone (a crash between steps) does not keep the mount
    held: the release that would leave only it lets the mount go idle. A release that meets
    a live holder stops there (the mount stays held), whatever else the folder has."""
    env = make_env()
    opened = lambda: Environment.open(env.ref, store=env.store, cache=env.cache,  # noqa: E731
                                      lower="merged")
    holders = mounts.env_dir(env.digest) / "holders"
    with opened() as first:
        early, late = holders / "weenv-0-gone", holders / "weenv-z-gone"  # around every id
        early.touch()
        late.touch()
        with opened() as second:
            assert second.exec(["true"]).ok
        [held] = mounts.list_mounts()
        assert not held.idle
        assert not early.exists() and late.exists()  # it stopped at `first`, a live holder
        assert first.exec(["true"]).ok
    [idle] = mounts.list_mounts()
    assert idle.idle and idle.holders == () and not late.exists()


def test_idle_mounts_over_the_bound_are_evicted_least_recently_used_first(
        warm_root: Path, make_env: Callable[..., EnvRef],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mounts.WARM_MAX_ENV, "2")
    first, second, third = make_env(), make_env(), make_env()
    _use(first)
    _use(second)
    _use(first)  # now second is the least recently used
    with Environment.open(third.ref, store=third.store, cache=third.cache, lower="merged"):
        # Held mounts do not count: two idle ones are within the bound.
        assert {m.key for m in mounts.list_mounts() if m.idle} == {first.digest, second.digest}
    # The node service evicts in a process of its own (the close did not wait for it).
    wait_for(lambda: {m.key for m in mounts.list_mounts() if m.idle} == {first.digest,
                                                                          third.digest},
             "the node service's eviction", 60.0)
    assert not daemon.is_mounted(mounts.mountpoint(second.digest))


def test_a_run_the_node_service_carries_out_asks_for_the_eviction_after_its_answer(
        warm_root: Path, make_env: Callable[..., EnvRef],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`weenv run` in the node service's process asks for the eviction once its client has
    the status (service_forks.when_answered): it still happens. The service runs before the
    bound is set, so its own housekeeping keeps the default bound: only the runs' request
    can evict."""
    run_weenv("mountd", "--detach")
    monkeypatch.setenv(mounts.WARM_MAX_ENV, "1")
    first, second = make_env(), make_env()
    for env in (first, second):
        run_weenv("run", "--store", str(env.store), "--cache", str(env.cache), "--lower",
                  "merged", env.ref, "true")
    wait_for(lambda: {m.key for m in mounts.list_mounts() if m.idle} == {second.digest},
             "the eviction the second run asked for", 60.0)
    assert not daemon.is_mounted(mounts.mountpoint(first.digest))


def test_without_the_node_service_a_close_evicts_itself(
        warm_root: Path, make_env: Callable[..., EnvRef],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mounts.WARM_MAX_ENV, "1")
    monkeypatch.setenv("WEENV_MOUNTD", "off")
    first, second = make_env(), make_env()
    _use(first)
    _use(second)
    assert {m.key for m in mounts.list_mounts() if m.idle} == {second.digest}
    assert not daemon.is_mounted(mounts.mountpoint(first.digest))


def test_an_expired_mount_is_evicted_and_a_held_one_never(
        warm_root: Path, make_env: Callable[..., EnvRef]) -> None:
    idle_env, held_env = make_env(), make_env()
    _use(idle_env)
    with Environment.open(held_env.ref, store=held_env.store, cache=held_env.cache,
                          lower="merged") as box:
        evicted = mounts.evict_idle(mounts.WarmPolicy(seconds=600, max_idle=0, max_memory=1),
                                    now=float("inf"))
        assert evicted == [idle_env.digest]
        assert box.exec(["true"]).ok
        assert daemon.is_mounted(mounts.mountpoint(held_env.digest))


def test_idle_mounts_over_the_memory_bound_are_evicted_least_recently_used_first(
        warm_root: Path, make_env: Callable[..., EnvRef]) -> None:
    first, second = make_env(), make_env()
    _use(first)
    _use(second)
    size = {m.key: mounts._daemon_memory(m.pid) for m in mounts.list_mounts()}
    assert size[first.digest] > 0 and size[second.digest] > 0
    # Over the bound by half the smaller daemon: evicting the older one is enough.
    bound = sum(size.values()) - min(size.values()) // 2
    policy = mounts.WarmPolicy(seconds=600, max_idle=16, max_memory=bound)
    assert mounts.evict_idle(policy) == [first.digest]
    assert {m.key for m in mounts.list_mounts() if m.idle} == {second.digest}


def test_eviction_leaves_a_busy_mount_to_its_holder_and_a_gone_one_gone(
        warm_root: Path, make_env: Callable[..., EnvRef]) -> None:
    """32 sandboxes closing at once each walked every eviction victim, waiting for its lock
    while another thread tore it down, then tore down the folder it had just made again."""
    env = make_env()
    _use(env)
    over = mounts.WarmPolicy(seconds=600, max_idle=0, max_memory=0)
    with mounts.locked(env.digest):  # being made, used or torn down by someone else
        assert mounts.evict_idle(over) == []
    assert daemon.is_mounted(mounts.mountpoint(env.digest))
    assert mounts.evict_idle(over) == [env.digest]
    assert not mounts.env_dir(env.digest).exists()
    assert not mounts._evict(env.digest, lambda info: True)
    assert not mounts.env_dir(env.digest).exists()  # not made again to be torn down


def test_a_daemons_memory_is_measured_once_for_many_releases(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Measuring walks the daemon's page tables: a harness releasing 32 environments' mounts
    at once measured every idle daemon at every release (seconds of CPU in all)."""
    measured: list[int] = []
    monkeypatch.setattr(mounts, "_measure_memory", lambda pid: measured.append(pid) or 7)
    monkeypatch.setattr(mounts, "_memory_seen", {})
    assert [mounts._daemon_memory(pid) for pid in (10, 11, 10, 11, 10)] == [7] * 5
    assert measured == [10, 11]
    monkeypatch.setattr(mounts, "MEMORY_TTL", 0.0)
    assert mounts._daemon_memory(10) == 7 and measured == [10, 11, 10]


def test_weenv_mounts_lists_and_evicts(warm_root: Path, make_env: Callable[..., EnvRef]) -> None:
    one, two = make_env(), make_env()
    _use(one)
    _use(two)
    rows = json.loads(run_weenv("mounts", "--json").stdout)
    assert {r["key"] for r in rows} == {one.digest, two.digest}
    for row in rows:
        assert row["env"] == row["key"] and row["layer"] is None and row["holders"] == []
        assert row["data_path"] in ("kernel", "fuse") and row["pid"] > 0
        assert row["warm_until"] > row["idle_since"]
    table = run_weenv("mounts").stdout.decode()
    assert one.digest[:12] in table and "ago" in table
    # A holder (here one whose sandbox is gone) makes evict refuse, unless --force.
    (mounts.env_dir(one.digest) / "holders" / "weenv-gone").touch()
    refused = run_weenv("mounts", "evict", one.digest[:16], check=False)
    assert refused.returncode != 0 and b"holder" in refused.stderr
    assert refused.stderr.decode().count("\n") == 1
    empty = run_weenv("mounts", "evict", "", check=False)  # not a prefix of every key
    assert empty.returncode == 2 and b"empty key" in empty.stderr
    assert daemon.is_mounted(mounts.mountpoint(one.digest))
    done = run_weenv("mounts", "evict", "--idle").stdout.decode()
    assert done.split() == ["evicted", two.digest]
    run_weenv("mounts", "evict", one.digest, "--force")
    assert mounts.list_mounts() == []
    assert not daemon.is_mounted(mounts.mountpoint(one.digest))


def test_a_mount_namespace_made_meanwhile_never_holds_up_the_teardown(
        warm_root: Path, make_env: Callable[..., EnvRef], holders: list[Holder],
        caplog: pytest.LogCaptureFixture) -> None:
    """A namespace made while a sandbox runs (`ip netns exec`, `unshare -m`: private here,
    as on a host whose root mount is private) holds copies of the sandbox's overlay and of
    its shared mount. Closing with keep-warm 0 unmounts both and removes their folders,
    which detaches the copies: the daemon exits at once and the unmount never falls back to
    a lazy one (before: each unmount waited out the daemon's timeout twice)."""
    env = make_env()
    with caplog.at_level("INFO", logger="weenvfs.runtime.mounts"), \
            Environment.open(env.ref, store=env.store, cache=env.cache, keep_warm=0) as box:
        assert box.exec(["true"]).ok
        rootfs, [info] = box.sandbox.rootfs, mounts.list_mounts()
        holders.append(Holder("private"))
        assert holders[0].mounts_under(rootfs) != [] and holders[0].mounts_under(warm_root)
    assert [r.message for r in caplog.records if "lazily" in r.message] == []
    assert info.pid is not None and not daemon.process_alive(info.pid)
    assert holders[0].mounts_under(rootfs, warm_root) == [] and mounts.list_mounts() == []


def test_a_copy_in_use_in_another_namespace_is_left_to_it_and_the_eviction_goes_on(
        warm_root: Path, make_env: Callable[..., EnvRef], holders: list[Holder],
        assert_logs: Any) -> None:
    """A process of another mount namespace works in its copy of a warm mount: removing
    the folder detaches the copy, lazily (it is in use), so the daemon serves on. The
    eviction says so and goes on instead of waiting out the daemon's timeout twice; the
    daemon ends once that process does."""
    env = make_env()
    mp = _use(env)
    [info] = mounts.list_mounts()
    holders.append(Holder("private", cwd=mp))
    holder = holders[0].proc.pid
    with assert_logs(rf"other mount namespaces hold a copy of .*\(pid {holder} \(sleep\)\)",
                     count=1):
        assert mounts.evict(env.digest, force=True)
    assert not daemon.is_mounted(mp) and mounts.list_mounts() == []
    assert info.pid is not None and daemon.process_alive(info.pid)
    assert "etc" in os.listdir(f"/proc/{holders[0].proc.pid}/cwd")  # served still
    holders.pop().end()
    daemon.wait_exit(info.pid, 20)


def test_gc_takes_a_warm_mount_whose_daemon_was_killed(
        warm_root: Path, make_env: Callable[..., EnvRef]) -> None:
    """A killed daemon leaves a mount nothing can be read from: gc unmounts it at once (its
    warm time keeps nothing), with its kernel layers, instead of listing it till it expires."""
    env = make_env()
    mp = _use(env)
    [info] = mounts.list_mounts()
    assert info.pid is not None and info.warm_until is not None
    os.kill(info.pid, 9)
    daemon.wait_exit(info.pid, 30)
    done = json.loads(run_weenv("sandbox", "gc", "--json").stdout)
    assert env.digest in done["mounts"], done
    assert mounts.list_mounts() == [] and not daemon.is_mounted(mp)
    with open("/proc/self/mounts", "rb") as table:
        assert os.fsencode(str(warm_root)) not in table.read()
