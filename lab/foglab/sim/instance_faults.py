"""The instance checker's seeded faults, installed as subclasses: the product classes have no
branch for them (docs/reliability.md, "Checking whole instances"). Those of
`agent.instance.core.Instance` itself override its rules; those of its parts (the watermarks,
agent.instance.marks; the admission, agent.instance.admission; the key groups' moves,
agent.instance.moves, and their side, agent.instance.group_side; the scaling driver with its idle
copies, agent.instance.driver and agent.instance.adoption; the wait for replays,
agent.instance.replays; the outputs, agent.instance.outputs) are subclasses of `Marks`,
`Admission`, `GroupMoves`, `GroupSide`, `ScalingDriver`, `ReplayWait` and `Outputs` the instance's
subclass builds (`Instance.marks_class`, `admission_class`, `moves_class`, `group_side_class`,
`driver_class`, `replays_class`, `outputs_class`).

`instance_class(faults)` is `Instance` itself when none of these is on, else a subclass with
each one's override (two faults of one part: a part class with both).
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional, Tuple, Type

from agent.dataplane.envelope import Envelope, Item
from agent.dataplane.keygroups import key_group, record_key
from agent.dataplane.watermarks import Mark, WatermarkTable
from agent.instance.admission import Admission
from agent.instance.commands import Command
from agent.instance.core import Instance
from agent.instance.marks import Marks
from agent.instance.driver import ScalingDriver
from agent.instance.group_side import GroupSide
from agent.instance.moves import GroupMoves
from agent.instance.outputs import Outputs
from agent.instance.replays import ReplayWait

__all__ = ["FAULT_RETRY_ONLY_WITH_DATA", "FAULT_ROUTE_AFRESH", "FAULT_MARKS_OWN_MAX", "FAULT_NO_ADD_PRED",
           "FAULT_NO_REMOVE_PRED", "FAULT_MARKS_UNACKED", "FAULT_EMPTY_ACK_HELD",
           "FAULT_NO_REDIRECT_RESEND", "FAULT_ACK_BEHIND_DRAIN",
           "FAULT_RESYNC_AT_FIRST_SEEN", "ResyncAtFirstSeenWait", "FAULT_REPLAY_CLOCK_AT_DROP", "ClockAtDropWait",
           "FAULT_ROUTE_PAST_DEPARTED", "FAULT_REPLAY_TO_DEPARTED",
           "FAULT_REHOME_ROUNDS_FROM_ONE", "FAULT_DRAIN_HOLDS_PROTOCOL", "FAULT_REHOME_STAYS",
           "FAULT_RESEND_PENDING_ONLY", "FAULT_WAIT_FOR_LEAVER", "FAULT_START_WITHOUT_LEAVERS",
           "FAULT_LEAVE_BEFORE_ADOPTION", "FAULT_HELD_AT_ONCE", "FAULT_NO_EOS", "FAULT_LEAVE_WITH_GROUPS",
           "FAULT_HELD_ACKED_AT_SAVE", "HANDOVER_FAULTS", "instance_class"]

# Refused publishes are retried only when there is data to flush, so a sink's refused ack holds
# back all its later acks.
FAULT_RETRY_ONLY_WITH_DATA = "retry_only_with_data"
# Records sent again are routed afresh, not to where they went before, so after a crash a copy
# can reach another sink instance, which keeps it (INVARIANT 8).
FAULT_ROUTE_AFRESH = "route_afresh"
# A keyed instance keeps its own watermark, the largest event time it took (the rule before marks
# flowed), so a record that took the other path, or waited for its group's move, is judged late.
FAULT_MARKS_OWN_MAX = "marks_own_max"
# Of the hand-over (docs/operators.md, "Key groups that move"; they need the keyed pipeline): a
# predecessor that joined during a move is not waited for; one that left is still waited for.
FAULT_NO_ADD_PRED = "no_add_pred"
FAULT_NO_REMOVE_PRED = "no_remove_pred"
# An instance passes on the marks it received, acked inputs or not, so a record processed again
# after a crash can be behind a mark already passed on.
FAULT_MARKS_UNACKED = "marks_unacked"
# An idle copy holds an empty ack from a successor's name even with a round message behind it, so
# two idle copies can wait for each other (CHANGELOG.md, "Records lost at an idle sink copy").
FAULT_EMPTY_ACK_HELD = "empty_ack_held"
# A silent move does not ask its predecessors again, so one whose Redirect a broker rollback lost
# never ends (needs the keyed pipeline).
FAULT_NO_REDIRECT_RESEND = "no_redirect_resend"
# A draining copy's ack of a Duplication waits behind its Drain, so the round that waits for it
# and the copy's records, acked only once that round starts the copy, wait for each other.
FAULT_ACK_BEHIND_DRAIN = "ack_behind_drain"
# A restarted receiver takes a predecessor's data at the first number it sees when its snapshot
# does not hold that channel (the checker's former `resync_past_lost_replays`).
FAULT_RESYNC_AT_FIRST_SEEN = "resync_at_first_seen"
# The wait for a replay marker starts its clock only at the first data batch it drops, not at a
# protocol message or a duplicate (CHANGELOG.md, "A lost replay marker was never asked for again").
FAULT_REPLAY_CLOCK_AT_DROP = "replay_clock_at_drop"
# A record sent again whose successor left our table is routed afresh (as it once was), so a copy
# a departed sink instance recorded reaches another (INVARIANT 8).
FAULT_ROUTE_PAST_DEPARTED = "route_past_departed"
# The unacked batches of a successor we removed are replayed to its new incarnation, which is
# departing and drops them, instead of re-routed (CHANGELOG.md, "A copy that became a new
# incarnation in its own deletion stranded its inputs").
FAULT_REPLAY_TO_DEPARTED = "replay_to_departed"

# Of the scaling driver, each a loss the chaos campaigns found (docs/reliability.md):
# a re-homed instance numbers its rounds from 1 again, which its neighbours take as repeats;
FAULT_REHOME_ROUNDS_FROM_ONE = "rehome_rounds_from_one"
# a draining copy holds its protocol queue, the data behind a repeated ack with it;
FAULT_DRAIN_HOLDS_PROTOCOL = "drain_holds_protocol"
# a re-homed copy ignores the deletion acks of its dead incarnation and stays;
FAULT_REHOME_STAYS = "rehome_stays"
# a round message sent again reaches the pending set only, not the copies a neighbour announced;
FAULT_RESEND_PENDING_ONLY = "resend_pending_only"
# a round waits for the ack of a pending neighbour that left;
FAULT_WAIT_FOR_LEAVER = "wait_for_leaver"
# our copies start without the neighbours that left after they learnt of them (ScalingCore.leavers);
FAULT_START_WITHOUT_LEAVERS = "start_without_leavers"
# of its idle copies: a creator scales in with an idle copy of its own waiting for adoption.
FAULT_LEAVE_BEFORE_ADOPTION = "leave_before_adoption"
# Of the hand-over, each a rule of docs/operators.md "Key groups that move" broken (they need the
# keyed pipeline): records of a group on its way here applied before its state;
FAULT_HELD_AT_ONCE = "held_applied_at_once"
# a predecessor takes a Redirect and sends no Eos;
FAULT_NO_EOS = "eos_not_sent"
# a leaver starts its Deletion at once, whatever it holds;
FAULT_LEAVE_WITH_GROUPS = "leave_with_groups"
# held records' inputs acked once their state is saved, their outputs still unacked (the demo's 21
# lost trips).
FAULT_HELD_ACKED_AT_SAVE = "held_acked_at_save"
HANDOVER_FAULTS = (FAULT_HELD_AT_ONCE, FAULT_NO_EOS, FAULT_LEAVE_WITH_GROUPS, FAULT_HELD_ACKED_AT_SAVE)


class RetryOnlyWithData(Instance):
    def retry_publishes(self) -> None:
        """Not at every turn: only from `flush`, when there is data to flush."""

    def flush(self, now: float, force: bool = False) -> List[Command]:
        retries = self.outputs.publish_retries() if self.outbox.pending else []
        return retries + super().flush(now, force)


class RouteAfresh(Instance):
    remembers_routes = False


class MarksOwnMax(Instance):
    marks_flow = False


class NoAddPred(GroupSide):
    def await_joined_pred(self, moves: GroupMoves, pred: str) -> None:
        """The moves do not learn of the new predecessor."""


class NoRemovePred(GroupSide):
    def forget_departed_pred(self, moves: GroupMoves, pred: str) -> None:
        """The moves keep waiting for the departed predecessor's Eos."""


