"""The way in of an envelope, from our inbox or from a chained predecessor: read and decoded
(agent.instance.intake; a source's ingest topic to the source), admitted or held
(agent.instance.admission), then delivered in its sender's numbering, once (INVARIANT 1:
agent.dataplane.channel): an ack taken by the outputs, a replay marker or what its replay brings
again dropped (agent.instance.replays), the rest queued for its turn (agent.instance.queues); the
replays a new incarnation asks of its predecessors; and a sender admitted only provisionally
forgotten.

Rules of this file: `Delivery` owns no state and holds no reference to the instance; it is handed
the parts an envelope goes through at construction, and per call the scaling driver (None before
the start), our epoch, the clocks and the instance's list of commands, which it extends in order
with what the driver appends to it meanwhile (a successor's restart first). No I/O, no clock.
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

    def received(self, ev: EnvelopeReceived, scaling: Any, epoch: int, wall: float, now: float,
                 out: List[Command]) -> None:
        """A message on one of our topics: an envelope in our inbox, or a source's ingest."""
        writer = self.intake.writer(ev.topic)
        if writer is None and self.intake.foreign(ev.topic):
            return  # our inbox on a node we no longer run on (counted)
        if writer is None:
            out += self.source.ingest(ev)
            return
        env = self.intake.decode(ev.payload, now)
        if env is None:
            return  # INVARIANT 5 (nothing dropped silently): counted, logged, skipped
        if self.admission.screen(env, ev.payload, writer, scaling, epoch, wall, now):
            self.accept(env, scaling, epoch, now, out)

    def handed(self, ev: EnvelopeHanded, scaling: Any, epoch: int, wall: float, now: float,
               out: List[Command]) -> None:
        """A chained predecessor's envelope (docs/runtime.md, "Chaining"): as `received` without
        the bytes. Written by our own node (same process); admitted by the same rules, so a
        sender our tables do not know is held or refused exactly as over MQTT."""
        env = ev.envelope
        if not isinstance(env, Envelope):
            raise LocalProtocolError(f"{self.me}: EnvelopeHanded without an Envelope: {env!r:.80}")
        if env.kind is Kind.DATA:
            self.stats["handed_in"] += 1
        if self.admission.screen(env, None, self.node, scaling, epoch, wall, now):
            self.accept(env, scaling, epoch, now, out)

    def release_held(self, scaling: Any, epoch: int, wall: float, now: float, out: List[Command]) -> None:
        """The held envelopes of senders the protocol has announced since, admitted now in each
        sender's order (`Admission.release`)."""
        self.admission.release(now, scaling, epoch, wall, self.intake.records,
                               lambda env: self.accept(env, scaling, epoch, now, out))

    def accept(self, env: Envelope, scaling: Any, epoch: int, now: float, out: List[Command]) -> None:
        """`env`, admitted: what it delivers in its sender's order taken (acks) or queued."""
        inbound = self.inbound
        before = inbound.stats.duplicates + inbound.stats.stale_epoch
        known = inbound.epoch_of(env.sender)
        succ = env.sender in self.outputs.links or env.sender in self.router.succs
        if env.epoch > (known if known is not None else 0) and succ:
            # The successor restarted: it may have lost what it held (agent.instance.outputs).
            out += self.outputs.successor_restarted(env.sender, now)
        if env.kind is Kind.ACK and tuple(env.body) == (0, 0) and scaling is not None:
            scaling.remind_departed(env.sender)  # a re-homed copy that forgot it left
        replays = self.replays
        replays.seen(env, now)
        # INVARIANT 1 (FIFO channel): envelopes are delivered in each sender's numbering, once.
        pred = scaling is not None and env.sender in scaling.core.preds  # it replays to us after a marker
        for e in inbound.receive(env, replays_to_us=pred):
            if e.kind is Kind.ACK:
                self._ack(e, scaling, epoch, now, out)
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

    def ask_replays(self, preds: Iterable[str]) -> List[Command]:
        """We are a new incarnation: each predecessor is told so by an ack of nothing, numbered in
        our new epoch, and replays what we had not acknowledged (agent.instance.outputs,
        `successor_restarted`); what it sent before its replay marker is dropped meanwhile."""
        self.replays.start(preds, self.inbound.position)
        out: List[Command] = []
        for pred in sorted(preds):
            out += self.outputs.send_envelope(pred, Kind.ACK, [0, 0])
        return out

    def _ack(self, env: Envelope, scaling: Any, epoch: int, now: float, out: List[Command]) -> None:
        """A successor's ack of our data up to its number, in our current epoch (agent.instance.outputs)."""
        self.stats["acks_in"] += 1
        acked_epoch, upto = env.body
        if scaling is not None and list(env.body) == [0, 0]:
            start = scaling.idle.on_idle_ping(env.sender, now)
            if start is not None:
                out += start
                return  # an idle copy asks for its Start
        if acked_epoch != epoch:
            self.stats["stale_acks"] += 1  # for a dead incarnation
            return
        self.outputs.on_ack(env.sender, upto, now)

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
