"""The mount server (`weenv mountd`): mounts started by fork serve the same bytes, take the
client's environment, and a server that cannot serve a client declines so that the client
starts its daemon the usual way.

Every server here listens on a socket of the test's own ($WEENV_MOUNTD_SOCKET) and is stopped
by the `server` fixture, also when the test fails.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mounts import force_unmount, publish, run_weenv
from support import trees
from support.mount_server import mount_server, server_pid
from support.polling import wait_for

from weenvfs.errors import WeenvError
from weenvfs.fuse import (
    daemon,
    mountd,
    node_socket,
    service_evictions,
    service_forks,
    service_loading,
    service_preload,
)
from weenvfs.fuse.commands import mount_args
from weenvfs.fuse.spawn import spawn as spawn_daemon

pytestmark = pytest.mark.requires_fuse


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A mount server of this test (`weenv mountd --detach`, its log in `server.log` beside
    the socket); its socket path."""
    sock = tmp_path / "mountd" / "mountd.sock"
    with mount_server(sock, monkeypatch, log_file=sock.with_name("server.log")):
        yield sock


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each `mountd.launch` of this process answered (True: the server forked)."""
    answers: list[bool] = []
    real = mountd.launch

    def spy(*args: object) -> bool:
        answers.append(real(*args))  # type: ignore[arg-type]
        return answers[-1]

    monkeypatch.setattr(mountd, "launch", spy)
    return answers


@pytest.fixture
def spawned(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """`spawned(ref, store, **mount options)`: spawn.spawn of a mount in this process; the
    mount point. Everything is unmounted afterwards."""
    mountpoints: list[Path] = []

    def spawn(ref: str, store: Path, args: list[str] | None = None) -> Path:
        mp = tmp_path / f"mnt{len(mountpoints)}"
        mp.mkdir()
        mountpoints.append(mp)
        log = tmp_path / f"mount{len(mountpoints)}.log"
        argv = args if args is not None else mount_args(
            ref, mp, str(store), tmp_path / "cache", log_file=log)
        spawn_daemon([a.replace("{MP}", str(mp)) for a in argv], log)
        return mp

    try:
        yield spawn
    finally:
        for mp in mountpoints:
            if daemon.is_mounted(mp):
                try:
                    daemon.unmount(mp)
                except WeenvError:
                    force_unmount(mp)


def _hostile_mount(tmp_path: Path, launches: list[bool],
                   spawned: Callable[..., Path]) -> tuple[Path, int]:
    """The hostile tree published and mounted through the server (checked to be forked by
    it and to serve the tree exactly); the mount point and its daemon's pid."""
    src = trees.hostile_tree(tmp_path / "src")
    ref = publish(tmp_path / "store", [src])
    mp = spawned(ref, tmp_path / "store")
    assert launches == [True]
    trees.assert_trees_equal(src, mp)
    record = daemon.read_pid_file(mp)
    assert record is not None
    return mp, record["pid"]


def test_a_forked_daemon_serves_the_tree_exactly(tmp_path: Path, server: Path,
                                                 launches: list[bool],
                                                 spawned: Callable[..., Path]) -> None:
    mp, pid = _hostile_mount(tmp_path, launches, spawned)
    # The server's child (it reaps it), and `ps` shows what it serves.
    assert _parent(pid) == server_pid(server)
    assert str(mp).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    daemon.unmount(mp)
    assert not daemon.process_alive(pid)
    # The idle server wakes for its child's exit and reaps it: no zombie is left.
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, "the server never reaped its daemon"
        time.sleep(0.01)
    mountd.check_running()  # the server outlives its mounts


