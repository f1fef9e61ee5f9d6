"""The one conformance suite every Store backend must pass (restic's `Suite`).

Written against the `Store` interface only, through the `store`, `writer` and `backend`
fixtures of conftest.py; nothing here may know which backend it runs on. Read tests put their
objects through `writer` (the store itself, or for a read-only store a writable one of the same
location); tests marked `writes` write or list through the store under test and are skipped on
read-only stores.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from weenvfs.store import (
    ObjectMissing,
    ObjectTooLarge,
    Store,
    StoreError,
    StoreUnavailable,
    validate_key,
    validate_prefix,
)

if TYPE_CHECKING:
    from conftest import Backend

MiB = 1 << 20


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic pseudo-random bytes, so a shifted or truncated copy never matches."""
    return random.Random(seed).randbytes(size)


# -- put / get -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4097, 5 * MiB], ids=["empty", "1B", "4KiB+1", "5MiB"])
def test_put_get_roundtrip(store: Store, writer: Store, size: int) -> None:
    data = payload(size, seed=size)
    writer.put("blobs/abc123", data)
    assert store.get("blobs/abc123") == data
    assert store.size("blobs/abc123") == size


@pytest.mark.writes
def test_put_accepts_bytes_like(store: Store) -> None:
    store.put("blobs/a", bytearray(b"from bytearray"))
    store.put("blobs/b", memoryview(b"xxfrom memoryviewxx")[2:-2])
    assert store.get("blobs/a") == b"from bytearray"
    assert store.get("blobs/b") == b"from memoryview"


@pytest.mark.writes
def test_put_same_content_twice_is_harmless(store: Store) -> None:
    store.put("blobs/ff00", b"same")
    store.put("blobs/ff00", b"same")
    assert store.get("blobs/ff00") == b"same"
    assert list(store.list()) == ["blobs/ff00"]


def test_get_with_a_limit_refuses_a_larger_object(store: Store, writer: Store) -> None:
    """A bounded read (SPEC.md 12.1) returns an object up to the limit and refuses a larger
    one with ObjectTooLarge, naming the key, its size where known, and the limit."""
    data = payload(5 * MiB + 3, seed=11)
    writer.put("manifests/big", data)
    writer.put("tags/env/x/empty", b"")
    assert store.get("manifests/big", len(data)) == data
    assert store.get("manifests/big", None) == data
    assert store.get("tags/env/x/empty", 0) == b""
    for limit in (0, MiB, len(data) - 1):
        with pytest.raises(ObjectTooLarge) as info:
            store.get("manifests/big", limit)
        assert info.value.key == "manifests/big" and info.value.limit == limit
        assert info.value.size in (None, len(data))
        assert f"limit is {limit}" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ObjectMissing):
        store.get("manifests/none", MiB)


def test_get_missing_raises_object_missing(store: Store) -> None:
    with pytest.raises(ObjectMissing) as info:
        store.get("blobs/0000")
    assert info.value.key == "blobs/0000"
    assert "blobs/0000" in str(info.value)


@pytest.mark.writes
def test_overwrite_tag(store: Store) -> None:
    key = "tags/env/team/proj/latest"
    store.put(key, b"manifests/" + b"a" * 64)
    store.put(key, b"manifests/" + b"b" * 64)
    assert store.get(key) == b"manifests/" + b"b" * 64
    store.put(key, b"short")  # a shorter value leaves no tail of the longer one
    assert store.get(key) == b"short"
    assert list(store.list("tags/")) == [key]


@pytest.mark.writes
def test_put_file(store: Store, tmp_path: Path) -> None:
    data = payload(3 * MiB + 17, seed=7)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    store.put_file("blobs/big", src)
    store.put_file("blobs/big-str", str(src))
    assert store.get("blobs/big") == data
    assert store.get("blobs/big-str") == data
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    store.put_file("blobs/empty", empty)
    assert store.get("blobs/empty") == b""


@pytest.mark.writes
def test_put_file_of_missing_source_raises_oserror(store: Store, tmp_path: Path) -> None:
    with pytest.raises(OSError):
        store.put_file("blobs/x", tmp_path / "does-not-exist")
    assert not store.exists("blobs/x")


# -- get_range -------------------------------------------------------------------------------


def test_get_range(store: Store, writer: Store) -> None:
    data = payload(10_000, seed=1)
    writer.put("blobs/r", data)
    for offset, length in [(0, 100), (4321, 1234), (9900, 100), (0, 10_000), (9999, 1)]:
        assert store.get_range("blobs/r", offset, length) == data[offset : offset + length]


def test_get_range_zero_length(store: Store, writer: Store) -> None:
    writer.put("blobs/r", b"0123456789")
    assert store.get_range("blobs/r", 0, 0) == b""
    assert store.get_range("blobs/r", 5, 0) == b""
    assert store.get_range("blobs/r", 10, 0) == b""  # at the very end


