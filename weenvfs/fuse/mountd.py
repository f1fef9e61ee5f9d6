"""The mount server: a resident process that starts mount daemons by forking itself, so a
mount pays neither the interpreter's start-up nor its imports (about 0.2-0.4 s of CPU per
mount with boto3; DESIGN.md: "a resident node daemon that serves mounts ... no Python
start-up or imports on the hot path"). pyfuse3 serves one mount per process, so each mount
still gets its own daemon process; only how it starts changes.

Owns:
- `serve`: `weenv mountd`: listen on a unix socket (`socket_path()`, mode 0600, requests only
  from our own uid, checked with SO_PEERCRED), then import everything its children run
  (service_loading.py: a step at a time between requests, so its starter waits for the
  socket only).
  For each request it forks (service_forks.py: the child starts a new session, takes the
  client's environment, umask, log file and readiness pipe, passed over the socket, and runs
  `weenv mount --foreground ...` in-process; the server reaps it when it exits). It exits
  after `idle` seconds without requests once no daemon it forked runs (0: never). A
  detached server first leaves its starter's cgroups (`leave_caller_cgroups`), and every
  HOUSEKEEPING_EVERY seconds it forks `weenv mounts evict --expired` (the idle bounds of the
  node's shared mounts, runtime/mounts.py).
- evictions: a request of kind EVICT (`request_eviction`: a sandbox released its mounts)
  forks the same eviction with the client's environment (its mounts folder and bounds), so
  the closing sandbox never waits for daemons to exit; at most one runs per environment,
  and requests arriving meanwhile make one more run after it (service_evictions.py).
- attached commands: a request of kind ATTACHED (`launch_attached`, weenvfs/hand_over.py:
  `weenv run` hands itself over) is forked the same way but runs with the client's stdin,
  stdout, stderr and working folder, writes `pid N` and then `exit N` on the status pipe the
  client passed, and takes the closing of the client's alive pipe as SIGTERM; it goes to
  the spare when one waits (forked ahead after a run, or once requests pause for
  SPARE_AFTER: service_forks.py `fork_spare`);
- `launch`: the client side used by `spawn.spawn` (its socket half, which needs none of this
  module's imports, is node_socket.py): True if the server forked the daemon,
  False when no server answers (after `start_server` tried to start one, when `may_start`:
  root or the user's own socket, from the node's own namespaces), or it declines (its code
  is older than the installed package, or it runs in another mount or network namespace
  than the client: a mount made there would be invisible here); the caller then starts the
  daemon the slow way.
- `stop`: end the server of `socket_path()` (by the pid it recorded).

With an `exporter` (exporter.py, `weenv mountd --metrics`), the server forks a child that
serves the node's Prometheus metrics while it runs, and starts it again if it dies.

The server stays single-threaded (fork and threads do not mix) and never serves a FUSE
request itself. After answering a request it prepares what its next children would make or
load again (service_preload.py): the store client of the request's store (no connection:
clients connect at their first request) and the manifest and indexes of the environment it
names.
$WEENV_MOUNTD_SOCKET moves the socket (tests, several servers on one node);
WEENV_MOUNTD=off makes `launch` neither use nor start a server.

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from weenvfs.errors import WeenvError

from . import daemon, node_socket
from .node_socket import (
    ATTACHED,
    CONNECT_TIMEOUT,
    DAEMON,
    EVICT,
    MAX_REQUEST,
    REPLAY,
    addressable,
    ask,
    enabled,
    fingerprint,
    received_fds,
    request_line,
)
from .node_socket import namespaces as node_namespaces
from .service_evictions import HOUSEKEEPING, Evictions
from .service_forks import (
    argv_env,
    child_fds,
    drop_spare,
    fork_attached,
    fork_daemon,
    fork_spare,
    fork_task,
    has_spare,
    reap_forked,
)
from .service_loading import Preload, preload_steps
from .service_preload import option_value, prebuild_clients, preload_envs

log = logging.getLogger(__name__)

SOCKET_ENV, SWITCH_ENV = node_socket.SOCKET_ENV, node_socket.SWITCH_ENV  # known from here
ATTACHED_FDS = 5
MAX_FDS = 8  # room for descriptors in a request (more are discarded by the kernel: refused)
# Hint replays (`weenv cache warm` for a mount, fuse/replay_process.py) the server runs at
# once: one per two CPUs. A replay apart from its mount daemon uses a core of its own; when
# many environments start together there is none to spare, and each daemon replays its own.
MAX_REPLAYS = max(1, (os.cpu_count() or 1) // 2)
AUTO_IDLE = 600.0  # seconds an auto-started server lingers with no request and no daemon
HOUSEKEEPING_EVERY = 60.0  # seconds between two runs of HOUSEKEEPING while the server runs
# Seconds between two checks while an eviction waits or a child has no pidfd to wake the loop.
PENDING_POLL = 0.05
# Seconds without a request before a spare is forked again (service_forks.py `fork_spare`;
# at once after a `weenv run`): not amid the requests of a cold start, whose children need
# the CPU.
SPARE_AFTER = 0.1


def socket_path() -> Path:
    """Where the server listens: $WEENV_MOUNTD_SOCKET, else next to the mounts' pid files."""
    return Path(node_socket.socket_path())


