"""The retained records and the latency probes that reach the agent from the bus, one handler per
topic kind (`Inbound.HANDLERS`): the other agents' states, statuses, hosted and re-homed records,
the pipeline records, the site manager's claims, the latency rows, pings and pongs.

Why a part of its own: each record only updates the parts it names (the fleet view, the host
tables, the standby copies, re-homing's offline times, the site manager's lease board, the
latency core), and what else it has the node do goes through `InboundCalls`, so the node's core
(agent.node.core) only hands a message here. Whatever a record holds, a bad one is counted and
logged through `bad` and never ends the loop (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Optional

from agent import topics
from agent.node.fleetview import FleetView
from agent.node.hostsync import HostSync
from agent.node.rehoming import Rehoming
from agent.node.replicas import Replication
from agent.node.site_manager import LeaseBoard

log = logging.getLogger(__name__)

FOLLOWED_FILE = "followed.json"  # the site manager this node follows (LeaseBoard.held), kept over a restart


@dataclasses.dataclass(frozen=True)
class InboundCalls:
    """What a record may have the rest of the node do."""

    publish: Callable[..., Any]  # (topic, payload, retain=..., qos=...)
    keep: Callable[[str, Any, str], bool]  # a file of the state directory, for the next start
    bad: Callable[[str, Optional[str], Any], None]  # a bad message: counted and logged
    changed: Callable[[], None]  # our state changed: publish it soon
    drop_stale: Callable[[str, float], None]  # the record of a pipeline changed
    retained_in: Callable[[], bool]  # the retained records of this connection are in
    restate_rehomed: Callable[[], None]  # publish our re-homed record again, as we hold it
    # when a message reached this node: stamped on the MQTT client's thread (agent.measure.latency.received_at)
    received: Callable[[Any, float], float]


class Inbound:
    """The handlers of the records and probes, given the parts they update."""

    def __init__(self, node: str, cluster: str, view: FleetView, hosts: HostSync, replication: Replication,
                 rehoming: Rehoming, trust: Any, leases: LeaseBoard, latency_core: Any, counters: Dict[str, int],
                 clock: Callable[[], float], wall: Callable[[], float], calls: InboundCalls) -> None:
        self.node = node
        self.cluster = cluster
        self.view = view
        self.hosts = hosts
        self.replication = replication
        self.rehoming = rehoming
        self.trust = trust
        self.leases = leases
        self.latency_core = latency_core
        self.counters = counters
        self.clock = clock
        self.wall = wall
        self.calls = calls

    def handle(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        """Hand `msg` to the handler of its topic's kind; a kind read elsewhere or nowhere: ignored."""
        handler = self.HANDLERS.get(parsed.kind)
        if handler is not None:
            handler(self, msg, parsed, now)

    def on_state(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        try:
            if self.view.on_state(str(parsed.node), msg.payload):
                self.hosts.dirty = True
        except (ValueError, TypeError, KeyError) as exc:
            self.calls.bad("state", str(parsed.node), exc)

    def on_status(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        node = str(parsed.node)
        up = msg.payload == b"online"
        if self.view.online.get(node) != up and node in self.replication.store.hosts():
            self.calls.changed()  # our state lists what our copies of an offline host own
        self.rehoming.on_status(node, up, bool(self.view.online.get(node)), now)
        self.view.on_status(node, up)
        self.hosts.dirty = True

    def on_rehomed(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        try:
            if self.view.on_rehomed(str(parsed.node), msg.payload):
                self.calls.restate_rehomed()  # the broker handed back an older copy of ours
            self.hosts.dirty = True
        except ValueError as exc:
            self.calls.bad("re-homed record", str(parsed.node), exc)

    def on_hosted(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        node = str(parsed.node)
        if node == self.node:
            return
        try:
            listed = self.view.on_hosted(node, msg.payload)
            self.hosts.dirty = True
            self.replication.drop_unlisted(node, listed)
        except ValueError as exc:
            self.calls.bad("hosted record", node, exc)

    def on_pipeline(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        name = str(parsed.node)
        unsigned = self.view.on_pipeline(name, msg.payload, self.trust)
        if unsigned:  # kept as if never written: neither deployed nor a newer generation
            self.counters["refused_signatures"] = self.counters.get("refused_signatures", 0) + 1
            log.warning("pipeline record %s refused: %s", name, unsigned, extra={"node": self.node})
            return
        self.calls.drop_stale(name, now)

    def on_site_manager(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        if parsed.sender is not None:
            return
        # Only `node` may write this topic (the ACL): the record is node's claim, refused if it
        # names another node or runs too far past this node's clock (docs/site-manager.md).
        refused = self.leases.on_record(str(parsed.node), msg.payload, self.wall())
        if refused:
            self.counters["site_lease_refused"] = self.counters.get("site_lease_refused", 0) + 1
            log.warning("site manager claim refused: %s", refused, extra={"node": self.node})
        self.state_whom_we_follow()

    def state_whom_we_follow(self) -> None:
        """Say on our own claim topic which leader we follow, when that changed: a reader that
        follows nobody yet takes the claim most nodes follow, so one forged claim beside the
        leader's does not keep it from the leader (site_manager.followed). Every record on the
        claim topics comes here, the leader's renewals too, so a follower states its leader
        within a period of the records being in."""
        if not self.calls.retained_in():
            return
        payload = self.leases.statement(self.view.online, self.wall())
        if payload is not None:
            self.calls.publish(topics.site_manager(self.cluster, self.node), payload, retain=True)
            self.calls.keep(FOLLOWED_FILE, {"follows": self.leases.stated}, "the leader followed")

    def on_latency_row(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        self.view.on_latency(str(parsed.node), msg.payload)

    def on_probe(self, msg: Any, parsed: topics.Parsed, now: float) -> None:
        if parsed.node != self.node or self.latency_core is None:
            return
        try:
            # timed at receipt on paho's thread, not when this loop reads it (docs/measurement.md)
            t = self.clock()
            out = self.latency_core.on_message(msg.topic, msg.payload, t, received=self.calls.received(msg, t))
        except ValueError as exc:
            self.calls.bad(f"latency {parsed.kind}", parsed.sender, exc)
            return
        for out_topic, payload in out:
            self.calls.publish(out_topic, payload, qos=0)

    def probe(self) -> None:
        """Once per loop turn, while connected: the latency core's pings to the online agents (a
        ping's send time: after the turn's other work) and, when due, our retained latency row."""
        core = self.latency_core
        if core is None:
            return
        core.set_neighbours((n for n in self.view.fleet if n != self.node and self.view.online.get(n, False)),
                            near=self.hosts.near)
        for topic, payload in core.poll(self.clock()):
            self.calls.publish(topic, payload, qos=0)
        if core.publish_due(self.clock()):
            topic, payload = core.retained(self.wall())
            self.calls.publish(topic, payload, retain=True)

    HANDLERS: Dict[str, Callable[["Inbound", Any, topics.Parsed, float], None]] = {
        "state": on_state, "status": on_status, "rehomed": on_rehomed, "hosted": on_hosted,
        "pipeline": on_pipeline, "site_manager": on_site_manager, "latency": on_latency_row,
        "ping": on_probe, "pong": on_probe,
    }
