"""The worker process: one operator instance (`python -m agent.instance.worker`).

Reads one `InstanceSpec` JSON line on stdin, then speaks the control channel of
`agent.instance.spec` (JSON lines: stdout to the agent, stdin from it; logs on stderr).

One thread owns everything that matters: the paho client (transport.py), the channels, the flow
control, the operator and the scaling core. A second thread only reads stdin lines into a queue.
The main loop:

    poll MQTT (callbacks only enqueue) -> sequence inbox envelopes per sender (channel.Inbound)
    -> process each sender's envelopes in its order (data through the operator into the outbox,
       protocol messages into the scaling core, whose outputs run strictly in order)
    -> send full / lingered batches to successors that have credit (flow.OutLink)
    -> acknowledge upstream the inputs whose outputs are all PUBACKed (flow.AckTracker)
    -> every period: the scaling decision with the measured load; every heartbeat: stats.

Extra control lines this worker understands besides the contract's "stop" and "spawned":
    {"event": "set", "service_time_ms": 20.0}   change the emulated per-record cost (tests, demo)
    {"event": "set", "paused": true}             pause / resume a source
    {"event": "set", "pinned": true}             fogctl scale pinned the count: no automatic decision
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import threading
import time
import zlib
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Set, TextIO, Tuple

from agent import topics
from agent.config import RUNTIME_POLICIES, PipelineConfig, load_pipeline_text
from agent.dataplane.inbound import ACCEPT, HOLD, REFUSE, HoldBuffer, LogLimiter, numbering_fault, writer_verdict
from agent.dataplane.channel import Inbound, Outbound
from agent.dataplane.envelope import Envelope, Item, Kind, MalformedEnvelope, data_body_bytes, decode, encode, encode_data
from agent.dataplane.flow import AckTracker, OutLink
from agent.operators.admission import OperatorRefused, node_allow_list
from agent.operators.builtin import OperatorContext, SinkOperator, load_operator
from agent.operators.keyed import KeyedOperator, keyed_config_problems
from agent.instance.recovery import RESEND_AFTER, LinkError, ReliableLinks
from agent.dataplane.routing import Outbox, Router
from agent.files import write_atomic
from agent.instance.keyed_state import KeyedState
from agent.instance.spec import InstanceSpec, control_line, parse_control_line
from agent.measure.capacity import LiveCapacity
from agent.measure.signals import PeriodSignals, Signals
from agent.policy.live import LIVE_POLICIES, LivePolicy, PeriodInputs
from agent.mqtt.client import worker_id
from agent.mqtt.transport import (
    Connected,
    Disconnected,
    PubAck,
    PublishRejected,
    Received,
    Transport,
    TransportError,
)

log = logging.getLogger("agent.instance.worker")

# Exit codes (the agent's supervisor maps them to restart decisions).
EXIT_OK = 0  # drained and exited (stop, or terminated by the protocol)
EXIT_CRASH = 1  # unexpected exception
EXIT_BAD_SPEC = 2  # the spec or the pipeline cannot be loaded: restarting will not help
EXIT_BROKER = 3  # could not connect/subscribe at start
EXIT_DRAIN_TIMEOUT = 4  # stop requested, but successors did not ack everything in time

MAX_POLL = 0.05  # longest sleep of the loop (stdin control lines are seen within this)
ACK_DELAY = 0.005  # coalesce upstream acks for at most this long
DECISION_EVENT_PERIOD = 5.0  # at most one "nothing to do" decision event per instance per 5 s
SOURCE_RESERVE = 2000  # records a source may generate past its last written position
LOCK_EVENT_BURST = 20  # at most this many lock events per instance per second (6 per round)
SINK_SETTLE_POLL = 0.05  # a sink whose spool is at its cap checks this often whether shipping freed it
STATE_PERIOD = 1.0  # persist the channel snapshot at most this often (a rename costs ~5 ms here)
# A hole in a sender's numbering this old will not close by itself: the broker lost those
# messages, or another connection with our client id took them (a fenced copy after a partition).
GAP_TIMEOUT = 5.0
# Batches to a successor unacked this long, with no ack from it meanwhile: replay them (what it
# lost sits at the end of its channel, so it sees no hole). A slow successor acks within a second
# or two; a stalled or restarting one gets a replay it may not need: duplicates, dropped by id.
LINK_SILENCE = 5.0
LINK_SILENCE_MAX = 600.0  # the wait doubles after each replay that brought no ack (a dead node's
# instance, re-homing off: its session would otherwise fill with a window of copies every 5 s)
SILENCE_CHECK = 1.0  # seconds between the two checks above
# A new copy still idle this long after it started asks its creator for Start again (doubling):
# Start is the one protocol message nobody acks, so a broker that lost it would leave the copy
# idle for ever with batches routed to it. The same ping reaches a creator re-homed after its node
# died in the middle of the round: that one adopts the copy (see `_ScalingDriver.on_idle_ping`).
IDLE_PING = 10.0
IDLE_PING_MAX = 40.0
PROBE, PROBE_ECHO = "probe", "probe_echo"  # see _ScalingDriver.on_probe
RECONNECT_ASK = 5.0  # a fenced worker asks its agent again this often (see Worker._ask_to_reconnect)
# Envelopes of senders not known yet (agent.dataplane.inbound.HoldBuffer) wait this long for the
# protocol to announce them (a new copy's Start, resent after IDLE_PING..IDLE_PING_MAX), then they
# are refused. An idle copy holds until its Start: until then it cannot know its predecessors.
HOLD_TTL = 60.0
# Envelopes of a known sender written by a node it is not bound to (yet) wait this long for the
# agent's "hosts" line to bind it there (a new host's record normally follows within a second),
# then they are refused (`refused_nodes`): a forgery by another node never gets bound.
WRITER_HOLD_TTL = 20.0
HOLD_MAX_SENDERS = 64
HOLD_MAX_BYTES = 8 << 20
# Idle pings ([0, 0] acks) from copies we do not know that we probe at once (`on_idle_ping`),
# and how long a probe waits for its echo before the channel it opened is forgotten.
MAX_PROBES = 8
PROBE_TTL = 60.0


class Worker:
    def __init__(
        self,
        spec: InstanceSpec,
        out: TextIO = sys.stdout,
        clock: Callable[[], float] = time.monotonic,
        transport: Optional[Transport] = None,
    ) -> None:
        self.spec = spec
        self.out = out
        self.clock = clock
        self.pipeline: PipelineConfig = load_pipeline_text(spec.pipeline_toml, f"pipeline {spec.pipeline}")
        self.op = self.pipeline.operator(spec.operator)
        # Defence in depth (docs/security.md, "No code from the bus"): the agent admitted this
        # function; refuse it again here, from the node's own allow-list, before anything is
        # created or imported.
        node_allow_list().check(self.op.function)
        self.stage = self.pipeline.index(spec.operator)
        self.kind = self.op.kind
        self.ctx = {"instance": spec.instance, "operator": spec.operator, "node": spec.node}
        self.state_dir = Path(spec.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.sink_dir = Path(spec.extra.get("sink_dir") or self.state_dir)
        self.sink_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.state_dir / f"{spec.instance}.state.json"
        self.inbox = topics.inbox_all(spec.cluster, spec.instance)
        # The node in an inbox topic must host the envelope's sender (docs/security.md, "Data
        # channels"): the agent sets this and sends the bindings as the control line "hosts".
        self.check_node = bool(spec.extra.get("check_sender_node"))
        self.hosts_bound: Dict[str, str] = {}
        self.hosts_former: Dict[str, List[str]] = {}
        # One process per identity: wait for a previous incarnation (still draining after its
        # agent died) to exit before reading its state or taking over its MQTT session.
        self._identity_lock = hold_identity_lock(
            self.state_dir / f"{spec.instance}.lock", float(spec.extra.get("drain_timeout", 10.0)) + 5.0
        )

        if spec.restart:
            self._take_handover(spec.extra)
        # Epoch: a restarted worker (same identity) numbers its messages in a new epoch.
        saved = self._load_state()
        self.epoch = int(saved.get("epoch", -1)) + 1 if saved else 0
        # Re-homed after its node died (agent.node.rehome): the old state is gone with the
        # node, so start above any epoch the dead incarnation can have used.
        self.epoch = max(self.epoch, int(spec.extra.get("min_epoch", 0) or 0))
        self.inbound = Inbound()
        if spec.restart:
            self.inbound.restore(saved.get("inbound") or {}, resync=True)
        self.outbound = Outbound(self.epoch)

        ctx = OperatorContext(
            instance=spec.instance,
            operator=spec.operator,
            node=spec.node,
            kind=self.kind,
            params=dict(self.op.params),
            state_dir=self.state_dir,
            sink_dir=self.sink_dir,
            restart=spec.restart,
            spill=dict(spec.extra.get("spill") or {}),
        )
        self.operator: Any = load_operator(self.op.function, ctx)
        self.is_source = self.kind == "source"
        self.is_sink = self.kind == "sink" or isinstance(self.operator, SinkOperator)
        self.service_time = self.op.service_time_ms / 1000.0
        # A sink that reads only record ids gets compact batches without their records rebuilt.
        self._decode_records = not (self.is_sink and getattr(self.operator, "reads_records", True) is False)

        # Keyed stateful operator (agent.instance.keyed_state): state saved with its input position.
        self.keyed: Optional[KeyedState] = None
        self.keyed_path = self.state_dir / f"{spec.instance}.keyed.json"
        if isinstance(self.operator, KeyedOperator):
            problems = keyed_config_problems(self.pipeline, self.stage, self.operator)
            if problems:
                raise ValueError("; ".join(problems))
            self.keyed = KeyedState(self.operator, spec.operator, self.pipeline.operators[self.stage - 1].key,
                                    self.op.key_groups)
        nxt = self.pipeline.operators[self.stage + 1] if self.stage + 1 < len(self.pipeline.operators) else None
        self.router = Router(spec.succs, key=self.op.key, groups=nxt.key_groups if nxt is not None else 128)
        self.outbox = Outbox(self.router, self.op.batch_size, self.op.linger_ms / 1000.0)
        self.links: Dict[str, OutLink] = {}
        self.tracker = AckTracker()
        if self.keyed is not None and spec.restart:
            saved_keyed = KeyedState.load(self.keyed_path)
            if saved_keyed is not None:
                again = self.keyed.restore(saved_keyed)
                if again:  # outputs the successors had not acked: sent again (the sink drops copies)
                    index = self.tracker.produced()
                    self.keyed.outputs = [(index, it) for it in again]
                    self.outbox.add(list(again), index, clock())
        self.queues: Dict[str, Deque[Envelope]] = {}
        self.pending_pub: Dict[int, int] = {}  # mid -> lowest process index it carries
        self.sink_wait: Deque[int] = deque()  # a deferred sink's record() calls not recorded yet
        self.retry: Deque[Tuple[str, bytes, Optional[int]]] = deque()  # (topic, payload, lowest index)
        self.ack_due: Dict[str, Tuple[int, int]] = {}  # sender -> (its epoch, data seq)
        self.ack_since: Optional[float] = None
        self.busy_until = 0.0
        self.high_water = 2 * self.op.batch_size
        self._unacked_batches = 0
        # Acks go out every quarter of the predecessors' window (their operator's setting).
        pred_window = self.pipeline.operators[self.stage - 1].max_inflight_batches if self.stage > 0 else 8
        self.ack_every = max(1, pred_window // 4)
        # Admission (agent.dataplane.inbound): how far ahead an honest sender's numbers can run is
        # set by the larger window on our channels; a held sender gets room for a window of data
        # twice over, plus its protocol and lock messages.
        self.window = max(pred_window, self.op.max_inflight_batches)
        self.hold = HoldBuffer(HOLD_MAX_SENDERS, 2 * self.window + 32, HOLD_MAX_BYTES)
        self._refusals = LogLimiter()
        # Only a name an instance of a neighbouring operator can have is worth holding: keepers
        # are "<pipeline>.<operator>.0" (deploy.keeper_id), every other instance "<operator>-..."
        # (ScalingCore._new_id, the agent's createNode, the bench). Invented names are refused
        # at once, so they cannot fill the hold buffer that a new copy's predecessors need.
        ops = self.pipeline.operators
        pred_op = [ops[self.stage - 1].name] if self.stage > 0 else []
        near = pred_op + [spec.operator] + ([ops[self.stage + 1].name] if self.stage + 1 < len(ops) else [])
        self._shapes = {
            Kind.DATA: (tuple(f"{o}-" for o in pred_op), {f"{spec.pipeline}.{o}.0" for o in pred_op}),
            Kind.PROTO: (tuple(f"{o}-" for o in near), {f"{spec.pipeline}.{o}.0" for o in near}),
        }

        self.transport = transport or Transport(worker_id(spec.broker, spec.cluster, spec.instance), spec.broker)
        # Re-homing on: after a lost connection, reconnect only when our agent says this identity
        # was not re-homed meanwhile (see _ask_to_reconnect).
        self.transport.gate_reconnect = bool(spec.extra.get("fence_reconnect"))
        self._asked_reconnect_at = -1e9
        self.control: "deque[Dict[str, Any]]" = deque()

        self.scaling = _ScalingDriver.maybe(self, saved)
        if self.scaling is not None and spec.restart and self.scaling.core.forwards_data:
            # The restored tables, not the spec's initial ones: since its creation the instance
            # may have been activated (a copy starts with none) or seen neighbours come and go.
            self.router.set_succs(self.scaling.core.routes()[0])

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
        }
        self._malformed_log = LogLimiter()  # bounded: a flood of invented names costs nothing
        self._malformed_logged: Set[str] = set()  # protocol senders (admitted ones only: bounded)
        self._period_records = 0
        self._last_load = 0.0
        # Live signals (docs/measurement.md, "Live signals"): taken at every decision period,
        # published in the heartbeat, and the online capacity estimate they feed.
        self.signals = PeriodSignals(clock(), time.process_time())
        self.last_signals: Optional[Signals] = None
        self.live_capacity = LiveCapacity(self.scaling.params.capacity if self.scaling is not None else 500.0)
        self._exit: Optional[Tuple[int, str, bool]] = None
        self._stopping = False
        self._stop_deadline = 0.0
        self._state_dirty = True
        self._last_state_write = 0.0
        self._last_heartbeat = 0.0
        self._sent_to_removed: Set[str] = set()
        self._final = False
        self._last_source_write = -1e9
        self._holes: Dict[str, Tuple[Tuple[int, int], float]] = {}  # sender -> ((epoch, missing seq), since)
        self._next_silence_check = clock() + SILENCE_CHECK
        self.first_record_at: Optional[float] = None
        self.activated_at: Optional[float] = None  # wall time of our Start (rescale breakdown)
        self._terminate_reason = ""
        self._period_start = clock()
        self._source_first: Dict[int, int] = {}  # source: poll index -> its first record seq
        self._source_reserved = 0  # source: records it may generate before writing its position
        self._source_started_at = time.time()  # source: wall time its rate profile started

    # ---- start-up ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect, subscribe, and only then say "ready".

        INVARIANT 2 (subscribe before announce): the agent tells nobody about this instance before
        it reads "ready", and "ready" is written only after the broker's SUBACK for the inbox.
        """
        self.transport.connect()
        self.transport.subscribe(self.inbox)
        topic = getattr(self.operator, "topic", None)
        if self.is_source and hasattr(self.operator, "ingest") and topic:
            self.transport.subscribe(topic)
        self._write_state(force=True)
        now = self.clock()
        if self.spec.restart and self.scaling is not None:
            # Tell each predecessor we are a new incarnation (an ack of nothing, numbered in our
            # new epoch): it replays what we had not acknowledged (see _replay_to).
            for pred in sorted(self.scaling.core.preds):
                self.send_envelope(pred, Kind.ACK, [0, 0])
            self.scaling.resync(now)
        if self.is_source:
            if self.spec.restart:
                self._resume_source()
            self.operator.start(now)
        self._period_start = now
        self._emit("ready")
        if self.scaling is not None and self.scaling.terminated:
            # Restarted (an agent restart re-adopting it, say) after the protocol had already
            # terminated it, before its final exit: gone from every table, so gone for good.
            self._exit = (EXIT_OK, "restarted after its termination: gone for good", True)
        elif self.scaling is not None and self.scaling.outputs:
            self.scaling.run_outputs(now)  # a restarted round: perform what was still queued

    def _resume_source(self) -> None:
        """A restarted source continues from its last written position (see TaxiSource.resume)."""
        resume = getattr(self.operator, "resume", None)
        try:
            pos = json.loads((self.sink_dir / f"{self.spec.instance}.source.json").read_text())
        except (OSError, ValueError):
            pos = {}
        if resume is None or not isinstance(pos, dict) or "resume_from" not in pos:
            log.warning("source restarted without a usable position: starting over", extra=self.ctx)
            return
        start = int(pos["resume_from"])
        upto = max(int(pos.get("generated", 0)), int(pos.get("reserved", 0)))
        self._source_started_at = float(pos.get("profile_started_at", time.time()))
        resume(start, upto, time.time() - self._source_started_at)
        self._source_reserved = upto
        log.info("source resumes at record %d, regenerating up to %d", start, upto, extra=self.ctx)

    # ---- the loop -----------------------------------------------------------------------------------

    def run(self) -> int:
        while self._exit is None:
            now = self.clock()
            self.transport.poll(self._timeout(now))
            self.step(self.clock())
        code, reason, final = self._exit
        self._finish(code, reason, final)
        return code

    def step(self, now: float) -> None:
        for ev in self.transport.take_events():
            if isinstance(ev, Received):
                self._on_received(ev)
            elif isinstance(ev, PubAck):
                self.pending_pub.pop(ev.mid, None)
            elif isinstance(ev, Disconnected):
                log.warning("broker connection lost: %s", ev.reason, extra=self.ctx)
                self._asked_reconnect_at = -1e9
            elif isinstance(ev, Connected):
                log.info("reconnected (session kept: %s)", ev.session_present, extra=self.ctx)
                if not ev.session_present:
                    self._new_incarnation("the broker lost our session", "sessions_lost")
        while self.control:
            self._on_control(self.control.popleft(), now)
        self._ask_to_reconnect(now)
        if self.scaling is not None:
            self.scaling.run_outputs(now)
        if self.is_source:
            self._produce(now)
        self._process(now)
        if self.keyed is not None and self.keyed.dirty:
            self._save_keyed()
        if self.hold:
            self._release_held(now)
        if self.is_sink:
            self._settle_sink()
        self._flush(now)
        self.signals.blocked(now, self._backpressured())
        self._send_acks(now)
        self._publish_retries()
        if self.scaling is not None:
            self.scaling.maybe_tick(now)
        if now - self._last_heartbeat >= self.spec.heartbeat_period:
            self._heartbeat(now)
        if now >= self._next_silence_check:
            self._check_silence(now)
        if self._state_dirty or self.inbound.changed:
            self._write_state()
        if self._stopping:
            self._check_stopped(now)

    def _timeout(self, now: float) -> float:
        if self.transport.events or self.control or self._exit is not None:
            return 0.0
        if self._has_ready_input(now):
            return 0.0
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

    # ---- inbox --------------------------------------------------------------------------------------

    def _on_received(self, ev: Received) -> None:
        writer = topics.inbox_writer(self.inbox, ev.topic)
        if writer is None:
            ingest = getattr(self.operator, "ingest", None)
            if ingest is not None:
                ingest(ev.topic, ev.payload)
            return
        try:
            env = decode(ev.payload, self._decode_records)
        except MalformedEnvelope as exc:
            # INVARIANT 5 (nothing dropped silently): counted, logged once per sender, skipped.
            self.stats["malformed"] += 1
            who = _guess_sender(ev.payload)
            if self._malformed_log.allow(who, self.clock()):
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

    # ---- admission (docs/security.md, "Data channels") ------------------------------------------

    def _admit(self, env: Envelope, writer: str) -> Tuple[str, str]:
        """ACCEPT, HOLD or REFUSE (with the reason) for one decoded envelope, before it touches
        any state: its sender must exist for our tables, be hosted by the node `writer` that wrote
        it (check_node), and its numbers must be ones that sender can have
        (agent.dataplane.inbound). Cheap on the hot path: dict lookups and a few compares."""
        if not self._sender_allowed(env):
            # Data and protocol messages may come from an instance the protocol announces to us
            # only later (a new copy's predecessors before its Start): hold, if the name can be
            # one of a neighbouring operator's. Acks come only from instances we sent data to,
            # which we know by then: refuse.
            shape = self._shapes.get(env.kind)
            if shape is not None and (env.sender.startswith(shape[0]) or env.sender in shape[1]):
                return HOLD, "sender"
            return REFUSE, "sender"
        if self.check_node and writer_verdict(self.hosts_bound.get(env.sender), self.hosts_former.get(env.sender, ()),
                                              writer) != ACCEPT:
            return HOLD, "node"
        fault = numbering_fault(self.inbound.position(env.sender), self.inbound.resync_unknown,
                                env.epoch, env.seq, time.time(), self.window)
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
        copy we may have to adopt (`_ScalingDriver.may_probe`). Protocol and lock messages: any
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
        if sc is None:
            return s in self.spec.preds or s in self.spec.succs
        return sc.knows(s)

    def _accept(self, env: Envelope) -> None:
        before = self.inbound.stats.duplicates + self.inbound.stats.stale_epoch
        known = self.inbound.epoch_of(env.sender)
        if env.sender in self.links and env.epoch > (known if known is not None else 0):
            self._replay_to(env.sender)  # the successor restarted: it may have lost what it held
        # INVARIANT 1 (FIFO channel): envelopes are delivered in each sender's numbering, once.
        for e in self.inbound.receive(env):
            if e.kind is Kind.ACK:
                self._on_ack(e)
            else:
                if e.kind is Kind.DATA:
                    self._period_records += len(e.body)
                    self.signals.arrived(len(e.body))
                q = self.queues.get(e.sender)
                if q is None:
                    q = self.queues[e.sender] = deque()
                q.append(e)
        dropped = self.inbound.stats.duplicates + self.inbound.stats.stale_epoch - before
        self.stats["duplicate_envelopes"] += dropped
        if dropped and env.kind is Kind.DATA and env.epoch < (self.inbound.epoch_of(env.sender) or 0):
            # Safe only because the sender's predecessors or source still hold what it carried
            # (acks are end to end); rare enough to say so once per occurrence.
            log.warning("data batch %d of %s's old epoch %d dropped (now epoch %s)", env.seq, env.sender,
                        env.epoch, self.inbound.epoch_of(env.sender), extra=self.ctx)

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
        if not self.hold.add((env.sender, writer), (head, bytes(payload)), len(payload) + 200, self.clock()):
            self.stats["held_dropped"] += 1
            self._refuse(env, why, writer, " (hold buffer full)")

    def _refuse(self, env: Envelope, why: str, writer: str, note: str = "") -> None:
        """Counted, logged at most once per sender per minute (and 20 lines a minute in all), and
        nothing else: no channel entry, no record id, nothing persisted."""
        key = {"epoch": "refused_epochs", "seq": "refused_seqs", "node": "refused_nodes"}.get(why, "refused_senders")
        self.stats[key] += 1
        if self._refusals.allow((env.sender, writer), self.clock()):
            more = self._refusals.take_suppressed()
            what = f"not bound to node {writer[:64]}" if why == "node" else f"{why} not plausible"
            log.warning("refused %s envelope %d/%d from %s (written by %s) on our inbox: %s%s%s",
                        env.kind.name.lower(), env.epoch, env.seq, env.sender[:64], writer[:64], what, note,
                        f" ({more} more refusals not logged)" if more else "", extra=self.ctx)

    def _release_held(self, now: float) -> None:
        """Senders the protocol has announced since their envelopes were held: admit those
        envelopes now, in arrival order (the channel then puts them in the sender's order). The
        rest wait, up to HOLD_TTL (an idle copy: until its Start)."""
        for key in self.hold.senders():
            writer = key[1]
            while True:
                held = self.hold.first(key)
                if held is None:
                    break
                if not self._sender_allowed(held[0]):
                    if held[0].kind is not Kind.ACK:
                        break  # still not announced: keep waiting
                    self.hold.pop_first(key)  # an ack is never held for itself (see _admit)
                    self._refuse(held[0], "sender", writer)
                    continue
                env = decode(held[1], self._decode_records)  # decoded once already: cannot fail
                verdict, why = self._admit(env, writer)
                if verdict == HOLD:
                    break
                self.hold.pop_first(key)
                if verdict == ACCEPT:
                    self.stats["held_released"] += 1
                    self._accept(env)
                else:
                    self._refuse(env, why, writer)
        if self.scaling is not None and not self.scaling.data_enabled:
            return  # idle: its predecessors are announced with its Start
        for (sender, writer), n in self.hold.expire(now, self._hold_ttl):
            # Not announced by the protocol, or not bound to the node that wrote it, in time.
            unbound = self._waits_for_binding(sender, writer)
            self.stats["refused_nodes" if unbound else "refused_senders"] += n
            if self._refusals.allow((sender, writer), now):
                log.warning("refused %d envelopes from %s (written by %s): %s within %.0fs", n, sender[:64],
                            writer[:64], f"not bound to node {writer[:64]}" if unbound else "not announced to us",
                            WRITER_HOLD_TTL if unbound else HOLD_TTL, extra=self.ctx)

    def _waits_for_binding(self, sender: str, writer: str) -> bool:
        """A held stream whose sender our tables know, written by a node it is not bound to."""
        return (self.check_node and self.hosts_bound.get(sender) != writer
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
        if self._stopping:
            return
        holes = {s: (g[0], g[1]) for s, g in self.inbound.gaps().items()}
        self._holes = {s: (h, self._holes[s][1] if self._holes.get(s, (None,))[0] == h else now)
                       for s, h in holes.items()}
        stuck = sorted(s for s, (_, since) in self._holes.items() if now - since >= GAP_TIMEOUT)
        if stuck:
            self._holes = {}
            self._new_incarnation(f"messages from {', '.join(stuck)} missing for {GAP_TIMEOUT:.0f}s", "gaps_recovered")
        if self.scaling is not None:
            self.scaling.ping_if_idle(now)
            self.scaling.expire_probes(now)
        for dest, link in list(self.links.items()):
            wait = min(LINK_SILENCE * 2 ** link.silent_replays, LINK_SILENCE_MAX)
            if link.inflight and link.oldest_age(now) >= wait and now - link.last_ack_at >= wait:
                self.stats["silent_links_replayed"] = self.stats.get("silent_links_replayed", 0) + 1
                link.silent_replays += 1
                self._replay_to(dest)

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
        self._write_state(force=True)
        self.stats[counter] = self.stats.get(counter, 0) + 1
        log.warning("%s: new epoch %d, asking for replays", why, self.epoch, extra=self.ctx)
        if self.scaling is not None:
            for pred in sorted(self.scaling.core.preds):
                self.send_envelope(pred, Kind.ACK, [0, 0])
            self.scaling.resync(self.clock())
        for dest, link in list(self.links.items()):
            link.restart_numbering()
            self._replay_to(dest)

    def _replay_to(self, dest: str) -> None:
        """Send every batch `dest` has not acked again, renumbered on the current channel.

        A worker restarted with the same identity (new epoch) has lost the batches it had taken
        from the broker but not yet forwarded; we still hold them (replay buffer). Records it had
        already forwarded come twice: the sink drops duplicate record ids."""
        link = self.links[dest]
        old = link.unacked()
        if not old:
            return
        topic = topics.inbox(self.spec.cluster, dest, self.spec.node)
        now = self.clock()
        for u in old:
            items = decode(u.payload).body
            seq = self.outbound.take(dest)
            payload = encode_data(self.spec.instance, self.epoch, seq, items)
            link.replace(u.seq, seq, payload, now)
            self._publish_tracked(topic, payload, self.tracker.last_index + 1)
        self.stats["replayed_batches"] = self.stats.get("replayed_batches", 0) + len(old)
        log.warning("replayed %d unacked batches to %s", len(old), dest, extra=self.ctx)

    def _on_ack(self, env: Envelope) -> None:
        self.stats["acks_in"] += 1
        link = self.links.get(env.sender)
        epoch, upto = env.body
        if self.scaling is not None and list(env.body) == [0, 0] and self.scaling.on_idle_ping(env.sender):
            return  # an idle copy asks for its Start
        if epoch != self.epoch:
            self.stats["stale_acks"] = self.stats.get("stale_acks", 0) + 1  # for a dead incarnation
            return
        if link is not None:
            link.ack(upto, self.clock())
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
            self.stats["spool_stalls"] = self.stats.get("spool_stalls", 0) + 1
            return True  # back pressure: the sink's spool is at its cap, stop reading (acks stop)
        if self.outbox.pending >= self.high_water:
            self.stats["credit_stalls"] += 1
            return True  # back pressure: successors have no credit, stop reading
        return False

    def _process(self, now: float) -> None:
        """Handle queued envelopes, round-robin over senders, each sender strictly in order
        (one exception: `_duplication_acks_ahead`)."""
        if self.scaling is not None and self.scaling.duplicating:
            self._duplication_acks_ahead()
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
            now = self.clock()

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
        assert self.scaling is not None
        if self.scaling.blocked:
            return
        for q in list(self.queues.values()):
            if len(q) < 2 or q[0].kind is not Kind.DATA:
                continue
            for i, env in enumerate(q):
                if env.kind is Kind.DATA:
                    continue
                if env.kind is Kind.PROTO and isinstance(env.body, dict) and env.body.get("type") == "duplication_ack":
                    del q[i]
                    self.stats["acks_ahead_of_data"] = self.stats.get("acks_ahead_of_data", 0) + 1
                    self._on_protocol(env)
                break  # the first non-data envelope decides
            if self.scaling.blocked or not self.scaling.duplicating:
                return

    def _process_data(self, env: Envelope, now: float) -> None:
        items: List[Item] = env.body
        n = len(items)
        if self.first_record_at is None:
            self.first_record_at = time.time()  # wall clock: compared across processes (bench)
        self.stats["records_in"] += n
        self.stats["batches_in"] += 1
        index = self.tracker.processed(env.sender, env.seq, env.epoch)
        t0 = time.perf_counter()
        if self.is_sink:
            self._record(items, index, env)
        elif self.keyed is not None:
            out = self.keyed.apply(env.sender, items, index)
            if out:
                self.outbox.add(out, index, now)
        else:
            out = self._apply(items)
            self.stats["filtered"] += n - len(out)
            if out:
                if not self.router.succs:
                    raise RuntimeError(f"{self.spec.instance}: records to forward but no successors")
                self.outbox.add(out, index, now)
        self.signals.processed(n, time.perf_counter() - t0 + n * self.service_time)
        if self.service_time:
            self.busy_until = max(self.busy_until, now) + n * self.service_time

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
            self._publish_tracked(pub.topic, pub.payload, index)
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
        from agent import events

        what = str(ev.pop("event", ""))
        etype = {"spool_full": "spool_full", "spool_resumed": "spool_resumed", "recovered": "spool_recovered"}.get(what)
        if etype is None:
            return
        if what == "spool_full":
            log.warning("spool at its cap (%s bytes): holding input back", ev.get("used_bytes"), extra=self.ctx)
        try:
            e = events.make(etype, ts=time.time(), node=self.spec.node, instance=self.spec.instance,
                            operator=self.spec.operator, pipeline=self.spec.pipeline,
                            detail={"source": "worker", **{k: v for k, v in ev.items() if k != "node"}})
            self.transport.publish(topics.events(self.spec.cluster), e.to_json().encode(), qos=1)
            self.stats["spool_events"] = self.stats.get("spool_events", 0) + 1
        except (TransportError, PublishRejected, ValueError) as exc:
            log.warning("spool event %s not published: %s", what, exc, extra=self.ctx)

    def _on_protocol(self, env: Envelope) -> None:
        if self.scaling is None:
            self.stats["protocol_in"] += 1
            self.stats["protocol_errors"] += 1
            if env.sender not in self._malformed_logged:  # logged once per sender (invariant 5)
                self._malformed_logged.add(env.sender)
                log.warning("protocol message from %s but scaling is off: ignored", env.sender, extra=self.ctx)
            return
        self.scaling.handle(env)

    # ---- source -----------------------------------------------------------------------------------

    def _can_produce(self) -> bool:
        # A paused source has nothing due: without this check its next_due() says "now" and the
        # loop polls it in a busy spin (measured: ~25k empty loop turns/s, a whole core).
        return (
            not self._stopping
            and not getattr(self.operator, "paused", False)
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
            self._source_reserved = generated + budget + SOURCE_RESERVE
            self._write_source_stats()
        items = self.operator.poll(now, budget)
        if items:
            self._period_records += len(items)
            self.stats["records_in"] += len(items)
            index = self.tracker.produced()
            self._source_first[index] = items[0][1]
            self.outbox.add(items, index, now)

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

    def _flush(self, now: float, force: bool = False) -> None:
        if self.outbox.pending == 0:
            return
        draining = self._stopping or (self.scaling is not None and self.scaling.draining)
        batches = self.outbox.take(now, self._credit, force=force or draining)
        if not batches and self.outbox.pending >= self.outbox.batch_size:
            self.stats["credit_stalls"] += 1
        for dest, items, low in batches:
            if dest not in self.router.succs:
                # Cannot happen (the outbox routes over the current table); counted if it does.
                self.stats["sends_to_non_successor"] += 1
                log.error("BUG: batch routed to %s which is not a successor", dest, extra=self.ctx)
            link = self.links.get(dest)
            if link is None:
                link = self.links[dest] = OutLink(dest, self.op.max_inflight_batches)
            seq = self.outbound.take(dest)
            payload = encode_data(self.spec.instance, self.epoch, seq, items)
            link.sent(seq, payload, len(items), now, low)  # replay buffer: kept until dest acks
            self._publish_tracked(topics.inbox(self.spec.cluster, dest, self.spec.node), payload, low)
            self.stats["batches_out"] += 1
            self.stats["records_out"] += len(items)

    def _publish_retries(self) -> None:
        """Publishes paho refused, in order, before anything newer (`_publish_tracked`). Every
        step, not only when there is data to flush: a sink or a departing copy has none, and an
        ack left here once held back every later ack of a sink for good (chaos seed 5002)."""
        while self.retry:
            topic, payload, low = self.retry[0]
            try:
                mid = self.transport.publish(topic, payload)
            except PublishRejected:
                break
            self.retry.popleft()
            if low is not None:
                self.pending_pub[mid] = low

    def _publish_tracked(self, topic: str, payload: bytes, low: Optional[int]) -> None:
        """Publish after whatever paho refused earlier (order). With `low`, the inputs from that
        index on stay unacked upstream until the broker PUBACKs (data we forward); None for our
        own acks and protocol messages, which carry no input."""
        if not self.retry:
            try:
                mid = self.transport.publish(topic, payload)
            except PublishRejected as exc:
                self.stats["publish_rejected"] += 1
                log.warning("%s; will retry", exc, extra=self.ctx)
            else:
                if low is not None:
                    self.pending_pub[mid] = low
                return
        self.retry.append((topic, payload, low))

    def send_envelope(self, dest: str, kind: Kind, body: Any) -> None:
        """Acks and protocol messages: numbered on the same channel as the data (invariant 1)."""
        env = Envelope(self.spec.instance, self.epoch, self.outbound.take(dest), kind, body)
        self._publish_tracked(topics.inbox(self.spec.cluster, dest, self.spec.node), encode(env), None)

    def _lowest_pending(self) -> Optional[int]:
        """The lowest input index not to be acked upstream yet: its outputs are not all acked by
        the successors, or (keyed state) the state that reflects it is not saved yet."""
        low = self._lowest_forwarding()
        if self.keyed is not None and self.keyed.lowest_unsaved() is not None:
            k = self.keyed.lowest_unsaved()
            low = k if low is None else min(low, k)
        return low

    def _save_keyed(self) -> None:
        """Keyed state, its input positions and the outputs not acked downstream, saved together
        (agent.instance.keyed_state); only after it are the inputs it reflects acked upstream."""
        assert self.keyed is not None
        self.keyed.prune_outputs(self._lowest_forwarding())
        self.keyed.save(self.keyed_path)

    def _lowest_forwarding(self) -> Optional[int]:
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
        lows += [r[2] for r in self.retry if r[2] is not None]
        if self.sink_wait:
            lows.append(self.sink_wait[0])
        return min(lows) if lows else None

    def _send_acks(self, now: float) -> None:
        """Ack inputs processed AND forwarded (PUBACKed) or recorded; coalesced for ACK_DELAY."""
        done = self.tracker.release(self._lowest_pending())
        for sender, pos in done.items():
            if pos > self.ack_due.get(sender, (-1, 0)):
                self.ack_due[sender] = pos
        self._unacked_batches += self.tracker.last_released
        if not self.ack_due:
            return
        if self.ack_since is None:
            self.ack_since = now
        # One ack per `ack_every` batches (a quarter of the predecessor's window) or after
        # ACK_DELAY: credit comes back in time while acks cost a fraction of a message per batch.
        if self._unacked_batches >= self.ack_every or now - self.ack_since >= ACK_DELAY or self._stopping:
            for sender, (epoch, seq) in sorted(self.ack_due.items()):
                self.send_envelope(sender, Kind.ACK, [epoch, seq])
                self.stats["acks_sent"] += 1
            self.ack_due.clear()
            self.ack_since = None
            self._unacked_batches = 0

    # ---- routes (called by the scaling driver) -----------------------------------------------------

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
            and not self.retry
            and all(link.inflight == 0 for link in self.links.values())
            and self.tracker.waiting() == 0
            and not self.ack_due
            and not self.sink_wait
        )

    # ---- control channel ----------------------------------------------------------------------------

    def _ask_to_reconnect(self, now: float) -> None:
        """Fencing after a partition (re-homing on). Our node may have been declared dead while
        we could not reach the broker, and this identity started elsewhere; reconnecting would
        take its MQTT session from the new incarnation (they took it from each other about 60
        times in the second before the agent killed us, and the new one stalled: records lost).
        So a worker that lost its connection waits until its agent, connected again, has checked
        the retained re-homing records and either kills it or sends "reconnect"."""
        if getattr(self.transport, "reconnect_held", False) and now - self._asked_reconnect_at >= RECONNECT_ASK:
            self._asked_reconnect_at = now
            self.stats["reconnect_asks"] = self.stats.get("reconnect_asks", 0) + 1
            self._emit("may_reconnect")

    def _on_control(self, msg: Dict[str, Any], now: float) -> None:
        event = msg.get("event")
        if event == "stop":
            self.request_stop(now)
        elif event == "reconnect":
            self.transport.allow_reconnect()
        elif event == "spawned":
            if self.scaling is not None:
                self.scaling.on_spawned(msg)
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
        elif event == "eof":
            self.request_stop(now)
        else:
            log.warning("unknown control event %r ignored", event, extra=self.ctx)

    def _on_hosts(self, msg: Dict[str, Any]) -> None:
        """The agent's instance -> node bindings (agent.node.hostmap): replaces ours; what they
        now bind is released from the hold buffer in this step (`_release_held`)."""
        bound = msg.get("bound")
        if not isinstance(bound, dict):
            log.warning("hosts line without its tables ignored", extra=self.ctx)
            return
        self.hosts_bound = {str(i): str(n) for i, n in bound.items()}
        former = msg.get("former")
        self.hosts_former = ({str(i): [str(n) for n in ns] for i, ns in former.items() if isinstance(ns, list)}
                             if isinstance(former, dict) else {})

    def request_stop(self, now: float) -> None:
        """Agent shutdown: stop producing, drain (bounded), exit; the session is kept."""
        if not self._stopping:
            self._stopping = True
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
        self._stopping = True
        self._stop_deadline = self.clock() + float(self.spec.extra.get("drain_timeout", 30.0))
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
        self._write_state(force=True)
        if self.keyed is not None:
            self._save_keyed()
        self._write_source_stats()
        self._heartbeat(self.clock())
        try:
            self.transport.close(final=final)
        except TransportError:
            pass
        # `final`: gone for good (terminated by the protocol); the agent then forgets this
        # instance instead of re-adopting it after its own restart (agent.node.hosted).
        self._emit("exit", code=code, reason=reason, final=final)

    # ---- heartbeat, persistence ---------------------------------------------------------------------

    def snapshot_stats(self) -> Dict[str, Any]:
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
            unpubacked=len(self.pending_pub) + len(self.retry),
            paho_out=self.transport.pending_out(),
            connected=self.transport.connected,
            service_time_ms=self.service_time * 1000,
            live_capacity=round(self.live_capacity.value, 2),
            online_service_time_ms=(round(self.live_capacity.service_time * 1000, 4)
                                    if self.live_capacity.service_time else None),
            signals=self.last_signals.to_stats() if self.last_signals is not None else None,
            first_record_at=self.first_record_at,
            activated_at=self.activated_at,
            at=time.time(),
        )
        s.update(self.operator.stats())
        if self.keyed is not None:
            s.update(self.keyed.stats())
        if self.scaling is not None:
            s.update(self.scaling.stats())
        return s

    def _heartbeat(self, now: float) -> None:
        self._last_heartbeat = now
        self._emit("heartbeat", stats=self.snapshot_stats())
        if self.is_source and now - self._last_source_write >= 2.0:  # a rename costs ~5-20 ms here
            self._last_source_write = now
            self._write_source_stats()

    def take_signals(self, now: float) -> Signals:
        """Close the live-signal period (the decision period) and feed the online capacity."""
        sig = self.signals.take(now, time.process_time())
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
        write_atomic(self.sink_dir / f"{self.spec.instance}.source.json", json.dumps(data))

    def _take_handover(self, extra: Dict[str, Any]) -> None:
        """A keeper migrated off a draining node (daemon `_hand_over`) arrives here with its
        persisted state in `extra["handover_state"]` (and a source's position in
        `extra["handover_source"]`), since its old state dir is on the other node. Written to our
        own paths before anything reads them, so the restore is exactly a same-node restart's.
        A state file already here with an epoch at least the shipped one's wins: it is a later
        incarnation on this node (a crash restart after the hand-over); an older one is a leftover
        of an earlier stay here and must not be restored."""
        state = extra.get("handover_state")
        if isinstance(state, dict) and int(self._load_state().get("epoch", -1)) < int(state.get("epoch", 0)):
            write_atomic(self.state_path, json.dumps(state))
            log.info("hand-over: restoring the state shipped with the spec (epoch %s)", state.get("epoch"),
                     extra=self.ctx)
        source = extra.get("handover_source")
        position = self.sink_dir / f"{self.spec.instance}.source.json"
        if isinstance(source, dict):
            try:
                here = int(json.loads(position.read_text()).get("resume_from", -1))
            except (OSError, ValueError, AttributeError):
                here = -1
            if here < int(source.get("resume_from", 0)):  # a shared sink_dir already has it
                write_atomic(position, json.dumps(source))

    def _load_state(self) -> Dict[str, Any]:
        try:
            return dict(json.loads(self.state_path.read_text()))
        except (OSError, ValueError):
            return {}

    def _write_state(self, force: bool = False) -> None:
        """Persist what a restart needs: epoch, channel positions, protocol snapshot (cheap:
        a small JSON file, at most every STATE_PERIOD unless the protocol state changed)."""
        now = self.clock()
        if not force and not self._state_dirty and now - self._last_state_write < STATE_PERIOD:
            return
        data: Dict[str, Any] = {"epoch": self.epoch, "inbound": self.inbound.snapshot()}
        if self.scaling is not None:
            data.update(self.scaling.persisted())
        write_atomic(self.state_path, json.dumps(data))
        self.inbound.changed = False
        self._state_dirty = False
        self._last_state_write = now

    def mark_state_changed(self) -> None:
        self._state_dirty = True

    def crash_point(self, name: str) -> None:
        """Fault injection for the reliability tests: with `extra.crash_at = "<instance>:<name>"`
        this instance dies here as if by kill -9, once (a marker file in the state dir makes it
        one-shot, so the restarted incarnation goes on). Never set in production configs."""
        if self.spec.extra.get("crash_at") != f"{self.spec.instance}:{name}":
            return
        marker = self.state_dir / f"{self.spec.instance}.crashed-at-{name}"
        if marker.exists():
            return
        marker.write_text("")
        log.warning("crash point %s: dying now (test fault injection)", name, extra=self.ctx)
        os.kill(os.getpid(), 9)

    def _emit(self, event: str, **fields: Any) -> None:
        try:
            self.out.write(control_line(event, **fields))
            self.out.flush()
        except (BrokenPipeError, ValueError):
            pass  # the agent is gone; the loop will be stopped by stdin EOF


