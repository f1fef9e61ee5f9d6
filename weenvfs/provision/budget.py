"""A node's budget shared among its sandboxes, and one tick of the policy for a whole node.

Owns: `fair_share` (max-min fair over headroom: every sandbox keeps its minimum, the rest is
split in equal slices, capped by what each wants) and `step` (observe every sampled sandbox,
share the memory and CPU budgets, settle their limits). Pure, like policy.py: no I/O, no
clock, no logging; the sidecar logs who is squeezed from the decisions' reasons.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .cgroup_driver import Sample
from .policy import Decision, PolicyConfig, SandboxState, Want, observe, settle


def fair_share(wants: Mapping[str, int], mins: Mapping[str, int], budget: int) -> dict[str, int]:
    """Split `budget` max-min fairly over headroom: each gets min(want, min + L), L the largest
    level that fits. Every sandbox keeps its minimum and gets an equal slice of what is left,
    so a large sandbox under pressure is not starved because it is already large.

    When the wants fit, everyone gets its want; when even the minimums do not, everyone gets
    its minimum (the node is over-committed: a minimum is never cut).
    """
    if sum(wants.values()) <= budget:
        return dict(wants)
    if sum(mins.values()) >= budget:
        return dict(mins)

    def total(level: int) -> int:
        return sum(min(w, mins[k] + level) for k, w in wants.items())

    low, high = 0, max(wants.values())
    while low < high:  # the largest level whose total fits the budget
        mid = (low + high + 1) // 2
        if total(mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return {k: min(w, mins[k] + low) for k, w in wants.items()}


@dataclass(frozen=True)
class Tick:
    """The outcome of one node tick."""

    states: dict[str, SandboxState]
    decisions: dict[str, Decision]
    mem_granted: int
    cpu_granted: int
    overcommitted: bool


def step(
    config: PolicyConfig,
    states: Mapping[str, SandboxState],
    samples: Mapping[str, Sample],
    mem_budget: int,
    cpu_budget: int,
    now: float,
) -> Tick:
    """One tick for a node: observe every sampled sandbox, share the budgets, settle.

    Sandboxes without a sample this tick (a read failed) keep their limits, which still count
    against the budgets.
    """
    observed: dict[str, SandboxState] = {}
    wants: dict[str, Want] = {}
    for key, state in states.items():
        if key in samples:
            observed[key], wants[key] = observe(config, state, samples[key])
        else:
            lim = state.limits
            observed[key] = state
            wants[key] = Want(lim.mem_high, lim.mem_high, lim.cpu_millis, lim.cpu_millis)
    mem = fair_share(
        {k: w.mem for k, w in wants.items()}, {k: w.mem_min for k, w in wants.items()}, mem_budget
    )
    cpu = fair_share(
        {k: w.cpu for k, w in wants.items()}, {k: w.cpu_min for k, w in wants.items()}, cpu_budget
    )
    new_states: dict[str, SandboxState] = {}
    decisions: dict[str, Decision] = {}
    for key, want in wants.items():
        grant_mem = max(want.mem_min, mem[key] // config.mem_quantum * config.mem_quantum)
        grant_cpu = max(want.cpu_min, cpu[key] // config.cpu_quantum * config.cpu_quantum)
        squeezed = grant_mem < want.mem or grant_cpu < want.cpu
        reasons = want.reasons + (
            (("mem:squeezed",) if grant_mem < want.mem else ())
            + (("cpu:squeezed",) if grant_cpu < want.cpu else ())
        )
        if key not in samples:
            new_states[key] = observed[key]
            decisions[key] = Decision(key, states[key].limits, states[key].limits, (), {})
            continue
        new_states[key], limits = settle(config, observed[key], grant_mem, grant_cpu, now)
        decisions[key] = Decision(key, states[key].limits, limits, reasons, want.inputs, squeezed)
    total_mem = sum(s.limits.mem_high for s in new_states.values())
    total_cpu = sum(s.limits.cpu_millis for s in new_states.values())
    return Tick(
        new_states,
        decisions,
        total_mem,
        total_cpu,
        total_mem > mem_budget or total_cpu > cpu_budget,
    )
