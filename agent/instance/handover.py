"""The hand-over of a key group's state from its old owner to a new one, as pure state machines.
NOT WIRED into the worker or the scaling protocol yet (docs/operators.md, "Key groups that move":
a keyed operator's policy must be "none" until it is). `Member` is one instance in both roles,
over any number of moves (a group may come back); the predecessors' routing is the explicit
group -> owner table of agent.dataplane.owners, changed only by Redirects.

Rules of this file: no I/O, no clock. Each role is a class whose methods take one input (a
message, a record) and return the outputs to perform, in order. Channels between two instances
are FIFO (the data plane's numbered channels, docs/design.md invariant 1); that is the only
assumption. Unknown or impossible inputs raise `HandoverError` naming the role, group and input.

The sequence for one group g moving from OLD to NEW, with predecessors P1..Pk (Elastic Storm's
pause-and-resume per task, section V of Cardellini et al., HPCS 2016, per key group here, with the
buffer at the new owner):

    OLD                        each Pi                            NEW
     | Redirect(g, NEW) ------>  |                                 |
     |                           | (records of g sent before: to OLD, FIFO ahead of the EOS)
     | <------------------ Eos(g)| then g's records go to NEW -----> | buffered: no state yet
     | (applies g's records up to every Pi's Eos: g's state is final)
     | StateChunk(g, i, n) ---------------------------------------> | (n chunks, each <= max_chunk bytes)
     | forgets g                                                     | setState, applies the buffer
     | <---------------------------------------------- Installed(g) | in arrival order, resumes g
     | (may drop what it kept for g)

Why it is exactly once and keeps each sender's order: a record of g sent by Pi before its Eos
reaches OLD before that Eos (FIFO) and is in the state OLD sends; one sent after reaches NEW, which
applies it only after the state is installed, in arrival order. Other groups keep flowing: only
g's records are buffered, only at NEW, only until its state arrives.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from agent.dataplane.owners import GroupTable

__all__ = [
    "HandoverError",
    "Redirect",
    "Eos",
    "StateChunk",
    "Installed",
    "Offer",
    "Send",
    "Apply",
    "Install",
    "Forget",
    "Predecessor",
    "OldOwner",
    "NewOwner",
    "Member",
    "MAX_CHUNK",
    "chunks",
]

# Raw state bytes per chunk: base64 in a JSON envelope makes it 4/3 larger plus a header, which
# stays under Mosquitto's default 1 MiB message limit.
MAX_CHUNK = 600_000


class HandoverError(RuntimeError):
    """An input the hand-over of this group cannot receive in its current state."""


# ---- messages between instances ----------------------------------------------------------------


@dataclass(frozen=True)
class Redirect:
    """From the group's owner to each predecessor: send the group to `new` from now on. `version`
    is the group's version in the owner table after the move (-1: not checked)."""

    group: int
    new: str
    version: int = -1


@dataclass(frozen=True)
class Offer:
    """From the old owner to the new one, ahead of the state on the same channel: expect `group`
    (a termination: the survivor did not decide the move; a copy learns its share with its Start)."""

    group: int


@dataclass(frozen=True)
class Eos:
    group: int
    sender: str


@dataclass(frozen=True)
class StateChunk:
    group: int
    index: int
    total: int
    data: bytes

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.total:
            raise HandoverError(f"state chunk {self.index} of {self.total} for group {self.group}: out of range")


@dataclass(frozen=True)
class Installed:
    group: int


# ---- outputs for the driver -----------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    dest: str
    message: Any


@dataclass(frozen=True)
class Apply:
    """Apply these records of the group (sender, record) now, in this order."""

    group: int
    records: Tuple[Tuple[str, Any], ...]


@dataclass(frozen=True)
class Install:
    """setState: restore the group from these bytes (before any Apply of it that follows)."""

    group: int
    data: bytes


@dataclass(frozen=True)
class Forget:
    """The group's state left this instance: drop it."""

    group: int


def chunks(group: int, data: bytes, max_chunk: int = MAX_CHUNK) -> List[StateChunk]:
    """The state of `group` cut into chunks of at most `max_chunk` bytes (one, if empty)."""
    if max_chunk < 1:
        raise ValueError(f"max_chunk must be >= 1, found {max_chunk}")
    parts = [data[i:i + max_chunk] for i in range(0, len(data), max_chunk)] or [b""]
    return [StateChunk(group, i, len(parts), p) for i, p in enumerate(parts)]


