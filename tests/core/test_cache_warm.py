"""`weenv cache warm` end to end (the CLI in a subprocess, a local directory store): the
hinted chunks land in the node cache, verified; `--all` brings every chunk; a second run
fetches nothing; no hint is said plainly; bad input is one line and a non-zero exit."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from support import trees
from support.trees import file

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import chunk_loc
from weenvfs.core.commands import _Progress
from weenvfs.core.node_hints import publish_run
from weenvfs.format.hints import HintRecord
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

CHUNK = 64 << 10


def weenv(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "weenvfs", *args], capture_output=True,
                          text=True, timeout=120, check=False)
    if check and done.returncode != 0:
        pytest.fail(f"weenv {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return done


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store with environment env:t: three files of several 64 KiB chunks."""
    rng = random.Random(3)
    src = trees.make_tree(tmp_path / "src", *[file(f"f{n}", rng.randbytes(3 * CHUNK + n))
                                              for n in range(3)])
    out = tmp_path / "store"
    weenv("build", str(src), "--store", str(out), "--group", "g:1", "--chunk-size", "64K")
    weenv("compose", "env:t", "--group", "g:1", "--store", str(out))
    return out


def hint_file(store: Path, path: str) -> list[bytes]:
    """Publish a hint of `path`'s chunks as env:t's `latest`; their digests."""
    with open_store(str(store)) as s:
        repo = Repository(s)
        digest, manifest = repo.resolve_env("env:t")
        index = repo.get_index(manifest.groups[0].index)
        chunks = index.file_chunks(index.resolve(path.encode()))
        publish_run(repo, digest, manifest, [index],
                    [HintRecord(0, c, t) for t, c in enumerate(chunks)], "latest")
        return [chunk_loc(index, c).digest for c in chunks]


def all_digests(store: Path) -> set[bytes]:
    with open_store(str(store)) as s:
        repo = Repository(s)
        index = repo.get_index(repo.resolve_env("env:t")[1].groups[0].index)
        return {chunk_loc(index, n).digest for n in range(index.header.chunk_count)}


def test_warm_fetches_the_hinted_chunks_then_nothing(store: Path, tmp_path: Path) -> None:
    hinted = hint_file(store, "f1")
    cache = tmp_path / "cache"
    first = json.loads(weenv("cache", "warm", "env:t", "--store", str(store), "--cache",
                             str(cache), "--json").stdout)
    assert first["hinted_chunks"] == first["chunks_fetched"] == len(hinted) == 4
    assert first["missing"] == 0 and first["source"] == "tag latest"
    opened = ChunkCache(cache, create=False)
    assert all(opened.contains(d) for d in hinted)
    assert not any(opened.contains(d) for d in all_digests(store) - set(hinted))
    again = json.loads(weenv("cache", "warm", "env:t", "--store", str(store), "--cache",
                             str(cache), "--json").stdout)
    assert again["chunks_fetched"] == 0 and again["bytes_fetched"] == 0


def test_warm_all_fetches_every_chunk(store: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = weenv("cache", "warm", "env:t", "--store", str(store), "--cache", str(cache),
                 "--all")
    every = all_digests(store)
    assert done.stdout.startswith(f"warmed env:t: fetched {len(every)} chunk(s)"), done.stdout
    opened = ChunkCache(cache, create=False)
    assert all(opened.contains(d) for d in every)


def test_warm_without_a_hint_says_so(store: Path, tmp_path: Path) -> None:
    done = weenv("cache", "warm", "env:t", "--store", str(store), "--cache",
                 str(tmp_path / "cache"))
    assert done.stdout.strip() == ("env:t has no prefetch hint (latest): nothing to warm "
                                   "(--all fetches every chunk)")


@pytest.mark.parametrize("args, message", [
    (("nope:x",), "no environment nope:x"),
    (("env:t", "--hint", "bad tag!"), "--hint: 'bad tag!' is not a tag, a hint digest or none"),
    (("env:t", "--pages-through", "relative"), "expected [N=]DIR with DIR absolute"),
    (("env:t", "--pages-through", "x=/mnt"), "expected [N=]DIR with DIR absolute"),
    (("env:t", "--pages-through", "1=/mnt"), "--pages-through 1=/mnt: the environment has "
                                             "groups 0 to 0"),
])
def test_bad_input_is_one_line(store: Path, tmp_path: Path, args: tuple[str, ...],
                               message: str) -> None:
    done = weenv("cache", "warm", *args, "--store", str(store), "--cache",
                 str(tmp_path / "cache"), check=False)
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_progress_counts_every_chunk_once_all_are_fetched(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """`cache warm --all` shows how far it is through the whole environment, not the hint's
    count (which stays 'N of N' for the rest of a long fetch)."""
    progress = _Progress("env:t")
    hints = {"state": "replaying", "chunks_done": 2, "chunks": 3}
    for state, said in (("replaying", "replaying, 2 of 3 hinted chunk(s)"),
                        ("fetching all", "fetching all, 40 of 100 chunk(s)")):
        progress.shown = float("-inf")  # as if a second had passed
        progress({"done": False, "fetch": {"bytes_fetched": 3 << 20},
                  "hints": {**hints, "state": state,
                            "fetch_all": {"done": 40, "chunks": 100, "missing": 0}}})
        assert capsys.readouterr().err == f"weenv: warming env:t: {said}, 3 MiB fetched\n"
