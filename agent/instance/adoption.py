"""Idle copies of the scaling driver (agent.instance.driver): the idle ping of a copy waiting for
its Start, Start sent again to a copy we started, and the probe, echo and adoption bookkeeping of
a copy an earlier incarnation of ours created (docs/reliability.md, agent.instance.recovery).

Rules of this file: sans-IO, part of the `Instance` (agent.instance.core) through its driver. The
part owns its state (the copies we sent Start, the copies to probe, the probes waiting for their
echo, the echoed copies waiting for adoption, the idle ping's timer) and reads the scaling core
(agent.protocol.scaling) it is handed. It holds no instance: it numbers its messages on the
instance's links (agent.instance.outputs, a sibling part it is handed) and returns them as
commands; it counts in the driver's counters. It starts no round: the driver adopts an echoed copy (`ScalingCore.adopt`)
when it is free to start one, and asks `pending` before it scales in.

Why apart from the driver: the ping, probe and echo answer messages outside the paper's protocol
and change no round state; they decide whom the driver adopts, never when.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from agent.instance.commands import Command

from agent.dataplane.envelope import Envelope, Kind
from agent.dataplane.inbound import LogLimiter
from agent.instance.groups import START_FIELD
from agent.protocol.messages import Start
from agent.protocol.scaling import InstanceState

__all__ = ["IdleCopies", "with_groups", "PROBE", "PROBE_ECHO", "IDLE_PING", "IDLE_PING_MAX", "MAX_PROBES",
           "PROBE_TTL", "LATE_COPY"]

log = logging.getLogger("agent.instance.worker")

# A new copy still idle this long after it started asks its creator for Start again (doubling):
# Start is the one protocol message nobody acks, so a broker that lost it would leave the copy
# idle for ever with batches routed to it. The same ping reaches a creator re-homed after its node
# died in the middle of the round: that one adopts the copy (see `IdleCopies.on_idle_ping`).
IDLE_PING = 10.0
IDLE_PING_MAX = 40.0
PROBE, PROBE_ECHO = "probe", "probe_echo"  # see IdleCopies.on_probe
# Idle pings ([0, 0] acks) from copies we do not know that we probe at once (`on_idle_ping`),
# and how long a probe waits for its echo before the channel it opened is forgotten.
MAX_PROBES = 8
PROBE_TTL = 60.0
# A re-homed creator's policy decides no scale-in for this long after its start: a copy its dead
# incarnation asked for just before its node was lost may start only after the re-home plan was
# made (an agent has the spawn's 30 s, agent.node.spawns RPC_TIMEOUT) and pings us IDLE_PING s
# later. Left before that ping, we would leave the copy idle for ever, nobody to start or adopt it.
LATE_COPY = 40.0


StartField = Callable[[str], Optional[Dict[str, Any]]]  # agent.instance.group_side.GroupSide.start_field


def with_groups(start_field: StartField, body: Dict[str, Any], copy: str) -> Dict[str, Any]:
    """A Start's JSON with our key-group table or share (agent.instance.groups), if any."""
    extra = start_field(copy)
    if extra is not None:
        body[START_FIELD] = extra
    return body


