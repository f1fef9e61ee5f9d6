"""Standby sandboxes (weenvfs/runtime/standby.py, native/weenv-standby.c): after a run that
parked its root, the node service starts the root's next sandbox ahead; the next run like it
hands its command over and gets exactly what a sandbox started for it would have given
(user, capabilities, filter, limits, namespaces, streams, status), one that does not fit
discards it, and nothing of a standby outlives its parked root.

Real sandboxes, crun, cgroups and the test's own node service (`parked_env`). The command
tells which init it ran under: /proc/1/cmdline is the standby program or catatonit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from rt_support import EnvRef, owned_by, run_weenv, started_run
from support.polling import wait_for

from weenvfs.fuse import daemon
from weenvfs.runtime import standby
from weenvfs.runtime.cgroups import cgroup_dirs
from weenvfs.runtime.crun import CRUN_ROOT
from weenvfs.runtime.launcher import INIT_PATH
from weenvfs.runtime.sandbox import Sandbox
from weenvfs.runtime.sandbox_state import SANDBOXES_ROOT, read_state

WAIT = 60.0  # a safety bound, not a timing
# Which init the command ran under, on stderr: catatonit's command line is INIT_PATH -- ARGV,
# the standby's INIT_PATH alone (the same program path: the same /dev).
INIT = "echo init:$(tr '\\0' ' ' </proc/1/cmdline | cut -d' ' -f2) >&2"
STANDBY, CATATONIT = "init:", "init:--"
# What a command sees of its sandbox, but for its init: identity, capabilities, the filter,
# limits, its process group, cgroup, devices, namespaces' contents. Its processes are counted
# by the shell itself: `ls /proc | grep -c` counted its own pipeline's, one more or fewer as
# they were scheduled (a CI failure).
PROBE = ("hostname; id; pwd; ulimit -n; ulimit -u; "
         "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp(_filters)?):' "
         "/proc/self/status; cut -d' ' -f1,5 /proc/self/stat; cut -d: -f2- /proc/self/cgroup "
         "| sort; ls -A /dev /dev/shm; ip -o link 2>/dev/null | cut -d: -f2; "
         "set -- /proc/[0-9]*; echo $#; env | sort")


@pytest.fixture(autouse=True)
def _receiver(require_or_skip: Callable[[object, str], None]) -> None:
    require_or_skip(standby.receiver(), f"{standby.RECEIVER} is not built (scripts/setup.sh)")


def _run(env: EnvRef, *command: str, options: tuple[str, ...] = (), check: bool = True,
         extra_env: dict[str, str] | None = None,
         stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*_client(), "run", "--store", str(env.store), "--cache", str(env.cache), *options,
         env.ref, *command], input=stdin, capture_output=True, timeout=WAIT, check=check,
        env={**os.environ, **(extra_env or {})})


def _client() -> list[str]:
    return [sys.executable, "-m", "weenvfs"]  # handed to the test's node service


def _init_of(done: subprocess.CompletedProcess[bytes]) -> str:
    """The init program the run's command saw (its stderr's last line)."""
    return done.stderr.decode().strip().splitlines()[-1]


def _parked_id(env: EnvRef) -> str:
    [found] = [p.name for p in SANDBOXES_ROOT.iterdir() if _state(p.name).get("status") ==
               "parked" and _state(p.name).get("mounts") == list(env.keys)]
    return found


def _state(sandbox_id: str) -> dict[str, Any]:
    try:
        return dict(read_state(SANDBOXES_ROOT / sandbox_id))
    except (OSError, ValueError):
        return {}


def _standby(env: EnvRef, other_than: int | None = None) -> tuple[str, dict[str, Any]]:
    """The parked root over `env` and its standby's record, once the service made one (with
    an init other than `other_than`)."""
    def made() -> tuple[str, dict[str, Any]] | None:
        for path in SANDBOXES_ROOT.iterdir():
            state = _state(path.name)
            record = state.get("standby")
            if (state.get("status") == "parked" and state.get("mounts") == list(env.keys)
                    and record and record["pid"] != other_than):
                return path.name, record
        return None

    return wait_for(made, "a standby after the run", WAIT)


def _wait_exec(pid: int) -> None:
    """Wait until the standby's init process runs the receiver: `crun run --detach` answers
    (and its pid file names the init) a moment before its child's exec, when /proc still
    shows the runtime's own command line (seen on a slower machine)."""
    receiver = str(standby.receiver())
    wait_for(lambda: os.path.samefile(f"/proc/{pid}/exe", receiver), "the standby's exec",
             WAIT)


