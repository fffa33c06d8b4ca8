"""A sink instance's recording: a batch's records recorded, at once or deferred to the spool, the
inputs a deferred sink has not recorded yet, and the spool's events (docs/runtime.md, "Instance").

Rules of this file: `SinkSide` owns the inputs waiting for the spool and holds no reference to the
instance; it is given the operator, the outputs (a sink's publishes are tracked there), the stats
counters and the names its events carry at construction, and the wall clock per call. Calls that
ask the shell for something return their commands. No I/O, no clock, no random.

Why the waiting inputs matter beyond the sink: an input is acked upstream only once it is recorded
(`first` bounds the lowest input still forwarding), and a spool at its cap holds every input back
(`full`: back pressure, never silent: `spool_full` and `spool_resumed` are published).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, Dict, List, Optional

from agent import events, topics
from agent.dataplane.envelope import Envelope, Item, data_body_bytes
from agent.instance.commands import Command, Notify
from agent.instance.outputs import RAW_TOPIC, Outputs
from agent.operators.builtin import SinkOperator

__all__ = ["SinkSide", "SINK_SETTLE_POLL"]

log = logging.getLogger("agent.instance.worker")

SINK_SETTLE_POLL = 0.05  # a sink whose spool is at its cap checks this often whether shipping freed it
# the spool's events and the event type each is published as
SPOOL_EVENTS = {"spool_full": "spool_full", "spool_resumed": "spool_resumed", "recovered": "spool_recovered"}


class SinkSide:
    """`waiting`: the input indexes a deferred sink's `record_batch` took and has not said are
    recorded yet, oldest first (empty at any instance that is no deferred sink). Its events carry
    the node, instance and operator of `ctx` and `pipeline`, and go to `cluster`'s events topic."""

    def __init__(self, operator: Any, outputs: Outputs, stats: Dict[str, int], ctx: Dict[str, Any],
                 cluster: str, pipeline: str) -> None:
        self.operator = operator
        self.waiting: Deque[int] = deque()
        self._outputs = outputs
        self._stats = stats
        self._ctx = ctx
        self._topic = topics.events(cluster)
        self._names = {"node": ctx["node"], "instance": ctx["instance"], "operator": ctx["operator"],
                       "pipeline": pipeline}

    def first(self) -> Optional[int]:
        """The oldest input not recorded yet (None: none waits)."""
        return self.waiting[0] if self.waiting else None

    def full(self) -> bool:
        """The spool is at its cap with inputs waiting: only a release (seen in `settle`) can help."""
        return bool(self.waiting and not self.operator.writable())

    def record(self, items: List[Item], index: int, env: Optional[Envelope] = None) -> List[Command]:
        """Input `index`'s records recorded (a deferred sink: handed to its spool, acked only once
        `settle` says it is recorded); the publishes the sink asks for, tracked as its input's."""
        op = self.operator
        if getattr(op, "deferred", False):
            pubs = op.record_batch(items, data_body_bytes(env) if env is not None else None)
            self.waiting.append(index)
        else:
            pubs = op.record(items)
        out: List[Command] = []
        for pub in pubs:
            out += self._outputs.publish(RAW_TOPIC + pub.topic, pub.payload, index)
        self._stats["records_out"] += len(items)
        return out

    def settle(self, wall: float) -> List[Command]:
        """A deferred sink (spilling to its spool): release the inputs it has now recorded, and
        publish its events (spool_full / spool_resumed: back pressure is never silent)."""
        op = self.operator
        if not isinstance(op, SinkOperator):
            return []
        if op.deferred:
            for _ in range(op.settle()):
                self.waiting.popleft()
        out: List[Command] = []
        for ev in op.take_events():
            out += self._spool_event(ev, wall)
        return out

    def _spool_event(self, ev: Dict[str, Any], wall: float) -> List[Command]:
        what = str(ev.pop("event", ""))
        etype = SPOOL_EVENTS.get(what)
        if etype is None:
            return []
        if what == "spool_full":
            log.warning("spool at its cap (%s bytes): holding input back", ev.get("used_bytes"), extra=self._ctx)
        try:
            e = events.make(etype, ts=wall, **self._names,
                            detail={"source": "worker", **{k: v for k, v in ev.items() if k != "node"}})
        except ValueError as exc:
            log.warning("spool event %s not published: %s", what, exc, extra=self._ctx)
            return []
        self._stats["spool_events"] += 1
        return [Notify(self._topic, e.to_json().encode(), 1, False)]
