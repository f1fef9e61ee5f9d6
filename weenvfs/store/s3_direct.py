"""GETs and LISTs of an S3 store without botocore's request pipeline: signed here (SigV4),
sent on kept-alive connections the store's threads share.

Why: a cold start with no hint makes ~90 ranged GETs, four at a time, in the mount daemon
whose one Python core also answers the kernel's reads. botocore spends ~2 ms of CPU per
request (events, serializers, endpoint rules, parsers) holding the GIL; measured on the
README's first run from SeaweedFS, 10 alternating pairs: 1.59 s against 1.67 s (mean), faster
in 9 pairs of 10 (docs/benchmarks.md, "GETs without botocore"). And every warm `weenv run`
GETs a tag: 9-10 ms through botocore in the node service's fork, ~5 ms here. A LIST
(ListObjectsV2) costs a process's first 7-10 ms of CPU in botocore (its operation model is
loaded then), 2.5-3.5 ms after: every mount daemon of an environment whose hint the node
does not know, on a node new to the environment's groups, lists its hint tags once before it
mounts (node_hints.py `may_have_hint`, fuse/mount_replay.py).

Owns: deciding whether a store's client can be bypassed for GETs (`DirectGetter.for_`:
an explicit plain-http endpoint with path-style addressing, SigV4, credentials, no proxy:
SeaweedFS, MinIO and the like on a node's network; AWS itself, https, virtual-hosted
addressing and proxies keep botocore, whose endpoint rules, TLS settings and redirects are
not redone here), building the request (URL, SigV4 headers with the client's credentials of
the moment), and answering like botocore's `get_object`: a dict with ContentLength,
ContentRange and Body, or a botocore ClientError built from the S3 error answer, so s3.py
translates and renews credentials exactly as for a request botocore sent; and checking a
whole object's stored checksum as botocore does (`_checksum_of`, `_Body`); a page of a
listing as botocore's `list_objects_v2` gives the keys (URL-encoded on the way, as botocore
asks for them), an answer it cannot read going back to botocore.
Must not: retry (RetryingStore does), interpret ranges (s3.py checks them), use a
connection for two requests at once, or use one a forked parent opened.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import http.client
import os
import select
import threading
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable
from typing import Any
from xml.etree import ElementTree

from botocore.exceptions import ClientError, FlexibleChecksumError

# The SHA-256 of a GET's empty body, signed as botocore signs it over http.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_SAFE = "-_.~/"  # S3 keys are URI-encoded once, "/" kept (also the canonical URI)
_ERROR_BODY_LIMIT = 64 << 10
# A page of a listing holds at most 1,000 keys of at most 1,024 bytes each (S3's limits);
# an answer declaring more is not one this getter reads (botocore then asks again).
_LIST_BODY_LIMIT = 8 << 20
# Idle connections kept for the next requests (botocore's pool keeps up to 32 in all).
MAX_IDLE = 16
# Answers after which botocore does something of its own (region redirects, a malformed
# authorization for the region): the store goes back to botocore for good.
_HAND_BACK = frozenset({301, 302, 307, 400})
_CHECKSUM = "x-amz-checksum-"
# The checksums of a whole object's answer checked here, in botocore's order of preference;
# an answer with any other (crc32c, crc64nvme, xxhash: botocore's with its CRT extension)
# goes back to botocore, which checks what it can.
_CHECKED: dict[str, Callable[[], Any]] = {
    "crc32": lambda: _Crc32(), "sha1": hashlib.sha1, "sha256": hashlib.sha256,
    "sha512": hashlib.sha512}


class HandBack(Exception):
    """This request is botocore's to send (and every later one once `usable` is False)."""


