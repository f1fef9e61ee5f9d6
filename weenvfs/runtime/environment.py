"""The Python API for RL frameworks: `Environment` (blocking) and `AsyncEnvironment` (trio).

    with Environment.open("debian:12", store="s3://bucket/weenv") as env:
        result = env.exec(["python3", "-c", "print(1)"], timeout=30)
        env.write_file("/work/task.txt", b"...")
        env.reset()                      # back to the pristine environment, milliseconds

Owns: resolving a reference to a manifest (`resolve_source`), running a command with its
output captured, input fed, and a timeout (`Environment.exec` -> `ExecResult`), file access
from the host into the sandbox's root, and the async wrapper. Every `Environment` owns one
sandbox (sandbox.py) whose owner is this process: if the process dies without closing it,
`weenv sandbox gc` removes it. Many environments can be open at once in one process, from
threads or trio tasks; one environment may run several commands at once too.

A timeout kills the command's whole session inside the sandbox (SIGKILL) and returns exit code
124 (as timeout(1) does) with `timed_out=True`; the sandbox stays usable. A command's output
is complete when it exits: what its background children write later is not waited for
longer than `IO_GRACE`.

Must not: know how sandboxes are built (sandbox.py) or parse arguments (commands.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from weenvfs.errors import WeenvError
from weenvfs.fuse.config import cache_dir_of

from . import node_resolve, recording
from .env_source import EnvSource
from .lower_modes import DEFAULT_LOWER

# The sandbox's modules (sandbox.py and what it imports, ~20 ms) are imported where they are
# first needed: `Environment.open` imports them while the node service resolves the
# reference for it, so a new interpreter's first `open` does not pay for them on top.
if TYPE_CHECKING:
    import selectors
    import subprocess

    import trio

    from .sandbox import Sandbox

log = logging.getLogger(__name__)

TIMEOUT_EXIT = 124  # timeout(1)'s status for a command that ran out of time
IO_GRACE = 0.1  # seconds to keep reading after the command exited (stragglers of its children)
_READ = 1 << 16


@dataclass(frozen=True)
class ExecResult:
    """What a command did: its exit code (128 + N when killed by signal N, 124 after a
    timeout, 127 when not found), its output, and whether it ran out of time."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Whether the command exited with 0."""
        return self.exit_code == 0


def resolve_source(ref: str, store: str | Path, cache: str | Path | None,
                   record_hint: bool | None = None, *, record_tag: str = recording.HINT_TAG,
                   node_service: bool = True) -> EnvSource:
    """Resolve `ref` (NAME[:TAG] or a manifest digest) in `store` to what a sandbox needs.
    `record_hint`: None records the environment's hint when it has none yet and the store
    is writable, True always (merged into the existing one), False never (recording.py);
    a recording publishes hint tag `record_tag` (`weenv convert` records its seed so).
    A remote store is resolved by the node service when that is faster (node_resolve.py),
    unless `node_service` is False."""
    return start_resolving(ref, store, cache, record_hint, record_tag=record_tag,
                           node_service=node_service)()


def start_resolving(ref: str, store: str | Path, cache: str | Path | None,
                    record_hint: bool | None = None, *, record_tag: str = recording.HINT_TAG,
                    node_service: bool = True) -> Callable[[], EnvSource]:
    """`resolve_source` in two steps: the node service is asked now (when it is asked at
    all), and the call returned gives the resolution (waiting for the service's answer, or
    resolving in this process). What the caller does in between overlaps the service's work."""
    cache_dir = cache_dir_of(cache)
    pending = None
    if node_service and node_resolve.worth_asking(str(store)):
        pending = node_resolve.ask_node_service(ref, str(store), cache_dir, record_hint,
                                                record_tag)

    def finish() -> EnvSource:
        source = None if pending is None else pending.result()
        if source is not None:
            return source
        return _resolve_here(ref, store, cache_dir, record_hint, record_tag)

    return finish


