"""crun is handed each sandbox's seccomp filter compiled (crun_seccomp.py, crun.py): the
program a probe had crun compile once per profile, byte for byte what crun compiles itself at
a start, applied to the init and every exec; a failed probe or a bad kept file only makes
crun compile the profile itself, never a sandbox without its filter.

Real crun, real sandboxes on real mounts; the kept programs go to the test's own folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rt_support import EnvRef, run_weenv

from weenvfs.runtime import crun_seccomp, seccomp
from weenvfs.runtime.crun import CRUN_ROOT, CrunLauncher
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.launcher import DEFAULT_CAPS
from weenvfs.runtime.runtimes import RUNTIME_ENV


@pytest.fixture(autouse=True)
def _crun(require_or_skip: Callable[[object, str], None], monkeypatch: pytest.MonkeyPatch
          ) -> None:
    require_or_skip(shutil.which("crun"), "crun not found (Debian package crun)")
    monkeypatch.setenv(RUNTIME_ENV, "crun")


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "seccomp"
    monkeypatch.setattr(crun_seccomp, "CACHE_ROOT", root)
    yield root
    assert not list(root.glob("probe-*")), "a probe folder was left behind"
    assert not list(root.glob(".tmp-*")), "a half-written program was left behind"


def _open(env: EnvRef) -> Environment:
    return Environment.open(env.ref, store=env.store, cache=env.cache)


def _started(env: Environment) -> tuple[dict[str, object], bytes]:
    """The sandbox's config.json and the program crun keeps in its state."""
    config = json.loads((env.sandbox.bundle / "config.json").read_text())
    return config, (CRUN_ROOT / env.id / "seccomp.bpf").read_bytes()


def _filtered(env: Environment) -> bool:
    status = env.exec(["cat", "/proc/self/status"]).stdout.decode()
    refused = env.exec(["unshare", "--uts", "true"])  # not in the default profile
    return "Seccomp:\t2" in status and refused.exit_code != 0


def test_the_kept_program_is_what_crun_compiles_itself(env_ref: EnvRef, kept: Path) -> None:
    with _open(env_ref) as env:  # nothing kept yet: a probe compiles the profile first
        config, program = _started(env)
        assert crun_seccomp.ANNOTATION in config["annotations"]  # type: ignore[operator]
        assert "seccomp" in config["linux"]  # type: ignore[operator]  (for whoever reads it)
        assert _filtered(env)
    files = list(kept.glob("*.bpf"))
    assert [f.read_bytes() for f in files] == [program]
    key = files[0].name.removesuffix(".bpf")
    (kept / f"{key}{crun_seccomp.FAILED}").touch()
    files[0].unlink()  # as after a failed probe: crun compiles the profile at the start
    with _open(env_ref) as env:
        config, compiled = _started(env)
        assert crun_seccomp.ANNOTATION not in config.get("annotations", {})  # type: ignore[operator]
        assert compiled == program
        assert _filtered(env)


def test_a_failed_probe_leaves_the_filter_to_crun_and_is_not_retried(
        env_ref: EnvRef, kept: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[object] = []
    real = CrunLauncher._probe

    def failing(self: CrunLauncher, seccomp: object) -> bytes | None:
        probes.append(seccomp)
        self._binary = "/bin/false"  # this crun "fails"; the sandbox gets the real one
        try:
            return real(self, seccomp)  # type: ignore[arg-type]
        finally:
            self._binary = shutil.which("crun") or "crun"

    monkeypatch.setattr(CrunLauncher, "_probe", failing)
    for _ in range(2):
        with _open(env_ref) as env:
            config, _ = _started(env)
            assert crun_seccomp.ANNOTATION not in config.get("annotations", {})  # type: ignore[operator]
            assert _filtered(env)
    assert len(probes) == 1
    assert [p.name.endswith(crun_seccomp.FAILED) for p in kept.iterdir()] == [True]


def test_a_torn_kept_program_is_compiled_again(env_ref: EnvRef, kept: Path) -> None:
    with _open(env_ref) as env:
        _, program = _started(env)
    [file] = kept.glob("*.bpf")
    file.write_bytes(program[:-3])  # not whole instructions: never handed to crun
    with _open(env_ref) as env:
        config, again = _started(env)
        assert again == program and _filtered(env)
    assert file.read_bytes() == program


def test_a_one_shot_run_is_filtered_and_keeps_the_program_for_the_next(env_ref: EnvRef) -> None:
    # The README's `weenv run` (in the node service, with the node's own kept programs).
    for _ in range(2):
        done = run_weenv("run", "--store", str(env_ref.store), "--cache", str(env_ref.cache),
                         env_ref.ref, "cat", "/proc/self/status")
        assert "Seccomp:\t2" in done.stdout.decode()
    profile = seccomp.resolve(None, DEFAULT_CAPS).profile
    assert profile is not None
    key = crun_seccomp.cache_key(profile, shutil.which("crun") or "crun")
    assert crun_seccomp.cached(key) is not None


def test_keys_name_the_profile_and_the_binary(tmp_path: Path) -> None:
    crun = tmp_path / "crun"
    crun.write_bytes(b"one")
    profile = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}
    key = crun_seccomp.cache_key(profile, str(crun))
    assert key == crun_seccomp.cache_key(dict(reversed(profile.items())), str(crun))
    assert key != crun_seccomp.cache_key({**profile, "defaultAction": "SCMP_ACT_KILL"}, str(crun))
    crun.write_bytes(b"an upgraded crun")
    assert key != crun_seccomp.cache_key(profile, str(crun))


@pytest.mark.parametrize(("size", "ok"), [(0, False), (7, False), (8, True), (7928, True),
                                          (4096 * 8, True), (4097 * 8, False)])
def test_only_whole_programs_within_the_kernels_limit_are_valid(size: int, ok: bool) -> None:
    assert crun_seccomp.valid(b"\0" * size) is ok
