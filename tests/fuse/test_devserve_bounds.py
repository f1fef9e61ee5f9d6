"""The native device server refuses a chunk record out of the format's bounds before it reads
the record's frame (native/weenv-devserve.c `fetch_from_source`). C cannot import
format/constants.py, so the file copies its numbers: this test keeps the copy equal to the
source (tests/fuse/test_mount_hostile_sizes.py checks what the bound is for).
"""

from __future__ import annotations

import re
from pathlib import Path

from weenvfs.format import constants as C

SOURCE = Path(__file__).resolve().parents[2] / "native" / "weenv-devserve.c"


def _define(text: str, name: str) -> int:
    """The value of `#define NAME (EXPR)` in `text`, an integer expression of literals and <<."""
    match = re.search(rf"^#define {name} \(?([0-9u <]+)\)?$", text, re.MULTILINE)
    assert match is not None, f"{name} is not defined in {SOURCE.name}"
    left, _, shift = match.group(1).replace("u", "").partition("<<")
    return int(left) << int(shift or 0)


def test_the_servers_chunk_bounds_are_the_formats() -> None:
    text = SOURCE.read_text()
    assert _define(text, "MAX_CHUNK_SIZE") == C.MAX_CHUNK_SIZE
    assert _define(text, "FRAME_SLACK") == C.FRAME_SLACK
    # The frame bound itself, as max_frame_size computes it.
    assert "clen > ulen + (ulen >> 7) + FRAME_SLACK" in text
    assert all(C.max_frame_size(n) == n + (n >> 7) + C.FRAME_SLACK
               for n in (1, 4096, 1 << 20, C.MAX_CHUNK_SIZE))
