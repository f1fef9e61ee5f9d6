"""A node's memo of the S3 stores it wrote to lately (fuse/writable_stores.py), as the
decision to record a first run's hint uses it (runtime/recording.py `decide`): one write probe
speaks for its store, URL and keys, for WRITABLE_TTL seconds; other keys, an expired memo, a
forgotten one and stores with no identity are probed.

Real parts: the session's SeaweedFS with its writer keys and its read-only keys in the
environment (as `weenv run` and the Python API open stores), the test's own memo folder (a
node service socket path under tmp_path). A probe with the read-only keys really fails, so a
decision that says "record" with them shows that no probe was made.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import s3_store
from support import trees

from weenvfs.format.manifest import Manifest
from weenvfs.fuse import writable_stores
from weenvfs.runtime import recording
from weenvfs.store import Store, open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group, open_source
from weenvfs.tools.publish import compose_env


@pytest.fixture
def published(seaweed: Any, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, Manifest]:
    """(URL, manifest digest, manifest) of a small environment with no hint, in a prefix of
    its own; the memo folder is this test's."""
    monkeypatch.setenv("WEENV_MOUNTD_SOCKET", str(tmp_path / "node" / "mountd.sock"))
    monkeypatch.delenv(recording.SWITCH_ENV, raising=False)
    url = seaweed.url(f"writable-{tmp_path.name}")
    src = trees.make_tree(tmp_path / "src", trees.file("etc/hostname", b"tiny\n"))
    with s3_store(seaweed, url) as store:
        repo = Repository(store)
        build_group(open_source(src), repo, "tiny-os", "1")
        compose_env(repo, "tiny", "1", ["tiny-os:1"])
        digest, manifest = repo.resolve_env("tiny:1", repo.get_manifest)
    return url, digest, manifest


def _keys(monkeypatch: pytest.MonkeyPatch, seaweed: Any, reader: bool) -> None:
    for key, value in seaweed.env(reader).items():
        monkeypatch.setenv(key, value)


def _records(store: Store, published: tuple[str, str, Manifest]) -> bool:
    _, digest, manifest = published
    return recording.decide(store, digest, manifest, None)


def _memo_files(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "node" / writable_stores.FOLDER
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_a_write_probe_speaks_for_the_same_keys_only(
    seaweed: Any, published: tuple[str, str, Manifest], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    url = published[0]
    _keys(monkeypatch, seaweed, reader=False)
    with open_store(url) as writer:
        assert not writable_stores.known_writable(writer)
        assert _records(writer, published)  # probed: the writer's keys may write
        assert writable_stores.known_writable(writer)
    assert len(_memo_files(tmp_path)) == 1
    _keys(monkeypatch, seaweed, reader=True)
    with open_store(url) as reader:
        assert not writable_stores.known_writable(reader)  # other keys: its own question
        assert not _records(reader, published)  # probed, and the probe failed
        assert not writable_stores.known_writable(reader)
    assert len(_memo_files(tmp_path)) == 1


def test_a_memo_is_trusted_until_it_expires_or_is_forgotten(
    seaweed: Any, published: tuple[str, str, Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    _keys(monkeypatch, seaweed, reader=True)  # a probe with these keys fails
    with open_store(published[0]) as store:
        writable_stores.remember(store)  # as if a probe had passed
        assert _records(store, published)  # no probe made: the memo was taken
        memo = writable_stores._memo(store)
        assert memo is not None
        old = time.time() - writable_stores.WRITABLE_TTL - 1
        os.utime(memo, (old, old))
        assert not writable_stores.known_writable(store)
        assert not _records(store, published)  # expired: probed again, and it failed
        writable_stores.remember(store)
        writable_stores.forget(store)  # what a recording mount does when it cannot publish
        assert not _records(store, published)
        assert not memo.exists()


def test_stores_without_the_nodes_credentials_are_always_probed(
    seaweed: Any, published: tuple[str, str, Manifest], tmp_path: Path
) -> None:
    """Keys given to one store object are not the node's, and a directory store's probe is a
    local file: neither has an identity, so neither is remembered."""
    with s3_store(seaweed, published[0]) as given:
        assert given.writer_identity() is None
        assert _records(given, published)
        writable_stores.remember(given)
        assert not writable_stores.known_writable(given)
    with open_store(str(tmp_path / "dir-store"), create=True) as folder:
        assert folder.writer_identity() is None
    assert _memo_files(tmp_path) == []
