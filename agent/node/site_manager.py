"""The site manager's decisions: node-level elasticity (docs/site-manager.md).

One manager per cluster watches the fleet's spare capacity and orders the nodes: drain the least
useful node when the fleet could run without it, release it (the release hook) once it hosts
nothing, acquire a released node (the acquire hook) when spare capacity falls below the target,
and undrain it once its agent is back online. It proposes and orders through the same requests
fogctl sends (DrainRequest); the decentralized protocol never waits for it.

Sans-IO: `decide(view, state, cfg, now)` is a pure function of the fleet view (the agents'
retained states), the manager's own state and the time passed in; `leader(...)` derives the
site manager from the nodes' claims, each on its own topic. The driver in the daemon does the I/O.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "SiteConfig", "NodeView", "ActionKind", "Action", "Pending", "SiteState", "spare", "decide",
    "spare_without", "view_of", "Lease", "Follows", "parse_lease", "lease_of", "follows_of", "lease_bound",
    "claim_problem", "valid_claims", "followed", "leader", "LeaseBoard", "hook_node",
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
#
# One record per node, on `agents/<node>/site_manager`, which the role's ACL lets only that node
# write (docs/security.md): the broker proves who wrote a claim, so no signature is needed and no
# node can renew, clear or overwrite another node's lease. Every reader derives the leader from
# the claims it holds (`leader`); a claim counts only while its holder's retained status says
# online, so a lease dies with its holder's connection (a revoked certificate cannot connect
# again, and its Will says offline). A node that does not lead states on the same record whom it
# follows (`Follows`): one record, one vote, which a reader that follows nobody yet counts when
# several claims run (`followed`).


@dataclass(frozen=True)
class Lease:
    """A node's claim to the role, on its own topic: while valid (see `valid_claims`), its lease.
    Its `state` (pending action, released nodes, last actions) is what `fogctl site` shows and
    what the next leader inherits its released list from."""

    node: str
    until: float  # unix seconds: the leader renews before; the claim is void after
    state: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"v": 1, "node": self.node, "until": self.until, "state": self.state}


MAX_LEASE_BYTES = 16 * 1024  # a record is a few hundred bytes; more is refused unread


def parse_lease(d: Any) -> Optional[Lease]:
    """The record, or None if absent or malformed."""
    if not isinstance(d, Mapping):
        return None
    node, until = d.get("node"), d.get("until")
    if not isinstance(node, str) or not node or isinstance(until, bool) or not isinstance(until, (int, float)):
        return None
    if not math.isfinite(until):
        return None
    st = d.get("state")
    return Lease(node[:200], float(until), dict(st) if isinstance(st, Mapping) else {})


@dataclass(frozen=True)
class Follows:
    """A node's statement, on its own claim topic, of the leader it follows (None: nobody), written
    whenever that changes by a node that does not lead. Its `until` of 0 makes it an expired claim
    for a reader that does not know statements."""

    node: str
    follows: Optional[str]

    def to_dict(self) -> Dict[str, Any]:
        return {"v": 1, "node": self.node, "until": 0, "follows": self.follows}


def _decoded(payload: bytes) -> Any:
    if not payload or len(payload) > MAX_LEASE_BYTES:
        return None
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return None


def lease_of(payload: bytes) -> Optional[Lease]:
    """The lease a retained payload states (None: empty, oversized, malformed, or a statement of
    whom its writer follows). Never raises."""
    d = _decoded(payload)
    return None if isinstance(d, Mapping) and "follows" in d else parse_lease(d)


def follows_of(payload: bytes) -> Optional[Follows]:
    """The statement a retained payload makes (None: none, or malformed: a name that is no plain
    string of at most 200 characters). Never raises."""
    d = _decoded(payload)
    if not isinstance(d, Mapping) or "follows" not in d:
        return None
    node, name = d.get("node"), d.get("follows")
    if not isinstance(node, str) or not node or not (name is None or isinstance(name, str) and 0 < len(name) <= 200):
        return None
    return Follows(node[:200], name)


# How far ahead of a reader's own clock a lease's `until` may be. A real leader writes its clock
# plus its `lease`; the rest covers clock skew between NTP-synchronised nodes and a candidate whose
# section differs. A forged `until = now + 1e9` would otherwise hold the role for ever.
MIN_LEASE_AHEAD = 60.0


def lease_bound(lease: float, period: float) -> float:
    """Seconds past its own clock a reader accepts a lease's `until`: its own lease plus three
    periods, at least MIN_LEASE_AHEAD."""
    return max(float(lease) + 3.0 * float(period), MIN_LEASE_AHEAD)


def claim_problem(writer: str, lease: Optional[Lease], now: float, max_ahead: float) -> Optional[str]:
    """Why the record `lease` on node `writer`'s own topic is refused (None: kept as its claim;
    an absent record is no claim and no problem either). The topic names the writer, as the ACL
    proves: a record naming another node is a forgery, one far past the reader's clock would
    hold the role for ever."""
    if lease is None:
        return None
    if lease.node != writer:
        return f"record on {writer[:40]}'s topic names node {lease.node[:40]!r}"
    if lease.until > now + max_ahead:
        return (f"lease of {writer[:40]} until {lease.until:.0f} is {lease.until - now:.0f} s ahead of this "
                f"node's clock (at most {max_ahead:.0f} s)")
    return None


def valid_claims(claims: Mapping[str, Optional[Lease]], online: Mapping[str, bool], now: float,
                 max_ahead: float) -> Dict[str, Lease]:
    """The claims that are leases now: keyed by the node whose topic carried them, naming that
    node, running (`now < until`), at most `max_ahead` past `now`, and of a node whose retained
    status says online (a holder gone offline, a revoked certificate included, holds nothing)."""
    return {w: c for w, c in claims.items()
            if c is not None and c.node == w and now < c.until <= now + max_ahead and online.get(w) is True}


def followed(valid: Mapping[str, Lease], follows: Mapping[str, Optional[str]], online: Mapping[str, bool],
             me: Optional[str] = None) -> Optional[str]:
    """The valid claim a strict majority of the votes for valid claims names, or None.

    One vote per online node other than the reader `me`, each from the one record only that node
    may write: a holder of a valid claim votes for itself (its record is its claim), any other
    node for the leader its statement names (`follows`). Why a node with a stolen key cannot
    lead by this: it has one vote, and every other valid claim has at least its holder's, so
    one vote is never a strict majority while another claim runs; lying about whom it follows
    only adds a vote to an honest claim. Why an honest leader is found: each node that follows
    it adds a vote, so one follower beside the leader outvotes the forger's claim."""
    votes: Dict[str, int] = {}
    for voter in set(valid) | set(follows):
        if voter == me or online.get(voter) is not True:
            continue
        choice = voter if voter in valid else follows.get(voter)
        if choice is not None and choice in valid:
            votes[choice] = votes.get(choice, 0) + 1
    total = sum(votes.values())
    for name, n in votes.items():
        if 2 * n > total:
            return name
    return None


