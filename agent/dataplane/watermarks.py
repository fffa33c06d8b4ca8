"""Watermarks that flow with the records: the rules as plain tables, sans-IO (no clock: `now` is
an argument; no sockets; no randomness). docs/operators.md, "Watermarks that flow".

Why: a keyed stage that derives its watermark from the largest event time it has seen counts the
system's own delays (a copy that lags, a key group that moves, a restart) against its lateness.
Here the watermark starts at the source, from the data's own disorder only, and every stage passes
on what it received:

- A **source** watermark is the largest event time the source emitted minus its bounded disorder
  (`SourceMarks`). A record older than it is late at the source already. A source that emitted
  nothing for `idle_after` seconds is **idle**: its mark says so, with the largest event time it
  emitted (it waited long enough for its stragglers); receivers leave it out of their minimum
  until it emits again or, when every input is idle, go on to the largest of them (Flink's
  idleness; a record that comes after it may then be late).
- A source whose input comes in **channels** that are each in order but not with one another
  (the sensors of an MQTT source: MQTT orders per topic, and a broker resuming a session may send
  a reading published after the reconnect ahead of the readings it queued while the source was
  away) marks the LEAST over its channels of each one's largest event time, minus the disorder
  (Kafka's per-partition watermarks in Flink): one channel running ahead cannot push the mark
  past the others' readings still on their way. A channel silent for `idle_after` while the
  source receives is idle and left out; a silence of the whole source (its input away) restarts
  every channel's clock, so the channels whose readings were merely held up are waited for.
  Channel values come from the data (the bus), so their number is bounded (`max_channels`): at
  the bound, idle channels are forgotten first; a record of a channel that still finds no room
  is judged against the mark of the others and holds nothing back (counted: `untracked`). A
  restarted source is given the channels its previous incarnation had (`restore`, from its
  position file), so a channel whose readings are still queued at the broker holds the mark
  from the start, not from its first reading.
- A mark travels on a data batch and applies AFTER that batch's records: "no record I send you
  after this batch is older than this, except records late at their source".
- A receiver keeps, per input channel (one sending instance, whatever its epoch), the LARGEST mark
  it took (`WatermarkTable.note`): a restarted or moved predecessor starts its marks over, lower,
  and cannot pull back what the receiver already used. Its watermark is the least over its live
  inputs (`current`); an input it knows but never heard from holds it back (None).
- What a stage passes on is not what it received but what it can no longer be asked to process
  again (`forwardable`): per input, the largest mark carried by a batch of which it has acked
  that batch and every earlier one upstream. An input acked upstream is never replayed (acks
  are end to end: docs/design.md, invariant 8), so a record a restart replays, or a record never
  sent that a new routing table (a key group that moved) sends elsewhere, is never behind a mark
  this stage passed on. Passing on `current` instead breaks exactly that (the test shows it).

The marks on the wire: `[watermark_ms, idle]`, a finite number of ms and 0 or 1 (`parse_mark`:
hostile input, checked before use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Tuple

__all__ = ["Mark", "MAX_MARK_MS", "MAX_CHANNELS", "parse_mark", "mark_json", "SourceMarks", "WatermarkTable"]

# Event times in ms within +-2^53 (~285,000 years): exact as floats, and what JSON carries
# losslessly to any reader.
MAX_MARK_MS = float(2 ** 53)
PENDING_MAX = 100_000  # noted marks per input waiting for their ack: beyond it the oldest merge
# channels a source keeps by default: a fleet's sensors (tens to thousands), each mark costs O(channels)
MAX_CHANNELS = 4096
CHANNELS_SAVED = 1024  # of them, the most behind in a restarted source's position (agent.wire's bound)


@dataclass(frozen=True)
class Mark:
    """A watermark in ms and whether its sender is idle (then receivers leave it out of their
    minimum; `value` is the last watermark it had, or -MAX_MARK_MS for none)."""

    value: float
    idle: bool = False


def parse_mark(value: Any) -> Mark:
    """A mark from a decoded envelope (untrusted): `[number, 0|1]`, the number finite and within
    +-MAX_MARK_MS. Raises ValueError saying what was expected."""
    if (type(value) is not list or len(value) != 2 or type(value[0]) not in (int, float)
            or type(value[1]) is not int or value[1] not in (0, 1)):
        raise ValueError(f"watermark: expected [ms, 0 or 1], found {str(value)[:60]}")
    v = float(value[0])
    if not math.isfinite(v) or abs(v) > MAX_MARK_MS:
        raise ValueError(f"watermark: expected a finite number of ms within +-2^53, found {str(value[0])[:40]}")
    return Mark(v, bool(value[1]))


def mark_json(mark: Mark) -> List[Any]:
    """A mark as the wire carries it (`parse_mark` reads it back equal)."""
    v = float(mark.value)
    return [int(v) if v.is_integer() else v, 1 if mark.idle else 0]


class SourceMarks:
    """The watermark of one source: the largest event time it emitted minus `disorder_ms` (how far
    out of order its own data comes), idle after `idle_after` seconds without a record (None:
    never idle). With `by_channel`, each record names its channel (`observe(..., channel)`) and
    the mark is the least over the channels of their largest event time, minus the disorder
    (see the module docstring), over at most `max_channels` channels. A restarted source starts
    a new one (with its channels `restore`d): its receivers keep the larger marks they had."""

    def __init__(self, disorder_ms: float = 0.0, idle_after: Optional[float] = None,
                 by_channel: bool = False, max_channels: int = MAX_CHANNELS) -> None:
        if not (disorder_ms >= 0 and math.isfinite(disorder_ms)):
            raise ValueError(f"disorder_ms: expected a finite number >= 0, got {disorder_ms!r}")
        if idle_after is not None and not (idle_after > 0):
            raise ValueError(f"idle_after: expected a number of seconds > 0, got {idle_after!r}")
        if type(max_channels) is not int or max_channels < 1:
            raise ValueError(f"max_channels: expected an integer >= 1, got {max_channels!r}")
        self.disorder_ms = float(disorder_ms)
        self.idle_after = idle_after
        self.by_channel = bool(by_channel)
        self.max_channels = max_channels
        self.untracked = 0  # records of channels that found no room (judged against the others' mark)
        self.max_time: Optional[float] = None
        self.last_record_at: Optional[float] = None
        self.started_at: Optional[float] = None
        self.late = 0  # records older than the watermark when emitted (late at the source)
        # by_channel: channel -> [its largest event time, when it last gave a record]
        self.channels: Dict[Any, List[float]] = {}
        # by_channel: the first record after the whole source was silent `idle_after` (its input
        # away): every channel's idleness counts from there, not from its last record
        self.resumed_at: Optional[float] = None

    def start(self, now: float) -> None:
        self.started_at = now

    def observe(self, t: float, now: float, channel: Any = None) -> bool:
        """A record with event time `t` (ms) emitted at `now`, of `channel` (by_channel only);
        True if it is on time (not older than the watermark before it: its channel's, by
        channel)."""
        if self.by_channel:
            return self._observe_channel(t, now, channel)
        mt = self.max_time
        on_time = mt is None or t >= mt - self.disorder_ms
        if not on_time:
            self.late += 1
        elif (mt is None or t > mt) and abs(t) <= MAX_MARK_MS:
            self.max_time = t
        self.last_record_at = now
        return on_time

    def _observe_channel(self, t: float, now: float, channel: Any) -> bool:
        last = self.last_record_at
        if self.idle_after is not None and last is not None and now - last >= self.idle_after:
            self.resumed_at = now
        ch = self.channels.get(channel)
        if ch is None:  # a channel first heard of: on time unless behind the mark of the others
            least = self._least(now)
            on_time = least is None or t >= least - self.disorder_ms
            if not self._room(now):
                self.untracked += 1
            elif abs(t) <= MAX_MARK_MS:  # behind, it starts at the others' mark: a late record holds nothing
                self.channels[channel] = [t if on_time or least is None else least, now]
        else:
            on_time = t >= ch[0] - self.disorder_ms
            if on_time and t > ch[0] and abs(t) <= MAX_MARK_MS:
                ch[0] = t
            ch[1] = now
        if not on_time:
            self.late += 1
        elif (self.max_time is None or t > self.max_time) and abs(t) <= MAX_MARK_MS:
            self.max_time = t
        self.last_record_at = now
        return on_time

    def _idle(self, at: float, now: float) -> bool:
        """A channel that last gave a record `at` is silent `idle_after` while the source received."""
        resumed = self.resumed_at
        return self.idle_after is not None and now - (at if resumed is None or at > resumed else resumed) >= self.idle_after

    def _least(self, now: float) -> Optional[float]:
        """by_channel: the least largest event time over the channels not idle (None: none)."""
        least: Optional[float] = None
        for t, at in self.channels.values():
            if self._idle(at, now):
                continue  # holds nothing back
            if least is None or t < least:
                least = t
        return least

    def _room(self, now: float) -> bool:
        """Room for one more channel: below the bound, or once the idle ones are forgotten (an
        idle channel holds nothing back; back, it is a channel first heard of)."""
        if len(self.channels) < self.max_channels:
            return True
        for name in [name for name, (_, at) in self.channels.items() if self._idle(at, now)]:
            del self.channels[name]
        return len(self.channels) < self.max_channels

    def channel_table(self, limit: int = CHANNELS_SAVED) -> List[List[Any]]:
        """by_channel: [channel, its largest event time] for the `limit` channels furthest behind
        (those hold the mark back), for the position file, which a move carries in its spawn
        request (a control message: bounded)."""
        table = sorted(self.channels.items(), key=lambda kv: kv[1][0])[:limit]
        return [[name, t] for name, (t, _) in table]

    def restore(self, table: Any, now: float, name: Any = lambda v: v) -> None:
        """The channels of the previous incarnation (`channel_table`, read back from our own file:
        its shape is checked, `name` makes a channel a dict key again), each as if it gave its
        last record at `now`: until it gives one again or goes idle it holds the mark at its
        largest event time, so its readings still queued at the broker are waited for."""
        if not self.by_channel or type(table) is not list:
            return
        for entry in table[:self.max_channels]:
            if (type(entry) is list and len(entry) == 2 and type(entry[1]) in (int, float)
                    and abs(entry[1]) <= MAX_MARK_MS):
                self.channels[name(entry[0])] = [float(entry[1]), now]

    def mark(self, now: float) -> Optional[Mark]:
        """The mark to send now: None before the first record (receivers wait for it) unless the
        source has been silent `idle_after` since it started (then idle, so it holds nothing).
        Idle, the mark is the largest event time emitted: `idle_after` without a record is taken
        as "no straggler is coming", so windows up to it can close (a record older than it that
        still comes is late downstream). By channel, not idle: the least over the channels."""
        since = self.last_record_at if self.last_record_at is not None else self.started_at
        idle = self.idle_after is not None and since is not None and now - since >= self.idle_after
        if self.max_time is None:
            return Mark(-MAX_MARK_MS, True) if idle else None
        if idle:
            return Mark(self.max_time, True)
        if self.by_channel:
            least = self._least(now)
            return Mark((self.max_time if least is None else least) - self.disorder_ms)
        return Mark(self.max_time - self.disorder_ms)


class _Input:
    """One input channel: the largest mark noted (`noted`, `noted_idle`), the marks noted at input
    indices not yet acked upstream (`pending`, in index order), and the largest released one."""

    __slots__ = ("noted", "noted_idle", "pending", "released", "released_idle", "leaving")

    def __init__(self) -> None:
        self.noted: Optional[float] = None
        self.noted_idle = False
        self.pending: Deque[Tuple[int, Mark]] = deque()
        self.released: Optional[float] = None
        self.released_idle = False
        self.leaving = False


def _raise(old: Optional[float], new: float) -> float:
    return new if old is None or new > old else old


class WatermarkTable:
    """An instance's marks per input channel (its predecessors), and the two minima over them:
    `current` (what it has received: what its keyed state judges lateness and fires windows by)
    and `forwardable` (what it may pass on: only what acked inputs carried)."""

    def __init__(self, inputs: Iterable[str] = ()) -> None:
        self.inputs: Dict[str, _Input] = {name: _Input() for name in inputs}

    def add_input(self, name: str) -> None:
        """A new predecessor (a copy, a new incarnation elsewhere): it holds the minimum back
        until its first mark. A name that is leaving comes back as live."""
        ch = self.inputs.get(name)
        if ch is None:
            self.inputs[name] = _Input()
        else:
            ch.leaving = False

    def remove_input(self, name: str) -> None:
        """A predecessor left (it sends nothing more): out of `current` at once, out of
        `forwardable` once every input index it gave is released (until then a crash here would
        have its records replayed)."""
        ch = self.inputs.get(name)
        if ch is None:
            return
        ch.leaving = True
        if not ch.pending:
            del self.inputs[name]

    def note(self, name: str, index: int, mark: Mark) -> None:
        """A batch from `name`, processed as input `index` (after its records were judged),
        carried `mark`. A sender not in the table is added (it sent data: it is an input)."""
        ch = self.inputs.get(name)
        if ch is None:
            ch = self.inputs[name] = _Input()
        ch.noted = _raise(ch.noted, mark.value)
        ch.noted_idle = mark.idle
        if ch.pending and ch.pending[-1][0] == index:
            ch.pending[-1] = (index, Mark(max(ch.pending[-1][1].value, mark.value), mark.idle))
        else:
            ch.pending.append((index, mark))
            if len(ch.pending) > PENDING_MAX:  # keep the later index with the larger value: safe
                i0, m0 = ch.pending.popleft()
                i1, m1 = ch.pending.popleft()
                ch.pending.appendleft((i1, Mark(max(m0.value, m1.value), m1.idle)))

    def release(self, lowest_pending: Optional[int]) -> None:
        """Every input index below `lowest_pending` (None: every one) is acked upstream: the marks
        noted with them may be passed on."""
        for name in list(self.inputs):
            ch = self.inputs[name]
            p = ch.pending
            while p and (lowest_pending is None or p[0][0] < lowest_pending):
                _, m = p.popleft()
                ch.released = _raise(ch.released, m.value)
                ch.released_idle = m.idle
            if ch.leaving and not p:
                del self.inputs[name]

    def current(self) -> Optional[Mark]:
        """The least noted mark over the live, non-idle inputs; None while one has none."""
        return _least((ch.noted, ch.noted_idle) for ch in self.inputs.values() if not ch.leaving)

    def forwardable(self) -> Optional[Mark]:
        """The least released mark over the inputs (leaving ones until released), idle ones left
        out; None while one has none: the mark this instance may send on."""
        return _least((ch.released, ch.released_idle) for ch in self.inputs.values())

    def to_json(self) -> Dict[str, Any]:
        """What a restarted instance needs to judge replays (the noted marks; pending ones are
        dropped: their inputs come again). Released = noted is NOT restored (see `restore`)."""
        return {name: [ch.noted, int(ch.noted_idle)] for name, ch in self.inputs.items()
                if ch.noted is not None and not ch.leaving}

    def restore(self, data: Any) -> None:
        """The noted marks a saved state held (untrusted file: bad entries are skipped). Their
        inputs were all applied before the save; what was not is replayed with its own marks."""
        if not isinstance(data, dict):
            return
        for name, v in data.items():
            try:
                m = parse_mark(v)
            except ValueError:
                continue
            ch = self.inputs.get(str(name))
            if ch is None:
                ch = self.inputs[str(name)] = _Input()
            ch.noted = _raise(ch.noted, m.value)
            ch.noted_idle = m.idle


def _least(entries: Iterable[Tuple[Optional[float], bool]]) -> Optional[Mark]:
    least: Optional[float] = None
    any_input = False
    last_idle: Optional[float] = None
    for value, idle in entries:
        any_input = True
        if idle:
            if value is not None:
                last_idle = value if last_idle is None else max(last_idle, value)
            continue
        if value is None:
            return None
        if least is None or value < least:
            least = value
    if least is not None:
        return Mark(least)
    if any_input:  # every input idle: so is this instance (it holds nothing back downstream)
        return Mark(last_idle if last_idle is not None else -MAX_MARK_MS, True)
    return None
