"""The `weenv run` and `weenv sandbox create|exec|reset|rm|ls|gc` commands.

Owns: their arguments, defaults and output. `run` makes a sandbox owned by itself (or by the
`weenv run` it runs for, in a process of the node service: weenvfs/hand_over.py), runs one command
with this terminal's stdin/stdout/stderr, removes the sandbox (also on SIGTERM, SIGHUP or
Ctrl-C) and exits with the command's status. `sandbox create` makes a detached sandbox
that lives until `sandbox rm`; the other subcommands find it by id through its state folder,
from any process. Must not: build sandboxes or capture output itself (sandbox.py,
environment.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weenvfs.cli import add_command, terminated_on_signals
from weenvfs.cli_args import (
    add_ref_and_command,
    add_store,
    env_dict,
    env_pair,
    non_negative,
    positive,
    print_json,
    split_command,
)
from weenvfs.errors import UsageError, WeenvError
from weenvfs.units import size_arg

from .lower_modes import DEFAULT_LOWER, LOWER_MODES

if TYPE_CHECKING:
    from .elastic import NodeView
    from .env_source import EnvSource
    from .sandbox import Sandbox

Sub = argparse._SubParsersAction  # type: ignore[type-arg]

log = logging.getLogger(__name__)


def register(subparsers: Sub) -> None:
    """Add `run` and `sandbox` with its subcommands."""
    _register_run(subparsers)
    group = add_command(
        subparsers, "sandbox",
        help="long-lived sandboxes: create, exec, reset, rm, ls, gc",
        description="Manage sandboxes that outlive one command (see `weenv run` for one).",
        examples=[
            "weenv sandbox create debian:12 --store /srv/weenv   # prints the id",
            "weenv sandbox exec weenv-0a1b2c3d4e python3 -V",
            "weenv sandbox reset weenv-0a1b2c3d4e",
            "weenv sandbox rm weenv-0a1b2c3d4e",
        ],
        func=None,
    )
    sub = group.add_subparsers(title="sandbox commands", metavar="COMMAND")
    _register_create(sub)
    _register_exec(sub)
    _register_reset(sub)
    _register_rm(sub)
    _register_ls(sub)
    _register_gc(sub)
    _register_resolve(sub)


def _add_sandbox_options(p: argparse.ArgumentParser, *, store_required: bool) -> None:
    add_store(p, required=store_required)
    p.add_argument("--cache", type=Path, metavar="DIR",
                   help="node chunk cache (default: as `weenv mount`)")
    p.add_argument("--cpus", type=positive, metavar="N", help="CPU quota in cores")
    p.add_argument("--memory", type=size_arg, metavar="SIZE", help="memory limit, e.g. 2G")
    p.add_argument("--pids", type=int, metavar="N",
                   help="most processes at once (default 4096)")
    p.add_argument("--tmpfs-upper", action="store_true",
                   help="keep the writable layer in RAM (tmpfs) instead of on disk")
    p.add_argument("--disk", type=size_arg, metavar="SIZE",
                   help="the writable layer holds at most SIZE (e.g. 2G; writes past it get "
                   "ENOSPC): an ext4 image of its own, or with --tmpfs-upper the tmpfs size")
    p.add_argument("--network", choices=("none", "host"), default="none",
                   help="none: loopback only (default); host: the node's network")
    p.add_argument("--keep-warm", type=non_negative, default=None, metavar="SECS",
                   help="keep the environment mounted SECS after its last sandbox ends "
                   "(default: $WEENV_KEEP_WARM, else 600; 0: unmount at once)")
    p.add_argument("--lower", choices=LOWER_MODES, default=DEFAULT_LOWER,
                   help="layers: a shared mount per group, stacked by overlayfs (environments "
                   "with common groups share their page cache; default); merged: one mount "
                   "of the whole environment")
    p.add_argument("--elastic", action="store_true",
                   help="let the node's provisioner size memory and CPU from use (starts it "
                   "if needed); --memory/--cpus are then the first limits (default: from "
                   "earlier sandboxes of the environment)")
    p.add_argument("--no-record-hint", dest="record_hint", action="store_false", default=None,
                   help="do not record this run as the environment's prefetch hint (by "
                   "default the first run of an environment with no hint records what it "
                   "reads, if the store is writable; the node service publishes it as the "
                   "run ends)")
    p.add_argument("--record-hint", dest="record_hint", action="store_true",
                   help="record this run and merge it into the environment's hint even if it "
                   "has one (the store must be writable); published before the run returns")
    p.add_argument("--record-tag", default="latest", metavar="TAG",
                   help="the hint tag a recording publishes (default latest, what mounts "
                   "replay; `weenv convert` records the image's command as `seed`)")
    p.add_argument("--security-opt", action="append", default=[], metavar="seccomp=PROFILE",
                   help="seccomp=unconfined: no syscall filter; seccomp=PATH.json: this "
                   "profile (Docker's or OCI's format) instead of the default, which refuses "
                   "what Docker's default profile refuses")
    _add_process_options(p)


def _add_process_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-e", "--env", type=env_pair, action="append", default=[],
                   metavar="KEY[=VALUE]",
                   help="set an environment variable (repeatable); KEY alone: its value "
                        "here, if set")
    p.add_argument("-w", "--workdir", metavar="DIR", help="working directory inside")
    p.add_argument("-u", "--user", metavar="USER[:GROUP]",
                   help="run as this user (name or uid, as Docker)")


def _register_run(subparsers: Sub) -> None:
    p = add_command(
        subparsers, "run",
        help="run one command in a fresh sandbox of an environment",
        description=(
            "Run COMMAND in a new sandbox of environment REF and exit with its status:\n"
            "weenv run [OPTIONS] REF [COMMAND [ARG...]], as docker run (options before REF,\n"
            "every word after REF is the command; a `--` before it is accepted).\n"
            "The sandbox is a writable overlay over the environment's shared lazy mounts\n"
            "(one per group, shared with every environment built on the same groups), in\n"
            "its own pid, mount, ipc, uts and (by default) network namespaces and cgroup.\n"
            "As docker run, COMMAND follows the environment's entrypoint (if it has one) in\n"
            "place of its cmd; without COMMAND the entrypoint and cmd run; --entrypoint\n"
            "replaces the entrypoint and drops the cmd. Everything is removed at\n"
            "exit (--keep keeps the writable layer for inspection), except the overlay of a\n"
            "run that changed nothing in it: it is parked for the next run of the same\n"
            "groups ($WEENV_PARK_SECONDS, default 60; 0: never). As root, the node service\n"
            "(`weenv mountd`, started when missing) carries the run out with this process's\n"
            "stdio, folder and environment; this process passes on signals and the exit\n"
            "status (WEENV_NODE_RUN=off: everything in this process). After a parked run\n"
            "the service starts the next sandbox of that root ahead, for the next run with\n"
            "the same user, limits and options (WEENV_STANDBY=off: none). A NAME:TAG run\n"
            "starts from what the tag named at the node's last run while the store confirms\n"
            "it, and starts over if it moved (WEENV_TAG_GUESS=off: the tag first)."
        ),
        examples=[
            "weenv run --store /srv/weenv debian:12 cat /etc/os-release",
            "weenv run --store s3://envs/weenv --cpus 2 --memory 4G py:3.11 python3 -V",
            "weenv run --store /srv/weenv --tmpfs-upper -e SEED=7 task:1234 ./run.sh",
            "weenv run --store /srv/weenv --elastic --memory 1G task:1234 -- make test",
            "weenv run --store /srv/weenv --entrypoint /bin/sh app:1 -c 'ls /'",
        ],
        func=_cmd_run,
    )
    _add_sandbox_options(p, store_required=False)
    p.add_argument("--keep", action="store_true",
                   help="keep the writable layer on disk and print where")
    p.add_argument("--entrypoint", metavar="PROGRAM",
                   help="run PROGRAM (then COMMAND as its arguments) instead of the "
                        "environment's entrypoint and cmd; \"\": no entrypoint")
    # Passed by a `weenv run` that the node service runs for it (hand_over.py): the sandbox's
    # owner is that process, the one its user sees and signals.
    p.add_argument("--owner-pid", type=int, help=argparse.SUPPRESS)
    add_ref_and_command(p, "ref", "REF", "environment NAME[:TAG] or manifest digest")


def _register_create(sub: Sub) -> None:
    p = add_command(
        sub, "create",
        help="create a sandbox that lives until `weenv sandbox rm`; prints its id",
        description="Create a detached sandbox of REF and print its id.",
        examples=[
            "weenv sandbox create debian:12 --store /srv/weenv",
            "weenv sandbox create py:3.11 --store /srv/weenv --memory 2G --name episode-7",
            "weenv sandbox create py:3.11 --store /srv/weenv --elastic",
        ],
        func=_cmd_create,
    )
    p.add_argument("ref", metavar="REF", help="environment NAME[:TAG] or manifest digest")
    _add_sandbox_options(p, store_required=True)
    p.add_argument("--name", metavar="ID", help="the sandbox id (default: weenv-<random>)")


def _register_exec(sub: Sub) -> None:
    p = add_command(
        sub, "exec",
        help="run a command in a sandbox; exits with its status",
        description=(
            "Run COMMAND in sandbox ID with this terminal's stdin, stdout and stderr:\n"
            "weenv sandbox exec [OPTIONS] ID COMMAND [ARG...] (options before ID)."
        ),
        examples=["weenv sandbox exec weenv-0a1b2c3d4e ls -l /",
                  "weenv sandbox exec -u nobody -w /tmp weenv-0a1b2c3d4e id"],
        func=_cmd_exec,
    )
    _add_process_options(p)
    add_ref_and_command(p, "id", "ID", "the sandbox id (`weenv sandbox create` printed it)")


def _register_reset(sub: Sub) -> None:
    p = add_command(
        sub, "reset",
        help="discard every change: back to the pristine environment",
        description="Kill the sandbox's processes, discard its writable layer, start afresh.",
        examples=["weenv sandbox reset weenv-0a1b2c3d4e"],
        func=_cmd_reset,
    )
    p.add_argument("id", metavar="ID")


def _register_rm(sub: Sub) -> None:
    p = add_command(
        sub, "rm",
        help="remove sandboxes",
        description="Kill and remove sandboxes: processes, mounts, cgroup, writable layer.",
        examples=["weenv sandbox rm weenv-0a1b2c3d4e",
                  "weenv sandbox rm --keep weenv-0a1b2c3d4e  # keep the writable layer"],
        func=_cmd_rm,
    )
    p.add_argument("ids", nargs="+", metavar="ID")
    p.add_argument("--keep", action="store_true", help="keep the writable layer on disk")


def _register_ls(sub: Sub) -> None:
    p = add_command(
        sub, "ls",
        help="list sandboxes and environment mounts on this node",
        description="List the sandboxes of this node (and, with --json, environment mounts).",
        examples=["weenv sandbox ls", "weenv sandbox ls --json | jq '.sandboxes[].id'"],
        func=_cmd_ls,
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def _register_resolve(sub: Sub) -> None:
    p = add_command(
        sub, "resolve",
        help="show what a sandbox of REF would mount and run",
        description="Resolve REF in the store and print what a sandbox of it gets: the "
        "manifest digest, its groups' index digests, the command (entrypoint + cmd), "
        "environment, working directory and user, and whether its run would record the "
        "prefetch hint. `weenv run` asks the node service for this when the store is remote.",
        examples=["weenv sandbox resolve py:3.11 --store /srv/weenv",
                  "weenv sandbox resolve py:3.11 --store s3://bucket/envs --json | jq .digest"],
        func=_cmd_resolve,
    )
    p.add_argument("ref", metavar="REF", help="environment NAME[:TAG] or manifest digest")
    add_store(p, required=True)
    p.add_argument("--cache", type=Path, metavar="DIR",
                   help="node chunk cache (default: as `weenv mount`)")
    p.add_argument("--no-record-hint", dest="record_hint", action="store_false", default=None,
                   help="as `weenv run --no-record-hint`")
    p.add_argument("--record-hint", dest="record_hint", action="store_true",
                   help="as `weenv run --record-hint`")
    p.add_argument("--record-tag", default="latest", metavar="TAG",
                   help="as `weenv run --record-tag`")
    p.add_argument("--json", action="store_true",
                   help='print JSON (a failure too: {"error": ..., "exit_code": N})')
    # Passed by the node service when it runs this command for `weenv run` (unused).
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def _cmd_resolve(args: argparse.Namespace) -> int:
    from weenvfs.core.tree import FormatError  # runtime reaches format through core

    from .environment import resolve_source
    from .node_resolve import error_to_json, source_to_json

    if args.ready_fd is not None:
        os.close(args.ready_fd)
    try:
        source = resolve_source(args.ref, args.store, args.cache, args.record_hint,
                                record_tag=args.record_tag, node_service=False)
    except (WeenvError, FormatError) as error:
        if not args.json:
            raise
        # For `weenv run`, which asked the node service (node_resolve.py): it raises this.
        print_json(error_to_json(error))
        return int(getattr(error, "exit_code", 1))
    document = source_to_json(source)
    if args.json:
        print_json(document)
        return 0
    for key, value in document.items():
        shown = " ".join(value) if isinstance(value, list) else value
        print(f"{key:<12} {shown}")
    return 0


def _register_gc(sub: Sub) -> None:
    p = add_command(
        sub, "gc",
        help="remove sandboxes whose controlling process died, and their leftovers",
        description=(
            "Remove orphans: sandboxes whose owner process is gone (e.g. after kill -9), their\n"
            "processes, overlays, cgroups and upper dirs, environment mounts no sandbox\n"
            "uses, and parked roots (finished runs' roots kept for the next run) past\n"
            "$WEENV_PARK_SECONDS. Sandboxes of live owners and `sandbox create`d ones are left\n"
            "alone."
        ),
        examples=["weenv sandbox gc", "weenv sandbox gc --json"],
        func=_cmd_gc,
    )
    p.add_argument("--json", action="store_true", help="print what was removed as JSON")
    p.add_argument("--mounts-only", action="store_true",
                   help="only unmount environments no sandbox uses")
    p.add_argument("--after", type=non_negative, default=0.0, help=argparse.SUPPRESS)


# -- handlers ---------------------------------------------------------------------------------


def _options(args: argparse.Namespace, **extra: Any) -> Any:
    from .cgroups import DEFAULT_PIDS, Limits
    from .sandbox import SandboxOptions

    limits = Limits(args.cpus, args.memory, DEFAULT_PIDS if args.pids is None else args.pids,
                    args.elastic)
    return SandboxOptions(
        limits=limits, tmpfs_upper=args.tmpfs_upper, network=args.network,
        keep_warm=args.keep_warm, env=env_dict(args.env), user=args.user, cwd=args.workdir,
        lower=args.lower, seccomp=_seccomp_option(args.security_opt), disk=args.disk,
        **extra,
    )


def _seccomp_option(values: list[str]) -> str | None:
    """The profile `--security-opt seccomp=...` names (the last one wins), or None."""
    profile = None
    for value in values:
        key, sep, rest = value.partition("=")
        if key != "seccomp" or not sep:
            raise UsageError(f"--security-opt {value!r}: only seccomp=unconfined, "
                             "seccomp=default or seccomp=PATH.json are supported")
        profile = rest
    if profile == "":
        raise UsageError("--security-opt seccomp= needs unconfined, default or a JSON file")
    return profile


def _signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """SIGTERM and SIGHUP raise Terminated (a KeyboardInterrupt), so `finally` blocks clean
    up and the exit status says which signal it was; even where the process inherited them
    ignored (the node service's fork of a run: its client relays them)."""
    return terminated_on_signals(even_ignored=True)


@contextlib.contextmanager
def _provisioner_notice(elastic: bool) -> Iterator[None]:
    """With --elastic, say on stderr (one line) when this command started the node's
    provisioner: it keeps running after the command, for every elastic sandbox of the node."""
    if not elastic:
        yield
        return
    from weenvfs.provision.registry import running_pid

    before = running_pid()
    yield
    after = running_pid()
    if before is None and after is not None:
        print(f"weenv: started the node's provisioner (pid {after}); it keeps running for "
              "elastic sandboxes: stop it with `weenv provision stop`", file=sys.stderr)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Let a teardown finish: a second Ctrl-C or SIGTERM must not cut it in half."""
    old = {s: signal.signal(s, signal.SIG_IGN)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _cmd_run(args: argparse.Namespace) -> int:
    from . import standby
    from .cgroups import prime_migrations

    # As early as can be, so the run's own work hides the wait; the only priming of a run
    # (`Sandbox.run_once` has no other caller; a second one there gained nothing, 24 rounds).
    prime_migrations()
    standby_on = standby.wanted()  # a bad $WEENV_STANDBY fails here, before anything is made
    given = split_command(args, "ref", store=True)
    if args.owner_pid:
        log.info("run by the node service for process %d", args.owner_pid)
    with _signals_interrupt():
        box, command = _run_sandbox(args, given)
        try:
            return _run_once(box, command)
        finally:
            with _signals_ignored():
                box.destroy(park=True)  # its root may wait for the next run (parking.py)
            _say_hint(box)
            if standby_on and box.state.get("status") == "parked":
                _standby_after_answer(box)
            if args.keep:
                print(f"weenv: upper layer kept in {box.upper_root / 'upper'}",
                      file=sys.stderr)


def _run_sandbox(args: argparse.Namespace, given: list[str]) -> tuple[Sandbox, list[str]]:
    """The sandbox `weenv run` starts its command in, not started yet, and the command: made
    from the node's guess of what the tag names while the store confirms it, the guess's
    sandbox discarded if the store names another (tag_guess.py), else from the store's
    answer. A usage error comes before anything is made."""
    from weenvfs.fuse.config import cache_dir_of

    from . import tag_guess
    from .environment import resolve_source

    guess = tag_guess.start(args.ref, args.store, cache_dir_of(args.cache), args.record_hint)
    if guess is not None and guess.source.run_argv(given, args.entrypoint):
        box, confirmed = _run_box(args, guess.source), False
        try:
            confirmed = guess.confirm()
        finally:
            if not confirmed:  # moved, or the store failed: the box ran nothing, --keep or not
                with _signals_ignored():
                    box.destroy(keep_upper=False, park=True)
        if confirmed:
            return box, guess.source.run_argv(given, args.entrypoint)
        log.info("%s no longer names %s: resolved again", args.ref, guess.source.digest[:12])
    source = resolve_source(args.ref, args.store, args.cache, args.record_hint,
                            record_tag=args.record_tag)
    command = source.run_argv(given, args.entrypoint)
    if not command:
        raise UsageError("no command given and the environment has no entrypoint or cmd")
    return _run_box(args, source), command


def _run_box(args: argparse.Namespace, source: EnvSource) -> Sandbox:
    """`weenv run`'s sandbox of `source`, made and not started."""
    from .sandbox import Sandbox

    with _provisioner_notice(args.elastic):
        return Sandbox.create(source, _options(args, keep_upper=args.keep),
                              owner_pid=args.owner_pid or os.getpid(), start=False)


def _standby_after_answer(box: Sandbox) -> None:
    """In the node service's fork of a run: once the client has its status, start the
    parked root's next sandbox for the next run like this one (standby.py). A run that is
    not the service's makes none: it would pay for it before its own exit."""
    from weenvfs.fuse.service_forks import when_answered

    when_answered(box.make_standby)


def _say_hint(box: Sandbox) -> None:
    """One stderr line when the sandbox's end published the hint it recorded."""
    from .recording import outcome_line

    if box.hint_outcome is None:
        return
    line = outcome_line(box.state["env"]["ref"], box.hint_outcome)
    if line is not None:
        print(line, file=sys.stderr)


def _run_once(box: Sandbox, command: list[str]) -> int:
    """Start `box` with `command` as its only process, with this process's stdio; on
    interrupt stop the launcher (the caller's `destroy` kills what it started) and re-raise."""
    from .launcher import check_args

    # Made just now (`cmd_run`): its create checked the shared mounts.
    proc = box.run_once(box.command(check_args(command), mounts_checked=True))
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.kill()  # runc got the terminal's SIGINT too, or not (SIGTERM to us only)
        proc.wait()
        raise
    return code


def _run_attached(box: Sandbox, command: list[str], env: dict[str, str], cwd: str | None,
                  user: str | None) -> int:
    """Run `command` with this process's stdio; on interrupt kill it and re-raise."""
    from .launcher import check_args

    spec = box.command(check_args(command), env=env, cwd=cwd, user=user)
    proc, pid_file = box.exec(spec)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        box.kill_session(pid_file)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        raise
    finally:
        box.forget_exec(pid_file)
    return code


def _cmd_create(args: argparse.Namespace) -> int:
    from .environment import resolve_source
    from .sandbox import Sandbox

    source = resolve_source(args.ref, args.store, args.cache, args.record_hint,
                            record_tag=args.record_tag)
    with _signals_interrupt(), _provisioner_notice(args.elastic):
        box = Sandbox.create(source, _options(args, name=args.name), owner_pid=None)
    print(box.id)
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    from .sandbox import Sandbox

    command = split_command(args, "id")
    if not command:
        raise UsageError("no command given (weenv sandbox exec [OPTIONS] ID COMMAND [ARG...])")
    box = Sandbox.load(args.id)
    with _signals_interrupt():
        return _run_attached(box, command, env_dict(args.env), args.workdir, args.user)


def _cmd_reset(args: argparse.Namespace) -> int:
    from .sandbox import Sandbox

    seconds = Sandbox.load(args.id).reset()
    print(f"reset {args.id} in {seconds * 1000:.0f} ms", file=sys.stderr)
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    from .sandbox import Sandbox

    boxes = [Sandbox.load(i) for i in args.ids]  # all exist, or nothing is removed
    for box in boxes:
        with _signals_ignored():
            box.destroy(keep_upper=args.keep or None)
        _say_hint(box)
        if args.keep:
            print(f"{box.id}: upper layer kept in {box.upper_root / 'upper'}")
    return 0


def _describe(box: Sandbox, node: NodeView) -> dict[str, Any]:
    """One sandbox for `ls --json`: `limits` are those in force (for an elastic sandbox read
    from its cgroup, as the provisioner left them), `provisioner` says more (or is null)."""
    state = box.state
    limits = dict(state.get("limits") or {})
    provisioner = None
    if box.is_elastic:
        provisioner = node.describe(box.id)
        provisioner["initial"] = (state.get("elastic") or {}).get("initial")
        limits.update(cpus=provisioner["cpus"], memory=provisioner["memory"])
    return {
        "id": box.id,
        "status": box.status(),
        "env": state["env"]["ref"],
        "digest": state["env"]["digest"],
        "owner": (state.get("owner") or {}).get("pid"),
        # A parked root's standby (standby.py): the pid of its init, waiting for a run.
        "standby": (state.get("standby") or {}).get("pid"),
        "created": state.get("created"),
        "resets": state.get("resets", 0),
        "rootfs": str(box.rootfs),
        "lower": [str(path) for path in box.lowers],
        "upper": str(box.upper_root / "upper"),
        "tmpfs_upper": state.get("tmpfs_upper"),
        "disk": state.get("disk"),
        "network": state.get("network"),
        "seccomp": box.seccomp.name,
        "no_new_privileges": True,
        "runtime": box.launcher.name,
        "runtime_installed": _runtime_missing(box) is None,
        "elastic": box.is_elastic,
        "limits": limits,
        "provisioner": provisioner,
        "cgroup": (state.get("cgroup") or {}).get("path"),
        "init_pid": state.get("init_pid"),
    }


def _runtime_missing(box: Sandbox) -> str | None:
    """Why the OCI runtime that made `box` cannot run here any more, or None."""
    try:
        box.launcher.check_installed()
    except WeenvError as error:
        return str(error)
    return None


def _cmd_ls(args: argparse.Namespace) -> int:
    from . import mounts, sandbox, sandbox_state
    from .elastic import NodeView

    boxes = []
    node = NodeView.take()
    for sandbox_id in sandbox_state.list_ids():
        try:
            box = sandbox.Sandbox.load(sandbox_id)
            boxes.append(_describe(box, node))
        except UsageError:
            continue  # removed meanwhile
        except WeenvError as error:
            log.warning("sandbox %s: %s", sandbox_id, error)
            continue
        missing = _runtime_missing(box)
        if missing is not None:  # made by an OCI runtime uninstalled since
            log.warning("sandbox %s: %s; it can be removed (weenv sandbox rm %s), not entered",
                        sandbox_id, missing, sandbox_id)
    if args.json:
        document = {"sandboxes": boxes, "mounts": [m.to_json() for m in mounts.list_mounts()]}
        print_json(document)
        return 0
    print(f"{'ID':<24} {'STATUS':<10} {'OWNER':>7} {'AGE':>8}  {'LIMITS':<22} ENV")
    now = time.time()
    for b in boxes:
        age = f"{now - b['created']:.0f}s" if b["created"] else "-"
        print(f"{b['id']:<24} {b['status']:<10} {b['owner'] or '-':>7} {age:>8}  "
              f"{_limits_text(b):<22} {b['env']}")
    return 0


def _limits_text(box: dict[str, Any]) -> str:
    """`2cpu 512M`, `- -` when unlimited, with `elastic` in front when the provisioner sizes
    them."""
    cpus, memory = box["limits"].get("cpus"), box["limits"].get("memory")
    text = (f"{cpus:g}cpu" if cpus else "-") + " " + (f"{memory >> 20}M" if memory else "-")
    return f"elastic {text}" if box["elastic"] else text


def _cmd_gc(args: argparse.Namespace) -> int:
    from . import gc

    report = gc.collect_after(args.after) if args.after else gc.collect(
        mounts_only=args.mounts_only)
    if args.json:
        print_json(report.to_json())
    else:
        for kind, items in report.to_json().items():
            for item in items:
                print(f"{kind}: {item}")
    return 1 if report.errors else 0
