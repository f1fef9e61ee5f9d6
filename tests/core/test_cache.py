"""core/cache.py on a real directory: atomic writes under kill -9, damaged files never served,
eviction under a bound with pins, cross-process locks, cleaning, and `weenv cache`.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from weenvfs.cli import main
from weenvfs.core import cache_bound
from weenvfs.core.cache import (
    CHEAP,
    HASHES,
    LOG_FOLDER,
    LOG_KEEP,
    MISSING,
    TRUST_XATTR,
    ChunkCache,
    current_boot_id,
    default_cache_dir,
)
from weenvfs.core.cache_bound import NODE_FOLDERS
from weenvfs.core.fetcher import Fetcher
from weenvfs.core.node_files import touch, write_atomically
from weenvfs.format.digest import digest_bytes
from weenvfs.store.faulty import FaultyStore

CHUNK = 4096


def _insert(cache: ChunkCache, plain: bytes) -> bytes:
    digest = digest_bytes(plain)
    cache.insert(digest, plain)
    return digest


def test_insert_then_open_reads_back(chunk_cache: ChunkCache, pattern) -> None:
    plain = pattern(1, 3 * CHUNK + 5)
    digest = _insert(chunk_cache, plain)
    path = chunk_cache.path(digest)
    assert path == chunk_cache.root / digest.hex()[:2] / digest.hex()
    assert path.read_bytes() == plain
    with chunk_cache.open(digest, len(plain)) as handle:
        assert handle.read() == plain
        assert handle.read(10, 20) == plain[10:20]
        assert handle.read(len(plain) - 3, len(plain) + 100) == plain[-3:]
    assert chunk_cache.open(digest_bytes(b"absent"), 6) is None
    usage = chunk_cache.usage()
    assert (usage.chunks, usage.bytes, usage.temp_files, usage.lock_files) == (1, len(plain), 0, 0)


def test_opening_a_complete_cache_makes_no_folder_and_a_missing_one_comes_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern) -> None:
    """Every mount daemon opens the node cache: a complete one is taken after one listing
    (no mkdir); one that lost a folder (or its CACHEDIR.TAG) is made whole again."""
    root = tmp_path / "cache"
    plain = pattern(1, 5000)
    digest = _insert(ChunkCache(root), plain)
    made: list[str] = []
    real_makedirs = os.makedirs
    monkeypatch.setattr(os, "makedirs", lambda path, *a, **k: (made.append(str(path)),
                                                               real_makedirs(path, *a, **k)))
    with ChunkCache(root).open(digest, len(plain)) as f:
        assert f.read() == plain
    assert made == []
    (root / "locks").rmdir()
    (root / "CACHEDIR.TAG").unlink()
    ChunkCache(root)
    assert (root / "locks").is_dir() and (root / "CACHEDIR.TAG").is_file() and made


def test_a_chunk_subfolder_is_made_with_its_first_chunk(tmp_path: Path, pattern) -> None:
    """A new cache makes 3 entries, not 259 (a new node's first mount waited for them);
    each of the 256 subfolders comes with its first chunk, also after being removed."""
    root = tmp_path / "cache"
    cache = ChunkCache(root)
    assert sorted(p.name for p in root.iterdir()) == ["CACHEDIR.TAG", "locks", "tmp"]
    plain = pattern(2, 3000)
    digest = _insert(cache, plain)
    folder = cache.path(digest).parent
    assert folder.is_dir() and cache.usage().chunks == 1
    cache.path(digest).unlink()
    folder.rmdir()
    assert cache.open(digest, len(plain)) is None and cache.usage().chunks == 0
    _insert(cache, plain)
    with ChunkCache(root).open(digest, len(plain)) as f:
        assert f.read() == plain
    assert not list((root / "tmp").iterdir())


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WEENV_CACHE", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("WEENV_CACHE")
    assert default_cache_dir() == Path("/var/cache/weenv/chunks")


# -- crash safety ---------------------------------------------------------------------------------

WRITER = """
import os, sys, time
import weenvfs.core.cache as cache_mod

def half_then_hang(fd, view):
    os.write(fd, view[: len(view) // 2])
    print("HALF", flush=True)
    time.sleep(600)

cache_mod._write_all = half_then_hang
cache = cache_mod.ChunkCache(sys.argv[1])
plain = open(sys.argv[2], "rb").read()
cache.insert(bytes.fromhex(sys.argv[3]), plain)
"""


def test_kill_9_mid_write_never_leaves_a_chunk(small_group, tmp_path: Path) -> None:
    (loc, *_) = small_group.locs(b"big")
    plain = small_group.files[b"big"][: loc.ulen]
    (tmp_path / "plain").write_bytes(plain)
    (tmp_path / "writer.py").write_text(WRITER)
    root = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "writer.py"), str(root), str(tmp_path / "plain"),
         loc.digest.hex()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "HALF", proc.stderr.read()  # type: ignore[union-attr]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes the pipes
    temps = os.listdir(root / "tmp")
    assert len(temps) == 1 and (root / "tmp" / temps[0]).stat().st_size == loc.ulen // 2
    cache = ChunkCache(root)  # the next user cleans up what the dead writer left
    assert os.listdir(root / "tmp") == []
    assert cache.open(loc.digest, loc.ulen) is None
    store = FaultyStore(small_group.repo.store)
    data = trio.run(Fetcher(store, cache).read, [(loc, 0, loc.ulen)])
    assert data == plain and store.calls["get_range"] == 1


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _garbage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _garbage, _empty], ids=lambda f: f.__name__[1:])
def test_a_damaged_cached_chunk_is_refetched_not_served(
    small_group, tmp_path: Path, assert_logs, damage
) -> None:
    (loc, *_) = small_group.locs(b"big")
    plain = small_group.files[b"big"][: loc.ulen]
    root = tmp_path / "cache"
    ChunkCache(root).insert(loc.digest, plain)
    damage(ChunkCache(root).path(loc.digest))  # as a power loss might leave it
    cache = ChunkCache(root, boot_id=b"after-the-power-loss")  # nothing is trusted yet
    store = FaultyStore(small_group.repo.store)
    with assert_logs(r"cached chunk [0-9a-f]{12} is damaged", count=1):
        data = trio.run(Fetcher(store, cache).read, [(loc, 0, loc.ulen)])
    assert data == plain and store.calls["get_range"] == 1
    assert cache.path(loc.digest).read_bytes() == plain


def test_a_verified_file_replaced_behind_our_back_is_verified_again(
    chunk_cache: ChunkCache, pattern, assert_logs
) -> None:
    plain = pattern(2, CHUNK)
    digest = _insert(chunk_cache, plain)
    chunk_cache.open(digest, CHUNK).close()  # trusted from now on, for this very file
    path = chunk_cache.path(digest)
    bad = path.with_name("bad")
    bad.write_bytes(bytes(CHUNK))
    os.replace(bad, path)  # a new inode
    with assert_logs("is damaged", count=1):
        assert chunk_cache.open(digest, CHUNK) is None
    assert not path.exists()


def test_chunks_verified_in_this_boot_are_trusted_by_later_processes(
    chunk_cache: ChunkCache, pattern
) -> None:
    plain = pattern(3, CHUNK)
    digest = _insert(chunk_cache, plain)
    path = chunk_cache.path(digest)
    boot = os.getxattr(path, TRUST_XATTR)
    assert boot == current_boot_id() != b""
    later = ChunkCache(chunk_cache.root)  # another mount, same boot: no need to hash again
    assert later.open_cost(digest) == CHEAP and not later.is_verified(digest)
    with later.open(digest, CHUNK) as handle:
        assert handle.read() == plain
    after_reboot = ChunkCache(chunk_cache.root, boot_id=b"the-next-boot")
    assert after_reboot.open_cost(digest) == HASHES
    with after_reboot.open(digest, CHUNK) as handle:  # verified, then marked for that boot
        assert handle.read() == plain
    assert os.getxattr(path, TRUST_XATTR) == b"the-next-boot"


def test_open_cost_says_what_open_would_do(chunk_cache: ChunkCache, pattern) -> None:
    plain = pattern(5, CHUNK)
    digest = digest_bytes(plain)
    assert chunk_cache.open_cost(digest) == MISSING
    assert chunk_cache.open(digest, CHUNK) is None
    _insert(chunk_cache, plain)
    assert chunk_cache.open_cost(digest) == CHEAP  # written, so verified, by this process
    path = chunk_cache.path(digest)
    assert ChunkCache(chunk_cache.root).open_cost(digest) == CHEAP  # marked in this boot
    assert ChunkCache(chunk_cache.root, boot_id=b"").open_cost(digest) == HASHES  # no trust
    os.removexattr(path, TRUST_XATTR)
    unmarked = ChunkCache(chunk_cache.root)
    assert unmarked.open_cost(digest) == HASHES
    with unmarked.open(digest, CHUNK) as handle:  # hashed, then marked again
        assert handle.read() == plain
    path.unlink()
    assert ChunkCache(chunk_cache.root).open_cost(digest) == MISSING
    assert ChunkCache(chunk_cache.root, boot_id=b"").open_cost(digest) == MISSING


def test_a_damaged_file_from_an_earlier_boot_is_not_marked(
    chunk_cache: ChunkCache, pattern, assert_logs
) -> None:
    digest = _insert(chunk_cache, pattern(4, CHUNK))
    path = chunk_cache.path(digest)
    data = bytearray(path.read_bytes())
    data[7] ^= 1
    path.write_bytes(bytes(data))  # same inode, still marked with the boot that wrote it
    after_reboot = ChunkCache(chunk_cache.root, boot_id=b"the-next-boot")
    with assert_logs("is damaged", count=1):
        assert after_reboot.open(digest, CHUNK) is None
    assert not path.exists()


# -- eviction --------------------------------------------------------------------------------------


def _age(cache: ChunkCache, digest: bytes, seconds_ago: float) -> None:
    when = time.time() - seconds_ago
    os.utime(cache.path(digest), (when, when))


def test_eviction_keeps_the_bound_and_spares_pinned_chunks(tmp_path: Path, pattern) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=10 * CHUNK, touch_interval=1e9)
    plains = [pattern(100 + i, CHUNK) for i in range(30)]
    pinned_plain = plains[0]
    digests = []
    pin = None
    for i, plain in enumerate(plains):
        digests.append(_insert(cache, plain))
        _age(cache, digests[-1], 1000 - i)  # insertion order = LRU order
        if i == 0:
            pin = cache.open(digests[0], CHUNK)  # the oldest chunk, in use by a read
        if cache.needs_maintenance():
            cache.maintain()
        assert cache.usage().bytes <= 10 * CHUNK
    assert pin is not None
    try:
        assert cache.path(digests[0]).exists()  # pinned in this process: never evicted
        assert not cache.path(digests[1]).exists()  # the next oldest went first
        assert cache.path(digests[-1]).exists()
        # Another process (another instance) evicts everything: the pin still reads.
        assert ChunkCache(tmp_path / "cache").prune(everything=True).chunks_left == 0
        assert not cache.path(digests[0]).exists()
        assert pin.read() == pinned_plain
    finally:
        pin.close()


def _counting_scans(cache: ChunkCache) -> list[int]:
    """Count the scans of the chunk folders `cache` makes from now on."""
    scans: list[int] = []
    scan = cache._scan_chunks

    def counted():  # type: ignore[no-untyped-def]
        scans.append(1)
        return scan()

    cache._scan_chunks = counted  # type: ignore[method-assign]
    return scans


def test_a_new_process_takes_a_fresh_usage_ledger_instead_of_scanning(tmp_path: Path,
                                                                       pattern) -> None:
    """Every mount daemon starts with no size estimate; a scan costs ~9 us per cached chunk,
    so 32 daemons starting at once each scanned the whole cache. The last scan's total, left
    in the ledger, serves a process that starts within LEDGER_SECONDS."""
    root = tmp_path / "cache"
    first = ChunkCache(root, max_bytes=100 * CHUNK)
    for i in range(5):
        _insert(first, pattern(400 + i, CHUNK))
    first.maintain()  # its first maintenance: a scan, left in the ledger
    ledger = root / cache_bound.LEDGER
    assert ledger.read_text() == f"{5 * CHUNK}\n"
    _insert(first, pattern(409, CHUNK))  # one more, since: the next process counts it anew

    second = ChunkCache(root, max_bytes=100 * CHUNK)
    scans = _counting_scans(second)
    assert second.needs_maintenance()  # no estimate yet
    assert second.maintain() is None
    assert scans == [] and not second.needs_maintenance()
    assert second._estimate == 5 * CHUNK  # the ledger's, not a scan's 6 chunks

    # An old ledger, one from the future, or one that is no byte count: a scan instead, whose
    # total is the new ledger.
    for text, age in (("5\n", cache_bound.LEDGER_SECONDS + 5), ("5\n", -60), ("five\n", 0),
                      ("-5\n", 0), ("", 0)):
        ledger.write_text(text)
        os.utime(ledger, (time.time() - age,) * 2)
        third = ChunkCache(root, max_bytes=100 * CHUNK)
        scans = _counting_scans(third)
        third.maintain()
        assert scans == [1] and third._estimate == 6 * CHUNK, (text, age)
        assert ledger.read_text() == f"{6 * CHUNK}\n"


def test_a_process_that_waited_for_another_scan_takes_its_ledger(tmp_path: Path,
                                                                 pattern) -> None:
    """32 daemons starting together found no fresh ledger and all scanned at once; scans take
    turns, and one that waited takes what the scan before it left."""
    root = tmp_path / "cache"
    first = ChunkCache(root, max_bytes=100 * CHUNK)
    for i in range(3):
        _insert(first, pattern(440 + i, CHUNK))
    assert not (root / cache_bound.LEDGER).exists()
    scanning = os.open(root / "scan.lock", os.O_RDWR | os.O_CREAT)  # another process scans
    fcntl.flock(scanning, fcntl.LOCK_EX)
    second = ChunkCache(root, max_bytes=100 * CHUNK)
    scans = _counting_scans(second)
    waiter = threading.Thread(target=second.maintain)
    waiter.start()
    try:
        waiter.join(0.3)
        assert waiter.is_alive()  # waiting for the scan in progress
        (root / cache_bound.LEDGER).write_text(f"{7 * CHUNK}\n")  # what that scan counted
    finally:
        os.close(scanning)
        waiter.join(30)
    assert not waiter.is_alive()
    assert scans == [] and second._estimate == 7 * CHUNK


def test_a_ledger_over_the_bound_evicts_and_records_what_is_left(tmp_path: Path,
                                                                 pattern) -> None:
    root = tmp_path / "cache"
    first = ChunkCache(root, max_bytes=100 * CHUNK, touch_interval=1e9)
    for i in range(8):
        _age(first, _insert(first, pattern(420 + i, CHUNK)), 100 - i)
    first.maintain()
    small = ChunkCache(root, max_bytes=4 * CHUNK)  # a process with a smaller bound
    result = small.maintain()
    assert result is not None and result.bytes_left <= 4 * CHUNK
    assert (root / cache_bound.LEDGER).read_text() == f"{result.bytes_left}\n"
    assert small.usage().total_bytes == result.bytes_left


def test_open_refreshes_the_lru_time(tmp_path: Path, pattern) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=2 * CHUNK, touch_interval=0)
    a, b, c = (_insert(cache, pattern(200 + i, CHUNK)) for i in range(3))
    _age(cache, a, 300)
    _age(cache, b, 200)
    _age(cache, c, 100)
    cache.open(a, CHUNK).close()  # a is now the most recently used
    cache.evict(2 * CHUNK)
    assert [cache.contains(d) for d in (a, b, c)] == [True, False, True]


def test_node_files_count_against_the_bound_and_go_in_lru_order(tmp_path: Path,
                                                                 pattern) -> None:
    """Indexes, images and layouts mounts keep beside the chunks are evicted with them, least
    recently used first; `touch` (what their users call) keeps a used one."""
    root = tmp_path / "cache"
    cache = ChunkCache(root, max_bytes=4 * CHUNK, touch_interval=1e9)
    chunk = _insert(cache, pattern(300, CHUNK))
    _age(cache, chunk, 500)
    index = root / NODE_FOLDERS[0] / ("ab" * 32)
    image = root / NODE_FOLDERS[1] / "stack.img"
    for n, path in enumerate((index, image)):
        write_atomically(path, pattern(310 + n, CHUNK))
        os.utime(path, (time.time() - 1000, time.time() - 1000))  # older than the chunk
    touch(image)  # the image was used just now: the index is the least recently used
    usage = cache.usage()
    assert (usage.node_files, usage.node_bytes, usage.total_bytes) == (2, 2 * CHUNK, 3 * CHUNK)
    result = cache.evict(2 * CHUNK)
    assert result is not None and result.removed_node_files == 1
    assert not index.exists() and image.exists() and cache.contains(chunk)
    assert cache.prune(everything=True).bytes_left == 0
    assert not image.exists() and not cache.contains(chunk)


def test_clean_removes_week_old_mount_logs(tmp_path: Path) -> None:
    logs = tmp_path / "cache" / LOG_FOLDER
    logs.mkdir(parents=True)
    (logs / "old.log").write_text("x")
    (logs / "new.log").write_text("x")
    os.utime(logs / "old.log", (time.time() - LOG_KEEP - 60,) * 2)
    ChunkCache(tmp_path / "cache")  # a mount's cache cleans as it opens
    assert sorted(p.name for p in logs.iterdir()) == ["new.log"]


# -- locks and cleaning ----------------------------------------------------------------------------


def test_chunk_locks_exclude_each_other_and_leave_no_file(chunk_cache, tmp_path: Path) -> None:
    other = ChunkCache(chunk_cache.root)  # an open file description of its own, like a process
    digest = digest_bytes(b"x")
    lock = chunk_cache.try_lock(digest)
    assert lock is not None
    assert other.try_lock(digest) is None
    lock.release()
    assert os.listdir(chunk_cache.root / "locks") == []
    second = other.try_lock(digest)
    assert second is not None
    second.release()


def test_an_abandoned_lock_wait_releases_the_lock_it_gets_later(chunk_cache) -> None:
    digest = digest_bytes(b"y")
    holder = ChunkCache(chunk_cache.root).lock(digest)

    async def main() -> None:
        with trio.move_on_after(0.05) as scope:
            await chunk_cache.lock_async(digest)
        assert scope.cancelled_caught
        holder.release()  # the abandoned thread now gets the lock and must let go of it
        with trio.fail_after(20):
            while (lock := chunk_cache.try_lock(digest)) is None:
                await trio.sleep(0.005)
        lock.release()

    trio.run(main)


def test_clean_removes_only_unlocked_leftovers(chunk_cache: ChunkCache) -> None:
    root = chunk_cache.root
    (root / "tmp" / "dead").write_bytes(b"partial")
    (root / "locks" / "stale").write_bytes(b"")
    live = os.open(root / "tmp" / "live", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(live, fcntl.LOCK_EX)
        assert chunk_cache.clean() == 2
        assert os.listdir(root / "tmp") == ["live"]
        assert os.listdir(root / "locks") == []
    finally:
        os.close(live)


# -- weenv cache -----------------------------------------------------------------------------------


def _fill(root: Path, pattern, n: int) -> None:
    cache = ChunkCache(root)
    for i in range(n):
        digest = _insert(cache, pattern(300 + i, CHUNK))
        _age(cache, digest, 100 - i)


def test_cache_stats_and_prune_commands(tmp_path: Path, pattern, capsys) -> None:
    root = tmp_path / "cache"
    _fill(root, pattern, 5)
    assert main(["cache", "stats", "--json", "--cache", str(root)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["chunks"], stats["bytes"], stats["path"]) == (5, 5 * CHUNK, str(root))
    assert main(["cache", "stats", "--cache", str(root)]) == 0
    assert "20 KiB (20480 bytes)" in capsys.readouterr().out
    assert main(["cache", "prune", "--max-size", "8K", "--cache", str(root)]) == 0
    assert "removed 3 chunk(s)" in capsys.readouterr().out
    assert ChunkCache(root).usage().chunks == 2
    assert main(["cache", "prune", "--all", "--cache", str(root)]) == 0
    assert ChunkCache(root).usage().chunks == 0


def test_cache_commands_use_weenv_cache_and_fail_in_one_line(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("WEENV_CACHE", str(tmp_path / "nowhere"))
    assert main(["cache", "stats"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"weenv: error: no chunk cache at {tmp_path / 'nowhere'}"
    assert not (tmp_path / "nowhere").exists()
