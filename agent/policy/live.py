"""The Gesscale policies (threshold, model, sized) in a running instance: one period's numbers in,
the protocol core's `Decision` out.

Why a module of its own: the worker owns the clocks and the measurements, the daemon owns the fleet
view (siblings, latencies, the predecessors' back pressure), and the policy objects are the very ones
`fog-agent simulate policies` drives (lab/foglab/sim/policies.py). `LivePolicy` is the seam: pure, fed
once per decision period with `PeriodInputs` (what the worker measured plus the latest context the
daemon sent), it builds the same `Measurements` the simulator builds, asks the policy, and maps the
resulting `ScalingAction` onto the decentralized protocol's vocabulary:

- SCALE_OUT count k  -> Decision(DUPLICATE, k): this instance creates k copies in one round;
- SCALE_IN           -> Decision(TERMINATE): this instance leaves (never the keeper);
- NONE               -> no round.

Which instance acts is decided by `share_of_delta` (agent/policy/base.py) from the rank the daemon
computed (docs/measurement.md, "Policies in the daemon").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from agent.policy.base import ActionKind, Measurements, Policy, ScalingAction
from agent.policy.registry import make_policy
from agent.policy.decentralized import NO_DECISION, Action, Decision
from agent.policy.model import is_overload_root

__all__ = ["LIVE_POLICIES", "LivePolicy", "PeriodInputs", "to_decision", "parse_context"]

# The policies that run through LivePolicy; "decentralized" keeps the protocol core's own decide()
LIVE_POLICIES = ("threshold", "model", "sized", "seasonal", "planned")


@dataclass(frozen=True)
class PeriodInputs:
    """One decision period of one instance (rates in records/s, ratios in [0, 1])."""

    now: float
    input_rate: float
    processed_rate: float
    capacity: float
    backpressure: float
    is_keeper: bool
    draw: float
    wall: Optional[float] = None  # unix time of `now`: the clock of a policy with clock = "wall"


def to_decision(action: ScalingAction) -> Decision:
    if action.kind is ActionKind.SCALE_OUT:
        return Decision(Action.DUPLICATE, action.count, float(action.target or 0))
    if action.kind is ActionKind.SCALE_IN:
        return Decision(Action.TERMINATE, 1, float(action.target or 0))
    return NO_DECISION


def parse_context(raw: Any) -> Optional[Dict[str, Any]]:
    """The daemon's context line (agent/node/placement.py instance_context), checked: the control
    pipe comes from our own agent, but a bad value must not reach the policy as a crash."""
    if not isinstance(raw, Mapping):
        return None
    n = raw.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    rank = raw.get("rank")
    if not (rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < n)):
        rank = None
    nd = raw.get("nd_max_ms", 0.0)
    up = raw.get("upstream_backpressure", 0.0)
    return {
        "n": n,
        "rank": rank,
        "nd_max_ms": float(nd) if isinstance(nd, (int, float)) and nd >= 0 else 0.0,
        "upstream_backpressure": min(1.0, max(0.0, float(up))) if isinstance(up, (int, float)) else 0.0,
    }


class LivePolicy:
    """One instance's policy object plus the last context; `decide(inputs)` once per period."""

    def __init__(self, name: str, scaling: Any = None) -> None:
        if name not in LIVE_POLICIES:
            raise ValueError(f"not a live Gesscale policy: {name!r} (expected one of {', '.join(LIVE_POLICIES)})")
        self.name = name
        self.policy: Policy = make_policy(name, scaling)
        self.context: Optional[Dict[str, Any]] = None
        self.last: Optional[Dict[str, Any]] = None  # the last decision's numbers (stats, fogctl why)

    def set_context(self, raw: Any) -> bool:
        ctx = parse_context(raw)
        if ctx is not None:
            self.context = ctx
        return ctx is not None

    def measurements(self, p: PeriodInputs) -> Measurements:
        ctx = self.context or {"n": 1, "rank": None, "nd_max_ms": 0.0, "upstream_backpressure": 0.0}
        wall = getattr(self.policy, "clock", "monotonic") == "wall" and p.wall is not None
        return Measurements(
            now=p.wall if wall else p.now, load=max(0.0, p.input_rate), throughput=max(0.0, p.processed_rate), capacity=p.capacity,
            cpu=None,  # utilisation = processed / live capacity: the busy share, emulated service time included
            backpressure=p.backpressure, upstream_backpressure=ctx["upstream_backpressure"], n_instances=ctx["n"],
            nd_max_ms=ctx["nd_max_ms"], rank=ctx["rank"], is_keeper=p.is_keeper, draw=p.draw,
        )

    def decide(self, p: PeriodInputs) -> Decision:
        m = self.measurements(p)
        action = self.policy.decide(m)
        self.last = {
            "policy": self.name, "utilisation": round(m.utilisation, 4), "n": m.n_instances, "rank": m.rank,
            "nd_max_ms": m.nd_max_ms, "backpressure": round(m.backpressure, 4),
            "upstream_backpressure": round(m.upstream_backpressure, 4),
            "overload_root": is_overload_root(m.backpressure, m.upstream_backpressure),
            "action": action.kind.value, "count": action.count, "target": action.target, "reason": action.reason,
            "context": self.context is not None,
        }
        if action.kind is ActionKind.SCALE_IN and p.is_keeper:
            return NO_DECISION  # share_of_delta never picks the keeper; a policy that did is overruled
        return to_decision(action)
