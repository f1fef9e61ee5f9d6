"""How a process gets the boto3 client of an S3 store without paying for it each time
(store/s3.py builds clients; this module keeps them):
- botocore's service-model loader, shared by every session of the process
  (`shared_loader`), and `warm_up`, which the node service runs before it forks;
- clients the node service made ahead for the processes it forks (`prebuilt`, filled by
  s3.py `prebuild` through `keep_prebuilt`), each with its first request of every kind a
  mount makes rehearsed offline (`rehearse`): a forked process takes one over;
- clients a process made for itself, taken again by its later stores of the same URL and
  environment for REUSE_SECONDS (`made_here`), forgotten in a forked child.
A client is only ever taken by a store that would have made the same one: same URL, same
environment variables that decide credentials and configuration (`environment_key`), same
settings (timeouts, pool size).

Must not: make a store's client (s3.py does; `warm_up` makes one to throw away), or talk to
a server (a rehearsal's answers are canned).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config

from weenvfs.store.s3_common import DEFAULT_REGION

log = logging.getLogger(__name__)
Credentials = tuple[str, str, str | None] | None  # key, secret, token
ClientKey = tuple[str, tuple[tuple[str, str], ...]]  # (url, `environment_key`)

_LOADER_LOCK = threading.Lock()
_loader: Any = None


def shared_loader() -> Any:
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
    loader = shared_loader()
    loader.load_service_model("s3", "service-2")
    loader.load_service_model("s3", "endpoint-rule-set-1")
    loader.load_data("endpoints")
    loader.load_data("partitions")
    core = botocore.session.Session()
    core.register_component("data_loader", loader)
    session = boto3.session.Session(botocore_session=core, aws_access_key_id="warm-up",
                                    aws_secret_access_key="warm-up", region_name=DEFAULT_REGION)
    session.client("s3", endpoint_url="http://127.0.0.1:9", config=Config(user_agent_extra="weenv"))


# Clients made ahead of time by the node service (s3.py `prebuild`), which the processes it forks
# take over (copy-on-write memory, no connection yet: a client connects at its first request)
# instead of spending about 20 ms each on a session and a client. Keyed by the store URL and
# every variable of the environment that can change which credentials and configuration a
# session finds, so a process only ever gets the client it would have made itself.
MAX_PREBUILT = 8
# (url, environment) -> (client, its credentials, the (timeouts, pool size) it was made with)
prebuilt: dict[ClientKey, tuple[Any, Credentials, Any]] = {}
# Clients a process made for itself, taken by its later stores of the same URL and
# environment for REUSE_SECONDS: a harness opening 32 environments at once made 32 sessions
# and clients (~30 ms of CPU each, on the critical path of every `Environment.open`).
# Clients are thread-safe; after that long a store reads the AWS configuration anew, as
# one did every time before (an authentication error re-reads it at once: s3.py
# `_renew_credentials`).
# They have connections open, so a forked process must never take one (it would talk on
# its parent's sockets): forgotten in the child at every fork.
REUSE_SECONDS = 60.0
made_here: dict[ClientKey, tuple[Any, Credentials, Any, float]] = {}
_made_here_lock = threading.Lock()  # a harness opens stores from many threads at once


def _forget_clients_made_here() -> None:
    global _made_here_lock  # another thread may have held it at the fork: a new one
    made_here.clear()
    _made_here_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_clients_made_here)


def environment_key(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `environ` that decide which credentials and configuration a session
    finds."""
    return tuple(sorted((k, v) for k, v in environ.items()
                        if k.startswith(("AWS_", "BOTO_")) or k == "HOME"))


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


def rehearse(client: Any, bucket: str, prefix: str) -> None:
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


def keep_prebuilt(key: ClientKey, client: Any, credentials: Credentials,
                  settings: Any) -> None:
    """Keep a client made ahead (s3.py `prebuild`) for the processes forked from now on."""
    while len(prebuilt) >= MAX_PREBUILT:
        del prebuilt[next(iter(prebuilt))]
    prebuilt[key] = (client, credentials, settings)


def take(key: ClientKey, settings: Any) -> tuple[Any, Credentials] | None:
    """The client (and its credentials) a store of `key` made with `settings` may take: one
    made ahead by the node service, else one this process made in the last REUSE_SECONDS;
    None when there is none to take."""
    made: tuple[Any, ...] | None = prebuilt.get(key)
    if made is None:
        made = made_here.get(key)
        if made is not None and time.monotonic() - made[3] >= REUSE_SECONDS:
            made = None
    if made is None or made[2] != settings:
        return None
    return made[0], made[1]


def remember(key: ClientKey, client: Any, credentials: Credentials, settings: Any) -> None:
    """Let this process's later stores of `key` take `client` (`made_here`)."""
    with _made_here_lock:
        made_here.pop(key, None)
        while len(made_here) >= MAX_PREBUILT:
            del made_here[next(iter(made_here))]
        made_here[key] = (client, credentials, settings, time.monotonic())


def made_here_client(key: ClientKey) -> Any:
    """The client this process's stores of `key` take now (None: none)."""
    made = made_here.get(key)
    return None if made is None else made[0]
