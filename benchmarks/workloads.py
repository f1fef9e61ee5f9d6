"""The workload family of the cold-start benchmark (benchmarks/coldstart.py), built once, cached.

SWE-style task environments that share their lower layers, as layer tars (oci_layers.py):

    base         Debian bookworm minbase (debootstrap: the cached sample of tools/sample.py)
    python       + python3, pip, venv, git, gcc, libc6-dev    (apt-get in a chroot of a copy)
    packages     + numpy, pandas, scipy, pytest, requests, yaml, jinja2        (apt-get)
    task-K       /work/task-K: a real project's source (an sdist from PyPI) committed to a
                 git repository, a test file and task.json, and a .pth in
                 /usr/local/lib/python3.11/dist-packages that installs it in development mode
    packages-v2  the packages layer rebuilt with one component bumped (requests 2.32.3 from its
                 PyPI wheel into /usr/local): the update-cost figure
    reference    optional (--reference): DESIGN.md's reference tree (tools/sample.py
                 `reference`: python3 + numpy + pandas and pandas' optional backends) as one
                 layer over base, for the budget line

Task K's image is base + python + packages + task-K. Task commands: `python3 -c "import numpy,
pandas"` (the first: time-to-ready ends when it exits), `git status` in the repository, and
pytest on the task's test file. Trees live under WORK (default /var/tmp/weenv-bench/swe) and
are rebuilt only when their recipe (a `.key` file next to them) changes.

`smoke=True` builds the same family shape from a tiny tree instead (host binaries and their
libraries, a few files per layer, one whiteout), in seconds and without network: the smoke test
exercises the builder, the diff and both layer forms with it.

Must not: publish anything (docker_peer.py, weenv_peer.py do) or time anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _mounting import BENCH_DIR
from oci_layers import subtree, tree_diff, write_layer

from weenvfs.tools.sample import sample_tree

WORK = BENCH_DIR / "swe"
VERSION = 1
PYTHON_PACKAGES = ("python3", "python3-pip", "python3-venv", "git", "gcc", "libc6-dev")
PACKAGES = ("python3-numpy", "python3-pandas", "python3-scipy", "python3-pytest",
            "python3-requests", "python3-yaml", "python3-jinja2")
BUMP = "requests==2.32.3"
SITE = "usr/local/lib/python3.11/dist-packages"
# (sdist requirement, module) of the task projects; task K uses PROJECTS[K % len(PROJECTS)].
PROJECTS = (("toolz==0.12.1", "toolz"), ("tabulate==0.8.10", "tabulate"),
            ("boltons==24.0.0", "boltons"), ("toolz==0.12.0", "toolz"),
            ("tabulate==0.8.9", "tabulate"), ("boltons==23.1.1", "boltons"),
            ("toolz==0.11.2", "toolz"), ("boltons==23.0.0", "boltons"))
LOWER = ("base", "python", "packages")
GIT_ENV = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.invalid",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.invalid",
           "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}
CHROOT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C",
              "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
IMAGE_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C.UTF-8"]
TEST_FILE = """\
import json
import pathlib

import numpy

TASK = json.loads((pathlib.Path(__file__).parent / "task.json").read_text())


def test_project_imports():
    module = __import__(TASK["module"])
    assert module.__file__.startswith("/work/")


def test_numpy():
    assert int(numpy.arange(TASK["task"] + 2).sum()) == (TASK["task"] + 1) * (TASK["task"] + 2) // 2
