"""Standby sandboxes: a parked root's next sandbox started ahead, waiting for its command.

A warm `weenv run` over a parked root (parking.py) still paid the OCI runtime's one-shot
`run` on its critical path: ~12.5 ms of ~38 ms of fixed cost, nearly all of it the runtime's
own start, whatever the spec asks (docs/design-notes.md, "A new machine, measured again").
So once a run has answered its client, the node service's fork of that run starts the next
sandbox of the parked root at once, as the runtime would for the next run (same config:
namespaces, mounts, cgroup and limits, seccomp filter, user, capabilities), but with
native/weenv-standby.c as its init instead of `catatonit -- COMMAND`: it waits on a Unix
socket bound in the sandbox's bundle. The next `weenv run` that takes the parked root and
whose config is the same but for the command, its environment and folder (the standby's
config digest says so) connects, hands over argv, env, cwd and its three standard streams,
and waits for the status line; the init then does what catatonit does (forks the command,
relays signals, reaps, exits with its status). Any other run (another user, limits,
network, filter or runtime; an init that died, does not answer or refuses) discards the
standby first, and the run goes on as without one: it is only a cache, its cost paid while
the node was idle. `sandbox create` and the Python API, whose init is catatonit, leave such
a root parked for the next run and make one of their own (sandbox.py `_take_parked`).

A standby never ran anything: the run that takes it gets a sandbox exactly as new as the
runtime's `run` would have made (fresh namespaces, /dev, /dev/shm, IPC), which is why a
sandbox is never reused for a second command. It lives and dies with its parked root: its
state keeps the record (`standby`) and the cgroup, so every teardown of a parked root (gc,
expiry, eviction of its mounts, a take-over by a run it does not fit) kills and deletes it
as any sandbox's init. `WEENV_STANDBY=off` in a run's environment makes none after that run
and uses none (switches.py words).

Owns: the standby's runtime config (`config`, `digest`), starting one (`start`), the request
and status line on its socket (`hand`, `Handed`). Must not: decide when a sandbox gets or
takes one, or tear one down (sandbox.py).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import logging
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, BinaryIO

from weenvfs import native_programs, switches
from weenvfs.errors import WeenvError

from .launcher import INIT_PATH, LaunchSpec, OciCliLauncher, ProcessSpec, kill_recorded
from .sandbox_state import process_start

log = logging.getLogger(__name__)

RECEIVER = "weenv-standby"  # native/weenv-standby.c, statically linked
SOCKET_NAME = "standby.sock"  # in the bundle: only root reaches it
SWITCH = "WEENV_STANDBY"
MAGIC = b"WSB1"
STATUS_LINE = 600  # "started\n", "exit N\n" or "error MESSAGE\n" (its C buffer: 512), at most
HANDSHAKE_SECONDS = 5.0  # to its "started" (~0.2 ms): a stopped or stuck init is discarded
KILLED = 128 + 9  # the status of a run whose init died without a word (killed)


def wanted() -> bool:
    """Whether standbys are made and used ($WEENV_STANDBY, on unless switched off) and the
    receiver program is installed."""
    return not switches.switched_off(SWITCH) and receiver() is not None


def receiver() -> str | None:
    """The installed receiver program (setup.sh builds it), or None."""
    return native_programs.find(RECEIVER)


def config(launcher: OciCliLauncher, launch: LaunchSpec, program: str) -> dict[str, Any]:
    """The runtime config of a standby for the runs of `launch`: what `launch` would run
    as a long-lived sandbox, with no command, environment or folder of its own (those come
    with the run) and `program` (the receiver) as its init, bound where catatonit is (so the
    command's /dev is a run's, to the name)."""
    blank = replace(launch, one_shot=False, process=replace(launch.process, args=(), env=(),
                                                            cwd="/"))
    document = launcher.config(blank)
    document["process"]["args"] = [INIT_PATH]
    for mount in document["mounts"]:
        if mount["destination"] == INIT_PATH:
            mount["source"] = program  # where catatonit is bound: the same /dev as a run's
    return document


def digest(document: Mapping[str, Any]) -> str:
    """What says two standby configs are the same."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def start(launcher: OciCliLauncher, launch: LaunchSpec) -> dict[str, Any]:
    """Start a standby for the runs of `launch` in its parked root (which the runtime has no
    container of); the record the state keeps: config digest, socket, init pid and start
    time. WeenvError (the runtime's message) or OSError when it did not start."""
    program = receiver()
    if program is None:
        raise WeenvError(f"{RECEIVER} is not installed (scripts/setup.sh builds it)")
    document = config(launcher, launch, program)
    path = launch.bundle / SOCKET_NAME
    path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(path))
        os.chmod(path, 0o600)  # root's only, whatever the umask (no connection before listen)
        listening.listen(1)
        pid = launcher.start_detached(launch.sandbox_id, launch.bundle, document,
                                      stdin=listening.fileno())
    started = process_start(pid)
    if started is None:
        raise WeenvError(f"the standby init of sandbox {launch.sandbox_id} ended at once")
    return {"digest": digest(document), "socket": str(path), "pid": pid, "start": started}


