"""core/frame_stash.py: neighbourhood responses held undecoded (bound, age, waiting for one on
its way), and the fetcher's reach following the rate the store sends them at."""

from __future__ import annotations

import trio

from weenvfs.core.cache import ChunkCache
from weenvfs.core.chunk_plan import ChunkLoc
from weenvfs.core.fetcher import NEAR_MIN_REACH, Fetcher
from weenvfs.core.frame_stash import FrameStash


def _loc(n: int, offset: int, clen: int = 10, blob: str = "b" * 64) -> ChunkLoc:
    return ChunkLoc(bytes([n]) * 32, blob, offset, clen, 100)


def test_take_returns_each_frame_once_and_frees_the_response_when_all_are_taken() -> None:
    a, b = _loc(1, 100), _loc(2, 110)
    stash = FrameStash()
    event = stash.begin([a, b])
    assert stash.covers(a.digest) and not event.is_set()
    stash.land([a, b], event, bytes(range(20)), 100)
    assert event.is_set() and stash.bytes == 20

    async def main() -> None:
        assert bytes(await stash.take(b)) == bytes(range(10, 20))
        assert await stash.take(b) is None  # taken: the reader caches it
        assert stash.bytes == 20  # a's frame still holds the response
        assert bytes(await stash.take(a)) == bytes(range(10))
        assert stash.bytes == 0 and not stash.covers(a.digest)

    trio.run(main)


def test_holds_and_at_edge_say_where_an_arrived_frame_lies_in_its_response() -> None:
    frames = [_loc(n, 100 + 10 * n) for n in range(6)]  # bytes 100..160, ten each
    stash = FrameStash()
    event = stash.begin(frames)
    assert not stash.holds(frames[0].digest)  # on its way only
    assert not stash.at_edge(frames[0].digest, 1.0)
    stash.land(frames, event, bytes(60), 100)
    assert all(stash.holds(loc.digest) for loc in frames)
    # Within a quarter of the response (15 bytes) of either end: the first two and the last
    # two frames.
    assert [stash.at_edge(loc.digest, 0.25) for loc in frames] == [True, True, False, False,
                                                                  True, True]
    assert not stash.at_edge(_loc(9, 0).digest, 1.0)  # never fetched


def test_a_frame_outside_the_response_is_not_held() -> None:
    inside, beyond = _loc(1, 0), _loc(2, 15)
    stash = FrameStash()
    stash.land([inside, beyond], stash.begin([inside, beyond]), bytes(20), 0)
    assert stash.covers(inside.digest) and not stash.covers(beyond.digest)


def test_a_chunk_stored_elsewhere_is_served_from_where_it_was_fetched() -> None:
    here = _loc(1, 40, clen=5)
    stash = FrameStash()
    stash.land([here], stash.begin([here]), b"0123456789", 38)
    elsewhere = here._replace(blob="c" * 64, offset=7000, clen=6)

    async def main() -> None:
        assert bytes(await stash.take(elsewhere)) == b"23456"

    trio.run(main)


def test_the_bound_drops_the_oldest_responses_and_counts_what_was_never_read() -> None:
    stash = FrameStash(limit=25)
    first, second, third = _loc(1, 0), _loc(2, 10), _loc(3, 20)
    for loc in (first, second, third):
        stash.land([loc], stash.begin([loc]), bytes(10), loc.offset)
    assert not stash.covers(first.digest)
    assert stash.covers(second.digest) and stash.covers(third.digest)
    assert stash.bytes == 20 and stash.unused_bytes == 10
    assert stash.unread_bytes == second.clen + third.clen


def test_responses_older_than_the_ttl_are_dropped() -> None:
    now = [0.0]
    stash = FrameStash(ttl=30.0, clock=lambda: now[0])
    old, new = _loc(1, 0), _loc(2, 10)
    stash.land([old], stash.begin([old]), bytes(10), 0)
    now[0] = 20.0
    stash.land([new], stash.begin([new]), bytes(10), 10)
    now[0] = 31.0
    stash.sweep()
    assert not stash.covers(old.digest) and stash.covers(new.digest)
    now[0] = 51.0
    stash.sweep()
    assert stash.bytes == 0 and stash.unused_bytes == 20 and stash.unread_bytes == 0


def test_a_reader_waits_for_a_response_on_its_way_and_gets_none_if_it_fails() -> None:
    loc = _loc(1, 0)
    stash = FrameStash()
    got = []

    async def main() -> None:
        event = stash.begin([loc])
        async with trio.open_nursery() as nursery:
            async def reader() -> None:
                got.append(await stash.take(loc))

            nursery.start_soon(reader)
            await trio.sleep(0.01)
            assert not got  # still waiting
            stash.fail([loc], event)
        assert got == [None] and not stash.covers(loc.digest)

    trio.run(main)


def test_the_reach_follows_the_rate_neighbourhoods_arrive_at(tmp_path) -> None:
    fetcher = Fetcher(store=None, cache=ChunkCache(tmp_path / "cache"))  # type: ignore[arg-type]
    assert fetcher.near_reach == NEAR_MIN_REACH  # untimed: start narrow
    for _ in range(3):  # 8 MiB in 10 ms: loopback, wide within a few
        fetcher._time_neighbourhood(8 << 20, 0.01)
    assert fetcher.near_reach > 4 << 20
    before = fetcher.near_reach
    fetcher._time_neighbourhood(1000, 1.0)  # too small to say anything about the link
    assert fetcher.near_reach == before
    fetcher._time_neighbourhood(1 << 20, 1.0)  # 1 MB in 1 s: a slow link, narrow at once
    assert fetcher.near_reach == NEAR_MIN_REACH


def test_unread_bytes_are_the_frames_held_and_not_taken() -> None:
    """What a mount's stats show as `neighbourhoods.held_bytes`: frames that arrived and that
    no reader took (nor the native server used) yet; a frame outside its response never
    counts, and what is dropped unread moves to `unused_bytes`."""
    first, second, outside = _loc(1, 100, 4), _loc(2, 104, 6), _loc(3, 200, 4)
    stash = FrameStash()
    run = [first, second, outside]
    stash.land(run, stash.begin(run), bytes(10), 100)
    assert stash.unread_bytes == first.clen + second.clen

    async def main() -> None:
        assert await stash.take(first) is not None

    trio.run(main)
    assert stash.unread_bytes == second.clen
    assert stash.discard(second.digest) and stash.unread_bytes == 0
    assert stash.unused_bytes == 0 and stash.bytes == 0