"""


@dataclass(frozen=True)
class Layer:
    """One layer tar: where it is, its diff_id (sha256 of the tar), size and whiteouts."""

    name: str
    tar: Path
    diff_id: str
    size: int
    whiteouts: int


def image_layers(name: str) -> tuple[str, ...]:
    """The layers of image `name` ('task-K', 'packages', 'reference', ...), lowest first."""
    if name.startswith("task-"):
        return (*LOWER, name)
    if name == "reference":
        return ("base", "reference")
    if name == "packages-v2":
        return ("base", "python", "packages-v2")
    return LOWER[: LOWER.index(name) + 1]


@dataclass(frozen=True)
class Family:
    """The built workload family: its layers and the commands of its tasks."""

    root: Path
    layers: dict[str, Layer]
    tasks: int
    smoke: bool

    def image(self, name: str) -> tuple[str, ...]:
        """The layers of image `name`, lowest first (see `image_layers`)."""
        return image_layers(name)

    def image_bytes(self, name: str) -> int:
        """Bytes of the image's layer tars (its uncompressed size, as `docker images` shows)."""
        return sum(self.layers[layer].size for layer in self.image(name))

    def ready_command(self, image: str) -> tuple[str, ...]:
        """The first task command: time-to-ready ends when it exits."""
        if self.smoke:
            return ("/bin/cat", "/opt/pkgs/numpy.txt", "/opt/pkgs/pandas.txt")
        return ("python3", "-c", "import numpy, pandas")

    def task_commands(self, k: int) -> list[tuple[str, ...]]:
        """Every command of task K's scripted rollout, the ready command first."""
        repo = f"/work/task-{k}"
        if self.smoke:
            return [self.ready_command(f"task-{k}"), ("/bin/ls", "-l", repo),
                    ("/bin/cat", f"{repo}/test_task.py")]
        return [self.ready_command(f"task-{k}"), ("git", "-C", repo, "status", "--short"),
                ("python3", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                 f"{repo}/test_task.py")]


def build_family(tasks: int, *, smoke: bool = False, reference: bool = False,
                 root: Path | None = None) -> Family:
    """Build (or reuse) every tree and layer tar of a family with `tasks` task layers."""
    root = root or (WORK if not smoke else BENCH_DIR / "swe-smoke")
    trees = _smoke_trees(root) if smoke else _real_trees(root)
    layers: dict[str, Layer] = {}
    pairs = [("base", None, "base"), ("python", "base", "python"),
             ("packages", "python", "packages"), ("packages-v2", "python", "packages-v2")]
    if reference and not smoke:
        trees["reference"] = sample_tree(None, "reference")
        pairs.append(("reference", "base", "reference"))
    for name, lower, upper in pairs:
        lower_tree = trees[lower] if lower else None
        layers[name] = _layer(root, name, lower_tree, trees[upper])
    for k in range(tasks):
        stage = _task_stage(root, k, trees["packages"], smoke)
        layers[f"task-{k}"] = _layer(root, f"task-{k}", None, stage)
    return Family(root, layers, tasks, smoke)


# -- caching --------------------------------------------------------------------------------


def _key_file(path: Path) -> Path:
    return path.with_name(path.name + ".key")


