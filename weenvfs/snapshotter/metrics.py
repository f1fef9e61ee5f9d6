"""The snapshotter's Prometheus metrics endpoint (docs/metrics.md, "The snapshotter").

What it serves:
- its own numbers: every call containerd made, by method and the status answered, with its
  duration (told by service.py's adapter, `Endpoint.observe`); the snapshots it keeps, by
  kind and whether they are WeEnv layers, and the group mounts they hold; the WeEnv layers
  it took (through labels or markers) and refused, and the snapshots it restored at start
  (`Snapshots.counts`). Snapshots and counts are read at each scrape without the snapshots'
  lock, which a Prepare holds while a group mounts: copying a dict is atomic in CPython;
- with `node_metrics`, the node's mount metrics too (fuse/metrics.py's `NodeCollector`, the
  families `weenv mountd` serves), for nodes whose mount server serves none: this process
  then receives the mount daemons' exit reports, and the mount servers it starts itself are
  told to serve no metrics ($WEENV_METRICS=off), so no node's totals are served twice. When
  another exporter receives the reports already, the node's metrics are left to it (logged).

The bound address is written to `<socket>.metrics` (useful with port 0), as `weenv mountd`
does. Owns: the collectors and the endpoint's life. Must not: change what a call does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from weenvfs.errors import WeenvError
from weenvfs.fuse import exporter, mountd
from weenvfs.fuse.metrics import NodeCollector

from .snapshots import Snapshots
from .state import ACTIVE, COMMITTED, VIEW

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:9388"  # next to the node service's 9387; ours, not registered
ENV = "WEENV_SNAPSHOTTER_METRICS"
KIND_NAMES = {VIEW: "view", ACTIVE: "active", COMMITTED: "committed"}
# Call durations: a plain call takes milliseconds, a WeEnv Prepare mounts a group (seconds
# on a cold node, longer from a slow store).
CALL_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class SnapshotsCollector(Collector):
    """The snapshots kept and the WeEnv layers taken, read from `Snapshots` at each scrape."""

    def __init__(self, snaps: Snapshots) -> None:
        self.snaps = snaps
        self.started = time.time()

    def collect(self) -> Iterator[Any]:
        records = list(self.snaps.state.by_key.values())
        counts = dict(self.snaps.counts)
        kept = GaugeMetricFamily("weenv_snapshotter_snapshots", "Snapshots kept, by kind and "
                                 "whether they are WeEnv layers", labels=["kind", "weenv"])
        for kind, name in KIND_NAMES.items():
            for weenv in (False, True):
                n = sum(1 for r in records if r.kind == kind and (r.weenv is not None) == weenv)
                kept.add_metric([name, str(weenv).lower()], n)
        yield kept
        yield GaugeMetricFamily(
            "weenv_snapshotter_group_mounts", "Shared group mounts the snapshots hold",
            value=len({str(r.weenv.get("key")) for r in records if r.weenv is not None}))
        taken = CounterMetricFamily("weenv_snapshotter_weenv_layers", "WeEnv layers mounted "
                                    "for a snapshot, by how they were named", labels=["via"])
        for via in ("labels", "marker"):
            taken.add_metric([via], counts.get(via, 0))
        yield taken
        yield CounterMetricFamily(
            "weenv_snapshotter_refused_layers", "WeEnv layers refused (bad or hostile labels or "
            "markers, stores not served, groups missing, mounts failed)",
            value=counts.get("refused", 0))
        yield GaugeMetricFamily("weenv_snapshotter_restored_snapshots", "WeEnv snapshots whose "
                                "mounts were taken again at start", value=counts.get("restored", 0))
        yield GaugeMetricFamily(
            "weenv_snapshotter_restore_failures", "WeEnv snapshots whose mounts could not be "
            "taken again at start", value=counts.get("restore_failed", 0))
        yield GaugeMetricFamily("weenv_snapshotter_start_time_seconds",
                                "When the snapshotter started (Unix time)", value=self.started)


class Endpoint:
    """The snapshotter's metrics, served over HTTP until `close()`."""

    def __init__(self, snaps: Snapshots, address: exporter.Address, socket: Path,
                 node_metrics: bool) -> None:
        self.registry = CollectorRegistry()
        self._calls = Counter("weenv_snapshotter_calls", "Calls containerd made, by method "
                              "and the status answered", ["method", "code"],
                              registry=self.registry)
        self._seconds = Histogram("weenv_snapshotter_call_seconds", "Duration of the calls, by "
                                  "method", ["method"], buckets=CALL_BUCKETS,
                                  registry=self.registry)
        self.registry.register(SnapshotsCollector(snaps))
        self.httpd = exporter.serve_registry(self.registry, address)  # first: it may fail
        self.node: NodeCollector | None = None
        if node_metrics:
            self._add_node_metrics()
        self.address_file = exporter.address_file(socket)
        host, port = self.httpd.server_address[:2]
        self.bound = str(exporter.Address(host, port))
        tmp = self.address_file.with_name(f".{self.address_file.name}.{os.getpid()}")
        tmp.write_text(self.bound + "\n")
        tmp.replace(self.address_file)
        log.info("snapshotter metrics on http://%s/metrics%s", self.bound,
                 " (with the node's mount metrics)" if self.node else "")

    def _add_node_metrics(self) -> None:
        # Before any mount of ours: the mount server a mount starts inherits this.
        os.environ[exporter.ENV] = "off"
        node = NodeCollector(mountd.socket_path())
        if node.start():
            self.registry.register(node)
            self.node = node
        else:
            log.warning("another exporter (the node's mount server: `weenv mountd --check`) "
                        "serves the node's mount metrics; this endpoint serves only the "
                        "snapshotter's own")

    def observe(self, method: str, code: str, seconds: float) -> None:
        """One call answered (service.py)."""
        self._calls.labels(method, code).inc()
        self._seconds.labels(method).observe(seconds)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.address_file.unlink(missing_ok=True)
        if self.node is not None:
            self.node.close()


def start(snaps: Snapshots, flag: str | None, socket: Path, node_metrics: bool
          ) -> Endpoint | None:
    """The endpoint at --metrics `flag`, else $WEENV_SNAPSHOTTER_METRICS, else DEFAULT_ADDRESS;
    None when off, or when the built-in default cannot be bound (logged). WeenvError (one
    line) when an address someone chose cannot be bound."""
    address, chosen = exporter.choose(flag, ENV, DEFAULT_ADDRESS)
    if address is None:
        return None
    try:
        return Endpoint(snaps, address, socket, node_metrics)
    except WeenvError as error:
        if chosen:
            raise
        log.warning("%s: the snapshotter's metrics are off (choose an address: --metrics or "
                    "$%s)", error, ENV)
        return None
