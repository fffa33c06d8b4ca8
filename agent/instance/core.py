"""One operator instance as a sans-IO state machine: `Instance.handle(event, now) -> [Command]`.

Rules of this file: no I/O, no sockets, no files, no clock (`now` comes with every event, the
wall time with `Started`/`Restarted`/`Tick`), no global random, no import from agent.mqtt,
agent.node or subprocess. The worker process (agent.instance.worker) is the shell: it turns paho
callbacks, control lines and its loop's turns into events (agent.instance.events) and performs
the commands (agent.instance.commands) in order. The interleaving checker
(foglab.sim.instance_check) drives the same class through a model of the broker.

The parts it routes to each have one job, own their state and hold no reference to the
instance (each with its job: docs/runtime.md, "Part 1"). The scaling driver, the key groups' side
and the group moves are handed the parts they act through and our list of commands
(agent.instance.driver_parts, agent.instance.group_side, agent.instance.moves_parts).
What stays here: building the parts, routing each event and each step of a loop turn to them, a
start and a new incarnation, a stop and the exit, what is persisted (docs/runtime.md, "Instance").

Lifecycle (`Phase`, the table `ACCEPTS` of agent.instance.lifecycle): NEW -(Started |
Restarted)-> RUNNING -(stop, eof, or Terminate from the protocol)-> STOPPING -(drained, or drain
timeout, or Abort)-> EXITED. An event the table does not list for the current phase raises
`LocalProtocolError` naming the phase: the shell broke the contract (a Tick before Started,
anything but publish feedback after Exit). Bad input from the bus is never an error here: it is
counted, logged, skipped.

The order of work in one loop turn is the table `Instance._TURN` (read top-down); the shell
delivers every transport event and control line first, then one Tick.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Deque, Dict, FrozenSet, List, Optional, Tuple, Type

from agent.config import PipelineConfig
from agent.dataplane.channel import Inbound
from agent.dataplane.envelope import Envelope, Kind
from agent.dataplane.flow import AckTracker
from agent.dataplane.routing import Outbox, Router
from agent.dataplane.sticky import needed
from agent.instance.commands import Command, Emit, Exit
from agent.instance.controls import ControlLines
from agent.instance.counters import new_counters
from agent.instance.cadence import Cadence
from agent.instance.clock import Clock
from agent.instance.delivery import Delivery
from agent.instance.driver import ScalingDriver
from agent.instance.driver_parts import DriverParts
from agent.instance import groups as keygroup_table
from agent.instance import moves as group_moves
from agent.instance.group_side import GroupSide
from agent.instance.moves_parts import MovesParts
from agent.instance.events import (
    Abort, Control, EnvelopeHanded, EnvelopeReceived, Event, PubAcked, PublishAccepted, PublishRefused, Restarted,
    SessionLost, Spawned, Started, Tick,
)
from agent.instance.admission import Admission
from agent.instance.heartbeat import HeartbeatStats
from agent.instance.hosts import Hosts
from agent.instance.incarnation import Incarnation
from agent.instance.intake import Intake, records_decoding
from agent.instance.keyed_state import keyed_state_for
from agent.instance.lifecycle import ACCEPTS as _ACCEPTS  # noqa: F401 (the tests read the table here)
from agent.instance.lifecycle import (
    EXIT_BAD_SPEC, EXIT_BROKER, EXIT_CRASH, EXIT_DRAIN_TIMEOUT, EXIT_OK, Lifecycle, Phase,
)
from agent.instance.load import Load, no_clock
from agent.instance.marks import Marks
from agent.instance.outputs import Outputs
from agent.instance.pace import Pace
from agent.instance.pending import PendingInputs
from agent.instance.processing import Processing
from agent.instance.queues import SenderQueues
from agent.instance.replays import REPLAY_WAIT, ReplayWait
from agent.instance.sink import SinkSide
from agent.instance.silence import GAP_TIMEOUT, SILENCE_CHECK, Silence  # noqa: F401 (SILENCE_CHECK: the tests')
from agent.instance.source import Source
from agent.instance.spec import InstanceSpec
from agent.operators.builtin import SinkOperator

__all__ = ["Instance", "Phase", "EXIT_OK", "EXIT_CRASH", "EXIT_BAD_SPEC", "EXIT_BROKER", "EXIT_DRAIN_TIMEOUT"]

log = logging.getLogger("agent.instance.worker")

MAX_POLL = 0.05  # longest wait the instance asks for (the shell sees control lines within this)


class Instance:
    """One operator instance: channels, flow control and acks, the replay buffer, the scaling
    driver and the lifecycle. Built by the shell from what it loaded (spec, pipeline, operator).
    `faults`: those the instance checker built this class with (foglab.sim.instance_faults); none
    is read here. `local`: the instances hosted by the same process (a chain, docs/runtime.md
    "Chaining"): envelopes to them are `Handoff`s."""

    # INVARIANT 8: a forwarding instance remembers where each record went where it must (False
    # only in the checker's seeded fault `route_afresh`).
    remembers_routes = True
    # Watermarks that flow (docs/operators.md): a keyed instance fires by the least mark over its
    # inputs, not by its own largest event time, which a record that took another path or waited
    # for its group's move may be behind (False only in the checker's fault `marks_own_max`).
    marks_flow = True
    # Parts built from a class attribute, so that the instance checker can install one with a
    # seeded fault (foglab.sim.instance_faults); outside it, always the product's own class.
    marks_class: Type[Marks] = Marks
    admission_class: Type[Admission] = Admission
    moves_class: Type[group_moves.GroupMoves] = group_moves.GroupMoves
    driver_class: Type[ScalingDriver] = ScalingDriver
    group_side_class: Type[GroupSide] = GroupSide
    replays_class: Type[ReplayWait] = ReplayWait
    outputs_class: Type[Outputs] = Outputs

    def __init__(self, spec: InstanceSpec, pipeline: PipelineConfig, operator: Any,
                 faults: FrozenSet[str] = frozenset(), perf: Callable[[], float] = no_clock,
                 cpu: Callable[[], float] = no_clock, local: FrozenSet[str] = frozenset(),
                 next_keyed: bool = False) -> None:
        self.spec = spec
        self.pipeline = pipeline
        self.op = pipeline.operator(spec.operator)
        self.operator = operator
        self.faults = frozenset(faults)
        # Co-hosted instances: fixed for the life of the process (the chain never changes its
        # members), so every envelope to one of them goes in memory, never some over MQTT.
        local = frozenset(local) - {spec.instance}
        # What the scaling decision reads of our load (agent.instance.load, docs/measurement.md):
        # the shell passes time.perf_counter and time.process_time, the checker nothing.
        self.load = Load(perf, cpu)
        self.stage = pipeline.index(spec.operator)
        kind = self.op.kind
        self.ctx = {"instance": spec.instance, "operator": spec.operator, "node": spec.node}
        # Per-node inboxes (docs/security.md, "Who may read an inbox"): agent.instance.intake, .outputs.
        per_node = bool(spec.extra.get("inbox_per_node"))
        self.hosts = Hosts()
        # Its phase, a stop and its drain, the exit decided (agent.instance.lifecycle).
        self.life = Lifecycle(spec.instance)
        self.clock = Clock()  # the time of the event being handled (agent.instance.clock)
        # The commands of that event: one list for its life, the parts' returns put in it in order.
        self._out: List[Command] = []
        self.inbound = Inbound()
        is_source = kind == "source"
        # A source's numbering and pacing (agent.instance.source); every capability off for the others.
        self.source = Source(spec.instance, operator if is_source else None, self.ctx)
        is_sink = kind == "sink" or isinstance(operator, SinkOperator)
        # The emulated service time per record and until when it keeps us busy (agent.instance.pace).
        self.pace = Pace(self.op.service_time_ms / 1000.0)
        # Keyed stateful operator (agent.instance.keyed_state): state saved with its input position,
        # acked upstream once a standby copy holds it where the agent keeps one.
        self.keyed = keyed_state_for(operator, pipeline, self.stage, spec.extra.get("replicate") is True)
        # Its key groups and their moves (agent.instance.moves): a deployed instance holds every
        # group (deploy starts one keeper per operator), a copy none until its Start names its share.
        self.moves: Optional[group_moves.GroupMoves] = None
        if self.keyed is not None:
            self.moves = self.moves_class(spec.instance, self.keyed, range(self.keyed.groups) if spec.active else ())
        nxt = pipeline.operators[self.stage + 1] if self.stage + 1 < len(pipeline.operators) else None
        # `next_keyed` (the shell resolves the next operator's function): its key groups move with
        # their state, so we route by its group -> owner table (agent.instance.groups), dealt at
        # deploy; a copy gets its creator's with its Start.
        self.group_routing = keygroup_table.GroupRouting(bool(next_keyed) and nxt is not None
                                                         and self.op.key is not None)
        key_groups = nxt.key_groups if nxt is not None else 128
        table = keygroup_table.initial_table(spec.succs, key_groups) if self.group_routing.on and spec.active else None
        self.router = Router(spec.succs, key=self.op.key, groups=key_groups, table=table)
        self.outbox = Outbox(self.router, self.op.batch_size, self.op.linger_ms / 1000.0)
        self.tracker = AckTracker()
        high_water = 4 * self.op.batch_size  # records the outbox may hold before we stop reading (O50)
        # Acks go out every half of the predecessors' window (their operator's setting): the
        # sender still has the other half of its credit while the ack travels (docs/runtime.md).
        pred_window = pipeline.operators[self.stage - 1].max_inflight_batches if self.stage > 0 else 8
        self.scaling: Optional[ScalingDriver] = None

        self.stats: Dict[str, int] = new_counters()  # what the heartbeat reports (agent.instance.counters)
        # Per sender, what it sent us in its order and we have not handled yet (agent.instance.queues).
        self.queued = SenderQueues(self.stats, keyed=self.moves is not None)
        # What we read from our inbox before the admission (agent.instance.intake).
        self.intake = Intake(spec.cluster, spec.node, spec.instance, per_node,
                             records_decoding(operator, is_sink, is_source, self.keyed is not None,
                                              self.router.key is not None), self.stats, self.ctx)
        # What we send (agent.instance.outputs): links, numbering, tracked publishes, acks upstream.
        # INVARIANT 8 (a record sent again goes where it went): a forwarding instance remembers
        # each record's successor where the next operator's instance count can change
        # (agent.dataplane.sticky.needed).
        sticky = (not is_sink and nxt is not None and self.remembers_routes
                  and needed(self.op.key, pipeline.scaling_for(nxt.name).max_instances))
        self.outputs = self.outputs_class(spec.instance, spec.cluster, spec.node, self.router, self.outbox,
                                          self.tracker, self.hosts, self.stats, self.ctx,
                                          window=self.op.max_inflight_batches, ack_every=max(1, pred_window // 2),
                                          per_node=per_node, local=local, sticky=sticky)
        # What we let in (agent.instance.admission): how far ahead an honest sender's numbers can
        # run is set by the larger window on our channels; the node in an inbox topic must host the
        # envelope's sender when the agent says so (docs/security.md, "Data channels").
        ops = pipeline.operators
        self.admission = self.admission_class(
            spec.instance, spec.operator, spec.pipeline, [ops[self.stage - 1].name] if self.stage > 0 else [],
            [nxt.name] if nxt is not None else [], spec.preds, spec.succs,
            window=max(pred_window, self.op.max_inflight_batches),
            hold_extra=key_groups if self.group_routing.on else 0,
            check_node=bool(spec.extra.get("check_sender_node")), keyed=self.moves is not None, hosts=self.hosts,
            inbound=self.inbound, links=self.outputs.links, router=self.router, stats=self.stats, ctx=self.ctx)
        # A sink's recording, and a deferred sink's inputs not recorded yet (agent.instance.sink).
        self.sink = SinkSide(operator, self.outputs, self.stats, self.ctx, spec.cluster, spec.pipeline)
        # Watermarks that flow with the batches (agent.instance.marks; docs/operators.md,
        # "Watermarks that flow"): on when the source has [operator.watermark], never at a sink.
        # A keyed instance then fires by the least mark over its inputs (`marks_flow`).
        wm_conf = getattr(pipeline.operators[0], "watermark", None)
        self.marks: Optional[Marks] = None
        if wm_conf is not None and not is_sink:
            self.marks = self.marks_class(wm_conf, is_source, self.keyed, self.tracker, self.outputs,
                                          self.stats)
            if self.keyed is not None and self.marks_flow:
                self.keyed.flowing = True
        # When we write our state and send a heartbeat (agent.instance.cadence).
        self.cadence = Cadence(spec.heartbeat_period)
        # Our epoch, and the state file our next incarnation reads back (agent.instance.incarnation).
        self.incarnation = Incarnation(self.inbound, self.outputs, self.router, self.moves, self.cadence)
        # The silence checks' clock and the holes in our senders' numbering (agent.instance.silence).
        self.silence = Silence()
        # A new incarnation of ours: the predecessors whose data before their replay marker we
        # drop (agent.instance.replays, docs/reliability.md "Replays in order").
        self.replays = self.replays_class(self.stats)
        # The way in: read, admitted, delivered in order, acks taken, the rest queued (agent.instance.delivery).
        self.delivery = Delivery(spec.instance, spec.node, intake=self.intake, source=self.source,
                                 admission=self.admission, inbound=self.inbound, outputs=self.outputs,
                                 router=self.router, replays=self.replays, load=self.load, queued=self.queued,
                                 silence=self.silence, stats=self.stats, ctx=self.ctx)
        # Our key groups at our edges: hand-over messages in, a Start's, a restart's (agent.instance.group_side).
        self.group_side = self.group_side_class(
            spec, self.ctx, self.stats, self.clock, routing=self.group_routing, router=self.router,
            outbox=self.outbox, tracker=self.tracker, outputs=self.outputs, incarnation=self.incarnation,
            cadence=self.cadence, keyed=self.keyed, moves=self.moves, refusals=self.admission.refusals)
        # The agent's control lines, but a stop (agent.instance.controls).
        self.controls = ControlLines(self.pace, operator if is_source else None, self.hosts, self.outputs,
                                     self.keyed, self.moves, self.ctx)
        # The inputs not to be acked upstream yet (agent.instance.pending).
        self.pending = PendingInputs(self.outputs, self.sink, self.keyed, self.moves)
        if self.moves is not None:  # built around the moves, handed to them now (agent.instance.moves_parts)
            self.moves.bind(MovesParts(clock=self.clock, tracker=self.tracker, outputs=self.outputs, stats=self.stats,
                                       ctx=self.ctx, refusals=self.admission.refusals, cadence=self.cadence,
                                       incarnation=self.incarnation, pending=self.pending))
        # A batch through the operator, and the back pressure that lets it (agent.instance.processing).
        self.processing = Processing(spec.instance, operator, source=self.source, is_source=is_source,
                                     is_sink=is_sink, keyed=self.keyed, moves=self.moves, marks=self.marks,
                                     router=self.router, outbox=self.outbox, high_water=high_water,
                                     outputs=self.outputs, tracker=self.tracker, load=self.load, pace=self.pace,
                                     sink=self.sink, stats=self.stats, ctx=self.ctx)
        # What our heartbeat reports, read from the parts (agent.instance.heartbeat).
        self.heartbeat = HeartbeatStats(self.stats, spec.instance, spec.operator, operator=operator, load=self.load,
                                        router=self.router, outbox=self.outbox, outputs=self.outputs,
                                        queued=self.queued, inbound=self.inbound, admission=self.admission,
                                        pace=self.pace, processing=self.processing, keyed=self.keyed,
                                        moves=self.moves, group_routing=self.group_routing)

    # ---- the one entry point ------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> List[Command]:
        """Apply one event at monotonic time `now`; the commands to perform, in order."""
        self.life.check(event)
        self.clock.now = now
        self._out.clear()
        self._HANDLERS[type(event)](self, event)
        due = self.life.due()
        if due is not None:
            self._finish(*due)
        out = self._out[:]
        self._out.clear()
        return out

    @property
    def now(self) -> float:
        """The time of the event being handled (`handle`'s `now`)."""
        return self.clock.now

    @property
    def is_source(self) -> bool:
        return self.processing.is_source

    @property
    def is_sink(self) -> bool:
        return self.processing.is_sink

    @property
    def reads_records(self) -> bool:
        """False: it never reads a record (a sink of ids, a map of `identity`): a chained
        predecessor may hand it records it has not rebuilt (agent.dataplane.envelope.Row)."""
        return self.intake.records is True

    @property
    def queues(self) -> Dict[str, Deque[Envelope]]:
        """Per sender, its envelopes not handled yet (agent.instance.queues)."""
        return self.queued.by_sender

    @property
    def next_keyed(self) -> bool:
        """We route by the next (keyed) operator's group table (agent.instance.groups)."""
        return self.group_routing.on

    @property
    def inbox(self) -> str:
        """The inbox topic filter the shell subscribes to."""
        return self.intake.topic

    @property
    def phase(self) -> Phase:
        return self.life.phase

    @property
    def stopping(self) -> bool:
        """Stopping: draining before the exit (a stop, or terminated by the protocol)."""
        return self.life.stopping

    @property
    def exited(self) -> bool:
        return self.life.phase is Phase.EXITED

    @property
    def epoch(self) -> int:
        """The epoch our channels are numbered in (agent.instance.incarnation)."""
        return self.incarnation.epoch

    def wall(self) -> float:
        """The wall clock, as of the last event that carried it (timestamps, epoch plausibility)."""
        return self.clock.wall()

    # ---- commands (the only way out) ----------------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> None:
        self._out.append(Emit(event, fields))

    # ---- start -----------------------------------------------------------------------------------------

    def _on_started(self, ev: Started) -> None:
        self._begin(ev.wall, False, {}, None)

    def _on_restarted(self, ev: Restarted) -> None:
        self.outputs.restore_routes(ev.routes, self.now)
        self._begin(ev.wall, True, ev.state, ev.source_position, ev.ingest_log)
        self._out += self.group_side.restarted(ev, self.scaling)

    def _begin(self, wall: float, restart: bool, saved: Dict[str, Any],
               source_position: Optional[Dict[str, Any]], ingest_log: Optional[List[Any]] = None) -> None:
        """Subscribed (the shell says so only after the broker's SUBACK, INVARIANT 2): take our
        epoch, restore what a restart needs, and only then say "ready"."""
        now = self.now
        self.clock.offset = wall - now
        self.life.run()
        self.incarnation.begin(saved, restart, self.spec.extra.get("min_epoch", 0))  # our epoch, our channels
        self.silence.checked(now)
        self.load.begin(now)
        self.source.started_at = wall
        self.scaling = self.driver_class(self._driver_parts(), saved, restart)
        if self.moves is not None:
            self.moves.started(self.scaling)
        self.load.set_capacity(self.scaling.params.capacity)
        if restart and self.scaling.core.forwards_data:
            # The restored tables, not the spec's initial ones: since its creation the instance
            # may have been activated (a copy starts with none) or seen neighbours come and go.
            self.router.set_succs(self.scaling.core.routes()[0])
            self.group_routing.restore(self.router, saved, self.ctx, self.spec.extra.get("succ_groups"))
        self.persist(force=True)
        if restart:  # the predecessors replay what we had not acknowledged (agent.instance.delivery)
            self._out += self.delivery.ask_replays(self.scaling.core.preds)
            self._out += self.scaling.resync(now)
        if self.is_source:
            self.source.start(restart, source_position, ingest_log, self.marks, now, wall, self.wall())
        self.emit("ready")
        if self.scaling.terminated:
            # Restarted (an agent restart re-adopting it, say) after the protocol had already
            # terminated it, before its final exit: gone from every table, so gone for good.
            self.life.exit = (EXIT_OK, "restarted after its termination: gone for good", True)
        elif self.scaling.outputs:
            self._out += self.scaling.run_outputs(now)  # a restarted round: perform what was still queued

    def _driver_parts(self) -> DriverParts:
        """What the scaling driver acts through (agent.instance.driver_parts): our parts, not us."""
        return DriverParts(
            spec=self.spec, pipeline=self.pipeline, stage=self.stage, epoch=self.epoch, is_source=self.is_source,
            ctx=self.ctx, stats=self.stats, clock=self.clock, life=self.life, load=self.load, outputs=self.outputs,
            router=self.router, incarnation=self.incarnation, cadence=self.cadence, delivery=self.delivery,
            group_side=self.group_side, marks=self.marks, moves=self.moves,
            flush=self.flush, drained=self.drained)

    # ---- one loop turn ---------------------------------------------------------------------------------

    def _on_tick(self, ev: Tick) -> None:
        """One loop turn: the steps of `_TURN`, in its order."""
        now = self.now
        self.clock.offset = ev.wall - now
        for _name, step in self._TURN:
            step(self, now)

    # The steps of a turn, each skipped when it has nothing to do (read top-down: the order is the
    # table's). Protocol work first (queued round outputs), then new data (a source's poll) and the
    # queues; what that made is saved, sent and acked before the periodic work (the round's
    # period, heartbeat, silence checks, persistence) and, last, whether a stop has drained.

    def _turn_round_outputs(self, now: float) -> None:
        if self.scaling is not None:
            self._out += self.scaling.run_outputs(now)

    def _turn_produce(self, now: float) -> None:
        if self.is_source:
            self._produce(now)

    def _turn_process(self, now: float) -> None:
        self._process(now)

    def _turn_moves(self, now: float) -> None:
        if self.moves is not None:
            self._out += self.moves.take_in_turn()  # a bounded share of the state chunks received
            self.moves.hand_out_turn()  # a bounded share of the groups whose state is final
            self._out += self.moves.flush()  # the turn's hand-over writes, then its messages (agent.instance.moves)

    def _turn_save_keyed(self, now: float) -> None:
        if self.keyed is not None and self.keyed.dirty:
            self._out.append(self.pending.save_keyed())

    def _turn_release_held(self, now: float) -> None:
        if self.admission.hold:
            self._out += self.delivery.release_held(self.scaling, self.epoch, self.wall(), now)

    def _turn_resend_moved(self, now: float) -> None:
        if self.outputs.moved:
            self._out += self.outputs.resend_moved(now)

    def _turn_settle_sink(self, now: float) -> None:
        if self.is_sink:
            self._out += self.sink.settle(self.wall())

    def _turn_flush(self, now: float) -> None:
        self._out += self.flush(now)

    def _turn_send_mark(self, now: float) -> None:
        if self.marks is not None:
            self._out += self.outputs.send_mark(now, self.marks.out_mark(now, self.pending.lowest()))

    def _turn_settle_source(self, now: float) -> None:
        if self.source.sensor:
            self._out += self.source.settle(self.pending.lowest)

    def _turn_blocked(self, now: float) -> None:
        self.load.blocked(now, self.processing.backpressured())

    def _turn_acks(self, now: float) -> None:
        self._send_acks(now)

    def _turn_publish_retries(self, now: float) -> None:
        self.retry_publishes()

    def _turn_round_tick(self, now: float) -> None:
        if self.scaling is not None:
            self._out += self.scaling.maybe_tick(now)

    def _turn_heartbeat(self, now: float) -> None:
        if self.cadence.beat_due(now):
            self._heartbeat(now)

    def _turn_silence(self, now: float) -> None:
        if self.silence.due(now):
            self._check_silence(now)

    def _turn_persist(self, now: float) -> None:
        if self.cadence.dirty or self.inbound.changed:
            self.persist()

    def _turn_stopped(self, now: float) -> None:
        if self.stopping:
            self._check_stopped(now)

    _TURN: Tuple[Tuple[str, Callable[["Instance", float], None]], ...] = (
        ("round outputs", _turn_round_outputs),  # a round's queued messages (agent.instance.driver)
        ("produce", _turn_produce),  # a source's poll
        ("process", _turn_process),  # the per-sender queues
        ("moves", _turn_moves),  # key-group hand-overs (agent.instance.moves)
        ("save keyed", _turn_save_keyed),
        ("release held", _turn_release_held),  # the hold buffer (agent.instance.admission)
        ("resend moved", _turn_resend_moved),  # to receivers on a new node (agent.instance.outputs)
        ("settle sink", _turn_settle_sink),
        ("flush", _turn_flush),  # the outbox's ready batches
        ("send mark", _turn_send_mark),  # a watermark alone (agent.instance.marks)
        ("settle source", _turn_settle_source),
        ("blocked", _turn_blocked),  # the live signals' backpressure
        ("acks", _turn_acks),  # upstream
        ("publish retries", _turn_publish_retries),
        ("round tick", _turn_round_tick),  # the scaling driver's period
        ("heartbeat", _turn_heartbeat),
        ("silence", _turn_silence),  # holes and missing replays
        ("persist", _turn_persist),
        ("stopped", _turn_stopped),  # a stop that has drained exits
    )

    def next_wake(self, now: float) -> float:
        """Seconds until the instance has something to do without a new message (the shell's
        poll timeout): 0 when work is ready."""
        if self.life.exit is not None:
            return 0.0
        if self.queued.any() and self.processing.may_take(now):
            return 0.0
        if self.moves is not None and (self.moves.queue or self.moves.inbox):
            return 0.0  # groups to hand out or chunks to take in, a few per turn
        deadlines = [now + MAX_POLL, self.cadence.next_beat()] + self.processing.deadlines(now, self.stopping,
                                                                                           self.scaling)
        return max(0.0, min(deadlines) - now)

    # ---- publish feedback, session, spawn ----------------------------------------------------------

    def _on_publish_accepted(self, ev: PublishAccepted) -> None:
        self.outputs.on_accepted(ev.token, ev.mid)

    def _on_publish_refused(self, ev: PublishRefused) -> None:
        self.outputs.on_refused(ev.token, ev.reason)

    def _on_puback(self, ev: PubAcked) -> None:
        self.outputs.on_puback(ev.mid)

    def _on_session_lost(self, ev: SessionLost) -> None:
        self._new_incarnation("the broker lost our session", "sessions_lost")

    def _on_spawned(self, ev: Spawned) -> None:
        if self.scaling is not None:
            self._out += self.scaling.on_spawned({"request": ev.request, "ok": ev.ok, "error": ev.error})

    def _on_abort(self, ev: Abort) -> None:
        self.life.exit = (EXIT_DRAIN_TIMEOUT, ev.reason, False)

    # ---- control lines, a stop and the exit ----------------------------------------------------------

    def _on_control(self, ev: Control) -> None:
        """A control line from the agent: a stop (or the end of our stdin) drains us; any other
        changes the part it names (agent.instance.controls)."""
        if ev.message.get("event") in ("stop", "eof"):
            self.request_stop(self.now)
        else:
            self._out += self.controls.apply(ev.message, self.scaling, self.now)

    def request_stop(self, now: float) -> None:
        """Agent shutdown: stop producing, drain (bounded), exit; the session is kept."""
        if self.life.stop(now, float(self.spec.extra.get("drain_timeout", 10.0))):
            log.info("stop requested: draining", extra=self.ctx)

    def _check_stopped(self, now: float) -> None:
        self.life.check_stopped(now, self.drained() and self._links_settled())

    def _links_settled(self) -> bool:
        """Terminated by the protocol: our deliveries acked and our own messages acked (2-FGME's
        reliable links, agent.instance.recovery), before the exit."""
        if not self.life.final or self.scaling is None:
            return True
        self._out += self.scaling.ack_links()
        return self.scaling.links is None or self.scaling.links.settled

    def _finish(self, code: int, reason: str, final: bool) -> None:
        try:
            self.operator.close()
        except Exception:  # noqa: BLE001
            log.exception("operator close failed", extra=self.ctx)
        self.cadence.changed()
        self.persist(force=True)
        if self.keyed is not None:
            self._out.append(self.pending.save_keyed())
        self._write_source_stats()
        self._heartbeat(self.now)
        # `final`: gone for good (terminated by the protocol); the agent then forgets this
        # instance instead of re-adopting it after its own restart (agent.node.hosted).
        self._out.append(Exit(code, reason, final))
        self.life.exited()

    # ---- inbox and queues ----------------------------------------------------------------------------

    def _on_envelope(self, ev: EnvelopeReceived) -> None:
        """A message on one of our topics: read, admitted, delivered (agent.instance.delivery)."""
        self._out += self.delivery.received(ev, self.scaling, self.epoch, self.wall(), self.now)

    def _on_handed(self, ev: EnvelopeHanded) -> None:
        """A chained predecessor's envelope (docs/runtime.md, "Chaining"), as over MQTT but its bytes."""
        self._out += self.delivery.handed(ev, self.scaling, self.epoch, self.wall(), self.now)

    def _process(self, now: float) -> None:
        """The queued envelopes, round-robin over senders, each sender strictly in order (three
        exceptions: agent.instance.queues); a data batch through the operator when back pressure
        lets it (agent.instance.processing). `now` stays the event's: an emulated service time
        ends this turn's data; the next Tick goes on."""
        self.queued.round_robin(self.scaling, self.moves.groups_in if self.moves is not None else None,
                                lambda: self.processing.blocked(now, self.scaling),
                                lambda env: self._out.extend(self.processing.batch(env, now, self.wall())),
                                self._on_protocol)

    def _on_protocol(self, env: Envelope) -> None:
        body = env.body
        if isinstance(body, dict) and body.get("type") in group_moves.HANDOVER_TYPES:
            self._out += self.group_side.on_message(env.sender, body, self.scaling)  # agent.instance.group_side
            return
        if self.scaling is None:
            self.intake.protocol_ignored(env.sender)  # counted, logged once per sender (invariant 5)
            return
        self._out += self.scaling.handle(env)

    # ---- silence, a new incarnation ------------------------------------------------------------------

    def _check_silence(self, now: float) -> None:
        """Messages that will never come (they were lost, or taken by another process with our
        session) show up as a hole in a sender's numbering that stays open (we become a new
        incarnation: every predecessor replays what we have not acked), or, when they were the
        last ones a sender sent us, as batches we never ack (the sender replays them to us)."""
        self.silence.checked(now)
        if self.stopping:
            return
        stuck = self.silence.stuck(self.inbound.gaps(), now)
        if stuck:
            self._new_incarnation(f"messages from {', '.join(stuck)} missing for {GAP_TIMEOUT:.0f}s", "gaps_recovered")
        unanswered = self.replays.unanswered(now)
        if unanswered:
            self._new_incarnation(f"no replay marker from {', '.join(unanswered)} in {REPLAY_WAIT:.0f}s",
                                  "replays_asked_again")
        if self.scaling is not None:
            self._out += self.scaling.idle.ping_if_idle(now)
            self.scaling.expire_probes(now)
        if self.moves is not None:
            self._out += self.moves.resend_silent(now)
        self._out += self.outputs.replay_silent(now)

    def _new_incarnation(self, why: str, counter: str) -> None:
        """The broker came back without our session (it restarted without its persistence, or
        lost it), or messages to us went missing (`_check_silence`: lost by the broker, or taken
        by another connection with our client id): what was queued for us or in flight through
        it may be gone. Become a new incarnation as after a crash, keeping what we still hold:
        a new epoch (receivers restart our channel), our own channels resync, predecessors
        replay what we had not acked (an empty ack in the new epoch, as in `start`), and we
        replay to our successors what they had not acked (their acks for the old epoch would be
        ignored). Records that got through twice are dropped by id at the sink; protocol
        messages lost on the way are sent again by the round's resend on silence
        (agent.instance.recovery)."""
        self.incarnation.renew()
        self.persist(force=True)
        self.stats[counter] += 1
        log.warning("%s: new epoch %d, asking for replays", why, self.epoch, extra=self.ctx)
        if self.scaling is not None:
            self._out += self.delivery.ask_replays(self.scaling.core.preds)
            self._out += self.scaling.resync(self.now)
        self._out += self.outputs.replay_all(self.now)

    # ---- source -----------------------------------------------------------------------------------

    def _produce(self, now: float) -> None:
        """A source's poll, when it may (agent.instance.processing)."""
        if self.processing.may_poll(self.stopping, self.scaling):
            self._out += self.processing.poll(now, self.pending.lowest)

    def source_resume_seq(self) -> int:
        """The first record seq a restarted source must generate again (agent.instance.source)."""
        return self.source.resume_seq(self.pending.lowest)

    # ---- output -----------------------------------------------------------------------------------

    def flush(self, now: float, force: bool = False) -> List[Command]:
        """The outbox's ready batches onto their links (agent.instance.outputs); all of them when
        forced or draining."""
        if self.outbox.pending == 0:
            return []
        draining = self.stopping or (self.scaling is not None and self.scaling.draining)
        # A source's floor before its batches leave the outbox: taken out, they are pending
        # nowhere until link.sent, and the claim would cover them.
        own = {self.spec.instance: self.source_resume_seq()} if self.is_source else None
        mark = self.marks.out_mark(now, self.pending.lowest()) if self.marks is not None else None
        return self.outputs.flush(now, force or draining, own, mark)

    def retry_publishes(self) -> None:
        """The publishes the broker refused, again, in their channels' order (agent.instance.outputs)."""
        self._out += self.outputs.publish_retries()

    def send_envelope(self, dest: str, kind: Kind, body: Any) -> None:
        """Acks and protocol messages: numbered on the same channel as the data (invariant 1)."""
        self._out += self.outputs.send_envelope(dest, kind, body)

    def _send_acks(self, now: float) -> None:
        """Ack inputs processed AND forwarded (PUBACKed) or recorded; coalesced (agent.instance.outputs)."""
        self._out += self.outputs.send_acks(now, self.pending.lowest(), self.stopping)

    # ---- routes (called by the scaling driver) -----------------------------------------------------

    def drained(self) -> bool:
        """Every data batch received is processed, forwarded, acked by the successors, and acked
        upstream (queued protocol messages do not count: they may wait behind the drain)."""
        return not self.queued.data_waiting() and self.processing.drained()

    # ---- heartbeat, persistence ---------------------------------------------------------------------

    def snapshot_stats(self) -> Dict[str, Any]:
        """The heartbeat's stats (agent.instance.heartbeat; the shell adds its transport's)."""
        return self.heartbeat.snapshot(self.scaling, self.wall(), self.now)

    def _heartbeat(self, now: float) -> None:
        self.cadence.beat(now)
        self.emit("heartbeat", stats=self.snapshot_stats())
        if self.is_source and self.source.write_due(now):
            self._write_source_stats()

    def _write_source_stats(self) -> None:
        """A source's position and its watermark channels, to its own file (agent.instance.source)."""
        if self.is_source:
            self._out.append(self.source.persisted(self.pending.lowest, self.marks))

    def persisted_state(self) -> Dict[str, Any]:
        """What a restart needs: epoch, channel positions, the scaling driver's state (agent.instance.incarnation)."""
        return self.incarnation.state(self.scaling)

    def persist(self, force: bool = False) -> None:
        """Persist what a restart needs, when due or forced (agent.instance.incarnation)."""
        save = self.incarnation.write(self.now, force, self.scaling)
        if save is not None:
            self._out.append(save)

    _HANDLERS: Dict[Type[Event], Callable[["Instance", Any], None]] = {
        Started: _on_started,
        Restarted: _on_restarted,
        EnvelopeReceived: _on_envelope,
        EnvelopeHanded: _on_handed,
        PublishAccepted: _on_publish_accepted,
        PublishRefused: _on_publish_refused,
        PubAcked: _on_puback,
        SessionLost: _on_session_lost,
        Spawned: _on_spawned,
        Control: _on_control,
        Tick: _on_tick,
        Abort: _on_abort,
    }
