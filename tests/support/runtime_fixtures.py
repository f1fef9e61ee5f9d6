"""The runtime fixtures, shared by tests/runtime and tests/security (each conftest imports
them): see tests/runtime/conftest.py for what each one gives.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from support.mount_server import mount_server
from support.runtime import (
    EnvRef,
    NodeSnapshot,
    force_cleanup,
    leaks,
    runtime_unavailable,
    sample_store,
)
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.runtime import mounts, parking, sandbox
from weenvfs.runtime.lower_modes import DEFAULT_LOWER
from weenvfs.runtime.lowers import plan_lowers
from weenvfs.runtime.recording import recording_key
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.publish import compose_env

__all__ = ["GROUP", "_runtime_requirements", "env_ref", "make_env", "minbase_store",
           "node_clean", "parked_env", "test_digests", "warm_root"]

GROUP = "minbase:t"


@pytest.fixture(autouse=True)
def _runtime_requirements(
    requires_fuse: None, require_or_skip: Callable[[object, str], None]
) -> None:
    reason = runtime_unavailable()
    require_or_skip(reason is None, reason or "")


@pytest.fixture(scope="session")
def minbase_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LocalStore holding group `minbase:t` built from the Debian minbase sample."""
    if runtime_unavailable() is not None:
        pytest.skip(runtime_unavailable() or "")
    return sample_store(tmp_path_factory.mktemp("runtime-store"), "minbase", "minbase")


@pytest.fixture
def test_digests() -> set[str]:
    """Digests of the environments this test made and keys of their mounts (what
    `node_clean` checks)."""
    return set()


@pytest.fixture
def make_env(minbase_store: Path, tmp_path: Path, test_digests: set[str]) -> Callable[..., EnvRef]:
    """`make_env(config=None, name="rt", groups=[minbase])`: a new environment of `groups`
    (NAME:TAG of groups in the minbase store, lowest first)."""
    count = [0]

    def make(config: RuntimeConfig | None = None, name: str = "rt",
             groups: Sequence[str] = (GROUP,)) -> EnvRef:
        count[0] += 1
        tag = f"t{count[0]}"
        store = open_store(str(minbase_store))
        try:
            repo = Repository(store)
            digest = compose_env(
                repo, name, tag, list(groups), config, {"test-nonce": uuid.uuid4().hex}
            )
            indexes = [g.index for g in repo.resolve_env(digest)[1].groups]
            keys = tuple(m.key for m in plan_lowers(digest, indexes, DEFAULT_LOWER, store.url,
                                                     tmp_path / "cache"))
            # The mounts a first run and a seed record the environment's hints through.
            recorders = {recording_key(digest, store.url, tmp_path / "cache", tag)
                         for tag in ("latest", "seed")}
        finally:
            store.close()
        test_digests.update({digest, *keys, *recorders})
        return EnvRef(f"{name}:{tag}", minbase_store, digest, tmp_path / "cache", keys)

    return make


@pytest.fixture
def env_ref(make_env: Callable[..., EnvRef]) -> EnvRef:
    """One fresh environment (its own digest, an empty chunk cache)."""
    return make_env()


@pytest.fixture(autouse=True)
def node_clean(_runtime_requirements: None, test_digests: set[str]) -> Iterator[None]:
    """Fail the test if it leaves anything of a sandbox behind (after removing it). Only
    what belongs to the test's environments counts: other jobs may run sandboxes too."""
    before = NodeSnapshot.take()
    try:
        yield
    finally:
        left = leaks(before, NodeSnapshot.take(), test_digests)
        if left:
            force_cleanup(before, test_digests)
    if left:
        pytest.fail(f"the test left sandbox state behind: {left}", pytrace=False)


@pytest.fixture(autouse=True)
def no_default_hint_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sandboxes stand on their environments' shared group mounts, not on a first run's
    recording mount (the tests name those mounts); tests of recording turn it back on."""
    monkeypatch.setenv("WEENV_RECORD_HINTS", "off")


@pytest.fixture
def warm_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              test_digests: set[str]) -> Iterator[Path]:
    """A private folder of shared mounts ($WEENV_ENVS_ROOT) kept warm 600 s, as on a node (the
    node service evicts them; the bounds a test sets never evict other jobs' mounts); every
    mount in it is evicted after the test (held ones too), and the roots parked over them
    first. No root is parked unless the test turns parking on ($WEENV_PARK_SECONDS, the
    `parking` fixture): these tests are about the mounts, which a parked root holds."""
    root = tmp_path / "envs"
    monkeypatch.setenv(mounts.ROOT_ENV, str(root))
    monkeypatch.setenv(mounts.KEEP_WARM_ENV, "600")
    monkeypatch.setenv(parking.PARK_SECONDS_ENV, "0")
    try:
        yield root
    finally:
        sandbox.drop_parked(keys={m.key for m in mounts.list_mounts()} | test_digests)
        for mount in mounts.list_mounts():
            mounts.evict(mount.key, force=True)


@pytest.fixture
def parked_env(warm_root: Path, make_env: Callable[..., EnvRef], tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[EnvRef]:
    """An environment whose runs park their roots (on a node keeping its mounts warm), run
    by a node service of the test's own: the session's service forks its housekeeping every
    minute, which also removes expired parked roots, and a removal it is finishing (the
    folder goes after the lock) would race what a test checks right after its own."""
    monkeypatch.setenv(parking.PARK_SECONDS_ENV, "60")
    with mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch):
        yield make_env()
