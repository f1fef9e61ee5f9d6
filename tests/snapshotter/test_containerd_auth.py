"""`weenv push` and `weenv pull` against a registry that requires HTTP basic auth (Debian's
docker-registry with an htpasswd file, tests/support/registry.py), credentials given as
`weenv convert` takes them: `--creds USER:PASS`, or the docker config. Without them, or with
wrong ones, both fail in one line and nothing is pushed; with them the image runs under real
containerd 1.6 through `weenv snapshotter` (the `node` fixture)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from support.containerd import Node
from support.registry import run_registry

from weenvfs.tools.registry_server import RegistryServer

pytestmark = pytest.mark.usefixtures("containerd_requirements")

USERS = {"alice": "s3cret"}


@pytest.fixture
def private(tmp_path: Path) -> Iterator[RegistryServer]:
    """A registry of the test that takes only alice's credentials."""
    with run_registry(tmp_path / "private", htpasswd=USERS) as registry:
        yield registry


def _refused(node: Node, *args: str) -> str:
    done = node.weenv(*args, check=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weenv: error: "), done.stderr
    return lines[0]


def _tags(registry: RegistryServer, repo: str) -> list[str]:
    resp = requests.get(f"http://{registry.host}/v2/{repo}/tags/list", auth=("alice", "s3cret"),
                        timeout=30)
    return [] if resp.status_code == 404 else list(resp.json().get("tags") or [])


def test_push_and_pull_with_basic_auth(node: Node, private: RegistryServer, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ref = f"{private.host}/private:v1"
    push = ("push", "two:v1", ref, "--store", str(node.store), "--insecure")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    line = _refused(node, *push)
    assert "requires credentials" in line, line
    line = _refused(node, *push, "--creds", "alice:nope")
    assert "the registry refused user 'alice'" in line, line
    assert _tags(private, "private") == []  # nothing was pushed

    node.weenv(*push, "--creds", "alice:s3cret")
    assert _tags(private, "private") == ["v1"]
    line = _refused(node, "pull", ref, "--insecure", "--containerd-socket", str(node.socket))
    assert "requires credentials" in line, line
    node.pull(ref, "--creds", "alice:s3cret")
    assert node.run(ref, "t-private", "/bin/sh", "-c", "test -s /work/task.txt") == 0
    node.remove_image(ref)

    # The docker config (`docker login` writes it): push, then pull through containerd,
    # which is handed the same credentials.
    config = tmp_path / "docker"
    config.mkdir()
    auth = base64.b64encode(b"alice:s3cret").decode()
    (config / "config.json").write_text(json.dumps({"auths": {private.host: {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    ref2 = f"{private.host}/private:v2"
    node.weenv("push", "two:v1", ref2, "--store", str(node.store), "--insecure")
    assert _tags(private, "private") == ["v1", "v2"]
    node.pull(ref2)
    assert node.run(ref2, "t-private-2", "/bin/sh", "-c", "test -s /work/task.txt") == 0
    node.remove_image(ref2)
