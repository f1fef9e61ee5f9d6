"""The kernel path's native device server (native/weenv-devserve.c, fuse/native_devices.py):
chosen by default where it is installed; what it serves are the right bytes and are seen by
the hint recording; the Python server where asked; and its faults: a killed server fails
reads (never a hang) and ends the mount, a killed daemon takes the server with it.

Real parts: `weenv mount` daemons on the kernel path (EROFS over the device folder), the
installed server (scripts/setup.sh builds it; CI fails rather than skip without it).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
from mounts import Mount, Mounter, run_weenv
from support.polling import read_or_error, wait_for
from support.processes import node_processes

from weenvfs.format.hints import Hint
from weenvfs.format.index import GroupIndex
from weenvfs.fuse import daemon
from weenvfs.fuse.native_devices import HELPER, SERVER_VARIABLE
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

pytestmark = [pytest.mark.requires_fuse, pytest.mark.usefixtures("native_server")]

WAIT = 30.0


def _server_pid(mount: Mount) -> int:
    """The pid of the mount daemon's native server."""
    for proc in node_processes():
        if proc.name == HELPER and proc.parent == mount.pid:
            return proc.pid
    raise AssertionError(f"no {HELPER} under the daemon {mount.pid}")


def _drop_page_cache() -> None:
    # Clean pages only, no sync first (a sync waits for every dirty page of the node): the
    # EROFS mount's pages are clean, and they are the ones that must go.
    Path("/proc/sys/vm/drop_caches").write_text("1")


def test_cached_reads_are_served_natively_and_right(varied_env, mounter: Mounter) -> None:
    store, contents = varied_env
    mount = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    for path in sorted(contents):
        assert (mount.mountpoint / path).read_bytes() == contents[path], path
    first = mount.stats()
    assert first["mount"]["device_server"] == "native"
    assert first["mount"]["device_server_reason"] is None
    native = first["mount"]["native_server"]
    # Each chunk fetched by the server itself from the folder store's blob files
    # (tests/fuse/test_native_fetch.py), or by the daemon and handed over after the first
    # read of it: the rest of its reads are served natively.
    assert native["served_reads"] > 0 and native["forwarded"] + native["fetched_chunks"] > 0
    assert first["fetch"]["bytes_served"] >= sum(map(len, contents.values()))
    # With the page cache dropped every read is a device read again: each chunk was handed
    # over (fewer than the server holds), so the server answers them all itself, from the
    # chunk files, at any offset (read backwards, in odd pieces).
    _drop_page_cache()
    for path in sorted(contents, reverse=True):
        with open(mount.mountpoint / path, "rb") as f:
            size = len(contents[path])
            for start in reversed(range(0, size, 12_345)):
                f.seek(start)
                assert f.read(12_345) == contents[path][start:start + 12_345], (path, start)
    again = mount.stats()
    assert again["mount"]["native_server"]["forwarded"] == native["forwarded"]
    assert again["mount"]["native_server"]["served_reads"] > native["served_reads"]
    assert again["fetch"]["cache_misses"] == first["fetch"]["cache_misses"]
    assert again["fetch"]["bytes_served"] >= 2 * sum(map(len, contents.values()))


def _chunk_files(cache: Path) -> list[Path]:
    return [p for p in cache.glob("[0-9a-f][0-9a-f]/*") if len(p.name) == 64]


