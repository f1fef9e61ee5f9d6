"""The sizing policy as a pure function, on traces with exact expectations.

Traces are lists of samples 0.25 s apart; `drive` feeds them to `policy.step` (one sandbox,
or several with a node budget) and returns what each tick decided. Configs switch off the
parts a test is not about (headroom 0, lookahead 0) so the arithmetic can be done by hand;
the comments show it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from weenvfs.provision.budget import fair_share, step
from weenvfs.provision.cgroup_driver import MIB, CgroupLimits, Sample
from weenvfs.provision.policy import (
    Bounds,
    Decision,
    PolicyConfig,
    default_bounds,
    initial_limits,
    initial_state,
    quantize,
)

DT = 0.25
PLAIN = PolicyConfig(
    mem_headroom=0.0,
    mem_lookahead=0.0,
    mem_margin=16 * MIB,
    mem_margin_frac=0.0,
    mem_calm=5.0,
    mem_floor=64 * MIB,
    cpu_headroom=0.0,
)
BIG = 1 << 40


def sample(t: float, mem_mib: float, **fields: Any) -> Sample:
    return Sample(time=t, mem_usage=round(mem_mib * MIB), **fields)


def drive(
    config: PolicyConfig,
    initial: CgroupLimits,
    samples: Sequence[Sample],
    bounds: Bounds | None = None,
) -> list[Decision]:
    """Feed one sandbox's samples, tick by tick, with no budget pressure."""
    states = {"a": initial_state(initial, bounds or default_bounds(config, BIG, 64_000), 0.0)}
    decisions = []
    for s in samples:
        tick = step(config, states, {"a": s}, BIG, 64_000, s.time)
        states = tick.states
        decisions.append(tick.decisions["a"])
    return decisions


def highs(decisions: Sequence[Decision]) -> list[int]:
    return [d.new.mem_high // MIB for d in decisions]


def mem_reasons(decision: Decision) -> tuple[str, ...]:
    return tuple(r for r in decision.reasons if r.startswith("mem:"))


def ramp(usages: Sequence[float], **fields: Any) -> list[Sample]:
    return [sample((i + 1) * DT, u, **fields) for i, u in enumerate(usages)]


def test_ramp_grows_within_the_tick_usage_nears_the_limit() -> None:
    # E=100: usage 90 >= 0.9*100 grows to max(100*1.5, 90, 90+16) = 150 at that very tick;
    # usage 140 >= 0.9*150 grows to 225. mem_max = ceil(E * 1.25).
    decisions = drive(
        PLAIN,
        initial_limits(PLAIN, 100 * MIB, 1000),
        ramp([50, 60, 70, 80, 90, 100, 110, 120, 130, 140]),
    )
    assert highs(decisions) == [100, 100, 100, 100, 150, 150, 150, 150, 150, 225]
    assert [d.new.mem_max // MIB for d in decisions][3:5] == [125, 188]
    assert decisions[-1].new.mem_max == 282 * MIB
    assert decisions[4].reasons == ("mem:near-limit", "mem:grow")
    # Tick 1 also sets the v1 soft limit (0 = unset) from the mean usage, to the 64 MiB floor.
    assert decisions[0].new.mem_soft == 64 * MIB
    assert [d.changed for d in decisions] == [True] + [False] * 3 + [True] + [False] * 4 + [True]


def test_lookahead_covers_the_growth_rate() -> None:
    # 100 -> 140 MiB in 0.25 s is 160 MiB/s; target = 140 + 160 * 0.5 s = 220 > E=200: track.
    # Next tick the rate decays (half-life 2 s): 160 * 0.5**(0.25/2) = 146.7, target 213 < 220.
    config = replace(PLAIN, mem_lookahead=0.5, mem_rate_half_life=2.0)
    decisions = drive(config, initial_limits(config, 200 * MIB, 1000), ramp([100, 140, 140]))
    assert highs(decisions) == [200, 220, 220]
    assert decisions[1].reasons == ("mem:track",)
    assert decisions[2].inputs["mem_rate"] == round(160 * MIB * 0.5 ** (0.25 / 2))


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"mem_limit_hits": 1}, "mem:limit-hit"),
        ({"mem_high_hits": 1}, "mem:high-hit"),
        ({"oom_kills": 1}, "mem:oom"),
        ({"held": True}, "mem:held"),
        ({"mem_stall_us": 20_000}, "mem:psi"),  # 20 ms stalled in 250 ms: 8% >= 5%
    ],
)
def test_every_pressure_signal_grows_memory_at_once(fields: dict[str, Any], reason: str) -> None:
    first = sample(DT, 100, mem_stall_us=0)
    second = sample(2 * DT, 100, **{"mem_stall_us": 0, **fields})
    decisions = drive(PLAIN, initial_limits(PLAIN, 200 * MIB, 1000), [first, second])
    assert highs(decisions) == [200, 300]  # 200 * 1.5, in the tick the signal shows
    assert decisions[1].reasons == (reason, "mem:grow")