def _resolve_here(ref: str, store: str | Path, cache_dir: Path, record_hint: bool | None,
                  record_tag: str) -> EnvSource:
    """`resolve_source` in this process."""
    # Imported here: a caller the node service resolves for (`weenv run`) never needs the
    # store or the format modules (about 25 ms of its start-up).
    from weenvfs.core.node_copies import note_resolved, resolve_env
    from weenvfs.store import open_store
    from weenvfs.store.repository import Repository

    with open_store(str(store)) as opened:
        digest, manifest = resolve_env(Repository(opened), ref, cache_dir)
        url = opened.url
        record = recording.decide(opened, digest, manifest, record_hint, cache_dir)
    if record:
        from weenvfs.core.node_hints import check_hint_spec

        check_hint_spec(record_tag, "--record-tag", allow_none=False)
    note_resolved(cache_dir, str(store), ref, digest)  # the next run's guess (tag_guess.py)
    return EnvSource.from_manifest(ref, digest, url, cache_dir, manifest,
                                   record_tag if record else None, record and record_hint is None)


# Environments still open when the interpreter exits normally are closed then; after a crash
# or kill -9, `weenv sandbox gc` removes them (their owner is gone).
_OPEN: weakref.WeakSet[Environment] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for env in list(_OPEN):
        with contextlib.suppress(Exception):
            env.close()


def _argv(command: Sequence[str] | str) -> tuple[str, ...]:
    """A list is an argv; a string runs with /bin/sh -c."""
    from .launcher import check_args

    if isinstance(command, str):
        return ("/bin/sh", "-c", command)
    return check_args(command)


