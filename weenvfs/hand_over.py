"""A command the node service carries out for this process (entry.HAND_OVER: `weenv run` and
`weenv pull`), this process only its stand-in.

A warm `weenv run` spent most of its fixed cost before the sandbox even started: the
interpreter's start and the imports of the runtime (about 60 ms), then a fork of the node
service to resolve the reference in the store (about 40 ms), on a 2-core node ~0.2 s of CPU
per run (docs/benchmarks.md). The node service (`weenv mountd`, fuse/mountd.py) has all of
that loaded, and a store client made. So `weenv run` hands its whole argument list to the
service, which forks a process that runs the command exactly as this process would have:
with this process's stdin, stdout and stderr (passed over the socket), working folder,
umask and environment. This process then only waits for its exit status and passes on the
signals it gets (Ctrl-C, SIGTERM, SIGHUP), so the command cleans up as it would here. If
this process goes away (kill -9), the command sees its end of a pipe close and cleans up as
for SIGTERM. Parsing the arguments is the command's: a bad option is reported by it, on
this process's stderr, with the same exit status.

`delegate` returns None when the service does not take it (no service and none may be
started, WEENV_MOUNTD=off or WEENV_NODE_RUN=off, not root, a declined request): the caller
then runs the command itself (also for `-h`/`--help` and from a deleted working folder).
Once the service took it, the command is never run twice: a service child that ends without
a status dies, as this process then does, of the SIGTERM or SIGHUP relayed to it before its
clean-up was set up; otherwise that is an error (EXIT_LOST).

`weenv pull` goes the same way for the same reason: in its own process it
spent ~125 ms importing grpc and the registry client before its first request and ~70 ms
shutting grpc down after its last, of a cold pull's ~0.55 s; where containerd is installed
the service has those modules loaded (cli.service_modules) and its child ends with
`os._exit`. Only `weenv run` names an owner (`--owner-pid`): a pull leaves no sandbox.

native/weenv-launch.c (the `weenv` of a setup.sh install) does what `delegate` does for `weenv
run` and `weenv pull`, in C, before any Python starts: the same request, byte for byte, the
same descriptors, signal relay and exit status (tests/test_launcher.py compares them); a
change here goes there.

Must not: import anything but fuse/node_socket.py at start-up (the point is not to: a test
lists what a handed-over run imports), or interpret the arguments beyond finding the
command's name (cli.py does that).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence

from weenvfs.fuse import node_socket
from weenvfs.switches import problem, switched_off

SWITCH_ENV = "WEENV_NODE_RUN"  # "off": every `weenv run` and `pull` runs in its own process
EXIT_LOST = 125  # as `docker run` when the daemon fails: the command's own status is unknown
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def hand_over(argv: Sequence[str], at: int) -> int | None:
    """`weenv run` or `weenv pull` carried out by the node service: its exit status, or None
    to run the command in this process (entry.main calls this before anything else is
    imported: entry.HAND_OVER). A switch set to neither on nor off is a usage error (2)."""
    for switch in (SWITCH_ENV, node_socket.SWITCH_ENV):
        wrong = problem(switch)
        if wrong is not None:
            print(f"weenv: error: {wrong}", file=sys.stderr)
            return 2
    return delegate(argv, at) if wanted(argv) else None


def wanted(argv: Sequence[str]) -> bool:
    """Whether to ask the node service for `weenv ARGV`: enabled, root (a sandbox and
    containerd's socket need it; a user's error comes from the command run here, as before),
    no `-h`/`--help` anywhere (help must not start a service; when the word belongs to the
    sandbox's command, that run merely goes the slower way), and a working folder that
    still exists (the service's process could not enter a deleted one)."""
    if (switched_off(SWITCH_ENV) or not node_socket.enabled()
            or os.geteuid() != 0 or any(word in ("-h", "--help") for word in argv)):
        return False
    try:
        os.getcwd()
    except OSError:
        return False
    return True


def delegate(argv: Sequence[str], at: int) -> int | None:
    """Have the node service run `weenv ARGV` (the command at `argv[at]`) attached to this
    process; its exit status, or None if the service did not take it (see the module). A
    sandbox's owner is this process (`--owner-pid`): the one its user sees, signals and
    waits for."""
    owner = ["--owner-pid", str(os.getpid())] if argv[at] == "run" else []
    argv = [*argv[:at + 1], *owner, *argv[at + 1:]]
    open_standard_fds()
    status_read, status_write = os.pipe()
    alive_read, alive_write = os.pipe()
    interrupted: list[int] = []
    try:
        try:
            taken = _interruptible(interrupted, lambda: _attach(
                argv, [0, 1, 2, status_write, alive_read]))
        finally:
            os.close(status_write)
            os.close(alive_read)
        if not taken:
            if interrupted:  # a Ctrl-C that something on the way swallowed
                raise KeyboardInterrupt
            return None
        return _wait(status_read, interrupted)
    finally:
        os.close(status_read)
        os.close(alive_write)  # the command's watch ends here: it has exited, or must


def open_standard_fds() -> None:
    """Open /dev/null on whichever of stdin, stdout and stderr is closed (read-only for
    stdin), as the command would see a closed one: else the pipes made next would take those
    numbers and be passed on as the command's stdio (its `cat` then read the status pipe, and
    the run hung)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if opened != fd:  # a lower one was closed too: it is filled in its own turn
                os.dup2(opened, fd)
                os.close(opened)


def _attach(argv: list[str], fds: list[int]) -> bool:
    """Whether the node service took `weenv ARGV` with `fds` (see mountd.ATTACHED). Only
    when no service answers does this process import the service's own module, which starts
    one and asks again (a cold node's first run)."""
    request = node_socket.request_line(argv, node_socket.ATTACHED, cwd=os.getcwd())
    answer = node_socket.ask(request, fds)
    if answer is not None:
        return answer == b"ok"
    from weenvfs.fuse import mountd

    return mountd.launch_attached(argv, fds)


def _interruptible(interrupted: list[int], attach: Callable[[], bool]) -> bool:
    """`attach()`, a Ctrl-C during it raising KeyboardInterrupt as usual and also noted in
    `interrupted`: Python ignores an exception raised in a finalizer (a Popen's `__del__`
    while the service starts), so the Ctrl-C would be lost and the command, once taken, run
    on with nobody to stop it. The caller relays a noted one to the command."""

    def note(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, note)
    try:
        return attach()
    finally:
        signal.signal(signal.SIGINT, old)


def _kill(pid: int, signum: int) -> None:
    try:  # noqa: SIM105 - contextlib is not among the cheap imports (node_socket.py)
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _wait(status_read: int, received: list[int]) -> int:
    """Relay signals to the command until its status line arrives (`received` those that
    came before, relayed once its pid is known). None arrives when the command died of a
    SIGTERM or SIGHUP relayed before it set up its clean-up (as this process would have,
    running it): this process then dies of it too; else EXIT_LOST."""
    pid = 0

    def relay(signum: int, _frame: object) -> None:
        received.append(signum)
        if pid:
            _kill(pid, signum)

    old = {s: signal.signal(s, relay) for s in FORWARDED}
    try:
        data = b""
        while True:
            part = os.read(status_read, 4096)  # retried after a relayed signal (PEP 475)
            if not part:
                break
            data += part
            lines = data.split(b"\n")
            for line in lines[:-1]:
                if line.startswith(b"pid ") and not pid:
                    pid = int(line[4:])
                    for signum in received:
                        _kill(pid, signum)
                elif line.startswith(b"exit "):
                    return int(line[5:])
            data = lines[-1]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    fatal = [s for s in received if s != signal.SIGINT]
    if fatal:
        signal.signal(fatal[-1], signal.SIG_DFL)
        os.kill(os.getpid(), fatal[-1])
        return 128 + fatal[-1]
    print("weenv: error: the node service's run of this command ended without an exit "
          "status (see `weenv mountd --check` and its log)", file=sys.stderr)
    return EXIT_LOST