def test_no_signal_no_change() -> None:
    quiet = [sample(DT, 100, mem_stall_us=0), sample(2 * DT, 100, mem_stall_us=10_000)]
    decisions = drive(PLAIN, initial_limits(PLAIN, 200 * MIB, 1000), quiet)  # 4% < 5%
    assert highs(decisions) == [200, 200]
    assert [d.reasons for d in decisions] == [(), ()]


def test_idle_shrinks_three_percent_per_tick_after_the_calm_period_down_to_usage_margin() -> None:
    # Usage 100 MiB flat, E=1000: no change before 5 s of calm (t=5.0 is tick 20); then
    # E := max(ceil(0.97 * E), usage + 16 MiB) each tick, down to 116.
    decisions = drive(PLAIN, initial_limits(PLAIN, 1000 * MIB, 1000), ramp([100] * 140))
    got = highs(decisions)
    assert got[:19] == [1000] * 19
    expected = [1000]
    while expected[-1] > 116:
        expected.append(max(116, math.ceil(expected[-1] * 0.97)))
    assert got[18 : 18 + len(expected)] == expected
    assert got[-1] == 116 and expected[1:4] == [970, 941, 913]
    assert all(mem_reasons(d) == ("mem:shrink",) for d in decisions[19 : 18 + len(expected)])


def test_sawtooth_grows_on_every_rise_and_never_cuts_below_usage() -> None:
    # Square wave: 8 ticks at 100 MiB, 8 at 300, repeated; headroom 20%.
    config = replace(PLAIN, mem_headroom=0.2)
    usages = ([100] * 8 + [300] * 8) * 6
    decisions = drive(config, initial_limits(config, 128 * MIB, 1000), ramp(usages))
    got = highs(decisions)
    # First rise (tick 9): near-limit, E := max(128*1.5, 300*1.2, 316) = 360 at once; it stays
    # while the calm clock (from t=2.25) runs; the first shrink is when usage drops again
    # after 5 s: at t=8.25 to max(360*0.97, 1.2 * decayed peak 293.3...) = 352.
    assert got[:32] == [128] * 8 + [360] * 24
    assert got[32] == 352 and mem_reasons(decisions[32]) == ("mem:shrink",)
    for i, (usage, decision) in enumerate(zip(usages, decisions, strict=True)):
        assert decision.new.mem_high >= (usage + 16) * MIB or decision.new.mem_high >= (
            decision.old.mem_high
        ), f"tick {i}: cut below usage + margin"
        if usage == 300 and usages[i - 1] == 100:
            assert decision.new.mem_high >= 360 * MIB, f"tick {i}: did not grow on the rise"
        if decision.new.mem_high < decision.old.mem_high:
            assert decision.new.mem_high >= math.floor(0.97 * decision.old.mem_high)


def test_cpu_throttling_doubles_the_quota_at_once() -> None:
    # 0.5 cores used of a 0.5 quota, throttled 100 ms per 250 ms tick (40%): C := 2 * 500.
    samples = [
        sample(DT, 100, cpu_usage_us=0, cpu_throttled_us=0),
        sample(2 * DT, 100, cpu_usage_us=125_000, cpu_throttled_us=100_000),
    ]
    decisions = drive(PLAIN, initial_limits(PLAIN, 200 * MIB, 500), samples)
    assert [d.new.cpu_millis for d in decisions] == [500, 1000]
    assert decisions[1].reasons == ("cpu:throttled", "cpu:near-limit", "cpu:grow")


def test_cpu_idle_quota_shrinks_five_percent_per_tick_to_the_floor() -> None:
    decisions = drive(PLAIN, initial_limits(PLAIN, 200 * MIB, 2000), ramp([100] * 120))
    got = [d.new.cpu_millis for d in decisions]
    expected = [2000]
    while expected[-1] > 100:
        step_down = quantize(expected[-1] * 0.95, 10)  # rounded up to 10 millicores...
        if step_down == expected[-1]:  # ...unless that undoes the step: one quantum then
            step_down -= 10
        expected.append(max(100, step_down))
    assert got[:19] == [2000] * 19  # cpu_calm is 5 s: tick 20 is the first shrink
    assert got[18 : 18 + len(expected)] == expected
    assert expected[1:3] == [1900, 1810] and expected[-3:] == [120, 110, 100]
    assert got[-1] == 100


def test_a_held_sandbox_at_its_ceiling_is_released_after_the_hold_timeout() -> None:
    # Tasks wait at the limit (v1 oom hold); the ceiling stops growth; after hold_timeout
    # (1 s from the first stuck tick at 0.25) the policy lets the kernel's OOM killer act.
    config = replace(PLAIN, hold_timeout=1.0)
    bounds = Bounds(64 * MIB, 200 * MIB, 100, 4000)
    held = [sample((i + 1) * DT, 200, held=True) for i in range(6)]
    calm = [sample(7 * DT, 150, held=False)]
    decisions = drive(config, initial_limits(config, 200 * MIB, 1000), held + calm, bounds)
    assert [d.new.hold for d in decisions] == [True, True, True, True, False, False, True]
    assert highs(decisions) == [200] * 7
    assert "mem:held" in decisions[1].reasons


