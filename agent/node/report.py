"""What the daemon says of its node: the retained node state (agent.node.nodestate builds the
JSON), the counters, systemd's status and watchdog, and the Prometheus endpoint.

Why a part of its own: every one of these is a reading of the same things (the supervisor's
workers, the drain, the pins) on its own beat, and none decides anything the loop acts on. It
reads the supervisor it is given and what `state_doc` is passed; it publishes nothing itself
(the loop owns the client and says when a state went out: `published`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from agent import notify
from agent.config import AgentConfig
from agent.control import records
from agent.control.fleet import Instance, Phase
from agent.node import nodestate
from agent.node.drain import Drain
from agent.node.pins import Pins
from agent.node.supervisor import Supervisor
from agent.node.workers import WorkerStatus

log = logging.getLogger(__name__)

STATE_MIN_INTERVAL = 0.25  # rate limit of change-triggered state publications
# Counted from the start (fogctl agents and the tests read them); others appear when first counted.
COUNTERS = ("spawned_local", "spawned_remote", "spawn_failed", "rpc_requests", "rpc_repeats", "restarts",
            "bad_messages", "peer_refused", "retained_ignored")


class Report:
    def __init__(self, cfg: AgentConfig, supervisor: Supervisor,
                 sample_machine: Callable[[Sequence[int]], nodestate.MachineSample], wall: Callable[[], float]) -> None:
        self.cfg = cfg
        self.node = cfg.agent.node
        self.supervisor = supervisor
        self.sample_machine = sample_machine
        self.wall = wall
        self.counters: Dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.last_state = -1e9
        self.last_watchdog = -1e9
        self.ready_notified = False
        self.metrics: Any = None  # agent.measure.metrics, when [metrics].port != 0
        self.stats_bridge: Any = None
        self.server: Any = None

    # -- the retained state ----------------------------------------------------------------------

    def instance_infos(self) -> List[nodestate.InstanceInfo]:
        out = []
        for w in self.supervisor.workers.values():
            stats = w.stats
            status = w.status.value
            # The protocol core's state, when the worker reports it (deleting/departing = leaving).
            if status == "active" and stats.get("state") in ("deleting", "departing", "terminated"):
                status = "terminating"
            out.append(nodestate.InstanceInfo(
                id=w.instance, operator=w.spec.operator, keeper=bool(stats.get("keeper", w.spec.keeper)),
                status=status, load=_num(stats.get("load")), capacity=_num(stats.get("capacity")),
                pid=w.pid, stats=stats,
            ))
        return out

    def local_instances(self) -> List[Instance]:
        """Our instances in the fleet model that fogctl's steering checks read (agent_actions)."""
        out = []
        for info in self.instance_infos():
            w = self.supervisor.get(info.id)
            phase = {"active": Phase.ACTIVE, "terminating": Phase.TERMINATING}.get(info.status, Phase.STARTING)
            if phase is Phase.ACTIVE and info.stats.get("state") == "idle":
                phase = Phase.STARTING  # created, not yet started by its creator
            out.append(Instance(id=info.id, operator=info.operator, node=self.node,
                                pipeline=w.spec.pipeline if w is not None else None,
                                keeper=info.keeper, phase=phase, load=info.load, capacity=info.capacity))
        return out

    def state_doc(self, free_slots: int, pins: Pins, drain: Drain, moved: Mapping[str, str],
                  copies: Mapping[str, Any]) -> Dict[str, Any]:
        """The node state; `moved` our "moved" statements, `copies` what our standby copies of
        offline hosts say they own (their re-home reads it)."""
        doc = nodestate.build_node_state(self.node, self.cfg.agent.slots, self.instance_infos(),
                                         self.sample_machine(self.supervisor.pids()), self.wall())
        # A draining node offers no slot to anybody: the other agents' placement (and fogctl's
        # checks) read this number, and would otherwise ask it for instances it refuses.
        doc["free_slots"] = min(int(doc["free_slots"]), free_slots)
        for item in doc.get("instances", []):  # which deploy an instance belongs to (fogctl undeploy --force)
            w = self.supervisor.get(str(item.get("id")))
            if w is not None:
                item["pipeline"] = w.spec.pipeline
                gen = records.spec_generation(w.spec)
                if gen:
                    item["generation"] = gen
                if pins.flagged(w.instance):
                    item["pinned"] = True
        if drain.draining:  # fogctl status flags the node (docs/fogctl.md, "Payloads")
            doc["draining"] = True
        if drain.moving:
            # Keepers stopped here whose start elsewhere is not answered yet: this node is not
            # empty (the site manager releases it, maybe powers it off, only once it is): a
            # failed start restarts the keeper here, and a keyed one's state is only here.
            doc["handing_over"] = sorted(drain.moving)
        if pins:
            doc["pins"] = pins.listed()
        if moved:
            doc["moved"] = moved
        if copies:
            doc["standby_groups"] = copies
        return doc

    def empty_state(self) -> bytes:
        """The state of a node that hosts nothing, retained as the agent leaves."""
        doc = nodestate.build_node_state(self.node, self.cfg.agent.slots, [], self.sample_machine(()), self.wall())
        return nodestate.encode_state(doc)

    def due(self, now: float, changed: bool) -> bool:
        """Every `state_period`, and soon after a change (at most every STATE_MIN_INTERVAL)."""
        since = now - self.last_state
        return since >= self.cfg.agent.state_period or (changed and since >= STATE_MIN_INTERVAL)

    def observe_node(self, spill: Any) -> None:
        if self.metrics is not None:  # fog_instances, fog_spool_*: on the beat of the retained state
            self.metrics.observe_node(self.supervisor.workers.values(), spill)

    # -- metrics ---------------------------------------------------------------------------------

    def start_metrics(self) -> None:
        """`[metrics].port` != 0: serve /metrics (prometheus_client multiprocess mode, files under
        the state dir) and export the workers' heartbeat counters through StatsBridge, so the
        endpoint's counters are exactly what the workers count, with no metrics code in their
        data path. Port 0 (the default and the tests') leaves everything off."""
        if self.cfg.metrics.port == 0:
            return
        from agent.measure import metrics

        metrics.enable_multiprocess(Path(self.cfg.agent.state_dir) / "metrics")
        self.metrics = metrics.Metrics()
        self.stats_bridge = metrics.StatsBridge(self.metrics)
        try:
            self.server = metrics.serve(self.cfg.metrics.port, self.cfg.metrics.address)
        except OSError as exc:  # a busy port must not stop the node from working
            log.error("metrics endpoint on %s:%d not started: %s", self.cfg.metrics.address,
                      self.cfg.metrics.port, exc, extra={"node": self.node})
            return
        log.info("metrics on %s", self.server.url if self.server else "-", extra={"node": self.node})

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def observe(self, w: Any) -> None:
        """A worker's heartbeat counters, exported as they are."""
        if self.stats_bridge is not None and isinstance(w.stats, dict):
            self.stats_bridge.observe(w.spec.pipeline, w.spec.operator, w.instance, w.stats)

    def exited(self, w: Any) -> None:
        self.observe(w)
        if self.metrics is not None:
            from agent.measure import metrics

            metrics.process_exited(w.pid)

    def reconnected(self) -> None:
        if self.metrics is not None:
            self.metrics.reconnect("agent")  # fog_mqtt_reconnects_total{client="agent"}

    # -- systemd ---------------------------------------------------------------------------------

    def notify(self, now: float, connected: bool, stopping: bool) -> None:
        """READY once connected with no worker starting; the watchdog while the workers are healthy."""
        if not notify.enabled():
            return
        if not self.ready_notified and connected and not stopping:
            starting = [w for w in self.supervisor.workers.values() if w.status is WorkerStatus.STARTING]
            if not starting:
                notify.ready(self.status_line(connected))
                self.ready_notified = True
        period = notify.watchdog_period()
        if period is not None and now - self.last_watchdog >= period:
            if self.supervisor.healthy(now) and not stopping:
                notify.watchdog()
                notify.status(self.status_line(connected))
                self.last_watchdog = now

    def status_line(self, connected: bool) -> str:
        ops: Dict[str, int] = {}
        for w in self.supervisor.workers.values():
            ops[w.spec.operator] = ops.get(w.spec.operator, 0) + 1
        detail = ", ".join(f"{k}={v}" for k, v in sorted(ops.items())) or "none"
        conn = "connected" if connected else "disconnected"
        return f"{conn}; {len(self.supervisor)}/{self.cfg.agent.slots} slots used; instances: {detail}"


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


__all__ = ["COUNTERS", "Report", "STATE_MIN_INTERVAL"]