class IdleCopies:
    """The copies of ours that may wait idle for a Start, seen from both ends: as a copy, the
    ping to our creator; as a creator, Start again, and the probe and echo of copies an earlier
    incarnation created."""

    def __init__(self, spec: Any, ctx: Dict[str, Any], stats: Dict[str, int], outputs: Any, router: Any,
                 start_field: StartField, core: Any, counts: Dict[str, int], errors_log: LogLimiter,
                 rehomed: bool, now: float) -> None:
        self.ctx = ctx  # the instance's log context
        self.stats = stats  # the instance's counters (protocol_errors)
        self.outputs = outputs  # the instance's links (agent.instance.outputs): our messages' numbers
        self.router = router  # the instance's routes (agent.dataplane.routing): who is a successor
        self.start_field = start_field
        self.core = core  # the driver's scaling core (read here, never driven)
        self.counts = counts  # the driver's counters
        self._errors_log = errors_log  # the driver's: once per sender per minute, bounded
        self.started: Deque[str] = deque(maxlen=256)  # copies this instance sent Start (see start_again)
        # A copy re-homed idle (agent.node.rehome) asks its creator at once: the creator may be a
        # new incarnation too, that knows nothing of it.
        self._next_ping = now + (0.0 if rehomed else IDLE_PING)
        self._idle_pings = 0
        self.late_until = now + LATE_COPY if rehomed and spec.active else float("-inf")  # (LATE_COPY)
        # Re-homed: the idle copies our dead incarnation created (plan_rehome, `idle_copies`),
        # probed at our first tick and adopted on their echo before we may scale in.
        # Names from other nodes' hosted records: only ones that can be a topic segment.
        self.expected: List[str] = [
            c for c in (spec.extra.get("idle_copies") or []) if isinstance(c, str) and not set(c) & set("/+#\0")
        ][:MAX_PROBES] if rehomed and spec.active else []
        # copy -> (number of the probe we sent it, when: unanswered probes expire after PROBE_TTL)
        self.probes: Dict[str, Tuple[int, float]] = {}  # (on_idle_ping)
        self._probe_seq = 0
        self.orphans: Deque[str] = deque()  # idle copies nobody will start: the driver adopts them

    @property
    def pending(self) -> bool:
        """A copy that may be ours waits for its Start: one plan_rehome told us of not probed
        yet, a probe waiting for its echo, an echoed copy not adopted yet. We do not scale in
        meanwhile: left, we would leave an idle copy nobody starts while neighbours route
        records to it (CHANGELOG.md, "An idle copy re-homed together with its creator came
        back active"). Only scale-ins wait, at most PROBE_TTL per probe (a probe of an invented
        name costs a delayed scale-in, never a lost record)."""
        return bool(self.expected or self.probes or self.orphans)

    def knows(self, sender: str) -> bool:
        """Is `sender` a copy we started, probe or are to adopt?"""
        return sender in self.started or sender in self.probes or sender in self.orphans

    def next_orphan(self) -> Optional[str]:
        """The echoed copy to adopt next (the driver adopts it), if any."""
        return self.orphans.popleft() if self.orphans else None

    # ---- as a copy ------------------------------------------------------------------------------

    def ping_if_idle(self, now: float) -> List[Command]:
        """An idle copy (created, not started) asks its creator for Start again: an ack of
        nothing ([0, 0]) after IDLE_PING s, then at doubling intervals up to IDLE_PING_MAX."""

        if self.core.state is not InstanceState.IDLE or not self.core.creator or now < self._next_ping:
            return []
        self._next_ping = now + min(IDLE_PING * 2 ** self._idle_pings, IDLE_PING_MAX)
        self._idle_pings += 1
        self.counts["start_requests"] += 1
        log.warning("still idle after creation: asking %s for Start again", self.core.creator, extra=self.ctx)
        return self.outputs.send_envelope(self.core.creator, Kind.ACK, [0, 0])

    # ---- as a creator ---------------------------------------------------------------------------

    def on_idle_ping(self, sender: str, now: float) -> Optional[List[Command]]:
        """An ack of nothing ([0, 0]) from `sender`: if it was a copy's idle ping for us, what we
        send for it (maybe nothing); None if it was not.

        From a copy we started: its Start was lost, send it again. From a copy of our current
        round: that round will start it. From a neighbour: a new incarnation of it asking for
        replays, not ours to answer (False). From any other instance: it may be a copy created by
        an earlier incarnation of ours, lost with its node (re-homing) in the middle of the
        round; nobody else may start it and records may already be routed to it, so we probe it
        and adopt it if it echoes the probe (`on_probe`)."""

        core = self.core
        if sender in self.started:
            return self.start_again(sender)
        if (sender in core.succs or sender in core.preds or sender in core.new_siblings
                or sender in self.orphans or core.state is InstanceState.IDLE or core.terminated):
            return [] if sender in core.new_siblings else None
        if sender in self.probes and now - self.probes[sender][1] < IDLE_PING:
            return []  # our probe is on its way (a new one would void the echo of this one)
        if not self.may_probe(sender):
            # Not named like a copy of ours: an instance of another operator we have a link
            # with (a re-homed idle copy asks its predecessors for replays), never ours to start.
            return None
        return self._probe(sender, now)

    def start_again(self, copy: str) -> List[Command]:
        """Send Start again to a copy we started that says it is still idle (its Start was lost
        with the broker's state): our current tables, as Algorithm 6 would send them now. A copy
        that is active by then rejects it as unexpected and nothing changes."""

        msg = Start(self.core.instance_id, self.core.stage, *self.core.routes())
        out = self.outputs.send_envelope(copy, Kind.PROTO, with_groups(self.start_field, msg.to_dict(), copy))
        self.counts["protocol_resent"] += 1
        log.warning("%s is still idle: sent Start again", copy, extra=self.ctx)
        return out

    def may_probe(self, sender: str) -> bool:
        """May an idle ping from `sender`, an instance we do not know, be a copy an earlier
        incarnation of ours created (`on_idle_ping`)? Only if it is named like our copies
        (`ScalingCore._new_id`: "<operator>-<digest>"), we are active, and fewer than MAX_PROBES
        probes wait for their echo: invented names cost at most MAX_PROBES channels, each
        forgotten after PROBE_TTL (`expire_probes`)."""

        return (self.core.state is InstanceState.ACTIVE and len(self.probes) < MAX_PROBES
                and len(sender) <= 128 and sender.startswith(self.core.operator + "-"))

    def probe_expected(self, now: float) -> List[Command]:
        """Probe the idle copies our dead incarnation created (plan_rehome's `idle_copies`)
        without waiting for their idle ping; each is adopted on its echo (`on_probe`)."""
        out: List[Command] = []
        if not self.expected or self.core.state is not InstanceState.ACTIVE:
            return out
        for copy in self.expected:
            if copy not in self.probes and copy not in self.orphans and self.may_probe(copy):
                out += self._probe(copy, now)
        self.expected = []
        return out

    def _probe(self, sender: str, now: float) -> List[Command]:
        self._probe_seq += 1
        self.probes[sender] = (self._probe_seq, now)
        self.counts["probes"] += 1
        log.warning("%s is idle and not a copy of this incarnation: probing it", sender, extra=self.ctx)
        return self.outputs.send_envelope(sender, Kind.PROTO,
                                          {"type": PROBE, "sender": self.core.instance_id, "n": self._probe_seq})

    def on_probe(self, env: Envelope, now: float) -> List[Command]:
        """A creator's probe to a copy, or the copy's echo of it (both outside the paper's cost).

        The copy echoes only while idle and only to its creator. The echo leaves the copy after
        every message an earlier incarnation of the creator sent it (one FIFO channel; a late one
        of an older epoch is dropped by the receive path), so no Start of that incarnation can
        still activate it, and an idle copy never leaves: adopting it cannot bring back an
        instance that has left its neighbours' tables."""

        body = env.body
        n = body.get("n")
        if type(n) is not int or n < 1 or body.get("sender") != env.sender:
            self.stats["protocol_errors"] += 1
            if self._errors_log.allow(env.sender, now):
                log.warning("bad %s from %s ignored", body.get("type"), env.sender, extra=self.ctx)
            return []
        core = self.core
        if body["type"] == PROBE:
            if core.state is InstanceState.IDLE and env.sender == core.creator:
                return self.outputs.send_envelope(env.sender, Kind.PROTO,
                                                  {"type": PROBE_ECHO, "sender": core.instance_id, "n": n})
        elif env.sender in self.probes and self.probes[env.sender][0] == n:
            del self.probes[env.sender]
            if env.sender not in self.started and env.sender not in self.orphans:
                self.orphans.append(env.sender)
        return []

    def expire_probes(self, now: float, knows: Callable[[str], bool]) -> List[str]:
        """Probes unanswered for PROBE_TTL: the instance was no copy of ours (or is gone). The
        copies whose channel and our numbering to it go (the caller forgets them), unless
        something else names it (`knows`: the driver's tables, rounds and round memory)."""
        gone: List[str] = []
        for copy, (_, at) in list(self.probes.items()):
            if now - at < PROBE_TTL:
                continue
            del self.probes[copy]
            if not knows(copy) and copy not in self.outputs.links and copy not in self.router.succs:
                gone.append(copy)
        return gone