class _ScalingDriver:
    """Drives the sans-IO scaling core (agent.protocol.scaling): feeds it messages and a decision
    tick, and performs its outputs strictly in order (see the core's ORDERING CONTRACT)."""

    def __init__(self, worker: Worker, saved: Dict[str, Any]) -> None:
        from agent.policy.decentralized import ScalingParams
        from agent.protocol.guarded import core_class, message_from_dict
        from agent.protocol.scaling import CreateInstance
        from agent.instance.recovery import RoundMemory, decode_outputs
        from agent.instance.rounds import RoundLog

        self.w = worker
        spec = worker.spec
        sc = worker.pipeline.scaling_for(spec.operator)
        capacity = sc.capacity if isinstance(sc.capacity, (int, float)) else float(spec.extra.get("capacity", 500.0))
        self.params = ScalingParams(
            capacity=float(spec.extra.get("capacity", capacity)),
            target_ratio=sc.target_ratio,
            up=sc.up,
            down=sc.down,
            use_r_secure=sc.r_secure,
        )
        self.period = sc.period
        self.cooldown = sc.cooldown
        self.policy = sc.policy
        if self.policy not in RUNTIME_POLICIES:  # deploy refuses these; a hand-made spec ends here
            raise ValueError("; ".join(worker.pipeline.runtime_policy_errors()))
        # threshold / model / sized: the simulator's policy objects, fed the live signals and the
        # daemon's sibling context (agent.policy.live); "decentralized" stays in the core.
        self.live: Optional[LivePolicy] = LivePolicy(self.policy, sc) if self.policy in LIVE_POLICIES else None
        # coordination = "ack" (paper) or "fgme" (rounds inside 2-FGME CSs, docs/gme.md). Lock
        # messages share the inbox and its numbered FIFO channel with the scaling messages.
        self.coordination = worker.pipeline.pipeline.coordination
        core_cls = core_class(self.coordination, worker.pipeline.pipeline.fgme_damping)
        self._from_dict = message_from_dict
        if spec.restart and saved.get("scaling"):
            self.core = core_cls.restore(saved["scaling"], self.params, incarnation=worker.epoch)
        elif spec.active:
            self.core = core_cls.initial(
                spec.instance, spec.operator, worker.stage, self.params,
                succs=spec.succs, preds=spec.preds, keeper=spec.keeper, incarnation=worker.epoch,
            )
        else:
            creator = str(spec.extra.get("creator", ""))
            self.core = core_cls.from_create(
                CreateInstance(spec.instance, spec.operator, worker.stage, creator), self.params,
                incarnation=worker.epoch,
            )
        if not (spec.restart and saved.get("scaling")) and spec.extra.get("min_epoch"):
            # Re-homed (agent.node.rehome): the dead incarnation's round numbers went with its
            # state, and each neighbour remembers the last round of ours it applied (RoundMemory):
            # a round numbered from 1 again looks like a repeat, is acked and NOT applied (chaos
            # seed 9310: a re-homed copy's Deletion acked by a predecessor that kept routing
            # records to it after it left). Start above any round it used: min_epoch is
            # wall-clock seconds, and no incarnation runs a thousand rounds a second.
            self.core.round = max(self.core.round, int(spec.extra["min_epoch"]) * 1000)
        self.log = RoundLog([op.name for op in worker.pipeline.operators], spec.operator)
        self.log.observe(self.core, time.monotonic(), time.time())
        self.lock_counts: Dict[str, Dict[str, int]] = {"in": {}, "out": {}}
        self._lock_events: Deque[float] = deque()  # publish times of the last lock events (rate limit)
        self.outputs: Deque[Any] = deque()
        # request -> instance: every copy of a round is requested at once (see run_outputs)
        self.waiting_spawn: Dict[str, str] = {}
        self._spawn_errors: List[str] = []
        self.round_created: List[str] = []  # copies of the current round whose create succeeded
        self.started: Deque[str] = deque(maxlen=256)  # copies this instance sent Start (see start_again)
        self._next_ping = worker.clock() + IDLE_PING
        self._idle_pings = 0
        # copy -> (number of the probe we sent it, when: unanswered probes expire after PROBE_TTL)
        self.probes: Dict[str, Tuple[int, float]] = {}  # (on_idle_ping)
        self._probe_seq = 0
        self.orphans: Deque[str] = deque()  # idle copies nobody will start: we adopt them (_maybe_adopt)
        self.memory = RoundMemory(saved.get("rounds_applied") if spec.restart else None)
        self._round_clock: Dict[str, float] = {}  # neighbour -> last sent to / heard from
        # coordination = "fgme": every protocol message of the core on an exactly-once FIFO
        # channel (agent.instance.recovery.ReliableLinks); "ack" keeps the paper's path
        self.links = self._make_links(saved) if self.coordination == "fgme" else None
        if spec.restart and saved.get("scaling"):
            # Finish what the crashed incarnation had queued (write-ahead, agent.instance.recovery).
            self.outputs.extend(decode_outputs(saved.get("outputs") or [], self._from_dict))
            self.round_created = [str(i) for i in saved.get("round_created") or []]
            if not self.outputs:  # its round messages went out: resend if the answers never come
                self._round_clock.update((n, worker.clock()) for n in self.core.pending)
        self.skip_decisions = 0  # decisions to skip (the first one after activation)
        self.forced: Deque[Tuple[str, int]] = deque()  # steering requests (fogctl), in order
        self.pinned = False  # fogctl scale pinned this operator's count: forced rounds only
        self.history: List[Any] = []  # last decision events (retained for `fogctl why`)
        self._last_none_event = -1e9
        self._last_history_pub = -1e9
        self.draining = False
        seed = int(spec.extra.get("seed", 0)) ^ zlib.crc32(spec.instance.encode())
        self.rng = random.Random(seed)
        self.next_tick = worker.clock() + self.period
        self.last_round_end = -1e9
        self.counts = {"scale_outs": 0, "scale_ins": 0, "spawns": 0, "spawn_failures": 0}
        self._errors_log = LogLimiter()  # once per sender per minute, bounded (probed names are invented)
        self._req = 0
        self.decisions: Deque[Dict[str, Any]] = deque(maxlen=32)  # recent decisions (bench, demo)

    def _make_links(self, saved: Dict[str, Any]) -> ReliableLinks:
        w = self.w
        if w.spec.restart and saved.get("links"):
            try:
                return ReliableLinks.load(w.spec.instance, saved["links"], w.clock())
            except ValueError as exc:
                log.warning("%s: starting new channels", exc, extra=w.ctx)
        # a new generation: above any earlier one of this identity (seconds, as min_epoch)
        lost = bool(w.spec.restart or w.spec.extra.get("min_epoch"))
        return ReliableLinks(w.spec.instance, int(time.time()), lost_state=lost)

    def _send_link(self, pairs: List[Tuple[str, Dict[str, Any]]]) -> None:
        """Link acks and resends (agent.instance.recovery.ReliableLinks). The state is written
        first: an ack must never leave before the deliveries it acknowledges are on disk."""
        if not pairs:
            return
        self.w._write_state(force=True)
        for dest, body in pairs:
            self.w.send_envelope(dest, Kind.PROTO, body)

    def resync(self, now: float) -> None:
        """We are a new incarnation: ask every peer for what we may have lost, resend ours."""
        if self.links is not None:
            core = self.core
            self._send_link(self.links.resync(set(core.preds) | set(core.succs), now))

    def ready_to_exit(self) -> bool:
        """Terminated: ack what we delivered, and wait until our own messages are acked."""
        if self.links is None:
            return True
        self._send_link(self.links.flush_acks())
        return self.links.settled

    @classmethod
    def maybe(cls, worker: Worker, saved: Dict[str, Any]) -> Optional["_ScalingDriver"]:
        try:
            import agent.protocol.scaling  # noqa: F401
        except ImportError:
            log.warning("agent.protocol.scaling unavailable: scaling disabled", extra=worker.ctx)
            return None
        return cls(worker, saved)

    @property
    def data_enabled(self) -> bool:
        """An idle (not yet started) instance buffers its input: its succs are unknown."""
        from agent.protocol.scaling import InstanceState

        return self.core.state is not InstanceState.IDLE

    @property
    def terminated(self) -> bool:
        from agent.protocol.scaling import InstanceState

        return self.core.state is InstanceState.TERMINATED

    @property
    def blocked(self) -> bool:
        """Protocol messages wait while earlier outputs run (the order of effects). Except while
        our deletion round's Drain waits for our input to empty: every predecessor has removed
        us, so only repeats come now (the second ack of a re-sent Deletion, a counted no-op);
        held, one held the data behind it, which the Drain waits for: a departing copy for ever
        (chaos seed 9121)."""
        return bool(self.outputs) and not self.draining

    @property
    def duplicating(self) -> bool:
        """Our own duplication round waits for its acks."""
        from agent.protocol.scaling import InstanceState

        return self.core.state is InstanceState.DUPLICATING

    def knows(self, sender: str) -> bool:
        """Is `sender` an instance our tables, our rounds or our round memory name? (Who may send
        us protocol and lock messages, besides the channels we already have: Worker._admit.)"""
        core = self.core
        return (sender in core.preds or sender in core.succs or sender == core.creator
                or sender in core.pending or sender in core.new_siblings
                or sender in core.preds_to_add or sender in core.succs_to_add
                or sender in core.preds_to_delete or sender in core.succs_to_delete
                or sender in self.started or sender in self.probes or sender in self.orphans
                or sender in self.memory.applied or sender in self.waiting_spawn.values()
                or sender in self.round_created)

    def may_probe(self, sender: str) -> bool:
        """May an idle ping from `sender`, an instance we do not know, be a copy an earlier
        incarnation of ours created (`on_idle_ping`)? Only if it is named like our copies
        (`ScalingCore._new_id`: "<operator>-<digest>"), we are active, and fewer than MAX_PROBES
        probes wait for their echo: invented names cost at most MAX_PROBES channels, each
        forgotten after PROBE_TTL (`expire_probes`)."""
        from agent.protocol.scaling import InstanceState

        return (self.core.state is InstanceState.ACTIVE and len(self.probes) < MAX_PROBES
                and len(sender) <= 128 and sender.startswith(self.core.operator + "-"))

    def expire_probes(self, now: float) -> None:
        """Probes unanswered for PROBE_TTL: the instance was no copy of ours (or is gone). Its
        channel and our numbering to it go, unless something else names it."""
        for copy, (_, at) in list(self.probes.items()):
            if now - at < PROBE_TTL:
                continue
            del self.probes[copy]
            if not self.knows(copy) and copy not in self.w.links and copy not in self.w.router.succs:
                self.w.forget_sender(copy)

    @property
    def lock_pending(self) -> bool:
        """A decision waits for its 2-FGME locks (coordination = "fgme"): decide nothing new."""
        return getattr(self.core, "intent", None) is not None

    # ---- rounds and locks: records and events -------------------------------------------------

    def _observe(self, outs: List[Any]) -> None:
        """After every core call: record round start/end and lock transitions, publish the lock
        events. Runs before `outs` are performed (see agent.instance.rounds on why that makes the
        recorded round intervals of neighbours disjoint whenever the protocol is right)."""
        trans, edge = self.log.observe(self.core, time.monotonic(), time.time())
        if edge == "start":
            self.round_created = []
        elif edge == "end":
            self.last_round_end = self.w.clock()
            self._stamp_decision("round_end_at")
        for t in trans:
            self._publish_lock_event(t)
        if trans or edge:
            self.w.mark_state_changed()

    def _publish_lock_event(self, t: Any) -> None:
        """A lock_request / lock_enter / lock_exit event (detail.boundary) through the worker's
        single client, QoS 0 like the decision events; never on an inbox, so no protocol cost.
        Rate-limited to LOCK_EVENT_BURST events per second per instance (an instance makes at
        most 6 per round; a flood would mean a bug, counted in `lock_events_dropped`)."""
        from agent import events

        etype = t.event_type
        if etype is None:
            return
        w = self.w
        now = time.monotonic()
        q = self._lock_events
        while q and now - q[0] > 1.0:
            q.popleft()
        if len(q) >= LOCK_EVENT_BURST:
            self.counts["lock_events_dropped"] = self.counts.get("lock_events_dropped", 0) + 1
            return
        q.append(now)
        try:
            ev = events.make(etype, ts=time.time(), node=w.spec.node, instance=w.spec.instance,
                             operator=w.spec.operator, pipeline=w.spec.pipeline,
                             detail={"boundary": t.boundary, "index": t.index, "source": "worker"})
            w.transport.publish(topics.events(w.spec.cluster), ev.to_json().encode(), qos=0)
            self.counts["lock_events"] = self.counts.get("lock_events", 0) + 1
        except (TransportError, ValueError) as exc:
            self.counts["lock_events_failed"] = self.counts.get("lock_events_failed", 0) + 1
            log.warning("lock event not published: %s", exc, extra=w.ctx)

    # ---- input ---------------------------------------------------------------------------------

    def handle(self, env: Envelope) -> None:
        from agent.protocol.errors import ProtocolError
        from agent.protocol.scaling import Send

        from agent.protocol.guarded import LockMessage

        stats = self.w.stats
        if isinstance(env.body, dict) and env.body.get("type") in (PROBE, PROBE_ECHO):
            self.on_probe(env)
            return
        if self.links is not None:
            try:
                body, replies = self.links.receive(env.sender, env.body, self.w.clock())
            except LinkError as exc:
                stats["protocol_errors"] += 1
                if self._errors_log.allow(env.sender, self.w.clock()):
                    log.warning("protocol message from %s rejected: %s", env.sender, exc, extra=self.w.ctx)
                return
            self.w.mark_state_changed()
            self._send_link(replies)
            if body is None:
                return  # a link ack, a copy, or a message past a gap (it comes again in order)
            env = replace(env, body=body)
        is_lock = isinstance(env.body, dict) and env.body.get("type") == LockMessage.type
        if is_lock:
            stats["lock_in"] = stats.get("lock_in", 0) + 1
            kind = str((env.body.get("inner") or {}).get("kind") if isinstance(env.body.get("inner"), dict) else "?")
            self.lock_counts["in"][kind] = self.lock_counts["in"].get(kind, 0) + 1
        else:
            stats["protocol_in"] += 1
        try:
            msg = self._from_dict(env.body)
            if msg.sender != env.sender:
                raise ValueError(f"message sender {msg.sender} differs from envelope sender {env.sender}")
            self._round_clock[env.sender] = self.w.clock()
            again = self.memory.replay_ack(msg, self.core.instance_id, self.core.stage)
            if again is not None:  # a round we applied, sent again by a restarted sender
                self._queue([Send(env.sender, again)])
                return
            outs = self.core.handle(msg)
            self.memory.applied_now(msg)
        except (ProtocolError, ValueError) as exc:
            # Unexpected or invalid: counted, logged once per sender, state unchanged.
            stats["protocol_errors"] += 1
            if self._errors_log.allow(env.sender, self.w.clock()):
                log.warning("protocol message from %s rejected: %s", env.sender, exc, extra=self.w.ctx)
            return
        if is_lock:
            self.w.mark_state_changed()  # the lock state changed even when nothing is sent
        self._observe(outs)
        self._queue(outs)
        if self.links is not None and getattr(self.core, "departed", None) and self.core.departed(env.sender):
            self._send_link(self.links.forget(env.sender))

    def force(self, action: str, count: int) -> None:
        """A steering request (fogctl scale/drain via the agent): queued, run by `_run_forced`
        through the same protocol as an automatic decision. One duplication round per copy."""
        if self.w.keyed is not None:  # its key groups would not take their state along (docs/operators.md)
            log.warning("scale %s refused: %s keeps keyed state, its instance count is fixed", action,
                        self.w.spec.operator, extra=self.w.ctx)
            return
        if action == "duplicate":
            self.forced.extend(("duplicate", 1) for _ in range(max(1, int(count))))
        elif action == "terminate":
            self.forced.append(("terminate", 1))
        else:
            log.warning("unknown scale action %r ignored", action, extra=self.w.ctx)

    def _run_forced(self, now: float) -> None:
        from agent.policy.decentralized import Action, Decision
        from agent.protocol.errors import LocalProtocolError
        from agent.protocol.scaling import InstanceState

        if not self.forced or self.outputs or self.w._stopping or self.lock_pending:
            return
        if self.core.state is not InstanceState.ACTIVE:
            if self.core.state is not InstanceState.IDLE and not self.core.in_round:
                self.forced.clear()  # leaving or gone: nothing more to do
            return
        action, count = self.forced.popleft()
        decision = Decision(Action.DUPLICATE if action == "duplicate" else Action.TERMINATE, count)
        self.round_created = []
        self.log.decided(time.monotonic())
        try:
            outs = self.core.start_round(decision)
        except LocalProtocolError as exc:
            log.warning("forced %s refused: %s", action, exc, extra=self.w.ctx)
            self._observe([])
            return
        self._observe(outs)
        kind = "scale_out" if action == "duplicate" else "scale_in"
        self.counts["scale_outs" if kind == "scale_out" else "scale_ins"] += 1
        self.counts["forced"] = self.counts.get("forced", 0) + 1
        new = [o.instance_id for o in outs if type(o).__name__ == "CreateInstance"]
        self.decisions.append({"at": time.time(), "kind": kind, "forced": True, "new": new})
        self.last_round_end = now
        self._queue(outs)

    def maybe_tick(self, now: float) -> None:
        self._run_forced(now)
        self._maybe_adopt()
        self.resend_silent(now)
        if self.links is not None:
            self._send_link(self.links.due(now))
        if now < self.next_tick:
            return
        load = self.w.measure_load(now)
        sig = self.w.take_signals(now)
        self.next_tick = now + self.period
        if self.policy == "none" or self.w.is_source or self.w._stopping or self.pinned:
            return
        if self.outputs or self.core.in_round or self.lock_pending or now - self.last_round_end < self.cooldown:
            return
        from agent.protocol.scaling import InstanceState

        if self.core.state is not InstanceState.ACTIVE:
            return
        if self.skip_decisions > 0:
            self.skip_decisions -= 1  # this period's load was measured only partly (activation)
            return
        self.round_created = []
        draw = self.rng.random()
        if self.live is not None:
            decision = self.live.decide(PeriodInputs(now, load, sig.processed_rate, self.w.live_capacity.value,
                                                     sig.backpressure, self.core.keeper, draw))
        else:
            decision = self.core.decide(load, draw)
        if decision.scales:
            self.log.decided(time.monotonic())
        outs = self.core.start_round(decision)
        self._observe(outs)
        self._publish_decision(now, load, draw, decision, outs)
        if outs:
            kind = "scale_out" if any(type(o).__name__ == "CreateInstance" for o in outs) else "scale_in"
            self.counts["scale_outs" if kind == "scale_out" else "scale_ins"] += 1
            new = [o.instance_id for o in outs if type(o).__name__ == "CreateInstance"]
            self.decisions.append({"at": time.time(), "kind": kind, "load": round(load, 1), "new": new})
            log.info("decision %s at load %.1f/s (capacity %.0f)%s", kind, load, self._capacity(),
                     f" {self.live.last}" if self.live is not None else "", extra=self.w.ctx)
            self.last_round_end = now
        self._queue(outs)

    def _capacity(self) -> float:
        """The capacity this instance's policy compares with: live for the Gesscale policies."""
        return self.w.live_capacity.value if self.live is not None else self.params.capacity

    def _publish_decision(self, now: float, load: float, draw: float, decision: Any, outs: List[Any]) -> None:
        """A decision event with the numbers it was drawn from (load, capacity, ratio, probability,
        draw) on the events topic, plus the retained per-instance history `fogctl why` reads.

        Through the worker's single client (one owner, docs/design.md section 6); never on the inbox path, so the
        paper's message cost is untouched. Rate-limited: a decision that acts is always published,
        a "nothing to do" one at most every DECISION_EVENT_PERIOD s (an instance decides every
        period; thousands of them would flood the topic). A publish failure is counted, never fatal.
        """
        from agent import events
        from agent.policy.decentralized import Action

        acted = bool(outs)
        if not acted and now - self._last_none_event < DECISION_EVENT_PERIOD:
            return
        if not acted:
            self._last_none_event = now
        w = self.w
        kind = {Action.DUPLICATE: "scale_out", Action.TERMINATE: "scale_in"}.get(decision.action, "decision")
        if not acted:
            kind = "decision"
        new = [o.instance_id for o in outs if type(o).__name__ == "CreateInstance"]
        try:
            ev = events.decision(
                ts=time.time(), node=w.spec.node, instance=w.spec.instance, operator=w.spec.operator,
                pipeline=w.spec.pipeline, load=float(load), capacity=float(self._capacity()),
                probability=float(decision.factor) if decision.action is not Action.NONE and self.live is None else None,
                draw=float(draw), action=decision.action.value, count=int(decision.count),
                type=kind, detail=self._decision_detail(new),
            )
            w.transport.publish(topics.events(w.spec.cluster), ev.to_json().encode(), qos=0)
            self.history = events.remember(self.history, ev)
            if acted or now - self._last_history_pub >= DECISION_EVENT_PERIOD:
                self._last_history_pub = now
                payload = json.dumps([e.to_dict() for e in self.history], sort_keys=True).encode()
                w.transport.publish(topics.decisions(w.spec.cluster, w.spec.instance), payload, qos=0, retain=True)
            self.counts["decision_events"] = self.counts.get("decision_events", 0) + 1
        except (TransportError, ValueError) as exc:
            self.counts["decision_events_failed"] = self.counts.get("decision_events_failed", 0) + 1
            log.warning("decision event not published: %s", exc, extra=w.ctx)

    def _decision_detail(self, new: List[str]) -> Dict[str, Any]:
        detail: Dict[str, Any] = {"source": "worker"}
        if new:
            detail["new"] = new
        if self.live is not None and self.live.last is not None:
            detail.update({k: v for k, v in self.live.last.items() if k != "context"})
        return detail

    def _queue(self, outs: List[Any]) -> None:
        if outs:
            self.outputs.extend(outs)
            self.w.mark_state_changed()
            # Write-ahead (agent.instance.recovery): the core's new state and the outputs still to
            # perform reach the disk before any of them is performed.
            self.w._write_state(force=True)
            self.run_outputs(self.w.clock())

    def persisted(self) -> Dict[str, Any]:
        """What a restarted worker needs to finish a round: the core, the outputs not yet
        performed, the rounds applied per sender, the copies created in the current round."""
        from agent.instance.recovery import encode_outputs

        return {"scaling": self.core.snapshot(), "outputs": encode_outputs(self.outputs),
                "rounds_applied": dict(self.memory.applied), "round_created": list(self.round_created),
                **({"links": self.links.dump()} if self.links is not None else {})}

    def ping_if_idle(self, now: float) -> None:
        """An idle copy (created, not started) asks its creator for Start again: an ack of
        nothing ([0, 0]) after IDLE_PING s, then at doubling intervals up to IDLE_PING_MAX."""
        from agent.protocol.scaling import InstanceState

        if self.core.state is not InstanceState.IDLE or not self.core.creator or now < self._next_ping:
            return
        self._next_ping = now + min(IDLE_PING * 2 ** self._idle_pings, IDLE_PING_MAX)
        self._idle_pings += 1
        self.counts["start_requests"] = self.counts.get("start_requests", 0) + 1
        log.warning("still idle after creation: asking %s for Start again", self.core.creator, extra=self.w.ctx)
        self.w.send_envelope(self.core.creator, Kind.ACK, [0, 0])

    def on_idle_ping(self, sender: str) -> bool:
        """An ack of nothing ([0, 0]) from `sender`: True if it was a copy's idle ping for us.

        From a copy we started: its Start was lost, send it again. From a copy of our current
        round: that round will start it. From a neighbour: a new incarnation of it asking for
        replays, not ours to answer (False). From any other instance: it may be a copy created by
        an earlier incarnation of ours, lost with its node (re-homing) in the middle of the
        round; nobody else may start it and records may already be routed to it, so we probe it
        and adopt it if it echoes the probe (`on_probe`)."""
        from agent.protocol.scaling import InstanceState

        core = self.core
        if sender in self.started:
            self.start_again(sender)
            return True
        if (sender in core.succs or sender in core.preds or sender in core.new_siblings
                or sender in self.orphans or core.state is InstanceState.IDLE or core.terminated):
            return sender in core.new_siblings
        self._probe_seq += 1
        self.probes[sender] = (self._probe_seq, self.w.clock())
        self.counts["probes"] = self.counts.get("probes", 0) + 1
        log.warning("%s is idle and not a copy of this incarnation: probing it", sender, extra=self.w.ctx)
        self.w.send_envelope(sender, Kind.PROTO, {"type": PROBE, "sender": self.core.instance_id, "n": self._probe_seq})
        return True

    def on_probe(self, env: Envelope) -> None:
        """A creator's probe to a copy, or the copy's echo of it (both outside the paper's cost).

        The copy echoes only while idle and only to its creator. The echo leaves the copy after
        every message an earlier incarnation of the creator sent it (one FIFO channel; a late one
        of an older epoch is dropped by the receive path), so no Start of that incarnation can
        still activate it, and an idle copy never leaves: adopting it cannot bring back an
        instance that has left its neighbours' tables."""
        from agent.protocol.scaling import InstanceState

        body = env.body
        n = body.get("n")
        if type(n) is not int or n < 1 or body.get("sender") != env.sender:
            self.w.stats["protocol_errors"] += 1
            if self._errors_log.allow(env.sender, self.w.clock()):
                log.warning("bad %s from %s ignored", body.get("type"), env.sender, extra=self.w.ctx)
            return
        core = self.core
        if body["type"] == PROBE:
            if core.state is InstanceState.IDLE and env.sender == core.creator:
                self.w.send_envelope(env.sender, Kind.PROTO, {"type": PROBE_ECHO, "sender": core.instance_id, "n": n})
        elif env.sender in self.probes and self.probes[env.sender][0] == n:
            del self.probes[env.sender]
            if env.sender not in self.started and env.sender not in self.orphans:
                self.orphans.append(env.sender)

    def _maybe_adopt(self) -> None:
        """Start an orphaned copy (on_probe) when we are free to start a round."""
        from agent.protocol.scaling import InstanceState

        if (not self.orphans or self.outputs or self.w._stopping or self.lock_pending
                or self.core.state is not InstanceState.ACTIVE):
            return
        copy_id = self.orphans.popleft()
        self.round_created = []
        outs = self.core.adopt(copy_id)
        self._observe(outs)
        self.counts["adopted"] = self.counts.get("adopted", 0) + 1
        log.warning("adopting %s, an idle copy of an earlier incarnation: announcing it again", copy_id,
                    extra=self.w.ctx)
        self._queue(outs)

    def start_again(self, copy: str) -> None:
        """Send Start again to a copy we started that says it is still idle (its Start was lost
        with the broker's state): our current tables, as Algorithm 6 would send them now. A copy
        that is active by then rejects it as unexpected and nothing changes."""
        from agent.protocol.messages import Start

        msg = Start(self.core.instance_id, self.core.stage, *self.core.routes())
        self.w.send_envelope(copy, Kind.PROTO, msg.to_dict())
        self.counts["protocol_resent"] = self.counts.get("protocol_resent", 0) + 1
        log.warning("%s is still idle: sent Start again", copy, extra=self.w.ctx)

    def resend_silent(self, now: float) -> None:
        """Send the round message again to pending neighbours silent for RESEND_AFTER s (they
        may have crashed between applying it and acking); never while outputs are queued."""
        from agent.instance.recovery import silent_pending

        if self.outputs or not self.core.in_round or self.links is not None:
            return  # with links, every message is resent until acked (ReliableLinks)
        for dest, msg in silent_pending(self.core, self._round_clock, now):
            self.w.send_envelope(dest, Kind.PROTO, msg.to_dict())
            self._round_clock[dest] = now
            self.counts["protocol_resent"] = self.counts.get("protocol_resent", 0) + 1
            log.warning("no answer from %s for %.0fs in round %d: sent %s again", dest,
                        RESEND_AFTER, self.core.round, msg.type, extra=self.w.ctx)

    # ---- outputs, strictly in order --------------------------------------------------------------

    def run_outputs(self, now: float) -> None:
        from agent.protocol.scaling import Activate, CreateInstance, Drain, RoutesChanged, Send, Terminate

        w = self.w
        while self.outputs:
            out = self.outputs[0]
            if isinstance(out, Send):
                # INVARIANT 6 (the paper's message cost): exactly the core's Sends go out, one
                # envelope each; data acks and heartbeats are separate (data plane, control pipe).
                # 2-FGME lock messages travel the same way but are counted apart, by kind.
                body = out.message.to_dict()
                if self.links is not None:
                    body = self.links.stamp(out.dest, body, now)
                w.send_envelope(out.dest, Kind.PROTO, body)
                self._round_clock[out.dest] = now
                if out.message.type == "start":
                    self.started.append(out.dest)
                inner = getattr(out.message, "inner", None)
                if inner is None:
                    w.stats["protocol_out"] += 1
                else:
                    w.stats["lock_out"] = w.stats.get("lock_out", 0) + 1
                    self.lock_counts["out"][inner.kind] = self.lock_counts["out"].get(inner.kind, 0) + 1
            elif isinstance(out, RoutesChanged) or isinstance(out, Activate):
                # INVARIANT 3: the data path switches tables here, before any later Send (ack).
                w.set_routes(out.succs, now)
                if isinstance(out, Activate):
                    if w.activated_at is None:
                        w.activated_at = time.time()
                    # DEVIATION (docs/scaling.md): the load of the period we were activated in is
                    # partial, so the first decision would scale a fresh copy straight back in.
                    self.skip_decisions = 1
            elif isinstance(out, CreateInstance):
                # INVARIANT 2: the Sends announcing this instance wait until the agent says it is
                # subscribed ("spawned" arrives only after the new worker's "ready").
                # Every copy at the head of the queue is requested at once, so the agent starts
                # them in parallel: one after another, each waited for its own "spawned" and
                # all but the first missed the pre-started worker (~0.34 s per copy measured);
                # the Sends still wait for every answer (on_spawned).
                if not self.waiting_spawn:
                    for o in list(self.outputs):
                        if not isinstance(o, CreateInstance):
                            break
                        self._request_spawn(o)
                return  # waiting for "spawned"
            elif isinstance(out, Drain):
                # Two-phase deletion: every predecessor removed us; forward everything first.
                w._flush(now, force=True)
                if not w.drained():
                    self.draining = True
                    return
                self.draining = False
            elif isinstance(out, Terminate):
                w.terminate("terminated by the scaling protocol")
                self.counts["terminated"] = 1
            self.outputs.popleft()

    def _request_spawn(self, out: Any) -> None:
        w = self.w
        self._req += 1
        request = f"{w.spec.instance}-{self._req}"
        extra = dict(w.spec.extra)
        extra["creator"] = w.spec.instance
        spec = replace(
            w.spec,
            instance=out.instance_id,
            succs=(),
            preds=(),
            keeper=False,
            active=False,
            restart=False,
            extra=extra,
        )
        self.waiting_spawn[request] = out.instance_id
        self.counts["spawns"] += 1
        w._emit("spawn", request=request, spec=json.loads(spec.to_json()))
        w.crash_point("spawn_requested")  # tests: a crash in the middle of a duplication round

    def on_spawned(self, msg: Dict[str, Any]) -> None:
        from agent.protocol.scaling import CreateInstance

        instance = self.waiting_spawn.pop(str(msg.get("request")), None)
        if instance is None:
            log.warning("unexpected spawned reply %s ignored", msg, extra=self.w.ctx)
            return
        if msg.get("ok"):
            self._stamp_decision("spawned_at")
            if instance not in self.round_created:
                self.round_created.append(instance)
        else:
            self.counts["spawn_failures"] += 1
            self._spawn_errors.append(str(msg.get("error")))
        self.w.mark_state_changed()
        if self.waiting_spawn:
            return  # the other copies' answers first: every copy is either created or refused
        errors, self._spawn_errors = self._spawn_errors, []
        if errors:
            # The announcement must not go out for an instance that does not exist. Retrying
            # while holding the round's messages stalled the neighbours, so withdraw the round
            # (or shrink it to the copies that exist): nothing was announced yet.
            self._cancel_round("; ".join(errors))
            return
        while self.outputs and isinstance(self.outputs[0], CreateInstance):
            self.outputs.popleft()  # every copy requested at once is done
        self.run_outputs(self.w.clock())

    def _stamp_decision(self, key: str) -> None:
        """Wall time of a step of the current scale-out round on its decision record (latest
        spawn reply, round end): `bench dataplane`/`bench rescale` split decision -> first record
        into spawn, protocol round and first batch with it."""
        d = self.decisions[-1] if self.decisions else None
        if d is not None and d.get("kind") == "scale_out" and (key == "spawned_at" or key not in d):
            d[key] = time.time()  # spawned_at: with several copies, the last reply counts

    def _cancel_round(self, why: str) -> None:
        from agent.protocol.messages import Duplication
        from agent.protocol.scaling import CreateInstance, Send

        core = self.core
        mine = core.instance_id
        # The round's outputs sit at the head of the queue: its creates, then its announcements.
        while self.outputs:
            out = self.outputs[0]
            if isinstance(out, CreateInstance) and out.creator == mine:
                self.outputs.popleft()
            elif (isinstance(out, Send) and isinstance(out.message, Duplication)
                  and out.message.sender == mine and out.message.round == core.round):
                self.outputs.popleft()
            else:
                break
        created = tuple(self.round_created)
        self.round_created = []
        replacement = core.cancel_duplication(created=created)
        self._observe(replacement)
        self.outputs.extendleft(reversed(replacement))
        self.counts["rounds_cancelled"] = self.counts.get("rounds_cancelled", 0) + 1
        # At max_instances (agent.node.bounds) a loaded instance asks again every period and
        # is refused: the bound working, not a failure, so not a warning each period.
        level = logging.INFO if all(e.startswith("max_instances reached") for e in why.split("; ")) else logging.WARNING
        log.log(level, "spawn failed (%s): duplication round %d %s", why, core.round,
                f"continues with {list(created)}" if created else "cancelled", extra=self.w.ctx)
        self.w._emit("round_cancelled", round=core.round, created=list(created), error=why)
        self.run_outputs(self.w.clock())

    def stats(self) -> Dict[str, Any]:
        s: Dict[str, Any] = dict(self.counts)
        s["state"] = self.core.state.value
        s["keeper"] = self.core.keeper
        s["preds"] = sorted(self.core.preds)
        s["decisions"] = list(self.decisions)
        s["capacity"] = self.params.capacity
        s["coordination"] = self.coordination
        s["policy"] = self.policy
        if self.live is not None:
            s["live_decision"] = self.live.last
        s.update(self.log.stats(self.core))
        if self.coordination == "fgme":
            s["lock_messages"] = {d: dict(c) for d, c in self.lock_counts.items()}
        if self.links is not None:
            s["links"] = dict(self.links.counts, unacked=self.links.unacked())
        return s


