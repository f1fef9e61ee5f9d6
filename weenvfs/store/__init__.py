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
from collections.abc import Callable, Mapping
from pathlib import Path

from weenvfs.errors import (
    ObjectCorrupt,
    ObjectMissing,
    ObjectTooLarge,
    StoreError,
    StoreUnavailable,
)
from weenvfs.store.base import Store, validate_key, validate_prefix
from weenvfs.store.local import LocalStore
from weenvfs.store.retry import RetryingStore, RetryPolicy, read_verified

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
    # As bytes: a folder whose name is not UTF-8 (Path.as_uri quotes its bytes) is the same
    # folder again, not one with U+FFFD in its name.
    return LocalStore(Path(os.fsdecode(urllib.parse.unquote_to_bytes(parts.path))),
                      create=create)


def _file_url(url: str) -> str:
    """`file:/path` (RFC 8089's short form, no authority) as `file:///path`; other URLs and
    plain paths unchanged. `file:relative` is refused: a file URL's path is absolute."""
    if url[:5].lower() != "file:" or url[5:7] == "//":
        return url
    if not url[5:].startswith("/"):
        raise StoreError(f"bad store URL {url!r}: expected file:/absolute/path or a directory")
    return "file://" + url[5:]


# Remote stores are wrapped in RetryingStore with this policy: up to 5 tries of a call whose
# failure is temporary (5xx, throttling, timeouts, resets, cut bodies), sleeping a random
# 0-0.2, 0-0.4, 0-0.8, 0-1.6 s between them (full jitter), and never past 30 s from the first
# try; permanent errors (missing objects, bad credentials, a missing bucket) are raised at once.
REMOTE_RETRY_POLICY = RetryPolicy(max_attempts=5, base_delay=0.2, max_delay=5.0, max_elapsed=30.0)


def _open_s3_url(url: str, create: bool) -> Store:
    """`s3://BUCKET/PREFIX?endpoint=...` -> S3Store (boto3 is imported here, lazily), retried.
    The bucket must exist: `create` only matters for the prefix, which S3 needs not create."""
    from weenvfs.store.s3 import S3Store

    return RetryingStore(S3Store(url), REMOTE_RETRY_POLICY)


def _open_http_url(url: str, create: bool) -> Store:
    """`http(s)://HOST/PREFIX` -> read-only HttpStore (requests imported lazily), retried."""
    from weenvfs.store.http import HttpStore

    return RetryingStore(HttpStore(url), REMOTE_RETRY_POLICY)


STORE_SCHEMES: dict[str, StoreFactory] = {
    "file": _open_file_url,
    "s3": _open_s3_url,
    "http": _open_http_url,
    "https": _open_http_url,
}


def warm_up() -> None:
    """Load now what the S3 backend loads on first use (boto3's service model), so that the
    processes a mount server forks afterwards start warm. The mount server calls it: the fuse
    package reaches the store through this package only."""
    from weenvfs.store import s3_clients

    s3_clients.warm_up()


def prebuild_client(url: str, environ: Mapping[str, str]) -> bool:
    """Make ahead of time the client a store of `url` opened with environment `environ`
    needs, for the processes the caller forks afterwards (the mount server calls it; only S3
    stores have clients worth it: `s3.prebuild`). True if one was made now."""
    if not url.startswith("s3://"):
        return False
    from weenvfs.store import s3

    return s3.prebuild(url, environ)


def url_scheme(url: str) -> str:
    """The scheme `open_store(url)` picks a backend by, lower-cased ("file" for a directory
    path or a `file:` URL); not checked against STORE_SCHEMES."""
    return _scheme_of(url) or "file"


def _scheme_of(url: str) -> str | None:
    """The lower-cased scheme of `url`, None for a plain path."""
    match = _SCHEME.match(url)
    return None if match is None else match.group(1).lower()


def open_store(url: str, *, create: bool = False) -> Store:
    """Open the store at `url`: `scheme://...` picks a backend from `STORE_SCHEMES` (and
    `file:/path` is `file:///path`, RFC 8089); a string without a scheme is a local directory
    path, relative to the current directory or absolute.

    `create=True` lets the backend make the location if it is missing (a publisher does
    this; a reader should not, so that a typo is reported rather than papered over). Nothing
    is contacted here: call `check()` to fail fast. Raises StoreError for an unknown scheme or
    a malformed URL, naming the supported schemes.
    """
    if not url:
        raise StoreError("empty store URL")
    url = _file_url(url)
    scheme = _scheme_of(url)
    if scheme is None:
        return STORE_SCHEMES["file"](Path(os.path.abspath(url)).as_uri(), create)
    factory = STORE_SCHEMES.get(scheme)
    if factory is None:
        supported = ", ".join(f"{s}://" for s in sorted(STORE_SCHEMES))
        raise StoreError(
            f"unsupported store URL scheme {scheme!r} in {url!r} "
            f"(supported: {supported}, or a plain directory path)"
        )
    return factory(url, create)


__all__ = [
    "REMOTE_RETRY_POLICY",
    "STORE_SCHEMES",
    "LocalStore",
    "ObjectCorrupt",
    "ObjectMissing",
    "ObjectTooLarge",
    "RetryPolicy",
    "RetryingStore",
    "Store",
    "StoreError",
    "StoreFactory",
    "StoreUnavailable",
    "open_store",
    "url_scheme",
    "read_verified",
    "validate_key",
    "validate_prefix",
    "warm_up",
]
