"""One operator instance as a sans-IO state machine: `Instance.handle(event, now) -> [Command]`.

Rules of this file: everything an instance decides lives here or in the modules it drives
(agent.instance.driver for scaling rounds and recovery, agent.dataplane for channels, flow
control and routing); nothing here does I/O. No sockets, no files, no clock (`now` comes with
every event, the wall time with `Started`/`Restarted`/`Tick`), no global random, no import
from agent.mqtt, agent.node or subprocess. The worker process (agent.instance.worker) is the
shell: it turns paho callbacks, control lines and its loop's turns into events (agent.instance
.events) and performs the commands (agent.instance.commands) in order. The interleaving checker
(foglab.sim.instance_check) drives the same class through a model of the broker.

Why one large module: the data path (admission, per-sender queues, processing, flow
control, replay, acks) and the lifecycle share one set of fields that every step reads; split
by function they would reach into each other's state (docs/runtime.md, "Instance").

Lifecycle (`Phase`, the table `_ACCEPTS`): NEW -(Started | Restarted)-> RUNNING -(stop,
eof, or Terminate from the protocol)-> STOPPING -(drained, or drain timeout, or Abort)-> EXITED.
An event the table does not list for the current phase raises `LocalProtocolError` naming the
phase: the shell broke the contract (a Tick before Started, anything but publish feedback
after Exit). Bad input from the bus is never an error here: it is counted, logged, skipped.

The order of work in one loop turn is the `Tick` handler's; the shell delivers every transport
event and control line first, then one Tick (exactly the old worker loop's step).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from enum import Enum
from typing import Any, Callable, Deque, Dict, FrozenSet, List, Optional, Set, Tuple, Type

from agent import events, topics
from agent.config import PipelineConfig
from agent.dataplane.channel import Inbound, Outbound
from agent.dataplane.envelope import (
    MAX_FLOORS, Envelope, Item, Kind, MalformedEnvelope, Passed, built, data_body_bytes, decode, encode, encode_data,
)
from agent.dataplane.flow import AckTracker, OutLink
from agent.dataplane.inbound import ACCEPT, HOLD, REFUSE, HoldBuffer, LogLimiter, numbering_fault, writer_verdict
from agent.dataplane.owners import TableError, groups_from_runs
from agent.dataplane.routing import Outbox, Router
from agent.dataplane.sticky import RouteMemory, needed
from agent.dataplane.watermarks import MAX_MARK_MS, Mark, SourceMarks, WatermarkTable
from agent.instance.commands import (
    AckIngest, Command, CrashPoint, Emit, Exit, Handoff, LogIngest, Notify, Persist, PersistSource, Publish,
    RequestSpawn, SaveKeyed, SaveRoutes,
)
from agent.instance.driver import ScalingDriver
from agent.instance import groups as keygroup_table
from agent.instance import moves as group_moves
from agent.instance.events import (
    Abort, Control, EnvelopeHanded, EnvelopeReceived, Event, PubAcked, PublishAccepted, PublishRefused, Restarted,
    SessionLost, Spawned, Started, Tick,
)
from agent.instance.keyed_state import KeyedState
from agent.instance.spec import InstanceSpec
from agent.measure.capacity import LiveCapacity
from agent.measure.signals import PeriodSignals, Signals
from agent.operators.builtin import SinkOperator
from agent.operators.keyed import KeyedOperator, keyed_config_problems, parse_event_time
from agent.operators.sources import SourceCaps, source_caps
from agent.protocol.errors import LocalProtocolError
from agent.protocol.scaling import FORWARDING

__all__ = ["Instance", "Phase", "EXIT_OK", "EXIT_CRASH", "EXIT_BAD_SPEC", "EXIT_BROKER", "EXIT_DRAIN_TIMEOUT",
           "FAULT_RETRY_ONLY_WITH_DATA", "FAULT_ROUTE_AFRESH", "FAULT_REPLAY_TO_DEPARTED",
           "FAULT_RESYNC_AT_FIRST_SEEN", "FAULT_ROUTE_PAST_DEPARTED"]

log = logging.getLogger("agent.instance.worker")

# Exit codes (the agent's supervisor maps them to restart decisions).
EXIT_OK = 0  # drained and exited (stop, or terminated by the protocol)
EXIT_CRASH = 1  # unexpected exception
EXIT_BAD_SPEC = 2  # the spec or the pipeline cannot be loaded: restarting will not help
EXIT_BROKER = 3  # could not connect/subscribe at start
EXIT_DRAIN_TIMEOUT = 4  # stop requested, but successors did not ack everything in time

MAX_POLL = 0.05  # longest wait the instance asks for (the shell sees control lines within this)
ACK_DELAY = 0.005  # coalesce upstream acks for at most this long
# A source reserves on disk the records it may generate before writing its position again
# (`_produce`): at least SOURCE_RESERVE, else RESERVE_SECONDS of its measured rate (at most
# SOURCE_RESERVE_MAX), so that it writes source.json about once a second whatever its rate. A
# fixed 2,000 records meant 25 writes a second at 50k records/s, each blocking the source 2-4 ms
# on a loaded disk (docs/measurement.md, "Cheap cuts of the data plane"). The price: a restarted
# source regenerates up to its reservation at once, i.e. up to a second of records sooner than
# its rate profile would have (docs/runtime.md).
SOURCE_RESERVE = 2000
RESERVE_SECONDS = 1.0
SOURCE_RESERVE_MAX = 500_000
SINK_SETTLE_POLL = 0.05  # a sink whose spool is at its cap checks this often whether shipping freed it
STATE_PERIOD = 1.0  # persist the channel snapshot at most this often (a rename costs ~5 ms here)
# A hole in a sender's numbering this old will not close by itself: the broker lost those
# messages, or another connection with our client id took them (a fenced copy after a partition).
GAP_TIMEOUT = 5.0
# Batches to a successor unacked this long, with no ack from it meanwhile: send them again under
# their own numbers (what it lost sits at the end of its channel, so it sees no hole). A successor
# that only was slow (an overloaded chain delays acks for seconds) drops the copies in its channel.
LINK_SILENCE = 5.0
# A predecessor whose data we drop while we wait for its replay marker (`_await_replays`) and whose
# marker has not come this long after the first drop never got our request (lost with a broker's
# state): we ask again, as a new incarnation. Generous: a loaded predecessor answers late.
REPLAY_WAIT = 10.0
LINK_SILENCE_MAX = 600.0  # the wait doubles after each replay that brought no ack (a dead node's
# instance, re-homing off: its session would otherwise fill with a window of copies every 5 s)
SILENCE_CHECK = 1.0  # seconds between the two checks above
# Envelopes of senders not known yet (agent.dataplane.inbound.HoldBuffer) wait this long for the
# protocol to announce them (a new copy's Start, resent after IDLE_PING..IDLE_PING_MAX), then they
# are refused. An idle copy holds until its Start: until then it cannot know its predecessors.
HOLD_TTL = 60.0
# Envelopes of a known sender written by a node it is not bound to (yet) wait this long for the
# agent's "hosts" line to bind it there (a new host's record normally follows within a second),
# then they are refused (`refused_nodes`): a forgery by another node never gets bound.
WRITER_HOLD_TTL = 20.0
HOLD_MAX_SENDERS = 64
FLOORS_KEPT = 4096  # sources whose floor claims an instance keeps and forwards (agent.instance.applied)
HOLD_MAX_BYTES = 8 << 20
# Marks a destination that is an MQTT topic of the operator's own (a sink's publications), not an
# instance: instance ids never contain "\0" (topics._check), so the two cannot be confused.
RAW_TOPIC = "\0"
# Envelopes kept per destination our binding table does not name yet (per-node inboxes,
# `_publish_tracked`): a window of data plus acks and protocol messages, many times over.
UNROUTED_MAX = 1024
# A successor that got no batch carrying our current watermark for this long gets it alone, in an
# empty data batch (agent.dataplane.watermarks): one whose key groups get no records still moves on.
MARK_PERIOD = 0.2
# ... and one we never sent data (a new copy, idle until its Start, holds what it gets: a few
# marks only in its hold buffer, HOLD_TTL / MARK_PERIOD_UNLINKED of them) this often.
MARK_PERIOD_UNLINKED = 5.0

# Seeded fault (foglab.sim.instance_check, never set elsewhere): refused publishes are retried
# only when there is data to flush, so a sink's refused ack holds back all its later acks.
FAULT_RETRY_ONLY_WITH_DATA = "retry_only_with_data"
# Seeded fault (the same): records sent again are routed afresh, not to where they went before,
# so after a crash a copy can reach another sink instance, which keeps it (INVARIANT 8).
FAULT_ROUTE_AFRESH = "route_afresh"
# Seeded fault (the same): a record sent again whose successor left our table is routed afresh
# (as it once was), so a copy a departed sink instance recorded reaches another (INVARIANT 8).
FAULT_ROUTE_PAST_DEPARTED = "route_past_departed"
# Seeded fault (the same): the unacked batches of a successor we removed are replayed to its new
# incarnation, which is departing and drops them, instead of re-routed (CHANGELOG.md, defect A).
FAULT_REPLAY_TO_DEPARTED = "replay_to_departed"
# A restarted receiver takes a predecessor's data at the first number it sees when its snapshot
# does not hold that channel (the checker's former `resync_past_lost_replays`).
FAULT_RESYNC_AT_FIRST_SEEN = "resync_at_first_seen"
# The wait for a replay marker starts its clock only at the first data batch it drops, not at a
# protocol message or a duplicate (seed 9230: the sink never asked again, 4 records lost).
FAULT_REPLAY_CLOCK_AT_DROP = "replay_clock_at_drop"
# an idle copy holds an empty ack from a successor's name even with a round message behind it
FAULT_EMPTY_ACK_HELD = "empty_ack_held"
# Seeded faults of the watermarks (agent.dataplane.watermarks): an instance passes on the marks
# it received, acked inputs or not ("marks_unacked"); a keyed instance keeps its own watermark,
# the largest event time it took ("marks_own_max": the rule before marks flowed).
FAULT_MARKS_UNACKED = "marks_unacked"
FAULT_MARKS_OWN_MAX = "marks_own_max"


class Phase(Enum):
    NEW = "new"  # built, not subscribed yet
    RUNNING = "running"
    STOPPING = "stopping"  # draining before exit (stop, eof, or terminated by the protocol)
    EXITED = "exited"  # the Exit command went out


_FEEDBACK: FrozenSet[Type[Event]] = frozenset({PublishAccepted, PublishRefused, PubAcked})
_LIVE: FrozenSet[Type[Event]] = _FEEDBACK | {EnvelopeReceived, EnvelopeHanded, SessionLost, Spawned, Control, Tick, Abort}
# Which events make sense in which phase; anything else is a LocalProtocolError.
_ACCEPTS: Dict[Phase, FrozenSet[Type[Event]]] = {
    Phase.NEW: frozenset({Started, Restarted}),
    Phase.RUNNING: _LIVE,
    Phase.STOPPING: _LIVE,
    Phase.EXITED: _FEEDBACK,
}


def _no_clock() -> float:
    """The live signals' clocks when none is passed (the checker): no time spent."""
    return 0.0


