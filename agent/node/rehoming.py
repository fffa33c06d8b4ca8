"""Re-homing's decisions in the daemon: which lost node's instances to start elsewhere, when, and
which of ours stand down because another node started them (agent.node.rehome plans one node's).

Rules of this file: no I/O, no clock, no reference to the daemon. `Rehoming` keeps what re-homing
remembers between loop turns (since when each node is offline or back, the nodes whose loss was
planned, the instances asked for, the failed ones to try again); the functions read the fleet view
the daemon passes in: `local` is {instance: its worker's last stats} of this node, `fleet` {node:
its retained state}, `online` {node: up}. Times are arguments (`now`: the daemon's loop clock;
`wall`: the wall clock the re-homed records and epoch floors use). The daemon (agent.node.rehomer)
admits each planned spec, starts it (createNode()), publishes the records and logs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Mapping, Optional, Set, Tuple

from agent.instance.spec import InstanceSpec

REHOMED_KEPT = 1000  # entries of this node's retained re-homed record (and failed re-homes kept)

Stats = Mapping[str, Any]


def entries_elsewhere(me: str, fleet: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool],
                      lost: Optional[str] = None) -> Iterator[Dict[str, Any]]:
    """The instance entries of every other ONLINE node's retained state (and of the `lost`
    node's last one)."""
    for n, doc in fleet.items():
        if n != me and (online.get(n) or n == lost):
            yield from (i for i in doc.get("instances", []) or [] if isinstance(i, dict))


def listed_elsewhere(me: str, fleet: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool]) -> Set[str]:
    """Instance ids that another ONLINE node lists in its retained state."""
    return {str(i.get("id")) for i in entries_elsewhere(me, fleet, online)}


def _reported(me: str, local: Mapping[str, Stats], fleet: Mapping[str, Mapping[str, Any]],
              online: Mapping[str, bool], lost: Optional[str]) -> Iterator[Tuple[str, Stats]]:
    """(instance, stats) as last reported: ours from the workers' heartbeats, then the other
    online nodes' (and the `lost` node's last one) from their retained states, whose entries
    without a stats object are skipped (bus input)."""
    yield from local.items()
    for i in entries_elsewhere(me, fleet, online, lost):
        stats = i.get("stats")
        if isinstance(stats, dict):
            yield str(i.get("id")), stats


def in_state(me: str, local: Mapping[str, Stats], fleet: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool],
             states: Tuple[str, ...], lost: Optional[str] = None) -> Set[str]:
    """Instances whose scaling core is in one of `states` (`_reported`). For
    agent.node.rehome.plan_rehome: departing instances stay out of a re-homed predecessor's
    successors; idle copies are re-homed idle, and their creator told of them."""
    return {i for i, stats in _reported(me, local, fleet, online, lost) if stats.get("state") in states}


def lost_groups(me: str, local: Mapping[str, Stats], fleet: Mapping[str, Mapping[str, Any]],
                online: Mapping[str, bool], lost: str) -> Dict[str, Any]:
    """The key groups each keyed instance last said it owned (`_reported`). A re-homed keyed
    incarnation resumes its own; a re-homed predecessor builds its group table from its
    successors' (agent.node.rehome.plan_rehome)."""
    return {i: stats["groups"] for i, stats in _reported(me, local, fleet, online, lost)
            if isinstance(stats.get("groups"), list)}


def lost_moves(me: str, local: Mapping[str, Stats], fleet: Mapping[str, Mapping[str, Any]],
               online: Mapping[str, bool], lost: str, key: str) -> Dict[str, Any]:
    """The moves each keyed instance last said it was part of (`_reported`): `handed` (handed
    out, not installed yet: a re-homed predecessor's table names their new owners) or
    `expecting` (on their way to it: a re-homed old owner starts them again), or each
    predecessor of keyed instances the Redirects it took lately (`redirected`), for
    agent.node.rehome.plan_rehome."""
    return {i: stats[key] for i, stats in _reported(me, local, fleet, online, lost)
            if isinstance(stats.get(key), list) and stats[key]}


