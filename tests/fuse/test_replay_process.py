"""A mount's hint replay in a process of its own (fuse/replay_process.py, core/warm.py), with
the real CLI, the session's node service and real mounts: the replay runs there and its work
counts for the mount (`weenv stats`: progress, bytes, hits, waste); without a node service
the mount replays itself; unmounting ends a replay even while its store hangs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hint_mounts import WAIT, publish_hint, publish_varied_env, published_hint, wait_for_state
from mounts import Mounter, run_weenv
from support.polling import wait_for
from support.processes import node_processes

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import chunk_loc
from weenvfs.fuse import mountd
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store"))
from fault_proxy import FaultProxy  # noqa: E402 - tests/store is not on the path by itself
from http_server import RangeHTTPServer  # noqa: E402

pytestmark = pytest.mark.requires_fuse

CHUNK = 64 << 10


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A store with environment env:t (64 KiB chunks) and the files' contents."""
    return publish_varied_env(tmp_path)


def warm_processes(digest: str) -> list[int]:
    """Pids of `weenv cache warm DIGEST` processes (the replays of that environment; the
    node service's children show their arguments as one string)."""
    needle = f"cache warm {digest} ".encode()
    return [proc.pid for proc in node_processes() if needle in proc.command]


def env_digest(store: Path | str) -> str:
    with open_store(str(store)) as s:
        return Repository(s).resolve_env("env:t")[0]


def test_the_replay_runs_apart_and_counts_for_the_mount(env, mounter: Mounter) -> None:
    store, contents = env
    paths = ["lib/big1", "etc/s005", "lib/big3"]
    count = publish_hint(store, "env:t", paths)
    mount = mounter.mount("env:t", store)
    stats = wait_for_state(mount, "done")
    hints, fetch = stats["hints"], stats["fetch"]
    assert hints["replayer"] == "separate process"
    assert hints["chunks"] == hints["chunks_done"] == count and hints["chunks_missing"] == 0
    # Nothing has been read: every chunk the mount counts came from the replay, all waste.
    assert fetch["chunks_fetched"] == fetch["prefetch"]["chunks"] == hints["waste"] == count
    assert fetch["bytes_fetched"] > 0 and fetch["requests"] > 0
    for path in paths:
        assert (mount.mountpoint / path).read_bytes() == contents[path], path
    after = mount.stats()
    assert after["fetch"]["cache_misses"] == 0
    assert after["fetch"]["prefetch"]["hint_hits"] == count and after["hints"]["waste"] == 0
    digest = env_digest(store)  # the replay process exits once it has reported:
    wait_for(lambda: not warm_processes(digest), "the replay process's exit", WAIT)


def test_a_warm_node_fetches_its_few_missing_chunks_without_a_replay_process(
        env, mounter: Mounter) -> None:
    """A first mount replays in a process (every chunk to fetch); a second one on the same
    node cache, with two of the hinted chunks gone from it (as a new task's own group),
    fetches those two itself and asks for no process (core/replay_choice.py)."""
    store, contents = env
    paths = ["lib/big1", "etc/s005", "lib/big3"]
    count = publish_hint(store, "env:t", paths, files=True)
    first = mounter.mount("env:t", store)
    stats = wait_for_state(first, "done")
    assert stats["hints"]["choice"] == {**stats["hints"]["choice"], "chosen": "process",
                                        "where": "process", "missing_chunks": count}
    run_weenv("umount", str(first.mountpoint))
    hint, indexes = published_hint(store)
    cache = ChunkCache(first.cache)
    gone = [chunk_loc(indexes[r.group], r.chunk).digest for r in hint.records[-2:]]
    for digest in gone:
        cache.path(digest).unlink()
    second = mounter.mount("env:t", store)
    stats = wait_for_state(second, "done")
    hints = stats["hints"]
    assert hints["replayer"] == "mount daemon" and hints["chunks_missing"] == 0
    assert hints["choice"] == {**hints["choice"], "chosen": "mount daemon",
                               "where": "mount daemon", "missing_chunks": 2}
    assert stats["fetch"]["prefetch"]["chunks"] == 2 and all(map(cache.contains, gone))
    assert "in a process of the node service" not in second.log_text()
    for path in paths:
        assert (second.mountpoint / path).read_bytes() == contents[path], path
    assert second.stats()["fetch"]["cache_misses"] == 0


