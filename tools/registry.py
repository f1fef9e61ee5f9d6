"""`docker://HOST/REPO[:TAG|@DIGEST]`: an image in a registry, over the Distribution HTTP API.

Owns: parsing references (Docker Hub's implied `docker.io/library/`), the plain-HTTP policy
(`--insecure` is for loopback registries unless `insecure_remote` forces it), requests with
retries on connection errors, 429 and 5xx (a 401 is answered once through
registry_auth.Authenticator, anonymous or with credentials), manifests by tag or digest
(an index is resolved by image_source), small blobs read whole and verified, and layer blobs
streamed into temporary files: sha256 and size checked as they arrive, an interrupted
download resumed with a `Range` request, a download started in the background for every
layer `prefetch` is given (a few at a time) so that parsing one layer overlaps fetching the
next. Temporary files are unlinked once opened and the directory removed on `close`.

Must not: write anything outside its temporary directory or trust the registry's
Docker-Content-Digest header (digests are computed).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import requests

from weenvfs.errors import SourceError, UsageError

from .image_source import ImageSource, Layer, SourceOptions
from .oci_docs import (
    ACCEPT_MANIFESTS,
    INDEX_TYPES,
    MANIFEST_TYPES,
    MAX_MANIFEST_BYTES,
    Descriptor,
    check_digest,
    hasher,
    verify_bytes,
)
from .progress import Progress
from .registry_auth import Authenticator, config_creds, is_loopback
from .staging import Staging

log = logging.getLogger(__name__)

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_RETRY_STATUS = (408, 429, 500, 502, 503, 504)
_GENERIC_TYPES = ("", "application/json", "text/plain", "application/octet-stream")
RETRIES = 5
BACKOFF = 0.5  # seconds, doubled after each failed attempt
TIMEOUT = (10.0, 120.0)  # connect, read
PARALLEL_DOWNLOADS = 3
_CHUNK = 1 << 20
_DOWNLOAD_CHUNK = 1 << 16  # a broken transfer resumes at a multiple of this


@dataclass(frozen=True)
class Reference:
    """A parsed `HOST/REPO[:TAG][@DIGEST]`."""

    host: str
    repository: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> Reference:
        name, _, digest = text.partition("@")
        tag = None
        slash = name.rfind("/")
        if ":" in name[slash + 1 :]:
            name, _, tag = name.rpartition(":")
            if not _TAG.fullmatch(tag):
                raise UsageError(f"invalid tag {tag!r:.130} in docker://{text}")
        first, sep, rest = name.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            host, repo = first, rest
        else:
            host, repo = "docker.io", name
            if "/" not in repo:
                repo = "library/" + repo
        if not _REPO.fullmatch(repo):
            raise UsageError(f"invalid repository {repo!r:.200} in docker://{text}")
        if digest:
            check_digest(digest, f"docker://{text}")
        elif tag is None:
            tag = "latest"
        return cls(host, repo, tag, digest or None)

    @property
    def api_host(self) -> str:
        return "registry-1.docker.io" if self.host == "docker.io" else self.host

    def __str__(self) -> str:
        tail = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"docker://{self.host}/{self.repository}{tail}"


class RegistryClient:
    """HTTP access to one repository of one registry."""

    def __init__(self, ref: Reference, options: SourceOptions) -> None:
        if options.insecure and not is_loopback(ref.host) and not options.insecure_remote:
            raise UsageError(
                f"refusing plain HTTP to {ref.host}: --insecure is for loopback registries "
                "(add --insecure-remote to force it)"
            )
        scheme = "http" if options.insecure else "https"
        self.ref = ref
        self.base = f"{scheme}://{ref.api_host}/v2/{ref.repository}"
        creds = options.creds or config_creds(ref.host)
        self._local = threading.local()
        self._auth_lock = threading.Lock()
        self._authorization: str | None = None
        self._auth = Authenticator(
            ref.host, ref.repository, creds, self._session(), options.insecure_remote
        )
        self.closing = threading.Event()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["User-Agent"] = "weenv"
        return session

    def request(
        self, method: str, url: str, headers: dict[str, str] | None = None, stream: bool = False,
        data: bytes | BinaryIO | None = None,
    ) -> requests.Response:
        """Send (with body `data`, for uploads: bytes, or a file sent from its start at each
        attempt) with retries; answer one 401 with credentials/a token."""
        answered = False
        delay = BACKOFF
        for attempt in range(RETRIES):
            if data is not None and not isinstance(data, bytes):
                data.seek(0)
            hdrs = dict(headers or {})
            if self._authorization:
                hdrs["Authorization"] = self._authorization
            try:
                resp = self._session().request(
                    method, url, headers=hdrs, stream=stream, timeout=TIMEOUT, data=data
                )
            except (requests.ConnectionError, requests.Timeout) as e:
                if attempt == RETRIES - 1:
                    raise SourceError(f"cannot reach registry {self.ref.host}: {e}") from None
                log.info("registry %s: %s; retrying", self.ref.host, e)
            else:
                if resp.status_code == 401 and not answered:
                    answered = True
                    with self._auth_lock:
                        self._authorization = self._auth.answer(
                            resp.headers.get("WWW-Authenticate")
                        )
                    resp.close()
                    continue
                if resp.status_code not in _RETRY_STATUS or attempt == RETRIES - 1:
                    return resp
                log.info("registry %s: HTTP %d; retrying", self.ref.host, resp.status_code)
                resp.close()
            if self.closing.wait(delay):
                raise SourceError(f"registry {self.ref.host}: cancelled")
            delay *= 2
        raise AssertionError("unreachable")

    def fail(self, resp: requests.Response, what: str) -> SourceError:
        if resp.status_code in (401, 403):
            creds = self._auth.creds
            if resp.status_code == 401 and creds and self._auth.scheme == "basic":
                return SourceError(
                    f"registry {self.ref.host}: authentication failed: the registry refused "
                    f"user {creds[0]!r} (HTTP 401)"
                )
            return SourceError(
                f"registry {self.ref.host}: access to {self.ref.repository} denied "
                f"(HTTP {resp.status_code} after authenticating)"
            )
        if resp.status_code == 404:
            return SourceError(f"{self.ref}: {what} not found (HTTP 404)")
        detail = resp.text[:200].strip() if not resp.raw.closed else ""
        return SourceError(f"{self.ref}: {what}: HTTP {resp.status_code} {detail}".strip())

    def read_small(
        self, url: str, what: str, limit: int, accept: Sequence[str] = ()
    ) -> tuple[bytes, str]:
        """(body, content type) of a GET whose body is at most `limit` bytes."""
        headers = {"Accept": ", ".join(accept)} if accept else None
        resp = self.request("GET", url, headers, stream=True)
        with resp:
            if resp.status_code != 200:
                raise self.fail(resp, what)
            parts, got = [], 0
            for part in resp.iter_content(_CHUNK):
                got += len(part)
                if got > limit:
                    raise SourceError(f"{self.ref}: {what} exceeds {limit} bytes")
                parts.append(part)
            kind = resp.headers.get("Content-Type", "").partition(";")[0].strip()
        return b"".join(parts), kind

    def manifest(self, reference: str) -> tuple[bytes, str | None]:
        """A manifest or index by tag or digest: (bytes, declared media type or None)."""
        data, kind = self.read_small(
            f"{self.base}/manifests/{reference}",
            f"manifest {reference}",
            MAX_MANIFEST_BYTES,
            ACCEPT_MANIFESTS,
        )
        return data, None if kind in _GENERIC_TYPES else kind

    def download(self, desc: Descriptor, dest: Path, on_bytes: Callable[[int], None]) -> int:
        """Fetch blob `desc` into `dest`, verified; resume with Range after a broken
        transfer. Returns the bytes received (including those of broken attempts)."""
        url = f"{self.base}/blobs/{desc.digest}"
        received = 0
        with open(dest, "wb") as f:
            h, have = hasher(desc.digest), 0
            for attempt in range(RETRIES):
                headers = {"Range": f"bytes={have}-"} if have else None
                resp = self.request("GET", url, headers, stream=True)
                with resp:
                    if resp.status_code == 200 and have:
                        log.info("%s: the registry ignored Range; restarting", desc.digest)
                        f.seek(0)
                        f.truncate()
                        h, have = hasher(desc.digest), 0
                    elif resp.status_code not in (200, 206) or (
                        resp.status_code == 206 and not _range_starts(resp, have)
                    ):
                        raise self.fail(resp, f"blob {desc.digest}")
                    try:
                        for part in resp.iter_content(_DOWNLOAD_CHUNK):
                            if self.closing.is_set():
                                raise SourceError(f"registry {self.ref.host}: cancelled")
                            f.write(part)
                            h.update(part)
                            have += len(part)
                            received += len(part)
                            on_bytes(len(part))
                            if have > desc.size:
                                raise SourceError(
                                    f"{self.ref}: blob {desc.digest} is larger than its "
                                    f"descriptor's {desc.size} bytes"
                                )
                    except (
                        requests.ConnectionError,
                        requests.exceptions.ChunkedEncodingError,
                        requests.Timeout,
                    ) as e:
                        log.info(
                            "%s: transfer broken at %d bytes (%s); resuming", desc.digest, have, e
                        )
                if have == desc.size:
                    break
                if attempt == RETRIES - 1 or self.closing.wait(BACKOFF * 2**attempt):
                    raise SourceError(
                        f"{self.ref}: blob {desc.digest} truncated: {have} of {desc.size} bytes"
                    )
        actual = f"{desc.digest.partition(':')[0]}:{h.hexdigest()}"
        if actual != desc.digest:
            raise SourceError(
                f"{self.ref}: blob digest mismatch: expected {desc.digest}, got {actual}"
            )
        return received


def _range_starts(resp: requests.Response, offset: int) -> bool:
    m = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
    return m is not None and int(m.group(1)) == offset


class RegistrySource(ImageSource):
    """An image in a registry; layers are downloaded into a temporary directory."""

    transport = "docker"
    layers_verified = True

    def __init__(self, text: str, options: SourceOptions) -> None:
        self.ref = Reference.parse(text)
        super().__init__(str(self.ref))
        self.client = RegistryClient(self.ref, options)
        # Locked and named by our pid (staging.py): if we are killed, the next conversion
        # or `weenv gc` finds the downloads and removes them.
        self._staging = Staging(options.tmp_dir, "pull")
        self._pool: ThreadPoolExecutor | None = None
        self._downloads: dict[str, Future[Path]] = {}
        self._progress: dict[str, int] = {}
        self._users: dict[str, int] = {}  # layers still to open, by digest
        self._lock = threading.Lock()

    def fetch_root(self) -> tuple[bytes, str | None, str | None]:
        data, kind = self.client.manifest(self.ref.digest or self.ref.tag or "latest")
        self.bytes_downloaded += len(data)
        return data, kind, self.ref.digest

    def fetch_blob(self, desc: Descriptor, limit: int) -> bytes:
        if desc.size > limit:
            raise SourceError(f"{self.ref}: {desc.digest} is {desc.size} bytes, more than {limit}")
        if desc.media_type in INDEX_TYPES + MANIFEST_TYPES:
            data, _ = self.client.manifest(desc.digest)
        else:
            url = f"{self.client.base}/blobs/{desc.digest}"
            data, _ = self.client.read_small(url, f"blob {desc.digest}", limit)
        self.bytes_downloaded += len(data)
        if len(data) != desc.size:
            raise SourceError(
                f"{self.ref}: {desc.digest} is {len(data)} bytes, its descriptor says {desc.size}"
            )
        return verify_bytes(data, desc.digest, f"{self.ref} blob")

    def _download(self, desc: Descriptor) -> Path:
        dest = self._staging.path / desc.digest.replace(":", "-")

        def count(n: int) -> None:
            with self._lock:
                self._progress[desc.digest] = self._progress.get(desc.digest, 0) + n

        got = self.client.download(desc, dest, count)
        with self._lock:
            self.bytes_downloaded += got
        return dest

    def _start(self, desc: Descriptor) -> Future[Path]:
        with self._lock:
            future = self._downloads.get(desc.digest)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        PARALLEL_DOWNLOADS, thread_name_prefix="weenv-pull"
                    )
                future = self._downloads[desc.digest] = self._pool.submit(self._download, desc)
            return future

    def prefetch(self, layers: Sequence[Layer]) -> None:
        """Start downloading `layers` in the background, in order, a few at a time."""
        for layer in layers:
            assert layer.digest is not None and layer.size is not None
            with self._lock:
                self._users[layer.digest] = self._users.get(layer.digest, 0) + 1
            self._start(Descriptor(layer.media_type, layer.digest, layer.size))

    def wait_for(self, layer: Layer, progress: Progress) -> None:
        """Make sure `layer` is downloaded, showing its download while waiting."""
        assert layer.digest is not None and layer.size is not None
        future = self._start(Descriptor(layer.media_type, layer.digest, layer.size))
        if future.done():
            future.result()
            return
        progress.begin(f"downloading {layer.label}", layer.size)
        shown = 0
        while not future.done():
            time.sleep(0.1)  # progress redraw only; the future carries the result
            with self._lock:
                now = self._progress.get(layer.digest, 0)
            progress.update(now - shown)
            shown = now
        progress.end()
        future.result()

    def layer_opener(self, desc: Descriptor) -> Callable[[], BinaryIO]:
        def opener() -> BinaryIO:
            path = self._start(desc).result()
            f = open(path, "rb")  # noqa: SIM115 - the caller closes it
            with self._lock:
                users = self._users[desc.digest] = self._users.get(desc.digest, 1) - 1
            if users <= 0:
                os.unlink(path)  # the open file keeps the data; the disk space goes with it
            return f

        return opener

    def close(self) -> None:
        self.client.closing.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._staging.close()
