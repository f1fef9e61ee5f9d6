"""`weenv export`: the composed tree, exactly, compared with an independent OCI applier.

Needs root (owners, device nodes, trusted.* xattrs): without it these fail, never skip.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from fixtures import (
    BAD_NAME,
    assert_one_line_error,
    base_specs,
    mid_specs,
    object_path,
    publish_env,
    run_cli,
    socket,
    standard_env,
    top_specs,
)
from support import layers, oci_apply, trees
from support.trees import chardev, dir, fifo, file, symlink, with_parents  # noqa: A004

from weenvfs.store.local import LocalStore
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group
from weenvfs.tools.publish import compose_env
from weenvfs.tools.source_dir import DirSource
from weenvfs.tools.source_tar import TarSource


def test_running_as_root() -> None:
    assert os.geteuid() == 0, "export tests create devices and foreign owners: run as root"


def _export(store: LocalStore, capsys: Any, ref: str, dest: Path, *extra: str) -> int:
    code, out, err = run_cli(["export", ref, str(dest), "--store", str(store.root), *extra], capsys)
    assert code == 0, err
    assert out.startswith(f"exported {ref} to {dest}")
    return code


def _oracle(tmp_path: Path, *layer_specs: list[Any]) -> Path:
    """The tree Docker would produce from the same layers (tests/support/oci_apply.py)."""
    tars = [layers.layer(*with_parents(specs)) for specs in layer_specs]
    return oci_apply.apply_layers(tmp_path / "expected", tars)


def test_composed_export_equals_oci_applier(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any
) -> None:
    standard_env(repo)
    dest = tmp_path / "out"
    _export(store, capsys, "py-env", dest)
    expected = _oracle(tmp_path, base_specs(), mid_specs(), top_specs())
    trees.assert_trees_equal(expected, dest)
    snap = trees.snapshot(dest)
    assert b"etc/passwd" not in snap and b"dev" not in snap and b"usr/lib/old.so" not in snap
    assert snap[b"names/" + BAD_NAME].type == "reg"
    assert snap[b"bin/tool"].links == (b"bin/tool", b"bin/tool-link")
    assert snap[b"bin/tool"].mode == 0o4755
    assert snap[b"app"].uid == 1000
    assert not any(name.startswith(b".wh.") for path in snap for name in path.split(b"/"))


def test_holes_stay_holes(repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any) -> None:
    standard_env(repo)
    _export(store, capsys, "py-env", tmp_path / "out")
    st = os.stat(tmp_path / "out" / "sparse.img")
    # 5 chunks of 64 KiB of which 3 are zero chunks: at most the 2 data chunks are allocated.
    assert st.st_size == 5 * 65536 and st.st_blocks * 512 <= 2 * 65536


def test_export_tells_its_progress_the_bytes_it_writes(
    repo: Repository, store: LocalStore, tmp_path: Path
) -> None:
    from weenvfs.tools.export import export_tree
    from weenvfs.tools.reader import ChunkReader, load_env

    standard_env(repo)
    told: list[int] = []
    stats = export_tree(load_env(repo, "py-env").tree(), ChunkReader(store), tmp_path / "out",
                        progress=told.append)
    assert sum(told) == stats.bytes_written > 0 and len(told) > 1


def test_built_hostile_tree_round_trips(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any
) -> None:
    source = trees.hostile_tree(tmp_path / "hostile")
    build_group(DirSource(source), repo, "hostile", "latest")
    compose_env(repo, "hostile-env", "latest", ["hostile"])
    dest = tmp_path / "out"
    _export(store, capsys, "hostile-env", dest)
    trees.assert_trees_equal(source, dest)
    snap = trees.snapshot(dest)
    assert snap[b"xattr/cap"].xattrs == {b"security.capability": trees.CAP_NET_BIND_SERVICE}
    assert snap[b"bin/sgid"].mode == 0o2755 and snap[b"tmp"].mode == 0o1777
    big = os.stat(dest / "sparse.img")
    assert big.st_size == 10 << 20 and big.st_blocks * 512 <= 4 << 20


def test_built_layers_export_like_docker(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any
) -> None:
    specs = [base_specs(), mid_specs(), top_specs()]
    names = []
    for n, group in enumerate(specs):
        tar = tmp_path / f"layer{n}.tar"
        tar.write_bytes(layers.layer(*with_parents(group)))
        build_group(TarSource(tar), repo, f"layer{n}", "latest")
        names.append(f"layer{n}")
    compose_env(repo, "layered", "latest", names)
    _export(store, capsys, "layered", tmp_path / "out")
    trees.assert_trees_equal(_oracle(tmp_path, *specs), tmp_path / "out")


def test_special_files(repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    publish_env(
        repo,
        "special",
        [
            (
                "g",
                [
                    socket("run/sock", 0o755, uid=7),
                    fifo("run/fifo", mode=0o620),
                    chardev("run/tty", 4, 64, mode=0o620, gid=5),
                    symlink("escape", str(outside)),
                    file("zz-after-escape", b"inside"),
                    dir("ro", mode=0o555),
                    file("ro/file", b"in a read-only dir", mode=0o400),
                ],
            )
        ],
    )
    dest = tmp_path / "out"
    _export(store, capsys, "special", dest)
    sock = os.lstat(dest / "run" / "sock")
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o755
    assert sock.st_uid == 7
    tty = os.lstat(dest / "run" / "tty")
    assert stat.S_ISCHR(tty.st_mode) and tty.st_rdev == os.makedev(4, 64) and tty.st_gid == 5
    assert stat.S_ISFIFO(os.lstat(dest / "run" / "fifo").st_mode)
    assert os.readlink(dest / "escape") == str(outside)
    assert list(outside.iterdir()) == []
    assert stat.S_IMODE(os.lstat(dest / "ro").st_mode) == 0o555
    assert (dest / "ro" / "file").read_bytes() == b"in a read-only dir"


def test_group_export(repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any) -> None:
    standard_env(repo)
    dest = tmp_path / "out"
    _export(store, capsys, "mid", dest, "--group")
    snap = trees.snapshot(dest)
    assert set(snap) == {b".", b"etc", b"etc/motd", b"usr", b"usr/lib", b"usr/lib/new.so"}


def test_destination_must_be_empty(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any
) -> None:
    standard_env(repo)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_bytes(b"x")
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    for dest, fragment in ((full, "is not empty"), (link, "symlink"), (plain, "not a directory")):
        argv = ["export", "py-env", str(dest), "--store", str(store.root)]
        code, _, err = run_cli(argv, capsys)
        assert fragment in assert_one_line_error(code, err)
    assert list(target.iterdir()) == [] and list(full.iterdir()) == [full / "keep"]


def test_missing_blob_names_the_file(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any
) -> None:
    standard_env(repo)
    (blob,) = repo.get_index(repo.get_tag("groups", "top", "latest")).blob_digests()
    object_path(store, "blobs", blob).unlink()
    argv = ["export", "py-env", str(tmp_path / "out"), "--store", str(store.root)]
    code, _, err = run_cli(argv, capsys)
    line = assert_one_line_error(code, err)
    assert "cannot read /app/main.py" in line and "is missing" in line


def test_reader_coalesces_and_shares_batch_chunks(repo: Repository, store: LocalStore) -> None:
    from weenvfs.store.faulty import FaultyStore
    from weenvfs.tools.reader import ChunkReader

    standard_env(repo)
    index = repo.get_index(repo.get_tag("groups", "base", "latest"))
    counting = FaultyStore(store)
    reader = ChunkReader(counting)
    contents = {s.path: s.content() for s in base_specs() if s.kind in ("reg", "sparse")}
    for path, data in contents.items():
        ino = index.resolve(path)
        assert ino is not None
        assert reader.read_file(index, ino) == data
    # bin/tool's 4 frames are adjacent (one read), sparse.img's 2 data frames follow them
    # (one read), and the 4 small files share one batch chunk (one read, then cached).
    assert counting.calls["get_range"] == 3
    small = ChunkReader(FaultyStore(store), max_request=1)
    ino = index.resolve(b"bin/tool")
    assert ino is not None
    assert small.read_file(index, ino) == contents[b"bin/tool"]
    assert small.requests == 4


def test_reader_streams_holes_without_fetching(repo: Repository, store: LocalStore) -> None:
    from weenvfs.tools.reader import ChunkReader

    standard_env(repo)
    index = repo.get_index(repo.get_tag("groups", "base", "latest"))
    ino = index.resolve(b"sparse.img")
    assert ino is not None
    pieces = list(ChunkReader(store).iter_pieces(index, ino))
    assert [p.data is None for p in pieces] == [False, True, True, False, True]
    assert [p.offset for p in pieces] == [k * 65536 for k in range(5)]


def _half_exportable(
    repo: Repository, store: LocalStore, tmp_path: Path
) -> tuple[Path, bytes]:
    """Environment "half": a lower group that exports (a finished read-only dir, a symlink
    out of the tree, a fifo, an odd name) below a group whose blob is gone, so that an export
    fails after writing the lower group's entries. Returns the blob's path and bytes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"not the export's")
    publish_env(repo, "half", [
        ("low", [dir("a", mode=0o555), file("a/f", b"in a read-only dir", mode=0o400),
                 symlink("escape", str(outside)), fifo("fifo"), file(BAD_NAME.decode(
                     "utf-8", "surrogateescape"), b"odd")]),
        ("high", [file("z/big", os.urandom(300_000))]),
    ])
    (blob,) = repo.get_index(repo.get_tag("groups", "high", "latest")).blob_digests()
    path = object_path(store, "blobs", blob)
    data = path.read_bytes()
    path.unlink()
    return path, data


