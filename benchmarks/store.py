#!/usr/bin/env python3
"""Benchmark time-to-ready from the local store vs SeaweedFS over loopback vs over a shaped link.

Owns one measurement (issue 5): the time from `weenv mount` to the end of the first command,
`chroot MOUNTPOINT python3 -c "import json, sqlite3"`, for the `python` sample environment
(`weenvfs.tools.sample`: Debian minbase + python3), with a cold node cache (a new folder each
run), a new mount (no kernel page cache of its files) and the store's files dropped from the
page cache (posix_fadvise DONTNEED on every file of the local store and of each SeaweedFS
folder). The environment is published into three stores:
- `local`: a store directory;
- `s3-loopback`: SeaweedFS (`weed server -s3`, weenvfs.store.seaweed) on 127.0.0.1;
- `s3-link`: the same server in a network namespace of its own, reached over a veth pair
  shaped with `tc tbf` to `--rate` (default 1 Gbit/s) in each direction, with `--rtt-ms`
  (default 2 ms) of round-trip delay. This kernel has no `netem`, so the delay is added by a
  TCP relay in this process that holds every segment for RTT/2 in each direction (plus one
  RTT before it connects upstream, standing in for the TCP handshake).
Each store is measured without and with the workload's prefetch hint (recorded once with
`weenv hints record`, replayed by the mount in the background), and with ranged-GET coalescing
on (the default) and off (the hidden `weenv mount --no-coalesce`: one GET per chunk).
Reported: the time, its spread, the ratio to `local` in the same setting (median of per-round
ratios), and the requests (of them prefetch), bytes and chunks the mount fetched.

Must not: assert anything about the numbers, or leave a mount, a namespace or a server
behind (everything is torn down in `finally`, processes by pid).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from _common import (
    Timing,
    add_common_args,
    compile_project,
    describe_machine,
    paired_ratio,
    print_table,
    repeats_for,
    timed,
    write_json,
)
from _mounting import mount_server
from tcp_relay import relay

from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.store.seaweed import SeaweedFS
from weenvfs.tools.builder import build_group, open_source
from weenvfs.tools.publish import compose_env
from weenvfs.tools.sample import sample_tree

NAME = "store"
FULL_REPEATS = 3
ENV = "bench-py:v1"
WORKLOAD = ["python3", "-c", "import json, sqlite3"]
WEENV = [sys.executable, "-m", "weenvfs"]
EXAMPLES = """examples:
  .venv/bin/python benchmarks/store.py                  # as published in docs/benchmarks.md
  .venv/bin/python benchmarks/store.py --quick          # smoke run: 1 round
  .venv/bin/python benchmarks/store.py --rate 100mbit --rtt-ms 20 --out /tmp
"""


# -- the shaped link ----------------------------------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def shaped_namespace(rate: str) -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair in 10.213.N.0/30 (N free here),
    both ends shaped by tbf to `rate`; yields (namespace, its address). Removed at exit."""
    tag = f"{os.getpid() % 0xFFFF:04x}"
    ns, veth = f"weenv-bench-{tag}", f"wbs{tag}"
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    subnet = next(n for n in range(40, 250) if f"10.213.{n}." not in used)
    outer, inner = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    shape = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{outer}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        for args in (["addr", "add", f"{inner}/30", "dev", "eth0"], ["link", "set", "eth0", "up"],
                     ["link", "set", "lo", "up"]):
            _ip("netns", "exec", ns, "ip", *args)
        subprocess.run(["tc", "qdisc", "add", "dev", veth, *shape], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *shape],
                       check=True)
        yield ns, inner
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


class NamespacedSeaweedFS(SeaweedFS):
    """`weed server -s3` run with `ip netns exec NS`, listening on `address` only."""

    def __init__(self, namespace: str, address: str) -> None:
        super().__init__()
        self.namespace, self.address = namespace, address

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.ports['s3']}"

    def _command(self, data: Path, config: Path) -> list[str]:
        cmd = [arg.replace("127.0.0.1", self.address) for arg in super()._command(data, config)]
        return ["ip", "netns", "exec", self.namespace, *cmd, "-master.telemetry=false"]


# -- stores and runs ----------------------------------------------------------------------------


