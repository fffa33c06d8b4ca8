"""Where a new operator instance goes: a pure, pluggable choice over what the agents published.

Rules of this file: no I/O, no clock, no randomness. A policy receives the request and a snapshot
of the fleet (built by the daemon from the agents' retained state and latency topics) and returns
the candidate nodes in order of preference. The daemon tries them in that order: a remote agent
may have filled its last slot since it published its state, so a ranking (not one answer) lets
the caller fall back without asking the policy again.

Default policy (issue 5): free slots first (a local free slot wins, since starting a local
process needs no network round trip and keeps the new instance's subscription on the broker path
we already know works), then the lowest mean latency to the instance's neighbours (the nodes that
host its predecessors and successors) once latencies are measured, then the most free slots
(spreads instances when nothing else tells them apart), then the node name (deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass(frozen=True)
class NodeView:
    """What placement knows about one agent (from its retained state and latency topics)."""

    node: str
    slots: int
    free_slots: int
    online: bool = True
    # Smoothed round-trip times in milliseconds from this node to others, when measured.
    latency_ms: Mapping[str, float] = field(default_factory=dict)
    # Instance ids hosted by this node (to find where an instance's neighbours run).
    instances: Tuple[str, ...] = ()


@dataclass(frozen=True)
class PlacementRequest:
    """One instance to place. `local` is the node asking (None for a deploy from outside)."""

    operator: str
    local: Optional[str] = None
    neighbours: Tuple[str, ...] = ()  # instance ids of its preds and succs

    def neighbour_nodes(self, fleet: Sequence[NodeView]) -> Tuple[str, ...]:
        hosts = []
        for inst in self.neighbours:
            for view in fleet:
                if inst in view.instances and view.node not in hosts:
                    hosts.append(view.node)
        return tuple(hosts)


PlacementPolicy = Callable[[PlacementRequest, Sequence[NodeView]], List[str]]


def _mean_latency(view: NodeView, targets: Sequence[str]) -> Optional[float]:
    """Mean RTT from `view` to the target nodes; a node is 0 ms from itself; None if unmeasured."""
    values = []
    for t in targets:
        if t == view.node:
            values.append(0.0)
        elif t in view.latency_ms:
            values.append(float(view.latency_ms[t]))
        else:
            return None
    return sum(values) / len(values) if values else None


def free_slots_then_latency(request: PlacementRequest, fleet: Sequence[NodeView]) -> List[str]:
    """The default ranking: local free slot, then latency to neighbours, then free slots, then name."""
    candidates = [v for v in fleet if v.online and v.free_slots > 0]
    targets = request.neighbour_nodes(fleet)

    def key(v: NodeView) -> Tuple[int, int, float, int, str]:
        lat = _mean_latency(v, targets)
        return (
            0 if v.node == request.local else 1,
            0 if lat is not None else 1,  # measured beats unknown
            lat if lat is not None else 0.0,
            -v.free_slots,
            v.node,
        )

    return [v.node for v in sorted(candidates, key=key)]


def spread(request: PlacementRequest, fleet: Sequence[NodeView]) -> List[str]:
    """Most free slots first, ignoring locality: spreads an operator over the fleet."""
    candidates = [v for v in fleet if v.online and v.free_slots > 0]
    return [v.node for v in sorted(candidates, key=lambda v: (-v.free_slots, v.node))]


def local_only(request: PlacementRequest, fleet: Sequence[NodeView]) -> List[str]:
    """Never leave the asking node (a single-node site, or tests of one agent)."""
    return [v.node for v in fleet if v.node == request.local and v.online and v.free_slots > 0]


POLICIES: Dict[str, PlacementPolicy] = {
    "free-slots-then-latency": free_slots_then_latency,
    "spread": spread,
    "local-only": local_only,
}
DEFAULT_POLICY = "free-slots-then-latency"


def get_policy(name: str) -> PlacementPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; expected one of {sorted(POLICIES)}") from None


__all__ = [
    "DEFAULT_POLICY",
    "NodeView",
    "POLICIES",
    "PlacementPolicy",
    "PlacementRequest",
    "free_slots_then_latency",
    "get_policy",
    "local_only",
    "spread",
]