def _failed_export(store: LocalStore, capsys: Any, dest: Path) -> str:
    code, _, err = run_cli(["export", "half", str(dest), "--store", str(store.root)], capsys)
    return assert_one_line_error(code, err)


def test_failed_export_removes_what_it_created(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any
) -> None:
    """A destination (and parents) the export created are gone after a failure, so a retry
    is not refused as "not empty"; what was there before stays."""
    blob, data = _half_exportable(repo, store, tmp_path)
    (tmp_path / "before").write_bytes(b"x")
    dest = tmp_path / "new" / "parent" / "out"
    assert "cannot read /z/big" in _failed_export(store, capsys, dest)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before", "outside", "store"]
    assert list((tmp_path / "outside").iterdir()) == [tmp_path / "outside" / "keep"]
    blob.write_bytes(data)
    _export(store, capsys, "half", dest)
    assert (dest / "z" / "big").stat().st_size == 300_000


def test_failed_export_empties_a_destination_that_was_empty(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any
) -> None:
    _half_exportable(repo, store, tmp_path)
    dest = tmp_path / "out"
    dest.mkdir(mode=0o751)
    os.chown(dest, 12, 34)
    assert "cannot read /z/big" in _failed_export(store, capsys, dest)
    st = os.lstat(dest)
    assert list(dest.iterdir()) == []
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o751, 12, 34)
    assert (tmp_path / "outside" / "keep").exists()


def test_interrupted_export_removes_what_it_wrote(
    repo: Repository, store: LocalStore, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    from weenvfs.tools.reader import ChunkReader

    standard_env(repo)
    calls = []

    real = ChunkReader.iter_pieces

    def interrupt(self: ChunkReader, *args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 3:  # some files and directories are written by now
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChunkReader, "iter_pieces", interrupt)
    dest = tmp_path / "out"
    code, _, err = run_cli(["export", "py-env", str(dest), "--store", str(store.root)], capsys)
    assert code == 130 and "interrupted" in err and len(calls) == 3
    assert not dest.exists()
