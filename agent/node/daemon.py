"""`fog-agent run`: the per-node daemon that hosts operator instances as worker processes.

Rules of this file (gunicorn's arbiter habit): ONE thread owns all state and does all publishing,
the main loop. Everything else only enqueues into `self._events` (a `queue.SimpleQueue`, whose
`put` is reentrant and therefore safe from a signal handler): paho's network thread (connect,
message), one stdout reader thread per worker, and the signal handlers; each enqueues a typed
event (agent.node.loopevents), which the loop hands to its handler through one table (`_LOOP`).
What the node decides is the sans-IO `NodeCore` (agent.node.core): the loop hands it a message,
a worker's decoded line, a reaped worker, a PUBACK, the session's start, the shutdown's start
and, at least every `TICK` seconds, a tick; the core acts through the ports it was given (this
shell's bus and supervisor, the report, the spill).

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

The shell: this module is the arbiter, what only it may do (the loop and its schedule, the MQTT
session's events, the workers' processes, the signals, the site manager's hooks, systemd's
notifications) and the wiring of the core to its ports. Its parts: the MQTT session (bus), the
worker processes (supervisor), what the node says of itself (report), the site manager's
candidate (site_driver, its effects carried out by siteeffects). The core's parts, with what each
decides, are listed in docs/runtime.md, "Layout".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

from agent import notify
from agent.config import AgentConfig, check_tls, load_agent_config
from agent.measure.latency import LatencyCore, received_at
from agent.mqtt import client as mqttc
from agent.node import loopevents, nodestate, siteeffects
from agent.node.bus import AgentBus, broker_of
from agent.node.core import NodeCore, SessionUp, Stopping, Tick, WorkerExited, WorkerSaid
from agent.node.placement import DEFAULT_POLICY, PlacementPolicy, get_policy
from agent.node.report import Report
from agent.node.site_driver import SiteDriver
from agent.node.supervisor import WORKER_COMMAND, Supervisor
from agent.operators import admission
from agent.spill.local import AgentSpill

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
        # [spill]: the sink workers' spool settings, this agent's metrics/events spool, shipping
        self.spill: Optional[AgentSpill] = AgentSpill.maybe(cfg, broker)
        # What the node decides (agent.node.core), on the ports above
        self.core = NodeCore(cfg, policy, self.supervisor, self.bus, self.report, self.spill, _latency_core(cfg),
                             allowed, clock, wall, received=lambda msg, t: received_at(msg, t, self.clock))
        # The site manager (docs/site-manager.md): [site_manager] enabled runs a candidate, which
        # shares the core's board of claims. A node state older than three state periods is not
        # counted as serving (a killed agent's last state would offer its slots until its Will arrives).
        self.site: Optional[SiteDriver] = (SiteDriver(cfg.site_manager, cfg.agent.node, cfg.agent.cluster,
                                                      stale_after=3 * cfg.agent.state_period,
                                                      board=self.core.site_leases)
                                           if cfg.site_manager.enabled else None)

    # -- MQTT (agent.node.bus) -----------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.bus.connected

    def _on_connected(self, session_present: bool) -> None:
        latency = self.core.latency_core
        self.bus.subscribe(latency.subscriptions() if latency is not None else ())
        if self.site is not None:  # a leader whose connection was lost leads no more (its Will voided its lease)
            for eff in self.site.on_reconnect():
                self.bus.publish(eff.topic, eff.payload, retain=eff.retain)
        self.bus.mark()  # when it comes back, the site manager's lease is in
        self.core.handle(SessionUp(session_present), self.clock())
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
        self.core.fencing.started(self.core.stored.specs())
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

    def _to_core(self, event: Any, now: float) -> None:
        self.core.handle(event, now)

    def _on_worker_line(self, event: loopevents.WorkerLine, now: float) -> None:
        msg = self.supervisor.handle_line(event.instance, event.line, now)
        if msg is not None:
            self.core.handle(WorkerSaid(event.instance, msg, self.wall()), now)

    def _on_worker_eof(self, event: loopevents.WorkerEof, now: float) -> None:
        self.supervisor.handle_eof(event.instance)  # its lines are handled: poll() may reap it

    def _on_puback(self, event: loopevents.Puback, now: float) -> None:
        self.bus.last_puback = now
        self.core.handle(event, now)

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
        loopevents.MqttMessage: _to_core, loopevents.WorkerLine: _on_worker_line,
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
        core = self.core
        for reaped in self.supervisor.poll(now):
            core.handle(WorkerExited(reaped), now)
        core.handle(Tick(), now)
        stopping_since = core.stopping_since
        if stopping_since is not None:
            if len(self.supervisor) == 0:
                raise Halt("all workers stopped", EXIT_OK)
            if now - stopping_since > self.cfg.agent.shutdown_timeout + SHUTDOWN_SLACK / 2:
                self._emergency_stop()
                raise Halt("shutdown timeout: remaining workers killed", EXIT_OK)
        gave_up = self.bus.gave_up(now)
        if gave_up:
            raise Halt(gave_up, EXIT_UNAVAILABLE)
        if self.site is not None and self.connected and self.bus.retained_in and stopping_since is None:
            # Not before the retained lease is in: an agent that claimed the role in the moment
            # between its connect and the lease's arrival took it from a live leader.
            siteeffects.tick(self.site, self.node, self.cluster, self.bus.client_id, core.view.fleet, core.view.online,
                             core.state_doc(), self.wall(), self.bus.publish,
                             lambda body: core.requests.steer(body, self.clock()))
        if self.spill is not None:
            self.spill.tick(now, self.supervisor.workers, Path(self.cfg.agent.state_dir))
        self.report.notify(now, self.connected, stopping_since is not None)

    # -- shutdown ------------------------------------------------------------------------------

    def _begin_shutdown(self, now: float, why: str) -> None:
        if self.core.stopping:
            return
        self.core.handle(Stopping(why), now)
        log.info("shutting down (%s): stopping %d workers", why, len(self.supervisor), extra={"node": self.node})
        try:
            notify.stopping(f"stopping {len(self.supervisor)} workers")
        except ImportError:  # pragma: no cover
            pass
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


def _latency_core(cfg: AgentConfig) -> LatencyCore:
    """The latency measurement core: the RTTs to the other agents that placement reads."""
    return LatencyCore(cfg.agent.node, cfg.agent.cluster, period=cfg.latency.period, smoothing=cfg.latency.smoothing)


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
