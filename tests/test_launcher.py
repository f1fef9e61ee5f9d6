"""The native launcher (native/weenv-launch.c, `.venv/bin/weenv` of a setup.sh install): for a
`weenv run` by root it sends the node service exactly the request the Python entry point sends
(node_socket.request_line, byte for byte), with the same descriptors; it relays signals and
passes the exit status on (hand_over.py `_wait`); everything Python would decide, it hands to
Python unchanged, with the same output.

A fake service on a socket of the test's own (WEENV_MOUNTD_SOCKET) records what arrives and
answers as each test says; runs through the real service are test_node_run.py's, which runs
each of its tests with both clients.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from weenvfs.fuse import node_socket

WAIT = 30.0  # a safety bound, not a timing
HOSTILE = (b"q\"\\\n\t\x7f\x1f \xff\xed\xa0\x80\xc0\xaf\xe2\x82\xf4\x90\x80\x80"
           b"\xf0\x9f\x98\x80 e\xcc\x81")  # quotes, controls, bad UTF-8, an emoji


class FakeService:
    """A listener at `path` that answers each request with the line `answer(fds)` returns
    (the descriptors the client passed, closed after it returns; None: close without an
    answer) and keeps what arrived."""

    def __init__(self, path: Path, answer: Callable[[list[int]], bytes | None]) -> None:
        self.path, self.answer = path, answer
        self.requests: list[bytes] = []
        self.senders: list[str] = []  # the program that sent each request (/proc/PID/exe)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with node_socket.addressable(path) as address:
            self.listener.bind(address)
        self.listener.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                pid = struct.unpack("3i", conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
                try:
                    self.senders.append(os.readlink(f"/proc/{pid}/exe"))
                except OSError:
                    self.senders.append("")
                data, fds = b"", array.array("i")
                while not data.endswith(b"\n"):
                    part, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(64))
                    if not part:
                        break
                    data += part
                    for _, _, payload in ancillary:
                        fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                self.requests.append(data)
                try:
                    line = self.answer(list(fds))
                    if line is not None:
                        conn.sendall(line + b"\n")
                finally:
                    for fd in fds:
                        os.close(fd)

    def close(self) -> None:
        self.listener.close()
        self.path.unlink(missing_ok=True)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., FakeService]]:
    made: list[FakeService] = []

    def start(answer: Callable[[list[int]], bytes | None],
              name: str = "service.sock") -> FakeService:
        made.append(FakeService(tmp_path / name, answer))
        return made[-1]

    yield start
    for service in made:
        service.close()


def _env(service: FakeService, **extra: str) -> dict[bytes, bytes]:
    return {**os.environb, b"LC_ALL": b"C.UTF-8", b"HOSTILE": HOSTILE,
            b"WEENV_MOUNTD_SOCKET": os.fsencode(service.path),
            **{k.encode(): v.encode() for k, v in extra.items()}}


def _status(fds: list[int], text: bytes) -> None:
    os.write(fds[3], text)


def test_a_run_sends_the_python_clients_request_byte_for_byte(
        launcher: Path, serve: Callable[..., FakeService], tmp_path: Path) -> None:
    service = serve(lambda fds: (_status(fds, b"exit 7\n"), b"ok")[1])
    folder = os.path.join(os.fsencode(tmp_path), b"work-\xff \xc3\xa9")
    os.mkdir(folder)
    words = [b"-v", b"--log-file", b"/dev/null", b"run", b"--store", b"st\xc3\xb6re-\xfe",
             b"ref:1", b"sh", b"-c", b"echo \"$x\" \\ \t\n\x7f\x01", HOSTILE]
    env = _env(service)
    done = subprocess.run([os.fsencode(launcher), *words], env=env, cwd=folder,
                          capture_output=True, timeout=WAIT, check=False)
    assert done.returncode == 7, done.stderr
    [sent] = service.requests
    argv = json.loads(sent)["argv"]
    owner = argv[argv.index("--owner-pid") + 1]
    assert argv.index("--owner-pid") == 4  # right after `run`
    python = ("import os, sys\n"
              "from weenvfs.fuse import node_socket as n\n"
              "owner, *words = sys.argv[1:]\n"
              "argv = [*words[:4], '--owner-pid', owner, *words[4:]]\n"
              "sys.stdout.buffer.write(n.request_line(argv, n.ATTACHED, cwd=os.getcwd()))\n")
    expected = subprocess.run([os.fsencode(sys.executable), b"-c", python.encode(),
                               owner.encode(), *words], env=env, cwd=folder,
                              capture_output=True, timeout=WAIT, check=True).stdout
    assert sent == expected


def test_a_pull_is_handed_over_too_with_no_owner(
        launcher: Path, serve: Callable[..., FakeService], tmp_path: Path) -> None:
    """`weenv pull` (entry.HAND_OVER) goes to the service the same way, byte for byte as the
    Python client sends it: with no `--owner-pid` (a pull leaves no sandbox)."""
    service = serve(lambda fds: (_status(fds, b"exit 0\n"), b"ok")[1])
    words = [b"--log-file", b"/dev/null", b"pull", b"127.0.0.1:5000/env:v1", b"--insecure",
             b"--json", HOSTILE]
    env = _env(service)
    done = subprocess.run([os.fsencode(launcher), *words], env=env, cwd=tmp_path,
                          capture_output=True, timeout=WAIT, check=False)
    assert done.returncode == 0, done.stderr
    [sent] = service.requests
    assert service.senders == [str(launcher)]  # the launcher itself, not Python it exec'd
    assert "--owner-pid" not in json.loads(sent)["argv"]
    python = ("import os, sys\n"
              "from weenvfs.fuse import node_socket as n\n"
              "sys.stdout.buffer.write(n.request_line(sys.argv[1:], n.ATTACHED, "
              "cwd=os.getcwd()))\n")
    expected = subprocess.run([os.fsencode(sys.executable), b"-c", python.encode(), *words],
                              env=env, cwd=tmp_path, capture_output=True, timeout=WAIT,
                              check=True).stdout
    assert sent == expected


class Attached:
    """A launcher's `weenv run` that a fake service took, and a `sleep` standing in for the
    command: `status` is the command's status pipe (the service's copy)."""

    def __init__(self, launcher: Path, serve: Callable[..., FakeService]) -> None:
        asked = threading.Event()
        self.held: list[int] = []

        def answer(fds: list[int]) -> bytes:
            self.held.append(os.dup(fds[3]))
            asked.set()
            return b"ok"

        self.client = subprocess.Popen([launcher, "run", "--store", "s", "ref", "true"],
                                       env=_env(serve(answer)), stderr=subprocess.PIPE)
        self.command = subprocess.Popen(["sleep", "60"])
        assert asked.wait(WAIT)
        self.status = self.held[0]

    def close(self) -> None:
        for process in (self.client, self.command):
            if process.poll() is None:
                process.kill()
                process.wait()
        for fd in self.held:
            os.close(fd)


@pytest.fixture
def attached(launcher: Path, serve: Callable[..., FakeService]) -> Iterator[Attached]:
    run = Attached(launcher, serve)
    yield run
    run.close()


def test_a_signal_before_the_pid_reaches_the_command_once_it_arrives(
        attached: Attached) -> None:
    attached.client.send_signal(signal.SIGINT)  # no pid yet: kept until one arrives
    os.write(attached.status, f"pid {attached.command.pid}\n".encode())
    assert attached.command.wait(WAIT) == -signal.SIGINT
    os.write(attached.status, b"exit 130\n")
    assert attached.client.wait(WAIT) == 130  # the command's status is the launcher's


def test_a_signal_after_it_is_relayed_and_a_command_dying_of_it_takes_the_launcher(
        attached: Attached) -> None:
    os.write(attached.status, f"pid {attached.command.pid}\n".encode())
    attached.client.send_signal(signal.SIGTERM)
    assert attached.command.wait(WAIT) == -signal.SIGTERM
    os.close(attached.held.pop())  # it died of it without a status: so does the client
    assert attached.client.wait(WAIT) == -signal.SIGTERM


def test_a_run_that_ends_without_a_status_is_one_error_line(
        launcher: Path, serve: Callable[..., FakeService]) -> None:
    service = serve(lambda fds: b"ok")  # its status pipe closes with nothing on it
    done = subprocess.run([launcher, "run", "--store", "s", "ref", "true"], env=_env(service),
                          capture_output=True, timeout=WAIT, check=False)
    assert done.returncode == 125
    assert done.stderr.decode().splitlines() == [
        "weenv: error: the node service's run of this command ended without an exit status "
        "(see `weenv mountd --check` and its log)"]


@pytest.mark.parametrize(("words", "switch"), [
    (["version"], None),
    ([], None),
    (["--version"], None),
    (["run", "--help"], None),
    (["--log-file", "run", "version"], None),
    (["-v", "run", "--store", "{missing}", "env:1", "true"], "WEENV_NODE_RUN=off"),
    (["run", "--store", "{missing}", "env:1", "true"], "WEENV_MOUNTD=off"),
    (["run", "--store", "{missing}", "env:1", "true"], "WEENV_NODE_RUN= False "),
    # Neither on nor off: Python's one-line usage error (switches.py), not a run.
    (["run", "--store", "{missing}", "env:1", "true"], "WEENV_MOUNTD=of"),
    (["pull", "x/y:1"], "WEENV_NODE_RUN=disabled"),
    (["mounts", "--no-such-option"], None),
])
def test_what_python_decides_goes_to_python_with_the_same_output(
        launcher: Path, serve: Callable[..., FakeService], tmp_path: Path, words: list[str],
        switch: str | None) -> None:
    service = serve(lambda fds: b"refused: this test's service takes nothing")
    args = [w.format(missing=tmp_path / "missing") for w in words]
    name, _, value = (switch or "").partition("=")
    env = _env(service, **({name: value} if switch else {}))
    native = subprocess.run([launcher, *args], env=env, capture_output=True, timeout=WAIT,
                            check=False)
    python = subprocess.run([sys.executable, "-m", "weenvfs", *args], env=env,
                            capture_output=True, timeout=WAIT, check=False)
    assert (native.returncode, native.stdout, native.stderr) == (
        python.returncode, python.stdout, python.stderr)
    assert service.requests == []
    if value.strip() in ("of", "disabled"):
        assert (python.returncode, python.stderr.decode()) == (
            2, f"weenv: error: ${name} is {value!r}: set it to on or off (or unset it)\n")


@pytest.mark.parametrize("answer", [
    b"stale: the installed weenvfs changed since this server started", b"okay", None])
def test_a_service_that_declines_leaves_the_run_to_python(
        launcher: Path, serve: Callable[..., FakeService], tmp_path: Path,
        answer: bytes | None) -> None:
    """Python asks again (the launcher decided nothing) and, declined too, runs it itself;
    so does a service that closes without answering."""
    service = serve(lambda fds: answer)
    args = ["run", "--store", str(tmp_path / "missing"), "env:1", "true"]
    native = subprocess.run([launcher, *args], env=_env(service), capture_output=True,
                            timeout=WAIT, check=False)
    assert len(service.requests) == 2
    python = subprocess.run([sys.executable, "-m", "weenvfs", *args], env=_env(service),
                            capture_output=True, timeout=WAIT, check=False)
    assert len(service.requests) == 3
    assert (native.returncode, native.stdout, native.stderr) == (
        python.returncode, python.stdout, python.stderr)
    assert native.stderr.decode().startswith("weenv: error: store file://")


def test_ok_is_read_as_python_reads_it(launcher: Path,
                                       serve: Callable[..., FakeService]) -> None:
    service = serve(lambda fds: (_status(fds, b"exit 3\n"), b" ok \r")[1])
    done = subprocess.run([launcher, "run", "--store", "s", "ref", "true"], env=_env(service),
                          capture_output=True, timeout=WAIT, check=False)
    assert (done.returncode, len(service.requests)) == (3, 1), done.stderr


def test_a_socket_path_longer_than_an_address_holds(
        launcher: Path, serve: Callable[..., FakeService], tmp_path: Path) -> None:
    folder = tmp_path / ("d" * 60) / ("e" * 60)
    folder.mkdir(parents=True)
    service = serve(lambda fds: (_status(fds, b"exit 0\n"), b"ok")[1],
                    name=str((folder / "service.sock").relative_to(tmp_path)))
    assert len(os.fsencode(service.path)) > node_socket.SUN_PATH_MAX
    done = subprocess.run([launcher, "run", "--store", "s", "ref", "true"], env=_env(service),
                          capture_output=True, timeout=WAIT, check=False)
    assert done.returncode == 0, done.stderr
    assert len(service.requests) == 1
