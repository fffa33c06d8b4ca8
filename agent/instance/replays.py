"""The replays a new incarnation of an instance waits for (docs/reliability.md, "Replays in order").

Rules of this file: `ReplayWait` owns the wait and holds no reference to the instance; it is given
the stats counters at construction, and per call the envelope, the time
`now` and what it reads of the channels (the position of a predecessor's channel, as a function).
No I/O, no clock, no random.

Why the wait: when we become a new incarnation (a restart, a lost session, a hole that stays open)
we ask every predecessor for a replay. Data a predecessor sent before it saw our new epoch may
still be queued for us: newer records than the ones we lost with our memory. Processed first, they
would reach the successors ahead of the replayed older ones (a keyed operator's window then closes
without them: CHANGELOG.md, "A keyed operator skipped replayed records that came after newer
ones"). Everything such a predecessor sent us and we did not ack is in its replay, which follows
its replay marker (an empty data batch, agent.instance.outputs), so what comes from it before the
marker is dropped, and its records reach us in its order. A marker that does not come within
REPLAY_WAIT of the predecessor showing it is alive was lost: the instance asks again, as a new
incarnation.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

from agent.dataplane.envelope import Envelope, Kind

__all__ = ["ReplayWait", "REPLAY_WAIT"]

# A predecessor whose data we drop while we wait for its replay marker and whose marker has not
# come this long after it showed it is alive never got our request (lost with a broker's state):
# we ask again, as a new incarnation. Generous: a loaded predecessor answers late.
REPLAY_WAIT = 10.0

# The seeded faults of the wait (the checker's `resync_at_first_seen`, `replay_clock_at_drop`) are
# subclasses it installs (foglab.sim.instance_faults): no branch here.


class ReplayWait:
    """Predecessor -> (its epoch we knew, None when our snapshot lacks its channel; when it first
    showed it is alive, or None), for the predecessors whose data before their replay marker we
    drop."""

    # A predecessor whose channel our snapshot lacks is awaited like the others (`start`): taken
    # at the first number seen, its data could be past replays a broker rollback lost, and our
    # cumulative ack would drop them from its buffer (False only in the checker's seeded fault
    # `resync_at_first_seen`, foglab.sim.instance_faults).
    awaits_unknown_channels = True
    # The clock of the wait for a predecessor's marker starts at anything it sends us but its
    # marker (`seen`), not only at a dropped data batch: a protocol message may open a channel
    # past replays a broker rollback lost, which then never reach `drops` (False only in the
    # checker's seeded fault `replay_clock_at_drop`, foglab.sim.instance_faults).
    clock_at_any_message = True

    def __init__(self, stats: Dict[str, int]) -> None:
        self.awaiting: Dict[str, Tuple[Optional[int], Optional[float]]] = {}
        self._stats = stats

    def __bool__(self) -> bool:
        return bool(self.awaiting)

    def start(self, preds: Iterable[str], position: Callable[[str], Optional[Tuple[int, int, bool]]]) -> None:
        """We are a new incarnation and ask `preds` for a replay: wait for each one's marker.
        Only predecessors we had a channel with (the others sent us nothing yet, and may not
        know us yet: they would never send a marker); a newer epoch of the predecessor ends the
        wait (restarted itself: all it sends is fresh). A predecessor whose channel our snapshot
        does not hold (`position` is None: it lags, we crashed before persisting it) is awaited
        too: its data is taken only from a marker or from number 1 (a channel that starts there
        has nothing before it). Taken at the first number seen, a batch that followed replays a
        broker rollback lost was acked, and the cumulative ack dropped the lost replays from the
        sender's buffer (`resync_past_lost_replays`)."""
        self.awaiting = {}
        for p in preds:
            pos = position(p)
            if pos is not None or self.awaits_unknown_channels:
                self.awaiting[p] = (pos[0] if pos is not None else None, None)

    def seen(self, env: Envelope, now: float) -> None:
        """Start the clock of the wait for `env.sender`'s replay marker (REPLAY_WAIT) at anything
        it sends us but its marker: it is alive, so a marker that does not follow was lost. Not
        only at a dropped data batch: a protocol message may open a channel the snapshot lacked
        past data and a marker a broker rollback lost, and the replays of that data under their
        own numbers then die in the channel as duplicates, never reaching `drops` (CHANGELOG.md,
        "A lost replay marker was never asked for again"; docs/reliability.md, "Replays in
        order"). A newer epoch of the sender is no evidence: its data ends the wait."""
        awaited = self.awaiting.get(env.sender)
        if awaited is None:
            return
        epoch, since = awaited
        if since is not None or not self.clock_at_any_message:
            return
        if (env.kind is not Kind.DATA or env.body) and (epoch is None or env.epoch <= epoch):
            self.awaiting[env.sender] = (epoch, now)

    def marker(self, sender: str) -> None:
        """`sender`'s replay marker came: its replay follows, in its order."""
        self.awaiting.pop(sender, None)

    def drops(self, env: Envelope, now: float) -> bool:
        """Drop `env` (data from a predecessor whose replay marker has not come yet)?"""
        awaited = self.awaiting.get(env.sender)
        if awaited is None:
            return False
        epoch, since = awaited
        if env.seq == 1 if epoch is None else env.epoch > epoch:
            del self.awaiting[env.sender]  # a new incarnation of it: fresh data
            return False
        self._stats["dropped_before_replay"] += 1
        if since is None:
            self.awaiting[env.sender] = (epoch, now)
        return True

    def eos_early(self, env: Envelope) -> bool:
        """Drop `env`, an Eos ahead of its predecessor's replay marker? It follows records we drop
        until that replay: taken now, it would overtake them. The move asks again
        (agent.instance.moves, MOVE_RESEND), and the new Eos comes behind the replay."""
        if (env.sender in self.awaiting and isinstance(env.body, dict) and env.body.get("type") == "eos"):
            self._stats["eos_before_replay"] += 1
            return True
        return False

    def unanswered(self, now: float) -> List[str]:
        """The predecessors alive for REPLAY_WAIT whose marker has not come (sorted)."""
        return sorted(s for s, (_, t) in self.awaiting.items() if t is not None and now - t >= REPLAY_WAIT)
