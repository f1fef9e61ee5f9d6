"""The store layer: one `Store` interface, its backends, and `open_store(url)`.

Owns: choosing a backend from a URL through the single registry `STORE_SCHEMES`. Adding a
backend is one entry there: a factory `(url, create) -> Store` that imports its library
lazily, so that `import weenvfs.store` never pulls in boto3 or requests. Must not: import trio,
pyfuse3, or anything from core/fuse/runtime.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from weenvfs.errors import ObjectCorrupt, ObjectMissing, StoreError, StoreUnavailable
from weenvfs.store.base import Store, validate_key, validate_prefix
from weenvfs.store.local import LocalStore
from weenvfs.store.retry import RetryingStore, RetryPolicy

# A factory gets the full URL and whether to create the location when it is missing.
StoreFactory = Callable[[str, bool], Store]

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def _open_file_url(url: str, create: bool) -> Store:
    """`file:///absolute/path` (or `file://localhost/...`) -> LocalStore."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise StoreError(f"bad store URL {url!r}: expected file:///absolute/path")
    if parts.query or parts.fragment:
        raise StoreError(f"bad store URL {url!r}: file URLs take no query or fragment")
    return LocalStore(Path(urllib.parse.unquote(parts.path)), create=create)


STORE_SCHEMES: dict[str, StoreFactory] = {
    "file": _open_file_url,
}


def open_store(url: str, *, create: bool = False) -> Store:
    """Open the store at `url`: `scheme://...` picks a backend from `STORE_SCHEMES`; a string
    without a scheme is a local directory path, relative to the current directory or absolute.

    `create=True` lets the backend make the location if it is missing (a publisher does
    this; a reader should not, so that a typo is reported rather than papered over). Nothing
    is contacted here: call `check()` to fail fast. Raises StoreError for an unknown scheme or
    a malformed URL, naming the supported schemes.
    """
    if not url:
        raise StoreError("empty store URL")
    match = _SCHEME.match(url)
    if match is None:
        return STORE_SCHEMES["file"](Path(os.path.abspath(url)).as_uri(), create)
    scheme = match.group(1).lower()
    factory = STORE_SCHEMES.get(scheme)
    if factory is None:
        supported = ", ".join(f"{s}://" for s in sorted(STORE_SCHEMES))
        raise StoreError(
            f"unsupported store URL scheme {scheme!r} in {url!r} "
            f"(supported: {supported}, or a plain directory path)"
        )
    return factory(url, create)


__all__ = [
    "STORE_SCHEMES",
    "LocalStore",
    "ObjectCorrupt",
    "ObjectMissing",
    "RetryPolicy",
    "RetryingStore",
    "Store",
    "StoreError",
    "StoreFactory",
    "StoreUnavailable",
    "open_store",
    "validate_key",
    "validate_prefix",
]
