"""LocalStore behaviour beyond the conformance suite: crash safety, temp files, symlinks,
key/directory conflicts, and open_store URL resolution."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from weenvfs.store import (
    STORE_SCHEMES,
    LocalStore,
    ObjectMissing,
    ObjectTooLarge,
    StoreError,
    StoreUnavailable,
    open_store,
    url_scheme,
)
from weenvfs.store.base import TEMP_PREFIX
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.retry import RetryingStore

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(TEMP_PREFIX + "*"))


def start_child(code: str, *args: str) -> subprocess.Popen[str]:
    """Run `code` in a fresh interpreter that prints 'ready' when the parent may kill it."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def kill(child: subprocess.Popen[str]) -> None:
    """SIGKILL the child (by its pid) and reap it."""
    if child.poll() is None:
        os.kill(child.pid, signal.SIGKILL)
    child.wait()
    if child.stdout:
        child.stdout.close()


# The child stops forever at a chosen point inside put(), so the kill lands exactly there.
STALL_CHILD = """
    import os, sys, time
    from weenvfs.store import LocalStore

    root, where = sys.argv[1], sys.argv[2]
    real_write = os.write

    def stall():
        print("ready", flush=True)
        while True:
            time.sleep(60)

    def half_write(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        os.fsync(fd)
        stall()

    if where == "write":
        os.write = half_write
    else:
        os.replace = lambda src, dst: stall()
    LocalStore(root).put("tags/env/x/latest", b"N" * (4 << 20))
"""


@pytest.mark.parametrize("where", ["write", "replace"])
def test_writer_killed_mid_put_leaves_old_object(tmp_path: Path, where: str) -> None:
    store = LocalStore(tmp_path / "store", create=True)
    store.put("tags/env/x/latest", b"old")
    child = start_child(STALL_CHILD, str(store.root), where)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert len(temp_files(store.root)) == 1  # the half-written temp file is there
    finally:
        kill(child)
    assert store.get("tags/env/x/latest") == b"old"
    assert list(store.list()) == ["tags/env/x/latest"]
    assert store.cleanup_temp() == 0  # too young: it could be a live write
    assert store.cleanup_temp(max_age=0) == 1
    assert temp_files(store.root) == []
    assert store.get("tags/env/x/latest") == b"old"


LOOP_CHILD = """
    import sys
    from weenvfs.store import LocalStore

    store = LocalStore(sys.argv[1])
    versions = [bytes([n]) * (8 << 20) for n in range(3)]
    n = 0
    while True:
        store.put("blobs/big", versions[n % 3])
        if n == 0:
            print("ready", flush=True)
        n += 1
"""


@pytest.mark.parametrize("seed", range(3))
def test_writer_killed_at_random_never_leaves_partial_object(tmp_path: Path, seed: int) -> None:
    store = LocalStore(tmp_path / "store", create=True)
    child = start_child(LOOP_CHILD, str(store.root))
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        # A random moment to kill at, not a timing assertion: any moment must be safe.
        time.sleep(random.Random(seed).uniform(0.0, 0.3))
    finally:
        kill(child)
    data = store.get("blobs/big")
    assert len(data) == 8 * MiB and data in {bytes([n]) * (8 * MiB) for n in range(3)}
    assert list(store.list()) == ["blobs/big"]
    left = len(temp_files(store.root))
    assert store.cleanup_temp(max_age=0) == left
    assert temp_files(store.root) == []


def test_cleanup_temp_removes_only_old_temp_files(local_store: LocalStore) -> None:
    local_store.put("blobs/keep", b"keep")
    local_store.put("tags/env/a/b/latest", b"tag")
    root = local_store.root
    old = [root / "blobs" / ".tmp-old1", root / "tags/env/a/b" / ".tmp-old2"]
    young = root / "blobs" / ".tmp-young"
    an_hour_and_more = time.time() - 3700
    for path in [*old, young]:
        path.write_bytes(b"partial")
    for path in old:
        os.utime(path, (an_hour_and_more, an_hour_and_more))
    assert local_store.cleanup_temp() == 2
    assert temp_files(root) == [young]
    assert list(local_store.list()) == ["blobs/keep", "tags/env/a/b/latest"]


def test_stray_files_are_not_listed(local_store: LocalStore) -> None:
    local_store.put("blobs/ok", b"ok")
    (local_store.root / "blobs" / ".tmp-abc").write_bytes(b"partial")
    (local_store.root / "blobs" / "not a key").write_bytes(b"junk")
    (local_store.root / "blobs" / ".tmp-dir").mkdir()
    (local_store.root / "blobs" / ".tmp-dir" / "x").write_bytes(b"junk")
    assert list(local_store.list()) == ["blobs/ok"]


def test_key_cannot_also_be_a_directory(local_store: LocalStore) -> None:
    local_store.put("tags/env/a", b"a")
    with pytest.raises(StoreError, match="conflicts with an existing key"):
        local_store.put("tags/env/a/latest", b"x")
    local_store.put("tags/group/b/latest", b"b")
    with pytest.raises(StoreError, match="conflicts with an existing key"):
        local_store.put("tags/group/b", b"x")
    assert list(local_store.list()) == ["tags/env/a", "tags/group/b/latest"]
    assert temp_files(local_store.root) == []


def test_symlink_out_of_root_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    root = tmp_path / "store"
    root.mkdir()
    (root / "blobs").symlink_to(outside)
    store = LocalStore(root)
    for call in (lambda: store.get("blobs/secret"), lambda: store.put("blobs/new", b"x")):
        with pytest.raises(StoreError, match="outside"):
            call()
    assert list(store.list()) == []
    assert not (outside / "new").exists()


