"""What an instance's heartbeat reports (docs/runtime.md, "Instance"; the shell adds its
transport's: paho_out, connected): its counters (agent.instance.counters), then what its parts
hold at this moment, always in the same order: the data path's successors, links, queues, holes
and hold buffer, its load and capacity, the operator's figures, the keyed state's and the moves'
(agent.instance.moves), the Redirects it took (agent.instance.groups) and the scaling driver's.

Rules of this file: `HeartbeatStats` owns no state and holds no reference to the instance; it reads
the parts handed to it at construction (each read through the part at call time, since a restart
replaces some of their fields), and is given per call the scaling driver (None before the start;
it keeps the wall time of our Start), the wall clock and `now`. No I/O, no clock, no random.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from agent.dataplane.channel import Inbound
from agent.dataplane.routing import Outbox, Router
from agent.instance.admission import Admission
from agent.instance.groups import GroupRouting
from agent.instance.keyed_state import KeyedState
from agent.instance.load import Load
from agent.instance.moves import GroupMoves
from agent.instance.outputs import Outputs
from agent.instance.pace import Pace
from agent.instance.processing import Processing
from agent.instance.queues import SenderQueues

__all__ = ["HeartbeatStats"]


class HeartbeatStats:
    """The heartbeat's stats of instance `instance` of `operator`, read from its parts."""

    def __init__(self, stats: Dict[str, int], instance: str, operator_name: str, *, operator: Any, load: Load,
                 router: Router, outbox: Outbox, outputs: Outputs, queued: SenderQueues, inbound: Inbound,
                 admission: Admission, pace: Pace, processing: Processing, keyed: Optional[KeyedState],
                 moves: Optional[GroupMoves], group_routing: GroupRouting) -> None:
        self.stats = stats
        self.instance = instance
        self.operator_name = operator_name
        self.operator = operator
        self.load = load
        self.router = router
        self.outbox = outbox
        self.outputs = outputs
        self.queued = queued
        self.inbound = inbound
        self.admission = admission
        self.pace = pace
        self.processing = processing
        self.keyed = keyed
        self.moves = moves
        self.group_routing = group_routing

    def snapshot(self, scaling: Any, wall: float, now: float) -> Dict[str, Any]:
        s: Dict[str, Any] = dict(self.stats)
        load, outputs, inbound = self.load, self.outputs, self.inbound
        s.update(
            instance=self.instance,
            operator=self.operator_name,
            load=round(load.last, 1),
            succs=list(self.router.succs),
            inflight={d: link.inflight for d, link in outputs.links.items()},
            outbox=self.outbox.pending,
            queued=self.queued.count(),
            gaps_skipped=inbound.gaps_skipped,
            inbound_senders=inbound.senders(),
            held=self.admission.hold.count,
            reorder_waiting=inbound.waiting_total(),
            gaps=inbound.gaps(),
            unpubacked=outputs.unpubacked(),
            unrouted=sum(len(q) for q in outputs.unrouted.values()),
            routes_remembered=len(outputs.routes),
            records_pinned=outputs.routes.pinned,
            service_time_ms=self.pace.service_time * 1000,
            live_capacity=round(load.capacity.value, 2),
            online_service_time_ms=(round(load.capacity.service_time * 1000, 4)
                                    if load.capacity.service_time else None),
            signals=load.last_signals.to_stats() if load.last_signals is not None else None,
            first_record_at=self.processing.first_record_at,
            activated_at=scaling.activated_at if scaling is not None else None,
            at=wall,
        )
        s.update(self.operator.stats())
        if self.keyed is not None:
            s.update(self.keyed.stats())
        if self.moves is not None:
            s.update(self.moves.stats())
        if self.group_routing.on:
            s["redirected"] = self.group_routing.redirected(now)
        if scaling is not None:
            s.update(scaling.stats())
        return s
