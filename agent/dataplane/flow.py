"""Credit/ack flow control, the replay buffer, and when to acknowledge upstream. Sans-IO.

Why application-level flow control (docs/design.md invariant 5): Mosquitto drops QoS 1 messages for a
client whose queue passed `max_queued_messages`, and `$share` round-robin is load-blind. So a
sender may have at most `window` (= the operator's `max_inflight_batches`) data batches to one
successor that the successor has not acknowledged; with no credit left it stops producing, which
in turn stops it acknowledging its own predecessors: a slow successor slows the whole chain
instead of overflowing the broker. The broker queue of one inbox is therefore bounded by the sum
of its predecessors' windows (plus a few acks and protocol messages).

The unacknowledged batches are kept (the replay buffer): after a successor's crash they can be
replayed to a live sibling (issue 10), and the sink's record-id dedup removes any duplicate.

`AckTracker` decides when an input batch may be acknowledged: only once it is processed AND every
record derived from it is forwarded (handed to the broker and PUBACKed, or recorded by a sink).
Inputs get increasing local "process indices"; everything still pending downstream carries the
lowest index it contains; every input below the lowest pending index is done.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, List, Optional, Tuple

__all__ = ["OutLink", "Unacked", "AckTracker"]


@dataclass(frozen=True)
class Unacked:
    seq: int
    payload: Any  # the bytes sent over MQTT, or the Envelope handed to a chained successor
    records: int
    sent_at: float
    low: int = 0  # lowest input index the batch carries (a source resumes from there after a crash)


class OutLink:
    """The data channel to one successor: credit window and replay buffer."""

    def __init__(self, dest: str, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, found {window}")
        self.dest = dest
        self.window = window
        self._unacked: "OrderedDict[int, Unacked]" = OrderedDict()
        self.acked_upto = 0
        self.last_ack_at = 0.0  # when the receiver last acked something new (see `ack`)
        self.silent_replays = 0  # replays since that ack (the worker backs off between them)
        self.batches_sent = 0
        self.records_sent = 0
        self.highest_sent = 0  # highest data seq sent in this epoch: no honest ack goes above it

    @property
    def credit(self) -> int:
        return self.window - len(self._unacked)

    @property
    def inflight(self) -> int:
        return len(self._unacked)

    @property
    def inflight_records(self) -> int:
        return sum(u.records for u in self._unacked.values())

    def sent(self, seq: int, payload: Any, records: int, now: float, low: int = 0) -> None:
        """Record a data batch handed to the transport (it must have had credit)."""
        if self.credit <= 0:
            raise RuntimeError(f"flow control to {self.dest}: sent seq {seq} without credit")
        self._unacked[seq] = Unacked(seq, payload, records, now, low)
        self.highest_sent = max(self.highest_sent, seq)
        self.batches_sent += 1
        self.records_sent += records

    def ack(self, upto: int, now: float = 0.0) -> int:
        """Cumulative ack: every data seq <= upto is done; returns the batches released."""
        if upto <= self.acked_upto:
            return 0
        self.acked_upto = upto
        self.last_ack_at = now
        self.silent_replays = 0
        released = 0
        while self._unacked:
            seq = next(iter(self._unacked))
            if seq > upto:
                break
            del self._unacked[seq]
            released += 1
        return released

    def restart_numbering(self) -> None:
        """We took a new epoch: our numbering to `dest` starts again at 1, so the ack position
        of the old epoch must go (kept, it made every ack of the new epoch look old)."""
        self.acked_upto = 0
        self.highest_sent = 0

    def renumber(self, moves: Dict[int, Tuple[int, Any]], now: float) -> None:
        """Batches sent again under new numbers (a replay after either side restarted), old seq
        -> (new seq, payload), all at once and in their order: a new number may be one a batch
        not yet renumbered still holds (our new epoch numbers from 1 again, and a message sent
        on the channel before the replay shifts the replay onto the old epoch's numbers), and
        renumbered one by one, each batch overwrote the next in the buffer."""
        entries = [Unacked(moves[u.seq][0], moves[u.seq][1], u.records, now, u.low) if u.seq in moves else u
                   for u in self._unacked.values()]
        if len({u.seq for u in entries}) != len(entries):
            raise RuntimeError(f"flow control to {self.dest}: renumbering onto a number still held")
        self._unacked = OrderedDict((u.seq, u) for u in entries)
        self.highest_sent = max([self.highest_sent] + [new for new, _ in moves.values()])

    def resent(self, seq: int, now: float) -> None:
        """A batch was sent again under its own number (a silent link: the receiver's channel
        drops it if it already has it); its age counts from now."""
        u = self._unacked[seq]
        self._unacked[seq] = Unacked(seq, u.payload, u.records, now, u.low)

    def plausible_ack(self, upto: int) -> bool:
        """An ack up to `upto` can come from the real receiver: it acks only what we sent it.
        A higher one (forged) would release the replay buffer and, kept as `acked_upto`, make
        every later real ack look old: no credit ever again (docs/security.md)."""
        return upto <= self.highest_sent

    def lowest_input(self) -> Optional[int]:
        """The lowest input index any unacked batch carries (None when all are acked)."""
        return min((u.low for u in self._unacked.values()), default=None)

    def unacked(self) -> List[Unacked]:
        """The replay buffer, oldest first."""
        return list(self._unacked.values())

    def oldest_age(self, now: float) -> float:
        if not self._unacked:
            return 0.0
        return now - next(iter(self._unacked.values())).sent_at


class AckTracker:
    """Which processed input batches are fully forwarded, hence may be acked to their sender."""

    def __init__(self) -> None:
        self._index = 0
        self._done_upto = 0  # inputs with index <= this are already released
        self._processed: Deque[Tuple[int, str, Tuple[int, int]]] = deque()  # (index, sender, (epoch, seq))
        self.last_released = 0  # batches released by the last release() call

    def processed(self, sender: str, seq: int, epoch: int = 0) -> int:
        """An input batch was processed (its outputs are now pending downstream); its index."""
        self._index += 1
        self._processed.append((self._index, sender, (epoch, seq)))
        return self._index

    def produced(self) -> int:
        """A new index for outputs produced on their own (a source's poll), with nobody to ack.

        Each poll needs an index of its own: the outputs' lowest pending index tells the source
        which polls are acked end to end (its restart position). Not queued for `release`."""
        self._index += 1
        return self._index

    @property
    def last_index(self) -> int:
        return self._index

    def release(self, lowest_pending: Optional[int]) -> Dict[str, Tuple[int, int]]:
        """Inputs below `lowest_pending` (None: nothing pending) are done:
        {sender: (epoch, highest seq)}, the newest incarnation of each sender only."""
        limit = self._index if lowest_pending is None else lowest_pending - 1
        out: Dict[str, Tuple[int, int]] = {}
        self.last_released = 0
        while self._processed and self._processed[0][0] <= limit:
            self.last_released += 1
            _, sender, pos = self._processed.popleft()
            if pos > out.get(sender, (-1, 0)):
                out[sender] = pos
        return out

    def waiting(self) -> int:
        return len(self._processed)

    def senders_waiting(self) -> Iterable[str]:
        return {s for _, s, _ in self._processed}
