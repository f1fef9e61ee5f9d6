"""The node's Prometheus metrics (`weenv mountd --metrics`, fuse/metrics.py, fuse/exporter.py):
the counters move by exactly what the mounts did, a daemon's numbers outlive it, and bad
addresses fail in one line.

Real parts: a `weenv mountd` of the test's own socket with its exporter on 127.0.0.1 (port 0:
any free one, read back from `<socket>.metrics`), `weenv mount` daemons forked by it, reads
through the mounts, and the endpoint scraped over HTTP and parsed by prometheus_client's own
parser. Everything mounted is unmounted by the `mounter` fixture; the server and its exporter
are stopped by pid, also when a test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mounts import Mounter, force_unmount, publish, run_weenv
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from support.mount_server import mount_server

from weenvfs.errors import WeenvError
from weenvfs.fuse import daemon, exporter, mountd
from weenvfs.fuse.metrics import COUNTERS, NodeCollector, Totals
from weenvfs.fuse.stats_channel import exits_path

pytestmark = pytest.mark.requires_fuse

BIG = 3_000_000  # three chunks of 1 MiB, the last one short
SMALL = b"small file\n"  # in a batch chunk
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def env(tmp_path: Path) -> tuple[str, Path, bytes]:
    """(ref, store, the big file's bytes) of a one-group environment: `big` plus `small`."""
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(BIG)
    (src / "big").write_bytes(big)
    (src / "small").write_bytes(SMALL)
    return publish(tmp_path / "store", [src]), tmp_path / "store", big


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A mount server exporting metrics on 127.0.0.1 (any free port); its socket path."""
    sock = tmp_path / "mountd" / "mountd.sock"
    with mount_server(sock, monkeypatch, "--metrics", "127.0.0.1:0") as pid:
        assert _exporter_of(pid) is not None, "the server started no exporter"
        try:
            yield sock
        finally:
            child = _exporter_of(pid)  # another one if the test killed the first
    if child is not None:
        _stop(child)
    assert not exporter.address_file(sock).exists()


def _exporter_of(server: int) -> int | None:
    """The exporter process the server `server` forked (by its parent pid and the title it
    sets itself once started: waited for), or None when the server has none."""
    deadline = time.monotonic() + 30
    while daemon.process_alive(server) and time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                title = (entry / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if int(stat[1]) == server and title.startswith(b"weenv mountd metrics"):
                return int(entry.name)
        time.sleep(0.05)
    return None


def _stop(pid: int) -> None:
    """The exporter leaves with its server; stop it by its pid if it has not (a failure)."""
    deadline = time.monotonic() + 30
    while daemon.process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if daemon.process_alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the exporter {pid} outlived its server")


def scrape(sock: Path, address: str | None = None) -> Samples:
    """Every sample of the endpoint of the server of `sock` (or at `address`), parsed by
    prometheus_client: (name, labels) -> value."""
    address = address or exporter.read_address(sock)
    assert address is not None and address.startswith("127.0.0.1:")
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=60) as answer:
        text = answer.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def settled(sock: Path, mounter: Mounter) -> tuple[Samples, list[dict]]:
    """A scrape and the `weenv stats` documents of every live mount, taken while nothing
    changed between them (read-ahead may still finish in the background)."""
    for _ in range(50):
        before = [m.stats() for m in mounter.mounts if daemon.is_mounted(m.mountpoint)]
        samples = scrape(sock)
        after = [m.stats() for m in mounter.mounts if daemon.is_mounted(m.mountpoint)]
        if [d["fetch"] for d in before] == [d["fetch"] for d in after]:
            return samples, after
        time.sleep(0.1)
    raise AssertionError("the mounts' statistics never stood still")


def counter_sum(documents: list[dict], path: tuple[str, ...]) -> int:
    total = 0
    for document in documents:
        node = document["fetch"]
        for key in path:
            node = node[key]
        total += node
    return total


def test_counters_are_the_sums_of_what_the_mounts_counted(
        env: tuple[str, Path, bytes], server: Path, mounter: Mounter) -> None:
    ref, store, big = env
    mounter.path = "fuse"
    first = mounter.mount(ref, store)
    assert (first.mountpoint / "big").read_bytes() == big
    assert (first.mountpoint / "small").read_bytes() == SMALL
    samples, docs = settled(server, mounter)
    # Bytes served == bytes read (each file once: the kernel keeps them cached after).
    assert value(samples, "weenv_served_bytes_total") == BIG + len(SMALL)
    assert value(samples, "weenv_mounts", path="fuse") == 1
    assert value(samples, "weenv_mounts", path="kernel") == 0
    fetched = value(samples, "weenv_fetched_bytes_total")
    assert fetched == docs[0]["fetch"]["bytes_fetched"] > 0
    requests = value(samples, "weenv_store_requests_total")
    assert value(samples, "weenv_fetch_latency_seconds_count") == requests > 0
    assert value(samples, "weenv_fetch_latency_seconds_bucket", le="+Inf") == requests
    assert value(samples, "weenv_fetch_latency_seconds_sum") > 0

    # A second mount of the same environment reads the same file from the node cache.
    second = mounter.mount(ref, store, cache=first.cache)
    assert (second.mountpoint / "big").read_bytes() == big
    assert (second.mountpoint / "small").read_bytes() == SMALL
    later, docs = settled(server, mounter)
    assert value(later, "weenv_served_bytes_total") == 2 * (BIG + len(SMALL))
    assert value(later, "weenv_fetched_bytes_total") == fetched  # nothing fetched again
    assert value(later, "weenv_cache_misses_total") == value(samples, "weenv_cache_misses_total")
    assert value(later, "weenv_cache_hits_total") == (value(samples, "weenv_cache_hits_total")
                                                      + docs[1]["fetch"]["cache_hits"])
    assert value(later, "weenv_mounts", path="fuse") == 2
    for path, name, _ in COUNTERS:  # every counter is the sum of what `weenv stats` shows
        assert value(later, f"{name}_total") == counter_sum(docs, path), name
    assert value(later, "weenv_neighbourhood_held_bytes") == counter_sum(
        docs, ("neighbourhoods", "held_bytes"))  # a gauge of the live mounts
    waits = value(later, "weenv_read_wait_seconds_count")
    assert waits == counter_sum(docs, ("read_waits", "count")) > 0  # the cold reads waited
    buckets = [v for (name, labels), v in sorted(later.items(), key=_le)
               if name == "weenv_fetch_latency_seconds_bucket"]
    assert buckets == sorted(buckets) and buckets[-1] == requests  # cumulative


def _le(item: tuple[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    labels = dict(item[0][1])
    return float(labels.get("le", "0").replace("+Inf", "inf"))


def test_an_exited_daemon_keeps_its_totals_and_a_new_one_adds_to_them(
        env: tuple[str, Path, bytes], server: Path, mounter: Mounter) -> None:
    ref, store, big = env
    mounter.path = "fuse"
    mount = mounter.mount(ref, store)
    assert (mount.mountpoint / "big").read_bytes() == big
    assert value(scrape(server), "weenv_served_bytes_total") == BIG
    daemon.unmount(mount.mountpoint)
    gone = scrape(server)
    assert value(gone, "weenv_served_bytes_total") == BIG
    assert value(gone, "weenv_mounts", path="fuse") == 0
    assert value(gone, "weenv_mount_daemons_exited_total", final="reported") == 1
    # The same mount point again: a new daemon, counted from zero on top of the first one.
    again = mounter.mount(ref, store, mountpoint=mount.mountpoint)
    assert (again.mountpoint / "small").read_bytes() == SMALL
    both = scrape(server)
    assert value(both, "weenv_served_bytes_total") == BIG + len(SMALL)
    assert value(both, "weenv_mounts", path="fuse") == 1


def test_a_mount_that_lived_between_two_scrapes_still_counts(
        env: tuple[str, Path, bytes], server: Path, mounter: Mounter) -> None:
    ref, store, big = env
    mounter.path = "fuse"
    mount = mounter.mount(ref, store)
    assert (mount.mountpoint / "big").read_bytes() == big
    final = mount.stats()["fetch"]
    daemon.unmount(mount.mountpoint)
    samples = scrape(server)  # the first scrape: the daemon is gone, its report is not
    assert value(samples, "weenv_served_bytes_total") == BIG
    assert value(samples, "weenv_fetched_bytes_total") == final["bytes_fetched"]
    assert value(samples, "weenv_mount_daemons_exited_total", final="reported") == 1


def test_a_killed_daemon_keeps_its_last_scraped_numbers(
        env: tuple[str, Path, bytes], server: Path, mounter: Mounter) -> None:
    ref, store, _ = env
    mounter.path = "fuse"
    mount = mounter.mount(ref, store)
    assert (mount.mountpoint / "small").read_bytes() == SMALL
    assert value(scrape(server), "weenv_served_bytes_total") == len(SMALL)
    os.kill(mount.pid, signal.SIGKILL)  # no exit report
    while daemon.process_alive(mount.pid):
        time.sleep(0.05)
    force_unmount(mount.mountpoint)
    samples = scrape(server)
    assert value(samples, "weenv_served_bytes_total") == len(SMALL)
    assert value(samples, "weenv_mount_daemons_exited_total", final="last_scrape") == 1
    assert value(samples, "weenv_mounts", path="fuse") == 0


def test_kernel_path_mounts_are_counted_by_path(
        env: tuple[str, Path, bytes], server: Path, mounter: Mounter,
        require_or_skip: object) -> None:
    require_or_skip(os.geteuid() == 0, "the kernel path needs root")  # type: ignore[operator]
    require_or_skip("erofs" in Path("/proc/filesystems").read_text(),  # type: ignore[operator]
                    "the kernel has no EROFS")
    ref, store, big = env
    mount = mounter.mount(ref, store, extra=["--path", "kernel"])
    assert (mount.mountpoint / "big").read_bytes() == big
    samples, docs = settled(server, mounter)
    assert docs[0]["mount"]["path"] == "kernel"
    assert value(samples, "weenv_mounts", path="kernel") == 1
    # The daemon serves the data device: the bytes EROFS read through it, at least the file.
    served = value(samples, "weenv_served_bytes_total")
    assert served == docs[0]["fetch"]["bytes_served"] >= BIG


def test_a_dead_exporter_is_started_again_and_counts_the_live_mounts(
        env: tuple[str, Path, bytes], server: Path, mounter: Mounter) -> None:
    ref, store, big = env
    mounter.path = "fuse"
    mount = mounter.mount(ref, store)
    assert (mount.mountpoint / "big").read_bytes() == big
    before = scrape(server)
    pid = _exporter_of(int(server.with_name(server.name + ".pid").read_text()))
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # The server notices between two requests: a second mount is one.
    mounter.mount(ref, store, cache=mount.cache)
    after = scrape(server)
    assert value(after, "weenv_metrics_start_time_seconds") > value(
        before, "weenv_metrics_start_time_seconds")
    assert value(after, "weenv_served_bytes_total") == BIG  # the live mount, from its start
    assert value(after, "weenv_mounts", path="fuse") == 2


def test_a_malformed_exit_report_is_ignored_and_logged(
        env: tuple[str, Path, bytes], server: Path, mounter: Mounter) -> None:
    ref, store, _ = env
    mounter.path = "fuse"
    mount = mounter.mount(ref, store)
    assert (mount.mountpoint / "small").read_bytes() == SMALL
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as conn:
        for garbage in (b"{not json", b'{"pid": "1", "start": "2", "stats": {}}'):
            with mountd.addressable(exits_path(server)) as address:
                conn.sendto(garbage, address)
    samples = scrape(server)
    assert value(samples, "weenv_served_bytes_total") == len(SMALL)
    assert value(samples, "weenv_mount_daemons_exited_total", final="reported") == 0
    log = server.with_suffix(".log").read_text()
    assert log.count("ignored a malformed exit report") == 2


def test_a_second_collector_serves_the_live_mounts_from_another_process(
        env: tuple[str, Path, bytes], server: Path, mounter: Mounter) -> None:
    """How the containerd snapshotter registers the node's metrics next to its own: a
    NodeCollector of the same node service, served by `serve_registry` from a thread. The
    server's exporter keeps the exit reports (`start` says it does not get them)."""
    ref, store, big = env
    mounter.path = "fuse"
    mount = mounter.mount(ref, store)
    assert (mount.mountpoint / "big").read_bytes() == big
    collector = NodeCollector(server)
    assert not collector.start()
    registry = CollectorRegistry()
    registry.register(collector)
    httpd = exporter.serve_registry(registry, exporter.Address("127.0.0.1", 0))
    try:
        samples = scrape(server, f"127.0.0.1:{httpd.server_port}")
    finally:
        httpd.shutdown()
        httpd.server_close()
        collector.close()
    assert value(samples, "weenv_served_bytes_total") == BIG
    assert value(samples, "weenv_mounts", path="fuse") == 1
    assert value(scrape(server), "weenv_served_bytes_total") == BIG  # the node's own, too


# -- the address ----------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1", "127.0.0.1:99999", ":9387"])
def test_a_bad_address_is_a_usage_error(address: str) -> None:
    done = run_weenv("mountd", "--metrics", address, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "weenv mountd: error: argument --metrics: expected HOST:PORT or off")
    assert "Traceback" not in done.stderr


def test_a_bad_address_in_the_environment_is_one_line(tmp_path: Path) -> None:
    env = _server_env(tmp_path, **{exporter.ENV: "localhost"})
    done = subprocess.run([sys.executable, "-m", "weenvfs", "mountd"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip() == ("weenv: error: $WEENV_METRICS: expected HOST:PORT or off, "
                                   "got 'localhost'")
    assert not Path(env[mountd.SOCKET_ENV]).exists()


def _server_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment with a socket of the test's own, $WEENV_METRICS unset
    (the suite sets it off), then `extra`."""
    env = {k: v for k, v in os.environ.items() if k != exporter.ENV}
    return {**env, mountd.SOCKET_ENV: str(tmp_path / "m" / "mountd.sock"), **extra}


def _run_server(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`weenv mountd --detach ARGS` with `env` (`stop_after` stops what it started)."""
    return subprocess.run([sys.executable, "-m", "weenvfs", "mountd", "--detach", *args],
                          env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def stop_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Sockets whose servers are stopped at the end (by the pid they recorded)."""
    sockets: list[Path] = []
    yield sockets
    for sock in sockets:
        monkeypatch.setenv(mountd.SOCKET_ENV, str(sock))
        pid = mountd.stop()
        if pid is not None and daemon.process_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_taken_address_someone_chose_fails_the_server_in_one_line(
        tmp_path: Path, stop_after: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _server_env(tmp_path)
        stop_after.append(Path(env[mountd.SOCKET_ENV]))
        done = _run_server(env, "--metrics", f"127.0.0.1:{port}")
        assert done.returncode != 0
        assert done.stderr.strip() == (
            f"weenv: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use")
        # The same through $WEENV_METRICS.
        done = _run_server({**env, exporter.ENV: f"127.0.0.1:{port}"})
        assert done.returncode != 0 and "Address already in use" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    monkeypatch.setenv(mountd.SOCKET_ENV, env[mountd.SOCKET_ENV])
    with pytest.raises(WeenvError):  # no server was left running
        mountd.check_running()


def test_metrics_off_and_a_taken_default_serve_mounts_without_metrics(
        tmp_path: Path, stop_after: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    env = _server_env(tmp_path, **{exporter.ENV: "off"})
    sock = Path(env[mountd.SOCKET_ENV])
    stop_after.append(sock)
    assert _run_server(env).returncode == 0
    monkeypatch.setenv(mountd.SOCKET_ENV, str(sock))
    assert "; no metrics" in run_weenv("mountd", "--check").stdout
    assert not exporter.address_file(sock).exists()
    mountd.stop()

    # The built-in default, taken (by this test, or by whatever else holds it here).
    default = exporter.parse_address(exporter.DEFAULT_METRICS)
    assert default is not None
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            taken.bind((default.host, default.port))
            taken.listen()
        except OSError:
            pass  # someone else holds it: the same case
        env = _server_env(tmp_path)
        assert _run_server(env).returncode == 0
        assert "; no metrics" in run_weenv("mountd", "--check").stdout
        log = sock.with_suffix(".log").read_text()
        assert f"cannot serve metrics on {exporter.DEFAULT_METRICS}" in log


def test_held_neighbourhood_bytes_are_summed_over_the_live_mounts() -> None:
    """`weenv_neighbourhood_held_bytes`: the live daemons' `fetch.neighbourhoods.held_bytes`
    (a daemon without neighbourhoods, or from before the field, adds nothing)."""
    totals = Totals()
    for document in ({"fetch": {"neighbourhoods": {"held_bytes": 5 << 20}}},
                     {"fetch": {"neighbourhoods": {"held_bytes": 7}}}, {"fetch": {}}, {}):
        totals.add(document)
    assert totals.held_neighbours == (5 << 20) + 7
    assert totals.plus(totals).held_neighbours == 2 * totals.held_neighbours
