"""Bad and hostile WeEnv layers under real containerd 1.6 (the `node` fixture): a group whose
index is missing from the store or corrupt, annotations with path traversal in their digests,
store URLs naming other hosts or paths. Each fails the pull (or the Prepare containerd passes
on, as Kubernetes' CRI does) with one line saying why, in `weenv pull`'s or `ctr`'s error
output, and leaves no snapshot or mount behind. Every command runs under the fixture's
timeouts: a hang fails the test, no duration is asserted."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from support import pushed, trees
from support.containerd import Node
from support.polling import wait_for

from weenvfs.format.oci_layer import KEY_INDEX, KEY_MANIFEST, KEY_POSITION, KEY_STORE
from weenvfs.format.refs import object_key
from weenvfs.snapshotter.labels import TARGET_LABEL
from weenvfs.snapshotter.pull import Containerd
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group, open_source
from weenvfs.tools.publish import compose_env

pytestmark = pytest.mark.usefixtures("containerd_requirements")


def _error_line(text: str, prefix: str, fragment: str) -> str:
    """The one error line (starting with `prefix`) of a failed command's stderr, which must
    hold `fragment`. (`ctr` also logs containerd's client's own info lines before it.)"""
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, text
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in text
    return lines[0]


def _weenv_error(text: str, fragment: str) -> str:
    assert len(text.strip().splitlines()) == 1, text
    return _error_line(text, "weenv: error: ", fragment)


def _ctr_error(text: str, fragment: str) -> str:
    return _error_line(text, "ctr: ", fragment)


def _nothing_left(node: Node) -> None:
    """No snapshot, mount or snapshot folder of a failed pull stays. (containerd removes
    what a failed pull prepared in its garbage collection, which calls the snapshotter's
    Remove after the metadata is gone: waited for.)"""
    def clean() -> bool:
        return (not node.snapshots() and not node.our_mounts()
                and not list((node.snap_root / "snapshots").iterdir()))

    wait_for(clean, "containerd to remove the failed pull's snapshots")


# -- a group the store cannot serve ---------------------------------------------------------

def _missing(path: Path) -> None:
    path.unlink()


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _broken_env(node: Node, name: str, damage: Callable[[Path], None]) -> str:
    """Publish environment `name` = minbase + a small group of its own, then damage that
    group's index object in the store; its ref in the registry, pushed."""
    tree = trees.make_tree(node.tmp / name, trees.file(f"{name}.txt", name.encode() * 1000))
    with open_store(str(node.store)) as store:
        repo = Repository(store)
        build_group(open_source(tree), repo, name, "t")
        digest = compose_env(repo, name, "v1", ["minbase:t", f"{name}:t"], None, {})
        index = repo.get_manifest(digest).groups[1].index
    node.envs[name] = digest
    ref = node.push(name, "broken")
    damage(node.store / object_key("indexes", index))
    return ref


@pytest.mark.parametrize(("damage", "fragment"), [
    (_missing, "missing"),
    (_corrupt, "corrupt"),
])
@pytest.mark.parametrize("how", ["labels", "markers"])
def test_a_missing_or_corrupt_group_index_fails_the_pull(
        node: Node, how: str, damage: Callable[[Path], None], fragment: str) -> None:
    ref = _broken_env(node, f"broken-{damage.__name__[1:]}-{how}", damage)
    if how == "labels":
        content = node.content()
        done = node.pull(ref, check=False)
        assert done.returncode == 1
        line = _weenv_error(done.stderr, fragment)
        assert line.startswith("weenv: error: containerd prepare"), line
        # Layer 0 was mounted before layer 1 failed: the failed pull's lease went
        # synchronously, and that layer with it, before the command returned: nothing of
        # the image stays.
        assert node.snapshots() == [] and node.our_mounts() == []
        assert list((node.snap_root / "snapshots").iterdir()) == []
        assert node.content() == content and node.leases() == []
    else:
        done = node.ctr("images", "pull", "--plain-http", "--snapshotter", "weenv", ref,
                        check=False)
        assert done.returncode != 0
        line = _ctr_error(done.stderr, fragment)
    assert "WeEnv layer 1 of" in line and "mount failed" in line, line
    node.ctr("images", "rm", "--sync", ref, check=False)
    _nothing_left(node)


def test_an_image_the_registry_lacks_fails_the_pull_with_no_lease_left(node: Node) -> None:
    done = node.pull(f"{node.registry.host}/no-such-image:v1", check=False)
    assert done.returncode == 1
    _weenv_error(done.stderr, "no-such-image")
    assert node.leases() == []


# -- hostile or wrong annotations -------------------------------------------------------

