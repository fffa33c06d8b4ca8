"""The worker's shell: one operator instance's I/O around the sans-IO `agent.instance.core.Instance`.

`Worker` owns the spec, the pipeline and the operator it loads, the identity lock, the state
files, the paho client (agent.mqtt.transport) and the control pipe; the instance makes every
decision. One thread owns all of it. The loop:

    poll MQTT (callbacks only enqueue) -> each transport event and control line becomes an event
    of the instance -> one Tick (process, flush, ack, decide, persist: the instance's order)
    -> perform the commands of each event in order (publish, persist, spawn, emit, exit).

Extra control lines a worker understands besides the contract's "stop" and "spawned":
    {"event": "set", "service_time_ms": 20.0}   change the emulated per-record cost (tests, demo)
    {"event": "set", "paused": true}             pause / resume a source
    {"event": "set", "pinned": true}             fogctl scale pinned the count: no automatic decision
    {"event": "reconnect"}                       the agent lets a fenced worker reconnect
    {"event": "replicated", "gen": g, "log": n}  the standby holds the keyed saves up to (g, n)

Why apart from agent.instance.worker (the process's entry point): a chain process
(agent.instance.chain) hosts several `Worker`s, and the entry point runs either; with the class
here neither module imports the other's importer.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, List, Optional, TextIO

from agent.config import PipelineConfig, load_pipeline_text
from agent.files import write_atomic
from agent.instance.commands import (
    AckIngest, Command, CrashPoint, Emit, Exit, Handoff, LogIngest, Notify, Persist, PersistSource, Publish,
    RequestSpawn, SaveKeyed, SaveRoutes,
)
from agent.instance import deployfiles
from agent.instance.ingestlog import IngestLog
from agent.instance.core import Instance
from agent.instance.keyed_state import KeyedState
from agent.instance.events import (
    Abort, Control, EnvelopeReceived, Event, PubAcked, PublishAccepted, PublishRefused, Restarted, SessionLost,
    Started, Tick,
)
from agent.instance.spec import InstanceSpec, control_line
from agent.mqtt.client import ingest_id, worker_id
from agent.mqtt.transport import (
    Connected, Disconnected, PubAck, PublishRejected, Received, Transport, TransportError, poll_all,
)
from agent.operators.admission import OperatorRefused, check_mqtt_topics, node_allow_list
from agent.operators.builtin import OperatorContext, load_operator
from agent.operators.keyed import is_keyed

log = logging.getLogger("agent.instance.worker")

RECONNECT_ASK = 5.0  # a fenced worker asks its agent again this often (see Worker._ask_to_reconnect)



def _next_is_keyed(pipeline: PipelineConfig, stage: int) -> bool:
    """Does the operator after ours keep keyed state? Then our key routing follows its group ->
    owner table (docs/operators.md, "Key groups that move"). Resolved through the node's
    allow-list, like our own function; a function it refuses makes that operator's workers fail
    at their start anyway, so it counts as not keyed here."""
    ops = pipeline.operators
    if stage + 1 >= len(ops) or ops[stage].key is None:
        return False
    try:
        return is_keyed(node_allow_list().resolve(ops[stage + 1].function))
    except (ValueError, OperatorRefused):
        return False

class Worker:
    """The shell: loads, locks, connects, and feeds one `Instance` (`self.core`)."""

    def __init__(
        self,
        spec: InstanceSpec,
        out: TextIO = sys.stdout,
        clock: Callable[[], float] = time.monotonic,
        transport: Optional[Transport] = None,
        wall: Callable[[], float] = time.time,
        ingest: Optional[Transport] = None,
        local: FrozenSet[str] = frozenset(),
        handoff: Optional[Callable[[str, Any], None]] = None,
        member: bool = False,
    ) -> None:
        self.spec = spec
        # A chain member (agent.instance.chain): `local` are the co-hosted instances, `handoff`
        # takes the envelopes for them, and every control line carries "member" (our id).
        self.handoff = handoff
        self.member = member
        self.out = out
        self.clock = clock
        self.wall = wall
        self.pipeline: PipelineConfig = load_pipeline_text(spec.pipeline_toml, f"pipeline {spec.pipeline}")
        op = self.pipeline.operator(spec.operator)
        # Defence in depth (docs/security.md, "No code from the bus"): the agent admitted this
        # function; refuse it again here, from the node's own allow-list, before anything is
        # created or imported.
        node_allow_list().check(op.function)
        # and an MQTT operator only on the topics its pipeline's (signed) allow-list names
        check_mqtt_topics(op.function, op.params, self.pipeline.pipeline.mqtt_topics)
        self.ctx = {"instance": spec.instance, "operator": spec.operator, "node": spec.node}
        self.state_dir = Path(spec.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.sink_dir = Path(spec.extra.get("sink_dir") or self.state_dir)
        self.sink_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.state_dir / f"{spec.instance}.state.json"
        self.source_path = self.sink_dir / f"{spec.instance}.source.json"
        self.keyed_path = self.state_dir / f"{spec.instance}.keyed.json"
        self.routes_path = self.state_dir / f"{spec.instance}.routes.json"  # agent.dataplane.sticky
        self.routes_log = self.state_dir / f"{spec.instance}.routes.log"
        self._routes_fd: Optional[int] = None
        # One process per identity: wait for a previous incarnation (still draining after its
        # agent died) to exit before reading its state or taking over its MQTT session.
        self._identity_lock = hold_identity_lock(
            self.state_dir / f"{spec.instance}.lock", float(spec.extra.get("drain_timeout", 10.0)) + 5.0
        )
        # Files a namesake of an earlier deploy left here are not ours (agent.instance.deployfiles).
        deployfiles.claim_spec(spec)
        if spec.restart:
            self._take_handover(spec.extra)
        ctx = OperatorContext(
            instance=spec.instance,
            operator=spec.operator,
            node=spec.node,
            kind=op.kind,
            params=dict(op.params),
            state_dir=self.state_dir,
            sink_dir=self.sink_dir,
            restart=spec.restart,
            spill=dict(spec.extra.get("spill") or {}),
        )
        self.operator: Any = load_operator(op.function, ctx)
        self.core = Instance(spec, self.pipeline, self.operator, perf=time.perf_counter, cpu=time.process_time,
                             local=local, next_keyed=_next_is_keyed(self.pipeline, self.pipeline.index(spec.operator)))
        self.transport = transport or Transport(worker_id(spec.broker, spec.cluster, spec.instance), spec.broker)
        # Re-homing on: after a lost connection, reconnect only when our agent says this identity
        # was not re-homed meanwhile (see _ask_to_reconnect).
        self.transport.gate_reconnect = bool(spec.extra.get("fence_reconnect"))
        # A source that reads sensors (taxi.MqttIngestSource) reads them on a connection of its
        # own with manual acks: a delivery is PUBACKed only once a successor acked its record.
        # Not on `transport`: deliveries waiting for that ack fill the broker's in-flight window
        # to the client, and the successors' acks to our inbox would queue behind them for ever.
        self.ingest: Optional[Transport] = ingest
        # ... and logs what it numbers (agent.instance.ingestlog); no other worker opens the file
        self.ingest_log = (IngestLog(self.sink_dir / f"{spec.instance}.ingest.log")
                           if self.core.source.sensor else None)
        if ingest is None and transport is None and self.core.source.sensor:
            self.ingest = Transport(ingest_id(spec.broker, spec.cluster, spec.instance), spec.broker, manual_ack=True)
        if self.ingest is not None:
            self.ingest.gate_reconnect = self.transport.gate_reconnect
        self._asked_reconnect_at = -1e9
        self.control: "deque[Dict[str, Any]]" = deque()
        self.exit_code: Optional[int] = None
        self.exit_command: Optional[Exit] = None
        self.abort = ""  # set by a second signal while draining: exit at the next turn
        self.counts: Dict[str, int] = {"notify_failed": 0, "reconnect_asks": 0, "mqtt_in": 0}

    # ---- start-up ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect, subscribe, and only then hand the instance its start (it says "ready").

        INVARIANT 2 (subscribe before announce): the agent tells nobody about this instance before
        it reads "ready", and "ready" is written only after the broker's SUBACK for the inbox.
        """
        self.subscribe()
        self.begin()

    def subscribe(self) -> None:
        """Connect and subscribe (the first half of `start`; a chain subscribes every member
        before it starts any, since a restarted member acks its chained predecessor at once)."""
        self.transport.connect()
        self.transport.subscribe(self.core.inbox)
        topic = self.core.source.topic
        if topic is not None:
            if self.ingest is not None:
                self.ingest.connect()
                self.ingest.subscribe(topic)
            else:
                self.transport.subscribe(topic)

    def transports(self) -> List[Transport]:
        """The connections to poll: ours, and a sensor source's ingest connection."""
        return [self.transport] if self.ingest is None else [self.transport, self.ingest]

    def begin(self) -> None:
        """Hand the instance its start (it says "ready"): after `subscribe`."""
        if self.spec.restart:
            position = self._load_json(self.source_path) or None
            keyed = KeyedState.load(self.keyed_path) if self.core.keyed is not None else None
            routes = (self._load_text(self.routes_path), self._load_text(self.routes_log))
            logged = self.ingest_log.load() if self.ingest_log is not None else None
            self.feed(Restarted(self.wall(), self._load_json(self.state_path), position, keyed, routes, logged))
        else:
            self.feed(Started(self.wall()))

    # ---- the loop -----------------------------------------------------------------------------------

    def run(self) -> int:
        while self.exit_code is None:
            if self.ingest is None:
                self.transport.poll(self._timeout(self.clock()))
            else:
                poll_all(self.transports(), self._timeout(self.clock()))
            self.step(self.clock())
        return self.exit_code

    def step(self, now: float) -> None:
        """One loop turn: every transport event and control line, then one Tick."""
        if self.exit_code is not None:
            return
        if self.abort:
            self.feed(Abort(self.abort), now)
            return
        for ev in self.transport.take_events():
            if isinstance(ev, Received):
                self.counts["mqtt_in"] += 1
                self.feed(EnvelopeReceived(ev.topic, ev.payload), now)
            elif isinstance(ev, PubAck):
                self.feed(PubAcked(ev.mid), now)
            elif isinstance(ev, Disconnected):
                log.warning("broker connection lost: %s", ev.reason, extra=self.ctx)
                self._asked_reconnect_at = -1e9
            elif isinstance(ev, Connected):
                log.info("reconnected (session kept: %s)", ev.session_present, extra=self.ctx)
                if not ev.session_present:
                    self.feed(SessionLost(), now)
        if self.ingest is not None:
            self._take_ingest(now)
        while self.control and self.exit_code is None:
            msg = self.control.popleft()
            if msg.get("event") == "reconnect":
                for t in self.transports():
                    t.allow_reconnect()
            else:
                self.feed(Control(msg), now)
        self._ask_to_reconnect(now)
        if self.exit_code is None:
            self.feed(Tick(self.wall()), now)

    def _take_ingest(self, now: float) -> None:
        """The ingest connection's deliveries, each with its ack token. A lost session loses
        nothing of ours: what it held unacked was never acked downstream either, and the
        subscription is renewed on every reconnect (Transport._renew_subscriptions)."""
        for ev in self.ingest.take_events():  # type: ignore[union-attr]
            if isinstance(ev, Received):
                self.counts["mqtt_in"] += 1
                token = (ev.mid, ev.qos) if ev.qos > 0 else None
                self.feed(EnvelopeReceived(ev.topic, ev.payload, token, ev.dup), now)
            elif isinstance(ev, Disconnected):
                log.warning("ingest connection lost: %s", ev.reason, extra=self.ctx)
                self._asked_reconnect_at = -1e9

    def _timeout(self, now: float) -> float:
        if self.ingest is not None and self.ingest.events:
            return 0.0
        if self.transport.events or self.control or self.exit_code is not None or self.abort:
            return 0.0
        return self.core.next_wake(now)

    def feed(self, event: Event, now: Optional[float] = None) -> None:
        """Hand one event to the instance and perform what it asks, with the publish feedback."""
        when = self.clock() if now is None else now
        commands = self.core.handle(event, when)
        while commands:
            feedback = self._perform(commands)
            commands = []
            for ev in feedback:
                commands += self.core.handle(ev, when)

    # ---- performing commands ---------------------------------------------------------------------------

    def _perform(self, commands: List[Command]) -> List[Event]:
        feedback: List[Event] = []
        refused = False
        for c in commands:
            if isinstance(c, Publish):
                if refused:  # keep the order (commands.py): after a refusal, refuse unseen
                    feedback.append(PublishRefused(c.token, "an earlier publish was refused"))
                    continue
                try:
                    mid = self.transport.publish(c.topic, c.payload)
                except PublishRejected as exc:
                    refused = True
                    feedback.append(PublishRefused(c.token, str(exc)))
                else:
                    feedback.append(PublishAccepted(c.token, mid))
            elif isinstance(c, Handoff):
                if self.handoff is None:
                    raise TypeError(f"hand-off to {c.dest} outside a chain")
                self.handoff(c.dest, c.envelope)  # queued: the chain delivers after this call
            elif isinstance(c, Persist):
                write_atomic(self.state_path, json.dumps(c.state))
            elif isinstance(c, Emit):
                fields = c.fields
                if c.event == "heartbeat":
                    fields = {"stats": {**fields["stats"], **self._transport_stats()}}
                self._emit(c.event, **fields)
            elif isinstance(c, Notify):
                try:
                    self.transport.publish(c.topic, c.payload, qos=c.qos, retain=c.retain)
                except (TransportError, PublishRejected, ValueError) as exc:
                    self.counts["notify_failed"] += 1
                    log.warning("event not published: %s", exc, extra=self.ctx)
            elif isinstance(c, PersistSource):
                write_atomic(self.source_path, json.dumps(c.data))
            elif isinstance(c, LogIngest):
                if self.ingest_log is None:  # only a sensor source's core asks for it
                    raise TypeError(f"{c!r} from an instance that is not a sensor source")
                self.ingest_log.append(c.entries, c.keep_from)
            elif isinstance(c, AckIngest):
                if self.ingest is not None:
                    for mid, qos in c.tokens:
                        self.ingest.ack(mid, qos)
            elif isinstance(c, SaveKeyed):
                c.state.save(self.keyed_path)
                if c.state.replicated_acks:  # the agent ships it to the standby (agent.node.replicas)
                    gen, log_bytes = c.state.saved_token()
                    self._emit("keyed_saved", gen=gen, log=log_bytes)
            elif isinstance(c, SaveRoutes):
                self._save_routes(c)
            elif isinstance(c, RequestSpawn):
                self._emit("spawn", request=c.request, spec=c.spec)
            elif isinstance(c, CrashPoint):
                self.crash_point(c.name)
            elif isinstance(c, Exit):
                self._exit(c)
            else:
                raise TypeError(f"unknown command {c!r}")
        return feedback

    def _transport_stats(self) -> Dict[str, Any]:
        stats = {"paho_out": self.transport.pending_out(), "connected": self.transport.connected,
                 **{k: v for k, v in self.counts.items() if v}}
        if self.ingest is not None:  # a sensor source's dups of deliveries it had PUBACKed already
            stats["ingest_acks_skipped"] = self.ingest.acks_skipped
        return stats

    def _exit(self, c: Exit) -> None:
        for t in self.transports():
            try:
                t.close(final=c.final)
            except TransportError:
                pass
        self._emit("exit", code=c.code, reason=c.reason, final=c.final)
        self.exit_code = c.code
        self.exit_command = c

    # ---- control channel ----------------------------------------------------------------------------

    def _ask_to_reconnect(self, now: float) -> None:
        """Fencing after a partition (re-homing on). Our node may have been declared dead while
        we could not reach the broker, and this identity started elsewhere; reconnecting would
        take its MQTT session from the new incarnation (they took it from each other about 60
        times in the second before the agent killed us, and the new one stalled: records lost).
        So a worker that lost its connection waits until its agent, connected again, has checked
        the retained re-homing records and either kills it or sends "reconnect"."""
        held = any(getattr(t, "reconnect_held", False) for t in self.transports())
        if held and now - self._asked_reconnect_at >= RECONNECT_ASK:
            self._asked_reconnect_at = now
            self.counts["reconnect_asks"] += 1
            self._emit("may_reconnect")

    # ---- files ----------------------------------------------------------------------------------------

    def _take_handover(self, extra: Dict[str, Any]) -> None:
        """A keeper migrated off a draining node (daemon `_hand_over`) arrives here with its
        persisted state in `extra["handover_state"]` (and a source's position in
        `extra["handover_source"]`), since its old state dir is on the other node. Written to our
        own paths before anything reads them, so the restore is exactly a same-node restart's.
        A state file already here with an epoch at least the shipped one's wins: it is a later
        incarnation on this node (a crash restart after the hand-over); an older one is a leftover
        of an earlier stay here and must not be restored.

        A keyed operator's state came in chunks before the spawn; our agent verified it and wrote
        it to `<instance>.keyed.handover` (agent.node.statexfer). It replaces our keyed snapshot,
        and its log goes (a leftover log of the same generation would be applied over it), before
        the state file, so that a crash in between installs nothing twice and loses nothing."""
        state = extra.get("handover_state")
        here_epoch = int(self._load_json(self.state_path).get("epoch", -1))
        staged = self.state_dir / f"{self.spec.instance}.keyed.handover"
        shipped_wins = isinstance(state, dict) and here_epoch < int(state.get("epoch", 0))
        if extra.get("handover_keyed") and staged.exists() and (shipped_wins or (state is None and here_epoch < 0)):
            self.keyed_path.with_name(self.keyed_path.name + ".log").unlink(missing_ok=True)
            os.replace(staged, self.keyed_path)
            log.info("hand-over: installed the keyed state shipped before the spawn", extra=self.ctx)
        else:
            staged.unlink(missing_ok=True)  # older than what is here
        if shipped_wins:
            write_atomic(self.state_path, json.dumps(state))
            log.info("hand-over: restoring the state shipped with the spec (epoch %s)", state.get("epoch"),
                     extra=self.ctx)
        source = extra.get("handover_source")
        if isinstance(source, dict):
            try:
                here = int(self._load_json(self.source_path).get("resume_from", -1))
            except (ValueError, TypeError):
                here = -1
            if here < int(source.get("resume_from", 0)):  # a shared sink_dir already has it
                write_atomic(self.source_path, json.dumps(source))

    def _save_routes(self, c: SaveRoutes) -> None:
        """Write-ahead of where records go (invariant 8): a new snapshot empties the log; the
        log is appended to (a torn last line is skipped at load: its batches never went out)."""
        if c.snapshot is not None:
            write_atomic(self.routes_path, c.snapshot)
            if self._routes_fd is not None:
                os.close(self._routes_fd)
            self._routes_fd = os.open(self.routes_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600)
        if c.log:
            if self._routes_fd is None:  # kept open: an open and a close per loop turn cost more than the write
                self._routes_fd = os.open(self.routes_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            view = memoryview(c.log.encode())
            while view:
                view = view[os.write(self._routes_fd, view):]

    @staticmethod
    def _load_text(path: Path) -> Optional[str]:
        try:
            return path.read_text()
        except (OSError, ValueError):
            return None

    @staticmethod
    def _load_json(path: Path) -> Dict[str, Any]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return dict(data) if isinstance(data, dict) else {}

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
        if self.member:
            fields["member"] = self.spec.instance
        try:
            self.out.write(control_line(event, **fields))
            self.out.flush()
        except (BrokenPipeError, ValueError):
            pass  # the agent is gone; the loop will be stopped by stdin EOF


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


__all__ = ["InstanceBusy", "Worker", "hold_identity_lock"]
