"""`weenv run` carried out by the node service (weenvfs/hand_over.py, fuse/mountd.py ATTACHED):
the command gets this process's stdin, stdout, stderr, working folder and exit status; a bad
option is reported as before; a client killed with SIGKILL leaves nothing behind; with
WEENV_NODE_RUN=off the client runs it itself. (SIGTERM and Ctrl-C relayed to the service's
process are the tests of test_cleanup.py and test_interrupts.py, which now go this way.)
Every test runs with both clients a user's `weenv` may be: the Python entry point and the
native launcher setup.sh installs (native/weenv-launch.c; its own tests: test_launcher.py).

Real sandboxes, mounts and the session's node service (tests/conftest.py)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rt_support import EnvRef, owned_by, started_run

from weenvfs.fuse import daemon
from weenvfs.fuse.service_forks import CLIENT_GONE
from weenvfs.runtime import sandbox_state
from weenvfs.runtime.sandbox import Sandbox

WAIT = 60.0  # a safety bound, not a timing
SCRIPT = "read line; echo \"out:$line\"; echo err >&2; exit 7"


Run = Callable[..., subprocess.CompletedProcess[bytes]]


@pytest.fixture(params=["python", "native"])
def client(request: pytest.FixtureRequest) -> list[str]:
    """`weenv` as the user starts it: the Python entry point or the native launcher."""
    if request.param == "python":
        return [sys.executable, "-m", "weenvfs"]
    return [str(request.getfixturevalue("launcher"))]


@pytest.fixture
def _weenv(client: list[str]) -> Run:
    def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*client, *args], input=stdin, capture_output=True, cwd=cwd,
                              env=env, timeout=WAIT, check=False)

    return run


def _by_service(stderr: bytes) -> bool:
    return b"run by the node service for process" in stderr


def test_the_node_service_runs_it_with_this_processs_stdio_folder_and_status(
    env_ref: EnvRef, _weenv: Run,
) -> None:
    # A relative --store: the service's process works in this process's folder.
    done = _weenv("-v", "run", "--store", env_ref.store.name, "--cache", str(env_ref.cache),
                  env_ref.ref, "/bin/sh", "-c", SCRIPT, cwd=env_ref.store.parent,
                  stdin=b"hello\n")
    assert done.returncode == 7, done.stderr
    assert done.stdout == b"out:hello\n"
    assert b"err\n" in done.stderr
    assert _by_service(done.stderr)


def test_the_pipes_of_the_command_have_ended_when_the_client_exits(
    warm_root: Path, env_ref: EnvRef, client: list[str], _weenv: Run,
) -> None:
    """Nothing holds the client's stdout and stderr once it has the exit status: the
    service's process lets go of them before it sends the status (a caller reading the pipes
    to their end, as subprocess.run with capture_output does, never waits for that process's
    own exit, or for what it does after the answer: with mounts kept warm and no parking,
    the run asks for the node's eviction then, `service_forks.when_answered`)."""
    argv = ["-v", "run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
            env_ref.ref, "/bin/sh", "-c", "echo out"]
    assert _by_service(_weenv(*argv).stderr)  # the service runs with this code now
    proc = subprocess.Popen([*client, *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.wait(timeout=WAIT) == 0
    read = []
    for pipe in (proc.stdout, proc.stderr):
        assert pipe is not None
        os.set_blocking(pipe.fileno(), False)
        data = b""
        while chunk := pipe.read():  # None: no data now, and a writer still holds the pipe
            data += chunk
        pipe.close()
        assert chunk == b"", "a writer still held the pipe after the client exited"
        read.append(data)
    assert read[0] == b"out\n" and _by_service(read[1])


def test_switched_off_the_client_runs_it_itself(env_ref: EnvRef, _weenv: Run) -> None:
    env = {**os.environ, "WEENV_NODE_RUN": "off"}
    done = _weenv("-v", "run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
                  env_ref.ref, "/bin/sh", "-c", SCRIPT, env=env, stdin=b"hello\n")
    assert (done.returncode, done.stdout) == (7, b"out:hello\n"), done.stderr
    assert not _by_service(done.stderr)


def test_a_bad_option_is_reported_as_before(env_ref: EnvRef, _weenv: Run) -> None:
    done = _weenv("run", "--store", str(env_ref.store), "--no-such-option", env_ref.ref,
                  "true")
    assert done.returncode == 2
    assert b"unrecognized arguments: --no-such-option" in done.stderr
    assert b"Traceback" not in done.stderr


def test_a_client_killed_with_sigkill_leaves_nothing(env_ref: EnvRef, client: list[str]) -> None:
    """The service's process sees the client's end of its alive pipe close and cleans up
    as for SIGTERM: sandbox, its processes and its mount go."""
    with started_run([*client, "run", "--store", str(env_ref.store), "--cache",
                      str(env_ref.cache), env_ref.ref, "/bin/sh", "-c",
                      "echo started; sleep 1000"]) as child:
        owned = owned_by(child.pid)
        assert len(owned) == 1  # owned by the client, the process its user sees
        box = Sandbox.load(owned[0])
        pids = box.processes()
        assert pids
        child.kill()
        child.wait(WAIT)
    deadline = time.monotonic() + WAIT
    while sandbox_state.exists(box.id) or any(daemon.process_alive(p) for p in pids):
        assert time.monotonic() < deadline, "the sandbox outlived its killed client"
        time.sleep(0.05)
    while daemon.is_mounted(env_ref.mountpoint()):  # released with the sandbox (keep-warm 0)
        assert time.monotonic() < deadline, "the mount outlived the sandbox"
        time.sleep(0.05)
    # Said as what happened (on the client's stderr, which a terminal still shows), not as a
    # SIGTERM nobody sent.
    assert child.stderr is not None
    assert child.stderr.read().decode().splitlines() == [f"weenv: {CLIENT_GONE}"]


def test_signals_reach_the_command_through_the_client(env_ref: EnvRef,
                                                     client: list[str]) -> None:
    """SIGHUP to the client ends the run as it would in-process (exit 129, sandbox gone)."""
    with started_run([*client, "run", "--store", str(env_ref.store), "--cache",
                      str(env_ref.cache), env_ref.ref, "/bin/sh", "-c",
                      "echo started; sleep 1000"]) as child:
        child.send_signal(signal.SIGHUP)
        assert child.wait(WAIT) == 128 + signal.SIGHUP
        assert child.stderr is not None
        assert child.stderr.read().decode().strip().endswith("weenv: terminated by SIGHUP")
    assert not owned_by(child.pid)


def test_a_missing_store_is_one_clear_line(tmp_path: Path, _weenv: Run) -> None:
    """Checked only when the reference does not resolve (environment.py): the store's own
    error, not "no such environment", on the client's stderr."""
    done = _weenv("run", "--store", str(tmp_path / "no-store"), "env:1", "true")
    assert done.returncode != 0
    assert done.stderr.decode().strip().splitlines() == [
        f"weenv: error: store file://{tmp_path / 'no-store'}: directory "
        f"{tmp_path / 'no-store'} does not exist"]


def test_a_deleted_working_folder_runs_it_here(env_ref: EnvRef, tmp_path: Path,
                                               client: list[str]) -> None:
    """The service's process could not enter it: the client runs the command itself."""
    script = (f"mkdir {tmp_path}/gone && cd {tmp_path}/gone && rmdir {tmp_path}/gone && "
              f"exec {shlex.join(client)} -v run --store {env_ref.store} "
              f"--cache {env_ref.cache} {env_ref.ref} /bin/echo ok")
    done = subprocess.run(["/bin/sh", "-c", script], capture_output=True, timeout=WAIT,
                          check=False)
    assert (done.returncode, done.stdout) == (0, b"ok\n"), done.stderr
    assert not _by_service(done.stderr)


def test_a_closed_stdin_is_an_empty_one_and_never_hangs(env_ref: EnvRef,
                                                       client: list[str]) -> None:
    """A client started with stdin (or stdout) closed: the command reads EOF (writes go
    nowhere) as in-process, instead of being handed the client's own status pipe."""
    run = [*client, "run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
           env_ref.ref, "/bin/sh", "-c"]

    def closed(which: str, script: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["/bin/sh", "-c", f'exec "$@" {which}&-', "sh", *run, script],
                              capture_output=True, timeout=WAIT, check=False)

    done = closed("<", "cat; echo read:$?; exit 5")
    assert (done.returncode, done.stdout) == (5, b"read:0\n"), done.stderr
    done = closed(">", "echo lost; exit 6")
    assert done.returncode == 6, done.stderr


@pytest.mark.parametrize("switch", ["on", "off"])
def test_names_that_are_not_utf8_reach_the_service_unchanged(env_ref: EnvRef, tmp_path: Path,
                                                            switch: str, client: list[str]
                                                            ) -> None:
    """Arguments, working folder and environment go to the service as JSON text (surrogate
    escapes) and must come back as the same bytes: a store found by a name that is not UTF-8,
    relative to a folder whose name is not UTF-8 either."""
    folder = os.path.join(os.fsencode(tmp_path), b"work-\xff\xc3")
    os.mkdir(folder)
    os.symlink(os.fsencode(env_ref.store), os.path.join(folder, b"store-\xfe"))
    env = {**os.environb, b"WEENV_TEST_RAW": b"v\xff\xfe", b"WEENV_NODE_RUN": switch.encode()}
    done = subprocess.run(
        [*map(os.fsencode, client), b"-v", b"run", b"--store",
         b"store-\xfe", b"--cache", os.fsencode(env_ref.cache), env_ref.ref.encode(),
         b"/bin/echo", b"ok"],
        cwd=folder, env=env, capture_output=True, timeout=WAIT, check=False)
    assert (done.returncode, done.stdout) == (0, b"ok\n"), done.stderr
    assert _by_service(done.stderr) == (switch == "on")


PRELOADED_RUN = """
import sys
from weenvfs import cli
from weenvfs.fuse.service_loading import preload_steps
for _what, action, _by in preload_steps(cli.SERVICE_MODULES, cli.prebuild_parsers,
                                        cli.pull_modules()):
    action()
before = set(sys.modules)
code = cli.main(sys.argv[1:])
print(" ".join(sorted(m for m in set(sys.modules) - before if m.startswith("weenvfs"))))
sys.exit(code)
"""


def test_a_run_in_the_services_fork_imports_nothing_the_service_did_not_load(
        env_ref: EnvRef) -> None:
    """What the node service loads before it forks (fuse/mountd.py `serve`'s preload, as
    commands.py gives it) is all a `weenv run` in its fork imports: a first run of the
    reference on the node and the next one (which starts from the tag's last answer,
    runtime/tag_guess.py). The sandbox's modules once went unlisted, and every warm run's
    fork imported 19 of them (~37 ms)."""
    argv = [sys.executable, "-c", PRELOADED_RUN, "run", "--store", str(env_ref.store),
            "--cache", str(env_ref.cache), env_ref.ref, "true"]
    for _ in range(2):
        done = subprocess.run(argv, capture_output=True, timeout=WAIT, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode().split() == []