def leader(claims: Mapping[str, Optional[Lease]], online: Mapping[str, bool], now: float, max_ahead: float,
           held: Optional[str] = None, follows: Optional[Mapping[str, Optional[str]]] = None,
           me: Optional[str] = None) -> Optional[Lease]:
    """The site manager as one reader sees it: its lease, or None (nobody leads).

    `claims`: node -> the last record on that node's own topic. `held`: the leader this reader
    followed so far. `follows`: node -> whom its own record says it follows; `me`: the reader
    (its own vote does not count). Pure, and only valid claims count (`valid_claims`):
    - the leader a reader follows stays while its claim is valid: a newer claim beside it, by a
      node that does not yield, takes nothing (election stability; no node takes a running lease);
    - otherwise the one valid claim; with several (two candidates that claimed at once, or a
      node that claims beside the leader), the one a strict majority of the other online nodes'
      votes names (`followed`), else none until one remains: picking one by a rule the claimer
      controls (a name, a time it writes) would hand the role to a forger, and the honest loser
      of a race withdraws within a period (SiteDriver)."""
    valid = valid_claims(claims, online, now, max_ahead)
    if held is not None and held in valid:
        return valid[held]
    if len(valid) == 1:
        return next(iter(valid.values()))
    if len(valid) > 1 and follows:
        name = followed(valid, follows, online, me)
        if name is not None:
            return valid[name]
    return None


MAX_CLAIMS = 4096  # distinct claimers a reader keeps (the ACL bounds them by the node list)
_UNSTATED = object()  # this node wrote no statement on its record since it last led or started


