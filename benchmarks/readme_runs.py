"""The README's commands in coldstart_ref.py: `weenv run` and the Python API, from SeaweedFS.

What a user runs (issue 13's budgets are for this path): a new process per command, the
environment in an S3 store (SeaweedFS on 127.0.0.1, its data kept in BENCH_DIR/seaweed-ref),
a sandbox around the command, the node service (`weenv mountd`, started by this benchmark
with its own socket, as a node keeps it running) forking the mount daemons. Contenders:

- `weenv run`, cold, first run: no hint in the store; the run records one, which the node
  service publishes once the run has its answer (the default; not timed, as the packing after
  it: the benchmark waits for both before the next contender) and the recording is removed
  again afterwards;
- `weenv run`, cold, first run, seed hint: the same, the environment's only hint the seed
  `weenv convert` records from a Python image's own command (`python3` with no input: the
  interpreter's start-up; tools/hint_command.py), recorded once at setup;
- `weenv run`, cold, hint: the hint recorded once at setup (`weenv hints record`) is the
  environment's `latest`, as it is after a first run anywhere;
- `weenv run`, warm: the same command again at once (the node service keeps the mount warm),
  the median of WARM_RUNS runs in a row, each timed alone (as coldstart_ref.py's warm
  contenders, local disk's included);
- Python API, cold, first run: `Environment.open` + `exec` + `close` in a new interpreter.

Bytes fetched: a first run's recording mount is gone (its hint published) before its stats
can be read, so the first run's bytes are taken once per benchmark, untimed, from the same
command with `--no-record-hint` (recording changes nothing that is fetched), whose mount the
node service keeps; the hint run's from its own mount.

Cold means: the benchmark's shared mounts evicted, its node service started afresh with
the store's client made (`forget_environments`: the environment unknown to it), the node
cache emptied, the page cache dropped and the weenv software read back (a node keeps it
warm, as Docker's daemon).
Must not: time anything but these contenders, or touch the node's own mounts and service.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _mounting import (
    BENCH_DIR,
    Published,
    drop_caches,
    evict_shared_mounts,
    forget_environments,
    mount_server,
    weenv,
)
from weenv_peer import mirror, point_hint_tag, start_seaweed

from weenvfs.errors import RefNotFound
from weenvfs.format.refs import SEED_TAG
from weenvfs.fuse.commands import read_stats
from weenvfs.native_programs import weenv_command
from weenvfs.runtime.mounts import list_mounts
from weenvfs.store import open_store
from weenvfs.store.repository import Repository

HINT_TAG = "bench-readme-2"  # -2: recorded since the native server reports every chunk read (12-05)
WARM_RUNS = 3  # a warm contender's sample: the median of this many runs in a row
SEED_KEPT = "bench-seed"  # where the seed is kept between runs (tag `seed` only while timed)
API_SCRIPT = """
import sys
from weenvfs.runtime import Environment
with Environment.open(sys.argv[1], store=sys.argv[2], cache=sys.argv[3]) as env:
    result = env.exec(["/usr/bin/python3", "-c", sys.argv[4]], timeout=900)
