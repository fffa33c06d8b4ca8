"""A node's drain (`fogctl drain`, or the site manager's): whether it takes new instances, and its
keepers on their way to another node (docs/fogctl.md, "drain").

Rules of this file: no I/O, no clock, no reference to the daemon. The daemon checks the request
and its actions (agent.control.rpc_schema.agent_actions), tells the workers, and reports here
what happened; the answers say which keeper to stop when. Why keyed copies leave first: a keeper
stopped while their groups come to it would leave with those groups on their way and the records
held for them unsaved; its new incarnation would install a group and fire the group's windows by
a watermark its other groups had moved on, before the replays of the held records came. So while
keyed copies leave, every keeper of the drain waits (the predecessors whose end-of-stream markers
those moves need too), until the copies have exited or COPIES_FIRST_WAIT is over.
"""

from __future__ import annotations

from typing import AbstractSet, Dict, List, Optional, Set, Tuple

# The keepers of a drain stop once the keyed copies it terminates have handed their groups on and
# exited, or after this long at most (seconds).
COPIES_FIRST_WAIT = 30.0


class Drain:
    def __init__(self) -> None:
        self.draining = False  # no new instance here (free slots 0) until undrained
        self.handing_over: Set[str] = set()  # keepers asked to stop, to start elsewhere
        # keepers not stopped yet -> (the keyed copies still leaving, when to stop anyway)
        self.copies_first: Dict[str, Tuple[Set[str], float]] = {}
        self.moving: Set[str] = set()  # stopped keepers whose start elsewhere is not answered yet

    def set(self, draining: bool) -> None:
        """A drain (True) or an undrain: then the keepers not stopped yet stay."""
        self.draining = draining
        if not draining:
            self.handing_over.difference_update(self.copies_first)
            self.copies_first.clear()

    def hand_over(self, keeper: str, copies: AbstractSet[str], now: float) -> bool:
        """`keeper` moves to another node, once the keyed `copies` of the same request have left;
        True: stop it now (no copy to wait for)."""
        self.handing_over.add(keeper)
        if copies:
            self.copies_first[keeper] = (set(copies), now + COPIES_FIRST_WAIT)
            return False
        return True

    def release(self, now: float, left: Optional[str] = None) -> List[Tuple[str, Set[str]]]:
        """(keeper, copies still leaving) of each waiting keeper whose copies have all left (`left`
        just exited) or whose wait is over at `now`: stop it now if it still runs and still hands
        over (`stops`)."""
        out = []
        for keeper, (copies, until) in list(self.copies_first.items()):
            if left is not None:
                copies.discard(left)
            if copies and now < until:
                continue
            del self.copies_first[keeper]
            out.append((keeper, copies))
        return out

    def stops(self, keeper: str) -> bool:
        return keeper in self.handing_over

    def exited(self, instance: str) -> bool:
        """The worker of `instance` exited: True if it was a keeper stopped to hand over."""
        was = instance in self.handing_over
        self.handing_over.discard(instance)
        self.copies_first.pop(instance, None)  # a keeper that exited while its copies left
        return was


__all__ = ["COPIES_FIRST_WAIT", "Drain"]
