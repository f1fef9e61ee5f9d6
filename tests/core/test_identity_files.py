"""Which chunks a mount asks for as it starts, for the sandbox's build (core/identity_files.py):
those of /etc/passwd and /etc/group where the composed environment has them, by the union's
rules (the topmost entry, whiteouts and opaque directories hide), real indexes built by
tools/builder.py."""

from __future__ import annotations

from typing import Any

from support import layers
from support.trees import dir, file, symlink  # noqa: A004

from weenvfs.core.chunk_plan import chunk_loc
from weenvfs.core.identity_files import identity_locs

PASSWD = b"root:x:0:0:root:/root:/bin/sh\n" * 3
GROUP = b"root:x:0:\n" * 3


def _chunks_of(built: Any, path: bytes) -> list[Any]:
    """The chunk locations of regular file `path` of group `built`."""
    index = built.index
    return [chunk_loc(index, n) for n in index.file_chunks(index.resolve(path))]


def test_one_group_gives_both_files_chunks(repo, build_group) -> None:
    base = build_group(repo, [dir("etc"), file("etc/passwd", PASSWD), file("etc/group", GROUP),
                              file("etc/hostname", b"h\n")], "base")
    assert identity_locs([base.index]) == (_chunks_of(base, b"etc/passwd")
                                           + _chunks_of(base, b"etc/group"))


def test_the_topmost_group_wins_and_what_it_hides_is_not_asked_for(repo, build_group) -> None:
    base = build_group(repo, [dir("etc"), file("etc/passwd", PASSWD), file("etc/group", GROUP)],
                       "base")
    users = build_group(repo, [dir("etc"), file("etc/passwd", PASSWD + b"me:x:1000:1000::/h:\n")],
                        "users")
    assert identity_locs([base.index, users.index]) == (_chunks_of(users, b"etc/passwd")
                                                        + _chunks_of(base, b"etc/group"))
    hidden = build_group(repo, [dir("etc"), layers.whiteout("etc/group")], "hidden")
    assert identity_locs([base.index, hidden.index]) == _chunks_of(base, b"etc/passwd")
    opaque = build_group(repo, [dir("etc"), layers.opaque("etc"), file("etc/hostname", b"h\n")],
                         "opaque")
    assert identity_locs([base.index, opaque.index]) == []
    assert identity_locs([opaque.index, base.index]) == (_chunks_of(base, b"etc/passwd")
                                                         + _chunks_of(base, b"etc/group"))


def test_paths_that_are_no_regular_file_give_nothing(repo, build_group) -> None:
    odd = build_group(repo, [dir("etc"), symlink("etc/passwd", "../passwd"),
                             dir("etc/group"), file("passwd", PASSWD)], "odd")
    assert identity_locs([odd.index]) == []
    flat = build_group(repo, [file("etc", b"not a folder")], "flat")
    assert identity_locs([flat.index]) == []
    empty = build_group(repo, [dir("srv")], "empty")
    assert identity_locs([empty.index]) == []
