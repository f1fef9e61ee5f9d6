"""The provisioner sidecar: one trio loop per node that watches sandboxes and sets their limits.

Owns: the tick (sync registrations, read every cgroup, `policy.step`, hand changed limits to
writers, rewrite status.json, append to the event log), the writers, the event log and
`run_sidecar` (pid lock, signals). Must not: decide limits (policy.py) or know file formats
(the drivers).

Trio discipline: `tick()` is synchronous, so it runs atomically between awaits; reading cgroup
files is a few cheap kernel calls and stays on the loop. Limit writes can block while the
kernel reclaims, so each sandbox has at most one writer task, which runs `driver.apply` in a
thread (`trio.to_thread.run_sync`, bounded by a CapacityLimiter); a newer decision replaces a
pending one (latest wins), and a write stuck in reclaim delays no other sandbox. Those threads
are the only calls sent off the loop. A cgroup that vanishes is dropped (its run goes into the
history); a garbled file skips that sandbox for the tick; both are logged and the loop goes on.

Between ticks, `wake()` (SIGUSR1, sent by the registry after each change) takes registration
changes at once and rewrites the status: a new sandbox is watched from its first instant, and
an unregistering runtime learns within milliseconds that the run is in the history.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import trio

from .budget import step
from .cgroup_driver import Cgroup, CgroupDriver, CgroupGone, CgroupLimits, ProvisionError, Sample
from .history import DEFAULT_HISTORY_DIR, History
from .policy import (
    Bounds,
    Decision,
    PolicyConfig,
    SandboxState,
    default_bounds,
    initial_limits,
    initial_state,
    quantize,
)
from .registry import (
    DEFAULT_CPU,
    DEFAULT_MEM,
    Registration,
    node_config,
    pid_lock,
    registrations,
    write_json_atomic,
)
from .status import EventLog, Watched, status_document

log = logging.getLogger(__name__)

WRITE_DRAIN = 5.0  # seconds a stopping sidecar waits for writes under way
# A folder's mtime has the kernel's coarse clock granularity (milliseconds): two changes in
# one step share one mtime, so the spool is rescanned while its mtime is this recent.
SPOOL_SETTLE_NS = 1_000_000_000
WAKE_SIGNAL = signal.SIGUSR1


def node_memory(meminfo: str = "/proc/meminfo") -> int:
    """Default memory budget: MemTotal minus max(1 GiB, 10%) kept for the node itself."""
    with open(meminfo, encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                return total - max(1 << 30, total // 10)
    raise ProvisionError(f"no MemTotal in {meminfo}")


@dataclass
class SidecarConfig:
    """Settings of one sidecar (None: from the machine)."""

    spool: Path
    interval: float = 0.25
    cgroups: tuple[str, ...] = ()
    node_memory: int | None = None  # memory budget in bytes
    node_cpus: float | None = None  # cores; the CPU budget is this times cpu_overcommit
    event_log: Path | None = None  # default: <spool>/events.jsonl
    log_every_tick: bool = False
    history_dir: Path | None = DEFAULT_HISTORY_DIR
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    write_threads: int = 16


class Sidecar:
    """The node's provisioner: call `run()` inside trio, `stop()` to end it."""

    def __init__(
        self,
        config: SidecarConfig,
        driver: CgroupDriver,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.driver = driver
        config.spool.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.policy = replace(node_config(driver.version, config.policy), tick=config.interval)
        self.mem_budget = config.node_memory or node_memory()
        cpus = config.node_cpus or os.cpu_count() or 1
        self.cpu_budget = round(cpus * 1000 * self.policy.cpu_overcommit)
        self.cpu_cores = round(cpus * 1000)  # one sandbox's default ceiling
        self.history = History(config.history_dir)
        self.events = EventLog(config.event_log or config.spool / "events.jsonl")
        self.watched: dict[str, Watched] = {}
        self.states: dict[str, SandboxState] = {}
        self.ticks = 0
        self._pending: dict[str, CgroupLimits] = {}
        self._in_flight: set[str] = set()
        self._gone: set[tuple[str, float]] = set()  # registrations whose cgroup vanished
        self._spool_mtime = -1
        self._limiter = trio.CapacityLimiter(config.write_threads)
        self._stop = trio.Event()
        self._wake = trio.Event()
        self._last_overcommitted = False
        self._granted = (0, 0)  # memory and CPU granted at the last tick, for the status
        self.wake_signal: str | None = None  # set by whoever delivers wake-ups (run_sidecar)

    # --- the loop -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick every `interval` seconds until `stop()`; writers run in this nursery."""
        self.events.write(
            "start",
            driver=self.driver.describe(),
            interval=self.config.interval,
            mem_budget=self.mem_budget,
            cpu_budget=self.cpu_budget,
            policy=self.policy.__dict__,
        )
        self._adopt_cli_cgroups()
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                deadline = trio.current_time()
                while not self._stop.is_set():
                    self.tick(nursery)
                    deadline += self.config.interval
                    if deadline < trio.current_time():  # fell behind: do not burst
                        deadline = trio.current_time() + self.config.interval
                    await self._sleep_until(deadline)
                self._pending.clear()
                with trio.move_on_after(WRITE_DRAIN):  # let writes under way finish
                    while self._in_flight:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        finally:
            self._release_holds()
            self.events.write("stop", ticks=self.ticks)
            self.events.close()

    def _release_holds(self) -> None:
        """On v1, let the kernel's OOM killer act again: with no sidecar, nobody would raise
        the limit for a task waiting at it."""
        for key, state in self.states.items():
            if not state.limits.hold:
                continue
            try:
                self.driver.apply(self.watched[key].cgroup, replace(state.limits, hold=False))
            except (ProvisionError, OSError) as error:
                log.info("sandbox %s: cannot release its hold: %s", key, error)

    async def _sleep_until(self, deadline: float) -> None:
        """Wait for the next tick; registration changes signalled meanwhile are taken now."""
        with trio.move_on_at(deadline):
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                if self._stop.is_set():
                    return
                now = self.clock()
                self._sync_registrations(now, force=True)
                self._write_status(now, *self._granted)

    def stop(self) -> None:
        """End the loop after the current tick (call from the loop's trio thread)."""
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Take registration changes now, not at the next tick (call from the loop's thread)."""
        self._wake.set()

    def tick(self, nursery: trio.Nursery) -> None:
        """One tick: registrations, samples, policy, writes, status."""
        now = self.clock()
        self.ticks += 1
        self._sync_registrations(now)
        samples = self._read_all()
        result = step(self.policy, self.states, samples, self.mem_budget, self.cpu_budget, now)
        self.states = result.states
        for key, decision in result.decisions.items():
            self._act(nursery, self.watched[key], decision, samples.get(key))
        if result.overcommitted != self._last_overcommitted:
            self._last_overcommitted = result.overcommitted
            if result.overcommitted:
                log.warning(
                    "node over-committed: usage floors exceed the budgets "
                    "(memory %d of %d, cpu %d of %d)",
                    result.mem_granted,
                    self.mem_budget,
                    result.cpu_granted,
                    self.cpu_budget,
                )
            self.events.write(
                "node",
                overcommitted=result.overcommitted,
                mem_granted=result.mem_granted,
                cpu_granted=result.cpu_granted,
            )
        self._granted = (result.mem_granted, result.cpu_granted)
        self._write_status(now, result.mem_granted, result.cpu_granted)

    def _act(
        self, nursery: trio.Nursery, watched: Watched, decision: Decision, sample: Sample | None
    ) -> None:
        """Log one sandbox's decision and hand changed limits to its writer."""
        key = watched.sandbox_id
        if decision.changed:
            self.events.write(
                "decision",
                sandbox=key,
                reasons=list(decision.reasons),
                inputs=dict(decision.inputs),
                old=decision.old.to_json(),
                new=decision.new.to_json(),
                squeezed=decision.squeezed,
            )
        if decision.squeezed != watched.squeezed:
            self._log_squeeze(watched, decision.squeezed, decision.reasons)
        watched.reasons, watched.squeezed = decision.reasons, decision.squeezed
        # Unchanged limits are written again only if the last write failed.
        if decision.changed or (watched.applied != decision.new and key not in self._in_flight):
            self._dispatch(nursery, key, decision.new)
        if self.config.log_every_tick and sample is not None:
            self.events.write(
                "sample",
                tick=self.ticks,
                sandbox=key,
                env=watched.env,
                sample=sample.to_json(),
                limits=decision.new.to_json(),
            )

    # --- sandboxes coming and going -------------------------------------------------------

    def _sync_registrations(self, now: float, force: bool = False) -> None:
        folder = self.config.spool / "sandboxes"
        try:
            mtime = folder.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = 0
        settled = abs(time.time_ns() - mtime) > SPOOL_SETTLE_NS
        if mtime == self._spool_mtime and settled and not force:
            return
        self._spool_mtime = mtime
        current = registrations(self.config.spool)
        for key, watched in list(self.watched.items()):
            if key.startswith("cgroup:"):
                continue
            reg = current.get(key)
            if reg is None or reg.registered != watched.registered:
                self._drop(key, "unregister")
        self._gone &= {(k, r.registered) for k, r in current.items()}
        for key, reg in current.items():
            if key not in self.watched and (key, reg.registered) not in self._gone:
                self._add_registration(reg, now)

    def _add_registration(self, reg: Registration, now: float) -> None:
        try:
            cgroup = self.driver.resolve(reg.cgroups)
        except ProvisionError as error:
            log.warning("ignoring sandbox %s: %s", reg.sandbox_id, error)
            self._gone.add((reg.sandbox_id, reg.registered))
            return
        bounds = default_bounds(self.policy, self.mem_budget, self.cpu_cores)
        bounds = replace(
            bounds,
            mem_ceiling=reg.mem_ceiling or bounds.mem_ceiling,
            cpu_ceiling=reg.cpu_ceiling or bounds.cpu_ceiling,
        )
        self._watch(reg.sandbox_id, cgroup, reg.env, reg.registered, reg.initial, bounds, now)

    def _watch(
        self,
        key: str,
        cgroup: Cgroup,
        env: str,
        registered: float,
        limits: CgroupLimits,
        bounds: Bounds,
        now: float,
    ) -> None:
        self.watched[key] = Watched(key, cgroup, env, registered)
        self.states[key] = initial_state(limits, bounds, now)
        self.events.write(
            "register", sandbox=key, env=env, cgroup=cgroup.paths(), limits=limits.to_json()
        )
        log.info("watching sandbox %s (%s)", key, cgroup.name)

    def _adopt_cli_cgroups(self) -> None:
        """Sandboxes given as --cgroup PATH: start from their usage, as env `cgroup:<name>`."""
        for path in self.config.cgroups:
            cgroup = self.driver.resolve([path])
            usage = self.driver.read(cgroup).mem_usage
            mem = max(
                DEFAULT_MEM,
                quantize(usage * (1 + self.policy.mem_headroom), self.policy.mem_quantum),
            )
            limits = initial_limits(self.policy, mem, DEFAULT_CPU)
            bounds = default_bounds(self.policy, self.mem_budget, self.cpu_cores)
            key = f"cgroup:{cgroup.name}"
            self._watch(key, cgroup, key, 0.0, limits, bounds, self.clock())

    def _drop(self, key: str, why: str, detail: str = "") -> None:
        watched = self.watched.pop(key)
        self.states.pop(key, None)
        self._pending.pop(key, None)
        summary = watched.stats.summary()
        if summary is not None and self.config.history_dir is not None:
            try:
                self.history.record(watched.env, summary)
            except OSError as error:
                log.warning("cannot record history of %s: %s", watched.env, error)
        if why == "gone":
            self._gone.add((key, watched.registered))
            log.warning("sandbox %s: cgroup vanished, no longer watched: %s", key, detail)
        self.events.write(
            why,
            sandbox=key,
            env=watched.env,
            detail=detail,
            run=None if summary is None else summary.__dict__,
        )

    def _read_all(self) -> dict[str, Sample]:
        samples: dict[str, Sample] = {}
        for key, watched in list(self.watched.items()):
            try:
                sample = self.driver.read(watched.cgroup)
            except CgroupGone as error:
                self._drop(key, "gone", str(error))
                continue
            except (ProvisionError, OSError) as error:
                watched.errors += 1
                # Log the first failure and then one in a hundred: a garbled file repeats.
                level = logging.WARNING if watched.errors % 100 == 1 else logging.DEBUG
                log.log(
                    level,
                    "sandbox %s: cannot read cgroup (%d so far): %s",
                    key,
                    watched.errors,
                    error,
                )
                self.events.write("read-error", sandbox=key, error=str(error))
                continue
            watched.last_sample = sample
            watched.stats.add(sample)
            samples[key] = sample
        return samples

    def _log_squeeze(self, watched: Watched, squeezed: bool, reasons: tuple[str, ...]) -> None:
        what = [r for r in reasons if r.endswith(":squeezed")]
        if squeezed:
            log.info("node budget: squeezing sandbox %s (%s)", watched.sandbox_id, ", ".join(what))
        self.events.write("squeeze", sandbox=watched.sandbox_id, squeezed=squeezed, what=what)

    # --- writers --------------------------------------------------------------------------

    def _dispatch(self, nursery: trio.Nursery, key: str, limits: CgroupLimits) -> None:
        self._pending[key] = limits
        if key not in self._in_flight:
            self._in_flight.add(key)
            nursery.start_soon(self._writer, key)

    async def _writer(self, key: str) -> None:
        try:
            while key in self._pending:
                limits = self._pending.pop(key)
                watched = self.watched.get(key)
                if watched is None:
                    return
                started = time.monotonic()
                try:
                    writes = await trio.to_thread.run_sync(
                        self.driver.apply,
                        watched.cgroup,
                        limits,
                        limiter=self._limiter,
                        abandon_on_cancel=True,
                    )
                except (ProvisionError, OSError) as error:
                    watched.applied = None  # the next tick tries again
                    gone = isinstance(error, CgroupGone)
                    watched.write_errors += 1
                    if not gone:  # the first failure, then one in a hundred: retries repeat
                        level = (
                            logging.WARNING if watched.write_errors % 100 == 1 else logging.DEBUG
                        )
                        log.log(
                            level,
                            "sandbox %s: writing limits failed (%d so far): %s",
                            key,
                            watched.write_errors,
                            error,
                        )
                    self.events.write("write-error", sandbox=key, error=str(error), gone=gone)
                    continue
                watched.applied = limits
                if writes:
                    self.events.write(
                        "write",
                        sandbox=key,
                        limits=limits.to_json(),
                        writes=[w.to_json() for w in writes],
                        started=started,
                        took=round(time.monotonic() - started, 6),
                    )
        finally:
            self._in_flight.discard(key)

    # --- status -----------------------------------------------------------------------------

    def _write_status(self, now: float, mem_granted: int, cpu_granted: int) -> None:
        node = {
            "mem_budget": self.mem_budget,
            "mem_granted": mem_granted,
            "cpu_budget": self.cpu_budget,
            "cpu_granted": cpu_granted,
            "overcommitted": self._last_overcommitted,
        }
        document = status_document(
            self.driver.describe(),
            self.config.interval,
            self.ticks,
            now,
            node,
            self.watched,
            self.states,
        )
        if self.wake_signal is not None:
            document["wake"] = self.wake_signal
        try:
            write_json_atomic(self.config.spool / "status.json", document)
        except OSError as error:
            log.warning("cannot write status: %s", error)


async def _serve(sidecar: Sidecar) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, WAKE_SIGNAL) as signals:
        sidecar.wake_signal = WAKE_SIGNAL.name

        async def stop_on_signal() -> None:
            async for signum in signals:
                if signum == WAKE_SIGNAL:
                    sidecar.wake()
                    continue
                log.info("provisioner: signal %d, stopping", signum)
                sidecar.stop()
                return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_on_signal)
            await sidecar.run()
            nursery.cancel_scope.cancel()


def run_sidecar(config: SidecarConfig, driver: CgroupDriver) -> None:
    """Run the node's sidecar in this process until SIGTERM/SIGINT (holds the pid lock)."""
    config.spool.mkdir(parents=True, exist_ok=True)
    # SIGUSR1 would end the process until _serve listens for it: once running_pid() names us,
    # registries may send it (they do only when the status offers it, but be safe).
    signal.signal(WAKE_SIGNAL, signal.SIG_IGN)
    with pid_lock(config.spool):
        sidecar = Sidecar(config, driver)
        log.info(
            "provisioner: %s, tick %g s, memory budget %d, cpu budget %d",
            driver.describe(),
            config.interval,
            sidecar.mem_budget,
            sidecar.cpu_budget,
        )
        trio.run(_serve, sidecar)
