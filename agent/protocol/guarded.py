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
CS of the other group, which is what 2-FGME's safety argument needs; `foglab.sim.guarded_check`
checks the resulting property (no two neighbouring operators in a round at once, no lost
records, every intent served) over random and exhaustive schedules.

A decision taken while an earlier one still waits for its locks is dropped (the first intent
is served first; the policy decides again at its next period).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from agent.policy.decentralized import Action, Decision
from agent.protocol.errors import LocalProtocolError, RemoteProtocolError
from agent.protocol.gme_base import INF, Entered, GmeMessage, GmeState
from agent.protocol.gme_base import Send as GmeSend
from agent.protocol.gme_base import message_from_dict as gme_message_from_dict
from agent.protocol.gme_fgme import DAMPING_DEFAULT, Ack, End, FgmeNode
from agent.protocol.messages import Message
from agent.protocol.messages import from_dict as scaling_from_dict
from agent.protocol.scaling import InstanceState, Output, ScalingCore, Send

__all__ = ["LockMessage", "MemberFgmeNode", "GuardedCore", "DampedGuardedCore", "PublishedGuardedCore",
           "COORDINATION_MODES", "core_class", "message_from_dict"]

COORDINATION_MODES = ("ack", "fgme")
DAMPED_DEFAULT = DAMPING_DEFAULT  # GuardedCore's lock nodes: DEVIATION 4 (docs/gme.md)


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

    def to_dict(self) -> Dict[str, Any]:
        """JSON-friendly; the inner 2-FGME message keeps its own `kind` (req / ack / end)."""
        return {"type": self.type, "sender": self.sender, "boundary": self.boundary, "inner": self.inner.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> "LockMessage":
        """Decode untrusted input; any defect raises `RemoteProtocolError` (never TypeError later
        in the core: the fields a 2-FGME node compares are type-checked here)."""
        if not isinstance(data, Mapping) or data.get("type") != cls.type:
            raise RemoteProtocolError(f"lock message: expected an object with type 'lock', found {_short(data)}")
        extra = sorted(str(k) for k in data if k not in ("type", "sender", "boundary", "inner"))
        sender, boundary, inner = data.get("sender"), data.get("boundary"), data.get("inner")
        if extra or not isinstance(sender, str) or not sender or not _is_int(boundary) or not isinstance(inner, Mapping):
            raise RemoteProtocolError(
                f"lock message: expected sender (str), boundary (int), inner (object), found {_short(data)}"
            )
        if inner.get("sender") != sender:
            raise RemoteProtocolError(f"lock message from {sender}: inner sender {_short(inner.get('sender'))} differs")
        kind = inner.get("kind")
        types = _INNER_FIELDS.get(kind) if isinstance(kind, str) else None
        if types is None:
            raise RemoteProtocolError(f"lock message from {sender}: unknown 2-FGME kind {_short(kind)}, expected req, ack or end")
        for name, check in types.items():
            if name in inner and not check(inner[name]):
                raise RemoteProtocolError(f"lock message from {sender}: {kind}.{name} = {_short(inner[name])} has the wrong type")
        unknown = sorted(str(k) for k in inner if k not in types and k not in ("kind", "sender"))
        if unknown:
            raise RemoteProtocolError(f"lock message from {sender}: {kind} with unknown fields {unknown}")
        return cls(sender, int(boundary), gme_message_from_dict(inner, "gme_fgme"))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


_INNER_FIELDS: Dict[str, Dict[str, Any]] = {
    "req": {"clock": lambda v: _is_int(v) and v >= 0, "epoch": lambda v: _is_int(v) and v >= 0},
    "ack": {"renew": lambda v: isinstance(v, bool), "end": lambda v: isinstance(v, bool),
            "epoch": lambda v: _is_int(v) and v >= 0},
    "end": {"clock": lambda v: _is_int(v) and v >= 0},
}


def message_from_dict(data: Any) -> Any:
    """A message of the guarded inbox: a `LockMessage` (type "lock") or a scaling message."""
    if isinstance(data, Mapping) and data.get("type") == LockMessage.type:
        return LockMessage.from_dict(data)
    return scaling_from_dict(data)


class MemberFgmeNode(FgmeNode):
    """A 2-FGME node whose competitor set follows a routing table (join / leave, see above)."""

    def __init__(self, node_id: str, lower: bool, competitors: Sequence[str] = (), damped: bool = False) -> None:
        groups: Dict[Any, int] = {node_id: 0 if lower else 1}
        super().__init__(node_id, groups)  # type: ignore[arg-type]
        self.damped = damped  # DEVIATION 4 (gme_fgme.py) for this node; see GuardedCore.damped
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
        if j == self.id:
            # Hostile input: joining ourselves as a competitor would make us answer ourselves.
            raise RemoteProtocolError(f"lock node {self.id}: {message!r} names us as its sender")
        if j not in self.competitors:
            if j in self.gone:  # excluded by the argument above, so a peer's bug or a forgery
                raise RemoteProtocolError(f"lock node {self.id}: {message!r} from departed {j}")
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

    # -- persistence (worker restart) -------------------------------------------------------------

    def dump(self) -> Dict[str, Any]:
        """JSON-friendly copy of every field a restarted worker needs (`load` inverts it)."""
        return {
            "lower": self.group == 0, "state": self.state.value, "entries": self.entries,
            "req_clock": None if self.req_clock == INF else int(self.req_clock), "lc": self.lc,
            "waiting_reqs": sorted(self.waiting_reqs.items()), "reqs_to_send": sorted(self.reqs_to_send),
            "acks_to_ign": sorted(self.acks_to_ign.items()), "epoch": self.epoch,
            "sent_epoch": sorted(self.sent_epoch.items()), "req_first_epoch": self.req_first_epoch,
            "competitors_authorized": self.competitors_authorized, "acks_rcvd": sorted(self.acks_rcvd),
            "competitors": sorted(self.competitors), "leaving": sorted(self.leaving), "gone": sorted(self.gone),
            "damped": self.damped, "authorized_for": sorted(self.authorized_for),
        }

    @classmethod
    def load(cls, node_id: str, d: Mapping[str, Any], damped: bool = False) -> "MemberFgmeNode":
        """Inverse of `dump`; `damped` for a dump written before the flag was persisted, i.e.
        before the damped variant existed (published: its `authorized_for` was never written)."""
        node = cls(node_id, lower=bool(d["lower"]), competitors=d["competitors"], damped=bool(d.get("damped", damped)))
        node.authorized_for = frozenset(str(k) for k in d.get("authorized_for", ()))
        node.state = GmeState(d["state"])
        node.entries = int(d["entries"])
        node.req_clock = INF if d["req_clock"] is None else int(d["req_clock"])
        node.lc = int(d["lc"])
        node.waiting_reqs = {str(k): int(e) for k, e in d["waiting_reqs"]}
        node.reqs_to_send = set(d["reqs_to_send"])
        node.acks_to_ign = {str(k): int(e) for k, e in d["acks_to_ign"]}
        node.epoch = int(d["epoch"])
        node.sent_epoch = {str(k): int(e) for k, e in d["sent_epoch"]}
        node.req_first_epoch = int(d["req_first_epoch"])
        node.competitors_authorized = bool(d["competitors_authorized"])
        node.acks_rcvd = set(d["acks_rcvd"])
        node.leaving = set(d["leaving"])
        node.gone = set(d["gone"])
        return node


class GuardedCore(ScalingCore):
    """A ScalingCore whose rounds run inside the 2-FGME CSs of its two boundaries.

    `start_round(decision)` records the intent and requests the lower boundary's lock; the
    round starts when the last lock is held; both are released when the round is over
    (ACTIVE again, or TERMINATED).
    """

    coordination: ClassVar[str] = "fgme"
    # DEVIATION 4 (damping, gme_fgme.py) in the lock nodes this core creates; see docs/gme.md
    # "Damping in lock-guarded scaling" for the measurement behind the default
    damped: ClassVar[bool] = DAMPED_DEFAULT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s = self.stage
        self.locks: Dict[int, MemberFgmeNode] = {
            s - 1: MemberFgmeNode(self.instance_id, lower=False, damped=self.damped),
            s: MemberFgmeNode(self.instance_id, lower=True, damped=self.damped),
        }
        self.intent: Optional[Decision] = None
        self.adopting: Optional[str] = None  # the intent adopts this copy (ScalingCore.adopt)
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

    def adopt(self, copy_id: str) -> List[Output]:
        """Inside the locks like any other round: a duplication of one, of this existing copy."""
        if self.intent is not None:
            return []
        self._require_idle_active("adopt a copy")
        self.intent = Decision(Action.DUPLICATE, 1)
        self.adopting = copy_id
        return self._acquire_next()

    def _acquire_next(self) -> List[Output]:
        for b in self._needed():
            if b not in self.holding:
                return self._lock_out(b, self.locks[b].request())
        # every lock held: run the round now
        decision, self.intent = self.intent, None
        copy_id, self.adopting = self.adopting, None
        assert decision is not None
        self.guarded_round = True
        out = list(ScalingCore.adopt(self, copy_id) if copy_id else ScalingCore.start_round(self, decision))
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

    def cancel_duplication(self, created: Sequence[str] = ()) -> List[Output]:
        """The core's cancel, then release the locks if that ended the round (a withdrawn round
        ends with no message; without this its locks would stay held and block the neighbours)."""
        out = list(super().cancel_duplication(created))
        out += self._after_core()
        return out

    # -- messages ---------------------------------------------------------------------------------

    def handle(self, message: Message) -> List[Output]:  # type: ignore[override]
        if self.state is InstanceState.TERMINATED:  # as ScalingCore.handle, for lock messages too
            raise RemoteProtocolError(f"{self.instance_id}: received {type(message).__name__} after termination")
        if type(message) is LockMessage:
            lm: LockMessage = message  # type: ignore[assignment]
            node = self.locks.get(lm.boundary)
            if node is None:
                raise RemoteProtocolError(
                    f"{self.instance_id} (stage {self.stage}): lock message for boundary "
                    f"{lm.boundary}, expected {sorted(self.locks)}"
                )
            return self._lock_out(lm.boundary, node.receive(lm.inner))
        out = list(super().handle(message))
        out += self._after_core()
        return out

    # -- observability ----------------------------------------------------------------------------

    @property
    def lock_state(self) -> GmeState:
        """The instance's lock state as a whole: IN_CS while its guarded round may run (every lock
        it needs is held), REQUESTING while an intent waits for locks, else IDLE."""
        if self.guarded_round:
            return GmeState.IN_CS
        if self.intent is not None:
            return GmeState.REQUESTING
        return GmeState.IDLE

    def lock_states(self) -> Dict[int, GmeState]:
        """Per boundary index: the 2-FGME node's own state (a node may hold one, want the next)."""
        return {b: n.state for b, n in sorted(self.locks.items())}

    # -- persistence ------------------------------------------------------------------------------

    def snapshot(self) -> Dict[str, Any]:
        """The scaling core's snapshot plus the lock state (JSON-friendly, for a worker restart)."""
        data = super().snapshot()
        intent = self.intent
        data["fgme"] = {
            "intent": None if intent is None else [intent.action.value, intent.count, intent.factor],
            "adopting": self.adopting, "holding": list(self.holding), "guarded_round": self.guarded_round,
            "locks": {str(b): n.dump() for b, n in sorted(self.locks.items())},
        }
        return data

    @classmethod
    def restore(cls, data: Dict[str, Any], params: Any, **kwargs: Any) -> "GuardedCore":
        """Inverse of `snapshot`. A snapshot without lock state (written by an "ack" core, i.e.
        the coordination setting changed) restores idle locks synced to the tables."""
        core = super().restore(data, params, **kwargs)
        assert isinstance(core, GuardedCore)
        g = data.get("fgme")
        if g is None:
            return core
        try:
            from agent.policy.decentralized import Action

            it = g["intent"]
            core.intent = None if it is None else Decision(Action(it[0]), int(it[1]), float(it[2]))
            core.adopting = None if g.get("adopting") is None else str(g["adopting"])
            core.holding = tuple(int(b) for b in g["holding"])
            core.guarded_round = bool(g["guarded_round"])
            # a lock node keeps the variant it was created with; a dump without the flag predates
            # the damped variant (the flag came with it), so it was published whatever the default
            core.locks = {int(b): MemberFgmeNode.load(core.instance_id, d, False) for b, d in g["locks"].items()}
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise LocalProtocolError(f"snapshot: cannot restore the lock state ({exc!r})") from None
        return core

    # -- checker support --------------------------------------------------------------------------

    def departed(self, peer: str) -> bool:
        """`peer` left for good: a lock node dropped it after its exit (ids are never reused).
        The driver then closes its channels to `peer` (agent.instance.recovery.ReliableLinks)."""
        return any(peer in n.gone and peer not in n.competitors for n in self.locks.values())

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
            self.intent, self.adopting, self.holding, self.guarded_round,
            tuple((b, n.snapshot()) for b, n in sorted(self.locks.items())),
        )


def _clone_lock(node: MemberFgmeNode) -> MemberFgmeNode:
    new = copy.copy(node)
    for k, v in node.__dict__.items():
        if isinstance(v, (set, dict, list)):
            setattr(new, k, copy.copy(v))
    return new


class DampedGuardedCore(GuardedCore):
    """GuardedCore whose lock nodes use DEVIATION 4 (`[pipeline] fgme_damping = true`)."""

    damped: ClassVar[bool] = True


class PublishedGuardedCore(GuardedCore):
    """GuardedCore whose lock nodes use the published line 79 (`fgme_damping = false`)."""

    damped: ClassVar[bool] = False


def core_class(coordination: str, damped: Optional[bool] = None) -> type:
    """The core class for a `coordination` setting: "ack" (paper) or "fgme" (lock-guarded);
    `damped` chooses the lock nodes' variant (None: GuardedCore's default)."""
    if coordination == "ack":
        return ScalingCore
    if coordination == "fgme":
        if damped is None:
            return GuardedCore
        return DampedGuardedCore if damped else PublishedGuardedCore
    raise ValueError(f"coordination: expected one of {COORDINATION_MODES}, found {coordination!r}")

