"""After a (re)connect: which of our instances another node now runs (fenced), what the first
connect re-adopts, and when a worker that lost its connection may reconnect (the daemon's fencing).

Rules of this file: no I/O, no clock, no reference to the daemon. The daemon (agent.node.reconcile,
agent.node.workerlines) reports its start (`started`, with what the previous incarnation hosted),
each connect (`connected`) and each worker's ask to reconnect (`asked`); once per loop turn it asks
whether the reconcile is due (`reconcile_due`) and which workers may reconnect (`grants`); when the
reconcile is due it hands over what it reads of the fleet (`Facts`) and carries out the answer
(`Reconcile`: kill and forget the fenced workers, forget the stored specs, re-adopt); a reaped
worker is reported (`gone`), which says whether it was fenced (then it never starts here again:
agent.node.restarts.exit_of).

The rules, and why:
- The reconcile runs READOPT_SETTLE seconds after a connect, once the retained records are in
  and not while the agent stops: before that, who runs what elsewhere is not known.
- An instance that another online node lists, or that another node re-homed after we started
  hosting it, runs elsewhere: our copy is killed and forgotten, so that one identity never runs
  twice (docs/design.md invariant 7). Except the copy the latest re-home started (its spec's
  epoch floor, agent.node.rehoming.rehomed_here): when two nodes both ran an identity while the
  broker was away, both would stop theirs, and it would run nowhere (CHANGELOG.md, "Two nodes
  ran, then both fenced, one copy").
- Only a worker started before this connect is fenced: one started since was placed here by a
  createNode() that saw the fleet as it is (a drain's hand-over, a re-home), while the retained
  state of the node it comes from may still list it for a moment.
- Re-adoption happens once, at the first reconcile, and only of what the previous incarnation
  hosted and is still stored (an instance started and stopped before it must not come back), not
  running, and not ruled out by its pipeline's record (an undeploy while we were away).
- A worker's ask to reconnect is granted once a PUBACK newer than the ask came back and no
  reconcile is pending: if our connection survived the worker's outage, the broker never fired
  our Will and nobody re-homed our instances; if it did not, we reconnected, and the reconcile
  (with the retained re-homing records in) has fenced every instance that runs elsewhere, which
  then asks no more. An ask of a worker that left or was fenced is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from agent.control import records
from agent.instance.spec import InstanceSpec
from agent.node import rehoming

READOPT_SETTLE = 1.0  # seconds after connecting before re-adopting, and not before the sync marker came back


@dataclass(frozen=True)
class Running:
    """One of our workers as the reconcile reads it: when it started (the daemon's clock) and its
    spec's epoch floor (`min_epoch`, None without one)."""

    started_at: float
    min_epoch: Any = None


@dataclass(frozen=True)
class Facts:
    """What the daemon reads for a reconcile: our workers, the instances stored as hosted here
    (`stored`; `since`: when this node recorded each instance of `rehomed_by_others` as hosted, 0
    when it does not), and the retained records of the fleet."""

    running: Mapping[str, Running]
    stored: AbstractSet[str]
    since: Mapping[str, float]
    fleet: Mapping[str, Mapping[str, Any]]
    online: Mapping[str, bool]
    rehomed_by_node: Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class Reconcile:
    """The reconcile's answer: `fence`, our workers to kill and forget (sorted); `forget`, stored
    specs of instances that run elsewhere and not here; `readopt`: re-adopt now (the first one)."""

    fence: Tuple[str, ...] = ()
    forget: Tuple[str, ...] = ()
    readopt: bool = False


@dataclass(frozen=True)
class Readopt:
    """What to re-adopt: `adopt`, the stored specs to admit and start again; `stale`, (spec, why)
    of those whose pipeline's record rules them out (to forget)."""

    adopt: Tuple[InstanceSpec, ...] = ()
    stale: Tuple[Tuple[InstanceSpec, str], ...] = ()


@dataclass
class Fencing:
    node: str
    reconcile_at: Optional[float] = None  # when the reconcile of the last connect is due; None: done
    connected_at: float = 0.0  # the last connect: workers started before it may be fenced
    asks: Dict[str, float] = field(default_factory=dict)  # worker -> when it asked to reconnect
    fenced: Set[str] = field(default_factory=set)  # killed because another node runs them
    to_readopt: List[InstanceSpec] = field(default_factory=list)  # hosted when this agent started
    readopted: bool = False

    def started(self, stored: Sequence[InstanceSpec]) -> None:
        """The agent starts: `stored`, what its previous incarnation hosted, read before this one
        starts anything; only these are re-adopted."""
        self.to_readopt = list(stored)

    def connected(self, now: float) -> None:
        """A (re)connect at `now`: a reconcile is due READOPT_SETTLE seconds later."""
        self.reconcile_at = now + READOPT_SETTLE
        self.connected_at = now

    def asked(self, instance: str, now: float) -> None:
        """`instance` asked to reconnect at `now` (its first ask counts)."""
        self.asks.setdefault(instance, now)

    def reconcile_due(self, now: float, retained_in: bool, stopping: bool) -> bool:
        """True (once per connect): reconcile now."""
        if self.reconcile_at is None or now < self.reconcile_at or not retained_in or stopping:
            return False
        self.reconcile_at = None
        return True

    def reconcile(self, facts: Facts) -> Reconcile:
        """Which of our instances run elsewhere now, and whether to re-adopt (module doc)."""
        floors = {i: r.min_epoch for i, r in facts.running.items()}
        elsewhere = ((rehoming.listed_elsewhere(self.node, facts.fleet, facts.online)
                      | rehoming.taken_over(self.node, facts.rehomed_by_node, facts.since))
                     - rehoming.rehomed_here(self.node, floors, facts.rehomed_by_node, facts.online))
        before = {i for i, r in facts.running.items() if r.started_at < self.connected_at}
        fence = tuple(sorted(elsewhere & before))
        self.fenced.update(fence)
        forget = tuple(sorted(i for i in facts.stored if i in elsewhere and i not in facts.running))
        readopt = not self.readopted
        self.readopted = True
        return Reconcile(fence, forget, readopt)

    def readopt(self, running: AbstractSet[str], stored: AbstractSet[str],
                pipeline_records: Mapping[str, Any]) -> Readopt:
        """The specs of the previous incarnation to start again: still stored (not forgotten
        since), not running; those their pipeline's record rules out are stale."""
        adopt: List[InstanceSpec] = []
        stale: List[Tuple[InstanceSpec, str]] = []
        for spec in self.to_readopt:
            if spec.instance in running or spec.instance not in stored:
                continue
            why = records.stale_reason(records.spec_generation(spec), pipeline_records.get(spec.pipeline))
            if why:
                stale.append((spec, why))
            else:
                adopt.append(spec)
        return Readopt(tuple(adopt), tuple(stale))

    def grants(self, running: AbstractSet[str], connected: bool, last_puback: float) -> List[str]:
        """The workers to tell "reconnect" now (module doc); their asks are done."""
        if not self.asks or not connected or self.reconcile_at is not None:
            return []
        out: List[str] = []
        for inst, asked in list(self.asks.items()):
            if inst not in running or inst in self.fenced:
                del self.asks[inst]
            elif last_puback > asked:
                del self.asks[inst]
                out.append(inst)
        return out

    def gone(self, instance: str) -> bool:
        """Our worker of `instance` was reaped: True if it was fenced (never restarted here)."""
        fenced = instance in self.fenced
        self.fenced.discard(instance)
        return fenced


def rehomed_by_others(node: str, rehomed_by_node: Mapping[str, Mapping[str, float]]) -> Set[str]:
    """The instances another node's re-homed record names."""
    return {i for n, record in rehomed_by_node.items() if n != node for i in record}


__all__ = ["READOPT_SETTLE", "Facts", "Fencing", "Readopt", "Reconcile", "Running", "rehomed_by_others"]
