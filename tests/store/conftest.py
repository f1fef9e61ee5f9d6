"""Fixtures for the store tests: one `store` per backend, for the conformance suite.

A backend joins the suite by adding one entry to `BACKENDS`: a class that, given a private
temporary directory, opens a fresh empty writable store and a store whose location is missing.
Backends that need a server (S3, HTTP) start it in a session fixture and take it from there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest

from weenvfs.store import LocalStore, Store


class Backend(Protocol):
    """What the conformance suite needs from a backend."""

    name: str

    def open(self) -> Store:
        """A fresh, empty, writable store."""
        ...

    def open_missing(self) -> Store:
        """A store whose location (directory, bucket) does not exist."""
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


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "local": LocalBackend,
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """The backend under test; its name is the test id's parameter."""
    return BACKENDS[request.param](request, tmp_path)


@pytest.fixture
def store(backend: Backend) -> Iterator[Store]:
    """A fresh, empty, writable store of each backend, closed after the test."""
    s = backend.open()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def local_store(tmp_path: Path) -> Iterator[LocalStore]:
    """A fresh LocalStore, for tests of local-only behaviour and of the wrappers."""
    s = LocalStore(tmp_path / "store", create=True)
    try:
        yield s
    finally:
        s.close()
