"""RetryingStore over FaultyStore over a real LocalStore: what is retried, how often, how long
it sleeps. Sleep, clock and randomness are injected: nothing here waits for real."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from weenvfs.store import (
    LocalStore,
    ObjectMissing,
    RetryingStore,
    RetryPolicy,
    StoreError,
    StoreUnavailable,
)
from weenvfs.store.faulty import FaultyStore

POLICY = RetryPolicy(max_attempts=5, base_delay=0.1, max_delay=1.0, max_elapsed=30.0)


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


def make(
    inner: LocalStore,
    script: str = "",
    policy: RetryPolicy = POLICY,
    rand: float | None = None,
    **overrides: object,
) -> tuple[RetryingStore, FaultyStore, FakeTime]:
    faulty = FaultyStore(inner, script, **overrides)  # type: ignore[arg-type]
    fake = FakeTime()
    rng = random.Random(0).random if rand is None else (lambda: rand)
    retrying = RetryingStore(faulty, policy, sleep=fake.sleep, clock=fake.clock, rand=rng)
    return retrying, faulty, fake


def test_two_temporary_failures_then_success(local_store: LocalStore) -> None:
    local_store.put("blobs/a", b"data")
    store, faulty, fake = make(local_store, "EEg")
    assert store.get("blobs/a") == b"data"
    assert faulty.calls["get"] == 3
    assert store.retries == 2 and store.give_ups == 0
    assert len(fake.sleeps) == 2
    assert 0 <= fake.sleeps[0] <= 0.1 and 0 <= fake.sleeps[1] <= 0.2


@pytest.mark.parametrize("method", ["get", "get_range", "put", "exists", "size", "delete"])
def test_every_method_is_retried(local_store: LocalStore, method: str) -> None:
    local_store.put("blobs/a", b"data")
    store, faulty, _ = make(local_store, "Eg")
    calls = {
        "get": lambda: store.get("blobs/a"),
        "get_range": lambda: store.get_range("blobs/a", 1, 2),
        "put": lambda: store.put("blobs/a", b"data"),
        "exists": lambda: store.exists("blobs/a"),
        "size": lambda: store.size("blobs/a"),
        "delete": lambda: store.delete("blobs/a"),
    }
    calls[method]()
    assert faulty.calls[method] == 2 and store.retries == 1


def test_put_file_and_check_are_retried(local_store: LocalStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"file data")
    store, faulty, _ = make(local_store, "EgEg")
    store.put_file("blobs/f", src)
    store.check(write=True)
    assert local_store.get("blobs/f") == b"file data"
    assert faulty.calls["put_file"] == 2 and faulty.calls["check"] == 2


def test_permanent_failure_is_not_retried(local_store: LocalStore) -> None:
    store, faulty, fake = make(local_store, "Pg")
    with pytest.raises(StoreUnavailable) as info:
        store.get("blobs/a")
    assert not info.value.temporary
    assert faulty.calls["get"] == 1 and store.retries == 0 and fake.sleeps == []


def test_missing_object_is_not_retried(local_store: LocalStore) -> None:
    store, faulty, fake = make(local_store, "Mg")
    local_store.put("blobs/a", b"data")  # present, but the fault says missing
    with pytest.raises(ObjectMissing):
        store.get("blobs/a")
    assert faulty.calls["get"] == 1 and store.retries == 0 and fake.sleeps == []


def test_real_missing_object_and_bad_key_are_not_retried(local_store: LocalStore) -> None:
    store, faulty, fake = make(local_store)
    with pytest.raises(ObjectMissing):
        store.get("blobs/none")
    with pytest.raises(StoreError, match="invalid store key"):
        store.get("../etc/passwd")
    assert faulty.calls["get"] == 2 and store.retries == 0 and fake.sleeps == []


def test_exhaustion_raises_the_last_error(local_store: LocalStore) -> None:
    errors = iter(StoreUnavailable(f"blip {n}") for n in range(100))

    def failing_get(key: str, limit: int | None = None) -> bytes:
        raise next(errors)

    store, faulty, fake = make(local_store, get=failing_get)
    with pytest.raises(StoreUnavailable, match="blip 4"):
        store.get("blobs/a")
    assert faulty.calls["get"] == POLICY.max_attempts == 5
    assert store.retries == 4 and store.give_ups == 1 and len(fake.sleeps) == 4


def test_exhaustion_with_a_repeating_script(local_store: LocalStore) -> None:
    store, faulty, _ = make(local_store, "E*", policy=RetryPolicy(max_attempts=3))
    for _ in range(2):
        with pytest.raises(StoreUnavailable) as info:
            store.exists("blobs/a")
        assert info.value.temporary
    assert faulty.calls["exists"] == 6 and store.retries == 4 and store.give_ups == 2


def test_backoff_caps_double_up_to_max_delay() -> None:
    caps = [POLICY.backoff_cap(n) for n in range(1, 8)]
    assert caps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert POLICY.backoff_cap(10_000) == 1.0  # no overflow


def test_sleeps_are_full_jitter_within_the_caps(local_store: LocalStore) -> None:
    policy = RetryPolicy(max_attempts=8, base_delay=0.1, max_delay=1.0, max_elapsed=1e9)
    store, _, fake = make(local_store, "EEEEEEEg", policy=policy)
    store.exists("blobs/a")
    assert len(fake.sleeps) == 7
    for attempt, slept in enumerate(fake.sleeps, start=1):
        assert 0 <= slept <= policy.backoff_cap(attempt)
    assert len(set(fake.sleeps)) > 1  # jittered, not a fixed schedule


@pytest.mark.parametrize("rand, expected", [(0.0, [0.0] * 4), (0.5, [0.05, 0.1, 0.2, 0.4])])
def test_sleep_is_cap_times_random_fraction(
    local_store: LocalStore, rand: float, expected: list[float]
) -> None:
    store, _, fake = make(local_store, "EEEEg", rand=rand)
    store.exists("blobs/a")
    assert fake.sleeps == pytest.approx(expected)


def test_gives_up_before_exceeding_max_elapsed(local_store: LocalStore) -> None:
    policy = RetryPolicy(max_attempts=1000, base_delay=0.3, max_delay=0.3, max_elapsed=1.0)
    store, faulty, fake = make(local_store, "E*", policy=policy, rand=0.999)
    with pytest.raises(StoreUnavailable):
        store.get("blobs/a")
    assert sum(fake.sleeps) <= 1.0
    assert len(fake.sleeps) == 3 and faulty.calls["get"] == 4 and store.give_ups == 1


def test_max_attempts_one_means_no_retry(local_store: LocalStore) -> None:
    store, faulty, _ = make(local_store, "Eg", policy=RetryPolicy(max_attempts=1))
    with pytest.raises(StoreUnavailable):
        store.get("blobs/a")
    assert faulty.calls["get"] == 1 and store.retries == 0


def test_bad_policy_is_rejected() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(base_delay=-1)


def test_retries_are_logged_once_each(
    local_store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    local_store.put("blobs/a", b"data")
    store, _, _ = make(local_store, "EEg")
    with caplog.at_level(logging.DEBUG, logger="weenvfs.store.retry"):
        store.get("blobs/a")
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 2
    assert all(r.levelno == logging.INFO for r in retries)
    assert all(r.levelno < logging.WARNING for r in caplog.records)


# -- list ------------------------------------------------------------------------------------


def test_list_failing_midway_resumes_without_repeats(local_store: LocalStore) -> None:
    keys = [f"blobs/{i:02d}" for i in range(10)]
    for key in keys:
        local_store.put(key, b"")
    failures = iter([4, 7])  # the first try dies after 4 keys, the second after 7

    def flaky_list(prefix: str = "") -> Iterator[str]:
        stop = next(failures, None)
        for n, key in enumerate(local_store.list(prefix)):
            if n == stop:
                raise StoreUnavailable("connection reset mid-listing")
            yield key

    store, faulty, fake = make(local_store, list=flaky_list)
    assert list(store.list("blobs/")) == keys
    assert faulty.calls["list"] == 3 and store.retries == 2


def test_list_failing_at_the_call_is_retried(local_store: LocalStore) -> None:
    local_store.put("blobs/a", b"")
    store, faulty, _ = make(local_store, "EEg")
    assert list(store.list()) == ["blobs/a"]
    assert faulty.calls["list"] == 3


def test_list_permanent_failure_propagates(local_store: LocalStore) -> None:
    store, faulty, _ = make(local_store, "Pg")
    with pytest.raises(StoreUnavailable):
        list(store.list())
    assert faulty.calls["list"] == 1


def test_a_folder_store_has_cheap_requests_through_wrappers(local_store: LocalStore) -> None:
    """A mount leaves out neighbourhood fetches for such a store (fuse/mount.py); wrappers
    keep what the store they wrap says, and injected faults make requests dear."""
    assert local_store.cheap_requests
    assert RetryingStore(local_store).cheap_requests
    assert FaultyStore(local_store).cheap_requests
    assert not FaultyStore(local_store, "Eg").cheap_requests
    assert not RetryingStore(FaultyStore(local_store, "Eg")).cheap_requests