def test_limits_are_never_lowered_below_usage_plus_margin_on_random_walks() -> None:
    config = PolicyConfig(mem_calm=1.0, mem_peak_half_life=1.0)
    rng = random.Random(4)
    for _walk in range(20):
        usage, samples = 300.0, []
        for i in range(400):
            usage = max(10.0, usage + rng.choice([-80, -20, 0, 0, 5, 30, 120]))
            samples.append(sample((i + 1) * DT, usage, held=rng.random() < 0.02))
        bounds = Bounds(64 * MIB, 4096 * MIB, 100, 4000)
        decisions = drive(config, initial_limits(config, 256 * MIB, 1000), samples, bounds)
        for s, d in zip(samples, decisions, strict=True):
            floor = s.mem_usage + max(config.mem_margin, config.mem_margin_frac * s.mem_usage)
            for field in ("mem_high", "mem_max"):
                old, new = getattr(d.old, field), getattr(d.new, field)
                assert new >= old or new >= floor, (field, s, d)
            assert d.new.mem_high <= d.new.mem_max
            assert 64 * MIB <= d.new.mem_high <= max(4096 * MIB, d.old.mem_high)


def test_fair_share_exact() -> None:
    wants, mins = {"a": 100, "b": 300, "c": 600}, {"a": 50, "b": 100, "c": 100}
    assert fair_share(wants, mins, 1000) == wants  # fits
    # Each gets min(want, min + L): a=100, b=c=100+L with 100 + 2*(100 + L) = 600: L = 150.
    assert fair_share(wants, mins, 600) == {"a": 100, "b": 250, "c": 250}
    assert fair_share(wants, mins, 200) == mins  # over-committed: minimums are never cut


def test_step_squeezes_a_calm_sandbox_to_feed_one_under_pressure() -> None:
    # a: E=600 calm at usage 200 (min 216); b: E=300 at usage 290 (near: wants 450, min 300).
    # Budget 1000: b gets its 450, a gets 216 + L with 216 + L + 450 = 1000 -> 550.
    config = PLAIN
    bounds = default_bounds(config, BIG, 4000)
    states = {
        "a": initial_state(initial_limits(config, 600 * MIB, 1000), bounds, 0.0),
        "b": initial_state(initial_limits(config, 300 * MIB, 1000), bounds, 0.0),
    }
    first = {"a": sample(DT, 200), "b": sample(DT, 250)}
    states = step(config, states, first, 1000 * MIB, 4000, DT).states
    tick = step(
        config, states, {"a": sample(0.5, 200), "b": sample(0.5, 290)}, 1000 * MIB, 4000, 0.5
    )
    assert tick.decisions["b"].new.mem_high == 450 * MIB
    assert tick.decisions["a"].new.mem_high == 550 * MIB
    assert tick.decisions["a"].squeezed and "mem:squeezed" in tick.decisions["a"].reasons
    assert not tick.decisions["b"].squeezed
    assert not tick.overcommitted
    tight = step(
        config, states, {"a": sample(0.5, 200), "b": sample(0.5, 290)}, 400 * MIB, 4000, 0.5
    )
    assert tight.decisions["a"].new.mem_high == 216 * MIB  # usage + margin, never less
    assert tight.decisions["b"].new.mem_high == 300 * MIB  # not lowered, not raised
    assert tight.overcommitted


def test_a_sandbox_without_a_sample_keeps_its_limits_and_its_share() -> None:
    bounds = default_bounds(PLAIN, BIG, 4000)
    states = {"a": initial_state(initial_limits(PLAIN, 600 * MIB, 1000), bounds, 0.0)}
    tick = step(PLAIN, states, {}, 500 * MIB, 4000, DT)
    assert tick.decisions["a"].new == tick.decisions["a"].old
    assert tick.states["a"] is states["a"]
    assert tick.overcommitted  # 600 MiB held against a 500 MiB budget


def test_first_sample_has_no_deltas() -> None:
    # Counters already high at the first sample are history, not events.
    first = sample(DT, 100, mem_limit_hits=50, oom_kills=3, cpu_throttled_us=10**9)
    decisions = drive(PLAIN, initial_limits(PLAIN, 200 * MIB, 1000), [first])
    assert decisions[0].reasons == ()
    assert (decisions[0].new.mem_high, decisions[0].new.cpu_millis) == (200 * MIB, 1000)


def test_config_overrides_and_sizes() -> None:
    config = PolicyConfig().with_overrides({"mem_floor": "128M", "mem_calm": "3", "tick": 1})
    assert (config.mem_floor, config.mem_calm, config.tick) == (128 * MIB, 3.0, 1.0)
    with pytest.raises(ValueError, match="unknown policy parameter 'nope'"):
        PolicyConfig().with_overrides({"nope": "1"})
    assert initial_limits(PolicyConfig(), 100 * MIB, 500) == CgroupLimits(100 * MIB, 125 * MIB, 500)
    assert quantize(100.0000001, 10) == 110 and quantize(100, 10) == 100
