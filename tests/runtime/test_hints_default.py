"""Hints by default (runtime/recording.py): an environment's first run records what it reads
through a recording mount and publishes the hint when it ends; the next run replays it; the
opt-out records nothing; a read-only store is said once and the run goes on.

Real mounts, sandboxes and a local store throughout (the runtime conftest's fixtures)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rt_support import EnvRef, compose_and_record, run_weenv
from support.polling import wait_for
from support.runtime_fixtures import GROUP
from test_stacked_lowers import task_env

from weenvfs.core.node_copies import known_hinted, resolve_env
from weenvfs.errors import RefNotFound
from weenvfs.fuse import daemon
from weenvfs.fuse.commands import read_stats
from weenvfs.runtime import mounts, recording
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.lower_modes import DEFAULT_LOWER
from weenvfs.runtime.lowers import plan_lowers
from weenvfs.runtime.recording import SWITCH_ENV, recording_key
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

READ = "cat /usr/bin/dpkg /usr/bin/apt-get > /dev/null 2>&1; cat /etc/os-release > /dev/null"


@pytest.fixture(autouse=True)
def _default_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWITCH_ENV, raising=False)  # the conftest turns it off for the others


def _hint_tag(env: EnvRef) -> str | None:
    with open_store(str(env.store)) as store:
        try:
            return Repository(store).get_tag("hints", env.digest, "latest")
        except RefNotFound:
            return None


def _store_url(env: EnvRef) -> str:
    with open_store(str(env.store)) as store:
        return store.url


def _wait_replayed(mountpoint: Path) -> dict[str, object]:
    """The stats of a mount once its hint replay has ended (a safety bound, not a timing)."""
    deadline = time.monotonic() + 60
    while True:
        doc = read_stats(mountpoint)
        if doc["hints"]["state"] not in ("starting", "looking up", "replaying"):
            return doc
        assert time.monotonic() < deadline, doc["hints"]
        time.sleep(0.05)


def test_first_run_publishes_a_hint_and_the_next_run_replays_it(
    env_ref: EnvRef, tmp_path: Path, test_digests: set[str]
) -> None:
    recorder = mounts.mountpoint(recording_key(env_ref.digest, _store_url(env_ref),
                                               env_ref.cache))
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache) as env:
        assert env.sandbox.lowers == [recorder]  # the private recording mount, merged
        assert env.exec(["/bin/sh", "-c", READ]).ok
    outcome = env.hint_outcome
    assert outcome is not None and outcome["hint"] and outcome["recorded"] > 0
    assert _hint_tag(env_ref) == outcome["hint"]
    assert not recorder.parent.exists()  # unmounted (that is when it published), gone

    # A cold node (an empty chunk cache of its own): the top group's shared mount replays it.
    cold = tmp_path / "cold-cache"
    with open_store(str(env_ref.store)) as store:
        repo = Repository(store)
        indexes = [g.index for g in repo.resolve_env(env_ref.digest)[1].groups]
        keys = [m.key for m in plan_lowers(env_ref.digest, indexes, DEFAULT_LOWER, store.url,
                                           cold)]
    test_digests.update(keys)
    with Environment.open(env_ref.ref, store=env_ref.store, cache=cold) as env:
        assert env.sandbox.lowers == [mounts.mountpoint(keys[0])]
        doc = _wait_replayed(mounts.mountpoint(keys[0]))
        assert doc["hints"]["hint"] == outcome["hint"] and doc["hints"]["chunks_done"] > 0
        assert env.exec(["/bin/sh", "-c", READ]).ok
        doc = read_stats(mounts.mountpoint(keys[0]))
        assert doc["fetch"]["prefetch"]["hint_hits"] > 0
    assert env.hint_outcome is None  # it had a hint: nothing recorded
    assert _hint_tag(env_ref) == outcome["hint"]


def test_a_stacks_top_layer_reads_every_layers_hinted_files_into_the_page_cache(
    make_env: Callable[..., EnvRef], minbase_store: Path, tmp_path: Path,
    test_digests: set[str],
) -> None:
    """The first run's hint names files of both groups; on a cold node the top layer's
    replay reads them all, those of the lower group through that group's own mount."""
    task = task_env(make_env, minbase_store, tmp_path, 0)
    with Environment.open(task.ref, store=task.store, cache=task.cache) as env:
        assert env.exec(["/bin/sh", "-c", READ + "; cat /work/task"]).ok
    assert env.hint_outcome is not None and env.hint_outcome["files"] > 1
    cold = tmp_path / "cold-cache"
    with open_store(str(task.store)) as store:
        repo = Repository(store)
        hint = repo.get_hint(env.hint_outcome["hint"])
        indexes = [g.index for g in repo.resolve_env(task.digest)[1].groups]
        keys = [m.key for m in plan_lowers(task.digest, indexes, DEFAULT_LOWER, store.url,
                                           cold)]
    test_digests.update(keys)
    assert {f.group for f in hint.files} == {0, 1}
    with Environment.open(task.ref, store=task.store, cache=cold) as env:
        top = mounts.mountpoint(keys[0])
        deadline = time.monotonic() + 60  # a safety bound, not a timing
        while (pages := read_stats(top)["hints"].get("pages")) is None \
                or pages["seconds"] is None:
            assert time.monotonic() < deadline, read_stats(top)["hints"]
            time.sleep(0.05)
        # Read, or found in the page cache already (the sandbox's start reads a few files
        # of the lower group itself, e.g. /etc/passwd): every file is there afterwards.
        assert pages["files"] == pages["files_read"] + pages["files_resident"] == len(hint.files)
        assert pages["files_read"] > 0 and pages["skipped"] == 0
        assert env.read_file("/work/task") == b"task 0\n"