class NoEos(GroupSide):
    def send_eos(self, dest: str, eos: Any) -> None:
        """Not sent: the old owner's move waits for it for ever."""


class MarksUnacked(Marks):
    def passable(self, marks: WatermarkTable) -> Optional[Mark]:
        """Every mark taken in, its input acked upstream or not."""
        return marks.current()


class EmptyAckHeldAdmission(Admission):
    def _empty_ack_before_round(self, key: Tuple[str, str], head: Envelope, sc: Optional[ScalingDriver]) -> bool:
        """Never taken: held like the rest of its stream until the copy's Start."""
        return False


class MovesNotAskedAgain(GroupMoves):
    resends_redirects = False


class AckBehindDrainDriver(ScalingDriver):
    acks_ahead_of_drain = False


class RoundsFromOneDriver(ScalingDriver):
    def _rounds_above_dead_incarnation(self, min_epoch: int) -> None:
        """Numbered from 1 again, as if no incarnation had run rounds before."""


class DrainHoldsProtocolDriver(ScalingDriver):
    @property
    def blocked(self) -> bool:
        """Every protocol message waits behind queued outputs, a draining copy's too."""
        return bool(self.outputs)


class StaysDriver(ScalingDriver):
    def _left_behind(self, body: Any) -> None:
        """Stays an active instance, whatever its dead incarnation was doing."""