class Instance:
    """One operator instance: channels, flow control and acks, the replay buffer, the scaling
    driver and the lifecycle. Built by the shell from what it loaded (spec, pipeline, operator);
    `faults` switch on seeded faults for the checker only. `local`: the instances hosted by the
    same process (a chain, docs/runtime.md "Chaining"): envelopes to them are `Handoff`s."""

    def __init__(self, spec: InstanceSpec, pipeline: PipelineConfig, operator: Any,
                 faults: FrozenSet[str] = frozenset(), perf: Callable[[], float] = _no_clock,
                 cpu: Callable[[], float] = _no_clock, local: FrozenSet[str] = frozenset(),
                 next_keyed: bool = False) -> None:
        self.spec = spec
        self.pipeline = pipeline
        self.op = pipeline.operator(spec.operator)
        self.operator = operator
        self.faults = frozenset(faults)
        # Co-hosted instances: fixed for the life of the process (the chain never changes its
        # members), so every envelope to one of them goes in memory, never some over MQTT.
        self.local = frozenset(local) - {spec.instance}
        # co-hosted successors whose operator never changes a record in place (the chain sets it:
        # `Operator.keeps_records`): handed their batches without a copy of the records (`_hand`)
        self.local_keeps: FrozenSet[str] = frozenset()
        # CPU-time and interval clocks for the live signals only (docs/measurement.md); the
        # shell passes time.perf_counter and time.process_time, the checker nothing.
        self.perf, self.cpu = perf, cpu
        self.stage = pipeline.index(spec.operator)
        self.kind = self.op.kind
        self.ctx = {"instance": spec.instance, "operator": spec.operator, "node": spec.node}
        # Per-node inboxes (docs/security.md, "Who may read an inbox"): we read
        # `inbox/<our node>/<us>/+` and write to the node our binding table says hosts the
        # receiver; before the table names it, what we send it waits in `unrouted`.
        self.per_node = bool(spec.extra.get("inbox_per_node"))
        self.inbox = (topics.inbox_all_at(spec.cluster, spec.node, spec.instance) if self.per_node
                      else topics.inbox_all(spec.cluster, spec.instance))
        self.unrouted: Dict[str, Deque[Tuple[bytes, Optional[int]]]] = {}
        # Receivers whose binding moved to another node, and when (`_on_hosts`): what we sent
        # them before went to the old node's topic, where the broker drops it (`_resend_moved`).
        self._moved: Dict[str, float] = {}
        self._inbox_root = f"{topics.base(spec.cluster)}/inbox/"
        # The node in an inbox topic must host the envelope's sender (docs/security.md, "Data
        # channels"): the agent sets this and sends the bindings as the control line "hosts".
        self.check_node = bool(spec.extra.get("check_sender_node"))
        self.hosts_bound: Dict[str, str] = {}
        self.hosts_former: Dict[str, List[str]] = {}
        # Senders whose binding the agent took without a statement from who moved them
        # (agent.node.hostmap "unproven"): no new epoch of theirs is taken (nor persisted) until proven.
        self.hosts_unproven: Set[str] = set()
        self.phase = Phase.NEW
        self.now = 0.0
        self._wall_offset = 0.0
        self._out: List[Command] = []
        self.epoch = 0
        self.inbound = Inbound()
        self.outbound = Outbound(0)
        self.is_source = self.kind == "source"
        self.source = source_caps(operator) if self.is_source else SourceCaps()
        self.is_sink = self.kind == "sink" or isinstance(operator, SinkOperator)
        self.service_time = self.op.service_time_ms / 1000.0
        # A sink that reads only record ids gets compact batches without their records rebuilt.
        self._decode_records = not (self.is_sink and getattr(operator, "reads_records", True) is False)

        # Keyed stateful operator (agent.instance.keyed_state): state saved with its input position.
        self.keyed: Optional[KeyedState] = None
        if isinstance(operator, KeyedOperator):
            problems = keyed_config_problems(pipeline, self.stage, operator)
            if problems:
                raise ValueError("; ".join(problems))
            self.keyed = KeyedState(operator, spec.operator, pipeline.operators[self.stage - 1].key,
                                    self.op.key_groups)
            # The agent keeps a standby copy of the saved state on another node (agent.node.replicas):
            # inputs are acked upstream only once it holds the save that reflects them.
            self.keyed.replicated_acks = spec.extra.get("replicate") is True
        # Watermarks that flow with the batches (agent.dataplane.watermarks; docs/operators.md,
        # "Watermarks that flow"): on when the source has [operator.watermark]. Per predecessor
        # the largest mark it sent; a source notes its own under "" per poll. Only what acked
        # inputs carried is passed on, so nothing this instance may process again is behind it.
        self.wm_conf = getattr(pipeline.operators[0], "watermark", None)
        self.marks: Optional[WatermarkTable] = WatermarkTable() if self.wm_conf is not None and not self.is_sink else None
        self.source_marks: Optional[SourceMarks] = None
        if self.marks is not None and self.is_source:
            self.source_marks = SourceMarks(self.wm_conf.disorder_ms, self.wm_conf.idle_after)
        if self.marks is not None and self.keyed is not None and FAULT_MARKS_OWN_MAX not in self.faults:
            self.keyed.flowing = True
        self._marks_sent: Dict[str, Tuple[Mark, float]] = {}  # successor -> (last mark sent it, when)
        # Its key groups and their moves (agent.instance.moves): a deployed instance holds every
        # group (deploy starts one keeper per operator), a copy none until its Start names its share.
        self.moves: Optional[group_moves.GroupMoves] = None
        if self.keyed is not None:
            self.moves = group_moves.GroupMoves(self, range(self.keyed.groups) if spec.active else ())
        nxt = pipeline.operators[self.stage + 1] if self.stage + 1 < len(pipeline.operators) else None
        # `next_keyed` (the shell resolves the next operator's function): its key groups move with
        # their state, so we route by its group -> owner table (agent.instance.groups), dealt at
        # deploy; a copy gets its creator's with its Start.
        self.next_keyed = bool(next_keyed) and nxt is not None and self.op.key is not None
        key_groups = nxt.key_groups if nxt is not None else 128
        table = keygroup_table.initial_table(spec.succs, key_groups) if self.next_keyed and spec.active else None
        self.router = Router(spec.succs, key=self.op.key, groups=key_groups, table=table)
        self._redirects_waiting: List[Tuple[str, Any]] = []  # an idle copy's, until its Start
        self.outbox = Outbox(self.router, self.op.batch_size, self.op.linger_ms / 1000.0)
        # INVARIANT 8 (a record sent again goes where it went): a forwarding instance remembers
        # each record's successor where the next operator's instance count can change
        # (agent.dataplane.sticky.needed).
        self.routes = RouteMemory()
        self.sticky = (not self.is_sink and nxt is not None and FAULT_ROUTE_AFRESH not in self.faults
                       and needed(self.op.key, pipeline.scaling_for(nxt.name).max_instances))
        self.links: Dict[str, OutLink] = {}
        self.tracker = AckTracker()
        self.queues: Dict[str, Deque[Envelope]] = {}
        self.pending_pub: Dict[int, int] = {}  # mid -> lowest process index it carries
        # token -> (destination, payload, lowest index, retried): issued, not yet answered by the shell
        self._unconfirmed: Dict[int, Tuple[str, bytes, Optional[int], bool]] = {}
        self._token = 0
        self.sink_wait: Deque[int] = deque()  # a deferred sink's record() calls not recorded yet
        self.retry: Deque[Tuple[str, bytes, Optional[int]]] = deque()  # (destination, payload, lowest index)
        self.ack_due: Dict[str, Tuple[int, int]] = {}  # sender -> (its epoch, data seq)
        self.ack_since: Optional[float] = None
        self.busy_until = 0.0
        self.high_water = 2 * self.op.batch_size
        self._unacked_batches = 0
        # Acks go out every half of the predecessors' window (their operator's setting): the
        # sender still has the other half of its credit while the ack travels (docs/runtime.md).
        pred_window = pipeline.operators[self.stage - 1].max_inflight_batches if self.stage > 0 else 8
        self.ack_every = max(1, pred_window // 2)
        # Admission (agent.dataplane.inbound): how far ahead an honest sender's numbers can run is
        # set by the larger window on our channels; a held sender gets room for a window of data
        # twice over, plus its protocol and lock messages.
        self.window = max(pred_window, self.op.max_inflight_batches)
        # A keyed successor moving key groups sends each predecessor a Redirect per group, a new
        # copy too, before the copy's Start names that successor: room for all of them, or the
        # ones refused leave a hole and the copy renews its incarnation 5 s later
        # (CHANGELOG.md, "A new copy refused its keyed successor's Redirects"). The byte
        # bound stays the memory bound.
        self.hold = HoldBuffer(HOLD_MAX_SENDERS, 2 * self.window + 32 + (key_groups if self.next_keyed else 0),
                               HOLD_MAX_BYTES)
        self._refusals = LogLimiter()
        # Only a name an instance of a neighbouring operator can have is worth holding: keepers
        # are "<pipeline>.<operator>.0" (deploy.keeper_id), every other instance "<operator>-..."
        # (ScalingCore._new_id, the agent's createNode, the bench). Invented names are refused
        # at once, so they cannot fill the hold buffer that a new copy's predecessors need.
        ops = pipeline.operators
        pred_op = [ops[self.stage - 1].name] if self.stage > 0 else []
        near = pred_op + [spec.operator] + ([ops[self.stage + 1].name] if self.stage + 1 < len(ops) else [])
        succ_op = [ops[self.stage + 1].name] if self.stage + 1 < len(ops) else []
        self._shapes = {
            Kind.DATA: (tuple(f"{o}-" for o in pred_op), {f"{spec.pipeline}.{o}.0" for o in pred_op}),
            Kind.PROTO: (tuple(f"{o}-" for o in near), {f"{spec.pipeline}.{o}.0" for o in near}),
            # held only while we are idle (`_admit`): a re-homed successor's first ack in its new
            # epoch reaches every predecessor of its rebuilt table, idle copies included
            Kind.ACK: (tuple(f"{o}-" for o in succ_op), {f"{spec.pipeline}.{o}.0" for o in succ_op}),
        }
        # a neighbour's Duplication we take unannounced (`_sender_allowed`): previous or next operator
        both = pred_op + succ_op
        self._round_shape = (tuple(f"{o}-" for o in both), {f"{spec.pipeline}.{o}.0" for o in both})
        self.scaling: Optional[ScalingDriver] = None

        self.stats: Dict[str, int] = {
            "records_in": 0,
            "records_out": 0,
            "filtered": 0,
            "operator_errors": 0,
            "batches_in": 0,
            "batches_out": 0,
            "malformed": 0,
            "duplicate_envelopes": 0,
            "acks_sent": 0,
            "acks_in": 0,
            "protocol_in": 0,
            "protocol_out": 0,
            "protocol_errors": 0,
            "sends_to_non_successor": 0,
            "credit_stalls": 0,
            "publish_rejected": 0,
            "refused_senders": 0,  # envelopes from senders our tables do not know (incl. expired holds)
            "refused_epochs": 0,  # an epoch no real incarnation of the sender can have
            "refused_seqs": 0,  # a number (or an ack) far beyond what the sender can have sent
            "refused_nodes": 0,  # written by a node that does not host the sender (incl. expired holds)
            "held_dropped": 0,  # of those, refused because the hold buffer was full
            "held_released": 0,  # held until the protocol announced their sender, then admitted
            "handed_out": 0,  # data batches handed in memory to a chained successor (no broker)
            "handed_in": 0,  # data batches handed in memory by a chained predecessor
            "passed_batches": 0,  # forwarded whole, as the bytes that came (an unchanged operator)
            "foreign_inbox": 0,  # envelopes on our inbox of a node we no longer run on (dropped)
            "stale_acks": 0,  # acks for an earlier incarnation of ours
            "acks_ahead_of_data": 0,  # duplication_acks taken ahead of data queued before them
            "duplications_ahead_of_data": 0,  # a predecessor's duplication taken ahead of its data
            "eos_ahead_of_data": 0,  # a predecessor's Eos taken ahead of its data without the group's records
            "spool_stalls": 0,  # a sink held back by its full spool
            "spool_events": 0,  # spool events published
            "unrouted_dropped": 0,  # envelopes for a destination no binding names, dropped past UNROUTED_MAX
            # key-group hand-over messages (agent.instance.moves), counted apart from the paper's
            "handover_in": 0,
            "handover_out": 0,
            "handover_bytes_in": 0,
            "handover_bytes_out": 0,
            "handover_errors": 0,  # hand-over messages refused (malformed, impossible in the move's state, no keyed state here)
            "eos_before_replay": 0,  # an Eos ahead of its predecessor's replay marker, dropped (asked again)
            # recovery (docs/reliability.md): a new incarnation of ours, by cause
            "sessions_lost": 0,
            "gaps_recovered": 0,
            "replays_asked_again": 0,
            "replay_markers": 0,  # sent, each ahead of a replay
            "dropped_before_replay": 0,  # data batches from a predecessor ahead of its replay marker
            "replayed_batches": 0,  # to a successor: a new incarnation of it, or silent (LINK_SILENCE)
            "silent_links_replayed": 0,  # of those, the replays to a silent successor
            "departed_rerouted": 0,  # records re-routed from a successor that left our table
            "resent_past_departed": 0,  # records sent again whose successor left: dropped (INVARIANT 8)
            "marks_sent": 0,  # watermarks sent alone (agent.dataplane.watermarks)
            "late_at_source": 0,  # source records older than its own watermark when polled
        }
        self._malformed_log = LogLimiter()  # bounded: a flood of invented names costs nothing
        self._malformed_logged: Set[str] = set()  # protocol senders (admitted ones only: bounded)
        self._period_records = 0
        self._last_load = 0.0
        # Live signals (docs/measurement.md, "Live signals"): taken at every decision period,
        # published in the heartbeat, and the online capacity estimate they feed.
        self.signals = PeriodSignals(0.0, 0.0)
        self.last_signals: Optional[Signals] = None
        self.live_capacity = LiveCapacity(500.0)
        self._exit: Optional[Tuple[int, str, bool]] = None
        self.stopping = False
        self._stop_deadline = 0.0
        self._state_dirty = True
        self._last_state_write = -1e9
        self._last_heartbeat = 0.0
        self._sent_to_removed: Set[str] = set()
        self._final = False
        self._last_source_write = -1e9
        self._holes: Dict[str, Tuple[Tuple[int, int], float]] = {}  # sender -> ((epoch, missing seq), since)
        # A new incarnation of ours: predecessor -> (its epoch we knew, None when our snapshot
        # lacks its channel; when we first dropped its data or None), for the predecessors whose
        # data before their replay marker we drop (`_await_replays`, docs/reliability.md).
        self._awaiting_replay: Dict[str, Tuple[Optional[int], Optional[float]]] = {}
        self._dup_behind_data = False  # a predecessor's duplication queued behind its data (`_duplications_ahead`)
        self._eos_behind_data = False  # a predecessor's Eos queued behind its data (`_eos_ahead`)
        # Source -> the largest floor claimed for it in our input (agent.instance.applied): passed
        # on with the records of that source; a source claims its own.
        self._floors: Dict[str, int] = {}
        self._next_silence_check = 0.0
        self.first_record_at: Optional[float] = None
        self.activated_at: Optional[float] = None  # wall time of our Start (rescale breakdown)
        self._terminate_reason = ""
        self._period_start = 0.0
        self._source_first: Dict[int, int] = {}  # source: poll index -> its first record seq
        self._source_reserved = 0  # source: records it may generate before writing its position
        self._reserved_at: Optional[Tuple[float, int]] = None  # source: (when, generated) at the last reservation
        self._source_started_at = 0.0  # source: wall time its rate profile started

    # ---- the one entry point ------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> List[Command]:
        """Apply one event at monotonic time `now`; the commands to perform, in order."""
        allowed = _ACCEPTS[self.phase]
        if type(event) not in allowed:
            raise LocalProtocolError(
                f"{self.spec.instance}: {type(event).__name__} in phase {self.phase.value}, expected one of "
                f"{sorted(t.__name__ for t in allowed)}")
        self.now = now
        self._out = []
        self._HANDLERS[type(event)](self, event)
        if self._exit is not None and self.phase is not Phase.EXITED:
            self._finish(*self._exit)
        out, self._out = self._out, []
        return out

    @property
    def exited(self) -> bool:
        return self.phase is Phase.EXITED

    def wall(self) -> float:
        """The wall clock, as of the last event that carried it (timestamps, epoch plausibility)."""
        return self.now + self._wall_offset

    # ---- commands (the only way out) ----------------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> None:
        self._out.append(Emit(event, fields))

    def notify(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        self._out.append(Notify(topic, payload, qos, retain))

    def request_spawn(self, request: str, spec: Dict[str, Any]) -> None:
        self._out.append(RequestSpawn(request, spec))

    def crash_point(self, name: str) -> None:
        """Where the tests' fault injection may kill the process (the shell decides)."""
        self._out.append(CrashPoint(name))

    # ---- start -----------------------------------------------------------------------------------------

    def _on_started(self, ev: Started) -> None:
        self._begin(ev.wall, False, {}, None)

    def _on_restarted(self, ev: Restarted) -> None:
        if self.sticky:
            try:
                self.routes = RouteMemory.load(ev.routes[0], ev.routes[1], self.now)
            except ValueError as exc:
                log.warning("%s: records replayed to us are routed afresh", exc, extra=self.ctx)
        self._begin(ev.wall, True, ev.state, ev.source_position, ev.ingest_log)
        if self.moves is not None and isinstance(ev.state.get("moves"), dict):
            self.moves.restore(ev.state["moves"])
        elif self.moves is not None and "owned_groups" in self.spec.extra:
            self._resume_groups(self.spec.extra["owned_groups"])
        if self.keyed is not None and ev.keyed is None and self.spec.extra.get("min_epoch"):
            # Re-homed without our keyed state (it went with our node): our groups' output
            # counters are lost, and numbering their keys' outputs from 1 again would give ids the
            # sink has recorded (it drops them as copies). Numbered from the wall clock in us.
            assert self.moves is not None
            self.keyed.floor_groups(self.moves.member.owned, int(ev.wall * 1e6))
        if self.keyed is not None and ev.keyed is not None:
            again = self.keyed.restore(ev.keyed)
            self.keyed.hold_until_replicated()
            if again:  # outputs the successors had not acked: sent again (the sink drops copies)
                index = self.tracker.produced()
                self.keyed.outputs = [(index, it) for it in again]
                self._forward(list(again), index, self.now)
        if self.moves is not None:
            self.moves.after_restart()
            if "moves_out" in self.spec.extra and "owned_groups" in self.spec.extra and not ev.state.get("moves"):
                n = self.moves.resume_moves(self.spec.extra["moves_out"], self.scaling.core.preds)
                if n:
                    log.info("re-homed: the moves of %d key groups their new owners wait for start again", n,
                             extra=self.ctx)

    def _resume_groups(self, runs: Any) -> None:
        """Re-homed without our state: own what our dead incarnation last said it owned."""
        assert self.moves is not None
        try:
            versions = groups_from_runs(runs, self.moves.groups)
        except TableError as exc:
            log.warning("re-homed without a usable list of our key groups (%s): we hold the dealing", exc,
                        extra=self.ctx)
            return
        self.moves.resume_groups(versions)
        log.info("re-homed: resuming our %d key groups", len(versions), extra=self.ctx)

    def _begin(self, wall: float, restart: bool, saved: Dict[str, Any],
               source_position: Optional[Dict[str, Any]], ingest_log: Optional[List[Any]] = None) -> None:
        """Subscribed (the shell says so only after the broker's SUBACK, INVARIANT 2): take our
        epoch, restore what a restart needs, and only then say "ready"."""
        now = self.now
        self._wall_offset = wall - now
        self.phase = Phase.RUNNING
        # Epoch: a restarted worker (same identity) numbers its messages in a new epoch.
        self.epoch = int(saved.get("epoch", -1)) + 1 if saved else 0
        # Re-homed after its node died (agent.node.rehome): the old state is gone with the
        # node, so start above any epoch the dead incarnation can have used.
        self.epoch = max(self.epoch, int(self.spec.extra.get("min_epoch", 0) or 0))
        if restart:
            self.inbound.restore(saved.get("inbound") or {}, resync=True)
        self.outbound = Outbound(self.epoch)
        self._next_silence_check = now + SILENCE_CHECK
        self._period_start = now
        self._source_started_at = wall
        self.signals = PeriodSignals(now, self.cpu())
        self.scaling = ScalingDriver(self, saved, restart)
        self.live_capacity = LiveCapacity(self.scaling.params.capacity)
        if restart and self.scaling.core.forwards_data:
            # The restored tables, not the spec's initial ones: since its creation the instance
            # may have been activated (a copy starts with none) or seen neighbours come and go.
            self.router.set_succs(self.scaling.core.routes()[0])
            if self.next_keyed:
                self.router.table = keygroup_table.restored_table(saved, self.router.succs, self.router.groups,
                                                                  self.ctx, self.spec.extra.get("succ_groups"))
        self.persist(force=True)
        if restart:
            # Tell each predecessor we are a new incarnation (an ack of nothing, numbered in our
            # new epoch): it replays what we had not acknowledged (see _replay_to).
            self._await_replays(self.scaling.core.preds)
            for pred in sorted(self.scaling.core.preds):
                self.send_envelope(pred, Kind.ACK, [0, 0])
            self.scaling.resync(now)
        if self.is_source:
            if self.source.sensor:
                self._number_source(wall, source_position if restart else None, ingest_log)
            elif restart:
                self._resume_source(source_position)
            self.operator.start(now)
        self._period_start = now
        self.emit("ready")
        if self.scaling.terminated:
            # Restarted (an agent restart re-adopting it, say) after the protocol had already
            # terminated it, before its final exit: gone from every table, so gone for good.
            self._exit = (EXIT_OK, "restarted after its termination: gone for good", True)
        elif self.scaling.outputs:
            self.scaling.run_outputs(now)  # a restarted round: perform what was still queued

    def _resume_source(self, pos: Optional[Dict[str, Any]]) -> None:
        """A restarted source continues from its last written position (see TaxiSource.resume)."""
        if not self.source.replayable or not isinstance(pos, dict) or "resume_from" not in pos:
            log.warning("source restarted without a usable position: starting over", extra=self.ctx)
            return
        start = int(pos["resume_from"])
        upto = max(int(pos.get("generated", 0)), int(pos.get("reserved", 0)))
        self._source_started_at = float(pos.get("profile_started_at", self.wall()))
        self.operator.resume(start, upto, self.wall() - self._source_started_at)
        self._source_reserved = upto
        log.info("source resumes at record %d, regenerating up to %d", start, upto, extra=self.ctx)

    # ---- one loop turn ---------------------------------------------------------------------------------

    def _on_tick(self, ev: Tick) -> None:
        now = self.now
        self._wall_offset = ev.wall - now
        if self.scaling is not None:
            self.scaling.run_outputs(now)
        if self.is_source:
            self._produce(now)
        self._process(now)
        if self.moves is not None:
            self.moves.take_in_turn()  # a bounded share of the state chunks received
            self.moves.hand_out_turn()  # a bounded share of the groups whose state is final
            self.moves.flush()  # the turn's hand-over writes, then its messages (agent.instance.moves)
        if self.keyed is not None and self.keyed.dirty:
            self._save_keyed()
        if self.hold:
            self._release_held(now)
        if self._moved:
            self._resend_moved(now)
        if self.is_sink:
            self._settle_sink()
        self.flush(now)
        if self.marks is not None:
            self._send_marks(now, self._out_mark(now))
        if self.source.sensor:
            self._settle_ingest()
        self.signals.blocked(now, self._backpressured())
        self._send_acks(now)
        if FAULT_RETRY_ONLY_WITH_DATA not in self.faults:
            self._publish_retries()
        if self.scaling is not None:
            self.scaling.maybe_tick(now)
        if now - self._last_heartbeat >= self.spec.heartbeat_period:
            self._heartbeat(now)
        if now >= self._next_silence_check:
            self._check_silence(now)
        if self._state_dirty or self.inbound.changed:
            self.persist()
        if self.stopping:
            self._check_stopped(now)

    def next_wake(self, now: float) -> float:
        """Seconds until the instance has something to do without a new message (the shell's
        poll timeout): 0 when work is ready."""
        if self._exit is not None:
            return 0.0
        if self._has_ready_input(now):
            return 0.0
        if self.moves is not None and (self.moves.queue or self.moves.inbox):
            return 0.0  # groups to hand out or chunks to take in, a few per turn
        deadlines = [now + MAX_POLL, self._last_heartbeat + self.spec.heartbeat_period]
        d = self.outbox.next_deadline()
        if d is not None and any(self._credit(s) > 0 for s in self.router.succs):
            deadlines.append(d)  # without credit only an ack (socket readable) can help: no spin
        if self.busy_until > now:
            deadlines.append(self.busy_until)
        if self.ack_since is not None:
            deadlines.append(self.ack_since + ACK_DELAY)
        if self.sink_wait:
            deadlines.append(now + SINK_SETTLE_POLL)  # the shipper (another process) cannot wake us
        if self.is_source and self._can_produce():
            deadlines.append(self.operator.next_due(now))
        return max(0.0, min(deadlines) - now)

    # ---- publish feedback, session, spawn ----------------------------------------------------------

    def _on_publish_accepted(self, ev: PublishAccepted) -> None:
        item = self._unconfirmed.pop(ev.token, None)
        if item is not None and item[2] is not None:
            self.pending_pub[ev.mid] = item[2]

    def _on_publish_refused(self, ev: PublishRefused) -> None:
        item = self._unconfirmed.pop(ev.token, None)
        if item is None:
            return
        if not item[3]:
            self.stats["publish_rejected"] += 1
            log.warning("%s; will retry", ev.reason or "publish refused", extra=self.ctx)
        # Refusals come in token order and every later publish of the same list is refused too
        # (commands.py), so appending keeps the channel order.
        self.retry.append(item[:3])

    def _on_puback(self, ev: PubAcked) -> None:
        self.pending_pub.pop(ev.mid, None)

    def _on_session_lost(self, ev: SessionLost) -> None:
        self._new_incarnation("the broker lost our session", "sessions_lost")

    def _on_spawned(self, ev: Spawned) -> None:
        if self.scaling is not None:
            self.scaling.on_spawned({"request": ev.request, "ok": ev.ok, "error": ev.error})

    def _on_abort(self, ev: Abort) -> None:
        self._exit = (EXIT_DRAIN_TIMEOUT, ev.reason, False)

    # ---- control lines -------------------------------------------------------------------------------

    def _on_control(self, ev: Control) -> None:
        msg = ev.message
        event = msg.get("event")
        now = self.now
        if event in ("stop", "eof"):
            self.request_stop(now)
        elif event == "spawned":
            self._on_spawned(Spawned(str(msg.get("request")), bool(msg.get("ok")), str(msg.get("error"))))
        elif event == "scale":
            if self.scaling is not None:
                self.scaling.force(str(msg.get("action")), int(msg.get("count", 1)))
        elif event == "set":
            if "service_time_ms" in msg:
                self.service_time = float(msg["service_time_ms"]) / 1000.0
                log.info("service time set to %.3f ms", self.service_time * 1000, extra=self.ctx)
            if "paused" in msg and self.is_source:
                self.operator.paused = bool(msg["paused"])
            if "pinned" in msg and self.scaling is not None:
                self.scaling.pinned = bool(msg["pinned"])
            if "context" in msg and self.scaling is not None and self.scaling.live is not None:
                if not self.scaling.live.set_context(msg["context"]):
                    log.warning("malformed policy context ignored: %.200r", msg["context"], extra=self.ctx)
        elif event == "hosts":
            self._on_hosts(msg)
        elif event == "replicated":
            if self.keyed is not None and isinstance(msg.get("gen"), int) and isinstance(msg.get("log"), int):
                self.keyed.replicated(msg["gen"], msg["log"])
                if self.moves is not None:
                    self.moves.replicated((msg["gen"], msg["log"]))
        else:
            log.warning("unknown control event %r ignored", event, extra=self.ctx)

    def _on_hosts(self, msg: Dict[str, Any]) -> None:
        """The agent's instance -> node bindings (agent.node.hostmap): replaces ours; what they
        now bind is released from the hold buffer at the next Tick (`_release_held`)."""
        bound = msg.get("bound")
        if not isinstance(bound, dict):
            log.warning("hosts line without its tables ignored", extra=self.ctx)
            return
        before, self.hosts_bound = self.hosts_bound, {str(i): str(n) for i, n in bound.items()}
        for dest in self.links:
            was, now_at = before.get(dest), self.hosts_bound.get(dest)
            if was is not None and now_at is not None and was != now_at:
                self._moved[dest] = self.now
        former = msg.get("former")
        self.hosts_former = ({str(i): [str(n) for n in ns] for i, ns in former.items() if isinstance(ns, list)}
                             if isinstance(former, dict) else {})
        unproven = msg.get("unproven")
        self.hosts_unproven = {str(i) for i in unproven} if isinstance(unproven, list) else set()
        for dest in [d for d in self.unrouted if d in self.hosts_bound]:
            parked = self.unrouted.pop(dest)
            for payload, low in parked:
                self._publish_tracked(dest, payload, low)

    def _resend_moved(self, now: float) -> None:
        """A receiver moved to another node (a drain's hand-over, a re-home): every batch we sent
        it before our table said so went to its old node's topic, where the broker drops it (the
        new node may not read it). Sent again at once, under their own numbers, to the new node
        (the receiver's channel drops what it has), and the silent-link backoff starts over: left
        to `_check_silence`, the resend waited for a backoff that had doubled on every replay into
        the old topic while the receiver started (CHANGELOG.md, "A drain could stall a moved
        instance for a minute").
        Run after the release of held envelopes: a renumbered replay for the receiver's new epoch
        (`_accept`) resends them already, and what it sent is newer than the move."""
        moved, self._moved = self._moved, {}
        for dest, since in moved.items():
            link = self.links.get(dest)
            if link is None or dest in self.local:
                continue
            link.silent_replays = 0
            if any(u.sent_at < since for u in link.unacked()):
                self.stats["moved_resent"] = self.stats.get("moved_resent", 0) + 1
                self._replay_to(dest, renumber=False, why=f"moved to node {self.hosts_bound.get(dest)}")

    def request_stop(self, now: float) -> None:
        """Agent shutdown: stop producing, drain (bounded), exit; the session is kept."""
        if not self.stopping:
            self.stopping = True
            self.phase = Phase.STOPPING
            self._stop_deadline = now + float(self.spec.extra.get("drain_timeout", 10.0))
            log.info("stop requested: draining", extra=self.ctx)

    def _check_stopped(self, now: float) -> None:
        if self.drained() and (not self._final or self.scaling is None or self.scaling.ready_to_exit()):
            self._exit = (EXIT_OK, "stopped", False)
        elif now > self._stop_deadline:
            self._exit = (EXIT_DRAIN_TIMEOUT, "drain timeout: successors did not ack everything", False)

    def terminate(self, reason: str) -> None:
        """INVARIANT 4 (drain before exit): called by the scaling driver on `Terminate`, which
        the core emits only after every deletion ack; the loop still finishes draining first."""
        self.stopping = True
        self.phase = Phase.STOPPING
        self._stop_deadline = self.now + float(self.spec.extra.get("drain_timeout", 30.0))
        self._final = True
        self._terminate_reason = reason

    def _finish(self, code: int, reason: str, final: bool) -> None:
        final = final or self._final
        if code == EXIT_OK and self._terminate_reason:
            reason = self._terminate_reason
        try:
            self.operator.close()
        except Exception:  # noqa: BLE001
            log.exception("operator close failed", extra=self.ctx)
        self._state_dirty = True
        self.persist(force=True)
        if self.keyed is not None:
            self._save_keyed()
        self._write_source_stats()
        self._heartbeat(self.now)
        # `final`: gone for good (terminated by the protocol); the agent then forgets this
        # instance instead of re-adopting it after its own restart (agent.node.hosted).
        self._out.append(Exit(code, reason, final))
        self.phase = Phase.EXITED

    # ---- inbox ----------------------------------------------------------------------------------------

    def _on_envelope(self, ev: EnvelopeReceived) -> None:
        writer = topics.inbox_writer(self.inbox, ev.topic)
        if writer is None and self.per_node and ev.topic.startswith(self._inbox_root):
            # Our inbox on a node we no longer run on: a subscription our session kept from an
            # earlier incarnation (a re-home, a hand-over). The role's ACL drops these at delivery;
            # a broker without it delivers them. Dropped either way; the predecessors replay what
            # we have not acked to our new topic (they learn our node from the hosted records).
            self.stats["foreign_inbox"] += 1
            return
        if writer is None:
            self._ingest(ev)
            return
        try:
            env = decode(ev.payload, self._decode_records)
        except MalformedEnvelope as exc:
            # INVARIANT 5 (nothing dropped silently): counted, logged once per sender, skipped.
            self.stats["malformed"] += 1
            who = _guess_sender(ev.payload)
            if self._malformed_log.allow(who, self.now):
                log.warning("malformed payload on inbox from %s skipped: %s", who, exc, extra=self.ctx)
            return
        if (env.sender, writer) in self.hold:
            # behind what it already holds: the order of (sender, writing node) is kept
            self._hold(env, ev.payload, writer, "node" if self._waits_for_binding(env.sender, writer) else "sender")
            return
        verdict, why = self._admit(env, writer)
        if verdict == ACCEPT:
            self._accept(env)
        elif verdict == HOLD:
            self._hold(env, ev.payload, writer, why)
        else:
            self._refuse(env, why, writer)

    def _on_handed(self, ev: EnvelopeHanded) -> None:
        """A chained predecessor's envelope (docs/runtime.md, "Chaining"): as `_on_envelope`
        without the bytes. Written by our own node (same process); admitted by the same rules,
        so a sender our tables do not know is held or refused exactly as over MQTT."""
        env = ev.envelope
        if not isinstance(env, Envelope):
            raise LocalProtocolError(f"{self.spec.instance}: EnvelopeHanded without an Envelope: {env!r:.80}")
        writer = self.spec.node
        if env.kind is Kind.DATA:
            self.stats["handed_in"] += 1
        if (env.sender, writer) in self.hold:
            self._hold(env, encode(env), writer, "node" if self._waits_for_binding(env.sender, writer) else "sender")
            return
        verdict, why = self._admit(env, writer)
        if verdict == ACCEPT:
            self._accept(env)
        elif verdict == HOLD:
            self._hold(env, encode(env), writer, why)  # rare: held as bytes like a broker's message
        else:
            self._refuse(env, why, writer)

    # ---- admission (docs/security.md, "Data channels") ------------------------------------------

    def _admit(self, env: Envelope, writer: str, unannounced_ok: bool = False) -> Tuple[str, str]:
        """ACCEPT, HOLD or REFUSE (with the reason) for one decoded envelope, before it touches
        any state: its sender must exist for our tables (unless `unannounced_ok`:
        `_empty_ack_before_round`), be hosted by the node `writer` that wrote it (check_node), and
        its numbers must be ones that sender can have (agent.dataplane.inbound). Cheap on the hot
        path: dict lookups and a few compares."""
        if not unannounced_ok and not self._sender_allowed(env):
            # Data and protocol messages may come from an instance the protocol announces to us
            # only later (a new copy's predecessors before its Start): hold, if the name can be
            # one of a neighbouring operator's. Acks come only from instances we sent data to,
            # which an active instance knows by then: refuse. An idle copy knows no successor
            # yet, but a re-homed one numbers its first ack (its new epoch) 1 on the channel to
            # us: refused, every later message of it would wait behind that hole until we became
            # a new incarnation, possibly in our own deletion (CHANGELOG.md, defect A).
            # So an idle copy holds acks from a successor's name until its Start, like data.
            shape = self._shapes.get(env.kind)
            if env.kind is Kind.ACK and not self._idle:
                shape = None
            if shape is not None and (env.sender.startswith(shape[0]) or env.sender in shape[1]):
                return HOLD, "sender"
            return REFUSE, "sender"
        if self.check_node and writer_verdict(self.hosts_bound.get(env.sender), self.hosts_former.get(env.sender, ()),
                                              writer) != ACCEPT:
            return HOLD, "node"
        if self.check_node and env.sender in self.hosts_unproven and self._new_epoch(env):
            return HOLD, "node"  # a binding nobody vouched for does not set the sender's epoch
        fault = numbering_fault(self.inbound.position(env.sender), self.inbound.resync_unknown,
                                env.epoch, env.seq, self.wall(), self.window)
        if fault is not None:
            return REFUSE, fault
        if env.kind is Kind.ACK and env.body[0] == self.epoch and env.body[1] > 0:
            link = self.links.get(env.sender)
            if link is None or not link.plausible_ack(env.body[1]):
                return REFUSE, "seq"  # acks (in our epoch) what we never sent it
        return ACCEPT, ""

    def _sender_allowed(self, env: Envelope) -> bool:
        """Does our view of the pipeline say `env.sender` may send us an envelope of this kind?

        Data: a predecessor (the core's table, or one announced to an idle copy). Acks: an
        instance we sent data to (a link, a successor), a copy of ours pinging for its Start, or a
        copy we may have to adopt (`ScalingDriver.may_probe`). Protocol and lock messages: any
        instance our tables, our rounds or our persisted channels know."""
        s = env.sender
        sc = self.scaling
        kind = env.kind
        if kind is Kind.DATA:
            if sc is None:
                return s in self.spec.preds
            return s in sc.core.preds or s in sc.core.preds_to_add
        if kind is Kind.ACK:
            if s in self.links or s in self.router.succs:
                return True
            if sc is None:
                return False
            core = sc.core
            if s in core.succs or s in core.new_siblings or s in sc.started or s in sc.probes or s in sc.orphans:
                return True
            return tuple(env.body) == (0, 0) and sc.may_probe(s)
        if self.inbound.position(s) is not None or s in self.links:
            return True
        if (self.moves is not None and isinstance(env.body, dict) and env.body.get("type") in group_moves.HANDOVER_TYPES
                and self._sibling(s)):
            return True  # a hand-over between two instances of our operator (agent.instance.moves)
        if sc is None:
            return s in self.spec.preds or s in self.spec.succs
        if sc.knows(s):
            return True
        # The Deletion of a neighbour's copy nobody told us of (it learnt of us from a round of
        # ours, or from its creator, while our own Start or round left it out): answered, or its
        # deletion waits for our ack for ever. The core takes it as the paper does (idle: not to
        # add; active: not in our tables) and only acks. Likewise a Duplication a neighbour sends
        # us, a copy it was told of, after a loss (`ScalingCore.widen_round`): idle, we keep it
        # for our Start (Algorithm 5) and ack; held instead, two such rounds wait for each
        # other's idle copies for ever. docs/reliability.md, "Checking whole instances".
        mtype = env.body.get("type") if isinstance(env.body, dict) else None
        shape = self._shapes[Kind.PROTO] if mtype == "deletion" else self._round_shape
        return mtype in ("deletion", "duplication") and (s.startswith(shape[0]) or s in shape[1])

    def _take_redirect(self, sender: str, msg: Any) -> None:
        try:
            group_moves.on_redirect(self, sender, msg)
        except group_moves.HandoverError as exc:
            self.handover_error(sender, str(exc))

    def handover_error(self, sender: str, why: str) -> None:
        """A hand-over message refused, here or in agent.instance.moves: counted once, in one place."""
        self.stats["handover_errors"] += 1
        if self.log_limited(sender):
            log.warning("hand-over from %s: %s", sender[:64], why, extra=self.ctx)

    def _sibling(self, name: str) -> bool:
        """Can `name` be another instance of our operator (ScalingCore._new_id, deploy.keeper_id)?"""
        return name != self.spec.instance and (name.startswith(f"{self.spec.operator}-")
                                               or name == f"{self.spec.pipeline}.{self.spec.operator}.0")

    def _accept(self, env: Envelope) -> None:
        before = self.inbound.stats.duplicates + self.inbound.stats.stale_epoch
        known = self.inbound.epoch_of(env.sender)
        if env.epoch > (known if known is not None else 0) and (env.sender in self.links
                                                                or env.sender in self.router.succs):
            # The successor restarted: it may have lost what it held. The marker first (it drops
            # what we sent before it: all of that is in the replay), then the replay, in order;
            # to a successor we have removed, no replay: its unacked batches go to the current
            # successors (CHANGELOG.md, defect A).
            self._send_replay_marker(env.sender)
            self._marks_sent.pop(env.sender, None)  # it lost the marks it had from us: sent again
            if env.sender in self.links:
                if env.sender in self.router.succs or FAULT_REPLAY_TO_DEPARTED in self.faults:
                    self._replay_to(env.sender)
                else:
                    self._reroute_departed(env.sender)
        if env.kind is Kind.ACK and tuple(env.body) == (0, 0) and self.scaling is not None:
            self.scaling.remind_departed(env.sender)  # a re-homed copy that forgot it left
        if env.sender in self._awaiting_replay:
            self._replay_wait_clock(env)
        # INVARIANT 1 (FIFO channel): envelopes are delivered in each sender's numbering, once.
        for e in self.inbound.receive(env):
            if e.kind is Kind.ACK:
                self._on_ack(e)
            else:
                if e.kind is Kind.DATA:
                    if not e.body and e.watermark is None:  # a replay marker: its replay follows (`_await_replays`)
                        self._awaiting_replay.pop(e.sender, None)
                        continue
                    if self._awaiting_replay and self._before_replay(e):
                        continue  # its replay brings it again, in order
                    self._period_records += len(e.body)
                    self.signals.arrived(len(e.body))
                elif (self._awaiting_replay and e.sender in self._awaiting_replay and isinstance(e.body, dict)
                      and e.body.get("type") == "eos"):
                    # An Eos ahead of its predecessor's replay marker follows records we drop until
                    # that replay: taken now, it would overtake them. The move asks again
                    # (agent.instance.moves, MOVE_RESEND), and the new Eos comes behind the replay.
                    self.stats["eos_before_replay"] += 1
                    continue
                q = self.queues.get(e.sender)
                if q is None:
                    q = self.queues[e.sender] = deque()
                q.append(e)
                if len(q) > 1 and e.kind is Kind.PROTO and isinstance(e.body, dict):
                    if e.body.get("type") == "duplication":
                        self._dup_behind_data = True
                    elif e.body.get("type") == "eos" and self.moves is not None:
                        self._eos_behind_data = True
        dropped = self.inbound.stats.duplicates + self.inbound.stats.stale_epoch - before
        self.stats["duplicate_envelopes"] += dropped
        if dropped and env.kind is Kind.DATA and env.epoch < (self.inbound.epoch_of(env.sender) or 0):
            # Safe only because the sender's predecessors or source still hold what it carried
            # (acks are end to end); rare enough to say so once per occurrence.
            log.warning("data batch %d of %s's old epoch %d dropped (now epoch %s)", env.seq, env.sender,
                        env.epoch, self.inbound.epoch_of(env.sender), extra=self.ctx)

    def _await_replays(self, preds: Any) -> None:
        """We are a new incarnation and ask `preds` for a replay. Data a predecessor sent before
        it saw our new epoch may still be queued for us: newer records than the ones we lost
        with our memory. Processed first, they would reach the successors ahead of the replayed
        older ones (a keyed operator's window then closes without them: seed 25 of the stateful
        chaos run). Everything such a predecessor sent us and we did not ack is in its replay,
        which follows its replay marker (an empty data batch, `_send_replay_marker`), so what
        comes from it before the marker is dropped, and its records reach us in its order.
        Only predecessors we had a channel with (the others sent us nothing yet, and may not
        know us yet: they would never send a marker); a newer epoch of the predecessor ends the
        wait (restarted itself: all it sends is fresh). docs/reliability.md, "Replays in order".
        A predecessor whose channel our snapshot does not hold (it lags: we crashed before
        persisting it) is awaited too: its data is taken only from a marker or from number 1
        (a channel that starts there has nothing before it). Taken at the first number seen,
        a batch that followed replays a broker rollback lost was acked, and the cumulative ack
        dropped the lost replays from the sender's buffer (`resync_past_lost_replays`)."""
        self._awaiting_replay = {}
        for p in preds:
            pos = self.inbound.position(p)
            if pos is not None or FAULT_RESYNC_AT_FIRST_SEEN not in self.faults:
                self._awaiting_replay[p] = (pos[0] if pos is not None else None, None)

    def _before_replay(self, env: Envelope) -> bool:
        """Drop `env` (data from a predecessor whose replay marker has not come yet)?"""
        awaited = self._awaiting_replay.get(env.sender)
        if awaited is None:
            return False
        epoch, since = awaited
        if env.seq == 1 if epoch is None else env.epoch > epoch:
            del self._awaiting_replay[env.sender]  # a new incarnation of it: fresh data
            return False
        self.stats["dropped_before_replay"] += 1
        if since is None:
            self._awaiting_replay[env.sender] = (epoch, self.now)
        return True

    def _replay_wait_clock(self, env: Envelope) -> None:
        """Start the clock of the wait for `env.sender`'s replay marker (REPLAY_WAIT) at anything
        it sends us but its marker: it is alive, so a marker that does not follow was lost. Not
        only at a dropped data batch: a protocol message may open a channel the snapshot lacked
        past data and a marker a broker rollback lost, and the replays of that data under their
        own numbers then die in the channel as duplicates, never reaching `_before_replay`
        (seed 9230 of the every-move mix, docs/reliability.md, "Replays in order"). A newer
        epoch of the sender is no evidence: its data ends the wait."""
        epoch, since = self._awaiting_replay[env.sender]
        if since is not None or FAULT_REPLAY_CLOCK_AT_DROP in self.faults:
            return
        if (env.kind is not Kind.DATA or env.body) and (epoch is None or env.epoch <= epoch):
            self._awaiting_replay[env.sender] = (epoch, self.now)

    def _send_replay_marker(self, dest: str) -> None:
        """An empty data batch on the channel to `dest`: what we send after it is our replay and
        newer data (see `_await_replays`). Outside the replay buffer and the credit window; the
        receiver never processes nor acks it (cumulative acks cover its number)."""
        seq = self.outbound.take(dest)
        if dest in self.local:  # chained: on the same in-memory channel as the replay after it
            self._hand(dest, Envelope(self.spec.instance, self.epoch, seq, Kind.DATA, []))
        else:
            self._publish_tracked(dest, encode_data(self.spec.instance, self.epoch, seq, []), None)
        self.stats["replay_markers"] += 1

    def forget_sender(self, sender: str) -> None:
        """Drop every per-sender entry of an instance admitted only provisionally (an unanswered
        probe): channel position, numbering, an empty queue."""
        if self.queues.get(sender):
            return  # something of it still waits to be handled: keep it
        self.queues.pop(sender, None)
        self.inbound.forget(sender)
        self.outbound.forget(sender)
        self._holes.pop(sender, None)
        self.mark_state_changed()

    def _hold(self, env: Envelope, payload: bytes, writer: str, why: str) -> None:
        # Kept: the bytes (decoded again on release, so memory is what the byte bound says) and
        # a header without records (what `_sender_allowed` looks at while it waits), per (sender,
        # writing node): one ordered stream each.
        head = Envelope(env.sender, env.epoch, env.seq, env.kind, [] if env.kind is Kind.DATA else env.body)
        if not self.hold.add((env.sender, writer), (head, bytes(payload)), len(payload) + 200, self.now):
            self.stats["held_dropped"] += 1
            self._refuse(env, why, writer, " (hold buffer full)")

    def _empty_ack_before_round(self, key: Tuple[str, str], head: Envelope) -> bool:
        """Idle, is `head` (first of the held stream `key`) an empty ack ([0, 0]: a new
        incarnation of a successor asking for replays; we sent it nothing) from a name of our
        successors' operator, with a round message behind it that we take unannounced
        (`_sender_allowed`)? Then it is taken (a no-op for us) so that the round message gets
        answered: held until our Start, it kept the Duplication of our creator's neighbour
        behind it, whose round waited for our ack while our creator's waited for that
        neighbour's idle copy, which held our creator's Duplication behind its data: two idle
        copies waiting for each other (CHANGELOG.md, "Records lost at an idle sink copy")."""
        if (not self._idle or head.kind is not Kind.ACK or tuple(head.body) != (0, 0)
                or FAULT_EMPTY_ACK_HELD in self.faults):
            return False
        prefix, names = self._shapes[Kind.ACK]
        if not (head.sender.startswith(prefix) or head.sender in names):
            return False
        return any(h.kind is Kind.PROTO and self._sender_allowed(h) for h, _ in self.hold.items(key)[1:])

    def _refuse(self, env: Envelope, why: str, writer: str, note: str = "") -> None:
        """Counted, logged at most once per sender per minute (and 20 lines a minute in all), and
        nothing else: no channel entry, no record id, nothing persisted."""
        if why == "sender" and env.kind is Kind.ACK and tuple(env.body) == (0, 0) and self.scaling is not None:
            self.scaling.remind_departed(env.sender)  # a re-homed copy that forgot it left
        key = {"epoch": "refused_epochs", "seq": "refused_seqs", "node": "refused_nodes"}.get(why, "refused_senders")
        self.stats[key] += 1
        if self._refusals.allow((env.sender, writer), self.now):
            more = self._refusals.take_suppressed()
            what = f"not bound to node {writer[:64]}" if why == "node" else f"{why} not plausible"
            log.warning("refused %s envelope %d/%d from %s (written by %s) on our inbox: %s%s%s",
                        env.kind.name.lower(), env.epoch, env.seq, env.sender[:64], writer[:64], what, note,
                        f" ({more} more refusals not logged)" if more else "", extra=self.ctx)

    def _release_held(self, now: float) -> None:
        """Senders the protocol has announced since their envelopes were held: admit those
        envelopes now, in the sender's order (epoch, then number). Not in arrival order: a
        channel that resyncs (a sender unknown after a restart or a new incarnation) starts at
        the first number it sees, and the ones below it are dropped as seen; held in arrival order
        2 before 1 (1 lost by the broker and sent again), record 1 was dropped, came back only
        through a later replay, and went out behind record 7 of its key. The rest wait, up to
        HOLD_TTL (an idle copy: until its Start)."""
        for key in self.hold.senders():
            writer = key[1]
            self.hold.order(key, lambda held: (held[0].epoch, held[0].seq))
            while True:
                held = self.hold.first(key)
                if held is None:
                    break
                unannounced_ok = False
                if not self._sender_allowed(held[0]):
                    if self._empty_ack_before_round(key, held[0]):
                        unannounced_ok = True
                    elif held[0].kind is not Kind.ACK or self._idle:
                        break  # still not announced: keep waiting (an idle copy: until its Start)
                    self.hold.pop_first(key)  # an ack is held only until Start (see _admit)
                    self._refuse(held[0], "sender", writer)
                    continue
                env = decode(held[1], self._decode_records)  # decoded once already: cannot fail
                verdict, why = self._admit(env, writer, unannounced_ok)
                if verdict == HOLD:
                    break
                self.hold.pop_first(key)
                if verdict == ACCEPT:
                    self.stats["held_released"] += 1
                    self._accept(env)
                else:
                    self._refuse(env, why, writer)
        if self._idle:
            return  # idle: its neighbours are announced with its Start
        for (sender, writer), n in self.hold.expire(now, self._hold_ttl):
            # Not announced by the protocol, or not bound to the node that wrote it, in time.
            unbound = self._waits_for_binding(sender, writer)
            self.stats["refused_nodes" if unbound else "refused_senders"] += n
            if self._refusals.allow((sender, writer), now):
                log.warning("refused %d envelopes from %s (written by %s): %s within %.0fs", n, sender[:64],
                            writer[:64], f"not bound to node {writer[:64]}" if unbound else "not announced to us",
                            WRITER_HOLD_TTL if unbound else HOLD_TTL, extra=self.ctx)

    @property
    def _idle(self) -> bool:
        """A copy not yet started: it knows its neighbours only from its Start."""
        return self.scaling is not None and not self.scaling.data_enabled

    def _new_epoch(self, env: Envelope) -> bool:
        position = self.inbound.position(env.sender)
        return position is None or env.epoch > position[0]

    def _waits_for_binding(self, sender: str, writer: str) -> bool:
        """A held stream whose sender our tables know, written by a node it is not bound to (or
        bound without proof)."""
        return (self.check_node and (self.hosts_bound.get(sender) != writer or sender in self.hosts_unproven)
                and writer not in self.hosts_former.get(sender, ())
                and self._sender_allowed(Envelope(sender, 0, 1, Kind.PROTO, {})))

    def _hold_ttl(self, key: Tuple[str, str]) -> float:
        return WRITER_HOLD_TTL if self._waits_for_binding(*key) else HOLD_TTL

    def _check_silence(self, now: float) -> None:
        """Messages that will never come (they were lost, or taken by another process with our
        session) show up as a hole in a sender's numbering that stays open (we become a new
        incarnation: every predecessor replays what we have not acked), or, when they were the
        last ones a sender sent us, as batches we never ack (the sender replays them to us)."""
        self._next_silence_check = now + SILENCE_CHECK
        if self.stopping:
            return
        holes = {s: (g[0], g[1]) for s, g in self.inbound.gaps().items()}
        self._holes = {s: (h, self._holes[s][1] if self._holes.get(s, (None,))[0] == h else now)
                       for s, h in holes.items()}
        stuck = sorted(s for s, (_, since) in self._holes.items() if now - since >= GAP_TIMEOUT)
        if stuck:
            self._holes = {}
            self._new_incarnation(f"messages from {', '.join(stuck)} missing for {GAP_TIMEOUT:.0f}s", "gaps_recovered")
        unanswered = sorted(s for s, (_, t) in self._awaiting_replay.items()
                            if t is not None and now - t >= REPLAY_WAIT)
        if unanswered:
            self._new_incarnation(f"no replay marker from {', '.join(unanswered)} in {REPLAY_WAIT:.0f}s",
                                  "replays_asked_again")
        if self.scaling is not None:
            self.scaling.ping_if_idle(now)
            self.scaling.expire_probes(now)
        if self.moves is not None:
            self.moves.resend_silent(now)
        for dest, link in list(self.links.items()):
            wait = min(LINK_SILENCE * 2 ** link.silent_replays, LINK_SILENCE_MAX)
            if link.inflight and link.oldest_age(now) >= wait and now - link.last_ack_at >= wait:
                self.stats["silent_links_replayed"] += 1
                link.silent_replays += 1
                self._replay_to(dest, renumber=False)

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
        self.epoch += 1
        self.outbound = Outbound(self.epoch)
        self.inbound.restore(self.inbound.snapshot(), resync=True)
        self.persist(force=True)
        self.stats[counter] += 1
        log.warning("%s: new epoch %d, asking for replays", why, self.epoch, extra=self.ctx)
        if self.scaling is not None:
            self._await_replays(self.scaling.core.preds)
            for pred in sorted(self.scaling.core.preds):
                self.send_envelope(pred, Kind.ACK, [0, 0])
            self.scaling.resync(self.now)
        for dest, link in list(self.links.items()):
            link.restart_numbering()
            self._replay_to(dest)

    def _reroute_departed(self, dest: str) -> None:
        """A successor we have removed (its deletion round) came back as a new incarnation while
        it still had batches of ours unacked: it is departing, its successors have removed it
        too (they refuse its data), so replayed to it they were stranded for good and replayed
        every few seconds (CHANGELOG.md, defect A). They go to our current successors
        instead, under their input index (nothing is acked upstream before they are acked
        again). Records the departed copy had already forwarded come twice: the sink drops them
        by id (INVARIANT 2). Keyless successors only: a keyed copy handed its state over with
        those records applied, so we replay to it as before (docs/reliability.md)."""
        link = self.links[dest]
        if self.router.key is not None or not self.router.succs:
            self._replay_to(dest)
            return
        batches = link.unacked()
        records = 0
        for u in reversed(batches):  # put_back prepends: the oldest ends first
            env = u.payload if isinstance(u.payload, Envelope) else decode(u.payload)
            self.outbox.put_back(list(env.body), u.low, self.now)
            records += len(env.body)
        del self.links[dest]
        self.stats["departed_rerouted"] += records
        log.warning("%s left our table and came back as a new incarnation: %d unacked batches (%d records) "
                    "re-routed to our successors", dest, len(batches), records, extra=self.ctx)

    def _replay_to(self, dest: str, renumber: bool = True, why: str = "silent link") -> None:
        """Send every batch `dest` has not acked again.

        renumber=True (a new epoch on either side): renumbered on the current channel. A worker
        restarted with the same identity has lost the batches it had taken from the broker but
        not yet forwarded; we still hold them (replay buffer). Records it had already forwarded
        come twice: the sink drops duplicate record ids, but only when the copy reaches the same
        sink instance.

        renumber=False (a silent link, same incarnations): each batch goes again under its first
        number and epoch, so the receiver's channel drops the ones it already has (a slow
        successor, the usual reason for the silence) and delivers only the ones really lost.
        Renumbered, a slow successor processed them twice and, round-robin over several sink
        instances, the second copy reached another sink, which cannot drop it
        (CHANGELOG.md, "Duplicates across sink instances under plain overload")."""
        link = self.links[dest]
        old = link.unacked()
        if not old:
            return
        now = self.now
        for u in old:
            # A chained successor's batches are kept as the Envelope handed over, not as bytes.
            env = u.payload if isinstance(u.payload, Envelope) else decode(u.payload)
            if not renumber and env.epoch == self.epoch:
                link.resent(u.seq, now)
                if isinstance(u.payload, Envelope):
                    self._hand(dest, env)
                else:
                    self._publish_tracked(dest, u.payload, self.tracker.last_index + 1)
                continue
            items = env.body
            seq = self.outbound.take(dest)
            if isinstance(u.payload, Envelope):
                again = Envelope(self.spec.instance, self.epoch, seq, Kind.DATA, items, floors=env.floors,
                                 watermark=env.watermark)
                link.replace(u.seq, seq, again, now)
                self._hand(dest, again)
                continue
            payload = encode_data(self.spec.instance, self.epoch, seq, items, env.floors, env.watermark)
            link.replace(u.seq, seq, payload, now)
            self._publish_tracked(dest, payload, self.tracker.last_index + 1)
        self.stats["replayed_batches"] += len(old)
        log.warning("replayed %d unacked batches to %s%s", len(old), dest,
                    "" if renumber else f" under their own numbers ({why})", extra=self.ctx)

    def _on_ack(self, env: Envelope) -> None:
        self.stats["acks_in"] += 1
        link = self.links.get(env.sender)
        epoch, upto = env.body
        if self.scaling is not None and list(env.body) == [0, 0] and self.scaling.on_idle_ping(env.sender):
            return  # an idle copy asks for its Start
        if epoch != self.epoch:
            self.stats["stale_acks"] += 1  # for a dead incarnation
            return
        if link is not None:
            link.ack(upto, self.now)
            if link.inflight == 0 and env.sender not in self.router.succs:
                del self.links[env.sender]  # a departed successor acked everything we sent it

    def _has_ready_input(self, now: float) -> bool:
        if not any(self.queues.values()):
            return False
        if self.sink_wait and not self.operator.writable():
            return False  # spool full: only a release (seen in settle) can help
        return now >= self.busy_until and self.outbox.pending < self.high_water

    def _backpressured(self) -> bool:
        """Held back by what comes after us: successors without credit, or the sink's spool full."""
        return self.outbox.pending >= self.high_water or bool(self.sink_wait and not self.operator.writable())

    def _data_blocked(self, now: float) -> bool:
        if self.scaling is not None and not self.scaling.data_enabled:
            return True  # idle new instance: keep input until Start (Algorithm 6)
        if now < self.busy_until:
            return True  # emulated service time
        if self.sink_wait and not self.operator.writable():
            self.stats["spool_stalls"] += 1
            return True  # back pressure: the sink's spool is at its cap, stop reading (acks stop)
        if self.outbox.pending >= self.high_water:
            self.stats["credit_stalls"] += 1
            return True  # back pressure: successors have no credit, stop reading
        return False

    def _process(self, now: float) -> None:
        """Handle queued envelopes, round-robin over senders, each sender strictly in order
        (three exceptions: `_duplication_acks_ahead`, `_duplications_ahead`, `_eos_ahead`). `now`
        stays the event's: an emulated service time ends this turn's data; the next Tick goes on."""
        if self.scaling is not None and self.scaling.duplicating:
            self._duplication_acks_ahead()
        if self._dup_behind_data:
            self._duplications_ahead()
        if self._eos_behind_data:
            self._eos_ahead()
        progress = True
        while progress:
            progress = False
            for sender in list(self.queues):
                q = self.queues[sender]
                if not q:
                    continue
                env = q[0]
                if env.kind is Kind.DATA:
                    if self._data_blocked(now):
                        continue
                    q.popleft()
                    self._process_data(env, now)
                    progress = True
                else:
                    if self.scaling is not None and self.scaling.blocked:
                        continue  # earlier outputs still running: keep the order of effects
                    q.popleft()
                    self._on_protocol(env)
                    progress = True

    def _duplication_acks_ahead(self) -> None:
        """While our duplication round waits for its acks, a predecessor's `duplication_ack`
        queued behind that predecessor's DATA batches is handled now instead of after them.

        Why: the creator of a copy is by definition overloaded, so its predecessors' data queue
        up to a credit window in front of their acks (with a Raspberry-Pi-like 4 ms per record
        and batches of 100: seconds), and the copy would get its Start only after the creator
        worked through all of it: most of decision -> first record (`bench rescale`).
        Why it is safe: handling a duplication ack changes none of our routing tables (our
        preds and succs stay as they are; the ack only completes the round and sends Start with
        the tables we already use), and the data batches it overtakes are still processed by us,
        in their order, right after. Only DATA is overtaken, never a protocol message (a
        neighbour's own round must be applied before our Start carries our tables), and never
        while our earlier outputs are still being performed. Deletion acks never move: invariant 1
        needs a deletion_ack handled after every batch its sender sent before it."""
        sc = self.scaling
        assert sc is not None
        if not sc.blocked:
            self._ahead_of_data("duplication_ack", "acks_ahead_of_data", lambda: not sc.blocked and sc.duplicating)

    def _ahead_of_data(self, msg_type: str, stat: str, go_on: Callable[[], bool]) -> bool:
        """In each sender's queue that starts with DATA, the first envelope that is not DATA is
        handled now if it is a protocol message of `msg_type` (and stays otherwise: it decides
        for what follows it). Stops when `go_on()` turns false after one: False then."""
        for q in list(self.queues.values()):
            if len(q) < 2 or q[0].kind is not Kind.DATA:
                continue
            for i, env in enumerate(q):
                if env.kind is Kind.DATA:
                    continue
                if env.kind is Kind.PROTO and isinstance(env.body, dict) and env.body.get("type") == msg_type:
                    del q[i]
                    self.stats[stat] += 1
                    self._on_protocol(env)
                break  # the first non-data envelope decides
            if not go_on():
                return False
        return True

    def _duplications_ahead(self) -> None:
        """A predecessor's `duplication` (it announces a copy of itself) queued behind that
        predecessor's DATA batches is handled now instead of after them: the mirror of
        `_duplication_acks_ahead`, on the successor's side of the same round.

        Why: the creator's round waits for every neighbour's ack, and a successor that is itself
        loaded (the demo's keyed `route_counts` behind `in_zone`, 4 ms per record) has up to a
        credit window of the creator's data in front of the duplication: `in_zone`'s round took
        3.7-4.7 s of the demo's 4.8 s decision -> first record outliers (docs/measurement.md,
        "decision -> first record in the demo"). Why it is safe: the duplication only adds the
        copy to our predecessors (the core acks it; no successor of ours changes, no record of
        the creator is moved or dropped), and a copy sends nothing before its Start, which needs
        our ack: the creator could as well have sent the duplication before those batches. The
        overtaken batches are processed right after, in their order. Only DATA is overtaken,
        never a protocol message (a creator's Eos or Deletion keeps its place: invariant 1), only
        while we forward (the core updates its tables then) and never while our earlier outputs
        are being performed."""
        sc = self.scaling
        if sc is None or sc.core.state not in FORWARDING:
            self._dup_behind_data = False
            return
        if sc.blocked:
            return  # asked again next turn
        self._dup_behind_data = not self._ahead_of_data(
            "duplication", "duplications_ahead_of_data",
            lambda: not sc.blocked and sc.core.state in FORWARDING)  # stopped: the other queues next turn

    def _eos_ahead(self) -> None:
        """A predecessor's Eos of group g queued behind that predecessor's DATA batches, none of
        which holds a record of g, is handled now instead of after them (docs/operators.md, "Key
        groups that move").

        Why: we hand groups out because we are overloaded, so each predecessor's batches queue
        here up to its credit window, and every Eos waited for all of them, every predecessor's
        queue drained round-robin at our service time: 0.9-2.6 s of a keyed copy's hand-over in
        the demo (docs/measurement.md, "decision -> first record in the demo"). Why it is safe:
        the Eos says the predecessor sends no more of g to us; every record of g it sent before
        is either applied here already or in a batch ahead of the Eos, and we only move the Eos
        when no batch ahead carries one, so g's state is final here exactly as if the batches
        had been processed (they hold only other groups, still ours or still moving, processed
        right after in their order). An Eos overtakes DATA and other Eos only (each concerns its
        own group), never another protocol message (invariant 1), never while our earlier
        outputs are being performed."""
        assert self.moves is not None
        if self.scaling is not None and self.scaling.blocked:
            return  # asked again next turn
        self._eos_behind_data = False
        moves = self.moves
        for q in list(self.queues.values()):
            if len(q) < 2 or q[0].kind is not Kind.DATA:
                continue
            ahead: Set[int] = set()  # groups of the records in the batches ahead
            i = 0
            while i < len(q):
                env = q[i]
                if env.kind is Kind.DATA:
                    ahead |= moves.groups_in(env.body)
                    i += 1
                    continue
                body = env.body
                if env.kind is not Kind.PROTO or not isinstance(body, dict) or body.get("type") != "eos":
                    break  # any other protocol message keeps its place, and what follows it
                g = body.get("g")
                if type(g) is int and g not in ahead:  # a malformed one keeps its place (decoded there)
                    del q[i]
                    self.stats["eos_ahead_of_data"] += 1
                    self._on_protocol(env)
                    if self.scaling is not None and self.scaling.blocked:
                        self._eos_behind_data = True
                        return
                    continue
                i += 1

    def _process_data(self, env: Envelope, now: float) -> None:
        items: List[Item] = env.body
        n = len(items)
        if not n:  # a watermark alone: after every earlier batch of its sender, never acked itself
            if self.marks is not None and env.watermark is not None:
                self._take_mark(env.sender, self.tracker.last_index, env.watermark, now)
            return
        if self.first_record_at is None:
            self.first_record_at = self.wall()  # wall clock: compared across processes (bench)
        self.stats["records_in"] += n
        self.stats["batches_in"] += 1
        index = self.tracker.processed(env.sender, env.seq, env.epoch)
        if env.floors:
            self._note_floors(env.floors)
        t0 = self.perf()
        if self.is_sink:
            self._record(items, index, env)
        elif self.keyed is not None:
            if self.moves is not None:
                items = self.moves.admit(env.sender, items, index)  # a group on its way here waits
            out = self.keyed.apply(env.sender, items, index, env.floors)
            if out:
                self._forward(out, index, now)
            if self.marks is not None and env.watermark is not None:
                self._take_mark(env.sender, index, env.watermark, now)
        else:
            out = self._apply(items)
            self.stats["filtered"] += n - len(out)
            if out:
                if not self.router.succs:
                    raise RuntimeError(f"{self.spec.instance}: records to forward but no successors")
                if len(out) == n and getattr(self.operator, "unchanged", False) and self.router.key is None:
                    body = data_body_bytes(env)  # passed on whole and unchanged: forward its bytes
                    if body is not None:
                        out = Passed(out, body)
                        self.stats["passed_batches"] += 1
                self._forward(out, index, now)
            if self.marks is not None and env.watermark is not None:
                self.marks.note(env.sender, index, env.watermark)
        self.signals.processed(n, self.perf() - t0 + n * self.service_time)
        if self.service_time:
            self.busy_until = max(self.busy_until, now) + n * self.service_time

    def _take_mark(self, sender: str, index: int, mark: Mark, now: float) -> None:
        """`sender`'s mark after the batch processed as input `index` (its records judged first);
        a keyed instance's watermark follows the least over its inputs and its due timers fire."""
        assert self.marks is not None
        self.marks.note(sender, index, mark)
        if self.keyed is not None and self.keyed.flowing:
            self._take_mark_changed(now, index)

    def _take_mark_changed(self, now: float, index: Optional[int] = None) -> None:
        """The least mark over the inputs may have risen: a keyed instance follows it and fires
        what came due (outputs under input `index`, else the latest)."""
        assert self.marks is not None and self.keyed is not None
        if index is None:
            index = self.tracker.last_index
        cur = self.marks.current()
        if cur is None or (self.keyed.max_time is not None and cur.value <= self.keyed.max_time):
            return
        self.keyed.max_time = cur.value
        out = self.keyed.fire_due(index)
        if out:
            self._forward(out, index, now)

    def _out_mark(self, now: float) -> Optional[Mark]:
        """The mark this instance may pass on now: the least over its inputs of what acked
        inputs carried (a source: what its acked polls made), less the own lateness of a keyed
        operator that fires by the watermark (its windows close that much later, and their
        outputs must not be late); one that keeps its own watermark (the DEBS merges) passes
        the marks on as they are."""
        marks = self.marks
        assert marks is not None
        if self.source_marks is not None:
            m = self.source_marks.mark(now)
            ch = marks.inputs.get("")
            if m is not None and (ch is None or ch.noted != m.value or ch.noted_idle != m.idle):
                marks.note("", self.tracker.last_index, m)  # a change without records: idleness
        marks.release(self._lowest_pending())
        out = marks.current() if FAULT_MARKS_UNACKED in self.faults else marks.forwardable()
        if out is not None and self.keyed is not None and self.keyed.op.uses_event_time and self.keyed.op.lateness_ms:
            out = Mark(max(-MAX_MARK_MS, out.value - self.keyed.op.lateness_ms), out.idle)
        return out

    def _send_marks(self, now: float, mark: Optional[Mark]) -> None:
        """`mark` alone to every successor that has not had it for MARK_PERIOD: outside the
        replay buffer and the credit window (the next one carries it again), never acked."""
        if mark is None:
            return
        for dest in self.router.succs:
            last = self._marks_sent.get(dest)
            period = MARK_PERIOD if dest in self.links else MARK_PERIOD_UNLINKED
            if last is not None and (last[0] == mark or now - last[1] < period):
                continue
            seq = self.outbound.take(dest)
            if dest in self.local:
                self._hand(dest, built(self.spec.instance, self.epoch, seq, Kind.DATA, [], None, mark))
            else:
                self._publish_tracked(dest, encode_data(self.spec.instance, self.epoch, seq, [], None, mark), None)
            self._marks_sent[dest] = (mark, now)
            self.stats["marks_sent"] += 1

    def _apply(self, items: List[Item]) -> List[Item]:
        try:
            return self.operator.process(items)
        except Exception:  # noqa: BLE001 - a user function failed: isolate the bad record(s)
            out: List[Item] = []
            for it in items:
                try:
                    out.extend(self.operator.process([it]))
                except Exception as exc:  # noqa: BLE001
                    self.stats["operator_errors"] += 1
                    if self.stats["operator_errors"] <= 5:
                        log.warning("operator failed on record %s:%s: %r", it[0], it[1], exc, extra=self.ctx)
            return out

    def _record(self, items: List[Item], index: int, env: Optional[Envelope] = None) -> None:
        op = self.operator
        if getattr(op, "deferred", False):
            pubs = op.record_batch(items, data_body_bytes(env) if env is not None else None)
            self.sink_wait.append(index)  # acked only once settle() says it is recorded
        else:
            pubs = op.record(items)
        for pub in pubs:
            self._publish_tracked(RAW_TOPIC + pub.topic, pub.payload, index)
        self.stats["records_out"] += len(items)

    def _settle_sink(self) -> None:
        """A deferred sink (spilling to its spool): release the inputs it has now recorded, and
        publish its events (spool_full / spool_resumed: back pressure is never silent)."""
        op = self.operator
        if not isinstance(op, SinkOperator):
            return
        if op.deferred:
            for _ in range(op.settle()):
                self.sink_wait.popleft()
        for ev in op.take_events():
            self._publish_spool_event(ev)

    def _publish_spool_event(self, ev: Dict[str, Any]) -> None:
        what = str(ev.pop("event", ""))
        etype = {"spool_full": "spool_full", "spool_resumed": "spool_resumed", "recovered": "spool_recovered"}.get(what)
        if etype is None:
            return
        if what == "spool_full":
            log.warning("spool at its cap (%s bytes): holding input back", ev.get("used_bytes"), extra=self.ctx)
        try:
            e = events.make(etype, ts=self.wall(), node=self.spec.node, instance=self.spec.instance,
                            operator=self.spec.operator, pipeline=self.spec.pipeline,
                            detail={"source": "worker", **{k: v for k, v in ev.items() if k != "node"}})
        except ValueError as exc:
            log.warning("spool event %s not published: %s", what, exc, extra=self.ctx)
            return
        self.notify(topics.events(self.spec.cluster), e.to_json().encode(), qos=1)
        self.stats["spool_events"] += 1

    def _on_protocol(self, env: Envelope) -> None:
        body = env.body
        if isinstance(body, dict) and body.get("type") in group_moves.HANDOVER_TYPES:
            self.stats["handover_in"] += 1
            self.stats["handover_bytes_in"] += group_moves.body_size(body)
            if body["type"] == "redirect" and self.next_keyed:
                try:
                    msg, _ = group_moves.decode(env.sender, body, self.router.groups)
                except ValueError as exc:
                    self.handover_error(env.sender, str(exc))
                    return
                if self.router.table is None:  # an idle copy: its table comes with its Start
                    if len(self._redirects_waiting) < self.router.groups:
                        self._redirects_waiting.append((env.sender, msg))
                    return
                self._take_redirect(env.sender, msg)
            elif self.moves is not None:
                self.moves.on_message(env.sender, body)
            else:
                self.handover_error(env.sender, f"{body['type']} to an instance that is not keyed")
            return
        if self.scaling is None:
            self.stats["protocol_in"] += 1
            self.stats["protocol_errors"] += 1
            if env.sender not in self._malformed_logged:  # logged once per sender (invariant 5)
                self._malformed_logged.add(env.sender)
                log.warning("protocol message from %s but scaling is off: ignored", env.sender, extra=self.ctx)
            return
        self.scaling.handle(env)


    # ---- source -----------------------------------------------------------------------------------

    def _ingest(self, ev: EnvelopeReceived) -> None:
        """A delivery on a source's ingest topic. A sensor source keeps its token with the record
        until a successor acks the record (`_settle_ingest`); any other source has it acked at
        once (agent.operators.sources)."""
        if self.source.topic is None:
            return
        if self.source.sensor:
            self.operator.ingest(ev.topic, ev.payload, ev.token, ev.dup)
            return
        self.operator.ingest(ev.topic, ev.payload)
        if ev.token is not None:
            self._out.append(AckIngest((ev.token,)))

    def _settle_ingest(self) -> None:
        """PUBACK the ingest deliveries whose records a successor has acked."""
        tokens = self.operator.settled(self.source_resume_seq())
        if tokens:
            self._out.append(AckIngest(tuple(tokens)))

    def _number_source(self, wall: float, pos: Optional[Dict[str, Any]], logged: Optional[List[Any]]) -> None:
        """A source whose records cannot be generated again (taxi.MqttIngestSource): the logged
        records its successors had not acked go out again first, under their numbers; new ones are
        numbered above every number an earlier incarnation can have used: its saved reservation,
        and the wall clock in microseconds for when that file is gone with its node."""
        floor, resume_from = int(wall * 1e6), 0
        if isinstance(pos, dict):
            for key in ("generated", "reserved"):
                try:
                    floor = max(floor, int(pos.get(key, 0)))
                except (TypeError, ValueError):
                    pass
            try:
                resume_from = int(pos.get("resume_from", 0))
            except (TypeError, ValueError):
                pass
        self.operator.number_from(floor)
        if logged:
            self.operator.replay(logged, resume_from)
        log.info("source numbers its records from %d", floor, extra=self.ctx)

    def _log_ingest(self) -> None:
        """The records just polled, to the ingest log before they leave (`LogIngest` precedes the
        flush's Publish commands)."""
        entries = self.operator.take_log()
        if entries:
            self._out.append(LogIngest(tuple(entries), self.source_resume_seq()))

    def _can_produce(self) -> bool:
        # A paused source has nothing due: without this check its next_due() says "now" and the
        # loop polls it in a busy spin (measured: ~25k empty loop turns/s, a whole core). Unless
        # it still sends again what its previous incarnation may have sent (taxi.TaxiSource.catching_up).
        return (
            not self.stopping
            and (not getattr(self.operator, "paused", False) or getattr(self.operator, "catching_up", False))
            and self.outbox.pending < self.high_water
            and bool(self.router.succs)
            and (self.scaling is None or self.scaling.data_enabled)
        )

    def _produce(self, now: float) -> None:
        if not self._can_produce():
            return
        budget = self.high_water - self.outbox.pending
        generated = int(getattr(self.operator, "generated", 0))
        if generated + budget > self._source_reserved:
            # Reserve ahead on disk before generating past the last reservation: a restarted
            # source regenerates up to it, so it never reports fewer records than were sent.
            self._source_reserved = generated + budget + self._reserve_span(now, generated)
            self._write_source_stats()
        items = self.operator.poll(now, budget)
        if items:
            self._period_records += len(items)
            self.stats["records_in"] += len(items)
            index = self.tracker.produced()
            self._source_first[index] = items[0][1]
            if self.source_marks is not None:
                self._observe(items, index, now)
            self._forward(items, index, now)
            if self.source.sensor:
                self._log_ingest()

    def _observe(self, items: List[Item], index: int, now: float) -> None:
        """The source's records' event times, into its watermark (noted at this poll's index)."""
        sm, conf = self.source_marks, self.wm_conf
        assert sm is not None and conf is not None and self.marks is not None
        late = sm.late
        for _, _, rec in items:
            t = parse_event_time(rec.get(conf.time_field), conf.time_unit) if type(rec) is dict else None
            if t is not None:
                sm.observe(t, now)
        self.stats["late_at_source"] += sm.late - late
        m = sm.mark(now)
        if m is not None:
            self.marks.note("", index, m)

    def _reserve_span(self, now: float, generated: int) -> int:
        """Records to reserve past this poll: RESERVE_SECONDS of the rate measured since the last
        reservation, within [SOURCE_RESERVE, SOURCE_RESERVE_MAX]."""
        last, self._reserved_at = self._reserved_at, (now, generated)
        if last is None or now <= last[0]:
            return SOURCE_RESERVE
        rate = (generated - last[1]) / (now - last[0])
        return int(min(SOURCE_RESERVE_MAX, max(SOURCE_RESERVE, rate * RESERVE_SECONDS)))

    def source_resume_seq(self) -> int:
        """The first record seq that a restarted source must generate again: the first of the
        oldest poll whose records are not all acked by a successor yet (buffered, unPUBACKed, or
        in a replay buffer). Everything below it has been processed and forwarded downstream, so
        regenerating from here (the generator is deterministic) loses nothing; records above it
        that already got through arrive twice and the sink drops them by id."""
        low = self._lowest_pending()
        for index in [i for i in self._source_first if low is None or i < low]:
            del self._source_first[index]  # fully acked: forget
        if low is None or not self._source_first:
            return int(getattr(self.operator, "generated", 0))
        return self._source_first[min(self._source_first)]

    # ---- output -----------------------------------------------------------------------------------

    def _credit(self, dest: str) -> int:
        link = self.links.get(dest)
        return self.op.max_inflight_batches if link is None else link.credit

    def _forward(self, items: List[Item], index: int, now: float) -> None:
        """Buffer the outputs of input `index`: a record sent before goes to the same successor
        again while it is in our table, nowhere once that successor left (INVARIANT 8,
        agent.dataplane.sticky), the rest as routed."""
        if self.sticky:
            items, pinned, gone = self.routes.split(items, self.router.succs)
            for dest, recs in pinned.items():
                self.outbox.add_to(dest, recs, index, now)
            if gone and FAULT_ROUTE_PAST_DEPARTED in self.faults:
                items = items + gone
            elif gone:
                # Their successor left after draining them (INVARIANT 4): they are further
                # down already, and another instance would take them twice (INVARIANT 8).
                self.stats["resent_past_departed"] += len(gone)
        self.outbox.add(items, index, now)

    def flush(self, now: float, force: bool = False) -> None:
        if self.outbox.pending == 0:
            return
        if FAULT_RETRY_ONLY_WITH_DATA in self.faults:
            self._publish_retries()
        draining = self.stopping or (self.scaling is not None and self.scaling.draining)
        # A source's floor before its batches leave the outbox: taken out, they are pending
        # nowhere until link.sent, and the claim would cover them.
        own = {self.spec.instance: self.source_resume_seq()} if self.is_source else None
        mark = self._out_mark(now) if self.marks is not None else None
        batches = self.outbox.take(now, self._credit, force=force or draining)
        if not batches and self.outbox.pending >= self.outbox.batch_size:
            self.stats["credit_stalls"] += 1
        if batches and self.sticky:
            # Write-ahead (INVARIANT 8): where these records go is on disk before they go, so a
            # crash cannot lose the destination of a record its predecessors will replay.
            for dest, items, _ in batches:
                self.routes.sent(dest, items, self.tracker.last_index)
            self._out.append(SaveRoutes(*self.routes.take_save(now)))
        for dest, items, low in batches:
            if dest not in self.router.succs:
                # Cannot happen (the outbox routes over the current table); counted if it does.
                self.stats["sends_to_non_successor"] += 1
                log.error("BUG: batch routed to %s which is not a successor", dest, extra=self.ctx)
            link = self.links.get(dest)
            if link is None:
                link = self.links[dest] = OutLink(dest, self.op.max_inflight_batches)
            seq = self.outbound.take(dest)
            floors = own or self._floors_for(items)
            if mark is not None:
                self._marks_sent[dest] = (mark, now)
            if dest in self.local:  # chained: no encoding, no broker (docs/runtime.md, "Chaining")
                env = built(self.spec.instance, self.epoch, seq, Kind.DATA, items, floors, mark)
                link.sent(seq, env, len(items), now, low)  # replay buffer: kept until dest acks
                self._hand(dest, env)
            else:
                payload = encode_data(self.spec.instance, self.epoch, seq, items, floors, mark)
                link.sent(seq, payload, len(items), now, low)  # replay buffer: kept until dest acks
                self._publish_tracked(dest, payload, low)
            self.stats["batches_out"] += 1
            self.stats["records_out"] += len(items)

    def _note_floors(self, floors: Dict[str, int]) -> None:
        """Keep the largest floor claimed per source (a claim stays true once made, so the order
        claims arrive in does not matter: agent.instance.applied)."""
        kept = self._floors
        for src, f in floors.items():
            old = kept.get(src)
            if old is None:
                if len(kept) >= FLOORS_KEPT:
                    continue  # only costs the keyed operator a longer list of ranges
                kept[src] = f
            elif f > old:
                kept[src] = f

    def _floors_for(self, items: List[Item]) -> Optional[Dict[str, int]]:
        """The floors a data batch carries: the ones we received for its records' sources (a
        source's own, the first number it has not seen acked end to end, is taken in `flush`)."""
        kept = self._floors
        if not kept:
            return None
        out: Dict[str, int] = {}
        for src in {it[0] for it in items}:
            f = kept.get(src)
            if f is not None:
                out[src] = f
                if len(out) >= MAX_FLOORS:
                    break
        return out or None

    def _publish_retries(self) -> None:
        """Publishes the client refused, in order, before anything newer (`_publish_tracked`).
        Every step, not only when there is data to flush: a sink or a departing copy has none,
        and an ack left here held back every later ack of a sink for good (docs/reliability.md)."""
        while self.retry:
            dest, payload, low = self.retry.popleft()
            self._issue(dest, payload, low, True)

    def _publish_tracked(self, dest: str, payload: bytes, low: Optional[int]) -> None:
        """Publish to `dest`'s inbox after whatever the client refused earlier (order). With
        `low`, the inputs from that index on stay unacked upstream until the broker PUBACKs (data
        we forward); None for our own acks and protocol messages, which carry no input.

        Per-node inboxes: a destination our binding table does not name yet (a new copy whose
        node's hosted record has not reached our agent; anything before our first table) waits in
        `unrouted`, in order, until a "hosts" line names it (`_on_hosts`)."""
        if self.per_node and not dest.startswith(RAW_TOPIC) and (dest in self.unrouted or dest not in self.hosts_bound):
            self._park(dest, payload, low)
        elif self.retry:
            self.retry.append((dest, payload, low))
        else:
            self._issue(dest, payload, low, False)

    def _park(self, dest: str, payload: bytes, low: Optional[int]) -> None:
        q = self.unrouted.get(dest)
        if q is None:
            q = self.unrouted[dest] = deque()
        if len(q) >= UNROUTED_MAX:
            # A destination no record ever lists (it died before its node published it): the
            # oldest goes; what it carried is still in our replay buffer (data) or resent by the
            # round on silence (protocol), should the destination appear after all.
            q.popleft()
            self.stats["unrouted_dropped"] += 1
        q.append((payload, low))

    def _topic(self, dest: str) -> str:
        if dest.startswith(RAW_TOPIC):
            return dest[1:]  # a sink operator's own publication (mqtt_sink), not an inbox
        if self.per_node:
            return topics.inbox_at(self.spec.cluster, self.hosts_bound[dest], dest, self.spec.node)
        return topics.inbox(self.spec.cluster, dest, self.spec.node)

    def _issue(self, dest: str, payload: bytes, low: Optional[int], retried: bool) -> None:
        if self.per_node and not dest.startswith(RAW_TOPIC) and dest not in self.hosts_bound:
            self._park(dest, payload, low)  # a retry whose binding a newer table no longer has
            return
        self._token += 1
        self._unconfirmed[self._token] = (dest, payload, low, retried)
        self._out.append(Publish(self._topic(dest), payload, self._token))

    def send_envelope(self, dest: str, kind: Kind, body: Any) -> None:
        """Acks and protocol messages: numbered on the same channel as the data (invariant 1)."""
        if dest in self.local:
            self._hand(dest, built(self.spec.instance, self.epoch, self.outbound.take(dest), kind, body))
        else:
            env = Envelope(self.spec.instance, self.epoch, self.outbound.take(dest), kind, body)
            self._publish_tracked(dest, encode(env), None)

    def _hand(self, dest: str, env: Envelope) -> None:
        """An envelope to a co-hosted instance (docs/runtime.md, "Chaining"). Its channel is
        numbered like any other (INVARIANT 1 holds as is), and a data batch stays in our replay
        buffer until `dest` acks it (flow control, acks and replay as over MQTT). Nothing is
        tracked as a publish: the hand-off cannot be refused, and what the broker's PUBACK
        guards (a message in flight that a crash could lose) does not exist in one process, which
        dies as a whole. The records of a data batch are handed as shallow copies: our replay
        buffer keeps the originals, so a successor that changes a record in place cannot change
        what a replay sends (about 10 us per 100 taxi records; 13% of a chain of 3's CPU, sampled).
        A successor in `local_keeps` promised never to change a record in place: no copy."""
        if env.kind is Kind.DATA:
            if dest not in self.local_keeps:
                env = built(env.sender, env.epoch, env.seq, Kind.DATA,
                            [(s, q, dict(r)) if type(r) is dict else (s, q, r) for s, q, r in env.body], env.floors,
                            env.watermark)
            self.stats["handed_out"] += 1
        self._out.append(Handoff(dest, env))

    def _lowest_pending(self) -> Optional[int]:
        """The lowest input index not to be acked upstream yet: its outputs are not all acked by
        the successors, or (keyed state) the state that reflects it is not saved yet."""
        low = fwd = self.lowest_forwarding()
        if self.keyed is not None and self.keyed.lowest_unsaved() is not None:
            k = self.keyed.lowest_unsaved()
            low = k if low is None else min(low, k)
        if self.moves is not None:
            # records held for a group on its way: acked once applied, saved and their outputs acked
            h = self.moves.lowest_held(fwd)
            if h is not None:
                low = h if low is None else min(low, h)
        return low

    def _save_keyed(self) -> None:
        """Keyed state, its input positions and the outputs not acked downstream, saved together
        (agent.instance.keyed_state) by the shell; only after it are the inputs it reflects acked
        upstream (`lowest_unsaved` holds them until then)."""
        assert self.keyed is not None
        self.keyed.prune_outputs(self.lowest_forwarding())
        self._out.append(SaveKeyed(self.keyed))
        if self.moves is not None:
            self.moves.saved()

    def save_keyed_now(self) -> None:
        """A hand-over changed the keyed state (a group out or in): saved before what follows."""
        self._save_keyed()
        self.mark_state_changed()
        self.persist(force=True)

    def forward_outputs(self, items: List[Item], index: int) -> None:
        """Outputs of held records applied once their group was installed (agent.instance.moves)."""
        self._forward(items, index, self.now)

    def log_limited(self, sender: str) -> bool:
        """May a warning about `sender` be logged now (bounded per sender and in all)?"""
        return self._refusals.allow((sender, "handover"), self.now)

    def send_handover(self, dest: str, msg: Any, extra: Optional[Dict[str, Any]] = None) -> None:
        """A hand-over message (agent.instance.moves) on the numbered channel to `dest`, counted
        apart from the paper's protocol messages."""
        body = group_moves.encode(msg)
        if extra:
            body.update(extra)
        self.send_handover_body(dest, body)

    def send_handover_body(self, dest: str, body: Dict[str, Any]) -> None:
        self.stats["handover_out"] += 1
        self.stats["handover_bytes_out"] += group_moves.body_size(body)
        self.send_envelope(dest, Kind.PROTO, body)

    def lowest_forwarding(self) -> Optional[int]:
        """The lowest input index whose outputs are not all acked by the successors yet.

        An input is acked upstream only when every record derived from it has been processed
        and forwarded by the NEXT instance too (its data ack), not merely PUBACKed by the broker:
        paho PUBACKs a delivery on receipt, so a batch in the broker is not safe once its
        receiver has taken it. If the receiver and we both restart (a whole node restarting),
        only an upstream replay buffer (or the source's resume position) still holds it."""
        lows = [lo for lo in (link.lowest_input() for link in self.links.values()) if lo is not None]
        lo = self.outbox.lowest_index()
        if lo is not None:
            lows.append(lo)
        if self.pending_pub:
            lows.append(min(self.pending_pub.values()))
        lows += [u[2] for u in self._unconfirmed.values() if u[2] is not None]
        lows += [r[2] for r in self.retry if r[2] is not None]
        lows += [u[1] for q in self.unrouted.values() for u in q if u[1] is not None]
        if self.sink_wait:
            lows.append(self.sink_wait[0])
        return min(lows) if lows else None

    def _send_acks(self, now: float) -> None:
        """Ack inputs processed AND forwarded (PUBACKed) or recorded; coalesced for ACK_DELAY."""
        low = self._lowest_pending()
        done = self.tracker.release(low)
        if self.sticky and not self.retry:  # an ack refused by the client is not on its way yet
            self.routes.released(self.tracker.last_index if low is None else low - 1, now)
        for sender, pos in done.items():
            if pos > self.ack_due.get(sender, (-1, 0)):
                self.ack_due[sender] = pos
        self._unacked_batches += self.tracker.last_released
        if not self.ack_due:
            return
        if self.ack_since is None:
            self.ack_since = now
        # One ack per `ack_every` batches (half the predecessor's window) or after
        # ACK_DELAY: credit comes back in time while acks cost a fraction of a message per batch.
        if self._unacked_batches >= self.ack_every or now - self.ack_since >= ACK_DELAY or self.stopping:
            for sender, (epoch, seq) in sorted(self.ack_due.items()):
                self.send_envelope(sender, Kind.ACK, [epoch, seq])
                self.stats["acks_sent"] += 1
            self.ack_due.clear()
            self.ack_since = None
            self._unacked_batches = 0

    # ---- routes (called by the scaling driver) -----------------------------------------------------

    def start_field(self, copy: str) -> Optional[Dict[str, Any]]:
        """The extra field of a Start we send `copy` (agent.instance.groups): our group table, and
        a keyed instance's share of its groups for the copy (agent.instance.moves)."""
        out = keygroup_table.start_field(self.router.table) if self.next_keyed else None
        if self.moves is not None:
            out = dict(out or {}, share=[list(x) for x in self.moves.share_for(copy)])
        return out

    def after_start(self, copy: str, preds: Any) -> None:
        """Our Start to `copy` is on its way: the moves of its share begin (docs/operators.md)."""
        if self.moves is not None:
            self.moves.start_share(copy, preds)

    def on_start_field(self, field: Any, succs: Tuple[str, ...]) -> None:
        """Our Start arrived (we are a copy; the Activate that follows sets `succs`): our
        creator's group table, or (keyed) the groups it hands us, before any record."""
        if self.next_keyed:
            self.router.table = keygroup_table.table_from_start(field, succs, self.router.groups, self.ctx)
            self.mark_state_changed()
            waiting, self._redirects_waiting = self._redirects_waiting, []
            for sender, msg in waiting:  # came before our Start (another channel): taken now
                self._take_redirect(sender, msg)
        if self.moves is not None and self.scaling is not None and self.scaling.core.creator:
            self.moves.take_share(field, self.scaling.core.creator)
            self.mark_state_changed()

    def stamp_decision(self, key: str) -> None:
        """Wall time of a step of our current scale-out on its decision record (agent.instance.driver)."""
        if self.scaling is not None:
            self.scaling.stamp_decision(key)

    def groups_moved(self) -> None:
        """The key groups our last scaling decision moved are installed at their new owners (their
        held records applied): stamped on that decision (`bench`, docs/operators.md)."""
        if self.scaling is not None:
            self.scaling.stamp_moved()

    def on_preds_changed(self, added: Tuple[str, ...], removed: Tuple[str, ...]) -> None:
        """A predecessor's round reached us (the driver calls this after the core applied it):
        the groups moving out wait for a new predecessor's Eos too (its table may route them
        here), and a departed one's Eos is not awaited (its deletion is behind all it sent us).
        A departed one's watermark no longer holds ours back (its deletion is behind its data)."""
        if self.marks is not None:
            for p in removed:
                self.marks.remove_input(p)
            if self.keyed is not None and self.keyed.flowing and removed:
                self._take_mark_changed(self.now)
        if self.moves is None:
            return
        for p in added:
            if group_moves.FAULT_NO_ADD_PRED not in self.faults:
                self.moves.perform(self.moves.member.add_pred(p))
        for p in removed:
            if group_moves.FAULT_NO_REMOVE_PRED not in self.faults:
                self.moves.perform(self.moves.member.remove_pred(p, self.moves.snapshot))
        self.mark_state_changed()

    def set_routes(self, succs: Tuple[str, ...], now: float) -> None:
        """INVARIANT 3 (route change before ack): the data path uses `succs` when this returns;
        the scaling driver sends the ack that follows only afterwards (same thread, in order)."""
        old = set(self.router.succs)
        self.router.set_succs(succs)
        moved = self.outbox.reroute(now)
        for gone in old - set(succs):
            self._sent_to_removed.add(gone)
        log.info(
            "routes: succs %s -> %s (%d buffered records re-routed)", sorted(old), sorted(succs), moved, extra=self.ctx
        )

    def drained(self) -> bool:
        """Every data batch received is processed, forwarded, acked by the successors, and acked
        upstream (queued protocol messages do not count: they may wait behind the drain)."""
        return (
            not any(e.kind is Kind.DATA for q in self.queues.values() for e in q)
            and self.outbox.pending == 0
            and not self.pending_pub
            and not self._unconfirmed
            and not self.retry
            and not self.unrouted
            and all(link.inflight == 0 for link in self.links.values())
            and self.tracker.waiting() == 0
            and not self.ack_due
            and not self.sink_wait
            and (self.moves is None or not self.moves.member.busy())  # a key group half moved stays
        )


    # ---- heartbeat, persistence ---------------------------------------------------------------------

    def snapshot_stats(self) -> Dict[str, Any]:
        """The heartbeat's stats (the shell adds its transport's: paho_out, connected)."""
        s: Dict[str, Any] = dict(self.stats)
        s.update(
            instance=self.spec.instance,
            operator=self.spec.operator,
            load=round(self._last_load, 1),
            succs=list(self.router.succs),
            inflight={d: link.inflight for d, link in self.links.items()},
            outbox=self.outbox.pending,
            queued=sum(len(q) for q in self.queues.values()),
            gaps_skipped=self.inbound.gaps_skipped,
            inbound_senders=self.inbound.senders(),
            held=self.hold.count,
            reorder_waiting=self.inbound.waiting_total(),
            gaps=self.inbound.gaps(),
            unpubacked=len(self.pending_pub) + len(self.retry) + len(self._unconfirmed),
            unrouted=sum(len(q) for q in self.unrouted.values()),
            routes_remembered=len(self.routes),
            records_pinned=self.routes.pinned,
            service_time_ms=self.service_time * 1000,
            live_capacity=round(self.live_capacity.value, 2),
            online_service_time_ms=(round(self.live_capacity.service_time * 1000, 4)
                                    if self.live_capacity.service_time else None),
            signals=self.last_signals.to_stats() if self.last_signals is not None else None,
            first_record_at=self.first_record_at,
            activated_at=self.activated_at,
            at=self.wall(),
        )
        s.update(self.operator.stats())
        if self.keyed is not None:
            s.update(self.keyed.stats())
        if self.moves is not None:
            s.update(self.moves.stats())
        if self.scaling is not None:
            s.update(self.scaling.stats())
        return s

    def _heartbeat(self, now: float) -> None:
        self._last_heartbeat = now
        self.emit("heartbeat", stats=self.snapshot_stats())
        if self.is_source and now - self._last_source_write >= 2.0:  # a rename costs ~5-20 ms here
            self._last_source_write = now
            self._write_source_stats()

    def take_signals(self, now: float) -> Signals:
        """Close the live-signal period (the decision period) and feed the online capacity."""
        sig = self.signals.take(now, self.cpu())
        self.live_capacity.update(sig.busy, sig.processed)
        self.last_signals = sig
        return sig

    def measure_load(self, now: float) -> float:
        """Records received per second since the last call (the paper's l_t, per second)."""
        dt = max(1e-6, now - self._period_start)
        load = self._period_records / dt
        self._period_records = 0
        self._period_start = now
        self._last_load = load
        return load

    def _write_source_stats(self) -> None:
        if not self.is_source:
            return
        data = {"instance": self.spec.instance, **self.operator.stats(), "resume_from": self.source_resume_seq(),
                "reserved": self._source_reserved, "profile_started_at": self._source_started_at}
        self._out.append(PersistSource(data))

    def persisted_state(self) -> Dict[str, Any]:
        """What a restart needs: epoch, channel positions, the scaling driver's state."""
        data: Dict[str, Any] = {"epoch": self.epoch, "inbound": self.inbound.snapshot()}
        if self.router.table is not None:
            data["group_table"] = self.router.table.to_wire()  # with the routing tables (the core's)
        if self.moves is not None:
            data["moves"] = self.moves.dump()
        if self.scaling is not None:
            data.update(self.scaling.persisted())
        return data

    def persist(self, force: bool = False) -> None:
        """Persist what a restart needs (cheap: a small JSON file, at most every STATE_PERIOD
        unless the protocol state changed)."""
        now = self.now
        if not force and not self._state_dirty and now - self._last_state_write < STATE_PERIOD:
            return
        self._out.append(Persist(self.persisted_state()))
        self.inbound.changed = False
        self._state_dirty = False
        self._last_state_write = now

    def mark_state_changed(self) -> None:
        self._state_dirty = True

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


def _guess_sender(payload: bytes) -> str:
    try:
        msg = json.loads(payload)
        if isinstance(msg, list) and len(msg) > 1 and isinstance(msg[1], str):
            return msg[1][:64]
    except (ValueError, TypeError, RecursionError):
        pass
    return "<unknown>"
