"""An instance's key groups at its edges (docs/operators.md, "Key groups that move"): the hand-over
messages it receives, each to the side it concerns (a Redirect to the group table it routes by,
agent.instance.groups; the rest to the groups it holds, agent.instance.moves), a refused one
counted once, what a Start carries of both sides, the moves' view of a round's predecessors, and a
restart's groups and keyed state back.

Rules of this file: sans-IO, part of the `Instance` (agent.instance.core), holding no reference to
it. `GroupSide` owns no state: it is handed the instance's parts it reads and acts through (the
table's side `GroupRouting`, the routes, the outbox, the links, the persistence, the moves); its
entry points return their commands (agent.instance.emitter), the moves' among them where they
stand. The scaling driver (None before the start) is passed per call: what a Redirect writes
ahead holds its state. No I/O, no clock, no random.

Why apart from the instance: the instance routes an event to this part without knowing which
side of a move it is on; what a hand-over message means for each side, and what a re-homed keyed
instance takes back of its groups, is read here in one place.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

from agent.dataplane.inbound import LogLimiter
from agent.dataplane.owners import TableError, groups_from_runs
from agent.instance.emitter import Emitter, emits
from agent.instance.events import Restarted
from agent.instance.groups import GroupRouting
from agent.instance.handover import Predecessor
from agent.instance.moves import HandoverError, body_size, decode, encode
from agent.instance.moves_parts import refuse, send_handover

__all__ = ["GroupSide"]

log = logging.getLogger("agent.instance.worker")

# The seeded faults of this side (the checker's `eos_not_sent`, `no_add_pred`, `no_remove_pred`)
# are subclasses it installs (foglab.sim.instance_faults): no branch here.


class GroupSide(Emitter):
    """The key groups' side of an instance's events; `routing`: its group table's side (off where
    it routes to no keyed operator); `moves`: the groups it holds (None where it is not keyed)."""

    def __init__(self, spec: Any, ctx: Dict[str, Any], stats: Dict[str, int], clock: Any, *, routing: GroupRouting,
                 router: Any, outbox: Any, tracker: Any, outputs: Any, incarnation: Any, cadence: Any, keyed: Any,
                 moves: Any, refusals: LogLimiter) -> None:
        super().__init__()
        self.spec = spec  # agent.instance.spec.InstanceSpec
        self.ctx = ctx
        self.stats = stats  # the instance's counters
        self.clock = clock  # agent.instance.clock.Clock: the time of the event being handled
        self.routing = routing
        self.router = router  # agent.dataplane.routing.Router: the group table we route by
        self.outbox = outbox  # agent.dataplane.routing.Outbox: a redirected group's records in it
        self.tracker = tracker  # agent.dataplane.flow.AckTracker: a restart's outputs numbered
        self.outputs = outputs  # agent.instance.outputs.Outputs: the links our messages go on
        self.incarnation = incarnation  # agent.instance.incarnation.Incarnation: the state written ahead
        self.cadence = cadence  # agent.instance.cadence.Cadence: the state changed
        self.keyed = keyed  # Optional[agent.instance.keyed_state.KeyedState]
        self.moves = moves  # Optional[agent.instance.moves.GroupMoves]
        self._refusals = refusals  # shared with the admission: one bound on the log lines per sender

    # ---- hand-over messages in -----------------------------------------------------------------

    @emits
    def on_message(self, sender: str, body: Dict[str, Any], scaling: Any) -> None:
        """A hand-over message (its type in HANDOVER_TYPES), counted apart from the paper's protocol."""
        self.stats["handover_in"] += 1
        self.stats["handover_bytes_in"] += body_size(body)
        router = self.router
        if body["type"] == "redirect" and self.routing.on:
            try:
                msg, _ = decode(sender, body, router.groups)
            except ValueError as exc:
                self.error(sender, str(exc))
                return
            if router.table is None:  # an idle copy: its table comes with its Start
                self.routing.hold(sender, msg, router.groups)
                return
            self.take_redirect(sender, msg, scaling)
        elif self.moves is not None:
            self._cmds += self.moves.on_message(sender, body)
        else:
            self.error(sender, f"{body['type']} to an instance that is not keyed")

    @emits
    def take_redirect(self, sender: str, msg: Any, scaling: Any) -> None:
        """A decoded Redirect onto our table (`_redirect`), reported in the heartbeat when it
        changed the group's version (`GroupRouting.took`)."""
        table = self.router.table
        before = table.version(msg.group) if table is not None else None  # group checked by decode
        try:
            self._redirect(sender, msg, scaling)
        except HandoverError as exc:
            self.error(sender, str(exc))
            return
        if table is not None and table.version(msg.group) != before:
            self.routing.took(msg.group, sender, msg.new, table.version(msg.group), self.clock.now)

    def _redirect(self, sender: str, msg: Any, scaling: Any) -> None:
        """A predecessor of the keyed operator: the owner of group g hands it to `msg.new`. Our
        table changes, g's records still in our outbox go to the new owner (`Outbox.reroute`), the
        table is on disk (a restart must not route g to the old owner again), and only then the
        Eos goes to the old owner, behind every batch of g already published to it (FIFO channel:
        `send_eos`)."""
        table = self.router.table
        if table is None:
            raise HandoverError(f"{self.spec.instance}: Redirect of group {msg.group} but no group table here")
        now = self.clock.now
        outs = Predecessor(self.spec.instance, table).on_redirect(sender, msg)
        moved = self.outbox.reroute(now)
        self.cadence.changed()
        save = self.incarnation.write(now, True, scaling)
        if save is not None:
            self._cmds.append(save)
        for o in outs:
            self.send_eos(o.dest, o.message)
        log.info("group %d -> %s (version %d): %d buffered records re-routed, Eos to %s", msg.group, msg.new,
                 table.version(msg.group), moved, sender, extra=self.ctx)

    def send_eos(self, dest: str, eos: Any) -> None:
        """Our Eos of a group whose Redirect we took, to its old owner, behind every batch of the
        group we published to it (FIFO channel): the move waits for it to know none of our
        records of the group is still on its way there. Not in the checker's seeded fault
        `eos_not_sent`."""
        self._cmds += send_handover(self.outputs, self.stats, dest, encode(eos))

    def error(self, sender: str, why: str) -> None:
        """A hand-over message refused here (agent.instance.moves_parts `refuse`)."""
        refuse(self.stats, self._refusals, self.ctx, sender, why, self.clock.now)

    # ---- a Start, both ways; a round's new predecessors -----------------------------------------

    def start_field(self, copy: str) -> Optional[Dict[str, Any]]:
        """The extra field of a Start we send `copy` (agent.instance.groups): our group table, and
        a keyed instance's share of its groups for the copy (agent.instance.moves)."""
        out = self.routing.start_field(self.router)
        if self.moves is not None:
            out = dict(out or {}, share=[list(x) for x in self.moves.share_for(copy)])
        return out

    @emits
    def on_start_field(self, field: Any, succs: Tuple[str, ...], scaling: Any) -> None:
        """Our Start arrived (we are a copy; the Activate that follows sets `succs`): our
        creator's group table, or (keyed) the groups it hands us, before any record."""
        waiting = self.routing.from_start(self.router, field, succs, self.ctx)
        if waiting is not None:
            self.cadence.changed()
            for sender, msg in waiting:  # came before our Start (another channel): taken now
                self.take_redirect(sender, msg, scaling)
        if self.moves is not None and scaling is not None and scaling.core.creator:
            self.moves.take_share(field, scaling.core.creator)
            self.cadence.changed()

    @emits
    def preds_changed(self, added: Tuple[str, ...], removed: Tuple[str, ...]) -> None:
        """A predecessor's round reached us: the groups moving out wait for a new predecessor's
        Eos too (its table may route them here), and a departed one's Eos is not awaited (its
        deletion is behind all it sent us). Through two hooks, which the checker's seeded faults
        `no_add_pred` and `no_remove_pred` replace."""
        moves = self.moves
        if moves is None:
            return
        for p in added:
            self.await_joined_pred(moves, p)
        for p in removed:
            self.forget_departed_pred(moves, p)
        self.cadence.changed()

    def await_joined_pred(self, moves: Any, pred: str) -> None:
        """The groups moving out wait for the Eos of `pred`, a predecessor that joined during
        their move: its table may still route them here (docs/operators.md, "Key groups that
        move"). Not in the checker's seeded fault `no_add_pred`."""
        self._cmds += moves.perform(moves.member.add_pred(pred))

    def forget_departed_pred(self, moves: Any, pred: str) -> None:
        """The groups moving out no longer wait for the Eos of `pred`, a predecessor that left
        during their move: its deletion is behind all it sent us, so a move would otherwise wait
        for an Eos that never comes. Not in the checker's seeded fault `no_remove_pred`."""
        self._cmds += moves.perform(moves.member.remove_pred(pred, moves.snapshot))

    # ---- a restart -----------------------------------------------------------------------------

    @emits
    def restarted(self, ev: Restarted, scaling: Any) -> None:
        """After a restart's start: the moves and keyed state saved, or, re-homed without them
        (they went with our node), the groups our dead incarnation last said it owned, its
        outputs numbered above any it can have used, and the moves it had begun begun again."""
        moves, keyed, extra = self.moves, self.keyed, self.spec.extra
        if moves is not None and isinstance(ev.state.get("moves"), dict):
            moves.restore(ev.state["moves"])
        elif moves is not None and "owned_groups" in extra:
            self._resume_groups(extra["owned_groups"])
        if keyed is not None and ev.keyed is None and extra.get("min_epoch"):
            # Re-homed without our keyed state (it went with our node): our groups' output
            # counters are lost, and numbering their keys' outputs from 1 again would give ids the
            # sink has recorded (it drops them as copies). Numbered from the wall clock in us.
            assert moves is not None
            keyed.floor_groups(moves.member.owned, int(ev.wall * 1e6))
        if keyed is not None and ev.keyed is not None:
            again = keyed.restore(ev.keyed)
            keyed.hold_until_replicated()
            if again:  # outputs the successors had not acked: sent again (the sink drops copies)
                index = self.tracker.produced()
                keyed.outputs = [(index, it) for it in again]
                self.outputs.forward(list(again), index, self.clock.now)
        if moves is not None:
            self._cmds += moves.after_restart()
            if "moves_out" in extra and "owned_groups" in extra and not ev.state.get("moves"):
                self._cmds += moves.resume_moves(extra["moves_out"], scaling.core.preds)

    def _resume_groups(self, runs: Any) -> None:
        """Re-homed without our state: own what our dead incarnation last said it owned."""
        moves = self.moves
        assert moves is not None
        try:
            versions = groups_from_runs(runs, moves.groups)
        except TableError as exc:
            log.warning("re-homed without a usable list of our key groups (%s): we hold the dealing", exc,
                        extra=self.ctx)
            return
        try:
            moved_on = groups_from_runs(self.spec.extra.get("moved_on") or [], moves.groups)
        except TableError as exc:
            log.warning("re-homed without a usable list of the moves our siblings have seen (%s)", exc,
                        extra=self.ctx)
            moved_on = {}
        moves.resume_groups(versions, moved_on)
        log.info("re-homed: resuming our %d key groups", len(versions), extra=self.ctx)
