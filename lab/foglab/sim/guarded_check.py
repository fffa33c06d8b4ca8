"""Checker for lock-guarded scaling: the scaling checker plus "no two neighbours in a round".

Why a separate module: `foglab.sim.checker` checks the scaling protocol's own invariants (no
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

from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.policy.decentralized import ScalingParams
from agent.protocol.guarded import GuardedCore, LockMessage
from agent.protocol.scaling import Send
from foglab.sim.checker import Plan, System, build_pipeline, explore, random_runs

__all__ = ["GuardedSystem", "build_guarded", "explore", "random_runs", "neighbours_in_round", "counting_core",
           "compare_damping"]


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


def counting_core(damped: bool) -> Tuple[type, Dict[str, int]]:
    """A guarded core class with the lock nodes' variant `damped` that counts, in the dict it
    returns with it, the lock messages its instances send and the rounds they start under the
    locks (docs/gme.md, "Damping in lock-guarded scaling")."""
    counts = {"lock_messages": 0, "rounds": 0}

    class Counting(GuardedCore):
        def _lock_out(self, b: int, outs: List[Any]) -> List[Any]:
            out = GuardedCore._lock_out(self, b, outs)
            counts["lock_messages"] += sum(1 for o in out if type(o) is Send and type(o.message) is LockMessage)
            return out

        def _acquire_next(self) -> List[Any]:
            was = self.guarded_round
            out = GuardedCore._acquire_next(self)
            counts["rounds"] += int(self.guarded_round and not was)
            return out

    Counting.damped = damped
    return Counting, counts


def compare_damping(schedules: int = 200, seed: int = 7, sizes: Tuple[int, int] = (1, 3),
                    sim_seeds: Sequence[int] = (), sim_steps: int = 200) -> List[Dict[str, Any]]:
    """Rounds finished and lock messages per round with and without DEVIATION 4 in the lock
    nodes: random guarded schedules (3-4 operators of `sizes` instances, 70% of the instances
    with a planned round, 8 extra rounds), and the scaling simulator for `sim_seeds`."""
    import random as _random

    from agent.policy.decentralized import Action
    from foglab.sim.checker import Plan

    def system(rng: _random.Random, cls: type) -> GuardedSystem:
        counts = [rng.randint(*sizes) for _ in range(rng.randint(3, 4))]
        plans = []
        for s, n in enumerate(counts):
            for k in range(n):
                if rng.random() < 0.7:
                    act = Action.DUPLICATE if k == 0 or rng.random() < 0.5 else Action.TERMINATE
                    plans.append(Plan(f"s{s}i{k}", act, rng.choice((1, 1, 2))))
        return build_guarded(counts, plans, core_cls=cls)

    rows: List[Dict[str, Any]] = []
    for damped in (False, True):
        cls, counts = counting_core(damped)
        r = random_runs(lambda rng: system(rng, cls), schedules=schedules, seed=seed, extra_rounds=8,
                        stop_at_first=False, max_steps=400_000)
        rows.append({"model": f"random {sizes}", "damped": damped, "rounds": r.rounds_completed,
                     "lock_messages": counts["lock_messages"], "violations": len(r.violations)})
    if sim_seeds:
        from foglab.sim.scaling_sim import SimConfig, simulate

        for damped in (False, True):
            cls, counts = counting_core(damped)
            open_rounds = 0
            for s in sim_seeds:
                res = simulate(SimConfig(seed=s, steps=sim_steps), core_cls=cls)
                open_rounds += res.rounds_open_at_end
            rows.append({"model": f"scaling_sim {list(sim_seeds)} x {sim_steps}", "damped": damped,
                         "rounds": counts["rounds"], "lock_messages": counts["lock_messages"],
                         "violations": open_rounds})
    for row in rows:
        row["per_round"] = round(row["lock_messages"] / max(1, row["rounds"]), 2)
    return rows
