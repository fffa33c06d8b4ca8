"""An instance's key groups at its edges (docs/operators.md, "Key groups that move"): the hand-over
messages it receives, each to the side it concerns (a Redirect to the group table it routes by,
agent.instance.groups; the rest to the groups it holds, agent.instance.moves), a refused one
counted once, what a Start carries of both sides, the moves' view of a round's predecessors, and a
restart's groups and keyed state back.

Rules of this file: sans-IO, part of the `Instance` (agent.instance.core). `GroupSide` owns no
state: the table's side (`GroupRouting`) and the admission's log limiter are handed to it, and it
reaches the instance through its port (agent.instance.port), as agent.instance.moves does, whose
`on_redirect` it calls with that port. The scaling driver (None before the start) is passed per
call where it is read. No I/O, no clock, no random.

Why apart from the instance: the instance routes an event to this part without knowing which
side of a move it is on; what a hand-over message means for each side, and what a re-homed keyed
instance takes back of its groups, is read here in one place.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

from agent.dataplane.inbound import LogLimiter
from agent.dataplane.owners import TableError, groups_from_runs
from agent.instance.events import Restarted
from agent.instance.groups import GroupRouting
from agent.instance.moves import HandoverError, body_size, decode, on_redirect
from agent.instance.port import InstancePort

__all__ = ["GroupSide"]

log = logging.getLogger("agent.instance.worker")


class GroupSide:
    """The key groups' side of instance `w`'s events; `routing`: its group table's side (off where
    it routes to no keyed operator); `w.moves`: the groups it holds (None where it is not keyed)."""

    def __init__(self, w: InstancePort, routing: GroupRouting, refusals: LogLimiter) -> None:
        self.w = w
        self.routing = routing
        self._refusals = refusals  # shared with the admission: one bound on the log lines per sender

    # ---- hand-over messages in -----------------------------------------------------------------

    def on_message(self, sender: str, body: Dict[str, Any]) -> None:
        """A hand-over message (its type in HANDOVER_TYPES), counted apart from the paper's protocol."""
        w = self.w
        w.stats["handover_in"] += 1
        w.stats["handover_bytes_in"] += body_size(body)
        if body["type"] == "redirect" and self.routing.on:
            try:
                msg, _ = decode(sender, body, w.router.groups)
            except ValueError as exc:
                self.error(sender, str(exc))
                return
            if w.router.table is None:  # an idle copy: its table comes with its Start
                self.routing.hold(sender, msg, w.router.groups)
                return
            self.take_redirect(sender, msg)
        elif w.moves is not None:
            w.moves.on_message(sender, body)
        else:
            self.error(sender, f"{body['type']} to an instance that is not keyed")

    def take_redirect(self, sender: str, msg: Any) -> None:
        """A decoded Redirect onto our table (agent.instance.moves `on_redirect`), reported in the
        heartbeat when it changed the group's version (`GroupRouting.took`)."""
        w = self.w
        table = w.router.table
        before = table.version(msg.group) if table is not None else None  # group checked by decode
        try:
            on_redirect(w, sender, msg)
        except HandoverError as exc:
            self.error(sender, str(exc))
            return
        if table is not None and table.version(msg.group) != before:
            self.routing.took(msg.group, sender, msg.new, table.version(msg.group), w.now)

    def error(self, sender: str, why: str) -> None:
        """A hand-over message refused, here or in agent.instance.moves: counted once, in one place,
        logged within the bound per sender and in all."""
        self.w.stats["handover_errors"] += 1
        if self._refusals.allow((sender, "handover"), self.w.now):
            log.warning("hand-over from %s: %s", sender[:64], why, extra=self.w.ctx)

    # ---- a Start, both ways; a round's new predecessors -----------------------------------------

    def start_field(self, copy: str) -> Optional[Dict[str, Any]]:
        """The extra field of a Start we send `copy` (agent.instance.groups): our group table, and
        a keyed instance's share of its groups for the copy (agent.instance.moves)."""
        w = self.w
        out = self.routing.start_field(w.router)
        if w.moves is not None:
            out = dict(out or {}, share=[list(x) for x in w.moves.share_for(copy)])
        return out

    def on_start_field(self, field: Any, succs: Tuple[str, ...], scaling: Any) -> None:
        """Our Start arrived (we are a copy; the Activate that follows sets `succs`): our
        creator's group table, or (keyed) the groups it hands us, before any record."""
        w = self.w
        waiting = self.routing.from_start(w.router, field, succs, w.ctx)
        if waiting is not None:
            w.mark_state_changed()
            for sender, msg in waiting:  # came before our Start (another channel): taken now
                self.take_redirect(sender, msg)
        if w.moves is not None and scaling is not None and scaling.core.creator:
            w.moves.take_share(field, scaling.core.creator)
            w.mark_state_changed()

    def preds_changed(self, added: Tuple[str, ...], removed: Tuple[str, ...]) -> None:
        """A predecessor's round reached us: the groups moving out wait for a new predecessor's
        Eos too (its table may route them here), and a departed one's Eos is not awaited (its
        deletion is behind all it sent us). Through the instance's two hooks, which the checker's
        seeded faults `no_add_pred` and `no_remove_pred` replace."""
        w = self.w
        if w.moves is None:
            return
        for p in added:
            w.await_joined_pred(w.moves, p)
        for p in removed:
            w.forget_departed_pred(w.moves, p)
        w.mark_state_changed()

    # ---- a restart -----------------------------------------------------------------------------

    def restarted(self, ev: Restarted, scaling: Any) -> None:
        """After a restart's start: the moves and keyed state saved, or, re-homed without them
        (they went with our node), the groups our dead incarnation last said it owned, its
        outputs numbered above any it can have used, and the moves it had begun begun again."""
        w = self.w
        moves, keyed, extra = w.moves, w.keyed, w.spec.extra
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
                index = w.tracker.produced()
                keyed.outputs = [(index, it) for it in again]
                w.forward_outputs(list(again), index)
        if moves is not None:
            moves.after_restart()
            if "moves_out" in extra and "owned_groups" in extra and not ev.state.get("moves"):
                n = moves.resume_moves(extra["moves_out"], scaling.core.preds)
                if n:
                    log.info("re-homed: the moves of %d key groups their new owners wait for start again", n,
                             extra=w.ctx)

    def _resume_groups(self, runs: Any) -> None:
        """Re-homed without our state: own what our dead incarnation last said it owned."""
        w = self.w
        moves = w.moves
        assert moves is not None
        try:
            versions = groups_from_runs(runs, moves.groups)
        except TableError as exc:
            log.warning("re-homed without a usable list of our key groups (%s): we hold the dealing", exc,
                        extra=w.ctx)
            return
        try:
            moved_on = groups_from_runs(w.spec.extra.get("moved_on") or [], moves.groups)
        except TableError as exc:
            log.warning("re-homed without a usable list of the moves our siblings have seen (%s)", exc,
                        extra=w.ctx)
            moved_on = {}
        moves.resume_groups(versions, moved_on)
        log.info("re-homed: resuming our %d key groups", len(versions), extra=w.ctx)
