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
   neighbour may have crashed after applying the message but before its ack left. The copies are
   counted apart (`protocol_resent`); under no fault none is sent.

What stays open: a neighbour that never comes back (its node is gone for good) keeps the round
waiting; see docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["RESEND_AFTER", "encode_outputs", "decode_outputs", "RoundMemory", "round_message"]

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
