"""When a spilling sink may ack its input upstream: at once (`written`) or once landed (`landed`).

Rules of this file: the ledger only; no I/O, no clock, no thread, no random. The sink (the
driver) tells it which `record()` calls are recorded and which spool files they wrote to, and
which spool files the centre has (the daemon's shipper deletes a closed file only once the
collector answered `landed` or `duplicate`, or once a path shipper landed it); it asks how many
calls it may ack now. Time is an argument.

Why (issue #34): in mode `written` a sink acks a batch once its spool line is in the OS file, so
its predecessors drop their copies; a node lost for good with its disk before its shipper landed
the file loses those records. In mode `landed` the acks wait until every spool file written so
far, up to and including that call's, has landed: then a lost node loses nothing that was acked,
and its predecessors replay the rest to the sink's next incarnation.

API
---
    hold = AckHold("landed", unlanded=names_found_at_start)   # files a previous incarnation left
    hold.wrote(["batches+n1+2026-12-06+0000000003"], now)     # one record() call recorded there
    hold.wrote([], now)                                       # a call with no line (all duplicates)
    hold.landed(hold.oldest())                                # the shipper released that file
    n = hold.take()                                           # calls the sink may ack now, in order

ORDERING CONTRACT: calls are released in the order they were registered (the worker acks
`record()` calls in order, `SinkOperator.settle`), and a call is released only once every file
that was touched at or before its registration has landed: the file of its own line, and the
files holding the earlier copies of ids it dropped as duplicates (earlier in this incarnation,
or left by a previous one: `unlanded`). Files are ordered by their first mention (the spool opens
them in sequence order); a file that lands out of order releases nothing until the files before
it landed too ("in file close order"). A landed report for a file the ledger does not know (it
landed before a restart, or is another spool's) is counted and ignored. In mode `written` every
call is released at once and nothing is tracked.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Iterable, List, Optional, Set

__all__ = ["ACK_MODES", "AckHold"]

ACK_MODES = ("written", "landed")


class AckHold:
    """The upstream acks a spilling sink owes, held until their spool files landed (module docstring)."""

    def __init__(self, mode: str = "written", *, unlanded: Iterable[str] = ()) -> None:
        if mode not in ACK_MODES:
            raise ValueError(f"ack mode {mode!r}: expected one of {', '.join(ACK_MODES)}")
        self.mode = mode
        self._order: Dict[str, int] = {}  # file -> its rank (first mention), for files not landed yet
        self._next = 0  # the rank of the next file mentioned
        self._landed: Set[int] = set()  # ranks at or above the frontier that landed (out of order)
        self._frontier = 0  # every rank below it landed
        # held calls, oldest first: [barrier rank (-1: no file), calls, registered at]
        self._held: Deque[List] = deque()
        self._free = 0  # calls released, not taken yet
        self.stats = {"calls": 0, "released": 0, "files": 0, "files_landed": 0, "unknown_landed": 0}
        for name in unlanded:
            self._rank(name)

    # ---- the driver's API ------------------------------------------------------------------------

    def wrote(self, files: Iterable[str] = (), now: float = 0.0, calls: int = 1) -> None:
        """`calls` record() calls are recorded; their spool lines went into `files`."""
        if calls < 1:
            raise ValueError(f"calls must be at least 1, got {calls}")
        self.stats["calls"] += calls
        if self.mode == "written":
            self._free += calls
            return
        for name in files:
            self._rank(name)
        barrier = self._next - 1  # the last file mentioned so far
        if barrier < self._frontier and not self._held:
            self._free += calls  # every file it depends on landed already
            return
        if self._held and self._held[-1][0] == barrier:
            self._held[-1][1] += calls  # same barrier: one entry (the oldest time is kept)
        else:
            self._held.append([barrier, calls, now])

    def landed(self, name: str) -> None:
        """The centre has this file (its shipper released it)."""
        rank = self._order.pop(name, None)
        if rank is None:
            self.stats["unknown_landed"] += 1
            return
        self.stats["files_landed"] += 1
        self._landed.add(rank)
        while self._frontier in self._landed:
            self._landed.discard(self._frontier)
            self._frontier += 1
        while self._held and self._held[0][0] < self._frontier:
            self._free += self._held.popleft()[1]

    def take(self) -> int:
        """How many more calls the sink may ack now (in registration order); they are forgotten."""
        n, self._free = self._free, 0
        self.stats["released"] += n
        return n

    # ---- what the driver looks at -------------------------------------------------------------

    def unlanded(self) -> List[str]:
        """The files not landed yet, oldest first (first mention)."""
        return list(self._order)  # ranks are given in insertion order: the dict is in rank order

    def oldest(self) -> Optional[str]:
        """The oldest file not landed yet: the one to watch (nothing is released before it lands)."""
        return next(iter(self._order), None)

    @property
    def held(self) -> int:
        """Calls recorded and not released yet."""
        return sum(e[1] for e in self._held)

    def held_since(self) -> Optional[float]:
        """When the oldest held call was registered (None: nothing held)."""
        return self._held[0][2] if self._held else None

    def waits_on(self) -> List[str]:
        """The files the oldest held call still waits for (empty: nothing held)."""
        if not self._held:
            return []
        barrier = self._held[0][0]
        out = []
        for name, rank in self._order.items():
            if rank > barrier:
                break
            out.append(name)
        return out

    # ---- internals ----------------------------------------------------------------------------

    def _rank(self, name: str) -> int:
        rank = self._order.get(name)
        if rank is None:
            rank = self._order[name] = self._next
            self._next += 1
            self.stats["files"] += 1
        return rank
