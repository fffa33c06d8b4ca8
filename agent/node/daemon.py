"""`fog-agent run`: the per-node daemon that hosts operator instances as worker processes.

Rules of this file (gunicorn's arbiter habit): ONE thread owns all state and does all publishing,
the main loop. Everything else only enqueues into `self._events` (a `queue.SimpleQueue`, whose
`put` is reentrant and therefore safe from a signal handler): paho's network thread (connect,
message), one stdout reader thread per worker, and the signal handlers; each enqueues a typed
event (agent.node.loopevents), which the loop hands to its handler through one table (`_LOOP`);
a message goes where its topic says (agent.node.routes: the requests of the rpc and peer topics,
the replies, the sync marker), or else to the handlers of the records and probes
(agent.node.inbound). The loop wakes at least every `TICK` seconds to reap workers, expire calls
and publish state.

What it does:
- MQTT 5 session (agent.node.bus, the one client): stable client id `fog-agent-<cluster>-<node>`,
  clean_start=False with a session expiry, so requests sent while it reconnects wait in the
  broker; retained status "online" with a Last Will "offline" (retained), so the fleet learns of
  a dead agent without polling.
- Node state: retained JSON (`agent.node.nodestate`, read by agent.node.report with the
  counters, systemd's status and the metrics endpoint) every `state_period`, and soon after
  every change of its instances.
- createNode(): a worker's "spawn" line, a "spawn" on our peer topic from another agent, or one
  on our rpc topic from `fog-agent deploy`. Placement (`agent.node.placement`) ranks the
  nodes; a local slot starts a worker here, a remote one becomes a peer request to that agent.
- Bus input (docs/security.md): control requests only on `agents/<me>/rpc/<admin>`, the
  protocol's spawns only on `agents/<me>/peer/<node>` and only for a pipeline that node hosts,
  re-homes or an admin deployed, each op answered by agent.node.requests; replies only to
  `replies/<requester>/<me>`; every payload bounded before parsing (agent.wire); no message ends
  the loop (`_on_message_safely`). Either way the answer ("spawned", or the rpc reply) is sent
  only after the new worker said "ready", i.e. after it subscribed to its inbox (docs/design.md
  invariant 2: subscribe before announce).
- Shutdown on SIGTERM/SIGINT: "stop" to every worker (they drain, invariant 4), SIGTERM after
  shutdown_timeout/2, SIGKILL after shutdown_timeout, then "offline" and exit. Bound: the process
  exits within shutdown_timeout + SHUTDOWN_SLACK seconds of the signal.

The shell and its parts: this module is the arbiter, what only it may do (the loop and its
schedule, the MQTT session's events, the workers' processes, the signals, the files, the events
and log lines it writes) and the wiring. Everything the node decides is in parts beside it, each
given the parts it reads, the time as an argument and, when it acts, a few late-bound calls,
none a reference to the Agent; the list, with what each decides, is docs/runtime.md, "Layout".
The parts the loop hands its events to: the MQTT session (bus), where a message goes (routes),
the rpc and peer requests (requests), the retained records and probes (inbound), our workers'
lines (workerlines) and exits (exits, with handover), createNode() (spawns, carried out by
spawnshell), the reconcile after a connect (reconcile, on fencing), the re-homing turn (rehomer,
on rehoming and rehome), the site manager (siteeffects), what the node says of itself (report).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from agent import events, notify, signing, topics
from agent.config import AgentConfig, check_tls, load_agent_config
from agent.schema import ConfigError
from agent.mqtt import client as mqttc
from agent.files import write_atomic
from agent.instance import deployfiles
from agent.instance.spec import InstanceSpec, request_spec
from agent.node import (hosted, nodestate, rehome, replicas, routes, rpc, siteeffects, spawns, spawnshell,
                        statexfer)
from agent.node.gate import Gate, NodeLocal
from agent.node.pins import Pins
from agent.node.restarts import Restarts
from agent.node.rehoming import Rehoming
from agent.node.rehomer import Rehomer, RehomerCalls
from agent.node.reconcile import ReconcileCalls, Reconciler
from agent.node.workerlines import LineCalls, WorkerLines
from agent.node.spawnshell import CreateNodes
from agent.node.fleetview import FleetView
from agent.node.bus import AgentBus, broker_of
from agent.node.report import Report
from agent.node.requests import NodeCalls, Requests, load_pins
from agent.node.drain import Drain
from agent.node.exits import ExitCalls, Exited, Exits
from agent.node.fencing import Fencing
from agent.node import loopevents
from agent.node.handover import HandOverCalls, HandOvers, read_json
from agent.node.hostmap import MAX_MOVED
from agent.node.hostsync import HostSync
from agent.node.contexts import PolicyContexts
from agent.node.inbound import FOLLOWED_FILE, Inbound, InboundCalls
from agent.node.placement import DEFAULT_POLICY, PlacementPolicy, get_policy
from agent.operators import admission
from agent.spill.local import AgentSpill
from agent.node.site_driver import SiteDriver
from agent.node.site_manager import LeaseBoard, lease_bound
from agent.node.supervisor import WORKER_COMMAND, WORKER_EXIT_BAD_SPEC, Reaped, Supervisor, Worker, WorkerStatus

log = logging.getLogger(__name__)

# Exit statuses of `fog-agent run` (sysexits.h values where one fits).
EXIT_OK = 0  # clean shutdown after a signal
EXIT_ERROR = 1  # unexpected error in the loop
EXIT_CONFIG = 78  # EX_CONFIG: the configuration is unusable
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: never reached the broker within connect_timeout

TICK = 0.2  # seconds: the loop's longest sleep
SHUTDOWN_SLACK = 3.0  # seconds beyond shutdown_timeout for reaping, "offline" and disconnect


class Halt(BaseException):
    """Leave the main loop with an exit status (gunicorn's HaltServer)."""

    def __init__(self, reason: str, status: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


def worker_env() -> Dict[str, str]:
    """The workers' environment: ours, with this checkout importable (for a non-installed tree)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root] + parts)
    return env


class Agent:
    """The daemon of one node. `run()` blocks until a signal or `request_stop()`; returns the status."""

    def __init__(
        self,
        cfg: AgentConfig,
        policy: PlacementPolicy = get_policy(DEFAULT_POLICY),
        worker_command: Sequence[str] = WORKER_COMMAND,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sample_machine: Callable[[Sequence[int]], nodestate.MachineSample] = nodestate.sample_machine,
        connect_timeout: Optional[float] = None,
        env: Optional[Dict[str, str]] = None,
        warm_worker: bool = True,
    ) -> None:
        self.cfg = cfg
        self.node = cfg.agent.node
        self.cluster = cfg.agent.cluster
        self.clock = clock
        self.wall = wall
        self._events: "queue.SimpleQueue[loopevents.LoopEvent]" = queue.SimpleQueue()
        # What a spec may name here (docs/security.md, "No code from the bus"): fixed at start.
        allowed = admission.AllowList.for_node(cfg.operators.modules)
        # Who may say which pipelines run here (docs/security.md, "Signed pipeline specs"):
        # the admins' public keys, fixed at start; none configured, signatures are not required.
        trust = signing.SpecTrust(self._admin_keys(cfg))
        timeout = cfg.agent.shutdown_timeout
        self.supervisor = Supervisor(
            emit=self._events.put,
            heartbeat_timeout=max(5.0, 5 * cfg.agent.heartbeat_period),
            unhealthy_after=max(1.0, 3 * cfg.agent.heartbeat_period),
            warm=warm_worker,
            term_after=timeout / 2,
            kill_after=timeout,
            command=worker_command,
            env=dict(env if env is not None else worker_env(), **allowed.env()),
        )
        self.report = Report(cfg, self.supervisor, sample_machine, wall)  # node state, counters, systemd, metrics
        broker = broker_of(cfg.mqtt)
        check_tls(cfg.mqtt)  # a bad CA/cert/key file: ConfigError now (exit 78), not in paho's thread
        # docs/security.md, "Client ids"
        self.bus = AgentBus(broker, mqttc.agent_id(broker, self.cluster, self.node), self.cluster, self.node,
                            self._events.put, connect_timeout, clock())
        self.view = FleetView(self.node)  # what the retained records say (agent.node.fleetview)
        self.contexts = PolicyContexts()  # the Gesscale policies' sibling contexts (agent.node.contexts)
        self.latency_core = _latency_core(cfg)  # RTT to the other agents (issue 6), if installed
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
        boot = format(int(wall()) % (36 ** 5), "x")
        self.spawns = spawns.Spawns(self.node, f"{self.bus.client_id}-{boot}")  # createNode() (agent.node.spawns)
        # loop state
        self._stopping_since: Optional[float] = None
        self._state_dirty = True
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
        # A node state older than three state periods is not counted as serving (a killed agent's
        # last state would offer its slots until its Will arrives).
        self.site: Optional[SiteDriver] = (SiteDriver(cfg.site_manager, cfg.agent.node, cfg.agent.cluster,
                                                      stale_after=3 * cfg.agent.state_period, board=self.site_leases)
                                           if cfg.site_manager.enabled else None)
        # [spill]: the sink workers' spool settings, this agent's metrics/events spool, shipping
        self.spill: Optional[AgentSpill] = AgentSpill.maybe(cfg, broker)
        # The parts, given the parts they read and calls into the node. Late-bound calls: the fuzzer
        # and the tests replace some of these methods on a built agent.
        event = lambda *a, **kw: self._event(*a, **kw)
        publish = lambda *a, **kw: self._publish(*a, **kw)
        bad = lambda *a: self._bad(*a)
        create_node = lambda *a, **kw: self.creating.create(*a, **kw)
        spawn = lambda e, now: self.creating.handle(e, now)
        start = lambda group, now: self._start_group(group, now)
        stop = lambda inst, now: self.supervisor.stop(inst, now)
        stopping = lambda: self._stopping_since is not None
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
            restate_rehomed=lambda: self._publish_rehomed()))

    @staticmethod
    def _admin_keys(cfg: AgentConfig) -> Optional[signing.Verifier]:
        """The verifier of `[security] admin_keys`, None when none is configured; a key file that
        is not an Ed25519 public key is a ConfigError naming the file and key (exit 78)."""
        if not cfg.security.admin_keys:
            return None
        try:
            return signing.load_verifier(cfg.security.admin_keys)
        except ValueError as exc:
            raise ConfigError(Path(cfg.source).name, "[security].admin_keys",
                              f"expected Ed25519 public key PEM files ({exc})") from None

    # -- MQTT (agent.node.bus) -----------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.bus.connected

    @property
    def _retained_in(self) -> bool:
        return self.bus.retained_in

    def _publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1,
                 properties: Any = None) -> Union[bool, int]:
        """The bus's publish, by the name the re-homing code and the tests call (and replace)."""
        return self.bus.publish(topic, payload, retain=retain, qos=qos, properties=properties)

    def _on_connected(self, session_present: bool) -> None:
        self.bus.subscribe(self.latency_core.subscriptions() if self.latency_core is not None else ())
        if self.site is not None:  # a leader whose connection was lost leads no more (its Will voided its lease)
            for eff in self.site.on_reconnect():
                self._publish(eff.topic, eff.payload, retain=eff.retain)
        self.bus.mark()  # when it comes back, the site manager's lease is in
        # State before status: whoever sees "online" (a snapshot ends at a sync marker, not after
        # a pause) then also finds this node's retained state, so `deploy` can place on it.
        self._publish_state(self.clock())
        self.bus.online()
        self._state_dirty = True
        self.stored.dirty = True
        if self.view.rehomed_by_node.get(self.node):
            # a broker restarted from its last autosave may have lost it (or kept an older copy)
            self._publish_rehomed()
        # Re-adopt (first connect) and fence (every connect) once the retained states are in.
        self.fencing.connected(self.clock())
        log.info("connected to %s:%d (session present: %s)", self.bus.broker.host, self.bus.broker.port,
                 session_present, extra={"node": self.node})

    # -- the loop ------------------------------------------------------------------------------

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask the loop to shut down (safe from a signal handler or another thread)."""
        self._events.put(loopevents.Signalled(signum))

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self._events.put(loopevents.Signalled(signum)))
        # SIGHUP (systemctl reload) re-reads what can change in place; its default action would
        # kill the daemon without a drain (docs/operations.md, "Reload").
        signal.signal(signal.SIGHUP, lambda signum, frame: self._events.put(loopevents.Reload(signum)))

    def run(self) -> int:
        self.report.start_metrics()
        # What the previous incarnation hosted, read before this one starts anything: only these
        # are re-adopted (an instance this agent starts and stops before the first reconcile
        # must not come back).
        self.fencing.started(self.stored.specs())
        self.bus.start()
        status = EXIT_OK
        try:
            while True:
                self._step()
        except Halt as halt:
            status = halt.status
            log.info("agent stops: %s (exit %d)", halt.reason, status, extra={"node": self.node})
        except Exception:
            log.exception("agent loop failed", extra={"node": self.node})
            status = EXIT_ERROR
            self._emergency_stop()
        finally:
            if self.spill is not None:
                self.spill.close()  # workers are stopped: close, ship what is closed, stop shipping
            self.bus.close(self.report.empty_state)
            self.report.close()
        return status

    def _step(self) -> None:
        try:
            event: Optional[loopevents.LoopEvent] = self._events.get(timeout=TICK)
        except queue.Empty:
            event = None
        now = self.clock()
        if event is not None:
            self._dispatch(event, now)
            # drain what else is queued before the periodic work (bounded, to stay responsive)
            for _ in range(200):
                try:
                    self._dispatch(self._events.get_nowait(), self.clock())
                except queue.Empty:
                    break
        self._periodic(self.clock())

    def _dispatch(self, event: loopevents.LoopEvent, now: float) -> None:
        """Hand one event of the queue to the handler of its type (`_LOOP`)."""
        self._LOOP[type(event)](self, event, now)

    def _on_mqtt_message(self, event: loopevents.MqttMessage, now: float) -> None:
        self._on_message_safely(event.msg, now)

    def _on_worker_line(self, event: loopevents.WorkerLine, now: float) -> None:
        msg = self.supervisor.handle_line(event.instance, event.line, now)
        if msg is not None:
            self.worker_lines.handle(event.instance, msg, now, self.wall())

    def _on_worker_eof(self, event: loopevents.WorkerEof, now: float) -> None:
        self.supervisor.handle_eof(event.instance)  # its lines are handled: poll() may reap it

    def _on_puback(self, event: loopevents.Puback, now: float) -> None:
        self.bus.last_puback = now
        if self.replication.waits_for(event.mid):
            self.replication.published(event.mid, now, self._publish_replica)

    def _on_connack(self, event: loopevents.Connected, now: float) -> None:
        again = self.bus.ever_connected
        if self.bus.connack(event):
            if again:
                self.report.reconnected()
            self._on_connected(event.session_present)

    def _on_connection_trouble(self, event: Any, now: float) -> None:
        self.bus.trouble(event)

    def _on_signal(self, event: loopevents.Signalled, now: float) -> None:
        self._begin_shutdown(now, f"signal {signal.Signals(event.signum).name}")

    def _on_reload(self, event: loopevents.Reload, now: float) -> None:
        self._reload()

    _LOOP: Dict[type, Callable[["Agent", Any, float], None]] = {
        loopevents.MqttMessage: _on_mqtt_message, loopevents.WorkerLine: _on_worker_line,
        loopevents.WorkerEof: _on_worker_eof, loopevents.Puback: _on_puback, loopevents.Connected: _on_connack,
        loopevents.ConnectFailed: _on_connection_trouble, loopevents.PahoError: _on_connection_trouble,
        loopevents.Disconnected: _on_connection_trouble, loopevents.Signalled: _on_signal, loopevents.Reload: _on_reload,
    }

    def _reload(self) -> None:
        """SIGHUP: re-read the config file and apply its [log] level, the one setting that changes
        safely in place; anything else needs a restart (drain, rejoin), which the log line says."""
        if self.report.ready_notified:
            notify.reloading()
        try:

            new = load_agent_config(self.cfg.source)
        except (OSError, ValueError) as exc:
            log.warning("SIGHUP: %s not reloaded, keeping the running configuration: %s", self.cfg.source,
                        exc, extra={"node": self.node})
        else:
            other = [f.name for f in dataclasses.fields(new) if f.name != "log"
                     and getattr(new, f.name) != getattr(self.cfg, f.name)]
            log.warning("SIGHUP: reloaded %s: log level %s%s", self.cfg.source, new.log.level,
                        f"; changed [{'], ['.join(other)}] need a restart (systemctl restart fog-agent)"
                        if other else "", extra={"node": self.node})
            logging.getLogger().setLevel(getattr(logging, new.log.level.upper(), logging.INFO))
        if self.report.ready_notified:
            notify.ready(self.report.status_line(self.connected))

    def _periodic(self, now: float) -> None:
        for reaped in self.supervisor.poll(now):
            self._on_reaped(reaped, now)
        if self.drain.copies_first:
            self.exits.release_keepers(now)
        if self.fencing.reconcile_due(now, self._retained_in, self._stopping_since is not None):
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
        if self._stopping_since is not None:
            if len(self.supervisor) == 0:
                raise Halt("all workers stopped", EXIT_OK)
            if now - self._stopping_since > self.cfg.agent.shutdown_timeout + SHUTDOWN_SLACK / 2:
                self._emergency_stop()
                raise Halt("shutdown timeout: remaining workers killed", EXIT_OK)
        gave_up = self.bus.gave_up(now)
        if gave_up:
            raise Halt(gave_up, EXIT_UNAVAILABLE)
        if self.connected:
            self.inbound.probe()  # a ping's send time: after the work above
            if self.report.due(now, self._state_dirty):
                self._publish_state(now)
                self._send_policy_contexts()
        if self.site is not None and self.connected and self._retained_in and self._stopping_since is None:
            # Not before the retained lease is in: an agent that claimed the role in the moment
            # between its connect and the lease's arrival took it from a live leader.
            siteeffects.tick(self.site, self.node, self.cluster, self.bus.client_id, self.view.fleet, self.view.online,
                             self.state_doc(), self.wall(), self._publish,
                             lambda body: self.requests.steer(body, self.clock()))
        if self.spill is not None:
            self.spill.tick(now, self.supervisor.workers, Path(self.cfg.agent.state_dir))
        self.report.notify(now, self.connected, self._stopping_since is not None)

    # -- state ---------------------------------------------------------------------------------

    @property
    def counters(self) -> Dict[str, int]:
        return self.report.counters

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
        props = rpc.publish_properties(correlation) if correlation is not None else None
        return self._publish(topics.agent_peer(self.cluster, standby, self.node), rpc.encode(body), properties=props)

    def _tell_replicated(self, instance: str, gen: int, size: int) -> None:
        self.supervisor.send(instance, "replicated", gen=gen, log=size)

    # -- shutdown ------------------------------------------------------------------------------

    def _begin_shutdown(self, now: float, why: str) -> None:
        if self._stopping_since is not None:
            return
        self._stopping_since = now
        log.info("shutting down (%s): stopping %d workers", why, len(self.supervisor), extra={"node": self.node})
        try:
            notify.stopping(f"stopping {len(self.supervisor)} workers")
        except ImportError:  # pragma: no cover
            pass
        self.creating.handle(spawns.Shutdown(), now)
        self.supervisor.stop_all(now)
        self.supervisor.close_warm()

    def _emergency_stop(self) -> None:
        """Kill every remaining worker and wait for it: never leave an orphan behind."""
        now = self.clock()
        self.supervisor.close_warm()
        for inst in list(self.supervisor.workers):
            self.supervisor.kill(inst, now, "agent exits")
        for w in list(self.supervisor.workers.values()):
            try:
                w.proc.wait(timeout=2.0)
            except Exception:
                pass
        self.supervisor.poll(now)


def _latency_core(cfg: AgentConfig) -> Any:
    """The latency measurement core of issue 6 when installed (placement works without it)."""
    try:
        from agent.measure.latency import LatencyCore
    except ImportError:
        return None
    return LatencyCore(cfg.agent.node, cfg.agent.cluster, period=cfg.latency.period, smoothing=cfg.latency.smoothing)


MOVED_FILE = "moved.json"
BINDINGS_FILE = "bindings.json"  # agent.node.hostmap's proven bindings, kept over a restart


def _load_moved(state_dir: Path) -> Dict[str, str]:
    """This node's "moved" statements, kept over an agent restart (oldest first); an unreadable
    file: none."""
    listed = (read_json(state_dir / MOVED_FILE) or {}).get("moved")
    pairs = [e for e in listed if isinstance(e, list) and len(e) == 2] if isinstance(listed, list) else []
    return dict([(i, n) for i, n in pairs if isinstance(i, str) and isinstance(n, str)][-MAX_MOVED:])


def run_agent(cfg: AgentConfig, policy_name: str = DEFAULT_POLICY, worker_command: Optional[Sequence[str]] = None,
              warm_worker: bool = True) -> int:
    """Entry point of `fog-agent run`: build, install signal handlers, loop, return the status."""
    agent = Agent(cfg, policy=get_policy(policy_name), worker_command=worker_command or WORKER_COMMAND,
                  warm_worker=warm_worker)
    agent.install_signal_handlers()
    log.info("agent %s starting (cluster %s, %d slots, broker %s:%d)", cfg.agent.node, cfg.agent.cluster,
             cfg.agent.slots, cfg.mqtt.host, cfg.mqtt.port, extra={"node": cfg.agent.node})
    return agent.run()


__all__ = [
    "Agent",
    "EXIT_CONFIG",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "Halt",
    "SHUTDOWN_SLACK",
    "run_agent",
]
