"""The site manager's decisions: node-level elasticity (docs/site-manager.md).

One manager per cluster watches the fleet's spare capacity and orders the nodes: drain the least
useful node when the fleet could run without it, release it (the release hook) once it hosts
nothing, acquire a released node (the acquire hook) when spare capacity falls below the target,
and undrain it once its agent is back online. It proposes and orders through the same requests
fogctl sends (DrainRequest); the decentralized protocol never waits for it.

Sans-IO: `decide(view, state, cfg, now)` is a pure function of the fleet view (the agents'
retained states), the manager's own state and the time passed in; `claim(...)` decides the
leader election from the retained leader record. The driver in the daemon does the I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "SiteConfig", "NodeView", "ActionKind", "Action", "Pending", "SiteState", "spare", "decide",
    "spare_without", "view_of", "Lease", "claim", "parse_lease", "accept_lease", "lease_bound", "hook_node",
]


@dataclass(frozen=True)
class SiteConfig:
    """target: the spare-capacity fraction the fleet keeps, (capacity - load) / capacity."""

    target: float = 0.3
    min_nodes: int = 1
    max_nodes: int = 64
    cooldown: float = 60.0  # seconds between two completed actions
    timeout: float = 300.0  # a drain or an acquisition not done by then is given up


@dataclass(frozen=True)
class NodeView:
    node: str
    online: bool
    draining: bool
    capacity: float  # records/s the node sustains (its instances' capacities, or measured)
    load: float  # records/s its instances carry now
    instances: int
    free_slots: int


class ActionKind(Enum):
    DRAIN = "drain"  # send DrainRequest(node): its instances leave through the hand-over
    RELEASE = "release"  # run the release hook with the node's name
    ACQUIRE = "acquire"  # run the acquire hook with the node's name
    UNDRAIN = "undrain"  # send DrainRequest(node, undo=True): the node takes instances again


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    node: str
    reason: str  # why, in words and figures: published on the events topic (fogctl why)

    def to_dict(self) -> Dict[str, Any]:
        return {"action": self.kind.value, "node": self.node, "reason": self.reason}


@dataclass(frozen=True)
class Pending:
    """The one action under way: a drain waiting for the node to empty, or an acquisition
    waiting for the agent to come online."""

    kind: ActionKind  # DRAIN or ACQUIRE
    node: str
    since: float


@dataclass(frozen=True)
class SiteState:
    pending: Optional[Pending] = None
    released: Tuple[str, ...] = ()  # nodes this manager released, acquirable, oldest first
    last_done: float = -math.inf  # when the last action completed (cooldown)


def spare(nodes: Sequence[NodeView]) -> Optional[float]:
    """(capacity - load) / capacity over the given nodes; None without capacity."""
    cap = sum(n.capacity for n in nodes)
    if cap <= 0:
        return None
    return (cap - sum(n.load for n in nodes)) / cap


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def spare_without(nodes: Sequence[NodeView], gone: NodeView) -> Optional[float]:
    """The spare fraction once `gone` is drained: its load moves onto the others' capacity."""
    cap = sum(n.capacity for n in nodes if n is not gone)
    if cap <= 0:
        return None
    return (cap - sum(n.load for n in nodes)) / cap


def _serving(view: Sequence[NodeView], released: Tuple[str, ...]) -> List[NodeView]:
    return [n for n in view if n.online and not n.draining and n.node not in released]


def _usefulness(n: NodeView) -> Tuple[float, int, float, str]:
    # Least useful first: fewest instances to move, least load, least capacity lost, then name.
    return (n.instances, n.load, n.capacity, n.node)