def _sibling(sock: Path, suffix: str) -> Path:
    return sock.with_name(sock.name + suffix)


# -- client ---------------------------------------------------------------------------------


def launch(args: list[str], ready_fd: int, log_fd: int, start: bool = True,
           kind: str = DAEMON) -> bool:
    """Ask the server to start `python -m weenvfs ARGS --ready-fd N` as a daemon whose
    readiness pipe is `ready_fd` and whose stdout/stderr is `log_fd`; True if it did. With
    `start`, a server is started first when none answers and this process may (`may_start`).
    `kind` REPLAY marks a mount's hint replay, which the server caps (MAX_REPLAYS)."""
    if not enabled():
        return False
    return _request(request_line(args, kind), [ready_fd, log_fd], start)


def launch_attached(args: list[str], fds: list[int]) -> bool:
    """Ask the server (started first if none answers and this process may) to run
    `python -m weenvfs ARGS` in a process of its own with this process's working folder and
    `fds` (ATTACHED_FDS of them, see ATTACHED); True if it did. The command's first line on
    the status pipe is `pid N`, its last `exit N` (weenvfs/hand_over.py reads them)."""
    if not enabled():
        return False
    return _request(request_line(args, ATTACHED, cwd=os.getcwd()), fds, start=True)


def request_eviction() -> bool:
    """Ask the running server (none is started for this) to run HOUSEKEEPING, the eviction
    of the idle mounts over the node's bounds, in a process of its own with this process's
    environment; True if it took the request (the caller then need not evict itself)."""
    if not enabled():
        return False
    return _request(request_line([], EVICT), [], start=False)


def _request(request: bytes, fds: list[int], start: bool) -> bool:
    answer = ask(request, fds)
    if answer is None and start and may_start() and start_server():
        answer = ask(request, fds)
    if answer is None:
        return False
    if answer != b"ok":
        log.debug("mount server declined: %s", answer.decode(errors="replace"))
        return False
    return True


def log_args() -> list[str]:
    """`--log-file PATH` of this process's log file (none without one): what a command the
    server forks for this process passes, so that its log lands next to the caller's."""
    files = [h.baseFilename for h in logging.getLogger().handlers
             if isinstance(h, logging.FileHandler)]
    return ["--log-file", files[0]] if files else []


def may_start() -> bool:
    """Whether this process may start the node's server: root, or a user whose own folder
    holds the socket (never a server in someone else's folder); and not from a private mount
    or network namespace (a server there would decline every client of the node's own)."""
    with contextlib.suppress(OSError):
        for kind in ("mnt", "net"):
            if os.readlink(f"/proc/self/ns/{kind}") != os.readlink(f"/proc/1/ns/{kind}"):
                return False
    if os.geteuid() == 0:
        return True
    folder = socket_path().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder.stat().st_uid == os.geteuid()
    except OSError:
        return False


