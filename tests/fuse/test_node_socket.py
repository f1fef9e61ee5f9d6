"""The client's half of the node service's socket (fuse/node_socket.py): a request line is
the JSON the server reads, whatever the arguments and environment hold; the code fingerprint
sees every source file; a socket path too long for an address still answers."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from weenvfs.fuse import node_socket

HOSTILE = ["plain", 'quote " and \\ backslash', "new\nline\ttab\x00nul", "é ü 中文 🙂",
           "\udcff\udc80 not UTF-8 (surrogate escapes)", "", "\x7f\x1b[31m"]


def test_a_request_line_is_one_line_of_the_json_the_server_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for i, value in enumerate(HOSTILE):
        monkeypatch.setenv(f"WEENV_TEST_{i}", value.replace("\x00", ""))
    line = node_socket.request_line(["run", *HOSTILE], node_socket.ATTACHED, cwd=HOSTILE[4])
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    request = json.loads(line)
    assert request["argv"] == ["run", *HOSTILE]
    assert request["env"] == dict(os.environ)
    assert request["kind"] == "attached" and request["cwd"] == HOSTILE[4]
    assert request["umask"] == node_socket.umask()
    assert request["fingerprint"] == node_socket.fingerprint()
    assert request["namespaces"] == node_socket.namespaces()


def test_the_fingerprint_sees_every_source_file_below_the_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "__pycache__").mkdir()
    files = [tmp_path / "a.py", tmp_path / "sub" / "deeper" / "b.py"]
    for path in files:
        path.write_text("x = 1\n")
        os.utime(path, ns=(10**18, 10**18))
    monkeypatch.setattr(node_socket, "PACKAGE", str(tmp_path))
    monkeypatch.setattr(node_socket, "MAPPED", ())  # the package's own folder only
    before = node_socket.fingerprint()
    stale = tmp_path / "__pycache__" / "c.py"  # never code the server runs
    stale.write_text("")
    os.utime(stale, ns=(2 * 10**18, 2 * 10**18))
    assert node_socket.fingerprint() == before
    os.utime(files[1], ns=(10**18 + 1, 10**18 + 1))
    assert node_socket.fingerprint() != before


def test_the_fingerprint_sees_the_subpackages_an_editable_install_maps_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """weenvfs.format and weenvfs.tools are the repository's format/ and tools/ in an
    editable install: an edit there changes the fingerprint too (a stale service would
    otherwise fork mount daemons with the old format code)."""
    folders = node_socket._code_folders()
    import weenvfs.format
    import weenvfs.tools

    for module in (weenvfs.format, weenvfs.tools):
        folder = os.path.realpath(os.path.dirname(module.__file__ or ""))
        assert any(folder == f or folder.startswith(f + os.sep) for f in folders), folder
    elsewhere = tmp_path / "format"
    elsewhere.mkdir()
    (elsewhere / "spec.py").write_text("x = 1\n")
    os.utime(elsewhere / "spec.py", ns=(10**18, 10**18))
    monkeypatch.setattr(node_socket, "_code_folders",
                        lambda: [node_socket.PACKAGE, str(elsewhere)])
    before = node_socket.fingerprint()
    os.utime(elsewhere / "spec.py", ns=(4 * 10**18, 4 * 10**18))
    assert node_socket.fingerprint() != before


def test_the_fingerprint_names_the_interpreter_however_its_path_is_spelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client started as `../.venv/bin/python` (or through a symlinked checkout) runs the
    service's code: before, its fingerprint differed, and it and a client spelling the path
    plainly ended each other's service in turn, failing the mounts in flight."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (tmp_path / "base-python").write_text("")
    (venv / "python").symlink_to(tmp_path / "base-python")
    (tmp_path / "checkout").symlink_to(tmp_path / "venv")
    (tmp_path / "other" / "bin").mkdir(parents=True)
    (tmp_path / "other" / "bin" / "python").symlink_to(tmp_path / "base-python")
    monkeypatch.setattr(node_socket, "_newest", lambda folder: 1)

    def print_of(executable: str) -> str:
        monkeypatch.setattr(node_socket.sys, "executable", executable)
        return node_socket.fingerprint()

    plain = print_of(str(venv / "python"))
    assert print_of(f"{tmp_path}/venv/bin/../bin/python") == plain
    assert print_of(f"{tmp_path}/checkout/bin/python") == plain
    # Another venv over the same base interpreter has packages of its own.
    assert print_of(str(tmp_path / "other" / "bin" / "python")) != plain


def test_a_socket_path_longer_than_an_address_still_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / ("d" * 60) / ("e" * 60)
    folder.mkdir(parents=True)
    path = folder / "mountd.sock"
    assert len(os.fsencode(str(path))) > node_socket.SUN_PATH_MAX
    monkeypatch.setenv(node_socket.SOCKET_ENV, str(path))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        with node_socket.addressable(path) as address:
            server.bind(address)
        server.listen(1)

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                assert conn.recv(100) == b"hello\n"
                conn.sendall(b"ok\n")

        thread = threading.Thread(target=answer)
        thread.start()
        assert node_socket.ask(b"hello\n", []) == b"ok"
        thread.join(10)
    monkeypatch.setenv(node_socket.SOCKET_ENV, str(folder / "none.sock"))
    assert node_socket.ask(b"hello\n", []) is None  # no server: the caller may start one