class DirectGetter:
    """Sends `get_object(Bucket, Key[, Range])` for a store whose client allows it. A whole
    object's answer carries the checksum the server stored with it (SeaweedFS: CRC32),
    which botocore checks: so does this getter (`_Body`), and it hands an answer with a
    checksum it cannot compute back to botocore (and every later whole object with it)."""

    def __init__(self, endpoint: str, bucket: str, region: str,
                 timeouts: tuple[float, float]) -> None:
        parts = urllib.parse.urlsplit(endpoint)
        self._netloc = parts.netloc
        self._base = parts.path.rstrip("/") + "/" + urllib.parse.quote(bucket, safe="") + "/"
        self._region = region
        self._timeouts = timeouts
        # Idle connections, the last returned on top: any thread takes one (a new worker
        # thread then needs no handshake, and a remote store's TCP window stays open), a
        # request holds it until its body is read to the end. Only this process's: `_pid`.
        self._idle: list[http.client.HTTPConnection] = []
        self._pid = os.getpid()
        self._closed = False
        self._lock = threading.Lock()
        self._signing_key: tuple[str, str, bytes] = ("", "", b"")  # secret, day, key
        self.requests = 0  # sent by this getter (tests read it)
        self.usable = True  # False after a HandBack
        self.whole_objects = True  # False once an answer had a checksum it cannot check

    @classmethod
    def for_(cls, client: Any, endpoint: str | None, addressing: str | None, bucket: str,
             timeouts: tuple[float, float]) -> DirectGetter | None:
        """A getter for `client`'s store, or None when botocore must send the requests."""
        if not endpoint or addressing == "virtual":
            return None
        if urllib.parse.urlsplit(endpoint).scheme != "http":
            return None
        config = client.meta.config
        if config.proxies or _proxied(endpoint):
            return None
        if (config.signature_version or "s3v4") not in ("s3v4", "v4"):
            return None
        if _credentials(client) is None or not client.meta.region_name:
            return None
        return cls(endpoint, bucket, client.meta.region_name, timeouts)

    # -- the request ---------------------------------------------------------------------

    def get_object(self, client: Any, *, Bucket: str, Key: str,
                   Range: str | None = None) -> dict[str, Any]:
        """What botocore's `client.get_object(Bucket=, Key=[, Range=])` returns, for the parts
        s3.py reads; raises ClientError for an error answer, OSError or HTTPException for a
        transport failure, FlexibleChecksumError (as botocore) when a whole object's body
        does not match its checksum, HandBack when botocore must send it. `Bucket` is the
        store's, which the getter was made for."""
        credentials = _credentials(client)
        if credentials is None or not self.usable or (Range is None and not self.whole_objects):
            raise HandBack
        path = self._base + urllib.parse.quote(Key, safe=_SAFE)
        # A whole object's answer carries its stored checksum when asked (as botocore asks).
        extra = {} if Range is not None else {"x-amz-checksum-mode": "ENABLED"}
        headers = self.signed_headers(path, credentials, _now(), extra)
        if Range is not None:
            headers["range"] = Range
        connection, response = self._send(path, headers)
        if response.status in (200, 206):
            check = None
            if Range is None:
                try:
                    check = _checksum_of(response)
                except HandBack:
                    self.whole_objects = False
                    response.close()
                    connection.close()
                    raise
            return {"ContentLength": _int(response.getheader("content-length")),
                    "ContentRange": response.getheader("content-range"),
                    "Body": _Body(response, self, connection, check)}
        raise self._failed(connection, response, "GetObject")

    def list_objects_v2(self, client: Any, *, Bucket: str, Prefix: str,
                        ContinuationToken: str | None = None,
                        MaxKeys: int | None = None) -> dict[str, Any]:
        """What botocore's `client.list_objects_v2(Bucket=, Prefix=[, ContinuationToken=,
        MaxKeys=])` returns, for the parts s3.py reads: Contents (each item's Key),
        IsTruncated and NextContinuationToken. Raises as `get_object`; HandBack also for an
        answer this getter cannot read (botocore then asks again, and says what is wrong)."""
        credentials = _credentials(client)
        if credentials is None or not self.usable:
            raise HandBack
        params = {"list-type": "2", "prefix": Prefix, "encoding-type": "url"}
        if ContinuationToken is not None:
            params["continuation-token"] = ContinuationToken
        if MaxKeys is not None:
            params["max-keys"] = str(MaxKeys)
        query = "&".join(f"{_quoted(name)}={_quoted(value)}"
                         for name, value in sorted(params.items()))
        path = self._base.rstrip("/")  # the bucket itself, as botocore addresses it
        headers = self.signed_headers(path, credentials, _now(), query=query)
        connection, response = self._send(f"{path}?{query}", headers)
        if response.status != 200:
            raise self._failed(connection, response, "ListObjectsV2")
        declared = _int(response.getheader("content-length"))
        if declared is not None and declared > _LIST_BODY_LIMIT:  # longer than any page
            response.close()
            connection.close()
            raise HandBack
        try:
            body = response.read()  # IncompleteRead (a temporary error) when cut short
        except BaseException:
            connection.close()
            raise
        self._give_back(connection)
        return _list_page(body)

    def _send(self, target: str, headers: dict[str, str],
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """GET `target` (path and query) on a connection of its own; its answer's head."""
        connection = self._take()
        try:
            connection.request("GET", target, headers=headers)
            response = connection.getresponse()
        except BaseException:
            connection.close()
            raise
        self.requests += 1
        return connection, response

    def _failed(self, connection: http.client.HTTPConnection,
                response: http.client.HTTPResponse, operation: str) -> Exception:
        """What an error answer raises: HandBack where botocore does something of its own,
        else the ClientError botocore would raise. Its connection is not used again (none
        of the answer may be left on it)."""
        try:
            body = response.read(_ERROR_BODY_LIMIT)
        finally:
            response.close()
            connection.close()
        if response.status in _HAND_BACK:
            self.usable = False
            return HandBack()
        return _client_error(response.status, body, operation)

    def signed_headers(self, path: str, credentials: tuple[str, str, str | None],
                       when: datetime.datetime, extra: dict[str, str] | None = None,
                       query: str = "") -> dict[str, str]:
        """The headers of a SigV4-signed GET of `path` with the canonical `query` (its
        parameters sorted and URI-encoded, as sent) at `when` (UTC), with the `extra`
        headers (lower-case names) signed too."""
        access, secret, token = credentials
        stamp = when.strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        headers = {"host": self._netloc, "x-amz-content-sha256": EMPTY_SHA256,
                   "x-amz-date": stamp, **(extra or {})}
        if token:
            headers["x-amz-security-token"] = token
        names = sorted(headers)
        signed = ";".join(names)
        canonical = "\n".join(["GET", path, query, *(f"{n}:{headers[n]}" for n in names), "",
                               signed, EMPTY_SHA256])
        scope = f"{day}/{self._region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        signature = hmac.new(self._key(secret, day), to_sign.encode(), hashlib.sha256)
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, "
                                    f"SignedHeaders={signed}, Signature={signature.hexdigest()}")
        return headers

    def _key(self, secret: str, day: str) -> bytes:
        """The day's signing key (derived once a day per secret)."""
        kept_secret, kept_day, key = self._signing_key
        if kept_secret != secret or kept_day != day:
            key = ("AWS4" + secret).encode()
            for part in (day, self._region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._signing_key = (secret, day, key)
        return key

    # -- connections ---------------------------------------------------------------------

    def _take(self) -> http.client.HTTPConnection:
        """An idle connection the server has not closed (as urllib3 checks before reusing
        one), else a new one."""
        if self._pid != os.getpid():  # a forked child: the parent's sockets stay its own,
            # and its lock may have been held by a thread the fork left behind
            self._lock, self._idle, self._pid = threading.Lock(), [], os.getpid()
        with self._lock:
            while self._idle:
                connection = self._idle.pop()
                if not _dropped(connection):
                    return connection
                connection.close()
        connection = http.client.HTTPConnection(self._netloc, timeout=self._timeouts[0])
        try:
            connection.connect()
            connection.sock.settimeout(self._timeouts[1])
        except BaseException:
            connection.close()
            raise
        return connection

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        """A connection whose last answer was read to its end, for the next request."""
        with self._lock:
            if (not self._closed and self._pid == os.getpid() and connection.sock is not None
                    and len(self._idle) < MAX_IDLE):
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        """Close the idle connections, and each busy one when its request ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class _Body:
    """A response body as s3.py reads botocore's: `read()` then `close()`. A body read to
    its end gives the connection back for the next request; one closed early closes it.
    With `check` (algorithm name, hash object, expected digest), the body read to its end
    must match it (FlexibleChecksumError, botocore's, otherwise)."""

    def __init__(self, response: http.client.HTTPResponse, getter: DirectGetter,
                 connection: http.client.HTTPConnection,
                 check: tuple[str, Any, bytes] | None = None) -> None:
        self._response = response
        self._getter = getter
        self._connection: http.client.HTTPConnection | None = connection
        self._check = check

    def read(self, amount: int | None = None) -> bytes:
        try:
            data = self._response.read(amount)
        except BaseException:
            self._end(reusable=False)
            raise
        if self._check is not None:
            self._check[1].update(data)
        if self._response.isclosed():  # read to its end
            self._end(reusable=True)
            if self._check is not None:
                name, hashed, expected = self._check
                self._check = None
                if hashed.digest() != expected:
                    raise FlexibleChecksumError(
                        error_msg=f"Expected checksum {base64.b64encode(expected).decode()} "
                                  f"did not match calculated checksum "
                                  f"{base64.b64encode(hashed.digest()).decode()} ({name})")
        return data

    def close(self) -> None:
        self._end(reusable=self._response.isclosed())
        self._response.close()

    def _end(self, reusable: bool) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if reusable:
            self._getter._give_back(connection)
        else:
            connection.close()


def _checksum_of(response: http.client.HTTPResponse) -> tuple[str, Any, bytes] | None:
    """What a whole object's body must match, as botocore picks it: the first of _CHECKED
    the answer carries (a composite one, `...-N`, is no checksum of the body: skipped, as
    botocore does); None when it carries none; HandBack when it carries one of another
    kind."""
    names = {name.lower()[len(_CHECKSUM):] for name, _ in response.getheaders()
             if name.lower().startswith(_CHECKSUM)} - {"type"}
    if names - _CHECKED.keys():
        raise HandBack
    for name, make in _CHECKED.items():
        value = response.getheader(_CHECKSUM + name)
        if value is not None and "-" not in value:
            try:
                expected = base64.b64decode(value, validate=True)
            except ValueError:
                raise HandBack from None
            return name, make(), expected
    return None


class _Crc32:
    """zlib's CRC32 as a hash object (botocore's Crc32Checksum: big-endian digest)."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes) -> None:
        self._value = zlib.crc32(data, self._value)

    def digest(self) -> bytes:
        return (self._value & 0xFFFFFFFF).to_bytes(4, "big")


def _credentials(client: Any) -> tuple[str, str, str | None] | None:
    """The credentials `client` signs with now (refreshed by botocore when they expire)."""
    held = getattr(getattr(client, "_request_signer", None), "_credentials", None)
    if held is None:
        return None
    frozen = held.get_frozen_credentials()
    if not frozen.access_key or not frozen.secret_key:
        return None
    return frozen.access_key, frozen.secret_key, frozen.token


def _proxied(endpoint: str) -> bool:
    """Whether the environment sends requests to `endpoint` through a proxy."""
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    return "http" in urllib.request.getproxies() and not urllib.request.proxy_bypass(host)


def _dropped(connection: http.client.HTTPConnection) -> bool:
    """Whether a kept connection was closed by the server (readable while idle: EOF)."""
    if connection.sock is None or connection.sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(connection.sock, select.POLLIN)
    return bool(poller.poll(0))


def _quoted(text: str) -> str:
    """`text` URI-encoded as SigV4 wants a query's names and values (only A-Z, a-z, 0-9,
    "-", "_", ".", "~" kept)."""
    return urllib.parse.quote(text, safe="-_.~")


def _list_page(body: bytes) -> dict[str, Any]:
    """The ListObjectsV2 answer `body` as botocore gives it (keys decoded when the answer
    says they were URL-encoded); HandBack when it is not one."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError:
        raise HandBack from None
    ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    if root.tag != ns + "ListBucketResult":
        raise HandBack
    url_encoded = root.findtext(ns + "EncodingType") == "url"
    contents = []
    for item in root.iterfind(ns + "Contents"):
        key = item.findtext(ns + "Key")
        if key is not None:
            contents.append({"Key": urllib.parse.unquote_plus(key) if url_encoded else key})
    truncated = (root.findtext(ns + "IsTruncated") or "").strip().lower() == "true"
    return {"Contents": contents, "IsTruncated": truncated,
            "NextContinuationToken": root.findtext(ns + "NextContinuationToken")}


def _client_error(status: int, body: bytes, operation: str) -> ClientError:
    """The ClientError botocore would raise for an S3 error answer."""
    error: dict[str, str] = {"Code": str(status), "Message": http.client.responses.get(status, "")}
    try:
        root = ElementTree.fromstring(body) if body else None
    except ElementTree.ParseError:
        root = None
    if root is not None and root.tag == "Error":
        for field in ("Code", "Message", "BucketName"):
            text = root.findtext(field)
            if text:
                error[field] = text
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}},
                       operation)


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
