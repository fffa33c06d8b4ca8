"""The policies by name: the `[scaling] policy` switch, and the paper's policy behind `decide()`.

Why a module of its own: every policy imports `agent.policy.base` for the shared types, so the
factory that imports every policy cannot live there without a cycle.
"""

from __future__ import annotations

from typing import Optional

from agent.policy import planned, seasonal
from agent.policy.base import NO_ACTION, ActionKind, Measurements, Policy, ScalingAction
from agent.policy.decentralized import Action, ScalingParams, decide
from agent.policy.model import ModelPolicy
from agent.policy.seasonal import SeasonalPolicy
from agent.policy.sized import SizedPolicy
from agent.policy.threshold import ThresholdPolicy

__all__ = ["DecentralizedPolicy", "POLICY_NAMES", "make_policy"]


class DecentralizedPolicy:
    """Adapter: the paper's probabilistic policy (agent.policy.decentralized) behind `decide()`.

    It is per-instance by construction (it never needs n); the load it compares with C is the
    records/s this instance received.
    """

    name = "decentralized"

    def __init__(self, params: Optional[ScalingParams] = None) -> None:
        self.params = params if params is not None else ScalingParams()

    def decide(self, m: Measurements) -> ScalingAction:
        params = self.params
        if params.capacity != m.capacity:  # the capacity follows calibration / throttling
            params = ScalingParams(m.capacity, params.target_ratio, params.up, params.down,
                                   params.use_r_secure, params.max_copies)
        d = decide(params, m.load, m.is_keeper, m.draw)
        if d.action is Action.DUPLICATE:
            return ScalingAction(ActionKind.SCALE_OUT, d.count, None, f"p={d.factor:.3f}")
        if d.action is Action.TERMINATE:
            return ScalingAction(ActionKind.SCALE_IN, 1, None, f"q={d.factor:.3f}")
        return NO_ACTION


POLICY_NAMES = ("decentralized", "threshold", "model", "sized", "seasonal", "planned")


def make_policy(name: str, scaling: "object" = None) -> Policy:
    """Build the policy an operator's `[scaling]` section (agent.config.ScalingSection) selects."""
    if name == "decentralized":
        if scaling is None:
            return DecentralizedPolicy()
        cap = scaling.capacity if isinstance(scaling.capacity, (int, float)) else 500.0
        return DecentralizedPolicy(ScalingParams(float(cap), scaling.target_ratio, scaling.up,
                                                 scaling.down, scaling.r_secure))
    if name == "threshold":
        if scaling is None:
            return ThresholdPolicy()
        return ThresholdPolicy(cooldown=scaling.cooldown, min_instances=scaling.min_instances,
                               max_instances=scaling.max_instances)
    if name == "model":
        if scaling is None:
            return ModelPolicy()
        return ModelPolicy(cooldown=scaling.cooldown, min_instances=scaling.min_instances,
                           max_instances=scaling.max_instances)
    if name == "sized":
        if scaling is None:
            return SizedPolicy()
        return SizedPolicy(min_instances=scaling.min_instances, max_instances=scaling.max_instances)
    if name == "seasonal":  # plan mode with a learned `profile`, else hysteresis on the recent peak
        return SeasonalPolicy() if scaling is None else seasonal.from_scaling(scaling)
    if name == "planned":  # a day plan in instance space from a learned `profile` (agent/policy/planned.py)
        return planned.PlannedPolicy() if scaling is None else planned.from_scaling(scaling)
    raise ValueError(f"unknown policy {name!r}: expected one of {', '.join(POLICY_NAMES)}")
