"""Ctrl-C at each step of `weenv run`, `weenv sandbox create` and `Environment.open` (issue 14).

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: here the command runs
in a process group of its own and gets `killpg(SIGINT)`, as from a terminal. Each test stops
the command at one step, deterministically, with what exists already: the store is served
over HTTP through tests/store/fault_proxy.py, whose `t` code stalls the first request of a
kind until the test ends, and the signal goes once the proxy has seen it:

- resolve: the command fetches the environment's tag or manifest;
- mount: a mount daemon fetches a group index (the daemon runs in a session of its own and
  gets no SIGINT: the command must stop it);
- setup: the first chunk read, which the sandbox's set-up makes through its overlay (the
  user lookup in /etc/passwd) before the init starts;
- exec: the command runs (it created a file in its sandbox);
- node service: no mount server answers, and the command's first mount starts one; the
  signal goes once that server's process exists (it may have answered by then: it then
  stays, as the node's resident service is meant to).

After each: exit 130 with one line `weenv: interrupted` and no traceback (the Python API
raises KeyboardInterrupt), and `node_clean` (conftest) finds nothing left: no sandbox state
folder, runc container, cgroup, mount, upper dir, loop device or process; and no mount daemon
of the environment runs. The node's mount server (`weenv mountd`) is resident by design and
stays. A hang guard fails a command that does not end before a timeout of its own (the
daemon's spawn or stop) could have ended it; not a timing check: the stall never ends while
the command runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rt_support import EnvRef
from support.processes import node_processes

from weenvfs.fuse import daemon, mountd
from weenvfs.runtime import sandbox, sandbox_state
from weenvfs.runtime.lower_modes import DEFAULT_LOWER
from weenvfs.runtime.lowers import plan_lowers
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store"))
from fault_proxy import FaultProxy  # noqa: E402 - tests/store is not on the path by itself
from http_server import RangeHTTPServer  # noqa: E402

pytestmark = pytest.mark.slow

STALL = 3600.0  # a stalled request is never answered while the command runs
# A Ctrl-C still unanswered after this waited for the spawn or a daemon exit to time out.
HANG_GUARD = min(daemon.SPAWN_TIMEOUT, daemon.EXIT_TIMEOUT) / 2
STEPS = {
    "resolve": r"^GET .*/(tags|manifests)/",
    "mount": r"^GET .*/indexes/",
    "setup": r"^GET .*/blobs/",
}
READY_FILE = "/tmp/weenv-test-ready"
READY_COMMAND = f"touch {READY_FILE}; exec sleep 1000"
# The Python API interrupted: KeyboardInterrupt reaches the caller, after the clean-up.
API = f"""
import sys
from weenvfs.runtime.environment import Environment
try:
    with Environment.open(sys.argv[1], store=sys.argv[2], cache=sys.argv[3]) as env:
        env.exec({READY_COMMAND!r})
except KeyboardInterrupt:
    print("KeyboardInterrupt", file=sys.stderr)
    sys.exit(130)
"""


class Served:
    """The test's environment read over HTTP through a fault proxy."""

    def __init__(self, env: EnvRef, proxy: FaultProxy) -> None:
        self.env, self.proxy = env, proxy
        self.url = proxy.url

    def stall(self, step: str) -> None:
        """Stall the first request of `step` (STEPS) until the test ends."""
        self.proxy.set_script("t", STEPS[step])

    def stalled(self) -> bool:
        return self.proxy.requests(code="t") > 0


@pytest.fixture
def served(env_ref: EnvRef, test_digests: set[str]) -> Iterator[Served]:
    with RangeHTTPServer(env_ref.store) as server, \
            FaultProxy(server.url, stall=STALL) as proxy:
        with open_store(proxy.url) as store:
            url = store.url
            indexes = [g.index for g in Repository(store).resolve_env(env_ref.digest)[1].groups]
        keys = [m.key for m in plan_lowers(env_ref.digest, indexes, DEFAULT_LOWER, url,
                                           env_ref.cache)]
        test_digests.update(keys)  # node_clean checks the mounts served from this URL too
        yield Served(env_ref, proxy)
        assert _daemons(keys) == [], "a mount daemon of the environment still runs"


