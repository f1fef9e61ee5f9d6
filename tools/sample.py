"""Sample Debian root trees for tests and benchmarks, built once with debootstrap and cached.

Owns: choosing a Debian mirror, running `debootstrap` (and `apt-get` inside the chroot for
extra packages), cleaning apt caches out of the result, and the cache folder's layout
(`<cache>/<profile>-<suite>-v<VERSION>`). A tree is built in a temporary folder next to
its target and renamed into place only when complete, under a per-profile lock, so a
crashed or interrupted build is never mistaken for a finished one and is simply redone.

Must not: touch anything outside the cache folder (except the mounts it makes inside the
tree it is building), or know anything about WeEnv's format or stores.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from weenvfs.errors import SourceError

log = logging.getLogger(__name__)

#: Bump when the way trees are built changes, so old cached trees are not reused.
VERSION = 1
SUITE = "bookworm"
DEFAULT_CACHE_DIR = Path("/var/cache/weenv-samples")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
CACHE_ENV = "WEENV_SAMPLE_CACHE"
MIRROR_ENV = "WEENV_DEBIAN_MIRROR"
_LOG_TAIL = 6


@dataclass(frozen=True)
class Profile:
    """What goes into one sample tree on top of `debootstrap --variant=minbase`."""

    packages: tuple[str, ...] = ()
    #: Install what the packages recommend, recursively (apt's default).
    recommends: bool = False


# pandas' own Recommends (its optional backends), listed so that apt does not follow
# recommends recursively: that pulls in compilers, Boost and LLVM, 2 GB and 56k files.
_PANDAS_EXTRAS = (
    "python3-scipy",
    "python3-matplotlib",
    "python3-bottleneck",
    "python3-numexpr",
    "python3-odf",
    "python3-openpyxl",
    "python3-bs4",
    "python3-html5lib",
    "python3-lxml",
    "python3-tables",
    "python3-jinja2",
)

PROFILES: dict[str, Profile] = {
    "minbase": Profile(),
    "python": Profile(("python3",)),
    # The reference workload of DESIGN.md (~1 GB): Python with numpy and pandas.
    "reference": Profile(("python3", "python3-numpy", "python3-pandas", *_PANDAS_EXTRAS)),
    # A large Python image (~2 GB) for benchmarks: the reference plus PyTorch and scikit-learn.
    "large": Profile(("python3", "python3-numpy", "python3-pandas", *_PANDAS_EXTRAS,
                      "python3-torch", "python3-sklearn")),
}


def default_cache_dir() -> Path:
    """The cache folder: $WEENV_SAMPLE_CACHE, else DEFAULT_CACHE_DIR."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else DEFAULT_CACHE_DIR


def sample_tree(cache_dir: Path | None, profile: str = "minbase", progress: bool = True) -> Path:
    """Return the cached root tree for `profile`, building it first if it is not there yet."""
    if profile not in PROFILES:
        raise SourceError(f"unknown sample profile {profile!r} (known: {', '.join(PROFILES)})")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"{profile}-{SUITE}-v{VERSION}"
    target = cache / name
    if target.is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{name}.lock"):
        if target.is_dir():  # another process finished it while we waited
            return target
        for stale in cache.glob(f".{name}.tmp-*"):
            _say(progress, f"sample {profile}: removing interrupted build {stale}")
            _remove_tree(stale)
        tmp = cache / f".{name}.tmp-{os.getpid()}"
        started = time.monotonic()
        try:
            spec = PROFILES[profile]
            # Every other profile starts from a copy of the cached minbase tree.
            base = sample_tree(cache, "minbase", progress) if spec.packages else None
            _build(tmp, spec, base, cache / f".{name}.log", progress, profile)
        except BaseException:
            _remove_tree(tmp)
            raise
        os.rename(tmp, target)
    files, size = tree_stats(target)
    _say(
        progress,
        f"sample {profile}: ready at {target} ({files} files, {size / 2**20:.0f} MiB,"
        f" {time.monotonic() - started:.0f} s)",
    )
    return target


