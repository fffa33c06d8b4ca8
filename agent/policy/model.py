"""Gesscale's model-based policy: back-pressure overload detection and the MST performance model.

Rules of this file: pure numbers in, decisions out; the only state is the list of calibration
points and the cooldown clock, both fed through `decide()`.

The model (Gesscale eq. 1):  MST(n, ND_max) = alpha * n**beta - gamma * ND_max
  alpha: MST of one instance, beta: parallelization inefficiency, gamma: cost of network delay
  (records/s per ms of the largest RTT among the operator's nodes).

Calibration (Gesscale IV-C-1): a point (n, ND_max, MST) can only be measured while the operator
works at its maximum capacity, i.e. when it is about to be scaled up; then its throughput IS its
MST. With one point, alpha = MST/n (beta = 1, gamma = 0, eq. 2); with two, alpha and gamma
(beta = 1, eq. 3); with three or more, all three by least squares. Before any point is measured
online, the calibrated capacity of one instance (`fog-agent calibrate`, Measurements.capacity)
serves as the single point (1, 0, capacity): that is what the thesis's capacity estimation
measures.

Decisions:
- scale-up (Algorithm 1 + 3): this operator is the root of back pressure when its predecessors are
  blocked (BP_{i-1} > 0.5) and it is not (BP_i <= 0.5): record (n, ND_max, CT) and add ONE instance.
- scale-down (Algorithms 2 + 4): remove as many instances as the model allows while the predicted
  MST still covers the demand with a margin: keep going down while MST(n-1) >= max(CT, IR) and
  DT(n-1) = 100 * (MST(n-1) - CT) / MST(n-1) >= Trshld_DT and n-1 >= n_min.
  Deviation: Algorithm 4 line 5 prints `MST <= IR` as the loop condition, which would remove
  instances exactly when they are needed; the text ("remove as many resource units as possible
  without reducing the MST below the current system throughput") says >=, which we follow.
  ND_max is kept at its current value for the smaller configurations: removing the farthest
  instance can only lower it, so the prediction errs on the safe side.
- extensions, all off by default (Gesscale as published): `sized_scale_up` adds enough instances
  to restore the scale-down margin (MST(n') >= CT / (1 - DT)) instead of one; `early_up` = u scales
  up when CT >= u * MST_predicted(n) before back pressure appears; `demand_window` = k scales down
  against the highest demand of the last k periods (less flapping, slower release);
  `min_scale_down` = k removes only when at least k instances can go at once (fewer, larger
  reconfigurations during a slow decline, at the price of some over-provisioning).
- after an action, no decision for `cooldown` seconds (a reconfiguration must settle before its
  effect is measured; Gesscale monitors every minute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from agent.policy.base import NO_ACTION, Measurements, ScalingAction, share_of_delta

__all__ = [
    "MstModel",
    "MstPoint",
    "MstPoints",
    "fit_mst",
    "is_overload_root",
    "scale_down_target",
    "ModelPolicy",
    "HIGH_BACKPRESSURE",
]

HIGH_BACKPRESSURE = 0.5  # Gesscale: "high level of back pressure" is BP > 0.5


@dataclass(frozen=True)
class MstPoint:
    n: int
    nd_max_ms: float
    mst: float

    def __post_init__(self) -> None:
        if self.n < 1 or self.nd_max_ms < 0 or not self.mst > 0:
            raise ValueError(f"invalid MST point n={self.n}, nd={self.nd_max_ms}, mst={self.mst}")


@dataclass(frozen=True)
class MstModel:
    alpha: float
    beta: float = 1.0
    gamma: float = 0.0
    points: int = 0  # how many measurements it was fitted on (1, 2: simplified forms)

    def predict(self, n: int, nd_max_ms: float = 0.0) -> float:
        return self.alpha * n ** self.beta - self.gamma * nd_max_ms

    def instances_for(self, rate: float, nd_max_ms: float = 0.0, n_max: int = 10 ** 6) -> Optional[int]:
        """Smallest n whose predicted MST covers `rate` (None if even n_max does not)."""
        for n in range(1, n_max + 1):
            if self.predict(n, nd_max_ms) >= rate:
                return n
        return None


def _lstsq2(x1: Sequence[float], x2: Sequence[float], y: Sequence[float]) -> Optional[Tuple[float, float]]:
    """Least squares for y = a*x1 + b*x2 (normal equations; None when singular)."""
    s11 = sum(a * a for a in x1)
    s22 = sum(b * b for b in x2)
    s12 = sum(a * b for a, b in zip(x1, x2))
    s1y = sum(a * c for a, c in zip(x1, y))
    s2y = sum(b * c for b, c in zip(x2, y))
    det = s11 * s22 - s12 * s12
    if abs(det) <= 1e-12 * max(1.0, s11 * s22):
        return None
    return (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det


def _alpha_only(points: Sequence[MstPoint], beta: float = 1.0) -> MstModel:
    xs = [p.n ** beta for p in points]
    alpha = sum(x * p.mst for x, p in zip(xs, points)) / sum(x * x for x in xs)
    return MstModel(alpha, beta, 0.0, len(points))


def _alpha_gamma(points: Sequence[MstPoint], beta: float) -> Tuple[Optional[MstModel], float]:
    """Best (alpha, gamma) for a fixed beta, gamma >= 0; and its squared error."""
    x1 = [p.n ** beta for p in points]
    x2 = [-p.nd_max_ms for p in points]
    y = [p.mst for p in points]
    sol = _lstsq2(x1, x2, y)
    if sol is None or sol[1] < 0:  # no delay information, or noise made gamma negative
        model = _alpha_only(points, beta)
    else:
        model = MstModel(sol[0], beta, sol[1], len(points))
    sse = sum((model.predict(p.n, p.nd_max_ms) - p.mst) ** 2 for p in points)
    return model, sse


def fit_mst(points: Sequence[MstPoint], beta_range: Tuple[float, float] = (0.2, 1.5)) -> MstModel:
    """The Gesscale calibration: 1 point -> eq. (2), 2 points -> eq. (3), 3+ -> eq. (1)."""
    pts = list(points)
    if not pts:
        raise ValueError("cannot fit the MST model without a measurement")
    if len(pts) == 1:
        return MstModel(pts[0].mst / pts[0].n, 1.0, 0.0, 1)
    if len(pts) == 2 or len({p.n for p in pts}) < 2:
        model, _ = _alpha_gamma(pts, 1.0)
        return MstModel(model.alpha, 1.0, model.gamma, len(pts))
    # For a fixed beta, alpha and gamma are linear: search beta (grid, then golden section).
    lo, hi = beta_range
    grid = [lo + (hi - lo) * i / 130 for i in range(131)]
    errs = [_alpha_gamma(pts, b)[1] for b in grid]
    i = min(range(len(grid)), key=errs.__getitem__)
    a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = _alpha_gamma(pts, c)[1], _alpha_gamma(pts, d)[1]
    for _ in range(60):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = _alpha_gamma(pts, c)[1]
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = _alpha_gamma(pts, d)[1]
    model, _ = _alpha_gamma(pts, (a + b) / 2)
    return model


class MstPoints:
    """The calibration points of one operator's MST model and the model fitted to them.

    One point per configuration (n, ND_max to 10 ms), the newest: the platform changes (a Pi
    heats, a neighbour loads it), so an old measurement of the same configuration is stale. The
    fit runs again only after a new point (the model, sized and seasonal policies ask every period).
    """

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self.points: List[MstPoint] = []
        self._model: Optional[MstModel] = None

    def record(self, point: MstPoint) -> None:
        self.points = [p for p in self.points
                       if not (p.n == point.n and abs(p.nd_max_ms - point.nd_max_ms) < 10.0)]
        self.points.append(point)
        del self.points[:-self.max_points]
        self._model = None

    def model(self) -> MstModel:
        """The fitted model (the points must not be empty)."""
        if self._model is None:
            self._model = fit_mst(self.points)
        return self._model

    def needed(self, rate: float, nd_max_ms: float, min_instances: int, max_instances: int) -> int:
        """Smallest instance count whose predicted MST covers `rate` (max_instances if none does)."""
        n = self.model().instances_for(rate, nd_max_ms, max_instances)
        return max(min_instances, n if n is not None else max_instances)


def is_overload_root(backpressure: float, upstream_backpressure: float) -> bool:
    """Algorithm 1: predecessors blocked, this operator not: it is the bottleneck."""
    return upstream_backpressure > HIGH_BACKPRESSURE and backpressure <= HIGH_BACKPRESSURE


def _dt(mst: float, ct: float) -> float:
    return 100.0 * (mst - ct) / mst if mst > 0 else -math.inf


def scale_down_target(model: MstModel, n: int, ct: float, ir: float, nd_max_ms: float,
                      threshold_dt: float, n_min: int = 1) -> int:
    """Algorithms 2 + 4 (corrected, see module doc): the smallest safe instance count <= n."""
    demand = max(ct, ir)
    while n - 1 >= n_min:
        mst = model.predict(n - 1, nd_max_ms)
        if mst >= demand and _dt(mst, demand) >= threshold_dt:
            n -= 1
        else:
            break
    return n


class ModelPolicy:
    """Gesscale behind `decide()`; one object per instance (see base.py for the share mapping)."""

    name = "model"

    def __init__(self, threshold_dt: float = 15.0, cooldown: float = 120.0, min_instances: int = 1,
                 max_instances: int = 64, max_points: int = 16, sized_scale_up: bool = False,
                 demand_window: int = 1, early_up: Optional[float] = None, min_scale_down: int = 1) -> None:
        if not 0 <= threshold_dt < 100:
            raise ValueError(f"threshold_dt is a percentage in [0, 100), found {threshold_dt}")
        if not 1 <= min_instances <= max_instances:
            raise ValueError(f"need 1 <= min_instances <= max_instances, found {min_instances}, {max_instances}")
        self.threshold_dt = threshold_dt
        self.cooldown = cooldown
        self.min_instances = min_instances
        self.max_instances = max_instances
        self.max_points = max_points
        self.sized_scale_up = sized_scale_up
        self.demand_window = max(1, demand_window)
        self.early_up = early_up
        self.min_scale_down = max(1, min_scale_down)
        self._recent: List[float] = []
        self.mst = MstPoints(max_points)
        self.last_action_at: Optional[float] = None

    def model(self, capacity: Optional[float] = None) -> Optional[MstModel]:
        if self.mst.points:
            return self.mst.model()
        return MstModel(capacity, 1.0, 0.0, 0) if capacity else None

    def decide(self, m: Measurements) -> ScalingAction:
        if self.last_action_at is not None and m.now - self.last_action_at < self.cooldown:
            return NO_ACTION
        n = m.n_instances or 1
        ct = m.throughput * n  # operator throughput, from this instance's even share
        ir = m.load * n
        self._recent.append(max(ct, ir))
        del self._recent[:-self.demand_window]
        root = is_overload_root(m.backpressure, m.upstream_backpressure)
        early = False
        if not root and self.early_up is not None and m.backpressure <= HIGH_BACKPRESSURE:
            mod = self.model(m.capacity)
            early = mod is not None and ct >= self.early_up * mod.predict(n, m.nd_max_ms)
        if root or early:
            if root and ct > 0:
                self.mst.record(MstPoint(n, m.nd_max_ms, ct))
            if n + 1 > self.max_instances:
                return NO_ACTION
            target = n + 1
            if self.sized_scale_up:
                # restore the scale-down margin: MST(n') >= CT / (1 - DT), at least +1
                need = ct / (1.0 - self.threshold_dt / 100.0)
                sized = self.model(m.capacity).instances_for(need, m.nd_max_ms, self.max_instances)
                target = max(n + 1, sized if sized is not None else self.max_instances)
            target = min(target, self.max_instances)
            self.last_action_at = m.now
            return share_of_delta(target - n, m, target, f"overload root, MST({n})={ct:.0f}")
        if m.upstream_backpressure > HIGH_BACKPRESSURE or m.backpressure > HIGH_BACKPRESSURE:
            return NO_ACTION  # saturated somewhere: never scale down under back pressure
        model = self.model(m.capacity)
        if model is None:
            return NO_ACTION
        peak = max(self._recent)
        target = scale_down_target(model, n, peak, peak, m.nd_max_ms, self.threshold_dt, self.min_instances)
        if n - target < min(self.min_scale_down, n - self.min_instances):
            return NO_ACTION  # batch removals: wait until several instances can go at once
        self.last_action_at = m.now
        return share_of_delta(target - n, m, target,
                              f"MST({target})={model.predict(target, m.nd_max_ms):.0f} >= {max(ct, ir):.0f}")