def decide(view: Sequence[NodeView], state: SiteState, cfg: SiteConfig, now: float
           ) -> Tuple[SiteState, List[Action]]:
    """At most one action per call, and none while another is pending (except its completion)."""
    by_name = {n.node: n for n in view}
    serving = _serving(view, state.released)
    p = state.pending
    if p is not None:
        n = by_name.get(p.node)
        if p.kind is ActionKind.DRAIN:
            # The draining node is out of `serving` already: what serving sustains is what stays.
            s = spare(serving)
            # No capacity figure at all (s is None) while nodes serve is not a shortage: the
            # moment the drained node's instances stop and start elsewhere, none may report one
            # (an empty node's capacity is the fleet's mean). Undoing the drain for it sent the
            # moved instances back and forth (test_drain_keyed's consolidation run): wait,
            # within `timeout`, for a figure instead.
            short = (s is None and not serving) or (s is not None and s < cfg.target) or len(serving) < cfg.min_nodes
            if short or now - p.since > cfg.timeout:
                why = (f"spare {_fmt(s)} < target {cfg.target:.2f} on {len(serving)} nodes before the node emptied"
                       if short else f"not empty after {cfg.timeout:.0f} s")
                return SiteState(None, state.released, now), [Action(ActionKind.UNDRAIN, p.node, why)]
            # Released only once its agent says it drains AND hosts nothing: a node that does
            # not report draining (the order not applied yet, or lost with an agent restart)
            # still takes new instances, which a power-off would take with it.
            if s is not None and n is not None and n.online and n.draining and n.instances == 0:
                done = SiteState(None, state.released + (p.node,), now)
                return done, [Action(ActionKind.RELEASE, p.node,
                                     f"drained: hosts no instance; spare {_fmt(s)} on {len(serving)} nodes")]
            return state, []
        # ACQUIRE: the node is back once its agent is online; it may still be draining (released).
        if n is not None and n.online:
            left = tuple(r for r in state.released if r != p.node)
            return SiteState(None, left, now), [Action(ActionKind.UNDRAIN, p.node, "agent online again")]
        if now - p.since > cfg.timeout:
            return SiteState(None, state.released, now), []
        return state, []
    if now - state.last_done < cfg.cooldown:
        return state, []
    s = spare(serving)
    if s is None:
        return state, []
    if s < cfg.target and state.released and len(serving) < cfg.max_nodes:
        node = state.released[0]
        reason = f"spare {s:.2f} < target {cfg.target:.2f} on {len(serving)} nodes"
        return replace(state, pending=Pending(ActionKind.ACQUIRE, node, now)), [Action(ActionKind.ACQUIRE, node, reason)]
    if len(serving) <= cfg.min_nodes:
        return state, []
    for cand in sorted(serving, key=_usefulness):
        rest = [n for n in serving if n is not cand]
        s_rest = spare_without(serving, cand)
        if s_rest is None or s_rest < cfg.target:
            continue
        if sum(n.free_slots for n in rest) < cand.instances:
            continue
        reason = (f"spare {s:.2f} on {len(serving)} nodes, {s_rest:.2f} >= target {cfg.target:.2f} "
                  f"without {cand.node} ({cand.instances} instances, load {cand.load:.1f})")
        return replace(state, pending=Pending(ActionKind.DRAIN, cand.node, now)), [Action(ActionKind.DRAIN, cand.node, reason)]
    return state, []


