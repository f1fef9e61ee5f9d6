"""The mount server: a resident process that starts mount daemons by forking itself, so a
mount pays neither the interpreter's start-up nor its imports (about 0.2-0.4 s of CPU per
mount with boto3; DESIGN.md: "a resident node daemon that serves mounts ... no Python
start-up or imports on the hot path"). pyfuse3 serves one mount per process, so each mount
still gets its own daemon process; only how it starts changes.

Owns:
- `serve`: `weenv mountd`: import everything a mount daemon needs, then wait on a unix socket
  (`socket_path()`, mode 0600, requests only from our own uid, checked with SO_PEERCRED).
  For each request it forks; the child starts a new session and forks again (the daemon is
  re-parented to init, as with `setsid --fork`), takes the client's environment, umask, log
  file and readiness pipe (passed over the socket), and runs `weenv mount --foreground ...`
  in-process. It exits after `idle` seconds without requests (0: never).
- `launch`: the client side used by `daemon.spawn`: True if the server forked the daemon,
  False when no server answers, or it declines (its code is older than the installed
  package, or it runs in another mount or network namespace than the client: a mount made
  there would be invisible here); the caller then starts the daemon the slow way.
- `stop`: end the server of `socket_path()` (by the pid it recorded).

The server stays single-threaded (fork and threads do not mix) and never serves a FUSE
request itself. $WEENV_MOUNTD_SOCKET moves the socket (tests, several servers on one node);
WEENV_MOUNTD=off makes `launch` never use a server.

Must not: mount anything itself, or wait for the daemon it forked (the readiness pipe tells
the client, exactly as for a daemon started with `setsid`).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from weenvfs.errors import WeenvError

from . import daemon

log = logging.getLogger(__name__)

SOCKET_ENV = "WEENV_MOUNTD_SOCKET"
SWITCH_ENV = "WEENV_MOUNTD"  # "off": never use a server
CONNECT_TIMEOUT = 5.0  # seconds for a server to accept and answer one request
MAX_REQUEST = 1 << 20
# Imported before the first fork: what `weenv mount --foreground` needs for any store.
PRELOAD = ("weenvfs.fuse.commands", "weenvfs.fuse.mount", "weenvfs.core.hints",
           "weenvfs.store.s3", "weenvfs.store.http", "weenvfs.store.local")
PACKAGE = Path(__file__).resolve().parent.parent  # the weenvfs folder
SUN_PATH_MAX = 107  # bytes of a unix socket path, NUL excluded


def socket_path() -> Path:
    """Where the server listens: $WEENV_MOUNTD_SOCKET, else next to the mounts' pid files."""
    override = os.environ.get(SOCKET_ENV)
    return Path(override) if override else daemon.run_dir().parent / "mountd.sock"


def _sibling(sock: Path, suffix: str) -> Path:
    return sock.with_name(sock.name + suffix)


def fingerprint() -> str:
    """What the server's code must match: interpreter, package folder and its newest file."""
    newest = max((p.stat().st_mtime_ns for p in PACKAGE.rglob("*.py")), default=0)
    return f"{sys.executable}|{PACKAGE}|{newest}"


@contextlib.contextmanager
def _addressable(path: Path) -> Iterator[str]:
    """An address for `path` that fits a unix socket (108 bytes): the path itself, or, when
    it is longer, the same file through /proc/self/fd of its folder opened with O_PATH."""
    if len(os.fsencode(str(path))) <= SUN_PATH_MAX:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def _namespaces() -> dict[str, str]:
    out = {}
    for kind in ("mnt", "net"):
        with contextlib.suppress(OSError):
            out[kind] = os.readlink(f"/proc/self/ns/{kind}")
    return out


# -- client ---------------------------------------------------------------------------------


