"""A warm `weenv run NAME:TAG` starts from what the tag named last on this node while the store
confirms it (weenvfs/runtime/tag_guess.py): a tag moved since runs the environment it names
now, a tag deleted since fails as it would have without the guess, and nothing is left
behind either way. Both ways a user's run goes: carried out by the node service, and by the
client itself (WEENV_NODE_RUN=off). Real sandboxes, mounts and the session's node service."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rt_support import EnvRef

from weenvfs.format.manifest import RuntimeConfig
from weenvfs.runtime import tag_guess
from weenvfs.runtime.environment import resolve_source
from weenvfs.runtime.sandbox import KEPT_MARKER, UPPERS_ROOT
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

WAIT = 60.0  # a safety bound, not a timing
GUESSED = b"which it named last, while the store confirms it"
MOVED = b"no longer names"


@pytest.fixture(params=["service", "client"])
def run(request: pytest.FixtureRequest) -> Callable[..., subprocess.CompletedProcess[bytes]]:
    """`weenv -v run --store STORE --cache CACHE REF sh -c 'echo $MARK'` as a user runs it."""
    def weenv_run(ref: EnvRef, name: str, *options: str) -> subprocess.CompletedProcess[bytes]:
        env = dict(os.environ)  # as the test left it
        if request.param == "client":
            env["WEENV_NODE_RUN"] = "off"
        return subprocess.run(
            [sys.executable, "-m", "weenvfs", "-v", "run", *options, "--store", str(ref.store),
             "--cache", str(ref.cache), name, "/bin/sh", "-c", "echo $MARK"],
            capture_output=True, env=env, timeout=WAIT, check=False)

    return weenv_run


def _marked(make_env: Callable[..., EnvRef], mark: str) -> EnvRef:
    return make_env(RuntimeConfig(env=(f"MARK={mark}", "PATH=/usr/bin:/bin")))


def _point(ref: EnvRef, name: str, digest: str) -> None:
    """Tag `name` (NAME:TAG) of `ref`'s store names environment `digest` from now on."""
    env_name, tag = name.split(":")
    with open_store(str(ref.store)) as store:
        Repository(store).set_tag("envs", env_name, tag, digest)


def test_a_tag_moved_since_the_last_run_runs_what_it_names_now(
    make_env: Callable[..., EnvRef], run: Callable[..., subprocess.CompletedProcess[bytes]],
) -> None:
    first, second = _marked(make_env, "first"), _marked(make_env, "second")
    done = run(first, first.ref)
    assert (done.returncode, done.stdout) == (0, b"first\n"), done.stderr
    assert GUESSED not in done.stderr  # nothing noted yet: resolved in the store

    done = run(first, first.ref)
    assert (done.returncode, done.stdout) == (0, b"first\n"), done.stderr
    assert GUESSED in done.stderr and MOVED not in done.stderr

    _point(first, first.ref, second.digest)
    done = run(first, first.ref)
    assert (done.returncode, done.stdout) == (0, b"second\n"), done.stderr
    assert GUESSED in done.stderr and MOVED in done.stderr

    done = run(first, first.ref)  # the note follows the store's answer
    assert (done.returncode, done.stdout) == (0, b"second\n"), done.stderr
    assert GUESSED in done.stderr and MOVED not in done.stderr


def _kept_uppers() -> set[Path]:
    if not UPPERS_ROOT.is_dir():
        return set()
    return {folder for folder in UPPERS_ROOT.iterdir() if (folder / KEPT_MARKER).exists()}


def test_a_kept_run_keeps_the_upper_of_its_own_sandbox_not_the_discarded_guess(
    make_env: Callable[..., EnvRef], run: Callable[..., subprocess.CompletedProcess[bytes]],
) -> None:
    first, second = _marked(make_env, "first"), _marked(make_env, "second")
    assert run(first, first.ref).returncode == 0
    _point(first, first.ref, second.digest)
    before = _kept_uppers()
    done = run(first, first.ref, "--keep")
    kept = _kept_uppers() - before
    for folder in kept:
        shutil.rmtree(folder)
    assert (done.returncode, done.stdout) == (0, b"second\n"), done.stderr
    assert MOVED in done.stderr
    assert len(kept) == 1 and f"kept in {next(iter(kept))}/upper".encode() in done.stderr


def test_a_tag_deleted_since_the_last_run_fails_as_without_a_guess(
    env_ref: EnvRef, run: Callable[..., subprocess.CompletedProcess[bytes]],
) -> None:
    assert run(env_ref, env_ref.ref).returncode == 0
    name, tag = env_ref.ref.split(":")
    with open_store(str(env_ref.store)) as store:
        Repository(store).delete_tag("envs", name, tag)
    done = run(env_ref, env_ref.ref)
    assert done.returncode != 0 and done.stdout == b""
    assert GUESSED in done.stderr
    assert b"Traceback" not in done.stderr
    assert f"{name}:{tag}".encode() in done.stderr.strip().splitlines()[-1]


def _noted(ref: EnvRef) -> None:
    resolve_source(ref.ref, ref.store, ref.cache, False, node_service=False)


def test_a_guess_needs_a_noted_resolution_and_a_decided_recording(
    env_ref: EnvRef, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No guess before the first resolution on the node; after it, only when the store's
    argument names one store wherever it is used, and whether to record a hint needs no
    store request."""
    store, cache = env_ref.store, env_ref.cache
    assert tag_guess.start(env_ref.ref, store, cache, False) is None
    _noted(env_ref)
    guess = tag_guess.start(env_ref.ref, store, cache, False)
    assert guess is not None and guess.source.digest == env_ref.digest
    assert guess.confirm()
    monkeypatch.chdir(store.parent)
    assert tag_guess.start(env_ref.ref, store.name, cache, False) is None  # relative folder
    assert tag_guess.start(env_ref.ref, store, cache, True) is None  # records: resolves
    monkeypatch.setenv("WEENV_RECORD_HINTS", "on")
    assert tag_guess.start(env_ref.ref, store, cache, None) is None  # a hint? the store says
    monkeypatch.setenv("WEENV_RECORD_HINTS", "off")
    assert tag_guess.start(env_ref.ref, store, cache, None) is not None
    monkeypatch.setenv(tag_guess.SWITCH, "off")
    assert tag_guess.start(env_ref.ref, store, cache, False) is None


def test_a_guess_without_its_manifests_node_copy_is_none(
    env_ref: EnvRef, assert_logs: Callable[..., Any],
) -> None:
    _noted(env_ref)
    for copy in (env_ref.cache / "manifests").iterdir():
        copy.write_bytes(b"damaged")
    with assert_logs("copy of manifest .* is damaged", count=1):
        assert tag_guess.start(env_ref.ref, env_ref.store, env_ref.cache, False) is None


def test_a_switch_that_is_neither_on_nor_off_is_a_one_line_usage_error(
    env_ref: EnvRef, monkeypatch: pytest.MonkeyPatch,
    run: Callable[..., subprocess.CompletedProcess[bytes]],
) -> None:
    monkeypatch.setenv(tag_guess.SWITCH, "maybe")
    done = run(env_ref, env_ref.ref)
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.strip().splitlines()[-1] == (
        b"weenv: error: $WEENV_TAG_GUESS is 'maybe': set it to on or off (or unset it)")
    assert b"Traceback" not in done.stderr
