"""Composition (SPEC.md 7): OCI union semantics over group indexes, with exact expectations.

Each case declares groups lowest first as {path: kind} ('dir', 'file', 'wh' whiteout, 'opq'
opaque dir, 'imp' implied dir, 'impopq' both) and the composed tree as {path: (group shown, type)}.
"""

from __future__ import annotations

import stat

import pytest
from format_support import exercise_composed

from weenvfs.format.compose import ComposedTree
from weenvfs.format.index import GroupIndex
from weenvfs.format.index_writer import Node, encode_index

Group = dict[str, str]
View = dict[str, tuple[int, str]]
OPAQUE, IMPLIED = ("opq", "impopq"), ("imp", "impopq")


def build(spec: Group, position: int) -> GroupIndex:
    """One group from {path: kind}; parents are created as plain dirs when not declared."""
    root = Node(stat.S_IFDIR | 0o755, mtime_ns=position)
    nodes = {"": root}
    for path in sorted(spec, key=lambda p: p.split("/")):
        parent = ""
        for part in path.split("/")[:-1]:
            here = f"{parent}/{part}" if parent else part
            if here not in nodes:
                nodes[here] = nodes[parent].children[part.encode()] = Node(stat.S_IFDIR | 0o755)
            parent = here
        kind = spec[path]
        if kind == "wh":
            node = Node(stat.S_IFCHR, whiteout=True)
        elif kind == "file":
            node = Node(stat.S_IFREG | 0o644, mtime_ns=position)
        else:
            node = nodes.get(path) or Node(stat.S_IFDIR | 0o755)
            node.opaque, node.implied = kind in OPAQUE, kind in IMPLIED
            node.mtime_ns = position
        if path == "":
            node.implied, node.opaque = kind in IMPLIED, kind in OPAQUE
            continue
        nodes[path] = nodes[parent].children[path.rsplit("/", 1)[-1].encode()] = node
    return GroupIndex(encode_index(root, 4096))


def compose(*groups: Group) -> ComposedTree:
    return ComposedTree([build(g, i) for i, g in enumerate(groups)])


def view(tree: ComposedTree) -> View:
    out = {}
    for path, entry in tree.walk():
        rec = tree.groups[entry.group].inode(entry.inode)
        out[path.decode()] = (entry.group, "dir" if rec.is_dir else "file")
    assert exercise_composed(tree) == len(out)
    return out


