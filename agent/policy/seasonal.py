"""Seasonal, forecast-sized scaling: provision for the forecast peak of the next hours (issue 25 item 6).

Rules of this file: pure numbers in, decisions out. The state is the recent operator-input history,
the MST-model calibration points, a low-demand counter and the time of the last action; time comes
in `Measurements.now`; no randomness. The seasonal profile is an input (learned offline from
earlier days with `learn_profile`), never updated from the bus, so every sibling computes the same
target from the same measurements (docs/measurement.md, "The policy goal against the bound").

Why: on a diurnal load most of a tracker's reconfigurations follow the daily ramps one instance at
a time. Knowing the daily shape (not the day's noise) lets a policy take each ramp in few, larger
steps and hold through the noise, which is what the clairvoyant schedule with few changes does.

The forecast: `profile[j]` is the mean operator input (records/s) of slot j of the day (one slot =
one decision period). The current level is the median ratio of the recent inputs to the profile at
their slots (a day busier than usual scales the whole profile); the forecast of slot j is
level x profile[j]. Without a profile (a live operator that has none yet) the forecast is flat at
the recent maximum, i.e. plain hysteresis.

The rule with a profile and `segments` (plan mode, what the simulator runs): `plan_day` cuts the
profile into at most `segments` constant pieces at the profile's maximum over each piece, least
total first. At each plan boundary the level is sampled and the instances needed for
level x plan x (1 + margin) are fixed until the next boundary. Every period:
- scale out to max(that count, needed(last input x (1 + margin_up)), n + 1) when the count exceeds
  n (at once), or when the input's count exceeds n or this operator is the root of the back
  pressure (Gesscale Algorithm 1) for `patience` consecutive periods;
- scale in to max(that count, needed(recent peak x (1 + margin_up))) after `hold` quiet periods
  without back pressure, by `min_step` or more, `cooldown_in` after the last action.

Without `segments` (forecast mode), every period:
- scale out when needed(max(last input, forecast of the next slot) x (1 + margin_up)) > n, or on
  the back-pressure root; the target is needed(max forecast over the next `horizon_up` slots x
  (1 + margin)), so one step covers the ramp ahead instead of the next minute;
- scale in when, for `hold` consecutive periods with no back pressure, needed(max(recent inputs,
  max forecast over the next `horizon_down` slots) x (1 + margin)) is at least `min_step` below n
  and the last action is `cooldown_in` seconds old.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from agent.policy.base import NO_ACTION, HeldScaleIn, Measurements, ScalingAction, share_of_delta
from agent.policy.model import MstPoint, MstPoints, is_overload_root

__all__ = ["SeasonalPolicy", "learn_profile", "plan_day", "OPERATING_POINT", "COOLDOWN_IN_PERIODS", "COOLDOWN_OUT_PERIODS",
           "from_scaling"]

# The operating point the simulator measures and a live operator with a profile runs (chosen on
# seeds 100-104 with training days 0-2, not the table's seeds 0-9: docs/measurement.md).
OPERATING_POINT: Dict[str, Any] = dict(segments=6, margin=0.10, margin_up=0.10, hold=6, min_step=2)
# Cooldowns in decision periods (the simulator's 60 s periods: out 60 s, in 240 s), so that an
# operator deciding every second keeps the same point instead of a 240-period scale-in cooldown.
COOLDOWN_OUT_PERIODS = 1.0
COOLDOWN_IN_PERIODS = 4.0


def learn_profile(rates: Sequence[float], slot_seconds: int, day_seconds: int) -> List[float]:
    """Mean input per slot of the day over whole days of a per-second rate series (the training days).

    Raises ValueError when the series holds no whole day: a profile from part of a day would
    silently forecast zero for the rest of it."""
    if slot_seconds < 1 or day_seconds % slot_seconds:
        raise ValueError(f"day_seconds must be a multiple of slot_seconds >= 1, found {day_seconds}, {slot_seconds}")
    days = len(rates) // day_seconds
    if days < 1:
        raise ValueError(f"need at least one whole day ({day_seconds} samples), found {len(rates)}")
    slots = day_seconds // slot_seconds
    out = [0.0] * slots
    for d in range(days):
        for j in range(slots):
            a = d * day_seconds + j * slot_seconds
            out[j] += sum(rates[a:a + slot_seconds]) / slot_seconds
    return [x / days for x in out]


@lru_cache(maxsize=32)
def plan_day(profile: Tuple[float, ...], segments: int) -> Tuple[float, ...]:
    """The cheapest piecewise-constant cover of the day's profile with at most `segments` pieces:
    each slot gets the maximum of the profile over its piece, and the sum over the day is least.

    It is the clairvoyant few-changes schedule (lab/foglab/sim/policies_oracle.py) computed on the
    learned profile instead of the future, in rate space (an instance count is about proportional
    to the rate). Exact DP, O(segments x slots^2); cached because every sibling builds the same."""
    s = len(profile)
    k_max = max(1, min(segments, s))
    inf = float("inf")
    # best[k][j]: least cost covering slots 0..j-1 with k pieces; cut[k][j]: start of the last piece
    best = [[inf] * (s + 1) for _ in range(k_max + 1)]
    cut = [[0] * (s + 1) for _ in range(k_max + 1)]
    best[0][0] = 0.0
    for k in range(1, k_max + 1):
        for j in range(1, s + 1):
            top = 0.0
            for i in range(j - 1, -1, -1):  # last piece = slots i..j-1
                top = max(top, profile[i])
                c = best[k - 1][i] + top * (j - i)
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    k = min(range(1, k_max + 1), key=lambda q: best[q][s])
    out = [0.0] * s
    j = s
    while j > 0:
        i = cut[k][j]
        top = max(profile[i:j])
        out[i:j] = [top] * (j - i)
        j, k = i, k - 1
    return tuple(out)


class SeasonalPolicy(HeldScaleIn):
    """One object per instance; every instance computes the same operator-level target.

    `clock`: "monotonic" (Measurements.now counts from any origin, `phase` aligns it: the
    simulator) or "wall" (a live operator: the daemon passes unix time as `now`, so every sibling,
    on any node, reads the same slot of the day; `phase` = -profile_start)."""

    name = "seasonal"
    clock = "monotonic"

    def __init__(self, profile: Optional[Sequence[float]] = None, slot_seconds: float = 60.0, phase: float = 0.0,
                 margin_up: float = 0.05, margin: float = 0.15, horizon_up: int = 12, horizon_down: int = 12,
                 level_periods: int = 5, hold: int = 3, min_step: int = 1, cooldown_out: float = 60.0,
                 cooldown_in: float = 240.0, min_instances: int = 1, max_instances: int = 64,
                 max_points: int = 16, segments: Optional[int] = None, patience: int = 1) -> None:
        if profile is not None and (not profile or min(profile) < 0):
            raise ValueError("profile must be a non-empty sequence of rates >= 0")
        if slot_seconds <= 0:
            raise ValueError(f"slot_seconds must be > 0, found {slot_seconds}")
        if min(margin_up, margin, cooldown_out, cooldown_in) < 0:
            raise ValueError("margins and cooldowns must be >= 0")
        if segments is not None and segments < 1:
            raise ValueError(f"segments must be >= 1, found {segments}")
        if min(horizon_up, horizon_down, level_periods, hold, min_step, patience) < 1:
            raise ValueError("horizons, level_periods, hold, min_step and patience must be >= 1")
        if not 1 <= min_instances <= max_instances:
            raise ValueError(f"need 1 <= min_instances <= max_instances, found {min_instances}, {max_instances}")
        self.profile = tuple(float(x) for x in profile) if profile is not None else None
        self.slot_seconds = slot_seconds
        self.phase = phase
        self.margin_up = margin_up
        self.margin = margin
        self.horizon_up = horizon_up
        self.horizon_down = horizon_down
        self.level_periods = level_periods
        self.hold = hold
        self.min_step = min_step
        self.cooldown_out = cooldown_out
        self.cooldown_in = cooldown_in
        self.min_instances = min_instances
        self.max_instances = max_instances
        self.max_points = max_points
        self.plan = plan_day(self.profile, segments) if self.profile is not None and segments else None
        self.plan_key: Optional[Tuple[float, float]] = None  # (plan now, plan next) when `planned` was set
        self.planned = 0.0  # level x plan at the last plan boundary, records/s
        self.desired = min_instances  # the instances `planned` needs, fixed at that boundary
        self.inputs: List[float] = []  # operator input estimate per period, newest last
        self.slots: List[int] = []  # the slot of the day of each input
        self.backpressured: List[bool] = []
        self.mst = MstPoints(max_points)
        self.low_periods = 0
        self.last_action_at: Optional[float] = None
        # Plan mode: a reactive scale-out (input above the plan, or the back-pressure root) waits
        # for `patience` consecutive overloaded periods; a burst shorter than that is ridden out
        # on back pressure instead of costing two reconfigurations (out, and back after `hold`).
        self.patience = patience
        self.over_periods = 0

    # ---- model and forecast -------------------------------------------------------------------


    def needed(self, rate: float, nd_max_ms: float) -> int:
        return self.mst.needed(rate, nd_max_ms, self.min_instances, self.max_instances)

    def slot(self, now: float) -> int:
        """The slot of the day that contains `now` (+ `phase`: seconds since the profile's midnight
        at now = 0); 0 without a profile."""
        if self.profile is None:
            return 0
        return int((now + self.phase) // self.slot_seconds) % len(self.profile)

    def level(self) -> float:
        """Median ratio of the recent inputs to the profile at their slots (1.0 without data)."""
        assert self.profile is not None
        ratios = [x / self.profile[s] for x, s in zip(self.inputs[-self.level_periods:], self.slots[-self.level_periods:])
                  if self.profile[s] > 0]
        return _median(ratios) if ratios else 1.0

    def forecast_peak(self, slots_ahead: int) -> float:
        """The largest forecast input over the next `slots_ahead` slots (recent max without a profile)."""
        recent = max(self.inputs[-self.level_periods:])
        if self.profile is None:
            return recent
        lv = self.level()
        s = self.slots[-1]
        return lv * max(self.profile[(s + k) % len(self.profile)] for k in range(1, slots_ahead + 1))

    # ---- decision -----------------------------------------------------------------------------

    def observe(self, m: Measurements) -> Tuple[int, float, float]:
        """Record one period's measurements (MST point, input, slot, back pressure); returns
        (n, operator input estimate, seconds since the last action)."""
        n = m.n_instances or 1
        self.mst.record(MstPoint(n, m.nd_max_ms, m.capacity * n))
        x = max(m.throughput * n, m.load * n)
        self.inputs.append(x)
        self.slots.append(self.slot(m.now))
        self.backpressured.append(m.upstream_backpressure > 0 or m.backpressure > 0)
        keep = max(self.hold, self.level_periods)
        del self.inputs[:-keep], self.slots[:-keep], self.backpressured[:-keep]
        return n, x, (m.now - self.last_action_at if self.last_action_at is not None else float("inf"))

    def decide(self, m: Measurements) -> ScalingAction:
        n, x, since = self.observe(m)
        if self.plan is not None:
            return self._follow_plan(m, n, x, since)
        near = max(x, self.forecast_peak(1))
        overloaded = is_overload_root(m.backpressure, m.upstream_backpressure)
        if self.needed(near * (1.0 + self.margin_up), m.nd_max_ms) > n or overloaded:
            self.low_periods = 0
            if since < self.cooldown_out or n >= self.max_instances:
                return NO_ACTION
            peak = max(near, self.forecast_peak(self.horizon_up))
            target = min(self.max_instances, max(n + 1, self.needed(peak * (1.0 + self.margin), m.nd_max_ms)))
            self.last_action_at = m.now
            return share_of_delta(target - n, m, target, f"forecast peak {peak:.0f}/s needs {target} (> {n})")

        if any(self.backpressured[-self.hold:]):
            self.low_periods = 0
            return NO_ACTION
        peak = max(max(self.inputs[-self.hold:]), self.forecast_peak(self.horizon_down))
        target = max(self.min_instances, self.needed(peak * (1.0 + self.margin), m.nd_max_ms))
        return self.held_scale_in(m, n, target, since, f"forecast peak {peak:.0f}/s fits {target} (< {n})")

    def _follow_plan(self, m: Measurements, n: int, x: float, since: float) -> ScalingAction:
        """Plan mode: provision level x plan for this slot and the next, out at once, in after `hold`."""
        assert self.plan is not None
        s = self.slots[-1]
        key = (self.plan[s], self.plan[(s + 1) % len(self.plan)])
        if key != self.plan_key:  # a plan boundary: level and instance count are fixed to the next one
            self.plan_key = key
            self.planned = self.level() * max(key)
            self.desired = self.needed(self.planned * (1.0 + self.margin), m.nd_max_ms)
        planned, desired = self.planned, self.desired
        now_needs = self.needed(x * (1.0 + self.margin_up), m.nd_max_ms)
        over = now_needs > n or is_overload_root(m.backpressure, m.upstream_backpressure)
        self.over_periods = self.over_periods + 1 if over else 0
        if desired > n or (over and self.over_periods >= self.patience):
            self.low_periods = 0
            if since < self.cooldown_out or n >= self.max_instances:
                return NO_ACTION
            target = min(self.max_instances, max(n + 1, desired, now_needs))
            self.last_action_at = m.now
            return share_of_delta(target - n, m, target, f"plan {planned:.0f}/s, input {x:.0f}/s need {target} (> {n})")
        return self.scale_in_above(m, n, desired, since, f"plan {planned:.0f}/s")

    def scale_in_above(self, m: Measurements, n: int, floor: int, since: float, why: str) -> ScalingAction:
        """The held scale-in of plan mode (and of `planned`): to max(floor, what the recent peak
        needs), never while any of the last `hold` periods was back-pressured."""
        if any(self.backpressured[-self.hold:]):
            self.low_periods = 0
            return NO_ACTION
        recent = self.needed(max(self.inputs[-self.hold:]) * (1.0 + self.margin_up), m.nd_max_ms)
        target = max(self.min_instances, floor, recent)
        return self.held_scale_in(m, n, target, since, f"{why}, recent peak needs {recent}: {target} (< {n})")


def from_scaling(scaling: Any, cls: Type[SeasonalPolicy] = SeasonalPolicy,
                 point: Optional[Dict[str, Any]] = None) -> SeasonalPolicy:
    """The policy an operator's `[scaling]` section (agent.config.ScalingSection) selects. With a
    `profile`: `cls` at `point` (default: plan mode at OPERATING_POINT) on unix time (slot j of
    the day starts at profile_start + j x profile_slot, modulo the day), cooldowns of 1 (out) and
    4 (in) periods. Without: hysteresis on the recent peak (the forecast is flat at the recent
    maximum). `planned` (agent/policy/planned.py) is built here too, with its own point."""
    if not scaling.profile:
        return cls(min_instances=scaling.min_instances, max_instances=scaling.max_instances)
    pol = cls(profile=scaling.profile, slot_seconds=scaling.profile_slot, phase=-scaling.profile_start,
              cooldown_out=COOLDOWN_OUT_PERIODS * scaling.period,
              cooldown_in=COOLDOWN_IN_PERIODS * scaling.period, min_instances=scaling.min_instances,
              max_instances=scaling.max_instances, **(OPERATING_POINT if point is None else point))
    pol.clock = "wall"
    return pol


def _median(values: List[float]) -> float:
    """statistics.median, the same number (the mean of the two middle values for an even count),
    without importing statistics (with fractions and decimal: 0.4-0.6 MB resident in the agent and
    every worker, which import this policy; docs/runtime.md, "Memory")."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
