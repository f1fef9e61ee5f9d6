#!/usr/bin/env python3
"""Benchmark cold start against Docker: time-to-ready, bytes to ready, update cost, RL tax.

The workloads are a family of SWE-style task environments (benchmarks/workloads.py: Debian
minbase, a python layer, a packages layer with numpy/pandas/scipy/pytest/requests, and one
small layer per task holding a real project's git repository and test file), the same layer
tars for both peers. Every server runs on this machine, started by this script:
- Docker: Debian's dockerd (`--bridge=none --iptables=false --ip-masq=false`, own data root)
  and docker-registry on 127.0.0.1; the images pushed there once (docker_peer.py). Cold =
  every image removed and the page cache dropped.
- WeEnv: SeaweedFS (S3) on 127.0.0.1 holding the groups and environments; sandboxes from
  `weenvfs.runtime.Environment` (runc over the lazy FUSE mount); cold = node cache emptied
  and page cache dropped (with --other-chunks, the cache then holds that many chunks of
  environments outside the benchmark, as a node that ran others does); with and without the
  recorded prefetch hint (weenv_peer.py). The node runs `weenv mountd` (resident like
  dockerd: mount daemons fork from it) unless --no-mountd.
- Then the same over a shaped link: both servers in a network namespace behind a veth pair
  shaped by tbf plus a delaying relay (default 1 Gbit/s, 2 ms RTT; netshape.py).
Figures, each a ratio of the two systems in the same run, repeated, median and spread:
1. time-to-ready (start to the first task command's exit, `python3 -c "import numpy,
   pandas"`) on a cold node and on a warm node (another task ran before), for N concurrent
   environments; 2. bytes moved to get there; 3. the cost of bumping one shared component
   for N task environments (coldstart_update.py); 4. the environment's share of a simulated
   RL iteration (coldstart_ready.py). Tables on stdout, JSON in benchmarks/results/, plots
   in docs/ (coldstart_report.py).

Must not: assert anything about the numbers; it reports them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from _common import add_common_args, compile_project, describe_machine, repeats_for, write_json
from _mounting import BENCH_DIR, can_drop_caches, mount_server
from coldstart_ready import Contender, Log, ideal_task, ready_rounds, rl_rounds
from coldstart_report import DOCS, plot_all, report, summarize
from coldstart_update import seed_docker, stamped_layer, update_docker, update_weenv
from docker_peer import (
    DOCKER,
    Dockerd,
    DockerPeer,
    Registry,
    RegistryMeter,
    docker_unavailable,
    push_family,
)
from netshape import ShapedLink, netshape_unavailable
from weenv_peer import (
    FetchMeter,
    WeenvPeer,
    mirror,
    publish_family,
    record_hints,
    set_hints,
    start_seaweed,
)
from workloads import Family, build_family, image_layers

NAME = "coldstart"
FULL_REPEATS = 3
EXAMPLES = """\
examples:
  # full run: N = 1, 8, 32; update of 50 tasks; RL iteration of 8 and 32; shaped link too
  .venv/bin/python benchmarks/coldstart.py
  # a few minutes: N = 1, 8; update of 5 tasks; RL iteration of 4; 1 round
  .venv/bin/python benchmarks/coldstart.py --quick
  # the RL iteration of 32 on a node whose cache holds 25,000 chunks of other environments
  .venv/bin/python benchmarks/coldstart.py --only rl --rl-k 32 --other-chunks 25000
  # WeEnv only, on a tiny tree (what tests/test_coldstart_smoke.py runs)
  .venv/bin/python benchmarks/coldstart.py --quick --smoke --peers weenv --no-plots
