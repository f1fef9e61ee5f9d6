"""`weenv inspect`: environment and group reports, entry listings, escaping of names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fixtures
import pytest
from fixtures import BAD_NAME, assert_one_line_error, run_cli, standard_env

from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools.inspect import escape_name, json_name

COMPOSED = {
    "/", "/app", "/app/main.py", "/bin", "/bin/tool", "/bin/tool-link", "/etc", "/etc/motd",
    "/lib", "/names", "/names/" + BAD_NAME.decode("utf-8", "surrogateescape"), "/sparse.img",
    "/usr", "/usr/lib", "/usr/lib/new.so",
}  # fmt: skip


@pytest.fixture
def env(repo: Repository) -> str:
    return standard_env(repo)


def _inspect(store: LocalStore, capsys: Any, *args: str) -> tuple[int, str, str]:
    return run_cli(["inspect", *args, "--store", str(store.root)], capsys)


def test_env_human_report(store: LocalStore, env: str, capsys: Any) -> None:
    code, out, err = _inspect(store, capsys, "py-env")
    assert code == 0, err
    assert f"manifest     {env}" in out
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines if ln.startswith("  ") and ln.split()[1] == "index"] == [
        "base",
        "mid",
        "top",
    ]
    assert "cwd         /app" in out and "cmd         python3 main.py" in out
    assert "env         PATH=/usr/bin" in out
    assert "source: fixtures" in out
    assert "hints        none" in out
    assert "in 15 entries (composed)" in out


def test_env_json_report(store: LocalStore, env: str, capsys: Any) -> None:
    code, out, _ = _inspect(store, capsys, "py-env", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["manifest"] == env
    base, mid, top = report["groups"]
    assert (base["name"], mid["name"], top["name"]) == ("base", "mid", "top")
    # base: root, etc, bin, usr, usr/lib, dev, names = 7 dirs; tool and its link are one file.
    assert base["dirs"] == 7 and base["files"] == 6 and base["symlinks"] == 1
    assert base["other"] == 2 and base["whiteouts"] == 0
    assert base["file_bytes"] == sum(
        len(s.content()) for s in fixtures.base_specs() if s.kind in ("reg", "sparse")
    )
    assert base["zero_chunks"] >= 3 and base["blobs"] == 1
    assert mid["whiteouts"] == 1 and mid["opaque_dirs"] == 1
    assert top["whiteouts"] == 1
    assert report["config"]["cmd"] == ["python3", "main.py"]
    assert report["provenance"] == {"source": "fixtures"}
    assert report["size"]["entries"] == len(COMPOSED)
    assert report["size"]["stored_bytes"] > sum(g["index_bytes"] for g in report["groups"])


def test_group_report(store: LocalStore, env: str, capsys: Any) -> None:
    code, out, _ = _inspect(store, capsys, "mid", "--group", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["whiteouts"] == 1 and report["opaque_dirs"] == 1 and report["files"] == 2
    code, out, _ = _inspect(store, capsys, report["index"], "--group")
    assert code == 0 and "opaque dirs 1" in out and report["index"] in out


def test_files_lists_the_composed_tree_safely(store: LocalStore, env: str, capsys: Any) -> None:
    code, out, _ = _inspect(store, capsys, "py-env", "--files")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(COMPOSED)
    # No raw control character (newline, escape) ever reaches the terminal.
    assert all(ch == "\n" or ord(ch) >= 0x20 for ch in out)
    assert any(ln.endswith("/names/bad\\xff\\nname\\x1b[31m") for ln in lines)
    tool = next(ln for ln in lines if ln.endswith(" /bin/tool"))
    assert tool.startswith("-rwsr-xr-x   2 0:0")
    assert next(ln for ln in lines if ln.endswith(" /lib -> usr/lib")).startswith("l")
    assert "2023-11-14 22:13:20.000000001 /" in lines[0]
    assert not any("passwd" in ln or "old.so" in ln or "/dev" in ln for ln in lines)


def test_files_json_round_trips_names(store: LocalStore, env: str, capsys: Any) -> None:
    code, out, _ = _inspect(store, capsys, "py-env", "--files", "--json")
    assert code == 0
    assert out.isascii()
    files = json.loads(out)["files"]
    assert {f["path"] for f in files} == COMPOSED
    odd = next(f for f in files if "path_hex" in f)
    assert odd["path"].encode("utf-8", "surrogateescape") == b"/names/" + BAD_NAME
    assert bytes.fromhex(odd["path_hex"]) == b"/names/" + BAD_NAME
    motd = next(f for f in files if f["path"] == "/etc/motd")
    assert motd["group"] == 1 and motd["size"] == len(b"mid motd\n")
    tool = next(f for f in files if f["path"] == "/bin/tool")
    assert tool["mode"] == 0o4755 and tool["nlink"] == 2 and tool["type"] == "reg"


def test_group_files_show_whiteouts_and_devices(store: LocalStore, env: str, capsys: Any) -> None:
    code, out, _ = _inspect(store, capsys, "base", "--group", "--files", "--tree", "/dev")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0].endswith(" /dev")
    assert any(" 1,3 " in ln and ln.startswith("c") for ln in lines)
    code, out, _ = _inspect(store, capsys, "mid", "--group", "--files", "--json")
    entries = {f["path"]: f for f in json.loads(out)["files"]}
    assert entries["/etc/passwd"]["type"] == "whiteout"
    assert entries["/usr/lib"]["opaque"] is True
    code, out, _ = _inspect(store, capsys, "base", "--group", "--files", "--json")
    motd = next(f for f in json.loads(out)["files"] if f["path"] == "/etc/motd")
    assert motd["xattrs"] == [{"key": "user.note", "value_hex": "00ff"}]


def test_tree_limits_the_listing(store: LocalStore, env: str, capsys: Any) -> None:
    code, out, _ = _inspect(store, capsys, "py-env", "--tree", "usr")
    assert code == 0
    paths = [ln.rsplit(" ", 1)[1] for ln in out.splitlines()]
    assert paths == ["/usr", "/usr/lib", "/usr/lib/new.so"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["nosuch"], "no environment nosuch:latest"),
        (["py-env:v9"], "no environment py-env:v9"),
        (["NotAName"], "not a valid name"),
        (["py-env", "--tree", "/usr/nothing"], "no such path"),
        (["nosuch", "--group"], "no group nosuch:latest"),
        (["0" * 64], "no environment manifest"),
    ],
)
def test_errors_are_one_line(
    store: LocalStore, env: str, capsys: Any, args: list[str], fragment: str
) -> None:
    code, _, err = _inspect(store, capsys, *args)
    assert fragment in assert_one_line_error(code, err)


def test_missing_store_is_one_line(tmp_path: Path, capsys: Any) -> None:
    code, _, err = run_cli(["inspect", "x", "--store", str(tmp_path / "absent")], capsys)
    assert "does not exist" in assert_one_line_error(code, err)


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        (b"plain.txt", "plain.txt"),
        (b"with space", "with space"),
        ("ünïcödé".encode(), "ünïcödé"),
        (b"new\nline\ttab\rcr", "new\\nline\\ttab\\rcr"),
        (b"back\\slash", "back\\\\slash"),
        (b"\xff\xfe", "\\xff\\xfe"),
        (b"esc\x1b[0m\x7f", "esc\\x1b[0m\\x7f"),
        ("zero\u200bwidth".encode(), "zero\\u200bwidth"),
    ],
)
def test_escape_name(name: bytes, shown: str) -> None:
    assert escape_name(name) == shown


def test_escape_name_is_injective() -> None:
    names = [b"a\\x41", b"aA", b"a\x41", b"\\xff", b"\xff", b"\\\\", b"\\"]
    assert len({escape_name(n) for n in names}) == len(set(names))


def test_json_name() -> None:
    obj: dict[str, Any] = {}
    json_name(obj, "path", "é".encode())
    assert obj == {"path": "é"}
    json_name(obj, "path", b"\xff")
    assert obj == {"path": "\udcff", "path_hex": "ff"}
