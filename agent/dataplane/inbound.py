"""What a receiver accepts on its inbox, checked before anything touches its state. Sans-IO.

docs/security.md, "Data channels": the broker's ACL proves only that *a node identity* wrote an
inbox message; the sender, epoch and sequence number in the envelope are claims. Taken as they
come, one forged envelope is enough to stall a pipeline for good: an epoch of 2**53 makes every
later real batch "old", a fake batch from an invented sender consumes record ids, and acks from
invented senders each create a channel entry that is persisted. So a receiver admits an envelope
only when what it claims is something a real sender can send:

- **sender**: the worker's own tables say it exists (`Instance._sender_allowed`: predecessors for
  data, instances it sent data to for acks, any neighbour, round peer or known channel for
  protocol messages). A sender the protocol may announce later (a predecessor that routes to a
  new copy before the copy's Start) is held in a bounded buffer (`HoldBuffer`), never in the
  channel tables; everything else is refused.
- **epoch** (`numbering_fault`): a sender's epoch grows by one per restart or new incarnation,
  or jumps to the wall clock when it is re-homed or handed over without its state (`min_epoch`).
  So a new epoch more than `MAX_CLOCK_AHEAD` s past our wall clock is refused, never persisted;
  only when our clock is behind the sender's known epoch (a Pi booted without a real-time clock)
  may it be up to `MAX_EPOCH_STEP` above the known one instead. (Both bounds had to be exceeded
  before: a forged epoch of the wall clock + 500 s passed, was persisted, and the real sender's
  batches were "old" for good once the forger stopped.) A sender whose binding the agent took
  without proof starts no new epoch at all (`Instance._admit`, hostmap "unproven").
- **seq**: a sender has at most a flow-control window of data batches unacknowledged, plus a
  few acks and protocol messages, so an honest envelope is never far beyond the next expected
  number; a jump past that (`seq_ahead`) is refused. After a restart from a lagging snapshot
  the bound is `RESYNC_AHEAD` (one state period of traffic, with a wide margin).

- **writing node** (`writer_verdict`): the node in the inbox topic (`inbox/<us>/<node>`, which
  only that node may write) must be the node that hosts the claimed sender, as the agent's
  binding table says (agent.node.hostmap, sent to the worker as the control line "hosts").
  Anything else is held, for a short time (the worker's WRITER_HOLD_TTL), then refused: a new
  incarnation (a restart elsewhere, a re-home, a hand-over, a new copy) writes before its node's
  hosted record reaches us, so "not the bound node" cannot be told from "not bound yet".

Refused envelopes are counted by the caller and logged through `LogLimiter` (once per sender per
minute, and a bounded number of lines per minute overall: 30k invented senders must not become
30k log lines).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Hashable, List, Optional, Sequence, Tuple, Union

__all__ = [
    "ACCEPT", "HOLD", "REFUSE", "MAX_EPOCH_STEP", "MAX_CLOCK_AHEAD", "MAX_SEQ", "RESYNC_AHEAD",
    "seq_ahead", "numbering_fault", "writer_verdict", "HoldBuffer", "LogLimiter",
]

ACCEPT, HOLD, REFUSE = "accept", "hold", "refuse"

# Restarts and new incarnations (worker.py: saved epoch + 1, `_new_incarnation`) add one each; a
# sender that crash-looped a thousand times while we did not hear from it is not plausible.
MAX_EPOCH_STEP = 1000
# Re-homing and hand-over without state start at `min_epoch` = the re-homing agent's wall clock
# in seconds (agent.node.rehome, agent.node.handover), plus one per later restart. Another
# node's clock may run ahead of ours: NTP keeps fog nodes within a second; a minute of margin
# (also for a burst of restarts right after a re-home). Whatever a forger sets within it, the
# real sender's next re-home or hand-over is above it a minute later.
MAX_CLOCK_AHEAD = 60.0
# Envelopes one sender sends to one destination in one epoch: 1000 a second for 30 years stays
# below this; 2**53 (the hostile test) does not.
MAX_SEQ = 2 ** 40
# In-order delivery is per channel; what can legitimately arrive ahead of a missing envelope is
# what the sender can have in flight: its credit window of data (flow.OutLink), about as many
# acks (one per batch it received from us at most) and a few protocol and lock messages.
SEQ_AHEAD_BASE = 256
SEQ_AHEAD_PER_WINDOW = 8
# A restarted receiver's snapshot lags by at most one state period (worker.STATE_PERIOD = 1 s)
# of traffic: a few hundred envelopes per sender at the bench's rates.
RESYNC_AHEAD = 100_000


def seq_ahead(window: int) -> int:
    """How far past the next expected number an honest envelope can be (window: the larger of the
    predecessors' and our own `max_inflight_batches`)."""
    return SEQ_AHEAD_BASE + SEQ_AHEAD_PER_WINDOW * max(1, window)


def numbering_fault(
    position: Optional[Tuple[int, int, bool]],
    resync_unknown: bool,
    epoch: int,
    seq: int,
    wall: float,
    window: int,
) -> Optional[str]:
    """None if a real sender can send (epoch, seq) on a channel at `position` (its (epoch, next
    seq, resync) from `channel.Inbound.position`, None for no channel yet); else "epoch" or "seq".

    `resync_unknown`: the receiver restarted without a position for new senders (their first
    number is unknown). An epoch below the known one is fine here: the channel drops it as stale
    without changing anything."""
    if seq > MAX_SEQ:
        return "seq"
    if position is None:
        known, next_seq, resync = 0, 1, resync_unknown
        new_epoch = True
    else:
        known, next_seq, resync = position
        if epoch < known:
            return None
        new_epoch = epoch > known
    if new_epoch:
        if epoch > wall + MAX_CLOCK_AHEAD and (known <= wall or epoch > known + MAX_EPOCH_STEP):
            return "epoch"
        next_seq = 1  # a new incarnation numbers from 1 (channel.Inbound.receive)
        if position is None and resync:
            return None  # no position for this sender survived: any first number (below MAX_SEQ)
    if seq > next_seq + (RESYNC_AHEAD if resync else seq_ahead(window)):
        return "seq"
    return None


def writer_verdict(bound: Optional[str], former: Sequence[str], writer: str) -> str:
    """ACCEPT if node `writer` (from the inbox topic) is the node the sender is bound to, or one
    it was bound to before that is offline now (`former`: what it wrote while it hosted the
    sender may still wait in the broker; an offline node writes nothing new). Else HOLD: the
    binding may be about to name it (the new host's hosted record is on its way; a forgery never
    gets bound, so it is refused when the hold expires)."""
    return ACCEPT if writer == bound or writer in former else HOLD


@dataclass
class _Held:
    since: float
    items: Deque[Tuple[Any, int]] = field(default_factory=deque)  # (item, its size in bytes)
    size: int = 0


class HoldBuffer:
    """Raw envelopes of senders that are not known YET, in arrival order, bounded.

    Why hold instead of refusing: a new copy learns its predecessors only with its Start, but they
    route records to it as soon as they have acked its creator's Duplication (docs/scaling.md);
    refused, those batches would come back only after the predecessors' silence replay (seconds
    to minutes). Bounded by sender count, envelopes per sender and bytes in all, so a flood of
    invented senders costs at most `max_bytes`; what does not fit is refused by the caller.
    The caller keeps payloads as received (bytes, not decoded records) and passes their size, so
    the byte bound is the memory bound. Keyed by one ordered stream: the worker uses (sender,
    writing node), so that another node's envelopes in a real sender's name never queue in
    front of the real ones."""

    def __init__(self, max_senders: int = 64, max_per_sender: int = 64, max_bytes: int = 8 << 20) -> None:
        self.max_senders = max_senders
        self.max_per_sender = max_per_sender
        self.max_bytes = max_bytes
        self._held: "OrderedDict[Hashable, _Held]" = OrderedDict()
        self.size = 0
        self.count = 0

    def __bool__(self) -> bool:
        return bool(self._held)

    def __contains__(self, sender: Hashable) -> bool:
        return sender in self._held

    def add(self, sender: Hashable, item: Any, size: int, now: float) -> bool:
        """Hold one envelope (`item`, `size` bytes); False when it does not fit (the caller
        refuses it)."""
        h = self._held.get(sender)
        if h is None and len(self._held) >= self.max_senders:
            return False
        if self.size + size > self.max_bytes or (h is not None and len(h.items) >= self.max_per_sender):
            return False
        if h is None:
            h = self._held[sender] = _Held(now)
        h.items.append((item, size))
        h.size += size
        self.size += size
        self.count += 1
        return True

    def senders(self) -> List[Any]:
        return list(self._held)

    def first(self, sender: Hashable) -> Optional[Any]:
        h = self._held.get(sender)
        return h.items[0][0] if h is not None else None

    def items(self, sender: Hashable) -> List[Any]:
        """What `sender`'s stream holds, first to last."""
        h = self._held.get(sender)
        return [item for item, _ in h.items] if h is not None else []

    def order(self, sender: Hashable, key: Callable[[Any], Any]) -> None:
        """Sort what `sender`'s stream holds by `key` (stable: equal keys keep arrival order)."""
        h = self._held.get(sender)
        if h is not None and len(h.items) > 1:
            h.items = deque(sorted(h.items, key=lambda pair: key(pair[0])))

    def pop_first(self, sender: Hashable) -> None:
        h = self._held[sender]
        _, size = h.items.popleft()
        h.size -= size
        self.size -= size
        self.count -= 1
        if not h.items:
            del self._held[sender]

    def expire(self, now: float, ttl: Union[float, Callable[[Any], float]]) -> List[Tuple[Any, int]]:
        """Drop the senders held for `ttl` s (or `ttl(sender)` s) or more: [(sender, envelopes
        dropped)]."""
        out = []
        for sender, h in list(self._held.items()):
            if now - h.since >= (ttl(sender) if callable(ttl) else ttl):
                out.append((sender, len(h.items)))
                self.size -= h.size
                self.count -= len(h.items)
                del self._held[sender]
        return out


class LogLimiter:
    """At most one log line per key per `period` s, and `burst` lines per period overall.

    The key table is bounded (`max_keys`, oldest forgotten first): a flood of invented senders
    must cost neither memory nor a log line each. `suppressed` counts the lines not written since
    the last one that was; the caller says how many in the next line it writes."""

    def __init__(self, period: float = 60.0, burst: int = 20, max_keys: int = 256) -> None:
        self.period = period
        self.burst = burst
        self.max_keys = max_keys
        self._last: "OrderedDict[Hashable, float]" = OrderedDict()
        self._window_start = -1e18
        self._lines = 0
        self.suppressed = 0

    def allow(self, key: Hashable, now: float) -> bool:
        if now - self._window_start >= self.period:
            self._window_start, self._lines = now, 0
        last = self._last.get(key)
        if (last is not None and now - last < self.period) or self._lines >= self.burst:
            self.suppressed += 1
            return False
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        self._lines += 1
        return True

    def take_suppressed(self) -> int:
        n, self.suppressed = self.suppressed, 0
        return n
