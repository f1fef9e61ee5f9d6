"""Sandboxes on real mounts: the upper layer, isolation, reset, namespaces, limits, config.

Every sandbox is a real overlayfs over a real `weenv mount` of an environment built from the
Debian minbase sample, run by real runc in real cgroups; `node_clean` (conftest) fails any test
that leaves something behind.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from rt_support import EnvRef

from weenvfs.format.manifest import RuntimeConfig
from weenvfs.fuse import daemon
from weenvfs.runtime import cgroups, etc_layer, start_weight
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.sandbox import UPPERS_ROOT
from weenvfs.tools.sample import sample_tree

MIB = 1 << 20


def _open(env: EnvRef, **kwargs: object) -> Environment:
    return Environment.open(env.ref, store=env.store, cache=env.cache, **kwargs)  # type: ignore[arg-type]


def test_writes_land_in_the_upper_and_the_shared_lower_is_untouched(env_ref: EnvRef) -> None:
    with _open(env_ref) as env:
        done = env.exec("echo new > /etc/added; echo more >> /etc/issue; rm /etc/debian_version")
        assert done.exit_code == 0, done.stderr
        upper = UPPERS_ROOT / env.id / "upper"
        assert (upper / "etc" / "added").read_bytes() == b"new\n"
        assert (upper / "etc" / "issue").read_bytes().endswith(b"more\n")
        whiteout = os.lstat(upper / "etc" / "debian_version")  # overlayfs: char device 0/0
        assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
        lower = env_ref.mountpoint()
        assert not (lower / "etc" / "added").exists()
        assert (lower / "etc" / "debian_version").exists()
        assert not (lower / "etc" / "issue").read_bytes().endswith(b"more\n")
        assert env.read_file("/etc/added") == b"new\n"
        with pytest.raises(FileNotFoundError):
            env.read_file("/etc/debian_version")


def test_two_sandboxes_of_one_environment_do_not_see_each_other(env_ref: EnvRef) -> None:
    with _open(env_ref) as a, _open(env_ref) as b:
        assert a.sandbox.lowers == b.sandbox.lowers  # one shared mount
        assert a.exec("echo from-a > /root/mine").ok
        b.write_file("/root/mine", b"from-b")
        assert a.exec(["cat", "/root/mine"]).stdout == b"from-a\n"
        assert b.exec(["cat", "/root/mine"]).stdout == b"from-b"
        assert b.exec(["test", "-e", "/etc/only-a"]).exit_code == 1
        a.write_file("/etc/only-a", "x")
        assert b.exec(["test", "-e", "/etc/only-a"]).exit_code == 1


# Every entry but `..`: that is the sandbox's root, whose upper a reset makes anew, so its
# time is the reset's (the listing differed in CI once, a minute boundary between the two).
LISTING = "ls -la /etc /root /tmp | grep -v ' \\.\\.$'; cat /etc/os-release"


def test_reset_restores_the_pristine_tree_and_kills_processes(env_ref: EnvRef) -> None:
    with _open(env_ref) as env:
        pristine = env.exec(LISTING).stdout
        env.exec("rm -rf /etc/apt; echo x > /root/x; mkdir -p /srv/deep/dir; chmod 700 /tmp")
        env.exec("sleep 1000 > /dev/null 2>&1 &")
        assert len(env.sandbox.processes()) == 2  # init and the sleep
        seconds = env.reset()
        assert seconds > 0
        assert env.sandbox.processes() == [env.sandbox.state["init_pid"]]
        assert env.exec(LISTING).stdout == pristine
        assert list((UPPERS_ROOT / env.id / "upper").iterdir()) == []
        assert env.sandbox.state["resets"] == 1
        assert not list(UPPERS_ROOT.glob(f".trash-{env.id}-*"))


def test_reset_of_a_tmpfs_upper(env_ref: EnvRef) -> None:
    with _open(env_ref, tmpfs_upper=True) as env:
        assert not (UPPERS_ROOT / env.id).exists()  # nothing on disk
        before = env.exec(["ls", "-A", "/root"]).stdout
        env.write_file("/root/a", b"1")
        env.reset()
        assert env.exec(["ls", "-A", "/root"]).stdout == before


def test_sandbox_sees_no_host_process(env_ref: EnvRef) -> None:
    with _open(env_ref) as env:
        done = env.exec("for p in /proc/[0-9]*; do echo ${p#/proc/}; done")
        pids = [int(x) for x in done.stdout.split()]
        assert 1 in pids and len(pids) <= 4, pids  # init, the shell, maybe its subshell
        assert env.exec(["cat", "/proc/1/cmdline"]).stdout.startswith(b"/dev/.weenv-init")
        marker = f"weenv-host-marker-{uuid.uuid4().hex}"
        cmdlines = env.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout.decode()
        assert marker not in cmdlines and "pytest" not in cmdlines


def test_network_none_has_only_loopback_and_host_shares_the_nodes(env_ref: EnvRef) -> None:
    def interfaces(text: bytes) -> set[str]:
        return {line.split(":")[0].strip() for line in text.decode().splitlines()[2:]}

    with _open(env_ref) as env:
        assert interfaces(env.exec(["cat", "/proc/net/dev"]).stdout) == {"lo"}
        # The image has no /etc/hosts; the sandbox has Docker's (etc_layer.py), so
        # localhost resolves, and /etc is still the image's folder (its files are there).
        assert not (sample_tree(None, "minbase", progress=False) / "etc" / "hosts").exists()
        found = env.exec(["getent", "hosts", "localhost"])  # through the C library
        assert found.exit_code == 0 and found.stdout.split()[1:2] == [b"localhost"], found
        assert env.exec(["cat", "/etc/hosts"]).stdout == etc_layer.HOSTS
        assert env.exec(["test", "-f", "/etc/os-release"]).exit_code == 0
    # Other jobs on the node add and remove interfaces: compare with those present
    # both before and after.
    before = interfaces(Path("/proc/net/dev").read_bytes())
    with _open(env_ref, network="host") as env:
        inside = interfaces(env.exec(["cat", "/proc/net/dev"]).stdout)
        assert env.exec(["cat", "/etc/hosts"]).stdout == Path("/etc/hosts").read_bytes()
    stable = before & interfaces(Path("/proc/net/dev").read_bytes())
    assert stable <= inside and len(inside) > 1


def test_limits_are_written_to_the_sandbox_cgroup(env_ref: EnvRef) -> None:
    with _open(env_ref, cpus=0.5, memory=256 * MIB, pids=77) as env:
        path = env.sandbox.cgroup_path
        assert path == f"/weenv/{env.id}" and "weenv" in env.id
        dirs = {d.parent.parent.name: d for d in cgroups.cgroup_dirs(path)}
        if "memory" in dirs:  # cgroup v1: one hierarchy per controller
            assert (dirs["memory"] / "memory.limit_in_bytes").read_text().strip() == str(256 * MIB)
            assert (dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
            assert (dirs["pids"] / "pids.max").read_text().strip() == "77"
        else:  # cgroup v2
            folder = next(iter(dirs.values()))
            assert (folder / "memory.max").read_text().strip() == str(256 * MIB)
            assert (folder / "cpu.max").read_text().split()[0] == "50000"
            assert (folder / "pids.max").read_text().strip() == "77"
        init = env.sandbox.state["init_pid"]
        assert init in env.sandbox.processes()


def test_the_init_starts_at_the_highest_cpu_weight_and_the_sandbox_runs_at_the_default(
    env_ref: EnvRef,
) -> None:
    # start_weight.py: the runtime's start asks for the highest weight, then the default is
    # written back before any command runs; a limit asked for is kept beside it.
    with _open(env_ref, cpus=0.5) as env:
        config = json.loads((env.sandbox.bundle / "config.json").read_text())
        assert config["linux"]["resources"]["cpu"] == {
            "quota": 50000, "period": 100000, "shares": start_weight.START_SHARES}
        assert "shares" not in env.sandbox.state["cgroup"]["resources"]["cpu"]  # not kept
        dirs = cgroups.cgroup_dirs(env.sandbox.cgroup_path)
        weights = {f.name: f.read_text().strip() for d in dirs
                   for f in (d / "cpu.shares", d / "cpu.weight") if f.exists()}
        assert weights in ({"cpu.shares": "1024"}, {"cpu.weight": "100"})
        seen = env.exec("cat /sys/fs/cgroup/cpu/cpu.shares 2>/dev/null || "
                        "cat /sys/fs/cgroup/cpu.weight")
        assert seen.stdout.strip() in (b"1024", b"100"), seen


def test_manifest_config_is_applied(make_env: Callable[..., EnvRef]) -> None:
    config = RuntimeConfig(
        env=("GREETING=hello", "PATH=/usr/bin:/bin"), cwd="/work/here", user="nobody"
    )
    env_ref = make_env(config)
    with _open(env_ref) as env:
        done = env.exec('echo "$GREETING $PATH $HOME"; pwd; id -u; id -g')
        assert done.stdout.decode().split() == [
            "hello",
            "/usr/bin:/bin",
            "/nonexistent",
            "/work/here",
            "65534",
            "65534",
        ]
        assert env.exec(["id", "-u"], user="0:0").stdout == b"0\n"
        assert env.exec(["id", "-u", "-n"], user="root").stdout == b"root\n"
        assert env.exec("id -u; id -g", user="1234:4321").stdout == b"1234\n4321\n"
        assert env.exec(["id", "-G"], user="root").stdout == b"0\n"
        assert env.exec(["pwd"], cwd="/tmp").stdout == b"/tmp\n"
        assert env.exec(["sh", "-c", "echo $X"], env={"X": "1"}).stdout == b"1\n"
        # The working directory did not exist in the image: it was made, owned by the user.
        assert env.exec(["stat", "-c", "%u", "/work/here"]).stdout == b"65534\n"


def test_exec_reports_statuses_and_feeds_input(env_ref: EnvRef) -> None:
    with _open(env_ref) as env:
        assert env.exec("exit 3").exit_code == 3
        assert env.exec("kill -9 $$").exit_code == 128 + 9
        missing = env.exec(["no-such-command"])
        assert missing.exit_code == 127 and b"not found" in missing.stderr
        # As a shell and docker run: a file that is not executable, or a folder, is 126.
        assert env.exec("touch /usr/local/bin/plain && mkdir /usr/local/bin/afolder").exit_code == 0
        for argv in (["/etc/passwd"], ["/etc"], ["plain"], ["afolder"]):  # the last two on PATH
            assert env.exec(argv).exit_code == 126, argv
        denied = env.exec(["/etc/passwd"])
        assert b"permission denied" in denied.stderr and b"not executable" in denied.stderr
        assert b"a directory" in env.exec(["/etc"]).stderr
        assert env.exec(["cat"], input=b"abc" * 100_000).stdout == b"abc" * 100_000
        both = env.exec("echo out; echo err >&2")
        assert (both.stdout, both.stderr) == (b"out\n", b"err\n")
        # A background child holding the pipes does not keep exec waiting.
        assert env.exec("sleep 1000 > /dev/null 2>&1 & echo started").stdout == b"started\n"


def test_file_access_cannot_escape_the_sandbox(env_ref: EnvRef) -> None:
    # The same absolute path exists on the host and (after the write) in the sandbox.
    secret = Path("/tmp") / f"weenv-test-secret-{uuid.uuid4().hex}"
    secret.write_text("host only")
    try:
        with _open(env_ref) as env:
            assert env.exec(["ln", "-s", str(secret), "/root/link"]).ok
            assert env.exec(["ln", "-s", "../../../../../../etc/hostname", "/root/up"]).ok
            with pytest.raises(FileNotFoundError):
                env.read_file("/root/link")  # resolved inside the sandbox: missing there
            assert env.read_file("/root/up") == env.exec(["cat", "/etc/hostname"]).stdout
            env.write_file("/root/link", b"inside")  # makes the target inside the sandbox
            assert secret.read_text() == "host only"
            assert env.exec(["cat", str(secret)]).stdout == b"inside"
            assert env.exec(["ln", "-s", "/no/such/dir/file", "/root/dangling"]).ok
            with pytest.raises(FileNotFoundError):
                env.write_file("/root/dangling", b"x")
    finally:
        secret.unlink()


def test_write_file_owner_and_parents(make_env: Callable[..., EnvRef]) -> None:
    env_ref = make_env(RuntimeConfig(user="nobody"))
    with _open(env_ref) as env:
        env.write_file("/tmp/a/b/c.txt", "hi", mode=0o600)
        assert env.exec(["stat", "-c", "%u %a", "/tmp/a/b", "/tmp/a/b/c.txt"]).stdout == (
            b"65534 755\n65534 600\n"
        )
        assert env.exec(["cat", "/tmp/a/b/c.txt"]).stdout == b"hi"


def test_last_sandbox_unmounts_the_environment(env_ref: EnvRef) -> None:
    mp = env_ref.mountpoint()
    env = _open(env_ref)
    try:
        pid = daemon.read_pid_file(mp)
        assert daemon.is_mounted(mp) and pid is not None
    finally:
        env.close()
    assert not daemon.is_mounted(mp)
    assert not daemon.process_alive(pid["pid"])
    assert not mp.parent.exists()
