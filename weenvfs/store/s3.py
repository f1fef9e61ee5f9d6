"""A store in an S3-compatible bucket (AWS S3, SeaweedFS, MinIO, ...), with boto3.

URL: `s3://BUCKET/PREFIX?endpoint=URL&region=R&addressing=path|virtual&profile=P&timeout=S`.
Everything not in the URL comes from the standard AWS configuration (AWS_* variables,
profiles, ~/.aws/config and ~/.aws/credentials, credential_process, SSO, instance roles).

Owns: one boto3 client per store, built in the constructor from an explicit
`boto3.session.Session()` (clients are thread-safe, sessions are not), or taken over from the
node service that forked this process (`prebuild`); translating botocore's
errors into the store errors (s3_common.py); credential renewal. Must not: retry (botocore's
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

import contextlib
import io
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config

from weenvfs.errors import ObjectMissing, ObjectTooLarge, StoreError, StoreUnavailable
from weenvfs.store.base import TEMP_PREFIX, Store, validate_key, validate_prefix
from weenvfs.store.s3_common import (
    BOTO_ERRORS,
    error_code,
    http_status,
    is_auth_error,
    parse_s3_url,
    translate,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
Credentials = tuple[str, str, str | None] | None  # key, secret, token

MiB = 1 << 20
DEFAULT_REGION = "us-east-1"
# The content-addressed kinds of SPEC.md: an existing object under these is never replaced.
CONTENT_ADDRESSED = ("blobs/", "indexes/", "manifests/", "hints/")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_RANGE_SLACK = 16 * MiB  # a server ignoring Range: slice a full body only this much larger
_LOADER_LOCK = threading.Lock()
_loader: Any = None


def _shared_loader() -> Any:
    """botocore's service-model loader, shared by every session of this process: loading the
    S3 model costs about 0.1 s per session otherwise, and the models never change while a
    process runs (the AWS configuration and credentials are still read per session)."""
    global _loader
    with _LOADER_LOCK:
        if _loader is None:
            _loader = botocore.loaders.create_loader()
        return _loader


def warm_up() -> None:
    """Load the S3 model now (the mount server does, before it forks mount daemons), and
    make one throwaway client: botocore imports and builds the rest of what a client needs
    (endpoint rules, handlers) at the first `client()`, about 40 ms a forked process would
    otherwise pay again. A client connects only at its first request, so none is made."""
    loader = _shared_loader()
    loader.load_service_model("s3", "service-2")
    loader.load_service_model("s3", "endpoint-rule-set-1")
    loader.load_data("endpoints")
    loader.load_data("partitions")
    core = botocore.session.Session()
    core.register_component("data_loader", loader)
    session = boto3.session.Session(botocore_session=core, aws_access_key_id="warm-up",
                                    aws_secret_access_key="warm-up", region_name=DEFAULT_REGION)
    session.client("s3", endpoint_url="http://127.0.0.1:9", config=Config(user_agent_extra="weenv"))


# Clients made ahead of time by the node service (`prebuild`), which the processes it forks
# take over (copy-on-write memory, no connection yet: a client connects at its first request)
# instead of spending about 20 ms each on a session and a client. Keyed by the store URL and
# every variable of the environment that can change which credentials and configuration a
# session finds, so a process only ever gets the client it would have made itself.
MAX_PREBUILT = 8
# (url, environment) -> (client, its credentials, the (timeouts, pool size) it was made with)
_prebuilt: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Any, Credentials, Any]] = {}
# Clients a process made for itself, taken by its later stores of the same URL and
# environment for REUSE_SECONDS: a harness opening 32 environments at once made 32 sessions
# and clients (~30 ms of CPU each, on the critical path of every `Environment.open`).
# Clients are thread-safe; after that long a store reads the AWS configuration anew, as
# one did every time before (an authentication error re-reads it at once: `_renew_credentials`).
# They have connections open, so a forked process must never take one (it would talk on
# its parent's sockets): forgotten in the child at every fork.
REUSE_SECONDS = 60.0
_made_here: dict[tuple[str, tuple[tuple[str, str], ...]],
                 tuple[Any, Credentials, Any, float]] = {}
_made_here_lock = threading.Lock()  # a harness opens stores from many threads at once


def _forget_clients_made_here() -> None:
    global _made_here_lock  # another thread may have held it at the fork: a new one
    _made_here.clear()
    _made_here_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_clients_made_here)


def _environment_key(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in environ.items()
                        if k.startswith(("AWS_", "BOTO_")) or k == "HOME"))


def prebuild(url: str, environ: Mapping[str, str]) -> bool:
    """Make the client an S3Store of `url` would make in a process with environment
    `environ`, for the processes this one forks later (see `_prebuilt`); True if made now.
    Only for static keys in the environment: other credential sources may reach the network
    (instance roles, credential_process, SSO), which the node service must never wait for."""
    key = (url, _environment_key(environ))
    if key in _prebuilt or not (environ.get("AWS_ACCESS_KEY_ID")
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
    _rehearse(store._client, store.bucket, store._prefix)
    while len(_prebuilt) >= MAX_PREBUILT:
        del _prebuilt[next(iter(_prebuilt))]
    _prebuilt[key] = (store._client, store._credentials, store._client_settings)
    return True


class _CannedBody(io.BytesIO):
    """A rehearsal's response body, read as botocore reads urllib3's (`stream` or `read`)."""

    def stream(self, amt: int = 1 << 16, decode_content: bool | None = None) -> Iterator[bytes]:
        while chunk := self.read(amt):
            yield chunk


_MISSING = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchKey</Code>'
            b"<Message>The specified key does not exist.</Message></Error>")
_NO_KEYS = (b'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.'
            b'amazonaws.com/doc/2006-03-01/"><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys>'
            b"<IsTruncated>false</IsTruncated></ListBucketResult>")
# What a mount daemon asks first: the hint tags of its environment (a listing), objects that
# may not exist (404), ranges of objects (206).
_REHEARSAL = (
    ("list_objects_v2", {}, 200, _NO_KEYS, {"content-type": "application/xml"}),
    ("get_object", {}, 404, _MISSING, {"content-type": "application/xml"}),
    ("get_object", {"Range": "bytes=0-0"}, 206, b"x",
     {"content-range": "bytes 0-0/1", "content-length": "1"}),
    ("head_object", {}, 404, b"", {}),
)


def _rehearse(client: Any, bucket: str, prefix: str) -> None:
    """Send a client's first requests of each kind a mount makes (`_REHEARSAL`) through
    botocore's whole pipeline, answered here instead of by the server (its `before-send`
    event: nothing reaches the network). A client builds its endpoint resolution, request
    serializers, response parsers and error shapes at its first request of each kind, about
    30 ms of CPU per request kind; rehearsed in the node service, every process it forks
    inherits them built."""
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ClientError

    canned: list[AWSResponse] = []  # the answer to the request being rehearsed

    def answer(request: Any, **kwargs: Any) -> AWSResponse:
        return canned[0]

    client.meta.events.register_first("before-send.s3", answer, unique_id="weenv-rehearsal")
    try:
        for operation, params, status, body, headers in _REHEARSAL:
            canned[:] = [AWSResponse("http://rehearsal.invalid/", status, headers,
                                     _CannedBody(body))]
            where = ({"Prefix": f"{prefix}weenv-rehearsal/"} if operation.startswith("list")
                     else {"Key": f"{prefix}weenv-rehearsal"})
            with contextlib.suppress(ClientError):
                response = getattr(client, operation)(Bucket=bucket, **where, **params)
                response.get("Body", _CannedBody()).read()
    except Exception as error:  # noqa: BLE001 - a rehearsal only saves time
        log.debug("rehearsal of the S3 client for %s failed: %s", bucket, error)
    finally:
        client.meta.events.unregister("before-send.s3", unique_id="weenv-rehearsal")


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
        key = (url, _environment_key(os.environ))
        self._reuse_key = key if prebuilt and not session_options else None
        made = _prebuilt.get(key) if self._reuse_key else None
        if made is None and self._reuse_key:
            made = _made_here.get(key)
            if made is not None and time.monotonic() - made[3] >= REUSE_SECONDS:
                made = None
        if made is not None and made[2] == self._client_settings:
            self._client, self._credentials = made[0], made[1]
        else:
            self._client, self._credentials = self._new_client()
            if self._reuse_key:
                self._remember_client(self._reuse_key)

    def _remember_client(self, key: tuple[str, tuple[tuple[str, str], ...]]) -> None:
        """Let this process's later stores of the same URL and environment take this
        store's client (`_made_here`)."""
        with _made_here_lock:
            _made_here.pop(key, None)
            while len(_made_here) >= MAX_PREBUILT:
                del _made_here[next(iter(_made_here))]
            _made_here[key] = (self._client, self._credentials, self._client_settings,
                               time.monotonic())

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
            core.register_component("data_loader", _shared_loader())
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
            shared = _made_here.get(self._reuse_key) if self._reuse_key else None
            if shared is not None and shared[0] is failed_client:
                self._remember_client(self._reuse_key)  # later stores take the new one
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
            return client.get_object(**params)
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
            page = self._call("list", full_prefix, lambda c, p=params: c.list_objects_v2(**p))
            for item in page.get("Contents", ()):
                key = item["Key"][len(self._prefix) :]
                if _is_key(key):
                    keys.append(key)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                break
        keys.sort()
        yield from keys

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
        """Close the client's connection pool."""
        self._client.close()


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