def view_of(docs: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool], now: float,
            stale_after: float, default_capacity: float = 0.0) -> List[NodeView]:
    """The manager's view of the agents' retained states (agent.node.nodestate documents).

    A node's capacity is what it sustains with every slot used: its slots times its instances'
    mean capacity (records/s), else the fleet's mean, else `default_capacity`; so an empty node
    still counts for what it would add, and the figure does not move with the instance count.
    A node whose state is older than `stale_after` seconds counts as offline: a killed agent's
    Will comes a keepalive and a half later, and until then its last state would offer slots."""
    def caps(doc: Mapping[str, Any]) -> List[float]:
        return [float(c) for i in _items(doc) for c in [i.get("capacity")]
                if isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0]

    every = [c for d in docs.values() for c in caps(d)]
    fleet_mean = sum(every) / len(every) if every else default_capacity
    out = []
    for node, doc in sorted(docs.items()):
        own = caps(doc)
        per = sum(own) / len(own) if own else fleet_mean
        slots = _int(doc.get("slots"))
        load = sum(float(v) for i in _items(doc) for v in [i.get("load")]
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
        ts = doc.get("time")
        fresh = isinstance(ts, (int, float)) and not isinstance(ts, bool) and now - ts <= stale_after
        moving = doc.get("handing_over")  # keepers it stopped whose start elsewhere is unanswered
        busy = len(_items(doc)) + (len(moving) if isinstance(moving, list) else 0)
        out.append(NodeView(node, bool(online.get(node, False)) and fresh, doc.get("draining") is True,
                            slots * per, load, busy, _int(doc.get("free_slots"))))
    return out


def _items(doc: Mapping[str, Any]) -> List[Mapping[str, Any]]:
    items = doc.get("instances")
    return [i for i in items if isinstance(i, Mapping)] if isinstance(items, list) else []


def _int(v: Any) -> int:
    return max(0, int(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0


# ---- election ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    """The retained leader record on topics.site_manager(cluster)."""

    node: str
    until: float  # unix seconds: the leader renews before, the others wait until after
    state: Dict[str, Any] = field(default_factory=dict)  # what fogctl site shows

    def to_dict(self) -> Dict[str, Any]:
        return {"v": 1, "node": self.node, "until": self.until, "state": self.state}


def parse_lease(d: Any) -> Optional[Lease]:
    """The record, or None if absent or malformed (then the role is free)."""
    if not isinstance(d, Mapping):
        return None
    node, until = d.get("node"), d.get("until")
    if not isinstance(node, str) or not node or isinstance(until, bool) or not isinstance(until, (int, float)):
        return None
    if not math.isfinite(until):
        return None
    st = d.get("state")
    return Lease(node[:200], float(until), dict(st) if isinstance(st, Mapping) else {})


def claim(current: Optional[Lease], me: str, now: float) -> bool:
    """May `me` publish its own lease now? Yes if the role is free, expired, or already its own.

    Two agents may both claim an expired lease at once; each then sees the other's record (MQTT
    orders the retained messages of one topic) and the one whose record is not retained stops
    at its next tick: leadership is decided by the record the broker kept."""
    return current is None or current.node == me or now >= current.until


# How far ahead of a reader's own clock a lease's `until` may be. A real leader writes its clock
# plus its `lease`; the rest covers clock skew between NTP-synchronised nodes and a candidate whose
# section differs. A forged `until = now + 1e9` would otherwise hold the role for ever.
MIN_LEASE_AHEAD = 60.0


def lease_bound(lease: float, period: float) -> float:
    """Seconds past its own clock a reader accepts a lease's `until`: its own lease plus three
    periods, at least MIN_LEASE_AHEAD."""
    return max(float(lease) + 3.0 * float(period), MIN_LEASE_AHEAD)


def accept_lease(current: Optional[Lease], new: Optional[Lease], now: float,
                 max_ahead: float) -> Tuple[Optional[Lease], Optional[str]]:
    """The lease a reader holds as valid after the record `new` arrived (None: absent or
    malformed), and why `new` was refused (None: accepted).

    Everything on the record's topic is hostile: any node identity may write it. So a reader
    - refuses a lease whose `until` is more than `max_ahead` seconds past its own clock;
    - takes a new holder only once the lease it holds ran out by its own clock (a node cannot
      take the role from a leader whose lease is running), or from the holder itself (renewal);
    - keeps the lease it holds when the record is cleared or malformed while that lease runs (a
      clear would otherwise free the role for a forger's claim at once); it runs out by itself.
    """
    held = current is not None and now < current.until
    if new is None:
        if held:
            assert current is not None
            return current, f"record cleared or malformed while {current.node}'s lease runs"
        return None, None
    if new.until > now + max_ahead:
        return (current if held else None), (
            f"lease of {new.node[:40]!r} until {new.until:.0f} is {new.until - now:.0f} s ahead of this "
            f"node's clock (at most {max_ahead:.0f} s)")
    if held and current is not None and new.node != current.node:
        return current, f"{new.node[:40]!r} claims the lease {current.node} holds until {current.until:.0f}"
    return new, None


_HOOK_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def hook_node(name: str, known: Iterable[str]) -> Optional[str]:
    """The node name a power hook may be given: one of `known` (node names this agent read from
    topic levels that only that node may write: the ACL proves them), plain (letters, digits,
    `_ . -`, not starting with `-`), and the known string itself, never a payload's. None: no hook."""
    for k in known:
        if k == name and _HOOK_NODE.fullmatch(k):
            return k
    return None
