"""The fencing core's answers carried out, and a pipeline record's verdict on our instances: which
workers are killed or stopped and which stored specs forgotten, what the first connect re-adopts
and how (the daemon's reconcile, re-adoption and stale instances).

Rules of this file: no socket, thread, process, clock or random; the stored specs through
agent.node.hosted.HostedSpecs, the rest of the node through `ReconcileCalls`, no reference to
the daemon; the loop time and one reading of the wall clock are arguments. Who runs what elsewhere
and what the first connect re-adopts is agent.node.fencing's decision; this part reads the facts
it needs, carries its answer out and admits what it re-adopts.

Why a stored spec is admitted again before it is re-adopted: a file in the state directory is no
more trusted than the request that wrote it, and the node's allow-list or directories may have
changed since; one it no longer admits is set aside (renamed, kept for a person), not started.
Node-local settings (broker, directories, spool) come from this agent, not from the stored spec.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Container, Dict, List, Mapping

from agent.control import records
from agent.instance.spec import InstanceSpec
from agent.node import chains
from agent.node.fencing import Facts, Fencing, Running, rehomed_by_others
from agent.node.fleetview import FleetView
from agent.node.gate import Gate
from agent.node.hosted import HostedSpecs
from agent.node.workerlines import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileCalls:
    """What the reconcile may have the rest of the node do."""

    forget: Callable[[str], None]  # gone from this node for good: stored spec, standby copy, files
    undeploy: Callable[[str], None]  # forgotten, and at its exit never started again
    kill: Callable[[str, float, str], None]  # (instance, now, why): our copy must not run on
    stop: Callable[[str, float], None]  # ask a running worker to stop (it drains)
    start: Callable[[List[InstanceSpec], float], None]  # one process (a chain's: upstream first)
    local_spec: Callable[[InstanceSpec], InstanceSpec]  # with this node's spool settings, when it spills
    changed: Callable[[], None]  # our state changed: publish it soon


class Reconciler:
    def __init__(self, node: str, slots: int, fencing: Fencing, gate: Gate, view: FleetView, stored: HostedSpecs,
                 workers: Mapping[str, Worker], undeploying: Container[str], counters: Dict[str, int],
                 calls: ReconcileCalls) -> None:
        self.node, self.slots, self.fencing, self.gate, self.view = node, slots, fencing, gate, view
        self.stored, self.workers, self.undeploying, self.counters = stored, workers, undeploying, counters
        self.calls = calls

    def reconcile(self, now: float, wall: float) -> None:
        """After a (re)connect, once the retained states are in: fence our instances that an
        online node now runs (kill our process, forget it), so that one identity never runs
        twice; on the first connect then re-adopt the rest (agent.node.fencing)."""
        v = self.view
        stored = {s.instance for s in self.stored.specs()}
        since = {i: self.stored.since(i) for i in rehomed_by_others(self.node, v.rehomed_by_node)}
        running = {i: Running(w.started_at, w.spec.extra.get("min_epoch")) for i, w in self.workers.items()}
        decided = self.fencing.reconcile(Facts(running, stored, since, v.fleet, v.online, v.rehomed_by_node))
        for inst in decided.fence:
            log.warning("instance re-homed while this node was away: stopping our copy", extra={"instance": inst})
            self.calls.kill(inst, now, "re-homed elsewhere")
            self.calls.forget(inst)
        for inst in decided.forget:
            self.calls.forget(inst)
        if decided.readopt:
            self.readopt(now, wall)

    def readopt(self, now: float, wall: float) -> None:
        """Restart, with the same identity, every instance this node hosted when its agent last
        stopped (agent.node.hosted, agent.node.fencing): they are still in their neighbours'
        routing tables. A stored spec this node no longer admits is set aside, not started."""
        present = {s.instance for s in self.stored.specs()}  # not forgotten since
        todo = self.fencing.readopt(set(self.workers), present, self.view.records)
        for spec, stale in todo.stale:
            log.warning("not re-adopted: %s (stored spec forgotten)", stale, extra={"instance": spec.instance})
            self.calls.forget(spec.instance)
        adopt: List[InstanceSpec] = []
        for spec in todo.adopt:
            spec = dataclasses.replace(spec, restart=True, **self.gate.node_local(spec.extra))
            try:  # a file in the state dir is no more trusted than the request that wrote it
                self.gate.admit(wall, spec, "the state dir")
            except ValueError:
                self.stored.set_aside(spec.instance)
                continue
            adopt.append(self.calls.local_spec(spec))
        for group in chains.group_chains(adopt):  # a chain's members together, as one process again
            try:
                self.calls.start(group, now)
            except (OSError, ValueError) as exc:
                log.error("cannot re-adopt instance: %s", exc, extra={"instance": group[0].instance})
                continue
            self.counters["readopted"] = self.counters.get("readopted", 0) + len(group)
            for spec in group:
                log.warning("re-adopted instance hosted before the agent restarted", extra={"instance": spec.instance})
        if len(self.workers) > self.slots:
            log.warning("%d re-adopted instances exceed the %d slots (no new ones until some leave)",
                        len(self.workers), self.slots, extra={"node": self.node})
        self.calls.changed()

    def drop_stale(self, pipeline: str, now: float) -> None:
        """The record of `pipeline` changed: every instance of it that the record now rules out
        (a tombstone, another deploy's generation: records.stale_reason) is forgotten and, if it
        runs, stopped. This is how an agent that was away during an undeploy learns it."""
        record = self.view.records.get(pipeline)
        for spec in self.stored.specs():
            why = spec.pipeline == pipeline and records.stale_reason(records.spec_generation(spec), record)
            if why and spec.instance not in self.workers:
                log.warning("stored spec forgotten: %s", why, extra={"instance": spec.instance})
                self.calls.forget(spec.instance)
        for inst, w in list(self.workers.items()):
            why = w.spec.pipeline == pipeline and records.stale_reason(records.spec_generation(w.spec), record)
            if why and inst not in self.undeploying:
                log.warning("stopping: %s", why, extra={"instance": inst})
                self.calls.undeploy(inst)
                self.calls.stop(inst, now)


__all__ = ["ReconcileCalls", "Reconciler"]