def start_server(idle: float = AUTO_IDLE) -> bool:
    """Start `weenv mountd --idle IDLE --leave-cgroups` in the background unless a server
    answers already (one starter at a time: a lock next to the socket); True once one
    answers. A failure is logged and answered False: the caller mounts the slow way."""
    path = socket_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(_sibling(path, ".start"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        with contextlib.suppress(WeenvError):
            check_running()
            return True
        log_file = _sibling(path, ".log")
        argv = ["--log-file", str(log_file), "mountd", "--idle", repr(idle), "--leave-cgroups"]
        try:
            pid = daemon.start(argv, log_file)
        except WeenvError as error:
            log.warning("could not start the node's mount server: %s", error)
            return False
    log.info("started the node's mount server %d on %s", pid, path)
    return True


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
    """Whether `pid` runs `weenvfs mountd` (its words NUL-separated as started, or one
    title: the server sets setproctitle up, which joins them with spaces)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
    except OSError:
        return False
    return b"weenvfs" in words and b"mountd" in words


# -- server ---------------------------------------------------------------------------------


class Exporter(Protocol):
    """What the server needs of its metrics exporter (exporter.Exporter, which imports this
    module: a protocol here keeps the imports one way)."""

    @property
    def socket(self) -> socket.socket | None:
        """The listening socket, which every other forked child closes."""

    def start(self, held: tuple[Any, ...]) -> bool: ...
    def poll(self, held: tuple[Any, ...]) -> None: ...
    def stop(self) -> None: ...


class _Stop(BaseException):
    """SIGTERM/SIGINT arrived: leave the accept loop (a BaseException, as KeyboardInterrupt:
    code that catches every Exception, a library's or a preload step's, lets it through)."""


# SIGTERM/SIGINT arrived: kept, in case code it interrupted caught even a BaseException.
_stopping: list[bool] = []


def serve(idle: float, run: Callable[[list[str]], int],
          ready: Callable[[], None] | None = None, leave_cgroups: bool = False,
          exporter: Exporter | None = None, preload: tuple[str, ...] = (),
          prepare: Callable[[], None] | None = None, later: tuple[str, ...] = ()) -> int:
    """Run the server until SIGTERM, or until it has had no request for `idle` seconds and
    no mount daemon it forked still runs (0: forever). A forked daemon calls `run(ARGV)`
    (the CLI's `main`: fuse may not import the CLI) and exits with what it returns; so does
    the housekeeping child (HOUSEKEEPING). Returns 0; 0 at once too when another server
    holds the socket already. `ready()` is called once the socket accepts requests. With
    `leave_cgroups` the server first moves to the root cgroup of every hierarchy
    (`leave_cgroups`), so neither it nor its daemons live in the cgroup of whoever started
    it. An `exporter` serves the node's metrics from a child process while the server runs
    (exporter.py); an address it cannot bind fails the server before `ready()`. `preload`
    names the modules of the other commands `run` is asked to run (the CLI knows them),
    `later` those of commands rarely asked for, and `prepare` what else to make ahead for
    them (the CLI's parsers); all are loaded after the socket listens, a step at a time
    between requests (service_loading.py)."""
    _set_up_titles()
    from . import spare_pages  # noqa: F401 - the service's own (its token), which forks inherit
    if leave_cgroups:
        leave_caller_cgroups()
    server = _listen(exporter)
    if server is None:
        return 0
    _stopping.clear()
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    log.info("mount server %d listening on %s", os.getpid(), server.path)
    if ready is not None:
        ready()
    try:
        _loop(server.listener, server.lock, idle, run, exporter,
              Preload(preload_steps(preload, prepare, later)))
    except _Stop:
        log.info("mount server stopping")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _close(server, exporter)
    return 0


def _set_up_titles() -> None:
    """Let setproctitle find this process's argument area now, while the C environment is
    the one the process started with: it finds it through that environment, which the
    server replaces later (store/s3.py `prebuild`, called by service_preload.py, makes a
    store's client in its client's environment). Set up in a child after that, it failed
    silently, and `ps` showed every daemon forked after the first S3 request as `weenv
    mountd` (and `pkill -f` on the server's command line would have matched them all). Set
    up here, every child inherits it and titles itself (service_forks.py `take_over`)."""
    import setproctitle

    setproctitle.setproctitle(setproctitle.getproctitle())


class _Listening:
    """A server's socket, the lock that makes it the node's only one, and its pid file. (A
    plain class: `dataclasses` costs `weenv run`, which imports this module, ~5 ms.)"""

    def __init__(self, path: Path, lock: Any, listener: socket.socket, bound: int,
                 pid_path: Path) -> None:
        self.path, self.lock, self.listener, self.pid_path = path, lock, listener, pid_path
        self.bound = bound  # the socket file's inode: removed at the end only if still ours


def _listen(exporter: Exporter | None) -> _Listening | None:
    """Take the server lock, start the exporter, bind the socket (0600) and write the pid
    file; None when another server holds the lock already."""
    path = socket_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(_sibling(path, ".lock"), "a+b")  # noqa: SIM115 - held for the server's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("a mount server already listens on %s", path)
        lock.close()
        return None
    if exporter is not None:
        try:
            exporter.start((lock,))
        except BaseException:
            lock.close()
            raise
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)  # the socket is created 0600: our uid only
    try:
        with addressable(path) as address:
            listener.bind(address)
    finally:
        os.umask(old_mask)
    bound = os.stat(path).st_ino
    listener.listen(64)
    pid_path = _sibling(path, ".pid")
    pid_path.write_text(f"{os.getpid()}\n")
    return _Listening(path, lock, listener, bound, pid_path)


def _raise_stop(signum: int, frame: object) -> None:
    _stopping.append(True)
    raise _Stop


def _close(server: _Listening, exporter: Exporter | None) -> None:
    """Undo `_listen`: the socket file (if still ours), the pid file, the exporter, the lock;
    and the pages the service's spares wrote ahead (spare_pages.py)."""
    with contextlib.suppress(OSError):
        if os.stat(server.path).st_ino == server.bound:
            server.path.unlink()
    server.listener.close()
    server.pid_path.unlink(missing_ok=True)
    from . import spare_pages

    spare_pages.forget()  # of no use to another service (its memory is laid out anew)
    if exporter is not None:
        exporter.stop()
    server.lock.close()


def _loop(listener: socket.socket, lock: Any, idle: float,
          run: Callable[[list[str]], int], exporter: Exporter | None = None,
          preload: Preload | None = None) -> None:
    """Accept requests until idle (see `serve`) or stale; housekeeping between them (and the
    metrics exporter started again if it died), and `preload`'s steps while no request
    waits."""
    preload = preload or Preload([])
    code_print, namespaces = fingerprint(), node_namespaces()
    # What every forked child closes besides the connection (service_forks.py `detached`).
    held: tuple[Any, ...] = (listener, lock)
    if exporter is not None and exporter.socket is not None:
        held += (exporter.socket,)
    daemons: dict[int, str] = {}  # pid -> start time, of every daemon forked and alive
    replays: dict[int, str] = {}  # the same, of the hint replays among them
    evictions = Evictions(held, run)
    last = time.monotonic()
    chores = last + HOUSEKEEPING_EVERY
    while True:
        if _stopping:  # caught and dropped by whatever it interrupted
            raise _Stop
        polled_children = reap_forked()  # children without a pidfd (kernels before 5.3)
        if exporter is not None:
            exporter.poll((listener, lock))
        now = time.monotonic()
        if now >= chores:
            fork_task(list(HOUSEKEEPING), held, run)
            chores = now + HOUSEKEEPING_EVERY
        waits = [chores - now]
        if evictions.poll() or polled_children:
            waits.append(PENDING_POLL)
        if idle > 0:
            waits.append(last + idle - now)
        if preload.pending:
            waits.append(0.0)  # only look for a request waiting
        elif not has_spare():  # the next `weenv run`'s process, forked once requests pause
            if now >= last + SPARE_AFTER:
                fork_spare(held, run)
            else:
                waits.append(last + SPARE_AFTER - now)
        if not _wait_for_client(listener, max(0.0, min(waits))):
            if preload.pending:
                preload.step()
                continue
            if idle > 0 and time.monotonic() >= last + idle and not _alive(daemons):
                log.info("mount server idle for %g s with no daemon left: exiting", idle)
                return
            continue
        conn, _ = listener.accept()
        last = time.monotonic()
        with conn:
            # What a forked daemon must not keep: above all the lock (flock belongs to the
            # open file, so a daemon holding it would lock out the next server).
            if not _handle(conn, (conn, *held), code_print, namespaces, run, daemons,
                           replays, evictions, preload):
                return


def _wait_for_client(listener: socket.socket, timeout: float) -> bool:
    """Wait until a client connects (True), a child exits (its pidfd: the loop reaps it) or
    `timeout` seconds pass. poll(2), not select(2): a node with hundreds of mounts has
    hundreds of children, and select takes no descriptor past 1023.

    A SIGTERM whose `_Stop` was swallowed since the loop last looked stops the server here,
    before it sleeps: one that lands in an at-fork hook (logging's, after the exporter or a
    child is forked) is printed as "Exception ignored" and dropped, and the server then slept
    in poll(2) until its next chore while `mountd --stop` gave up on it (CI saw that once)."""
    if _stopping:
        raise _Stop
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    for fd in child_fds():
        poller.register(fd, select.POLLIN)
    ready = poller.poll(timeout * 1000.0)
    return any(fd == listener.fileno() for fd, _ in ready)


def leave_caller_cgroups() -> None:
    """Move this process to the root cgroup of each cgroup v1 hierarchy and of cgroup2
    (those it can write), so the node's server and its mount daemons outlive, and are not
    limited or killed with, the sandbox, job or session that happened to start it first."""
    from weenvfs.cgroup_places import own_cgroups

    moved, failed = [], []
    for hierarchy, root, where in own_cgroups():
        if where == "/":
            continue
        try:
            (root / "cgroup.procs").write_text(f"{os.getpid()}\n")
            moved.append(hierarchy)
        except OSError as error:
            failed.append(f"{hierarchy} ({error.strerror})")
    if moved:
        log.info("mount server left its starter's cgroups: %s", ", ".join(moved))
    if failed:
        log.info("mount server stays in its starter's cgroup of %s", ", ".join(failed))


def _handle(conn: socket.socket, held: tuple[Any, ...], code_print: str,
            namespaces: dict[str, str], run: Callable[[list[str]], int],
            daemons: dict[int, str], replays: dict[int, str], evictions: Evictions,
            preload: Preload | None = None) -> bool:
    """Serve one request (the daemon it forks is added to `daemons`, and to `replays` if it
    is a hint replay; an eviction goes to `evictions`); False when this server must exit
    (its code is stale). A child is forked once `preload` has taken the steps it needs."""
    conn.settimeout(CONNECT_TIMEOUT)
    fds: list[int] = []
    spare = False
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
            # Logged: a server that ends this way is otherwise gone without a word (another
            # checkout's client on the same socket ends it too; its mounts stay).
            log.info("mount server exiting: a client runs other code (%s, not %s)",
                     request.get("fingerprint"), code_print)
            return False
        if request.get("namespaces") != namespaces:
            _answer(conn, "declined: the client runs in another mount or network namespace")
            return True
        attached = request.get("kind") == ATTACHED
        evict = request.get("kind") == EVICT
        wanted = ATTACHED_FDS if attached else 0 if evict else 2
        if len(fds) != wanted:
            _answer(conn, f"refused: a request of kind {request.get('kind', DAEMON)} passes "
                          f"exactly {wanted} file descriptors")
            return True
        if evict:
            # Answered before the fork: the closing sandbox waits for this answer, not for
            # the eviction, which is the node's housekeeping (~5 ms less per close).
            key = evictions.key(request)
            _answer(conn, "ok")
            evictions.ask(key, request, held)
            return True
        replay = request.get("kind") == REPLAY
        if replay and _alive(replays) >= MAX_REPLAYS:
            _answer(conn, f"busy: {MAX_REPLAYS} hint replay(s) run already")
            return True
        if preload is not None and preload.pending:  # (steady state: nothing to look at)
            preload.take_for(None if attached else option_value(argv_env(request)[0], "--store"),
                             daemon=not attached)
        pid = (fork_attached if attached else fork_daemon)(request, fds, held, run)
        if pid:
            daemons[pid] = daemon.start_time(pid)
            if replay:
                replays[pid] = daemons[pid]
        _answer(conn, "ok")
        if prebuild_clients(request) | preload_envs(request):
            drop_spare()  # forked without what the server holds now
        spare = attached and (preload is None or not preload.pending)
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("bad mount request: %s", error)
        with contextlib.suppress(OSError):
            _answer(conn, f"error: {error}")
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    if spare:  # a run is often followed by another one; forked once the client's
        fork_spare(held, run)  # descriptors are closed here (the spare must not hold them)
    return True


def _alive(children: dict[int, str]) -> int:
    """Forget the children of `children` (pid -> start time) that ended; how many are left."""
    for pid, started in list(children.items()):
        if daemon.start_time(pid) != started:
            del children[pid]
    return len(children)


def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    """The request line and the descriptors that came with it."""
    fds: list[int] = []
    data = b""
    size = array.array("i").itemsize
    while b"\n" not in data and len(data) < MAX_REQUEST:
        part, ancdata, _flags, _ = conn.recvmsg(65536, socket.CMSG_SPACE(MAX_FDS * size))
        fds.extend(received_fds(ancdata))
        if not part:
            break
        data += part
    return data.split(b"\n", 1)[0], fds


def _answer(conn: socket.socket, text: str) -> None:
    conn.sendall(text.encode() + b"\n")


def check_running() -> None:
    """WeenvError unless a server answers on `socket_path()` (for `weenv mountd --check`)."""
    path = socket_path()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, \
                addressable(path) as address:
            conn.settimeout(CONNECT_TIMEOUT)
            conn.connect(address)
    except OSError as error:
        raise WeenvError(f"no mount server answers on {path}: {error.strerror or error}") \
            from None
