"""How the node service's children start (fuse/mountd.py forks them; DESIGN.md: "a
resident node daemon ... no Python start-up or imports on the hot path").

Every child is forked once (`detached`) into a session of its own; the server goes on at
once and reaps it when it exits (its loop waits on each child's pidfd, `child_fds`, beside
its socket). (Forking twice, so that the command was nobody's child, kept the server ~3 ms
longer per request: the first child's session and second fork, whose pid it waited for;
docs/design-notes.md.) The command then takes its client's arguments, environment and umask
(`take_over`) and runs `weenv ARGV` in-process through the `run` the server was given (the
CLI's `main`: fuse may not import the CLI):
- `fork_daemon`: a mount daemon, its readiness pipe and log file passed by the client;
- `fork_attached`: a command with the client's stdin, stdout, stderr and working folder
  (`weenv run` hands itself over: hand_over.py), its pid and exit status on a status pipe;
  what it asked to do after its answer (`when_answered`: a closing `weenv run` asks for the
  eviction of idle mounts over the node's bounds, runtime/mounts.py) runs once the status
  is out, with the client's stdio closed and signals ignored. The child is the spare when
  one waits (`fork_spare`: forked ahead while the server was idle, it takes the request and
  its descriptors over a socket pair), so a warm `weenv run` does not wait for the fork
  (~3 ms: the page tables of the server's ~70 MB);
- `fork_task`: a chore of the server's own (housekeeping, an eviction).

Must not: return into the server's loop from a child (every path ends in `os._exit`), or
keep what the server holds (its socket, lock and the connection: `held`).
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from weenvfs.errors import Terminated

from .node_socket import received_fds

log = logging.getLogger(__name__)

# Said (instead of "terminated by SIGTERM") by a command whose client went away (kill -9).
CLIENT_GONE = "stopped: the weenv process it ran for went away"
_children: dict[int, int] = {}  # children of `detached` not reaped yet: pid -> pidfd (or -1)
# What an attached command asked to do once its client has its exit status (`when_answered`);
# None in any process that is not such a command.
_after_answer: list[Callable[[], None]] | None = None
# The spare (`fork_spare`): its pid and the server's end of its socket pair, or None.
_spare: tuple[int, socket.socket] | None = None
SPARE_SWITCH = "WEENV_SPARE"  # off (the server's environment): every command forked anew
SPARE_REQUEST = 1 << 20  # the largest request a spare takes (a larger one: a fork)
_bad_switch_said = False  # a bad $WEENV_SPARE is logged once


def fork_daemon(request: dict[str, Any], fds: list[int], held: tuple[Any, ...],
                run: Callable[[list[str]], int]) -> int:
    """Fork the daemon of `request` (see `detached`); its pid."""
    argv, env = argv_env(request)
    umask = int(request["umask"])
    return detached(held, lambda: _become_daemon(argv, env, umask, run, ready_fd=fds[0],
                                                 log_fd=fds[1]))


def fork_attached(request: dict[str, Any], fds: list[int], held: tuple[Any, ...],
                  run: Callable[[list[str]], int]) -> int:
    """Fork the command of an ATTACHED request (see `detached`), or hand it to the spare;
    its pid."""
    pid = _hand_to_spare(request, fds)
    if pid:
        return pid
    argv, env = argv_env(request)
    umask, cwd = int(request["umask"]), str(request["cwd"])
    return detached(held, lambda: _become_attached(argv, env, umask, cwd, run, fds))


def fork_spare(held: tuple[Any, ...], run: Callable[[list[str]], int]) -> None:
    """Fork, now, the child the next ATTACHED request takes (`fork_attached`), unless one
    waits or $WEENV_SPARE is off: the server calls it when idle, after the preloads of the
    last request (the spare has what a child forked then would have). It waits for a
    request on its socket pair and then is that request's command; it exits when the
    server's end closes (the server exited) without one."""
    global _spare, _bad_switch_said
    if _spare is not None:
        return
    from weenvfs.switches import switched_off

    try:
        if switched_off(SPARE_SWITCH):
            return
    except Exception:  # noqa: BLE001 - a bad value is the server's log line, never its end
        if not _bad_switch_said:
            _bad_switch_said = True
            log.warning("$%s is neither on nor off: no spare", SPARE_SWITCH)
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = detached((*held, ours), lambda: _become_spare(theirs, run))
    except OSError as error:
        ours.close()
        log.warning("no spare: %s", error)
        return
    finally:
        theirs.close()
    _spare = (pid, ours)


