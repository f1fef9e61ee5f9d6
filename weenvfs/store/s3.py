"""A store in an S3-compatible bucket (AWS S3, SeaweedFS, MinIO, ...), with boto3.

URL: `s3://BUCKET/PREFIX?endpoint=URL&region=R&addressing=path|virtual&profile=P&timeout=S`.
Everything not in the URL comes from the standard AWS configuration (AWS_* variables,
profiles, ~/.aws/config and ~/.aws/credentials, credential_process, SSO, instance roles).

Owns: one boto3 client per store, built in the constructor from an explicit
`boto3.session.Session()` (clients are thread-safe, sessions are not), or taken over from the
node service that forked this process (`prebuild`) or from an earlier store of this process
(s3_clients.py keeps both kinds); translating botocore's
errors into the store errors (s3_common.py); credential renewal. GETs and LISTs go through
s3_direct.py where the client allows it (a plain-http endpoint: SeaweedFS, MinIO), which
answers as botocore would, so everything here treats both alike. Must not: retry (botocore's
own retries are off, `total_max_attempts=1`, so that RetryingStore alone decides and its
counters are the truth), cache, or know what the objects mean, except which key prefixes
hold content-addressed objects (`create_only_prefixes`, for conditional create).

Credentials that expire or are rotated while a process runs: credentials botocore can
refresh on its own (credential_process, SSO, AssumeRole, container and instance roles) are
refreshed by botocore before they expire. Static keys are read once per client, so on an
authentication error (InvalidAccessKeyId, SignatureDoesNotMatch, ExpiredToken, or any
401/403, since a HEAD answer carries no error code) the store builds a new session, which
reads the environment, the profile and the credentials files again; if the credentials it
finds differ from those in use, it swaps in a new client and repeats the request once.
Rotating keys = writing the new ones to the credentials file (or the credential_process
output) before the old ones are revoked: no remount.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.session
from botocore.config import Config

from weenvfs.errors import ObjectMissing, ObjectTooLarge, StoreError, StoreUnavailable
from weenvfs.store import s3_clients
from weenvfs.store.base import TEMP_PREFIX, Store, validate_key, validate_prefix
from weenvfs.store.s3_clients import Credentials, environment_key, shared_loader
from weenvfs.store.s3_common import (
    BOTO_ERRORS,
    DEFAULT_REGION,
    error_code,
    http_status,
    is_auth_error,
    parse_s3_url,
    translate,
)
from weenvfs.store.s3_direct import DirectGetter, HandBack

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
# The content-addressed kinds of SPEC.md: an existing object under these is never replaced.
CONTENT_ADDRESSED = ("blobs/", "indexes/", "manifests/", "hints/")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_RANGE_SLACK = 16 * MiB  # a server ignoring Range: slice a full body only this much larger


def prebuild(url: str, environ: Mapping[str, str]) -> bool:
    """Make the client an S3Store of `url` would make in a process with environment
    `environ`, for the processes this one forks later (s3_clients.py); True if made now.
    Only for static keys in the environment: other credential sources may reach the network
    (instance roles, credential_process, SSO), which the node service must never wait for."""
    key = (url, environment_key(environ))
    if key in s3_clients.prebuilt or not (environ.get("AWS_ACCESS_KEY_ID")
                                          and environ.get("AWS_SECRET_ACCESS_KEY")):
        return False
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(environ)
        store = S3Store(url, prebuilt=False)
    except StoreError as error:
        log.debug("no client made ahead for %s: %s", url, error)
        return False
    finally:
        os.environ.clear()
        os.environ.update(saved)
    s3_clients.rehearse(store._client, store.bucket, store._prefix)
    s3_clients.keep_prebuilt(key, store._client, store._credentials, store._client_settings)
    return True


class S3Store(Store):
    """Objects under `PREFIX/` in `BUCKET`.

    `session_options` are passed to `boto3.session.Session` (e.g. explicit keys, for tests
    and embedding); credentials given that way are fixed and never renewed.
    `create_only_prefixes`: keys under these are written with `If-None-Match: *` where the
    server supports it (detected at the first put), so an existing immutable object is kept.
    `prebuilt`: take the client the node service made for this URL and environment, if any
    (`prebuild`), else one this process made for an earlier store in the last
    REUSE_SECONDS (only with the timeouts and pool size it was made with).
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_connections: int = 32,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        upload_threads: int = 4,
        create_only_prefixes: tuple[str, ...] = CONTENT_ADDRESSED,
        session_options: dict[str, Any] | None = None,
        prebuilt: bool = True,
    ) -> None:
        self._url = url
        self.location = parse_s3_url(url)
        self.bucket = self.location.bucket
        self._prefix = self.location.prefix
        self._timeouts = (connect_timeout, self.location.timeout or read_timeout)
        self._max_connections = max_connections
        self._multipart = (max(multipart_threshold, part_size), part_size, upload_threads)
        self._create_only = create_only_prefixes
        self._conditional = True  # until the server says it cannot
        self._session_options = dict(session_options or {})
        self._lock = threading.Lock()
        self._bucket_seen = False
        self._settings_key = (url, environment_key(os.environ))  # its client and writes
        self._reuse_key = self._settings_key if prebuilt and not session_options else None
        made = (s3_clients.take(self._settings_key, self._client_settings) if self._reuse_key
                else None)
        if made is not None:
            self._client, self._credentials = made
        else:
            self._client, self._credentials = self._new_client()
            self._remember_client()
        # GETs (a cold start's many small reads, a warm run's tag) skip botocore where they
        # can.
        self._direct = DirectGetter.for_(
            self._client, self.location.endpoint, self.location.addressing, self.bucket,
            self._timeouts)

    def _remember_client(self) -> None:
        """Let this process's later stores of the same URL and environment take this
        store's client (s3_clients.py)."""
        if self._reuse_key:
            s3_clients.remember(self._reuse_key, self._client, self._credentials,
                                self._client_settings)

    def writer_identity(self) -> str | None:
        """See `Store.writer_identity`: the URL and the environment's AWS settings (None for
        credentials given as `session_options`)."""
        if self._session_options:
            return None
        return hashlib.sha256(repr(self._settings_key).encode()).hexdigest()

    @property
    def _client_settings(self) -> tuple[Any, ...]:
        """What a client is made with besides the URL and the environment."""
        return self._timeouts, self._max_connections

    @property
    def url(self) -> str:
        """The URL the store was opened from (it never holds credentials)."""
        return self._url

    # -- client and credentials ----------------------------------------------------------

    def _new_client(self) -> tuple[Any, Credentials]:
        """A client from a fresh session, and the credentials it signs with."""
        session, credentials = self._new_session()
        return self._client_from(session), credentials

    def _new_session(self) -> tuple[Any, Credentials]:
        """A session, which reads the AWS configuration anew, and its credentials now."""
        try:
            core = botocore.session.Session()
            core.register_component("data_loader", shared_loader())
            session = boto3.session.Session(
                botocore_session=core, profile_name=self.location.profile,
                **self._session_options,
            )
            credentials = session.get_credentials()
            frozen = credentials.get_frozen_credentials() if credentials else None
        except Exception as e:  # ProfileNotFound, a failing credential_process, bad config
            raise StoreError(f"store {self.url}: AWS configuration: {e}") from None
        return session, (tuple(frozen) if frozen else None)  # type: ignore[return-value]

    def _client_from(self, session: Any) -> Any:
        loc = self.location
        addressing = loc.addressing or ("path" if loc.endpoint else None)
        config = Config(
            region_name=loc.region or session.region_name or DEFAULT_REGION,
            connect_timeout=self._timeouts[0],
            read_timeout=self._timeouts[1],
            retries={"total_max_attempts": 1, "mode": "standard"},  # RetryingStore retries
            max_pool_connections=self._max_connections,
            s3={"addressing_style": addressing} if addressing else None,
            user_agent_extra="weenv",
        )
        return session.client("s3", endpoint_url=loc.endpoint, config=config)

    def _renew_credentials(self, failed_client: Any) -> bool:
        """After an authentication error: re-read the AWS configuration (about 15 ms) and, if
        it now holds other credentials, switch to a new client. True if the caller should
        try again. Threads failing together wait for one re-read."""
        if self._session_options.get("aws_access_key_id"):
            return False  # fixed credentials: nothing to re-read
        with self._lock:
            if self._client is not failed_client:
                return True  # another thread renewed them meanwhile
            try:
                session, credentials = self._new_session()
            except StoreError as e:
                log.info("store %s: cannot re-read credentials: %s", self.url, e)
                return False
            if credentials == self._credentials:
                return False
            self._client, self._credentials = self._client_from(session), credentials
            if self._reuse_key and s3_clients.made_here_client(self._reuse_key) is failed_client:
                self._remember_client()  # later stores take the new one
        log.info("store %s: credentials changed, using the new ones", self.url)
        return True

    def _call(self, what: str, key: str, op: Callable[[Any], T]) -> T:
        """Run `op(client)`, translating errors; once more after renewed credentials."""
        client = self._client
        try:
            return op(client)
        except BOTO_ERRORS as e:
            if not (is_auth_error(e) and self._renew_credentials(client)):
                raise translate(e, self.url, what, key) from None
        try:
            return op(self._client)
        except BOTO_ERRORS as e:
            raise translate(e, self.url, what, key) from None

    def _key(self, key: str) -> str:
        return self._prefix + validate_key(key)

    def _absent(self, key: str) -> ObjectMissing:
        """ObjectMissing for `key` after a bare 404, which HEAD gives for a missing bucket
        too: the bucket is checked once, so a missing bucket is never an empty store."""
        if not self._bucket_seen:
            self._call("check", "", self._head_bucket)
            self._bucket_seen = True
        return ObjectMissing(key, self.url)

    def _no_bucket(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"store {self.url}: bucket {self.bucket!r} does not exist", temporary=False
        )

    def _head_bucket(self, client: Any) -> None:
        """HEAD the bucket; on a bare 403/400 (a HEAD answer has no body), list one key
        instead: it either works (the prefix is readable) or says precisely what is wrong."""
        from botocore.exceptions import ClientError

        try:
            client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if http_status(e) == 404:
                raise self._no_bucket() from None
            if http_status(e) not in (400, 401, 403):
                raise
            client.list_objects_v2(Bucket=self.bucket, Prefix=self._prefix, MaxKeys=1)

    # -- reading -------------------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes:
        """See `Store.get`. A body shorter than its Content-Length is a temporary error; with
        a `limit`, a Content-Length above it is refused before the body is read."""
        s3key = self._key(key)

        def op(client: Any) -> bytes:
            response = self._get_object(client, key, Bucket=self.bucket, Key=s3key)
            declared = response.get("ContentLength")
            if limit is not None and declared is not None and declared > limit:
                response["Body"].close()
                raise ObjectTooLarge(key, self.url, limit, declared)
            return _read_body(response, declared, self.url, key, limit)

        return self._call("get", key, op)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """See `Store.get_range`: one ranged GET, checked to return exactly `length` bytes."""
        if offset < 0 or length < 0:
            raise ValueError(f"negative range: offset={offset} length={length}")
        if length == 0:  # HTTP cannot ask for zero bytes: check the object's size instead
            size = self.size(key)
            if offset > size:
                raise self._short(key, offset, length, size)
            return b""
        s3key = self._key(key)
        wanted = f"bytes={offset}-{offset + length - 1}"

        def op(client: Any) -> bytes:
            response = self._get_object(client, key, Bucket=self.bucket, Key=s3key, Range=wanted)
            return self._range_body(response, key, offset, length)

        return self._call("get_range", key, op)

    def _get_object(self, client: Any, key: str, **params: Any) -> Any:
        from botocore.exceptions import ClientError

        try:
            return self._direct_first(client, "get_object", params)
        except ClientError as e:
            if error_code(e) == "InvalidRange" or http_status(e) == 416:
                raise self._short(key, *_range_of(params["Range"]), None) from None
            raise

    def _range_body(self, response: Any, key: str, offset: int, length: int) -> bytes:
        """The requested bytes from a GET answer: 206 with a Content-Range, or a full 200."""
        declared = response.get("ContentLength")
        match = _CONTENT_RANGE.fullmatch(response.get("ContentRange") or "")
        if match is None:  # the server ignored Range and sent the whole object
            if declared is not None and declared > offset + length + _RANGE_SLACK:
                response["Body"].close()
                raise StoreError(f"store {self.url}: server ignored the Range header")
            data = _read_body(response, declared, self.url, key)
            if len(data) < offset + length:
                raise self._short(key, offset, length, len(data))
            return data[offset : offset + length]
        start, end, total = match.groups()
        if int(start) != offset or int(end) + 1 < offset + length:
            response["Body"].close()
            raise self._short(key, offset, length, None if total == "*" else int(total))
        return _read_body(response, declared, self.url, key)[:length]

    def _short(self, key: str, offset: int, length: int, size: int | None) -> StoreError:
        has = "" if size is None else f"is {size} bytes, "
        return StoreError(
            f"object {key!r} in {self.url} {has}shorter than the requested range "
            f"{offset}+{length}"
        )

    def exists(self, key: str) -> bool:
        """See `Store.exists` (a HEAD request)."""
        try:
            self.size(key)
        except ObjectMissing:
            return False
        return True

    def size(self, key: str) -> int:
        """See `Store.size` (a HEAD request)."""
        s3key = self._key(key)
        try:
            head = self._call("size", key, lambda c: c.head_object(Bucket=self.bucket, Key=s3key))
        except ObjectMissing:
            raise self._absent(key) from None
        return int(head["ContentLength"])

    def list(self, prefix: str = "") -> Iterator[str]:
        """See `Store.list`. Pages of ListObjectsV2, sorted here: S3 itself sorts, but some
        servers (SeaweedFS) walk directories and return "a/x" before "a-b". Keys that are
        not valid store keys (folder markers, temp probes) are skipped."""
        validate_prefix(prefix)
        return self._list_sorted(self._prefix + prefix)

    def _list_sorted(self, full_prefix: str) -> Iterator[str]:
        keys: list[str] = []
        token: str | None = None
        while True:
            params = {"Bucket": self.bucket, "Prefix": full_prefix}
            if token:
                params["ContinuationToken"] = token
            page = self._call("list", full_prefix,
                              lambda c, p=params: self._direct_first(c, "list_objects_v2", p))
            for item in page.get("Contents", ()):
                key = item["Key"][len(self._prefix) :]
                if _is_key(key):
                    keys.append(key)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                break
        keys.sort()
        yield from keys

    def _direct_first(self, client: Any, operation: str, params: dict[str, Any]) -> Any:
        """botocore's `client.OPERATION(**params)`, sent by the direct getter where it can
        (its methods answer as botocore's of the same name), else by botocore."""
        if self._direct is not None:
            try:
                return getattr(self._direct, operation)(client, **params)
            except HandBack:
                pass
        return getattr(client, operation)(**params)

    # -- writing -------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """See `Store.put`: one PUT (atomic on S3). Under `create_only_prefixes` an existing
        object is kept (same digest, same bytes) where the server supports If-None-Match."""
        s3key = self._key(key)
        body = data if isinstance(data, bytes | bytearray) else bytes(memoryview(data))
        created = self._conditional and key.startswith(self._create_only)
        if created and self._put_if_absent(key, s3key, body):
            return
        self._call("put", key, lambda c: c.put_object(Bucket=self.bucket, Key=s3key, Body=body))

    def _put_if_absent(self, key: str, s3key: str, body: bytes | bytearray) -> bool:
        """Conditional create; False if the server cannot do it (then never asked again)."""
        from botocore.exceptions import ClientError

        def op(client: Any) -> bool:
            try:
                client.put_object(Bucket=self.bucket, Key=s3key, Body=body, IfNoneMatch="*")
            except ClientError as e:
                if error_code(e) == "PreconditionFailed" or http_status(e) == 412:
                    log.debug("store %s: %s exists, kept", self.url, key)
                    return True
                if not _conditional_unsupported(e):
                    raise
                self._conditional = False
                log.info("store %s: no conditional PUT support; plain PUTs from now", self.url)
                return False
            return True

        return self._call("put", key, op)

    def put_file(self, key: str, path: Path | str) -> None:
        """See `Store.put_file`: one PUT up to the multipart threshold, else a multipart
        upload with parts sent in parallel (the object appears only when it completes)."""
        s3key = self._key(key)
        with open(path, "rb") as f:  # OSError here is the caller's, not the store's
            size = os.fstat(f.fileno()).st_size
            threshold, part_size, threads = self._multipart
            if size < threshold:
                self.put(key, f.read())
                return
            self._upload_parts(key, s3key, f.fileno(), size, part_size, threads)

    def _upload_parts(
        self, key: str, s3key: str, fd: int, size: int, part_size: int, threads: int
    ) -> None:
        start = self._call(
            "put_file", key, lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=s3key)
        )
        upload_id = start["UploadId"]
        common = {"Bucket": self.bucket, "Key": s3key, "UploadId": upload_id}

        def part(number: int) -> dict[str, Any]:
            offset = (number - 1) * part_size
            data = os.pread(fd, min(part_size, size - offset), offset)
            answer = self._call(
                "put_file", key, lambda c: c.upload_part(PartNumber=number, Body=data, **common)
            )
            return {"PartNumber": number, "ETag": answer["ETag"]}

        try:
            with ThreadPoolExecutor(threads) as pool:
                parts = list(pool.map(part, range(1, -(-size // part_size) + 1)))
            self._call(
                "put_file", key,
                lambda c: c.complete_multipart_upload(MultipartUpload={"Parts": parts}, **common),
            )
        except BaseException:
            try:
                self._client.abort_multipart_upload(**common)
            except Exception as e:  # the upload expires by the bucket's lifecycle anyway
                log.debug("store %s: abort of upload %s failed: %s", self.url, upload_id, e)
            raise

    def delete(self, key: str) -> None:
        """See `Store.delete` (S3 deletes are idempotent)."""
        s3key = self._key(key)
        self._call("delete", key, lambda c: c.delete_object(Bucket=self.bucket, Key=s3key))

    # -- maintenance ---------------------------------------------------------------------

    def check(self, write: bool = False) -> None:
        """See `Store.check`: HEAD the bucket (one clear line for a missing bucket, bad or
        expired credentials, access denied, an unreachable endpoint); with `write=True` also
        put and delete a probe object (named like a temp file, so never listed)."""
        self._call("check", "", self._head_bucket)
        self._bucket_seen = True
        if write:
            probe = self._prefix + TEMP_PREFIX + "check-" + os.urandom(6).hex()
            self._call("check", "", lambda c: c.put_object(Bucket=self.bucket, Key=probe, Body=b""))
            self._call("check", "", lambda c: c.delete_object(Bucket=self.bucket, Key=probe))

    def close(self) -> None:
        """Close the client's connection pool (and the ranged GETs' connections)."""
        self._client.close()
        if self._direct is not None:
            self._direct.close()


def _read_body(
    response: Any, declared: int | None, url: str, key: str, limit: int | None = None
) -> bytes:
    """The whole body (at most `limit + 1` bytes of it); a temporary error if it ends before
    its declared length."""
    body = response["Body"]
    try:
        data = body.read() if limit is None else body.read(limit + 1)
    finally:
        body.close()
    if limit is not None and len(data) > limit:  # no Content-Length, or more than it said
        raise ObjectTooLarge(key, url, limit)
    if declared is not None and len(data) != declared:
        raise StoreUnavailable(
            f"store {url}: {key!r}: body cut short ({len(data)} of {declared} bytes)",
            temporary=True,
        )
    return data  # type: ignore[no-any-return]


def _range_of(header: str) -> tuple[int, int]:
    first, last = header.removeprefix("bytes=").split("-")
    return int(first), int(last) - int(first) + 1


def _is_key(key: str) -> bool:
    try:
        validate_key(key)
    except StoreError:
        return False
    return True


def _conditional_unsupported(err: Exception) -> bool:
    """Whether a conditional PUT failed because the server does not implement it."""
    if error_code(err) == "NotImplemented" or http_status(err) == 501:
        return True
    return http_status(err) == 400 and "if-none-match" in str(err).lower()