def tree_stats(path: Path) -> tuple[int, int]:
    """Count regular files under `path` and sum their sizes (apparent, not allocated)."""
    files = total = 0
    for dirpath, _dirs, names in os.walk(os.fsencode(path)):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                files += 1
                total += st.st_size
    return files, total


def debian_mirror(etc_apt: Path = Path("/etc/apt")) -> str:
    """The Debian mirror to use: $WEENV_DEBIAN_MIRROR, else the first Debian URI in apt's
    sources (one-line and deb822 formats), else DEFAULT_MIRROR."""
    env = os.environ.get(MIRROR_ENV)
    if env:
        return env.rstrip("/")
    for uri in _source_uris(etc_apt):
        if _is_debian_archive(uri):
            return uri.rstrip("/")
    return DEFAULT_MIRROR


def _source_uris(etc_apt: Path) -> Iterator[str]:
    """Every enabled `deb` URI in apt's sources, in apt's own file order."""
    files = [etc_apt / "sources.list"]
    parts = etc_apt / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if path.suffix == ".sources":
            yield from _deb822_uris(text)
        else:
            yield from _one_line_uris(text)


def _one_line_uris(text: str) -> Iterator[str]:
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] == "deb":
            # Skip an options block such as `[arch=amd64 signed-by=...]`.
            rest = words[1:]
            if rest and rest[0].startswith("["):
                while rest and not rest[0].endswith("]"):
                    rest = rest[1:]
                rest = rest[1:]
            if rest:
                yield rest[0]


def _deb822_uris(text: str) -> Iterator[str]:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
            yield from fields.get("uris", "").split()


def _is_debian_archive(uri: str) -> bool:
    """True for a main Debian archive (not security, ports, or a third-party repository)."""
    path = uri.split("://", 1)[-1].rstrip("/")
    return bool(re.search(r"/debian$", path)) or bool(re.search(r"/archive/debian/\d", path))


def _build(
    tmp: Path, profile: Profile, base: Path | None, logfile: Path, progress: bool, name: str
) -> None:
    if os.geteuid() != 0:
        raise SourceError("building a sample tree needs root (debootstrap, chroot, chown)")
    if base is not None:
        _say(progress, f"sample {name}: copying {base} to {tmp}")
        subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(tmp)], check=True)
        with open(logfile, "wb") as out:
            _apt_install(tmp, profile, out, progress, name, logfile)
        _clean_apt(tmp)
        return
    debootstrap = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin")
    if debootstrap is None:
        raise SourceError("debootstrap is not installed (apt-get install debootstrap)")
    mirror = debian_mirror()
    _say(
        progress,
        f"sample {name}: debootstrap --variant=minbase {SUITE} from {mirror}"
        f" into {tmp} (log {logfile})",
    )
    with open(logfile, "wb") as out:
        _run(
            "debootstrap",
            [debootstrap, "--variant=minbase", SUITE, str(tmp), mirror],
            out,
            progress,
            name,
            logfile,
            tmp / "debootstrap" / "debootstrap.log",
        )
    _clean_apt(tmp)


def _apt_install(
    tmp: Path, profile: Profile, out: BinaryIO, progress: bool, name: str, logfile: Path
) -> None:
    """Install extra packages with apt-get inside the chroot, with /proc mounted."""
    _say(progress, f"sample {name}: apt-get install {' '.join(profile.packages)}")
    policy = tmp / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\n# no daemons while building a sample tree\nexit 101\n")
    policy.chmod(0o755)
    if not (tmp / "etc/resolv.conf").exists() and Path("/etc/resolv.conf").exists():
        shutil.copy("/etc/resolv.conf", tmp / "etc/resolv.conf")
    proc = tmp / "proc"
    mounted = subprocess.run(["mount", "-t", "proc", "proc", str(proc)], capture_output=True)
    if mounted.returncode != 0:
        raise SourceError(f"cannot mount /proc in {tmp}: {mounted.stderr.decode().strip()}")
    try:
        chroot = ["chroot", str(tmp)]
        _run("apt-get update", [*chroot, "apt-get", "update"], out, progress, name, logfile)
        install = [*chroot, "apt-get", "install", "-y", "-o", "Dpkg::Use-Pty=0"]
        install.append("--install-recommends" if profile.recommends else "--no-install-recommends")
        _run("apt-get install", [*install, *profile.packages], out, progress, name, logfile)
    finally:
        subprocess.run(["umount", str(proc)], check=False)
        policy.unlink(missing_ok=True)


