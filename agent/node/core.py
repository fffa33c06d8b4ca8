"""The node's decisions, sans-IO: `NodeCore` holds every part that decides what this node does
(the fleet view, the gate, createNode(), restarts and hand-overs, the reconcile after a connect,
re-homing, pins, drains, standby copies, the rpc and peer requests, the records and probes from
the bus) and is driven by typed events through one table, `NodeCore.handle`: a message from the
bus, a worker's control line, a worker's exit, a PUBACK, the start of a session, the loop's tick,
the start of the shutdown.

Rules of this file (h11's habit: the protocol knows nothing of sockets): no socket, thread,
process or random number, enforced by tests/test_layout.py; the time is an argument of every
event, the wall clock a call it is given. What the core has done goes through the ports it is
given, each typed below or in agent.node.workers: the bus (`BusPort`, agent.node.bus.AgentBus:
publish, and what the session knows), the worker table (`WorkerTable`, the supervisor: start,
send, stop, kill), the report (agent.node.report.Report: the counters and the figures of the
node state) and the spill (agent.spill.local.AgentSpill, or None). The daemon (agent.node.daemon)
is the shell: it owns the loop, the threads, the processes, the signals and the MQTT client, and
hands each event to this core; a test builds a core on fakes of the ports and drives it without a
broker or a process.

The parts and what each decides are listed in docs/runtime.md, "Layout".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Union

from agent import events, signing, topics
from agent.config import AgentConfig
from agent.files import write_atomic
from agent.instance import deployfiles
from agent.instance.spec import InstanceSpec, request_spec
from agent.node import hosted, loopevents, nodestate, rehome, replicas, routes, rpc, spawns, spawnshell, statexfer
from agent.node.contexts import PolicyContexts
from agent.node.drain import Drain
from agent.node.exits import ExitCalls, Exited, Exits
from agent.node.fencing import Fencing
from agent.node.fleetview import FleetView
from agent.node.gate import Gate, NodeLocal
from agent.node.handover import HandOverCalls, HandOvers, read_json
from agent.node.hostmap import MAX_MOVED
from agent.node.hostsync import HostSync
from agent.node.inbound import FOLLOWED_FILE, Inbound, InboundCalls
from agent.node.pins import Pins
from agent.node.placement import PlacementPolicy
from agent.node.reconcile import ReconcileCalls, Reconciler
from agent.node.rehomer import Rehomer, RehomerCalls
from agent.node.rehoming import Rehoming
from agent.node.requests import NodeCalls, Requests, load_pins
from agent.node.restarts import Restarts
from agent.node.site_manager import LeaseBoard, lease_bound
from agent.node.spawnshell import CreateNodes
from agent.node.workerlines import LineCalls, WorkerLines
from agent.node.workers import WORKER_EXIT_BAD_SPEC, Reaped, Worker, WorkerStatus, WorkerTable
import agent.operators.admission as admission
from agent.schema import ConfigError

log = logging.getLogger(__name__)

MOVED_FILE = "moved.json"
BINDINGS_FILE = "bindings.json"  # agent.node.hostmap's proven bindings, kept over a restart


class BusPort(Protocol):
    """What the core may read and ask of the MQTT session (agent.node.bus.AgentBus)."""

    client_id: str
    broker: Any  # agent.mqtt.settings.BrokerSpec
    connected: bool
    retained_in: bool  # the retained records of this connection are in (its sync marker came back)
    last_puback: float

    def publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1,
                correlation: Optional[bytes] = None) -> Union[bool, int]: ...

    def online(self) -> None: ...

    def marked(self, payload: bytes) -> bool: ...


# -- the events the core is driven by (beside agent.node.loopevents' MqttMessage and Puback) ------


@dataclass(frozen=True)
class WorkerSaid:
    """A worker's control line, decoded by the supervisor (`handle_line`), with one wall reading."""

    instance: str
    msg: Dict[str, Any]
    wall: float


@dataclass(frozen=True)
class WorkerExited:
    reaped: Reaped


@dataclass(frozen=True)
class SessionUp:
    """A CONNACK the bus accepted; the shell has subscribed and sent its sync marker."""

    session_present: bool


@dataclass(frozen=True)
class Tick:
    """The loop's turn: at least every agent.node.daemon.TICK seconds."""


