"""The syscall filter and no_new_privileges: what Docker's default profile refuses, a sandbox
refuses (with EPERM, as Docker); `--security-opt seccomp=unconfined|PATH` loosens it per
sandbox, and `weenv sandbox ls --json` says which profile is in force."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from support.runtime import EnvRef, run_weenv

from weenvfs.runtime.environment import Environment

PROBE = "/usr/local/bin/probe"  # where conftest.hostile_env puts the probe


def _open(env: EnvRef, **kwargs: object) -> Environment:
    return Environment.open(env.ref, store=env.store, cache=env.cache, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def probed(hostile_env: Callable[..., EnvRef]) -> EnvRef:
    """An environment with the probe and nothing hostile."""
    return hostile_env()


def _probe(env: Environment, verb: str) -> str:
    return env.exec([PROBE, verb]).stdout.decode().strip()


def test_the_default_profile_refuses_what_dockers_refuses(probed: EnvRef) -> None:
    with _open(probed) as env:
        for verb in ("add_key", "keyctl", "personality", "vsock", "unshare_user", "clone_ns"):
            assert _probe(env, verb) == "EPERM", verb
        escape = env.exec("unshare -U -r sh -c 'mount -t tmpfs none /mnt && echo mounted'")
        assert escape.exit_code != 0 and b"mounted" not in escape.stdout
        assert env.exec(["setarch", "-R", "true"]).exit_code != 0
        status = env.exec(["grep", "-E", "^(NoNewPrivs|Seccomp):", "/proc/self/status"])
        assert status.stdout.split() == [b"NoNewPrivs:", b"1", b"Seccomp:", b"2"]
        # What ordinary programs do still works: threads (clone without namespace flags),
        # chroot (CAP_SYS_CHROOT is in the capability set), sockets of ordinary families.
        assert env.exec("sleep 0.1 & wait; chroot / true; echo ok > /dev/tcp/127.0.0.1/1 "
                        "2>/dev/null; true").exit_code == 0


def test_unconfined_lifts_the_filter_and_ls_says_so(probed: EnvRef) -> None:
    with _open(probed, seccomp="unconfined") as env:
        assert _probe(env, "personality") == "ok"
        assert env.exec(["grep", "^Seccomp:", "/proc/self/status"]).stdout.split()[1] == b"0"
        listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)
        mine = [b for b in listed["sandboxes"] if b["id"] == env.id]
        assert mine[0]["seccomp"] == "unconfined" and mine[0]["no_new_privileges"] is True


def test_a_profile_from_a_file_in_dockers_format(probed: EnvRef, tmp_path: Path) -> None:
    profile = tmp_path / "deny-mkdir.json"
    profile.write_text(json.dumps({
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO",
                      "errnoRet": 13}],
    }))
    done = run_weenv("sandbox", "create", probed.ref, "--store", str(probed.store), "--cache",
                     str(probed.cache), "--security-opt", f"seccomp={profile}")
    box = done.stdout.decode().strip()
    try:
        made = run_weenv("sandbox", "exec", box, "--", "mkdir", "/made", check=False)
        assert made.returncode != 0 and b"Permission denied" in made.stderr
        assert run_weenv("sandbox", "exec", box, "--", PROBE, "personality").stdout == b"ok\n"
        listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)
        mine = [b for b in listed["sandboxes"] if b["id"] == box]
        assert mine[0]["seccomp"] == str(profile)
        run_weenv("sandbox", "reset", box)  # the profile was kept: the file is not read again
        profile.unlink()
        made = run_weenv("sandbox", "exec", box, "--", "mkdir", "/made", check=False)
        assert made.returncode != 0
    finally:
        run_weenv("sandbox", "rm", box)


@pytest.mark.parametrize("option", ["seccomp=/nonexistent/profile.json", "seccomp=",
                                    "apparmor=unconfined", "seccomp=BADJSON"])
def test_bad_security_options_are_one_line_errors(probed: EnvRef, tmp_path: Path,
                                                  option: str) -> None:
    if option.endswith("BADJSON"):
        bad = tmp_path / "bad.json"
        bad.write_text("{not json")
        option = f"seccomp={bad}"
    done = run_weenv("run", probed.ref, "--store", str(probed.store), "--cache",
                     str(probed.cache), "--security-opt", option, "--", "true", check=False)
    message = done.stderr.decode().strip()
    assert done.returncode == 2 and len(message.splitlines()) == 1, message
    assert "internal error" not in message
