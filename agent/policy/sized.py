"""Sized, forecast-driven scaling with asymmetric hysteresis (issue 6: fewer, cheaper reconfigurations).

Rules of this file: pure numbers in, decisions out. The state is the recent operator-input
history, the calibration points of the MST model, a low-demand counter and the time of the last
action; time comes in `Measurements.now`; no randomness (the share mapping of
base.py uses `Measurements.draw` only when ranks are unknown).

Why another policy: the CPU-threshold baseline adds or removes ONE instance per decision and
needs a cooldown between them, so a steep ramp costs several reconfigurations and its 0.5 scale-in
threshold keeps a wide surplus; Gesscale's model policy sizes scale-down but adds one instance per
back-pressure episode, i.e. only after the operator is already saturated. This policy sizes BOTH
directions with the calibrated MST model, in one reconfiguration each:

- input estimate x: the operator's input rate, max(CT, IR) from this instance's even share (as
  model.py). Under back pressure (upstream blocked for a fraction bp of the period) the input is
  hidden: the operator processed CT but more was waiting, so x = CT * (1 + bp * `bp_boost`).
  `bp_boost` is 0 by default: right after a scale-up CT also contains the drain of the backlog,
  so a boost overshoots (measured: the first version, boost 0.5, went 2 -> 4 -> 8 -> 10 instances
  at a 1100 records/s start); a back-pressured operator adds at least one instance instead.
- forecast f = x + `horizon` * max(0, trend), trend = the mean per-period increase over the last
  `trend_periods` periods (none across back-pressured periods, whose CT includes a drain):
  scale-up happens before the back pressure, on a rising input.
- scale-up: n_up = smallest n with MST(n) >= f * (1 + `margin_up`). If n_up > n (or the operator is
  the root of back pressure, model.is_overload_root), go at once to n' = smallest n with MST(n) >= f' * (1 +
  `margin_up_target`), f' the forecast over `horizon_target` periods (default `horizon`),
  margin_up_target >= margin_up: overshoot a little so the next step is not one period later;
  at least n + 1, at most `max_instances`. One reconfiguration, however many instances.
- scale-in (asymmetric hysteresis): n_dn = smallest n with MST(n) >= peak * (1 + `margin_down`),
  peak = the highest input of the last `hold` periods. Only when n - n_dn >= `min_step` held for
  `hold` consecutive periods, nothing was back-pressured in them, and the last action is at
  least `cooldown_in` seconds old, remove n - n_dn instances at once (never below
  `min_instances`; the keeper stays, base.share_of_delta).
- scale-out is allowed every period after `cooldown_out` seconds (a reconfiguration must take
  effect before its result is measured); scale-in waits `cooldown_in` (longer) after any action.

MST model: Gesscale's MST(n, ND_max) = alpha * n**beta - gamma * ND_max (model.py), calibrated
from points (n, ND_max, n * capacity) recorded every period: `Measurements.capacity` is the
online per-instance capacity (calibrated value corrected by measured service times, issue 6), so
n * capacity is the operator's MST at its current configuration without waiting for saturation.
One point per configuration is kept (the newest: the platform drifts, e.g. thermal throttling).
The prediction at ND_max uses the current ND_max: a scale-out may raise it, which the margins cover.
"""

from __future__ import annotations

from typing import List, Optional

from agent.policy.base import NO_ACTION, HeldScaleIn, Measurements, ScalingAction, share_of_delta
from agent.policy.model import MstPoint, MstPoints, is_overload_root

__all__ = ["SizedPolicy"]


