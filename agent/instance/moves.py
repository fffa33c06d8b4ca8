"""The hand-over of key groups inside the Instance: the messages of agent.instance.handover as
envelopes on the data plane, the keyed instance's `Member`, the predecessors' Redirect
(docs/operators.md, "Key groups that move").

Rules of this file: sans-IO, part of the `Instance` (agent.instance.core), like the scaling
driver. Everything from the bus is hostile (docs/security.md): a hand-over message is decoded
by `decode` (agent.instance.handover_wire), which checks every field and bounds every size
before anything is built; a message the hand-over cannot take in its state is counted (the
instance's `handover_errors`, one counter for the predecessor's side and the keyed instance's),
logged, skipped.

The messages travel as protocol envelopes (kind "p") on the numbered channels, so each is in
FIFO order with the data batches of its channel (docs/design.md invariant 1): an Eos from a
predecessor is behind every record of the group it sent before. They are counted apart from
the paper's messages (`handover_out`/`handover_in`, and their bytes). Body:

    {"type": "redirect", "g": group, "new": instance, "v": version}     owner -> each predecessor
    {"type": "eos", "g": group}                                         predecessor -> owner
    {"type": "offer", "g": group, "v": version}                         leaver -> survivor
    {"type": "state_chunk", "g": group, "i": index, "n": total, "data": base64, "v": version,
     "e": epoch}                                                        old -> new owner
    {"type": "installed", "g": group}                                   new -> old owner

Old and new owner are siblings (instances of the same operator), which the receive path admits
only for these messages (`Instance._sender_allowed`).

Records the keyed instance cannot apply yet (a group on its way to it, or not announced yet:
`Member.early`) are held with their input index; that input is not acked upstream until they
are applied, saved and their outputs acked downstream (`lowest_held`; acks are end to end,
agent.instance.applied), so a predecessor still holds them, and its credit
window bounds how many wait. A hard bound (`HOLD_MAX`) guards against a sender that ignores
credit.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from agent.dataplane.envelope import Item
from agent.dataplane.keygroups import key_group, record_key
from agent.dataplane.owners import group_runs, split_share
from agent.instance.handover import (
    Apply, Eos, Forget, HandoverError, Install, Installed, Member, Offer, Redirect, Send, StateChunk,
    chunks,
)
# the codec, re-exported: the instance's receive path reaches it through this module
from agent.instance.handover_wire import HANDOVER_TYPES, MAX_CHUNKS, MAX_NAME, body_size, decode, encode, int_field
from agent.instance.emitter import Emitter, emits
from agent.instance.moves_parts import MovesParts, refuse, send_handover

__all__ = ["HANDOVER_TYPES", "MAX_CHUNKS", "HOLD_MAX", "HAND_OUT_BUDGET", "GroupMoves", "HandoverError", "decode",
           "encode", "body_size"]

log = logging.getLogger("agent.instance.worker")

HOLD_MAX = 200_000  # records held for groups not installed or not announced yet (honest: a credit window)
# A move silent this long is asked along again (messages a crash lost: a Redirect or an Eos, the
# chunks or the Installed): the Redirect to each predecessor whose Eos is missing (one that has
# taken it answers with its Eos at once), the chunks to a new owner that has not said Installed
# (one that has installed the group says it again). Both answers are idempotent.
MOVE_RESEND = 10.0
# Bytes of group state serialized and sent per turn of the loop (at least one group per turn):
# the groups whose state is final wait in `queue`, so that the other groups' records are
# processed between (docs/operators.md, "Key groups that move", step 5). ~5 ms of JSON unloaded.
HAND_OUT_BUDGET = 64_000

# The seeded faults of the moves (the checker's `held_applied_at_once`, `leave_with_groups`,
# `held_acked_at_save` and `no_redirect_resend`) are subclasses it installs
# (foglab.sim.instance_faults): no branch here.


class GroupMoves(Emitter):
    """The keyed instance's side: its `Member` (which groups it holds, hands out, expects), the
    version of each group it holds (the Redirects it sends carry the next one), and what it
    holds back until a group is installed. Its entry points return their commands (`emits`)."""

    # A move silent for MOVE_RESEND sends its Redirect again to each predecessor whose Eos is
    # missing: one lost (a broker rollback) would leave the move waiting forever (False only in
    # the checker's seeded fault `no_redirect_resend`, foglab.sim.instance_faults).
    resends_redirects = True

    def __init__(self, me: str, keyed: Any, owned: Iterable[int], versions: Optional[Dict[int, int]] = None) -> None:
        super().__init__()
        self.me = me
        self.parts: Any = None  # MovesParts: what it acts through, handed by `bind`
        self.keyed = keyed
        self.groups = keyed.groups
        self.key_field = keyed.key_field
        self.member = Member(me, owned)
        self.versions: Dict[int, int] = dict(versions) if versions is not None else {g: 0 for g in self.member.owned}
        # group -> the newest move of it towards us we have seen (Offer, Start share or chunk), or
        # away from us once its new owner installed it: never dropped, so that a chunk sent again
        # for a move we completed long ago is told Installed, an Offer sent again for one is not
        # taken, and a chunk of a newer move whose Offer a crash lost is taken as that Offer
        self.seen: Dict[int, int] = {}
        self.held = 0  # records in the member's buffers (new.buffer and early)
        self.shares: Dict[str, List[Tuple[int, int]]] = {}  # copy -> [(group, version)] its Start names
        # group -> (new owner, version, chunk bodies): its state final (every Eos in), kept in
        # the keyed state (frozen: no timer fires) until Installed; the bodies are made by
        # `hand_out_turn` (empty until then) and kept in memory only, for a resend after a silence.
        # The instance state names the group, not its bytes: a restart makes them again.
        self.outgoing: Dict[int, Tuple[str, int, List[Dict[str, Any]]]] = {}
        self.queue: List[int] = []  # groups of `outgoing` to serialize, in the order their state became final
        # chunks received, not taken in yet (`take_in_turn`): (sender, body, chunk, version). Not
        # saved: lost in a crash, they come again after the old owner's silence (MOVE_RESEND)
        self.inbox: List[Tuple[str, Dict[str, Any], StateChunk, int]] = []
        self.budget = HAND_OUT_BUDGET
        # group -> the epoch of the old owner's serialization whose chunks we are collecting: a
        # restarted old owner serializes again, and chunks of two serializations never mix
        self.attempts: Dict[int, int] = {}
        self.last_heard: Dict[int, float] = {}  # group moving out -> when it last made progress
        self.leaving = False  # decided to terminate: hands every group to the keeper first
        self.unconfirmed: Set[int] = set()  # groups of the last decision's moves not Installed yet
        # What waits for the end of the loop's turn (`flush`): one keyed save and one state write
        # for all the Eos, chunks and installs of the turn, then the messages they allow.
        self.flush_due = False
        self.restored = False  # the member came from the saved state (`restore`)
        self.resumed = False  # the member came from a re-home's plan (`resume_groups`)
        self.to_forget: List[int] = []  # installed at their new owner: dropped from the keyed state after the write
        self.deferred: List[Tuple[str, Dict[str, Any]]] = []  # (dest, body): chunks, Installed
        # with a standby copy: (save token, the turn's deferred messages), until the standby holds it
        self.after_copy: List[Tuple[Tuple[int, int], List[Tuple[str, Dict[str, Any]]]]] = []
        # groups installed here whose Installed has not left yet (it waits for the standby copy of
        # the save that installed them): group -> (old owner, the move's version). Until it leaves,
        # the old owner still holds the state and this node's loss loses our install of it, so the
        # heartbeat reports them as on their way here (`stats`), not as ours (agent.node.rehome)
        self.installing: Dict[int, Tuple[str, int]] = {}
        # every group installed here -> its old owner, saved: a leaver says Installed again for each
        # (`installed_again`). Its first Installed can be lost (kept in memory until the standby
        # copy holds the save, when a drain ends the worker; or in a broker that lost our session)
        # and once we have left, the old owner's chunks sent again after the silence reach nobody:
        # it would wait for that Installed for ever, busy, and never scale in
        self.installed_from: Dict[int, str] = {}
        # fresh index of held records' outputs -> the lowest input index they came in with: that
        # input stays unacked until those outputs are acked downstream (`lowest_held`)
        self.forwarding: Dict[int, int] = {}
        # (the errors are the instance's one `handover_errors` counter: `_error`)
        self.counts: Dict[str, int] = {"groups_out": 0, "groups_in": 0, "held_records": 0, "hold_dropped": 0}
        # wall times for `fog-agent demo`'s decision -> first record split (docs/measurement.md):
        # the first group installed here, the first record applied (a copy's first records are
        # held until then: the instance's first_record_at says only that they arrived)
        self.first_installed_at: Optional[float] = None
        self.first_applied_at: Optional[float] = None

    # ---- records -------------------------------------------------------------------------------------

    def admit(self, sender: str, items: List[Item], index: int) -> List[Item]:
        """The records of one input batch to apply now; the others wait in the member (a group on
        its way here, or not announced yet), with their input index."""
        m = self.member
        owned = m.new.owned
        if not m.busy():
            groups = [key_group(record_key(it[2], self.key_field), self.groups) for it in items]
            if all(g in owned for g in groups):
                self._applied(items)
                return items
        now: List[Item] = []
        for it in items:
            g = key_group(record_key(it[2], self.key_field), self.groups)
            if g in owned and g not in m.old.moving:
                now.append(it)
                continue
            if g not in owned and g not in m.new.expected and self._replayed(it):
                # A group that left: a predecessor's replay of a record applied here before its
                # Eos (after our restart, say; `flush` saves those records before the Eos is
                # remembered): a duplicate, never a record to hold. Not every record of a group
                # that left is one: the group may be on its way back (its Offer still to come).
                self.counts["replays_after_move"] = self.counts.get("replays_after_move", 0) + 1
                continue
            if g not in owned and self.held >= HOLD_MAX:
                self.counts["hold_dropped"] += 1
                self._error(sender, f"hold full ({HOLD_MAX} records): record of group {g} dropped")
                continue
            try:
                outs = m.on_record(sender, g, (it, index))
            except HandoverError as exc:
                if self._replayed(it):
                    self.counts["replays_after_move"] = self.counts.get("replays_after_move", 0) + 1
                    continue  # applied here before its Eos, replayed by a predecessor since
                self._error(sender, str(exc))
                continue
            if outs:
                now.append(it)  # Apply: owned (moving out, still before its Eos)
            else:
                self.held += 1
                self.counts["held_records"] += 1
        self._applied(now)
        return now

    def _applied(self, records: List[Any]) -> None:
        if records and self.first_applied_at is None:
            self.first_applied_at = self.parts.clock.wall()

    def groups_in(self, items: List[Item]) -> Set[int]:
        """The key groups of these records (agent.instance.queues, `eos_ahead`: may an Eos pass them?)."""
        return {key_group(record_key(it[2], self.key_field), self.groups) for it in items}

    def _replayed(self, it: Item) -> bool:
        a = self.keyed.applied.get(it[0])
        return a is not None and it[1] in a

    def lowest_held(self, forwarding: Any = False) -> Optional[int]:
        """The lowest input index with records held, or applied with outputs not acked downstream
        yet: not acked upstream yet (applied, not saved or not replicated: the keyed state's
        `came_in_with`). `forwarding`: the instance's
        `lowest_forwarding()` if the caller has it.

        Held records are applied under a fresh index (`_apply`), above the index they came in
        with; saved, only that fresh index would hold their outputs, and the input they came in
        with would be acked while those outputs are still on their way. Acks are end to end
        (agent.instance.applied): the source's floor claim would then pass them and the next
        keyed operator skip them as replays (CHANGELOG.md,
        "Held records acked before their outputs")."""
        if self.forwarding:
            low = self.parts.pending.lowest_forwarding() if forwarding is False else forwarding
            for idx in [i for i in self.forwarding if low is None or i < low]:
                del self.forwarding[idx]  # every output of it acked
        lows = list(self.forwarding.values())
        if self.held:
            for bufs in (self.member.new.buffer, self.member.early):
                for recs in bufs.values():
                    lows += [r[1][1] for r in recs]
        return min(lows) if lows else None

    def saved(self) -> None:
        """The keyed state is being saved (its SaveKeyed is out): the held records applied since
        are on disk, and the groups we own go with it (`KeyedState.owned`, what a standby copy
        says we hold: agent.node.rehome reads it when our node is lost before its retained state
        shows a move)."""
        self.keyed.owned = self.reported_groups()

    # ---- messages ------------------------------------------------------------------------------------

    @emits
    def on_message(self, sender: str, body: Any) -> None:
        try:
            msg, version = decode(sender, body, self.groups)
            if isinstance(msg, Eos):
                if msg.group in self.member.old.gone and msg.group not in self.member.old.moving:
                    return  # asked again after a crash: it came twice
                outs = self.member.on_eos(msg, self.snapshot)
                self.last_heard[msg.group] = self.parts.clock.now
                # The records before this Eos are saved before the member's memory of it is
                # (`flush`): a replay of them after a crash is then a duplicate (`_replayed`).
                self.flush_due = True
            elif isinstance(msg, Offer):
                n = self.member.new
                if 0 <= version <= self.seen.get(msg.group, -1) and msg.group not in n.owned and msg.group not in n.expected:
                    # A move we have had the group at a newer version than (we installed it, or
                    # resumed it re-homed, and have handed it on since): its old owner sent the
                    # Offer again. Taken, we held the group a second time with the old owner's older
                    # state: two owners (CHANGELOG.md, "A re-homed new owner took its old
                    # owner's Offer again after handing the group on"). Its chunks are answered
                    # Installed.
                    self.counts["stale_offers"] = self.counts.get("stale_offers", 0) + 1
                    return
                outs = self.member.on_offer(sender, msg)
                self.versions[msg.group] = version
                self.seen[msg.group] = max(version, self.seen.get(msg.group, -1))
                # Written before the Offer's ack leaves (`flush` comes before the turn's acks):
                # acked and then lost in a crash, the leaver would never send it again, and we
                # would answer its chunks, sent again after the silence, as a group installed.
                self.flush_due = True
            elif isinstance(msg, StateChunk):
                # installed a budget per turn (`take_in_turn`): a leaver's 64 groups arriving
                # together would stall our other groups' records as a hand-out in one turn did
                if "e" in body:
                    int_field(body, "e", -1, 2 ** 53)  # checked now: nothing malformed waits
                self.inbox.append((sender, body, msg, version))
                return
            elif isinstance(msg, Installed):
                if msg.group not in self.member.old.waiting_install or self.outgoing.get(msg.group, ("",))[0] != sender:
                    # said again for chunks we sent again, or by a leaver for a move of the group
                    # that is over (`installed_again`): only the new owner of our move confirms it
                    return
                outs = self.member.on_installed(msg)
                self.outgoing.pop(msg.group, None)
                self.last_heard.pop(msg.group, None)
                # dropped from the keyed state only after the instance state without it is written
                # (`flush`): a crash in between finds the group in the keyed file, not outgoing: stale
                self.to_forget.append(msg.group)
                self.flush_due = True
                if msg.group in self.unconfirmed:
                    self.unconfirmed.discard(msg.group)
                    if not self.unconfirmed:
                        self._groups_moved()  # every group of the decision is processed at its new owner
            else:
                raise HandoverError(f"{type(msg).__name__} of group {msg.group} to a keyed instance")
        except (HandoverError, ValueError) as exc:
            self._error(sender, str(exc))
            return
        self.perform(outs)

    @emits
    def take_in_turn(self) -> None:
        """Once per turn of the loop: the chunks received, in their order, up to `budget` bytes
        (at least one chunk). A group waiting here is still expected: its records are held."""
        spent = 0
        while self.inbox and (spent == 0 or spent < self.budget):
            sender, body, msg, version = self.inbox.pop(0)
            spent += len(msg.data) + 1
            try:
                outs = self._on_chunk(sender, body, msg, version)
            except (HandoverError, ValueError) as exc:
                self._error(sender, str(exc))
                continue
            self.perform(outs)

    def _on_chunk(self, sender: str, body: Dict[str, Any], msg: StateChunk, version: int) -> List[Any]:
        """One chunk of a group moving here, in its turn (`take_in_turn`): the outputs to perform."""
        n = self.member.new
        g = msg.group
        if (n.expected.get(g) != sender and version > self.seen.get(g, -1) and g not in n.owned
                and g not in n.expected):
            # A newer move than any we have seen: its Offer was lost in our crash (taken,
            # not yet written): the chunk stands for it.
            self.member.on_offer(sender, Offer(g))
            self.versions[g] = self.seen[g] = version
            self.counts["offers_from_chunks"] = self.counts.get("offers_from_chunks", 0) + 1
        if n.expected.get(g) != sender:
            # Sent again (our Installed was lost, or the old owner restarted) for a group we
            # installed, and may have handed on since: Installed again, so that it stops.
            self.deferred.append((sender, encode(Installed(g))))
            self.flush_due = True
            return []
        e = int_field(body, "e", -1, 2 ** 53) if "e" in body else -1
        if self.attempts.get(g, e) != e and n.parts.get(g):
            n.parts[g] = {}  # a restarted old owner serialized the group again: its chunks only
            self.counts["chunks_restarted"] = self.counts.get("chunks_restarted", 0) + 1
        self.attempts[g] = e
        if msg.index in n.parts.get(msg.group, {}):
            return []  # a chunk sent again while the others are on their way
        return self.member.on_chunk(sender, msg)

    @emits
    def start(self, group: int, new: str, preds: Iterable[str], offer: bool = True) -> None:
        """Hand `group` to `new` (its version rises by one: the Redirects carry it)."""
        self.start_many([group], new, preds, offer)

    @emits
    def start_many(self, groups: Iterable[int], new: str, preds: Iterable[str], offer: bool = True) -> None:
        """Hand `groups` to `new`, each at its next version; one state write for all of them."""
        started = []
        for group in groups:
            v = self.versions.get(group, 0) + 1
            self.versions[group] = v
            started.append((self.member.start(group, new, sorted(preds), v, offer=offer), v))
            self.last_heard[group] = self.parts.clock.now
        if not started:
            return
        self.parts.cadence.changed()
        self._persist()  # write-ahead: a restart finds the moves before any Redirect left
        for outs, v in started:
            self.perform(outs, version=v)

    def expect(self, group: int, old: str, version: int) -> None:
        """A copy's share, named in its Start: `group` comes from `old` (its creator)."""
        self.member.expect(group, old)
        self.versions[group] = version
        self.seen[group] = max(version, self.seen.get(group, -1))

    # ---- rounds ---------------------------------------------------------------------------------------

    def share_for(self, copy: str) -> List[Tuple[int, int]]:
        """The groups our Start hands `copy` (our duplication round is complete), with the version
        each will have: about half of those we hold and are not moving (`split_share`; the same
        list if the Start is sent again), balanced by their measured load (`KeyedState.load`)."""
        if copy not in self.shares:
            m = self.member
            mine = [g for g in m.owned if g not in m.old.moving]
            self.shares[copy] = [(g, self.versions.get(g, 0) + 1) for g in split_share(mine, self.keyed.load)]
        return self.shares[copy]

    @emits
    def start_share(self, copy: str, preds: Iterable[str]) -> None:
        """The Start naming the share is sent: each group's move begins (Redirects to every
        predecessor; no Offer, the Start said it)."""
        gs = [g for g, _ in self.shares.get(copy, ()) if g in self.member.owned and g not in self.member.old.moving]
        self.unconfirmed.update(gs)
        self.start_many(gs, copy, preds, offer=False)

    def take_share(self, field: Any, creator: str) -> None:
        """Our Start's share (untrusted: bounded by the group count): expected from our creator
        before any record is applied."""
        share = field.get("share") if isinstance(field, dict) else None
        if not isinstance(share, list) or len(share) > self.groups:
            if share is not None:
                self._error(creator, "malformed share in our Start")
            return
        for pair in share:
            if (not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) is not int
                    or not 0 <= pair[0] < self.groups or type(pair[1]) is not int):
                self._error(creator, "malformed share in our Start")
                continue
            try:
                self.expect(pair[0], creator, pair[1])
            except HandoverError as exc:
                self._error(creator, str(exc))

    @emits
    def hand_rest(self, keeper: str, preds: Iterable[str]) -> None:
        """Leaving: every group we hold and do not move yet goes to the keeper, which never
        terminates (a leaver does not know its other siblings; docs/operators.md)."""
        m = self.member
        gs = [g for g in sorted(m.owned) if g not in m.old.moving]
        self.unconfirmed.update(gs)
        self.start_many(gs, keeper, preds, offer=True)

    @emits
    def resend_silent(self, now: float) -> None:
        """Moves silent for MOVE_RESEND: the Redirect again to each predecessor whose Eos is
        missing, the chunks again to a new owner that has not said Installed."""
        m = self.member
        for g, (new, left) in sorted(m.old.moving.items()):
            if now - self.last_heard.get(g, now) >= MOVE_RESEND and self.resends_redirects:
                self.last_heard[g] = now
                for p in sorted(left):
                    self._send(p, Redirect(g, new, m.old.versions.get(g, -1)))
                self.counts["moves_resent"] = self.counts.get("moves_resent", 0) + 1
        for g, (new, _, bodies) in sorted(self.outgoing.items()):
            if bodies and now - self.last_heard.get(g, now) >= MOVE_RESEND:
                self.last_heard[g] = now
                for body in bodies:
                    self._send_body(new, body)
                self.counts["moves_resent"] = self.counts.get("moves_resent", 0) + 1

    def ready_to_leave(self) -> bool:
        """Decided to leave (`leaving`): our Deletion starts only once we hold no group and no
        move is under way (docs/operators.md, "Key groups that move"). A group still ours, or
        one on its way here, would leave with us: its state and the records held for it kept
        by nobody, while the predecessors' tables still route it to us."""
        return self.leaving and not self.member.owned and not self.member.busy()

    def snapshot(self, group: int) -> bytes:
        """Every Eos of the group is in: its state is final. Not serialized here (a duplication's
        64 groups of 80 kB each stalled the loop for a second): frozen, and queued
        for `hand_out_turn`; the member's chunk of these empty bytes is dropped (`perform`)."""
        self.keyed.freeze_group(group)
        return b""

    def hand_out_turn(self) -> None:
        """Once per turn of the loop, before `flush`: the next groups of `queue`, up to `budget`
        bytes of state (at least one group), serialized and cut into chunks, which leave after
        the turn's keyed save (`flush`). The other groups' records are processed between turns."""
        spent = 0
        if len(self.queue) > 1:
            # the busiest groups first: their records wait at the new owner until their state is there
            load = self.keyed.load
            self.queue.sort(key=lambda g: -load.get(g, 0.0))
        while self.queue and (spent == 0 or spent < self.budget):
            g = self.queue.pop(0)
            entry = self.outgoing.get(g)
            if entry is None or entry[2]:
                continue  # installed meanwhile (a restart's leftover) or made already
            new, v, _ = entry
            data = self.keyed.hand_out(g, forget=False)
            bodies = [dict(encode(c), v=v, e=self.parts.incarnation.epoch) for c in chunks(g, data, self.member.old.max_chunk)]
            self.outgoing[g] = (new, v, bodies)
            self.deferred += [(new, b) for b in bodies]
            self.last_heard[g] = self.parts.clock.now
            spent += len(data)
            self.counts["hand_out_turns_groups"] = self.counts.get("hand_out_turns_groups", 0) + 1
            self.flush_due = True
        if spent:
            self.counts["hand_out_turns"] = self.counts.get("hand_out_turns", 0) + 1

    @emits
    def flush(self) -> None:
        """End of the loop's turn (Instance._on_tick, after the queues): the keyed state (the
        records before each Eos, the groups taken in, those handed out still in it), then the
        instance state (the member: Eos taken, groups gone with their chunks, groups installed),
        then the messages they allow. One save and one write per turn, whatever the number of
        groups that moved in it (each had cost two file writes with their fsyncs)."""
        if not self.flush_due:
            return
        self.flush_due = False
        self._save_keyed()
        for g in self.to_forget:
            if g not in self.member.owned and g not in self.outgoing:
                self.keyed.forget_group(g)
        self.to_forget = []
        deferred, self.deferred = self.deferred, []
        if self.keyed.replicated_acks and deferred:
            # An Installed says the group is safe here: only once the standby holds the save
            # that installed it (agent.node.replicas), or losing this node would lose the group.
            self.after_copy.append((self.keyed.saved_token(), deferred))
            return
        for dest, body in deferred:
            self._send_deferred(dest, body)

    @emits
    def replicated(self, token: Tuple[int, int]) -> None:
        """The standby holds the saves up to `token`: the messages that waited for them go."""
        while self.after_copy and self.after_copy[0][0] <= token:
            for dest, body in self.after_copy.pop(0)[1]:
                self._send_deferred(dest, body)

    def _send_deferred(self, dest: str, body: Dict[str, Any]) -> None:
        """A message that waited for the turn's save (and its standby copy) leaves; an Installed
        makes its group ours in the heartbeat from now on (`installing`)."""
        if body.get("type") == "installed":
            self.installing.pop(body.get("g"), None)  # type: ignore[arg-type]
        self._send_body(dest, body)

    @emits
    def perform(self, outs: List[Any], version: int = -1) -> None:
        p = self.parts
        forgot = [o.group for o in outs if isinstance(o, Forget)]
        for g in forgot:
            # state final (`snapshot`): the chunks come from `hand_out_turn`, with the move's
            # version (read before the Forget below drops it)
            dest = next(o.dest for o in outs if isinstance(o, Send) and isinstance(o.message, StateChunk)
                        and o.message.group == g)
            self.outgoing[g] = (dest, self.versions.get(g, -1), [])
            self.queue.append(g)
            self.last_heard[g] = p.clock.now
        if forgot:
            self.flush_due = True  # the Eos taken are written before anything else (`flush`)
            self._stamp("chunks_at")  # every Eos of a group in: its state is final (the split's hand-over)
        for o in outs:
            if isinstance(o, Send) and isinstance(o.message, StateChunk):
                continue  # `snapshot`'s empty bytes: the state leaves from `hand_out_turn`
            elif isinstance(o, Send) and isinstance(o.message, Installed):
                self.deferred.append((o.dest, encode(o.message)))
                self.installing[o.message.group] = (o.dest, self.versions.get(o.message.group, -1))
                self.installed_from[o.message.group] = o.dest
                self.flush_due = True
            elif isinstance(o, Send):
                msg = o.message
                if isinstance(msg, Offer):
                    self._send(o.dest, msg, {"v": version})
                else:
                    self._send(o.dest, msg)
            elif isinstance(o, Install):
                if o.group in self.keyed.frozen:
                    # back before the turn's write forgot what we handed out: that is stale
                    self.keyed.forget_group(o.group)
                if o.group in self.keyed.states or o.group in self.keyed.emitted:
                    pass  # installed before a crash, the state write of it lost: the saved one stands
                else:
                    try:
                        self.keyed.take_in(o.group, o.data)
                    except (ValueError, TypeError, KeyError, RecursionError) as exc:
                        # bytes no hand_out wrote (forged, or a bug): the group starts empty here
                        self._error(self.member.name, f"state of group {o.group} not installed: {str(exc)[:200]}")
                self.counts["groups_in"] += 1
                self.flush_due = True
                if self.first_installed_at is None:
                    self.first_installed_at = p.clock.wall()
            elif isinstance(o, Apply):
                self._apply(o)
            elif isinstance(o, Forget):
                v = self.versions.pop(o.group, None)
                if v is not None:  # handed on at v: a move of it towards us up to v is over
                    self.seen[o.group] = max(v, self.seen.get(o.group, -1))
                self.counts["groups_out"] += 1
        if any(isinstance(o, Install) for o in outs):
            idx = p.tracker.produced()
            out = self.keyed.fire_due(idx)  # windows of the group our watermark has passed already
            if out:
                p.outputs.forward(out, idx, p.clock.now)

    def _apply(self, a: Apply) -> None:
        """Held records of a group now installed here, in arrival order, under a fresh index (the
        keyed outputs' indices only grow); their inputs are released once the state is saved and
        the outputs are acked downstream (`lowest_held`)."""
        p = self.parts
        self.held -= len(a.records)
        self._applied(a.records)
        run: List[Item] = []
        low = 0  # the lowest input index of the run
        last: Optional[str] = None
        for sender, (item, index) in list(a.records) + [(None, (None, None))]:
            if sender != last and run:
                idx = p.tracker.produced()
                out = self.keyed.apply(last, run, idx, judge_late=False)
                self.keyed.came_in_with(low)
                if out:
                    p.outputs.forward(out, idx, p.clock.now)
                    self._input_waits_for_outputs(idx, low)
                run = []
            if sender is None:
                break
            low = index if not run else min(low, index)
            last = sender
            run.append(tuple(item))  # type: ignore[arg-type]

    def _input_waits_for_outputs(self, idx: int, low: int) -> None:
        """Held records applied under fresh index `idx` keep the input they came in with, `low`,
        unacked upstream until their outputs are acked downstream (`lowest_held`): acks are end
        to end, and acked at the save alone, the source's floor claim would pass records whose
        outputs are still on their way."""
        self.forwarding[idx] = low

    # ---- saved with the instance state -----------------------------------------------------------

    def dump(self) -> Dict[str, Any]:
        member = self.member.to_json()
        # Held records are not saved: their inputs are not acked (`lowest_held`), so the
        # predecessors replay them to a restarted instance.
        member["buffer"] = [[g, []] for g, _ in member["buffer"]]
        member["early"] = []
        return {"member": member, "versions": sorted([g, v] for g, v in self.versions.items()),
                "seen": sorted([g, v] for g, v in self.seen.items()),
                "shares": {c: [list(x) for x in sh] for c, sh in self.shares.items()},
                "leaving": self.leaving,
                "attempts": sorted([g, e] for g, e in self.attempts.items()),
                "outgoing": [[g, new, v] for g, (new, v, _) in sorted(self.outgoing.items())],
                "installed_from": sorted([g, old] for g, old in self.installed_from.items())}

    def restore(self, d: Dict[str, Any]) -> None:
        """What `dump` saved (our own file: trusted as the rest of the instance state)."""
        self.member = Member.from_json(d["member"])
        self.versions = {int(g): int(v) for g, v in d.get("versions") or []}
        self.seen = {int(g): int(v) for g, v in d.get("seen") or []}
        self.held = 0
        self.restored = True
        # [group, new owner, version]; in older files [group, new owner, chunk bodies]
        self.outgoing = {}
        for g, new, x in d.get("outgoing") or []:
            bodies = list(x) if isinstance(x, list) else []
            v = int(x) if not isinstance(x, list) else (int(bodies[0].get("v", -1)) if bodies else -1)
            self.outgoing[int(g)] = (str(new), v, bodies)
        self.queue = sorted(g for g, (_, _, bodies) in self.outgoing.items() if not bodies)
        self.attempts = {int(g): int(e) for g, e in d.get("attempts") or []}
        # asked along at the first check after the restart: what the crash lost is sent again
        self.last_heard = {g: self.parts.clock.now - MOVE_RESEND for g in list(self.member.old.moving) + list(self.outgoing)}
        self.shares = {str(c): [(int(g), int(v)) for g, v in sh] for c, sh in (d.get("shares") or {}).items()}
        self.leaving = bool(d.get("leaving"))
        self.installed_from = {int(g): str(old) for g, old in d.get("installed_from") or []}

    @emits
    def installed_again(self) -> None:
        """Leaving (every group handed on and installed at its new owner): Installed again to the
        old owner of each group we installed, which drops it unless it still waits for that move
        (an Installed lost on its way). Our new owners hold the groups now: nothing waits for a
        copy."""
        for g, old in sorted(self.installed_from.items()):
            self._send(old, Installed(g))
        self.installed_from = {}

    @emits
    def after_restart(self) -> None:
        """The keyed state is loaded. A group on its way out (`outgoing`) stays in it, frozen, and
        is serialized again (`queue`); one the saved member does not hold otherwise left here
        before the crash (installed at its new owner, the keyed file's forgetting of it lost) and
        is forgotten; so is one of an older file, whose chunks the instance state held."""
        held = set(self.keyed.states) | set(self.keyed.emitted)
        stale = {g for g, (_, _, bodies) in self.outgoing.items() if bodies and g in held}
        if self.restored or self.resumed:
            # Resumed (re-homed with a standby copy): a group the copy holds that the re-home did
            # not give us moved on to an owner that holds it at a newer version; kept, its
            # timers fired its windows here a second time, with older contents.
            stale |= held - self.member.owned - {g for g, (_, _, bodies) in self.outgoing.items() if not bodies}
        for g in sorted(stale):
            self.keyed.hand_out(g)
        for g in self.queue:
            self.keyed.freeze_group(g)
        if stale:
            self._save_keyed()

    def resume_groups(self, versions: Dict[int, int], moved_on: Optional[Dict[int, int]] = None) -> None:
        """A re-homed incarnation whose state was lost with its node: it owns the groups, at their
        versions, that its dead incarnation last said it owned (its node's retained state,
        agent.node.rehome), not the dealing of a deployed keeper. Taking all of them made it
        and its siblings refuse each other's Redirects for ever: two owners of every group.
        `moved_on` (group -> the newest version its siblings know of, agent.node.rehome
        `_moved_on`) stands for what our dead incarnation had `seen`: an Offer or chunks of a move
        towards us no newer than that, sent again by an old owner whose Installed was lost, are
        of a move over long ago, not one whose Offer our loss lost; taken, the group's old state
        replaced the newer one its owners since had built (CHANGELOG.md, "A re-homed new owner
        took a move long over again from a leaver's chunks")."""
        self.member = Member(self.me, versions)
        self.versions = dict(versions)
        for g, v in (moved_on or {}).items():
            self.seen[g] = max(v, self.seen.get(g, -1))
        self.resumed = True

    @emits
    def resume_moves(self, entries: Any, preds: Iterable[str]) -> None:
        """A re-homed incarnation whose state was lost with its node: the moves its dead
        incarnation had started (or finished handing out) and a live new owner still waits for
        (`extra["moves_out"]`, agent.node.rehome: [group, new owner, the move's version]) start
        again: Redirects to every predecessor (one that took the first already answers with its
        Eos at once), then the group's state, as any move. Without it the new owner held the
        group's records and waited for its state for ever. Bus input: an entry that does not fit
        (not a group we own at the version before the move, already moving, ourselves) is
        skipped."""
        if not isinstance(entries, list):
            return
        m = self.member
        by_new: Dict[str, List[int]] = {}
        for e in entries[:self.groups]:
            if not (isinstance(e, list) and len(e) == 3 and type(e[0]) is int and isinstance(e[1], str)
                    and type(e[2]) is int):
                continue
            g, new, v = e
            if (g in m.owned and g not in m.old.moving and new != m.name and 0 < len(new) <= MAX_NAME
                    and self.versions.get(g, 0) + 1 == v):
                by_new.setdefault(new, []).append(g)
        preds = sorted(preds)
        if not preds or not by_new:
            return
        for new, gs in sorted(by_new.items()):
            self.start_many(sorted(set(gs)), new, preds, offer=False)
        log.info("re-homed: the moves of %d key groups their new owners wait for start again",
                 sum(len(set(gs)) for gs in by_new.values()), extra=self.parts.ctx)

    # ---- what it does through the instance's parts -------------------------------------------------

    def bind(self, parts: MovesParts) -> None:
        """The parts it acts through, once the instance has built them (`MovesParts`)."""
        self.parts = parts

    def started(self, scaling: Any) -> None:
        """The instance started: its scaling driver's state is in every write-ahead from now on,
        and its decision records take our stamps."""
        self.parts.scaling = scaling

    def _send(self, dest: str, msg: Any, extra: Optional[Dict[str, Any]] = None) -> None:
        body = encode(msg)
        if extra:
            body.update(extra)
        self._send_body(dest, body)

    def _send_body(self, dest: str, body: Dict[str, Any]) -> None:
        p = self.parts
        self._cmds += send_handover(p.outputs, p.stats, dest, body)

    def _persist(self) -> None:
        """Write-ahead: the instance's state, ours and the scaling driver's in it, before what follows."""
        p = self.parts
        save = p.incarnation.write(p.clock.now, True, p.scaling)
        if save is not None:
            self._cmds.append(save)

    def _save_keyed(self) -> None:
        """A group out or in changed the keyed state: saved, and the instance's state written, first."""
        self._cmds.append(self.parts.pending.save_keyed())
        self.parts.cadence.changed()
        self._persist()

    def _stamp(self, key: str) -> None:
        """Wall time of a step of the current scale-out on its decision record (agent.instance.scaling_events)."""
        if self.parts.scaling is not None:
            self.parts.scaling.stamp_decision(key)

    def _groups_moved(self) -> None:
        """The groups of our last decision are installed at their new owners: stamped on it."""
        if self.parts.scaling is not None:
            self.parts.scaling.events.stamp_moved(self.parts.clock.wall())

    def _error(self, sender: str, why: str) -> None:
        p = self.parts
        refuse(p.stats, p.refusals, p.ctx, sender, why, p.clock.now)

    def reported_groups(self) -> Dict[int, int]:
        """What the heartbeat says we own (`groups`), which a re-home reads (agent.node.rehome):
        every group whose state is here, at the version a predecessor's table gives it. A group
        moving out is still ours at the version before the move (`versions` holds the move's)
        until its last Eos: a predecessor that has not taken our Redirect routes it to us, and a
        predecessor re-homed with a table from these reports takes our Redirect sent again after
        the silence. Left out, a group in the middle of a move was reported by no instance, the
        re-homed predecessor dealt its table again and refused the movers' Redirects for ever
        ("which does not own it")."""
        m = self.member
        out = {g: self.versions.get(g, 0) for g in m.owned if g not in m.old.moving}
        for g in m.old.moving:
            if g in m.owned:
                out[g] = max(0, max(self.versions.get(g, 0), m.old.versions.get(g, -1)) - 1)
        return out

    def stats(self) -> Dict[str, Any]:
        m = self.member
        # A group installed here whose Installed waits for the standby copy is not ours yet as far
        # as a re-home goes: lost with this node, the copy lacks it while the old owner still
        # holds its state. Reported as on its way here, a re-homed old owner resumes it and sends
        # it again; reported as ours, our re-homed incarnation resumed it empty and answered the
        # old owner's chunks with Installed, or handed it back over the old owner's older state.
        settled = {g: v for g, v in self.reported_groups().items() if g not in self.installing}
        on_way = dict(m.new.expected)
        on_way.update((g, old) for g, (old, _) in self.installing.items())
        return {"handover": dict(self.counts, owned=len(m.owned), moving=len(m.old.moving),
                                 expected=len(m.new.expected), held=self.held),
                "groups": group_runs(settled),
                # groups handed out (every Eos in: a predecessor's table names the new owner), not
                # Installed yet: [group, new owner, the move's version] (agent.node.rehome)
                "handed": [[g, new, v] for g, (new, v, _) in sorted(self.outgoing.items())],
                # groups on their way here, or installed with their Installed waiting for the standby
                # copy: [group, old owner, the move's version] (agent.node.rehome: a re-homed old
                # owner that no longer knows it was moving one starts the move again)
                "expecting": [[g, old, self.installing[g][1] if g in self.installing else self.versions.get(g, -1)]
                              for g, old in sorted(on_way.items())],
                "first_installed_at": self.first_installed_at, "first_applied_at": self.first_applied_at}
