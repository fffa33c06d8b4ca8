"""Where a new operator instance goes: a pure, pluggable choice over what the agents published.

Rules of this file: no I/O, no clock, no randomness. A policy receives the request and a snapshot
of the fleet (built by the daemon from the agents' retained state and latency topics) and returns
the candidate nodes in order of preference. The daemon tries them in that order: a remote agent
may have filled its last slot since it published its state, so a ranking (not one answer) lets
the caller fall back without asking the policy again.

This is the ONE placement module (the daemon, deploy and the policy simulator use it): the slot
and neighbour ranking below, and the Gesscale latency functions (ND_max of a placement, the node
that keeps it smallest, the farthest instance, an instance's rank among its siblings) with the
per-instance context the daemon hands its workers for the Gesscale policies (`instance_context`,
docs/measurement.md "Policies in the daemon").

Default policy (issue 5): free slots first (a local free slot wins, since starting a local
process needs no network round trip and keeps the new instance's subscription on the broker path
we already know works), then the lowest mean latency to the instance's neighbours (the nodes that
host its predecessors and successors) once latencies are measured, then the most free slots
(spreads instances when nothing else tells them apart), then the node name (deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from agent.policy.live import LIVE_POLICIES


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
    siblings: Tuple[str, ...] = ()  # instance ids of its operator's other instances (ND_max placement)

    def neighbour_nodes(self, fleet: Sequence[NodeView]) -> Tuple[str, ...]:
        return _hosts(self.neighbours, fleet)

    def sibling_nodes(self, fleet: Sequence[NodeView]) -> Tuple[str, ...]:
        return _hosts(self.siblings, fleet)


def _hosts(instances: Sequence[str], fleet: Sequence[NodeView]) -> Tuple[str, ...]:
    hosts: List[str] = []
    for inst in instances:
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


# ---- Gesscale latency functions (ND_max, farthest, rank) ------------------------------------------

Matrix = Mapping[str, Mapping[str, float]]


def _rtt(matrix: Matrix, a: str, b: str) -> float:
    if a == b:
        return 0.0
    v = matrix.get(a, {}).get(b)
    if v is None:
        v = matrix.get(b, {}).get(a)
    if v is None:
        raise KeyError(f"no latency between {a!r} and {b!r} in the matrix")
    return float(v)


def nd_max(matrix: Matrix, nodes: Sequence[str]) -> float:
    """The greatest RTT among the nodes hosting an operator (0 for a single node)."""
    uniq = sorted(set(nodes))
    return max((_rtt(matrix, a, b) for i, a in enumerate(uniq) for b in uniq[i + 1:]), default=0.0)


def rank_nodes_for_scale_out(matrix: Matrix, current: Sequence[str], candidates: Sequence[str]) -> Tuple[str, ...]:
    """Candidates best first: smallest resulting ND_max, then smallest summed RTT, then name."""
    def key(c: str) -> Tuple[float, float, str]:
        return (nd_max(matrix, list(current) + [c]), sum(_rtt(matrix, c, x) for x in current), c)

    return tuple(sorted(candidates, key=key))


def farthest(matrix: Matrix, placement: Mapping[str, str], keeper: Optional[str] = None) -> Optional[str]:
    """The instance (of `placement`: instance -> node) with the greatest summed RTT to the others."""
    ranked = [i for i in _by_distance(matrix, placement) if i != keeper]
    return ranked[0] if ranked else None


def _by_distance(matrix: Matrix, placement: Mapping[str, str]) -> Tuple[str, ...]:
    def key(inst: str) -> Tuple[float, str]:
        node = placement[inst]
        return (-sum(_rtt(matrix, node, placement[o]) for o in placement if o != inst), inst)

    return tuple(sorted(placement, key=key))


def sibling_rank(matrix: Matrix, placement: Mapping[str, str], instance: str, keeper: Optional[str] = None) -> int:
    """`Measurements.rank` for `instance`: 0 = farthest; the keeper is always ranked last."""
    order = [i for i in _by_distance(matrix, placement) if i != keeper]
    if keeper is not None and keeper in placement:
        order.append(keeper)
    return order.index(instance)


def complete_matrix(latency: Mapping[str, Mapping[str, float]], nodes: Sequence[str]) -> Dict[str, Dict[str, float]]:
    """The measured RTTs among `nodes` as a full matrix: a missing direction takes the other one,
    a pair measured in neither direction counts as 0 ms. Every agent that reads the same retained
    latency rows builds the same matrix, so siblings agree on their ranks."""
    out: Dict[str, Dict[str, float]] = {a: {} for a in nodes}
    for a in nodes:
        for b in nodes:
            if a == b:
                continue
            v = latency.get(a, {}).get(b)
            if v is None:
                v = latency.get(b, {}).get(a)
            out[a][b] = float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 else 0.0
    return out


def instance_context(docs: Mapping[str, Mapping[str, Any]], latency: Mapping[str, Mapping[str, float]],
                     pipeline: str, operator: str, pred_operator: Optional[str], instance: str) -> Dict[str, Any]:
    """What an instance of a Gesscale policy needs to know about its siblings, from the agents'
    retained states (`docs`: node -> parsed state) and latency rows (node -> {peer: ms}).

    n: the operator's instances that are not leaving (starting ones count: a copy on its way is
    capacity already decided); nd_max_ms: ND_max of their nodes; rank: the instance's position,
    0 = farthest, keeper last (None when it is not in the view yet); upstream_backpressure: the
    greatest back-pressure ratio among the predecessor operator's instances (Gesscale Algorithm 1);
    keeper: the keeper's id. Pure; docs/measurement.md "Policies in the daemon".
    """
    placement: Dict[str, str] = {}
    keeper: Optional[str] = None
    upstream = 0.0
    for node, doc in sorted(docs.items()):
        for item in doc.get("instances", []) or []:
            if not isinstance(item, dict) or item.get("pipeline", pipeline) != pipeline:
                continue
            op = item.get("operator")
            stats = item.get("stats") if isinstance(item.get("stats"), dict) else {}
            if op == operator and item.get("status") != "terminating":
                iid = str(item.get("id"))
                placement[iid] = str(doc.get("node", node))
                if item.get("keeper"):
                    keeper = iid
            elif pred_operator is not None and op == pred_operator and item.get("status") == "active":
                sig = stats.get("signals") if isinstance(stats.get("signals"), dict) else {}
                bp = sig.get("backpressure")
                if isinstance(bp, (int, float)) and math.isfinite(bp):
                    upstream = max(upstream, min(1.0, max(0.0, float(bp))))
    matrix = complete_matrix(latency, sorted(set(placement.values())))
    rank = sibling_rank(matrix, placement, instance, keeper) if instance in placement else None
    return {"n": max(1, len(placement)), "nd_max_ms": round(nd_max(matrix, list(placement.values())), 3),
            "rank": rank, "upstream_backpressure": round(upstream, 4), "keeper": keeper}


def nd_max_first(request: PlacementRequest, fleet: Sequence[NodeView]) -> List[str]:
    """Gesscale's latency-aware placement, as the policy simulator places: among nodes with a free
    slot, the one that keeps the operator's ND_max (largest RTT among its nodes) smallest, then the
    smallest summed RTT to the nodes of its instances (`rank_nodes_for_scale_out`), then the asking
    node, then free slots, then the name. RTTs from the fleet's latency rows (`complete_matrix`).
    Without siblings in the view it ranks as `free_slots_then_latency`."""
    current = list(request.sibling_nodes(fleet))
    if not current:
        return free_slots_then_latency(request, fleet)
    candidates = [v for v in fleet if v.online and v.free_slots > 0]
    nodes = sorted({v.node for v in fleet} | set(current))
    matrix = complete_matrix({v.node: v.latency_ms for v in fleet}, nodes)

    def key(v: NodeView) -> Tuple[float, float, int, int, str]:
        return (nd_max(matrix, current + [v.node]), sum(_rtt(matrix, v.node, x) for x in current),
                0 if v.node == request.local else 1, -v.free_slots, v.node)

    return [v.node for v in sorted(candidates, key=key)]


def policy_for_operator(configured: PlacementPolicy, operator_policy: str) -> PlacementPolicy:
    """The ranking for a copy of an operator: ND_max placement for the Gesscale policies (threshold,
    model, sized) when the agent runs the default placement; otherwise the agent's own choice (a
    deliberate `spread` or `local-only` is kept)."""
    if configured is POLICIES[DEFAULT_POLICY] and operator_policy in LIVE_POLICIES:
        return nd_max_first
    return configured


POLICIES: Dict[str, PlacementPolicy] = {
    "free-slots-then-latency": free_slots_then_latency,
    "spread": spread,
    "local-only": local_only,
    "nd-max": nd_max_first,
}
DEFAULT_POLICY = "free-slots-then-latency"


def get_policy(name: str) -> PlacementPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; expected one of {sorted(POLICIES)}") from None


__all__ = [
    "DEFAULT_POLICY",
    "complete_matrix",
    "farthest",
    "instance_context",
    "nd_max_first",
    "policy_for_operator",
    "nd_max",
    "rank_nodes_for_scale_out",
    "sibling_rank",
    "NodeView",
    "POLICIES",
    "PlacementPolicy",
    "PlacementRequest",
    "free_slots_then_latency",
    "get_policy",
    "local_only",
    "spread",
]
