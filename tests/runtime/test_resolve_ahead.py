"""`weenv run NAME:TAG` makes its sandbox from this node's last answer for the tag while the
store is asked (runtime/resolve_ahead.py): the store's answer still decides. A tag moved
since runs what it names now; a tag gone fails as it did before, leaving no sandbox; a guess
that cannot be used is no error."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
from rt_support import EnvRef, run_weenv

from weenvfs.core.node_copies import MANIFEST_DIR
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.format.refs import object_key
from weenvfs.runtime import sandbox_state
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

TAG = "moving:latest"


def _point(env: EnvRef, at: EnvRef | None) -> None:
    """Point tag TAG of `env`'s store at environment `at` (None: delete it)."""
    with open_store(str(env.store)) as store:
        repo = Repository(store)
        if at is None:
            repo.delete_tag("envs", "moving", "latest")
        else:
            repo.set_tag("envs", "moving", "latest", at.digest)


def _which(env: EnvRef, switch: str, check: bool = True) -> bytes:
    done = run_weenv("run", "--store", str(env.store), "--cache", str(env.cache), TAG,
                     "/bin/sh", "-c", "echo $WHICH", check=check)
    return done.stdout if check else done.stderr


@pytest.fixture(params=["on", "off"])
def switch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run by the node service, and in the client's own process."""
    monkeypatch.setenv("WEENV_NODE_RUN", request.param)
    return str(request.param)


def test_a_tag_moved_since_the_last_run_runs_what_it_names_now(
        make_env: Callable[..., EnvRef], switch: str) -> None:
    first = make_env(RuntimeConfig(env=("WHICH=first",)))
    second = make_env(RuntimeConfig(env=("WHICH=second",)))
    _point(first, first)
    assert _which(first, switch) == b"first\n"
    assert _which(first, switch) == b"first\n"  # from the guess, confirmed
    _point(first, second)
    assert _which(first, switch) == b"second\n"
    assert _which(first, switch) == b"second\n"
    _point(first, first)  # and back
    assert _which(first, switch) == b"first\n"


def test_a_tag_gone_fails_as_before_and_leaves_no_sandbox(
        make_env: Callable[..., EnvRef], switch: str) -> None:
    env = make_env(RuntimeConfig(env=("WHICH=first",)))
    _point(env, env)
    assert _which(env, switch) == b"first\n"
    before = set(sandbox_state.list_ids())
    _point(env, None)
    said = _which(env, switch, check=False).decode()
    assert said.startswith("weenv: error: no environment moving:latest"), said
    assert said.count("\n") == 1
    running = {i for i in set(sandbox_state.list_ids()) - before
               if sandbox_state.read_state(sandbox_state.sandbox_dir(i)).get("status")
               != "parked"}
    assert not running


def test_a_guess_whose_manifest_is_gone_is_no_error(
        make_env: Callable[..., EnvRef], switch: str) -> None:
    first = make_env(RuntimeConfig(env=("WHICH=first",)))
    second = make_env(RuntimeConfig(env=("WHICH=second",)))
    _point(first, first)
    assert _which(first, switch) == b"first\n"
    # The node's copy of the guessed manifest and the store's are gone; the tag moved on.
    shutil.rmtree(first.cache / MANIFEST_DIR, ignore_errors=True)
    with open_store(str(first.store)) as store:
        store.delete(object_key("manifests", first.digest))
    _point(first, second)
    assert _which(first, switch) == b"second\n"
