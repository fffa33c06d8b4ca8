"""Where each record an instance sent went: a record sent again takes the same path. Sans-IO.

Why (docs/design.md invariant 8): duplicates are removed per receiver. A numbered channel drops
what it already has from one sender epoch; a sink drops the ids IT recorded (its id file). A
record travels a second time after a fault: the predecessors replay what a restarted (or
re-incarnated) instance had not acked, renumbered in its new epoch, and it processes those
inputs again; a restarted source regenerates from its resume position. Routed afresh, round-robin,
the second copy of a record the first incarnation had sent to sink A could go to sink B, which
keeps it: a duplicate no receiver can see (CHANGELOG.md, "A record recorded by both sink
instances"). So a forwarding instance remembers, per record id (source instance, number),
the successor it sent the record to, and sends the record there again while that successor is
in its table. A successor that left had drained everything it had first (docs/design.md
invariant 4): a record it got is already further down (at a sink: in that sink's id file), so a
copy of it sent again goes nowhere (`split` returns it apart, the caller drops it); routed
afresh it would reach an instance that never saw it (CHANGELOG.md, "A record recorded by
both sink instances").

What is remembered and for how long (the caller says when inputs are acked upstream):
- from sending until the inputs the record came from are acked upstream (a source: until its
  poll is acked end to end): the predecessors still hold them and replay them after our crash;
- on disk PERSIST_GRACE seconds longer: the ack may still be on its way (lost with a crash
  before the broker took it), and a source writes its resume position about once a second;
- in memory RETAIN seconds longer: a crash UPSTREAM (a predecessor or the source restarted)
  sends records again that we had acked; later than that, or a second crash of ours in that
  window, is the gap (docs/reliability.md, "Not covered yet"). MAX_RUNS bounds this part.
A restored memory belongs to the dead incarnation's input numbering: everything in it counts as
acked at the restart (the replays that need it arrive within seconds).

Held as runs, not per record: a batch is `[successor, {source: runs}]`, runs a flat list
[gap, length, ...] (each run starts `gap` after the end of the one before; the first after 0),
and the lookup is per source a sorted list of disjoint id ranges [start, end) -> batch
(`_Spans`). Keyless batches are consecutive ids of one source (round-robin per batch), so a
batch of 100 records is one range: the memory and the work per batch do not grow with the batch
size (a filter's sparse output: one range per kept record, as before).

On disk (written by the shell, this module only makes the text): a log with one line per loop
turn that sends batches, appended BEFORE those batches are published (write-ahead: a crash
cannot lose the destination of a record the predecessors will replay), and a snapshot of what
is still needed (sent, or acked upstream less than PERSIST_GRACE ago), which replaces the log
once the log outgrows it (`take_save`): a save costs what was sent, not what is remembered.

Where the successor operator's instance count cannot change, nothing is remembered (`needed`).
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections import deque
from functools import lru_cache
from operator import countOf, itemgetter
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from agent.dataplane.envelope import Item

__all__ = ["RouteMemory", "needed", "RETAIN", "PERSIST_GRACE", "MAX_RUNS", "MAX_RESTORED", "LOG_MIN"]

RETAIN = 30.0  # seconds a record is remembered after its inputs were acked upstream (memory)
PERSIST_GRACE = 5.0  # of those, persisted (an ack on its way, a source's position written ~1/s)
# Id ranges remembered; past it the oldest ACKED batches are forgotten early (never unacked
# ones). ~370 bytes a batch of one range (tracemalloc, 100-record batches): 1.5 MB. 4,096
# batches of 100 records cover 409,600 records, 1.6 s at the bench's 250k records/s and the
# whole RETAIN below 13k records/s; the old cap was 100,000 records in 15 MB (docs/reliability.md,
# "The route memory's cost").
MAX_RUNS = 4096
MAX_RESTORED = 1_000_000  # id ranges the files may bring back (a damaged file is refused)
LOG_MIN = 256 << 10  # bytes of log below which no snapshot is rewritten for its sake

_src, _seq = itemgetter(0), itemgetter(1)
_quoted = lru_cache(maxsize=256)(json.dumps)  # instance ids as JSON strings (a handful per instance)
Runs = Tuple[Tuple[str, Tuple[int, ...]], ...]  # ((source, (gap, length, ...)), ...)


def needed(key: Optional[str], successor_max_instances: int) -> bool:
    """Whether a forwarding instance must remember where its records went (invariant 8), given
    its own `key` and its successor operator's [scaling] max_instances.

    Not when the successor operator has at most one instance: a record sent again can only go
    where it went. Every copy is refused at createNode() by the agent hosting the instance that
    asks for it, and that agent counts the asker (agent.node.bounds: a hard bound). Not for
    key-group routing, which sends a key to one instance per table: its successor is normally a
    keyed operator, whose groups move with their state and their applied record numbers
    (docs/operators.md, "Key groups that move"), so a record sent again by the current table
    reaches the one owner that knows whether it was applied. Key routing to a plain operator
    that scales is a gap (docs/reliability.md, "Not covered yet": a table change between the
    send and the replay moves a key group)."""
    return key is None and successor_max_instances > 1


class _Entry:
    """One batch sent: its successor, the highest input index it can carry, its ids as runs."""

    __slots__ = ("dest", "bound", "runs", "count", "released_at")

    def __init__(self, dest: str, bound: int, runs: Runs, count: int) -> None:
        self.dest, self.bound, self.runs, self.count = dest, bound, runs, count
        self.released_at = 0.0

    def doc(self) -> List[Any]:
        """The batch as saved: [successor, {source: runs}]."""
        return [self.dest, {src: list(runs) for src, runs in self.runs}]

    def text(self) -> str:
        """`doc()` as compact JSON, built directly (json.dumps costs ~3x as much per batch)."""
        if len(self.runs) == 1 and len(self.runs[0][1]) == 2:  # one source, one run: the common case
            src, (gap, n) = self.runs[0]
            return f"[{_quoted(self.dest)},{{{_quoted(src)}:[{gap},{n}]}}]"
        return "[" + _quoted(self.dest) + ",{" + ",".join(
            _quoted(src) + ":[" + ",".join(map(str, runs)) + "]" for src, runs in self.runs) + "}]"


class _Spans:
    """One source's remembered ids: disjoint ranges [start, end) sorted by start, each owned by
    the batch that sent those ids last.

    The ranges before `head` are forgotten: ranges are forgotten oldest first, at the front, and
    deleting there shifts every range behind it (4,096 of them once the memory is full: three
    ~32 kB moves per batch forgotten, the largest single cost of a forwarding hop's route
    memory, docs/results.md, O50). The front is cut off once it is half the lists."""

    __slots__ = ("starts", "ends", "owners", "head")

    def __init__(self) -> None:
        self.starts: List[int] = []
        self.ends: List[int] = []
        self.owners: List[Optional[_Entry]] = []
        self.head = 0

    def __len__(self) -> int:
        return len(self.starts) - self.head

    def newer_than_all(self, start: int) -> bool:
        """Nothing remembered reaches `start` or beyond (the common case of a new batch)."""
        return len(self.starts) == self.head or start >= self.ends[-1]

    def find(self, seq: int) -> Optional[_Entry]:
        i = bisect_right(self.starts, seq, self.head) - 1
        return self.owners[i] if i >= self.head and seq < self.ends[i] else None

    def assign(self, start: int, end: int, owner: _Entry) -> None:
        """Ids [start, end) were sent by batch `owner`: it owns them now (a later send wins)."""
        starts, ends, owners = self.starts, self.ends, self.owners
        if self.newer_than_all(start):  # the common case
            starts.append(start)
            ends.append(end)
            owners.append(owner)
            return
        i = bisect_right(ends, start, self.head)  # the first range ending after `start`
        j = bisect_left(starts, end, self.head)  # the first range starting at or after `end`
        s, e, n = [start], [end], [owner]
        if i < j and starts[i] < start:  # keep the part of the first overlapped range before us
            s.insert(0, starts[i])
            e.insert(0, start)
            n.insert(0, owners[i])
        if i < j and ends[j - 1] > end:  # and the part of the last one after us
            s.append(end)
            e.append(ends[j - 1])
            n.append(owners[j - 1])
        starts[i:j], ends[i:j], owners[i:j] = s, e, n

    def drop(self, start: int, end: int, owner: _Entry) -> None:
        """Forget the ids in [start, end) that batch `owner` still owns (`assign` only ever shrinks
        a batch's ranges, so they lie inside the ranges it was sent with)."""
        starts, ends, owners, head = self.starts, self.ends, self.owners, self.head
        i = bisect_right(ends, start, head)
        j = bisect_left(starts, end, head)
        if j == i + 1 and owners[i] is owner:  # one range, the batch's own: the common case
            if i == head:  # the oldest: forgotten in place
                owners[i] = None
                self.head = head = head + 1
                if head == len(starts):
                    del starts[:], ends[:], owners[:]
                    self.head = 0
                elif head >= 64 and 2 * head >= len(starts):
                    del starts[:head], ends[:head], owners[:head]
                    self.head = 0
            else:
                del starts[i], ends[i], owners[i]
            return
        keep = [k for k in range(i, j) if owners[k] is not owner]
        starts[i:j] = [starts[k] for k in keep]
        ends[i:j] = [ends[k] for k in keep]
        owners[i:j] = [owners[k] for k in keep]


def _to_runs(seqs: List[int]) -> Tuple[int, ...]:
    """Ids as [gap, length, ...] (sorted, duplicates once): a batch of consecutive ids is two
    numbers, a sparse one (a filter's output) about two small ones per id. `seqs` is the
    caller's own list (not copied, not changed)."""
    n = len(seqs)
    if not n:
        return ()
    lo = seqs[0]
    if seqs[-1] - lo == n - 1 and seqs == list(range(lo, lo + n)):
        return (lo, n)  # consecutive and ascending (the common case: no set, no sort, no loop)
    ids = sorted(set(seqs))
    if ids[-1] - ids[0] == len(ids) - 1:
        return (ids[0], len(ids))  # consecutive in any order, or with duplicates: still one run
    out: List[int] = []
    end = 0
    for s in ids:
        if out and s == end:
            out[-1] += 1
        else:
            out += [s - end, 1]
        end = s + 1
    return tuple(out)


def _check_runs(runs: Any) -> Tuple[int, ...]:
    if not isinstance(runs, list) or len(runs) % 2 or not all(type(v) is int and v >= 0 for v in runs):
        raise ValueError("route memory: runs must be a flat list of [gap, length] pairs of integers >= 0")
    return tuple(runs)


def _ranges(runs: Tuple[int, ...]) -> List[Tuple[int, int]]:
    """[gap, length, ...] -> [(start, end), ...]"""
    out = []
    end = 0
    for i in range(0, len(runs), 2):
        start = end + runs[i]
        end = start + runs[i + 1]
        if end > start:
            out.append((start, end))
    return out


class RouteMemory:
    """record id -> the successor it was sent to, for the records that may come again."""

    def __init__(self, retain: float = RETAIN, grace: float = PERSIST_GRACE, max_runs: int = MAX_RUNS) -> None:
        self.retain, self.grace, self.max_runs = retain, grace, max_runs
        self._where: Dict[str, _Spans] = {}  # source -> its ranges -> the batch that sent them last
        self._held: Deque[_Entry] = deque()  # inputs not acked upstream yet, in send order
        self._done: Deque[_Entry] = deque()  # acked upstream, in the order they were
        self._count = 0  # ids in all entries (an id sent twice counts twice)
        self._runs = 0  # ranges in all entries (what the memory costs)
        self.pinned = 0  # records sent again to where they went before (the heartbeat's stats)
        self._unsaved: List[_Entry] = []  # sent since the last take_save
        self._log_bytes = 0
        self._base_bytes = 0
        self._full_next = True  # the files hold nothing of ours yet: start with a snapshot

    def __len__(self) -> int:
        return self._count

    def runs(self) -> int:
        """Id ranges remembered (bounded by max_runs once their inputs are acked upstream)."""
        return self._runs

    def sent(self, dest: str, items: Sequence[Item], bound: int) -> None:
        """A batch of `items` goes to `dest`; every input it carries has an index <= `bound`."""
        if not items:
            return
        first = items[0][0]
        if countOf(map(_src, items), first) == len(items):  # one source (a C loop, no list)
            runs: Runs = ((first, _to_runs(list(map(_seq, items)))),)
        else:
            per: Dict[str, List[int]] = {}
            for it in items:
                per.setdefault(it[0], []).append(it[1])
            runs = tuple((src, _to_runs(seqs)) for src, seqs in per.items())
        self._add(dest, runs, len(items), bound)

    def _add(self, dest: str, runs: Runs, count: int, bound: int) -> _Entry:
        entry = _Entry(dest, bound, runs, count)
        self._held.append(entry)
        self._unsaved.append(entry)
        for src, r in runs:
            spans = self._where.get(src)
            if spans is None:
                spans = self._where[src] = _Spans()
            if len(r) == 2:  # one run (the common case)
                if r[1]:
                    spans.assign(r[0], r[0] + r[1], entry)
                    self._runs += 1
                continue
            for start, end in _ranges(r):
                spans.assign(start, end, entry)
                self._runs += 1
        self._count += count
        return entry

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
        while done and (now - done[0].released_at >= self.retain or self._runs > self.max_runs):
            self._forget(done.popleft())

    def _forget(self, entry: _Entry) -> None:
        self._count -= entry.count
        for src, r in entry.runs:
            spans = self._where.get(src)
            if spans is None:
                continue
            if len(r) == 2:  # one run (the common case)
                if r[1]:
                    spans.drop(r[0], r[0] + r[1], entry)
                    self._runs -= 1
            else:
                for start, end in _ranges(r):
                    spans.drop(start, end, entry)
                    self._runs -= 1
            if not spans:
                del self._where[src]

    def dest_of(self, src: str, seq: int) -> Optional[str]:
        spans = self._where.get(src)
        entry = spans.find(seq) if spans is not None else None
        return entry.dest if entry is not None else None

    def split(self, items: List[Item], succs: Sequence[str]
              ) -> Tuple[List[Item], Dict[str, List[Item]], List[Item]]:
        """(records to route freely, {successor: records sent to it before}, records sent
        before to a successor no longer in `succs`). The free list is `items` itself when
        nothing was sent before (the common case: no copy). The third list went through the
        successor that left (it drained before it left): sent again, it would be a duplicate."""
        if not self._where or not items:
            return items, {}, []
        first = items[0][0]
        spans = self._where.get(first)
        if countOf(map(_src, items), first) == len(items) and \
                (spans is None or spans.newer_than_all(min(map(_seq, items)))):
            return items, {}, []  # all newer than anything sent from that source (the common case)
        pinned: Dict[str, List[Item]] = {}
        gone: List[Item] = []
        free: Optional[List[Item]] = None
        for i, it in enumerate(items):
            dest = self.dest_of(it[0], it[1])
            if dest is None:
                if free is not None:
                    free.append(it)
                continue
            if free is None:
                free = list(items[:i])
            if dest in succs:
                pinned.setdefault(dest, []).append(it)
                self.pinned += 1
            else:
                gone.append(it)
        return (items if free is None else free), pinned, gone

    def snapshot(self, now: float) -> List[Any]:
        """What a restart needs: [[successor, {source: runs}], ...] for every batch whose inputs
        are not acked upstream or were acked less than PERSIST_GRACE s ago."""
        return [e.doc() for e in self._needed(now)]

    def _needed(self, now: float) -> List[_Entry]:
        return [e for e in self._done if now - e.released_at < self.grace] + list(self._held)

    def take_save(self, now: float) -> Tuple[Optional[str], str]:
        """What the shell must write before the batches sent since the last call go out:
        (snapshot text or None, log text). With a snapshot: write it (atomically) and start the
        log again with the log text; without: append the log text. The log text is one line
        (empty when nothing was sent)."""
        line = "[" + ",".join(e.text() for e in self._unsaved) + "]\n" if self._unsaved else ""
        self._unsaved = []
        if self._full_next or self._log_bytes + len(line) > max(LOG_MIN, 2 * self._base_bytes):
            snap = "[" + ",".join(e.text() for e in self._needed(now)) + "]"
            self._full_next = False
            self._base_bytes = len(snap)
            self._log_bytes = 0
            return snap, ""  # the snapshot already holds what was just sent
        self._log_bytes += len(line)
        return None, line

    @classmethod
    def load(cls, snapshot: Optional[str], log_text: Optional[str], now: float) -> "RouteMemory":
        """The memory the files hold, all of it counted as acked upstream at `now` (the dead
        incarnation's input indices mean nothing to us; past MAX_RUNS the newest are kept). A
        torn last log line (a crash in the middle of the write: its batches never went out) is
        skipped; ValueError on anything else that is not what `take_save` wrote."""
        mem = cls(max_runs=MAX_RUNS)
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
            runs = tuple((str(src), _check_runs(r)) for src, r in per_src.items())
            total += sum(len(r) // 2 for _, r in runs)
            if total > MAX_RESTORED:
                raise ValueError(f"route memory: more than {MAX_RESTORED} id ranges")
            mem._add(dest, runs, sum(sum(r[1::2]) for _, r in runs), 0)
            if mem._runs > mem.max_runs:
                mem.released(0, now)  # the oldest go first: never more than the cap held at once
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
