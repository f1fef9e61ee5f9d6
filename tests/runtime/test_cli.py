"""`weenv run` and `weenv sandbox ...` end to end (subprocesses), plus the pure parts: the OCI
spec we generate and user resolution against an image's /etc/passwd and /etc/group."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from rt_support import EnvRef, run_weenv

from weenvfs.errors import UsageError
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.runtime import rootfs
from weenvfs.runtime.cgroups import Limits, oci_resources
from weenvfs.runtime.launcher import CgroupSpec, LaunchSpec, ProcessSpec, runtime_spec
from weenvfs.runtime.sandbox import UPPERS_ROOT


def _base(env: EnvRef) -> tuple[str, ...]:
    return ("--store", str(env.store), "--cache", str(env.cache))


def test_run_passes_stdio_and_exits_with_the_status(env_ref: EnvRef) -> None:
    done = run_weenv(
        "run",
        env_ref.ref,
        *_base(env_ref),
        "--",
        "sh",
        "-c",
        "cat; echo to-err >&2; exit 5",
        check=False,
        input=b"from stdin\n",
    )
    assert done.returncode == 5
    assert done.stdout == b"from stdin\n" and done.stderr == b"to-err\n"


def test_run_options(env_ref: EnvRef, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEENV_TEST_PASSED", "from here")  # -e KEY: its value here, if set
    monkeypatch.delenv("WEENV_TEST_UNSET", raising=False)
    done = run_weenv(
        "run",
        env_ref.ref,
        *_base(env_ref),
        "--tmpfs-upper",
        "--memory",
        "300M",
        "--cpus",
        "1.5",
        "--pids",
        "99",
        "-e",
        "A=b",
        "-e",
        "WEENV_TEST_PASSED",
        "-e",
        "WEENV_TEST_UNSET",
        "-u",
        "nobody",
        "-w",
        "/tmp",
        "--",
        "sh",
        "-c",
        "echo $A; id -un; pwd; cat /proc/net/dev | wc -l; "
        'echo "$WEENV_TEST_PASSED" "${WEENV_TEST_UNSET-unset}"',
    )
    assert done.stdout.decode().split("\n")[:5] == [  # 2 headers + lo
        "b", "nobody", "/tmp", "3", "from here unset"]
    host = run_weenv(
        "run", env_ref.ref, "--network", "host", *_base(env_ref), "--", "cat", "/proc/net/dev"
    )
    assert len(_interfaces(host.stdout)) > 1  # the node's interfaces, not only lo


def test_a_runs_one_shot_start_is_not_boosted(env_ref: EnvRef) -> None:
    # start_weight.py: its init starts the command at once, so its start is the command's.
    done = run_weenv("run", env_ref.ref, *_base(env_ref), "--", "sh", "-c",
                     "cat /sys/fs/cgroup/cpu/cpu.shares 2>/dev/null || "
                     "cat /sys/fs/cgroup/cpu.weight")
    assert done.stdout.strip() in (b"1024", b"100"), done


def _interfaces(text: bytes) -> set[str]:
    return {line.split(":")[0].strip() for line in text.decode().splitlines()[2:]}


def test_sandbox_lifecycle(env_ref: EnvRef) -> None:
    sid = (
        run_weenv(
            "sandbox",
            "create",
            env_ref.ref,
            *_base(env_ref),
            "--name",
            "weenv-clitest",
            "--memory",
            "128M",
        )
        .stdout.decode()
        .strip()
    )
    assert sid == "weenv-clitest"
    try:
        run_weenv("sandbox", "exec", sid, "--", "sh", "-c", "echo x > /root/x")
        assert run_weenv("sandbox", "exec", sid, "--", "cat", "/root/x").stdout == b"x\n"
        assert run_weenv("sandbox", "exec", sid, "--", "false", check=False).returncode == 1
        listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)
        mine = next(b for b in listed["sandboxes"] if b["id"] == sid)
        assert mine["status"] == "running" and mine["owner"] is None
        assert mine["limits"]["memory"] == 128 << 20 and mine["digest"] == env_ref.digest
        assert sid.encode() in run_weenv("sandbox", "ls").stdout
        reset = run_weenv("sandbox", "reset", sid)
        assert b"reset" in reset.stderr
        assert (
            run_weenv("sandbox", "exec", sid, "--", "test", "-e", "/root/x", check=False).returncode
            == 1
        )
        again = run_weenv(
            "sandbox", "create", env_ref.ref, *_base(env_ref), "--name", sid, check=False
        )
        assert again.returncode == 2 and b"exists already" in again.stderr
    finally:
        run_weenv("sandbox", "rm", sid)
    gone = run_weenv("sandbox", "exec", sid, "--", "true", check=False)
    assert gone.returncode == 2 and b"no sandbox" in gone.stderr
    assert not (UPPERS_ROOT / sid).exists()


def test_usage_errors_are_one_line(env_ref: EnvRef) -> None:
    no_store = run_weenv("run", env_ref.ref, "--", "true", check=False)
    assert no_store.returncode == 2 and no_store.stderr.count(b"\n") == 1
    assert b"--store" in no_store.stderr
    no_env = run_weenv("run", "nope:x", *_base(env_ref), "--", "true", check=False)
    assert no_env.returncode != 0 and no_env.stderr.startswith(b"weenv: error:")
    no_cmd = run_weenv("run", env_ref.ref, *_base(env_ref), check=False)
    assert no_cmd.returncode == 2 and b"entrypoint" in no_cmd.stderr
    # Limits the runtime cannot start with are refused before anything is made.
    for limit, words in ((("--pids", "1"), b"pids must be at least 2"),
                         (("--pids", "-1"), b"pids must be at least 2"),
                         (("--memory", "100K"), b"memory must be at least 6M")):
        refused = run_weenv("run", *limit, *_base(env_ref), env_ref.ref, "true", check=False)
        assert refused.returncode == 2 and refused.stderr.count(b"\n") == 1, refused.stderr
        assert words in refused.stderr


def test_run_follows_the_entrypoint_as_docker_run(make_env: Callable[..., EnvRef]) -> None:
    """COMMAND is the entrypoint's arguments in place of the cmd; no COMMAND: entrypoint +
    cmd; --entrypoint replaces the entrypoint and drops the cmd ("" : no entrypoint)."""
    env = make_env(RuntimeConfig(entrypoint=("echo", "entry"), cmd=("default",)))

    def run(*argv: str) -> bytes:
        return run_weenv("run", *_base(env), *argv).stdout

    assert run(env.ref) == b"entry default\n"
    assert run(env.ref, "x", "y") == b"entry x y\n"
    assert run("--entrypoint", "printf", env.ref, "%s-", "a", "b") == b"a-b-"
    assert run("--entrypoint", "/bin/echo", env.ref) == b"\n"  # the cmd went with it
    assert run("--entrypoint", "", env.ref, "echo", "plain") == b"plain\n"
    nothing = run_weenv("run", *_base(env), "--entrypoint", "", env.ref, check=False)
    assert nothing.returncode == 2 and b"no command given" in nothing.stderr


def test_run_takes_options_before_ref_and_the_command_after_it(env_ref: EnvRef) -> None:
    # docker run [OPTIONS] IMAGE [COMMAND] [ARG...]: the command's own options stay its own.
    done = run_weenv("run", *_base(env_ref), env_ref.ref, "echo", "hi", "--store", "x")
    assert done.stdout == b"hi --store x\n"
    box = run_weenv("sandbox", "create", *_base(env_ref), env_ref.ref).stdout.decode().strip()
    try:
        assert run_weenv("sandbox", "exec", "-w", "/tmp", box, "pwd").stdout == b"/tmp\n"
    finally:
        run_weenv("sandbox", "rm", box)


def test_options_after_ref_without_dashes_are_an_error_not_dropped(env_ref: EnvRef) -> None:
    done = run_weenv("run", env_ref.ref, *_base(env_ref), "echo", "hi", check=False)
    assert done.returncode == 2 and b"options go before REF" in done.stderr
    late = run_weenv("run", env_ref.ref, "echo", "hi", *_base(env_ref), check=False)
    assert late.returncode == 2 and b"--store is required (before REF" in late.stderr


@pytest.mark.parametrize("command", [("run",), ("sandbox", "create")])
def test_a_bad_option_value_is_reported_once(env_ref: EnvRef, command: tuple[str, ...]) -> None:
    tail = ("--", "true") if command == ("run",) else ()
    for argv in ((*command, env_ref.ref, *_base(env_ref), "--memory", "2X", *tail),
                 (*command, "--memory", "2X", *_base(env_ref), env_ref.ref, *tail)):
        done = run_weenv(*argv, check=False)
        assert done.returncode == 2
        assert done.stderr.count(b"invalid size") == 1, done.stderr


def test_help_shows_examples() -> None:
    for command in (
        ("run",),
        ("sandbox",),
        ("sandbox", "create"),
        ("sandbox", "exec"),
        ("sandbox", "reset"),
        ("sandbox", "rm"),
        ("sandbox", "ls"),
        ("sandbox", "gc"),
    ):
        done = run_weenv(*command, "--help")
        assert b"examples:" in done.stdout, command


def test_runtime_spec_namespaces_mounts_and_limits(tmp_path: Path) -> None:
    process = ProcessSpec(("sh",), ("PATH=/bin",), "/w", 5, 6, (7,))
    cgroup = CgroupSpec("/weenv/x", oci_resources(Limits(cpus=2, memory=1 << 30, pids=10)))
    spec = runtime_spec(LaunchSpec("x", tmp_path / "r", tmp_path / "b", process, cgroup))
    kinds = {n["type"] for n in spec["linux"]["namespaces"]}
    assert kinds == {"pid", "ipc", "uts", "mount", "network"}
    assert spec["linux"]["resources"]["memory"] == {"limit": 1 << 30}
    assert spec["linux"]["resources"]["cpu"] == {"quota": 200_000, "period": 100_000}
    assert spec["linux"]["resources"]["pids"] == {"limit": 10}
    assert spec["linux"]["cgroupsPath"] == "/weenv/x"
    assert spec["process"]["user"] == {"uid": 5, "gid": 6, "additionalGids": [7]}
    assert spec["process"]["args"] == ["/dev/.weenv-init", "-P"]
    destinations = {m["destination"] for m in spec["mounts"]}
    assert {"/proc", "/dev", "/dev/pts", "/dev/shm", "/sys", "/dev/.weenv-init"} <= destinations
    sys_mount = next(m for m in spec["mounts"] if m["destination"] == "/sys")
    assert "ro" in sys_mount["options"]
    host = runtime_spec(LaunchSpec("x", tmp_path, tmp_path, process, cgroup, network="host"))
    assert "network" not in {n["type"] for n in host["linux"]["namespaces"]}
    assert spec["process"]["cwd"] == "/"  # the waiting init's; commands bring their own


def test_runtime_spec_of_a_one_shot_sandbox_runs_the_command_under_the_init(
        tmp_path: Path) -> None:
    process = ProcessSpec(("sh", "-c", "exit 3"), ("PATH=/bin",), "/w", 5, 6, (7,))
    spec = runtime_spec(LaunchSpec("x", tmp_path, tmp_path, process, CgroupSpec("/weenv/x"),
                                   one_shot=True))
    assert spec["process"]["args"] == ["/dev/.weenv-init", "--", "sh", "-c", "exit 3"]
    assert spec["process"]["cwd"] == "/w"
    assert spec["process"]["user"] == {"uid": 5, "gid": 6, "additionalGids": [7]}
    assert spec["process"]["env"] == ["PATH=/bin"]


def test_run_ends_with_its_command_and_leaves_no_process(env_ref: EnvRef) -> None:
    """`weenv run` starts the command as the sandbox's only command (the init runs it): a
    process it leaves in the background ends with it, a signal's status is 128 + N."""
    left = run_weenv("run", env_ref.ref, *_base(env_ref), "--", "sh", "-c",
                     "sleep 600 & echo $! > /tmp/pid; echo started", timeout=120)
    assert left.stdout == b"started\n"
    killed = run_weenv("run", env_ref.ref, *_base(env_ref), "--", "sh", "-c", "kill -TERM $$",
                       check=False)
    assert killed.returncode == 143