def _cached(path: Path, key: dict[str, Any], make: Callable[[Path], None]) -> Path:
    """`path` if it was completed from recipe `key`, else `make(tmp)` then rename tmp to path."""
    stamp = _key_file(path)
    key = json.loads(json.dumps(key))  # tuples as lists, as they come back from the file
    try:
        if path.exists() and json.loads(stamp.read_text()) == key:
            return path
    except (OSError, ValueError):
        pass
    stamp.unlink(missing_ok=True)
    _remove(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _remove(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        make(tmp)
    except BaseException:
        _remove(tmp)
        raise
    tmp.rename(path)
    stamp.write_text(json.dumps(key, sort_keys=True))
    return path


def _key_of(path: Path) -> Any:
    """The recipe a cached path was made from (a sample tree: its path)."""
    try:
        return json.loads(_key_file(path).read_text())
    except (OSError, ValueError):
        return str(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _layer(root: Path, name: str, lower: Path | None, upper: Path) -> Layer:
    """The layer tar `name` turning tree `lower` (None: nothing) into tree `upper`."""
    tar = root / "layers" / f"{name}.tar"
    key = {"v": VERSION, "lower": _key_of(lower) if lower else None, "upper": _key_of(upper)}
    meta = tar.with_name(tar.name + ".json")

    def make(tmp: Path) -> None:
        diff = tree_diff(lower, upper) if lower else subtree(upper)
        diff_id, size = write_layer(upper, diff, tmp)
        meta.write_text(json.dumps({"diff_id": diff_id, "size": size,
                                    "whiteouts": len(diff.whiteouts)}))

    _cached(tar, key, make)
    info = json.loads(meta.read_text())
    return Layer(name, tar, info["diff_id"], info["size"], info["whiteouts"])


# -- the real trees -------------------------------------------------------------------------


def _say(message: str) -> None:
    print(f"workloads: {message}", file=sys.stderr, flush=True)


def _real_trees(root: Path) -> dict[str, Path]:
    base = sample_tree(None, "minbase")
    python = _derived(root, "python", base, lambda t: _apt_install(t, PYTHON_PACKAGES),
                      {"apt": PYTHON_PACKAGES})
    packages = _derived(root, "packages", python, lambda t: _apt_install(t, PACKAGES),
                        {"apt": PACKAGES})
    wheel = _pip_download(root, BUMP, binary=True)
    v2 = _derived(root, "packages-v2", packages, lambda t: _install_wheel(t, wheel),
                  {"wheel": wheel.name}, hardlink=True)
    return {"base": base, "python": python, "packages": packages, "packages-v2": v2}


def _derived(root: Path, name: str, parent: Path, change: Callable[[Path], None],
             recipe: dict[str, Any], hardlink: bool = False) -> Path:
    """Tree `name`: a copy of `parent` (hardlinks with `hardlink`: `change` must then only
    add files) changed by `change`, cached under root/trees."""
    target = root / "trees" / name

    def make(tmp: Path) -> None:
        _say(f"building tree {name} from {parent} (once; kept in {target})")
        flag = "-al" if hardlink else "-a"
        subprocess.run(["cp", flag, str(parent), str(tmp)], check=True)
        change(tmp)

    key = {"v": VERSION, "parent": _key_of(parent), **recipe}
    return _cached(target, key, make)


def _apt_install(tree: Path, packages: tuple[str, ...]) -> None:
    """apt-get install `packages` in a chroot of `tree` (with /proc, no daemons started),
    then drop apt's downloads and lists, as `apt-get clean && rm -rf lists/*` would."""
    policy = tree / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    subprocess.run(["mount", "-t", "proc", "proc", str(tree / "proc")], check=True)
    log = tree.parent / f"{tree.name}.apt.log"
    try:
        with open(log, "wb") as out:
            for argv in (["apt-get", "update"],
                         ["apt-get", "install", "-y", "--no-install-recommends",
                          "-o", "Dpkg::Use-Pty=0", *packages]):
                done = subprocess.run(["chroot", str(tree), *argv], stdout=out,
                                      stderr=subprocess.STDOUT, env=CHROOT_ENV, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(argv)} failed in {tree}; see {log}")
    finally:
        subprocess.run(["umount", str(tree / "proc")], check=False)
        policy.unlink(missing_ok=True)
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*"):
        for path in tree.glob(pattern):
            _remove(path)


def _pip_download(root: Path, requirement: str, binary: bool) -> Path:
    """The wheel (`binary`) or sdist of `requirement` from PyPI (pip download), cached."""
    folder = root / "downloads"
    name = requirement.replace("==", "-")
    found = sorted(p for p in folder.glob(f"{name}*") if p.suffix in (".whl", ".gz"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    kind = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:",
                                                      "--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *kind,
                    requirement, "-d", str(folder)], check=True, capture_output=True)
    return _pip_download(root, requirement, binary)


def _install_wheel(tree: Path, wheel: Path) -> None:
    """Unpack a pure-Python wheel into /usr/local (what pip install --no-deps does)."""
    target = tree / SITE
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)


def _task_stage(root: Path, k: int, packages: Path, smoke: bool) -> Path:
    """The tree of task K's layer: /work/task-K and the .pth, parents as in `packages`."""
    requirement, module = PROJECTS[k % len(PROJECTS)]
    stage = root / "tasks" / f"task-{k}"
    key = {"v": VERSION, "task": k, "project": requirement, "smoke": smoke}

    def make(tmp: Path) -> None:
        repo = tmp / "work" / f"task-{k}"
        if smoke:
            (repo / "src").mkdir(parents=True)
            (repo / "src" / "mod.py").write_text(f"TASK = {k}\n" * 50)
        else:
            _unpack_sdist(_pip_download(root, requirement, binary=False), repo)
        (repo / "task.json").write_text(json.dumps({"task": k, "project": requirement,
                                                    "module": module}) + "\n")
        if not smoke:
            _git_commit(repo)
        (repo / "test_task.py").write_text(TEST_FILE)  # untracked: what `git status` shows
        site = tmp / SITE
        site.mkdir(parents=True)
        (site / "swe-task.pth").write_text(f"/work/task-{k}\n")
        _copy_parent_meta(packages, tmp, SITE)
        os.chmod(tmp, 0o755)

    return _cached(stage, key, make)


def _unpack_sdist(sdist: Path, repo: Path) -> None:
    """The sdist's files into `repo`, without its top-level folder."""
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        shutil.copytree(top, repo)


def _git_commit(repo: Path) -> None:
    env = {**os.environ, **GIT_ENV}
    for argv in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "task"]):
        subprocess.run(["git", "-C", str(repo), *argv], env=env, check=True, capture_output=True)


