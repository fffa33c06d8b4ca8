"""Which inputs an instance may not ack upstream yet, and the keyed save that lets it ack more
(docs/runtime.md, "Instance"; docs/reliability.md: acks are end to end).

An input is pending while its outputs are not all acked by the successors (agent.instance.outputs),
a deferred sink has not recorded it (agent.instance.sink), the keyed state that reflects it is not
saved, or not yet held by the standby copy (agent.instance.keyed_state), or its records wait for
their key group's move or their outputs for their acks (agent.instance.moves). The lowest pending
index is what the acks upstream, a source's resume position and the watermark passed on read.

Rules of this file: `PendingInputs` owns no state of its own and holds no reference to the
instance; it reads the parts that hold inputs back, handed at construction. No I/O, no clock.
"""

from __future__ import annotations

from typing import Optional

from agent.instance.commands import SaveKeyed
from agent.instance.keyed_state import KeyedState
from agent.instance.moves import GroupMoves
from agent.instance.outputs import Outputs
from agent.instance.sink import SinkSide

__all__ = ["PendingInputs"]


class PendingInputs:
    """The inputs not to be acked upstream yet, read from the parts that hold them (`keyed`,
    `moves`: None where there are none)."""

    def __init__(self, outputs: Outputs, sink: SinkSide, keyed: Optional[KeyedState],
                 moves: Optional[GroupMoves]) -> None:
        self.outputs = outputs
        self.sink = sink
        self.keyed = keyed
        self.moves = moves

    def lowest_forwarding(self) -> Optional[int]:
        """The lowest input index whose outputs are not all acked by the successors yet, nor
        recorded by a deferred sink (agent.instance.outputs)."""
        return self.outputs.lowest_forwarding(self.sink.first())

    def lowest(self) -> Optional[int]:
        """The lowest input index not to be acked upstream yet: its outputs are not all acked by
        the successors, or (keyed state) the state that reflects it is not saved yet."""
        low = fwd = self.lowest_forwarding()
        if self.keyed is not None and self.keyed.lowest_unsaved() is not None:
            k = self.keyed.lowest_unsaved()
            low = k if low is None else min(low, k)
        if self.moves is not None:
            # records held for a group on its way: acked once applied, saved and their outputs acked
            h = self.moves.lowest_held(fwd)
            if h is not None:
                low = h if low is None else min(low, h)
        return low

    def save_keyed(self) -> SaveKeyed:
        """Keyed state, its input positions and the outputs not acked downstream, saved together
        (agent.instance.keyed_state) by the shell; only after it are the inputs it reflects acked
        upstream (`lowest_unsaved` holds them until then)."""
        assert self.keyed is not None
        self.keyed.prune_outputs(self.lowest_forwarding())
        save = SaveKeyed(self.keyed)
        if self.moves is not None:
            self.moves.saved()
        return save
