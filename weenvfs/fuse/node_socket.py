"""The client's half of the node service's socket (fuse/mountd.py is the server): where it
listens, what a request says, and asking it once.

Split from mountd.py so that a process that only hands itself over (`weenv run`,
weenvfs/hand_over.py) starts as little Python as it can: this module imports only the
interpreter's cheapest modules (no logging, pathlib, json or re: about 35 ms of a warm `weenv
run`, docs/benchmarks.md). Starting a server when none answers is mountd.py's (`start_server`);
a caller that gets None from `ask` goes there.

A request is one JSON line (`request_line`), the descriptors it passes ride along as
SCM_RIGHTS; the answer is one line: `ok`, or why not (`stale: ...`, `declined: ...`,
`refused: ...`, `busy: ...`, `error: ...`).

native/weenv-launch.c writes the same request for `weenv run` (tests/test_launcher.py checks
it byte for byte): a change of `request_line`, `fingerprint` or `ask` goes there too.

Must not: import anything beyond the cheap standard modules above (a test checks), or start
or serve anything.
"""

from __future__ import annotations

import array
import os
import socket
import sys
from _json import encode_basestring_ascii as _quoted  # json.dumps' own string encoder

from weenvfs.switches import switched_off

SOCKET_ENV = "WEENV_MOUNTD_SOCKET"
SWITCH_ENV = "WEENV_MOUNTD"  # "off": never use a server
CONNECT_TIMEOUT = 5.0  # seconds for a server to accept and answer one request
DAEMON, REPLAY = "daemon", "replay"  # what a request starts (`launch`'s kind)
# A command attached to the client's stdio (`launch_attached`, weenvfs/hand_over.py): its
# stdin, stdout and stderr, the write end of its status pipe and the read end of a pipe whose
# write end only the client holds (EOF: the client is gone).
ATTACHED = "attached"
# Evict the node's idle mounts over its bounds (`mountd.request_eviction`): no descriptors.
EVICT = "evict"
MAX_REQUEST = 1 << 20
SUN_PATH_MAX = 107  # bytes of a unix socket path, NUL excluded
PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the weenvfs folder
# Subpackages whose folder may lie outside PACKAGE: pyproject.toml maps weenvfs.format and
# weenvfs.tools to the repository's format/ and tools/, which an editable install (the
# README's) imports from there. A wheel puts them below PACKAGE.
MAPPED = ("weenvfs.format", "weenvfs.tools")


def run_base() -> str:
    """The node's run-time folder: /run/weenv for root, a per-user folder otherwise (the
    mounts' pid files are in its `mounts`, the socket next to them)."""
    if os.geteuid() == 0:
        return "/run/weenv"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/weenv-{os.geteuid()}"
    return os.path.join(base, "weenv")


def socket_path() -> str:
    """Where the server listens: $WEENV_MOUNTD_SOCKET, else in `run_base()`."""
    return os.environ.get(SOCKET_ENV) or os.path.join(run_base(), "mountd.sock")


def enabled() -> bool:
    """Whether the node service is used at all (WEENV_MOUNTD is not `off`)."""
    return not switched_off(SWITCH_ENV)


def fingerprint() -> str:
    """What the server's code must match: interpreter, package folder and the newest source
    file of the package, wherever its subpackages live (`MAPPED`): a service started before
    an edit of format/ or tools/ (a `git pull`) must not serve the new client."""
    newest = max(_newest(folder) for folder in _code_folders())
    return f"{interpreter()}|{PACKAGE}|{newest}"


def interpreter() -> str:
    """This interpreter, however the client spelled its path (`../.venv/bin/python`, a
    symlinked checkout): two spellings of one venv must not take turns ending the service.
    Its folder is resolved, not the file: a venv's python links to the base interpreter,
    which another venv (other packages) shares."""
    folder, name = os.path.split(os.path.abspath(sys.executable))
    return os.path.join(os.path.realpath(folder), name)