def test_chunks_the_cache_trusts_are_served_without_asking(varied_env, mounter: Mounter) -> None:
    store, contents = varied_env
    first = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    for path in sorted(contents):
        assert (first.mountpoint / path).read_bytes() == contents[path], path
    run_weenv("umount", str(first.mountpoint))
    # A new daemon over the same node cache: every chunk was verified in this boot, so the
    # server opens them itself; nothing is forwarded, nothing fetched.
    again = mounter.mount("env:t", store, cache=first.cache,
                          extra=["--path", "kernel", "--hint", "none"])
    for path in sorted(contents):
        assert (again.mountpoint / path).read_bytes() == contents[path], path
    stats = again.stats()
    assert stats["mount"]["native_server"]["forwarded"] == 0, stats["mount"]
    assert stats["fetch"]["cache_misses"] == 0 and stats["fetch"]["requests"] == 0
    assert stats["fetch"]["cache_hits"] >= len(_chunk_files(first.cache))
    run_weenv("umount", str(again.mountpoint))
    # A chunk file without this boot's marker is not trusted: damaged, it is never served;
    # the chunk is fetched again (and verified) and its file replaced.
    damaged = []
    for chunk in _chunk_files(first.cache):
        os.removexattr(chunk, "user.weenv.verified")
        data = bytearray(chunk.read_bytes())
        data[0] ^= 0xFF
        chunk.write_bytes(bytes(data))
        damaged.append(chunk)
    third = mounter.mount("env:t", store, cache=first.cache,
                          extra=["--path", "kernel", "--hint", "none"])
    third.expect_log_lines("is damaged")
    for path in sorted(contents):
        assert (third.mountpoint / path).read_bytes() == contents[path], path
    stats = third.stats()
    # Fetched again (by the server from the store's blob files), replacing the damaged files.
    assert stats["fetch"]["chunks_fetched"] == len(damaged), stats["fetch"]
    for chunk in damaged:
        assert blake3.blake3(chunk.read_bytes()).hexdigest() == chunk.name


def _recorded(store: Path) -> tuple[Hint, GroupIndex]:
    """The hint tagged `rec` of env:t in `store` (a recording mount published it when
    unmounted), and the index of the environment's group."""
    shown = json.loads(run_weenv("hints", "show", "env:t", "--store", str(store), "--hint",
                                 "rec", "--json").stdout)
    with open_store(str(store)) as opened:
        repo = Repository(opened)
        _, manifest = repo.resolve_env("env:t")
        return repo.get_hint(shown["hint"]), repo.get_index(manifest.groups[0].index)


def test_files_read_natively_are_in_the_recorded_hint(varied_env, mounter: Mounter) -> None:
    store, contents = varied_env
    small = [path for path in sorted(contents) if path.startswith("etc/")][:30]
    mount = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none",
                                                 "--record-hints", "rec"])
    for path in small:
        assert (mount.mountpoint / path).read_bytes() == contents[path]
    assert mount.stats()["mount"]["native_server"]["served_reads"] > 0
    run_weenv("umount", str(mount.mountpoint))
    hint, index = _recorded(store)
    # Every file read is in the hint's file table (what a replay warms), natively served or
    # not, in the order they were read.
    assert [f.inode for f in hint.files] == [index.resolve(p.encode()) for p in small]