class Handed:
    """A command handed to a standby: waited for and killed as the runtime's process of a
    one-shot run (`Launcher.run`), through the connection to its init."""

    def __init__(self, connection: socket.socket, lines: BinaryIO, pid: int,
                 started: int) -> None:
        self._connection = connection
        self._lines = lines
        self._init = (pid, started)
        self.returncode: int | None = None

    def wait(self) -> int:
        """The command's status: "exit N" from the init; KILLED when the init ended without
        one (killed, or `kill` below)."""
        if self.returncode is None:
            line = _read_line(self._lines)
            self._lines.close()
            self._connection.close()
            self.returncode = _status(line)
        return self.returncode

    def kill(self) -> None:
        """Kill the init (and so everything in the sandbox's pid namespace)."""
        kill_recorded(*self._init)


def hand(record: Mapping[str, Any], expected: str, process: ProcessSpec) -> Handed | None:
    """Hand `process` (argv, env, cwd; its identity is the standby's) and this process's
    standard streams to the standby of `record` if its config digest is `expected` and its
    init still waits; None otherwise (the caller discards it)."""
    if record.get("digest") != expected:
        return None
    pid, started = record.get("pid"), record.get("start")
    if not isinstance(pid, int) or process_start(pid) != started:
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(HANDSHAKE_SECONDS)  # an init that does not answer is not waited for
    try:
        connection.connect(str(record["socket"]))
        strings = [process.cwd, *process.args, *process.env]
        payload = b"".join(s.encode(errors="surrogateescape") + b"\0" for s in strings)
        head = MAGIC + struct.pack("<III", len(process.args), len(process.env), len(payload))
        streams = array.array("i", (0, 1, 2))
        connection.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, streams)])
        connection.sendall(payload)
        lines = connection.makefile("rb")
        answer = _read_line(lines)
    except (OSError, KeyError) as error:
        answer = str(error).encode()
    # Anything but "started" (said before its fork): nothing ran, and the caller runs the
    # command as without a standby.
    if answer != b"started\n":
        connection.close()
        log.info("the standby of pid %s did not take the command: %s", pid,
                 answer.decode(errors="replace").strip() or "it ended")
        return None
    connection.settimeout(None)  # the command runs as long as it runs
    return Handed(connection, lines, pid, started)


def _read_line(lines: BinaryIO) -> bytes:
    """The init's next line (empty when it ended without one)."""
    with contextlib.suppress(OSError):
        return lines.readline(STATUS_LINE)
    return b""


def _status(line: bytes) -> int:
    """The command's status in the init's `line`; KILLED for none."""
    word, _, rest = line.decode(errors="replace").strip().partition(" ")
    return int(rest) if word == "exit" and rest.isdigit() else KILLED
