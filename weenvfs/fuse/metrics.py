"""The node's Prometheus metrics: what every mount daemon of one node service counted, summed
at scrape time, as a prometheus_client collector (`NodeCollector`). docs/metrics.md lists
the metrics; docs/design-notes.md says why they are gathered this way.

Where the numbers come from: each mount daemon counts in core/stats.py (plain integers on
its trio thread; nothing here touches a read). At each scrape the collector finds the node
service's daemons by their pid files (those naming its socket, `server`), reads each one's
statistics document through `user.weenv.stats` (stats_channel.read_stats, in a thread of its
own so that a stuck daemon costs a timeout, not the scrape), and adds them up. A daemon is
known by (pid, start time). What it counted is kept after it exits: its exit report (the
final document, stats_channel) replaces its last scraped one when the report arrives; a
daemon that died without one (SIGKILL) keeps its last scraped values. So every counter
only grows while the collector lives (a daemon's own counters only grow), nothing is counted
twice (a report's daemon is never read again), and a mount that lived between two scrapes
still counts. Only the exporter's restart starts the totals from zero again, which
Prometheus treats as a counter reset.

Exit reports: one collector per node service receives them (`receive_exits`, an flock next
to the socket decides); another collector of the same node (e.g. in the containerd
snapshotter) may read the live daemons without them.

Must not: write to a mount, hold its lock while a read waits forever, or know how the
numbers are counted (core/stats.py does).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import select
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from weenvfs.core.stats import doubling_bound

from . import daemon, mountd, stats_channel

log = logging.getLogger(__name__)

Identity = tuple[int, str]  # (pid, start time): one daemon, never a reused pid
READ_TIMEOUT = 5.0  # seconds a scrape waits for the daemons' statistics
FINISHED_MEMORY = 1 << 16  # daemons whose exit report arrived, remembered (bounded)
# The histograms' buckets: the core histogram's doublings from 10 us to 2**25 * 10 us (335 s);
# longer durations count in +Inf only.
LATENCY_BOUNDS = [doubling_bound(k) for k in range(26)]
# Histograms of a statistics document's "fetch" part (core LatencyHistogram summaries).
HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("fetch_latency", "weenv_fetch_latency_seconds", "Duration of successful store requests"),
    ("read_waits", "weenv_read_wait_seconds",
     "How long demand reads waited for a fetch (their own or one in flight)"),
)

# Counters of a statistics document's "fetch" part: (key path, metric name, help).
COUNTERS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("reads",), "weenv_reads", "Demand read requests the mounts answered"),
    (("bytes_served",), "weenv_served_bytes",
     "Bytes the mounts returned to readers (kernel path: device reads the page cache missed)"),
    (("cache_hits",), "weenv_cache_hits", "Chunks demand reads found in the node cache"),
    (("cache_misses",), "weenv_cache_misses", "Chunks demand reads had to fetch or wait for"),
    (("zero_chunks",), "weenv_zero_chunks", "All-zero chunks served without I/O"),
    (("requests",), "weenv_store_requests", "Store range requests, every attempt"),
    (("retries",), "weenv_store_retries",
     "Store attempts after a temporary failure or a corrupt body"),
    (("bytes_fetched",), "weenv_fetched_bytes", "Compressed bytes received from the store"),
    (("chunks_fetched",), "weenv_fetched_chunks", "Chunks fetched, verified and cached"),
    (("bytes_decompressed",), "weenv_decompressed_bytes", "Plaintext bytes of those chunks"),
    (("waited_for_other_process",), "weenv_waited_chunks",
     "Chunks another process fetched while this one waited for them"),
    (("prefetch", "requests"), "weenv_prefetch_requests", "Store requests made by prefetch"),
    (("prefetch", "chunks"), "weenv_prefetched_chunks", "Chunks prefetch brought in"),
    (("prefetch", "bytes"), "weenv_prefetched_bytes", "Plaintext bytes prefetch brought in"),
    (("prefetch", "hint_hits"), "weenv_prefetch_hits",
     "Chunks a demand read used that prefetch had brought in"),
    (("prefetch", "dropped"), "weenv_prefetch_dropped",
     "Read-ahead batches dropped because too many were in flight"),
    (("neighbourhoods", "requests"), "weenv_neighbourhood_requests",
     "Store requests for the blob neighbourhood of a miss, fetched undecoded"),
    (("neighbourhoods", "bytes"), "weenv_neighbourhood_bytes",
     "Compressed bytes of those neighbourhoods (also in weenv_fetched_bytes)"),
    (("neighbourhoods", "hits"), "weenv_neighbourhood_hits",
     "Chunks a read took from a neighbourhood instead of asking the store"),
    (("neighbourhoods", "unused_bytes"), "weenv_neighbourhood_unused_bytes",
     "Compressed bytes of neighbourhood frames dropped unread (age or memory bound): waste"),
)


class Histogram:
    """Sums of core LatencyHistogram summaries: counts per doubling, count, total."""

    def __init__(self) -> None:
        self.doublings: list[int] = []
        self.count = 0
        self.seconds = 0.0

    def add(self, doublings: list[int], count: int, seconds: float) -> None:
        for k, n in enumerate(doublings):
            if k >= len(self.doublings):
                self.doublings.extend([0] * (k + 1 - len(self.doublings)))
            self.doublings[k] += int(n)
        self.count += count
        self.seconds += seconds

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs over LATENCY_BOUNDS, then +Inf."""
        out, seen = [], 0
        for k, bound in enumerate(LATENCY_BOUNDS):
            seen += self.doublings[k] if k < len(self.doublings) else 0
            out.append((repr(bound), float(seen)))
        out.append(("+Inf", float(self.count)))
        return out


