"""A read-only store served over HTTP(S): a CDN or a plain web server in front of a store
directory or bucket, read with `requests`.

URL: `http(s)://HOST[:PORT]/PREFIX`; key `a/b` is `GET http(s)://HOST/PREFIX/a/b`. What the
server must do: answer 200 (or 206 to a Range request) for an object, 404 (or 410) for a
missing one, and answer a HEAD of the prefix's root URL (`.../PREFIX/`) with anything but
404/410 (a directory listing, an index page, even 403), so that a wrong URL is reported as a
missing store instead of looking like an empty one. `~/.netrc` credentials apply (requests'
usual environment handling, also for proxies and CA bundles).

Owns: one `requests.Session` per store with a connection pool sized for concurrent readers,
timeouts, ranged GETs checked byte for byte, translating HTTP answers and transport errors into
the store errors. Must not: write, list (HTTP has no listing), retry (RetryingStore does), or
decompress (it asks for `Accept-Encoding: identity`, so ranges are ranges of the object).
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import requests
from requests.adapters import HTTPAdapter

from weenvfs.errors import ObjectMissing, ObjectTooLarge, StoreError, StoreUnavailable
from weenvfs.store.base import Store, validate_key, validate_prefix

log = logging.getLogger(__name__)

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_RANGE_SLACK = 16 << 20  # a full 200 answer to a Range request is sliced only if this small
_GONE = (404, 410)
_TEMPORARY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504, 507, 509})


class HttpStore(Store):
    """Objects under a base URL, read-only."""

    read_only = True

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_connections: int = 32,
    ) -> None:
        self._url = url
        self.base = _base_url(url)
        self._timeout = (connect_timeout, read_timeout)
        self._root_seen = False
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=max_connections, max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._session.headers.update(
            {"User-Agent": "weenv", "Accept-Encoding": "identity"}
        )

    @property
    def url(self) -> str:
        """The URL the store was opened from."""
        return self._url

    # -- requests ------------------------------------------------------------------------

    def _request(
        self, method: str, key: str, what: str, headers: dict[str, str] | None = None
    ) -> requests.Response:
        """One request for `key` ('' = the root), body not yet read; transport errors
        translated. The caller reads or closes the response."""
        target = self.base + key
        try:
            return self._session.request(
                method, target, headers=headers, timeout=self._timeout, stream=True
            )
        except requests.exceptions.SSLError as e:
            raise StoreUnavailable(f"{self._where(what, key)}: TLS error: {e}",
                                   temporary=False) from None
        except (requests.ConnectionError, requests.Timeout) as e:
            raise StoreUnavailable(f"{self._where(what, key)}: {type(e).__name__}: {e}",
                                   temporary=True) from None
        except requests.RequestException as e:
            raise StoreError(f"{self._where(what, key)}: {e}") from None

    def _where(self, what: str, key: str) -> str:
        return f"store {self.url}: {what} {key!r}" if key else f"store {self.url}: {what}"

    def _object(self, method: str, key: str, what: str, **headers: str) -> requests.Response:
        """A request for the object `key` that succeeded (2xx), else the right error."""
        response = self._request(method, validate_key(key), what, headers or None)
        status = response.status_code
        # A redirect to ".../key/" means a directory of a web server, not an object.
        if status < 300 and not urllib.parse.urlsplit(response.url).path.endswith("/"):
            return response
        response.close()
        if status < 300 or status in _GONE:
            raise self._absent(key)
        if status == 416:
            raise self._short(key, None)
        self._raise_for(status, what, key)

    def _raise_for(self, status: int, what: str, key: str) -> NoReturn:
        where = self._where(what, key)
        if status in (401, 403, 407):
            raise StoreUnavailable(f"{where}: access denied (HTTP {status})", temporary=False)
        if status in _TEMPORARY_STATUS or status >= 500:
            raise StoreUnavailable(f"{where}: HTTP {status}", temporary=True)
        raise StoreError(f"{where}: unexpected HTTP {status}")

    def _absent(self, key: str) -> StoreError:
        """ObjectMissing, after checking once that the store's root exists at all."""
        if not self._root_seen:
            self.check()
        return ObjectMissing(key, self.url)

    def _short(self, key: str, size: int | None) -> StoreError:
        has = "" if size is None else f" ({size} bytes)"
        return StoreError(f"object {key!r} in {self.url}{has} is shorter than the requested range")

    def _body(
        self, response: requests.Response, what: str, key: str, limit: int | None = None
    ) -> bytes:
        """The whole body, checked against Content-Length; a cut body is temporary. With a
        `limit`, a larger Content-Length is refused unread, and a body without one is read
        only until it passes the limit."""
        declared = response.headers.get("Content-Length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        if limit is not None and size is not None and size > limit:
            response.close()
            raise ObjectTooLarge(key, self.url, limit, size)
        try:
            data = response.content if limit is None else _read_capped(response, limit)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError,
                requests.Timeout) as e:
            raise StoreUnavailable(f"{self._where(what, key)}: body cut short: {e}",
                                   temporary=True) from None
        finally:
            response.close()
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(key, self.url, limit)
        if size is not None and size != len(data):
            raise StoreUnavailable(
                f"{self._where(what, key)}: body cut short ({len(data)} of {declared} bytes)",
                temporary=True,
            )
        return data

    # -- reading -------------------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes:
        """See `Store.get`."""
        return self._body(self._object("GET", key, "get"), "get", key, limit)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """See `Store.get_range`: a Range GET; the 206 answer's Content-Range and length are
        checked, and a 200 (server ignoring Range) is sliced only when small."""
        if offset < 0 or length < 0:
            raise ValueError(f"negative range: offset={offset} length={length}")
        if length == 0:
            size = self.size(key)
            if offset > size:
                raise self._short(key, size)
            return b""
        response = self._object(
            "GET", key, "get_range", Range=f"bytes={offset}-{offset + length - 1}"
        )
        if response.status_code == 206:
            return self._partial(response, key, offset, length)
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > offset + length + _RANGE_SLACK:
            response.close()
            raise StoreError(f"store {self.url}: server ignored the Range header for {key!r}")
        data = self._body(response, "get_range", key)
        if len(data) < offset + length:
            raise self._short(key, len(data))
        return data[offset : offset + length]

    def _partial(self, response: requests.Response, key: str, offset: int, length: int) -> bytes:
        match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
        if match is None:
            response.close()
            raise StoreError(f"store {self.url}: 206 without a valid Content-Range for {key!r}")
        start, end, total = match.groups()
        if int(start) != offset or int(end) + 1 < offset + length:
            response.close()
            raise self._short(key, None if total == "*" else int(total))
        return self._body(response, "get_range", key)[:length]

    def exists(self, key: str) -> bool:
        """See `Store.exists` (a HEAD request)."""
        try:
            self._object("HEAD", key, "exists").close()
        except ObjectMissing:
            return False
        return True

    def size(self, key: str) -> int:
        """See `Store.size` (a HEAD request; the server must send Content-Length)."""
        response = self._object("HEAD", key, "size")
        response.close()
        declared = response.headers.get("Content-Length", "")
        if not declared.isdigit():
            raise StoreError(f"store {self.url}: no Content-Length for {key!r}")
        return int(declared)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Not supported: raises StoreError (after checking the prefix)."""
        validate_prefix(prefix)
        raise StoreError(f"store {self.url}: a read-only HTTP store cannot list")

    # -- writing: refused ----------------------------------------------------------------

    def _read_only(self, what: str, key: str) -> NoReturn:
        validate_key(key)
        raise StoreError(f"store {self.url} is read-only (HTTP): cannot {what} {key!r}")

    def put(self, key: str, data: bytes) -> None:
        """Refused: StoreError."""
        self._read_only("put", key)

    def put_file(self, key: str, path: Path | str) -> None:
        """Refused: StoreError."""
        self._read_only("put", key)

    def delete(self, key: str) -> None:
        """Refused: StoreError."""
        self._read_only("delete", key)

    # -- maintenance ---------------------------------------------------------------------

    def check(self, write: bool = False) -> None:
        """See `Store.check`: HEAD the root URL. 404/410 means the store does not exist;
        401/407 that credentials are needed; `write=True` fails: the store is read-only."""
        response = self._request("HEAD", "", "check")
        response.close()
        status = response.status_code
        if status in _GONE:
            raise StoreUnavailable(
                f"store {self.url}: not found (HEAD {self.base} answered {status})",
                temporary=False,
            )
        if status in (401, 407) or status in _TEMPORARY_STATUS or status >= 500:
            self._raise_for(status, "check", "")
        self._root_seen = True
        if write:
            raise StoreError(f"store {self.url} is read-only (HTTP): cannot be written")

    def close(self) -> None:
        """Close the connection pool."""
        self._session.close()


def _base_url(url: str) -> str:
    """`scheme://host[:port]/prefix/` from the store URL, checked."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StoreError(f"bad store URL {url!r}: expected http(s)://HOST/PREFIX")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise StoreError(
            f"bad store URL {url!r}: no credentials, query or fragment (use ~/.netrc)"
        )
    prefix = parts.path.strip("/")
    if prefix:
        validate_prefix(prefix + "/")
    return f"{parts.scheme}://{parts.netloc}/{prefix + '/' if prefix else ''}"


def _read_capped(response: requests.Response, limit: int) -> bytes:
    """A streamed body, read until it ends or passes `limit` (by less than one piece)."""
    parts, total = [], 0
    for part in response.iter_content(1 << 20):
        parts.append(part)
        total += len(part)
        if total > limit:
            break
    return b"".join(parts)
