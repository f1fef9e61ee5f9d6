"""`weenv dev registry` and the server under it (tools/registry_server.py), against the real
Debian `docker-registry`: the command serves until SIGTERM or SIGINT, then stops its registry
(the port is free again) and removes a temp folder; a blob pushed through the Distribution API
reads back; `--user` turns on basic auth; a kept folder keeps what was pushed across restarts;
bad arguments and a taken port are refused in one line with a non-zero exit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import oci_images as O
import pytest
import requests
from fixtures import run_cli
from support import layers as L
from support.polling import wait_for
from support.registry import tools_missing

from weenvfs.tools.registry_server import RegistryServer, registry_missing

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _registry_installed(require_or_skip: Callable[[object, str], None]) -> None:
    reason = registry_missing()
    require_or_skip(reason is None, reason or "")


class Served:
    """`weenv dev registry ARGS` in a subprocess; its stdout lines gathered by a thread."""

    def __init__(self, *args: str) -> None:
        self.child = subprocess.Popen(
            [sys.executable, "-m", "weenvfs", "dev", "registry", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            self.lines.append(line)

    def output_until(self, last_line: Callable[[str], bool]) -> str:
        """Every line printed up to the one `last_line` accepts (failing if the child ends)."""

        def arrived() -> bool:
            if self.child.poll() is not None:
                pytest.fail(f"weenv dev registry exited: {self.stop(signal.SIGTERM)}")
            return any(last_line(line) for line in self.lines)

        wait_for(arrived, "the registry's address")
        return "".join(self.lines)

    def stop(self, signum: int) -> tuple[int, str]:
        """Send `signum` (SIGKILL after 60 s); the exit code and stderr."""
        if self.child.poll() is None:
            self.child.send_signal(signum)
            try:
                self.child.wait(60)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        self._reader.join(10)
        assert self.child.stderr is not None
        err = "" if self.child.stderr.closed else self.child.stderr.read()
        self.child.stderr.close()
        return self.child.returncode, err


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """Start `weenv dev registry` with arguments; every one started is stopped at the end."""
    started: list[Served] = []

    def start(*args: str) -> Served:
        started.append(Served(*args))
        return started[-1]

    yield start
    for served in started:
        served.stop(signal.SIGTERM)


def _port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:`port` (SO_REUSEADDR: as a server binds, so a
    closed connection's TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _push_blob(url: str, repo: str, data: bytes, auth: tuple[str, str] | None = None) -> str:
    """Upload `data` as a blob of `repo` (POST, then PUT with the digest); its digest."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    started = requests.post(f"{url}/v2/{repo}/blobs/uploads/", auth=auth, timeout=10)
    assert started.status_code == 202, started.text
    location = started.headers["Location"]
    location = location if location.startswith("http") else url + location
    done = requests.put(location, params={"digest": digest}, data=data, auth=auth, timeout=10,
                        headers={"Content-Type": "application/octet-stream"})
    assert done.status_code == 201, done.text
    return digest


def test_serves_until_sigterm_then_frees_its_port_and_folder(serve) -> None:
    served = serve("--json")
    doc = json.loads(served.output_until(lambda line: line.rstrip() == "}"))
    assert doc["host"].startswith("127.0.0.1:") and doc["url"] == f"http://{doc['host']}"
    assert doc["kept"] is False and doc["users"] == []
    port = int(doc["host"].rpartition(":")[2])
    assert requests.get(f"{doc['url']}/v2/", timeout=10).status_code == 200
    data = os.urandom(5000)
    digest = _push_blob(doc["url"], "dev/blob", data)
    got = requests.get(f"{doc['url']}/v2/dev/blob/blobs/{digest}", timeout=10)
    assert got.status_code == 200 and got.content == data
    assert not _port_is_free(port)
    code, err = served.stop(signal.SIGTERM)
    assert code == 0, err
    assert "stopping the registry" in err
    assert _port_is_free(port)
    assert not Path(doc["directory"]).exists()  # a temp folder is deleted at exit


def test_users_need_basic_auth_and_a_kept_folder_stays(serve, tmp_path: Path) -> None:
    folder = tmp_path / "reg"
    served = serve("--dir", str(folder), "--user", "alice:s3cret", "--user", "bob:pw")
    text = served.output_until(lambda line: line.lstrip().startswith("weenv push"))
    assert "Basic auth is on for: alice, bob." in text
    assert "--creds alice:PASSWORD" in text and "s3cret" not in text  # passwords not echoed
    url = re.search(r"serving at (http://127\.0\.0\.1:\d+) ", text)
    assert url, text
    v2 = f"{url.group(1)}/v2/"
    refused = requests.get(v2, timeout=10)
    assert refused.status_code == 401 and "Basic" in refused.headers["WWW-Authenticate"]
    assert requests.get(v2, auth=("alice", "wrong"), timeout=10).status_code == 401
    assert requests.get(v2, auth=("bob", "pw"), timeout=10).status_code == 200
    _push_blob(url.group(1), "dev/kept", b"kept", auth=("alice", "s3cret"))
    code, err = served.stop(signal.SIGINT)
    assert code == 0, err
    assert (folder / "data").is_dir() and (folder / "registry.log").exists()


def test_a_kept_folder_serves_what_was_pushed_after_a_restart(tmp_path: Path) -> None:
    missing = tools_missing()
    if missing:
        pytest.skip(missing)
    image = O.write_layout(tmp_path / "layout", [L.layer(L.file("hello", b"hi\n"))], tag="v1")
    with RegistryServer(tmp_path / "reg", users={"alice": "s3cret"}) as server:
        ref = server.push(tmp_path / "layout", "v1", "team/hello")
        assert ref == f"{server.host}/team/hello:v1"
    assert not server.is_temp and server.process is None
    with RegistryServer(tmp_path / "reg") as again:  # no users now: no auth
        got = requests.get(f"{again.url}/v2/team/hello/manifests/v1", timeout=10,
                           headers={"Accept": O.OCI_MANIFEST})
        assert got.status_code == 200
        assert O.sha256(got.content) == image.manifest_digest


@pytest.mark.parametrize(("args", "complaint"), [
    (["--port", "0"], "argument --port: expected a port number from 1 to 65535, got '0'"),
    (["--port", "65536"], "argument --port: expected a port number"),
    (["--port", "http"], "argument --port: expected a port number"),
    (["--user", "alice"], "argument --user: expected NAME:PASSWORD, got 'alice'"),
    (["--user", ":pw"], "argument --user: expected NAME:PASSWORD"),
    (["--user", "alice:"], "argument --user: expected NAME:PASSWORD"),
    (["--listen", "0.0.0.0"], "unrecognized arguments: --listen 0.0.0.0"),
])
def test_bad_arguments_are_refused(capsys, args: list[str], complaint: str) -> None:
    code, out, err = run_cli(["dev", "registry", *args], capsys)
    assert code == 2 and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("weenv dev registry: error: ") or last.startswith("weenv: error: ")
    assert complaint in last, err


def test_a_taken_port_is_one_line(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(["dev", "registry", "--port", str(port)], capsys)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0] == f"weenv: error: cannot listen on 127.0.0.1:{port}: address already in use"
