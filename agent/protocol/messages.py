"""Messages of the decentralized scaling protocol (Belkhiria & Tedeschi, Algorithms 4-10).

Rules of this file:
- one frozen dataclass per message type, all under `Message`; every message names its `sender`
  (an instance id) and the sender's pipeline `stage` (0 = source). The stage is not in the paper:
  the paper classifies a sender as successor or predecessor by looking it up in `succs`/`preds`,
  which fails on a new instance whose tables are still empty (it must park the change in
  `succsToAdd`/`predsToAdd` but cannot tell which). Carrying the stage makes that unambiguous.
- constructors validate their fields and raise `LocalProtocolError` (we built a bad message);
  `from_dict`/`from_json` validate untrusted input and raise `RemoteProtocolError` only, whatever
  the input (wrong type, missing key, unknown type, bad JSON).
- `to_dict()` is JSON-friendly (str, int, list, dict) and round-trips: `from_dict(m.to_dict()) == m`.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, Mapping, Tuple, Type, Union

from agent.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "Message",
    "Duplication",
    "DuplicationAck",
    "Start",
    "Deletion",
    "DeletionAck",
    "DataBatch",
    "PROTOCOL_TYPES",
    "MESSAGE_TYPES",
    "from_dict",
    "from_json",
]

Ids = Tuple[str, ...]

# Error messages quote untrusted values through reprlib: bounded length and depth, so a hostile
# value (a 900-deep list from JSON) cannot turn a RemoteProtocolError into a RecursionError.
_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, 60, 60
_r = _repr.repr


def _check_id(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise LocalProtocolError(f"{name}: expected a non-empty string, found {_r(value)}")


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LocalProtocolError(f"{name}: expected an integer >= 0, found {_r(value)}")


def _check_ids(name: str, value: Any) -> None:
    if not isinstance(value, tuple):
        raise LocalProtocolError(f"{name}: expected a tuple of ids, found {type(value).__name__}")
    for v in value:
        _check_id(name, v)
    if len(set(value)) != len(value):
        raise LocalProtocolError(f"{name}: ids must be unique, found {_r(value)}")


@dataclass(frozen=True)
class Message:
    """Base class: who sent it and from which pipeline stage."""

    sender: str
    stage: int

    type: ClassVar[str] = "message"

    def __post_init__(self) -> None:
        _check_id("sender", self.sender)
        _check_int("stage", self.stage)

    @classmethod
    def trusted(cls, **values: Any) -> "Message":
        """Build without validation: only for values a core already validated (hot path)."""
        obj = object.__new__(cls)
        obj.__dict__.update(values)
        return obj

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"type": self.type}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class _Round(Message):
    """A message that belongs to one scaling round of the `sender` (or echoes one, for acks)."""

    round: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("round", self.round)


@dataclass(frozen=True)
class Duplication(_Round):
    """Algorithm 4 line 12: 'I (sender) am creating `new_instances`, add them to your table'."""

    new_instances: Ids

    type: ClassVar[str] = "duplication"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_ids("new_instances", self.new_instances)
        if not self.new_instances:
            raise LocalProtocolError("new_instances: a duplication announces at least one instance")
        if self.sender in self.new_instances:
            raise LocalProtocolError("new_instances: must not contain the sender")


@dataclass(frozen=True)
class DuplicationAck(_Round):
    """Algorithm 5 line 14: 'my data path now knows your new siblings' (echoes the round)."""

    type: ClassVar[str] = "duplication_ack"


@dataclass(frozen=True)
class Start(Message):
    """Algorithm 6 line 5: activates a new sibling with its creator's current tables."""

    succs: Ids
    preds: Ids

    type: ClassVar[str] = "start"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_ids("succs", self.succs)
        _check_ids("preds", self.preds)


@dataclass(frozen=True)
class Deletion(_Round):
    """Algorithm 8 line 6: 'I (sender) am terminating, stop routing to me'."""

    type: ClassVar[str] = "deletion"


@dataclass(frozen=True)
class DeletionAck(_Round):
    """Algorithm 9 line 14: 'you are out of my table; everything I sent you precedes this ack'."""

    type: ClassVar[str] = "deletion_ack"


@dataclass(frozen=True)
class DataBatch(Message):
    """A batch of `count` records (the data plane, as modelled by the simulator and checker).

    Not handled by the scaling core: it only has to travel on the same FIFO channel as the
    protocol messages so that a `DeletionAck` overtakes no data (docs/design.md invariant 1).
    """

    seq: int
    count: int

    type: ClassVar[str] = "data"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("seq", self.seq)
        _check_int("count", self.count)


PROTOCOL_TYPES: Tuple[Type[Message], ...] = (Duplication, DuplicationAck, Start, Deletion, DeletionAck)
MESSAGE_TYPES: Dict[str, Type[Message]] = {cls.type: cls for cls in PROTOCOL_TYPES + (DataBatch,)}


def from_dict(data: Any) -> Message:
    """Build a message from untrusted JSON-like data; raise `RemoteProtocolError` on any defect."""
    if not isinstance(data, Mapping):
        raise RemoteProtocolError(f"message: expected a JSON object, found {type(data).__name__}")
    kind = data.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RemoteProtocolError(
            f"message: unknown type {_r(kind)}, expected one of {sorted(MESSAGE_TYPES)}"
        )
    names = [f.name for f in fields(cls)]
    missing = [n for n in names if n not in data]
    extra = sorted(str(k) for k in data if k not in names and k != "type")
    if missing or extra:
        raise RemoteProtocolError(f"{kind}: missing fields {missing}, unknown fields {extra}")
    kwargs: Dict[str, Any] = {}
    for n in names:
        v = data[n]
        kwargs[n] = tuple(v) if isinstance(v, list) else v
    try:
        return cls(**kwargs)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(f"{kind}: {exc}") from None
    except (TypeError, ValueError) as exc:  # pragma: no cover - defensive, fields are checked above
        raise RemoteProtocolError(f"{kind}: {exc}") from None


def from_json(raw: Union[str, bytes, bytearray]) -> Message:
    """Decode one JSON message; raise `RemoteProtocolError` on bad encoding or content."""
    try:
        data = json.loads(raw)
    except (ValueError, TypeError, RecursionError) as exc:
        raise RemoteProtocolError(f"message: not valid JSON ({exc})") from None
    return from_dict(data)
