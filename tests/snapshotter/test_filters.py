"""snapshotter/filters.py: containerd's filter syntax on snapshot records."""

from __future__ import annotations

import pytest

from weenvfs.snapshotter.filters import matches
from weenvfs.snapshotter.state import COMMITTED, Record

REC = Record(1, "default/3/sha256:aa", "default/2/sha256:bb", COMMITTED,
             {"containerd.io/snapshot.ref": "sha256:aa", "x": "y,z"})


@pytest.mark.parametrize(("filters", "expected"), [
    ([], True),
    (['labels."containerd.io/snapshot.ref"==sha256:aa,parent=="default/2/sha256:bb"'], True),
    (['labels."containerd.io/snapshot.ref"==sha256:aa,parent=="other"'], False),
    (["kind==committed"], True),
    (["kind==active", "name~=sha256"], True),  # any filter of the list
    (["kind!=committed"], False),
    (['labels.x=="y,z"'], True),
    (["labels.missing"], False),
    (["labels.x"], True),
    (["name==default/3/sha256:aa"], True),
    (["this is not a filter"], True),  # unreadable: containerd filters again
])
def test_matches(filters: list[str], expected: bool) -> None:
    assert matches(REC, filters) is expected