def test_the_next_run_runs_in_the_standby_and_sees_the_sandbox_a_run_makes(
        parked_env: EnvRef) -> None:
    first = _run(parked_env, "sh", "-c", f"hostname; {INIT}")
    assert _init_of(first) == CATATONIT  # the first run started its own sandbox
    root, record = _standby(parked_env)
    assert root == first.stdout.decode().strip()
    # Waiting: its init is the receiver, in the sandbox's cgroup, its runtime's container.
    _wait_exec(record["pid"])
    with open(f"/proc/{record['pid']}/cmdline", "rb") as f:
        assert f.read() == INIT_PATH.encode() + b"\0"
    box = Sandbox.load(root)
    assert box.processes() == [record["pid"]] and (CRUN_ROOT / root).is_dir()
    assert os.stat(record["socket"]).st_mode & 0o7777 == 0o600  # root's only
    listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)["sandboxes"]
    assert [(b["status"], b["standby"]) for b in listed if b["id"] == root] == [
        ("parked", record["pid"])]

    seen = _run(parked_env, "sh", "-c", f"{PROBE}; {INIT}")
    assert _init_of(seen) == STANDBY
    assert not daemon.process_alive(record["pid"])  # used once, then gone
    root_again, again = _standby(parked_env, other_than=record["pid"])  # and made anew
    assert root_again == root
    plain = _run(parked_env, "sh", "-c", f"{PROBE}; {INIT}",
                 extra_env={standby.SWITCH: "off"})
    assert _init_of(plain) == CATATONIT  # switched off: the run used none and made none
    assert not daemon.process_alive(again["pid"])
    assert seen.stdout == plain.stdout and seen.stdout.startswith(root.encode())
    assert _init_of(_run(parked_env, "sh", "-c", INIT)) == CATATONIT


def test_streams_status_options_and_signals_are_those_of_any_run(parked_env: EnvRef) -> None:
    _run(parked_env, "true")
    cases: list[tuple[tuple[str, ...], tuple[str, ...], bytes, int, bytes]] = [
        ((), ("sh", "-c", f"read l; echo out:$l; echo err >&2; {INIT}; exit 7"),
         b"in\n", 7, b"out:in\n"),
        ((), ("sh", "-c", f"{INIT}; kill -9 $$"), b"", 137, b""),
        ((), ("sh", "-c", f"{INIT}; kill -TERM $$"), b"", 143, b""),
        ((), ("sh", "-c", f"{INIT}; head -c 3000000 /dev/zero | tr '\\0' x"), b"", 0,
         b"x" * 3_000_000),
        (("-w", "/tmp", "-e", "WHO=me"), ("sh", "-c", f"echo $PWD $WHO; {INIT}"), b"", 0,
         b"/tmp me\n"),
        ((), ("sh", "-c", f"{INIT}; cat"), b"", 0, b""),  # stdin at its end, never a hang
        (("-e", os.fsdecode(b"V=\xe9t\xe9")), ("sh", "-c", f'{INIT}; printf %s "$1$V"', "sh",
                                                os.fsdecode(b"caf\xe9")), b"", 0,
         b"caf\xe9\xe9t\xe9"),  # bytes that are not UTF-8, unchanged
    ]
    for options, command, stdin, status, out in cases:
        _standby(parked_env)
        done = _run(parked_env, *command, options=options, stdin=stdin, check=False)
        assert (done.returncode, done.stdout) == (status, out), (command, done.stderr)
        assert _init_of(done) == STANDBY, command
        assert b"Traceback" not in done.stderr
    missing = _run(parked_env, "no-such-command", check=False)
    assert missing.returncode == 127 and b"command not found" in missing.stderr


def test_a_bad_switch_value_is_one_line_before_anything_runs(parked_env: EnvRef) -> None:
    done = _run(parked_env, "sh", "-c", "echo ran", check=False,
                extra_env={standby.SWITCH: "maybe"})
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr == (f"weenv: error: ${standby.SWITCH} is 'maybe': set it to on or off "
                           "(or unset it)\n").encode()


@pytest.mark.parametrize("option", [("--user", "nobody"), ("--memory", "100m"),
                                    ("--network", "host"),
                                    ("--security-opt", "seccomp=unconfined")])
