"""Spare sandboxes (runtime/spares.py): a `weenv run` the node service ran leaves a spare of
its kind once its client has the status; the next run of exactly that kind claims it (its
command runs in it, with the same stdio, status, signals and clean-up as in a fresh one);
runs of another kind never do; a spare nobody claims goes when its time is up, when its
making or claim was cut short, or when its mounts are evicted; it never serves dead.

Real sandboxes, mounts and the session's node service. Spares are off for every other test
(runtime_fixtures.py `no_spares`); these turn them on and discard what they made."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rt_support import EnvRef, run_weenv
from support.polling import wait_for

from weenvfs.errors import UsageError
from weenvfs.fuse.service_forks import ANSWERED_TITLE
from weenvfs.runtime import cgroups, gc, mounts, sandbox_state, spares
from weenvfs.runtime.cgroups import Limits
from weenvfs.runtime.environment import resolve_source
from weenvfs.runtime.runtimes import default_launcher
from weenvfs.runtime.sandbox import EnvSource, Sandbox, SandboxOptions

WAIT = 60.0  # a safety bound, not a timing


@pytest.fixture
def allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spares allowed (2 at most) and mounts kept warm 600 s (a spare waits as long)."""
    monkeypatch.setenv(spares.SPARES_ENV, "2")
    monkeypatch.setenv(mounts.KEEP_WARM_ENV, "600")


@pytest.fixture
def spares_on(allowed: None, env_ref: EnvRef) -> Iterator[EnvRef]:
    """Spares allowed; every spare of the test's environment and its mounts are removed at
    the end."""
    try:
        yield env_ref
    finally:
        wait_for(lambda: not _tidying(), "the runs' processes to make their spares", WAIT)
        for box in _spares_of(env_ref):
            spares.discard(box.state.get("mounts") or ())
        for box in _spares_of(env_ref):  # a claim cut short by a failing test
            box.destroy()
        for key in env_ref.keys:
            mounts.evict(key, force=True)


