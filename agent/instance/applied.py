"""Which record numbers of one source a keyed operator has applied: a floor and ranges above it.

Rules of this file: pure, no I/O. Why a set and not the highest number applied: a record's
number grows along its source, but the records of one source do not always reach a keyed
operator in that order. A predecessor that restarts, or becomes a new incarnation, processes what
its own predecessors replay to it after whatever newer input was already queued for it, so the
keyed operator can see record 900 before the replayed 850 it never applied; "the highest applied"
then skipped 850 as a replay (docs/reliability.md, "Keyed state: exactly once in any order";
CHANGELOG.md, "A keyed operator skipped replayed records that came after newer ones"). A set is
right in every order: a number is applied once, the first time it comes.

What bounds it: numbers below `floor` count as applied. The floor comes from the source itself
(agent.instance.core: each data batch carries, per source of its records, the first number its
source has not seen acked end to end; acks are end to end, so every record below it was applied by
every operator downstream or filtered before it), forwarded unchanged by every operator on the
way. Such a claim stays true once made, so the largest one seen is the floor whatever order the
claims arrive in. Above it, `ranges` hold the applied numbers as disjoint, non-adjacent
inclusive intervals: one per hole (a record filtered upstream, or one still on its way). Without
claims (records of a keyed operator's outputs: no source instance) holes stay; numbers that come
consecutively still make one interval.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, List

__all__ = ["Applied"]


class Applied:
    """The applied numbers of one source: every n < floor, and the intervals in `los`/`his`."""

    __slots__ = ("floor", "los", "his")

    def __init__(self, floor: int = 0) -> None:
        self.floor = floor
        self.los: List[int] = []  # interval starts, increasing, all > floor
        self.his: List[int] = []  # interval ends (inclusive); his[i] + 1 < los[i + 1]

    def __contains__(self, n: int) -> bool:
        if n < self.floor:
            return True
        i = bisect_right(self.los, n)
        return i > 0 and self.his[i - 1] >= n

    def add(self, n: int) -> bool:
        """Mark `n` applied; False when it already was (a replay)."""
        los, his = self.los, self.his
        if not los:
            if n < self.floor:
                return False
            if n == self.floor:
                self.floor += 1
            else:
                los.append(n)
                his.append(n)
            return True
        last = his[-1]
        if n > last:  # the usual case: the next number, or one past a hole
            if n == last + 1:
                his[-1] = n
            else:
                los.append(n)
                his.append(n)
            return True
        if n < self.floor:
            return False
        i = bisect_right(los, n)
        if i > 0 and his[i - 1] >= n:
            return False
        left = his[i - 1] == n - 1 if i > 0 else n == self.floor
        right = i < len(los) and los[i] == n + 1
        if i == 0 and left:  # joins the floor
            self.floor = n + 1
            if right:
                self.floor = his[0] + 1
                del los[0], his[0]
        elif left and right:
            his[i - 1] = his[i]
            del los[i], his[i]
        elif left:
            his[i - 1] = n
        elif right:
            los[i] = n
        else:
            los.insert(i, n)
            his.insert(i, n)
        return True

    def raise_floor(self, floor: int) -> bool:
        """Every number below `floor` counts as applied from now on; True if that changed anything."""
        if floor <= self.floor:
            return False
        self.floor = floor
        los, his = self.los, self.his
        k = 0
        while k < len(los) and los[k] <= self.floor:
            self.floor = max(self.floor, his[k] + 1)
            k += 1
        if k:
            del los[:k], his[:k]
        return True

    def intervals(self) -> int:
        return len(self.los)

    def to_json(self) -> List[Any]:
        """[floor, [lo, hi, lo, hi, ...]]"""
        flat: List[int] = []
        for lo, hi in zip(self.los, self.his):
            flat += (lo, hi)
        return [self.floor, flat]

    @classmethod
    def from_json(cls, data: Any) -> "Applied":
        floor, flat = data
        a = cls(int(floor))
        for j in range(0, len(flat), 2):
            lo, hi = int(flat[j]), int(flat[j + 1])
            if lo <= a.floor or (a.his and lo <= a.his[-1] + 1) or hi < lo:
                raise ValueError(f"applied ranges: [{lo}, {hi}] after floor {a.floor} and {a.his[-1:]}")
            a.los.append(lo)
            a.his.append(hi)
        return a

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Applied) and (self.floor, self.los, self.his) == (other.floor, other.los, other.his)

    def __repr__(self) -> str:
        return f"Applied({self.to_json()!r})"


def union(a: Applied, b: Applied) -> Applied:
    """The numbers applied in `a` or in `b` (a key group's hand-over: the new owner also counts as
    applied what the old owner applied, since a replay of it may now reach the new owner; record
    ids are unique, so a number applied for another group is never sent to it anyway)."""
    floor = max(a.floor, b.floor)
    los: List[int] = []
    his: List[int] = []
    for lo, hi in sorted(zip(a.los + b.los, a.his + b.his)):
        if hi < floor:
            continue
        if not los and lo <= floor:  # joins the floor
            floor = max(floor, hi + 1)
        elif los and lo <= his[-1] + 1:
            his[-1] = max(his[-1], hi)
        else:
            los.append(lo)
            his.append(hi)
    out = Applied(floor)
    out.los, out.his = los, his
    return out