class LeaseBoard:
    """One reader's claims and the leader it follows (sans-IO state; `leader` decides).

    Fed with every record on `agents/+/site_manager` (`on_record`); `current` says who leads for
    this reader now. A candidate that leads puts its own lease here (`lead`), since it knows its
    record before the broker echoes it back."""

    def __init__(self, me: str, max_ahead: float, max_claims: int = MAX_CLAIMS) -> None:
        self.me = me
        self.max_ahead = max_ahead
        self.max_claims = max_claims
        self.claims: Dict[str, Lease] = {}
        self.follows: Dict[str, Optional[str]] = {}  # node -> whom its own record says it follows
        self.stated: Any = _UNSTATED  # whom this node's own statement names, as last published
        self.held: Optional[str] = None  # the leader this reader follows
        self.previous: Optional[str] = None  # the last other node it followed (whose released list a new leader inherits)
        self.own: Optional[Lease] = None  # this node's lease while it leads

    def on_record(self, writer: str, payload: bytes, now: float) -> Optional[str]:
        """A record on `writer`'s own topic (empty: cleared, the writer withdrew). Returns why it
        was refused (None: kept); a refused record also voids the writer's previous claim (the
        broker replaced it)."""
        self.follows.pop(writer, None)
        stated = follows_of(payload)
        if stated is not None:
            self.claims.pop(writer, None)
            if stated.node != writer:
                return f"statement on {writer[:40]}'s topic names node {stated.node[:40]!r}"
            if len(self.follows) >= self.max_claims:
                return f"more than {self.max_claims} statements: {writer[:40]}'s not kept"
            self.follows[writer] = stated.follows
            return None
        lease = lease_of(payload)
        problem = "malformed record" if payload and lease is None else claim_problem(writer, lease, now, self.max_ahead)
        if lease is None or problem:
            self.claims.pop(writer, None)
            return problem
        if writer not in self.claims and len(self.claims) >= self.max_claims:
            return f"more than {self.max_claims} claimers: {writer[:40]}'s claim not kept"
        self.claims[writer] = lease
        return None

    def valid(self, online: Mapping[str, bool], now: float) -> Dict[str, Lease]:
        claims, up = self._inputs(online)
        return valid_claims(claims, up, now, self.max_ahead)

    def current(self, online: Mapping[str, bool], now: float) -> Optional[Lease]:
        """The leader now (`leader` on this reader's claims and `held`), which it then follows."""
        claims, up = self._inputs(online)
        got = leader(claims, up, now, self.max_ahead, self.held, self.follows, self.me)
        self.held = got.node if got is not None else None
        if got is not None and got.node != self.me:
            self.previous = got.node
        return got

    def statement(self, online: Mapping[str, bool], now: float) -> Optional[bytes]:
        """The record this node writes on its own claim topic to say whom it follows now, when
        that changed since it last said so (None: nothing to write; a leader's claim is its
        statement). Called once the retained records are in: a reader that followed the first
        claim it read would follow a forger's."""
        if self.own is not None:
            return None
        got = self.current(online, now)
        name = got.node if got is not None else None
        if name == self.me or name == self.stated:
            return None
        self.stated = name
        return json.dumps(Follows(self.me, name).to_dict()).encode()

    def restate(self) -> None:
        """Write the statement again at the next `statement` (a new connection: the broker may
        have lost its retained records)."""
        self.stated = _UNSTATED

    def lead(self, lease: Lease) -> None:
        """This node leads with `lease` (its own record, published now: it replaces the
        statement)."""
        self.own = lease
        self.held = self.me
        self.stated = _UNSTATED

    def withdraw(self) -> None:
        """This node stopped leading (its record is cleared: the next statement is written)."""
        self.own = None
        self.claims.pop(self.me, None)
        self.stated = _UNSTATED
        if self.held == self.me:
            self.held = None

    def _inputs(self, online: Mapping[str, bool]) -> Tuple[Dict[str, Optional[Lease]], Dict[str, bool]]:
        claims: Dict[str, Optional[Lease]] = dict(self.claims)
        if self.own is not None:
            claims[self.me] = self.own
        up = dict(online)
        up[self.me] = True  # this reader runs: its own claim is not void for a status it has not seen yet
        return claims, up


_HOOK_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def hook_node(name: str, known: Iterable[str]) -> Optional[str]:
    """The node name a power hook may be given: one of `known` (node names this agent read from
    topic levels that only that node may write: the ACL proves them), plain (letters, digits,
    `_ . -`, not starting with `-`), and the known string itself, never a payload's. None: no hook."""
    for k in known:
        if k == name and _HOOK_NODE.fullmatch(k):
            return k
    return None
