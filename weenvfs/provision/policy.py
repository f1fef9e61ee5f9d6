"""The sizing policy for one sandbox: pure functions from usage samples to limits.

Owns: `PolicyConfig` (every parameter, with defaults), per-sandbox `SandboxState` (decaying
statistics), `observe` (what a sandbox wants this tick, and why) and `settle` (the limits it
gets once the node's budget is shared: budget.py, whose `step` runs a whole node's tick).
No I/O, no clock, no logging: the sidecar and the simulator feed it samples and act on its
decisions, so traces test it exactly. docs/provisioner.md states the rules.

Memory, per tick, with u = usage and E = the elastic limit (v2 memory.high; v1 the hard limit
with tasks held at it):
- statistics: peak = max(u, u + (peak - u) * d(peak_half_life)) decays towards u; mean is an
  EWMA; rate = max(growth per second now, rate * d(rate_half_life)); d(h) = 0.5 ** (dt / h).
- target = peak * (1 + headroom) + rate * lookahead; hard_min = u + max(margin, margin_frac*u).
- pressure (a limit hit, a high hit, an OOM kill, tasks held, PSI stall >= mem_psi, or
  u >= near * E): E := max(E * grow, target, hard_min) at once, and the calm clock restarts.
- else target > E: E := target. Else after `calm` seconds without either: E := max(E * (1 -
  shrink), target, hard_min) each tick. Never below hard_min (unless E already was), never
  outside [floor, ceiling], rounded up to `mem_quantum`. mem_max = E * max_over_high.
CPU works the same way on the usage rate in thousandths of a core, with throttling (throttled
time / wall time >= cpu_throttle), PSI and near-quota use as pressure, and no hard minimum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from weenvfs.units import parse_size

from .cgroup_driver import MIB, CgroupLimits, Sample

SIZE_FIELDS = frozenset({"mem_margin", "mem_floor", "mem_ceiling", "mem_quantum"})


@dataclass(frozen=True)
class PolicyConfig:
    """Every parameter of the policy (sizes in bytes, times in seconds, CPU in millicores)."""

    tick: float = 0.25
    mem_headroom: float = 0.20
    mem_margin: int = 16 * MIB
    mem_margin_frac: float = 0.05
    mem_near: float = 0.90
    mem_grow: float = 1.5
    mem_shrink: float = 0.03
    mem_calm: float = 5.0
    mem_peak_half_life: float = 5.0
    mem_mean_half_life: float = 60.0
    mem_rate_half_life: float = 2.0
    mem_lookahead: float = 0.5
    mem_psi: float = 0.05
    mem_floor: int = 64 * MIB
    mem_ceiling: int = 0  # 0: the node's memory budget
    mem_max_over_high: float = 1.25  # v2 safety net; 1.0 on v1 (hard limit == elastic limit)
    mem_quantum: int = MIB
    mem_soft_hysteresis: float = 0.10
    hold_timeout: float = 10.0
    cpu_headroom: float = 0.25
    cpu_near: float = 0.90
    cpu_throttle: float = 0.02
    cpu_psi: float = 0.10
    cpu_grow: float = 2.0
    cpu_shrink: float = 0.05
    cpu_calm: float = 5.0
    cpu_peak_half_life: float = 10.0
    cpu_floor: int = 100
    cpu_ceiling: int = 0  # 0: the node's cores
    cpu_quantum: int = 10
    # Quotas cap, they do not reserve: CFS shares the cores when quotas add up to more, so
    # the node's CPU budget is its cores times this.
    cpu_overcommit: float = 4.0

    def with_overrides(self, overrides: Mapping[str, str | float | int]) -> PolicyConfig:
        """A copy with `name=value` overrides; sizes accept K/M/G suffixes. ValueError if bad."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, float | int] = {}
        for name, value in overrides.items():
            if name not in fields:
                raise ValueError(f"unknown policy parameter {name!r} (see docs/provisioner.md)")
            if name in SIZE_FIELDS:
                changes[name] = parse_size(str(value))
            elif fields[name].type in ("int", int):
                changes[name] = int(value)
            else:
                changes[name] = float(value)
        return replace(self, **changes)


