"""The way in of an envelope, from our inbox or from a chained predecessor: read and decoded
(agent.instance.intake; a source's ingest topic to the source), admitted or held
(agent.instance.admission), then delivered in its sender's numbering, once (INVARIANT 1:
agent.dataplane.channel): an ack taken by the outputs, a replay marker or what its replay brings
again dropped (agent.instance.replays), the rest queued for its turn (agent.instance.queues); the
replays a new incarnation asks of its predecessors; and a sender admitted only provisionally
forgotten.

Rules of this file: `Delivery` owns no state and holds no reference to the instance; it is handed
the parts an envelope goes through at construction, and per call the scaling driver (None before
the start), our epoch and the clocks; each call returns its commands in order, the driver's among
them where it was called (a successor's restart first). No I/O, no clock.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List

from agent.dataplane.channel import Inbound, is_replay_marker
from agent.dataplane.envelope import Envelope, Kind
from agent.dataplane.routing import Router
from agent.instance.admission import Admission
from agent.instance.commands import Command
from agent.instance.events import EnvelopeHanded, EnvelopeReceived
from agent.instance.intake import Intake
from agent.instance.load import Load
from agent.instance.outputs import Outputs
from agent.instance.queues import SenderQueues
from agent.instance.replays import ReplayWait
from agent.instance.silence import Silence
from agent.instance.source import Source
from agent.protocol.errors import LocalProtocolError

__all__ = ["Delivery"]

log = logging.getLogger("agent.instance.worker")


class Delivery:
    """The way in of instance `me` on node `node`."""

    def __init__(self, me: str, node: str, *, intake: Intake, source: Source, admission: Admission,
                 inbound: Inbound, outputs: Outputs, router: Router, replays: ReplayWait, load: Load,
                 queued: SenderQueues, silence: Silence, stats: Dict[str, int], ctx: Dict[str, Any]) -> None:
        self.me = me
        self.node = node
        self.intake = intake
        self.source = source
        self.admission = admission
        self.inbound = inbound
        self.outputs = outputs
        self.router = router
        self.replays = replays
        self.load = load
        self.queued = queued
        self.silence = silence
        self.stats = stats
        self.ctx = ctx

    def received(self, ev: EnvelopeReceived, scaling: Any, epoch: int, wall: float, now: float) -> List[Command]:
        """A message on one of our topics: an envelope in our inbox, or a source's ingest."""
        writer = self.intake.writer(ev.topic)
        if writer is None and self.intake.foreign(ev.topic):
            return []  # our inbox on a node we no longer run on (counted)
        if writer is None:
            return self.source.ingest(ev)
        env = self.intake.decode(ev.payload, now)
        if env is None:
            return []  # INVARIANT 5 (nothing dropped silently): counted, logged, skipped
        if self.admission.screen(env, ev.payload, writer, scaling, epoch, wall, now):
            return self.accept(env, scaling, epoch, now)
        return self._remind(scaling)

    def handed(self, ev: EnvelopeHanded, scaling: Any, epoch: int, wall: float, now: float) -> List[Command]:
        """A chained predecessor's envelope (docs/runtime.md, "Chaining"): as `received` without
        the bytes. Written by our own node (same process); admitted by the same rules, so a
        sender our tables do not know is held or refused exactly as over MQTT."""
        env = ev.envelope
        if not isinstance(env, Envelope):
            raise LocalProtocolError(f"{self.me}: EnvelopeHanded without an Envelope: {env!r:.80}")
        if env.kind is Kind.DATA:
            self.stats["handed_in"] += 1
        if self.admission.screen(env, None, self.node, scaling, epoch, wall, now):
            return self.accept(env, scaling, epoch, now)
        return self._remind(scaling)

    def release_held(self, scaling: Any, epoch: int, wall: float, now: float) -> List[Command]:
        """The held envelopes of senders the protocol has announced since, admitted now in each
        sender's order (`Admission.release`)."""
        out: List[Command] = []

        def take(env: Envelope) -> None:
            out.extend(self._remind(scaling))  # of what was refused before it
            out.extend(self.accept(env, scaling, epoch, now))

        self.admission.release(now, scaling, epoch, wall, self.intake.records, take)
        return out + self._remind(scaling)

    def _remind(self, scaling: Any) -> List[Command]:
        """The scaling driver reminds the senders of the empty acks the admission refused as
        unknown (`Admission.reminders`): a copy re-homed while leaving may not know it left."""
        out: List[Command] = []
        while self.admission.reminders:
            out += scaling.remind_departed(self.admission.reminders.pop(0))
        return out

    def accept(self, env: Envelope, scaling: Any, epoch: int, now: float) -> List[Command]:
        """`env`, admitted: what it delivers in its sender's order taken (acks) or queued."""
        out: List[Command] = []
        inbound = self.inbound
        before = inbound.stats.duplicates + inbound.stats.stale_epoch
        known = inbound.epoch_of(env.sender)
        succ = env.sender in self.outputs.links or env.sender in self.router.succs
        if env.epoch > (known if known is not None else 0) and succ:
            # The successor restarted: it may have lost what it held (agent.instance.outputs).
            out += self.outputs.successor_restarted(env.sender, now)
        if env.kind is Kind.ACK and tuple(env.body) == (0, 0) and scaling is not None:
            out += scaling.remind_departed(env.sender)  # a re-homed copy that forgot it left
        replays = self.replays
        replays.seen(env, now)
        # INVARIANT 1 (FIFO channel): envelopes are delivered in each sender's numbering, once.
        pred = scaling is not None and env.sender in scaling.core.preds  # it replays to us after a marker
        for e in inbound.receive(env, replays_to_us=pred):
            if e.kind is Kind.ACK:
                out += self._ack(e, scaling, epoch, now)
            else:
                if e.kind is Kind.DATA:
                    if is_replay_marker(e):  # its replay follows
                        replays.marker(e.sender)
                        continue
                    if replays and replays.drops(e, now):
                        continue  # its replay brings it again, in order
                    self.load.arrived(len(e.body))
                elif replays and replays.eos_early(e):
                    continue  # an Eos ahead of its predecessor's replay marker: sent again behind it
                self.queued.put(e)
        for sender in inbound.take_asks():  # a new epoch's first numbers missing: its marker, please
            self.stats["replays_asked_at_start"] += 1
            out += self.outputs.send_envelope(sender, Kind.ACK, [0, 0])
        dropped = inbound.stats.duplicates + inbound.stats.stale_epoch - before
        self.stats["duplicate_envelopes"] += dropped
        if dropped and env.kind is Kind.DATA and env.epoch < (inbound.epoch_of(env.sender) or 0):
            # Safe only because the sender's predecessors or source still hold what it carried
            # (acks are end to end); rare enough to say so once per occurrence.
            log.warning("data batch %d of %s's old epoch %d dropped (now epoch %s)", env.seq, env.sender,
                        env.epoch, inbound.epoch_of(env.sender), extra=self.ctx)
        return out

    def ask_replays(self, preds: Iterable[str]) -> List[Command]:
        """We are a new incarnation: each predecessor is told so by an ack of nothing, numbered in
        our new epoch, and replays what we had not acknowledged (agent.instance.outputs,
        `successor_restarted`); what it sent before its replay marker is dropped meanwhile."""
        self.replays.start(preds, self.inbound.position)
        out: List[Command] = []
        for pred in sorted(preds):
            out += self.outputs.send_envelope(pred, Kind.ACK, [0, 0])
        return out

    def _ack(self, env: Envelope, scaling: Any, epoch: int, now: float) -> List[Command]:
        """A successor's ack of our data up to its number, in our current epoch (agent.instance.outputs)."""
        self.stats["acks_in"] += 1
        acked_epoch, upto = env.body
        if scaling is not None and list(env.body) == [0, 0]:
            start = scaling.idle.on_idle_ping(env.sender, now)
            if start is not None:
                return start  # an idle copy asks for its Start
        if acked_epoch != epoch:
            self.stats["stale_acks"] += 1  # for a dead incarnation
            return []
        self.outputs.on_ack(env.sender, upto, now)
        return []

    def forget(self, sender: str) -> bool:
        """Drop every per-sender entry of an instance admitted only provisionally (an unanswered
        probe): channel position, numbering, an empty queue. False: something of it still waits
        to be handled, and all is kept."""
        if not self.queued.forget(sender):
            return False
        self.inbound.forget(sender)
        self.outputs.outbound.forget(sender)
        self.silence.forget(sender)
        return True
