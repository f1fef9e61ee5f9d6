"""`weenv snapshotter` over its gRPC socket, as containerd calls it, for ordinary layers: what
each call answers, state that survives a restart, Cleanup, and bad WeEnv labels refused with
the status containerd shows. The real server runs as a subprocess; no containerd here (the
containerd tests are test_containerd.py)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from weenvfs.format.oci_layer import LayerRef
from weenvfs.snapshotter import api
from weenvfs.store.local import LocalStore

REMOTE = {**LayerRef("file:///elsewhere", "a" * 64, 0, "b" * 64).annotations(),
          "containerd.io/snapshot.ref": "sha256:cc"}


class Client:
    def __init__(self, socket: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket}")

    def __call__(self, method: str, **fields: Any) -> Any:
        request, response, streaming = api.METHODS[method]
        kind = self.channel.unary_stream if streaming else self.channel.unary_unary
        call = kind(f"/{api.SERVICE}/{method}",
                    request_serializer=api.message(request).SerializeToString,
                    response_deserializer=api.message(response).FromString)
        out = call(api.message(request)(snapshotter="weenv", **fields), timeout=30)
        return list(out) if streaming else out

    def code(self, method: str, **fields: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as caught:
            self(method, **fields)
        return caught.value.code(), caught.value.details()


class Server:
    def __init__(self, tmp: Path) -> None:
        self.socket, self.root = tmp / "s.sock", tmp / "root"
        LocalStore(tmp / "store", create=True).close()
        self.store = tmp / "store"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> Client:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weenvfs", "snapshotter", "--store", str(self.store),
             "--socket", str(self.socket), "--root", str(self.root), "--cache",
             str(self.root.parent / "cache"), *extra])
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        return Client(self.socket)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(30) == 0
        assert not self.socket.exists()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    try:
        yield s
    finally:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def _mounts(response: Any) -> list[tuple[str, str, list[str]]]:
    return [(m.type, m.source, list(m.options)) for m in response.mounts]


def test_ordinary_layers_and_restart(server: Server) -> None:
    client = server.start()
    kind, source, options = _mounts(client("Prepare", key="ns/1/a", parent=""))[0]
    assert (kind, options) == ("bind", ["rw", "rbind"])
    (Path(source) / "hello").write_text("hi")
    client("Commit", name="ns/2/base", key="ns/1/a", labels={"l": "1"})
    assert client.code("Stat", key="ns/1/a")[0] == grpc.StatusCode.NOT_FOUND
    [(kind, _, options)] = _mounts(client("Prepare", key="ns/3/b", parent="ns/2/base"))
    assert kind == "overlay"
    assert options[2] == f"lowerdir={source}"
    assert _mounts(client("View", key="ns/4/v", parent="ns/2/base")) == [
        ("bind", source, ["ro", "rbind"])]
    info = client("Stat", key="ns/2/base").info
    assert (info.kind, dict(info.labels)) == (api.KINDS["COMMITTED"], {"l": "1"})
    assert client("Usage", key="ns/2/base").inodes == 1
    updated = api.message("Info")(name="ns/2/base", labels={"m": "2"})
    mask = api.message("google.protobuf.FieldMask")(paths=["labels.m"])
    assert dict(client("Update", info=updated, update_mask=mask).info.labels) == {
        "l": "1", "m": "2"}
    code, details = client.code("Remove", key="ns/2/base")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "children" in details
    assert client.code("Prepare", key="ns/3/b", parent="")[0] == grpc.StatusCode.ALREADY_EXISTS
    assert client.code("Prepare", key="x", parent="nope")[0] == grpc.StatusCode.NOT_FOUND

    server.stop()
    (server.root / "snapshots" / "99").mkdir()  # what a crash leaves
    client = server.start()
    listed = {i.name: i.parent for r in client("List") for i in r.info}
    assert listed == {"ns/2/base": "", "ns/3/b": "ns/2/base", "ns/4/v": "ns/2/base"}
    assert (Path(source) / "hello").read_text() == "hi"
    client("Cleanup")
    assert not (server.root / "snapshots" / "99").exists()
    for key in ("ns/3/b", "ns/4/v", "ns/2/base"):
        client("Remove", key=key)
    assert list((server.root / "snapshots").iterdir()) == []
    server.stop()


@pytest.mark.parametrize(("labels", "status", "fragment"), [
    (REMOTE, grpc.StatusCode.FAILED_PRECONDITION, "does not serve"),
    ({**REMOTE, "containerd.io/snapshot/weenv/position": "x"}, grpc.StatusCode.INVALID_ARGUMENT,
     "expected a number"),
    ({"containerd.io/snapshot/weenv/index": "b" * 64, "containerd.io/snapshot.ref": "s"},
     grpc.StatusCode.INVALID_ARGUMENT, "missing"),
])
def test_bad_weenv_labels_are_refused(server: Server, labels: dict[str, str],
                                      status: grpc.StatusCode, fragment: str) -> None:
    client = server.start()
    code, details = client.code("Prepare", key="ns/1/x", parent="", labels=labels)
    assert code == status and fragment in details
    assert list((server.root / "snapshots").iterdir()) == []
    server.stop()


def _scrape(socket: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    address = socket.with_name(socket.name + ".metrics").read_text().strip()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_endpoint(server: Server) -> None:
    client = server.start("--metrics", "127.0.0.1:0")
    client("Prepare", key="ns/1/a", parent="")
    client.code("Stat", key="nope")
    client.code("Prepare", key="ns/1/x", parent="", labels=REMOTE)
    samples = _scrape(server.socket)
    assert samples[("weenv_snapshotter_calls_total", (("code", "OK"), ("method", "Prepare")))] == 1
    assert samples[("weenv_snapshotter_calls_total",
                    (("code", "NOT_FOUND"), ("method", "Stat")))] == 1
    assert samples[("weenv_snapshotter_refused_layers_total", ())] == 1
    assert samples[("weenv_snapshotter_snapshots", (("kind", "active"), ("weenv", "false")))] == 1
    assert not any(name.startswith("weenv_fetched") for name, _ in samples)  # no node metrics
    server.stop()
    assert not server.socket.with_name(server.socket.name + ".metrics").exists()


def test_a_metrics_address_in_use_fails_in_one_line(server: Server) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "weenvfs", "snapshotter", "--store", str(server.store),
             "--socket", str(server.socket), "--root", str(server.root),
             "--metrics", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"weenv: error: cannot serve metrics on 127.0.0.1:{port}: "
                                   "Address already in use")
    assert not server.socket.exists()
