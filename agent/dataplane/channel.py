"""Per-sender FIFO sequencing and duplicate removal (docs/design.md invariant 1), sans-IO.

Rules of this file: no I/O, no clock. `Inbound` turns envelopes in arrival order into envelopes in
each sender's sending order, exactly once; `Outbound` hands out the numbers. Both snapshot to a
small JSON-able dict so a restarted worker (same identity, `spec.restart`) resumes its numbering
instead of having every later message dropped as a duplicate, or accepting old ones twice.

Why reorder instead of trusting MQTT: Mosquitto promises in-order delivery only with
`max_inflight_messages 1`; after a reconnect QoS 1 retransmissions may come twice and out of
order. A data batch delivered after the sender's `deletion_ack`, or twice, is a lost or duplicated
record; here it can happen neither way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from agent.dataplane.envelope import Envelope, Kind

__all__ = ["Inbound", "Outbound", "ChannelStats", "is_replay_marker"]


def is_replay_marker(env: Envelope) -> bool:
    """An empty data batch without a watermark: what a predecessor sends before it replays what
    a new incarnation of its successor had not acked (agent.instance.outputs)."""
    return env.kind is Kind.DATA and not env.body and env.watermark is None


@dataclass
class ChannelStats:
    delivered: int = 0
    duplicates: int = 0  # seq already delivered or already buffered: dropped
    stale_epoch: int = 0  # from an older incarnation of the sender: dropped
    reordered: int = 0  # arrived ahead of a gap and waited for it


@dataclass
class _In:
    epoch: int
    next_seq: int
    pending: Dict[int, Envelope] = field(default_factory=dict)
    resync: bool = False  # restored from a snapshot that may lag: accept the first seq seen
    # a new epoch of the sender met while resyncing: taken from its number 1 or its replay marker
    from_marker: bool = False
    asked: bool = False  # that epoch's number 1 missing: the sender asked for its marker once


class Inbound:
    """Receiver side: one expected sequence number per sender.

    `max_pending` bounds the reorder buffer of one sender: a gap that never closes (a message the
    broker lost) must not grow memory without bound; past the bound the oldest gap is skipped and
    counted in `gaps_skipped` (which the worker reports as an error; it means loss upstream).
    """

    def __init__(self, max_pending: int = 10000) -> None:
        self._chans: Dict[str, _In] = {}
        self.max_pending = max_pending
        self.stats = ChannelStats()
        self.gaps_skipped = 0
        self.changed = False  # set on every state change; the owner persists and clears it
        self.resync_unknown = False  # set by restore(): senders missing from the snapshot resync
        self._asks: List[str] = []  # senders to ask for a replay marker (`take_asks`)

    def receive(self, env: Envelope, replays_to_us: bool = True) -> List[Envelope]:
        """Accept one envelope; return the envelopes now deliverable in sender order.
        `replays_to_us`: the sender is a predecessor, which sends a replay marker ahead of its
        replay when we are a new incarnation. A successor sends acks, each covering the earlier
        ones, and a sibling protocol messages, sent again on silence: for those a resync at the
        first number seen loses nothing."""
        ch = self._chans.get(env.sender)
        if ch is None:
            # A restarted receiver may have lost a sender's position with the rest of a lagging
            # snapshot (or the whole snapshot): it cannot assume the sender starts at 1.
            ch = self._chans[env.sender] = _In(env.epoch, 1, resync=self.resync_unknown)
        if env.epoch < ch.epoch:
            self.stats.stale_epoch += 1
            return []
        if env.epoch > ch.epoch:
            # A new incarnation of the sender starts numbering again at 1. That start is known,
            # not lagging, so a resync does not carry over to it: taken at its first number seen,
            # the numbers below would be dropped when they come (a drain moves a source and its
            # receiver at once; the source's first batches went to the receiver's old node and
            # come again after later ones), and the replay would bring their records behind
            # newer ones, out of order. A predecessor's starts at 1 or at its replay marker
            # instead; the others resync as before.
            ch.epoch, ch.next_seq, ch.pending = env.epoch, 1, {}
            if replays_to_us and (ch.resync or ch.from_marker):
                ch.from_marker, ch.resync, ch.asked = True, False, False
        if ch.from_marker and env.seq > ch.next_seq and is_replay_marker(env):
            # The sender saw our new incarnation: all it sent before this marker and we have not
            # taken follows it again, renumbered (agent.instance.replays).
            ch.from_marker, ch.next_seq = False, env.seq
            ch.pending = {s: e for s, e in ch.pending.items() if s > env.seq}
        elif ch.from_marker and ch.next_seq == 1 and env.seq > 1 and not ch.asked:
            # Its first numbers are missing: maybe on their way again from our old node's
            # topic, maybe lost (sent before our new node subscribed). Its marker comes once it
            # sees our new epoch, which we tell it now rather than after a hole's GAP_TIMEOUT.
            ch.asked = True
            self._asks.append(env.sender)
        if ch.resync:
            # The snapshot is written at most every few ms (cheap persistence), so after a crash
            # it can lag behind what was already acknowledged to the broker; those messages will
            # not come again. Resume at the first one that does; the sink's record-id dedup
            # removes whatever this lets through twice.
            ch.resync = False
            if env.seq > ch.next_seq:
                ch.next_seq = env.seq
        if env.seq < ch.next_seq or env.seq in ch.pending:
            self.stats.duplicates += 1
            return []
        if env.seq > ch.next_seq:
            ch.pending[env.seq] = env
            self.stats.reordered += 1
            if len(ch.pending) > self.max_pending:
                self.gaps_skipped += 1
                ch.next_seq = min(ch.pending)
            else:
                return []
        else:
            ch.pending[env.seq] = env
        out: List[Envelope] = []
        while ch.next_seq in ch.pending:
            out.append(ch.pending.pop(ch.next_seq))
            ch.next_seq += 1
        self.stats.delivered += len(out)
        self.changed = True
        return out

    def take_asks(self) -> List[str]:
        """The senders whose new epoch's first numbers are missing since the last call: to be
        told our epoch (an empty ack), so that their replay marker comes."""
        asks, self._asks = self._asks, []
        return asks

    def gaps(self) -> Dict[str, Any]:
        """Senders whose next envelope is missing: {sender: [epoch, expected seq, lowest waiting]}."""
        return {s: [c.epoch, c.next_seq, min(c.pending)] for s, c in self._chans.items() if c.pending}

    def waiting_total(self) -> int:
        return sum(len(c.pending) for c in self._chans.values())

    def epoch_of(self, sender: str) -> Optional[int]:
        ch = self._chans.get(sender)
        return ch.epoch if ch else None

    def waiting(self, sender: str) -> int:
        ch = self._chans.get(sender)
        return len(ch.pending) if ch else 0

    def next_seq(self, sender: str) -> Optional[int]:
        ch = self._chans.get(sender)
        return ch.next_seq if ch else None

    def position(self, sender: str) -> Optional[Tuple[int, int, bool]]:
        """(epoch, next seq, resync) of a known sender, None for one never received from: what
        `agent.dataplane.inbound.numbering_fault` checks an envelope against before `receive`."""
        ch = self._chans.get(sender)
        return (ch.epoch, ch.next_seq, ch.resync) if ch else None

    def senders(self) -> int:
        return len(self._chans)

    def forget(self, sender: str) -> None:
        """Drop a sender's channel (one that was admitted only provisionally, see
        `ScalingDriver.expire_probes`): its next envelope starts a new channel."""
        self._chans.pop(sender, None)

    def snapshot(self) -> Dict[str, Any]:
        return {s: [c.epoch, c.next_seq] for s, c in self._chans.items()}

    def restore(self, snap: Dict[str, Any], resync: bool = True) -> None:
        self._chans = {s: _In(int(e), int(n), resync=resync) for s, (e, n) in snap.items()}
        self.resync_unknown = resync


class Outbound:
    """Sender side: the next sequence number per destination, under this incarnation's epoch.

    A restarted worker takes a new epoch (persisted once at start) and numbers from 1 again, so
    the per-message counters never need to reach the disk.
    """

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self._next: Dict[str, int] = {}

    def take(self, dest: str) -> int:
        n = self._next.get(dest, 1)
        self._next[dest] = n + 1
        return n

    def peek(self, dest: str) -> int:
        return self._next.get(dest, 1)

    def forget(self, dest: str) -> None:
        self._next.pop(dest, None)

    def snapshot(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "next": dict(self._next)}

    def restore(self, snap: Dict[str, Any]) -> None:
        self.epoch = int(snap["epoch"])
        self._next = {d: int(n) for d, n in snap["next"].items()}
