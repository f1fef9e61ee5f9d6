"""Resolving an environment of an S3 store through the node service (runtime/node_resolve.py):
a process that has not loaded boto3 gets the same `EnvSource` as an in-process resolution
without loading it, and falls back to resolving in-process, with the usual error, when the
service cannot answer or the resolution fails.

Real parts: the session's SeaweedFS, a real node service on a socket of the test's own
(support/mount_server.py), `weenv` and Python in subprocesses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import s3_store
from support import trees
from support.mount_server import mount_server

from weenvfs.errors import WeenvError
from weenvfs.runtime.environment import resolve_source
from weenvfs.runtime.node_resolve import source_to_json
from weenvfs.tools.builder import build_group, open_source
from weenvfs.tools.publish import compose_env

RESOLVE = """
import json, sys
from weenvfs.errors import WeenvError
from weenvfs.runtime.environment import resolve_source
from weenvfs.runtime.node_resolve import source_to_json
source = resolve_source(sys.argv[1], sys.argv[2], sys.argv[3], None)
print(json.dumps(source_to_json(source)))
print("boto3 loaded" if "boto3" in sys.modules else "boto3 not loaded", file=sys.stderr)
"""


@pytest.fixture
def published(seaweed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A small environment `tiny:1` in a prefix of its own; the server's keys in this
    process's environment (and so the subprocesses' and the node service's requests)."""
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    url = seaweed.url(f"resolve-{tmp_path.name}")
    src = trees.make_tree(tmp_path / "src", trees.file("etc/hostname", b"tiny\n"))
    store = s3_store(seaweed, url)
    try:
        from weenvfs.store.repository import Repository

        repo = Repository(store)
        build_group(open_source(src), repo, "tiny-os", "1")
        compose_env(repo, "tiny", "1", ["tiny-os:1"])
    finally:
        store.close()
    return url