@dataclass(frozen=True)
class Bounds:
    """Per-sandbox floor and ceiling (0 ceiling: none besides the node budget)."""

    mem_floor: int
    mem_ceiling: int
    cpu_floor: int
    cpu_ceiling: int


def default_bounds(config: PolicyConfig, mem_budget: int, node_cpu: int) -> Bounds:
    """The config's floor and ceiling; a 0 ceiling means the memory budget, the node's cores."""
    return Bounds(
        config.mem_floor,
        config.mem_ceiling or mem_budget,
        config.cpu_floor,
        config.cpu_ceiling or node_cpu,
    )


@dataclass(frozen=True)
class SandboxState:
    """What the policy remembers of one sandbox between ticks."""

    limits: CgroupLimits
    bounds: Bounds
    since: float  # when it was registered (monotonic seconds)
    prev: Sample | None = None
    mem_peak: float = 0.0
    mem_mean: float = 0.0
    mem_rate: float = 0.0
    cpu_peak: float = 0.0
    mem_calm_since: float = 0.0
    cpu_calm_since: float = 0.0
    stuck_since: float | None = None


def initial_state(limits: CgroupLimits, bounds: Bounds, now: float) -> SandboxState:
    """A new sandbox: its first limits count as calm from `now`."""
    return SandboxState(limits, bounds, now, mem_calm_since=now, cpu_calm_since=now)