class Environment:
    """One sandbox of an environment, owned by this process."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls, ref: str, *, store: str | Path, cache: str | Path | None = None,
        cpus: float | None = None, memory: int | None = None, pids: int | None = None,
        tmpfs_upper: bool = False, network: str = "none", keep_warm: float | None = None,
        env: dict[str, str] | None = None, user: str | None = None, cwd: str | None = None,
        elastic: bool = False, lower: str = DEFAULT_LOWER,
        seccomp: str | dict[str, Any] | None = None, disk: int | None = None,
        record_hint: bool | None = None,
    ) -> Environment:
        """Start a sandbox of `ref` from `store` (a URL or directory); `cache` is the node's
        chunk cache (default as `weenv mount`). `memory` is in bytes; `pids` defaults to
        cgroups.DEFAULT_PIDS. The environment's mounts stay `keep_warm` seconds after the
        last sandbox of it closes (None: the node's policy, runtime/mounts.py; 0: none).
        With `elastic` the node's provisioner sizes memory and CPU from what the sandbox
        uses (starting its sidecar if none runs): `cpus` and
        `memory` are then the first limits (default: from earlier sandboxes of the
        environment on this node), and closing records the run for the next ones. `lower`
        is "layers" (a shared mount per group, default) or "merged" (runtime/lowers.py).
        `seccomp` is the syscall filter: None (Docker's default profile, runtime/seccomp.py),
        "unconfined", the path of a profile's JSON file, or a profile as a dict. `disk`
        bounds the writable layer in bytes (ENOSPC past it; runtime/disk.py).
        `record_hint`: by default (None) the first run of an environment with no prefetch hint
        records what it reads and publishes it as the hint (tag latest) at `close`, when the
        store is writable (the node service publishes it after `close` returns, when one
        runs); False opts out, True records even when a hint exists, published before
        `close` returns (runtime/recording.py). `hint_outcome` then says what was
        published, or that it is being published (`pending`)."""
        finish = start_resolving(ref, store, cache, record_hint)
        # Loaded while the node service resolves (a no-op once loaded).
        from .cgroups import DEFAULT_PIDS, Limits
        from .sandbox import Sandbox, SandboxOptions

        source = finish()
        limits = Limits(cpus, memory, DEFAULT_PIDS if pids is None else pids, elastic)
        options = SandboxOptions(limits=limits, tmpfs_upper=tmpfs_upper, network=network,
                                 keep_warm=keep_warm, env=dict(env or {}), user=user, cwd=cwd,
                                 lower=lower, seccomp=seccomp, disk=disk)
        env = cls(Sandbox.create(source, options, owner_pid=os.getpid()))
        _OPEN.add(env)
        return env

    @property
    def id(self) -> str:
        """The sandbox id (`weenv sandbox ls` shows it)."""
        return self.sandbox.id

    @property
    def root(self) -> Path:
        """The sandbox's root as seen from the host (read it through `read_file`)."""
        return self.sandbox.rootfs

    def _check_open(self) -> None:
        if self._closed:
            raise WeenvError(f"environment {self.id} is closed")

    def exec(
        self, command: Sequence[str] | str, *, timeout: float | None = None,
        input: bytes | str | None = None, env: dict[str, str] | None = None,
        cwd: str | None = None, user: str | None = None,
    ) -> ExecResult:
        """Run `command` in the sandbox and wait for it; see `ExecResult`."""
        import subprocess

        from .sandbox import CommandCannotRun

        self._check_open()
        try:
            spec = self.sandbox.command(_argv(command), env=env, cwd=cwd, user=user)
        except CommandCannotRun as error:
            return ExecResult(error.exit_code, b"", f"{error}\n".encode())
        data = input.encode() if isinstance(input, str) else input
        proc, pid_file = self.sandbox.exec(
            spec, stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            out, err, timed_out = _communicate(proc, data, timeout, self.sandbox, pid_file)
        finally:
            if proc.poll() is None:  # left by an exception (e.g. KeyboardInterrupt)
                self.sandbox.kill_session(pid_file)
                proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            self.sandbox.forget_exec(pid_file)
        if timed_out:
            return ExecResult(TIMEOUT_EXIT, out, err, True)
        assert proc.returncode is not None
        return ExecResult(self.sandbox.launcher.exit_code(proc.returncode, err), out, err)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write `data` to `path` in the sandbox (parents made as needed); a new file belongs
        to the sandbox's user. Symlinks resolve inside the sandbox."""
        from . import rootfs, safe_paths

        self._check_open()
        rootfs.check_inside(path)
        process = self.sandbox.process
        owner = (process.uid, process.gid)
        parent = path.rsplit("/", 1)[0]
        if parent:
            safe_paths.ensure_dir(self.root, parent, owner)
        payload = data.encode() if isinstance(data, str) else data
        rootfs.write_in_root(self.root, path, payload, mode, owner)

    def read_file(self, path: str) -> bytes:
        """The content of `path` in the sandbox (FileNotFoundError if missing)."""
        from . import rootfs

        self._check_open()
        return rootfs.read_in_root(self.root, rootfs.check_inside(path))

    def reset(self) -> float:
        """Back to the pristine environment: processes killed, every change gone. Returns the
        seconds it took."""
        self._check_open()
        with self._lock:
            return self.sandbox.reset()

    @property
    def hint_outcome(self) -> dict[str, Any] | None:
        """After `close`: what its recording published (hint digest, chunks), or
        `{"pending": True, "manifest", "tag"}` while the node service publishes it, else
        None."""
        return self.sandbox.hint_outcome

    def close(self) -> None:
        """Remove the sandbox (idempotent); publishes the hint it recorded, if it did."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _OPEN.discard(self)
            self.sandbox.destroy(park=True)  # its root may serve the next open (parking.py)
        outcome = self.sandbox.hint_outcome
        if outcome is not None:
            line = recording.outcome_line(self.sandbox.state["env"]["ref"], outcome)
            if line is not None:
                log.info("%s", line.removeprefix("weenv: "))

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _communicate(
    proc: subprocess.Popen[bytes], data: bytes | None, timeout: float | None,
    sandbox: Sandbox, pid_file: Path,
) -> tuple[bytes, bytes, bool]:
    """Feed `data`, collect stdout/stderr until the command exits (plus IO_GRACE for pipes
    its children still hold), killing its session at `timeout`. Returns (stdout, stderr,
    timed_out). The exit is watched through a pidfd in the same selector as the pipes, so
    nothing here sleeps: a command's end is noticed at once."""
    import selectors

    assert proc.stdout is not None and proc.stderr is not None
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out, exited_at = False, None
    pending = memoryview(data) if data is not None else None
    pidfd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as sel:
            for fd in chunks:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            sel.register(pidfd, selectors.EVENT_READ)
            if proc.stdin is not None:
                os.set_blocking(proc.stdin.fileno(), False)
                if pending:
                    sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
                else:
                    proc.stdin.close()
            while True:
                now = time.monotonic()
                if exited_at is not None and (
                    not any(fd in chunks for fd in sel.get_map()) or now - exited_at > IO_GRACE
                ):
                    break
                if deadline is not None and now >= deadline:
                    timed_out, deadline = True, None
                if timed_out and exited_at is None:
                    # Again every round until runc reports the exit: the pid file may not
                    # exist yet, and a fork bomb may need several passes.
                    sandbox.kill_session(pid_file)
                for key, _ in sel.select(_wait(now, deadline, exited_at, timed_out)):
                    if key.fd == pidfd:
                        sel.unregister(pidfd)
                        proc.wait()
                        exited_at = time.monotonic()
                    else:
                        pending = _service(key.fd, sel, proc, chunks, pending)
    finally:
        os.close(pidfd)
    if proc.stdin is not None and not proc.stdin.closed:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    return (b"".join(chunks[proc.stdout.fileno()]), b"".join(chunks[proc.stderr.fileno()]),
            timed_out)


def _wait(now: float, deadline: float | None, exited_at: float | None,
          killing: bool) -> float | None:
    """How long the selector may block: until the deadline, the end of the grace period,
    or the next kill round; None (no limit) when nothing is due."""
    limits = []
    if deadline is not None:
        limits.append(deadline - now)
    if exited_at is not None:
        limits.append(exited_at + IO_GRACE - now)
    if killing and exited_at is None:
        limits.append(0.05)
    return max(0.0, min(limits)) if limits else None


def _service(fd: int, sel: selectors.BaseSelector, proc: subprocess.Popen[bytes],
             chunks: dict[int, list[bytes]], pending: memoryview | None) -> memoryview | None:
    """Read from an output pipe or write the next piece of input."""
    if fd in chunks:
        try:
            piece = os.read(fd, _READ)
        except BlockingIOError:
            return pending
        if piece:
            chunks[fd].append(piece)
        else:
            sel.unregister(fd)
        return pending
    assert proc.stdin is not None and pending is not None
    try:
        written = os.write(fd, pending[: _READ])
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        written = len(pending)  # the command stopped reading; the rest is dropped
    pending = pending[written:]
    if not pending:
        sel.unregister(fd)
        proc.stdin.close()
    return pending


# One limiter per trio run, shared by every AsyncEnvironment of it: commands block a thread
# each for their whole duration, so trio's default limiter (40) would cap concurrency.
MAX_THREADS = 256
_THREADS: Any = None  # a trio RunVar, made on first use: trio is imported only when needed


class AsyncEnvironment:
    """`Environment` for trio: the same methods, awaited. The blocking work (runc, mounts,
    pipes) runs in worker threads of a shared limiter, so many environments progress at once
    and the trio loop never blocks. Cancelling an awaited call does not stop its thread;
    use `timeout=` to bound a command."""

    def __init__(self, env: Environment) -> None:
        self.env = env

    @staticmethod
    def _threads() -> trio.CapacityLimiter:
        import trio

        global _THREADS
        if _THREADS is None:
            _THREADS = trio.lowlevel.RunVar("weenv_environment_threads")
        try:
            return _THREADS.get()
        except LookupError:
            limiter = trio.CapacityLimiter(MAX_THREADS)
            _THREADS.set(limiter)
            return limiter

    @classmethod
    async def _run(cls, fn: Any, *args: Any, **kwargs: Any) -> Any:
        import functools

        import trio

        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs),
                                             limiter=AsyncEnvironment._threads())

    @classmethod
    async def open(cls, ref: str, **kwargs: Any) -> AsyncEnvironment:
        """As `Environment.open`."""
        return cls(await cls._run(Environment.open, ref, **kwargs))

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self.env.id

    async def exec(self, command: Sequence[str] | str, **kwargs: Any) -> ExecResult:
        """As `Environment.exec`."""
        result: ExecResult = await self._run(self.env.exec, command, **kwargs)
        return result

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """As `Environment.write_file`."""
        await self._run(self.env.write_file, path, data, mode)

    async def read_file(self, path: str) -> bytes:
        """As `Environment.read_file`."""
        data: bytes = await self._run(self.env.read_file, path)
        return data

    async def reset(self) -> float:
        """As `Environment.reset`."""
        seconds: float = await self._run(self.env.reset)
        return seconds

    async def close(self) -> None:
        """As `Environment.close`; shielded, so a cancelled task still cleans up."""
        import trio

        with trio.CancelScope(shield=True):
            await self._run(self.env.close)

    async def __aenter__(self) -> AsyncEnvironment:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


def open_many(refs: Sequence[str], **kwargs: Any) -> list[Environment]:
    """Open one environment per ref, all at once (threads); on any failure close them all."""
    results: list[Environment | BaseException | None] = [None] * len(refs)

    def one(i: int) -> None:
        try:
            results[i] = Environment.open(refs[i], **kwargs)
        except BaseException as error:  # reported below, after every thread ended
            results[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(refs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    envs = [r for r in results if isinstance(r, Environment)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for env in envs:
            env.close()
        raise failed[0]
    return envs
