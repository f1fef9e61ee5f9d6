"""GETs and LISTs of an S3 store without botocore (weenvfs/store/s3_direct.py), against a
real SeaweedFS: the same bytes, keys and errors as botocore's requests, signatures botocore
would make, and botocore kept wherever the getter does not apply."""

from __future__ import annotations

import datetime
import functools
import os
import random
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import botocore.auth
import botocore.awsrequest
import botocore.credentials
import pytest
from fault_proxy import FaultProxy

from weenvfs.errors import ObjectMissing, StoreError, StoreUnavailable
from weenvfs.store import RetryingStore, RetryPolicy
from weenvfs.store.s3_direct import EMPTY_SHA256, DirectGetter, HandBack, _list_page

DATA = random.Random(7).randbytes(200_000)


def test_ranges_come_from_the_getter_with_the_right_bytes(open_s3: Any) -> None:
    store = open_s3("direct-bytes")
    store.put("blobs/a", DATA)
    for offset, length in ((0, 1), (0, len(DATA)), (12_345, 70_000), (len(DATA) - 1, 1)):
        assert store.get_range("blobs/a", offset, length) == DATA[offset:offset + length]
    assert store._direct.requests == 4


def test_whole_objects_come_from_the_getter_too(open_s3: Any) -> None:
    store = open_s3("direct-get")
    store.put("blobs/a", DATA)
    store.put("blobs/empty", b"")
    assert store.get("blobs/a") == DATA
    assert store.get("blobs/empty") == b""
    assert store.get_range("blobs/a", 5, 5) == DATA[5:10]
    assert store._direct.requests == 3 and store._direct.whole_objects


def test_keys_with_every_allowed_character_are_found(open_s3: Any) -> None:
    store = open_s3("direct-keys")
    keys = ["refs/~a.b-c_d", "refs/A..B~~", "blobs/x/y/z.1", "refs/-.-_~"]
    for key in keys:
        store.put(key, key.encode() * 3)
    for key in keys:
        assert store.get_range(key, 1, 4) == (key.encode() * 3)[1:5]
    assert store._direct.requests == len(keys)


def test_a_connection_is_kept_for_the_next_request_of_any_thread(open_s3: Any) -> None:
    store = open_s3("direct-kept")
    store.put("blobs/a", DATA)
    store.get_range("blobs/a", 0, 10)
    [first] = store._direct._idle
    thread = threading.Thread(target=store.get_range, args=("blobs/a", 10, 10))
    thread.start()
    thread.join()
    assert store._direct._idle == [first]
    first.sock.close()  # as if the server had closed it: the next request reconnects
    assert store.get_range("blobs/a", 20, 10) == DATA[20:30]
    assert store._direct._idle[0] is not first and store._direct.requests == 3


def test_requests_at_once_each_have_a_connection(open_s3: Any) -> None:
    store = open_s3("direct-parallel")
    store.put("blobs/a", DATA)
    with ThreadPoolExecutor(4) as pool:
        parts = list(pool.map(lambda i: store.get_range("blobs/a", i * 1000, 50_000), range(8)))
    assert parts == [DATA[i * 1000:i * 1000 + 50_000] for i in range(8)]
    assert 1 <= len(store._direct._idle) <= 4


def test_a_body_left_unread_closes_its_connection(open_s3: Any) -> None:
    store = open_s3("direct-unread")
    store.put("blobs/a", DATA)
    direct = store._direct
    response = direct.get_object(store._client, Bucket=store.bucket, Key=store._key("blobs/a"),
                                 Range="bytes=0-99999")
    response["Body"].read(10)
    response["Body"].close()
    assert direct._idle == []
    assert store.get_range("blobs/a", 0, 10) == DATA[:10]


def test_a_forked_child_never_uses_its_parents_connection(open_s3: Any) -> None:
    store = open_s3("direct-fork")
    store.put("blobs/a", DATA)
    store.get_range("blobs/a", 0, 10)
    [parent] = store._direct._idle
    store._direct._lock.acquire()  # as if another thread held it at the fork
    pid = os.fork()
    if pid == 0:  # the child: a fresh connection, and the parent's left open
        signal.alarm(30)  # a deadlock fails the test instead of hanging it
        ok = (store.get_range("blobs/a", 5, 10) == DATA[5:15]
              and store._direct._idle[0] is not parent and parent.sock is not None)
        os._exit(0 if ok else 1)
    store._direct._lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get_range("blobs/a", 30, 10) == DATA[30:40]
    assert store._direct._idle == [parent]


def test_close_closes_idle_connections_and_busy_ones_when_done(open_s3: Any) -> None:
    store = open_s3("direct-close")
    store.put("blobs/a", DATA)
    busy = store._direct.get_object(store._client, Bucket=store.bucket,
                                    Key=store._key("blobs/a"), Range="bytes=0-9")
    store.get_range("blobs/a", 0, 10)  # on a second connection, then idle
    [idle] = store._direct._idle
    store.close()
    assert idle.sock is None and busy["Body"].read() == DATA[:10]
    assert store._direct._idle == []


