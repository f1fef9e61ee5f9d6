"""S3Store beyond the conformance suite, against the session's real SeaweedFS: URLs, the
standard AWS configuration, clear errors from `check`, conditional create, multipart uploads,
credential rotation without reopening, and the `weenv dev seaweedfs` command."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy

from weenvfs.errors import ObjectMissing, StoreError, StoreUnavailable
from weenvfs.store import REMOTE_RETRY_POLICY, RetryingStore, open_store
from weenvfs.store.s3 import S3Store, parse_s3_url
from weenvfs.store.seaweed import FILE_CHUNK_MB, SeaweedFS, find_weed

REPO = Path(__file__).resolve().parents[2]

# -- URLs ------------------------------------------------------------------------------------


def test_parse_url_with_every_parameter() -> None:
    loc = parse_s3_url(
        "s3://my-bucket/envs/prod?endpoint=http://127.0.0.1:8333&region=eu-west-1"
        "&addressing=virtual&profile=ci&timeout=2.5"
    )
    assert loc.bucket == "my-bucket" and loc.prefix == "envs/prod/"
    assert loc.endpoint == "http://127.0.0.1:8333" and loc.region == "eu-west-1"
    assert loc.addressing == "virtual" and loc.profile == "ci" and loc.timeout == 2.5
    bare = parse_s3_url("s3://bkt")
    assert bare.prefix == "" and bare.endpoint is None and bare.addressing is None


@pytest.mark.parametrize(
    "url, problem",
    [
        ("s3://ab/x", "bucket name"),
        ("s3://Upper/x", "bucket name"),
        ("s3://key:secret@bucket/x", "no credentials"),
        ("s3://bucket/x?colour=red", "unknown parameter"),
        ("s3://bucket/x?addressing=sideways", "addressing"),
        ("s3://bucket/a b", "invalid store prefix"),
        ("s3://bucket/x?timeout=soon", "timeout"),
    ],
)
def test_bad_urls_are_one_clear_line(url: str, problem: str) -> None:
    with pytest.raises(StoreError, match=problem) as info:
        parse_s3_url(url)
    assert "\n" not in str(info.value)


def test_open_store_wraps_s3_and_http_in_retries(seaweed: Any, monkeypatch: Any) -> None:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    for url in (seaweed.url("open"), "http://127.0.0.1:9/x"):
        store = open_store(url)
        try:
            assert isinstance(store, RetryingStore) and store.policy == REMOTE_RETRY_POLICY
            assert store.url == url
        finally:
            store.close()


# -- standard AWS configuration --------------------------------------------------------------


def test_credentials_from_environment(seaweed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    with open_store(seaweed.url("from-env")) as store:
        store.check(write=True)
        store.put("tags/env/a/latest", b"x")
        assert store.get("tags/env/a/latest") == b"x"


def test_a_client_made_ahead_is_taken_over_only_with_the_same_environment(
    seaweed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the node service does before forking (fuse/mountd.py): a store opened later in
    the same environment takes the client over; any other environment, URL or option makes
    its own, and without static keys nothing is made ahead (it might reach the network)."""
    from weenvfs.store import prebuild_client, s3_clients

    monkeypatch.setattr(s3_clients, "prebuilt", {})
    url = seaweed.url("prebuilt")
    keys = seaweed.env()
    assert not prebuild_client(url, dict(os.environ))  # no static keys in it
    environ = {**os.environ, **keys}
    assert prebuild_client(url, environ) and not prebuild_client(url, environ)
    assert not prebuild_client("file:///tmp/x", environ)
    assert "AWS_ACCESS_KEY_ID" not in os.environ  # the environment was put back
    for name, value in keys.items():
        monkeypatch.setenv(name, value)
    ((made, _, _),) = s3_clients.prebuilt.values()
    store = S3Store(url)
    assert store._client is made
    store.check(write=True)
    store.put("tags/env/a/latest", b"x")
    assert store.get("tags/env/a/latest") == b"x"
    assert S3Store(url, read_timeout=7.0)._client is not made
    assert S3Store(seaweed.url("other"))._client is not made
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another secret")
    assert S3Store(url)._client is not made