def _valid_ref(node: Node) -> dict[str, str]:
    """The annotations of a good layer: group 0 of environment `one`."""
    [(blob, _)] = pushed.weenv_layers(node.store, "one:v1")
    return dict(blob.annotations)


# case -> (the annotations of a good layer changed, in a store's folder; the refusal's words)
HOSTILE: dict[str, tuple[Callable[[dict[str, str], Path], dict[str, str]], str]] = {
    "manifest-traversal": (lambda a, s: {**a, KEY_MANIFEST: "../../../../etc/passwd"},
                           "expected 64 hex digits"),
    "index-traversal": (lambda a, s: {**a, KEY_INDEX: "../indexes/" + "a" * 53},
                        "expected 64 hex digits"),
    "position": (lambda a, s: {**a, KEY_POSITION: "4096"}, "expected 0-4095"),
    "other-host": (lambda a, s: {**a, KEY_STORE: "http://192.0.2.1:8333/weenv"},
                   "does not serve"),
    "s3-elsewhere": (lambda a, s: {**a, KEY_STORE: "s3://weenv/x?endpoint=http://192.0.2.1"},
                     "does not serve"),
    "path-traversal": (lambda a, s: {**a, KEY_STORE: f"file://{s}/../{s.name}"},
                       "does not serve"),
    "other-path": (lambda a, s: {**a, KEY_STORE: "file:///etc"}, "does not serve"),
    # Well-formed, but naming what the store does not have.
    "unknown-manifest": (lambda a, s: {**a, KEY_MANIFEST: "0" * 64},
                         "no environment manifest 000000000000"),
    "unknown-index": (lambda a, s: {**a, KEY_INDEX: "0" * 64}, "has no group 000000000000"),
}


@pytest.fixture
def lease(node: Node) -> Iterator[Containerd]:
    """containerd's snapshots API for the `weenv` snapshotter, under a lease of the test."""
    containerd = Containerd(node.socket, "default", "weenv", plain_http=True)
    containerd.lease = containerd.ctr("leases", "create").strip()
    try:
        yield containerd
    finally:
        containerd.ctr("leases", "delete", "--sync", containerd.lease)
        containerd.close()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_annotations_are_refused(node: Node, lease: Containerd, case: str) -> None:
    change, fragment = HOSTILE[case]
    annotations = change(_valid_ref(node), node.store)
    # As Kubernetes' CRI passes them: containerd's unpacker prepares the layer with its
    # annotations as labels; the snapshotter's refusal comes back through containerd.
    chain = "sha256:" + uuid.uuid4().hex * 2
    with pytest.raises(grpc.RpcError) as refused:
        lease.call("Prepare", key=f"extract-{case} {chain}", parent="",
                   labels={**annotations, TARGET_LABEL: chain})
    assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.FAILED_PRECONDITION)
    assert fragment in refused.value.details()
    # `weenv pull` refuses the same image (itself, or through the snapshotter's answer).
    layer = pushed.marker_layer(annotations, None)
    ref = pushed.push(pushed.assemble([layer]), f"{node.registry.host}/hostile:{case}")
    done = node.pull(ref, check=False)
    assert done.returncode == 1
    _weenv_error(done.stderr, fragment)
    _nothing_left(node)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_markers_are_refused(node: Node, case: str) -> None:
    change, fragment = HOSTILE[case]
    a = change(_valid_ref(node), node.store)
    marker = {"version": 1, "store": a[KEY_STORE], "manifest": a[KEY_MANIFEST],
              "index": a[KEY_INDEX], "position": int(a[KEY_POSITION])}
    name = f"layer-{marker['position']}.json"
    # No annotations: `ctr images pull` passes none anyway; the marker alone names the group.
    layer = pushed.marker_layer({}, marker, name)
    ref = pushed.push(pushed.assemble([layer]), f"{node.registry.host}/hostile-marker:{case}")
    done = node.ctr("images", "pull", "--plain-http", "--snapshotter", "weenv", ref,
                    check=False)
    assert done.returncode != 0
    _ctr_error(done.stderr, fragment)
    node.ctr("images", "rm", "--sync", ref, check=False)
    _nothing_left(node)


def test_a_marker_that_is_not_json_is_refused(node: Node) -> None:
    layer = pushed.marker_layer({}, b"{not json")
    ref = pushed.push(pushed.assemble([layer]), f"{node.registry.host}/bad-marker:v1")
    done = node.ctr("images", "pull", "--plain-http", "--snapshotter", "weenv", ref,
                    check=False)
    assert done.returncode != 0
    _ctr_error(done.stderr, "WeEnv layer marker: weenv layer marker: not JSON")
    node.ctr("images", "rm", "--sync", ref, check=False)
    _nothing_left(node)
