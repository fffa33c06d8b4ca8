"""What a worker reports about its scaling rounds and its 2-FGME locks (pure bookkeeping).

Why a module of its own: the worker's scaling driver feeds the core and performs its outputs; this
file only *watches* the core after each call and turns state changes into records: round
intervals (for tests and benchmarks: "were two neighbouring operators ever in a round at once?"),
lock transitions per boundary (for the `lock_request` / `lock_enter` / `lock_exit` events that
`fogctl watch` prints) and the `lock` view of the heartbeat stats (what `fogctl locks` shows,
through the agent's retained state). No I/O and no clock: the driver passes the times in.

Round interval. `enter` is taken right after the core call that moved the instance into a round
returns, `exit` right after the call that ended it, before any output of that call is performed.
With `coordination = "fgme"` the core enters a round only after the last lock Ack arrived and
sends its exit messages (End / Ack(end)) only as outputs of the call that ends the round, so a
neighbour that enters after us does so after receiving one of those messages: our `exit` precedes
its `enter` on any clock shared by both processes (CLOCK_MONOTONIC is system-wide on Linux). The
recorded intervals of two conflicting rounds are therefore disjoint whenever the protocol is
right, and an overlap of recorded intervals on one host is a real violation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

__all__ = ["LockTransition", "RoundLog", "boundary_name"]

ROUNDS_KEPT = 32  # round records kept in the heartbeat stats (newest last)


def boundary_name(operators: Sequence[str], b: int) -> Optional[str]:
    """"a|b" for boundary b (between operators b and b+1), None outside the pipeline."""
    if 0 <= b < len(operators) - 1:
        return f"{operators[b]}|{operators[b + 1]}"
    return None


@dataclass(frozen=True)
class LockTransition:
    """Boundary `boundary` (index `index`) of this instance went `old` -> `new` (GmeState values)."""

    index: int
    boundary: str
    old: str
    new: str

    @property
    def event_type(self) -> Optional[str]:
        if self.new == "requesting":
            return "lock_request"
        if self.new == "in_cs":
            return "lock_enter"
        if self.old == "in_cs" and self.new == "idle":
            return "lock_exit"
        return None  # requesting -> idle cannot happen (a request ends in the CS)


class RoundLog:
    """Watches one core (a `ScalingCore` or a `GuardedCore`) after each driver call."""

    def __init__(self, operators: Sequence[str], operator: str) -> None:
        self.operators = tuple(operators)
        self.operator = operator
        self.rounds: Deque[Dict[str, Any]] = deque(maxlen=ROUNDS_KEPT)
        self.rounds_started = 0
        self.rounds_finished = 0
        self._in_round = False
        self._locks: Dict[int, str] = {}
        self._decided: Optional[float] = None  # when the pending decision was taken (mono)
        self.lock_waits: List[float] = []  # decision -> round start, seconds (guarded rounds)

    def decided(self, mono: float) -> None:
        """A decision that acts was handed to the core at `mono` (its round may start later)."""
        if self._decided is None:
            self._decided = mono

    def observe(self, core: Any, mono: float, wall: float) -> Tuple[List[LockTransition], Optional[str]]:
        """Compare with the last call: lock transitions, and "start"/"end" if a round did."""
        trans: List[LockTransition] = []
        states = core.lock_states() if hasattr(core, "lock_states") else {}
        for b, st in states.items():
            name = boundary_name(self.operators, b)
            if name is None:
                continue
            old = self._locks.get(b, "idle")
            if st.value != old:
                trans.append(LockTransition(b, name, old, st.value))
                self._locks[b] = st.value
        edge: Optional[str] = None
        now_in = bool(core.in_round)
        if now_in and not self._in_round:
            rec: Dict[str, Any] = {"round": core.round, "kind": core.state.value, "enter": mono,
                                   "exit": None, "wall": round(wall, 3)}
            if self._decided is not None:
                rec["wait"] = round(mono - self._decided, 4)
                if hasattr(core, "locks"):
                    self.lock_waits.append(mono - self._decided)
                    del self.lock_waits[:-ROUNDS_KEPT]
            self._decided = None
            self.rounds.append(rec)
            self.rounds_started += 1
            edge = "start"
        elif self._in_round and not now_in:
            if self.rounds and self.rounds[-1]["exit"] is None:
                self.rounds[-1]["exit"] = mono
            self.rounds_finished += 1
            edge = "end"
        self._in_round = now_in
        if not now_in and getattr(core, "intent", None) is None:
            self._decided = None  # no round and no intent waiting: that decision is over
        return trans, edge

    def stats(self, core: Any) -> Dict[str, Any]:
        """`rounds` (intervals, monotonic seconds) always; `lock` only for a guarded core."""
        out: Dict[str, Any] = {"rounds": [dict(r) for r in self.rounds], "rounds_started": self.rounds_started}
        if hasattr(core, "lock_states"):
            bounds = []
            for b, st in core.lock_states().items():
                name = boundary_name(self.operators, b)
                if name is None:
                    continue
                node = core.locks[b]
                bounds.append({
                    "boundary": name, "index": b, "group": self.operator, "state": st.value,
                    "competitors": len(node.competitors), "entries": node.entries,
                })
            # `intent` with `adopting` None is a round decided and not started yet: a re-home
            # gives it to the new incarnation (agent.node.rehome, `lock_intent`); an adoption is
            # redone from `idle_copies` instead
            out["lock"] = {"state": core.lock_state.value, "boundaries": bounds,
                           "intent": core.intent.action.value if core.intent is not None else None,
                           "adopting": getattr(core, "adopting", None)}
            if self.lock_waits:
                w = sorted(self.lock_waits)
                out["lock_wait_s"] = {"n": len(w), "median": round(w[len(w) // 2], 4), "max": round(w[-1], 4)}
        return out
