"""What an instance lets in: the admission of every envelope on its inbox and the hold buffer of
senders not announced yet (docs/security.md, "Data channels").

Rules of this file: the part owns its state (the hold buffer, the refusal log limiter, the shapes
of the names worth holding) and holds no reference to the instance. It reads the data-plane
objects it shares with the instance (the inbound channels, the links, the router, the hosts
table), counts in the instance's stats, and is handed per call what changes under it: the
scaling driver (whose tables announce senders), our epoch, the wall clock and `now`. What it
admits goes to the `accept` function the instance passes; it decides nothing else. No I/O.

Cheap on the hot path: an envelope from a known sender costs dict lookups and a few compares.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent.dataplane.channel import Inbound
from agent.dataplane.envelope import Envelope, Kind, decode, encode
from agent.dataplane.flow import OutLink
from agent.dataplane.inbound import ACCEPT, HOLD, REFUSE, HoldBuffer, LogLimiter, numbering_fault, writer_verdict
from agent.dataplane.routing import Router
from agent.instance import moves as group_moves
from agent.instance.driver import ScalingDriver
from agent.instance.hosts import Hosts

__all__ = ["Admission", "HOLD_TTL", "WRITER_HOLD_TTL", "HOLD_MAX_SENDERS", "HOLD_MAX_BYTES"]

log = logging.getLogger("agent.instance.worker")

# Envelopes of senders not known yet (agent.dataplane.inbound.HoldBuffer) wait this long for the
# protocol to announce them (a new copy's Start, resent after IDLE_PING..IDLE_PING_MAX), then they
# are refused. An idle copy holds until its Start: until then it cannot know its predecessors.
HOLD_TTL = 60.0
# Envelopes of a known sender written by a node it is not bound to (yet) wait this long for the
# agent's "hosts" line to bind it there (a new host's record normally follows within a second),
# then they are refused (`refused_nodes`): a forgery by another node never gets bound.
WRITER_HOLD_TTL = 20.0
HOLD_MAX_SENDERS = 64
HOLD_MAX_BYTES = 8 << 20

Shape = Tuple[Tuple[str, ...], set]  # (name prefixes, keeper names) an instance of some operators can have


def _idle(sc: Optional[ScalingDriver]) -> bool:
    """A copy not yet started: it knows its neighbours only from its Start."""
    return sc is not None and not sc.data_enabled


class Admission:
    """Admission for instance `me` of operator `operator` in `pipeline`, whose neighbouring
    operators are `pred_op` (data, protocol), `succ_op` (acks, protocol): `preds`, `succs` are
    the spec's, used before the scaling driver exists. `window`: the larger credit window on our
    channels (how far ahead an honest sender's numbers can run); `hold_extra`: room held per
    sender beyond two windows (a keyed successor's Redirects, one per group)."""

    def __init__(self, me: str, operator: str, pipeline: str, pred_op: List[str], succ_op: List[str],
                 preds: Tuple[str, ...], succs: Tuple[str, ...], *, window: int, hold_extra: int,
                 check_node: bool, keyed: bool, hosts: Hosts, inbound: Inbound, links: Dict[str, OutLink],
                 router: Router, stats: Dict[str, int], ctx: Dict[str, Any]) -> None:
        self.me, self.operator, self.pipeline = me, operator, pipeline
        self.preds, self.succs = preds, succs
        self.window = window
        self.check_node = check_node
        self.keyed = keyed
        self.hosts, self.inbound, self.links, self.router = hosts, inbound, links, router
        self.stats, self.ctx = stats, ctx
        # A keyed successor moving key groups sends each predecessor a Redirect per group, a new
        # copy too, before the copy's Start names that successor: room for all of them, or the
        # ones refused leave a hole and the copy renews its incarnation 5 s later
        # (CHANGELOG.md, "A new copy refused its keyed successor's Redirects"). The byte
        # bound stays the memory bound.
        self.hold = HoldBuffer(HOLD_MAX_SENDERS, 2 * window + 32 + hold_extra, HOLD_MAX_BYTES)
        self.refusals = LogLimiter()
        # Senders of an empty ack refused as unknown: a re-homed copy that may not know it left,
        # which the scaling driver reminds (`ScalingDriver.remind_departed`), taken by the caller
        # (agent.instance.delivery) before what it admits next: the reminder's commands are its.
        self.reminders: List[str] = []
        # Only a name an instance of a neighbouring operator can have is worth holding: keepers
        # are "<pipeline>.<operator>.0" (deploy.keeper_id), every other instance "<operator>-..."
        # (ScalingCore._new_id, the agent's createNode, the bench). Invented names are refused
        # at once, so they cannot fill the hold buffer that a new copy's predecessors need.
        near = pred_op + [operator] + succ_op
        self._shapes: Dict[Kind, Shape] = {
            Kind.DATA: (tuple(f"{o}-" for o in pred_op), {f"{pipeline}.{o}.0" for o in pred_op}),
            Kind.PROTO: (tuple(f"{o}-" for o in near), {f"{pipeline}.{o}.0" for o in near}),
            # held only while we are idle (`admit`): a re-homed successor's first ack in its new
            # epoch reaches every predecessor of its rebuilt table, idle copies included
            Kind.ACK: (tuple(f"{o}-" for o in succ_op), {f"{pipeline}.{o}.0" for o in succ_op}),
        }
        # a neighbour's Duplication we take unannounced (`sender_allowed`): previous or next operator
        both = pred_op + succ_op
        self._round_shape: Shape = (tuple(f"{o}-" for o in both), {f"{pipeline}.{o}.0" for o in both})

    def screen(self, env: Envelope, payload: Optional[bytes], writer: str, sc: Optional[ScalingDriver], epoch: int,
               wall: float, now: float) -> bool:
        """True when `env` (written by node `writer`; `payload` its bytes, None for a chained
        predecessor's, encoded only if held) is to be accepted now; else it is held or refused
        here."""
        if (env.sender, writer) in self.hold:
            # behind what it already holds: the order of (sender, writing node) is kept
            self._hold(env, payload, writer, "node" if self._waits_for_binding(env.sender, writer, sc) else "sender",
                       sc, now)
            return False
        verdict, why = self.admit(env, writer, sc, epoch, wall)
        if verdict == ACCEPT:
            return True
        if verdict == HOLD:
            self._hold(env, payload, writer, why, sc, now)
        else:
            self._refuse(env, why, writer, sc, now)
        return False

    def admit(self, env: Envelope, writer: str, sc: Optional[ScalingDriver], epoch: int, wall: float,
              unannounced_ok: bool = False) -> Tuple[str, str]:
        """ACCEPT, HOLD or REFUSE (with the reason) for one decoded envelope, before it touches
        any state: its sender must exist for our tables (unless `unannounced_ok`:
        `_empty_ack_before_round`), be hosted by the node `writer` that wrote it (check_node), and
        its numbers must be ones that sender can have (agent.dataplane.inbound)."""
        if not unannounced_ok and not self.sender_allowed(env, sc):
            # Data and protocol messages may come from an instance the protocol announces to us
            # only later (a new copy's predecessors before its Start): hold, if the name can be
            # one of a neighbouring operator's. Acks come only from instances we sent data to,
            # which an active instance knows by then: refuse. An idle copy knows no successor
            # yet, but a re-homed one numbers its first ack (its new epoch) 1 on the channel to
            # us: refused, every later message of it would wait behind that hole until we became
            # a new incarnation, possibly in our own deletion (CHANGELOG.md, "A copy that became
            # a new incarnation in its own deletion stranded its inputs").
            # So an idle copy holds acks from a successor's name until its Start, like data.
            shape = self._shapes.get(env.kind)
            if env.kind is Kind.ACK and not _idle(sc):
                shape = None
            if shape is not None and (env.sender.startswith(shape[0]) or env.sender in shape[1]):
                return HOLD, "sender"
            return REFUSE, "sender"
        if self.check_node and writer_verdict(self.hosts.bound.get(env.sender), self.hosts.former.get(env.sender, ()),
                                              writer) != ACCEPT:
            return HOLD, "node"
        if self.check_node and env.sender in self.hosts.unproven and self._new_epoch(env):
            return HOLD, "node"  # a binding nobody vouched for does not set the sender's epoch
        fault = numbering_fault(self.inbound.position(env.sender), self.inbound.resync_unknown,
                                env.epoch, env.seq, wall, self.window)
        if fault is not None:
            return REFUSE, fault
        if env.kind is Kind.ACK and env.body[0] == epoch and env.body[1] > 0:
            link = self.links.get(env.sender)
            if link is None or not link.plausible_ack(env.body[1]):
                return REFUSE, "seq"  # acks (in our epoch) what we never sent it
        return ACCEPT, ""

    def sender_allowed(self, env: Envelope, sc: Optional[ScalingDriver]) -> bool:
        """Does our view of the pipeline say `env.sender` may send us an envelope of this kind?

        Data: a predecessor (the core's table, or one announced to an idle copy). Acks: an
        instance we sent data to (a link, a successor), a copy of ours pinging for its Start, or a
        copy we may have to adopt (`IdleCopies.may_probe`). Protocol and lock messages: any
        instance our tables, our rounds or our persisted channels know."""
        s = env.sender
        kind = env.kind
        if kind is Kind.DATA:
            if sc is None:
                return s in self.preds
            return s in sc.core.preds or s in sc.core.preds_to_add
        if kind is Kind.ACK:
            if s in self.links or s in self.router.succs:
                return True
            if sc is None:
                return False
            core = sc.core
            if s in core.succs or s in core.new_siblings or sc.idle.knows(s):
                return True
            return tuple(env.body) == (0, 0) and sc.idle.may_probe(s)
        if self.inbound.position(s) is not None or s in self.links:
            return True
        if (self.keyed and isinstance(env.body, dict) and env.body.get("type") in group_moves.HANDOVER_TYPES
                and self._sibling(s)):
            return True  # a hand-over between two instances of our operator (agent.instance.moves)
        if sc is None:
            return s in self.preds or s in self.succs
        if sc.knows(s):
            return True
        # The Deletion of a neighbour's copy nobody told us of (it learnt of us from a round of
        # ours, or from its creator, while our own Start or round left it out): answered, or its
        # deletion waits for our ack for ever. The core takes it as the paper does (idle: not to
        # add; active: not in our tables) and only acks. Likewise a Duplication a neighbour sends
        # us, a copy it was told of, after a loss (`ScalingCore.widen_round`): idle, we keep it
        # for our Start (Algorithm 5) and ack; held instead, two such rounds wait for each
        # other's idle copies for ever. docs/reliability.md, "Checking whole instances".
        mtype = env.body.get("type") if isinstance(env.body, dict) else None
        shape = self._shapes[Kind.PROTO] if mtype == "deletion" else self._round_shape
        return mtype in ("deletion", "duplication") and (s.startswith(shape[0]) or s in shape[1])

    def _sibling(self, name: str) -> bool:
        """Can `name` be another instance of our operator (ScalingCore._new_id, deploy.keeper_id)?"""
        return name != self.me and (name.startswith(f"{self.operator}-") or name == f"{self.pipeline}.{self.operator}.0")

    def _hold(self, env: Envelope, payload: Optional[bytes], writer: str, why: str, sc: Optional[ScalingDriver],
              now: float) -> None:
        # Kept: the bytes (decoded again on release, so memory is what the byte bound says) and
        # a header without records (what `sender_allowed` looks at while it waits), per (sender,
        # writing node): one ordered stream each.
        if payload is None:
            payload = encode(env)  # a chained predecessor's: held as bytes like a broker's message
        head = Envelope(env.sender, env.epoch, env.seq, env.kind, [] if env.kind is Kind.DATA else env.body)
        if not self.hold.add((env.sender, writer), (head, bytes(payload)), len(payload) + 200, now):
            self.stats["held_dropped"] += 1
            self._refuse(env, why, writer, sc, now, " (hold buffer full)")

    def _empty_ack_before_round(self, key: Tuple[str, str], head: Envelope, sc: Optional[ScalingDriver]) -> bool:
        """Idle, is `head` (first of the held stream `key`) an empty ack ([0, 0]: a new
        incarnation of a successor asking for replays; we sent it nothing) from a name of our
        successors' operator, with a round message behind it that we take unannounced
        (`sender_allowed`)? Then it is taken (a no-op for us) so that the round message gets
        answered: held until our Start, it kept the Duplication of our creator's neighbour
        behind it, whose round waited for our ack while our creator's waited for that
        neighbour's idle copy, which held our creator's Duplication behind its data: two idle
        copies waiting for each other (CHANGELOG.md, "Records lost at an idle sink copy").
        Never in the checker's seeded fault `empty_ack_held` (foglab.sim.instance_faults)."""
        if not _idle(sc) or head.kind is not Kind.ACK or tuple(head.body) != (0, 0):
            return False
        prefix, names = self._shapes[Kind.ACK]
        if not (head.sender.startswith(prefix) or head.sender in names):
            return False
        return any(h.kind is Kind.PROTO and self.sender_allowed(h, sc) for h, _ in self.hold.items(key)[1:])

    def _refuse(self, env: Envelope, why: str, writer: str, sc: Optional[ScalingDriver], now: float,
                note: str = "") -> None:
        """Counted, logged at most once per sender per minute (and 20 lines a minute in all), and
        nothing else: no channel entry, no record id, nothing persisted."""
        if why == "sender" and env.kind is Kind.ACK and tuple(env.body) == (0, 0) and sc is not None:
            self.reminders.append(env.sender)  # a re-homed copy that forgot it left
        key = {"epoch": "refused_epochs", "seq": "refused_seqs", "node": "refused_nodes"}.get(why, "refused_senders")
        self.stats[key] += 1
        if self.refusals.allow((env.sender, writer), now):
            more = self.refusals.take_suppressed()
            what = f"not bound to node {writer[:64]}" if why == "node" else f"{why} not plausible"
            log.warning("refused %s envelope %d/%d from %s (written by %s) on our inbox: %s%s%s",
                        env.kind.name.lower(), env.epoch, env.seq, env.sender[:64], writer[:64], what, note,
                        f" ({more} more refusals not logged)" if more else "", extra=self.ctx)

    def release(self, now: float, sc: Optional[ScalingDriver], epoch: int, wall: float,
                decode_records: bool, accept: Callable[[Envelope], None]) -> None:
        """Senders the protocol has announced since their envelopes were held: admit those
        envelopes now (each to `accept`), in the sender's order (epoch, then number). Not in
        arrival order: a
        channel that resyncs (a sender unknown after a restart or a new incarnation) starts at
        the first number it sees, and the ones below it are dropped as seen; held in arrival order
        2 before 1 (1 lost by the broker and sent again), record 1 was dropped, came back only
        through a later replay, and went out behind record 7 of its key. The rest wait, up to
        HOLD_TTL (an idle copy: until its Start)."""
        for key in self.hold.senders():
            writer = key[1]
            self.hold.order(key, lambda held: (held[0].epoch, held[0].seq))
            while True:
                held = self.hold.first(key)
                if held is None:
                    break
                unannounced_ok = False
                if not self.sender_allowed(held[0], sc):
                    if self._empty_ack_before_round(key, held[0], sc):
                        unannounced_ok = True
                    elif held[0].kind is not Kind.ACK or _idle(sc):
                        break  # still not announced: keep waiting (an idle copy: until its Start)
                    self.hold.pop_first(key)  # an ack is held only until Start (see admit)
                    self._refuse(held[0], "sender", writer, sc, now)
                    continue
                env = decode(held[1], decode_records)  # decoded once already: cannot fail
                verdict, why = self.admit(env, writer, sc, epoch, wall, unannounced_ok)
                if verdict == HOLD:
                    break
                self.hold.pop_first(key)
                if verdict == ACCEPT:
                    self.stats["held_released"] += 1
                    accept(env)
                else:
                    self._refuse(env, why, writer, sc, now)
        if _idle(sc):
            return  # idle: its neighbours are announced with its Start
        for (sender, writer), n in self.hold.expire(now, lambda k: self._hold_ttl(k, sc)):
            # Not announced by the protocol, or not bound to the node that wrote it, in time.
            unbound = self._waits_for_binding(sender, writer, sc)
            self.stats["refused_nodes" if unbound else "refused_senders"] += n
            if self.refusals.allow((sender, writer), now):
                log.warning("refused %d envelopes from %s (written by %s): %s within %.0fs", n, sender[:64],
                            writer[:64], f"not bound to node {writer[:64]}" if unbound else "not announced to us",
                            WRITER_HOLD_TTL if unbound else HOLD_TTL, extra=self.ctx)

    def _new_epoch(self, env: Envelope) -> bool:
        position = self.inbound.position(env.sender)
        return position is None or env.epoch > position[0]

    def _waits_for_binding(self, sender: str, writer: str, sc: Optional[ScalingDriver]) -> bool:
        """A held stream whose sender our tables know, written by a node it is not bound to (or
        bound without proof)."""
        return (self.check_node and (self.hosts.bound.get(sender) != writer or sender in self.hosts.unproven)
                and writer not in self.hosts.former.get(sender, ())
                and self.sender_allowed(Envelope(sender, 0, 1, Kind.PROTO, {}), sc))

    def _hold_ttl(self, key: Tuple[str, str], sc: Optional[ScalingDriver]) -> float:
        return WRITER_HOLD_TTL if self._waits_for_binding(*key, sc) else HOLD_TTL
