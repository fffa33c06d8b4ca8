"""This node as the re-homer: when it plans a lost node, what of the plan starts (admitted like a
spawn), and a failed re-home tried again (the daemon's re-homing turn).

Rules of this file: no I/O, no clock, no reference to the daemon. Once per loop turn the daemon
hands `Rehomer.tick` its loop time and one reading of the wall clock (the plans' epoch floors and
our re-homed record's times; agent.node.rehoming.rehomed_here compares the two); the rehomer reads
the fleet view, asks agent.node.rehoming (what re-homing remembers between turns) and
agent.node.rehome (the plan of one lost node), admits each planned spec through the gate, and has
the node act through `RehomerCalls`: createNode(), our re-homed record published, our "moved"
statement.

The gates of a turn, in order, and why:
- Claims are dropped first, every turn: a node that now lists an instance we asked for may be the
  next one lost.
- Nothing else before the retained records of this connection are in: on what the last connection
  left, a node that came back while we were away is still offline here, and so is who else is
  online; re-homing a live node's instances runs each identity twice.
- Failed re-homes are tried again (agent.node.rehoming.Rehoming.retries) before new plans.
- Only the responsible agent plans a lost node (agent.node.rehome.responsible: the lowest-named
  online one), while connected, not while it stops, and only with `dead_after` set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Set

from agent.instance.spec import InstanceSpec
from agent.node import rehome, rehoming
from agent.node.fencing import READOPT_SETTLE
from agent.node.fleetview import FleetView
from agent.node.gate import Gate
from agent.node.rehoming import Rehoming, Stats
from agent.node.spawns import RPC_TIMEOUT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RehomerCalls:
    """What the re-homer reads of this node and may have it do."""

    create_node: Callable[..., None]  # (spec, reply, cause=, now=): placed like any createNode()
    publish_rehomed: Callable[[], None]  # our retained re-homed record, as the fleet view holds it
    moved: Callable[[str, Any], None]  # we moved the instance to that node: our "moved" statement
    connected: Callable[[], bool]
    retained_in: Callable[[], bool]  # the retained records of this connection are in
    stopping: Callable[[], bool]  # the agent shuts down
    local: Callable[[], Mapping[str, Stats]]  # our workers: {instance: its last stats}
    copies: Callable[[str], Mapping[str, Any]]  # our standby copies of that node's instances: {instance: runs}


class Rehomer:
    """The re-homing turn of one node (module doc)."""

    def __init__(self, node: str, dead_after: float, state_period: float, rehoming_: Rehoming, view: FleetView,
                 gate: Gate, calls: RehomerCalls) -> None:
        self.node, self.dead_after, self.state_period = node, dead_after, state_period
        self.rehoming, self.view, self.gate, self.calls = rehoming_, view, gate, calls

    def _listed(self) -> Set[str]:
        """Instances another ONLINE node lists in its retained state, or that run here."""
        return rehoming.listed_elsewhere(self.node, self.view.fleet, self.view.online) | set(self.calls.local())

    def _our_record(self) -> Dict[str, float]:
        return self.view.rehomed_by_node.setdefault(self.node, {})

    def tick(self, now: float, wall: float) -> None:
        """Start elsewhere, same identities, the instances of nodes offline for `dead_after`
        seconds, if this agent is the responsible one (module doc)."""
        r, v = self.rehoming, self.view
        if r.claims:
            r.drop_claims(now, RPC_TIMEOUT + 3 * self.state_period, self._listed())
        if not self.calls.retained_in():
            return
        self._retry(now, wall)
        if not self.calls.connected() or self.calls.stopping() or not r.offline_since or self.dead_after <= 0:
            return
        if not rehome.responsible(self.node, {n for n, up in v.online.items() if up} | {self.node}):
            return
        for node, since in r.lost(now, self.dead_after):
            standby = rehoming.standby_groups(self.node, node, v.hosted_by_node, self.calls.copies(node), v.fleet,
                                              v.online)
            plan = rehome.plan_lost(self.node, node, v.hosted_by_node, v.fleet, v.online, self.calls.local(),
                                    self._listed() | set(r.claims), int(wall), standby, v.records, v.deployed_text)
            r.planned(node)
            if plan.planned:
                rehoming.with_plan(self._our_record(), list(plan.planned), wall)
                self.calls.publish_rehomed()
            log.warning("node %s offline for %.0fs: re-homing %d instances%s%s", node, now - since,
                        len(plan.planned), f", idle copies {list(plan.idle)}" if plan.idle else "",
                        f", creators told of idle copies {list(plan.told)}" if plan.told else "",
                        extra={"node": self.node})
            for inst, stale in plan.skipped:  # an undeployed pipeline does not come back through a dead node's record
                log.info("not re-homing %s: %s", inst, stale, extra={"node": self.node})
            for data in plan.start:
                try:  # the hosted record is bus input: admitted like a spawn request
                    spec = self.gate.spec_from(wall, data, template=None, requester=f"the hosted record of {node}")
                except (TypeError, ValueError) as exc:
                    log.error("cannot re-home %s: %s", data.get("instance"), exc, extra={"node": self.node})
                    continue
                self._start(node, spec, now)

    def _start(self, node: str, spec: InstanceSpec, now: float) -> None:
        """Claim `spec` (lost with `node`) and ask createNode() for it; a failure is tried again
        later (agent.node.rehoming.Rehoming.failed), a success says where it went."""
        def reply(result: Dict[str, Any]) -> None:
            if not result.get("ok"):
                log.error("re-homing %s failed: %s", spec.instance, result.get("error"), extra={"node": self.node})
                # our re-homed record no longer claims it
                if self.rehoming.failed(node, spec, self.view.rehomed_by_node.get(self.node, {})) \
                        and self.calls.connected():
                    self.calls.publish_rehomed()
            else:
                self.calls.moved(spec.instance, result.get("node"))  # the re-homer says where

        self.rehoming.claim(spec.instance, now)
        self.calls.create_node(spec, reply, cause="rehome", now=now)

    def _retry(self, now: float, wall: float) -> None:
        """A re-home that failed after its node came back: the next plan of that node never comes
        (it is online), and the node, seeing our re-homed record at its reconnect, may have
        forgotten the instance: it ran nowhere. Once the node has been back long enough for its
        state to show what it re-adopted, an instance that no online node runs is re-homed again,
        under a new epoch floor (agent.node.rehoming.rehomed_here)."""
        if not self.rehoming.retry or not self.calls.connected() or self.calls.stopping():
            return
        listed = self._listed() | set(self.rehoming.claims)
        settle = READOPT_SETTLE + 2 * self.state_period
        for node, spec in self.rehoming.retries(now, listed, self.view.online, settle):
            again = self.rehoming.again(spec, wall, self._our_record())
            self.calls.publish_rehomed()
            log.warning("re-homing %s again: node %s is back and does not run it", spec.instance, node,
                        extra={"node": self.node})
            self._start(node, again, now)


__all__ = ["Rehomer", "RehomerCalls"]
