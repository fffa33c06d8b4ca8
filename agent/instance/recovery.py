"""Crash recovery of a worker's scaling round (pure: no I/O, no clock; the driver passes `now`).

The papers assume instances never crash. Ours do (kill -9, power loss), and a scaling round must
still finish. Three small mechanisms, all in the worker's scaling driver, none in the protocol
core (whose message cost and checked behaviour stay the paper's):

1. Write-ahead outputs. The core's outputs (sends, createNode, route changes, drain, terminate)
   are persisted with the core's snapshot BEFORE the driver performs them (`encode_outputs`), and
   a restarted worker performs again whatever is still queued (`decode_outputs`). A send may thus
   go out twice; the rules below make that harmless. createNode() may be asked twice for one
   instance id: the agent answers the second request with the instance that already exists.
2. Replayed rounds. A neighbour that receives a Duplication or Deletion for a round it already
   applied (its sender restarted and sent it again) answers with the ack again but does not apply
   it twice (`RoundMemory`): a second application could re-add an instance that has left since.
   Why answer at all: the first ack may be lost for good, e.g. delivered to the crashed
   incarnation's client and never processed.
3. Resend on silence. An instance in a round that hears nothing from a pending neighbour for
   `RESEND_AFTER` seconds sends that neighbour the round's message again (`round_message`): the
   neighbour may have crashed after applying the message but before its ack left, or the broker
   lost it; then also to the copies that neighbour announced before it acked, which may have
   started without our round (`ScalingCore.widen_round`); a pending neighbour whose Deletion
   we applied meanwhile is not waited for any more (`ScalingCore.release`). The copies are
   counted apart (`protocol_resent`); under no fault none is sent.

What stays open: a neighbour that never comes back (its node is gone for good) keeps the round
waiting; see docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent.protocol.messages import Deletion, DeletionAck, Duplication, DuplicationAck, Message
from agent.protocol.scaling import (
    Activate,
    CreateInstance,
    Drain,
    InstanceState,
    RoutesChanged,
    ScalingCore,
    Send,
    Terminate,
)

__all__ = ["RESEND_AFTER", "encode_outputs", "decode_outputs", "RoundMemory", "round_message", "open_links"]

log = logging.getLogger("agent.instance.worker")

RESEND_AFTER = 10.0  # seconds of silence from a pending neighbour before the round message is sent again

_EFFECTS = {cls.__name__: cls for cls in (CreateInstance, Activate, RoutesChanged, Drain, Terminate)}


def encode_outputs(outputs: Any) -> List[Dict[str, Any]]:
    """JSON-friendly copy of queued core outputs (Sends and effects), in order."""
    out: List[Dict[str, Any]] = []
    for o in outputs:
        if isinstance(o, Send):
            out.append({"send": o.dest, "message": o.message.to_dict()})
        else:
            fields = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(o).items()}
            out.append({"effect": type(o).__name__, **fields})
    return out


def decode_outputs(data: Any, from_dict: Callable[[Any], Message]) -> List[Any]:
    """The outputs `encode_outputs` wrote; raises ValueError on anything else (a damaged file)."""
    if not isinstance(data, list):
        raise ValueError(f"queued outputs: expected a list, found {type(data).__name__}")
    out: List[Any] = []
    for item in data:
        if not isinstance(item, dict):
            raise ValueError(f"queued output: expected an object, found {item!r}")
        if "send" in item:
            out.append(Send(str(item["send"]), from_dict(item["message"])))
            continue
        cls = _EFFECTS.get(str(item.get("effect")))
        if cls is None:
            raise ValueError(f"queued output: unknown effect {item.get('effect')!r}")
        kwargs = {f.name: item[f.name] for f in dataclasses.fields(cls)}
        for name in ("succs", "preds"):
            if name in kwargs:
                kwargs[name] = tuple(kwargs[name])
        out.append(cls(**kwargs))
    return out


class RoundMemory:
    """The last round of each sender whose Duplication/Deletion this instance applied.

    A core's round number only grows (it is part of its persisted snapshot), so a message for a
    round at or below the remembered one is a copy sent again after a crash.
    """

    def __init__(self, applied: Optional[Dict[str, int]] = None) -> None:
        self.applied: Dict[str, int] = dict(applied or {})
        self.replays = 0

    def replay_ack(self, msg: Message, me: str, stage: int) -> Optional[Message]:
        """The ack to send again if `msg` repeats an applied round, else None (apply it)."""
        if not isinstance(msg, (Duplication, Deletion)):
            return None
        if msg.round > self.applied.get(msg.sender, -1):
            return None
        self.replays += 1
        ack = DuplicationAck if isinstance(msg, Duplication) else DeletionAck
        return ack.trusted(sender=me, stage=stage, round=msg.round)

    def applied_now(self, msg: Message) -> None:
        if isinstance(msg, (Duplication, Deletion)):
            self.applied[msg.sender] = max(msg.round, self.applied.get(msg.sender, -1))


def round_message(core: ScalingCore) -> Optional[Message]:
    """The message of the round `core` is waiting on (what a pending neighbour must answer)."""
    if not core.pending:
        return None
    if core.state is InstanceState.DUPLICATING:
        return Duplication.trusted(sender=core.instance_id, stage=core.stage, round=core.round,
                                   new_instances=tuple(core.new_siblings))
    if core.state in (InstanceState.DELETING, InstanceState.DEPARTING):
        return Deletion.trusted(sender=core.instance_id, stage=core.stage, round=core.round)
    return None


def silent_pending(core: ScalingCore, last_heard: Dict[str, float], now: float,
                   after: float = RESEND_AFTER) -> List[Tuple[str, Message]]:
    """(neighbour, message) pairs to resend: pending neighbours silent for `after` seconds.
    `last_heard` holds when each was last sent something or heard from; a neighbour missing from
    it has not been sent the round message yet (the driver is still performing outputs) and is
    skipped. The caller updates `last_heard` for the pairs returned."""
    msg = round_message(core)
    if msg is None:
        return []
    return [(n, msg) for n in sorted(core.pending) if n in last_heard and now - last_heard[n] >= after]


# ---- 4. Exactly-once protocol channels (coordination = "fgme") ---------------------------------

ACK_AFTER = RESEND_AFTER / 2  # a link message that got no reply carrying its ack: ack it alone after this
SYNC_EVERY = 2.0  # at most one resend request per peer this often (a gap shows on every later message)
LINK_FIELD = "link"  # [generation, number, acked generation, acked number], added to the message body
LINK_ACK = "link_ack"  # {"type", "sender", "ack": [generation, number], "sync": bool}
_MAX_NUMBER = 2 ** 53  # JSON-safe; a channel never comes near it


class LinkError(ValueError):
    """A link field or link ack that is not well-formed (hostile or broken peer): counted, dropped."""


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_NUMBER


class ReliableLinks:
    """Exactly-once, FIFO delivery of one instance's protocol messages to each peer, over a bus
    that may lose them (a broker killed before its autosave, a worker killed after taking them
    from the broker) or repeat them (the write-ahead replay of rule 1).

    Why: 2-FGME assumes reliable FIFO channels (docs/gme.md), and the lock-guarded leave rule
    needs a Deletion and the exit message after it to arrive in that order. The scaling round
    can resend its one round message on silence (rule 3) because a repeat is recognised by its
    round number; a lost or repeated 2-FGME Req, Ack or End has no such identity and changes the
    lock state, so a copy cannot be told from a new message and a loss can leave a boundary
    locked. With coordination = "fgme" every protocol message a core sends goes through here:

    - Numbering. Each (sender, peer) channel numbers its messages 1, 2, ... within the sender's
      *generation* (chosen when an instance starts without persisted link state, increasing:
      wall-clock seconds, like a re-homed core's rounds). Messages carry
      [generation, number, acked generation, acked number] in the `link` field.
    - Delivery. A receiver delivers number seen+1 only; a lower one is a repeat (dropped, acked
      again), a higher one means something in between was lost (dropped, and a resend requested
      with a sync ack, at most every SYNC_EVERY s). A new generation of the sender restarts at 1.
      A receiver that lost its own state (re-homed) starts each channel at the first message.
    - Acks. The highest number delivered rides on every message back (`acked`); when none goes
      back within ACK_AFTER s, a `link_ack` carries it alone (counted apart from the protocol's
      messages, like data acks). The sender keeps each message until it is acked.
    - Resends. All unacked messages to a peer, in order, when (a) the peer sends a sync ack
      (it restarted, or saw a gap), (b) nothing was acked for RESEND_AFTER s while some wait, or
      (c) we became a new incarnation (`resync`: we also send every peer a sync ack, since what
      they sent may be lost with our old session or our unprocessed input).

    Crash consistency: the state here is persisted with the core's snapshot and the queued
    outputs in one write (`dump`), and a restarted worker performs the queued sends again
    (rule 1): the numbers they get are the numbers they had, so the receiver drops the copies.
    The receiver's `seen` is persisted with the core state it produced, before any ack of it
    leaves (an ack is sent only after the write the driver forces before performing outputs;
    a link_ack alone, by `due`, after the driver's periodic write: see `acks_persisted`).
    Pure: no I/O, no clock (`now` is passed in).
    """

    def __init__(self, me: str, generation: int, lost_state: bool = False) -> None:
        self.me = me
        self.generation = int(generation)
        self.lost_state = lost_state  # re-homed: channels we have no position for start at their first message
        self.out: Dict[str, Dict[str, Any]] = {}  # peer -> {"next", "unacked": [[n, body]], "progress"}
        self.inp: Dict[str, List[int]] = {}  # peer -> [its generation, highest number delivered]
        self.ack_due: Dict[str, float] = {}  # peer -> when a delivery first went unacked
        self.gone: List[str] = []  # peers that left for good (`forget`): late copies from them are dropped
        self._sync_at: Dict[str, float] = {}
        self.counts: Dict[str, int] = {"resent": 0, "duplicates": 0, "gaps": 0, "stale": 0, "acks_out": 0,
                                       "syncs_out": 0}

    # -- sending ----------------------------------------------------------------------------------

    def stamp(self, dest: str, body: Dict[str, Any], now: float) -> Dict[str, Any]:
        """The body to send to `dest`, numbered; kept until `dest` acks it."""
        link = self.out.get(dest)
        if link is None:
            link = self.out[dest] = {"next": 1, "unacked": [], "progress": now}
        n = link["next"]
        link["next"] = n + 1
        if not link["unacked"]:
            link["progress"] = now  # the silence of RESEND_AFTER counts from the first wait
        link["unacked"].append([n, dict(body)])
        return self._numbered(dest, n, body)

    def _numbered(self, dest: str, n: int, body: Dict[str, Any]) -> Dict[str, Any]:
        self.ack_due.pop(dest, None)  # the ack rides on this message
        ag, a = self.inp.get(dest, [0, 0])
        return {**body, LINK_FIELD: [self.generation, n, ag, a]}

    def _resend(self, dest: str, now: float) -> List[Tuple[str, Dict[str, Any]]]:
        link = self.out.get(dest)
        if not link or not link["unacked"]:
            return []
        link["progress"] = now
        self.counts["resent"] += len(link["unacked"])
        return [(dest, self._numbered(dest, n, body)) for n, body in link["unacked"]]

    def _ack_body(self, peer: str, sync: bool) -> Dict[str, Any]:
        self.ack_due.pop(peer, None)
        self.counts["syncs_out" if sync else "acks_out"] += 1
        return {"type": LINK_ACK, "sender": self.me, "ack": list(self.inp.get(peer, [0, 0])), "sync": sync}

    # -- receiving --------------------------------------------------------------------------------

    def receive(self, sender: str, body: Any, now: float) -> Tuple[Optional[Dict[str, Any]], List[Tuple[str, Dict[str, Any]]]]:
        """(the message to deliver or None, what to send back now). A body without a link
        field (a probe, a Start sent again to an idle copy) is delivered as it is. Raises
        LinkError on a malformed link field or link ack (state unchanged)."""
        if not isinstance(body, dict):
            return body, []
        if sender in self.gone:
            self.counts["stale"] += 1  # a late copy from an instance that left: never answer it
            return None, []
        if body.get("type") == LINK_ACK:
            ack, sync = body.get("ack"), body.get("sync")
            if (set(body) - {"type", "sender", "ack", "sync"} or not isinstance(ack, list) or len(ack) != 2
                    or not all(_count(v) for v in ack) or not isinstance(sync, bool)):
                raise LinkError(f"{LINK_ACK} from {sender}: expected ack [generation, number] and sync (bool)")
            self._acked(sender, ack[0], ack[1], now)
            return None, self._resend(sender, now) if sync else []
        link = body.get(LINK_FIELD)
        if link is None:
            return body, []
        if not isinstance(link, list) or len(link) != 4 or not all(_count(v) for v in link) or link[1] < 1:
            raise LinkError(f"{LINK_FIELD} from {sender}: expected [generation, number >= 1, generation, number]")
        g, n, ag, a = link
        self._acked(sender, ag, a, now)
        msg = {k: v for k, v in body.items() if k != LINK_FIELD}
        pos = self.inp.get(sender)
        if pos is None:
            pos = [g, n - 1 if self.lost_state else 0]
        elif g > pos[0]:
            pos = [g, 0]  # the sender starts over (it lost its state): its channel starts at 1
        elif g < pos[0]:
            self.counts["stale"] += 1  # an incarnation the sender left behind
            return None, []
        if n <= pos[1]:
            self.counts["duplicates"] += 1
            self.ack_due[sender] = min(self.ack_due.get(sender, now), now - ACK_AFTER)  # ack at the next `due`
            return None, []
        if n > pos[1] + 1:
            self.counts["gaps"] += 1
            self.inp.setdefault(sender, [pos[0], pos[1]])
            if now - self._sync_at.get(sender, -1e18) >= SYNC_EVERY:
                self._sync_at[sender] = now
                return None, [(sender, self._ack_body(sender, sync=True))]
            return None, []
        self.inp[sender] = [pos[0], n]
        self.ack_due.setdefault(sender, now)
        return msg, []

    def _acked(self, peer: str, generation: int, upto: int, now: float) -> None:
        link = self.out.get(peer)
        if link is None or generation != self.generation:
            return
        before = len(link["unacked"])
        link["unacked"] = [u for u in link["unacked"] if u[0] > upto]
        if len(link["unacked"]) < before:
            link["progress"] = now

    # -- time and incarnations --------------------------------------------------------------------

    def due(self, now: float) -> List[Tuple[str, Dict[str, Any]]]:
        """Acks that waited ACK_AFTER s for a message back, and resends after RESEND_AFTER s
        without an ack while messages wait."""
        out = [(p, self._ack_body(p, sync=False)) for p, t in sorted(self.ack_due.items()) if now - t >= ACK_AFTER]
        for dest in sorted(self.out):
            link = self.out[dest]
            if link["unacked"] and now - link["progress"] >= RESEND_AFTER:
                out += self._resend(dest, now)
        return out

    def resync(self, peers: Any, now: float) -> List[Tuple[str, Dict[str, Any]]]:
        """We are a new incarnation (restarted, or the broker lost our session): ask every peer
        to resend what we have not delivered, and resend what they have not acked."""
        out: List[Tuple[str, Dict[str, Any]]] = []
        for p in sorted(set(peers) | set(self.inp) | set(self.out)):
            if p == self.me:
                continue
            out.append((p, self._ack_body(p, sync=True)))
            out += self._resend(p, now)
        return out

    def forget(self, peer: str) -> List[Tuple[str, Dict[str, Any]]]:
        """`peer` left for good (its exit was delivered): ack what it sent at once (it waits for
        that before exiting) and drop its channels (nothing may be sent to it again)."""
        out = [(peer, self._ack_body(peer, sync=False))] if peer in self.inp else []
        self.out.pop(peer, None)
        self.inp.pop(peer, None)
        self.ack_due.pop(peer, None)
        self._sync_at.pop(peer, None)
        if peer not in self.gone:
            self.gone = (self.gone + [peer])[-256:]  # ids are never reused; the latest ones matter
        return out

    def flush_acks(self) -> List[Tuple[str, Dict[str, Any]]]:
        """Ack every delivery now: we leave for good (a peer must not wait for our acks, nor
        resend to an inbox nobody reads)."""
        return [(p, self._ack_body(p, sync=False)) for p in sorted(self.ack_due)]

    @property
    def settled(self) -> bool:
        """Every message sent was acked (a terminated instance waits for this before it exits)."""
        return not any(link["unacked"] for link in self.out.values())

    def unacked(self) -> int:
        return sum(len(link["unacked"]) for link in self.out.values())

    # -- persistence ------------------------------------------------------------------------------

    def dump(self) -> Dict[str, Any]:
        return {"generation": self.generation,
                "out": {p: {"next": l["next"], "unacked": l["unacked"]} for p, l in sorted(self.out.items())},
                "in": {p: list(v) for p, v in sorted(self.inp.items())}, "gone": list(self.gone)}

    @classmethod
    def load(cls, me: str, data: Any, now: float) -> "ReliableLinks":
        """Inverse of `dump`; raises ValueError on a damaged record."""
        try:
            links = cls(me, int(data["generation"]))
            for p, l in data["out"].items():
                unacked = [[int(n), dict(b)] for n, b in l["unacked"]]
                links.out[str(p)] = {"next": int(l["next"]), "unacked": unacked, "progress": now}
            links.inp = {str(p): [int(v[0]), int(v[1])] for p, v in data["in"].items()}
            links.gone = [str(p) for p in data.get("gone", [])]
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"link state: {exc!r}") from None
        return links


def open_links(instance: str, min_epoch: int, saved: Dict[str, Any], restart: bool, now: float, wall: float,
               ctx: Dict[str, Any]) -> ReliableLinks:
    """An instance's links (coordination = "fgme"): a restart's saved ones, else a new generation.

    A new generation is above any earlier one of this identity (seconds, as `min_epoch`). A
    re-homed incarnation also starts at its epoch floor at least: its own clock alone may give the
    generation its dead incarnation had (a re-home within the second of that start, or a node
    clock behind), and the peers then drop its messages as repeats or stale ones, its lock
    requests among them (a round that never starts)."""
    if restart and saved.get("links"):
        try:
            return ReliableLinks.load(instance, saved["links"], now)
        except ValueError as exc:
            log.warning("%s: starting new channels", exc, extra=ctx)
    return ReliableLinks(instance, max(int(wall), min_epoch), lost_state=bool(restart or min_epoch))