"""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, FULL_REPEATS)
    add = parser.add_argument
    add("--smoke", action="store_true", help="a tiny workload (seconds): proves the script runs")
    add("--peers", default="docker,weenv", help="docker and/or weenv (default both)")
    add("--n", type=_ints, default=None, help="concurrent environments (default 1,8,32; "
        "1,8 with --quick)")
    add("--shaped-n", type=_ints, default=None, help="N over the shaped link (default 1,8; "
        "1 with --quick)")
    add("--update-n", type=int, default=None, help="task images to republish (default 50, "
        "5 with --quick)")
    add("--rl-k", type=_ints, default=None, help="environments per RL iteration (default "
        "8,32; 4 with --quick)")
    add("--think", type=float, default=None, help="seconds each rollout runs after its "
        "commands (default 30, 5 with --quick)")
    add("--rate-mbit", type=float, default=1000.0, help="shaped link rate (default 1000)")
    add("--rtt-ms", type=float, default=2.0, help="shaped link round trip (default 2)")
    add("--no-shaped", action="store_true", help="skip the shaped link")
    add("--no-mountd", action="store_true", help="WeEnv without its resident mount server "
        "(`weenv mountd`): each mount daemon starts a new interpreter")
    add("--lower", choices=("layers", "merged"), default="layers",
        help="WeEnv sandboxes over a shared mount per group (layers, default) or one mount "
        "per environment (merged)")
    add("--other-chunks", type=int, default=0, metavar="N",
        help="chunks of other environments in WeEnv's node cache at each turn's start "
        "(default 0: a node that ran nothing else; sparse files, never read)")
    add("--reference", action=argparse.BooleanOptionalAction, default=None,
        help="also the cold start of DESIGN.md's reference tree (default: on, off with --quick)")
    add("--only", default="ready,update,rl", help="figures to run: ready,update,rl")
    add("--no-plots", action="store_true", help="do not draw the plots into docs/")
    add("--plots-dir", type=Path, default=DOCS, help=f"where plots go (default {DOCS})")
    add("--replot", type=Path, metavar="JSON", default=None,
        help="print the tables and draw the plots of an earlier run's JSON, run nothing")
    return parser.parse_args(argv)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    quick, smoke = args.quick or args.smoke, args.smoke
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - {"docker", "weenv"}
    if unknown or not peers:
        sys.exit(f"coldstart.py: --peers takes docker and/or weenv, not {args.peers}")
    n = args.n or ([1, 2] if smoke else [1, 8] if quick else [1, 8, 32])
    return {
        "quick": args.quick, "smoke": smoke, "peers": peers, "n": n,
        "repeats": repeats_for(args, FULL_REPEATS),
        "shaped_n": [] if args.no_shaped else
        (args.shaped_n or ([] if smoke else [1] if quick else [1, 8])),
        "update_n": args.update_n or (2 if smoke else 5 if quick else 50),
        "rl_k": args.rl_k or ([2] if smoke else [4] if quick else [8, 32]),
        "think": args.think if args.think is not None else (0.2 if smoke else 5.0 if quick
                                                             else 30.0),
        "reference": (not quick) if args.reference is None else args.reference and not smoke,
        "only": set(args.only.split(",")),
        "rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "mountd": not args.no_mountd,
        "lower": args.lower, "other_chunks": args.other_chunks,
    }


def _check(s: dict[str, Any]) -> None:
    if not can_drop_caches():
        sys.exit("coldstart.py: needs root (it drops the page cache, mounts, runs sandboxes)")
    if "docker" in s["peers"]:
        why = docker_unavailable()
        if why:
            sys.exit(f"coldstart.py: cannot measure Docker: {why} (or pass --peers weenv)")
    if s["shaped_n"]:
        why = netshape_unavailable()
        if why:
            sys.exit(f"coldstart.py: no shaped link: {why} (or pass --no-shaped)")


class Run:
    """The servers, peers and results of one run; `stack` undoes everything."""

    def __init__(self, s: dict[str, Any], family: Family, work: Path,
                 stack: contextlib.ExitStack) -> None:
        self.s, self.family, self.work, self.stack = s, family, work, stack
        self.root = family.root
        self.tasks = [f"task-{k}" for k in range(family.tasks)]
        hinted = max([*s["n"], *s["rl_k"], *s["shaped_n"]]) + 1
        self.hinted = self.tasks[:hinted] + (["reference"] if s["reference"] else [])
        self.results: dict[str, Any] = {"ready": {}, "rl": {}, "update": {}}
        self.seaweed_lo: Any = None
        self.url = ""
        self.dockerd: Dockerd | None = None
        self.registry: Registry | None = None

        self.say = Log(lambda message: print(message, flush=True))
        self.checkpoint: Any = lambda: None  # writes the JSON so far (set by main)

    # -- servers ----------------------------------------------------------------------------

    def start_weenv(self) -> None:
        # The node's resident mount server, as dockerd is Docker's (unless --no-mountd), and
        # shared mounts of our own (a cold turn evicts them all: weenv_peer.reset_cold).
        self.stack.enter_context(mount_server(self.work / "mountd", self.s["mountd"]))
        # --smoke: a throw-away store (fast to stop, nothing kept); else one kept between runs
        folder = self.work if self.s["smoke"] else self.root / "seaweed-lo"
        self.seaweed_lo = start_seaweed(None if self.s["smoke"] else folder)
        self.stack.callback(self.seaweed_lo.stop)
        self.url = self.seaweed_lo.url("swe")
        publish_family(self.family, self.url, folder, self.hinted + self.tasks[len(self.hinted):])
        record_hints(self.family, self.url, self.hinted, self.work)

    def start_docker(self) -> None:
        self.dockerd = Dockerd(self.root / "docker").start()
        self.stack.callback(self.dockerd.stop)
        self.registry = Registry(self.root / "registry").start()
        self.stack.callback(self.registry.stop)
        images = self.tasks + ["python"] + (["reference"] if self.s["reference"] else [])
        push_family(self.family, self.registry, images)

    def contenders(self, registry: Registry | None, url: str) -> dict[str, Contender]:
        out: dict[str, Contender] = {}
        if "docker" in self.s["peers"] and registry is not None and self.dockerd is not None:
            out["docker"] = Contender(DockerPeer(self.dockerd, registry.host),
                                      RegistryMeter(registry))
        if "weenv" in self.s["peers"]:
            cache = self.work / "node-cache"
            for hints in (False, True):
                peer = WeenvPeer(url, cache, self.hinted, hints, self.s["lower"],
                                 self.s["other_chunks"])
                out[peer.name] = Contender(peer, FetchMeter(peer))
        return out

    def warm_extra(self) -> list[list[str]]:
        if self.dockerd is None:
            return []
        return [["env", f"DOCKER_HOST=unix://{self.dockerd.socket}", DOCKER, "version"]]

    # -- figures ----------------------------------------------------------------------------

    def ready(self, label: str, contenders: dict[str, Contender], ns: list[int]) -> None:
        self.say(f"\nfigure 1-2: time-to-ready and bytes, {label}")
        by_n = self.results["ready"].setdefault(label, {})
        for n in ns:
            by_n[str(n)] = ready_rounds(contenders, self.family, [f"task-{i}" for i in
                                        range(1, n + 1)], self.s["repeats"],
                                        warm_extra=self.warm_extra(), log=self.say)
            self.checkpoint()
        if self.s["reference"] and label == "loopback":
            self.say("reference tree (DESIGN.md), cold, N=1")
            self.results["reference"] = ready_rounds(
                contenders, self.family, ["reference"], self.s["repeats"],
                scenarios=("cold",), warm_extra=self.warm_extra(), log=self.say)

    def rl(self, contenders: dict[str, Contender]) -> None:
        self.say("\nfigure 4: RL iteration")
        ideal = {}
        for name, c in contenders.items():
            c.peer.prepare()
            ideal[name] = ideal_task(c.peer, self.family)
        runs: dict[str, Any] = {}
        self.results["rl"] = {"think_s": self.s["think"], "ideal_task_s": ideal, "runs": runs}
        for k in self.s["rl_k"]:
            runs[str(k)] = rl_rounds(contenders, self.family, k, self.s["think"],
                                     self.s["repeats"], self.warm_extra(), self.say)
            self.checkpoint()

    def update(self) -> None:
        n = self.s["update_n"]
        self.say(f"\nfigure 3: update one shared component for {n} task environments")
        peer = None
        if "docker" in self.s["peers"] and self.dockerd and self.registry:
            peer = DockerPeer(self.dockerd, self.registry.host)
            seed_docker(peer, self.registry, self.family, n, self.work)
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(self.s["repeats"]):
            run = f"{int(time.time())}-{r}"
            tar = stamped_layer(self.family, run, self.work / "packages-v2-stamped.tar")
            jobs: dict[str, Any] = {}
            if peer is not None and self.registry is not None:
                jobs["docker"] = partial(update_docker, peer, self.registry, self.family, n,
                                         run, tar, self.work)
            if "weenv" in self.s["peers"]:
                jobs["weenv"] = partial(update_weenv, self.url, self.family, n, run, tar)
            for name, job in jobs.items():
                try:
                    out = job()
                except Exception as error:  # a result too; the run goes on
                    runs.setdefault(name, []).append({"error": f"{type(error).__name__}: "
                                                               f"{str(error)[-600:]}"})
                    self.say(f"  {name:7} FAILED: {runs[name][-1]['error']}")
                    continue
                runs.setdefault(name, []).append(out)
                self.say(f"  {name:7} {out['total_s']:7.1f} s, "
                         f"{out['bytes_uploaded'] / 1e6:8.1f} MB uploaded")
            tar.unlink()
        self.results["update"] = {"n": n, "runs": runs}

    def shaped(self) -> None:
        link = self.stack.enter_context(ShapedLink(self.s["rate_mbit"], self.s["rtt_ms"]))
        label = f"shaped link ({link.label})"
        registry = None
        contenders: dict[str, Contender] = {}
        if self.dockerd is not None and self.registry is not None:
            registry = Registry(self.registry.root, link.server_ip, link.netns).start()
            self.stack.callback(registry.stop)
            host = f"127.0.0.1:{link.proxy(registry.port).port}"
            contenders["docker"] = Contender(DockerPeer(self.dockerd, host),
                                             RegistryMeter(registry))
        url = ""
        if "weenv" in self.s["peers"]:
            seaweed = start_seaweed(self.root / "seaweed-ns", like=self.seaweed_lo,
                                    netns=(link.prefix(), link.server_ip))
            self.stack.callback(seaweed.stop)
            copied = mirror(self.url, seaweed.url("swe"))
            self.say(f"copied {copied / 1e6:.0f} MB into the shaped link's store")
            proxy = link.proxy(seaweed.ports["s3"])
            url = seaweed.url("swe").replace(seaweed.endpoint, f"http://127.0.0.1:{proxy.port}")
            contenders.update(self.contenders(None, url))
        for c in contenders.values():
            c.meter = _LinkMeter(c.meter, link) if c.meter else None
        self.ready(label, contenders, self.s["shaped_n"])
        if url:
            set_hints(url, self.hinted, False)


def _cleanup(work: Path) -> None:
    """Remove the run's folder, unless the run failed: then its logs are worth reading."""
    if sys.exc_info()[0] is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"coldstart.py: failed; logs kept in {work}", file=sys.stderr)