def test_resolve_user_forms(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n"
        "bob:x:1001:1001::/home/bob:/bin/sh\n"
    )
    (tmp_path / "etc" / "group").write_text(
        "root:x:0:\nalice:x:1000:\nbob:x:1001:\ndocker:x:999:alice,bob\nvideo:x:44:alice\n"
    )
    assert rootfs.resolve_user(tmp_path, "") == rootfs.User(0, 0, (), "/root")
    assert rootfs.resolve_user(tmp_path, "alice") == rootfs.User(
        1000, 1000, (44, 999), "/home/alice"
    )
    assert rootfs.resolve_user(tmp_path, "1001") == rootfs.User(1001, 1001, (999,), "/home/bob")
    assert rootfs.resolve_user(tmp_path, "alice:docker") == rootfs.User(
        1000, 999, (), "/home/alice"
    )
    assert rootfs.resolve_user(tmp_path, "4242:7") == rootfs.User(4242, 7, (), "/")
    assert rootfs.resolve_user(tmp_path, "4242") == rootfs.User(4242, 0, (), "/")
    with pytest.raises(UsageError, match="no user"):
        rootfs.resolve_user(tmp_path, "mallory")
    with pytest.raises(UsageError, match="no group"):
        rootfs.resolve_user(tmp_path, "alice:nogroup")
    # /etc/passwd as a symlink out of the root is resolved inside it.
    (tmp_path / "etc" / "passwd").unlink()
    (tmp_path / "etc" / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(UsageError):
        rootfs.resolve_user(tmp_path, "root")  # the host's passwd is not read
