"""Store keys, names and tags (SPEC.md, "Store layout").

    blobs/<digest>          packed chunk frames
    indexes/<digest>        group indexes (zstd)
    manifests/<digest>      environment manifests (canonical JSON)
    hints/<digest>          prefetch hints (zstd)
    erofs/<digest>          a group's published EROFS metadata image (zstd)
    tags/<kind>/<name>/<tag>  "<digest>\\n", the only mutable objects; a '/' in the name is
                              written as '~' so that one name's tags never nest in another's

Pure string functions; no I/O.
"""

from __future__ import annotations

import re

from . import constants as C
from .digest import check_digest
from .errors import FormatError

KINDS = ("blobs", "indexes", "manifests", "hints", "erofs")
# The most bytes a reader reads of a whole stored object of each kind (SPEC.md 12.1). Blobs
# have none: readers fetch ranges of frames, whose length the index bounds, and hash a whole
# blob streamed (no reader of this project holds one in memory).
STORED_LIMITS: dict[str, int | None] = {
    "blobs": None,
    "indexes": C.MAX_STORED_INDEX_SIZE,
    "manifests": C.MAX_MANIFEST_SIZE,
    "hints": C.MAX_STORED_HINT_SIZE,
    "erofs": C.MAX_STORED_IMAGE_SIZE,
}
TAG_KINDS = ("groups", "envs", "hints")
DEFAULT_TAG = "latest"
# The hint tag of an environment's seed hint (SPEC.md 9.4): recorded by `weenv convert` from
# the image's own command, replayed while the environment has no hint `latest` of its own.
SEED_TAG = "seed"

_NAME_PART = r"[a-z0-9]+(?:[._-][a-z0-9]+)*"
_NAME = re.compile(rf"{_NAME_PART}(?:/{_NAME_PART})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
MAX_NAME_LENGTH = 255
NAME_SEPARATOR_IN_KEY = "~"  # names never contain '~'; keys never nest one name in another


def object_key(kind: str, digest: str) -> str:
    """The key of an immutable object of `kind` (one of KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"unknown object kind {kind!r}")
    return f"{kind}/{check_digest(digest)}"


def stored_limit(kind: str) -> int | None:
    """The most bytes of a whole object of `kind` (one of KINDS) a reader reads: a larger
    one is refused unread. None for blobs."""
    if kind not in KINDS:
        raise ValueError(f"unknown object kind {kind!r}")
    return STORED_LIMITS[kind]


def check_name(name: str, what: str = "name") -> str:
    """Validate a group or environment name (lowercase, Docker-repository style)."""
    if len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name):
        raise FormatError(
            what, f"{name!r:.80} is not a valid name (lowercase letters, digits, . _ - and /)"
        )
    return name


def check_tag(tag: str) -> str:
    """Validate a tag (Docker tag rules: up to 128 of letters, digits, . _ -)."""
    if not _TAG.fullmatch(tag):
        raise FormatError("tag", f"{tag!r:.80} is not a valid tag")
    return tag


def parse_name_tag(ref: str, what: str = "reference") -> tuple[str, str]:
    """Split 'NAME[:TAG]' into a validated (name, tag); the tag defaults to 'latest'."""
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:
        name, tag = ref, DEFAULT_TAG
    if ":" in name:  # say the reference as given, not the part before its last colon
        raise FormatError(what, f"{ref!r:.80} is not NAME[:TAG] (one colon at most)")
    return check_name(name, what), check_tag(tag)


def tag_key(kind: str, name: str, tag: str) -> str:
    """The key of the tag `name:tag` of `kind` (one of TAG_KINDS)."""
    if kind not in TAG_KINDS:
        raise ValueError(f"unknown tag kind {kind!r}")
    if kind == "hints":
        check_digest(name, "hint tag name")
    else:
        check_name(name)
    return f"tags/{kind}/{name.replace('/', NAME_SEPARATOR_IN_KEY)}/{check_tag(tag)}"


def parse_tag_key(key: str) -> tuple[str, str, str]:
    """(kind, name, tag) of a tag key made by `tag_key`."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != "tags" or parts[1] not in TAG_KINDS:
        raise FormatError("tag key", f"{key!r:.80} is not a tag key")
    return parts[1], parts[2].replace(NAME_SEPARATOR_IN_KEY, "/"), parts[3]


def encode_tag(digest: str) -> bytes:
    """The stored content of a tag pointing at `digest`."""
    return (check_digest(digest) + "\n").encode("ascii")


def decode_tag(data: bytes) -> str:
    """The digest a stored tag points at."""
    if len(data) > C.TAG_SIZE:
        raise FormatError("tag", f"{len(data)} bytes, more than the {C.TAG_SIZE} of a tag")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise FormatError("tag", "not ASCII") from None
    if not text.endswith("\n"):
        raise FormatError("tag", "missing final newline")
    return check_digest(text[:-1], "tag digest")
