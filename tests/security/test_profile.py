"""The filter as data (no sandbox): Docker's conditions resolved against the capability set,
user profiles in Docker's format converted for runc, and the OCI config carrying it."""

from __future__ import annotations

from pathlib import Path

import pytest

from weenvfs.errors import UsageError
from weenvfs.runtime import seccomp
from weenvfs.runtime.cgroups import Limits, oci_resources
from weenvfs.runtime.launcher import DEFAULT_CAPS, CgroupSpec, LaunchSpec, ProcessSpec, runtime_spec


def _rules(profile: dict[str, object], name: str) -> list[dict[str, object]]:
    return [r for r in profile["syscalls"] if name in r["names"]]  # type: ignore[attr-defined, index]


def test_the_default_profile_without_cap_sys_admin() -> None:
    oci = seccomp.resolve(None, DEFAULT_CAPS, "x86_64").profile
    assert oci is not None
    assert oci["defaultAction"] == "SCMP_ACT_ERRNO" and oci["defaultErrnoRet"] == 1
    assert oci["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    for name in ("keyctl", "add_key", "request_key", "mount", "umount2", "unshare", "setns",
                 "bpf", "kexec_load", "init_module"):
        assert all(r["action"] != "SCMP_ACT_ALLOW" for r in _rules(oci, name)), name
    clone = _rules(oci, "clone")
    assert clone == [{"names": ["clone"], "action": "SCMP_ACT_ALLOW", "args": [
        {"index": 0, "value": 0x7E020000, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]}]
    assert _rules(oci, "clone3")[0]["errnoRet"] == 38
    assert sorted(r["args"][0]["value"] for r in _rules(oci, "personality")) == [  # type: ignore[index]
        0, 8, 0x20000, 0x20008, 0xFFFFFFFF]
    assert _rules(oci, "chroot")  # CAP_SYS_CHROOT is in the set
    assert _rules(oci, "arch_prctl") and not _rules(
        seccomp.resolve(None, DEFAULT_CAPS, "aarch64").profile or {"syscalls": []}, "arch_prctl")


def test_cap_sys_admin_would_open_mount_and_unshare() -> None:
    oci = seccomp.resolve(None, (*DEFAULT_CAPS, "CAP_SYS_ADMIN"), "x86_64").profile
    assert oci is not None
    assert any(r["action"] == "SCMP_ACT_ALLOW" for r in _rules(oci, "mount"))
    assert all("args" not in r for r in _rules(oci, "clone"))


def test_profiles_from_files_and_bad_ones(tmp_path: Path) -> None:
    assert seccomp.resolve("unconfined", DEFAULT_CAPS) == seccomp.Seccomp("unconfined", None)
    good = tmp_path / "p.json"
    good.write_text('{"defaultAction": "SCMP_ACT_ALLOW", "archMap": [{"architecture": '
                    '"SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]}], "syscalls": ['
                    '{"name": "mkdir", "action": "SCMP_ACT_ERRNO", "comment": "x"}, '
                    '{"names": ["mount"], "action": "SCMP_ACT_ALLOW", '
                    '"includes": {"caps": ["CAP_SYS_ADMIN"]}}]}')
    loaded = seccomp.resolve(str(good), DEFAULT_CAPS, "x86_64")
    assert loaded.name == str(good)
    assert loaded.profile == {"defaultAction": "SCMP_ACT_ALLOW",
                              "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"],
                              "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_ERRNO"}]}
    for text in ("[]", "{}", '{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": []}]}'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(UsageError):
            seccomp.resolve(str(bad), DEFAULT_CAPS)


def test_the_oci_config_carries_the_filter_and_no_new_privileges(tmp_path: Path) -> None:
    filt = seccomp.resolve(None, DEFAULT_CAPS).profile
    spec = LaunchSpec("weenv-x", tmp_path, tmp_path, ProcessSpec(("true",), ()),
                      CgroupSpec("/weenv/x", oci_resources(Limits())), seccomp=filt)
    config = runtime_spec(spec)
    assert config["linux"]["seccomp"] == filt
    assert config["process"]["noNewPrivileges"] is True
    assert config["process"]["capabilities"]["bounding"] == list(DEFAULT_CAPS)
    unconfined = runtime_spec(LaunchSpec("weenv-x", tmp_path, tmp_path,
                                         ProcessSpec(("true",), ()), CgroupSpec("/weenv/x")))
    assert "seccomp" not in unconfined["linux"]