def _daemons(keys: list[str]) -> list[int]:
    """Pids of mount daemons serving one of `keys`."""
    return [pid for key in keys for pid in _processes(key.encode())
            if b"--foreground" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`argv` in a process group of its own (a terminal's foreground job). A command still
    running at the hang guard gets SIGABRT: its Python threads' stacks go to stderr."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            process_group=0,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})


def _wait(until: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 120
    while not until():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"ended ({proc.returncode}) before {what}: {err!r}")
        assert time.monotonic() < deadline, f"never reached {what}"
        time.sleep(0.02)


def _interrupt(proc: subprocess.Popen[bytes]) -> tuple[str, str]:
    """Ctrl-C as a terminal sends it; the output once the command ended."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=HANG_GUARD)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate()
        raise AssertionError(f"still running {HANG_GUARD:g} s after Ctrl-C:\n"
                             f"{err.decode(errors='replace')}") from None
    return out.decode(errors="replace"), err.decode(errors="replace")


def _assert_interrupted(proc: subprocess.Popen[bytes], err: str, last: str) -> None:
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == last, err


@contextlib.contextmanager
def _running(argv: list[str], env: dict[str, str] | None = None
             ) -> Iterator[subprocess.Popen[bytes]]:
    proc = _start(argv, env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _weenv(served: Served, command: str, *args: str) -> list[str]:
    env = served.env
    return [sys.executable, "-m", "weenvfs", *command.split(), "--store", served.url,
            "--cache", str(env.cache), *args, env.ref]


def _api(served: Served) -> list[str]:
    env = served.env
    return [sys.executable, "-c", API, env.ref, served.url, str(env.cache)]


COMMANDS = {
    "run": lambda served: [*_weenv(served, "run"), "sh", "-c", READY_COMMAND],
    "sandbox create": lambda served: _weenv(served, "sandbox create"),
    "Environment.open": _api,
}
LAST_LINE = {"run": "weenv: interrupted", "sandbox create": "weenv: interrupted",
             "Environment.open": "KeyboardInterrupt"}


def _ready_file_seen() -> bool:
    """Whether the command of a sandbox of this node created READY_FILE (the upper layer
    holds it: the command runs)."""
    return any(Path(sandbox.SANDBOXES_ROOT).glob(f"*/rootfs{READY_FILE}"))


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("step", sorted(STEPS))
def test_interrupted_at_a_store_step_leaves_nothing(served: Served, command: str,
                                                    step: str) -> None:
    served.stall(step)
    with _running(COMMANDS[command](served)) as proc:
        _wait(served.stalled, proc, f"the {step} step")
        _, err = _interrupt(proc)
        _assert_interrupted(proc, err, LAST_LINE[command])


@pytest.mark.parametrize("command", ["run", "Environment.open"])
def test_interrupted_command_leaves_nothing(served: Served, command: str) -> None:
    with _running(COMMANDS[command](served)) as proc:
        _wait(_ready_file_seen, proc, "the command's start")
        _, err = _interrupt(proc)
        _assert_interrupted(proc, err, LAST_LINE[command])


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_interrupted_while_the_node_service_starts(served: Served, tmp_path: Path,
                                                   command: str) -> None:
    """No mount server answers: the command starts one (`weenv mountd`) before its first
    mount, and Ctrl-C comes while that server starts. Either the server is stopped, or it
    had answered already and stays, as the node's resident service is meant to."""
    sock = tmp_path / "mountd.sock"

    def server_starting() -> bool:
        return bool(_processes(f"{sock}.log".encode()))

    try:
        with _running(COMMANDS[command](served), {mountd.SOCKET_ENV: str(sock)}) as proc:
            _wait(server_starting, proc, "the start of the mount server")
            _, err = _interrupt(proc)
            if proc.returncode == 0:  # `sandbox create` completed before the signal
                _remove_created(served)
            else:
                _assert_interrupted(proc, err, LAST_LINE[command])
    finally:
        for pid in _processes(f"{sock}.log".encode()):  # the server, if it stayed
            os.kill(pid, signal.SIGTERM)
            daemon.wait_exit(pid, daemon.EXIT_TIMEOUT)


# `weenv run` whose Ctrl-C comes while a finalizer runs, just before it asks the node service:
# Python ignores an exception raised in a `__del__` (one of subprocess.Popen's did, while the
# client started the service: the Ctrl-C was lost and the command ran on).
SWALLOWED = """
import os, signal, sys
from weenvfs.entry import main
from weenvfs.fuse import node_socket

ask = node_socket.ask

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)

def interrupted_ask(request, fds):
    node_socket.ask = ask
    Finalized()  # finalized at once: the KeyboardInterrupt is raised in it, and ignored
    return ask(request, fds)

node_socket.ask = interrupted_ask
sys.argv = ["weenv", *sys.argv[1:]]
sys.exit(main())
"""


def test_a_ctrl_c_that_a_finalizer_swallowed_still_stops_the_run(served: Served) -> None:
    """The client notes Ctrl-C while it hands the run over, and relays it to the service's
    process once that has the run (hand_over.py `_interruptible`): the run stops, 130."""
    argv = [sys.executable, "-c", SWALLOWED, *COMMANDS["run"](served)[3:]]
    with _running(argv) as proc:
        try:
            _, err = proc.communicate(timeout=HANG_GUARD)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {HANG_GUARD:g} s after Ctrl-C") from None
        message = err.decode(errors="replace")
        assert "Exception ignored in" in message, message  # the finalizer did swallow it
        _assert_interrupted(proc, message.split("KeyboardInterrupt", 1)[-1],
                            LAST_LINE["run"])


def _processes(needle: bytes) -> list[int]:
    """Live processes whose command line holds `needle`, this one excepted."""
    return [proc.pid for proc in node_processes()
            if needle in proc.command and daemon.process_alive(proc.pid)]


def _remove_created(served: Served) -> None:
    for sandbox_id in sandbox_state.list_ids():
        box = sandbox.Sandbox.load(sandbox_id)
        if box.state["env"]["digest"] == served.env.digest:
            box.destroy()


def test_sigterm_while_resolving_ends_weenv_run_as_in_its_own_process(served: Served) -> None:
    """Before its sandbox exists a run stops on SIGTERM as every command does (cli.py:
    `Terminated`, status 128 + 15, one line); carried out by the node service
    (weenvfs/hand_over.py), the process the user signalled ends the same way, rather than
    reporting a lost status."""
    served.stall("resolve")
    with _running(COMMANDS["run"](served)) as proc:
        _wait(served.stalled, proc, "the resolve step")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_GUARD)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert err.strip().splitlines()[-1] == b"weenv: terminated by SIGTERM", err
        assert b"Traceback" not in err and b"exit status" not in err, err
