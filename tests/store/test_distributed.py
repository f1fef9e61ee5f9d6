"""A mount reading from a distributed SeaweedFS while parts of it fail.

The test builds a small network inside this machine: a bridge in the root namespace and one
network namespace per server (`weed master`, two `weed volume`s in the same rack, `weed filer
-s3`), each joined to the bridge by a veth pair, with addresses in a private /24 that exists
only on these veths; every server listens on its own address only. Data is written with
replication 001 (one more copy on another server of the same rack), so either volume server
holds all of it. An environment published through the S3 gateway is mounted, then:
1. one volume server is killed: every read still succeeds (from the other copy);
2. the gateway's veth goes down: reads of data the node has not cached fail with EIO once
   the mount's --deadline has passed (never hang), cached data keeps being served;
3. the veth comes back: the same reads succeed, without a remount.
Everything (processes by pid, veths, bridge, namespaces) is removed in `finally`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from support.polling import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuse"))
from mounts import Mounter  # noqa: E402 - tests/fuse is not on the path by itself

from weenvfs.errors import StoreError  # noqa: E402
from weenvfs.store.repository import Repository  # noqa: E402
from weenvfs.store.s3 import S3Store  # noqa: E402
from weenvfs.store.seaweed import find_weed  # noqa: E402
from weenvfs.tools.builder import BuildOptions, build_group, open_source  # noqa: E402
from weenvfs.tools.chunker import ChunkOptions  # noqa: E402
from weenvfs.tools.publish import compose_env  # noqa: E402

pytestmark = [pytest.mark.requires_fuse, pytest.mark.slow]

KIB = 1 << 10
BUCKET = "weenv"
ROLES = ("master", "vol1", "vol2", "filer")
DEADLINE = 3.0  # --deadline of the mount
WAIT = 90.0  # a condition not true after this long fails the test (a hang guard)
ACCESS_KEY, SECRET_KEY = "distributed", "distributed-secret-key"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def _free_subnet() -> int:
    """N such that 10.213.N.0/24 is on no interface or route of this machine."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True,
                            text=True, check=True).stdout
    addresses = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True,
                               check=True).stdout
    for n in random.Random(os.getpid()).sample(range(100, 250), 150):
        if f"10.213.{n}." not in routes + addresses:
            return n
    pytest.fail("no free 10.213.N.0/24 subnet")