sys.exit(result.exit_code)
"""


class ReadmeRuns:
    """The contenders above, for environment `pub` mirrored into SeaweedFS."""

    def __init__(self, stack: contextlib.ExitStack, pub: Published, profile: str, code: str,
                 work: Path) -> None:
        self.code, self.work = code, work
        self.cache = work / "readme-cache"
        server = start_seaweed(BENCH_DIR / "seaweed-ref")
        stack.callback(server.stop)
        self.url = server.url(f"ref-{profile}")
        copied = mirror(str(pub.store), self.url)
        if copied:
            print(f"copied {copied / 1e6:.0f} MB of {pub.ref} into SeaweedFS", flush=True)
        self.ref = pub.ref
        stack.enter_context(mount_server(work / "mountd"))  # and shared mounts of our own
        with open_store(self.url) as store:
            self.env_digest, _ = Repository(store).resolve_env(self.ref)
        self.hint = self._recorded_hint()
        self.seed = self._recorded_seed()
        self._first_bytes: int | None = None

    def _recorded_hint(self) -> str:
        """The hint of the workload (recorded once, kept under HINT_TAG; again if the kept
        one predates file records, which a replay reads into the page cache; packed if it
        predates packs, as `weenv hints record` and a first run now do)."""
        with open_store(self.url) as store:
            repo = Repository(store)
            with contextlib.suppress(RefNotFound):
                digest = repo.get_tag("hints", self.env_digest, HINT_TAG)
                hint = repo.get_hint(digest)
                if hint.files and hint.pack is not None:
                    return digest
                if hint.files:
                    print(f"packing the hint of {self.ref} (once)", flush=True)
                    weenv("hints", "pack", "--store", self.url, "--tag", HINT_TAG, self.ref)
                    return repo.get_tag("hints", self.env_digest, HINT_TAG)
        print(f"recording the hint of {self.ref} (once)", flush=True)
        weenv("hints", "record", "--replace", "--store", self.url, "--cache", str(self.cache),
              "--tag", HINT_TAG, self.ref, "/usr/bin/python3", "-c", self.code)
        evict_shared_mounts()
        with open_store(self.url) as store:
            return Repository(store).get_tag("hints", self.env_digest, HINT_TAG)

    def _recorded_seed(self) -> str:
        """The seed hint, as `weenv convert` records it from an image whose command is
        `python3` (run with no input; recorded once, kept under SEED_KEPT, packed). Recorded
        here with `weenv hints record` (the same reads: convert runs it in a sandbox)."""
        with open_store(self.url) as store, contextlib.suppress(RefNotFound):
            return Repository(store).get_tag("hints", self.env_digest, SEED_KEPT)
        print(f"recording the seed hint of {self.ref} (once)", flush=True)
        subprocess.run([*weenv_command(), "hints", "record", "--replace", "--store", self.url,
                        "--cache", str(self.cache), "--tag", SEED_KEPT, self.ref,
                        "/usr/bin/python3"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       check=True)
        evict_shared_mounts()
        with open_store(self.url) as store:
            return Repository(store).get_tag("hints", self.env_digest, SEED_KEPT)

    def _set_seed(self, enabled: bool) -> None:
        with open_store(self.url) as store:
            point_hint_tag(Repository(store), self.env_digest, self.seed if enabled else None,
                           SEED_TAG)

    def _set_hint(self, enabled: bool) -> None:
        with open_store(self.url) as store:
            point_hint_tag(Repository(store), self.env_digest, self.hint if enabled else None)

    def _cold(self) -> None:
        forget_environments(self.url, self.cache)
        shutil.rmtree(self.cache, ignore_errors=True)
        drop_caches()
        subprocess.run([sys.executable, "-c", "import weenvfs.cli, weenvfs.runtime.commands, "
                        "weenvfs.runtime.environment, weenvfs.fuse.mount, boto3"], check=True)

    def _time(self, argv: list[str]) -> float:
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"{' '.join(argv[:4])} ... failed ({done.returncode}): "
                     f"{done.stderr.strip()[-1500:]}")
        return seconds

    def _run_argv(self) -> list[str]:
        return [*weenv_command(), "run", "--store", self.url, "--cache", str(self.cache),
                self.ref, "/usr/bin/python3", "-c", self.code]

    def run_first(self) -> dict[str, float]:
        """`weenv run`, cold, with no hint in the store (the run records one)."""
        self._set_hint(False)
        self._set_seed(False)
        self._cold()
        seconds = self._time(self._run_argv())
        name = "weenv run (README), cold, first run"
        wait_for_recordings()
        wait_for_packing()  # the hint it published is packed in the background: not timed
        self._set_hint(False)  # what this run published: the next first run finds none
        if self._first_bytes is None:
            self._first_bytes = self._first_run_bytes()
            return {name: seconds, f"bytes: {name}": self._first_bytes}
        return {name: seconds}

    def _first_run_bytes(self) -> int:
        """What a first run fetches (untimed): the same command, cold, with no hint in the
        store, not recording one, so that its mount stays for `weenv stats`."""
        self._cold()
        argv = self._run_argv()
        argv.insert(argv.index("run") + 1, "--no-record-hint")
        self._time(argv)
        fetched = self.fetched()
        evict_shared_mounts()
        return fetched

    def run_first_seeded(self) -> dict[str, float]:
        """`weenv run`, cold, first run of an environment whose only hint is the seed."""
        self._set_hint(False)
        self._set_seed(True)
        try:
            self._cold()
            seconds = self._time(self._run_argv())
            wait_for_recordings()
            wait_for_packing()
        finally:
            self._set_hint(False)  # what this run published
            self._set_seed(False)
        return {"weenv run (README), cold, first run, seed hint": seconds}

    def run_hint(self) -> dict[str, float]:
        """`weenv run`, cold, with the recorded hint; then the same again, warm."""
        self._set_hint(True)
        self._cold()
        seconds = self._time(self._run_argv())
        fetched = self.fetched()
        warm = statistics.median(self._time(self._run_argv()) for _ in range(WARM_RUNS))
        name = "weenv run (README), cold, hint"
        return {name: seconds, f"bytes: {name}": fetched, "weenv run (README), warm": warm}

    def api_first(self) -> dict[str, float]:
        """`Environment.open` + `exec` in a new interpreter, cold, no hint in the store."""
        self._set_hint(False)
        self._cold()
        seconds = self._time([sys.executable, "-c", API_SCRIPT, self.ref, self.url,
                              str(self.cache), self.code])
        wait_for_recordings()
        wait_for_packing()
        self._set_hint(False)
        return {"Python API, cold, first run": seconds}

    def fetched(self) -> int:
        """Bytes the node's shared mounts fetched so far (their `weenv stats`)."""
        return sum(int(read_stats(str(mount.mountpoint))["fetch"]["bytes_fetched"])
                   for mount in list_mounts())


def wait_for_recordings(timeout: float = 120.0) -> None:
    """Wait until no recording mount is left (a first run leaves its own to the node
    service, which unmounts it after the run's answer and its daemon publishes then)."""
    deadline = time.monotonic() + timeout
    while any(m.record for m in list_mounts()):
        if time.monotonic() > deadline:
            print("warning: a recording mount is still publishing", file=sys.stderr)
            return
        time.sleep(0.05)


def wait_for_packing(timeout: float = 120.0) -> None:
    """Wait until no `weenv hints pack` runs (a first run's recording mount starts one once
    it published its hint; the next contender must not share the CPUs with it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = subprocess.run(["pgrep", "-f", "weenvfs.* hints pack "], capture_output=True)
        if busy.returncode != 0:
            return
        time.sleep(0.1)
    print("warning: a hint is still being packed", file=sys.stderr)


def readme_steps(runs: ReadmeRuns, record: Callable[[dict[str, float]], None]
                 ) -> list[Callable[[], None]]:
    """The steps coldstart_ref.py rotates through: each hands its samples to `record` (times
    by contender; `bytes: CONTENDER` the bytes its mounts fetched)."""
    return [lambda: record(runs.run_first()), lambda: record(runs.run_first_seeded()),
            lambda: record(runs.run_hint()), lambda: record(runs.api_first())]