class _LinkMeter:
    """A meter plus the bytes the shaped link carried to the node."""

    def __init__(self, inner: Any, link: ShapedLink) -> None:
        self.inner, self.link, self.base = inner, link, 0

    def begin(self) -> None:
        self.inner.begin()
        self.base = self.link.rx_bytes()

    def read(self, envs: Any) -> dict[str, Any]:
        return {**self.inner.read(envs), "link_bytes": self.link.rx_bytes() - self.base}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return _replot(args)
    s = _settings(args)
    _check(s)
    compile_project()  # before anything is timed (_common.py)
    print(describe_machine())
    tasks = max([*s["n"], *s["shaped_n"], s["update_n"], *s["rl_k"]]) + 1
    family = build_family(tasks, smoke=s["smoke"], reference=s["reference"])
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="coldstart-", dir=BENCH_DIR))
    params = {k: sorted(v) if isinstance(v, set) else v for k, v in s.items()}
    with contextlib.ExitStack() as stack:
        stack.callback(_cleanup, work)
        run = Run(s, family, work, stack)
        if "weenv" in s["peers"]:
            run.start_weenv()
        if "docker" in s["peers"]:
            run.start_docker()
        contenders = run.contenders(run.registry, run.url)
        run.checkpoint = lambda: _save(args, {**params, "partial": True}, run.results,
                                       family, quiet=True)
        # Longest last; the JSON is rewritten after each figure, so an interrupted run
        # keeps what it measured (params.partial says so).
        steps = [("ready", lambda: run.ready("loopback", contenders, s["n"])),
                 ("update", run.update),
                 ("ready", run.shaped if s["shaped_n"] else lambda: None),
                 ("rl", lambda: run.rl(contenders))]
        for figure, step in steps:
            if figure in s["only"]:
                step()
                run.checkpoint()
        if run.url:
            set_hints(run.url, run.hinted, False)
    results = _save(args, params, run.results, family)
    report(results)
    if not args.no_plots:
        for plot in plot_all(results, args.plots_dir):
            print(f"wrote {plot}")
    return 0


def _replot(args: argparse.Namespace) -> int:
    """--replot: the tables and plots of a written JSON (its summary is recomputed)."""
    document = json.loads(args.replot.read_text())
    results = document["results"]
    layers = results["family"]["layers"]
    results["summary"] = summarize(
        results, lambda image: sum(layers[name]["bytes"] for name in image_layers(image)))
    report(results)
    if not args.no_plots:
        for plot in plot_all(results, args.plots_dir):
            print(f"wrote {plot}")
    return 0


def _save(args: argparse.Namespace, params: dict[str, Any], results: dict[str, Any],
          family: Family, quiet: bool = False) -> dict[str, Any]:
    """Summarize `results` and write the JSON; returns the results with their summary."""
    results["family"] = {"root": str(family.root),
                         "layers": {n: {"bytes": la.size, "whiteouts": la.whiteouts}
                                    for n, la in family.layers.items()},
                         "image_bytes": family.image_bytes("task-1")}
    results["summary"] = summarize(results, family.image_bytes)
    path = write_json(NAME, args.out, params, results)
    if not quiet:
        print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