def launch(args: list[str], ready_fd: int, log_fd: int) -> bool:
    """Ask the server to start `python -m weenvfs ARGS --ready-fd N` as a daemon whose
    readiness pipe is `ready_fd` and whose stdout/stderr is `log_fd`; True if it did."""
    if os.environ.get(SWITCH_ENV, "").lower() in ("off", "0", "no"):
        return False
    path = socket_path()
    if not path.exists():
        return False
    request = json.dumps({
        "argv": list(args), "env": dict(os.environ), "umask": _umask(),
        "fingerprint": fingerprint(), "namespaces": _namespaces(),
    }).encode() + b"\n"
    sent = False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, \
                _addressable(path) as address:
            conn.settimeout(CONNECT_TIMEOUT)
            conn.connect(address)
            conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [ready_fd, log_fd]))])
            sent = True
            answer = _read_line(conn)
    except OSError as error:
        log.debug("mount server at %s did not answer: %s", path, error)
        # Once the request is out, the server may have forked the daemon: starting a second
        # one could race it for the mount point. The readiness pipe tells either way.
        return sent
    if answer != b"ok":
        log.debug("mount server declined: %s", answer.decode(errors="replace"))
        return False
    return True


def _umask() -> int:
    """This process's umask, read without changing it (other threads may create files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data and len(data) < MAX_REQUEST:
        part = conn.recv(65536)
        if not part:
            break
        data += part
    return data.split(b"\n", 1)[0].strip()


def stop(timeout: float = daemon.EXIT_TIMEOUT) -> int | None:
    """SIGTERM the server of `socket_path()` and wait for it; its pid, or None if none ran."""
    pid_path = _sibling(socket_path(), ".pid")
    try:
        pid = int(pid_path.read_text())
    except (OSError, ValueError):
        return None
    if not daemon.process_alive(pid) or not _is_server(pid):
        pid_path.unlink(missing_ok=True)
        return None
    os.kill(pid, signal.SIGTERM)
    daemon.wait_exit(pid, timeout)
    return pid


def _is_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"weenvfs" in cmdline and b"mountd" in cmdline


# -- server ---------------------------------------------------------------------------------


class _Stop(Exception):
    """SIGTERM/SIGINT arrived: leave the accept loop."""


def serve(idle: float, run: Callable[[list[str]], int],
          ready: Callable[[], None] | None = None) -> int:
    """Run the server until SIGTERM, or `idle` seconds without a request (0: forever).
    A forked daemon calls `run(ARGV)` (the CLI's `main`: fuse may not import the CLI) and
    exits with what it returns. Returns 0; 0 at once too when another server holds the
    socket already. `ready()` is called once the socket accepts requests."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from weenvfs.store import s3

    s3.warm_up()
    path = socket_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(_sibling(path, ".lock"), "a+b")  # noqa: SIM115 - held for the server's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("a mount server already listens on %s", path)
        lock.close()
        return 0
    code_print, namespaces = fingerprint(), _namespaces()
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)  # the socket is created 0600: our uid only
    try:
        with _addressable(path) as address:
            listener.bind(address)
    finally:
        os.umask(old_mask)
    bound = os.stat(path).st_ino
    listener.listen(64)
    pid_path = _sibling(path, ".pid")
    pid_path.write_text(f"{os.getpid()}\n")

    def on_signal(signum: int, frame: object) -> None:
        raise _Stop

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    log.info("mount server %d listening on %s", os.getpid(), path)
    if ready is not None:
        ready()
    try:
        last = time.monotonic()
        while True:
            wait = None if idle <= 0 else max(0.0, last + idle - time.monotonic())
            readable, _, _ = select.select([listener], [], [], wait)
            if not readable:
                log.info("mount server idle for %g s: exiting", idle)
                break
            conn, _ = listener.accept()
            last = time.monotonic()
            with conn:
                # What a forked daemon must not keep: above all the lock (flock belongs to
                # the open file, so a daemon holding it would lock out the next server).
                held = (conn, listener, lock)
                if not _handle(conn, held, code_print, namespaces, run):
                    break
    except _Stop:
        log.info("mount server stopping")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == bound:  # still ours
                path.unlink()
        listener.close()
        pid_path.unlink(missing_ok=True)
        lock.close()
    return 0