def test_symlinks_inside_root_are_followed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", create=True)
    store.put("blobs/real", b"data")
    (store.root / "blobs" / "alias").symlink_to(store.root / "blobs" / "real")
    (store.root / "blobs" / "dangling").symlink_to(tmp_path / "nowhere")
    assert store.get("blobs/alias") == b"data"
    assert list(store.list()) == ["blobs/alias", "blobs/real"]
    with pytest.raises(StoreError):
        store.get("blobs/dangling")


def test_root_reached_through_a_symlink(tmp_path: Path) -> None:
    real = LocalStore(tmp_path / "real", create=True)
    real.put("blobs/a", b"a")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    store = LocalStore(tmp_path / "link")
    assert store.get("blobs/a") == b"a"
    assert list(store.list()) == ["blobs/a"]
    assert store.url == (tmp_path / "link").as_uri()


def test_reader_never_creates_a_missing_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "missing")
    with pytest.raises(StoreUnavailable, match="does not exist"):
        store.put("blobs/a", b"a")
    assert not (tmp_path / "missing").exists()


def test_delete_on_missing_root_reports_it(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="does not exist"):
        LocalStore(tmp_path / "missing").delete("blobs/a")


def test_check_on_a_file_root(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreUnavailable, match="not a directory"):
        LocalStore(tmp_path / "file").check()
    for read in (lambda s: s.get("tags/envs/a/b"), lambda s: list(s.list())):  # the same words
        with pytest.raises(StoreUnavailable, match="not a directory"):
            read(LocalStore(tmp_path / "file"))


def test_create_makes_the_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a" / "b" / "store", create=True)
    assert store.root.is_dir()
    store.check(write=True)


# -- open_store ------------------------------------------------------------------------------


def test_open_store_file_url(tmp_path: Path) -> None:
    LocalStore(tmp_path / "s", create=True).put("blobs/a", b"a")
    for url in [(tmp_path / "s").as_uri(), "FILE://" + str(tmp_path / "s"),
                "file://localhost" + str(tmp_path / "s")]:
        store = open_store(url)
        assert isinstance(store, LocalStore)
        assert store.get("blobs/a") == b"a"


def test_open_store_percent_encoded_path(tmp_path: Path) -> None:
    target = tmp_path / "with space%"
    store = open_store(target.as_uri(), create=True)
    assert "%20" in store.url
    store.put("blobs/a", b"a")
    assert (target / "blobs" / "a").read_bytes() == b"a"


def test_open_store_plain_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    LocalStore(tmp_path / "s", create=True).put("blobs/a", b"a")
    assert open_store(str(tmp_path / "s")).get("blobs/a") == b"a"
    monkeypatch.chdir(tmp_path)
    for url in ["s", "./s", "s/", "sub/../s"]:
        store = open_store(url)
        assert store.get("blobs/a") == b"a"
        assert store.url == (tmp_path / "s").as_uri()


def test_url_scheme_is_what_open_store_picks_by() -> None:
    assert [url_scheme(u) for u in ("S3://b/p", "https://h/x", "file:///srv", "file:/srv",
                                    "/srv/store", "rel/store")] == \
        ["s3", "https", "file", "file", "file", "file"]


def test_open_store_does_not_create_unless_asked(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "new"))
    with pytest.raises(StoreUnavailable, match="does not exist"):
        store.check()
    assert not (tmp_path / "new").exists()
    open_store(str(tmp_path / "new"), create=True).check(write=True)


@pytest.mark.parametrize(
    "url", ["file://otherhost/x", "file://relative", "file:///x?y=1", "file:///x#frag", ""]
)
def test_open_store_bad_urls(url: str) -> None:
    with pytest.raises(StoreError):
        open_store(url)


def test_open_store_unknown_scheme_names_scheme_and_supported() -> None:
    with pytest.raises(StoreError) as info:
        open_store("ftp://host/bucket")
    message = str(info.value)
    assert "'ftp'" in message and "file://" in message and "\n" not in message


def test_scheme_registry_is_one_dict() -> None:
    assert STORE_SCHEMES["file"] is not None
    assert all(callable(f) for f in STORE_SCHEMES.values())


def test_missing_object_message_names_the_store(local_store: LocalStore) -> None:
    with pytest.raises(ObjectMissing) as info:
        local_store.get("blobs/none")
    assert local_store.url in str(info.value)


def test_a_limit_refuses_a_huge_file_from_its_size(local_store: LocalStore) -> None:
    """A 5 GB (sparse) object read with a limit is refused from its size, none of it read:
    this process's peak resident memory does not grow by anything like it."""
    local_store.put("manifests/huge", b"{")
    os.truncate(local_store.root / "manifests" / "huge", 5 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ObjectTooLarge, match="is 5368709120 bytes: refused, the limit is 4096"):
        local_store.get("manifests/huge", 4096)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


def test_local_file_is_the_key_s_file_unless_something_stands_in_front(tmp_path: Path) -> None:
    """`local_file`: what the native device server reads blobs through (a folder store's
    file, behind the retry wrapper too), never a file out of the root, and nothing where
    reads must pass through a store's own code (injected faults, a server)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "store"
    store = LocalStore(root, create=True)
    store.put("blobs/aa", b"frames")
    (root / "escape").symlink_to(outside)
    assert store.local_file("blobs/aa") == str(root / "blobs" / "aa")
    assert Path(store.local_file("blobs/aa") or "").read_bytes() == b"frames"
    assert store.local_file("escape/secret") is None
    assert store.local_file("../outside") is None
    assert RetryingStore(store).local_file("blobs/aa") == store.local_file("blobs/aa")
    assert FaultyStore(store, "C*").local_file("blobs/aa") is None