class Cluster:
    """The namespaces, the bridge and the SeaweedFS servers of one test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = f"{os.getpid() % 0xFFFF:04x}"
        self.subnet = _free_subnet()
        self.bridge = f"wb{self.tag}"
        self.ns = {role: f"weenv-{self.tag}-{role}" for role in ROLES}
        self.veth = {role: f"wv{self.tag}{i}" for i, role in enumerate(ROLES)}
        self.ip = {role: f"10.213.{self.subnet}.{10 + i}" for i, role in enumerate(ROLES)}
        # gRPC ports are HTTP + 10000: the gateway inside `weed filer` assumes so. Distinct
        # numbers per server although each has its own namespace: weed names unix sockets in
        # the shared /tmp after its ports.
        base = random.Random(os.getpid()).randrange(20000, 45000, 10)
        self.ports = {role: (base + i, base + i + 10000) for i, role in enumerate(ROLES)}
        self.s3_port, self.s3_grpc = base + 5, base + 10005
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._made: list[tuple[str, str]] = []  # ("ns" | "link", name), to remove in reverse

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip['filer']}:{self.s3_port}"

    def store_url(self, prefix: str, query: str = "") -> str:
        return f"s3://{BUCKET}/{prefix}?endpoint={self.endpoint}{query}"

    # -- network -------------------------------------------------------------------------

    def build_network(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _sh("ip", "addr", "add", f"10.213.{self.subnet}.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for role in ROLES:
            ns, veth = self.ns[role], self.veth[role]
            _sh("ip", "netns", "add", ns)
            self._made.append(("ns", ns))
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("link", veth))
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            inside = ("ip", "netns", "exec", ns, "ip")
            _sh(*inside, "addr", "add", f"{self.ip[role]}/24", "dev", "eth0")
            _sh(*inside, "link", "set", "eth0", "up")
            _sh(*inside, "link", "set", "lo", "up")

    def set_link(self, role: str, up: bool) -> None:
        _sh("ip", "link", "set", self.veth[role], "up" if up else "down")

    # -- servers -------------------------------------------------------------------------

    def start(self, weed: str) -> None:
        master = f"{self.ip['master']}:{self.ports['master'][0]}"
        master_arg = f"{master}.{self.ports['master'][1]}"  # host:port.grpcPort
        common = ["-telemetry=false"]
        self._spawn("master", [weed, "master", *self._addr("master"), *common,
                               f"-mdir={self._dir('master')}", "-defaultReplication=001",
                               "-volumeSizeLimitMB=64"])
        for vol in ("vol1", "vol2"):
            self._spawn(vol, [weed, "volume", *self._addr(vol), f"-dir={self._dir(vol)}",
                              f"-master={master_arg}", "-dataCenter=dc1", "-rack=rack1",
                              "-max=100", "-preStopSeconds=0"])
        self._write_identities()
        self._spawn("filer", [
            weed, "filer", *self._addr("filer"), f"-master={master_arg}",
            f"-defaultStoreDir={self._dir('filer')}", "-defaultReplicaPlacement=001",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={self.s3_grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.root / 's3.json'}",
            "-s3.autoCreateBucket=false",
        ])
        wait_for(lambda: len(self.data_nodes()) == 2, "both volume servers joined", WAIT,
                 not_yet=(Exception,), interval=0.2)
        wait_for(self._bucket_ready, "the S3 gateway takes writes", WAIT, not_yet=(Exception,),
                 interval=0.2)

    def _addr(self, role: str) -> list[str]:
        http, grpc = self.ports[role]
        ip = self.ip[role]
        return [f"-ip={ip}", f"-ip.bind={ip}", f"-port={http}", f"-port.grpc={grpc}"]

    def _dir(self, role: str) -> Path:
        path = self.root / role
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _spawn(self, role: str, argv: list[str]) -> None:
        log = open(self.root / f"{role}.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            self.procs[role] = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[role], *argv], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, cwd=self._dir(role),
                env=dict(os.environ, TMPDIR=str(self._dir(role))), start_new_session=True,
            )
        finally:
            log.close()

    def _write_identities(self) -> None:
        identity = {"name": "admin", "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
        (self.root / "s3.json").write_text(json.dumps({"identities": [identity]}))

    def data_nodes(self) -> list[dict[str, Any]]:
        """The volume servers the master knows, with their volumes."""
        url = f"http://{self.ip['master']}:{self.ports['master'][0]}/vol/status"
        with urllib.request.urlopen(url, timeout=5) as answer:
            topology = json.load(answer)["Volumes"]["DataCenters"]
        return [{"node": node, "volumes": volumes or []}
                for racks in topology.values() for rack in racks.values()
                for node, volumes in rack.items()]

    def _bucket_ready(self) -> bool:
        client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            config=Config(retries={"total_max_attempts": 1}, s3={"addressing_style": "path"}),
        )
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=BUCKET)
            client.put_object(Bucket=BUCKET, Key="probe", Body=b"")  # grows the volumes
            client.delete_object(Bucket=BUCKET, Key="probe")
        finally:
            client.close()
        return True

    def store(self, prefix: str) -> S3Store:
        return S3Store(self.store_url(prefix), session_options={
            "aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY})

    def kill(self, role: str) -> None:
        """SIGKILL the server `role` (a process this test started) and reap it."""
        proc = self.procs[role]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def teardown(self) -> None:
        for role in self.procs:
            self.kill(role)
        for kind, name in reversed(self._made):
            cmd = ["ip", "netns", "del", name] if kind == "ns" else ["ip", "link", "del", name]
            subprocess.run(cmd, capture_output=True, check=False, timeout=30)
        for http, grpc in [*self.ports.values(), (self.s3_port, self.s3_grpc)]:
            for port in (http, grpc):
                for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                    sock.unlink(missing_ok=True)


@pytest.fixture
def cluster(tmp_path: Path, require_or_skip: Any) -> Iterator[Cluster]:
    require_or_skip(os.geteuid() == 0, "network namespaces need root")
    require_or_skip(shutil.which("ip"), "`ip` not found (Debian package iproute2)")
    try:
        weed = find_weed()
    except StoreError as e:
        weed = ""
        require_or_skip(False, str(e))
    c = Cluster(tmp_path / "cluster")
    try:
        c.build_network()
        c.start(weed)
        yield c
    finally:
        c.teardown()


def _contents() -> dict[str, bytes]:
    rng = random.Random(29)
    files = {f"set{s}/f{n}": rng.randbytes(rng.choice([20, 150, 400]) * KIB)
             for s in "ABC" for n in range(6)}
    files |= {f"set{s}/small{n}": rng.randbytes(rng.randint(50, 3000))
              for s in "ABC" for n in range(4)}
    return files


def _publish(cluster: Cluster, src: Path, contents: dict[str, bytes]) -> str:
    for path, data in contents.items():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_bytes(data)
    with cluster.store("dist") as store:
        repo = Repository(store)
        options = BuildOptions(chunk=ChunkOptions(chunk_size=64 * KIB, batch_threshold=4 * KIB))
        build_group(open_source(src), repo, "dist-g0", "t", options)
        compose_env(repo, "dist", "t", ["dist-g0:t"])
    return "dist:t"


def _read(path: Path) -> bytes | OSError:
    """The file's bytes (page cache dropped first, so the daemon serves them) or the error;
    fails the test if the read hangs."""
    outcome: list[bytes | OSError] = []

    def run() -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                outcome.append(f.read())
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE + WAIT)
    if not outcome:
        pytest.fail(f"reading {path} hung")
    return outcome[0]


def test_reads_survive_a_dead_volume_server_and_a_cut_gateway(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    contents = _contents()
    ref = _publish(cluster, tmp_path / "src", contents)
    for node in cluster.data_nodes():  # replication 001: both servers hold every volume
        assert any(v["Collection"] == BUCKET and v["ReplicaPlacement"]["node"] == 1
                   for v in node["volumes"]), node
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    mounter = Mounter(tmp_path)
    try:
        mount = mounter.mount(ref, cluster.store_url("dist", "&timeout=2"),  # type: ignore[arg-type]
                              extra=["--deadline", str(DEADLINE)])
        mount.expect_log_lines(r"chunk [0-9a-f]{12} is unavailable")
        mp = mount.mountpoint
        sets = {s: sorted(p for p in contents if p.startswith(f"set{s}/")) for s in "ABC"}
        for path in sets["A"]:
            assert _read(mp / path) == contents[path]

        cluster.kill("vol2")
        for path in sets["B"]:  # never read before: from the surviving copy
            assert _read(mp / path) == contents[path], path
        assert not mount.stats()["fetch"]["errors"]

        cluster.set_link("filer", up=False)
        for path in sets["C"][:3]:  # not cached: EIO after the deadline
            got = _read(mp / path)
            assert isinstance(got, OSError) and got.errno == errno.EIO, (path, got)
        for path in sets["A"] + sets["B"]:  # cached on the node: still served
            assert _read(mp / path) == contents[path], path

        cluster.set_link("filer", up=True)
        first = sets["C"][0]
        wait_for(lambda: _read(mp / first) == contents[first], "the gateway serves again", WAIT,
                 not_yet=(Exception,), interval=0.2)
        for path in sets["C"]:
            assert _read(mp / path) == contents[path], path
        errors = mount.stats()["fetch"]["errors"]
        assert sum(errors.values()) >= 3, errors
    finally:
        problems = mounter.close()
    assert not problems, problems