@pytest.mark.parametrize("offset, length", [(5, 6), (10, 1), (11, 0), (100, 5), (0, 11)])
def test_get_range_past_end_raises(store: Store, writer: Store, offset: int, length: int) -> None:
    writer.put("blobs/r", b"0123456789")
    with pytest.raises(StoreError) as info:
        store.get_range("blobs/r", offset, length)
    assert not isinstance(info.value, ObjectMissing)


def test_get_range_of_empty_object(store: Store, writer: Store) -> None:
    writer.put("blobs/e", b"")
    assert store.get_range("blobs/e", 0, 0) == b""
    with pytest.raises(StoreError):
        store.get_range("blobs/e", 0, 1)


def test_get_range_missing_raises_object_missing(store: Store) -> None:
    with pytest.raises(ObjectMissing):
        store.get_range("blobs/none", 0, 1)
    with pytest.raises(ObjectMissing):
        store.get_range("blobs/none", 0, 0)


def test_get_range_negative_is_value_error(store: Store, writer: Store) -> None:
    writer.put("blobs/r", b"0123456789")
    with pytest.raises(ValueError):
        store.get_range("blobs/r", -1, 2)
    with pytest.raises(ValueError):
        store.get_range("blobs/r", 0, -2)


# -- exists / size / delete ------------------------------------------------------------------


def test_exists_and_size(store: Store, writer: Store) -> None:
    assert not store.exists("indexes/aa")
    with pytest.raises(ObjectMissing):
        store.size("indexes/aa")
    writer.put("indexes/aa", b"12345")
    assert store.exists("indexes/aa")
    assert store.size("indexes/aa") == 5


def test_a_prefix_of_keys_is_not_an_object(store: Store, writer: Store) -> None:
    writer.put("tags/env/team/proj/latest", b"x")
    assert not store.exists("tags/env/team")
    with pytest.raises(ObjectMissing):
        store.get("tags/env/team")
    with pytest.raises(ObjectMissing):
        store.size("tags/env/team")
    writer.delete("tags/env/team")  # not an object: nothing to do
    assert store.get("tags/env/team/proj/latest") == b"x"


@pytest.mark.writes
def test_delete_is_idempotent(store: Store) -> None:
    store.delete("blobs/never-there")
    store.put("blobs/d", b"data")
    store.put("blobs/keep", b"keep")
    store.delete("blobs/d")
    assert not store.exists("blobs/d")
    with pytest.raises(ObjectMissing):
        store.get("blobs/d")
    store.delete("blobs/d")
    assert list(store.list()) == ["blobs/keep"]


# -- list ------------------------------------------------------------------------------------

LAYOUT = [
    "blobs/00ff",
    "blobs/0a1b",
    "blobs/ab12",
    "hints/77",
    "indexes/cd34",
    "manifests/ef56",
    "tags/env/team/proj/latest",
    "tags/env/team/proj/v1.2",
    "tags/env/team-b/x/latest",
    "tags/group/base-os/2024.06",
]


@pytest.fixture
def laid_out(store: Store) -> Store:
    for key in LAYOUT:
        store.put(key, key.encode())
    return store


@pytest.mark.parametrize(
    "prefix",
    ["", "blobs/", "blobs/0", "blobs/0a", "blob", "tags/", "tags/env/team", "tags/env/team/",
     "tags/env/team/proj/", "tags/env/team/proj/l", "tags/group/base-os/2024.06", "nothing/",
     "nothing", "tags/env/zzz/"],
)
@pytest.mark.writes
def test_list_by_prefix(laid_out: Store, prefix: str) -> None:
    expected = sorted(k for k in LAYOUT if k.startswith(prefix))
    assert list(laid_out.list(prefix)) == expected


@pytest.mark.writes
def test_list_is_in_key_order(store: Store) -> None:
    # "-" and "." sort before "/", which naive directory-by-directory walks get wrong.
    keys = ["a/x", "a-b", "a.c", "a/b/c", "a0", "a_b/z", "A", "a~", "a/-", "a/b-/q", "a/b/-"]
    for key in keys:
        store.put(key, b"")
    assert list(store.list()) == sorted(keys)
    assert list(store.list("a/")) == sorted(k for k in keys if k.startswith("a/"))


@pytest.mark.writes
def test_list_is_complete_for_2000_keys(store: Store) -> None:
    keys = [f"blobs/{i:04x}{'ab' * 30}" for i in range(2000)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: store.put(k, k.encode()), keys))
    listed = list(store.list("blobs/"))
    assert listed == sorted(keys)
    assert len(set(listed)) == 2000


@pytest.mark.writes
def test_list_never_shows_unfinished_writes(store: Store) -> None:
    """While objects are being written, a listing shows only keys that were put."""
    keys = [f"blobs/{i:03d}" for i in range(60)]
    data = payload(256 * 1024)
    done = threading.Event()

    def writer() -> None:
        try:
            for key in keys:
                store.put(key, data)
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        seen: set[str] = set()
        while not done.is_set():
            seen.update(store.list())
    finally:
        thread.join()
    assert seen <= set(keys)
    assert list(store.list()) == keys


