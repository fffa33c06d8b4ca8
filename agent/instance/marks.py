"""The watermarks an instance takes in and passes on (agent.dataplane.watermarks; docs/operators.md,
"Watermarks that flow"): per predecessor the largest mark it sent, a source's own marks from the
event times it polls, and the mark this instance may pass on (only what acked inputs carried, so
nothing it may process again is behind it).

Rules of this file: no I/O, no clock (`now` per call), no reference to the instance. Built with the
shared data-plane objects (the ack tracker for the latest input index, the outputs a keyed
operator's due timers forward through, the keyed state, the stats); what changes under it (the
lowest input not acked upstream) is passed per call. Sending a mark alone is `Outputs.send_mark`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from agent.dataplane.flow import AckTracker
from agent.dataplane.envelope import Item
from agent.dataplane.watermarks import MAX_CHANNELS, MAX_MARK_MS, Mark, SourceMarks, WatermarkTable
from agent.instance.keyed_state import KeyedState, hashable_key
from agent.instance.outputs import Outputs
from agent.operators.keyed import parse_event_time

__all__ = ["Marks"]

# The seeded faults of the watermarks (the checker's `marks_unacked`, `marks_own_max`) are
# subclasses it installs (foglab.sim.instance_faults): no branch here.


class Marks:
    """An instance's watermarks: `table` per input (a source's own under ""), `source` a source's
    own marks from its records' event times (None elsewhere), `conf` the source's
    [operator.watermark]. Built only where marks flow (not at a sink); a keyed instance then
    follows the least mark over its inputs instead of its own largest event time."""

    def __init__(self, conf: Any, is_source: bool, keyed: Optional[KeyedState], tracker: AckTracker,
                 outputs: Outputs, stats: Dict[str, int]) -> None:
        self.conf = conf
        self.table = WatermarkTable()
        self.channel_field: Optional[str] = getattr(conf, "channel_field", None)
        self.source: Optional[SourceMarks] = (
            SourceMarks(conf.disorder_ms, conf.idle_after, self.channel_field is not None,
                        getattr(conf, "max_channels", MAX_CHANNELS)) if is_source else None)
        self.keyed = keyed
        self.tracker = tracker
        self.outputs = outputs
        self.stats = stats

    def note(self, sender: str, index: int, mark: Mark) -> None:
        """`sender`'s mark after input `index`, nothing fired (a stateless operator)."""
        self.table.note(sender, index, mark)

    def take(self, sender: str, index: int, mark: Mark, now: float) -> None:
        """`sender`'s mark after the batch processed as input `index` (its records judged first);
        a keyed instance's watermark follows the least over its inputs and its due timers fire."""
        self.table.note(sender, index, mark)
        if self.keyed is not None and self.keyed.flowing:
            self.changed(now, index)

    def changed(self, now: float, index: Optional[int] = None) -> None:
        """The least mark over the inputs may have risen: a keyed instance follows it and fires
        what came due (outputs under input `index`, else the latest)."""
        assert self.keyed is not None
        if index is None:
            index = self.tracker.last_index
        cur = self.table.current()
        if cur is None or (self.keyed.max_time is not None and cur.value <= self.keyed.max_time):
            return
        self.keyed.max_time = cur.value
        out = self.keyed.fire_due(index)
        if out:
            self.outputs.forward(out, index, now)

    def preds_removed(self, removed: Any, now: float) -> None:
        """Departed predecessors' marks no longer hold ours back (their deletion is behind their data)."""
        for p in removed:
            self.table.remove_input(p)
        if self.keyed is not None and self.keyed.flowing and removed:
            self.changed(now)

    def out_mark(self, now: float, lowest_pending: Optional[int]) -> Optional[Mark]:
        """The mark this instance may pass on now: the least over its inputs of what acked
        inputs carried (a source: what its acked polls made; `lowest_pending` the lowest input
        not acked upstream yet), less the own lateness of a keyed operator that fires by the
        watermark (its windows close that much later, and their outputs must not be late); one
        that keeps its own watermark (the DEBS merges) passes the marks on as they are."""
        marks = self.table
        if self.source is not None:
            m = self.source.mark(now)
            ch = marks.inputs.get("")
            if m is not None and (ch is None or ch.noted != m.value or ch.noted_idle != m.idle):
                marks.note("", self.tracker.last_index, m)  # a change without records: idleness
        marks.release(lowest_pending)
        out = self.passable(marks)
        if out is not None and self.keyed is not None and self.keyed.op.uses_event_time and self.keyed.op.lateness_ms:
            out = Mark(max(-MAX_MARK_MS, out.value - self.keyed.op.lateness_ms), out.idle)
        return out

    def passable(self, marks: WatermarkTable) -> Optional[Mark]:
        """Of the marks taken in, only what acked inputs carried: an input not acked upstream may
        come again after a crash, and a mark passed on ahead of it would let its records be late
        downstream. Not in the checker's seeded fault `marks_unacked`."""
        return marks.forwardable()

    def channel_table(self) -> Optional[List[Any]]:
        """A source by channel: its channels and their times, for its position file (None: no channels)."""
        return self.source.channel_table() if self.source is not None and self.source.by_channel else None

    def restore_channels(self, table: Any, now: float) -> None:
        """A restarted source: the channels its position file kept (`channel_table`)."""
        if self.source is not None:
            self.source.restore(table, now, hashable_key)

    def observe(self, items: List[Item], index: int, now: float) -> None:
        """The source's records' event times, into its watermark (noted at this poll's index)."""
        sm, conf = self.source, self.conf
        assert sm is not None
        late, untracked = sm.late, sm.untracked
        field = self.channel_field
        for _, _, rec in items:
            t = parse_event_time(rec.get(conf.time_field), conf.time_unit) if type(rec) is dict else None
            if t is not None:
                if field is None:
                    sm.observe(t, now)
                else:  # [operator.watermark] channel_field: the record's channel (a sensor)
                    sm.observe(t, now, hashable_key(rec.get(field)))
        self.stats["late_at_source"] += sm.late - late
        if sm.untracked != untracked:
            self.stats["channels_untracked"] += sm.untracked - untracked
        m = sm.mark(now)
        if m is not None:
            self.table.note("", index, m)
