"""Converting a container image into layer groups and an environment manifest.

Owns: grouping the image's layers, reusing groups the store already holds, building the
others in order on top of each other, and publishing: every group's blobs and index, then
the manifest, then the group tags, then the environment tag, so nothing is tagged unless
the whole conversion succeeded.

Grouping. By default each layer is its own group. `--group NAME[:TAG]=RANGE` (RANGE is `N`,
`N-M` or `N-`, zero-based and inclusive) squashes consecutive layers into one group with OCI
semantics inside it; the specs must cover every layer once, in order.

Names, tags and reuse. Each group has a *content key*: 32 hex digits of the sha256 of
"weenv-group-v1", the chain ID of the layers below the group (OCI: the hash chain of their
diff_ids) and the chain ID up to its top layer. The key depends on every layer up to the
group's top (a layer's conversion can depend on what lies below it: copied-up hardlinks,
refused symlinks), and on nothing else. A default group is named `layer-<key>` (tag
`latest`); a named group is `NAME:<key>` unless a TAG is given. When such a key-named tag
already exists with the same chunk size and its blobs are all stored, the group is reused
as is: its layers are not even downloaded, so converting a second image that shares its
base layers with a first one reads and uploads only the layers above them. An explicit TAG
is never trusted for reuse (it may point at anything); the group is rebuilt.

Dedup. A group that is built reuses chunks (by digest, and small files by file digest) of:
every group below it in this conversion, the groups of the environment NAME:TAG points at
now (an earlier conversion of the same name), the version an explicit group tag points at
now, and every `--dedup-with` environment or group. Chunks found there are not uploaded.

Must not: parse image formats (image_source.py and the transports), layers (layers.py), or
arguments (convert_commands.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weenvfs.errors import ObjectMissing, RefNotFound, SourceError, StoreError, UsageError
from weenvfs.format.digest import short
from weenvfs.format.errors import FormatError
from weenvfs.format.index import GroupIndex
from weenvfs.format.manifest import GroupRef, Manifest, check_provenance, encode_manifest
from weenvfs.format.refs import check_name, check_tag
from weenvfs.store.repository import Repository

from .chunker import Chunker, ChunkOptions, DedupTable
from .convert_group import LowerView, StackedTree, StoredGroup, build_group_untagged
from .dedup_sources import recent_versions
from .image_source import Image, ImageSource, Layer
from .layers import LayerSource, check_media_type
from .layout import LayoutOrder
from .oci_docs import Platform
from .progress import Progress
from .reader import ChunkReader

log = logging.getLogger(__name__)

KEY_VERSION = "weenv-group-v1"  # bump when conversion semantics change: old groups not reused
_SPEC = re.compile(r"(?P<ref>[^=]+)=(?P<first>\d+)(?:(?P<dash>-)(?P<last>\d+)?)?")


@dataclass(frozen=True)
class GroupSpec:
    """A `--group NAME[:TAG]=RANGE` argument: layers first..last (None: to the end)."""

    name: str
    tag: str | None
    first: int
    last: int | None

    @classmethod
    def parse(cls, text: str) -> GroupSpec:
        m = _SPEC.fullmatch(text.strip())
        if m is None:
            raise UsageError(f"invalid --group {text!r}: expected NAME[:TAG]=N, N-M or N-")
        name, sep, tag = m.group("ref").partition(":")
        check_name(name, "group name")
        if sep:
            check_tag(tag)
        first = int(m.group("first"))
        last = first if not m.group("dash") else (int(m.group("last")) if m.group("last") else None)
        if last is not None and last < first:
            raise UsageError(f"invalid --group {text!r}: the range ends before it starts")
        return cls(name, tag if sep else None, first, last)


@dataclass
class PlannedGroup:
    """One group of the conversion: layers first..last (inclusive)."""

    name: str
    tag: str
    first: int
    last: int
    key: str
    explicit_tag: bool = False

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


def chain_ids(layers: Sequence[Layer]) -> list[str]:
    """The OCI chain ID of each prefix of `layers` (diff_ids; blob digests when the config
    has none)."""
    out: list[str] = []
    for layer in layers:
        ident = layer.diff_id or layer.digest or ""
        out.append(
            ident
            if not out
            else "sha256:" + hashlib.sha256(f"{out[-1]} {ident}".encode()).hexdigest()
        )
    return out


def group_key(chains: Sequence[str], first: int, last: int) -> str:
    """The content key of a group of layers first..last (module doc)."""
    below = chains[first - 1] if first else "-"
    text = f"{KEY_VERSION} {below} {chains[last]}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def plan_groups(specs: Sequence[GroupSpec], layers: Sequence[Layer]) -> list[PlannedGroup]:
    """The groups of a conversion: one per layer by default, else `specs` checked to cover
    every layer once, in order."""
    count = len(layers)
    if count == 0:
        raise UsageError("the image has no layers")
    chains = chain_ids(layers)
    if not specs:
        return [
            PlannedGroup(f"layer-{(k := group_key(chains, n, n))}", "latest", n, n, k)
            for n in range(count)
        ]
    planned, expected, names = [], 0, set()
    for spec in specs:
        last = count - 1 if spec.last is None else spec.last
        where = f"--group {spec.name}={spec.first}-{'' if spec.last is None else spec.last}"
        if spec.first != expected:
            detail = (
                f"layers {expected}-{spec.first - 1} are in no group"
                if spec.first > expected
                else f"it overlaps layer {spec.first}"
            )
            raise UsageError(f"{where}: groups must cover the layers in order; {detail}")
        if last >= count:
            raise UsageError(f"{where}: the image has only {count} layers (0-{count - 1})")
        if spec.name in names:
            raise UsageError(f"{where}: group name {spec.name!r} is used twice")
        names.add(spec.name)
        key = group_key(chains, spec.first, last)
        planned.append(
            PlannedGroup(spec.name, spec.tag or key, spec.first, last, key, spec.tag is not None)
        )
        expected = last + 1
    if expected != count:
        raise UsageError(
            f"layers {expected}-{count - 1} are in no group (add e.g. NAME={expected}-)"
        )
    return planned


@dataclass(frozen=True)
class ConvertOptions:
    """How to convert, besides the source and the target."""

    groups: tuple[GroupSpec, ...] = ()
    platform: Platform | None = None
    chunk: ChunkOptions = field(default_factory=ChunkOptions)
    reuse: bool = True
    dedup_with: tuple[str, ...] = ()
    tmp_dir: Path | None = None
    layout: LayoutOrder | None = None  # hinted data first, in hint order (layout.py)


@dataclass
class GroupResult:
    """What became of one planned group."""

    plan: PlannedGroup
    index_digest: str
    reused: bool
    stored: StoredGroup | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group": self.plan.ref,
            "layers": [self.plan.first, self.plan.last],
            "index": self.index_digest,
            "reused": self.reused,
        }
        s = self.stored
        if s is not None:
            out.update(counts=s.counts.as_dict(), **s.stats.as_dict())
            out.update(
                blobs_new=s.blobs_new,
                blobs_uploaded=s.blobs_uploaded,
                bytes_uploaded=s.bytes_uploaded,
                index_size=s.index_size,
                copied_up=s.copied_up,
            )
        return out


@dataclass
class ConvertResult:
    """What a conversion published."""

    env: str
    manifest_digest: str
    image: Image
    groups: list[GroupResult]
    bytes_downloaded: int

    @property
    def bytes_uploaded(self) -> int:
        return sum(g.stored.bytes_uploaded for g in self.groups if g.stored)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (the CLI's --json output)."""
        return {
            "env": self.env,
            "manifest": self.manifest_digest,
            "source": self.image.provenance(),
            "layers": len(self.image.layers),
            "groups": [g.as_dict() for g in self.groups],
            "groups_reused": sum(g.reused for g in self.groups),
            "bytes_downloaded": self.bytes_downloaded,
            "bytes_uploaded": self.bytes_uploaded,
        }


