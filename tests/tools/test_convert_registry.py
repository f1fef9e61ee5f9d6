"""`weenv convert docker://...` against a real registry (Debian's docker-registry on
127.0.0.1), images pushed with skopeo; auth, resume and corruption through the test auth
proxy (support.registry.AuthProxy) in front of it. Results are compared with `umoci unpack`
of the image that was pushed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import oci_images as O
import pytest
import requests
from fixtures import run_cli, run_weenv
from support import layers as L
from support import trees
from support.registry import run_auth_proxy, run_registry, tools_missing

from weenvfs.store.local import LocalStore
from weenvfs.tools import registry as weenv_registry
from weenvfs.tools.registry_server import RegistryServer

ACCEPT = ", ".join(
    [O.OCI_MANIFEST, O.OCI_INDEX, "application/vnd.docker.distribution.manifest.v2+json"]
)
USERS = {"alice": "s3cret"}


@pytest.fixture(autouse=True)
def _tools(require_or_skip: Callable[[object, str], None]) -> None:
    reason = tools_missing()
    require_or_skip(reason is None, reason or "")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    if tools_missing():
        pytest.skip(tools_missing() or "")
    with run_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def union(registry: RegistryServer,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[O.Image, Path]:
    """The union image pushed as union:v1, and umoci's rootfs of it."""
    tmp = tmp_path_factory.mktemp("union")
    media = [O.LAYER_GZIP, O.LAYER_TAR, O.LAYER_GZIP, O.LAYER_GZIP, O.LAYER_TAR, O.LAYER_GZIP]
    image = O.write_layout(tmp / "layout", O.union_layers(), tag="v1", media_types=media)
    registry.push(tmp / "layout", "v1", "union")
    subprocess.run(
        ["umoci", "unpack", "--image", f"{tmp / 'layout'}:v1", str(tmp / "bundle")],
        check=True,
        capture_output=True,
    )
    return image, tmp / "bundle" / "rootfs"


def convert(capsys, ref: str, env: str, store: Path, *extra: str) -> dict:
    rc, out, err = run_cli(
        ["convert", f"docker://{ref}", env, "--store", str(store), "--insecure", "--json", *extra],
        capsys,
    )
    assert rc == 0, err
    return json.loads(out)


def refused(capsys, ref: str, store: Path, *extra: str, code: int = 1) -> str:
    rc, out, err = run_cli(
        ["convert", f"docker://{ref}", "env", "--store", str(store), "--insecure", "--quiet",
         *extra],
        capsys,
    )
    assert rc == code, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weenv: error: "), err
    assert not store.exists() or list(LocalStore(store).list("tags/")) == []
    return lines[0]


def export(capsys, store: Path, env: str, dest: Path) -> Path:
    rc, _, err = run_cli(["export", env, str(dest), "--store", str(store)], capsys)
    assert rc == 0, err
    return dest


def registry_manifest(host: str, repo: str, tag: str) -> tuple[str, dict]:
    resp = requests.get(
        f"http://{host}/v2/{repo}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=10
    )
    resp.raise_for_status()
    return "sha256:" + hashlib.sha256(resp.content).hexdigest(), resp.json()


def blob_gets(proxy) -> list[str]:
    return [p.rpartition("/")[2] for p in proxy.paths() if "/blobs/" in p]


def test_registry_matches_umoci(registry, union, tmp_path, capsys):
    _, rootfs = union
    digest, _ = registry_manifest(registry.host, "union", "v1")
    result = convert(capsys, f"{registry.host}/union:v1", "reg:v1", tmp_path / "store")
    assert result["source"]["manifest"] == digest
    assert result["bytes_downloaded"] > 0
    trees.assert_trees_equal(rootfs, export(capsys, tmp_path / "store", "reg:v1", tmp_path / "o"))
    # By digest, into the same store: every group is reused, no layer is downloaded.
    again = convert(capsys, f"{registry.host}/union@{digest}", "reg:v2", tmp_path / "store")
    assert all(g["reused"] for g in again["groups"])
    assert again["bytes_downloaded"] < 10_000  # manifest and config only