def test_opting_out_records_nothing(env_ref: EnvRef) -> None:
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache,
                          record_hint=False) as env:
        assert env.sandbox.lowers == [env_ref.mountpoint()]  # the shared group mount
        assert env.exec(["/bin/sh", "-c", READ]).ok
    assert env.hint_outcome is None
    assert _hint_tag(env_ref) is None


@contextlib.contextmanager
def _read_only_view(folder: Path, at: Path) -> Iterator[Path]:
    """`folder` bind-mounted read-only at `at` (even root cannot write through it)."""
    at.mkdir()
    subprocess.run(["mount", "--bind", str(folder), str(at)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(at)], check=True)
        yield at
    finally:
        subprocess.run(["umount", str(at)], check=True)


def test_a_read_only_store_is_said_once_and_the_run_goes_on(
    env_ref: EnvRef, tmp_path: Path, test_digests: set[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="weenvfs.runtime.recording")
    with _read_only_view(env_ref.store, tmp_path / "ro-store") as ro:
        with open_store(str(ro)) as store:
            repo = Repository(store)
            indexes = [g.index for g in repo.resolve_env(env_ref.digest)[1].groups]
            test_digests.update(m.key for m in plan_lowers(
                env_ref.digest, indexes, DEFAULT_LOWER, store.url, env_ref.cache))
        for _ in range(2):
            with Environment.open(env_ref.ref, store=ro, cache=env_ref.cache) as env:
                assert env.exec(["/bin/sh", "-c", READ]).ok
            assert env.hint_outcome is None
    said = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert _hint_tag(env_ref) is None


def test_weenv_run_says_in_one_line_that_it_published_a_hint(
    env_ref: EnvRef, test_digests: set[str]
) -> None:
    done = run_weenv("run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
                     env_ref.ref, "/bin/sh", "-c", READ)
    lines = [ln for ln in done.stderr.decode().splitlines() if "prefetch hint" in ln]
    assert len(lines) == 1 and env_ref.ref in lines[0], done.stderr
    assert _hint_tag(env_ref) is not None
    # The second run has a hint: it records nothing and says nothing about hints.
    again = run_weenv("run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
                      env_ref.ref, "true")
    assert b"prefetch hint" not in again.stderr


def test_no_record_hint_flag(env_ref: EnvRef) -> None:
    done = run_weenv("run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
                     "--no-record-hint", env_ref.ref, "/bin/sh", "-c", READ)
    assert b"prefetch hint" not in done.stderr
    assert _hint_tag(env_ref) is None


def test_compose_with_a_hint_command_publishes_the_hint(
    minbase_store: Path, tmp_path: Path, test_digests: set[str]
) -> None:
    digest, stderr = compose_and_record(minbase_store, f"hinted-{tmp_path.name}:t", GROUP,
                                        tmp_path / "cache", test_digests, "--hint-command", READ)
    lines = [ln for ln in stderr.splitlines() if "prefetch hint" in ln]
    assert len(lines) == 1, stderr
    with open_store(str(minbase_store)) as store:
        hint = Repository(store).get_tag("hints", digest, "latest")
    assert hint in lines[0] or digest[:12] in lines[0]


def test_a_node_that_saw_a_hint_does_not_ask_the_store_again(env_ref: EnvRef) -> None:
    """Whether to record costs a store request only until the node saw a hint: then the
    manifest's node copy says so (core/node_copies.py HINTED). Shown by removing the tag
    behind the node's back: a default start still records nothing, a forced one does."""
    with open_store(str(env_ref.store)) as store:
        repo = Repository(store)
        digest, manifest = resolve_env(repo, env_ref.digest, env_ref.cache)
        assert recording.decide(store, digest, manifest, None, env_ref.cache)  # no hint yet
        # Only whether the tag exists matters here, not what it names.
        repo.set_tag("hints", digest, recording.HINT_TAG, repo.put_object("hints", b"x"))
        assert not known_hinted(env_ref.cache, digest)
        assert not recording.decide(store, digest, manifest, None, env_ref.cache)
        assert known_hinted(env_ref.cache, digest)
        repo.delete_tag("hints", digest, recording.HINT_TAG)
        assert not recording.decide(store, digest, manifest, None, env_ref.cache)
        assert recording.decide(store, digest, manifest, True, env_ref.cache)
        assert recording.decide(store, digest, manifest, None, None)  # no node: the store


def _no_recording_mount() -> bool:
    return not any(m.record for m in mounts.list_mounts())


def test_a_first_run_leaves_the_publish_to_the_node_service(
    env_ref: EnvRef, warm_root: Path
) -> None:
    """Nobody reads a default recording's hint next: `close` leaves the recording mount,
    idle and due, to the node service's eviction, whose unmount has the daemon publish."""
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache) as env:
        assert env.exec(["/bin/sh", "-c", READ]).ok
    assert env.hint_outcome == {"pending": True, "manifest": env_ref.digest, "tag": "latest"}
    wait_for(_no_recording_mount, "the node service's unmount of the recording mount", 60.0)
    hint = _hint_tag(env_ref)
    assert hint is not None
    with open_store(str(env_ref.store)) as store:
        assert Repository(store).get_hint(hint).records


