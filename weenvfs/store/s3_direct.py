"""Ranged GETs of an S3 store without botocore's request pipeline: signed here (SigV4), sent
on kept-alive connections the store's threads share.

Why: a cold start with no hint makes ~90 ranged GETs, four at a time, in the mount daemon
whose one Python core also answers the kernel's reads. botocore spends ~2 ms of CPU per
request (events, serializers, endpoint rules, parsers) holding the GIL; measured on the
README's first run from SeaweedFS, 10 alternating pairs: 1.59 s against 1.67 s (mean), faster
in 9 pairs of 10 (docs/benchmarks.md, "GETs without botocore").

Owns: deciding whether a store's client can be bypassed for ranged GETs (`DirectGetter.for_`:
an explicit plain-http endpoint with path-style addressing, SigV4, credentials, no proxy:
SeaweedFS, MinIO and the like on a node's network; AWS itself, https, virtual-hosted
addressing and proxies keep botocore, whose endpoint rules, TLS settings and redirects are
not redone here), building the request (URL, SigV4 headers with the client's credentials of
the moment), and answering like botocore's `get_object`: a dict with ContentLength,
ContentRange and Body, or a botocore ClientError built from the S3 error answer, so s3.py
translates and renews credentials exactly as for a request botocore sent.
Must not: retry (RetryingStore does), interpret ranges (s3.py checks them), use a
connection for two requests at once, or use one a forked parent opened.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import os
import select
import threading
import urllib.parse
import urllib.request
from typing import Any
from xml.etree import ElementTree

from botocore.exceptions import ClientError

# The SHA-256 of a GET's empty body, signed as botocore signs it over http.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_SAFE = "-_.~/"  # S3 keys are URI-encoded once, "/" kept (also the canonical URI)
_ERROR_BODY_LIMIT = 64 << 10
# Idle connections kept for the next requests (botocore's pool keeps up to 32 in all).
MAX_IDLE = 16
# Answers after which botocore does something of its own (region redirects, a malformed
# authorization for the region): the store goes back to botocore for good.
_HAND_BACK = frozenset({301, 302, 307, 400})


class HandBack(Exception):
    """This request (and every later one) is botocore's to send."""


class DirectGetter:
    """Sends `get_object(Bucket, Key, Range)` for a store whose client allows it. Whole
    objects stay botocore's: it checks the checksum a server stored with them (CRC32 and
    the like, as SeaweedFS does), which a range does not carry."""

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

    def get_object(self, client: Any, *, Bucket: str, Key: str, Range: str) -> dict[str, Any]:
        """What botocore's `client.get_object(Bucket=, Key=, Range=)` returns, for the parts
        s3.py reads; raises ClientError for an error answer, OSError or HTTPException for a
        transport failure, HandBack when botocore must send it. `Bucket` is the store's,
        which the getter was made for."""
        credentials = _credentials(client)
        if credentials is None or not self.usable:
            raise HandBack
        path = self._base + urllib.parse.quote(Key, safe=_SAFE)
        headers = self.signed_headers(path, credentials, _now())
        headers["range"] = Range
        connection = self._take()
        try:
            connection.request("GET", path, headers=headers)
            response = connection.getresponse()
        except BaseException:
            connection.close()
            raise
        self.requests += 1
        if response.status in (200, 206):
            return {"ContentLength": _int(response.getheader("content-length")),
                    "ContentRange": response.getheader("content-range"),
                    "Body": _Body(response, self, connection)}
        try:  # an error answer's body, then a new connection (none of it may be left)
            body = response.read(_ERROR_BODY_LIMIT)
        finally:
            response.close()
            connection.close()
        if response.status in _HAND_BACK:
            self.usable = False
            raise HandBack
        raise _client_error(response.status, body)

    def signed_headers(self, path: str, credentials: tuple[str, str, str | None],
                       when: datetime.datetime) -> dict[str, str]:
        """The headers of a SigV4-signed GET of `path` (its query empty) at `when` (UTC)."""
        access, secret, token = credentials
        stamp = when.strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        headers = {"host": self._netloc, "x-amz-content-sha256": EMPTY_SHA256,
                   "x-amz-date": stamp}
        if token:
            headers["x-amz-security-token"] = token
        names = sorted(headers)
        signed = ";".join(names)
        canonical = "\n".join(["GET", path, "", *(f"{n}:{headers[n]}" for n in names), "",
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
    its end gives the connection back for the next request; one closed early closes it."""

    def __init__(self, response: http.client.HTTPResponse, getter: DirectGetter,
                 connection: http.client.HTTPConnection) -> None:
        self._response = response
        self._getter = getter
        self._connection: http.client.HTTPConnection | None = connection

    def read(self, amount: int | None = None) -> bytes:
        try:
            data = self._response.read(amount)
        except BaseException:
            self._end(reusable=False)
            raise
        if self._response.isclosed():  # read to its end
            self._end(reusable=True)
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


def _client_error(status: int, body: bytes) -> ClientError:
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
                       "GetObject")


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
