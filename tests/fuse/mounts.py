"""Helpers for real mounts: publish environments with the real builder, mount them with the
real `weenv mount` (a daemon in its own session), and always clean up.

Owns: `publish` (one group per source, a directory or a layer tar, composed into an
environment in a local store), `run_weenv` (the CLI in a subprocess), and `Mounter` (used by
the `mounter` fixture of conftest.py): every mount it makes is unmounted by `close()` with
`fusermount3 -u -z`, and the daemon it started (by the pid in that mount's pid file, checked
against its command line) is terminated if still alive. `close()` also reports WARNING or
ERROR lines of the daemon logs that the test did not declare with `Mount.expect_log_lines`.

Must not: kill any process it did not start, or leave anything mounted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from weenvfs.fuse import daemon
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, build_group, open_source
from weenvfs.tools.chunker import ChunkOptions
from weenvfs.tools.publish import compose_env

CLI_TIMEOUT = 120.0


def run_weenv(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`python -m weenvfs ARGS` in a subprocess (the daemon it may start outlives it)."""
    done = subprocess.run(
        [sys.executable, "-m", "weenvfs", *args],
        capture_output=True, text=True, timeout=CLI_TIMEOUT, check=False,
    )
    if check and done.returncode != 0:
        pytest.fail(f"weenv {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done


def refused_mount(ref: str, store: Path | str, tmp_path: Path) -> str:
    """`weenv mount REF` that must be refused: one `weenv: error:` line, a non-zero exit and
    nothing mounted; returns the line. Unmounts anyway, should a regression mount it."""
    mp = tmp_path / "refused-mp"
    mp.mkdir(exist_ok=True)
    try:
        done = run_weenv("--log-file", str(tmp_path / "refused-mount.log"), "mount", ref,
                         str(mp), "--store", str(store), "--cache", str(tmp_path / "cache"),
                         check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1, done.stderr
        assert lines[0].startswith("weenv: error:"), lines[0]
        assert not os.path.ismount(mp)
        return lines[0]
    finally:
        force_unmount(mp)


def publish(
    store_dir: Path,
    sources: Sequence[Path],
    env: str = "env:t",
    chunk_size: int = 1 << 20,
    batch_threshold: int = 64 << 10,
) -> str:
    """Build one group per source (lowest first) and compose them as `env`; return `env`."""
    store = open_store(str(store_dir), create=True)
    repo = Repository(store)
    options = BuildOptions(chunk=ChunkOptions(chunk_size=chunk_size,
                                              batch_threshold=batch_threshold))
    name = env.split(":")[0]
    groups = []
    for n, source in enumerate(sources):
        build_group(open_source(source), repo, f"{name}-g{n}", "t", options)
        groups.append(f"{name}-g{n}:t")
    env_name, _, tag = env.partition(":")
    compose_env(repo, env_name, tag or "latest", groups)
    store.close()
    return env


@dataclass
class Mount:
    """One mount made by the `mounter` fixture."""

    mountpoint: Path
    pid: int
    log_file: Path
    cache: Path
    said: str = ""  # what `weenv mount` wrote on stderr
    expected_log: list[re.Pattern[str]] = field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        """`weenv stats --json MOUNTPOINT`."""
        return json.loads(run_weenv("stats", "--json", str(self.mountpoint)).stdout)

    def log_lines(self, pattern: str) -> list[str]:
        """Lines of the daemon log matching regex `pattern`."""
        return [line for line in self.log_text().splitlines() if re.search(pattern, line)]

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def expect_log_lines(self, pattern: str) -> None:
        """Declare WARNING/ERROR lines matching `pattern` as expected in the daemon log."""
        self.expected_log.append(re.compile(pattern))

    def unexpected_log_lines(self) -> list[str]:
        return [
            line for line in self.log_text().splitlines()
            if re.search(r" (WARNING|ERROR|CRITICAL) ", line)
            and not any(p.search(line) for p in self.expected_log)
        ]


def _is_our_daemon(pid: int, mountpoint: Path) -> bool:
    """Whether `pid` is the daemon of `mountpoint` (started by exec, its arguments; forked
    by a mount server, its process title: one string)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"weenvfs" in cmdline and os.fsencode(f" {mountpoint} ") in cmdline + b" "


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while daemon.process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not daemon.process_alive(pid)


def stop_daemon(pid: int, mountpoint: Path) -> None:
    """Stop the daemon `pid` of `mountpoint` if it still runs: it exits by itself once
    unmounted; else SIGTERM, and SIGKILL after 10 s more."""
    if not _is_our_daemon(pid, mountpoint) or _wait_gone(pid, 10):
        return
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, 10):
        os.kill(pid, signal.SIGKILL)


def force_unmount(mountpoint: Path) -> None:
    """Detach whatever (even a dead daemon's mount) is mounted there: `fusermount3 -u -z`
    for a tree mount; a kernel-path mount also has its daemon told to unmount its private
    layers and device folder (`daemon.force_unmount`)."""
    if _mounted(mountpoint):
        daemon.force_unmount(mountpoint)


def _mounted(mountpoint: Path) -> bool:
    target = os.path.abspath(mountpoint).encode()
    with open("/proc/self/mounts", "rb") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


class Mounter:
    """Mounts environments with the real CLI and tears every mount down."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.mounts: list[Mount] = []
        self._count = 0
        self.path: str | None = None  # `--path` of every mount (None: the default, auto)

    def mount(
        self, ref: str, store: Path, *, cache: Path | None = None,
        mountpoint: Path | None = None, extra: Sequence[str] = (),
    ) -> Mount:
        """`weenv mount REF MP --store STORE --cache CACHE --log-file LOG EXTRA...`."""
        self._count += 1
        mp = mountpoint or self.tmp_path / f"mnt{self._count}"
        mp.mkdir(exist_ok=True)
        cache = cache or self.tmp_path / "cache"
        log_file = self.tmp_path / f"mount{self._count}.log"
        chosen = ["--path", self.path] if self.path and "--path" not in extra else []
        done = run_weenv("--log-file", str(log_file), "mount", ref, str(mp), "--store",
                         str(store), "--cache", str(cache), *chosen, *extra)
        record = daemon.read_pid_file(mp)
        assert record is not None, f"no pid file for {mp}"
        mount = Mount(mp, record["pid"], log_file, cache, said=done.stderr)
        self.mounts.append(mount)
        return mount

    def close(self) -> list[str]:
        """Unmount everything and stop the daemons; return unexpected daemon log lines."""
        problems = []
        for mount in self.mounts:
            try:
                force_unmount(mount.mountpoint)
            finally:
                stop_daemon(mount.pid, mount.mountpoint)
                # A daemon a test killed never removed its record (/run/weenv/mounts).
                if not daemon.process_alive(mount.pid):
                    daemon.remove_pid_file(mount.mountpoint, mount.pid)
            problems += [f"{mount.log_file.name}: {line}" for line in mount.unexpected_log_lines()]
        return problems
