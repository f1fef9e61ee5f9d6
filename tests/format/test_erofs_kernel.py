"""The kernel is the oracle of the EROFS writer (format/erofs.py, SPEC.md section 15).

Each test writes an image and its data device (each chunk at block * 4096) to tmp_path,
mounts it read-only with mount(2) (file-backed, `device=` the device file), compares what the
kernel shows with the declared tree (names, lstat fields, st_ino shared by hardlinks only,
readlink, every xattr, file bytes with holes as zeros, random reads) and runs
`fsck.erofs --device` (erofs-utils) on the image. Trees: the golden vector, ~20 seeded random
trees, and two images stacked read-only with overlayfs (whiteout and opaque directory).
Every mount is undone in `finally` (tests/support/kmount.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.kmount import can_mount_erofs, can_mount_overlay, mounted, mounted_erofs

from weenvfs.format.erofs import BLOCK_SIZE

Require = Callable[[object, str], None]


@pytest.fixture
def erofs_ok(require_or_skip: Require) -> None:
    require_or_skip(can_mount_erofs(), "needs root and erofs in /proc/filesystems")


def _write(tmp: Path, name: str, image: bytes, device: bytes) -> tuple[Path, Path]:
    img, dev = tmp / f"{name}.img", tmp / f"{name}.dev"
    img.write_bytes(image)
    dev.write_bytes(device)
    return img, dev


def _fsck(img: Path, dev: Path) -> None:
    done = subprocess.run(
        ["fsck.erofs", f"--device={dev}", str(img)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _resolved(entries: list[Any]) -> dict[bytes, Any]:
    by_path = {e.path: e for e in entries}
    return {e.path: by_path[e.target] if e.kind == "hard" else e for e in entries}


def compare(mp: Path, entries: list[Any], generator: ModuleType, rng: random.Random) -> None:
    """Assert the mounted tree at `mp` is exactly the declared `entries`."""
    real = _resolved(entries)
    key = {e.path: (e.target if e.kind == "hard" else e.path) for e in entries}
    links = {k: list(key.values()).count(k) for k in set(key.values())}
    inos: dict[bytes, int] = {}
    for path, e in real.items():
        where = os.path.join(os.fsencode(mp), path) if path else os.fsencode(mp)
        st = os.lstat(where)
        assert st.st_mode == generator.mode_of(e), path
        assert (st.st_uid, st.st_gid, st.st_mtime_ns) == (e.uid, e.gid, e.mtime_ns), path
        inos.setdefault(key[path], st.st_ino)
        assert st.st_ino == inos[key[path]], path
        xattrs = dict(e.xattrs)
        if e.opaque:
            xattrs[b"trusted.overlay.opaque"] = b"y"
        listed = {os.fsencode(n) for n in os.listxattr(where, follow_symlinks=False)}
        assert listed == set(xattrs), path
        for name, value in xattrs.items():
            assert os.getxattr(where, name, follow_symlinks=False) == value, (path, name)
        if e.kind == "dir":
            prefix = path + b"/" if path else b""
            names = {p[len(prefix) :] for p in real if p.startswith(prefix) and p != path}
            names = {n for n in names if b"/" not in n}
            assert set(os.listdir(where)) == names, path
            subdirs = sum(real[prefix + n].kind == "dir" for n in names)
            assert st.st_nlink == 2 + subdirs, path
            continue
        assert st.st_nlink == links[key[path]], path
        if e.kind == "lnk":
            assert os.readlink(where) == e.target and st.st_size == len(e.target), path
        elif e.kind == "reg":
            assert st.st_size == len(e.data), path
            with open(where, "rb") as f:
                assert f.read() == e.data, path
                for _ in range(3 if e.data else 0):
                    offset = rng.randrange(len(e.data))
                    length = rng.randrange(1, 3 * BLOCK_SIZE)
                    assert os.pread(f.fileno(), length, offset) == e.data[offset : offset + length]
        else:
            assert st.st_rdev == e.rdev and st.st_size == 0, path
    assert len(set(inos.values())) == len(inos)  # distinct inodes, distinct st_ino


def _mount_and_compare(
    tmp: Path, name: str, entries: list[Any], generator: ModuleType, chunk_bits: int, seed: int
) -> None:
    image, device = generator.erofs_image(entries, chunk_bits)
    img, dev = _write(tmp, name, image, device)
    _fsck(img, dev)
    mp = tmp / f"{name}.mnt"
    mp.mkdir()
    with mounted_erofs(img, dev, mp):
        compare(mp, entries, generator, random.Random(seed))


def test_golden_tree_through_the_kernel(
    erofs_ok: None, tmp_path: Path, generator: ModuleType, require_or_skip: Require
) -> None:
    require_or_skip(shutil.which("fsck.erofs"), "fsck.erofs not installed (erofs-utils)")
    _mount_and_compare(tmp_path, "golden", generator.EROFS_TREE, generator, 0, 1)


# -- random trees -----------------------------------------------------------------------------

_XATTR_PREFIXES = (b"user.", b"trusted.", b"security.")


def _name(rng: random.Random) -> bytes:
    length = rng.choice([1, 2, 5, 12, 40, 255, rng.randrange(1, 256)])
    alphabet = [b for b in range(1, 256) if b != ord("/")]
    while True:
        name = bytes(rng.choice(alphabet) for _ in range(length))
        if name not in (b".", b".."):
            return name


def _data(rng: random.Random, chunk: int) -> bytes:
    size = rng.choice([0, 1, 100, BLOCK_SIZE, chunk + 1, rng.randrange(4 * chunk)])
    parts = []
    pos = 0
    while pos < size:
        n = min(chunk, size - pos)
        parts.append(bytes(n) if rng.random() < 0.25 else rng.randbytes(n))
        pos += n
    return b"".join(parts)


def random_tree(seed: int, generator: ModuleType, chunk_bits: int) -> list[Any]:
    """A seeded tree of every file type, hostile names, xattrs, hardlinks and holes."""
    rng = random.Random(seed)
    E = generator.E
    chunk = BLOCK_SIZE << chunk_bits
    entries = [E(b"", "dir", 0o755, mtime_ns=rng.randrange(-(10**18), 10**18))]
    dirs, files = [b""], []
    for _ in range(rng.randrange(20, 120)):
        parent = rng.choice(dirs)
        path = (parent + b"/" if parent else b"") + _name(rng)
        if any(e.path == path for e in entries):
            continue
        kind = rng.choice(["dir", "reg", "reg", "reg", "lnk", "chr", "blk", "fifo", "sock", "hard"])
        if kind == "hard":
            if not files:
                continue
            entries.append(E(path, "hard", target=rng.choice(files)))
            continue
        # Linux allows user.* only on regular files and directories (reads elsewhere: ENODATA)
        prefixes = _XATTR_PREFIXES if kind in ("dir", "reg") else _XATTR_PREFIXES[1:]
        xattrs = tuple(
            (rng.choice(prefixes) + b"k%d" % k, rng.randbytes(rng.choice([0, 3, 700])))
            for k in range(rng.choice([0, 0, 1, 3]))
        )
        common = {
            "uid": rng.choice([0, 1000, 2**32 - 2]),
            "gid": rng.choice([0, 100, 2**31]),
            "mtime_ns": rng.randrange(-(2**62), 2**62),
            "xattrs": xattrs,
        }
        perm = rng.randrange(0o10000)
        if kind == "dir":
            entries.append(E(path, "dir", perm | 0o700, **common))
            dirs.append(path)
        elif kind == "reg":
            entries.append(E(path, "reg", perm, data=_data(rng, chunk), **common))
            files.append(path)
        elif kind == "lnk":
            target = bytes(rng.randrange(1, 256) for _ in range(rng.choice([1, 50, 4095])))
            entries.append(E(path, "lnk", 0o777, target=target, **common))
        else:
            rdev = (
                os.makedev(rng.randrange(4096), rng.randrange(1 << 20))
                if kind in ("chr", "blk")
                else 0
            )
            entries.append(E(path, kind, perm, rdev=rdev, **common))
    return entries


@pytest.mark.parametrize("seed", range(20))
def test_random_tree_through_the_kernel(
    seed: int, erofs_ok: None, tmp_path: Path, generator: ModuleType, require_or_skip: Require
) -> None:
    require_or_skip(shutil.which("fsck.erofs"), "fsck.erofs not installed (erofs-utils)")
    chunk_bits = seed % 3
    entries = random_tree(seed, generator, chunk_bits)
    _mount_and_compare(tmp_path, f"seed{seed}", entries, generator, chunk_bits, seed)


# -- overlayfs stacking -----------------------------------------------------------------------


def test_overlay_whiteout_and_opaque(
    erofs_ok: None, tmp_path: Path, generator: ModuleType, require_or_skip: Require
) -> None:
    require_or_skip(can_mount_overlay(), "needs root and overlay in /proc/filesystems")
    E = generator.E
    lower = [
        E(b"", "dir", 0o755),
        E(b"gone", "reg", data=b"hidden by a whiteout\n"),
        E(b"keep", "reg", data=b"kept\n"),
        E(b"d", "dir", 0o755),
        E(b"d/old", "reg", data=b"hidden by the opaque dir\n"),
        E(b"m", "dir", 0o755),
        E(b"m/lower", "reg", data=b"merged\n"),
    ]
    upper = [
        E(b"", "dir", 0o755),
        E(b"gone", "whiteout"),
        E(b"d", "dir", 0o755, opaque=True),
        E(b"d/new", "reg", data=b"new\n"),
        E(b"m", "dir", 0o755),
        E(b"m/upper", "reg", data=b"merged too\n"),
    ]
    mps = {}
    with contextlib.ExitStack() as stack:
        for name, entries in (("lower", lower), ("upper", upper)):
            img, dev = _write(tmp_path, name, *generator.erofs_image(entries))
            mps[name] = tmp_path / f"{name}.mnt"
            mps[name].mkdir()
            stack.enter_context(mounted_erofs(img, dev, mps[name]))
        merged = tmp_path / "merged"
        merged.mkdir()
        options = f"lowerdir={mps['upper']}:{mps['lower']}"
        stack.enter_context(mounted("overlay", merged, "overlay", options))
        assert sorted(os.listdir(merged)) == ["d", "keep", "m"]
        assert os.listdir(merged / "d") == ["new"]
        assert sorted(os.listdir(merged / "m")) == ["lower", "upper"]
        assert (merged / "keep").read_bytes() == b"kept\n"
        assert (merged / "d" / "new").read_bytes() == b"new\n"
        assert not (merged / "gone").exists()
