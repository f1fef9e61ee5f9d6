"""`--store file:/path` (RFC 8089's short form) opens /path, not a folder named `file:`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weenvfs.fuse.config import is_url
from weenvfs.store import StoreError, open_store


@pytest.mark.parametrize("form", ["file:{p}", "file://{p}", "FILE:{p}", "{p}"])
def test_file_url_forms_open_the_same_folder(tmp_path: Path, form: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "store"
    with open_store(form.format(p=target), create=True) as store:
        assert Path(store.root) == target  # type: ignore[attr-defined]
    assert not (tmp_path / "file:").exists() and not (tmp_path / "file%3A").exists()


def test_relative_file_url_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="file:/absolute/path"):
        open_store("file:relative/x")


def test_is_url() -> None:
    assert is_url("file:/x") and is_url("s3://b/p") and not is_url("./file/x")


def test_a_folder_named_in_bytes_that_are_not_utf8_keeps_its_name(tmp_path: Path) -> None:
    """The store's URL quotes the name's bytes; opening that URL finds the same folder (it
    found one named with U+FFFD instead: every command given the URL then failed)."""
    target = Path(os.fsdecode(os.fsencode(tmp_path) + b"/st\xff\xc3re"))
    with open_store(str(target), create=True) as store:
        url = store.url
    assert "%FF%C3" in url
    with open_store(url) as again:
        again.check()
        assert os.fsencode(again.root) == os.fsencode(target)  # type: ignore[attr-defined]
