"""What one agent knows of the fleet, from the retained records it reads (the daemon's fleet view).

Rules of this file: no I/O, no clock, no reference to the daemon. Each `on_*` method takes one
retained record as it came off the bus (the node or pipeline its topic names, the payload) and
updates the view; a record that does not parse raises ValueError, and the view keeps what it had
(the daemon counts and logs it). What follows from a change (recompute the host bindings, drop
a standby copy, stop a stale instance) is the daemon's: the methods say what changed.

The records: each node's state (`agents/<n>/state`: its instances, free slots, "moved"
statements), status ("online"/"offline", the Will), latency row, hosted record (the specs it
hosts) and re-homed record; each pipeline's record (deployed with its generation and admin's
text, or a tombstone). Besides them, what this agent placed elsewhere since those nodes' last
states: the slots it asked for (`reserved`) and the copies it placed (`placed`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from agent import signing
from agent.control import records as pipeline_records
from agent.node import nodestate, rehome
from agent.node.hostmap import moved_of
from agent.node.placement import NodeView

Known = Tuple[str, str, str]  # (instance, pipeline, operator), as agent.node.bounds counts them


class FleetView:
    def __init__(self, me: str) -> None:
        self.me = me
        self.fleet: Dict[str, Dict[str, Any]] = {}  # node -> its retained state (ours: the last we published)
        self.online: Dict[str, bool] = {}
        self.latency: Dict[str, Dict[str, float]] = {}
        self.reserved: Dict[str, int] = {}  # remote slots we asked for since their last state
        # copies started on another node since its last state: counted for max_instances (bounds)
        self.placed: Dict[str, Tuple[str, Known]] = {}  # instance -> (node, known)
        self.hosted_by_node: Dict[str, List[Dict[str, Any]]] = {}
        self.rehomed_by_node: Dict[str, Dict[str, float]] = {}  # node -> {instance: when it re-homed it}
        # The retained pipeline records (deployed with a generation, or a tombstone).
        self.records: Dict[str, pipeline_records.PipelineRecord] = {}
        self.deployed: Set[str] = set()  # pipelines an admin deployed
        # The text of each pipeline an admin deployed (its record): what a peer spawn or a re-home
        # starts, whatever text the requester's spec or a node's hosted record carries.
        self.deployed_text: Dict[str, str] = {}

    # -- records ---------------------------------------------------------------------------------

    def on_state(self, node: str, payload: bytes) -> bool:
        """`node`'s retained state; True when its "moved" statements changed (the host bindings
        must be computed again). An empty payload clears it; our own is ours to keep."""
        if node == self.me or not payload:
            if not payload:
                self.fleet.pop(node, None)
            return False
        doc = nodestate.parse_node_state(payload)
        if doc["node"] != node:
            raise ValueError(f"state on {node}'s topic names node {str(doc['node'])[:40]!r}")
        nodestate.node_view(doc)  # what placement will read of it must be readable
        moved = moved_of(doc) != moved_of(self.fleet.get(node))
        self.fleet[node] = doc
        self.reserved.pop(node, None)
        # Published after its replies to us (one connection, in order): it lists their copies.
        self.placed = {i: v for i, v in self.placed.items() if v[0] != node}
        return moved

    def on_status(self, node: str, up: bool) -> None:
        self.online[node] = up

    def on_rehomed(self, node: str, payload: bytes) -> bool:
        """`node`'s re-homed record. Ours is the one we keep once we hold one (our retained
        record read at our start, or what we re-homed since): a broker restarted from its last
        autosave (killed with SIGKILL) hands back at our reconnect the copy it saved, which
        lacks what we re-homed since, and taking it would make us forget those re-homes (a
        returning node would then re-adopt a re-homed copy that has left since, and two nodes
        that both ran an instance would both stop theirs: rehoming.taken_over, rehomed_here).
        True when that copy of ours differs from what we hold: publish ours again."""
        record = rehome.decode_rehomed(payload)
        if node == self.me and node in self.rehomed_by_node:
            return record != self.rehomed_by_node[node]
        self.rehomed_by_node[node] = record
        return False

    def on_hosted(self, node: str, payload: bytes) -> List[str]:
        """`node`'s hosted record (ours is the one we publish); the instances it lists."""
        self.hosted_by_node[node] = rehome.decode_hosted(payload)
        return [str(s["instance"]) for s in self.hosted_by_node[node]]

    def on_latency(self, node: str, payload: bytes) -> None:
        self.latency[node] = nodestate.parse_latency(payload)

    def on_pipeline(self, name: str, payload: bytes, trust: signing.SpecTrust) -> Optional[str]:
        """Pipeline `name`'s record; why it was refused (not signed by an admin: kept as if never
        written, neither deployed nor a newer generation), or None."""
        record = pipeline_records.parse_record(payload)
        text = pipeline_records.deployed_text(payload) if record is not None else None
        if record is not None and record.state == "deployed" and text is not None:
            unsigned = trust.check(name, record.generation, text, record.signature)
            if unsigned:
                return unsigned
        if record is None:
            self.records.pop(name, None)
        else:
            self.records[name] = record
        if record is not None and record.state == "deployed" and text is not None:
            self.deployed.add(name)
            self.deployed_text[name] = text
        else:
            self.deployed.discard(name)
            self.deployed_text.pop(name, None)
        return None

    # -- what this agent placed ------------------------------------------------------------------

    def reserve(self, node: str) -> None:
        """We asked `node` for a slot: counted until its next state."""
        self.reserved[node] = self.reserved.get(node, 0) + 1

    def place(self, node: str, known: Known) -> None:
        """A copy started on `node`: counted until its next state lists it."""
        self.placed[known[0]] = (node, known)

    # -- readings --------------------------------------------------------------------------------

    def views(self, local: NodeView, max_slots: Mapping[str, int]) -> List[NodeView]:
        """Placement's view: this node's own (`local`), then every other node's from its state,
        its free slots less those we asked for since (`max_slots`: the slots a node may claim)."""
        out = [local]
        for node, doc in sorted(self.fleet.items()):
            if node == self.me:
                continue
            view = nodestate.node_view(doc, online=self.online.get(node, True), latency_ms=self.latency.get(node, {}),
                                       max_slots=max_slots.get(node))
            free = max(0, view.free_slots - self.reserved.get(node, 0))
            out.append(dataclasses.replace(view, free_slots=free))
        return out

    def siblings(self, pipeline: str, operator: str, instance: str) -> List[str]:
        """Ids of `operator`'s instances (of `pipeline`) that other online nodes list."""
        out: List[str] = []
        for node, doc in self.fleet.items():
            if node == self.me or not self.online.get(node, True):
                continue
            out.extend(str(i.get("id")) for i in doc.get("instances", []) or []
                       if isinstance(i, dict) and i.get("operator") == operator
                       and i.get("pipeline", pipeline) == pipeline and i.get("id") != instance)
        return out

    def runs_on(self, instance: str) -> Optional[str]:
        """Another online node whose state lists `instance`, if any."""
        for node, doc in self.fleet.items():
            if node != self.me and self.online.get(node) and any(
                isinstance(i, dict) and i.get("id") == instance for i in doc.get("instances", []) or []
            ):
                return node
        return None

    def placed_copies(self) -> Iterable[Known]:
        return [known for _, known in self.placed.values()]

    def eligible_standbys(self) -> List[str]:
        """Online nodes that are not draining (a standby for keyed state, agent.node.replicas)."""
        return [n for n, up in self.online.items() if up and not (self.fleet.get(n) or {}).get("draining")]


__all__ = ["FleetView", "Known"]
