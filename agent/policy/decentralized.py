"""The paper's local, probabilistic scaling decision (thesis 3.3.1, 3.3.3; paper Algorithms 2-3, 11).

Every instance runs `decide()` once per period with the load it measured; all instances of an
operator see about the same load (the load is shared evenly), so independent coin flips add up to
the right number of instances *in expectation* without any coordination.

- replication factor p = l_t / (r*C) - 1: the number of copies of itself this instance should add
  so that every instance of the operator ends up loaded at r (the paper's n_diff / n_t with
  L_t = l_t * n_t; n_t cancels out, so an instance does not need to know its sibling count).
  Deviation: thesis Algorithm 3 floors p before using its fractional part, which would make the
  probabilistic part always 0; we keep p real, as the text and the paper's Algorithm 2 intend.
- scale-out when l_t/C >= up: floor(p) copies plus one more with probability p - floor(p).
  Deviation: Algorithm 4 line 7 reads `if n > 1`, which would never create a single copy although
  the message-cost analysis counts single duplications; we create n >= 1 copies.
- scale-in when l_t/C <= down and not keeper: terminate with probability -p = 1 - l_t/(r*C), so
  the expected survivors are n_t * l_t/(r*C) = L_t/(r*C), the ideal count.
- r_secure (thesis 3.3.3, optional, scale-out only): p_secure = ceil(l_t/C - 1) guarantees the
  capacity is not exceeded; when the r that guarantee implies (r_secure = l_t/(C*(p_secure+1))) is
  below the user's r, the decision uses r_secure. Applying it to scale-in would forbid scale-in
  altogether (r_secure = l_t/C <= down < r there), so it is not applied there.

All functions are pure; the random draw (uniform in [0, 1)) is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

__all__ = ["Action", "Decision", "ScalingParams", "NO_DECISION", "replication_factor", "r_secure", "decide"]


class Action(Enum):
    NONE = "none"
    DUPLICATE = "duplicate"
    TERMINATE = "terminate"


@dataclass(frozen=True)
class Decision:
    """What an instance intends to do; `count` = copies to create (DUPLICATE) else 0/1."""

    action: Action
    count: int = 0
    factor: float = 0.0  # the replication factor or termination probability behind it

    @property
    def scales(self) -> bool:
        return self.action is not Action.NONE


NO_DECISION = Decision(Action.NONE)


@dataclass(frozen=True)
class ScalingParams:
    """Paper defaults: C = 500 records per step, r = 0.7, up = 0.8, down = 0.6."""

    capacity: float = 500.0
    target_ratio: float = 0.7
    up: float = 0.8
    down: float = 0.6
    use_r_secure: bool = False
    max_copies: int = 64  # bound on one round's fan-out (a burst cannot create unbounded processes)

    def __post_init__(self) -> None:
        if not self.capacity > 0:
            raise ValueError(f"capacity must be > 0, found {self.capacity}")
        if not 0 < self.target_ratio <= 1:
            raise ValueError(f"target_ratio must be in (0, 1], found {self.target_ratio}")
        if not self.down < self.up:
            raise ValueError(f"down ({self.down}) must be lower than up ({self.up})")
        if self.max_copies < 1:
            raise ValueError("max_copies must be >= 1")


def replication_factor(capacity: float, target_ratio: float, load: float) -> float:
    """p = l_t / (r*C) - 1 (negative: the instance is under-loaded)."""
    return load / (target_ratio * capacity) - 1.0


def r_secure(capacity: float, load: float) -> float:
    """The load ratio reached if every instance duplicates ceil(l_t/C - 1) times (thesis 3.3.3)."""
    p_secure = max(0, math.ceil(load / capacity - 1.0))
    return load / (capacity * (p_secure + 1))


def decide(params: ScalingParams, load: float, is_keeper: bool, draw: float) -> Decision:
    """Algorithm 11 with the factor of Algorithms 2-4/8: one decision from one measured load."""
    if load < 0:
        raise ValueError(f"load must be >= 0, found {load}")
    ratio = load / params.capacity
    if ratio >= params.up:
        r = params.target_ratio
        if params.use_r_secure:
            r = min(r, r_secure(params.capacity, load))
        p = replication_factor(params.capacity, r, load)
        if p <= 0:
            return NO_DECISION
        whole = math.floor(p)
        n = whole + (1 if draw < p - whole else 0)
        n = min(n, params.max_copies)
        return Decision(Action.DUPLICATE, n, p) if n >= 1 else NO_DECISION
    if ratio <= params.down and not is_keeper:
        q = min(1.0, max(0.0, -replication_factor(params.capacity, params.target_ratio, load)))
        return Decision(Action.TERMINATE, 1, q) if draw < q else NO_DECISION
    return NO_DECISION
