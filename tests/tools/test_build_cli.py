"""`weenv build` and `weenv compose` through `weenvfs.cli.main`, failures, and kill -9.

A failed or killed build must never leave a tag that points at something missing: tags are
checked by following them to their index and every blob the index names.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures import run_cli
from support import layers, trees
from support.trees import dir, file  # noqa: A004

from weenvfs.errors import StoreError
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex
from weenvfs.store.faulty import FaultyStore
from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import BuildOptions, build_group
from weenvfs.tools.publish import compose_env
from weenvfs.tools.source_dir import DirSource

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def small_tree(root: Path, seed: int = 1) -> Path:
    rng = random.Random(seed)
    return trees.make_tree(
        root,
        dir("."),
        file("big", rng.randbytes(2 * MIB + 5)),
        dir("etc"),
        *(file(f"etc/f{i}", rng.randbytes(100)) for i in range(20)),
    )


def check_tags_complete(store: LocalStore) -> int:
    """Follow every group and env tag to everything below it; return how many tags."""
    repo = Repository(store)
    count = 0
    for kind in ("groups", "envs"):
        for _name, _tag, digest in repo.list_tags(kind):
            count += 1
            if kind == "envs":
                for group in repo.get_manifest(digest).groups:
                    _check_index(store, repo.get_index(group.index))
            else:
                _check_index(store, repo.get_index(digest))
    return count


def _check_index(store: LocalStore, index: GroupIndex) -> None:
    sizes = {b: store.size(f"blobs/{b}") for b in index.blob_digests()}
    for n in range(index.header.chunk_count):
        rec = index.chunk(n)
        if not rec.zero:
            assert rec.offset + rec.clen <= sizes[index.blob_digest(rec.blob)]


def test_build_json_and_summary(tmp_path, capsys, store, repo):
    src = small_tree(tmp_path / "src")
    code, out, err = run_cli(
        ["build", str(src), "--store", store.url, "--group", "g:v1", "--json"], capsys
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["group"] == "g:v1" and result["chunks_new"] == 4
    assert repo.get_tag("groups", "g", "v1") == result["index"]
    code, out, err = run_cli(
        ["build", str(src), "--store", str(store.root), "--group", "g:v1", "--quiet"], capsys
    )
    assert code == 0, err
    assert out.startswith(f"group g:v1 -> index {result['index']}\n")
    assert "reused: 4 chunks" in out and err == ""


def test_build_from_stdin(tmp_path, capsys, store, repo, monkeypatch):
    data = layers.gzip(layers.layer(dir("."), file("a", b"from stdin")))

    class Stdin:
        buffer = io.BufferedReader(io.BytesIO(data))

    monkeypatch.setattr("sys.stdin", Stdin)
    code, out, err = run_cli(["build", "-", "--store", store.url, "--group", "s", "--quiet"],
                             capsys)
    assert code == 0, err
    _, index = repo.resolve_group("s")
    assert index.resolve(b"a") is not None


@pytest.mark.parametrize(
    "member",
    [
        layers.file("../x", b"x"),
        trees.Spec("reg", b"/etc/../../x", data=b"x"),
        layers.symlink("a", "/"),
        trees.Spec("hard", b"h", target=b"never/seen"),
        trees.Spec("reg", b"sub/.wh.."),
    ],
    ids=["dotdot", "abs-dotdot", "symlink-traversal", "unseen-hardlink", "whiteout-dotdot"],
)
def test_hostile_tar_fails_with_one_line(tmp_path, capsys, store, member, store_state):
    members = [dir("sub"), member]
    if member.kind == "lnk":
        members.append(trees.Spec("reg", b"a/x", data=b"through the link"))
    tar = tmp_path / "evil.tar"
    tar.write_bytes(layers.layer(*members))
    code, out, err = run_cli(["build", str(tar), "--store", store.url, "--group", "g"], capsys)
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weenv: error: refusing entry"), err
    assert store_state() == {"tags": [], "indexes": []}


@pytest.mark.parametrize(
    "args",
    [["--chunk-size", "1K"], ["--batch-threshold", "2M"], ["--level", "0"], ["--chunk-size", "x"]],
)
def test_bad_options_are_usage_errors(tmp_path, capsys, store, args):
    src = small_tree(tmp_path / "src")
    code, _, err = run_cli(["build", str(src), "--store", store.url, "--group", "g", *args], capsys)
    assert code == 2 and len(err.strip().splitlines()) >= 1


def test_missing_source(tmp_path, capsys, store):
    code, _, err = run_cli(
        ["build", str(tmp_path / "nope"), "--store", store.url, "--group", "g"], capsys
    )
    assert code == 1 and "does not exist" in err


def test_help_has_examples(capsys):
    for command in ("build", "compose"):
        code, out, _ = run_cli([command, "--help"], capsys)
        assert code == 0 and "examples:" in out and f"weenv {command} " in out


def test_compose(tmp_path, capsys, store, repo):
    for name, seed in (("base", 1), ("app", 2)):
        src = small_tree(tmp_path / name, seed)
        assert run_cli(["build", str(src), "--store", store.url, "--group", name], capsys)[0] == 0
    config = ["--store", store.url, "--env", "PATH=/bin", "--env", "A=b=c", "--cwd", "/work",
              "--user", "1000", "--entrypoint", '["/bin/sh", "-c"]', "--cmd", '["echo hi"]',
              "--label", "k=v"]
    code, out, err = run_cli(
        ["compose", "env:v1", "--group", "base", "--group", "app:latest", *config], capsys
    )
    assert code == 0, err
    digest = out.strip()
    got, manifest = repo.resolve_env("env:v1")
    assert got == digest
    assert [g.name for g in manifest.groups] == ["base", "app"]
    assert manifest.groups[0].index == repo.get_tag("groups", "base", "latest")
    c = manifest.config
    assert (c.env, c.cwd, c.user) == (("PATH=/bin", "A=b=c"), "/work", "1000")
    assert (c.entrypoint, c.cmd, c.labels) == (("/bin/sh", "-c"), ("echo hi",), {"k": "v"})
    # The same inputs give the same manifest.
    again = run_cli(["compose", "env:v2", "--group", "base", "--group", "app", *config], capsys)
    assert again[0] == 0
    by_digest = run_cli(
        ["compose", "env:v3", "--group", manifest.groups[0].index, "--store", store.url, "--json"],
        capsys,
    )
    assert by_digest[0] == 0 and json.loads(by_digest[1])["env"] == "env:v3"


def test_compose_with_a_missing_group_publishes_nothing(tmp_path, capsys, store):
    src = small_tree(tmp_path / "src")
    assert run_cli(["build", str(src), "--store", store.url, "--group", "base"], capsys)[0] == 0
    code, out, err = run_cli(
        ["compose", "env", "--group", "base", "--group", "nope", "--store", store.url], capsys
    )
    assert code != 0 and "nope" in err
    assert list(store.list("manifests/")) == [] and list(store.list("tags/envs/")) == []
    code, _, err = run_cli(
        ["compose", "env", "--group", "base", "--store", store.url, "--cmd", "echo hi"], capsys
    )
    assert code == 2 and "JSON list" in err


def test_compose_refuses_a_float_in_provenance_before_writing(tmp_path, capsys, store, repo):
    # Canonical JSON has integers only (SPEC.md 8.2): a float is refused, not rounded.
    src = small_tree(tmp_path / "src")
    assert run_cli(["build", str(src), "--store", store.url, "--group", "base"], capsys)[0] == 0
    with pytest.raises(FormatError, match=r"manifest\.provenance\.built\.at: a float"):
        compose_env(repo, "env", "v1", ["base"], None, {"built": {"at": 1e-05}})
    assert list(store.list("manifests/")) == [] and list(store.list("tags/envs/")) == []
    assert list(store.list("erofs/")) == []


def test_upload_failure_tags_nothing_and_cleans_up(tmp_path, store, store_state):
    src = small_tree(tmp_path / "src")
    calls = []

    def failing_put_file(key, path):
        calls.append(key)
        raise OSError(5, "injected I/O error")

    faulty = FaultyStore(store, put_file=failing_put_file)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(OSError, match="injected"):
        build_group(DirSource(src), Repository(faulty), "g", "latest", BuildOptions(tmp_dir=work))
    assert calls and store_state() == {"tags": [], "indexes": []}
    assert list(work.iterdir()) == []
    faulty = FaultyStore(store, "gggP*")
    with pytest.raises(StoreError):
        build_group(DirSource(src), Repository(faulty), "g", "latest", BuildOptions(tmp_dir=work))
    assert store_state()["tags"] == [] and list(work.iterdir()) == []


@pytest.mark.slow
def test_kill_9_never_leaves_a_dangling_tag(tmp_path):
    rng = random.Random(1234)
    entries = [dir("."), dir("data"), dir("small")]
    entries += [file(f"data/b{i:02d}", rng.randbytes(MIB + i)) for i in range(40)]
    entries += [file(f"small/s{i:03d}", rng.randbytes(rng.randrange(10, 5000))) for i in range(300)]
    src = trees.make_tree(tmp_path / "src", *entries)
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def command(store: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "weenvfs",
            "build",
            str(src),
            "--store",
            str(store),
            "--group",
            "g",
            "--max-blob-size",
            "3M",
            "--quiet",
        ]

    start = time.monotonic()
    subprocess.run(command(tmp_path / "full"), check=True, env=env, cwd=ROOT, capture_output=True)
    full = time.monotonic() - start
    outcomes = set()
    for attempt in range(8):
        store_dir = tmp_path / f"store{attempt}"
        proc = subprocess.Popen(
            command(store_dir),
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(rng.uniform(0.1, 1.1) * full)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        store = LocalStore(store_dir, create=True)
        tagged = check_tags_complete(store)
        outcomes.add((tagged, bool(list(store.list("blobs/")))))
        # A later build into the same store completes and is whole.
        subprocess.run(command(store_dir), check=True, env=env, cwd=ROOT, capture_output=True)
        assert check_tags_complete(store) == 1
    # Not an assertion on timing: just report which points the kills hit.
    print("kill outcomes (tags, any blob):", sorted(outcomes))


def test_sigterm_cleans_up_as_ctrl_c(tmp_path):
    """SIGTERM (as `timeout` and service managers send it) stops a build as Ctrl-C does: its
    staging folder goes, no tag is left, one line, status 128 + 15."""
    rng = random.Random(99)
    src = trees.make_tree(tmp_path / "src", dir("."), dir("data"),
                          *(file(f"data/b{i:02d}", rng.randbytes(4 * MIB)) for i in range(40)))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    store_dir = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weenvfs", "build", str(src), "--store", str(store_dir),
         "--group", "g", "--quiet"],
        env=dict(os.environ, TMPDIR=str(tmp)), cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not any(tmp.glob("weenv-build-*")) and proc.poll() is None:
            assert time.monotonic() < deadline, "the build never staged anything"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.decode().strip().splitlines()[-1] == "weenv: terminated by SIGTERM"
    assert list(tmp.iterdir()) == []
    assert check_tags_complete(LocalStore(store_dir, create=True)) == 0
