"""The control lines our workers write, one handler per event (`WorkerLines.HANDLERS`): a
heartbeat's counters, "ready", a worker's createNode() ("spawn"), its ask to reconnect, a keyed
save to copy to its standby, a scaling round it cancelled, its announced exit.

Rules of this file: no socket, thread, process, clock or random; no reference to the daemon. The
supervisor decodes a line (bounded, JSON, the worker's status updated: agent.node.supervisor
`handle_line`) and the node's core (agent.node.core) hands the message here with the loop time
and one reading of the wall clock; the stored specs change through agent.node.hosted.HostedSpecs,
the rest of the node acts through `LineCalls`. An event of no handler is ignored.

Why "ready" is the moment of three things, in this order (docs/design.md invariant 2, subscribe
before announce): the worker has subscribed to its inbox, so from now on it may be announced.
Its spec is stored (an agent restart must bring it back, unless an undeploy stops it), our hosted
record goes out before anybody is told (its receivers learn that this node hosts it, the binding
of its envelopes), and only then does createNode()'s core answer its requester (agent.node.spawns
`Ready`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Container, Dict, Mapping

from agent.node import spawns
from agent.node.fencing import Fencing
from agent.node.fleetview import FleetView
from agent.node.gate import Gate, without_handover
from agent.node.hosted import HostedSpecs
from agent.node.pins import Pins
from agent.node.workers import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineCalls:
    """What a worker's line may have the rest of the node do."""

    observe: Callable[[Any, float], None]  # (worker, wall): a heartbeat's counters to the metrics and the spill
    send: Callable[..., Any]  # (instance, event, **fields): a control line to one worker
    spawn: Callable[[spawns.SpawnEvent, float], None]  # to createNode()'s core
    create_node: Callable[..., None]  # (spec, reply, cause=, now=): placed anywhere
    event: Callable[..., None]  # an event of one instance (etype, instance, operator, pipeline, **detail)
    publish_state: Callable[[float], None]  # our retained state, now
    publish_hosted: Callable[[], None]  # our retained hosted record, now
    saved: Callable[[str, int, int], None]  # (instance, generation, log size): a keyed save to copy
    replicate: Callable[[float], None]  # copy the keyed saves to their standbys
    apply_pins: Callable[[], None]  # tell the workers whether they are pinned
    changed: Callable[[], None]  # our state changed: publish it soon
    connected: Callable[[], bool]


class WorkerLines:
    """The handlers of our workers' lines, given the parts they update."""

    def __init__(self, workers: Mapping[str, Worker], spawning: spawns.Spawns, gate: Gate, view: FleetView,
                 stored: HostedSpecs, fencing: Fencing, pins: Pins, undeploying: Container[str],
                 calls: LineCalls) -> None:
        self.workers, self.spawning, self.gate, self.view, self.stored = workers, spawning, gate, view, stored
        self.fencing, self.pins, self.undeploying, self.calls = fencing, pins, undeploying, calls

    def handle(self, instance: str, msg: Dict[str, Any], now: float, wall: float) -> None:
        """One decoded line of the worker of `instance`, to the handler of its event."""
        handler = self.HANDLERS.get(msg["event"])
        if handler is not None:
            handler(self, instance, msg, now, wall)

    def _heartbeat(self, instance: str, msg: Dict[str, Any], now: float, wall: float) -> None:
        w = self.workers.get(instance)
        if w is not None:
            self.calls.observe(w, wall)

    def _ready(self, instance: str, msg: Dict[str, Any], now: float, wall: float) -> None:
        self.calls.changed()
        cause = self.spawning.cause_of(instance)
        w = self.workers.get(instance)
        if w is not None and instance not in self.undeploying:
            # From now on the instance may be announced: an agent restart must bring it back.
            self.stored.remember(without_handover(w.spec))
            if self.calls.connected():
                # Before the reply below: the receivers of the new instance learn that this node
                # hosts it (the binding of its envelopes) before anybody is told it exists.
                self.calls.publish_hosted()
            if self.pins:
                self.calls.apply_pins()
            self.calls.event("spawned", instance, w.spec.operator, w.spec.pipeline,
                             cause=cause or ("restart" if w.spec.restart else "unknown"),
                             warm=w.warm_age is not None,
                             warm_age_s=round(w.warm_age, 2) if w.warm_age is not None else None,
                             start_to_ready_s=round(now - w.started_at, 3))
        # Invariant 2: the new instance's inbox is subscribed ("ready"), only now is it announced.
        self.calls.spawn(spawns.Ready(instance), now)

    def spawn(self, requester: str, msg: Dict[str, Any], now: float, wall: float) -> None:
        """A worker's createNode() of a copy: admitted (agent.node.gate `worker_copy`), then placed
        anywhere; the answer goes back to the worker as "spawned"."""
        req_id = msg.get("request")
        w = self.workers.get(requester)

        def reply(result: Dict[str, Any]) -> None:
            fields = {k: v for k, v in result.items() if k in ("ok", "instance", "node", "error")}
            self.calls.send(requester, "spawned", request=req_id, **fields)

        local = [(x.spec.instance, x.spec.pipeline, x.spec.operator) for x in self.workers.values()]
        placing = self.spawning.placing() + list(self.view.placed_copies())
        spec = self.gate.worker_copy(wall, w.spec if w is not None else None, msg,
                                     self.view.records.get(w.spec.pipeline) if w is not None else None,
                                     requester in self.undeploying, local, placing, self.view.fleet, self.view.online)
        if isinstance(spec, str):
            reply({"ok": False, "error": spec})
            return
        self.calls.create_node(spec, reply, cause="spawn", now=now)

    def _may_reconnect(self, instance: str, msg: Dict[str, Any], now: float, wall: float) -> None:
        # Fencing: answered once a PUBACK newer than this ask proves our own connection is up
        # (then the broker never fired our Will meanwhile, or we reconnected and the reconcile
        # ran; agent.node.fencing `grants`). The state publish provokes that PUBACK.
        self.fencing.asked(instance, now)
        if self.calls.connected():
            self.calls.publish_state(now)

    def _keyed_saved(self, instance: str, msg: Dict[str, Any], now: float, wall: float) -> None:
        gen, size = msg.get("gen"), msg.get("log")
        if isinstance(gen, int) and isinstance(size, int):
            self.calls.saved(str(msg.get("member") or instance), gen, size)
            self.calls.replicate(now)

    def _round_cancelled(self, instance: str, msg: Dict[str, Any], now: float, wall: float) -> None:
        w = self.workers.get(instance)
        if w is not None:
            self.calls.event("refused", instance, w.spec.operator, w.spec.pipeline, what="round_cancelled",
                             round=msg.get("round"), created=msg.get("created"), error=msg.get("error"))

    def _exit(self, instance: str, msg: Dict[str, Any], now: float, wall: float) -> None:
        log.info("worker announced exit: %s", msg.get("reason"), extra={"instance": instance})
        self.calls.changed()

    HANDLERS: Dict[str, Callable[["WorkerLines", str, Dict[str, Any], float, float], None]] = {
        "heartbeat": _heartbeat, "ready": _ready, "spawn": spawn, "may_reconnect": _may_reconnect,
        "keyed_saved": _keyed_saved, "round_cancelled": _round_cancelled, "exit": _exit,
    }


__all__ = ["LineCalls", "Worker", "WorkerLines"]