def lost_intents(me: str, local: Mapping[str, Stats], fleet: Mapping[str, Mapping[str, Any]],
                 online: Mapping[str, bool], lost: str) -> Dict[str, str]:
    """The round each lock-guarded instance last said it had decided and was waiting to start
    (its heartbeat's `lock.intent`, not an adoption; `_reported`), for
    agent.node.rehome.plan_rehome: the decision lived only in the lost incarnation's files."""
    out: Dict[str, str] = {}
    for i, stats in _reported(me, local, fleet, online, lost):
        lock = stats.get("lock")
        if (isinstance(lock, dict) and lock.get("intent") in ("duplicate", "terminate")
                and lock.get("adopting") is None):
            out[i] = str(lock["intent"])
    return out


def plan_inputs(me: str, local: Mapping[str, Stats], fleet: Mapping[str, Mapping[str, Any]],
                online: Mapping[str, bool], lost: str) -> Dict[str, Any]:
    """What the last reports say of the instances around `lost`, as the keyword arguments of
    agent.node.rehome.plan_rehome: `departing`, `idle`, `groups`, `handed`, `expecting`,
    `redirected`, `intents`."""
    view = (me, local, fleet, online)
    return dict(departing=in_state(*view, ("departing", "terminated")), idle=in_state(*view, ("idle",), lost=lost),
                groups=lost_groups(*view, lost), handed=lost_moves(*view, lost, "handed"),
                expecting=lost_moves(*view, lost, "expecting"), redirected=lost_moves(*view, lost, "redirected"),
                intents=lost_intents(*view, lost))


def standby_groups(me: str, lost: str, hosted_by_node: Mapping[str, Any], ours: Mapping[str, Any],
                   fleet: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool]) -> Dict[str, Any]:
    """The key groups the standby copy of each keyed instance of `lost` says it owns, for
    agent.node.rehome.plan_rehome: from the standby its hosted record names, our own copies
    (`ours`: {instance: group runs}) when that is us, else that node's retained state while it is
    online; a value that is not a list of runs is skipped (bus input)."""
    out: Dict[str, Any] = {}
    for s in hosted_by_node.get(lost, ()):
        standby = (s.get("extra") or {}).get("standby")
        if standby == me:
            copies: Any = ours
        elif isinstance(standby, str) and online.get(standby):
            copies = fleet.get(standby, {}).get("standby_groups")
        else:
            continue
        runs = copies.get(str(s["instance"])) if isinstance(copies, dict) else None
        if isinstance(runs, list):
            out[str(s["instance"])] = runs
    return out


def rehomed_here(me: str, floors: Mapping[str, Any], rehomed_by_node: Mapping[str, Mapping[str, float]],
                 online: Mapping[str, bool]) -> Set[str]:
    """Our workers (`floors`: {instance: its spec's `min_epoch`}) started by the latest re-home of
    their identity: the spec's epoch floor (the re-homing agent's wall clock at its plan) is at
    least the time that agent's retained record gives the re-home. Both numbers come from one
    clock, so every node reads the same answer: a copy older than the re-home (the node that came
    back, a second placement of an earlier attempt) has a lower floor and stands down."""
    latest: Dict[str, float] = {}
    for node, record in rehomed_by_node.items():
        if node == me or online.get(node):
            for inst, when in record.items():
                latest[inst] = max(when, latest.get(inst, 0.0))
    return {inst for inst, floor in floors.items()
            if inst in latest and isinstance(floor, int) and floor >= int(latest[inst])}


def taken_over(me: str, rehomed_by_node: Mapping[str, Mapping[str, float]], since: Mapping[str, float]) -> Set[str]:
    """Our hosted instances (`since`: {instance: when this node recorded it as hosted}) that
    another node re-homed after we started hosting them (they may have terminated there since:
    re-adopting them would resurrect a departed instance)."""
    return {inst for node, record in rehomed_by_node.items() if node != me
            for inst, when in record.items() if when > since.get(inst, 0.0) > 0}


def with_plan(record: Dict[str, float], instances: List[str], wall: float) -> Dict[str, float]:
    """This node's re-homed record with `instances` re-homed at `wall`, bounded: the oldest
    entries go first."""
    record.update((inst, wall) for inst in instances)
    for inst in sorted(record, key=record.get)[:-REHOMED_KEPT]:  # type: ignore[arg-type]
        del record[inst]
    return record


