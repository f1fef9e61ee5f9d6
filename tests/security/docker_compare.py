"""What `docker run --rm --network none` does with the escape attempts of tests/security: the
Docker column of docs/security.md. A script, not a test (it runs a dockerd of its own):

    .venv/bin/python tests/security/docker_compare.py

It starts `dockerd --bridge=none --iptables=false --ip-masq=false` in a temp folder
(benchmarks/docker_peer.Dockerd), loads images of the minbase sample plus one small hostile
layer each (docker-save format built here), runs each attempt and prints one line per attempt.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from docker_peer import Dockerd  # noqa: E402
from support.layers import layer  # noqa: E402
from support.trees import Spec, file, symlink  # noqa: E402

from tools.sample import sample_tree  # noqa: E402

PROBE = "usr/local/bin/probe"


def _save_archive(path: Path, tag: str, layers: list[bytes]) -> None:
    """A `docker load` archive of `layers` (uncompressed tars, lowest first)."""
    names = [f"{hashlib.sha256(data).hexdigest()}/layer.tar" for data in layers]
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["sh"]},
                         "rootfs": {"type": "layers", "diff_ids": [
                             f"sha256:{hashlib.sha256(d).hexdigest()}" for d in layers]}})
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, data in zip(names, layers, strict=True):
            add(name, data)
        add("config.json", config.encode())
        add("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": [tag],
                                          "Layers": names}]).encode())


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="weenv-docker-compare-"))
    probe = work / "probe"
    subprocess.run(["gcc", "-static", "-O1", "-o", str(probe),
                    str(Path(__file__).with_name("probe.c"))], check=True)
    base = work / "base.tar"
    subprocess.run(["tar", "-C", str(sample_tree(None, "minbase", progress=False)), "-cf",
                    str(base), "."], check=True)
    victim = Path(f"/tmp/weenv-victim-{uuid.uuid4().hex[:8]}")
    victim.mkdir()
    (victim / "precious").write_text("keep")
    variants: dict[str, list[Spec]] = {
        "plain": [], "dev": [symlink("dev", str(victim))],
        "proc": [symlink("proc", str(victim))], "sys": [symlink("sys", str(victim))],
        "tmp-out": [symlink("tmp", "/nonexistent-host-dir")], "tmp-loop": [symlink("tmp", "tmp")],
        "work-out": [symlink("work", f"/tmp/weenv-absent-{uuid.uuid4().hex[:8]}")],
    }
    dockerd = Dockerd(work / "dockerd").start()
    try:
        for name, entries in variants.items():
            top = layer(*entries, file(PROBE, probe.read_bytes(), mode=0o755))
            archive = work / f"{name}.tar"
            _save_archive(archive, f"weenv-sec-{name}:t", [base.read_bytes(), top])
            dockerd.docker("load", "-i", str(archive))

        def run(image: str, *argv: str, options: tuple[str, ...] = ()) -> str:
            done = subprocess.run(["docker", "run", "--rm", "--network", "none", *options,
                                   f"weenv-sec-{image}:t", *argv], env=dockerd.env(),
                                  capture_output=True, text=True, check=False, timeout=300)
            text = (done.stdout + done.stderr).strip().splitlines()
            return f"exit {done.returncode}: {text[-1] if text else ''}"[:160]

        for name in ("dev", "proc", "sys"):
            print(f"/{name} -> host dir: {run(name, 'true')}; victim now "
                  f"{sorted(p.name for p in victim.iterdir())}")
        print(f"/tmp -> /nonexistent: {run('tmp-out', 'sh', '-c', 'echo hi > /tmp/x')}")
        print(f"/tmp -> tmp (loop): {run('tmp-loop', 'true')}")
        print(f"workdir via /work -> absent host dir: "
              f"{run('work-out', 'pwd', options=('-w', '/work/task'))}")
        for verb in ("add_key", "keyctl", "personality", "vsock", "unshare_user", "clone_ns"):
            print(f"probe {verb}: {run('plain', '/' + PROBE, verb)}")
        print("unshare -U -r + mount tmpfs: " + run(
            "plain", "sh", "-c", "unshare -U -r sh -c 'mount -t tmpfs none /mnt && echo mounted'"))
        print("NoNewPrivs/Seccomp: " + run("plain", "sh", "-c",
                                           "grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status "
                                           "| tr '\\n' ' '"))
        print("dd 64M with --storage-opt size=24M: " + run(
            "plain", "sh", "-c", "dd if=/dev/zero of=/fill bs=1M count=64 2>&1 | tail -1",
            options=("--storage-opt", "size=24M")))
        print("dd 64M (no option): " + run(
            "plain", "sh", "-c", "dd if=/dev/zero of=/fill bs=1M count=64 2>&1 | tail -1"))
    finally:
        dockerd.stop()
        subprocess.run(["rm", "-rf", str(work), str(victim)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