def test_errors_are_the_ones_botocore_requests_give(open_s3: Any, seaweed: Any) -> None:
    store = open_s3("direct-errors")
    store.put("blobs/a", DATA)
    with pytest.raises(ObjectMissing):
        store.get_range("blobs/missing", 0, 10)
    with pytest.raises(StoreError, match="shorter than the requested range"):
        store.get_range("blobs/a", len(DATA) + 10, 10)
    assert store._direct.requests == 2
    wrong = open_s3(seaweed.url("direct-errors"))
    wrong._client._request_signer._credentials = botocore.credentials.Credentials(
        seaweed.env()["AWS_ACCESS_KEY_ID"], "not-the-secret")
    with pytest.raises(StoreUnavailable, match="secret key does not match") as raised:
        wrong.get_range("blobs/a", 0, 10)
    assert not raised.value.temporary and wrong._direct.requests == 1


@pytest.fixture
def proxy(seaweed: Any) -> Iterator[FaultProxy]:
    with FaultProxy(seaweed.endpoint, stall=3.0) as p:
        yield p


@pytest.mark.parametrize("code", "5trc")
def test_a_fault_is_temporary_and_the_next_request_works(
        open_s3: Any, proxy: FaultProxy, code: str) -> None:
    open_s3("direct-faults").put("blobs/a", DATA)
    inner = open_s3(f"s3://weenv/direct-faults?endpoint={proxy.url}", read_timeout=1.0)
    store = RetryingStore(inner, RetryPolicy(max_attempts=1))
    assert store.get_range("blobs/a", 0, 10) == DATA[:10]  # a kept connection
    proxy.set_script(code)
    with pytest.raises(StoreUnavailable) as raised:
        store.get_range("blobs/a", 100, 50_000)
    assert raised.value.temporary
    assert store.get_range("blobs/a", 100, 50_000) == DATA[100:50_100]
    assert inner._direct.requests >= 2 and proxy.requests("GET") == 3


def test_a_whole_object_that_does_not_match_its_checksum_is_a_temporary_error(
        open_s3: Any, proxy: FaultProxy) -> None:
    """The server's stored checksum (SeaweedFS: CRC32) is checked as botocore checks it:
    a body changed on the way fails, and the next request gets the object."""
    open_s3("direct-sum").put("blobs/a", DATA)
    inner = open_s3(f"s3://weenv/direct-sum?endpoint={proxy.url}")
    store = RetryingStore(inner, RetryPolicy(max_attempts=1))
    proxy.set_script("f")
    with pytest.raises(StoreUnavailable, match="checksum") as raised:
        store.get("blobs/a")
    assert raised.value.temporary
    assert store.get("blobs/a") == DATA
    assert inner._direct.requests == 2 and inner._direct.whole_objects


def test_a_checksum_the_getter_cannot_compute_goes_back_to_botocore(
        open_s3: Any, proxy: FaultProxy) -> None:
    open_s3("direct-kind").put("blobs/a", DATA)
    store = open_s3(f"s3://weenv/direct-kind?endpoint={proxy.url}")
    proxy.set_script("k")
    assert store.get("blobs/a") == DATA  # botocore asked again, and checked what it can
    assert proxy.requests("GET") == 2 and not store._direct.whole_objects
    assert store.get("blobs/a") == DATA and store._direct.requests == 1  # botocore's now
    assert store.get_range("blobs/a", 0, 10) == DATA[:10] and store._direct.requests == 2


@pytest.mark.parametrize("query", [
    "endpoint=https://127.0.0.1:9", "endpoint=http://127.0.0.1:9&addressing=virtual", "",
])
def test_botocore_keeps_what_the_getter_does_not_redo(open_s3: Any, query: str) -> None:
    store = open_s3(f"s3://weenv/p?{query}&region=us-east-1")
    assert store._direct is None


