"""One interface for every scaling policy: `policy.decide(measurements) -> ScalingAction`.

Why: the operator's `[scaling] policy = "decentralized" | "threshold" | "model"` must be a
configuration switch, not a code path per policy in the worker, the daemon and the simulator.
Each policy object is owned by ONE operator instance, is fed that instance's measurements once per
period, and may keep state between calls (a cooldown clock, model calibration points); it never
reads a clock or a random generator itself: `Measurements.now` and `Measurements.draw` bring them.

Mapping Gesscale's per-operator decision onto decentralized instances
----------------------------------------------------------------------
Gesscale (and the CPU-threshold baselines) decide for a whole operator: "go from n to n' replicas".
Here there is no operator controller; every instance decides for itself. Each instance therefore
(1) estimates the operator-level inputs from its own share, assuming the even split the routing
gives (operator throughput CT = n * own throughput, input rate IR = n * own received load, n from
the retained agent states), (2) computes the same operator-level target n' as the paper, and
(3) applies its *share* of the change delta = n' - n:

- with a rank (`Measurements.rank`: this instance's position among its siblings, 0 = the one
  farthest from the others in the latency matrix), the share is exact and deterministic: on
  scale-in the |delta| farthest non-keeper instances terminate; on scale-out instance k (counting
  from the closest, i.e. n-1-rank) creates ceil((delta - k) / n) copies, so the n instances create
  exactly delta in total (Gesscale's "remove the farthest", plus "add near the others", which the
  placement functions below choose);
- without a rank, each instance acts with probability: scale-out delta/n copies per instance
  (floor plus a coin flip on the fraction), scale-in with probability |delta|/(n-1) per non-keeper
  (the keeper never terminates), so the expected change is delta, as in the paper's protocol.

Placement (where a new instance goes, which one is the farthest, the rank above) lives in ONE
module, agent/node/placement.py, which the daemon and the simulator both use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Optional

try:  # Python 3.8+: typing.Protocol
    from typing import Protocol
except ImportError:  # pragma: no cover
    Protocol = object  # type: ignore

__all__ = [
    "ActionKind",
    "ScalingAction",
    "Measurements",
    "Policy",
    "NO_ACTION",
    "share_of_delta",
    "HeldScaleIn",
]


class ActionKind(Enum):
    NONE = "none"
    SCALE_OUT = "scale_out"  # duplicate this instance `count` times
    SCALE_IN = "scale_in"  # terminate this instance


@dataclass(frozen=True)
class ScalingAction:
    """What one instance does now. `target` is the operator-level n' the policy aimed for (if any)."""

    kind: ActionKind
    count: int = 0
    target: Optional[int] = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.kind is ActionKind.NONE and self.count != 0:
            raise ValueError(f"a NONE action has count 0, found {self.count}")
        if self.kind is not ActionKind.NONE and self.count < 1:
            raise ValueError(f"a {self.kind.value} action needs count >= 1, found {self.count}")

    @property
    def scales(self) -> bool:
        return self.kind is not ActionKind.NONE


NO_ACTION = ScalingAction(ActionKind.NONE)


@dataclass(frozen=True)
class Measurements:
    """What one instance measured over its last period (rates in records/s, times in seconds).

    load: records/s this instance received (the paper's l_t divided by the period).
    throughput: records/s it processed (Gesscale's CT for its share).
    capacity: records/s one instance sustains here (calibrated, corrected online).
    cpu: this instance's CPU utilisation in [0, 1] (None: use throughput/capacity).
    backpressure: fraction of the period this instance was blocked by its successors.
    upstream_backpressure: the same for its predecessors toward it (max over them).
    n_instances: siblings including itself (None when unknown: per-instance policies only).
    nd_max_ms: the largest RTT among the operator's nodes, ms (Gesscale ND_max).
    rank: position among siblings, 0 = farthest in the latency matrix (None: unknown).
    draw: a uniform number in [0, 1) for probabilistic policies.
    """

    now: float
    load: float
    throughput: float
    capacity: float
    cpu: Optional[float] = None
    backpressure: float = 0.0
    upstream_backpressure: float = 0.0
    n_instances: Optional[int] = None
    nd_max_ms: float = 0.0
    rank: Optional[int] = None
    is_keeper: bool = False
    draw: float = 0.0

    def __post_init__(self) -> None:
        if self.load < 0 or self.throughput < 0:
            raise ValueError(f"load and throughput must be >= 0, found {self.load}, {self.throughput}")
        if not self.capacity > 0:
            raise ValueError(f"capacity must be > 0, found {self.capacity}")
        if self.n_instances is not None and self.n_instances < 1:
            raise ValueError(f"n_instances must be >= 1, found {self.n_instances}")
        if not 0.0 <= self.draw < 1.0:
            raise ValueError(f"draw must be in [0, 1), found {self.draw}")

    @property
    def utilisation(self) -> float:
        """CPU when measured, else processed/capacity (what a busy single-threaded worker shows)."""
        return self.cpu if self.cpu is not None else self.throughput / self.capacity


class Policy(Protocol):
    name: str

    def decide(self, m: Measurements) -> ScalingAction:  # pragma: no cover - interface
        ...


def share_of_delta(delta: int, m: Measurements, target: Optional[int] = None, reason: str = "") -> ScalingAction:
    """This instance's part of an operator-level change of `delta` instances (see module doc)."""
    n = m.n_instances or 1
    if delta > 0:
        if m.rank is not None:
            k = n - 1 - m.rank  # 0 = closest to the others: it adds first
            count = max(0, math.ceil((delta - k) / n))
        else:
            per = delta / n
            count = math.floor(per) + (1 if m.draw < per - math.floor(per) else 0)
        return ScalingAction(ActionKind.SCALE_OUT, count, target, reason) if count else NO_ACTION
    if delta < 0 and not m.is_keeper:
        if m.rank is not None:
            go = m.rank < -delta
        else:
            go = m.draw < min(1.0, -delta / max(1, n - 1))
        return ScalingAction(ActionKind.SCALE_IN, 1, target, reason) if go else NO_ACTION
    return NO_ACTION


class HeldScaleIn:
    """Hysteresis for scale-in, shared by the sized and seasonal policies: a scale-in to `target`
    happens only after `hold` consecutive periods in which it removes at least `min_step`
    instances (or down to `min_instances`), and `cooldown_in` seconds after the last action. One
    low period in between and the count starts again: a dip shorter than `hold` periods never
    removes instances that the next peak would have to start again (docs/measurement.md)."""

    hold: int
    min_step: int
    min_instances: int
    cooldown_in: float
    low_periods: int
    last_action_at: Optional[float]

    def held_scale_in(self, m: Measurements, n: int, target: int, since: float, reason: str) -> ScalingAction:
        if target < n and n - target >= min(self.min_step, n - self.min_instances):
            self.low_periods += 1
        else:
            self.low_periods = 0
            return NO_ACTION
        if self.low_periods < self.hold or since < self.cooldown_in:
            return NO_ACTION
        self.low_periods = 0
        self.last_action_at = m.now
        return share_of_delta(target - n, m, target, reason)