class _Converter:
    def __init__(
        self, source: ImageSource, repo: Repository, options: ConvertOptions, progress: Progress
    ) -> None:
        self.source = source
        self.repo = repo
        self.options = options
        self.progress = progress
        self.seed = DedupTable()
        self.reader = ChunkReader(repo.store)

    def seed_from(self, refs: Sequence[str]) -> None:
        """Add the indexes of environments or groups `refs` (`--dedup-with`) to the seed."""
        for ref in refs:
            try:
                _, manifest = self.repo.resolve_env(ref)
            except RefNotFound:
                try:
                    digest, index = self.repo.resolve_group(ref)
                except RefNotFound:
                    raise RefNotFound(f"--dedup-with {ref}: no such environment or group") from None
                self.seed.add_index(index)
                log.info("dedup against group %s (%s)", ref, short(digest))
                continue
            for g in manifest.groups:
                self.seed.add_index(self.repo.get_index(g.index))
            log.info("dedup against the %d groups of %s", len(manifest.groups), ref)

    def seed_from_previous(self, ref: str) -> None:
        """Add the groups of the environment `ref` points at now, if it exists and is whole
        (an earlier conversion of the same name; best effort)."""
        try:
            _, manifest = self.repo.resolve_env(ref)
            indexes = [self.repo.get_index(g.index) for g in manifest.groups]
        except (RefNotFound, StoreError) as e:
            log.debug("no previous version of %s to dedup against: %s", ref, e)
            return
        for index in indexes:
            self.seed.add_index(index)
        log.info("dedup against the %d groups of the current %s", len(indexes), ref)

    def reusable(self, plan: PlannedGroup) -> tuple[str, GroupIndex] | None:
        if not self.options.reuse or plan.explicit_tag:
            return None
        try:
            digest, index = self.repo.resolve_group(plan.ref)
        except RefNotFound:
            return None
        if index.chunk_size != self.options.chunk.chunk_size:
            log.info("not reusing %s: chunk size %d", plan.ref, index.chunk_size)
            return None
        if not all(self.repo.has_object("blobs", b) for b in index.blob_digests()):
            log.warning("not reusing %s: some of its blobs are missing from the store", plan.ref)
            return None
        return digest, index

    def table_for(self, plan: PlannedGroup, lower: Sequence[GroupIndex]) -> DedupTable:
        table = DedupTable()
        table.chunks = dict(self.seed.chunks)
        table.files = dict(self.seed.files)
        for index in lower:
            table.add_index(index)
        # Earlier versions of this group's name (the tag replaced, the newest others): a new
        # tag of a group mostly holds what the previous ones did.
        for version_tag, digest in recent_versions(self.repo, plan.name, plan.tag):
            with contextlib.suppress(ObjectMissing):
                table.add_index(self.repo.get_index(digest))
                log.info("dedup %s against %s:%s (%s)", plan.ref, plan.name, version_tag,
                         short(digest))
        return table

    def read_layer(self, layer: Layer, total: int) -> Any:
        def read(tree: StackedTree, chunker: Chunker) -> None:
            self.source.wait_for(layer, self.progress)
            self.progress.begin(f"{layer.label}, {layer.index + 1} of {total}", layer.size)
            source = LayerSource(layer, self.progress.update)
            try:
                for entry in source.entries():
                    for e, node in tree.add(entry):
                        chunker.add_file(node, e)
            except SourceError as e:
                if str(e).startswith(layer.label):
                    raise
                raise SourceError(f"{layer.label}: {e}") from None
            finally:
                source.close()
            self.progress.end()

        return read

    def build(self, plan: PlannedGroup, image: Image, lower: list[GroupIndex]) -> StoredGroup:
        layers = image.layers[plan.first : plan.last + 1]
        readers = [self.read_layer(la, len(image.layers)) for la in layers]
        return build_group_untagged(
            readers,
            LowerView(lower, self.reader),
            self.repo,
            self.options.chunk,
            self.table_for(plan, lower),
            self.progress,
            self.options.tmp_dir,
            self.options.layout,
        )


