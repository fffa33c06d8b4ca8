"""Lock-guarded scaling (`coordination = "fgme"`): a scaling round runs only inside 2-FGME CSs.

Rules of this file: the scaling core (`agent.protocol.scaling.ScalingCore`) is reused unchanged;
this subclass only decides *when* `start_round` really runs, and carries one 2-FGME node per
boundary. Same sans-IO contract as the core: `handle(message)` / `start_round(decision)` return
the outputs to perform, in order.

Why: neighbouring operators must not scale at the same time (thesis chapter 5), while all the
instances of one operator may. Boundary b sits between operators (stages) b and b+1 and has one
2-FGME lock whose two groups are the instances of stage b and those of stage b+1. An instance
of stage s is a member of lock s-1 (group "upper") and of lock s (group "lower"). It runs a
round only while in the CS of both, acquired in increasing boundary order (s-1, then s), so a
chain of waits always climbs the boundary index and no cycle can form: the holder of the
highest lock in a chain needs nothing more, finishes its round, releases, and so on down.

Membership changes (the thesis assumes fixed groups; ours change). The lock's competitor set of
an instance IS its routing table: its predecessors for lock s-1, its successors for lock s. The
scaling protocol already keeps these tables right, and only a round changes them; a round runs
inside the CS of its initiator's group at both boundaries, hence while no competitor is in the
CS. So:

- Join. Instance c created by X (stage s) is announced to the neighbours by X's Duplication,
  sent while X holds the CS. A neighbour y that processes it adds c to its competitors; if y is
  requesting, it sends c its Req (or puts c in reqs_to_send if it holds its requests), and it
  now also needs c's Ack. c's lock nodes start idle (priority infinity), so they acknowledge at
  once, even before c's Start (an idle 2-FGME node needs no knowledge of its competitors to
  acknowledge: the sender is added lazily). y still needs X's Ack, which X gives only when it
  leaves, so y cannot enter while X's round runs. c requests a lock only once active, i.e. after
  every neighbour processed X's Duplication (the Start follows all the acks), so its competitors
  always know it.
- Leave. Instance z (stage s) terminates in a deletion round, hence inside the CS. A neighbour y
  removes z from its table when it processes z's Deletion; at that moment z is in the CS. y
  marks z *leaving*: it never sends z anything again (z would be gone when it arrives), it drops
  any Ack of z it counted, and it keeps z among the competitors it must hear from. z leaves the
  CS after its round (after its Terminate) and sends its Ack(end)/End as usual: by FIFO that
  message reaches y after z's Deletion. When y processes it, z's permission is replaced by its
  exit: y removes z from its competitors and re-checks its entry condition. A leaving node can
  send nothing else first (a node in the CS only queues Reqs, lines 20 and 42).

So at every boundary the set of nodes y waits for always contains every node that may be in the
CS of the other group, which is what 2-FGME's safety argument needs; `agent.sim.guarded_check`
checks the resulting property (no two neighbouring operators in a round at once, no lost
records, every intent served) over random and exhaustive schedules.

A decision taken while an earlier one still waits for its locks is dropped (the first intent
is served first; the policy decides again at its next period).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Set, Tuple

from agent.policy.decentralized import Action, Decision
from agent.protocol.gme_base import Entered, GmeMessage, GmeState
from agent.protocol.gme_base import Send as GmeSend
from agent.protocol.gme_fgme import Ack, End, FgmeNode
from agent.protocol.messages import Message
from agent.protocol.scaling import InstanceState, Output, ScalingCore, Send

__all__ = ["LockMessage", "MemberFgmeNode", "GuardedCore", "COORDINATION_MODES", "core_class"]

COORDINATION_MODES = ("ack", "fgme")


@dataclass(frozen=True)
class LockMessage:
    """A 2-FGME message of boundary `boundary`, carried on the instances' FIFO inbox channel.

    It shares the channel with the scaling messages on purpose: the membership argument above
    relies on FIFO order between a Deletion and the lock exit message that follows it.
    """

    type: ClassVar[str] = "lock"
    sender: str
    boundary: int
    inner: GmeMessage


class MemberFgmeNode(FgmeNode):
    """A 2-FGME node whose competitor set follows a routing table (join / leave, see above)."""

    def __init__(self, node_id: str, lower: bool, competitors: Sequence[str] = ()) -> None:
        groups: Dict[Any, int] = {node_id: 0 if lower else 1}
        super().__init__(node_id, groups)  # type: ignore[arg-type]
        self.competitors = frozenset(competitors)
        self._sorted_competitors = tuple(sorted(self.competitors))
        self.leaving: Set[str] = set()  # competitors in their last CS: wait for their exit
        self.gone: Set[str] = set()  # never send to these again (ids are never reused)

    # -- membership -------------------------------------------------------------------------------

    def sync(self, table: Set[str]) -> List[Any]:
        """Make the competitor set follow `table`: new ids join, missing ones start leaving."""
        out: List[Any] = []
        for k in sorted(table - self.competitors - self.gone):
            out += self._join(k)
        for k in sorted(self.competitors - table - self.leaving):
            self.leaving.add(k)
            self.gone.add(k)
            self.acks_rcvd.discard(k)  # its exit message will stand for its permission
        return out

    def _join(self, k: str) -> List[Any]:
        self.competitors = self.competitors | {k}
        self._sorted_competitors = tuple(sorted(self.competitors))
        if self.state is not GmeState.REQUESTING:
            return []
        if self.competitors_authorized:
            self.reqs_to_send.add(k)  # sent when the authorization ends (line 14's rule)
            return []
        return self._multicast_req([k])

    def _drop(self, k: str) -> List[Any]:
        """k left the CS for good: its exit replaced its permission."""
        self.leaving.discard(k)
        self.competitors = self.competitors - {k}
        self._sorted_competitors = tuple(sorted(self.competitors))
        self.acks_rcvd.discard(k)
        self.reqs_to_send.discard(k)
        self.waiting_reqs.pop(k, None)
        self.acks_to_ign.pop(k, None)
        self.sent_epoch.pop(k, None)
        if self.state is GmeState.REQUESTING and self.acks_rcvd >= self.competitors:
            return self._enter()
        return []

    # -- driver API -------------------------------------------------------------------------------

    def _filter(self, outs: List[Any]) -> List[Any]:
        gone = self.gone
        return [o for o in outs if not (type(o) is GmeSend and o.to in gone)]

    def request(self) -> List[Any]:
        return self._filter(super().request())

    def exit(self) -> List[Any]:
        return self._filter(super().exit())

    def receive(self, message: GmeMessage) -> List[Any]:
        j = message.sender
        if j not in self.competitors:
            if j in self.gone:  # pragma: no cover - excluded by the argument; kept loud
                raise ValueError(f"lock node {self.id}: {message!r} from departed {j}")
            out = self._join(j)  # lazily: an idle new instance learns its neighbours at Start
        else:
            out = []
        out += super().receive(message)
        if j in self.leaving and (type(message) is End or (type(message) is Ack and message.end)):
            out += self._drop(j)
        return self._filter(out)

    def snapshot(self) -> Tuple[object, ...]:
        return super().snapshot() + (
            tuple(sorted(self.competitors)), tuple(sorted(self.leaving)), tuple(sorted(self.gone)),
        )


class GuardedCore(ScalingCore):
    """A ScalingCore whose rounds run inside the 2-FGME CSs of its two boundaries.

    `start_round(decision)` records the intent and requests the lower boundary's lock; the
    round starts when the last lock is held; both are released when the round is over
    (ACTIVE again, or TERMINATED).
    """

    coordination: ClassVar[str] = "fgme"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s = self.stage
        self.locks: Dict[int, MemberFgmeNode] = {
            s - 1: MemberFgmeNode(self.instance_id, lower=False),
            s: MemberFgmeNode(self.instance_id, lower=True),
        }
        self.intent: Optional[Decision] = None
        self.holding: Tuple[int, ...] = ()  # boundaries whose CS we are in, in acquisition order
        self.guarded_round = False  # a round we started under the locks is running
        if self.state is not InstanceState.IDLE:
            self._sync()

    # -- the lock seam ----------------------------------------------------------------------------

    def _needed(self) -> List[int]:
        """Boundaries to hold, in the global order: below (if any operator below), then above."""
        s = self.stage
        need = []
        if s > 0:
            need.append(s - 1)
        if self.succs:
            need.append(s)
        return need

    def start_round(self, decision: Decision, new_ids: Optional[Sequence[str]] = None) -> List[Output]:
        if decision.action is Action.NONE or self.intent is not None:
            return []
        self._require_idle_active("start a round")
        self.intent = decision
        return self._acquire_next()

    def _acquire_next(self) -> List[Output]:
        for b in self._needed():
            if b not in self.holding:
                return self._lock_out(b, self.locks[b].request())
        # every lock held: run the round now
        decision, self.intent = self.intent, None
        assert decision is not None
        self.guarded_round = True
        out = list(ScalingCore.start_round(self, decision))
        out += self._after_core()
        return out

    def _lock_out(self, b: int, outs: List[Any]) -> List[Output]:
        """Wrap a lock node's outputs; an Entered continues the acquisition."""
        out: List[Output] = []
        entered = False
        for o in outs:
            if type(o) is GmeSend:
                out.append(Send(o.to, LockMessage(self.instance_id, b, o.message)))
            elif isinstance(o, Entered):
                entered = True
        if entered:
            self.holding = self.holding + (b,)
            out += self._acquire_next()
        return out

    def _after_core(self) -> List[Output]:
        """After the core moved: follow the tables, release the locks when our round ended."""
        out = self._sync()
        if self.guarded_round and not self.in_round:
            self.guarded_round = False
            held, self.holding = self.holding, ()
            for b in held:
                out += self._lock_out(b, self.locks[b].exit())
        return out

    def _sync(self) -> List[Output]:
        if self.state is InstanceState.IDLE:
            return []  # tables unknown until Start; lock nodes answer lazily meanwhile
        out: List[Output] = []
        s = self.stage
        for b, table in ((s - 1, self.preds), (s, self.succs)):
            out += self._lock_out(b, self.locks[b].sync(set(table)))
        return out

    # -- messages ---------------------------------------------------------------------------------

    def handle(self, message: Message) -> List[Output]:  # type: ignore[override]
        if type(message) is LockMessage:
            lm: LockMessage = message  # type: ignore[assignment]
            node = self.locks.get(lm.boundary)
            if node is None:
                from agent.protocol.errors import RemoteProtocolError

                raise RemoteProtocolError(
                    f"{self.instance_id} (stage {self.stage}): lock message for boundary "
                    f"{lm.boundary}, expected {sorted(self.locks)}"
                )
            return self._lock_out(lm.boundary, node.receive(lm.inner))
        out = list(super().handle(message))
        out += self._after_core()
        return out

    # -- checker support --------------------------------------------------------------------------

    @property
    def lock_busy(self) -> bool:
        """Waiting for or holding a lock (a terminal state with this is an unserved intent)."""
        return self.intent is not None or bool(self.holding) or any(
            n.state is not GmeState.IDLE for n in self.locks.values()
        )

    def clone(self) -> "GuardedCore":
        new = super().clone()
        new.locks = {b: _clone_lock(n) for b, n in self.locks.items()}  # type: ignore[attr-defined]
        return new  # type: ignore[return-value]

    def key(self) -> Tuple[Any, ...]:
        return super().key() + (
            self.intent, self.holding, self.guarded_round,
            tuple((b, n.snapshot()) for b, n in sorted(self.locks.items())),
        )


def _clone_lock(node: MemberFgmeNode) -> MemberFgmeNode:
    new = copy.copy(node)
    for k, v in node.__dict__.items():
        if isinstance(v, (set, dict, list)):
            setattr(new, k, copy.copy(v))
    return new


def core_class(coordination: str) -> type:
    """The core class for a `coordination` setting: "ack" (paper) or "fgme" (lock-guarded)."""
    if coordination == "ack":
        return ScalingCore
    if coordination == "fgme":
        return GuardedCore
    raise ValueError(f"coordination: expected one of {COORDINATION_MODES}, found {coordination!r}")