class ResendsToPendingDriver(ScalingDriver):
    def _widen_round(self, dest: str) -> Tuple[str, ...]:
        """Nobody besides `dest`."""
        return ()


class WaitsForLeaverDriver(ScalingDriver):
    def _release_leaver(self, dest: str) -> Optional[List[Any]]:
        """Still waited for, left or not."""
        return None


class StartsWithoutLeaversDriver(ScalingDriver):
    def _core_handles(self, msg: Any) -> List[Any]:
        """The round forgets its leavers as soon as it learns of them."""
        outs = super()._core_handles(msg)
        self.core.leavers.clear()
        return outs


class LeavesBeforeAdoptionDriver(ScalingDriver):
    @property
    def adoption_pending(self) -> bool:
        """A scale-in waits for no adoption."""
        return False


class AppliesHeldAtOnce(GroupMoves):
    def admit(self, sender: str, items: List[Item], index: int) -> List[Item]:
        """The records of a group on its way here applied at once, before its state; the others,
        in runs between them, as the product admits them."""
        now: List[Item] = []
        run: List[Item] = []
        for it in items:
            if key_group(record_key(it[2], self.key_field), self.groups) in self.member.new.expected:
                now += super().admit(sender, run, index) if run else []
                run = []
                now.append(it)
            else:
                run.append(it)
        now += super().admit(sender, run, index) if run else []
        self._applied(now)
        return now


class LeavesWithGroups(GroupMoves):
    def ready_to_leave(self) -> bool:
        """At once, whatever we hold."""
        return self.leaving


class AcksHeldAtSave(GroupMoves):
    def _input_waits_for_outputs(self, idx: int, low: int) -> None:
        """Acked with the save: the input waits for none of its outputs."""


class ResyncAtFirstSeenWait(ReplayWait):
    awaits_unknown_channels = False


class ClockAtDropWait(ReplayWait):
    clock_at_any_message = False


class RoutesPastDeparted(Outputs):
    drops_sent_to_departed = False


