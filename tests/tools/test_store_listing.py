"""`weenv ls` (what a store holds), "did you mean" on a missing name, and default dedup of a
new tag against the earlier versions of the same group (issue 14)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from fixtures import run_cli
from support import trees
from support.trees import dir, file  # noqa: A004

from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools.dedup_sources import recent_versions

MIB = 1 << 20


def _tree(root: Path, small: bytes = b"one") -> Path:
    rng = random.Random(7)
    return trees.make_tree(root, dir("."), file("big", rng.randbytes(3 * MIB)),
                           file("small", small))


def _build(capsys, store: LocalStore, src: Path, group: str) -> dict:
    code, out, err = run_cli(["build", str(src), "--store", store.url, "--group", group,
                              "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def test_a_new_tag_reuses_the_chunks_of_the_previous_tag(tmp_path, capsys, store) -> None:
    _build(capsys, store, _tree(tmp_path / "a"), "tricky:1")
    second = _build(capsys, store, _tree(tmp_path / "b", b"two"), "tricky:2")
    assert second["chunks_reused"] >= 3 and second["bytes_uploaded"] < MIB
    assert [s.split("@")[0] for s in second["dedup_sources"]] == ["tricky:1"]
    code, out, _ = run_cli(["build", str(tmp_path / "b"), "--store", store.url,
                            "--group", "tricky:3", "--quiet"], capsys)
    assert code == 0 and "(from tricky:" in out


def test_recent_versions_order_and_bound(tmp_path, capsys, store) -> None:
    for i, tag in enumerate(["v1", "v2", "v10", "latest", "v9"]):
        _build(capsys, store, _tree(tmp_path / tag, str(i).encode()), f"g:{tag}")
    _build(capsys, store, _tree(tmp_path / "other"), "h:v99")
    found = recent_versions(Repository(store), "g", "v2")
    assert [t for t, _ in found] == ["v2", "latest", "v10"]
    assert recent_versions(Repository(store), "nope", "x") == []


def test_ls_lists_environments_groups_tags_and_hints(tmp_path, capsys, store) -> None:
    _build(capsys, store, _tree(tmp_path / "a"), "base:1")
    assert run_cli(["compose", "--store", store.url, "env:1", "--group", "base:1"], capsys)[0] == 0
    code, out, err = run_cli(["ls", "--store", store.url, "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert [e["name"] for e in doc["environments"]] == ["env"]
    version = doc["environments"][0]["versions"][0]
    assert version["tags"] == ["1"] and version["groups"] == ["base"]
    assert version["file_bytes"] == 3 * MIB + 3 and version["hints"] == []
    group = doc["groups"][0]
    assert group["name"] == "base" and group["versions"][0]["date"].endswith("Z")
    code, out, _ = run_cli(["ls", "--store", store.url], capsys)
    assert code == 0 and "ENVIRONMENT" in out and "env" in out and "base" in out


def test_ls_of_an_empty_store(tmp_path, capsys, store) -> None:
    code, out, _ = run_cli(["ls", "--store", store.url], capsys)
    assert code == 0 and "no environments" in out and "no groups" in out


def test_a_missing_environment_suggests_near_names(tmp_path, capsys, store) -> None:
    _build(capsys, store, _tree(tmp_path / "a"), "base:1")
    compose = ["compose", "--store", store.url, "python-env:1", "--group", "base:1"]
    assert run_cli(compose, capsys)[0] == 0
    code, _, err = run_cli(["inspect", "pyhton-env:1", "--store", store.url], capsys)
    assert code != 0 and "did you mean python-env:1" in err
    code, _, err = run_cli(["inspect", "python-env:2", "--store", store.url], capsys)
    assert code != 0 and "did you mean python-env:1" in err


def test_ls_lists_unreadable_tags_and_the_rest(tmp_path, capsys, store) -> None:
    """A tag that cannot be read is listed as unreadable (as a missing manifest is listed as
    missing), whether the store's listing skips it (a folder, a symlink loop) or it holds
    garbage; the readable rest is listed as usual."""
    _build(capsys, store, _tree(tmp_path / "a"), "base:1")
    for tag in ("1", "2", "3"):
        compose = ["compose", "--store", store.url, f"env:{tag}", "--group", "base:1"]
        assert run_cli(compose, capsys)[0] == 0
    tags = store.root / "tags" / "envs" / "env"
    (tags / "2").unlink()
    (tags / "2").symlink_to("2")
    (tags / "3").unlink()
    (tags / "3").mkdir()
    (store.root / "tags" / "groups" / "base" / "2").write_bytes(b"garbage\n")
    code, out, err = run_cli(["ls", "--store", store.url, "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert [v["tags"] for v in doc["environments"][0]["versions"]] == [["1"]]
    assert [v["tags"] for v in doc["groups"][0]["versions"]] == [["1"]]
    unreadable = {u["tag"]: u["error"] for u in doc["unreadable_tags"]}
    assert sorted(unreadable) == ["envs/env:2", "envs/env:3", "groups/base:2"]
    assert "symbolic links" in unreadable["envs/env:2"]
    assert unreadable["envs/env:3"] == "a folder, not a tag file"
    assert "not a 64-character" in unreadable["groups/base:2"]
    code, out, _ = run_cli(["ls", "--store", store.url], capsys)
    assert code == 0 and "UNREADABLE TAG" in out
    assert any(ln.split(None, 1) == ["envs/env:3", "a folder, not a tag file"]
               for ln in out.splitlines())