# ---- the three roles --------------------------------------------------------------------------------


class Predecessor:
    """An upstream instance: where each group's records go. `route(g)` is the owner to send to.
    `owners` is a GroupTable (the live form) or a plain dict group -> owner."""

    def __init__(self, name: str, owners: Union[GroupTable, Mapping[int, str]]) -> None:
        self.name = name
        self.table: Optional[GroupTable] = owners if isinstance(owners, GroupTable) else None
        self._owners: Dict[int, str] = {} if self.table is not None else dict(owners)

    @property
    def owners(self) -> Dict[int, str]:
        if self.table is not None:
            return {g: self.table.owner(g) for g in range(self.table.groups)}
        return self._owners

    def route(self, group: int) -> str:
        return self.table.owner(group) if self.table is not None else self._owners[group]

    def on_redirect(self, sender: str, msg: Redirect) -> List[Any]:
        """From the group's current owner: an Eos behind everything of the group sent to it, then
        the group's records go to the new owner."""
        if (self.table is not None and 0 <= msg.version <= self.table.version(msg.group)
                and self.table.owner(msg.group) == msg.new):
            # Known already (a copy whose table was taken after its creator's Redirect): nothing
            # of the group went to `sender` from here; the Eos says so.
            return [Send(sender, Eos(msg.group, self.name))]
        old = self.route(msg.group) if msg.group in self.owners else None
        if old != sender:
            raise HandoverError(f"predecessor {self.name}: Redirect of group {msg.group} from {sender}, "
                                f"which does not own it (owner: {old})")
        if self.table is not None:
            if msg.version >= 0 and msg.version != self.table.version(msg.group) + 1:
                raise HandoverError(f"predecessor {self.name}: Redirect of group {msg.group} to version "
                                    f"{msg.version}, after version {self.table.version(msg.group)}")
            self.table.moved(msg.group, msg.new)
        else:
            self._owners[msg.group] = msg.new
        return [Send(old, Eos(msg.group, self.name))]


class OldOwner:
    """The instance the group leaves. Applies the group's records until every predecessor's Eos,
    then sends the state (chunked) and forgets the group."""

    def __init__(self, name: str, max_chunk: int = MAX_CHUNK) -> None:
        self.name = name
        self.max_chunk = max_chunk
        self.moving: Dict[int, Tuple[str, Set[str]]] = {}  # group -> (new owner, preds without Eos yet)
        self.gone: Set[int] = set()
        self.waiting_install: Dict[int, int] = {}  # group -> Installed still to come (it may move out twice)
        self.versions: Dict[int, int] = {}  # group moving -> its version after the move (for late Redirects)

    def start(self, group: int, new: str, preds: Sequence[str], version: int = -1) -> List[Any]:
        """Move `group` to `new`; `version` is its version in the owner table after the move."""
        if group in self.moving or group in self.gone:
            raise HandoverError(f"old owner {self.name}: group {group} is already moving or gone")
        if not preds:
            raise HandoverError(f"old owner {self.name}: moving group {group} needs its predecessors")
        self.moving[group] = (new, set(preds))
        self.versions[group] = version
        return [Send(p, Redirect(group, new, version)) for p in sorted(set(preds))]

    def add_pred(self, pred: str) -> List[Any]:
        """A predecessor joined (its creator's duplication round reached this instance before the
        copy's Start): every group moving out now also waits for its Eos, so a record it routes
        here from a table copied before the Redirect is still applied here."""
        out: List[Any] = []
        for g, (new, left) in sorted(self.moving.items()):
            if pred not in left:
                left.add(pred)
                out.append(Send(pred, Redirect(g, new, self.versions[g])))
        return out

    def remove_pred(self, pred: str, snapshot: Callable[[int], bytes]) -> List[Any]:
        """A predecessor left (its deletion reached this instance after every record it sent:
        docs/design.md invariant 1): no Eos will come from it."""
        out: List[Any] = []
        for g in sorted(self.moving):
            left = self.moving[g][1]
            if pred in left:
                left.discard(pred)
                if not left:
                    out += self._final(g, snapshot)
        return out

    def on_record(self, sender: str, group: int, record: Any) -> List[Any]:
        if group in self.gone:
            raise HandoverError(f"old owner {self.name}: record of group {group} from {sender} after its Eos")
        mv = self.moving.get(group)
        if mv is not None and sender not in mv[1]:
            raise HandoverError(f"old owner {self.name}: record of group {group} from {sender} after its Eos")
        return [Apply(group, ((sender, record),))]

    def on_eos(self, msg: Eos, snapshot: Callable[[int], bytes]) -> List[Any]:
        """`snapshot(group) -> bytes` is called once, when the state is final."""
        mv = self.moving.get(msg.group)
        if mv is None or msg.sender not in mv[1]:
            raise HandoverError(f"old owner {self.name}: unexpected Eos of group {msg.group} from {msg.sender}")
        mv[1].discard(msg.sender)
        return [] if mv[1] else self._final(msg.group, snapshot)

    def _final(self, group: int, snapshot: Callable[[int], bytes]) -> List[Any]:
        """Every predecessor's Eos is in: the state is final, it goes to the new owner."""
        new = self.moving.pop(group)[0]
        self.versions.pop(group, None)
        self.gone.add(group)
        self.waiting_install[group] = self.waiting_install.get(group, 0) + 1
        out: List[Any] = [Send(new, c) for c in chunks(group, snapshot(group), self.max_chunk)]
        out.append(Forget(group))
        return out

    def on_installed(self, msg: Installed) -> List[Any]:
        if msg.group not in self.waiting_install:
            raise HandoverError(f"old owner {self.name}: Installed for group {msg.group}, which it did not send")
        n = self.waiting_install.pop(msg.group) - 1
        if n:
            self.waiting_install[msg.group] = n
        return []


