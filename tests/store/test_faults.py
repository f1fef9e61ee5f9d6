"""Wire faults between WeEnv and a real SeaweedFS, injected by tests/store/fault_proxy.py.

Under each fault (500, 503, SlowDown, 501, stall, cut body, reset, flipped byte), through
S3Store + RetryingStore: reads return the right bytes or raise after exactly the retries the
policy allows; writes land intact; a flipped byte never reaches a caller that verifies; and a
`weenv build` through the proxy either completes (a tag that resolves to a fully verified
group) or leaves no tag.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy

from weenvfs.cli import main
from weenvfs.errors import ObjectCorrupt, RefNotFound, StoreError, StoreUnavailable
from weenvfs.format.digest import digest_hex, verify_digest
from weenvfs.store import RetryingStore, RetryPolicy, read_verified
from weenvfs.store.repository import Repository

POLICY = RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05, max_elapsed=120.0)
READ_TIMEOUT = 1.0  # the proxy stalls 3 s: every stall is a client timeout
TRANSIENT = "53sntcrf"  # every code that fails one request
DATA = random.Random(5).randbytes(300_000)


class Remote:
    """One test's prefix, reached directly (to seed and check) and through the proxy."""

    def __init__(self, open_s3: Any, proxy: FaultProxy, prefix: str) -> None:
        self.sleeps: list[float] = []
        self.direct = open_s3(prefix)
        inner = open_s3(proxied(proxy, prefix), read_timeout=READ_TIMEOUT)
        self.store = RetryingStore(inner, POLICY, sleep=self.sleeps.append)


def proxied(proxy: FaultProxy, prefix: str, query: str = "") -> str:
    """The URL of `prefix` in the test bucket, through the proxy."""
    return f"s3://weenv/{prefix}?endpoint={proxy.url}{query}"


@pytest.fixture
def proxy(seaweed: Any) -> Iterator[FaultProxy]:
    with FaultProxy(seaweed.endpoint, stall=3 * READ_TIMEOUT) as p:
        yield p


@pytest.fixture
def remote(open_s3: Any, proxy: FaultProxy, request: pytest.FixtureRequest) -> Remote:
    return Remote(open_s3, proxy, "faults-" + digest_hex(request.node.nodeid.encode())[:16])


# -- reads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", TRANSIENT)
def test_get_survives_two_faults(remote: Remote, proxy: FaultProxy, code: str) -> None:
    remote.direct.put("blobs/a", DATA)
    proxy.set_script(code * 2)
    assert remote.store.get("blobs/a") == DATA
    assert proxy.requests("GET") == 3
    assert remote.store.retries == 2 and remote.store.give_ups == 0
    assert len(remote.sleeps) == 2


@pytest.mark.parametrize("code", TRANSIENT.replace("f", ""))
def test_get_range_survives_two_faults(remote: Remote, proxy: FaultProxy, code: str) -> None:
    remote.direct.put("blobs/a", DATA)
    proxy.set_script(code * 2)
    assert remote.store.get_range("blobs/a", 1000, 70_000) == DATA[1000:71_000]
    assert proxy.requests("GET") == 3 and remote.store.retries == 2


@pytest.mark.parametrize("code", TRANSIENT)
def test_persistent_fault_gives_up_after_the_policy(
    remote: Remote, proxy: FaultProxy, code: str
) -> None:
    remote.direct.put("blobs/a", DATA)
    proxy.set_script(code + "*")
    with pytest.raises(StoreUnavailable) as info:
        remote.store.get("blobs/a")
    assert info.value.temporary and "\n" not in str(info.value)
    assert proxy.requests("GET") == POLICY.max_attempts
    assert remote.store.retries == POLICY.max_attempts - 1 and remote.store.give_ups == 1
    proxy.set_script("")
    assert remote.store.get("blobs/a") == DATA  # and all is well once the store recovers


def test_exists_and_size_survive_faults(remote: Remote, proxy: FaultProxy) -> None:
    remote.direct.put("indexes/i", b"12345")
    proxy.set_script("5trg3")
    assert remote.store.exists("indexes/i")
    assert remote.store.size("indexes/i") == 5
    assert not remote.store.exists("indexes/none")
    assert remote.store.retries == 4


def test_list_survives_faults(remote: Remote, proxy: FaultProxy) -> None:
    keys = [f"tags/env/x/v{i:02d}" for i in range(12)]
    for key in keys:
        remote.direct.put(key, b"d")
    proxy.set_script("sc")
    assert list(remote.store.list("tags/")) == keys
    assert remote.store.retries == 2


def test_full_get_catches_a_flipped_byte_on_the_wire(remote: Remote, proxy: FaultProxy) -> None:
    """boto3 checks the CRC32 SeaweedFS stored at upload: a flip is a temporary error."""
    remote.direct.put("blobs/a", DATA)
    proxy.set_script("f")
    assert remote.store.get("blobs/a") == DATA
    assert remote.store.retries == 1


def test_flipped_range_is_read_again_by_read_verified(remote: Remote, proxy: FaultProxy) -> None:
    """Ranges carry no checksum: the caller's digest check catches the flip, and
    read_verified reads again (temporary for the first tries), then gives up."""
    remote.direct.put("blobs/a", DATA)
    piece = DATA[5000:9000]
    expected = digest_hex(piece)

    def read() -> bytes:
        return remote.store.get_range("blobs/a", 5000, 4000)

    def verify(data: bytes) -> None:
        verify_digest(data, expected, "chunk")

    proxy.set_script("ff")
    assert read_verified(read, verify, "chunk") == piece
    assert proxy.requests("GET", "f") == 2 and proxy.requests("GET") == 3
    proxy.set_script("f*")
    with pytest.raises(ObjectCorrupt, match="in each of 3 reads"):
        read_verified(read, verify, "chunk")