def _tidying() -> bool:
    """Whether a command the node service ran is still at work after its answer (making a
    spare): it says so in its title before it answers."""
    for proc in Path("/proc").iterdir():
        try:
            if ANSWERED_TITLE.encode() in (proc / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def _spares_of(env: EnvRef) -> list[Sandbox]:
    found = []
    for sandbox_id in sandbox_state.list_ids():
        try:
            box = Sandbox.load(sandbox_id)
        except UsageError:
            continue
        if box.state["env"]["digest"] == env.digest and box.state.get("spare"):
            found.append(box)
    return found


def _run(env: EnvRef, *command: str, options: tuple[str, ...] = (),
         stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return run_weenv("run", "--store", str(env.store), "--cache", str(env.cache), *options,
                     env.ref, *command, check=False, input=stdin, timeout=WAIT)


def _one_spare(env: EnvRef) -> Sandbox:
    """The one claimable spare of `env`, once the last run's process made it."""

    def ready() -> list[Sandbox] | None:
        found = [box for box in _spares_of(env) if box.id in spares.ids()]
        return found if len(found) == 1 else None

    return wait_for(ready, "the spare the run leaves", WAIT)[0]


def _source_and_options(env: EnvRef, **options: object) -> tuple[object, SandboxOptions]:
    source = resolve_source(env.ref, str(env.store), str(env.cache), False)
    return source, SandboxOptions(**options)  # type: ignore[arg-type]


def test_the_next_run_of_the_same_kind_runs_in_the_spare_the_last_one_left(
        spares_on: EnvRef) -> None:
    env = spares_on
    first = _run(env, "hostname")
    assert first.returncode == 0, first.stderr
    spare = _one_spare(env)
    assert spare.status() == "spare" and spare.state["owner"] is None
    assert spare.id != first.stdout.decode().strip()
    second = _run(env, "/bin/sh", "-c", 'hostname; read line; echo "out:$line"; '
                  "echo err >&2; exit 7", stdin=b"hello\n")
    assert second.returncode == 7, second.stderr
    assert second.stdout.decode().splitlines() == [spare.id, "out:hello"]
    assert b"err\n" in second.stderr
    assert not sandbox_state.exists(spare.id)  # the run is one-shot: its sandbox is gone
    nxt = _one_spare(env)  # and it left the next one
    assert nxt.id != spare.id


def test_a_spare_has_the_fresh_sandboxs_process_and_nothing_a_run_left(
        spares_on: EnvRef) -> None:
    """The claimed spare runs the command as a fresh sandbox would (user, folder, env), its
    upper is empty, and what the last run wrote or started is not in it."""
    env = spares_on
    facts = "id -u; pwd; echo $HOME; hostname"
    first = _run(env, "/bin/sh", "-c", f"touch /root/left-behind; sleep 1000 & {facts}")
    spare = _one_spare(env)
    second = _run(env, "/bin/sh", "-c", "test -e /root/left-behind && echo left || echo clean;"
                  " cat /proc/[0-9]*/comm | grep -x sleep || echo no-sleep; " + facts)
    assert (first.returncode, second.returncode) == (0, 0), second.stderr
    assert first.stdout.decode().splitlines()[:3] == ["0", "/", "/root"]
    assert second.stdout.decode().splitlines() == ["clean", "no-sleep", "0", "/", "/root",
                                                   spare.id]


def test_runs_of_another_kind_do_not_take_the_spare(spares_on: EnvRef) -> None:
    env = spares_on
    assert _run(env, "true").returncode == 0
    spare = _one_spare(env)
    for options in (("--cpus", "1"), ("-e", "X=1"), ("--tmpfs-upper",), ("--keep-warm", "5")):
        done = _run(env, "hostname", options=options)
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode().strip() != spare.id
    assert sandbox_state.exists(spare.id) and spare.id in spares.ids()


def test_the_kinds_never_kept_as_spares(allowed: None) -> None:
    source = EnvSource("e:t", "d" * 64, "file:///s", Path("/c"))
    name = default_launcher().name
    plain = spares.spare_key(source, SandboxOptions(), name)
    assert plain is not None
    assert spares.spare_key(source, SandboxOptions(), name) == plain  # the same kind
    for options in (SandboxOptions(keep_upper=True), SandboxOptions(keep_warm=0),
                    SandboxOptions(name="named"), SandboxOptions(limits=Limits(elastic=True))):
        assert spares.spare_key(source, options, name) is None
    recording = dataclasses.replace(source, record_tag="latest")
    assert spares.spare_key(recording, SandboxOptions(), name) is None
    assert spares.spare_key(source, SandboxOptions(network="host"), name) not in (None, plain)
    old = os.umask(0o077)  # the modes of the folders a sandbox makes
    try:
        assert spares.spare_key(source, SandboxOptions(), name) not in (None, plain)
    finally:
        os.umask(old)


@pytest.mark.parametrize("value", ["off", "0"])
def test_spares_switched_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(spares.SPARES_ENV, value)
    source = EnvSource("e:t", "d" * 64, "file:///s", Path("/c"))
    assert spares.spare_key(source, SandboxOptions(), "crun") is None


def test_a_bad_spares_setting_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(spares.SPARES_ENV, "many")
    with pytest.raises(UsageError, match="WEENV_SPARES"):
        spares.max_spares()


def test_a_spare_is_claimed_once(spares_on: EnvRef) -> None:
    source, options = _source_and_options(spares_on)
    made = spares.make(source, options, "k" * 32)  # type: ignore[arg-type]
    assert made is not None
    assert spares.make(source, options, "k" * 32) is None  # one per kind  # type: ignore[arg-type]
    box = spares.claim("k" * 32, os.getpid())
    try:
        assert box is not None and box.id == made.id
        assert box.status() == "running" and box.state["owner"]["pid"] == os.getpid()
        assert "spare" not in box.state
        assert spares.claim("k" * 32, os.getpid()) is None
    finally:
        if box is not None:
            box.destroy()


def test_a_spare_whose_init_died_is_destroyed_not_served(spares_on: EnvRef) -> None:
    source, options = _source_and_options(spares_on)
    made = spares.make(source, options, "d" * 32)  # type: ignore[arg-type]
    assert made is not None
    os.kill(int(made.state["init_pid"]), signal.SIGKILL)
    wait_for(lambda: made.launcher.status(made.id) != "running", "the init to die", WAIT)
    assert spares.claim("d" * 32, os.getpid()) is None
    assert not sandbox_state.exists(made.id)


def test_sweep_removes_spares_past_their_time_and_those_cut_short(spares_on: EnvRef) -> None:
    source, options = _source_and_options(spares_on)
    kept = spares.make(source, options, "a" * 32)  # type: ignore[arg-type]
    assert kept is not None
    assert spares.sweep() == []  # within its time
    assert spares.sweep(now=kept.state["spare"]["until"] + 1) == [kept.id]
    assert not sandbox_state.exists(kept.id) and kept.id not in spares.ids()
    # Cut short: the state says spare, no claimable file (a claimer killed half way).
    cut = spares.make(source, options, "b" * 32)  # type: ignore[arg-type]
    assert cut is not None
    next(spares.SPARES_ROOT.glob(f"{'b' * 32}.*")).unlink()
    assert spares.sweep() == []  # it may be a making that is still under way
    later = time.time() + spares.UNCLAIMED_GRACE + 1
    assert spares.sweep(now=later) == [cut.id]


def test_gc_removes_a_spare_cut_short(spares_on: EnvRef) -> None:
    source, options = _source_and_options(spares_on)
    cut = spares.make(source, options, "c" * 32)  # type: ignore[arg-type]
    assert cut is not None
    next(spares.SPARES_ROOT.glob(f"{'c' * 32}.*")).unlink()
    cut.state["created"] -= spares.UNCLAIMED_GRACE + 1
    cut.save()
    assert cut.id in gc.collect().sandboxes
    assert not sandbox_state.exists(cut.id)


def test_evicting_the_mounts_a_spare_holds_discards_it(spares_on: EnvRef) -> None:
    env = spares_on
    assert _run(env, "true", options=("--keep-warm", "600")).returncode == 0
    spare = _one_spare(env)
    listed = run_weenv("mounts", "--json").stdout.decode()
    assert spare.id in listed  # a holder of its mounts
    # --idle: a mount only spares hold counts as idle.
    evicted = run_weenv("mounts", "evict", "--idle").stdout.decode()
    assert env.keys[0] in evicted
    assert not sandbox_state.exists(spare.id) and spare.id not in spares.ids()


def test_discarding_waits_for_a_spare_being_made(spares_on: EnvRef,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare whose making is under way when its mounts are evicted would take them again:
    `discard` waits for it, then removes it too."""
    source, options = _source_and_options(spares_on)
    started, go = threading.Event(), threading.Event()
    real = Sandbox.create

    def held(*args: object, **kwargs: object) -> Sandbox:
        started.set()
        go.wait(WAIT)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(spares.Sandbox, "create", held)
    made: list[Sandbox | None] = []
    maker = threading.Thread(target=lambda: made.append(
        spares.make(source, options, "e" * 32)))  # type: ignore[arg-type]
    maker.start()
    try:
        assert started.wait(WAIT)
        discarded: list[str] = []
        discarder = threading.Thread(target=lambda: discarded.extend(spares.discard()))
        discarder.start()
        go.set()
        discarder.join(WAIT)
        maker.join(WAIT)
    finally:
        go.set()
        maker.join(WAIT)
    [box] = made
    assert box is not None and discarded == [box.id]
    assert not sandbox_state.exists(box.id)


def test_a_client_killed_in_a_claimed_spare_leaves_nothing(spares_on: EnvRef) -> None:
    env = spares_on
    assert _run(env, "true").returncode == 0
    spare = _one_spare(env)
    child = subprocess.Popen(
        [sys.executable, "-m", "weenvfs", "run", "--store", str(env.store), "--cache",
         str(env.cache), env.ref, "/bin/sh", "-c", "hostname; sleep 1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().decode().strip() == spare.id
        assert spare.processes()
        child.kill()
        child.wait(WAIT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    wait_for(lambda: not sandbox_state.exists(spare.id), "the claimed spare to go", WAIT)


def test_priming_cgroup_moves_moves_nothing() -> None:
    before = Path("/proc/self/cgroup").read_text()
    cgroups._write_own_cgroup()
    assert Path("/proc/self/cgroup").read_text() == before