def test_a_client_made_ahead_is_rehearsed_offline_and_then_answers_from_the_server(
    seaweed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prebuild` sends the requests a mount makes first through botocore with canned
    answers (s3_clients.rehearse), so the processes forked later inherit what botocore builds at a
    client's first requests. Nothing of the rehearsal reaches the network (an endpoint where
    nothing listens is rehearsed just the same), and afterwards every request is answered
    by the server: a missing key, a listing, a range, an object's size."""
    from weenvfs.store import prebuild_client, s3_clients

    monkeypatch.setattr(s3_clients, "prebuilt", {})
    keys = seaweed.env()
    environ = {**os.environ, **keys}
    assert prebuild_client("s3://nowhere/x?endpoint=http://127.0.0.1:9", environ)
    url = seaweed.url("rehearsed")
    assert prebuild_client(url, environ)
    for name, value in keys.items():
        monkeypatch.setenv(name, value)
    store = S3Store(url)
    key = (url, s3_clients.environment_key(os.environ))
    assert store._client is s3_clients.prebuilt[key][0]
    store.check(write=True)
    data = os.urandom(3000)
    store.put("blobs/ab", data)
    assert store.get_range("blobs/ab", 1000, 5) == data[1000:1005]
    assert store.get("blobs/ab") == data and store.size("blobs/ab") == 3000
    assert list(store.list("blobs/")) == ["blobs/ab"]
    with pytest.raises(ObjectMissing):
        store.get("tags/env/none/latest")
    with pytest.raises(ObjectMissing):
        store.size("blobs/none")


def test_a_process_takes_its_own_client_again_for_a_while_and_never_in_a_fork(
    seaweed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A harness opening many environments makes one session and client per store URL and
    environment, not one per store; a forked process makes its own (the client has its
    parent's connections); after REUSE_SECONDS the configuration is read anew."""
    from weenvfs.store import s3_clients

    monkeypatch.setattr(s3_clients, "prebuilt", {})
    monkeypatch.setattr(s3_clients, "made_here", {})
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    url = seaweed.url("reused")
    first = S3Store(url)
    first.put("tags/env/a/latest", b"x")
    first.close()  # closing the first store leaves the client usable by the next ones
    second = S3Store(url)
    assert second._client is first._client and second.get("tags/env/a/latest") == b"x"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports whether it took its parent's client
        os.write(write, b"shared" if S3Store(url)._client is second._client else b"own")
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"own"
    os.close(read)
    os.waitpid(pid, 0)
    assert S3Store(url)._client is second._client  # the parent still has it
    monkeypatch.setattr(s3_clients, "REUSE_SECONDS", 0.0)
    third = S3Store(url)
    assert third._client is not second._client
    monkeypatch.setattr(s3_clients, "REUSE_SECONDS", 60.0)
    assert S3Store(url)._client is third._client
    assert S3Store(url, read_timeout=7.0)._client is not third._client  # other settings
    assert S3Store(seaweed.url("other"))._client is not third._client
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another secret")
    assert S3Store(url)._client is not third._client  # another environment


def test_credentials_from_a_profile(
    seaweed: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[ci]\naws_access_key_id = {seaweed.access_key}\n"
        f"aws_secret_access_key = {seaweed.secret_key}\n"
    )
    (tmp_path / "config").write_text("[profile ci]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    with open_store(seaweed.url("from-profile") + "&profile=ci") as store:
        store.check(write=True)
    with pytest.raises(StoreError, match="profile"):
        open_store(seaweed.url("x") + "&profile=nobody")


def test_no_credentials_is_a_clear_permanent_error(seaweed: Any) -> None:
    store = S3Store(seaweed.url("none"))
    try:
        with pytest.raises(StoreUnavailable, match="no usable AWS credentials") as info:
            store.check()
        assert not info.value.temporary
    finally:
        store.close()


# -- check -----------------------------------------------------------------------------------


def _check_error(store: Any, write: bool = False) -> StoreUnavailable:
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.check(write=write)
    finally:
        store.close()
    message = str(info.value)
    assert "\n" not in message and store.url in message
    return info.value


def test_check_reports_an_unknown_access_key(seaweed: Any) -> None:
    store = S3Store(seaweed.url("k"), session_options={
        "aws_access_key_id": "NOSUCHKEY", "aws_secret_access_key": "x"})
    err = _check_error(store)
    assert "InvalidAccessKeyId" in str(err) and not err.temporary


def test_check_reports_a_wrong_secret(seaweed: Any) -> None:
    store = S3Store(seaweed.url("k"), session_options={
        "aws_access_key_id": seaweed.access_key, "aws_secret_access_key": "wrong"})
    err = _check_error(store)
    assert "SignatureDoesNotMatch" in str(err) and not err.temporary


def test_check_reports_access_denied_for_writes(open_s3: Any) -> None:
    reader = open_s3("denied", reader=True)
    reader.check()  # may read
    err = _check_error(reader, write=True)
    assert "access denied" in str(err) and not err.temporary


def test_check_reports_a_missing_bucket(seaweed: Any, open_s3: Any) -> None:
    err = _check_error(open_s3(seaweed.url("x", bucket="no-such-bucket")))
    assert "bucket 'no-such-bucket' does not exist" in str(err) and not err.temporary


def test_check_reports_an_unreachable_endpoint(seaweed: Any) -> None:
    store = S3Store("s3://weenv/x?endpoint=http://127.0.0.1:9", connect_timeout=1,
                    session_options={"aws_access_key_id": "a", "aws_secret_access_key": "b"})
    err = _check_error(store)
    assert "cannot reach the endpoint" in str(err) and err.temporary


def test_an_endpoint_that_never_answers_is_said_so(seaweed: Any) -> None:
    """A server that takes the connection and sends nothing: one line saying so, not
    'TimeoutError: timed out' (what the CLI printed after the timeout)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"s3://weenv/x?endpoint=http://127.0.0.1:{silent.getsockname()[1]}"
        store = S3Store(url, read_timeout=1, session_options={"aws_access_key_id": "a",
                                                              "aws_secret_access_key": "b"})
        with pytest.raises(StoreUnavailable) as raised:
            store.get("tags/envs/x/y")
        store.close()
    assert "no answer from the endpoint in time" in str(raised.value)
    assert raised.value.temporary


# -- writes ----------------------------------------------------------------------------------


def test_content_addressed_objects_are_created_once(open_s3: Any) -> None:
    """Under blobs/ (and the other digest-named kinds) an existing object is kept;
    tags are overwritten."""
    store = open_s3("create-once")
    store.put("blobs/d", b"first")
    store.put("blobs/d", b"second")
    assert store.get("blobs/d") == b"first"
    store.put("tags/env/a/latest", b"first")
    store.put("tags/env/a/latest", b"second")
    assert store.get("tags/env/a/latest") == b"second"


def test_conditional_put_falls_back_once_when_unsupported(
    seaweed: Any, open_s3: Any, assert_logs: Any
) -> None:
    with FaultProxy(seaweed.endpoint) as proxy:
        store = open_s3(f"s3://weenv/fallback?endpoint={proxy.url}")
        proxy.set_script("n")  # the server answers 501 to If-None-Match
        with assert_logs("no conditional PUT support", count=1, level=20):
            store.put("blobs/a", b"a")
            store.put("blobs/b", b"b")
    assert [c for _, _, c in proxy.log] == ["n", "g", "g"]
    assert open_s3("fallback").get("blobs/a") == b"a"


def test_put_file_uses_multipart_above_the_threshold(
    seaweed: Any, open_s3: Any, tmp_path: Path
) -> None:
    data = random.Random(1).randbytes(11 << 20)
    src = tmp_path / "blob"
    src.write_bytes(data)
    with FaultProxy(seaweed.endpoint) as proxy:
        store = open_s3(f"s3://weenv/multipart?endpoint={proxy.url}",
                        multipart_threshold=5 << 20, part_size=5 << 20)
        store.put_file("blobs/big", src)
        store.put_file("blobs/small", _small(tmp_path))
    parts = [p for m, p, _ in proxy.log if m == "PUT" and "partNumber=" in p]
    assert len(parts) == 3
    assert open_s3("multipart").get("blobs/big") == data
    assert open_s3("multipart").get_range("blobs/big", (5 << 20) - 3, 6) == data[
        (5 << 20) - 3 : (5 << 20) + 3
    ]


def test_seaweedfs_stores_objects_in_pieces_of_one_mib(
    seaweed: Any, open_s3: Any, tmp_path: Path
) -> None:
    """The SeaweedFS WeEnv starts stores objects in 1 MiB pieces: its S3 gateway answers a
    range of more than 256 KiB by reading each piece it touches whole (seaweed.py), so a
    blob's ranged reads cost it up to 1 MiB a piece, not 4. The filer's listing of the
    object's pieces says so; a range across pieces still reads right."""
    data = random.Random(2).randbytes((3 << 20) + 5)
    src = tmp_path / "blob"
    src.write_bytes(data)
    store = open_s3("pieces", multipart_threshold=64 << 20)
    store.put_file("blobs/p", src)
    url = f"{seaweed.filer_url}/buckets/{seaweed.bucket}/pieces/blobs/p?metadata=true"
    with urllib.request.urlopen(url, timeout=30) as answer:
        pieces = json.loads(answer.read())["chunks"]
    assert len(pieces) == 4
    assert all(int(piece["size"]) <= FILE_CHUNK_MB << 20 for piece in pieces)
    start = (1 << 20) - 100_000
    assert store.get_range("blobs/p", start, 300_000) == data[start : start + 300_000]


def _small(tmp_path: Path) -> Path:
    path = tmp_path / "small"
    path.write_bytes(b"small")
    return path


def test_missing_object_in_an_existing_bucket(open_s3: Any) -> None:
    store = open_s3("missing")
    assert not store.exists("blobs/none")
    with pytest.raises(ObjectMissing):
        store.size("blobs/none")


# -- credential rotation ---------------------------------------------------------------------


def test_rotated_credentials_are_picked_up_without_reopening(
    seaweed: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, assert_logs: Any
) -> None:
    """Keys in a credentials file are replaced, then the old ones revoked: the open store
    re-reads the file on the first authentication error and carries on."""
    credentials = tmp_path / "credentials"

    def write_keys(key: str, secret: str) -> None:
        credentials.write_text(
            f"[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
        )

    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    write_keys(seaweed.reader_key, seaweed.reader_secret)  # the "old" keys
    with FaultProxy(seaweed.endpoint) as proxy:
        store = open_store(f"s3://weenv/rotation?endpoint={proxy.url}")
        try:
            store.check()
            with pytest.raises(StoreUnavailable, match="access denied"):
                store.put("tags/env/a/latest", b"x")  # the old keys may only read
            write_keys(seaweed.access_key, seaweed.secret_key)  # rotate...
            proxy.revoked.add(seaweed.reader_key)  # ...and revoke the old keys
            with assert_logs("credentials changed", count=1, level=20):
                assert not store.exists("tags/env/a/latest")
                store.put("tags/env/a/latest", b"x")
            assert store.get("tags/env/a/latest") == b"x"
        finally:
            store.close()
    assert proxy.requests(code="x") == 1  # one request failed, and was repeated


def test_unchanged_credentials_keep_the_client(
    seaweed: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Bad keys: each failure re-reads the configuration, finds the same keys, and keeps the
    client (so nothing but a cheap re-read is repeated)."""
    credentials = tmp_path / "credentials"
    credentials.write_text("[default]\naws_access_key_id = NOPE\naws_secret_access_key = x\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    store = S3Store(seaweed.url("unchanged"))
    client = store._client
    try:
        for _ in range(3):
            with pytest.raises(StoreUnavailable, match="InvalidAccessKeyId"):
                store.get("blobs/a")
        assert store._client is client
    finally:
        store.close()


# -- the seaweed helper and its command --------------------------------------------------------


def test_weed_is_found() -> None:
    assert os.access(find_weed(), os.X_OK)


def test_kept_folder_keeps_its_credentials(tmp_path: Path) -> None:
    """No server needed: the identities written to a kept folder are reused by the next run,
    so exported keys stay valid; a temp folder is removed by stop()."""
    first = SeaweedFS(tmp_path / "s3")
    (tmp_path / "s3").mkdir()
    (tmp_path / "s3" / "s3.json").write_text(json.dumps(first._identities()))
    again = SeaweedFS(tmp_path / "s3")
    assert (again.access_key, again.secret_key) == (first.access_key, first.secret_key)
    assert not again.is_temp
    temp = SeaweedFS()
    assert temp.is_temp and temp.directory.is_dir()
    temp.stop()
    assert not temp.directory.exists()


@pytest.mark.slow
def test_dev_seaweedfs_command_serves_until_interrupted() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-m", "weenvfs", "dev", "seaweedfs"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        text = _read_until(child, "STORE=")
        exports = dict(re.findall(r"export (\w+)=(\S+)", text))
        url = re.search(r"STORE='([^']+)'", text)
        folder = re.search(r"data in (\S+),", text)
        assert url and folder and {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(exports)
        store = S3Store(url.group(1), session_options={
            "aws_access_key_id": exports["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": exports["AWS_SECRET_ACCESS_KEY"]})
        store.put("tags/env/a/b", b"hello")
        assert store.get("tags/env/a/b") == b"hello"
        store.close()
    finally:
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert not Path(folder.group(1)).exists()  # a temp folder is deleted at exit


def _read_until(child: subprocess.Popen[str], marker: str, timeout: float = 60) -> str:
    assert child.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        lines.append(line)
        if not line or line.strip().startswith(marker):
            break
    return "".join(lines)