def test_a_node_new_to_the_groups_asks_for_the_replay_before_its_lookup(
        tmp_path: Path, mounter: Mounter) -> None:
    """None of the environment's identity files cached: the mount asks for a replay process
    at once, as a cold node has the hint's worth to fetch; the next mount, on a node that
    has them, looks its hint up first and fetches nothing (every hinted chunk cached)."""
    store, contents = publish_varied_env(tmp_path, identity=True)
    # No hint yet (a first run): one listing says so, and nothing is asked for or looked up.
    unhinted = mounter.mount("env:t", store, cache=tmp_path / "other-node")
    assert wait_for_state(unhinted, "no hint")["hints"]["choice"] is None
    assert "no hint for env:t" in unhinted.log_text()
    assert "no hint seed" not in unhinted.log_text() and not warm_processes(env_digest(store))
    count = publish_hint(store, "env:t", ["lib/big1", "lib/big3"])
    first = mounter.mount("env:t", store)
    hints = wait_for_state(first, "done")["hints"]
    assert hints["choice"] == {"chosen": "process", "where": "process", "missing_chunks": None,
                               "missing_bytes": None, "why": "a node new to these groups"}
    assert hints["chunks_done"] == count and "asked of the node service at once" in \
        first.log_text()
    run_weenv("umount", str(first.mountpoint))
    second = mounter.mount("env:t", store)
    stats = wait_for_state(second, "done")
    assert stats["hints"]["choice"] == {**stats["hints"]["choice"], "chosen": "mount daemon",
                                        "missing_chunks": 0}
    assert stats["fetch"]["prefetch"]["chunks"] == 0
    assert (second.mountpoint / "etc/passwd").read_bytes() == contents["etc/passwd"]


def test_without_a_node_service_the_mount_replays_itself(env, mounter: Mounter,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store, contents = env
    count = publish_hint(store, "env:t", ["lib/big0"])
    monkeypatch.setenv("WEENV_MOUNTD", "off")
    mount = mounter.mount("env:t", store)
    stats = wait_for_state(mount, "done")
    assert stats["hints"]["replayer"] == "mount daemon"
    assert stats["hints"]["chunks_done"] == count == stats["fetch"]["prefetch"]["chunks"]
    assert (mount.mountpoint / "lib/big0").read_bytes() == contents["lib/big0"]


def test_unmounting_ends_a_replay_whose_store_hangs(env, mounter: Mounter) -> None:
    store, _ = env
    publish_hint(store, "env:t", ["lib/big2"])
    digest = env_digest(store)
    with RangeHTTPServer(store) as server, \
            FaultProxy(server.url, "t*", stall=3600, match=r"^GET .*/blobs/") as proxy:
        mount = mounter.mount("env:t", proxy.url)  # type: ignore[arg-type]
        wait_for(lambda: proxy.requests(code="t"), "the replay's stalled chunk request", WAIT)
        assert warm_processes(digest)
        run_weenv("umount", str(mount.mountpoint))
        wait_for(lambda: not warm_processes(digest), "the replay's end with its mount", WAIT)


def test_no_hint_starts_no_replay_process(env, mounter: Mounter) -> None:
    """The mount's own lookup (`latest`, then the seed) that finds no hint is the only look:
    no replay process is asked for, so none looks again."""
    store, contents = env
    mount = mounter.mount("env:t", store)
    stats = wait_for_state(mount, "no hint")
    assert stats["hints"]["replayer"] == "mount daemon" and stats["hints"]["choice"] is None
    assert not warm_processes(env_digest(store))
    assert mount.log_text().count("no hint seed for") == 1
    assert "hint replay in the" not in mount.log_text()
    assert (mount.mountpoint / "lib/big0").read_bytes() == contents["lib/big0"]


def test_the_node_service_runs_at_most_max_replays(env, mounter: Mounter) -> None:
    """Replays whose store hangs keep running: one mount more than the cap replays itself."""
    store, _ = env
    publish_hint(store, "env:t", ["lib/big2"])
    with RangeHTTPServer(store) as server, \
            FaultProxy(server.url, "t*", stall=3600, match=r"^GET .*/blobs/") as proxy:
        mounts = [mounter.mount("env:t", proxy.url)  # type: ignore[arg-type]
                  for _ in range(mountd.MAX_REPLAYS + 1)]
        wait_for(lambda: proxy.requests(code="t") >= mountd.MAX_REPLAYS + 1,
                 "every replay's stalled chunk request", WAIT)
        where = sorted(m.stats()["hints"]["replayer"] for m in mounts)
        assert where == ["mount daemon"] + ["separate process"] * mountd.MAX_REPLAYS
        for mount in mounts:
            run_weenv("umount", str(mount.mountpoint))


def test_misses_fetch_neighbourhoods_once_the_replay_says_it_replays_the_seed(
        tmp_path: Path) -> None:
    """The mount holds its neighbourhoods back while another process replays a hint
    (core/prefetch.py says why), but not for the seed, which names the start-up only."""
    from weenvfs.core.cache import ChunkCache
    from weenvfs.core.fetcher import Fetcher
    from weenvfs.fuse.replay_process import ReplayProcess

    def around(loc, reach=None):
        return []

    fetcher = Fetcher(open_store(str(tmp_path / "store")), ChunkCache(tmp_path / "cache"))
    fetcher.neighbours = around
    read_fd, write_fd = os.pipe()
    try:
        replay = ReplayProcess(read_fd, fetcher)
        assert fetcher.neighbours is None
        line = {"hints": {"state": "replaying", "source": "tag latest", "partial": False},
                "fetch": {}, "fetched": []}
        replay._apply(json.dumps(line).encode())
        assert fetcher.neighbours is None  # a whole hint: until it is done
        line["hints"] = {"state": "replaying", "source": "tag seed", "partial": True}
        replay._apply(json.dumps(line).encode())
        assert fetcher.neighbours is around
    finally:
        os.close(read_fd)
        os.close(write_fd)