def test_a_run_the_standby_does_not_fit_discards_it_and_the_next_like_it_fits(
        parked_env: EnvRef, option: tuple[str, ...]) -> None:
    _run(parked_env, "true")
    _, record = _standby(parked_env)
    other = _run(parked_env, "sh", "-c", f"id -un; {PROBE}; {INIT}", options=option)
    assert _init_of(other) == CATATONIT  # its own sandbox, as without standbys
    assert not daemon.process_alive(record["pid"])
    expected = b"nobody\n" if option[0] == "--user" else b"root\n"
    assert other.stdout.startswith(expected)
    _, mine = _standby(parked_env, other_than=record["pid"])  # made for runs like it
    fits = _run(parked_env, "sh", "-c", f"id -un; {PROBE}; {INIT}", options=option)
    assert (fits.stdout, _init_of(fits)) == (other.stdout, STANDBY)  # the same sandbox
    assert not daemon.process_alive(mine["pid"])
    _, record = _standby(parked_env, other_than=mine["pid"])
    plain = _run(parked_env, "sh", "-c", f"id -un; {INIT}")  # and back again
    assert (plain.stdout, _init_of(plain)) == (b"root\n", CATATONIT)


def test_a_run_outside_the_node_service_uses_a_standby_and_makes_none(
        parked_env: EnvRef) -> None:
    """It would pay for one before its own exit. The runtime's record of the standby it used
    stays with the parked root until whoever starts it next deletes it (here the next run,
    which then starts its own sandbox)."""
    _run(parked_env, "true")
    root, record = _standby(parked_env)
    alone = _run(parked_env, "sh", "-c", f"hostname; {INIT}",
                 extra_env={"WEENV_NODE_RUN": "off"})
    assert alone.stdout.decode().strip() == root and _init_of(alone) == STANDBY
    assert _state(root)["status"] == "parked" and "standby" not in _state(root)
    assert (CRUN_ROOT / root).is_dir() and not daemon.process_alive(record["pid"])
    after = _run(parked_env, "sh", "-c", f"hostname; {INIT}")
    assert after.stdout.decode().strip() == root and _init_of(after) == CATATONIT
    _standby(parked_env)


def test_a_standby_whose_init_died_is_not_used_and_leaves_nothing(parked_env: EnvRef) -> None:
    _run(parked_env, "true")
    root, record = _standby(parked_env)
    os.kill(record["pid"], signal.SIGKILL)
    wait_for(lambda: not daemon.process_alive(record["pid"]), "the init's death", WAIT)
    done = _run(parked_env, "sh", "-c", f"hostname; {INIT}")
    assert done.stdout.decode().strip() == root and _init_of(done) == CATATONIT


@pytest.mark.parametrize("fault", ["stopped", "taken", "socket gone"])
def test_a_standby_that_does_not_take_the_command_is_discarded_and_the_run_goes_on(
        parked_env: EnvRef, fault: str) -> None:
    """Its init stopped (the run waits HANDSHAKE_SECONDS for its answer, never longer),
    someone else connected first, or its socket removed: the run starts its own sandbox."""
    _run(parked_env, "true")
    root, record = _standby(parked_env)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
        if fault == "stopped":
            os.kill(record["pid"], signal.SIGSTOP)
        elif fault == "taken":
            first.connect(record["socket"])
        else:
            os.unlink(record["socket"])
        done = _run(parked_env, "sh", "-c", f"hostname; {INIT}")
    assert done.stdout.decode().strip() == root and _init_of(done) == CATATONIT
    wait_for(lambda: not daemon.process_alive(record["pid"]), "the discarded init's end", WAIT)


def test_the_python_api_leaves_a_standby_for_the_next_run(parked_env: EnvRef) -> None:
    """An API sandbox would have to discard the standby (its init is `catatonit -P`): it
    makes a root of its own and leaves the parked one, standby and all, to the next run."""
    from weenvfs.runtime.environment import Environment

    _run(parked_env, "true")
    root, record = _standby(parked_env)
    with Environment.open(parked_env.ref, store=parked_env.store,
                          cache=parked_env.cache) as env:
        assert env.sandbox.id != root
        assert daemon.process_alive(record["pid"])
        assert _parked_id(parked_env) == root and _state(root).get("standby") == record
        done = env.exec(["sh", "-c", "cat /proc/1/cmdline"])
        assert done.ok and done.stdout.split(b"\0")[:2] == [INIT_PATH.encode(), b"-P"]
    done = _run(parked_env, "sh", "-c", f"hostname; {INIT}")
    assert done.stdout.decode().strip() == root and _init_of(done) == STANDBY