def test_weenv_run_says_the_node_service_publishes_its_hint(
    env_ref: EnvRef, warm_root: Path
) -> None:
    done = run_weenv("run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
                     env_ref.ref, "/bin/sh", "-c", READ)
    lines = [ln for ln in done.stderr.decode().splitlines() if "prefetch hint" in ln]
    assert len(lines) == 1 and "the node service publishes it" in lines[0], done.stderr
    wait_for(_no_recording_mount, "the node service's unmount of the recording mount", 60.0)
    assert _hint_tag(env_ref) is not None


def test_an_explicit_recording_is_published_before_close_returns(
    env_ref: EnvRef, warm_root: Path
) -> None:
    """`record_hint=True` (`--record-hint`, what `weenv convert` runs): its caller reads the
    hint next, so the close waits for the publish even where the node service could."""
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache,
                          record_hint=True) as env:
        assert env.exec(["/bin/sh", "-c", READ]).ok
    outcome = env.hint_outcome
    assert outcome is not None and not outcome.get("pending") and outcome["hint"]
    assert _hint_tag(env_ref) == outcome["hint"]
    assert _no_recording_mount()


def test_a_sandbox_that_starts_before_the_publish_joins_the_recording(
    env_ref: EnvRef, warm_root: Path
) -> None:
    """A recording mount left to the node service is idle, not gone: the next sandbox of the
    environment takes the same mount (the same daemon), and the hint is published when the
    last holder leaves. No eviction is asked for here, so nothing races the second acquire."""
    url = _store_url(env_ref)
    key = recording_key(env_ref.digest, url, env_ref.cache)

    def take(holder: str) -> Path:
        return mounts.acquire(key, holder, store_url=url, cache_dir=env_ref.cache,
                              env=env_ref.digest, record="latest")

    mp = take("first")
    assert (mp / "etc/os-release").read_bytes()
    pending = mounts.release(key, "first", evict=False, publish_later=True)
    assert pending is not None and pending["pending"]
    [left] = mounts.list_mounts()
    assert left.record and left.idle and left.warm_until is not None
    assert left.warm_until <= time.time() and daemon.is_mounted(mp)
    assert take("second") == mp
    [joined] = mounts.list_mounts()
    assert joined.pid == left.pid and not joined.idle and joined.warm_until is None
    outcome = mounts.release(key, "second")  # waited for: unmounted and published now
    assert outcome is not None and outcome["hint"] and outcome["recorded"] > 0
    assert _hint_tag(env_ref) == outcome["hint"] and _no_recording_mount()
