"""Checker for lock-guarded scaling: the scaling checker plus "no two neighbours in a round".

Why a separate module: `agent.sim.checker` checks the scaling protocol's own invariants (no
stale route, no message to a terminated instance, no operator lost, consistent views at
quiescence). With `coordination = "fgme"` (`agent.protocol.guarded.GuardedCore`) we also need:

- safety, every reached state: no instance of stage s and one of stage s+1 are in a scaling
  round (DUPLICATING / DELETING / DEPARTING) at the same time;
- liveness, every terminal state: no instance still waits for or holds a lock (every intent
  was served, no deadlock of the lock chain).

The System subclass only adds these checks; moves, channels and copy-on-write are the scaling
checker's (lock messages travel on the same FIFO channels as the scaling messages).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from agent.policy.decentralized import ScalingParams
from agent.protocol.guarded import GuardedCore
from agent.sim.checker import Plan, System, build_pipeline, explore, random_runs

__all__ = ["GuardedSystem", "build_guarded", "explore", "random_runs", "neighbours_in_round"]


def neighbours_in_round(system: System) -> Optional[Tuple[str, str]]:
    stages = {}
    for c in system.cores.values():
        if c.in_round:
            stages.setdefault(c.stage, c.instance_id)
    for s, iid in stages.items():
        if s + 1 in stages:
            return ("neighbours_in_round", f"{iid} (stage {s}) and {stages[s + 1]} (stage {s + 1}) "
                    "are both in a scaling round")
    return None


class GuardedSystem(System):
    __slots__ = ()

    def copy(self) -> "GuardedSystem":
        new = System.copy(self)
        new.__class__ = GuardedSystem
        return new  # type: ignore[return-value]

    def safety(self) -> Optional[Tuple[str, str]]:
        return System.safety(self) or neighbours_in_round(self)

    def quiescence(self) -> Optional[Tuple[str, str]]:
        bad = System.quiescence(self)
        if bad:
            return bad
        for c in self.cores.values():
            if getattr(c, "lock_busy", False) and not c.terminated:
                return ("lock_not_released", f"{c.instance_id}: intent {c.intent}, holding "
                        f"{c.holding}")  # type: ignore[attr-defined]
        return None


def build_guarded(
    sizes: Sequence[int],
    plans: Sequence[Plan] = (),
    *,
    params: Optional[ScalingParams] = None,
    core_cls: type = GuardedCore,
) -> GuardedSystem:
    """`checker.build_pipeline` with guarded cores, as a GuardedSystem."""
    system = build_pipeline(sizes, plans, params=params, core_cls=core_cls)
    system.__class__ = GuardedSystem
    return system  # type: ignore[return-value]
