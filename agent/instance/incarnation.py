"""Which incarnation of an instance this is, and what the next one needs to take over
(docs/reliability.md; docs/runtime.md, "Instance"): the epoch its channels are numbered in (each
incarnation its own: receivers restart our channels and ignore what a dead one sent), taken at
the start above any a dead incarnation can have used and raised when we become a new one without
a crash; and the state file a restart reads back (`Persist`: the epoch, the channel positions, the
group table, the moves and the scaling driver's state), written at the cadence's times
(agent.instance.cadence).

Rules of this file: `Incarnation` owns the epoch and holds no reference to the instance; it is
handed the parts whose state it writes or resets (inbound channels, outputs, router, moves,
cadence) at construction, and per call the scaling driver (None before the start) and the time
`now`. A write is returned as its command. No I/O, no clock, no random.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from agent.dataplane.channel import Inbound
from agent.dataplane.routing import Router
from agent.instance.cadence import Cadence
from agent.instance.commands import Persist
from agent.instance.moves import GroupMoves
from agent.instance.outputs import Outputs

__all__ = ["Incarnation"]


class Incarnation:
    """`epoch`: ours, 0 until the start."""

    def __init__(self, inbound: Inbound, outputs: Outputs, router: Router, moves: Optional[GroupMoves],
                 cadence: Cadence) -> None:
        self.epoch = 0
        self.inbound = inbound
        self.outputs = outputs
        self.router = router
        self.moves = moves
        self.cadence = cadence

    def begin(self, saved: Dict[str, Any], restart: bool, min_epoch: Any) -> None:
        """Our start, `saved` what our last incarnation wrote ({} when none): a restarted worker
        (same identity) numbers its messages in a new epoch, above `min_epoch` too when re-homed
        after its node died (agent.node.rehome: the old state is gone with the node, so above any
        epoch the dead incarnation can have used); a restart takes its channel positions back."""
        self.epoch = int(saved.get("epoch", -1)) + 1 if saved else 0
        self.epoch = max(self.epoch, int(min_epoch or 0))
        if restart:
            self.inbound.restore(saved.get("inbound") or {}, resync=True)
        self.outputs.renumber(self.epoch)

    def renew(self) -> None:
        """A new incarnation without a crash (`Instance._new_incarnation`): a new epoch, in which
        our channels number from 1 again, and our own channels resync."""
        self.epoch += 1
        self.outputs.renumber(self.epoch)
        self.inbound.restore(self.inbound.snapshot(), resync=True)

    def state(self, scaling: Any) -> Dict[str, Any]:
        """What a restart needs: epoch, channel positions, the scaling driver's state."""
        data: Dict[str, Any] = {"epoch": self.epoch, "inbound": self.inbound.snapshot()}
        if self.router.table is not None:
            data["group_table"] = self.router.table.to_wire()  # with the routing tables (the core's)
        if self.moves is not None:
            data["moves"] = self.moves.dump()
        if scaling is not None:
            data.update(scaling.persisted())
        return data

    def write(self, now: float, force: bool, scaling: Any) -> Optional[Persist]:
        """The state file written now, if it is due (cheap: a small JSON file, at most every
        STATE_PERIOD unless the protocol state changed or `force`)."""
        if not self.cadence.write_due(now, force):
            return None
        save = Persist(self.state(scaling))
        self.inbound.changed = False
        self.cadence.written(now)
        return save