def test_daemons_forked_after_an_s3_request_show_what_they_serve(
        tmp_path: Path, server: Path, launches: list[bool], spawned: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request naming an S3 store makes the server build that store's client in the
    client's environment (service_preload.py), which replaces the server's C environment;
    `ps` still shows every daemon forked after it as the command it runs (setproctitle
    found the argument area through that environment: it failed silently in every later
    child, and they all showed the server's `weenv mountd` command line)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    ref = publish(tmp_path / "store", [src])
    for key, value in (("AWS_ACCESS_KEY_ID", "key"), ("AWS_SECRET_ACCESS_KEY", "secret"),
                       ("AWS_EC2_METADATA_DISABLED", "true")):
        monkeypatch.setenv(key, value)
    url = "s3://bucket/envs?endpoint=http://127.0.0.1:9&region=us-east-1"
    ready_read, ready_write = os.pipe()
    with open(tmp_path / "bad.log", "wb") as log:
        # A daemon that fails at once (no mount point); the server makes the client after.
        assert mountd.launch(["mount", ref, "--store", url], ready_write, log.fileno())
    os.close(ready_write)
    os.read(ready_read, 100)  # closed when that daemon exits
    os.close(ready_read)
    mp = spawned(ref, tmp_path / "store")
    record = daemon.read_pid_file(mp)
    assert record is not None
    title = Path(f"/proc/{record['pid']}/cmdline").read_bytes()
    assert b" mount " in title and str(mp).encode() in title and b"mountd" not in title
    daemon.unmount(mp)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_daemon_takes_the_clients_environment(tmp_path: Path, server: Path,
                                                  launches: list[bool],
                                                  spawned: Callable[..., Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The server started without $WEENV_CACHE; the client sets it, and the daemon (no
    --cache) caches there."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "data").write_bytes(os.urandom(300_000))
    ref = publish(tmp_path / "store", [src])
    cache = tmp_path / "client-cache"
    monkeypatch.setenv("WEENV_CACHE", str(cache))
    log = tmp_path / "m.log"
    mp = spawned(ref, tmp_path / "store", ["--log-file", str(log), "mount", ref, "{MP}",
                                           "--store", str(tmp_path / "store"), "--foreground"])
    assert launches == [True]
    assert (mp / "data").read_bytes() == (src / "data").read_bytes()
    assert any(p.is_file() for p in cache.rglob("*")), "the chunk was not cached in $WEENV_CACHE"


def test_a_stale_server_declines_and_exits(tmp_path: Path, server: Path, launches: list[bool],
                                           spawned: Callable[..., Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Code installed after the server started: the client mounts the slow way, and the
    server exits rather than fork old code again."""
    pid = server_pid(server)
    assert pid is not None
    monkeypatch.setattr(node_socket, "fingerprint", lambda: "weenvfs was upgraded")
    src = trees.hostile_tree(tmp_path / "src")
    ref = publish(tmp_path / "store", [src])
    mp = spawned(ref, tmp_path / "store")
    assert launches == [False]
    trees.assert_trees_equal(src, mp)
    daemon.wait_exit(pid, 30)
    assert not server.exists()
    # and says why in its log (it is otherwise gone without a word)
    assert "exiting: a client runs other code" in server.with_name("server.log").read_text()


def test_another_namespace_is_declined(tmp_path: Path, server: Path, launches: list[bool],
                                       spawned: Callable[..., Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_socket, "namespaces", lambda: {"mnt": "mnt:[1]", "net": "net:[2]"})
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    ref = publish(tmp_path / "store", [src])
    mp = spawned(ref, tmp_path / "store")
    assert launches == [False]
    assert (mp / "f").read_text() == "x"
    mountd.check_running()  # still serving clients of its own namespaces


def test_a_client_in_a_private_mount_namespace_mounts_the_slow_way(
        tmp_path: Path, server: Path) -> None:
    """A mount the server made would be invisible inside `unshare -m`: the real check."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("private")
    ref = publish(tmp_path / "store", [src])
    mp = tmp_path / "mnt"
    mp.mkdir()
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from weenvfs.fuse import daemon, mountd, spawn\n"
        "from weenvfs.fuse.commands import mount_args\n"
        f"mp, log = Path({str(mp)!r}), Path({str(tmp_path / 'm.log')!r})\n"
        f"args = mount_args({ref!r}, mp, {str(tmp_path / 'store')!r}, "
        f"Path({str(tmp_path / 'cache')!r}), log_file=log)\n"
        "answers = []\n"
        "real = mountd.launch\n"
        "mountd.launch = lambda *a: answers.append(real(*a)) or answers[-1]\n"
        "spawn.spawn(args, log)\n"
        "print(answers, (mp / 'f').read_text())\n"
        "daemon.unmount(mp)\n"
    )
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable,
                           "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[False]", "private"]


def test_a_daemon_error_is_reported_the_same_way(tmp_path: Path, server: Path,
                                                 launches: list[bool],
                                                 spawned: Callable[..., Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    publish(tmp_path / "store", [src])
    messages = []
    for switch in ("on", "off"):
        monkeypatch.setenv(mountd.SWITCH_ENV, switch)
        with pytest.raises(WeenvError) as caught:
            spawned("missing:t", tmp_path / "store")
        messages.append(str(caught.value))
    assert launches == [True, False]
    assert messages[0] == messages[1] and "missing" in messages[0] and "\n" not in messages[0]
    mountd.check_running()


def test_bad_requests_are_refused_and_the_server_goes_on(server: Path) -> None:
    def ask(payload: bytes, fds: list[int]) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(str(server))
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            conn.sendmsg([payload], ancillary if fds else [])
            return conn.recv(4096)

    assert ask(b"not json\n", []).startswith(b"error:")
    request = (b'{"argv": [], "env": {}, "umask": 18, "fingerprint": "%s", "namespaces": %s}\n'
               % (mountd.fingerprint().encode(),
                  str(node_socket.namespaces()).replace("'", '"').encode()))
    assert ask(request, []).startswith(b"refused: a request of kind daemon passes exactly 2")
    read_end, write_end = os.pipe()
    try:
        assert ask(request, [write_end]).startswith(b"refused")
        attached = request.replace(b'"umask"', b'"kind": "attached", "cwd": "/", "umask"')
        assert ask(attached, [write_end, write_end]).startswith(
            b"refused: a request of kind attached passes exactly 5")
        # An eviction is answered before it is forked, but never a bad one.
        evict = request.replace(b'"umask": 18', b'"kind": "evict", "umask": 18')
        assert ask(evict.replace(b'"env": {}', b'"env": []'), []).startswith(b"error:")
        assert ask(evict.replace(b'"umask": 18', b'"umask": "x"'), []).startswith(b"error:")
    finally:
        os.close(read_end)
        os.close(write_end)
    mountd.check_running()


def test_check_stop_and_idle_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "mountd.sock"
    monkeypatch.setenv(mountd.SOCKET_ENV, str(sock))
    done = run_weenv("mountd", "--check", check=False)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "no mount server answers" in done.stderr
    assert "no mount server was running" in run_weenv("mountd", "--stop").stdout
    run_weenv("mountd", "--detach", "--idle", "5")
    pid = server_pid(sock)
    assert pid is not None
    try:
        # A second server on the same socket steps aside at once.
        second = subprocess.run([sys.executable, "-m", "weenvfs", "mountd"], timeout=60,
                                capture_output=True, text=True, check=False)
        assert second.returncode == 0
        daemon.wait_exit(pid, 60)  # idle for five seconds: gone
        assert not sock.exists()
    finally:
        if daemon.process_alive(pid) and mountd._is_server(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_socket_path_longer_than_a_unix_address(tmp_path: Path, launches: list[bool],
                                                  spawned: Callable[..., Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """sun_path holds 108 bytes; a deeper socket is reached through /proc/self/fd."""
    sock = tmp_path / ("d" * 60) / ("e" * 60) / "mountd.sock"
    sock.parent.mkdir(parents=True)
    assert len(str(sock)) > 108
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("deep")
    ref = publish(tmp_path / "store", [src])
    with mount_server(sock, monkeypatch):
        mountd.check_running()
        mp = spawned(ref, tmp_path / "store")
        assert launches == [True]
        assert (mp / "f").read_text() == "deep"


def test_a_new_server_starts_while_an_old_ones_mounts_live(
        tmp_path: Path, launches: list[bool], spawned: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked daemons keep nothing of the server: not its socket, not its lock."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("still here")
    ref = publish(tmp_path / "store", [src])
    sock = tmp_path / "mountd" / "mountd.sock"
    with mount_server(sock, monkeypatch):
        first = spawned(ref, tmp_path / "store")
    assert (first / "f").read_text() == "still here"
    with mount_server(sock, monkeypatch):  # would fail if the daemon held the lock
        second = spawned(ref, tmp_path / "store")
        assert (second / "f").read_text() == "still here"
    assert launches == [True, True]


# -- the node service: started by the first mount -------------------------------------------


@pytest.fixture
def own_cgroup(tmp_path: Path) -> Iterator[Path | None]:
    """A new cgroup of this test (cgroup v1 memory hierarchy, else cgroup2), or None;
    removed after the test however it ended (its processes are gone by then: the test
    waits for its subprocess; a moment is allowed for the kernel to let go)."""
    folder = None
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            candidate = root / f"weenv-test-mountd-{os.getpid()}-{tmp_path.name}"
            try:
                candidate.mkdir()
            except OSError:
                continue
            folder = candidate
            break
    try:
        yield folder
    finally:
        if folder is not None:
            wait_for(lambda: _removed(folder), f"the removal of {folder}", 10.0)


def _removed(folder: Path) -> bool:
    try:
        folder.rmdir()
    except FileNotFoundError:
        return True
    except OSError:  # EBUSY while a process in it exits
        return False
    return True


def _cgroup_of(pid: int, root: Path) -> str:
    """The path of `pid` in the hierarchy mounted at `root`."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    wanted = "memory" if root.name == "memory" else ""
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if wanted in controllers.split(",") or (not wanted and not controllers):
            return where
    raise AssertionError(f"no {root} line in /proc/{pid}/cgroup")


def test_a_mount_starts_the_node_service_outside_the_callers_cgroup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_cgroup: Path | None,
        require_or_skip: Callable[[object, str], None]) -> None:
    """No server answers: the first mount starts one (which leaves the caller's cgroup
    before it serves) and forks from it; the second mount forks from the same server."""
    require_or_skip(os.geteuid() == 0, "moving processes between cgroups needs root")
    group = own_cgroup
    require_or_skip(group is not None, "no writable cgroup hierarchy")
    assert group is not None
    sock = tmp_path / "auto" / "mountd.sock"
    monkeypatch.setenv(mountd.SOCKET_ENV, str(sock))
    monkeypatch.delenv(mountd.SWITCH_ENV, raising=False)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("auto")
    ref = publish(tmp_path / "store", [src])
    mps = [tmp_path / "mnt0", tmp_path / "mnt1"]
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from weenvfs.fuse import daemon, mountd, spawn\n"
        "from weenvfs.fuse.commands import mount_args\n"
        f"Path({str(group / 'cgroup.procs')!r}).write_text(str(os.getpid()))\n"
        "answers = []\n"
        "real = mountd.launch\n"
        "mountd.launch = lambda *a: answers.append(real(*a)) or answers[-1]\n"
        f"for n, mp in enumerate(({str(mps[0])!r}, {str(mps[1])!r})):\n"
        "    Path(mp).mkdir()\n"
        f"    log = Path({str(tmp_path)!r}) / f'm{{n}}.log'\n"
        f"    args = mount_args({ref!r}, Path(mp), {str(tmp_path / 'store')!r}, "
        f"Path({str(tmp_path / 'cache')!r}), log_file=log)\n"
        "    spawn.spawn(args, log)\n"
        "    print(Path(mp, 'f').read_text())\n"
        "print(answers)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=180, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["auto", "auto", "[True,", "True]"]
        pid = server_pid(sock)
        assert pid is not None and mountd._is_server(pid)
        mountd.check_running()
        # The server and the daemons it forked live outside the caller's cgroup.
        inside = "/" + group.name
        assert _cgroup_of(pid, group.parent) != inside
        for mp in mps:
            record = daemon.read_pid_file(mp)
            assert record is not None and _cgroup_of(record["pid"], group.parent) != inside
            assert _parent(record["pid"]) == pid  # the server's child: it reaps it
    finally:
        for mp in mps:
            if daemon.is_mounted(mp):
                try:
                    daemon.unmount(mp)
                except WeenvError:
                    force_unmount(mp)
        pid = mountd.stop()
        assert pid is None or not daemon.process_alive(pid)


def test_opting_out_starts_no_server(tmp_path: Path, launches: list[bool],
                                     spawned: Callable[..., Path],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "off" / "mountd.sock"
    monkeypatch.setenv(mountd.SOCKET_ENV, str(sock))
    monkeypatch.setenv(mountd.SWITCH_ENV, "off")
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("slow way")
    ref = publish(tmp_path / "store", [src])
    mp = spawned(ref, tmp_path / "store")
    assert launches == [False]
    assert (mp / "f").read_text() == "slow way"
    assert not sock.exists() and server_pid(sock) is None


def test_an_idle_server_stays_while_its_daemons_live(
        tmp_path: Path, launches: list[bool], spawned: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--idle` counts only once no mount daemon the server forked runs."""
    sock = tmp_path / "idle" / "mountd.sock"
    monkeypatch.setenv(mountd.SOCKET_ENV, str(sock))
    monkeypatch.delenv(mountd.SWITCH_ENV, raising=False)
    run_weenv("mountd", "--detach", "--idle", "1")
    pid = server_pid(sock)
    assert pid is not None
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "f").write_text("x")
        ref = publish(tmp_path / "store", [src])
        mp = spawned(ref, tmp_path / "store")
        assert launches == [True]
        # Well past its idle second, it still runs: its daemon does.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            time.sleep(0.2)
        assert daemon.process_alive(pid)
        daemon.unmount(mp)
        daemon.wait_exit(pid, 60)  # no daemon left, and idle: it exits by itself
    finally:
        if daemon.process_alive(pid) and mountd._is_server(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_request_naming_an_s3_store_makes_its_client_ahead(monkeypatch) -> None:
    """`service_preload.prebuild_clients` after answering: the next children opening the
    same store in the same environment take the client over (tests/store/test_s3.py checks
    the taking); no client is made for other stores or without static keys, and a bad URL is
    no error."""
    from weenvfs.store import s3_clients

    monkeypatch.setattr(s3_clients, "prebuilt", {})
    url = "s3://bucket/envs?endpoint=http://127.0.0.1:9&region=us-east-1"
    env = {"AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret", "HOME": "/root",
           "AWS_EC2_METADATA_DISABLED": "true"}
    for argv, env_ in ((["mount", "x", "--store", "/srv/weenv"], env),
                       (["mount", "x", "--store", url], {"HOME": "/root"}),
                       (["mount", "x", "--store", "s3://"], env)):
        service_preload.prebuild_clients({"argv": argv, "env": env_})
    assert s3_clients.prebuilt == {}
    service_preload.prebuild_clients({"argv": ["sandbox", "resolve", "e:t", "--store", url],
                                      "env": env})
    assert [key[0] for key in s3_clients.prebuilt] == [url]


def _hostile_env(tmp_path: Path) -> tuple[Path, Path, str, str, Any]:
    """A hostile tree published as env:t: (source, store, reference, digest, manifest)."""
    from weenvfs.store import open_store
    from weenvfs.store.repository import Repository

    src = trees.hostile_tree(tmp_path / "src")
    store = tmp_path / "store"
    ref = publish(store, [src])
    with open_store(str(store)) as opened:
        digest, manifest = Repository(opened).resolve_env(ref)
    return src, store, ref, digest, manifest


def test_a_request_s_environment_is_kept_in_memory_for_the_next_children(
        tmp_path: Path, server: Path, spawned: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`service_preload.preload_envs` after answering: the manifest and indexes of the
    environment a mount or replay request names (a manifest digest with node copies in its
    `--cache`) are kept in the server's memory (core/node_copies.py `preload_env`), hashed
    on one thread (a forked child must be able to hash on many:
    tests/format/test_digest_fork.py); other arguments and relative folders keep nothing.
    Through the server: a daemon forked after that takes the kept index, not the node copy
    (damaged here, which a load would say in its log)."""
    from weenvfs.core import node_copies
    from weenvfs.format import digest as digests

    monkeypatch.setattr(digests, "_threads_allowed", True)
    monkeypatch.setattr(node_copies, "_preloaded", type(node_copies._preloaded)())
    src, store, _, env_digest, manifest = _hostile_env(tmp_path)
    cache = tmp_path / "cache"  # the `spawned` mounts' node cache
    mounts = [spawned(env_digest, store) for _ in range(2)]  # the second is kept by the server
    args = mount_args(env_digest, tmp_path / "mnt", str(store), cache, log_file=tmp_path / "l")
    service_preload.preload_envs({"argv": [*args[:-1], "0" * 64, args[-1]], "env": {}})
    assert {key for key in node_copies._preloaded} == {
        ("manifest", str(cache), env_digest), ("index", str(cache), manifest.groups[0].index)}
    assert digests._threads_allowed is False
    node_copies.forget_preloaded()
    service_preload.preload_envs({"argv": [a if a != str(cache) else "cache" for a in args],
                                  "env": {}})
    service_preload.preload_envs({"argv": ["mount", env_digest, "/mnt"], "env": {}})
    assert not node_copies._preloaded
    copy = cache / node_copies.INDEX_DIR / manifest.groups[0].index
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    mounts.append(spawned(env_digest, store))
    for mp in mounts:
        trees.assert_trees_equal(src, mp)
    assert "is damaged" not in (tmp_path / "mount3.log").read_text()
    assert copy.read_bytes() == bytes(data)  # nobody loaded (and so replaced) it


def test_a_mount_by_tag_has_its_environment_kept_for_the_next_one(
        tmp_path: Path, spawned: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`weenv mount NAME:TAG` names no digest: its daemon notes what the tag resolved to
    (core/node_copies.py `note_resolved`), and the server preloads that environment for the
    next request naming the same tag in the same `--store` argument (nothing for another
    store argument); once the tag moves, the next mount notes the new digest."""
    from weenvfs.core import node_copies
    from weenvfs.store import open_store
    from weenvfs.store.repository import Repository

    monkeypatch.setattr(node_copies, "_preloaded", type(node_copies._preloaded)())
    src, store, ref, env_digest, manifest = _hostile_env(tmp_path)
    cache = tmp_path / "cache"
    args = mount_args(ref, tmp_path / "mnt", str(store), cache, log_file=tmp_path / "l")
    service_preload.preload_envs({"argv": args, "env": {}})
    assert not node_copies._preloaded  # no mount of the tag on this node yet
    trees.assert_trees_equal(src, spawned(ref, store))
    assert node_copies.last_resolved(cache, str(store), ref) == env_digest
    other = [a if a != str(store) else str(tmp_path / "elsewhere") for a in args]
    service_preload.preload_envs({"argv": other, "env": {}})
    assert not node_copies._preloaded
    service_preload.preload_envs({"argv": args, "env": {}})
    assert {key for key in node_copies._preloaded} == {
        ("manifest", str(cache), env_digest), ("index", str(cache), manifest.groups[0].index)}
    (src / "moved").write_bytes(b"the tag moves")
    assert publish(store, [src]) == ref
    with open_store(str(store)) as opened:
        moved, _ = Repository(opened).resolve_env(ref)
    assert moved != env_digest
    trees.assert_trees_equal(src, spawned(ref, store))  # resolved in the store, not the note
    assert node_copies.last_resolved(cache, str(store), ref) == moved


def test_the_server_loads_what_its_children_need_in_order(assert_logs: Any) -> None:
    """`Preload`'s steps: what a command needs (the parsers, the runtime's modules), then
    what mount daemons need (trio, pyfuse3, the fuse modules, the store backends, the S3
    model), then the rarely used commands' modules. `take_for` takes what one child needs;
    what each step made is frozen at once (gc.freeze: no child, whenever forked, traverses
    those objects in a collection and copies them on write); a failing step is logged and
    the rest go on."""
    import gc

    made: list[str] = []
    steps = service_loading.preload_steps(("weenvfs.runtime.commands", "trio"),
                                          lambda: made.append("made"),
                                          later=("weenvfs.tools.registry_auth",))
    names = [name for name, _, _ in steps]
    assert names[:4] == ["prepare", "import weenvfs.runtime.commands", "import trio",
                         "import pyfuse3"]
    assert names[-2:] == ["the S3 model", "import weenvfs.tools.registry_auth"]
    assert tuple(by for _, _, by in steps)[-5:-2] == ("file", "http", "s3")
    assert "import weenvfs.fuse.mount" in names and names.count("import trio") == 1
    broken = [("import nowhere", lambda: __import__("weenvfs.no_such_module"),
               service_loading.COMMANDS), *steps]
    gc.unfreeze()
    try:
        preload = service_loading.Preload(broken)
        with assert_logs(r"preloading \(import nowhere\) failed", count=1):
            preload.take_for(None, daemon=False)  # a command's: up to the runtime's modules
        assert made == ["made"] and "import weenvfs.fuse.mount" not in _taken(preload, names)
        assert gc.get_freeze_count() > 0
        preload.take_for("/srv/store", daemon=True)  # a daemon of a local store
        assert "import weenvfs.store.http" not in _taken(preload, names)
        preload.take_for("s3://bucket/prefix", daemon=True)
        assert _taken(preload, names)[-1] == "the S3 model" and preload.pending
        while preload.pending:
            preload.step()
    finally:
        gc.unfreeze()


def _taken(preload: service_loading.Preload, names: list[str]) -> list[str]:
    """The steps of `names` that `preload` has taken."""
    left = {name for name, _, _ in preload._steps}
    return [name for name in names if name not in left]


@contextlib.contextmanager
def _slow_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 prepare: str) -> Iterator[tuple[subprocess.Popen[bytes], float, Path]]:
    """A server of this test in a process of its own whose first preload step is the
    function `prepare` (its source: `def prepare(): ...`); (its process, seconds until it
    was ready, its log). Stopped at the end."""
    sock = tmp_path / "mountd" / "mountd.sock"
    monkeypatch.setenv(mountd.SOCKET_ENV, str(sock))
    monkeypatch.delenv(mountd.SWITCH_ENV, raising=False)
    log = tmp_path / "server.log"
    code = ("import os, sys, time, logging\n"
            "from weenvfs import cli\n"
            "from weenvfs.fuse import mountd\n"
            "logging.basicConfig(filename=sys.argv[2], level=logging.INFO)\n"
            "ready = int(sys.argv[1])\n"
            f"{prepare}\n"
            "mountd.serve(0, cli.main, ready=lambda: os.write(ready, b'ready'),\n"
            "             preload=cli.service_modules(), prepare=prepare)\n")
    read_end, write_end = os.pipe()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code, str(write_end), str(log)],
                            pass_fds=(write_end,))
    os.close(write_end)
    try:
        assert select.select([read_end], [], [], 60)[0] and os.read(read_end, 5) == b"ready"
        yield proc, time.monotonic() - started, log
    finally:
        os.close(read_end)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_the_server_answers_before_it_has_preloaded(tmp_path: Path, launches: list[bool],
                                                    spawned: Callable[..., Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The server listens before it loads its children's code: whoever started it waits for
    the socket only, and a mount requested meanwhile is forked once its steps are taken (not
    the freeze after them) and serves the tree exactly."""
    with _slow_server(tmp_path, monkeypatch, "def prepare(): time.sleep(2)") as (proc, took,
                                                                             log):
        assert took < 2.0  # before the first step (2 s) was done
        _, pid = _hostile_mount(tmp_path, launches, spawned)
        assert _parent(pid) == proc.pid
        deadline = time.monotonic() + 60
        while "preloaded its children's code" not in log.read_text() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert text.index("preloaded its children's code") > text.index("listening on")


def test_a_server_stopped_while_preloading_stops(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM in a preload step whose code catches every exception (as libraries may) still
    ends the server once that step returns."""
    swallow = ("def prepare():\n"
               "    for _ in range(300):\n"
               "        try:\n"
               "            time.sleep(0.01)\n"
               "        except BaseException:\n"
               "            pass\n")
    with _slow_server(tmp_path, monkeypatch, swallow) as (proc, _, log):
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "mount server stopping" in log.read_text()


def test_a_stop_swallowed_since_the_loop_looked_ends_the_wait_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM whose `_Stop` an at-fork hook swallowed (logging's, after the server forked
    its exporter again: CI saw it) leaves only the flag: the loop's wait for a client raises
    it before it sleeps, instead of sleeping until its next chore while `mountd --stop`
    gives up (and the server, killed then, leaves its socket and files behind)."""
    monkeypatch.setattr(mountd, "_stopping", [True])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        started = time.monotonic()
        with pytest.raises(mountd._Stop):
            mountd._wait_for_client(listener, 30.0)
        assert time.monotonic() - started < 10  # not the wait's own timeout
    monkeypatch.setattr(mountd, "_stopping", [])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(tmp_path / "wait.sock"))
        listener.listen(1)
        assert mountd._wait_for_client(listener, 0.05) is False  # no flag: it waits


def test_evictions_run_one_at_a_time_per_environment_and_once_more_after(
        tmp_path: Path) -> None:
    """EVICT requests (a sandbox released its mounts): the server forks the eviction with the
    client's environment; while one runs for the same WEENV_ variables, any number of new
    requests make exactly one more run after it; another environment's runs at once."""
    runs = tmp_path / "runs"

    def run(argv: list[str]) -> int:
        with open(runs, "a") as f:
            f.write(f"{os.environ['WEENV_ENVS_ROOT']} {' '.join(argv)}\n")
        time.sleep(1.0)
        return 0

    evictions = service_evictions.Evictions((), run)
    for root in ("a", "a", "a", "a", "b"):
        request = {"env": {"WEENV_ENVS_ROOT": root, "PATH": os.environ["PATH"]}, "umask": "18"}
        evictions.ask(evictions.key(request), request, ())
    deadline = time.monotonic() + 60
    while evictions.poll() or any(evictions._still_running(k) for k in list(evictions.running)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    line = " ".join(service_evictions.HOUSEKEEPING)
    assert sorted(runs.read_text().splitlines()) == [f"a {line}", f"a {line}", f"b {line}"]


def test_a_detached_command_runs_in_its_own_session_and_is_reaped_once_it_exits(
        tmp_path: Path) -> None:
    """`detached` returns the child's pid at once; the child runs in a session of its own;
    its pidfd (`child_fds`) wakes a poll when it exits, and `reap_forked` then collects it:
    no zombie is left. Other children's pidfds are not the child's to hold."""
    marker = tmp_path / "ran"
    release = tmp_path / "release"

    def body() -> None:
        held = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
        marker.write_text(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "fds": held}))
        while not release.exists():
            time.sleep(0.01)

    first = service_forks.detached((), lambda: time.sleep(30))
    pid = service_forks.detached((), body)
    try:
        assert pid > 0 and len(service_forks.child_fds()) >= 2
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "the detached body never ran"
            time.sleep(0.01)
        seen = json.loads(marker.read_text())
        assert seen["pid"] == pid and seen["sid"] == pid  # a session leader: its own session
        assert "anon_inode:[pidfd]" not in seen["fds"]  # not even its elder sibling's
        release.write_text("")
        poller = select.poll()
        for fd in service_forks.child_fds():
            poller.register(fd, select.POLLIN)
        assert poller.poll(30_000), "no pidfd woke the poll when the child exited"
        while pid in service_forks._children:
            service_forks.reap_forked()
            assert time.monotonic() < deadline, "the child was never reaped"
            time.sleep(0.01)
        assert not os.path.exists(f"/proc/{pid}")  # reaped: no zombie left
    finally:
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while first in service_forks._children:
            service_forks.reap_forked()
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_request_eviction_needs_a_running_server(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv(mountd.SOCKET_ENV, str(tmp_path / "none.sock"))
    assert not mountd.request_eviction()  # none runs, and none is started for it
    assert not (tmp_path / "none.sock").exists()
    monkeypatch.setenv(mountd.SWITCH_ENV, "off")
    assert not mountd.request_eviction()