class Totals:
    """Sums of statistics documents: the counters, errors by kind, the histograms."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.histograms = {name: Histogram() for _, name, _ in HISTOGRAMS}
        self.unused_prefetched = 0  # prefetched chunks no read used (yet)
        self.held_neighbours = 0  # compressed bytes of neighbourhood frames held unread

    def add(self, document: dict[str, Any]) -> None:
        """Add one daemon's document (what `weenv stats --json` prints); parts it lacks
        count as zero."""
        fetch = document.get("fetch") or {}
        for path, name, _ in COUNTERS:
            value: Any = fetch
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, int):
                self.counters[name] += value
        for kind, n in (fetch.get("errors") or {}).items():
            self.errors[str(kind)] += int(n)
        for key, name, _ in HISTOGRAMS:
            summary = fetch.get(key) or {}
            self.histograms[name].add(list(summary.get("per_doubling") or ()),
                                      int(summary.get("count") or 0),
                                      float(summary.get("total_ms") or 0.0) / 1000.0)
        self.unused_prefetched += int((fetch.get("prefetch") or {}).get("waste") or 0)
        self.held_neighbours += int((fetch.get("neighbourhoods") or {}).get("held_bytes") or 0)

    def plus(self, other: Totals) -> Totals:
        """A new Totals: this one and `other` added."""
        out = Totals()
        for part in (self, other):
            out.counters.update(part.counters)
            out.errors.update(part.errors)
            out.unused_prefetched += part.unused_prefetched
            out.held_neighbours += part.held_neighbours
            for name, histogram in part.histograms.items():
                out.histograms[name].add(histogram.doublings, histogram.count,
                                         histogram.seconds)
        return out


class NodeCollector(Collector):
    """The metrics of the mount daemons of the node service on `server_socket` (see the
    module docstring). `start()` begins receiving exit reports when `receive_exits` and no
    other collector of that service receives them; register it with a prometheus_client
    registry and it is read at each scrape."""

    def __init__(self, server_socket: Path | None = None, receive_exits: bool = True,
                 read_timeout: float = READ_TIMEOUT) -> None:
        self.server_socket = Path(server_socket or mountd.socket_path())
        self.receive_exits = receive_exits
        self.read_timeout = read_timeout
        self.started = time.time()
        self._lock = threading.Lock()
        self._live: dict[Identity, dict[str, Any]] = {}  # last document of each daemon
        self._pending: dict[Identity, concurrent.futures.Future[dict[str, Any]]] = {}
        self._finished: OrderedDict[Identity, None] = OrderedDict()
        self._retired = Totals()
        self._exited: Counter[str] = Counter()  # "reported" / "last_scrape", see collect()
        self._unanswered = 0
        self._exits: socket.socket | None = None
        self._exits_lock: Any = None
        self._stop = threading.Event()

    # -- exit reports -----------------------------------------------------------------------

    def start(self) -> bool:
        """Bind the exit-report socket and drain it in a thread; True if this collector
        receives the reports (False: another one does, or `receive_exits` is off)."""
        if not self.receive_exits:
            return False
        path = stats_channel.exits_path(self.server_socket)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a+b")  # noqa: SIM115 - held till close
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            log.info("another exporter receives the exit reports of %s", self.server_socket)
            return False
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        old_mask = os.umask(0o177)  # our uid only, as the server's socket
        try:
            with mountd.addressable(path) as address:
                sock.bind(address)
        finally:
            os.umask(old_mask)
        sock.setblocking(False)
        self._exits, self._exits_lock = sock, lock
        threading.Thread(target=self._drain_forever, name="weenv-exit-reports",
                         daemon=True).start()
        return True

    def close(self) -> None:
        """Stop receiving exit reports and remove their socket."""
        self._stop.set()
        if self._exits is not None:
            with self._lock:
                path = stats_channel.exits_path(self.server_socket)
                path.unlink(missing_ok=True)
                self._exits.close()
                self._exits_lock.close()
                self._exits = None

    def _drain_forever(self) -> None:
        """Keep the report queue empty (the kernel queues only a few datagrams per socket)."""
        while not self._stop.is_set():
            sock = self._exits
            if sock is None:
                return
            with contextlib.suppress(OSError, ValueError):
                select.select([sock], [], [], 1.0)
            with self._lock:
                self._drain()

    def _drain(self) -> None:
        """Fold every queued exit report into the totals (the lock is held)."""
        while self._exits is not None:
            try:
                data = self._exits.recv(stats_channel.MAX_REPORT)
            except (BlockingIOError, OSError):
                return
            parsed = stats_channel.parse_exit_report(data)
            if parsed is None:
                log.warning("ignored a malformed exit report (%d bytes)", len(data))
                continue
            identity, document = parsed
            if identity in self._finished:
                continue
            self._finish(identity)
            self._live.pop(identity, None)
            self._retired.add(document)
            self._exited["reported"] += 1

    def _finish(self, identity: Identity) -> None:
        self._finished[identity] = None
        self._pending.pop(identity, None)
        if len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    # -- scraping ---------------------------------------------------------------------------

    def _daemons(self) -> dict[Identity, Path]:
        """The live daemons of this node service: identity -> mount point."""
        out: dict[Identity, Path] = {}
        server = str(self.server_socket)
        for path in daemon.run_dir().glob("*.pid"):
            try:
                record = json.loads(path.read_text())
                pid, mountpoint = int(record["pid"]), Path(record["mountpoint"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if record.get("server") != server:
                continue
            started = daemon.start_time(pid)
            if started:
                out[(pid, started)] = mountpoint
        return out

    def refresh(self) -> None:
        """Bring the per-daemon documents up to date (what `collect` does first)."""
        with self._lock:
            # Who is gone is decided before the reports are read: a daemon queues its report
            # before it exits, so every report of a daemon seen gone is in the queue now.
            gone = [i for i in self._live if daemon.start_time(i[0]) != i[1]]
            self._drain()
            for identity in gone:
                if identity in self._live:  # no report: its last scraped values stay
                    self._retired.add(self._live.pop(identity))
                    self._exited["last_scrape"] += 1
                    self._finish(identity)
            found = self._daemons()
            for identity in [i for i in self._pending if i not in found]:
                del self._pending[identity]
            for identity, mountpoint in found.items():
                if identity not in self._finished and identity not in self._pending:
                    self._pending[identity] = _read_in_thread(mountpoint)
            concurrent.futures.wait(list(self._pending.values()), timeout=self.read_timeout)
            self._unanswered = 0
            for identity, future in list(self._pending.items()):
                if not future.done():
                    self._unanswered += 1  # still waiting: read again once it answers
                    continue
                del self._pending[identity]
                document = None if future.exception() else future.result()
                if document is None or _pid(document) != identity[0]:
                    self._unanswered += 1
                    continue
                self._live[identity] = _newer(self._live.get(identity), document)

    def collect(self) -> Iterator[Any]:
        """The metric families (prometheus_client calls this at each scrape)."""
        self.refresh()
        with self._lock:
            live = Totals()
            paths: Counter[str] = Counter({"kernel": 0, "fuse": 0})
            for document in self._live.values():
                live.add(document)
                paths[str((document.get("mount") or {}).get("path") or "fuse")] += 1
            totals = self._retired.plus(live)
            wasted = self._retired.unused_prefetched
            exited = dict(self._exited)
            unanswered = self._unanswered
        yield from _families(totals, live.unused_prefetched, wasted)
        yield GaugeMetricFamily(
            "weenv_neighbourhood_held_bytes", "Compressed bytes of neighbourhood frames the "
            "live mounts hold unread: read later, or dropped as unused", value=live.held_neighbours)
        mounts = GaugeMetricFamily("weenv_mounts", "Mount daemons serving, by data path",
                                   labels=["path"])
        for path, n in sorted(paths.items()):
            mounts.add_metric([path], n)
        yield mounts
        gone = CounterMetricFamily(
            "weenv_mount_daemons_exited", "Mount daemons that exited, by where their final "
            "numbers came from: their exit report (exact) or the last scrape (killed)",
            labels=["final"])
        for how in ("reported", "last_scrape"):
            gone.add_metric([how], exited.get(how, 0))
        yield gone
        yield GaugeMetricFamily(
            "weenv_mount_stats_unanswered", "Live daemons whose statistics this scrape could "
            "not read (their last values are used)", value=unanswered)
        yield GaugeMetricFamily(
            "weenv_metrics_start_time_seconds",
            "When these totals started (Unix time): the exporter's start", value=self.started)


def _families(totals: Totals, unused: int, wasted: int) -> Iterator[Any]:
    for _, name, text in COUNTERS:
        yield CounterMetricFamily(name, text, value=totals.counters[name])
    errors = CounterMetricFamily("weenv_store_errors", "Store failures by kind (timeout, "
                                 "unavailable, corrupt, missing, ...)", labels=["kind"])
    for kind, n in sorted(totals.errors.items()):
        errors.add_metric([kind], n)
    yield errors
    for _, name, text in HISTOGRAMS:
        histogram = totals.histograms[name]
        yield HistogramMetricFamily(name, text, buckets=histogram.buckets(),
                                    sum_value=histogram.seconds)
    yield GaugeMetricFamily("weenv_prefetch_unused_chunks", "Chunks prefetch brought in that "
                            "no read has used yet, in the live mounts", value=unused)
    yield CounterMetricFamily("weenv_prefetch_wasted_chunks", "Chunks prefetch brought in "
                              "that no read used before their mount exited", value=wasted)


def _read_in_thread(mountpoint: Path) -> concurrent.futures.Future[dict[str, Any]]:
    """`read_stats(mountpoint)` in a thread of its own: a daemon that never answers holds
    that thread, not the scrape (at most one read per daemon is outstanding)."""
    future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

    def work() -> None:
        try:
            future.set_result(stats_channel.read_stats(mountpoint))
        except Exception as error:  # noqa: BLE001 - any failure: the daemon did not answer
            future.set_exception(error)

    threading.Thread(target=work, name="weenv-stats-read", daemon=True).start()
    return future


def _pid(document: dict[str, Any]) -> int | None:
    pid = (document.get("mount") or {}).get("pid")
    return pid if isinstance(pid, int) else None


def _newer(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The later of two documents of one daemon (a slow read may answer after a newer one)."""
    if old is None:
        return new
    age = (old.get("mount") or {}).get("uptime_s") or 0.0
    return new if ((new.get("mount") or {}).get("uptime_s") or 0.0) >= age else old

