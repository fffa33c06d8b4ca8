"""CPU/utilisation threshold policy with cooldown: the baseline of Gesscale, E2DF and Elastic Storm.

Rules of this file: one pure decision per call; the only state is the time of the last action the
policy itself asked for (the cooldown clock), and time comes in `Measurements.now`.

The rule (Gesscale's THR baselines, section V-A c): utilisation above `up` (0.9) adds ONE instance
to the operator, utilisation below `down` (0.5) removes ONE; after any action the policy stays
quiet for `cooldown` seconds (Elastic Storm's EM_cld: "to avoid stressing a topology with frequent
scaling decisions"). With `storm_halving=True` it behaves like Elastic Storm instead: every
overloaded instance duplicates once (at most doubling the operator) and, when all are under
`down`, the operator is halved.

Utilisation is the instance's CPU share when measured, else processed/capacity. Every instance
sees about the same utilisation (even split), so the per-operator "+1 / -1" is mapped onto the
instances by `share_of_delta` (base.py): exactly one instance acts when ranks are known.
"""

from __future__ import annotations

import math
from typing import Optional

from agent.policy.base import NO_ACTION, ActionKind, Measurements, ScalingAction, share_of_delta

__all__ = ["ThresholdPolicy"]


class ThresholdPolicy:
    name = "threshold"

    def __init__(self, up: float = 0.9, down: float = 0.5, cooldown: float = 120.0,
                 min_instances: int = 1, max_instances: int = 64, storm_halving: bool = False) -> None:
        if not 0 <= down < up:
            raise ValueError(f"need 0 <= down < up, found down={down}, up={up}")
        if cooldown < 0:
            raise ValueError(f"cooldown must be >= 0, found {cooldown}")
        if not 1 <= min_instances <= max_instances:
            raise ValueError(f"need 1 <= min_instances <= max_instances, found {min_instances}, {max_instances}")
        self.up = up
        self.down = down
        self.cooldown = cooldown
        self.min_instances = min_instances
        self.max_instances = max_instances
        self.storm_halving = storm_halving
        self.last_action_at: Optional[float] = None

    def in_cooldown(self, now: float) -> bool:
        return self.last_action_at is not None and now - self.last_action_at < self.cooldown

    def decide(self, m: Measurements) -> ScalingAction:
        if self.in_cooldown(m.now):
            return NO_ACTION
        u = m.utilisation
        n = m.n_instances or 1
        delta = 0
        if u > self.up and n < self.max_instances:
            delta = min(n if self.storm_halving else 1, self.max_instances - n)
        elif u < self.down and n > self.min_instances:
            delta = max(self.min_instances, math.ceil(n / 2)) - n if self.storm_halving else -1
        if delta == 0:
            return NO_ACTION
        # every instance sees the same utilisation, so all of them start the cooldown together,
        # whether or not their share of the change is to act
        self.last_action_at = m.now
        if self.storm_halving and delta > 0:
            return ScalingAction(ActionKind.SCALE_OUT, 1, n + delta, f"u={u:.2f}>{self.up}")
        reason = f"u={u:.2f}{'>' if delta > 0 else '<'}{self.up if delta > 0 else self.down}"
        return share_of_delta(delta, m, n + delta, reason)