def _copy_parent_meta(reference: Path, stage: Path, rel: str) -> None:
    """Give the stage's directories on the way to `rel` the metadata they have in
    `reference`, so the task layer does not change them in the composed tree."""
    parts = Path(rel).parts
    for i in range(1, len(parts) + 1):
        sub = Path(*parts[:i])
        src = reference / sub
        if src.is_dir():
            st = src.stat()
            os.chown(stage / sub, st.st_uid, st.st_gid)
            os.chmod(stage / sub, st.st_mode & 0o7777)
            os.utime(stage / sub, ns=(st.st_atime_ns, st.st_mtime_ns))


# -- the tiny trees of --smoke ----------------------------------------------------------------


SMOKE_BINARIES = ("sh", "cat", "ls", "sleep", "true")


def _smoke_trees(root: Path) -> dict[str, Path]:
    """base: host binaries with their libraries; the other trees add and remove a few files."""
    base = _cached(root / "trees" / "base", {"v": VERSION, "smoke": 1}, _tiny_base)

    def python(t: Path) -> None:
        (t / "opt/runtime/bin").mkdir(parents=True)
        (t / "opt/runtime/bin/python3").write_text("#!/bin/sh\necho python\n")
        (t / "etc/motd").unlink()  # a whiteout in the python layer

    def packages(t: Path) -> None:
        (t / "opt/pkgs").mkdir(parents=True)
        (t / "opt/pkgs/numpy.txt").write_bytes(os.urandom(1536 << 10))  # two 1 MiB chunks
        (t / "opt/pkgs/pandas.txt").write_text("pandas\n" * 2000)
        (t / "opt/pkgs/requests.txt").write_text("requests 2.28\n")

    def bump(t: Path) -> None:
        (t / "opt/pkgs/requests.txt").unlink()
        (t / "opt/pkgs/requests.txt").write_text("requests 2.32.3\n")

    py = _derived(root, "python", base, python, {"smoke": 1})
    pk = _derived(root, "packages", py, packages, {"smoke": 1})
    v2 = _derived(root, "packages-v2", pk, bump, {"smoke": 1})
    return {"base": base, "python": py, "packages": pk, "packages-v2": v2}


def _tiny_base(tmp: Path) -> None:
    for d in ("bin", "etc", "tmp", "root", "proc", "dev", "sys", "work", "usr/bin"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    os.chmod(tmp / "tmp", 0o1777)
    (tmp / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (tmp / "etc/group").write_text("root:x:0:\n")
    (tmp / "etc/motd").write_text("smoke\n")
    libs: set[str] = set()
    for name in SMOKE_BINARIES:
        path = shutil.which(name)
        if path is None:
            raise RuntimeError(f"{name} not found on this machine")
        shutil.copy(os.path.realpath(path), tmp / "bin" / name)
        libs.update(_libraries(path))
    for lib in libs:
        dest = tmp / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.realpath(lib), dest)
    os.chmod(tmp, 0o755)


def _libraries(binary: str) -> list[str]:
    """The absolute paths of the shared libraries `ldd` lists for `binary`."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    found = []
    for line in out.splitlines():
        words = [w for w in line.split() if w.startswith("/")]
        if words:
            found.append(words[0])
    return found
