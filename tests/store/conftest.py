"""Fixtures for the store tests: one `store` per backend, for the conformance suite.

A backend joins the suite by adding one entry to `BACKENDS`: a class that, given the test's
request and a private temporary directory, opens a fresh empty store and a store whose
location is missing. Backends that need a server start it in a session fixture, taken lazily
through `request.getfixturevalue`, so a run of local tests only starts no server:
- s3: one SeaweedFS for the session (`seaweed`); each test gets its own prefix in its bucket;
- http: one static web server (`http_server`) over a folder; each test gets a subfolder,
  written through a LocalStore (`Backend.writer`) and read over HTTP.
A read-only backend (`Store.read_only`) skips the tests marked `writes`.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from http_server import RangeHTTPServer

from weenvfs.errors import StoreError
from weenvfs.store import LocalStore, Store

_counter = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "writes: a conformance test that writes or lists (not run on read-only stores)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip: CI allows no skips) `writes` tests of read-only backends."""
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        read_only = params.get("backend") in READ_ONLY_BACKENDS
        (drop if read_only and item.get_closest_marker("writes") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class Backend(Protocol):
    """What the conformance suite needs from a backend."""

    name: str

    def open(self) -> Store:
        """A fresh, empty store."""
        ...

    def open_missing(self) -> Store:
        """A store whose location (directory, bucket) does not exist."""
        ...

    def writer(self, store: Store) -> Store:
        """A writable store of the same location as `store` (itself if it is writable)."""
        ...


class LocalBackend:
    """Stores in a directory under the test's tmp_path."""

    name = "local"

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def open(self) -> Store:
        """A fresh, empty, writable store."""
        return LocalStore(self.tmp_path / "store", create=True)

    def open_missing(self) -> Store:
        """A store whose location does not exist."""
        return LocalStore(self.tmp_path / "no-such-store")

    def writer(self, store: Store) -> Store:
        """The store itself."""
        return store


class S3Backend:
    """Stores under a fresh prefix of the session's SeaweedFS bucket."""

    name = "s3"

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.server = request.getfixturevalue("seaweed")
        self.prefix = re.sub(r"[^A-Za-z0-9._-]", "_", f"t{next(_counter)}-{request.node.name}")[:80]

    def open(self) -> Store:
        """A fresh, empty, writable store."""
        return s3_store(self.server, self.server.url(self.prefix))

    def open_missing(self) -> Store:
        """A store in a bucket that does not exist."""
        return s3_store(self.server, self.server.url("x", bucket="no-such-bucket"))

    def writer(self, store: Store) -> Store:
        """The store itself."""
        return store


class HttpBackend:
    """A LocalStore folder served by the session's static web server, read over HTTP."""

    name = "http"

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.server: RangeHTTPServer = request.getfixturevalue("http_server")
        self.folder = f"s{next(_counter)}"
        self.local = LocalStore(Path(self.server.root) / self.folder, create=True)

    def open(self) -> Store:
        """A fresh, empty, read-only store."""
        from weenvfs.store.http import HttpStore

        return HttpStore(f"{self.server.url}/{self.folder}")

    def open_missing(self) -> Store:
        """A URL under which the server has nothing."""
        from weenvfs.store.http import HttpStore

        return HttpStore(f"{self.server.url}/no-such-{self.folder}/")

    def writer(self, store: Store) -> Store:
        """The LocalStore behind the web server."""
        return self.local


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "local": LocalBackend,
    "s3": S3Backend,
    "http": HttpBackend,
}
READ_ONLY_BACKENDS = frozenset({"http"})  # cannot put, delete or list


def s3_store(server: Any, url: str, reader: bool = False, **options: Any) -> Store:
    """An S3Store of `url` on `server`, with the server's keys given explicitly (tests of the
    standard AWS configuration set the environment instead)."""
    from weenvfs.store.s3 import S3Store

    keys = server.env(reader)
    session = {
        "aws_access_key_id": keys["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": keys["AWS_SECRET_ACCESS_KEY"],
    }
    return S3Store(url, session_options=session, **options)


OpenS3 = Callable[..., Store]


@pytest.fixture
def open_s3(seaweed: Any) -> Iterator[OpenS3]:
    """`open_s3(url_or_prefix, reader=False, **S3Store options)`: an S3Store on the session's
    SeaweedFS (a bare prefix means that prefix of its bucket), closed after the test."""
    opened: list[Store] = []

    def open_(where: str, reader: bool = False, **options: Any) -> Store:
        url = where if "://" in where else seaweed.url(where)
        opened.append(s3_store(seaweed, url, reader, **options))
        return opened[-1]

    try:
        yield open_
    finally:
        for s in opened:
            s.close()


@pytest.fixture(autouse=True)
def _isolated_aws_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test sees the machine's AWS configuration, and boto3 never asks the instance
    metadata service (a link-local address, off limits) for credentials."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_CA_BUNDLE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)


@pytest.fixture(scope="session")
def seaweed() -> Iterator[Any]:
    """One SeaweedFS S3 server for the whole session (starting one takes seconds). Without
    the `weed` binary: skip with the reason, or fail when WEENVFS_TEST_STRICT=1 (CI)."""
    from weenvfs.store.seaweed import SeaweedFS, find_weed

    try:
        find_weed()
    except StoreError as e:
        if os.environ.get("WEENVFS_TEST_STRICT", "") not in ("", "0"):
            pytest.fail(f"{e} (WEENVFS_TEST_STRICT=1 makes this a failure)", pytrace=False)
        pytest.skip(str(e))
    server = SeaweedFS()
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RangeHTTPServer]:
    """One static web server with Range support over a session folder."""
    root = tmp_path_factory.mktemp("http-root")
    with RangeHTTPServer(root) as server:
        yield server


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """The backend under test; its name is the test id's parameter."""
    return BACKENDS[request.param](request, tmp_path)


@pytest.fixture
def store(backend: Backend, request: pytest.FixtureRequest) -> Iterator[Store]:
    """A fresh, empty store of each backend, closed after the test. Tests marked `writes`
    are skipped, with the reason, on read-only backends."""
    s = backend.open()
    try:
        # Deselected at collection (pytest_collection_modifyitems); this guards the table.
        writes = request.node.get_closest_marker("writes") is not None
        assert not (s.read_only and writes), (
            f"{backend.name} is read-only: add it to READ_ONLY_BACKENDS"
        )
        yield s
    finally:
        s.close()


@pytest.fixture
def writer(backend: Backend, store: Store) -> Store:
    """A writable store of `store`'s location (`store` itself unless it is read-only)."""
    return backend.writer(store)


@pytest.fixture
def local_store(tmp_path: Path) -> Iterator[LocalStore]:
    """A fresh LocalStore, for tests of local-only behaviour and of the wrappers."""
    s = LocalStore(tmp_path / "store", create=True)
    try:
        yield s
    finally:
        s.close()