@dataclass
class Contender:
    """One store, reached one way, with or without its hint, with coalescing on or off."""

    store: str
    url: str
    env: dict[str, str]
    page_cache_dirs: list[Path]
    hint: bool = False
    coalesce: bool = True
    samples: list[float] = field(default_factory=list)
    fetch: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.store + " +hint" * self.hint + " no-coalesce" * (not self.coalesce)


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ (where boto3 finds the server's keys) for the block."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def publish(url: str, tree: Path, env: dict[str, str]) -> None:
    """Build the tree as one group, compose it as ENV in the store at `url`, and record the
    workload's prefetch hint (`weenv hints record`, tag latest)."""
    with environment(env), open_store(url, create=True) as store:
        repo = Repository(store)
        build_group(open_source(tree), repo, "bench-py-os", "v1")
        compose_env(repo, "bench-py", "v1", ["bench-py-os:v1"])
    weenv("hints", "record", ENV, "--store", url, "--", *WORKLOAD, env=env)


def drop_page_cache(dirs: list[Path]) -> None:
    """Evict every file under `dirs` from the page cache (only those files: the machine is
    shared, so no global drop_caches)."""
    os.sync()
    for top in dirs:
        for root, _, files in os.walk(top):
            for name in files:
                try:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    continue  # a socket, or gone
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def weenv(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([*WEENV, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"weenv {' '.join(args[:2])} failed: {done.stderr.strip()}")
    return done.stdout


def run_once(c: Contender, work: Path) -> None:
    """One cold run: fresh cache and mount point, store files out of the page cache; the
    timed part is `weenv mount` + the workload."""
    run = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    mp = run / "mnt"
    mp.mkdir()
    drop_page_cache(c.page_cache_dirs)
    extra = ["--hint", "latest" if c.hint else "none"] + ["--no-coalesce"] * (not c.coalesce)

    def ready() -> None:
        weenv("--log-file", str(run / "mount.log"), "mount", ENV, str(mp), "--store", c.url,
              "--cache", str(run / "cache"), *extra, env=c.env)
        subprocess.run(["chroot", str(mp), *WORKLOAD], check=True, capture_output=True,
                       timeout=600)

    try:
        seconds, _ = timed(ready)
        c.samples.append(seconds)
        c.fetch.append(json.loads(weenv("stats", "--json", str(mp)))["fetch"])
    finally:
        subprocess.run([*WEENV, "umount", str(mp)], capture_output=True, check=False)
        shutil.rmtree(run, ignore_errors=True)


def rtt_probe(url: str, env: dict[str, str], count: int = 20) -> float:
    """Median seconds of a one-byte GET (connection reused) through `url`."""
    with environment(env), open_store(url) as store:
        store.put("tags/probe/x/y", b"1")
        samples = [timed(lambda: store.get("tags/probe/x/y"))[0] for _ in range(count)]
        store.delete("tags/probe/x/y")
    return median(samples)


def setup_contenders(stack: ExitStack, args: argparse.Namespace, tree: Path, work: Path,
                     notes: dict[str, Any]) -> list[Contender]:
    """Publish the environment into each store; return the contenders (each store without
    and with its hint, coalescing on and off)."""
    local = work / "store"
    publish(str(local), tree, {})
    stores = [("local", str(local), {}, [local])]
    loop = stack.enter_context(SeaweedFS())
    publish(loop.url(), tree, loop.env())
    stores.append(("s3-loopback", loop.url(), loop.env(), [loop.directory]))
    notes["rtt_loopback_ms"] = rtt_probe(loop.url(), loop.env()) * 1000
    reason = _link_unavailable()
    if reason:
        print(f"s3-link skipped: {reason}")
        notes["s3_link_skipped"] = reason
    else:
        ns, address = stack.enter_context(shaped_namespace(args.rate))
        far = stack.enter_context(NamespacedSeaweedFS(ns, address))
        publish(far.url(), tree, far.env())
        port = stack.enter_context(relay((address, far.ports["s3"]), args.rtt_ms / 2000,
                                         handshake=True))  # rtt / 2 each way
        url = f"s3://{far.bucket}?endpoint=http://127.0.0.1:{port}&region=us-east-1"
        stores.append(("s3-link", url, far.env(), [far.directory]))
        notes["rtt_link_ms"] = rtt_probe(url, far.env()) * 1000
    return [Contender(name, url, env, dirs, hint, co)
            for hint in (False, True) for co in (True, False) for name, url, env, dirs in stores]


def _link_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian package iproute2)"
    return None


def measure_all(contenders: list[Contender], repeats: int, work: Path) -> None:
    """`repeats` rounds; in each, every contender runs once, the first one rotating."""
    for r in range(repeats):
        order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
        for c in order:
            run_once(c, work)
            print(f"round {r + 1}: {c.name}: {c.samples[-1]:.2f} s, "
                  f"{c.fetch[-1]['requests']} requests", flush=True)


def summarize(contenders: list[Contender]) -> dict[str, Any]:
    base = {(c.hint, c.coalesce): Timing(tuple(c.samples))
            for c in contenders if c.store == "local"}
    out: dict[str, Any] = {}
    for c in contenders:
        t = Timing(tuple(c.samples))
        out[c.name] = {
            **t.as_dict(),
            "ratio_to_local": paired_ratio(t, base[c.hint, c.coalesce]),
            "prefetch_requests": median(f["prefetch"]["requests"] for f in c.fetch),
            "requests": median(f["requests"] for f in c.fetch),
            "bytes_fetched": median(f["bytes_fetched"] for f in c.fetch),
            "chunks_fetched": median(f["chunks_fetched"] for f in c.fetch),
            "fetch": c.fetch,
        }
    timings = {(c.store, c.hint, c.coalesce): Timing(tuple(c.samples)) for c in contenders}
    for c in contenders:  # against the same store and hint setting with coalescing on
        if not c.coalesce:
            out[c.name]["time_ratio_to_coalescing_on"] = paired_ratio(
                timings[c.store, c.hint, False], timings[c.store, c.hint, True])
    return out


def report(results: dict[str, Any], notes: dict[str, Any], repeats: int, tree_info: str) -> None:
    rows = [[name, r["median_s"], r["spread"], r["ratio_to_local"], int(r["requests"]),
             int(r["prefetch_requests"]), r["bytes_fetched"] / 1e6, int(r["chunks_fetched"])]
            for name, r in results.items()]
    print_table(
        f"time-to-ready (mount + `{' '.join(WORKLOAD)}`), {tree_info}, cold, "
        f"{repeats} round(s)",
        ["store", "median s", "spread", "vs local", "requests", "of them prefetch",
         "MB fetched", "chunks"], rows)
    pairs = [(name, results[name], results.get(name + " no-coalesce"))
             for name in results if not name.endswith("no-coalesce")]
    print_table("ranged-GET coalescing: off / on",
                ["store", "requests on", "requests off", "time off / on (paired)"],
                [[n, int(on["requests"]), int(off["requests"]), off["time_ratio_to_coalescing_on"]]
                 for n, on, off in pairs if off])
    print("\n" + ", ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}"
                           for k, v in notes.items()))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, FULL_REPEATS)
    parser.add_argument("--rate", default="1gbit", help="tbf rate of the link (default 1gbit)")
    parser.add_argument("--rtt-ms", type=float, default=2.0, help="round trip (default 2 ms)")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("benchmarks/store.py needs root (mount, chroot, network namespaces)",
              file=sys.stderr)
        return 2
    repeats = repeats_for(args, FULL_REPEATS)
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    tree = sample_tree(None, "python")
    files = sum(len(f) for _, _, f in os.walk(tree))
    work = Path(tempfile.mkdtemp(prefix="weenv-bench-store-", dir=args.work))
    notes: dict[str, Any] = {"rate": args.rate, "rtt_ms_configured": args.rtt_ms}
    try:
        with ExitStack() as stack:
            # A node service of the benchmark's own, never the node's (every run has a cache
            # folder of its own, so nothing it keeps in memory carries over).
            stack.enter_context(mount_server(work / "mountd"))
            contenders = setup_contenders(stack, args, tree, work, notes)
            measure_all(contenders, repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = summarize(contenders)
    report(results, notes, repeats, f"python sample ({files:,} files)")
    params = {"repeats": repeats, "tree": str(tree), "files": files, "workload": WORKLOAD,
              **notes}
    path = write_json(NAME, args.out, params, results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