# Lines worth relaying: debootstrap's stages and apt's summary, not one line per package.
_PROGRESS = re.compile(
    rb"^(I: (Retrieving Release|Checking|Found|Resolving|Installing core|Unpacking the base"
    rb"|Configuring the base|Base system)|E: |W: |\d+ upgraded, |Need to get |After this)"
)


def _run(
    what: str,
    cmd: list[str],
    out: BinaryIO,
    progress: bool,
    name: str,
    logfile: Path,
    detail_log: Path | None = None,
) -> None:
    """Run `cmd`, appending its output to `out`; relay stage lines; raise SourceError on failure."""
    env = dict(
        os.environ,
        DEBIAN_FRONTEND="noninteractive",
        LC_ALL="C",
        PATH="/usr/sbin:/usr/bin:/sbin:/bin",
    )
    tail: list[bytes] = []
    errors: list[bytes] = []
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        pass_fds=tuple(_held_locks),
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:
            out.write(line)
            tail = [*tail, line.rstrip()][-_LOG_TAIL:]
            if line.startswith((b"E: ", b"W: Failure")):
                errors = [*errors, line.rstrip()][-2:]
            if progress and _PROGRESS.match(line):
                _say(True, f"sample {name}: {line.decode(errors='replace').rstrip()}")
    if child.returncode == 0:
        return
    # debootstrap's own log (inside the tree, removed with it) holds the underlying error.
    if detail_log is not None and detail_log.exists():
        detail = detail_log.read_bytes()
        out.write(b"\n--- " + bytes(detail_log) + b" ---\n" + detail)
        tail = detail.splitlines()[-3:]
    out.flush()
    shown = " | ".join(t.decode(errors="replace").strip() for t in errors + tail if t.strip())
    raise SourceError(f"{what} failed (exit {child.returncode}): {shown} (log {logfile})")


def _clean_apt(root: Path) -> None:
    """Drop downloaded packages and package lists, as `apt-get clean && rm -rf lists/*` would."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*"):
        for path in root.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _mounts_below(path: Path) -> list[str]:
    """Mount points at or below `path`, deepest first."""
    prefix = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def _remove_tree(path: Path) -> None:
    """Remove a half-built tree, unmounting what an interrupted build left mounted inside it
    first: removing files through a mounted /proc or /dev would reach the host's."""
    if not path.exists():
        return
    for point in _mounts_below(path):
        subprocess.run(["umount", "-l", point], check=False)
    left = _mounts_below(path)
    if left:
        raise SourceError(f"cannot remove {path}: still mounted: {', '.join(left)}")
    shutil.rmtree(path)


# Lock fds that builders inherit: if we are killed, the lock stays held until debootstrap
# and apt (which would go on writing into the temporary tree) have exited too.
_held_locks: list[int] = []


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` while building; the kernel releases it on exit."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _held_locks.append(fd)
        yield
    finally:
        if fd in _held_locks:
            _held_locks.remove(fd)
        os.close(fd)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m weenvfs.tools.sample [PROFILE...]`: build sample trees, print their paths."""
    parser = argparse.ArgumentParser(prog="weenvfs.tools.sample", description=__doc__)
    parser.add_argument("profiles", nargs="*", default=["minbase"], choices=list(PROFILES))
    parser.add_argument("--cache", type=Path, default=None, help="cache folder")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    try:
        for profile in args.profiles:
            path = sample_tree(args.cache, profile, progress=not args.quiet)
            files, size = tree_stats(path)
            print(f"{profile}\t{path}\t{files} files\t{size} bytes")
    except SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
