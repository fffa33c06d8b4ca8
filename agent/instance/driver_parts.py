"""What the scaling driver (agent.instance.driver) is handed by its instance: the parts it reads
and acts through, and the two calls of the data path its Drain needs.

Rules of this file: types only; it imports nothing from agent.instance.

Why a bundle of parts and not the instance: the driver performs the core's outputs strictly in
order between the instance's own effects, so it acts through the same parts (the links it numbers
its messages on, the persistence it writes ahead, the key groups' side a Start feeds); named here,
these are all it can reach. The data path's `flush` and `drained` stay the instance's: a Drain
waits for every part of it (queues, operator, outbox, acks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List

__all__ = ["DriverParts"]


@dataclass(frozen=True)
class DriverParts:
    # identity, configuration
    spec: Any  # agent.instance.spec.InstanceSpec
    pipeline: Any  # agent.config.PipelineConfig
    stage: int
    epoch: int  # of our channels, at the start (agent.instance.incarnation)
    is_source: bool
    ctx: Dict[str, Any]  # the log context
    stats: Dict[str, int]  # the instance's counters (the heartbeat's)
    # the parts
    clock: Any  # agent.instance.clock.Clock
    life: Any  # agent.instance.lifecycle.Lifecycle: stopping, and the protocol's Terminate
    load: Any  # agent.instance.load.Load: the load and live signals a decision reads
    outputs: Any  # agent.instance.outputs.Outputs: the links our messages are numbered on, the routes
    router: Any  # agent.dataplane.routing.Router
    incarnation: Any  # agent.instance.incarnation.Incarnation: the state written ahead
    cadence: Any  # agent.instance.cadence.Cadence: the protocol state changed
    delivery: Any  # agent.instance.delivery.Delivery: a probed copy's channel forgotten
    group_side: Any  # agent.instance.group_side.GroupSide: a Start's key groups, both ways
    marks: Any  # Optional[agent.instance.marks.Marks]: a departed predecessor's watermark
    moves: Any  # Optional[agent.instance.moves.GroupMoves]: a keyed instance's groups
    # the data path, as a Drain needs it
    flush: Callable[[float, bool], List[Any]]  # the commands of the outbox's batches onto their links
    drained: Callable[[], bool]