def test_repository_never_returns_wrong_bytes(remote: Remote, proxy: FaultProxy) -> None:
    """Many threads, every kind of fault at random: each read is right or an error."""
    writer = Repository(remote.direct)
    objects = {writer.put_object("blobs", random.Random(n).randbytes(20_000 + n)): None
               for n in range(24)}
    rng = random.Random(11)
    proxy.set_script("".join(rng.choice("gggg" + TRANSIENT) for _ in range(400)))
    repo = Repository(remote.store)

    def read(digest: str) -> str:
        try:
            data = repo.get_object("blobs", digest)
        except StoreError as e:
            return type(e).__name__
        assert digest_hex(data) == digest  # never wrong bytes
        return "ok"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(read, list(objects) * 4))
    assert outcomes.count("ok") > len(outcomes) // 2
    assert set(outcomes) <= {"ok", "StoreUnavailable", "ObjectCorrupt"}


# -- writes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["tags/env/x/latest", "blobs/x"], ids=["tag", "blob"])
@pytest.mark.parametrize("code", TRANSIENT.replace("n", ""))
def test_put_survives_a_fault(remote: Remote, proxy: FaultProxy, code: str, key: str) -> None:
    """A flipped request body is refused by the server (checksum), never stored. A blob put
    whose answer was lost ('c') finds it stored when tried again (412 = already there)."""
    proxy.set_script(code)
    remote.store.put(key, DATA)
    assert remote.direct.get(key) == DATA
    assert proxy.requests("PUT") == 2 and remote.store.retries == 1


def test_multipart_upload_survives_failed_parts(
    seaweed: Any, open_s3: Any, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Two of the first upload's three parts fail (sent in parallel): the upload is aborted
    and the whole file sent again."""
    inner = open_s3(proxied(proxy, "faults-multipart"), multipart_threshold=5 << 20,
                    part_size=5 << 20, read_timeout=5)
    store = RetryingStore(inner, POLICY, sleep=lambda s: None)
    big = random.Random(3).randbytes(12 << 20)
    src = tmp_path / "big"
    src.write_bytes(big)
    proxy.set_script("5f", match=r"^PUT .*partNumber=")
    store.put_file("blobs/big", src)
    assert open_s3("faults-multipart").get("blobs/big") == big
    assert store.retries == 1
    assert proxy.requests("POST") == 3  # create, create, complete
    assert proxy.requests("DELETE") == 1  # the abort of the failed upload
    uploads = seaweed.client().list_multipart_uploads(Bucket=seaweed.bucket, Prefix="faults-m")
    assert uploads.get("Uploads", []) == []


# -- a build through the proxy ----------------------------------------------------------------


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    rng = random.Random(2)
    for n in range(40):
        path = src / f"d{n % 4}" / f"f{n}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.choice([100, 5000, 70_000, 1_500_000])))
    return src


def _build(seaweed: Any, proxy: FaultProxy, prefix: str, src: Path,
           monkeypatch: pytest.MonkeyPatch) -> int:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    url = proxied(proxy, prefix, "&timeout=1")
    return main(["build", str(src), "--store", url, "--group", "app:v1", "--quiet"])


def _tag_state(open_s3: Any, prefix: str) -> str:
    """'none' without a tag, 'complete' if it resolves to a group whose objects all verify."""
    repo = Repository(open_s3(prefix))
    try:
        _, index = repo.resolve_group("app:v1")
    except RefNotFound:
        return "none"
    for blob in index.blob_digests():
        repo.get_object("blobs", blob)  # raises ObjectCorrupt or ObjectMissing if not
    return "complete"


@pytest.fixture
def clean_build_requests(seaweed: Any, open_s3: Any, proxy: FaultProxy, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> int:
    """Requests a fault-free build of the test source makes, a retry not counted: a PUT
    that timed out (timeout=1 on a loaded machine) is sent again, and counting it would let
    the broken builds' good requests cover their whole build (a flaky pass-as-success)."""
    # A prefix of its own: in one already holding the blobs the build would skip uploads.
    prefix = f"build-clean-{uuid.uuid4().hex[:8]}"
    assert _build(seaweed, proxy, prefix, _source(tmp_path), monkeypatch) == 0
    assert _tag_state(open_s3, prefix) == "complete"
    requests = [(method, path) for method, path, _ in proxy.log]
    return sum(1 for k, r in enumerate(requests) if k == 0 or r != requests[k - 1])


@pytest.mark.slow
def test_build_with_transient_faults_completes(
    seaweed: Any, open_s3: Any, proxy: FaultProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    rng = random.Random(7)
    proxy.set_script("".join(rng.choice("g" * 30 + TRANSIENT) for _ in range(300)))
    assert _build(seaweed, proxy, "build-transient", _source(tmp_path), monkeypatch) == 0
    assert _tag_state(open_s3, "build-transient") == "complete"
    assert proxy.requests(code="g") < len(proxy.log)  # faults did happen


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 0.9, 0.99])
def test_build_that_fails_leaves_no_tag(
    seaweed: Any, open_s3: Any, proxy: FaultProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    clean_build_requests: int, fraction: float,
) -> None:
    """The store breaks for good after a fraction of the build's requests."""
    prefix = f"build-broken-{int(fraction * 100)}"
    proxy.set_script("g" * int(clean_build_requests * fraction) + "5*")
    code = _build(seaweed, proxy, prefix, _source(tmp_path), monkeypatch)
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("weenv: error:") and err.count("\n") == 1
    assert _tag_state(open_s3, prefix) == "none"