CASES: dict[str, tuple[list[Group], View]] = {
    "upper file hides lower file": (
        [{"a": "file"}, {"a": "file"}],
        {"": (1, "dir"), "a": (1, "file")},
    ),
    "whiteout hides the name and is invisible": (
        [{"a": "file", "b": "file"}, {"a": "wh", "c": "wh"}],
        {"": (1, "dir"), "b": (0, "file")},
    ),
    "whiteout in the lowest group is invisible": (
        [{"a": "wh", "b": "file"}],
        {"": (0, "dir"), "b": (0, "file")},
    ),
    "whiteout of a directory hides its subtree": (
        [{"d/x": "file", "d/e/y": "file"}, {"d": "wh"}],
        {"": (1, "dir")},
    ),
    "re-added above its whiteout": (
        [{"d/x": "file"}, {"d": "wh"}, {"d/y": "file"}],
        {"": (2, "dir"), "d": (2, "dir"), "d/y": (2, "file")},
    ),
    "directories merge, topmost attributes": (
        [{"d/x": "file", "d/s/z": "file"}, {"d/y": "file"}],
        {
            "": (1, "dir"),
            "d": (1, "dir"),
            "d/s": (0, "dir"),
            "d/s/z": (0, "file"),
            "d/x": (0, "file"),
            "d/y": (1, "file"),
        },
    ),
    "opaque hides lower children only": (
        [{"d/x": "file", "d/s/z": "file", "e": "file"}, {"d": "opq", "d/y": "file"}],
        {"": (1, "dir"), "d": (1, "dir"), "d/y": (1, "file"), "e": (0, "file")},
    ),
    "opaque does not hide its own group or upper groups": (
        [{"d/x": "file"}, {"d": "opq", "d/y": "file"}, {"d/z": "file"}],
        {"": (2, "dir"), "d": (2, "dir"), "d/y": (1, "file"), "d/z": (2, "file")},
    ),
    "opaque in the lowest group changes nothing": (
        [{"d": "opq", "d/x": "file"}],
        {"": (0, "dir"), "d": (0, "dir"), "d/x": (0, "file")},
    ),
    "opaque root hides every lower group": (
        [{"a": "file"}, {"": "opq", "b": "file"}],
        {"": (1, "dir"), "b": (1, "file")},
    ),
    "file over directory": (
        [{"d/x": "file"}, {"d": "file"}],
        {"": (1, "dir"), "d": (1, "file")},
    ),
    "directory over file": (
        [{"d": "file"}, {"d/y": "file"}],
        {"": (1, "dir"), "d": (1, "dir"), "d/y": (1, "file")},
    ),
    "a file between two directories cuts the lower one": (
        [{"d/x": "file"}, {"d": "file"}, {"d/y": "file"}],
        {"": (2, "dir"), "d": (2, "dir"), "d/y": (2, "file")},
    ),
    "a whiteout between two directories cuts the lower one": (
        [{"d/x": "file"}, {"d": "wh"}, {"d/y": "file"}],
        {"": (2, "dir"), "d": (2, "dir"), "d/y": (2, "file")},
    ),
    "whiteout inside an opaque directory": (
        [{"d/x": "file"}, {"d": "opq", "d/x": "wh", "d/y": "file"}],
        {"": (1, "dir"), "d": (1, "dir"), "d/y": (1, "file")},
    ),
    "implied directory shows a lower directory's attributes": (
        [{"d/x": "file"}, {"d": "dir", "d/y": "file"}, {"": "imp", "d": "imp", "d/z": "file"}],
        {
            "": (1, "dir"),
            "d": (1, "dir"),
            "d/x": (0, "file"),
            "d/y": (1, "file"),
            "d/z": (2, "file"),
        },
    ),
    "implied and opaque: the lower directory's attributes, only its own entries": (
        [{"d/x": "file"}, {"d": "impopq", "d/y": "file"}],
        {"": (1, "dir"), "d": (0, "dir"), "d/y": (1, "file")},
    ),
    "implied and opaque twice: the first declared directory below both": (
        [{"d/x": "file"}, {"d": "impopq", "d/z": "file"}, {"d": "impopq", "d/y": "file"}],
        {"": (2, "dir"), "d": (0, "dir"), "d/y": (2, "file")},
    ),
    "implied and opaque over a whiteout: nothing below to show": (
        [{"d/x": "file"}, {"d": "wh"}, {"d": "impopq", "d/y": "file"}],
        {"": (2, "dir"), "d": (2, "dir"), "d/y": (2, "file")},
    ),
    "implied and opaque over a file: nothing below to show": (
        [{"d": "file"}, {"d": "impopq", "d/y": "file"}],
        {"": (1, "dir"), "d": (1, "dir"), "d/y": (1, "file")},
    ),
    "implied and opaque root: the lower root's attributes": (
        [{"a": "file"}, {"": "impopq", "b": "file"}],
        {"": (0, "dir"), "b": (1, "file")},
    ),
    "all implied: the lowest layer": (
        [{"": "imp", "d": "imp", "d/x": "file"}, {"": "imp", "d": "imp", "d/y": "file"}],
        {"": (0, "dir"), "d": (0, "dir"), "d/x": (0, "file"), "d/y": (1, "file")},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_composition(name: str) -> None:
    groups, expected = CASES[name]
    assert view(compose(*groups)) == expected


def test_lookup_and_resolve() -> None:
    tree = compose({"d/x": "file", "f": "file"}, {"d/x": "wh", b"\xff".decode("latin-1"): "file"})
    assert tree.resolve(b"d/x") is None
    assert tree.resolve(b"f/x") is None  # through a file
    assert tree.resolve(b"nope") is None
    assert tree.resolve(b"") == tree.root and tree.resolve(b"./d/") == tree.resolve(b"d")
    d = tree.resolve(b"d")
    assert d is not None and d.is_dir and tree.names(d) == []
    assert tree.lookup(tree.root, b"f") == tree.resolve(b"f")
    assert tree.names(tree.root) == sorted(tree.names(tree.root))


def test_hardlinks_compose_per_name() -> None:
    lower = Node(stat.S_IFDIR | 0o755)
    shared = Node(stat.S_IFREG | 0o644)
    lower.children[b"a"] = lower.children[b"b"] = shared
    upper = Node(stat.S_IFDIR | 0o755)
    upper.children[b"a"] = Node(stat.S_IFCHR, whiteout=True)
    tree = ComposedTree([GroupIndex(encode_index(t, 4096)) for t in (lower, upper)])
    assert [(p, e.group) for p, e in tree.walk()] == [(b"", 1), (b"b", 0)]


def test_an_opaque_cut_keeps_the_attributes_of_the_directory_below() -> None:
    tree = compose({"d/x": "file"}, {"d": "impopq", "d/y": "file"})
    d = tree.resolve(b"d")
    assert d is not None and (d.group, [g for g, _ in d.layers]) == (0, [1])
    assert tree.names(d) == [b"y"]


def test_link_count_is_the_number_of_visible_names() -> None:
    lower = Node(stat.S_IFDIR | 0o755)
    shared, other = Node(stat.S_IFREG | 0o644), Node(stat.S_IFREG | 0o644)
    sub = lower.children[b"d"] = Node(stat.S_IFDIR | 0o755)
    lower.children[b"a"] = lower.children[b"b"] = sub.children[b"c"] = shared
    lower.children[b"o"] = sub.children[b"p"] = other
    upper = Node(stat.S_IFDIR | 0o755)
    upper.children[b"a"] = Node(stat.S_IFCHR, whiteout=True)  # hides one name of three
    upper.children[b"d"] = Node(stat.S_IFREG | 0o644)  # a file over d hides d/c and d/p
    top = Node(stat.S_IFDIR | 0o755)
    top.children[b"t"] = top.children[b"u"] = Node(stat.S_IFREG | 0o644)
    tree = ComposedTree([GroupIndex(encode_index(t, 4096)) for t in (lower, upper, top)])
    b, o, t = (tree.resolve(n) for n in (b"b", b"o", b"t"))
    assert b is not None and o is not None and t is not None
    assert tree.groups[0].inode(b.inode).nlink == 3
    assert (tree.link_count(b), tree.visible_paths(b)) == (1, [b"b"])
    assert tree.link_count(o) == 1  # its only other name is under a hidden directory
    assert tree.link_count(t) == 2  # the topmost group's names are all visible


def test_layers_of_a_looked_up_directory() -> None:
    tree = compose({"a/x": "file", "b/y": "file"}, {"a/z": "file"})
    a = tree.lookup(tree.root, b"a")
    assert a is not None and [g for g, _ in a.layers] == [1, 0]
    assert tree.lookup(a, b"x") is not None and tree.lookup(a, b"y") is None
