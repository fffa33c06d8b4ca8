"""Per-instance state machine of the decentralized scaling protocol (Belkhiria & Tedeschi).

Rules of this file: everything that changes an instance's routing tables or its scaling state
lives here; no I/O, no clock, no global random. A driver (the simulator in `foglab.sim`, the
worker process, `agent.instance.worker`) feeds the core and performs what it returns.

API
---
    core = ScalingCore.initial("validate-0", "validate", stage=1, params=ScalingParams(),
                               succs=("in_zone-0",), preds=("source-0",), keeper=True)
    outs = core.tick(load=412.0, draw=rng.random())     # periodic decision (Algorithm 11)
    outs = core.handle(message)                         # one protocol message (Algorithms 5-10)
    new  = ScalingCore.from_create(effect, params)      # a CreateInstance effect -> idle core
    data = core.snapshot(); core2 = ScalingCore.restore(data, params)   # crash recovery

    decision = core.decide(load, draw)                  # seam for lock-guarded scaling (2-FGME):
    outs = core.start_round(decision)                   #   decide now, start the round later
    outs = core.cancel_duplication(created=())          # createNode() failed: withdraw the round
    outs = core.adopt(copy_id)                          # start an orphaned idle copy (re-homing)
    extra = core.widen_round(neighbour)                 # resend on silence: who else must hear it

`handle` and `tick` return a list of outputs, in the order they must be performed:

- `Send(dest, message)`: put `message` on the FIFO channel to instance `dest`.
- `CreateInstance(instance_id, operator, stage, creator)`: the paper's createNode(). The new
  instance must exist and be subscribed to its inbox before the sends that follow it
  (docs/design.md invariant 2, "subscribe before announce").
- `Activate(succs, preds)`: a new instance got its Start: begin processing with these tables.
- `RoutesChanged(succs, preds)`: the full new routing tables of this instance.
- `Drain()`: two-phase deletion only: every predecessor has acknowledged our deletion, so no
  more input will arrive: process and forward everything received before continuing.
- `Terminate(instance_id)`: all deletion acks arrived and the input is drained: exit.

ORDERING CONTRACT: the driver performs outputs in list order and finishes each effect before
performing the next output. In particular `RoutesChanged` precedes the ack it enables (invariant 3
"route change before ack": the data path must use the new table before the ack is sent), `Drain`
precedes the deletion messages to successors, and `Terminate` is only ever emitted after the last
deletion ack (invariant 4 "drain before exit").

Errors: a message the protocol does not expect in the current state (an ack nobody waits for, a
Start to an active instance, a message from a non-neighbouring stage, anything to a terminated
instance) raises `RemoteProtocolError`; misuse by the driver (starting a round while one runs)
raises `LocalProtocolError`. Either way the state is unchanged.

Deviations from the paper, and why (see docs/scaling.md):
1. Senders are classified as successor/predecessor by the stage carried in every message, not by
   table membership (an idle new instance has empty tables and could not classify them).
2. Acks are matched by (round, sender) instead of a bare counter, so a late or duplicated ack is
   detected instead of completing a round early.
3. Deletion is two-phase by default (`DeletionMode.TWO_PHASE`): first the predecessors (input
   closes), then drain, then the successors. Same message count 2(|succs|+|preds|). The paper's
   one-phase deletion (`DeletionMode.PAPER`) lets a successor S that already removed us from its
   preds terminate without telling us while we still flush records to it (a sequential del/del
   case the paper does not discuss); the interleaving checker finds that loss.
4. A duplication creates n >= 1 copies (Algorithm 4 tests n > 1, which never creates one copy).
5. A round message the driver sends again after a silence also goes to the copies the silent
   neighbour announced before it acked (`widen_round`): a lost message broke the FIFO order the
   paper's argument for concurrent rounds needs. No extra message without a loss.
6. At that resend a pending neighbour whose Deletion we applied in the round is not waited for
   any more (`release`): after a loss it may have left without answering.
7. A neighbour whose Deletion we apply in our duplication round after it acked the round knows
   our copies and sends them its Deletion too: the copies' Start keeps it in their tables
   (`leavers`), so that they cannot leave without telling it (it would wait for their ack for
   ever). No extra message.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from agent.policy.decentralized import NO_DECISION, Action, Decision, ScalingParams, decide
from agent.protocol.errors import LocalProtocolError, RemoteProtocolError
from agent.protocol.messages import (
    Deletion,
    DeletionAck,
    Duplication,
    DuplicationAck,
    Message,
    Start,
)

__all__ = [
    "InstanceState",
    "DeletionMode",
    "Send",
    "Effect",
    "CreateInstance",
    "Activate",
    "RoutesChanged",
    "Drain",
    "Terminate",
    "Output",
    "ScalingCore",
]

Ids = Tuple[str, ...]


class InstanceState(Enum):
    IDLE = "idle"  # created, waiting for Start (the paper's !isActive)
    ACTIVE = "active"
    DUPLICATING = "duplicating"  # waiting for duplication acks
    DELETING = "deleting"  # waiting for deletion acks (from preds only, in TWO_PHASE mode)
    DEPARTING = "departing"  # TWO_PHASE: input drained, waiting for the successors' acks
    TERMINATED = "terminated"


class DeletionMode(Enum):
    TWO_PHASE = "two_phase"
    PAPER = "paper"


# States whose data path forwards records (so whose succs must never name a terminated instance).
FORWARDING = frozenset({InstanceState.ACTIVE, InstanceState.DUPLICATING, InstanceState.DELETING})


@dataclass(frozen=True)
class Send:
    dest: str
    message: Message


class Effect:
    """Base class of the effects a driver performs locally."""

    __slots__ = ()


@dataclass(frozen=True)
class CreateInstance(Effect):
    instance_id: str
    operator: str
    stage: int
    creator: str


@dataclass(frozen=True)
class Activate(Effect):
    succs: Ids
    preds: Ids


@dataclass(frozen=True)
class RoutesChanged(Effect):
    succs: Ids
    preds: Ids


@dataclass(frozen=True)
class Drain(Effect):
    pass


@dataclass(frozen=True)
class Terminate(Effect):
    instance_id: str


Output = Union[Send, Effect]

_SUCC, _PRED = "succ", "pred"


class ScalingCore:
    """One operator instance's view of the pipeline and its scaling round (if any)."""

    def __init__(
        self,
        instance_id: str,
        operator: str,
        stage: int,
        params: ScalingParams,
        *,
        succs: Iterable[str] = (),
        preds: Iterable[str] = (),
        active: bool = True,
        keeper: bool = False,
        creator: Optional[str] = None,
        deletion_mode: DeletionMode = DeletionMode.TWO_PHASE,
        emit_routes: bool = True,
        incarnation: int = 0,
    ) -> None:
        if not instance_id or not isinstance(instance_id, str):
            raise LocalProtocolError(f"instance_id: expected a non-empty string, found {instance_id!r}")
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise LocalProtocolError(f"stage: expected an integer >= 0, found {stage!r}")
        if not active and not creator:
            raise LocalProtocolError("an idle (new) instance needs the id of its creator")
        self.instance_id = instance_id
        self.operator = operator
        self.stage = stage
        self.params = params
        self.keeper = keeper
        self.creator = creator
        self.deletion_mode = deletion_mode
        self.emit_routes = emit_routes
        # Which incarnation of this identity runs the core (the worker's epoch). An instance
        # re-homed after its node died restarts from a rebuilt state with `round` at 0, so the
        # copies it creates need ids its earlier incarnation's rounds cannot have used: ids are
        # never reused (a departed copy's id would inherit its inbox, channels and state file).
        self.incarnation = incarnation
        self.state = InstanceState.ACTIVE if active else InstanceState.IDLE
        self.succs: Set[str] = set(succs)
        self.preds: Set[str] = set(preds)
        self.succs_to_add: Set[str] = set()
        self.succs_to_delete: Set[str] = set()
        self.preds_to_add: Set[str] = set()
        self.preds_to_delete: Set[str] = set()
        self.round = 0  # number of the last round this instance started
        self.pending: Set[str] = set()  # peers whose ack the current round waits for
        self.new_siblings: Ids = ()  # instances created by the current duplication round
        # Pending neighbour -> the copies it announced to us (its Duplication) before it acked our
        # round: it may have started them with tables that lack our round (`widen_round`).
        self.unsure: Dict[str, Set[str]] = {}
        # Pending neighbours whose Deletion we applied in this round: they send us nothing more
        # and may be gone before our round message reaches them (`release`).
        self.gone: Set[str] = set()
        # Neighbours that acked our current duplication round: they know our copies.
        self.acked: Set[str] = set()
        # Neighbours (-> side) whose Deletion we applied in our duplication round after they
        # had acked it: they know our copies, which must know them (`_finish_duplication`).
        self.leavers: Dict[str, str] = {}

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def initial(
        cls,
        instance_id: str,
        operator: str,
        stage: int,
        params: ScalingParams,
        *,
        succs: Iterable[str] = (),
        preds: Iterable[str] = (),
        keeper: bool = False,
        **kwargs: Any,
    ) -> "ScalingCore":
        """An instance deployed with the pipeline: active, tables known."""
        return cls(instance_id, operator, stage, params, succs=succs, preds=preds, keeper=keeper, **kwargs)

    @classmethod
    def from_create(cls, effect: CreateInstance, params: ScalingParams, **kwargs: Any) -> "ScalingCore":
        """The idle core of an instance created by a `CreateInstance` effect."""
        return cls(
            effect.instance_id, effect.operator, effect.stage, params,
            active=False, creator=effect.creator, **kwargs,
        )

    # ---- read-only views ------------------------------------------------------------------

    @property
    def is_active(self) -> bool:
        return self.state in FORWARDING

    @property
    def forwards_data(self) -> bool:
        """True when the data path of this instance sends records to its successors."""
        return self.state in FORWARDING

    @property
    def in_round(self) -> bool:
        return self.state in (InstanceState.DUPLICATING, InstanceState.DELETING, InstanceState.DEPARTING)

    @property
    def terminated(self) -> bool:
        return self.state is InstanceState.TERMINATED

    def routes(self) -> Tuple[Ids, Ids]:
        return tuple(sorted(self.succs)), tuple(sorted(self.preds))

    def __repr__(self) -> str:
        return (
            f"ScalingCore({self.instance_id!r}, stage={self.stage}, {self.state.value}, "
            f"succs={sorted(self.succs)}, preds={sorted(self.preds)}, pending={sorted(self.pending)})"
        )

    # ---- decisions (Algorithm 11) -----------------------------------------------------------

    def decide(self, load: float, draw: float) -> Decision:
        """The policy's intent for this period; pure (does not change the state)."""
        if self.state is not InstanceState.ACTIVE:
            return NO_DECISION
        return decide(self.params, load, self.keeper, draw)

    def tick(self, load: float, draw: float) -> List[Output]:
        """Periodic decision: decide and, if the policy says so, start the round at once."""
        return self.start_round(self.decide(load, draw))

    def start_round(self, decision: Decision, new_ids: Optional[Sequence[str]] = None) -> List[Output]:
        if decision.action is Action.NONE:
            return []
        if decision.action is Action.DUPLICATE:
            return self.start_duplication(decision.count, new_ids)
        return self.start_deletion()

    def start_duplication(
        self, count: int, new_ids: Optional[Sequence[str]] = None, *, create: bool = True
    ) -> List[Output]:
        """Algorithm 4: create `count` idle siblings and announce them to every neighbour
        (`create=False`: the siblings exist already, see `adopt`)."""
        self._require_idle_active("start a duplication")
        if count < 1:
            raise LocalProtocolError(f"a duplication creates at least one instance, asked for {count}")
        rnd = self.round + 1
        ids = tuple(new_ids) if new_ids is not None else tuple(self._new_id(rnd, k) for k in range(count))
        if len(ids) != count or len(set(ids)) != count or self.instance_id in ids:
            raise LocalProtocolError(f"new_ids: expected {count} distinct new ids, found {ids!r}")
        self.round = rnd
        self.new_siblings = ids
        out: List[Output] = []
        if create:
            out = [CreateInstance(i, self.operator, self.stage, self.instance_id) for i in ids]
        msg = Duplication(self.instance_id, self.stage, rnd, ids)
        targets = sorted(self.succs) + sorted(self.preds)
        out.extend(Send(t, msg) for t in targets)
        self.pending = set(targets)
        self._forget_round()
        self.state = InstanceState.DUPLICATING
        if not self.pending:
            out.extend(self._finish_duplication())
        return out

    def adopt(self, copy_id: str) -> List[Output]:
        """A duplication round for a copy that exists, idle, and that no round of ours will start.

        Why: an instance re-homed after its node died (docs/reliability.md) restarts from rebuilt
        tables and knows nothing of the round its earlier incarnation was in. The copy that round
        created waits for a Start that only we may send, while the neighbours that applied the
        Duplication route records to it, so those records would never be processed. Announcing
        the copy again is idempotent for those neighbours (`_on_duplication` acks an instance it
        knows without a change) and adds it for the others; then Start activates it with our
        tables: the end of Algorithm 4, same message cost as a duplication of one copy.

        Safe only for a copy known to be idle now and created by an earlier incarnation of ours:
        the driver adopts a copy only after it answered a probe sent by this incarnation
        (agent.instance.worker), so no earlier Start can still reach it and it cannot have left."""
        if copy_id == self.instance_id:
            raise LocalProtocolError(f"{self.instance_id} cannot adopt itself")
        return self.start_duplication(1, (copy_id,), create=False)

    def cancel_duplication(self, created: Sequence[str] = ()) -> List[Output]:
        """Withdraw the current duplication round, or shrink it to the copies that exist.

        Why: createNode() can fail (no node has a free slot). Retrying while the round's
        announcements wait in the driver stalls the neighbours (they get nothing from us in the
        meantime, FIFO) and leaves records undelivered at shutdown. Cancelling is safe because the
        round's `CreateInstance` outputs come before any of its `Send`s: a driver whose create
        failed has not announced anything yet, so no peer knows the round.

        The driver discards the round's outputs it still holds (remaining creates and the
        announcements) and performs the returned ones in their place. `created` are the new ids
        whose CreateInstance already succeeded: with none, the instance is back to ACTIVE with its
        tables untouched and nothing is sent; otherwise the round goes on with those copies only
        (same message cost as a duplication of len(created) copies). The round number stays
        advanced so a copy whose start merely timed out can never collide with a later id.
        """
        if self.state is not InstanceState.DUPLICATING:
            raise LocalProtocolError(
                f"{self.instance_id}: cannot cancel a duplication in state {self.state.value}, expected duplicating"
            )
        kept = tuple(i for i in self.new_siblings if i in set(created))
        unknown = set(created) - set(self.new_siblings)
        if unknown:
            raise LocalProtocolError(
                f"{self.instance_id}: created {sorted(unknown)} are not new siblings of round {self.round} "
                f"(expected a subset of {list(self.new_siblings)})"
            )
        if not kept:
            self.state = InstanceState.ACTIVE
            self.pending = set()
            self._forget_round()
            self.new_siblings = ()
            return []
        self.new_siblings = kept
        msg = Duplication(self.instance_id, self.stage, self.round, kept)
        return [Send(t, msg) for t in sorted(self.pending)]

    def widen_round(self, dest: str) -> Ids:
        """The neighbours our round message must reach besides pending `dest`, which the driver
        sends it to again after a silence: the copies `dest` announced to us before it acked our
        round. They join the pending set (our round ends once they know it too).

        Why: the paper's correctness sketch (Section 4.3, concurrent rounds) rests on FIFO
        channels: our round message goes to `dest` before our ack of its Duplication, so `dest`
        applies our round before its own ends and starts its copies with tables that hold it. A
        message the broker lost breaks that order: `dest` takes our ack, starts its copies without
        our round, and gets our round message only when we send it again; `dest` then knows it,
        its copies never would (a copy of ours named as their neighbour, waiting for them for
        ever; or us, leaving, still in their tables). Only at a resend: without a loss the order
        holds and the round costs exactly the paper's messages (docs/design.md, invariant 6).
        CHANGELOG.md, "A Duplication resent after a loss"."""
        if not self.in_round or dest not in self.pending:
            return ()
        extra = tuple(sorted(self.unsure.pop(dest, set()) - self.pending - {self.instance_id}))
        self.pending.update(extra)
        return extra

    def release(self, dest: str) -> Optional[List[Output]]:
        """Stop waiting for pending `dest` if it left meanwhile (we applied its Deletion in this
        round): the outputs of the round's end if it was the last one, else []; None if `dest`
        did not leave (send it the round message again).

        Why: the driver calls this where it would send our round message again after a silence.
        A neighbour whose Deletion we applied has drained what it sent us (two-phase deletion:
        its Deletion follows its last record) or stops taking ours, and it is out of our tables,
        so out of the Start of our copies: our round is no news it needs. Without a loss it acks
        in time (it acks every round message until it terminates, FIFO puts ours before our
        ack of its Deletion); after one (our round message lost, our ack delivered past the
        hole) it may have terminated, and our round would wait for it for ever, our idle copy
        never started while our neighbours route to it. CHANGELOG.md,
        "A round waited for ever for a pending neighbour that left"."""
        if not self.in_round or dest not in self.pending or dest not in self.gone:
            return None
        self.pending.discard(dest)
        self.unsure.pop(dest, None)
        if self.pending:
            return []
        if self.state is InstanceState.DUPLICATING:
            return self._finish_duplication()
        return self._deletion_acks_complete()

    def start_deletion(self) -> List[Output]:
        """Algorithm 8: announce our termination (to preds first, in TWO_PHASE mode)."""
        self._require_idle_active("start a deletion")
        if self.keeper:
            raise LocalProtocolError(f"{self.instance_id} is its operator's keeper: it never terminates")
        self.round += 1
        msg = Deletion(self.instance_id, self.stage, self.round)
        if self.deletion_mode is DeletionMode.PAPER:
            targets = sorted(self.succs) + sorted(self.preds)
        else:
            targets = sorted(self.preds)
        self.pending = set(targets)
        self._forget_round()
        self.state = InstanceState.DELETING
        out: List[Output] = [Send(t, msg) for t in targets]
        if not self.pending:
            out.extend(self._deletion_acks_complete())
        return out

    # ---- messages ---------------------------------------------------------------------------

    def handle(self, message: Message) -> List[Output]:
        """One message from a peer (Algorithms 5, 6, 7, 9, 10)."""
        if self.state is InstanceState.TERMINATED:
            raise RemoteProtocolError(
                f"{self.instance_id}: received {message.type} from {message.sender} after termination"
            )
        handler = self._HANDLERS.get(type(message))
        if handler is None:
            raise RemoteProtocolError(
                f"{self.instance_id}: {message.type} is not a scaling protocol message"
            )
        if message.sender == self.instance_id:
            raise RemoteProtocolError(f"{self.instance_id}: received its own {message.type}")
        return handler(self, message)

    def _on_duplication(self, msg: Duplication) -> List[Output]:
        side = self._side(msg)
        new = set(msg.new_instances)
        if self.instance_id in new:
            raise RemoteProtocolError(f"{self.instance_id}: duplication from {msg.sender} announces us")
        out: List[Output] = []
        if self.in_round and msg.sender in self.pending:
            # It has not acked our round: it may start these copies without it (`widen_round`).
            self.unsure.setdefault(msg.sender, set()).update(new)
        if self.state is InstanceState.IDLE:
            (self.succs_to_add if side == _SUCC else self.preds_to_add).update(new)
        elif self.state in FORWARDING:
            table = self.succs if side == _SUCC else self.preds
            if not new <= table:
                table.update(new)
                out.extend(self._routes_changed())
        # DEPARTING: input closed and drained, we send nothing any more: just acknowledge.
        out.append(Send(msg.sender, DuplicationAck.trusted(
            sender=self.instance_id, stage=self.stage, round=msg.round)))
        return out

    def _on_deletion(self, msg: Deletion) -> List[Output]:
        side = self._side(msg)
        out: List[Output] = []
        for copies in self.unsure.values():
            copies.discard(msg.sender)  # it leaves: our round is no news to it (and it may be gone)
        if self.in_round and msg.sender in self.pending:
            self.gone.add(msg.sender)
        elif self.state is InstanceState.DUPLICATING and msg.sender in self.acked \
                and msg.sender in (self.succs if side == _SUCC else self.preds):
            # It acked our Duplication, so it applied it: it will send our copies its Deletion
            # and wait for their acks (deviation 7). Not one that joined our tables during the
            # round (a neighbour's new copy): it may never have heard of ours.
            self.leavers[msg.sender] = side
        if self.state is InstanceState.IDLE:
            (self.succs_to_delete if side == _SUCC else self.preds_to_delete).add(msg.sender)
        else:
            table = self.succs if side == _SUCC else self.preds
            if msg.sender in table:
                table.discard(msg.sender)
                if self.state in FORWARDING:
                    out.extend(self._routes_changed())
        out.append(Send(msg.sender, DeletionAck.trusted(
            sender=self.instance_id, stage=self.stage, round=msg.round)))
        return out

    def _on_start(self, msg: Start) -> List[Output]:
        if self.state is not InstanceState.IDLE:
            raise RemoteProtocolError(
                f"{self.instance_id}: start from {msg.sender} in state {self.state.value}, expected idle"
            )
        if msg.sender != self.creator or msg.stage != self.stage:
            raise RemoteProtocolError(
                f"{self.instance_id}: start from {msg.sender} (stage {msg.stage}), "
                f"expected it from creator {self.creator} (stage {self.stage})"
            )
        self.succs = (set(msg.succs) | self.succs_to_add) - self.succs_to_delete
        self.preds = (set(msg.preds) | self.preds_to_add) - self.preds_to_delete
        self.succs_to_add, self.succs_to_delete = set(), set()
        self.preds_to_add, self.preds_to_delete = set(), set()
        self.state = InstanceState.ACTIVE
        succs, preds = self.routes()
        return [Activate(succs, preds)]

    def _on_duplication_ack(self, msg: DuplicationAck) -> List[Output]:
        self._check_ack(msg, (InstanceState.DUPLICATING,))
        self.pending.discard(msg.sender)
        self.acked.add(msg.sender)
        self.unsure.pop(msg.sender, None)
        return [] if self.pending else self._finish_duplication()

    def _on_deletion_ack(self, msg: DeletionAck) -> List[Output]:
        self._check_ack(msg, (InstanceState.DELETING, InstanceState.DEPARTING))
        self.pending.discard(msg.sender)
        self.unsure.pop(msg.sender, None)
        return [] if self.pending else self._deletion_acks_complete()

    _HANDLERS = {
        Duplication: _on_duplication,
        Deletion: _on_deletion,
        Start: _on_start,
        DuplicationAck: _on_duplication_ack,
        DeletionAck: _on_deletion_ack,
    }

    # ---- round completion (Algorithms 6 and 10) -------------------------------------------

    def _forget_round(self) -> None:
        """What a round learnt of its neighbours (`unsure`, `gone`, `acked`, `leavers`) ends with
        it: a new round, a round's end and termination start from nothing (`leavers` and `acked`
        are only ever filled in a duplication round)."""
        self.unsure = {}
        self.gone = set()
        self.leavers = {}
        self.acked = set()

    def _finish_duplication(self) -> List[Output]:
        """All neighbours know the new siblings: activate them with our current tables, plus
        the neighbours that left after they learnt of the siblings (`leavers`): those send the
        siblings their Deletion, and a sibling that left first, not knowing them, would never
        answer it (CHANGELOG.md, "A departing copy waited for a copy that ended")."""
        succs = self.succs | {n for n, side in self.leavers.items() if side == _SUCC}
        preds = self.preds | {n for n, side in self.leavers.items() if side == _PRED}
        start = Start(self.instance_id, self.stage, tuple(sorted(succs)), tuple(sorted(preds)))
        out: List[Output] = [Send(i, start) for i in self.new_siblings]
        self.new_siblings = ()
        self._forget_round()
        self.state = InstanceState.ACTIVE
        return out

    def _deletion_acks_complete(self) -> List[Output]:
        if self.state is InstanceState.DELETING and self.deletion_mode is DeletionMode.TWO_PHASE:
            # Every predecessor removed us and sent its last record before its ack: drain, then
            # tell the successors (who may still receive our records until they see this).
            self.round += 1
            msg = Deletion(self.instance_id, self.stage, self.round)
            targets = sorted(self.succs)
            self.pending = set(targets)
            self._forget_round()
            self.state = InstanceState.DEPARTING
            out: List[Output] = [Drain()]
            out.extend(Send(t, msg) for t in targets)
            if not self.pending:
                out.extend(self._deletion_acks_complete())
            return out
        self.state = InstanceState.TERMINATED
        self._forget_round()
        out = [] if self.deletion_mode is DeletionMode.TWO_PHASE else [Drain()]
        out.append(Terminate(self.instance_id))
        return out

    # ---- helpers ----------------------------------------------------------------------------

    def _side(self, msg: Message) -> str:
        if msg.stage == self.stage + 1:
            return _SUCC
        if msg.stage == self.stage - 1:
            return _PRED
        raise RemoteProtocolError(
            f"{self.instance_id} (stage {self.stage}): {msg.type} from {msg.sender} at stage "
            f"{msg.stage}, expected a neighbouring stage {self.stage - 1} or {self.stage + 1}"
        )

    def _check_ack(self, msg: Union[DuplicationAck, DeletionAck], states: Tuple[InstanceState, ...]) -> None:
        if self.state not in states:
            raise RemoteProtocolError(
                f"{self.instance_id}: {msg.type} from {msg.sender} in state {self.state.value}, "
                f"no such round in progress"
            )
        if msg.round != self.round or msg.sender not in self.pending:
            raise RemoteProtocolError(
                f"{self.instance_id}: {msg.type} from {msg.sender} for round {msg.round}, expected "
                f"round {self.round} from one of {sorted(self.pending)}"
            )

    def _require_idle_active(self, what: str) -> None:
        if self.state is not InstanceState.ACTIVE:
            raise LocalProtocolError(
                f"{self.instance_id}: cannot {what} in state {self.state.value}, expected active"
            )

    def _routes_changed(self) -> List[Output]:
        if not self.emit_routes:
            return []
        succs, preds = self.routes()
        return [RoutesChanged(succs, preds)]

    def _new_id(self, rnd: int, k: int) -> str:
        """Deterministic, short, unique-in-practice id for a new sibling (identity from inputs)."""
        digest = hashlib.blake2b(f"{self.instance_id}|{self.incarnation}|{rnd}|{k}".encode(),
                                 digest_size=6).hexdigest()
        return f"{self.operator}-{digest}"

    # ---- snapshot / restore -----------------------------------------------------------------

    def snapshot(self) -> Dict[str, Any]:
        """JSON-friendly copy of the whole state (for crash recovery and for the checker)."""
        return {
            "instance_id": self.instance_id,
            "operator": self.operator,
            "stage": self.stage,
            "keeper": self.keeper,
            "creator": self.creator,
            "deletion_mode": self.deletion_mode.value,
            "state": self.state.value,
            "succs": sorted(self.succs),
            "preds": sorted(self.preds),
            "succs_to_add": sorted(self.succs_to_add),
            "succs_to_delete": sorted(self.succs_to_delete),
            "preds_to_add": sorted(self.preds_to_add),
            "preds_to_delete": sorted(self.preds_to_delete),
            "round": self.round,
            "pending": sorted(self.pending),
            "new_siblings": list(self.new_siblings),
            "unsure": {n: sorted(c) for n, c in sorted(self.unsure.items())},
            "gone": sorted(self.gone),
            "leavers": dict(sorted(self.leavers.items())),
            "acked": sorted(self.acked),
        }

    @classmethod
    def restore(cls, data: Dict[str, Any], params: ScalingParams, **kwargs: Any) -> "ScalingCore":
        try:
            core = cls(
                data["instance_id"], data["operator"], data["stage"], params,
                succs=data["succs"], preds=data["preds"], keeper=bool(data["keeper"]),
                creator=data["creator"], active=True,
                deletion_mode=DeletionMode(data["deletion_mode"]), **kwargs,
            )
            core.state = InstanceState(data["state"])
            core.succs_to_add = set(data["succs_to_add"])
            core.succs_to_delete = set(data["succs_to_delete"])
            core.preds_to_add = set(data["preds_to_add"])
            core.preds_to_delete = set(data["preds_to_delete"])
            core.round = int(data["round"])
            core.pending = set(data["pending"])
            core.new_siblings = tuple(data["new_siblings"])
            # absent from snapshots written before `unsure` existed: nothing unsure
            core.unsure = {str(n): {str(c) for c in cs} for n, cs in (data.get("unsure") or {}).items()}
            core.gone = {str(n) for n in data.get("gone") or ()}
            core.leavers = {str(n): str(side) for n, side in (data.get("leavers") or {}).items()
                            if side in (_SUCC, _PRED)}
            core.acked = {str(n) for n in data.get("acked") or ()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LocalProtocolError(f"snapshot: cannot restore ({exc!r})") from None
        return core

    def clone(self) -> "ScalingCore":
        """A cheap independent copy (the interleaving checker copies whole systems)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        for name in ("succs", "preds", "succs_to_add", "succs_to_delete", "preds_to_add",
                     "preds_to_delete", "pending", "gone", "acked"):
            setattr(new, name, set(getattr(self, name)))
        new.unsure = {n: set(c) for n, c in self.unsure.items()}
        new.leavers = dict(self.leavers)
        return new

    def key(self) -> Tuple[Any, ...]:
        """Hashable summary of the full state (used to deduplicate explored states)."""
        return (
            self.instance_id, self.state, frozenset(self.succs), frozenset(self.preds),
            frozenset(self.succs_to_add), frozenset(self.succs_to_delete),
            frozenset(self.preds_to_add), frozenset(self.preds_to_delete),
            self.round, frozenset(self.pending), self.new_siblings,
            frozenset((n, frozenset(c)) for n, c in self.unsure.items()), frozenset(self.gone),
            frozenset(self.leavers.items()), frozenset(self.acked),
        )