def _guess_sender(payload: bytes) -> str:
    try:
        msg = json.loads(payload)
        if isinstance(msg, list) and len(msg) > 1 and isinstance(msg[1], str):
            return msg[1][:64]
    except (ValueError, TypeError, RecursionError):
        pass
    return "<unknown>"


class InstanceBusy(Exception):
    """Another live process holds this instance's identity (its previous incarnation)."""


def hold_identity_lock(path: Path, timeout: float) -> int:
    """Take the exclusive lock of an instance identity, waiting up to `timeout` s; returns the
    fd, held for the life of the process (the kernel releases it when the process dies, however
    it dies). Why: an agent restarted by systemd re-adopts its instances at once, while the
    workers of its previous incarnation may still drain; two processes with one identity would
    fight over one MQTT client id and one state file."""
    import fcntl

    fd = os.open(str(path), os.O_CREAT | os.O_RDWR, 0o600)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise InstanceBusy(f"{path} still locked by another process after {timeout:.0f}s") from None
            time.sleep(0.05)




def _stdin_reader(stream: TextIO, sink: "deque[Dict[str, Any]]") -> None:
    """The only other thread: turns control lines into queued dicts (EOF = the agent is gone)."""
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            sink.append(parse_control_line(line))
        except ValueError as exc:
            log.warning("bad control line ignored: %s", exc)
    sink.append({"event": "eof"})