class Rehoming:
    """What re-homing remembers between loop turns, and its decisions on it."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.offline_since: Dict[str, float] = {}
        self.online_since: Dict[str, float] = {}  # node -> when we last saw it come online
        self.rehomed: Set[str] = set()  # lost nodes whose instances were planned
        self.claims: Dict[str, float] = {}  # instance -> when we asked for its re-home
        # failed re-homes whose node may come back before the next plan: instance -> (node, spec)
        self.retry: Dict[str, Tuple[str, InstanceSpec]] = {}

    def on_status(self, node: str, up: bool, was_up: bool, now: float) -> None:
        """`node`'s retained status says `up` (it said `was_up` before)."""
        if up and not was_up:
            self.online_since[node] = now
        if up:
            self.offline_since.pop(node, None)
            self.rehomed.discard(node)
        elif node != self.me:
            self.offline_since.setdefault(node, now)

    def drop_claims(self, now: float, ttl: float, listed: Set[str]) -> None:
        """A re-home already asked for (placed, or its createNode() still on its way) stays out of
        the next attempt, which follows a failure of another one: before its node's state lists
        it, planned again it would be placed a second time. A claim lasts until a node lists it
        (`listed`, checked every period: that node may be the next one lost), or `ttl`: as long
        as a createNode() may take plus the state periods its node needs to list it."""
        self.claims = {i: t for i, t in self.claims.items() if i not in listed and now - t < ttl}

    def lost(self, now: float, dead_after: float) -> List[Tuple[str, float]]:
        """(node, offline since) of the nodes offline for `dead_after` whose instances were not
        planned yet, by name."""
        return [(node, since) for node, since in sorted(self.offline_since.items())
                if node not in self.rehomed and now - since >= dead_after]

    def planned(self, node: str) -> None:
        self.rehomed.add(node)

    def claim(self, instance: str, now: float) -> None:
        self.claims[instance] = now

    def failed(self, node: str, spec: InstanceSpec, record: Dict[str, float]) -> bool:
        """The re-home of `spec` (lost with `node`) failed: try it again at the next plan of its
        node while the node is offline, once the node has been back a while otherwise (`retries`).
        Until then our re-homed `record` does not claim it: a returning node would otherwise
        forget an instance that runs nowhere (`taken_over`). True when the record changed."""
        self.rehomed.discard(node)
        self.claims.pop(spec.instance, None)
        if len(self.retry) < REHOMED_KEPT:
            self.retry[spec.instance] = (node, spec)
        return record.pop(spec.instance, None) is not None

    def again(self, spec: InstanceSpec, wall: float, record: Dict[str, float]) -> InstanceSpec:
        """A failed re-home (`retries`) tried again at `wall`: under a new epoch floor, never
        below its old one, which our re-homed `record` gives it too, so that this copy is the one
        that stays (`rehomed_here`)."""
        floor = max(int(spec.extra.get("min_epoch", 0) or 0), int(wall))
        record[spec.instance] = float(floor)
        return dataclasses.replace(spec, extra={**spec.extra, "min_epoch": floor})

    def retries(self, now: float, listed: Set[str], online: Mapping[str, bool],
                settle: float) -> List[Tuple[str, InstanceSpec]]:
        """(node, spec) of the failed re-homes to try again now: of a node back for `settle`
        seconds (its state shows what it re-adopted) that no online node runs (`listed`). One
        that runs somewhere, or whose node is offline again (its next plan takes it), is
        dropped."""
        out = []
        for inst, (node, spec) in sorted(self.retry.items()):
            if inst in listed or not online.get(node):
                del self.retry[inst]
                continue
            if now - self.online_since.get(node, now) < settle:
                continue
            del self.retry[inst]
            out.append((node, spec))
        return out


__all__ = ["REHOMED_KEPT", "Rehoming", "entries_elsewhere", "in_state", "listed_elsewhere", "lost_groups",
           "lost_moves", "plan_inputs", "rehomed_here", "standby_groups", "taken_over", "with_plan"]
