"""Records through the operator: a source's poll, and a data batch's records applied (a keyed
operator's with their state, a map's with its failures isolated, passed on whole when unchanged)
or recorded at a sink; the back pressure that decides whether the next poll or batch may be taken
now, when the data path next has work without a new message, and whether it has drained
(docs/runtime.md, "Instance").

Rules of this file: `Processing` owns the wall time of the first record it processed and holds no
reference to the instance; it is given the operator and the parts it hands records to or counts
in (a source's numbering, keyed state, group moves, watermarks, router, outputs, ack tracker,
load, pace, the sink's recording, stats) at construction, and per call the time `now`, the wall
clock, the scaling driver (read only: whether data may flow yet) and the instance's lowest
pending input as a function (a source's position reads it). Calls that ask the shell for
something return their commands. No I/O, no clock, no random.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from agent.dataplane.envelope import Envelope, Item, Passed, data_body_bytes
from agent.dataplane.flow import AckTracker
from agent.dataplane.routing import Outbox, Router
from agent.instance.commands import Command
from agent.instance.keyed_state import KeyedState
from agent.instance.load import Load
from agent.instance.marks import Marks
from agent.instance.moves import GroupMoves
from agent.instance.outputs import ACK_DELAY, Outputs
from agent.instance.pace import Pace
from agent.instance.sink import SINK_SETTLE_POLL, SinkSide
from agent.instance.source import Lowest, Source

__all__ = ["Processing"]

log = logging.getLogger("agent.instance.worker")


class Processing:
    """Instance `me`'s operator applied to its input batches. `high_water`: the records the outbox
    may hold before we stop reading (the successors' credit is the back pressure); `is_sink`: the
    records are recorded, not applied; `keyed`, `moves`, `marks`: None where there are none."""

    def __init__(self, me: str, operator: Any, *, source: Source, is_source: bool, is_sink: bool,
                 keyed: Optional[KeyedState],
                 moves: Optional[GroupMoves],
                 marks: Optional[Marks], router: Router, outbox: Outbox, high_water: int, outputs: Outputs,
                 tracker: AckTracker, load: Load, pace: Pace, sink: SinkSide, stats: Dict[str, int],
                 ctx: Dict[str, Any]) -> None:
        self.me = me
        self.operator = operator
        self.source = source
        self.is_source = is_source
        self.is_sink = is_sink
        self.keyed = keyed
        self.moves = moves
        self.marks = marks
        self.router = router
        self.outbox = outbox
        self.high_water = high_water
        self.outputs = outputs
        self.tracker = tracker
        self.load = load
        self.pace = pace
        self.sink = sink
        self.stats = stats
        self.ctx = ctx
        self.first_record_at: Optional[float] = None  # wall clock: compared across processes (bench)

    # ---- back pressure -------------------------------------------------------------------------

    def backpressured(self) -> bool:
        """Held back by what comes after us: successors without credit, or the sink's spool full."""
        return self.outbox.pending >= self.high_water or self.sink.full()

    def may_take(self, now: float) -> bool:
        """Could a batch be processed at `now` (the shell's poll timeout: 0 then)?"""
        if self.sink.full():
            return False  # spool full: only a release (seen in settle) can help
        return not self.pace.busy(now) and self.outbox.pending < self.high_water

    def blocked(self, now: float, scaling: Any) -> bool:
        """May the next data batch not be processed now? Counts the stalls back pressure causes."""
        if scaling is not None and not scaling.data_enabled:
            return True  # idle new instance: keep input until Start (Algorithm 6)
        if self.pace.busy(now):
            return True  # emulated service time
        if self.sink.full():
            self.stats["spool_stalls"] += 1
            return True  # back pressure: the sink's spool is at its cap, stop reading (acks stop)
        if self.outbox.pending >= self.high_water:
            self.stats["credit_stalls"] += 1
            return True  # back pressure: successors have no credit, stop reading
        return False

    def deadlines(self, now: float, stopping: bool, scaling: Any) -> List[float]:
        """When the data path has something to do without a new message (the shell's poll
        timeout): a batch's linger, the emulated service time, the acks upstream held back, a
        full spool's release, a source's next poll."""
        out: List[float] = []
        d = self.outbox.next_deadline()
        if d is not None and any(self.outputs.credit(s) > 0 for s in self.router.succs):
            out.append(d)  # without credit only an ack (socket readable) can help: no spin
        if self.pace.busy_until > now:
            out.append(self.pace.busy_until)
        if self.outputs.ack_since is not None:
            out.append(self.outputs.ack_since + ACK_DELAY)
        if self.sink.waiting:
            out.append(now + SINK_SETTLE_POLL)  # the shipper (another process) cannot wake us
        if self.is_source and self.may_poll(stopping, scaling):
            out.append(self.operator.next_due(now))
        return out

    def drained(self) -> bool:
        """Every data batch taken is processed, forwarded, acked by the successors, and acked
        upstream (the queues are the caller's to ask)."""
        return (
            self.outbox.pending == 0
            and self.outputs.settled()
            and self.tracker.waiting() == 0
            and not self.sink.waiting
            and (self.moves is None or not self.moves.member.busy())  # a key group half moved stays
        )

    # ---- a source's poll -----------------------------------------------------------------------

    def may_poll(self, stopping: bool, scaling: Any) -> bool:
        """A source may poll: not stopping, room in the outbox, successors to send to, data
        enabled (an idle copy: not before its Start), and the operator not paused."""
        return (
            not stopping
            and self.source.can_produce()
            and self.outbox.pending < self.high_water
            and bool(self.router.succs)
            and (scaling is None or scaling.data_enabled)
        )

    def poll(self, now: float, low: Lowest) -> List[Command]:
        """The source operator polled for what the outbox has room for, as one input of the ack
        tracker; its position written first when the poll may pass its reservation."""
        out: List[Command] = []
        budget = self.high_water - self.outbox.pending
        if self.source.reserve(now, budget):
            # the reservation on disk before the records it covers
            out.append(self.source.persisted(low, self.marks))
        items = self.operator.poll(now, budget)
        if items:
            self.load.produced(len(items))
            self.stats["records_in"] += len(items)
            index = self.tracker.produced()
            self.source.polled(index, items[0][1])
            if self.marks is not None and self.marks.source is not None:
                self.marks.observe(items, index, now)
            self.outputs.forward(items, index, now)
            if self.source.sensor:
                out += self.source.take_log(low)
        return out

    # ---- a batch -------------------------------------------------------------------------------

    def batch(self, env: Envelope, now: float, wall: float) -> List[Command]:
        """Data batch `env`, next in its sender's order, processed as one input of the ack tracker
        (a watermark alone is taken, never acked itself)."""
        items: List[Item] = env.body
        n = len(items)
        out_cmds: List[Command] = []
        if not n:  # a watermark alone: after every earlier batch of its sender, never acked itself
            if self.marks is not None and env.watermark is not None:
                self.marks.take(env.sender, self.tracker.last_index, env.watermark, now)
            return out_cmds
        if self.first_record_at is None:
            self.first_record_at = wall
        self.stats["records_in"] += n
        self.stats["batches_in"] += 1
        index = self.tracker.processed(env.sender, env.seq, env.epoch)
        if env.floors:
            self.outputs.note_floors(env.floors)
        t0 = self.load.clock()
        if self.is_sink:
            out_cmds = self.sink.record(items, index, env)
        elif self.keyed is not None:
            if self.moves is not None:
                items = self.moves.admit(env.sender, items, index)  # a group on its way here waits
            out = self.keyed.apply(env.sender, items, index, env.floors)
            if out:
                self.outputs.forward(out, index, now)
            if self.marks is not None and env.watermark is not None:
                self.marks.take(env.sender, index, env.watermark, now)
        else:
            out = self.apply(items)
            self.stats["filtered"] += n - len(out)
            if out:
                if not self.router.succs:
                    raise RuntimeError(f"{self.me}: records to forward but no successors")
                if len(out) == n and getattr(self.operator, "unchanged", False) and self.router.key is None:
                    body = data_body_bytes(env)  # passed on whole and unchanged: forward its bytes
                    if body is not None:
                        out = Passed(out, body)
                        self.stats["passed_batches"] += 1
                self.outputs.forward(out, index, now)
            if self.marks is not None and env.watermark is not None:
                self.marks.note(env.sender, index, env.watermark)
        self.load.processed(n, t0, self.pace.cost(n))
        self.pace.processed(n, now)
        return out_cmds

    def apply(self, items: List[Item]) -> List[Item]:
        """The operator on `items`; when it fails, record by record, the failing ones counted and
        dropped (a user function's bad record must not stop the stream)."""
        try:
            return self.operator.process(items)
        except Exception:  # noqa: BLE001 - a user function failed: isolate the bad record(s)
            out: List[Item] = []
            for it in items:
                try:
                    out.extend(self.operator.process([it]))
                except Exception as exc:  # noqa: BLE001
                    self.stats["operator_errors"] += 1
                    if self.stats["operator_errors"] <= 5:
                        log.warning("operator failed on record %s:%s: %r", it[0], it[1], exc, extra=self.ctx)
            return out