def test_a_proxy_in_the_environment_keeps_botocore(
        open_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("no_proxy", "")
    assert open_s3("direct-proxy")._direct is None


# A GET of an object, and a page of a listing (its query canonical: sorted, URI-encoded).
SIGNED = [("/my-bucket/blobs/a~b.c-d_e", "", {}),
          ("/my-bucket",
           "continuation-token=a%2Fb%2Bc%3D&encoding-type=url&list-type=2&prefix=p%2Fx~y",
           {"list-type": "2", "prefix": "p/x~y", "encoding-type": "url",
            "continuation-token": "a/b+c="})]


@pytest.mark.parametrize("token", [None, "a-session-token"])
@pytest.mark.parametrize(("path", "query", "params"), SIGNED)
def test_the_signature_is_the_one_botocore_makes(
        monkeypatch: pytest.MonkeyPatch, token: str | None, path: str, query: str,
        params: dict[str, str]) -> None:
    when = datetime.datetime(2026, 12, 4, 1, 2, 3)
    getter = DirectGetter("http://127.0.0.1:8333", "my-bucket", "eu-west-3", (1.0, 1.0))
    ours = getter.signed_headers(path, ("AKID", "SECRET/+=", token),
                                 when.replace(tzinfo=datetime.UTC), query=query)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: when)
    request = botocore.awsrequest.AWSRequest(
        method="GET", url="http://127.0.0.1:8333" + path, params=params,
        headers={"X-Amz-Content-SHA256": EMPTY_SHA256})
    credentials = botocore.credentials.Credentials("AKID", "SECRET/+=", token)
    botocore.auth.S3SigV4Auth(credentials, "s3", "eu-west-3").add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"]


# -- listings ------------------------------------------------------------------------------

# Objects a store never writes but a bucket may hold under its prefix (written by other
# tools): listed and decoded as botocore lists them, then skipped by the store.
FOREIGN = ["tags/x y", "tags/a+b", "tags/caf\u00e9", "tags/100%", "tags/q?x=1&y", "tags/"]


def _pages(list_page: Any, store: Any, prefix: str) -> list[list[str]]:
    """Every page of a listing of `prefix`, two keys a page, by `list_page(**params)`."""
    pages, token = [], None
    for _ in range(50):  # a listing that never ends fails here instead of hanging
        params = {"Bucket": store.bucket, "Prefix": store._prefix + prefix, "MaxKeys": 2}
        if token:
            params["ContinuationToken"] = token
        page = list_page(**params)
        pages.append([item["Key"] for item in page.get("Contents", ())])
        token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        if not token:
            return pages
    raise AssertionError(f"no end after {len(pages)} pages")


def test_a_listing_comes_from_the_getter_as_botocore_gives_it(open_s3: Any) -> None:
    store = open_s3("direct-list")
    keys = ["refs/~a.b-c_d", "refs/A..B~~", "tags/envs/e/t1", "tags/envs/e/t2", "tags/z"]
    for key in keys:
        store.put(key, b"x")
    for key in FOREIGN:
        store._client.put_object(Bucket=store.bucket, Key=store._prefix + key, Body=b"x")
    direct = store._direct
    assert list(store.list("")) == sorted(keys)
    assert list(store.list("tags/envs/e/")) == keys[2:4]
    assert list(store.list("nothing/")) == []
    assert direct.requests == 3 and direct.usable
    ours = _pages(functools.partial(direct.list_objects_v2, store._client), store, "")
    theirs = _pages(store._client.list_objects_v2, store, "")
    assert ours == theirs and len(ours) >= 5
    assert sorted(k for page in ours for k in page) == sorted(
        store._prefix + k for k in keys + FOREIGN)


def test_a_listings_errors_are_the_ones_botocore_requests_give(
        open_s3: Any, seaweed: Any, proxy: FaultProxy) -> None:
    """The getter's own error, from its one request (botocore does not ask again)."""
    store = open_s3(f"s3://no-such-bucket/p?endpoint={proxy.url}")
    with pytest.raises(StoreUnavailable, match="does not exist"):
        list(store.list("tags/"))
    assert store._direct.requests == 1 and proxy.requests("GET") == 1
    wrong = open_s3(f"s3://weenv/direct-list-errors?endpoint={proxy.url}")
    wrong._client._request_signer._credentials = botocore.credentials.Credentials(
        seaweed.env()["AWS_ACCESS_KEY_ID"], "not-the-secret")
    with pytest.raises(StoreUnavailable, match="secret key does not match") as raised:
        list(wrong.list("tags/"))
    assert not raised.value.temporary and wrong._direct.requests == 1
    assert proxy.requests("GET") == 2


@pytest.mark.parametrize("code", "5c")
def test_a_listing_fault_is_temporary_and_the_next_listing_works(
        open_s3: Any, proxy: FaultProxy, code: str) -> None:
    open_s3("direct-list-faults").put("tags/a", b"x")
    inner = open_s3(f"s3://weenv/direct-list-faults?endpoint={proxy.url}")
    store = RetryingStore(inner, RetryPolicy(max_attempts=1))
    proxy.set_script(code)
    with pytest.raises(StoreUnavailable) as raised:
        list(store.list("tags/"))
    assert raised.value.temporary
    assert list(store.list("tags/")) == ["tags/a"]
    assert inner._direct.requests == 2 and inner._direct.usable


@pytest.mark.parametrize("body", [b"", b"<html>not a listing", b"<Error><Code>X</Code></Error>"])
def test_an_answer_that_is_no_listing_goes_back_to_botocore(body: bytes) -> None:
    with pytest.raises(HandBack):
        _list_page(body)
