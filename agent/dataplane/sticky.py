"""Where each record an instance sent went: a record sent again takes the same path. Sans-IO.

Why (docs/design.md invariant 8): duplicates are removed per receiver. A numbered channel drops
what it already has from one sender epoch; a sink drops the ids IT recorded (its id file). A
record travels a second time after a fault: the predecessors replay what a restarted (or
re-incarnated) instance had not acked, renumbered in its new epoch, and it processes those
inputs again; a restarted source regenerates from its resume position. Routed afresh, round-robin,
the second copy of a record the first incarnation had sent to sink A could go to sink B, which
keeps it: a duplicate no receiver can see (docs/reliability.md, "Found by the sink-duplicate
reproduction"). So every forwarding instance remembers, per record id (source instance, number),
the successor it sent the record to, and sends the record there again while that successor is
in its table. Only a successor that left (it drained everything it had, so a record it got is
already further down) frees the record to go anywhere.

What is remembered and for how long (the caller says when inputs are acked upstream):
- from sending until the inputs the record came from are acked upstream (a source: until its
  poll is acked end to end): the predecessors still hold them and replay them after our crash;
- on disk PERSIST_GRACE seconds longer: the ack may still be on its way (lost with a crash
  before the broker took it), and a source writes its resume position only every 2 s;
- in memory RETAIN seconds longer: a crash UPSTREAM (a predecessor or the source restarted)
  sends records again that we had acked; later than that, or a second crash of ours in that
  window, is the gap (docs/reliability.md, "Not covered yet").
A restored memory belongs to the dead incarnation's input numbering: everything in it counts as
acked at the restart (the replays that need it arrive within seconds).

On disk (written by the shell, this module only makes the text): a log with one line per loop
turn that sends batches, appended BEFORE those batches are published (write-ahead: a crash
cannot lose the destination of a record the predecessors will replay), and a snapshot of what
is still needed (sent, or acked upstream less than PERSIST_GRACE ago), which replaces the log
once the log outgrows it (`take_save`): a save costs what was sent, not what is remembered.
A batch is `[successor, {source: runs}]`, runs a flat list [gap, length, ...] (each run starts
`gap` after the end of the one before; the first after 0).

Keyless routing only: key-group routing sends a key to the same instance as long as the table
is the same, and keyed operators never scale (docs/operators.md).
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from agent.dataplane.envelope import Item

__all__ = ["RouteMemory", "RETAIN", "PERSIST_GRACE", "MAX_REMEMBERED", "MAX_RESTORED", "LOG_MIN"]

RETAIN = 30.0  # seconds a record is remembered after its inputs were acked upstream (memory)
PERSIST_GRACE = 5.0  # of those, persisted (an ack on its way, a source's position written every 2 s)
MAX_REMEMBERED = 100_000  # records (~10 MB); past it the oldest acked ones are forgotten early
MAX_RESTORED = 1_000_000  # record ids the files may bring back (a damaged file is refused)
LOG_MIN = 256 << 10  # bytes of log below which no snapshot is rewritten for its sake


class _Entry:
    """One batch sent: its successor, the highest input index it can carry, its ids per source."""

    __slots__ = ("no", "dest", "bound", "ids", "released_at", "_runs")

    def __init__(self, no: int, dest: str, bound: int, ids: Dict[str, List[int]],
                 released_at: Optional[float] = None) -> None:
        self.no, self.dest, self.bound, self.ids = no, dest, bound, ids
        self.released_at = released_at
        self._runs: Optional[Dict[str, List[int]]] = None

    def runs(self) -> Dict[str, List[int]]:
        """The ids as runs [gap, length, ...] per source (`_to_runs`, computed once)."""
        if self._runs is None:
            self._runs = {src: _to_runs(seqs) for src, seqs in self.ids.items()}
        return self._runs

    def count(self) -> int:
        return sum(len(s) for s in self.ids.values())


def _to_runs(seqs: List[int]) -> List[int]:
    """Sorted ids as [gap, length, ...]: a batch of consecutive ids is two numbers, a sparse one
    (a filter's output) about two small ones per id."""
    out: List[int] = []
    end = 0
    for s in sorted(set(seqs)):
        if out and s == end:
            out[-1] += 1
        else:
            out += [s - end, 1]
        end = s + 1
    return out


def _from_runs(runs: Any) -> List[int]:
    if not isinstance(runs, list) or len(runs) % 2 or not all(type(v) is int and v >= 0 for v in runs):
        raise ValueError("route memory: runs must be a flat list of [gap, length] pairs of integers >= 0")
    seqs: List[int] = []
    end = 0
    for i in range(0, len(runs), 2):
        if len(seqs) + runs[i + 1] > MAX_RESTORED:
            raise ValueError(f"route memory: more than {MAX_RESTORED} record ids")
        start = end + runs[i]
        end = start + runs[i + 1]
        seqs.extend(range(start, end))
    return seqs


class RouteMemory:
    """record id -> the successor it was sent to, for the records that may come again."""

    def __init__(self, retain: float = RETAIN, grace: float = PERSIST_GRACE,
                 max_remembered: int = MAX_REMEMBERED) -> None:
        self.retain, self.grace, self.max_remembered = retain, grace, max_remembered
        self._where: Dict[str, Dict[int, int]] = {}  # source -> number -> entry no (the latest send)
        self._top: Dict[str, int] = {}  # source -> the highest number ever sent (split's fast path)
        self._entries: Dict[int, _Entry] = {}
        self._held: Deque[_Entry] = deque()  # inputs not acked upstream yet, in send order
        self._done: Deque[_Entry] = deque()  # acked upstream, in the order they were
        self._next = 0
        self._count = 0  # ids in all entries (an id sent twice counts twice)
        self.pinned = 0  # records sent again to where they went before (the heartbeat's stats)
        self._unsaved: List[_Entry] = []  # sent since the last take_save
        self._log_bytes = 0
        self._base_bytes = 0
        self._full_next = True  # the files hold nothing of ours yet: start with a snapshot

    def __len__(self) -> int:
        return self._count

    def sent(self, dest: str, items: Sequence[Item], bound: int) -> None:
        """A batch of `items` goes to `dest`; every input it carries has an index <= `bound`."""
        ids: Dict[str, List[int]] = {}
        for it in items:
            seqs = ids.get(it[0])
            if seqs is None:
                seqs = ids[it[0]] = []
            seqs.append(it[1])
        self._next += 1
        entry = _Entry(self._next, dest, bound, ids)
        self._entries[entry.no] = entry
        self._held.append(entry)
        self._unsaved.append(entry)
        for src, seqs in ids.items():
            where = self._where.get(src)
            if where is None:
                where = self._where[src] = {}
            where.update(dict.fromkeys(seqs, entry.no))
            top = max(seqs)
            if top > self._top.get(src, -1):
                self._top[src] = top
        self._count += len(items)

    def released(self, upto: int, now: float) -> None:
        """Every input with index <= `upto` is acked upstream (a source: acked end to end)."""
        held = self._held
        while held and held[0].bound <= upto:
            entry = held.popleft()
            entry.released_at = now
            self._done.append(entry)
        self._expire(now)

    def _expire(self, now: float) -> None:
        done = self._done
        while done and (now - done[0].released_at >= self.retain  # type: ignore[operator]
                        or self._count > self.max_remembered):
            self._forget(done.popleft())

    def _forget(self, entry: _Entry) -> None:
        del self._entries[entry.no]
        self._count -= entry.count()
        for src, seqs in entry.ids.items():
            where = self._where.get(src)
            if where is None:
                continue
            for s in seqs:
                if where.get(s) == entry.no:  # not sent again since (a later entry owns it)
                    del where[s]
            if not where:
                del self._where[src]

    def dest_of(self, src: str, seq: int) -> Optional[str]:
        where = self._where.get(src)
        no = where.get(seq) if where is not None else None
        return self._entries[no].dest if no is not None else None

    def split(self, items: List[Item], succs: Sequence[str]) -> Tuple[List[Item], Dict[str, List[Item]]]:
        """(records to route freely, {successor: records sent to it before}). The free list is
        `items` itself when nothing was sent before (the common case: no copy)."""
        if not self._where:
            return items, {}
        first = items[0][0] if items else None
        if first is not None and all(it[0] == first for it in items) and \
                min(it[1] for it in items) > self._top.get(first, -1):
            return items, {}  # all newer than anything sent from that source (the common case)
        pinned: Dict[str, List[Item]] = {}
        free: Optional[List[Item]] = None
        for i, it in enumerate(items):
            where = self._where.get(it[0])
            no = where.get(it[1]) if where is not None else None
            dest = self._entries[no].dest if no is not None else None
            if dest is None or dest not in succs:
                if free is not None:
                    free.append(it)
                continue
            if free is None:
                free = list(items[:i])
            pinned.setdefault(dest, []).append(it)
            self.pinned += 1
        return (items if free is None else free), pinned

    def snapshot(self, now: float) -> List[Any]:
        """What a restart needs: [[successor, {source: runs}], ...] for every batch whose inputs
        are not acked upstream or were acked less than PERSIST_GRACE s ago."""
        out: List[Any] = [[e.dest, e.runs()] for e in self._done
                          if now - e.released_at < self.grace]  # type: ignore[operator]
        out += [[e.dest, e.runs()] for e in self._held]
        return out

    def take_save(self, now: float) -> Tuple[Optional[str], str]:
        """What the shell must write before the batches sent since the last call go out:
        (snapshot text or None, log text). With a snapshot: write it (atomically) and start the
        log again with the log text; without: append the log text. The log text is one line
        (empty when nothing was sent)."""
        line = (json.dumps([[e.dest, e.runs()] for e in self._unsaved], separators=(",", ":")) + "\n"
                if self._unsaved else "")
        self._unsaved = []
        if self._full_next or self._log_bytes + len(line) > max(LOG_MIN, 2 * self._base_bytes):
            snap = json.dumps(self.snapshot(now), separators=(",", ":"))
            self._full_next = False
            self._base_bytes = len(snap)
            self._log_bytes = 0
            return snap, ""  # the snapshot already holds what was just sent
        self._log_bytes += len(line)
        return None, line

    @classmethod
    def load(cls, snapshot: Optional[str], log_text: Optional[str], now: float) -> "RouteMemory":
        """The memory the files hold, all of it counted as acked upstream at `now` (the dead
        incarnation's input indices mean nothing to us). A torn last log line (a crash in the
        middle of the write: its batches never went out) is skipped; ValueError on anything
        else that is not what `take_save` wrote."""
        mem = cls()
        batches: List[Any] = []
        if snapshot:
            batches += _parse(snapshot)
        lines = (log_text or "").split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                batches += _parse(line)
            except ValueError:
                if i < len(lines) - 1 and any(x.strip() for x in lines[i + 1:]):
                    raise
        total = 0
        for dest, per_src in batches:
            ids = {str(src): _from_runs(runs) for src, runs in per_src.items()}
            total += sum(len(v) for v in ids.values())
            if total > MAX_RESTORED:
                raise ValueError(f"route memory: more than {MAX_RESTORED} record ids")
            mem.sent(dest, [(src, s, None) for src, seqs in ids.items() for s in seqs], 0)
        mem.released(0, now)
        mem._unsaved = []
        return mem


def _parse(text: str) -> List[Any]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"route memory: not JSON ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"route memory: expected a list, found {type(data).__name__}")
    for item in data:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], dict)):
            raise ValueError("route memory: each batch must be [successor, {source: runs}]")
    return data