def drop_spare() -> None:
    """Let the spare go (it exits): the server now holds what it lacks (a store client, an
    environment's indexes kept after a request), and the next spare is forked with them."""
    global _spare
    if _spare is not None:
        _spare[1].close()
        _spare = None


def has_spare() -> bool:
    """Whether a spare waits (or was forked and has not been handed a request)."""
    return _spare is not None


def _hand_to_spare(request: dict[str, Any], fds: list[int]) -> int:
    """Send `request` and its descriptors to the spare; its pid, or 0 when there is none or
    it did not take them (gone, or the request too large): the caller forks."""
    global _spare
    if _spare is None:
        return 0
    pid, ours = _spare
    _spare = None
    try:
        with ours:
            ours.sendmsg([json.dumps(request).encode()],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    except OSError as error:
        log.info("the spare %d did not take a request (%s): forking", pid, error)
        return 0
    return pid


def _become_spare(theirs: socket.socket, run: Callable[[list[str]], int]) -> None:
    """In the spare: wait for a request, then become its command (`_become_attached`)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the server's handler
    with contextlib.suppress(Exception):  # what `ps` shows until it takes a request
        import setproctitle

        setproctitle.setproctitle("weenv mountd: spare for the next weenv run")
    with contextlib.suppress(Exception):  # the faults the run would take
        from . import spare_pages  # loaded by the service (mountd.serve), as this process is

        spare_pages.prefault_if_learned()
    size = array.array("i").itemsize
    data, ancdata, _flags, _ = theirs.recvmsg(SPARE_REQUEST, socket.CMSG_SPACE(8 * size))
    fds = received_fds(ancdata)
    theirs.close()
    if not data:
        os._exit(0)  # the server exited: nothing to do
    request = json.loads(data)
    argv, env = argv_env(request)
    _become_attached(argv, env, int(request["umask"]), str(request["cwd"]), run, fds)


def argv_env(request: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """A request's arguments and environment, as strings whatever the JSON held."""
    return [str(a) for a in request["argv"]], request_env(request)


def request_env(request: dict[str, Any]) -> dict[str, str]:
    """A request's environment, as strings whatever the JSON held."""
    return {str(k): str(v) for k, v in request["env"].items()}


def fork_task(argv: list[str], held: tuple[Any, ...], run: Callable[[list[str]], int],
              request: dict[str, Any] | None = None) -> int:
    """Run `weenv ARGV` in a detached child of the server (its housekeeping), in the
    environment and umask of `request` if given; the child's pid (0 if none started)."""

    def task() -> None:
        if request is not None:
            take_over(argv, request_env(request), int(request["umask"]))
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        os._exit(run(argv))

    try:
        return detached(held, task)
    except OSError as error:
        log.warning("mount server housekeeping did not start: %s", error)
        return 0


def detached(held: tuple[Any, ...], body: Callable[[], None]) -> int:
    """Fork `body` into a session of its own; its pid. The caller (the server) reaps it
    once it exits (`reap_forked`, woken by `child_fds`) and never waits for it."""
    pid = os.fork()
    if pid:
        try:
            _children[pid] = os.pidfd_open(pid)
        except OSError:  # no pidfds (Linux before 5.3): the server's loop polls instead
            _children[pid] = -1
        return pid
    try:
        os.setsid()
        forget_children()
        for thing in held:  # the server's socket, connection and lock
            thing.close()
        body()
    except BaseException:  # noqa: BLE001 - a forked child must never return into the loop
        pass
    os._exit(70)


def forget_children() -> None:
    """In a process just forked from the server: close the server's pidfds of its other
    children (not this process's to hold or reap), and its end of the spare's socket pair
    (the spare must see it close when the server exits)."""
    global _spare
    for fd in _children.values():
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    _children.clear()
    if _spare is not None:
        _spare[1].close()
        _spare = None


def reap_forked() -> bool:
    """Reap the children of `detached` that have exited (the server's loop calls this; one is
    a zombie only until then); whether any child without a pidfd is still running (the loop
    then polls for it)."""
    for pid, fd in list(_children.items()):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            del _children[pid]
            if fd >= 0:
                os.close(fd)
    return any(fd < 0 for fd in _children.values())


def child_fds() -> list[int]:
    """A pidfd of each running child of `detached`: each becomes readable when its child
    exits, so the server's loop wakes to reap it."""
    return [fd for fd in _children.values() if fd >= 0]


def _become_daemon(argv: list[str], env: dict[str, str], umask: int,
                   run: Callable[[list[str]], int], ready_fd: int, log_fd: int) -> None:
    """In the forked daemon: the client's view of the world, then `weenv ARGV` in-process."""
    take_over(argv, env, umask)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for fd in (devnull, log_fd):
        os.close(fd)
    os.chdir("/")
    code = run([*argv, "--ready-fd", str(ready_fd)])
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def take_over(argv: list[str], env: dict[str, str], umask: int) -> None:
    """What a forked command takes from its client (its arguments, as `ps` shows them, its
    umask and environment), and none of the server's logging."""
    import setproctitle

    sys.argv = [sys.executable, "-m", "weenvfs", *argv]
    # What `ps` shows and what tools match on (else the server's command line); setproctitle
    # was set up in the server (mountd.py `_set_up_titles`). Bytes that are not UTF-8
    # (surrogate escapes in argv) are shown replaced: it takes UTF-8 only.
    title = " ".join(sys.argv).encode(errors="surrogateescape").decode(errors="replace")
    setproctitle.setproctitle(title)
    os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    root = logging.getLogger()
    for handler in list(root.handlers):  # the server's logging is not the command's
        root.removeHandler(handler)


def when_answered(action: Callable[[], None]) -> bool:
    """In a command the server forked for an attached client: run `action` in this process
    after the client got the exit status, with the client's stdio closed (no pipe waits
    for it) and no signal relayed; True. Anywhere else: False, and nothing is done."""
    if _after_answer is None:
        return False
    _after_answer.append(action)
    return True


def _release_stdio() -> None:
    """Point stdin, stdout and stderr at /dev/null: the client's pipes end here. (At exit the
    kernel closes a process's descriptors only after it has torn its memory down: ~4 ms for
    a command forked from the service, which a caller reading the pipes waited for.)"""
    devnull = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(devnull, target)
    os.close(devnull)


def _run_after_answer(actions: list[Callable[[], None]]) -> None:
    """The actions of `when_answered`, after the status line went out (stdio released)."""
    for action in actions:
        try:
            action()
        except Exception as error:  # noqa: BLE001 - the client has its answer already
            log.warning("after the command's answer: %s", error)


def _become_attached(argv: list[str], env: dict[str, str], umask: int, cwd: str,
                     run: Callable[[list[str]], int], fds: list[int]) -> None:
    """In the forked command: the client's stdio, folder, umask and environment, then `weenv
    ARGV` in-process, its exit status on the status pipe. A client that goes away (its end
    of the alive pipe closes) is taken as SIGTERM: the command cleans up as it would."""
    import threading

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    status, alive = fds[3], fds[4]
    for fd in (status, alive):
        os.set_inheritable(fd, False)
    global _after_answer
    _after_answer = []
    code = 125
    try:
        os.write(status, b"pid %d\n" % os.getpid())  # the client relays Ctrl-C from here
        take_over(argv, env, umask)
        os.chdir(cwd)

        def watch() -> None:
            with contextlib.suppress(OSError):
                os.read(alive, 1)  # returns once the client's end is closed
                Terminated.reasons[signal.SIGTERM] = CLIENT_GONE
                os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="client-watch", daemon=True).start()
        code = run(argv)
    except KeyboardInterrupt:  # relayed before `run` handles it: nothing started yet
        print("weenv: interrupted", file=sys.stderr)
        code = 128 + signal.SIGINT  # as the CLI reports Ctrl-C
    except Exception as error:  # the set-up failed (`run` reports its own errors)
        print(f"weenv: error: the node service could not start the command: {error}",
              file=sys.stderr)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        # The client relays no signal meant for the command past this, and its exit (the
        # client-watch's SIGTERM) must not cut short what this process does after the answer.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        with contextlib.suppress(OSError):
            _release_stdio()  # before the status: its reader finds the pipes ended too
        with contextlib.suppress(OSError):
            os.write(status, b"exit %d\n" % code)
    with contextlib.suppress(Exception):  # what the next spare writes ahead
        from . import spare_pages

        spare_pages.learn_if_due()
    if _after_answer:
        for fd in (status, alive):
            os.close(fd)
        _run_after_answer(_after_answer)
    os._exit(code)