def test_multi_platform_index(registry, tmp_path, capsys):
    _, images = O.write_index_layout(
        tmp_path / "multi",
        {
            "amd64": [L.layer(L.file("arch", b"amd64"))],
            "arm64": [L.layer(L.file("arch", b"arm64"))],
        },
        tag="m",
    )
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--all",
            "--dest-tls-verify=false",
            f"oci:{tmp_path / 'multi'}:m",
            f"docker://{registry.host}/multi:m",
        ],
        check=True,
        capture_output=True,
    )
    store = tmp_path / "store"
    result = convert(
        capsys, f"{registry.host}/multi:m", "m:arm", store, "--platform", "linux/arm64"
    )
    assert result["source"]["platform"] == "linux/arm64"
    assert "index" in result["source"]
    assert (export(capsys, store, "m:arm", tmp_path / "o") / "arch").read_bytes() == b"arm64"
    line = refused(capsys, f"{registry.host}/multi:m", tmp_path / "s2", "--platform", "linux/386")
    assert "no image for platform linux/386" in line


def test_token_auth(registry, union, tmp_path, capsys, monkeypatch):
    _, rootfs = union
    with run_auth_proxy(registry.host, USERS) as proxy:
        ref = f"{proxy.host}/union:v1"
        line = refused(capsys, ref, tmp_path / "bad", "--creds", "alice:wrong")
        assert "authentication failed" in line and "user 'alice'" in line, line
        line = refused(capsys, ref, tmp_path / "anon")
        assert "refused anonymous access" in line, line
        assert not (tmp_path / "bad").exists() and not (tmp_path / "anon").exists()
        store = tmp_path / "store"
        convert(capsys, ref, "auth:v1", store, "--creds", "alice:s3cret")
        assert proxy.token_requests[-1] == "alice"
        trees.assert_trees_equal(rootfs, export(capsys, store, "auth:v1", tmp_path / "o"))
        # The standard Docker config: auths.<host>.auth = base64(user:pass).
        config = tmp_path / "docker"
        config.mkdir()
        auth = base64.b64encode(b"alice:s3cret").decode()
        (config / "config.json").write_text(json.dumps({"auths": {proxy.host: {"auth": auth}}}))
        monkeypatch.setenv("DOCKER_CONFIG", str(config))
        convert(capsys, ref, "auth:v2", tmp_path / "store2")
        assert proxy.token_requests[-1] == "alice"


def test_registry_with_htpasswd(tmp_path, capsys):
    with run_registry(tmp_path / "reg", htpasswd=USERS) as reg:
        O.write_layout(tmp_path / "layout", [L.layer(L.file("secret", b"data"))], tag="v1")
        reg.push(tmp_path / "layout", "v1", "private")
        ref = f"{reg.host}/private:v1"
        line = refused(capsys, ref, tmp_path / "s")
        assert "requires credentials" in line, line
        line = refused(capsys, ref, tmp_path / "s", "--creds", "alice:nope")
        assert "authentication failed: the registry refused user 'alice'" in line, line
        assert not (tmp_path / "s").exists()
        convert(capsys, ref, "p", tmp_path / "s", "--creds", "alice:s3cret")
    assert (export(capsys, tmp_path / "s", "p", tmp_path / "o") / "secret").read_bytes() == b"data"


def test_basic_auth_and_anonymous_tokens(registry, union, tmp_path, capsys):
    with run_auth_proxy(registry.host, USERS, mode="basic") as proxy:
        line = refused(capsys, f"{proxy.host}/union:v1", tmp_path / "s")
        assert "requires credentials" in line, line
        convert(capsys, f"{proxy.host}/union:v1", "b", tmp_path / "s", "--creds", "alice:s3cret")
    with run_auth_proxy(registry.host, USERS, anonymous=True) as proxy:
        convert(capsys, f"{proxy.host}/union:v1", "a", tmp_path / "s3")
        assert proxy.token_requests == [None]


def test_interrupted_download_resumes(registry, tmp_path, capsys):
    data = random.Random(7).randbytes(1 << 20)  # incompressible: the blob is over 1 MiB
    image = O.write_layout(tmp_path / "big", [L.layer(L.file("big.bin", data))], tag="big")
    registry.push(tmp_path / "big", "big", "big")
    _, manifest = registry_manifest(registry.host, "big", "big")
    blob = manifest["layers"][0]
    with run_auth_proxy(
        registry.host, USERS, anonymous=True, cut_blobs={blob["digest"]: 600_000}
    ) as proxy:
        result = convert(capsys, f"{proxy.host}/big:big", "r", tmp_path / "store")
        ranged = [p for m, p, s in proxy.log if s == 206]
    assert ranged == [f"/v2/big/blobs/{blob['digest']}"]
    assert blob["size"] < result["bytes_downloaded"] < 2 * blob["size"]
    out = export(capsys, tmp_path / "store", "r", tmp_path / "o")
    assert (out / "big.bin").read_bytes() == data
    assert image.diff_ids == [la["diff_id"] for la in result["source"]["layers"]]