def convert_image(
    source: ImageSource,
    repo: Repository,
    name: str,
    tag: str,
    options: ConvertOptions | None = None,
    progress: Progress | None = None,
    image: Image | None = None,
) -> ConvertResult:
    """Convert the image of `source` (`image` if the caller resolved it already) into groups
    and the environment `name:tag` (module doc). Raises SourceError for a bad image,
    StoreError for store failures, UsageError for bad grouping; in every case nothing is
    tagged."""
    check_name(name, "environment name")
    check_tag(tag)
    options = options or ConvertOptions()
    progress = progress or Progress.quiet()
    if image is None:
        image = source.resolve(options.platform or Platform.host())
    try:  # the manifest will hold it: fail before anything is built
        check_provenance({"image": image.provenance()})
    except FormatError as error:
        raise SourceError(f"{image.source}: {error}") from None
    for layer in image.layers:
        check_media_type(layer)
    plans = plan_groups(options.groups, image.layers)
    conv = _Converter(source, repo, options, progress)
    conv.seed_from_previous(f"{name}:{tag}")
    conv.seed_from(options.dedup_with)
    reuse = {id(p): conv.reusable(p) for p in plans}
    source.prefetch(
        [la for p in plans if reuse[id(p)] is None for la in image.layers[p.first : p.last + 1]]
    )
    results: list[GroupResult] = []
    lower: list[GroupIndex] = []
    for plan in plans:
        found = reuse[id(plan)]
        if found is not None:
            log.info("reusing group %s (layers %d-%d)", plan.ref, plan.first, plan.last)
            results.append(GroupResult(plan, found[0], True))
            lower.append(found[1])
            continue
        stored = conv.build(plan, image, lower)
        results.append(GroupResult(plan, stored.index_digest, False, stored))
        lower.append(stored.index)
    digest = _publish(repo, name, tag, image, results)
    return ConvertResult(f"{name}:{tag}", digest, image, results, source.bytes_downloaded)


def _publish(
    repo: Repository, name: str, tag: str, image: Image, results: list[GroupResult]
) -> str:
    """Manifest, then group tags, then the environment tag."""
    provenance = {
        "converted_by": "weenv convert",
        "image": image.provenance(),
        "groups": [
            {"group": r.plan.ref, "layers": [r.plan.first, r.plan.last], "key": r.plan.key}
            for r in results
        ],
    }
    refs = tuple(GroupRef(r.plan.name, r.index_digest) for r in results)
    manifest = Manifest(refs, image.config.runtime_config(), None, provenance)
    digest = repo.put_object("manifests", encode_manifest(manifest))
    for r in results:
        if not r.reused:
            repo.set_tag("groups", r.plan.name, r.plan.tag, r.index_digest)
    repo.set_tag("envs", name, tag, digest)
    log.info("published environment %s:%s -> %s", name, tag, short(digest))
    return digest