class NewOwner:
    """The instance the group arrives at. Buffers the group's records until its state is
    installed, then applies them in arrival order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.expected: Dict[int, str] = {}  # group -> old owner
        self.parts: Dict[int, Dict[int, bytes]] = {}
        self.buffer: Dict[int, List[Tuple[str, Any]]] = {}
        self.owned: Set[int] = set()

    def expect(self, group: int, old: str) -> None:
        if group in self.owned or group in self.expected:
            raise HandoverError(f"new owner {self.name}: group {group} is already owned or expected")
        self.expected[group] = old
        self.parts[group] = {}
        self.buffer[group] = []

    def on_record(self, sender: str, group: int, record: Any) -> List[Any]:
        if group in self.owned:
            return [Apply(group, ((sender, record),))]
        if group in self.expected:
            self.buffer[group].append((sender, record))
            return []
        raise HandoverError(f"new owner {self.name}: record of group {group} from {sender}, not owned nor expected")

    def on_chunk(self, sender: str, msg: StateChunk) -> List[Any]:
        old = self.expected.get(msg.group)
        if old != sender:
            raise HandoverError(f"new owner {self.name}: state of group {msg.group} from {sender} (expected {old})")
        parts = self.parts[msg.group]
        if msg.index in parts:
            raise HandoverError(f"new owner {self.name}: chunk {msg.index} of group {msg.group} twice")
        parts[msg.index] = msg.data
        if len(parts) < msg.total:
            return []
        data = b"".join(parts[i] for i in range(msg.total))
        del self.expected[msg.group], self.parts[msg.group]
        self.owned.add(msg.group)
        buffered = tuple(self.buffer.pop(msg.group))
        out: List[Any] = [Install(msg.group, data)]
        if buffered:
            out.append(Apply(msg.group, buffered))
        out.append(Send(old, Installed(msg.group)))
        return out

    def buffered(self, group: int) -> Optional[int]:
        b = self.buffer.get(group)
        return None if b is None else len(b)


class Member:
    """One instance of the keyed operator in both roles, over any number of moves: it owns groups,
    hands some over (`start`), receives others (`expect` for a copy's share named in its Start,
    `Offer` from a terminating instance) and may get a group back that it once handed away.

    A record of a group it neither owns nor expects is held (`early`) until the Offer: a
    predecessor redirected by the old owner can send it before the Offer on the old -> new channel
    arrives. The live shell bounds that hold like any inbox (docs/security.md)."""

    def __init__(self, name: str, owned: Iterable[int] = (), max_chunk: int = MAX_CHUNK) -> None:
        self.name = name
        self.old = OldOwner(name, max_chunk)
        self.new = NewOwner(name)
        self.new.owned = set(owned)
        self.early: Dict[int, List[Tuple[str, Any]]] = {}

    @property
    def owned(self) -> Set[int]:
        """Groups whose state is here (including those moving out until their last Eos)."""
        return self.new.owned

    def busy(self) -> bool:
        """A move in or out is under way: the instance may not start another change (duplicate,
        terminate) until it is over."""
        return bool(self.old.moving or self.old.waiting_install or self.new.expected or self.early)

    def start(self, group: int, new: str, preds: Sequence[str], version: int = -1, offer: bool = True) -> List[Any]:
        """Hand `group` to `new`. `offer`: announce it on the channel to `new` first (a copy that
        learnt its share with its Start does not need it)."""
        if group not in self.new.owned or group in self.old.moving:
            raise HandoverError(f"member {self.name}: cannot move group {group}: not owned here or already moving")
        if new == self.name:
            raise HandoverError(f"member {self.name}: cannot move group {group} to itself")
        self.old.gone.discard(group)
        out: List[Any] = [Send(new, Offer(group))] if offer else []
        return out + self.old.start(group, new, preds, version)

    def expect(self, group: int, old: str) -> None:
        if group in self.old.moving:
            raise HandoverError(f"member {self.name}: group {group} is expected while still moving out")
        self.new.expect(group, old)
        self.new.buffer[group] = self.early.pop(group, [])

    def on_offer(self, sender: str, msg: Offer) -> List[Any]:
        self.expect(msg.group, sender)
        return []

    def on_record(self, sender: str, group: int, record: Any) -> List[Any]:
        if group in self.old.moving:
            return self.old.on_record(sender, group, record)
        if group in self.new.owned or group in self.new.expected:
            return self.new.on_record(sender, group, record)
        self.early.setdefault(group, []).append((sender, record))
        return []

    def on_eos(self, msg: Eos, snapshot: Callable[[int], bytes]) -> List[Any]:
        return self._forgot(self.old.on_eos(msg, snapshot))

    def add_pred(self, pred: str) -> List[Any]:
        return self.old.add_pred(pred)

    def remove_pred(self, pred: str, snapshot: Callable[[int], bytes]) -> List[Any]:
        return self._forgot(self.old.remove_pred(pred, snapshot))

    def _forgot(self, out: List[Any]) -> List[Any]:
        for o in out:
            if isinstance(o, Forget):
                self.new.owned.discard(o.group)
        return out

    def on_chunk(self, sender: str, msg: StateChunk) -> List[Any]:
        out = self.new.on_chunk(sender, msg)
        if out:
            self.old.gone.discard(msg.group)
        return out

    def on_installed(self, msg: Installed) -> List[Any]:
        return self.old.on_installed(msg)

    # ---- saved with the keyed state (a crash mid-move must find the move where it was) ------------

    def to_json(self) -> Dict[str, Any]:
        """Everything of the moves under way, as JSON (records must be JSON values, as on the bus)."""
        o, n = self.old, self.new
        return {"name": self.name, "max_chunk": o.max_chunk,
                "moving": [[g, new, sorted(left), o.versions.get(g, -1)] for g, (new, left) in sorted(o.moving.items())],
                "gone": sorted(o.gone), "waiting_install": [list(x) for x in sorted(o.waiting_install.items())],
                "owned": sorted(n.owned), "expected": [list(x) for x in sorted(n.expected.items())],
                "parts": [[g, i, base64.b64encode(b).decode()] for g, p in sorted(n.parts.items()) for i, b in sorted(p.items())],
                "buffer": [[g, [list(r) for r in recs]] for g, recs in sorted(n.buffer.items())],
                "early": [[g, [list(r) for r in recs]] for g, recs in sorted(self.early.items())]}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Member":
        m = cls(str(d["name"]), (int(g) for g in d["owned"]), int(d["max_chunk"]))
        o, n = m.old, m.new
        for g, new, left, version in d["moving"]:
            o.moving[int(g)] = (str(new), {str(p) for p in left})
            o.versions[int(g)] = int(version)
        o.gone = {int(g) for g in d["gone"]}
        o.waiting_install = {int(g): int(k) for g, k in d["waiting_install"]}
        n.expected = {int(g): str(old) for g, old in d["expected"]}
        n.parts = {g: {} for g in n.expected}
        for g, i, b in d["parts"]:
            n.parts[int(g)][int(i)] = base64.b64decode(b)
        n.buffer = {int(g): [(str(s), r) for s, r in recs] for g, recs in d["buffer"]}
        m.early = {int(g): [(str(s), r) for s, r in recs] for g, recs in d["early"]}
        return m