def test_a_client_killed_during_its_command_leaves_no_process(parked_env: EnvRef) -> None:
    _run(parked_env, "true")
    root, record = _standby(parked_env)
    with started_run([*_client(), "run", "--store", str(parked_env.store), "--cache",
                      str(parked_env.cache), parked_env.ref, "sh", "-c",
                      "echo started; sleep 1000"]) as child:
        pids = Sandbox.load(root).processes()
        assert record["pid"] in pids and len(pids) >= 2  # the init and the command
        child.kill()
        child.wait(WAIT)
    wait_for(lambda: not any(daemon.process_alive(p) for p in pids), "the command's end", WAIT)
    wait_for(lambda: not owned_by(child.pid), "the run's cleanup", WAIT)


def test_sigterm_to_the_client_ends_a_command_in_a_standby_as_any_run(
        parked_env: EnvRef) -> None:
    _run(parked_env, "true")
    _standby(parked_env)
    with started_run([*_client(), "run", "--store", str(parked_env.store), "--cache",
                      str(parked_env.cache), parked_env.ref, "sh", "-c",
                      f"{INIT}; echo started; sleep 1000"]) as child:
        child.send_signal(signal.SIGTERM)
        assert child.wait(WAIT) == 128 + signal.SIGTERM
        assert child.stderr is not None
        said = child.stderr.read().decode()
        assert said.startswith(STANDBY + "\n") and said.strip().endswith("terminated by SIGTERM")
    assert not owned_by(child.pid)


def _request(argv: list[bytes], env: list[bytes], cwd: bytes = b"/", *,
             magic: bytes = standby.MAGIC, counts: tuple[int, int] | None = None) -> bytes:
    payload = b"".join(s + b"\0" for s in [cwd, *argv, *env])
    argc, envc = counts or (len(argv), len(env))
    return magic + struct.pack("<III", argc, envc, len(payload)) + payload


@pytest.mark.parametrize("request_bytes, fds, refusal", [
    (_request([b"/bin/true"], [], magic=b"XXXX"), 3, "no request"),
    (_request([b"/bin/true"], []), 0, "the request lacks its three streams"),
    (_request([], [b"A=1"]), 3, "a request out of bounds"),
    (_request([b"/bin/true"], [b"A=1"], counts=(1, 2)), 3,
     "a request with fewer strings than it says"),
    (_request([b"/bin/true", b"x"], [b"A=1"], counts=(1, 1)), 3,
     "a request with more strings than it says"),
    (standby.MAGIC + struct.pack("<III", 1, 0, 100) + b"/\0/bin/true\0", 3,
     "the request ended early"),
])
def test_a_bad_request_is_refused_in_one_line_and_runs_nothing(
        parked_env: EnvRef, request_bytes: bytes, fds: int, refusal: str) -> None:
    _run(parked_env, "true")
    root, record = _standby(parked_env)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(record["socket"])
        head, rest = request_bytes[:16], request_bytes[16:]
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("3i", 0, 1, 2))]
        connection.sendmsg([head], ancillary if fds else [])
        if refusal == "the request ended early":
            connection.sendall(rest)
            connection.shutdown(socket.SHUT_WR)
        else:
            connection.sendall(rest)
        answer = connection.recv(200)
    assert answer == f"error {refusal}\n".encode()
    wait_for(lambda: not daemon.process_alive(record["pid"]), "the refusing init's end", WAIT)
    assert _state(root)["standby"] == record  # discarded by the next run, which works
    assert _init_of(_run(parked_env, "sh", "-c", INIT)) == CATATONIT


def test_evicting_the_mounts_of_a_parked_root_ends_its_standby(parked_env: EnvRef) -> None:
    _run(parked_env, "true")
    root, record = _standby(parked_env)
    run_weenv("mounts", "evict", "--all")
    assert not daemon.process_alive(record["pid"])
    assert not (SANDBOXES_ROOT / root).exists() and not (CRUN_ROOT / root).exists()
    assert cgroup_dirs(f"/weenv/{root}") == []