class ReplaysToDeparted(Outputs):
    reroutes_departed_replays = False


# The faults of the instance's own rules: its subclass for each.
_OWN = ((FAULT_RETRY_ONLY_WITH_DATA, RetryOnlyWithData), (FAULT_ROUTE_AFRESH, RouteAfresh),
        (FAULT_MARKS_OWN_MAX, MarksOwnMax))
# The faults of its parts: the Instance attribute the part is built from, and the part's subclass.
_OF_PARTS = ((FAULT_MARKS_UNACKED, "marks_class", MarksUnacked),
             (FAULT_EMPTY_ACK_HELD, "admission_class", EmptyAckHeldAdmission),
             (FAULT_NO_REDIRECT_RESEND, "moves_class", MovesNotAskedAgain),
             (FAULT_HELD_AT_ONCE, "moves_class", AppliesHeldAtOnce),
             (FAULT_LEAVE_WITH_GROUPS, "moves_class", LeavesWithGroups),
             (FAULT_HELD_ACKED_AT_SAVE, "moves_class", AcksHeldAtSave),
             (FAULT_NO_ADD_PRED, "group_side_class", NoAddPred),
             (FAULT_NO_REMOVE_PRED, "group_side_class", NoRemovePred),
             (FAULT_NO_EOS, "group_side_class", NoEos),
             (FAULT_ACK_BEHIND_DRAIN, "driver_class", AckBehindDrainDriver),
             (FAULT_REHOME_ROUNDS_FROM_ONE, "driver_class", RoundsFromOneDriver),
             (FAULT_DRAIN_HOLDS_PROTOCOL, "driver_class", DrainHoldsProtocolDriver),
             (FAULT_REHOME_STAYS, "driver_class", StaysDriver),
             (FAULT_RESEND_PENDING_ONLY, "driver_class", ResendsToPendingDriver),
             (FAULT_WAIT_FOR_LEAVER, "driver_class", WaitsForLeaverDriver),
             (FAULT_START_WITHOUT_LEAVERS, "driver_class", StartsWithoutLeaversDriver),
             (FAULT_LEAVE_BEFORE_ADOPTION, "driver_class", LeavesBeforeAdoptionDriver),
             (FAULT_RESYNC_AT_FIRST_SEEN, "replays_class", ResyncAtFirstSeenWait),
             (FAULT_REPLAY_CLOCK_AT_DROP, "replays_class", ClockAtDropWait),
             (FAULT_ROUTE_PAST_DEPARTED, "outputs_class", RoutesPastDeparted),
             (FAULT_REPLAY_TO_DEPARTED, "outputs_class", ReplaysToDeparted))
# The classes `instance_class` made, by name (`__getattr__`).
_MADE: Dict[str, type] = {}


def instance_class(faults: FrozenSet[str]) -> Type[Instance]:
    """The class to build an instance with under the seeded `faults`: each part with a fault
    built from one class with the overrides of all its faults on."""
    own = [cls for name, cls in _OWN if name in faults]
    parts: Dict[str, List[type]] = {}
    for name, attr, cls in _OF_PARTS:
        if name in faults:
            parts.setdefault(attr, []).append(cls)
    return _made(own or [Instance], {attr: _made(classes) for attr, classes in parts.items()}, "Faulty")


def _made(bases: List[Any], parts: Optional[Dict[str, type]] = None, prefix: str = "") -> Any:
    """The one base itself, or the class of all `bases` (with `parts` for its part classes),
    made once per combination and named after what it combines."""
    if len(bases) == 1 and not parts:
        return bases[0]
    named = [c for c in bases if c is not Instance] + list((parts or {}).values())
    name = prefix + "".join(c.__name__ for c in named)
    if name not in _MADE:
        _MADE[name] = type(name, tuple(bases), dict(parts or {}, __module__=__name__))
    return _MADE[name]


def __getattr__(name: str) -> type:
    """A class `instance_class` made, found by name as pickle finds a class (the checker's
    `explore` pickles its worlds, their instances and parts with them)."""
    try:
        return _MADE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