class SizedPolicy(HeldScaleIn):
    """One object per instance; every instance computes the same operator-level target."""

    name = "sized"

    def __init__(self, margin_up: float = 0.05, margin_up_target: float = 0.30, margin_down: float = 0.10,
                 hold: int = 3, min_step: int = 2, horizon: float = 1.0, trend_periods: int = 2,
                 horizon_target: Optional[float] = None,
                 bp_boost: float = 0.0, cooldown_out: float = 60.0, cooldown_in: float = 240.0,
                 min_instances: int = 1, max_instances: int = 64, max_points: int = 16) -> None:
        if not 0 <= margin_up <= margin_up_target:
            raise ValueError(f"need 0 <= margin_up <= margin_up_target, found {margin_up}, {margin_up_target}")
        if margin_down < 0:
            raise ValueError(f"margin_down must be >= 0, found {margin_down}")
        if hold < 1 or min_step < 1 or trend_periods < 1:
            raise ValueError(f"hold, min_step and trend_periods must be >= 1, "
                             f"found {hold}, {min_step}, {trend_periods}")
        if min(horizon, horizon_target if horizon_target is not None else 0.0, bp_boost, cooldown_out, cooldown_in) < 0:
            raise ValueError("horizon, horizon_target, bp_boost and the cooldowns must be >= 0")
        if not 1 <= min_instances <= max_instances:
            raise ValueError(f"need 1 <= min_instances <= max_instances, found {min_instances}, {max_instances}")
        self.margin_up = margin_up
        self.margin_up_target = margin_up_target
        self.margin_down = margin_down
        self.hold = hold
        self.min_step = min_step
        self.horizon = horizon
        self.horizon_target = horizon if horizon_target is None else horizon_target
        self.trend_periods = trend_periods
        self.bp_boost = bp_boost
        self.cooldown_out = cooldown_out
        self.cooldown_in = cooldown_in
        self.min_instances = min_instances
        self.max_instances = max_instances
        self.max_points = max_points
        self.inputs: List[float] = []  # operator input estimate per period, newest last
        self.backpressured: List[bool] = []
        self.mst = MstPoints(max_points)
        self.low_periods = 0  # consecutive periods in which a scale-in of >= min_step was possible
        self.last_action_at: Optional[float] = None

    # ---- model -----------------------------------------------------------------------------------



    def needed(self, rate: float, nd_max_ms: float) -> int:
        return self.mst.needed(rate, nd_max_ms, self.min_instances, self.max_instances)

    def forecast(self, horizon: Optional[float] = None) -> float:
        """Last input plus `horizon` periods of its recent (positive) trend."""
        horizon = self.horizon if horizon is None else horizon
        x = self.inputs[-1]
        k = min(self.trend_periods, len(self.inputs) - 1)
        if k <= 0 or any(self.backpressured[-1 - k:]):
            return x  # a backlog hides the input and its drain inflates CT: no trend from those
        trend = (x - self.inputs[-1 - k]) / k
        return x + horizon * max(0.0, trend)

    # ---- decision --------------------------------------------------------------------------------

    def decide(self, m: Measurements) -> ScalingAction:
        n = m.n_instances or 1
        self.mst.record(MstPoint(n, m.nd_max_ms, m.capacity * n))
        ct = m.throughput * n
        bp = m.upstream_backpressure  # blocked toward us: our input is hidden
        x = max(ct, m.load * n)
        if bp > 0:
            x = max(x, ct * (1.0 + bp * self.bp_boost))
        self.inputs.append(x)
        # blocked either way: no trend from this period, no scale-in after it
        self.backpressured.append(bp > 0 or m.backpressure > 0)
        keep = max(self.hold, self.trend_periods + 1)
        del self.inputs[:-keep]
        del self.backpressured[:-keep]
        since = m.now - self.last_action_at if self.last_action_at is not None else float("inf")

        f = self.forecast()
        # Gesscale's Algorithm 1: only the root of the back pressure adds instances; an operator
        # blocked by its successors would add capacity that cannot be used
        overloaded = is_overload_root(m.backpressure, m.upstream_backpressure)
        if self.needed(f * (1.0 + self.margin_up), m.nd_max_ms) > n or overloaded:
            self.low_periods = 0
            if since < self.cooldown_out or n >= self.max_instances:
                return NO_ACTION
            target = self.needed(self.forecast(self.horizon_target) * (1.0 + self.margin_up_target), m.nd_max_ms)
            target = min(self.max_instances, max(target, n + 1))
            self.last_action_at = m.now
            return share_of_delta(target - n, m, target, f"forecast {f:.0f}/s needs {target} (> {n})")

        if any(self.backpressured[-self.hold:]):
            self.low_periods = 0
            return NO_ACTION  # never scale in while anything was backlogged
        peak = max(self.inputs[-self.hold:])
        target = max(self.min_instances, self.needed(peak * (1.0 + self.margin_down), m.nd_max_ms))
        return self.held_scale_in(m, n, target, since, f"peak {peak:.0f}/s fits {target} (< {n})")
