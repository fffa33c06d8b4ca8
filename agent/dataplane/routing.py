"""Routing to successors and output batching (size + linger). Sans-IO: time is passed in.

- Without a key: batches go round-robin over the successors, skipping one without flow-control
  credit (a slow instance then receives less instead of blocking its siblings' share; when all
  have credit it is plain round-robin, as the paper assumes for an even load share).
- With a key (the operator declares `key = "field"`): records are routed by key GROUP, not by raw
  hash modulo instance count (docs/design.md section 8): the mapping key -> group -> instance is
  the one of agent.dataplane.keygroups, shared with the keyed operators' state, so every
  predecessor maps a key to the same instance, and a later state hand-over can move whole groups.
  With an explicit group -> owner table (`Router.table`, agent.dataplane.owners) a group goes to
  the owner the table names, whatever the successor set: a copy gets a group only once its old
  owner's Redirect changed the table (docs/operators.md, "Key groups that move").

- Pinned (`Outbox.add_to`): records this instance sent before, which must go to the same successor
  again (docs/design.md invariant 8, agent.dataplane.sticky), wait in that successor's buffer as
  keyed records do, and leave in input order with the shared ones (`Outbox._pinned_fronts`).

The outbox never drops a record: records buffered for a successor that leaves the routing table
are routed again over the new table (docs/design.md invariant 3: after the route change nothing more
goes to the leaving instance). Each buffered record carries the process index of the input batch
it came from, so the worker can tell which inputs are fully forwarded (see flow.AckTracker).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

from agent.dataplane.envelope import Item
from agent.dataplane.keygroups import DEFAULT_GROUPS, key_group, record_key
from agent.dataplane.owners import GroupTable

__all__ = ["Router", "Outbox", "key_group", "DEFAULT_GROUPS"]

Pending = Tuple[Item, int]  # (item, process index)


class Router:
    """The routing table to the next operator (the paper's `succs`)."""

    def __init__(self, succs: Sequence[str] = (), key: Optional[str] = None, groups: int = DEFAULT_GROUPS,
                 table: Optional[GroupTable] = None) -> None:
        self.key = key
        self.groups = groups
        if table is not None and table.groups != groups:
            raise ValueError(f"a group table of {table.groups} groups for a routing of {groups}")
        self.table = table
        self._succs: Tuple[str, ...] = ()
        self.set_succs(succs)
        self._rr = 0

    @property
    def succs(self) -> Tuple[str, ...]:
        return self._succs

    def set_succs(self, succs: Iterable[str]) -> None:
        self._succs = tuple(sorted(set(succs)))

    def add(self, dest: str) -> None:
        self.set_succs(self._succs + (dest,))

    def remove(self, dest: str) -> None:
        self.set_succs(s for s in self._succs if s != dest)

    def by_key(self, record: Any) -> str:
        g = key_group(record_key(record, self.key), self.groups)
        if self.table is not None:
            return self.table.owner(g)
        # keygroups.owner without its sort: _succs is kept sorted and duplicate-free
        return self._succs[g % len(self._succs)]

    def next_with_credit(self, credit: Callable[[str], int]) -> Optional[str]:
        n = len(self._succs)
        for i in range(n):
            dest = self._succs[(self._rr + i) % n]
            if credit(dest) > 0:
                self._rr = (self._rr + i + 1) % n
                return dest
        return None


class Outbox:
    """Buffered output records waiting for a full batch, the linger time, or credit."""

    def __init__(self, router: Router, batch_size: int, linger: float) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        self.router = router
        self.batch_size = batch_size
        self.linger = linger
        # Keyless: one shared buffer (dest chosen at send time) of chunks [items, index, offset]
        # (one per add: no per-record tuple on the way through). Keyed, and pinned keyless
        # records: one buffer per dest.
        self._shared: Deque[List[Any]] = deque()
        self._shared_n = 0
        self._shared_since = 0.0
        self._keyed: Dict[str, List[Pending]] = {}
        self._keyed_since: Dict[str, float] = {}
        self.pending = 0

    def add(self, items: Sequence[Item], index: int, now: float) -> None:
        """Buffer the records derived from input `index` (keyless: the list itself is kept, as
        one chunk, so the caller must not change it afterwards; the worker never does)."""
        if not items:
            return
        if self.router.key is None:
            if not self._shared:
                self._shared_since = now
            self._shared.append([items if isinstance(items, list) else list(items), index, 0])
            self._shared_n += len(items)
        else:
            if not self.router.succs:
                raise RuntimeError("keyed routing without successors")
            for it in items:
                dest = self.router.by_key(it[2])
                buf = self._keyed.get(dest)
                if buf is None:
                    buf = self._keyed[dest] = []
                    self._keyed_since[dest] = now
                buf.append((it, index))
        self.pending += len(items)

    def add_to(self, dest: str, items: Sequence[Item], index: int, now: float) -> None:
        """Buffer records derived from input `index` for `dest` itself: records sent to it before
        (docs/design.md invariant 8). If `dest` leaves the table they are routed again (reroute)."""
        if not items:
            return
        buf = self._keyed.get(dest)
        if buf is None:
            buf = self._keyed[dest] = []
            self._keyed_since[dest] = now
        buf.extend((it, index) for it in items)
        self.pending += len(items)

    def put_back(self, items: Sequence[Item], index: int, now: float) -> None:
        """Buffer again records sent earlier (to a successor that left the table) ahead of the
        rest: everything still buffered was produced after them, so the buffers stay in index
        order, which the upstream ack position (`lowest_index`, each batch's low) relies on."""
        if not items:
            return
        if self.router.key is None:
            if not self._shared:
                self._shared_since = now
            self._shared.appendleft([list(items), index, 0])
            self._shared_n += len(items)
            self.pending += len(items)
            return
        self.add(items, index, now)
        for buf in self._keyed.values():
            buf.sort(key=lambda p: p[1])

    def take(self, now: float, credit: Callable[[str], int], force: bool = False) -> List[Tuple[str, List[Item], int]]:
        """Batches to send now: [(dest, items, lowest index)]. The caller must send them all."""
        out: List[Tuple[str, List[Item], int]] = []
        if not self.router.succs:
            return out
        sent: Dict[str, int] = {}

        def left(dest: str) -> int:  # credit minus the batches already taken in this call
            return credit(dest) - sent.get(dest, 0)

        if self.router.key is not None:
            self._take_buffers(now, left, force, out, sent)
            return out
        if not self._keyed:  # nothing pinned (the usual case)
            self._take_shared(now, left, force, out, sent, {})
            return out
        while True:  # keyless: pinned and shared records leave in input order (`_pinned_fronts`)
            taken = len(out)
            shared = self._shared[0][1] if self._shared else None
            self._take_buffers(now, left, force or shared is not None, out, sent, upto=shared)
            fronts = self._pinned_fronts()
            self._take_shared(now, left, force or bool(fronts), out, sent, fronts)
            if len(out) == taken or not fronts:
                return out

    def _pinned_fronts(self) -> Dict[str, int]:
        """Per successor in the table, the lowest input index of a pinned record waiting for it.

        Why: records sent again after a fault (a restarted source regenerating, a predecessor's
        replay) are pinned, and the newer records of the same inputs go to the shared buffer. If
        each buffer left whenever it was full, newer records would overtake older ones on one
        channel, and a keyed window downstream, its watermark moved on, would drop the older
        ones as late (docs/reliability.md, "Replays in order": an instance forwards in the order
        it took its inputs). So on each channel records leave in input order: a shared record
        goes to a successor only after every record pinned to it from a lower or the same input
        index, a pinned one only after every shared record of a lower index, and while both
        kinds wait neither waits for a full batch (transient: records are pinned only after a
        fault)."""
        return {dest: buf[0][1] for dest, buf in self._keyed.items() if buf and dest in self.router.succs}

    def _take_shared(self, now: float, left: Callable[[str], int], force: bool,
                     out: List[Tuple[str, List[Item], int]], sent: Dict[str, int], fronts: Dict[str, int]) -> None:
        """Batches from the keyless shared buffer; to a successor with pinned records (`fronts`),
        only records of inputs below the first of those."""
        while self._shared and (
            self._shared_n >= self.batch_size or force or now - self._shared_since >= self.linger
        ):
            if fronts:
                first = self._shared[0][1]
                dest = self.router.next_with_credit(lambda d: left(d) if fronts.get(d, first + 1) > first else 0)
            else:
                dest = self.router.next_with_credit(left)
            if dest is None:
                break
            n = min(self.batch_size, self._shared_n)
            if dest in fronts:
                n = self._shared_below(fronts[dest], n)
            low = self._shared[0][1]
            batch: List[Item] = []
            need = n
            while need:
                c = self._shared[0]
                items, _, off = c
                k = min(need, len(items) - off)
                if off == 0 and k == len(items) == need and not batch:
                    batch = items  # the whole chunk: no copy
                else:
                    batch.extend(items[off:off + k])
                need -= k
                if off + k == len(items):
                    self._shared.popleft()
                else:
                    c[2] = off + k
            out.append((dest, batch, low))
            sent[dest] = sent.get(dest, 0) + 1
            self.pending -= n
            self._shared_n -= n

    def _shared_below(self, below: int, limit: int) -> int:
        """How many shared records (up to `limit`) come from inputs below index `below`."""
        n = 0
        for items, index, off in self._shared:
            if index >= below or n >= limit:
                break
            n += len(items) - off
        return min(n, limit)

    def _take_buffers(self, now: float, left: Callable[[str], int], force: bool,
                      out: List[Tuple[str, List[Item], int]], sent: Dict[str, int],
                      upto: Optional[int] = None) -> None:
        """Batches from the per-dest buffers (keyed records, pinned keyless ones), of records whose
        input index is at most `upto`."""
        for dest in list(self._keyed):
            if dest not in self.router.succs:
                continue  # left the table: reroute() moves these (invariant 3)
            buf = self._keyed[dest]
            while buf and (len(buf) >= self.batch_size or force or now - self._keyed_since[dest] >= self.linger):
                if left(dest) <= 0:
                    break
                k = min(len(buf), self.batch_size)
                if upto is not None:
                    k = next((i for i in range(k) if buf[i][1] > upto), k)
                    if k == 0:
                        break
                chunk, self._keyed[dest] = buf[:k], buf[k:]
                buf = self._keyed[dest]
                out.append((dest, [p[0] for p in chunk], chunk[0][1]))
                sent[dest] = sent.get(dest, 0) + 1
                self.pending -= len(chunk)
            if not buf:
                del self._keyed[dest]
                del self._keyed_since[dest]

    def reroute(self, now: float) -> int:
        """After a routing-table change: move keyed records to their new destination.

        Returns how many records changed destination. The keyless shared buffer needs nothing:
        its destination is chosen at send time from the current table; pinned records of a
        successor that left go back to it, in input order.
        """
        if not self._keyed:
            return 0
        if self.router.key is None:
            gone = [d for d in self._keyed if d not in self.router.succs]
            chunks = [[[it], index, 0] for d in gone for it, index in self._keyed[d]]
            for d in gone:
                del self._keyed[d], self._keyed_since[d]
            if chunks:
                if not self._shared:
                    self._shared_since = now
                # stable: the chunks stay in index order (lowest_index reads the first)
                self._shared = deque(sorted(list(self._shared) + chunks, key=lambda c: c[1]))
                self._shared_n += len(chunks)
            return len(chunks)
        moved = 0
        old, self._keyed, self._keyed_since = self._keyed, {}, {}
        self.pending = 0
        for dest, buf in sorted(old.items(), key=lambda kv: kv[1][0][1]):
            for it, index in buf:
                new = self.router.by_key(it[2]) if self.router.succs else dest
                moved += new != dest
                self._keyed.setdefault(new, []).append((it, index))
                self._keyed_since.setdefault(new, now)
                self.pending += 1
        # keep each buffer in process-index order (the lowest index is the first element)
        for buf in self._keyed.values():
            buf.sort(key=lambda p: p[1])
        return moved

    def lowest_index(self) -> Optional[int]:
        lows = [buf[0][1] for buf in self._keyed.values() if buf]
        if self._shared:
            lows.append(self._shared[0][1])
        return min(lows) if lows else None  # chunks are in index order: the first is the lowest

    def next_deadline(self) -> Optional[float]:
        times = [self._keyed_since[d] + self.linger for d, b in self._keyed.items() if b]
        if self._shared:
            times.append(self._shared_since + self.linger)
        return min(times) if times else None

    def buffered_for(self, dest: str) -> int:
        return len(self._keyed.get(dest, ()))
