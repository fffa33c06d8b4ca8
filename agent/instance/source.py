"""A source instance's numbering and pacing: where a restarted source resumes, what it reserves on
disk before generating, how a sensor source numbers records it cannot generate again, and the
ingest deliveries it acks (docs/runtime.md, "Sources").

Rules of this file: the part owns its state (the first record of each poll not yet acked end to
end, the reservation, the rate profile's start) and drives the source operator; it holds no
reference to the instance. The instance's lowest pending input index, which says what is acked
end to end, is passed in as a function and read exactly where the position needs it. Calls that
ask the shell for something return their commands. No I/O, no clock.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent.instance.commands import AckIngest, Command, LogIngest, PersistSource
from agent.instance.events import EnvelopeReceived
from agent.instance.marks import Marks
from agent.operators.sources import Source as SourceOperator
from agent.operators.sources import SourceCaps, SourceState, source_caps, with_state

__all__ = ["Source", "SOURCE_RESERVE", "RESERVE_SECONDS", "SOURCE_RESERVE_MAX"]

log = logging.getLogger("agent.instance.worker")

# A source reserves on disk the records it may generate before writing its position again
# (`reserve`): at least SOURCE_RESERVE, else RESERVE_SECONDS of its measured rate (at most
# SOURCE_RESERVE_MAX), so that it writes source.json about once a second whatever its rate. A
# fixed 2,000 records meant 25 writes a second at 50k records/s, each blocking the source 2-4 ms
# on a loaded disk (docs/measurement.md, "Cheap cuts of the data plane"). The price: a restarted
# source regenerates up to its reservation at once, i.e. up to a second of records sooner than
# its rate profile would have (docs/runtime.md).
SOURCE_RESERVE = 2000
RESERVE_SECONDS = 1.0
SOURCE_RESERVE_MAX = 500_000

Lowest = Callable[[], Optional[int]]  # the instance's lowest input index not acked end to end yet


class Source:
    """The numbering and pacing of instance `me`'s source operator `operator` (None for an
    instance that is no source: every capability off). `replayable`, `sensor`, `topic`: what the
    operator can do (agent.operators.sources.SourceCaps), read by the shell too. The operator's
    `generated`, `paused` and `catching_up` are read as they are (the `Source` protocol;
    `with_state` gave their defaults at load to a source without them)."""

    def __init__(self, me: str, operator: Any, ctx: Dict[str, Any]) -> None:
        caps = source_caps(operator) if operator is not None else SourceCaps()
        self.replayable, self.sensor, self.topic = caps.replayable, caps.sensor, caps.topic
        self.operator: SourceOperator = with_state(operator) if operator is not None else SourceState()
        self.me, self.ctx = me, ctx
        self._first: Dict[int, int] = {}  # poll index -> its first record seq
        self.reserved = 0  # records it may generate before writing its position
        self._reserved_at: Optional[Tuple[float, int]] = None  # (when, generated) at the last reservation
        self.started_at = 0.0  # wall time its rate profile started
        self._last_write = -1e9

    # ---- start ---------------------------------------------------------------------------------

    def start(self, restart: bool, pos: Optional[Dict[str, Any]], logged: Optional[List[Any]],
              marks: Optional[Marks], now: float, wall: float, resume_wall: float) -> None:
        """The instance started (`wall`: the wall time its start carried), `pos` what its last
        position file held: a restart's watermark channels back (`Marks.restore_channels`), a sensor
        source numbered (`number`) or a restarted one resumed (`resume`, its rate profile at
        `resume_wall`, the instance's clock), and the operator started."""
        if restart and marks is not None and isinstance(pos, dict):
            marks.restore_channels(pos.get("channels"), now)
        if self.sensor:
            self.number(wall, pos if restart else None, logged)
        elif restart:
            self.resume(pos, resume_wall)
        self.operator.start(now)

    def resume(self, pos: Optional[Dict[str, Any]], wall: float) -> None:
        """A restarted source continues from its last written position (see TaxiSource.resume)."""
        if not self.replayable or not isinstance(pos, dict) or "resume_from" not in pos:
            log.warning("source restarted without a usable position: starting over", extra=self.ctx)
            return
        start = int(pos["resume_from"])
        upto = max(int(pos.get("generated", 0)), int(pos.get("reserved", 0)))
        self.started_at = float(pos.get("profile_started_at", wall))
        self.operator.resume(start, upto, wall - self.started_at)
        self.reserved = upto
        log.info("source resumes at record %d, regenerating up to %d", start, upto, extra=self.ctx)

    def number(self, wall: float, pos: Optional[Dict[str, Any]], logged: Optional[List[Any]]) -> None:
        """A source whose records cannot be generated again (taxi.MqttIngestSource): the logged
        records its successors had not acked go out again first, under their numbers; new ones are
        numbered above every number an earlier incarnation can have used: its saved reservation,
        and the wall clock in microseconds for when that file is gone with its node."""
        floor, resume_from = int(wall * 1e6), 0
        if isinstance(pos, dict):
            for key in ("generated", "reserved"):
                try:
                    floor = max(floor, int(pos.get(key, 0)))
                except (TypeError, ValueError):
                    pass
            try:
                resume_from = int(pos.get("resume_from", 0))
            except (TypeError, ValueError):
                pass
        self.operator.number_from(floor)
        if logged:
            self.operator.replay(logged, resume_from)
        log.info("source numbers its records from %d", floor, extra=self.ctx)

    # ---- ingest --------------------------------------------------------------------------------

    def ingest(self, ev: EnvelopeReceived) -> List[Command]:
        """A delivery on a source's ingest topic. A sensor source keeps its token with the record
        until a successor acks the record (`settle`); any other source has it acked at once
        (agent.operators.sources)."""
        if self.topic is None:
            return []
        if self.sensor:
            self.operator.ingest(ev.topic, ev.payload, ev.token, ev.dup)
            return []
        self.operator.ingest(ev.topic, ev.payload)
        return [AckIngest((ev.token,))] if ev.token is not None else []

    def settle(self, low: Lowest) -> List[Command]:
        """PUBACK the ingest deliveries whose records a successor has acked."""
        tokens = self.operator.settled(self.resume_seq(low))
        return [AckIngest(tuple(tokens))] if tokens else []

    def take_log(self, low: Lowest) -> List[Command]:
        """The records just polled, to the ingest log before they leave (`LogIngest` precedes the
        flush's Publish commands)."""
        entries = self.operator.take_log()
        return [LogIngest(tuple(entries), self.resume_seq(low))] if entries else []

    # ---- pacing --------------------------------------------------------------------------------

    def can_produce(self) -> bool:
        # A paused source has nothing due: without this check its next_due() says "now" and the
        # loop polls it in a busy spin (measured: ~25k empty loop turns/s, a whole core). Unless
        # it still sends again what its previous incarnation may have sent (taxi.TaxiSource.catching_up).
        return not self.operator.paused or self.operator.catching_up

    def reserve(self, now: float, budget: int) -> bool:
        """Before a poll of up to `budget` records: True when it would generate past the last
        reservation, which then moves ahead (the position is to be written before the poll: a
        restarted source regenerates up to it, so it never reports fewer records than were sent)."""
        generated = int(self.operator.generated)
        if generated + budget <= self.reserved:
            return False
        self.reserved = generated + budget + self._reserve_span(now, generated)
        return True

    def _reserve_span(self, now: float, generated: int) -> int:
        """Records to reserve past this poll: RESERVE_SECONDS of the rate measured since the last
        reservation, within [SOURCE_RESERVE, SOURCE_RESERVE_MAX]."""
        last, self._reserved_at = self._reserved_at, (now, generated)
        if last is None or now <= last[0]:
            return SOURCE_RESERVE
        rate = (generated - last[1]) / (now - last[0])
        return int(min(SOURCE_RESERVE_MAX, max(SOURCE_RESERVE, rate * RESERVE_SECONDS)))

    def polled(self, index: int, first_seq: int) -> None:
        """The poll taken as input `index` starts at record `first_seq`."""
        self._first[index] = first_seq

    # ---- position ------------------------------------------------------------------------------

    def resume_seq(self, low: Lowest) -> int:
        """The first record seq that a restarted source must generate again: the first of the
        oldest poll whose records are not all acked by a successor yet (buffered, unPUBACKed, or
        in a replay buffer). Everything below it has been processed and forwarded downstream, so
        regenerating from here (the generator is deterministic) loses nothing; records above it
        that already got through arrive twice and the sink drops them by id."""
        lowest = low()
        for index in [i for i in self._first if lowest is None or i < lowest]:
            del self._first[index]  # fully acked: forget
        if lowest is None or not self._first:
            return int(self.operator.generated)
        return self._first[min(self._first)]

    def position(self, low: Lowest) -> Dict[str, Any]:
        """What `<instance>.source.json` holds (PersistSource): the operator's figures, where to
        resume, the reservation and the rate profile's start."""
        return {"instance": self.me, **self.operator.stats(), "resume_from": self.resume_seq(low),
                "reserved": self.reserved, "profile_started_at": self.started_at}

    def persisted(self, low: Lowest, marks: Optional[Marks]) -> PersistSource:
        """`position` written, with the table of the source's watermark channels a restart waits
        for (agent.dataplane.watermarks), if its `marks` keep one."""
        position = self.position(low)
        table = marks.channel_table() if marks is not None else None
        if table is not None:
            position["channels"] = table
        return PersistSource(position)

    def write_due(self, now: float) -> bool:
        """With the heartbeat, the position is written at most every 2 s (a rename costs ~5-20 ms here)."""
        if now - self._last_write < 2.0:
            return False
        self._last_write = now
        return True
