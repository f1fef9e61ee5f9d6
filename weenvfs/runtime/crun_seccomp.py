"""crun's compiled seccomp filters, kept on the node so that a sandbox's start does not compile
its profile again.

crun compiles config.json's `linux.seccomp` with libseccomp at every `run` and `create`: on
this 2-core node ~10 ms of the ~27 ms a one-shot `crun run` of `true` takes (Docker's default
profile, ~350 calls for three architectures; docs/benchmarks.md, "weenv run's fixed cost").
Given the annotation `run.oci.seccomp_bpf_data` (the compiled program, base64; crun(1)), it
loads that program instead, and keeps it in the container's state for every later exec, as
it keeps the one it compiles. So the first sandbox with a profile on this boot has crun
compile the profile once, into a probe container that is created and never started (crun
writes the program into the container's state as seccomp.bpf; the probe is then killed and
its state removed), and every sandbox after it hands crun that program: crun's own output
for the same profile, byte for byte what it would have compiled (a test compares them).

A program is kept under `CACHE_ROOT` (/run: gone at reboot), root's only, named by the
profile and the crun binary (path, inode, size, mtime), so an upgraded crun compiles again.
A probe that fails is remembered for the boot (one marker file) and the sandbox starts as
before, crun compiling the profile: a slower start, never a sandbox without its filter.

Owns: `cache_key`, `cached`, `failed_before`, `keep`, `probe_config`, `annotate`. Must not:
run crun (crun.py does, with its own command line), or change the profile (seccomp.py).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CACHE_ROOT = Path("/run/weenv/seccomp")
ANNOTATION = "run.oci.seccomp_bpf_data"
PROBE_PATH = "/probe"  # where the probe's (never run) init is bound
MAX_INSTRUCTIONS = 4096  # BPF_MAXINSNS: the kernel loads no longer seccomp program
INSTRUCTION = 8  # bytes of one struct sock_filter
FAILED = ".failed"  # suffix of the marker of a profile whose probe failed on this boot


def cache_key(seccomp: Mapping[str, Any], binary: str) -> str:
    """The name of `seccomp`'s program as the crun at `binary` compiles it."""
    st = os.stat(binary)
    identity = [os.path.realpath(binary), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    text = json.dumps([identity, seccomp], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def valid(program: bytes) -> bool:
    """Whether `program` can be a seccomp BPF program: whole instructions, at most the
    kernel's limit (a torn or foreign file is not handed to crun)."""
    return 0 < len(program) <= MAX_INSTRUCTIONS * INSTRUCTION and len(program) % INSTRUCTION == 0


def cached(key: str) -> bytes | None:
    """The kept program of `key`, or None when there is none (or it is not a program)."""
    try:
        program = (CACHE_ROOT / f"{key}.bpf").read_bytes()
    except OSError:
        return None
    return program if valid(program) else None


def failed_before(key: str) -> bool:
    """Whether a probe of `key` failed on this boot (the caller then does not probe again)."""
    return (CACHE_ROOT / f"{key}{FAILED}").exists()


def keep(key: str, program: bytes | None) -> None:
    """Keep `program` as `key`'s (None: remember that its probe failed), written whole or
    not at all (a rename), root's only. Best effort: a node that cannot keep it compiles
    again next time."""
    root = CACHE_ROOT
    with contextlib.suppress(OSError):
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"{key}.bpf" if program is not None else f"{key}{FAILED}"
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(program or b"")
            os.replace(tmp, root / name)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def probe_config(seccomp: Mapping[str, Any], init: str) -> dict[str, Any]:
    """config.json of the probe: a mount namespace around an empty root in which only the
    init (`init`, bound at PROBE_PATH: crun checks that the command exists) and /dev
    exist, no cgroups (the caller passes `--cgroup-manager=disabled`), and `seccomp`."""
    return {
        "ociVersion": "1.0.2",
        "process": {"args": [PROBE_PATH], "cwd": "/", "user": {"uid": 0, "gid": 0}},
        "root": {"path": "rootfs", "readonly": False},
        "mounts": [{"destination": PROBE_PATH, "type": "bind", "source": init,
                    "options": ["bind", "ro"]}],
        "linux": {"namespaces": [{"type": "mount"}], "seccomp": dict(seccomp)},
    }


def annotate(config: dict[str, Any], program: bytes) -> dict[str, Any]:
    """`config` with `program` as its compiled filter (crun then ignores `linux.seccomp`,
    which stays for whoever reads config.json)."""
    annotations = dict(config.get("annotations") or {})
    annotations[ANNOTATION] = base64.b64encode(program).decode()
    return {**config, "annotations": annotations}
