"""FaultyStore itself: the script language, overrides and call counting, over a real
LocalStore. The retry tests rely on all of this behaving exactly as documented."""

from __future__ import annotations

import threading

import pytest

from weenvfs.store import LocalStore, ObjectMissing, StoreUnavailable
from weenvfs.store.faulty import FaultyStore, corrupt


@pytest.fixture
def inner(local_store: LocalStore) -> LocalStore:
    local_store.put("blobs/a", b"0123456789")
    return local_store


def test_script_codes_apply_in_call_order(inner: LocalStore) -> None:
    store = FaultyStore(inner, "gEPMCSg", delay=0)
    assert store.get("blobs/a") == b"0123456789"
    with pytest.raises(StoreUnavailable) as temporary:
        store.exists("blobs/a")
    with pytest.raises(StoreUnavailable) as permanent:
        store.size("blobs/a")
    with pytest.raises(ObjectMissing):
        store.get("blobs/a")
    assert store.get_range("blobs/a", 2, 4) == corrupt(b"2345") != b"2345"
    assert store.get("blobs/a") == b"0123456789"  # S: slept, then passed
    assert store.get("blobs/a") == b"0123456789"
    assert store.get("blobs/a") == b"0123456789"  # script exhausted: passes
    assert temporary.value.temporary and not permanent.value.temporary
    assert store.calls == {"get": 5, "exists": 1, "size": 1, "get_range": 1}
    assert store.injected["E"] == 1 and store.injected["g"] == 3


def test_star_repeats_the_last_code(inner: LocalStore) -> None:
    store = FaultyStore(inner, "gE*")
    assert store.exists("blobs/a")
    for _ in range(5):
        with pytest.raises(StoreUnavailable):
            store.exists("blobs/a")


def test_corrupt_flips_exactly_one_byte() -> None:
    data = bytes(range(100))
    bad = corrupt(data)
    assert len(bad) == len(data)
    assert sum(a != b for a, b in zip(data, bad, strict=True)) == 1
    assert corrupt(b"") == b"\x00"


def test_corrupt_code_leaves_writes_alone(inner: LocalStore) -> None:
    store = FaultyStore(inner, "C")
    store.put("blobs/b", b"intact")
    assert inner.get("blobs/b") == b"intact"


def test_faults_on_put_leave_the_store_untouched(inner: LocalStore) -> None:
    store = FaultyStore(inner, "EP")
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            store.put("blobs/b", b"x")
    assert not inner.exists("blobs/b")


@pytest.mark.parametrize("script", ["x", "gg?", "*", "g**", "e"])
def test_bad_scripts_are_rejected(inner: LocalStore, script: str) -> None:
    with pytest.raises(ValueError, match="bad fault script"):
        FaultyStore(inner, script)


def test_override_replaces_the_inner_call(inner: LocalStore) -> None:
    seen: list[tuple[str, int, int]] = []

    def short_read(key: str, offset: int, length: int) -> bytes:
        seen.append((key, offset, length))
        return inner.get_range(key, offset, length)[:-1]

    store = FaultyStore(inner, "Eg", get_range=short_read)
    with pytest.raises(StoreUnavailable):
        store.get_range("blobs/a", 0, 4)
    assert store.get_range("blobs/a", 0, 4) == b"012"
    assert seen == [("blobs/a", 0, 4)]  # the faulted call never reached the override
    assert store.get("blobs/a") == b"0123456789"


def test_unknown_override_is_rejected(inner: LocalStore) -> None:
    with pytest.raises(TypeError, match="gett"):
        FaultyStore(inner, gett=lambda key: b"")


def test_script_is_consumed_once_per_call_across_threads(inner: LocalStore) -> None:
    store = FaultyStore(inner, "E" * 100)
    failures = 0
    lock = threading.Lock()

    def worker() -> None:
        nonlocal failures
        for _ in range(25):
            try:
                store.exists("blobs/a")
            except StoreUnavailable:
                with lock:
                    failures += 1

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == 100 and store.calls["exists"] == 200


def test_url_and_close_pass_through(inner: LocalStore) -> None:
    store = FaultyStore(inner, "P*")
    assert store.url == inner.url
    store.close()