def _code_folders() -> list[str]:
    """PACKAGE and the folders of the MAPPED subpackages that lie outside it."""
    found = (os.path.realpath(folder) for name in MAPPED for folder in _locations(name))
    return [PACKAGE, *(f for f in found if not (f + os.sep).startswith(PACKAGE + os.sep))]


def _locations(name: str) -> list[str]:
    """The folders of subpackage `name` as the import system would find them (the first of
    its finders whose `find_spec` knows it; that imports nothing)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = None if find is None else find(name, [PACKAGE])
        if spec is not None:
            return list(spec.submodule_search_locations or ())
    return []


def _newest(folder: str) -> int:
    """The newest modification time (ns) of a .py file below `folder`."""
    newest = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.endswith(".py") and entry.is_file():
                newest = max(newest, entry.stat().st_mtime_ns)
            elif entry.is_dir(follow_symlinks=False) and entry.name != "__pycache__":
                newest = max(newest, _newest(entry.path))
    return newest


def namespaces() -> dict[str, str]:
    """This process's mount and network namespaces (a server elsewhere declines)."""
    out = {}
    for kind in ("mnt", "net"):
        try:  # noqa: SIM105 - contextlib is not among the cheap imports
            out[kind] = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            pass
    return out


def umask() -> int:
    """This process's umask, read without changing it (other threads may create files)."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def request_line(args: list[str], kind: str, **extra: str) -> bytes:
    """A request: what to run, with this process's environment, umask and code, namespaces.
    The JSON `json.dumps` would write (its own string encoder), without importing json."""
    fields = {
        "argv": _json_list(args), "env": _json_dict(dict(os.environ)), "umask": str(umask()),
        "fingerprint": _quoted(fingerprint()), "namespaces": _json_dict(namespaces()),
        "kind": _quoted(kind), **{key: _quoted(value) for key, value in extra.items()},
    }
    body = ", ".join(f"{_quoted(key)}: {value}" for key, value in fields.items())
    return ("{" + body + "}\n").encode()


def _json_list(items: list[str]) -> str:
    return "[" + ", ".join(_quoted(item) for item in items) + "]"


def _json_dict(items: dict[str, str]) -> str:
    return "{" + ", ".join(f"{_quoted(k)}: {_quoted(v)}" for k, v in items.items()) + "}"


def ask(request: bytes, fds: list[int]) -> bytes | None:
    """The server's answer to `request` (with `fds` passed); None when no server listens.
    Once the request is out, the server may have forked its command: a lost answer then
    counts as `ok` (starting it a second time could race the first; the caller's pipes tell
    either way)."""
    path = socket_path()
    if not os.path.exists(path):
        return None
    sent = False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, \
                addressable(path) as address:
            conn.settimeout(CONNECT_TIMEOUT)
            conn.connect(address)
            conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", fds))])
            sent = True
            return read_line(conn)
    except OSError:
        return b"ok" if sent else None


def received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors the SCM_RIGHTS messages of `ancdata` (from `recvmsg`) carried."""
    size = array.array("i").itemsize
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % size])
            fds.extend(received)
    return fds


class addressable:  # noqa: N801 - used as `with addressable(path) as address:`
    """An address for the socket at `path` that fits a socket address (108 bytes): the path
    itself, or, when it is longer, the same file through /proc/self/fd of its folder opened
    with O_PATH while the `with` lasts."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.handle = -1

    def __enter__(self) -> str:
        if len(os.fsencode(self.path)) <= SUN_PATH_MAX:
            return self.path
        folder, name = os.path.split(self.path)
        self.handle = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return f"/proc/self/fd/{self.handle}/{name}"

    def __exit__(self, *_exc: object) -> None:
        if self.handle >= 0:
            os.close(self.handle)
            self.handle = -1


def read_line(conn: socket.socket) -> bytes:
    """One line from `conn` (its end or MAX_REQUEST bytes end it too), stripped."""
    data = b""
    while b"\n" not in data and len(data) < MAX_REQUEST:
        part = conn.recv(65536)
        if not part:
            break
        data += part
    return data.split(b"\n", 1)[0].strip()
