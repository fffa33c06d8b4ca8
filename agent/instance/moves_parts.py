"""What the key groups' moves (agent.instance.moves) act through instead of the instance, and the
two acts the moves and the key groups' side (agent.instance.group_side) share: a hand-over
message sent, a hand-over message refused.

Rules of this file: sans-IO; it imports nothing from agent.instance but the hand-over codec.

Why the parts are handed after the moves are built (`GroupMoves.bind`): the persistence that
writes the moves and the inputs that wait for them are built around them, so the moves cannot be
handed them at construction; the scaling driver exists only from the instance's start.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

from agent.dataplane.envelope import Kind
from agent.instance.handover_wire import body_size

__all__ = ["MovesParts", "send_handover", "refuse"]

log = logging.getLogger("agent.instance.worker")


def refuse(stats: Dict[str, int], refusals: Any, ctx: Dict[str, Any], sender: str, why: str, now: float) -> None:
    """A hand-over message refused, by the moves or the key groups' side (agent.instance.group_side):
    counted once, in one place, logged within the bound per sender and in all (`refusals`, the
    admission's `LogLimiter`)."""
    stats["handover_errors"] += 1
    if refusals.allow((sender, "handover"), now):
        log.warning("hand-over from %s: %s", sender[:64], why, extra=ctx)


class MovesParts:
    """What the moves act through, handed by the instance once it has built them (`GroupMoves.bind`):
    the persistence that writes the moves and the inputs that wait for them are built after the
    moves, around them. `scaling`: the scaling driver, from the instance's start (its state is in
    every write-ahead; its decision records take the moves' stamps)."""

    def __init__(self, *, clock: Any, tracker: Any, outputs: Any, stats: Dict[str, int], ctx: Dict[str, Any],
                 refusals: Any, cadence: Any, incarnation: Any, pending: Any) -> None:
        self.clock = clock  # agent.instance.clock.Clock
        self.tracker = tracker  # agent.dataplane.flow.AckTracker: held records' outputs numbered
        self.outputs = outputs  # agent.instance.outputs.Outputs: the links, the outputs forwarded
        self.stats = stats  # the instance's counters
        self.ctx = ctx
        self.refusals = refusals  # the admission's LogLimiter
        self.cadence = cadence  # agent.instance.cadence.Cadence
        self.incarnation = incarnation  # agent.instance.incarnation.Incarnation: the write-ahead, our epoch
        self.pending = pending  # agent.instance.pending.PendingInputs: the keyed save, the lowest input forwarding
        self.scaling: Any = None  # agent.instance.driver.ScalingDriver, from the start


def send_handover(outputs: Any, stats: Dict[str, int], dest: str, body: Dict[str, Any]) -> List[Any]:
    """A hand-over message's commands: on the numbered channel to `dest` (agent.instance.outputs),
    counted apart from the paper's protocol messages."""
    stats["handover_out"] += 1
    stats["handover_bytes_out"] += body_size(body)
    return outputs.send_envelope(dest, Kind.PROTO, body)
