"""Oversized objects in a real S3 store (SeaweedFS), through the CLI (issue 16 item 5).

A 320 MiB object where a manifest belongs and a 1 MiB tag: `weenv inspect`, `verify` and
`mount` refuse each in one line from the object's Content-Length, before reading its body, and
each command stays within a few hundred MB (`ru_maxrss`: reading the object whole would pass
the bound). The same refusals on a directory store are in tests/tools/test_hostile_sizes.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.measured import MEMORY_BOUND, Measured, run_weenv_measured

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuse"))
from mounts import refused_mount  # noqa: E402 - tests/fuse is not on the path

from weenvfs.format import constants as C  # noqa: E402
from weenvfs.format.refs import object_key, tag_key  # noqa: E402
from weenvfs.store.repository import Repository  # noqa: E402
from weenvfs.store.s3 import S3Store  # noqa: E402

MIB = 1 << 20
PREFIX = "oversized"
BIG = 320 * MIB
FAKE = "ab" * 32  # a manifest digest: nothing will hash to it, but it is never read


@pytest.fixture(scope="module")
def url(seaweed: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """PREFIX of the session's SeaweedFS holding env `big` (a tag to a BIG-byte manifest
    object) and env `bigtag` (a 1 MiB tag); removed afterwards."""
    keys = seaweed.env()
    store = S3Store(seaweed.url(PREFIX), session_options={
        "aws_access_key_id": keys["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": keys["AWS_SECRET_ACCESS_KEY"],
    })
    big = tmp_path_factory.mktemp("oversized") / "big"
    big.touch()
    os.truncate(big, BIG)  # uploaded as zeros, multipart
    written = [object_key("manifests", FAKE), tag_key("envs", "big", "latest"),
               tag_key("envs", "bigtag", "latest")]
    try:
        store.put_file(written[0], big)
        Repository(store).set_tag("envs", "big", "latest", FAKE)
        store.put(written[2], b"x" * MIB)
        yield seaweed.url(PREFIX)
    finally:
        for key in written:
            store.delete(key)
        store.close()


def _run(seaweed: Any, url: str, *argv: str) -> Measured:
    done = run_weenv_measured(*argv, "--store", url, env=seaweed.env())
    assert done.maxrss < MEMORY_BOUND, f"weenv {argv[0]}: {done.maxrss >> 20} MiB resident"
    return done


def _one_line(done: Measured, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0].startswith("weenv: error:") and all(w in lines[0] for w in words), lines[0]


def test_an_oversized_manifest_is_refused_unread(seaweed: Any, url: str) -> None:
    _one_line(_run(seaweed, url, "inspect", "big"),
              f"manifests/{FAKE}", f"is {BIG} bytes", f"limit is {C.MAX_MANIFEST_SIZE}")
    done = _run(seaweed, url, "verify", "big")
    assert done.returncode == 1 and done.stderr == "", done.stderr
    assert f"is {BIG} bytes, over the limit of {C.MAX_MANIFEST_SIZE}" in done.stdout


def test_an_oversized_tag_is_refused_unread(seaweed: Any, url: str) -> None:
    for argv in (["inspect", "bigtag"], ["verify", "bigtag"]):
        _one_line(_run(seaweed, url, *argv), "tags/envs/bigtag/latest", f"is {MIB} bytes",
                  f"limit is {C.TAG_SIZE}")


@pytest.mark.requires_fuse
@pytest.mark.parametrize("ref", ["big", "bigtag"])
def test_a_mount_of_an_oversized_object_fails_in_one_line(
    seaweed: Any, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ref: str
) -> None:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)  # the mount (and a daemon) read the AWS variables
    assert "limit is" in refused_mount(ref, url, tmp_path)