@pytest.mark.writes
def test_list_empty_store(store: Store) -> None:
    assert list(store.list()) == []
    assert list(store.list("blobs/")) == []


# -- keys ------------------------------------------------------------------------------------

BAD_KEYS = [
    "", "/blobs/abs", "blobs//x", "blobs/", "./blobs/x", "blobs/./x", "blobs/../x", "..",
    "blobs/a\x00b", "blobs\\x", "blobs/a b", "blobs/é", "tags/x/.tmp-123", "blobs/a?b",
    "blobs/a%2Fb", "b" * 256, "a/" * 600,
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_rejected_by_every_method(store: Store, writer: Store, key: str) -> None:
    calls = [
        lambda: store.get(key),
        lambda: store.get_range(key, 0, 1),
        lambda: store.put(key, b"x"),
        lambda: store.exists(key),
        lambda: store.size(key),
        lambda: store.delete(key),
    ]
    for call in calls:
        with pytest.raises(StoreError, match="invalid store key"):
            call()
    assert list(writer.list()) == []


def test_invalid_key_message_is_one_clear_line() -> None:
    with pytest.raises(StoreError) as info:
        validate_key("blobs/../etc/passwd")
    message = str(info.value)
    assert "\n" not in message
    assert "'blobs/../etc/passwd'" in message and "'..'" in message


@pytest.mark.parametrize(
    "key", ["blobs/" + "0f" * 32, "tags/env/team/proj/v1.2-rc_3", "a", "x~y/Z.9", "..a/b..c"]
)
def test_valid_keys_accepted(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize("prefix", ["/x", "blobs//", "a/../b", "a b", "tags/.tmp-/", "\\"])
def test_invalid_prefixes_rejected(store: Store, prefix: str) -> None:
    with pytest.raises(StoreError, match="invalid store prefix"):
        list(store.list(prefix))


@pytest.mark.parametrize("prefix", ["", "blobs", "blobs/", "blobs/0", "tags/env/a.", "t"])
def test_valid_prefixes_accepted(prefix: str) -> None:
    assert validate_prefix(prefix) == prefix


# -- concurrency -----------------------------------------------------------------------------


@pytest.mark.writes
def test_concurrent_puts_of_one_key_leave_one_intact_version(store: Store) -> None:
    versions = [payload(1 * MiB, seed=n) for n in range(8)]
    barrier = threading.Barrier(9)
    torn: list[int] = []

    def writer(n: int) -> None:
        barrier.wait()
        for _ in range(4):
            store.put("tags/env/x/latest", versions[n])

    def reader() -> None:
        barrier.wait()
        for _ in range(40):
            try:
                data = store.get("tags/env/x/latest")
            except ObjectMissing:
                continue  # before the first writer finished
            if data not in versions:
                torn.append(len(data))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torn == []
    assert store.get("tags/env/x/latest") in versions
    assert list(store.list()) == ["tags/env/x/latest"]


@pytest.mark.writes
def test_concurrent_puts_of_different_keys(store: Store) -> None:
    def put_many(n: int) -> None:
        for i in range(25):
            store.put(f"blobs/t{n}/{i:02d}", f"{n}:{i}".encode())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put_many, range(8)))
    keys = list(store.list())
    assert len(keys) == 200
    for n in range(8):
        for i in range(25):
            assert store.get(f"blobs/t{n}/{i:02d}") == f"{n}:{i}".encode()


# -- check -----------------------------------------------------------------------------------


def test_check_passes_on_a_good_store(store: Store) -> None:
    store.check()
    if not store.read_only:
        store.check(write=True)
        assert list(store.list()) == []  # the write probe leaves nothing behind


def test_check_fails_fast_on_a_missing_store(backend: Backend) -> None:
    missing = backend.open_missing()
    try:
        for write in (False, True):
            with pytest.raises(StoreUnavailable) as info:
                missing.check(write=write)
            assert not info.value.temporary
            message = str(info.value)
            assert "\n" not in message and missing.url in message
    finally:
        missing.close()


def test_missing_store_is_not_a_missing_object(backend: Backend) -> None:
    """A missing store must never look like an empty one."""
    missing = backend.open_missing()
    try:
        with pytest.raises(StoreUnavailable):
            missing.get("blobs/x")
        with pytest.raises(StoreUnavailable):
            missing.exists("blobs/x")
        if not missing.read_only:
            with pytest.raises(StoreUnavailable):
                list(missing.list())
            with pytest.raises(StoreUnavailable):
                missing.put("blobs/x", b"x")
    finally:
        missing.close()


def test_store_is_a_context_manager(backend: Backend) -> None:
    with backend.open() as s:
        backend.writer(s).put("blobs/c", b"c")
        assert s.get("blobs/c") == b"c"
        assert s.url in repr(s)