def test_every_chunk_read_natively_is_in_the_recorded_hint(varied_env, mounter: Mounter) -> None:
    """A file read in its first chunk, then its last, then its second, every chunk served by
    the native server: the second is recorded too (the server once reported only chunks
    above the highest it had reported, so a library's middle chunks read after its tail were
    left out of hints, and each run with the hint fetched them on demand)."""
    store, contents = varied_env
    first = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    assert (first.mountpoint / "lib/big2").read_bytes() == contents["lib/big2"]
    run_weenv("umount", str(first.mountpoint))
    # A new daemon over the same node cache: the server serves every chunk itself.
    mount = mounter.mount("env:t", store, cache=first.cache,
                          extra=["--path", "kernel", "--hint", "none", "--record-hints", "rec"])
    chunk = 64 << 10  # tests/fuse/hint_mounts.py CHUNK
    fd = os.open(mount.mountpoint / "lib/big2", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # these pages, no read-ahead
        for at in (0, 5 * chunk, chunk):
            assert os.pread(fd, 4096, at) == contents["lib/big2"][at:at + 4096]
    finally:
        os.close(fd)
    assert mount.stats()["mount"]["native_server"]["forwarded"] == 0
    run_weenv("umount", str(mount.mountpoint))
    hint, index = _recorded(store)
    chunks = list(index.file_chunks(index.resolve(b"lib/big2")))
    assert [r.chunk for r in hint.records] == [chunks[0], chunks[5], chunks[1]]


def test_the_python_server_when_asked(varied_env, mounter: Mounter, monkeypatch) -> None:
    store, contents = varied_env
    monkeypatch.setenv(SERVER_VARIABLE, "python")
    mount = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    for path in sorted(contents):
        assert (mount.mountpoint / path).read_bytes() == contents[path], path
    shown = mount.stats()["mount"]
    assert shown["device_server"] == "python"
    assert shown["device_server_reason"] == f"{SERVER_VARIABLE}=python"
    assert "native_server" not in shown
    with pytest.raises(AssertionError):
        _server_pid(mount)


def _folder_statfs(mount: Mount) -> tuple[int, ...]:
    st = os.statvfs(daemon.kernel_dir(mount.mountpoint) / "devices")
    return (st.f_blocks, st.f_bfree, st.f_files, st.f_bsize, st.f_frsize, st.f_namemax)


def test_the_native_server_answers_statfs_as_the_python_server(
        varied_env, mounter: Mounter, monkeypatch) -> None:
    # How the runtime asks whether a kernel-path mount's daemon lives (check_answers).
    store, _contents = varied_env
    native = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    shown = _folder_statfs(native)
    monkeypatch.setenv(SERVER_VARIABLE, "python")
    python = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    assert shown == _folder_statfs(python)
    assert shown[0] > 0 and shown[2] >= 2 and shown[3] == 4096 and shown[5] == 255


def test_statfs_is_answered_without_a_round_trip_to_the_daemon(
        varied_env, mounter: Mounter) -> None:
    # The native server answers it (a warm sandbox's start asks once per shared mount); it
    # runs only while the daemon does: a stopped daemon still answers, a dead one does not
    # (test_a_killed_daemon_takes_its_native_server_along).
    store, _contents = varied_env
    mount = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    os.kill(mount.pid, signal.SIGSTOP)
    asking = subprocess.Popen([sys.executable, "-c", "import os, sys; os.statvfs(sys.argv[1])",
                               str(daemon.kernel_dir(mount.mountpoint) / "devices")])
    try:
        code = asking.wait(WAIT)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        # A request the daemon was sent waits for its answer whatever signal comes: it must
        # run again before the asker can end.
        os.kill(mount.pid, signal.SIGCONT)
        asking.wait(WAIT)
    assert code == 0, "the statfs waited for the stopped daemon"
    daemon.check_answers(mount.mountpoint)


def test_a_killed_native_server_fails_reads_and_ends_the_mount(
        varied_env, mounter: Mounter) -> None:
    store, contents = varied_env
    mount = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    assert (mount.mountpoint / "etc/s000").read_bytes() == contents["etc/s000"]
    mount.expect_log_lines(f"{HELPER} ended")
    # Opened before (the daemon then takes the mount down): its data is read after.
    opened = open(mount.mountpoint / "lib/big3", "rb", buffering=0)  # noqa: SIM115
    try:
        os.kill(_server_pid(mount), signal.SIGKILL)
        outcome = read_or_error(Path(f"/proc/self/fd/{opened.fileno()}"), WAIT)
    finally:
        opened.close()
    assert isinstance(outcome, OSError) and outcome.errno in (errno.EIO, errno.ENOTCONN), outcome
    wait_for(lambda: not daemon.process_alive(mount.pid), "the daemon ends", WAIT)
    assert f"{HELPER} ended" in mount.log_text()
    # The daemon took its mounts down on the way out.
    assert not daemon.is_mounted(mount.mountpoint)
    assert not daemon.kernel_dir(mount.mountpoint).exists()


def test_a_killed_daemon_takes_its_native_server_along(varied_env, mounter: Mounter) -> None:
    store, contents = varied_env
    mount = mounter.mount("env:t", store, extra=["--path", "kernel", "--hint", "none"])
    assert (mount.mountpoint / "etc/s001").read_bytes() == contents["etc/s001"]
    server = _server_pid(mount)
    os.kill(mount.pid, signal.SIGKILL)
    wait_for(lambda: not daemon.process_alive(server), f"{HELPER} ends", WAIT)
    outcome = read_or_error(mount.mountpoint / "lib/big4", WAIT)
    assert isinstance(outcome, OSError), outcome
    with pytest.raises(OSError) as dead:  # how the runtime finds a shared mount dead
        daemon.check_answers(mount.mountpoint)
    assert dead.value.errno == errno.ENOTCONN
    run_weenv("umount", "--lazy", str(mount.mountpoint))
    assert not daemon.is_mounted(mount.mountpoint)
