"""HttpStore beyond the conformance suite: URLs, read-only refusals, ranges on servers that
ignore them, directories, reachability, and wire faults through the fault proxy (where a
flipped byte has no transport checksum to catch it, so the digest check must)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_proxy import FaultProxy
from http_server import RangeHTTPServer

from weenvfs.errors import (
    ObjectCorrupt,
    ObjectMissing,
    ObjectTooLarge,
    StoreError,
    StoreUnavailable,
)
from weenvfs.store import LocalStore, RetryingStore, RetryPolicy, open_store
from weenvfs.store.http import HttpStore
from weenvfs.store.repository import Repository

POLICY = RetryPolicy(max_attempts=4, base_delay=0.0, max_delay=0.0)
MiB = 1 << 20


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[RangeHTTPServer, LocalStore]]:
    """A private web server over a fresh LocalStore folder."""
    local = LocalStore(tmp_path / "www" / "store", create=True)
    with RangeHTTPServer(tmp_path / "www") as server:
        yield server, local


@pytest.fixture
def http_store(served: tuple[RangeHTTPServer, LocalStore]) -> Iterator[HttpStore]:
    store = HttpStore(f"{served[0].url}/store")
    try:
        yield store
    finally:
        store.close()


@pytest.mark.parametrize(
    "url",
    ["ftp://host/x", "http:///x", "http://user:pw@host/x", "http://host/x?token=1",
     "http://host/x#frag", "http://host/a b"],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(StoreError, match="bad store URL|invalid store prefix"):
        HttpStore(url)


def test_base_url_ends_in_one_slash() -> None:
    assert HttpStore("http://h:8/a/b/").base == "http://h:8/a/b/"
    assert HttpStore("https://h").base == "https://h/"


def test_writes_and_listing_are_refused(http_store: HttpStore, tmp_path: Path) -> None:
    assert http_store.read_only
    src = tmp_path / "f"
    src.write_bytes(b"x")
    for call in (lambda: http_store.put("blobs/a", b"x"),
                 lambda: http_store.put_file("blobs/a", src),
                 lambda: http_store.delete("blobs/a"),
                 lambda: list(http_store.list("blobs/")),
                 lambda: http_store.check(write=True)):
        with pytest.raises(StoreError, match="read-only|cannot list") as info:
            call()
        assert not isinstance(info.value, StoreUnavailable)
    with pytest.raises(StoreError, match="invalid store key"):
        http_store.put("../x", b"x")  # the key is still checked first


def test_get_range_sends_one_range_request(
    served: tuple[RangeHTTPServer, LocalStore], http_store: HttpStore
) -> None:
    server, local = served
    data = random.Random(1).randbytes(100_000)
    local.put("blobs/a", data)
    server.requests.clear()
    assert http_store.get_range("blobs/a", 70_000, 30_000) == data[70_000:]
    assert server.requests == [("GET", "/store/blobs/a", "bytes=70000-99999")]


def test_server_ignoring_range_small_object_is_sliced(
    served: tuple[RangeHTTPServer, LocalStore], http_store: HttpStore
) -> None:
    server, local = served
    data = random.Random(2).randbytes(50_000)
    local.put("blobs/a", data)
    server.ignore_range = True
    assert http_store.get_range("blobs/a", 10, 20) == data[10:30]
    with pytest.raises(StoreError, match="shorter"):
        http_store.get_range("blobs/a", 49_990, 20)


def test_server_ignoring_range_large_object_is_an_error(
    served: tuple[RangeHTTPServer, LocalStore], http_store: HttpStore
) -> None:
    server, local = served
    local.put("blobs/big", bytes(20 * MiB))
    server.ignore_range = True
    with pytest.raises(StoreError, match="ignored the Range header"):
        http_store.get_range("blobs/big", 0, 10)


def test_a_directory_is_not_an_object(
    served: tuple[RangeHTTPServer, LocalStore], http_store: HttpStore
) -> None:
    served[1].put("tags/env/a/latest", b"x")
    assert not http_store.exists("tags/env")  # 301 to tags/env/, then a listing page
    with pytest.raises(ObjectMissing):
        http_store.get("tags/env")


def test_unreachable_server_is_temporary() -> None:
    store = HttpStore("http://127.0.0.1:9/store", connect_timeout=1)
    for call in (store.check, lambda: store.get("blobs/a")):
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert info.value.temporary and "\n" not in str(info.value)


def test_open_store_reads_a_published_object(served: tuple[RangeHTTPServer, LocalStore]) -> None:
    server, local = served
    digest = Repository(local).put_object("manifests", b'{"x": 1}')
    with open_store(f"{server.url}/store/") as store:
        store.check()
        assert Repository(store).get_object("manifests", digest) == b'{"x": 1}'


# -- wire faults -----------------------------------------------------------------------------


@pytest.fixture
def proxy(served: tuple[RangeHTTPServer, LocalStore]) -> Iterator[FaultProxy]:
    with FaultProxy(served[0].url, stall=2.0) as p:
        yield p


def _through(proxy: FaultProxy) -> RetryingStore:
    return RetryingStore(HttpStore(f"{proxy.url}/store", read_timeout=0.5), POLICY,
                         sleep=lambda s: None)


@pytest.mark.parametrize("code", "53stcr")
def test_reads_survive_faults(
    served: tuple[RangeHTTPServer, LocalStore], proxy: FaultProxy, code: str
) -> None:
    data = random.Random(3).randbytes(200_000)
    served[1].put("blobs/a", data)
    store = _through(proxy)
    proxy.set_script(code * 2)
    assert store.get_range("blobs/a", 100, 150_000) == data[100:150_100]
    proxy.set_script(code)
    assert store.get("blobs/a") == data
    assert store.retries == 3
    store.close()


def test_persistent_fault_gives_up(
    served: tuple[RangeHTTPServer, LocalStore], proxy: FaultProxy
) -> None:
    served[1].put("blobs/a", b"data")
    store = _through(proxy)
    proxy.set_script("3*")
    with pytest.raises(StoreUnavailable) as info:
        store.get("blobs/a")
    assert info.value.temporary and proxy.requests("GET") == POLICY.max_attempts
    store.close()


def test_flipped_byte_is_caught_by_the_repository(
    served: tuple[RangeHTTPServer, LocalStore], proxy: FaultProxy
) -> None:
    """Plain HTTP has no checksum: the flipped bytes reach the store's caller, and
    Repository's digest check reads again (a flip on the way is temporary), then turns a
    persistent mismatch into ObjectCorrupt; never wrong bytes."""
    digest = Repository(served[1]).put_object("blobs", random.Random(4).randbytes(10_000))
    store = _through(proxy)
    proxy.set_script("ff")
    assert len(Repository(store).get_object("blobs", digest)) == 10_000
    assert proxy.requests("GET") == 3
    proxy.set_script("fff")
    with pytest.raises(ObjectCorrupt, match="in each of 3 reads"):
        Repository(store).get_object("blobs", digest)
    store.close()


def test_a_limit_bounds_a_body_without_content_length(
    served: tuple[RangeHTTPServer, LocalStore], http_store: HttpStore
) -> None:
    """A server that streams (chunked, no Content-Length) cannot make a bounded read take
    the whole body: it stops once the limit is passed and refuses the object."""
    server, local = served
    data = random.Random(5).randbytes(5 * MiB)
    local.put("manifests/big", data)
    server.chunked = True
    assert http_store.get("manifests/big") == data
    assert http_store.get("manifests/big", len(data)) == data
    with pytest.raises(ObjectTooLarge) as info:
        http_store.get("manifests/big", MiB)
    assert info.value.size is None and "larger than that" in str(info.value)
