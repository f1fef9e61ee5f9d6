"""`--disk SIZE`: a sandbox's writable layer holds at most SIZE bytes; writing past it gives
ENOSPC inside the sandbox, not a full node. The upper is an ext4 image on a loop device (or,
with --tmpfs-upper, a tmpfs of that size); every exit path leaves no mount and no loop device
(`node_clean` checks both)."""

from __future__ import annotations

import json

import pytest
from support.runtime import EnvRef, loop_devices, run_weenv

from weenvfs.errors import UsageError
from weenvfs.runtime.environment import Environment

MIB = 1 << 20
FILL = "dd if=/dev/zero of=/fill bs=1M count=64 2>&1; sync"


def _base(env: EnvRef) -> tuple[str, ...]:
    return ("--store", str(env.store), "--cache", str(env.cache))


@pytest.mark.parametrize("tmpfs", [False, True])
def test_writing_past_the_disk_limit_gives_enospc(env_ref: EnvRef, tmpfs: bool) -> None:
    extra = ("--tmpfs-upper",) if tmpfs else ()
    done = run_weenv("run", env_ref.ref, *_base(env_ref), "--disk", "24M", *extra, "--",
                     "sh", "-c", FILL, check=False)
    assert b"No space left on device" in done.stdout, done.stdout + done.stderr


def test_the_limit_holds_across_resets_and_ls_shows_it(env_ref: EnvRef) -> None:
    loops_before = loop_devices()
    with Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache,
                          disk=24 * MIB) as env:
        assert len(loop_devices() - loops_before) == 1
        assert b"No space left" in env.exec(FILL).stdout
        listed = json.loads(run_weenv("sandbox", "ls", "--json").stdout)
        mine = [b for b in listed["sandboxes"] if b["id"] == env.id]
        assert mine[0]["disk"] == 24 * MIB
        env.reset()
        assert env.exec(["test", "-e", "/fill"]).exit_code == 1  # the full upper is gone
        assert env.exec("dd if=/dev/zero of=/half bs=1M count=8 2>/dev/null").ok
        assert b"No space left" in env.exec(FILL).stdout
        assert len(loop_devices() - loops_before) == 1  # the old one was released
    assert loop_devices() - loops_before == set()


def test_create_and_rm_with_a_disk_leave_nothing(env_ref: EnvRef) -> None:
    loops_before = loop_devices()
    box = run_weenv("sandbox", "create", env_ref.ref, *_base(env_ref), "--disk", "16M",
                    "--name", f"disk-{env_ref.digest[7:15]}").stdout.decode().strip()
    try:
        assert run_weenv("sandbox", "exec", box, "--", "df", "-k", "/").returncode == 0
    finally:
        run_weenv("sandbox", "rm", box)
    assert loop_devices() - loops_before == set()


def test_bad_disk_sizes_are_one_line_errors(env_ref: EnvRef) -> None:
    done = run_weenv("run", env_ref.ref, *_base(env_ref), "--disk", "1K", "--", "true",
                     check=False)
    assert done.returncode == 2 and len(done.stderr.decode().strip().splitlines()) == 1
    done = run_weenv("run", env_ref.ref, *_base(env_ref), "--disk", "16M", "--keep", "--",
                     "true", check=False)
    assert done.returncode == 2 and b"--disk" in done.stderr
    with pytest.raises(UsageError, match="disk"):
        Environment.open(env_ref.ref, store=env_ref.store, cache=env_ref.cache, disk=1024)