def _resolve_in_subprocess(ref: str, url: str, cache: Path) -> tuple[dict[str, Any], str]:
    done = subprocess.run([sys.executable, "-c", RESOLVE, ref, url, str(cache)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_the_node_service_resolves_without_boto3_here(published: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    expected = source_to_json(resolve_source("tiny:1", published, cache, None,
                                             node_service=False))
    with mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch):
        got, stderr = _resolve_in_subprocess("tiny:1", published, cache)
    assert got == expected
    assert "boto3 not loaded" in stderr


def test_without_the_node_service_it_resolves_in_process(published: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEENV_MOUNTD", "off")
    cache = tmp_path / "cache"
    got, stderr = _resolve_in_subprocess("tiny:1", published, cache)
    assert got["ref"] == "tiny:1" and len(got["groups"]) == 1
    assert "boto3 loaded" in stderr


OVERLAP = """
import json, sys
from weenvfs.runtime import Environment  # noqa: F401 - what the Python API's users import
loaded = sorted(m for m in ("weenvfs.runtime.sandbox", "weenvfs.fuse.mountd", "boto3")
                if m in sys.modules)
from weenvfs.runtime.environment import start_resolving
from weenvfs.runtime.node_resolve import source_to_json
finish = start_resolving(sys.argv[1], sys.argv[2], sys.argv[3], None)
asked = sorted(m for m in ("weenvfs.fuse.mountd", "boto3") if m in sys.modules)
import weenvfs.runtime.sandbox  # what `Environment.open` loads meanwhile
source = source_to_json(finish())
print(json.dumps({"loaded": loaded, "asked": asked, "source": source,
                  "boto3": "boto3" in sys.modules}))
"""


def test_the_api_loads_the_sandbox_while_the_service_resolves(
        published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the API loads neither the sandbox's modules nor the service's server side
    nor boto3; the resolution is asked for first and its answer read after the sandbox's
    modules are loaded, through the running service's socket alone (no mountd.py)."""
    cache = tmp_path / "cache"
    expected = source_to_json(resolve_source("tiny:1", published, cache, None,
                                             node_service=False))
    with mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch):
        done = subprocess.run([sys.executable, "-c", OVERLAP, "tiny:1", published, str(cache)],
                              capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["loaded"] == [] and document["asked"] == []
    assert document["source"] == expected and document["boto3"] is False


def test_a_failed_resolution_gives_the_usual_error(published: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch):
        done = subprocess.run(
            [sys.executable, "-m", "weenvfs", "run", "--store", published, "tiny:2", "true"],
            capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no environment tiny:2" in lines[0], done.stderr
    assert "did you mean tiny:1" in lines[0]


def test_a_failed_resolution_is_not_repeated_in_process(
        published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node service's child reports the resolution's own error, which is raised as it is:
    resolving again here would repeat it (and wait as long again on a stalled store)."""
    from weenvfs.runtime import node_resolve

    with (mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch),
          pytest.raises(WeenvError, match="no environment tiny:2") as raised):
        pending = node_resolve.ask_node_service("tiny:2", published, tmp_path / "cache", None)
        assert pending is not None  # the service took the request
        pending.result()
    assert "did you mean tiny:1" in str(raised.value)
    done = subprocess.run([sys.executable, "-m", "weenvfs", "sandbox", "resolve", "tiny:2",
                           "--store", published, "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    document = json.loads(done.stdout)
    assert done.returncode == document["exit_code"] != 0
    assert "no environment tiny:2" in document["error"]


def test_sandbox_resolve_prints_the_source(published: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "weenvfs", "sandbox", "resolve", "tiny:1",
                           "--store", published, "--cache", str(cache), "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    expected = source_to_json(resolve_source("tiny:1", published, cache, None,
                                             node_service=False))
    assert json.loads(done.stdout) == expected
    text = subprocess.run([sys.executable, "-m", "weenvfs", "sandbox", "resolve", "tiny:1",
                           "--store", published, "--cache", str(cache)],
                          capture_output=True, text=True, timeout=300, check=True).stdout
    assert f"digest       {expected['digest']}" in text


def test_the_answer_is_read_past_log_lines_and_refused_when_it_is_not_one() -> None:
    from weenvfs.runtime.env_source import EnvSource
    from weenvfs.runtime.node_resolve import _source

    source = EnvSource("tiny:1", "d" * 64, "s3://b/p", Path("/c"), ("A=1",), "/", "",
                       ("sh", "-c", "ls"), ("e" * 64,), None, entrypoint=("sh", "-c"))
    answer = json.dumps(source_to_json(source), indent=2).encode()
    assert _source(answer) == source
    assert _source(b"WARNING botocore: something\n" + answer) == source
    assert _source(b"weenv: error: no environment tiny:2 in s3://b/p\n") is None
    assert _source(answer.replace(b'"groups"', b'"groupz"')) is None
    # An error of the resolution itself is raised with its message and exit code.
    failed = json.dumps({"error": "no environment tiny:2", "exit_code": 2}).encode()
    with pytest.raises(WeenvError, match="no environment tiny:2") as raised:
        _source(b"WARNING botocore: something\n" + failed)
    assert raised.value.exit_code == 2


OPEN_FAILS = """
import os, sys
from weenvfs.runtime import node_resolve
from weenvfs.runtime.environment import Environment
asked = []
ask = node_resolve.ask_node_service
def recorded(*args, **kwargs):
    pending = ask(*args, **kwargs)
    asked.append(pending is not None)
    return pending
node_resolve.ask_node_service = recorded
def fds():
    return sorted(os.listdir("/proc/self/fd"))
before = fds()
sys.modules["weenvfs.runtime.sandbox"] = None  # loading the sandbox's modules fails
try:
    Environment.open(sys.argv[1], store=sys.argv[2], cache=sys.argv[3])
except ImportError:
    pass
else:
    sys.exit("opened")
print("asked" if asked == [True] else f"not asked: {asked}")
print("leaked" if fds() != before else "no fd left")
"""


def test_an_open_that_fails_before_taking_its_resolution_leaves_no_pipe_open(
        published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Environment.open` asks the node service to resolve, then loads the sandbox's modules:
    when that raises, the answer is never taken, and its two pipe ends were left open."""
    with mount_server(tmp_path / "mountd" / "mountd.sock", monkeypatch):
        done = subprocess.run([sys.executable, "-c", OPEN_FAILS, "tiny:1", published,
                               str(tmp_path / "cache")],
                              capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["asked", "no fd left"], done.stdout + done.stderr