def _handle(conn: socket.socket, held: tuple[Any, ...], code_print: str,
            namespaces: dict[str, str], run: Callable[[list[str]], int]) -> bool:
    """Serve one request; False when this server must exit (its code is stale)."""
    conn.settimeout(CONNECT_TIMEOUT)
    fds: list[int] = []
    try:
        data, fds = _receive(conn)
        if not data:
            return True  # a liveness probe (`weenv mountd --check`)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  struct.calcsize("3i")))[1]
        request = json.loads(data)
        if uid != os.geteuid():
            _answer(conn, f"refused: uid {uid} is not the server's")
            return True
        if request.get("fingerprint") != code_print:
            _answer(conn, "stale: the installed weenvfs changed since this server started")
            return False
        if request.get("namespaces") != namespaces:
            _answer(conn, "declined: the client runs in another mount or network namespace")
            return True
        if len(fds) != 2:
            _answer(conn, "refused: a request passes exactly two file descriptors")
            return True
        _fork_daemon(request, fds, held, run)
        _answer(conn, "ok")
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("bad mount request: %s", error)
        with contextlib.suppress(OSError):
            _answer(conn, f"error: {error}")
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    return True


def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    """The request line and the descriptors that came with it."""
    fds: list[int] = []
    data = b""
    size = array.array("i").itemsize
    while b"\n" not in data and len(data) < MAX_REQUEST:
        part, ancdata, _flags, _ = conn.recvmsg(65536, socket.CMSG_SPACE(4 * size))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % size])
                fds.extend(received)
        if not part:
            break
        data += part
    return data.split(b"\n", 1)[0], fds


def _answer(conn: socket.socket, text: str) -> None:
    conn.sendall(text.encode() + b"\n")


def _fork_daemon(request: dict[str, Any], fds: list[int], held: tuple[Any, ...],
                 run: Callable[[list[str]], int]) -> None:
    """Fork; the child forks the daemon and exits at once (reaped here), so the daemon is
    nobody's child, in a session of its own."""
    argv = [str(a) for a in request["argv"]]
    env = {str(k): str(v) for k, v in request["env"].items()}
    umask = int(request["umask"])
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        for thing in held:  # the server's socket, connection and lock
            thing.close()
        _become_daemon(argv, env, umask, run, ready_fd=fds[0], log_fd=fds[1])
    except BaseException:  # noqa: BLE001 - a forked child must never return into the loop
        os._exit(70)


def _become_daemon(argv: list[str], env: dict[str, str], umask: int,
                   run: Callable[[list[str]], int], ready_fd: int, log_fd: int) -> None:
    """In the forked daemon: the client's view of the world, then `weenv ARGV` in-process."""
    import setproctitle

    sys.argv = [sys.executable, "-m", "weenvfs", *argv]
    # What `ps` shows and what tools match on (else the server's command line). Before the
    # environment is replaced: setproctitle moves the environment block on first use.
    setproctitle.setproctitle(" ".join(sys.argv))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for fd in (devnull, log_fd):
        os.close(fd)
    os.chdir("/")
    os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    root = logging.getLogger()
    for handler in list(root.handlers):  # the server's logging is not the daemon's
        root.removeHandler(handler)
    code = run([*argv, "--ready-fd", str(ready_fd)])
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def check_running() -> None:
    """WeenvError unless a server answers on `socket_path()` (for `weenv mountd --check`)."""
    path = socket_path()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, \
                _addressable(path) as address:
            conn.settimeout(CONNECT_TIMEOUT)
            conn.connect(address)
    except OSError as error:
        raise WeenvError(f"no mount server answers on {path}: {error.strerror or error}") \
            from None