@dataclass(frozen=True)
class Want:
    """What one sandbox asks of the node budget this tick, and why."""

    mem: int
    mem_min: int
    cpu: int
    cpu_min: int
    reasons: tuple[str, ...] = ()
    inputs: Mapping[str, float | int | bool | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """The limits one sandbox gets this tick, with the reasons and inputs behind them."""

    sandbox: str
    old: CgroupLimits
    new: CgroupLimits
    reasons: tuple[str, ...]
    inputs: Mapping[str, float | int | bool | None]
    squeezed: bool = False

    @property
    def changed(self) -> bool:
        """Whether anything must be written."""
        return self.old != self.new


def _decay(dt: float, half_life: float) -> float:
    return 0.5 ** (dt / half_life) if half_life > 0 else 0.0


def _toward(value: float, peak: float, decay: float) -> float:
    """A peak that decays towards the current value."""
    return max(value, value + (peak - value) * decay)


def quantize(value: float, quantum: int) -> int:
    """`value` rounded up to a multiple of `quantum`."""
    return int(math.ceil(value / quantum - 1e-9)) * quantum


@dataclass(frozen=True)
class _Resource:
    """One resource's rules, for `_resize`: the same steps size memory and CPU."""

    grow: float
    shrink: float
    calm: float
    floor: int
    ceiling: int
    quantum: int


def _resource(config: PolicyConfig, bounds: Bounds, kind: str) -> _Resource:
    if kind == "mem":
        return _Resource(
            config.mem_grow,
            config.mem_shrink,
            config.mem_calm,
            bounds.mem_floor,
            bounds.mem_ceiling,
            config.mem_quantum,
        )
    return _Resource(
        config.cpu_grow,
        config.cpu_shrink,
        config.cpu_calm,
        bounds.cpu_floor,
        bounds.cpu_ceiling,
        config.cpu_quantum,
    )


def _bound(candidate: float, current: int, hard_min: float, floor: int, ceiling: int) -> float:
    """Clamp to [floor, ceiling]; never lower below hard_min (raise as far as the ceiling)."""
    new = min(max(candidate, floor), ceiling)
    if new < hard_min:
        new = max(current, min(hard_min, ceiling))
    return new


def _resize(
    rule: _Resource, current: int, target: float, hard_min: float, pressure: bool, calm_for: float
) -> tuple[int, str | None]:
    """The new limit and the action taken: grow (pressure), track (target above), shrink
    (calm long enough), or None. Bounded, rounded up to the quantum; a shrink step smaller
    than the quantum, which rounding would undo, takes one quantum instead."""
    action: str | None = None
    candidate: float = current
    if pressure:
        candidate, action = max(current * rule.grow, target, hard_min), "grow"
    elif target > current:
        candidate, action = target, "track"
    elif calm_for >= rule.calm and current > max(target, hard_min):
        candidate, action = max(current * (1 - rule.shrink), target, hard_min), "shrink"
    new = quantize(_bound(candidate, current, hard_min, rule.floor, rule.ceiling), rule.quantum)
    if action == "shrink" and new >= current:
        lowest = _bound(max(target, hard_min), current, hard_min, rule.floor, rule.ceiling)
        new = max(current - rule.quantum, quantize(lowest, rule.quantum))
    return new, action


def _stall(before: int | None, after: int | None, dt: float) -> float | None:
    if before is None or after is None or dt <= 0:
        return None
    return (after - before) / (dt * 1e6)


def _mem_signals(config: PolicyConfig, prev: Sample, s: Sample, dt: float, limit: int) -> list[str]:
    signals = []
    if s.mem_limit_hits > prev.mem_limit_hits:
        signals.append("mem:limit-hit")
    if s.mem_high_hits > prev.mem_high_hits:
        signals.append("mem:high-hit")
    if s.oom_kills > prev.oom_kills:
        signals.append("mem:oom")
    if s.held:
        signals.append("mem:held")
    stall = _stall(prev.mem_stall_us, s.mem_stall_us, dt)
    if stall is not None and stall >= config.mem_psi:
        signals.append("mem:psi")
    if s.mem_usage >= config.mem_near * limit:
        signals.append("mem:near-limit")
    return signals


def _cpu_signals(
    config: PolicyConfig, prev: Sample, s: Sample, dt: float, rate: float, quota: int
) -> list[str]:
    signals = []
    if (s.cpu_throttled_us - prev.cpu_throttled_us) / (dt * 1e6) >= config.cpu_throttle:
        signals.append("cpu:throttled")
    stall = _stall(prev.cpu_stall_us, s.cpu_stall_us, dt)
    if stall is not None and stall >= config.cpu_psi:
        signals.append("cpu:psi")
    if rate >= config.cpu_near * quota:
        signals.append("cpu:near-limit")
    return signals


def _statistics(config: PolicyConfig, state: SandboxState, s: Sample) -> SandboxState:
    """The state with `s` counted: decayed peaks, mean and growth rate (calm clocks kept)."""
    prev, u = state.prev, float(s.mem_usage)
    dt = max(0.0, s.time - prev.time) if prev is not None else 0.0
    growth = cpu_rate = 0.0
    if prev is not None and dt > 0:
        growth = max(0.0, (u - prev.mem_usage) / dt)
        cpu_rate = (s.cpu_usage_us - prev.cpu_usage_us) / dt / 1e3
    mean = u if prev is None else u + (state.mem_mean - u) * _decay(dt, config.mem_mean_half_life)
    # Built field by field: dataclasses.replace costs more than the rest of a tick here.
    return SandboxState(
        state.limits,
        state.bounds,
        state.since,
        s,
        mem_peak=_toward(u, state.mem_peak, _decay(dt, config.mem_peak_half_life)),
        mem_mean=mean,
        mem_rate=max(growth, state.mem_rate * _decay(dt, config.mem_rate_half_life)),
        cpu_peak=_toward(cpu_rate, state.cpu_peak, _decay(dt, config.cpu_peak_half_life)),
        mem_calm_since=state.mem_calm_since,
        cpu_calm_since=state.cpu_calm_since,
        stuck_since=state.stuck_since,
    )


def observe(config: PolicyConfig, state: SandboxState, s: Sample) -> tuple[SandboxState, Want]:
    """Update one sandbox's statistics with sample `s`; say what it wants and why."""
    prev, now, old, b = state.prev, s.time, state.limits, state.bounds
    dt = max(0.0, now - prev.time) if prev is not None else 0.0
    new = _statistics(config, state, s)
    cpu_rate = (s.cpu_usage_us - prev.cpu_usage_us) / dt / 1e3 if prev and dt > 0 else 0.0
    u = float(s.mem_usage)
    hard_min = u + max(config.mem_margin, config.mem_margin_frac * u)
    mem_target = new.mem_peak * (1 + config.mem_headroom) + new.mem_rate * config.mem_lookahead
    cpu_target = new.cpu_peak * (1 + config.cpu_headroom)
    mem_signals: list[str] = []
    cpu_signals: list[str] = []
    if prev is not None and dt > 0:  # counters at the first sample are history, not events
        mem_signals = _mem_signals(config, prev, s, dt, old.mem_high)
        cpu_signals = _cpu_signals(config, prev, s, dt, cpu_rate, old.cpu_millis)
    mem, mem_action = _resize(
        _resource(config, b, "mem"),
        old.mem_high,
        mem_target,
        hard_min,
        bool(mem_signals),
        now - state.mem_calm_since,
    )
    cpu, cpu_action = _resize(
        _resource(config, b, "cpu"),
        old.cpu_millis,
        cpu_target,
        0.0,
        bool(cpu_signals),
        now - state.cpu_calm_since,
    )
    if mem_action in ("grow", "track"):
        new = replace(new, mem_calm_since=now)
    if cpu_action in ("grow", "track"):
        new = replace(new, cpu_calm_since=now)
    # A squeeze may lower E to usage + margin, never lower; nor need it raise E to that.
    mem_min = min(mem, max(b.mem_floor, min(quantize(hard_min, config.mem_quantum), old.mem_high)))
    reasons = tuple(
        mem_signals
        + [f"mem:{mem_action}"] * bool(mem_action)
        + cpu_signals
        + [f"cpu:{cpu_action}"] * bool(cpu_action)
    )
    inputs = {
        "mem_usage": s.mem_usage,
        "mem_peak": round(new.mem_peak),
        "mem_mean": round(new.mem_mean),
        "mem_rate": round(new.mem_rate),
        "mem_target": round(mem_target),
        "hard_min": round(hard_min),
        "held": s.held,
        "limit_hits": s.mem_limit_hits,
        "high_hits": s.mem_high_hits,
        "oom_kills": s.oom_kills,
        "cpu_rate": round(cpu_rate, 1),
        "cpu_peak": round(new.cpu_peak, 1),
        "throttled_us": s.cpu_throttled_us,
    }
    return new, Want(mem, mem_min, cpu, min(cpu, b.cpu_floor), reasons, inputs)


def _soft(config: PolicyConfig, state: SandboxState, high: int) -> int:
    soft = quantize(state.mem_mean * (1 + config.mem_headroom), config.mem_quantum)
    soft = min(max(soft, state.bounds.mem_floor), high)
    old = state.limits.mem_soft
    if old and abs(soft - old) < config.mem_soft_hysteresis * old:
        return min(old, high)
    return soft


def initial_limits(
    config: PolicyConfig, mem: int, cpu_millis: int, soft: int = 0, hold: bool = True
) -> CgroupLimits:
    """Limits with elastic memory `mem` (its safety net derived), quota `cpu_millis`."""
    mem_max = max(mem, quantize(mem * config.mem_max_over_high, config.mem_quantum))
    return CgroupLimits(mem, mem_max, cpu_millis, soft, hold)


def settle(
    config: PolicyConfig, state: SandboxState, mem: int, cpu: int, now: float
) -> tuple[SandboxState, CgroupLimits]:
    """The limits for granted elastic memory `mem` and quota `cpu`; v1 hold/release logic.

    A sandbox whose tasks are held at the limit and who could not grow for `hold_timeout`
    seconds is released (`hold=False`): the kernel's OOM killer then acts, as v2's memory.max.
    """
    old = state.limits
    held = state.prev is not None and state.prev.held
    stuck = held and mem <= old.mem_high
    stuck_since = (state.stuck_since if state.stuck_since is not None else now) if stuck else None
    release = stuck_since is not None and now - stuck_since >= config.hold_timeout
    limits = initial_limits(config, mem, cpu, _soft(config, state, mem), not release)
    new_state = SandboxState(
        limits,
        state.bounds,
        state.since,
        state.prev,
        state.mem_peak,
        state.mem_mean,
        state.mem_rate,
        state.cpu_peak,
        state.mem_calm_since,
        state.cpu_calm_since,
        stuck_since,
    )
    return new_state, limits
