"""The pure parts of the S3 backend: `s3://` URLs, and botocore's exceptions translated into
the store errors, in one table.

Owns: parsing and checking store URLs; which S3 error codes, HTTP statuses and transport
failures are a missing object, a temporary failure (retried by RetryingStore), or a permanent
one, and the one-line message for each. Must not: do I/O, retry, or build clients.

| what                                                    | becomes                            |
| ------------------------------------------------------- | ---------------------------------- |
| NoSuchKey, bare 404                                     | ObjectMissing                      |
| NoSuchBucket                                            | StoreUnavailable(temporary=False)  |
| 5xx, 429, SlowDown and other throttling, RequestTimeout | StoreUnavailable(temporary=True)   |
| BadDigest, IncompleteBody (corrupted in transit)        | StoreUnavailable(temporary=True)   |
| timeouts, resets, refused connections, cut bodies       | StoreUnavailable(temporary=True)   |
| bad or expired credentials, AccessDenied, 401/403       | StoreUnavailable(temporary=False)  |
| no credentials at all, TLS errors                       | StoreUnavailable(temporary=False)  |
| anything else (400s, bad parameters)                    | StoreError                         |
"""

from __future__ import annotations

import http.client
import re
import urllib.parse
from typing import NamedTuple

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.exceptions import HTTPError as URLLib3Error

from weenvfs.errors import ObjectMissing, StoreError, StoreUnavailable
from weenvfs.store.base import validate_prefix

# Where a client signs when neither the URL nor the AWS configuration names a region.
DEFAULT_REGION = "us-east-1"
_QUERY_KEYS = frozenset({"endpoint", "region", "addressing", "profile", "timeout"})
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")

# What `S3Store._call` catches: botocore's errors, and urllib3/http.client/socket errors that
# can escape while a response body is being read.
BOTO_ERRORS = (ClientError, BotoCoreError, URLLib3Error, http.client.HTTPException, OSError)

AUTH_CODES = {
    "InvalidAccessKeyId": "bad credentials: the server does not know the access key",
    "SignatureDoesNotMatch": "bad credentials: the secret key does not match the access key",
    "ExpiredToken": "the credentials have expired",
    "ExpiredTokenException": "the credentials have expired",
    "TokenRefreshRequired": "the credentials have expired",
    "RequestExpired": "the credentials have expired",
    "InvalidToken": "bad credentials: the session token is invalid",
    "InvalidClientTokenId": "bad credentials: the session token is invalid",
}
DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem"})
TEMPORARY_CODES = frozenset(
    {
        "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled",
        "RequestLimitExceeded", "TooManyRequests", "ProvisionedThroughputExceededException",
        "RequestTimeout", "InternalError", "ServiceUnavailable", "OperationAborted",
        "BadDigest", "IncompleteBody", "XAmzContentSHA256Mismatch",
        "ConditionalRequestConflict",
    }
)


def error_code(err: BaseException) -> str:
    """The S3 error code of a ClientError ('' otherwise); HEAD answers carry only a status."""
    if isinstance(err, ClientError):
        return str(err.response.get("Error", {}).get("Code", ""))
    return ""


def http_status(err: BaseException) -> int | None:
    """The HTTP status of a ClientError, else None."""
    if isinstance(err, ClientError):
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status else None
    return None


def is_auth_error(err: BaseException) -> bool:
    """Whether other credentials might make `err` go away (worth re-reading them): a known
    credentials error, no credentials, or any 401/403 (a HEAD answer has no error code, so
    a revoked key looks like any other refusal)."""
    if isinstance(err, NoCredentialsError) or error_code(err) in AUTH_CODES:
        return True
    return http_status(err) in (401, 403)


def translate(err: BaseException, url: str, what: str, key: str) -> StoreError:
    """The store error for `err`, raised by operation `what` on `key` of the store `url`."""
    where = f"store {url}: {what} {key!r}" if key else f"store {url}: {what}"
    if isinstance(err, ClientError):
        return _client_error(err, url, where, key)
    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return StoreUnavailable(
            f"{where}: no usable AWS credentials (set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a credentials file)",
            temporary=False,
        )
    if isinstance(err, SSLError):
        return StoreUnavailable(f"{where}: TLS error: {err}", temporary=False)
    if isinstance(err, EndpointConnectionError):
        return StoreUnavailable(f"{where}: cannot reach the endpoint: {err}", temporary=True)
    if isinstance(err, (TimeoutError, ReadTimeoutError, ConnectTimeoutError)):
        return StoreUnavailable(f"{where}: no answer from the endpoint in time", temporary=True)
    if isinstance(err, (ConnectionError, HTTPClientError, IncompleteReadError,
                        FlexibleChecksumError, URLLib3Error, http.client.HTTPException,
                        OSError)):
        return StoreUnavailable(f"{where}: {type(err).__name__}: {err}", temporary=True)
    return StoreError(f"{where}: {err}")


def _client_error(err: ClientError, url: str, where: str, key: str) -> StoreError:
    code, status = error_code(err), http_status(err) or 0
    message = err.response.get("Error", {}).get("Message") or code
    if code == "NoSuchBucket":
        bucket = err.response.get("Error", {}).get("BucketName") or "the bucket"
        return StoreUnavailable(f"store {url}: bucket {bucket!r} does not exist", temporary=False)
    if code == "NoSuchKey" or (status == 404 and code in ("", "404", "NotFound")):
        return ObjectMissing(key, url)
    if code in AUTH_CODES:
        return StoreUnavailable(f"{where}: {AUTH_CODES[code]} ({code})", temporary=False)
    if code in DENIED_CODES or status in (401, 403):
        return StoreUnavailable(
            f"{where}: access denied ({code or status}): the credentials lack permission",
            temporary=False,
        )
    if code in TEMPORARY_CODES or status >= 500 or status == 429:
        return StoreUnavailable(f"{where}: {code or status}: {message}", temporary=True)
    return StoreError(f"{where}: {code or status}: {message}")


class S3Location(NamedTuple):
    """The parts of an `s3://` URL."""

    bucket: str
    prefix: str  # "" or ending in "/"
    endpoint: str | None
    region: str | None
    addressing: str | None
    profile: str | None
    timeout: float | None


def parse_s3_url(url: str) -> S3Location:
    """Split and check an `s3://BUCKET/PREFIX?...` URL; StoreError naming the problem."""
    parts = urllib.parse.urlsplit(url)

    def bad(why: str) -> StoreError:
        return StoreError(f"bad store URL {url!r}: {why}")

    if parts.scheme != "s3" or "@" in parts.netloc or parts.fragment:
        raise bad("expected s3://BUCKET/PREFIX?endpoint=...&region=... (no credentials)")
    if not _BUCKET.fullmatch(parts.netloc):
        raise bad("the bucket name must be 3-63 lowercase letters, digits, '.' or '-'")
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(query) - _QUERY_KEYS
    if unknown:
        raise bad(f"unknown parameter(s) {sorted(unknown)}; known: {sorted(_QUERY_KEYS)}")
    if query.get("addressing", "path") not in ("path", "virtual"):
        raise bad("addressing must be 'path' or 'virtual'")
    prefix = parts.path.strip("/")
    if prefix:
        validate_prefix(prefix + "/")
    try:
        timeout = float(query["timeout"]) if "timeout" in query else None
    except ValueError:
        raise bad("timeout must be a number of seconds") from None
    return S3Location(
        parts.netloc, prefix + "/" if prefix else "", query.get("endpoint") or None,
        query.get("region") or None, query.get("addressing"), query.get("profile") or None,
        timeout,
    )