@dataclass(frozen=True)
class Stopping:
    """The shutdown began (a signal): no createNode() from now on."""

    why: str


class NodeCore:
    """The decisions of one node. `handle(event, now)` for every event; the parts are attributes."""

    def __init__(self, cfg: AgentConfig, policy: PlacementPolicy, supervisor: WorkerTable, bus: BusPort, report: Any,
                 spill: Any, latency_core: Any, allowed: admission.AllowList, clock: Callable[[], float],
                 wall: Callable[[], float], received: Callable[[Any, float], float] = lambda msg, now: now) -> None:
        self.cfg = cfg
        self.node = cfg.agent.node
        self.cluster = cfg.agent.cluster
        self.clock = clock
        self.wall = wall
        self.supervisor = supervisor
        self.bus = bus
        self.report = report
        self.spill = spill
        broker = bus.broker
        # Who may say which pipelines run here (docs/security.md, "Signed pipeline specs"):
        # the admins' public keys, fixed at start; none configured, signatures are not required.
        trust = signing.SpecTrust(admin_keys(cfg))
        boot = format(int(wall()) % (36 ** 5), "x")
        self.view = FleetView(self.node)  # what the retained records say (agent.node.fleetview)
        self.contexts = PolicyContexts()  # the Gesscale policies' sibling contexts (agent.node.contexts)
        self.latency_core = latency_core  # RTT to the other agents (agent.measure.latency), or None
        self.restarts = Restarts()  # crashed workers to start again here, and their backoff
        self.drain = Drain()  # fogctl drain: no new instances, keepers moving (agent.node.drain)
        self.staging = statexfer.Staging()  # keyed states arriving with a hand-over, by (node, instance)
        # keyed states copied to a standby node, both roles (agent.node.replicas)
        self.replication = replicas.Replication(self.node, Path(self.cfg.agent.state_dir))
        self.rehoming = Rehoming(self.node)  # offline times, planned nodes, claims, retries
        # the specs stored as hosted here, and whether our retained hosted record lags (agent.node.hosted)
        self.stored = hosted.HostedSpecs(cfg.agent.state_dir)
        # Which node hosts which instance (docs/security.md, "Data channels"), sent to every worker
        # as the control line "hosts", and where this node moved instances to (agent.node.hostsync),
        # both kept in the state directory.
        self.hosts = HostSync(self.node, _load_moved(Path(cfg.agent.state_dir)),
                              read_json(Path(cfg.agent.state_dir) / BINDINGS_FILE))
        # After each connect: our instances that run elsewhere now, the first re-adoption, and the
        # workers' reconnect grants (agent.node.fencing)
        self.fencing = Fencing(self.node)
        self.spawns = spawns.Spawns(self.node, f"{self.bus.client_id}-{boot}")  # createNode() (agent.node.spawns)
        self.stopping_since: Optional[float] = None  # when the shutdown began
        self._state_dirty = True  # our retained state lags: publish it soon
        # Who may ask for what (agent.node.gate): the admission of specs and of peer requests.
        self.gate = Gate(NodeLocal(self.node, self.cluster, broker, cfg.agent.state_dir,
                                   cfg.agent.heartbeat_period, cfg.agent.dead_after > 0, cfg.mqtt.inbox_per_node,
                                   cfg.agent.keyed_standby),
                         allowed, admission.NodeDirs.of(cfg), trust, self.report.counters, boot)
        # fogctl scale pins (agent.node.pins), kept in the state directory
        self.pins = Pins(load_pins(Path(cfg.agent.state_dir)))
        # The site manager (docs/site-manager.md): every agent reads the nodes' claims, each on its
        # own topic, and derives the leader (a drain on the peer topic is accepted from the leader
        # only); [site_manager] enabled runs a candidate, which shares this board.
        sm = cfg.site_manager
        self.site_leases = LeaseBoard(cfg.agent.node, lease_bound(sm.lease, sm.period))
        # The leader we followed before a restart, kept while its claim stays valid: a restarted
        # reader that followed nobody tied between the leader and a claim beside it in a fleet of 3.
        followed = (read_json(Path(cfg.agent.state_dir) / FOLLOWED_FILE) or {}).get("follows")
        if isinstance(followed, str) and followed and followed != self.node and len(followed) <= 256:
            self.site_leases.held = self.site_leases.previous = followed
        # The parts, given the parts they read and calls into the node. Late-bound calls: the fuzzer
        # and the tests replace some of these methods on a built core.
        event = lambda *a, **kw: self._event(*a, **kw)
        publish = lambda *a, **kw: self._publish(*a, **kw)
        bad = lambda *a: self._bad(*a)
        create_node = lambda *a, **kw: self.creating.create(*a, **kw)
        spawn = lambda e, now: self.creating.handle(e, now)
        start = lambda group, now: self._start_group(group, now)
        stop = lambda inst, now: self.supervisor.stop(inst, now)
        stopping = lambda: self.stopping
        connected, retained_in = (lambda: self.connected), (lambda: self._retained_in)
        # createNode() on this node: placed, walked (agent.node.spawns), carried out (agent.node.spawnshell)
        self.creating = CreateNodes(self.spawns, spawnshell.Here(
            self.node, self.cluster, cfg.agent.state_dir, self.supervisor, self.spill, self.view, self.staging,
            self.counters, connected, lambda: self.free_slots(),
            # a re-home placed on the standby holding its copy starts beyond the slots, not while we drain
            lambda spec, cause: spawns.starts_beyond_slots(spec, cause, self.node, self.drain.draining,
                                                           self.replication.store.meta(spec.instance) is not None),
            lambda spec: self.replication.install_copy(spec, self.counters), self._changed, self._hosted_first,
            publish, bad), policy, self.contexts, cfg.agent.slots, cfg.security.node_slots, stopping)
        # This node as the re-homer of lost nodes (agent.node.rehomer)
        self.rehomer = Rehomer(self.node, cfg.agent.dead_after, cfg.agent.state_period, self.rehoming, self.view,
                               self.gate, RehomerCalls(
            create_node=create_node, publish_rehomed=lambda: self._publish_rehomed(), moved=self._stated_move,
            connected=connected, retained_in=retained_in, stopping=stopping,
            local=lambda: {i: w.stats for i, w in self.supervisor.workers.items()},
            copies=lambda node: self.replication.store.owned([node])))
        # Our workers' exits and the restarts and hand-overs they lead to (agent.node.exits,
        # agent.node.handover)
        self.exits = Exits(self.node, self.spawns, self.drain, self.fencing, self.pins, self.restarts, self.hosts,
                           self.supervisor, self.report.counters, ExitCalls(
            unhost=self._unhost, forget=self._forget, spawn=spawn, event=event,
            hand_over=lambda *a: self.handovers.start(*a), start=start, stop=stop, stopping=stopping))
        self.handovers = HandOvers(self.node, cfg.agent.state_dir, boot, self.drain, lambda: self.wall(), HandOverCalls(
            create_node=create_node, restart=lambda spec: self.exits.restart(spec, self.clock()),
            moved=self._stated_move, forget=self._forget, event=event, changed=self._changed, stopping=stopping))
        # After a connect, the fencing core's answers carried out, and the instances a pipeline's
        # record rules out (agent.node.reconcile)
        self.reconciler = Reconciler(self.node, cfg.agent.slots, self.fencing, self.gate, self.view, self.stored,
                                     self.supervisor.workers, self.exits.undeploying, self.report.counters,
                                     ReconcileCalls(
            forget=self._forget, undeploy=self._undeploy, kill=lambda *a: self.supervisor.kill(*a), stop=stop,
            start=start, local_spec=lambda spec: self.spill.with_spill(spec) if self.spill is not None else spec,
            changed=self._changed))
        # Our workers' control lines (agent.node.workerlines)
        self.worker_lines = WorkerLines(self.supervisor.workers, self.spawns, self.gate, self.view, self.stored,
                                        self.fencing, self.pins, self.exits.undeploying, LineCalls(
            observe=self._heartbeat, send=lambda *a, **kw: self.supervisor.send(*a, **kw), spawn=spawn,
            create_node=create_node, event=event, publish_state=self._publish_state,
            publish_hosted=self._publish_hosted, saved=self.replication.saved, replicate=self._replicate,
            apply_pins=lambda: self.requests.apply_pins(), changed=self._changed, connected=connected))
        # The requests on our rpc and peer topics (agent.node.requests)
        self.requests = Requests(self.node, self.cluster, cfg.agent.state_dir, wall, self.supervisor, self.gate,
                                 self.view, self.hosts.hostmap, self.site_leases, self.pins, self.drain,
                                 self.replication.store, self.staging, self.spill, self.report.counters,
                                 self.report.local_instances, NodeCalls(
            spawn=spawn, undeploy=self._undeploy, event=event, changed=self._changed,
            free_slots=lambda: self.free_slots(), fleet_slots=lambda: self.creating.fleet_slots(), stopping=stopping,
            publish=publish, bad=bad))
        # The records and probes from the bus (agent.node.inbound)
        self.inbound = Inbound(self.node, self.cluster, self.view, self.hosts, self.replication, self.rehoming,
                               self.gate.trust, self.site_leases, self.latency_core, self.report.counters,
                               lambda: self.clock(), lambda: self.wall(), InboundCalls(
            publish=publish, keep=self._keep, bad=bad, changed=self._changed,
            drop_stale=lambda p, now: self.reconciler.drop_stale(p, now), retained_in=retained_in,
            restate_rehomed=lambda: self._publish_rehomed(), received=received))

    @property
    def connected(self) -> bool:
        return self.bus.connected

    @property
    def _retained_in(self) -> bool:
        return self.bus.retained_in

    @property
    def counters(self) -> Dict[str, int]:
        return self.report.counters

    @property
    def stopping(self) -> bool:
        return self.stopping_since is not None

    def _publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1,
                 correlation: Optional[bytes] = None) -> Union[bool, int]:
        """The bus's publish, by the name the parts call (and the tests replace)."""
        return self.bus.publish(topic, payload, retain=retain, qos=qos, correlation=correlation)

    # -- the events ------------------------------------------------------------------------------

    def handle(self, event: Any, now: float) -> None:
        """Hand one event to the handler of its type (`_EVENTS`)."""
        self._EVENTS[type(event)](self, event, now)

    def _on_mqtt_message(self, event: loopevents.MqttMessage, now: float) -> None:
        self._on_message_safely(event.msg, now)

    def _on_worker_said(self, event: WorkerSaid, now: float) -> None:
        self.worker_lines.handle(event.instance, event.msg, now, event.wall)

    def _on_worker_exited(self, event: WorkerExited, now: float) -> None:
        self._on_reaped(event.reaped, now)

    def _on_puback(self, event: loopevents.Puback, now: float) -> None:
        if self.replication.waits_for(event.mid):
            self.replication.published(event.mid, now, self._publish_replica)

    def _on_session_up(self, event: SessionUp, now: float) -> None:
        # State before status: whoever sees "online" (a snapshot ends at a sync marker, not after
        # a pause) then also finds this node's retained state, so `deploy` can place on it.
        self._publish_state(now)
        self.bus.online()
        self._state_dirty = True
        self.stored.dirty = True
        if self.view.rehomed_by_node.get(self.node):
            # a broker restarted from its last autosave may have lost it (or kept an older copy)
            self._publish_rehomed()
        # Re-adopt (first connect) and fence (every connect) once the retained states are in.
        self.fencing.connected(now)

    def _on_stopping(self, event: Stopping, now: float) -> None:
        if self.stopping_since is None:
            self.stopping_since = now
            self.creating.handle(spawns.Shutdown(), now)

    def _on_tick(self, event: Tick, now: float) -> None:
        """The periodic work, in this order: exits first (a reaped worker's restart or hand-over),
        then what the fleet's records ask, then what we say of ourselves."""
        if self.drain.copies_first:
            self.exits.release_keepers(now)
        if self.fencing.reconcile_due(now, self._retained_in, self.stopping):
            self.reconciler.reconcile(now, self.wall())
        if self.stored.dirty and self.connected:
            self._publish_hosted()
        self._sync_hosts()
        self.rehomer.tick(now, self.wall())
        self._grant_reconnects(now)
        if self.pins:
            self.requests.expire_pins()
        self.exits.tick(now)
        if self.spawns.calls:
            self.creating.handle(spawns.Expire(), now)
        if self.replication.shippers:
            self._replicate(now)
        self.staging.expire(now)
        if self.connected:
            self.inbound.probe()  # a ping's send time: after the work above
            if self.report.due(now, self._state_dirty):
                self._publish_state(now)
                self._send_policy_contexts()

    _EVENTS: Dict[type, Callable[["NodeCore", Any, float], None]] = {
        loopevents.MqttMessage: _on_mqtt_message, WorkerSaid: _on_worker_said, WorkerExited: _on_worker_exited,
        loopevents.Puback: _on_puback, SessionUp: _on_session_up, Stopping: _on_stopping, Tick: _on_tick,
    }

    # -- state ---------------------------------------------------------------------------------

    def state_doc(self) -> Dict[str, Any]:
        copies = self.replication.store.owned(n for n, up in self.view.online.items() if not up and n != self.node)
        return self.report.state_doc(self.free_slots(), self.pins, self.drain,
                                     self.hosts.moved_statements(self.supervisor), copies)

    def free_slots(self) -> int:
        if self.drain.draining:
            return 0  # `fogctl drain`: no new instance until `undrain`
        return max(0, self.cfg.agent.slots - len(self.supervisor))

    def _changed(self) -> None:
        self._state_dirty = True

    def _stated_move(self, instance: str, node: Any) -> None:
        """We moved `instance` to `node` (its createNode() reply): say so in our state record."""
        if self.hosts.stated_move(instance, node):
            self._keep(MOVED_FILE, {"moved": [[i, n] for i, n in self.hosts.moved_to.items()]}, "moved statements")
            self._state_dirty = True

    def _keep(self, name: str, doc: Any, what: str) -> bool:
        """Write `doc` as `<state_dir>/<name>` (atomically) for the next start; False, logged, when
        the disk refused it."""
        state_dir = Path(self.cfg.agent.state_dir)
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(state_dir / name, json.dumps(doc))
        except OSError as exc:
            log.warning("%s not saved: %s", what, exc, extra={"node": self.node})
            return False
        return True

    def _publish_state(self, now: float) -> None:
        self.report.observe_node(self.spill)
        doc = self.state_doc()
        self.view.fleet[self.node] = doc
        if self._publish(topics.agent_state(self.cluster, self.node), nodestate.encode_state(doc), retain=True):
            self.report.last_state = now
            self._state_dirty = False

    def _send_policy_contexts(self) -> None:
        """Each local instance of a Gesscale policy gets its sibling context (agent.node.contexts)."""
        docs = {n: d for n, d in self.view.fleet.items() if n == self.node or self.view.online.get(n, True)}
        active = [(w.instance, w.spec) for w in self.supervisor.workers.values() if w.status is WorkerStatus.ACTIVE]
        for instance, ctx in self.contexts.contexts(docs, self.view.latency, active):
            self.supervisor.send(instance, "set", context=ctx)

    def _event(self, etype: str, instance: str, operator: str, pipeline: str, **detail: Any) -> None:
        detail["source"] = "agent"
        try:
            ev = events.make(etype, ts=self.wall(), node=self.node, instance=instance, operator=operator,
                             pipeline=pipeline, detail=detail)
        except ValueError as exc:  # a bad event must never take the agent down
            log.error("event %s not published: %s", etype, exc, extra={"node": self.node})
            return
        self._publish(topics.events(self.cluster), ev.to_json().encode(), qos=1)
        if self.spill is not None:
            self.spill.on_event(ev.to_dict())

    # -- messages ------------------------------------------------------------------------------

    def _on_message_safely(self, msg: Any, now: float) -> None:
        """One message from the bus: whatever it holds, it never ends the loop (docs/security.md).
        A failure the handlers did not foresee is counted and logged in one line naming the
        topic and the sender, and the loop goes on with the next message."""
        try:
            self._on_message(msg, now)
        except Exception as exc:
            self.counters["bad_messages"] += 1
            topic = str(getattr(msg, "topic", "?"))
            sender = routes.sender(topics.parse(self.cluster, topic))
            log.warning("message on %s from %s skipped: %s: %s", topic[:200], sender or "?", type(exc).__name__,
                        str(exc)[:200], extra={"node": self.node})

    def _bad(self, what: str, sender: Optional[str], exc: Any) -> None:
        self.counters["bad_messages"] += 1
        log.warning("ignoring %s from %s: %s", what, sender or "?", str(exc)[:200], extra={"node": self.node})

    def _on_message(self, msg: Any, now: float) -> None:
        """Hand one message to the part that handles its topic (agent.node.routes decides where)."""
        parsed = topics.parse(self.cluster, msg.topic)
        to = routes.route(self.node, parsed, bool(getattr(msg, "retain", False)), self._retained_in)
        if to == routes.RETAINED:
            self.counters["retained_ignored"] += 1
            log.warning("ignoring a retained message on %s (never retained)", msg.topic[:200],
                        extra={"node": self.node})
        elif to == routes.REQUEST or (to == routes.HOLD and not self.requests.hold(msg)):
            self.requests.on_request(msg, str(parsed.sender), peer=parsed.kind == "peer", now=now)
        elif to == routes.REPLY:
            self._on_rpc_reply(msg, str(parsed.sender), now)
        elif to == routes.MARKER and self.bus.marked(msg.payload):
            self.site_leases.restate()  # once per connection, from every claim and statement
            self.inbound.state_whom_we_follow()
            while self.requests.held:  # each on its own: one that fails strands none behind it
                self._on_message_safely(self.requests.held.popleft(), now)
        elif to == routes.INBOUND:
            self.inbound.handle(msg, parsed, now)

    def _on_rpc_reply(self, msg: Any, replier: str, now: float) -> None:
        """A reply on `replies/<me>/<replier>`: it answers a call only if it comes from the node
        the call went to (the topic proves the replier) with the call's correlation."""
        correlation = (rpc.correlation_of(msg) or b"").decode(errors="replace")
        if self.replication.owns(correlation):
            try:
                result = rpc.decode_reply(msg.payload)
            except ValueError as exc:
                self._bad("reply", replier, exc)
                result = {"ok": False, "error": str(exc)}
            self.replication.on_reply(correlation, replier, result, now, self._publish_replica, self._tell_replicated)
            return
        try:
            event = spawns.PeerReply(correlation, replier, rpc.decode_reply(msg.payload))
        except ValueError as exc:
            event = spawns.PeerReply(correlation, replier, bad=str(exc))
        self.creating.handle(event, now)

    # -- workers -------------------------------------------------------------------------------

    def _heartbeat(self, w: Worker, wall: float) -> None:
        """A worker's heartbeat counters: to the metrics endpoint and the spill."""
        self.report.observe(w)
        if self.spill is not None:
            self.spill.on_heartbeat(w.spec, w.stats, wall)

    def _on_reaped(self, reaped: Reaped, now: float) -> None:
        """A worker exited: counted, logged, and what follows decided (agent.node.exits)."""
        w = reaped.worker
        self._state_dirty = True
        self.report.exited(w)
        reason = (w.exit_event or {}).get("reason") or w.killed_for or f"exit status {reaped.returncode}"
        log.info("worker pid %d exited with %d (%s)", w.pid, reaped.returncode, reason, extra={"instance": w.instance})
        self.exits.reaped(Exited(w.spec, w.stats, reaped.returncode, str(reason), reaped.clean, reaped.crashed,
                                 bool((w.exit_event or {}).get("final")), reaped.returncode == WORKER_EXIT_BAD_SPEC,
                                 bool(w.chain), w.asked_to_stop), now)

    def _start_group(self, group: List[InstanceSpec], now: float) -> None:
        """One process for one spec, or a chain process for a chain's members (upstream first)."""
        if len(group) == 1:
            self.supervisor.start(group[0], now)
        else:
            self.supervisor.start_chain(group, now)

    def _grant_reconnects(self, now: float) -> None:
        """Let workers that lost their connection reconnect (re-homing on, see
        shell.Worker._ask_to_reconnect) when agent.node.fencing says why it is safe."""
        for inst in self.fencing.grants(set(self.supervisor.workers), self.connected, self.bus.last_puback):
            self.supervisor.send(inst, "reconnect")

    def _undeploy(self, instance: str) -> None:
        """Stopped for an undeploy: forgotten, never restarted."""
        self.exits.undeployed(instance)
        self._forget(instance)

    def _unhost(self, instance: str) -> None:
        """Its stored spec and our standby copy's claim go: never re-adopted (agent.node.exits)."""
        self.stored.forget(instance)
        self.replication.forget(instance)

    def _forget(self, instance: str) -> None:
        """Gone from this node for good: its stored spec, standby copy, pending restart and files."""
        self._unhost(instance)
        self.restarts.forget(instance)
        deployfiles.forget(instance, Path(self.cfg.agent.state_dir))

    # -- what it hosts: hosted and re-homed records, host tables, standby copies ---------------

    def _hosted_first(self) -> None:
        """Our hosted record, published before a request that the receiver checks against it."""
        if self.stored.dirty:
            self._publish_hosted()

    def _publish_hosted(self) -> None:
        specs = [self.replication.with_standby(request_spec(s)) for s in self.stored.specs()]
        self.view.hosted_by_node[self.node] = specs
        self.hosts.dirty = True
        if self._publish(topics.agent_hosted(self.cluster, self.node), rehome.encode_hosted(specs), retain=True):
            self.stored.dirty = False

    def _publish_rehomed(self) -> None:
        """Our retained re-homed record, as we hold it (FleetView keeps our own copy over what a
        broker restarted from its last autosave hands back)."""
        record = self.view.rehomed_by_node.get(self.node, {})
        self._publish(topics.agent_rehomed(self.cluster, self.node), json.dumps(record, sort_keys=True).encode(),
                      retain=True)

    def _sync_hosts(self) -> None:
        """Send each worker the host table of its pipeline when it changed (agent.node.hostsync)."""
        workers = {i: (w.spec.pipeline, w.pid) for i, w in self.supervisor.workers.items()}
        v = self.view
        recomputed, send = self.hosts.sync(workers, v.hosted_by_node, v.fleet, v.online, v.rehomed_by_node)
        if recomputed:
            self._save_bindings()
        for inst, pid, table in send:
            if self.supervisor.send(inst, "hosts", **table):
                self.hosts.delivered(inst, pid, table)

    def _save_bindings(self) -> None:
        """Keep the proven bindings over a restart (agent.node.hostmap, `saved`), when they changed."""
        saved = self.hosts.bindings_to_keep()
        if saved is not None and self._keep(BINDINGS_FILE, saved, "bindings"):
            self.hosts.kept(saved)

    def _replicate(self, now: float) -> None:
        """Copy the keyed saves of our workers to their standbys (agent.node.replicas): to online
        nodes that are not draining."""
        eligible = self.view.eligible_standbys()
        if self.replication.tick(now, eligible if self.connected else [], self._publish_replica, self._tell_replicated):
            self.stored.dirty = True  # the hosted record names each standby

    def _publish_replica(self, standby: str, body: Dict[str, Any], correlation: Optional[str]) -> Any:
        """False when not queued, else the message id: the next part of a snapshot waits for its
        PUBACK (replicas.Replication.published), so paho holds a few parts, not the snapshot."""
        self._hosted_first()  # the standby accepts a copy only of what our hosted record lists
        return self._publish(topics.agent_peer(self.cluster, standby, self.node), rpc.encode(body),
                             correlation=correlation.encode() if correlation is not None else None)

    def _tell_replicated(self, instance: str, gen: int, size: int) -> None:
        self.supervisor.send(instance, "replicated", gen=gen, log=size)


def admin_keys(cfg: AgentConfig) -> Optional[signing.Verifier]:
    """The verifier of `[security] admin_keys`, None when none is configured; a key file that
    is not an Ed25519 public key is a ConfigError naming the file and key (exit 78)."""
    if not cfg.security.admin_keys:
        return None
    try:
        return signing.load_verifier(cfg.security.admin_keys)
    except ValueError as exc:
        raise ConfigError(Path(cfg.source).name, "[security].admin_keys",
                          f"expected Ed25519 public key PEM files ({exc})") from None


def _load_moved(state_dir: Path) -> Dict[str, str]:
    """This node's "moved" statements, kept over an agent restart (oldest first); an unreadable
    file: none."""
    listed = (read_json(state_dir / MOVED_FILE) or {}).get("moved")
    pairs = [e for e in listed if isinstance(e, list) and len(e) == 2] if isinstance(listed, list) else []
    return dict([(i, n) for i, n in pairs if isinstance(i, str) and isinstance(n, str)][-MAX_MOVED:])


__all__ = ["BINDINGS_FILE", "BusPort", "MOVED_FILE", "NodeCore", "SessionUp", "Stopping", "Tick", "WorkerExited",
           "WorkerSaid", "admin_keys"]
