"""A WeEnv group as a layer of an OCI image (`weenv push`, read by `weenv snapshotter`).

A pushed environment is an ordinary OCI image with one layer per group. Each layer names the
group twice, so that every containerd client path finds it:

- in the layer descriptor's annotations (`annotations()`): keys under containerd's snapshot
  label prefix, which containerd's unpacker copies into the labels of the snapshot it
  prepares (CRI, nerdctl and any client that pulls with `WithPullUnpack`), as eStargz does
  with `containerd.io/snapshot/stargz/toc.digest`;
- in the layer blob (`encode_layer_tar()`): an uncompressed tar holding exactly one file,
  `.weenv/layer-<N>.json`, the same reference as canonical JSON (SPEC.md 8.2; byte for
  byte what this module wrote before that section existed, for every ASCII store URL, so
  re-pushing an environment gives the same layers). A client that unpacks the
  blob itself (`ctr images pull`) writes that file into the snapshot, where the snapshotter
  finds it when the snapshot is committed (`decode_marker`).

The tar is deterministic (owner 0:0, mode 0644, mtime 0), so a layer's diff ID depends only on
the reference. A client without WeEnv unpacks the markers and nothing else: the image is not
runnable there, unless pushed with full layers (docs/containerd.md, "Without WeEnv").

Owns: the annotation keys, the marker's path and JSON, and their validation (hex digests,
position range, no control characters in the store URL). A marker is read with the value
rules of canonical JSON but in any spelling: no digest depends on its JSON alone, and markers
pushed before SPEC.md 8.2 escaped non-ASCII characters. Must not: decide whether a store URL
is acceptable on a node (the snapshotter allows only the stores it is configured with).
"""

from __future__ import annotations

import io
import re
import tarfile
from dataclasses import dataclass

from . import canonical_json
from .errors import FormatError

LABEL_PREFIX = "containerd.io/snapshot/weenv/"
KEY_STORE = LABEL_PREFIX + "store"  # the store URL the group's data is read from
KEY_MANIFEST = LABEL_PREFIX + "manifest"  # the environment manifest digest the group is in
KEY_POSITION = LABEL_PREFIX + "position"  # the group's position (0 is the lowest)
KEY_INDEX = LABEL_PREFIX + "index"  # the group's index digest
MARKER_DIR = ".weenv"
MARKER_VERSION = 1
MAX_POSITION = 4095
MAX_MARKER = 4096  # bytes: a marker is a few hundred
MAX_STORE_URL = 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MARKER_NAME = re.compile(r"layer-([0-9]{1,4})\.json")


@dataclass(frozen=True)
class LayerRef:
    """Group `position` (index digest `index`) of environment `manifest` in store `store`."""

    store: str
    manifest: str
    position: int
    index: str

    def __post_init__(self) -> None:
        _check(self)

    def annotations(self) -> dict[str, str]:
        """The layer descriptor's annotations naming this group."""
        return {KEY_STORE: self.store, KEY_MANIFEST: self.manifest,
                KEY_POSITION: str(self.position), KEY_INDEX: self.index}

    @property
    def marker_name(self) -> str:
        """The marker's path inside the layer tar."""
        return f"{MARKER_DIR}/layer-{self.position}.json"

    def marker(self) -> bytes:
        """The marker file's bytes: canonical JSON."""
        body = {"version": MARKER_VERSION, "store": self.store, "manifest": self.manifest,
                "position": self.position, "index": self.index}
        return canonical_json.encode(body, "weenv layer marker")


def _check(ref: LayerRef) -> None:
    if not isinstance(ref.store, str) or not ref.store or len(ref.store) > MAX_STORE_URL:
        raise FormatError("weenv layer store", f"expected a URL of 1-{MAX_STORE_URL} chars")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in ref.store):
        raise FormatError("weenv layer store", "control characters or spaces in the URL")
    for what, value in (("manifest", ref.manifest), ("index", ref.index)):
        if not isinstance(value, str) or not _HEX64.fullmatch(value):
            raise FormatError(f"weenv layer {what}", f"expected 64 hex digits, got {value!r:.80}")
    if (not isinstance(ref.position, int) or isinstance(ref.position, bool)
            or not 0 <= ref.position <= MAX_POSITION):
        raise FormatError("weenv layer position",
                          f"expected 0-{MAX_POSITION}, got {ref.position!r:.20}")


def from_labels(labels: dict[str, str]) -> LayerRef | None:
    """The group named by snapshot `labels` (or annotations); None when they name none;
    FormatError when they name one badly (some keys missing, malformed values)."""
    keys = (KEY_STORE, KEY_MANIFEST, KEY_POSITION, KEY_INDEX)
    present = [k for k in keys if k in labels]
    if not present:
        return None
    if len(present) != len(keys):
        missing = ", ".join(k for k in keys if k not in labels)
        raise FormatError("weenv layer labels", f"missing {missing}")
    position = labels[KEY_POSITION]
    if not position.isdigit() or len(position) > 4:
        raise FormatError("weenv layer position", f"expected a number, got {position!r:.20}")
    return LayerRef(labels[KEY_STORE], labels[KEY_MANIFEST], int(position), labels[KEY_INDEX])


def encode_layer_tar(ref: LayerRef) -> bytes:
    """The layer blob: a tar of the folder `.weenv/` and the marker, deterministic."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folder = tarfile.TarInfo(MARKER_DIR)
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        data = ref.marker()
        entry = tarfile.TarInfo(ref.marker_name)
        entry.size, entry.mode = len(data), 0o644
        tar.addfile(entry, io.BytesIO(data))
    return out.getvalue()


def decode_marker(name: str, data: bytes) -> LayerRef:
    """The reference in marker file `name` (its base name) with content `data`."""
    match = _MARKER_NAME.fullmatch(name)
    if match is None:
        raise FormatError("weenv layer marker", f"unexpected file name {name!r:.80}")
    if len(data) > MAX_MARKER:
        raise FormatError("weenv layer marker", f"{len(data)} bytes, over {MAX_MARKER}")
    body = canonical_json.parse(data, "weenv layer marker")
    if not isinstance(body, dict) or body.get("version") != MARKER_VERSION:
        raise FormatError("weenv layer marker", f"expected version {MARKER_VERSION}")
    ref = LayerRef(body.get("store"), body.get("manifest"),  # type: ignore[arg-type]
                   body.get("position"), body.get("index"))  # type: ignore[arg-type]
    if ref.position != int(match.group(1)):
        raise FormatError("weenv layer marker",
                          f"{name} holds position {ref.position}, its name another")
    return ref