def test_corrupt_blob_is_refused(registry, union, tmp_path, capsys):
    _, manifest = registry_manifest(registry.host, "union", "v1")
    digest = manifest["layers"][2]["digest"]
    with run_auth_proxy(registry.host, USERS, anonymous=True, corrupt_blobs={digest}) as proxy:
        line = refused(capsys, f"{proxy.host}/union:v1", tmp_path / "store")
    assert "digest mismatch" in line and digest in line, line


def test_second_image_downloads_only_its_own_layers(registry, union, tmp_path, capsys):
    image, _ = union
    task = L.layer(L.dir("work"), L.file("work/task.py", b"print(1235)\n"))
    O.write_layout(tmp_path / "task", [*image.tars[:5], task], tag="1235")
    registry.push(tmp_path / "task", "1235", "task")
    _, manifest = registry_manifest(registry.host, "task", "1235")
    store = tmp_path / "store"
    with run_auth_proxy(registry.host, USERS, anonymous=True) as proxy:
        convert(capsys, f"{proxy.host}/union:v1", "task-1234", store)
        first = len(blob_gets(proxy))
        result = convert(capsys, f"{proxy.host}/task:1235", "task-1235", store)
        fetched = blob_gets(proxy)[first:]
    assert [g["reused"] for g in result["groups"]] == [True] * 5 + [False]
    assert fetched == [manifest["config"]["digest"], manifest["layers"][5]["digest"]]


def test_bad_references(registry, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(weenv_registry, "BACKOFF", 0.01)
    line = refused(capsys, f"{registry.host}/union:nope", tmp_path / "s")
    assert "manifest nope not found (HTTP 404)" in line, line
    line = refused(capsys, "registry.example.com/x:y", tmp_path / "s", code=2)
    assert "refusing plain HTTP to registry.example.com" in line, line
    line = refused(capsys, "127.0.0.1:1/x:y", tmp_path / "s")
    assert "cannot reach registry 127.0.0.1:1" in line, line


def test_a_killed_conversions_downloads_are_removed_by_gc_and_the_next_conversion(
    registry, tmp_path
):
    """SIGKILL while a layer downloads (the proxy holds the transfer midway) leaves the
    `weenv-pull-<pid>-*` folder (and the conversion's blob staging); `weenv gc` lists them,
    and the next conversion removes them."""
    data = random.Random(11).randbytes(1 << 20)
    O.write_layout(tmp_path / "img", [L.layer(L.file("big.bin", data))], tag="k")
    registry.push(tmp_path / "img", "k", "killed")
    _, manifest = registry_manifest(registry.host, "killed", "k")
    blob = manifest["layers"][0]["digest"]
    tmpdir, store = tmp_path / "tmp", tmp_path / "store"
    tmpdir.mkdir()
    LocalStore(store, create=True).close()
    with run_auth_proxy(registry.host, USERS, anonymous=True,
                        stall_blobs={blob: 300_000}) as proxy:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weenvfs", "convert", f"docker://{proxy.host}/killed:k",
             "e", "--store", str(store), "--insecure", "--quiet"],
            env={**os.environ, "TMPDIR": str(tmpdir)}, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            assert proxy.stalled.wait(120), "the conversion never got to its download"
        finally:
            proc.kill()
            proc.wait()
    left = sorted(p for p in tmpdir.iterdir() if p.name.startswith("weenv-"))
    pulls = [p for p in left if p.name.startswith(f"weenv-pull-{proc.pid}-")]
    assert len(pulls) == 1 and any(pulls[0].iterdir()), left  # (and its blob staging)
    dry = run_weenv(tmpdir, "gc", "--store", str(store))
    assert dry.returncode == 0, dry.stderr
    assert all(str(p) in dry.stdout for p in left) and all(p.exists() for p in left)
    again = run_weenv(tmpdir, "convert", f"docker://{registry.host}/killed:k", "e",
                   "--store", str(store), "--insecure", "--quiet")
    assert again.returncode == 0, again.stderr
    assert not any(p.exists() for p in left)
    assert [p for p in tmpdir.iterdir() if p.name.startswith("weenv-")] == []