def _install_signals(worker: Worker) -> None:
    """SIGTERM/SIGINT: the first one drains like "stop"; a second one (the agent's escalation
    after its stop timeout, or a second Ctrl-C) exits at the next loop turn without draining.
    The handler only enqueues or sets a flag; the loop does the work (gunicorn's arbiter style)."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        if worker._stopping:
            worker._exit = (EXIT_DRAIN_TIMEOUT, f"signal {signum} while draining", False)
        else:
            worker.control.append({"event": "stop"})

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _preimport() -> None:
    """Import what building any instance needs (scaling core, policy, recovery, operators)
    before reading the spec. Why: the agent keeps one pre-started worker waiting for its spec
    (supervisor.prewarm), so whatever is imported here is off the path decision -> first
    record of a scale-out (~70 ms idle, 2-4x that on a loaded machine); a cold start pays the
    same total either way. A module that fails to import here is imported (and reported) later,
    where it is used."""
    import importlib

    for name in ("agent.protocol.scaling", "agent.protocol.guarded", "agent.policy.decentralized",
                 "agent.instance.recovery", "agent.instance.rounds", "agent.events", "agent.operators.taxi"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    node_allow_list()  # reads the installed packages' entry points (once per process)


def main(argv: Optional[List[str]] = None) -> int:
    from agent.log import setup_logging

    setup_logging(os.environ.get("FOG_AGENT_LOG_LEVEL"))
    _preimport()  # a pre-started (warm) worker does this before its spec arrives
    line = sys.stdin.readline()
    try:
        spec = InstanceSpec.from_json(line)
    except (ValueError, TypeError, KeyError) as exc:
        log.error("bad instance spec on stdin: %s", exc)
        sys.stdout.write(control_line("exit", code=EXIT_BAD_SPEC, reason=f"bad spec: {exc}"))
        return EXIT_BAD_SPEC
    try:
        worker = Worker(spec)
    except InstanceBusy as exc:
        log.error("%s", exc)
        return EXIT_CRASH  # no exit line: the agent treats it as a crash and retries (bounded)
    except OperatorRefused as exc:  # not on this node's allow-list: one line, never imported
        log.error("instance %s: %s", spec.instance, exc)
        sys.stdout.write(control_line("exit", code=EXIT_BAD_SPEC, reason=str(exc)[:300]))
        return EXIT_BAD_SPEC
    except Exception as exc:  # noqa: BLE001 - config/operator errors: say so and do not restart
        log.exception("cannot build instance %s", spec.instance)
        sys.stdout.write(control_line("exit", code=EXIT_BAD_SPEC, reason=str(exc)[:300]))
        return EXIT_BAD_SPEC
    _install_signals(worker)  # before "ready": the agent may signal us as soon as it reads it
    try:
        worker.start()
    except (TransportError, OSError) as exc:
        log.error("cannot reach the broker: %s", exc, extra=worker.ctx)
        worker._emit("exit", code=EXIT_BROKER, reason=str(exc))
        return EXIT_BROKER
    threading.Thread(target=_stdin_reader, args=(sys.stdin, worker.control), daemon=True, name="stdin").start()
    try:
        prof_dir = os.environ.get("FOG_WORKER_PROFILE")  # benchmarks: cProfile dump per instance
        if prof_dir:
            import cProfile

            prof = cProfile.Profile()
            try:
                return int(prof.runcall(worker.run))
            finally:
                prof.dump_stats(os.path.join(prof_dir, f"{spec.instance}.prof"))
        return worker.run()
    except Exception as exc:  # noqa: BLE001
        log.exception("worker crashed", extra=worker.ctx)
        worker._emit("exit", code=EXIT_CRASH, reason=repr(exc)[:300])
        return EXIT_CRASH


__all__ = ["Worker", "main", "EXIT_OK", "EXIT_CRASH", "EXIT_BAD_SPEC", "EXIT_BROKER", "EXIT_DRAIN_TIMEOUT"]

if __name__ == "__main__":
    sys.exit(main())
