"""Common vocabulary of the group mutual exclusion (GME) cores: states, outputs, the node interface.

Rules of this file: nothing here knows a particular algorithm. A GME core is a pure state machine
driven by three inputs, `request()`, `exit()` and `receive(message)`, each returning the list of
outputs the driver must perform: `Send(to, message)` and, at most once per request, `Entered()`.
The core never sleeps, never reads a clock and never draws random numbers; the simulator, the
exhaustive checker and the MQTT benchmark are three drivers of the same code.

Messages are frozen dataclasses with a `sender` field and a `kind` class attribute, so that a
driver can count them by kind and encode them as small JSON dicts (`to_dict` / `message_from_dict`).
"""

from __future__ import annotations

import dataclasses
import enum
import reprlib
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Hashable, List, Mapping, NamedTuple, Sequence, Tuple, Type, Union

from agent.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "GmeState",
    "GmeMessage",
    "Send",
    "Entered",
    "Output",
    "GmeNode",
    "register_message",
    "message_from_dict",
    "INF",
    "LocalProtocolError",
    "RemoteProtocolError",
]

NodeId = int
Group = Hashable

# The clock value of "no request": larger than any real Lamport clock (thesis: <n_i, infinity>).
INF = float("inf")


class GmeState(enum.Enum):
    """What a node is doing with respect to the critical section (CS)."""

    IDLE = "idle"
    REQUESTING = "requesting"
    IN_CS = "in_cs"


@dataclass(frozen=True)
class GmeMessage:
    """Base of all GME messages. `kind` names the message for counting and encoding."""

    kind: ClassVar[str] = "?"
    sender: NodeId

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d


_REGISTRY: Dict[str, Type[GmeMessage]] = {}


def register_message(cls: Type[GmeMessage]) -> Type[GmeMessage]:
    """Class decorator: make `message_from_dict` able to decode `cls` (keyed by `cls.kind`)."""
    key = cls.__module__.rsplit(".", 1)[-1] + ":" + cls.kind
    _REGISTRY[key] = cls
    cls._registry_key = key  # type: ignore[attr-defined]
    return cls


def message_from_dict(d: Any, algorithm_module: str) -> GmeMessage:
    """Decode a dict produced by `to_dict`; `algorithm_module` is e.g. "gme_fgme".

    Untrusted input: any defect (not an object, unknown kind, missing or unknown field, a field
    of the wrong type) raises `RemoteProtocolError`, so that a core never compares, adds or
    indexes with a hostile value (a str clock, a list as sender, a vector of floats).
    """
    if not isinstance(d, Mapping):
        raise RemoteProtocolError(f"GME message for {algorithm_module}: expected an object, found {type(d).__name__}")
    kind = d.get("kind")
    cls = _REGISTRY.get(algorithm_module + ":" + kind) if isinstance(kind, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown GME message kind {_r(kind)} for {algorithm_module}")
    checks = _field_checks(cls)
    kwargs = {}
    for name, (what, check) in checks.items():
        if name not in d:
            raise RemoteProtocolError(f"{cls.__name__} message without field {name!r}: {_r(dict(d))}")
        v = d[name]
        v = tuple(v) if isinstance(v, list) else v
        if not check(v):
            raise RemoteProtocolError(f"{cls.__name__}.{name}: expected {what}, found {_r(v)}")
        kwargs[name] = v
    extra = sorted(str(k) for k in d if k != "kind" and k not in checks)
    if extra:
        raise RemoteProtocolError(f"{cls.__name__} message with unknown fields {_r(extra)}")
    return cls(**kwargs)


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, 60, 60
_r = _repr.repr


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


_CHECKS: Dict[Any, Tuple[str, Any]] = {
    int: ("an integer >= 0", _is_count),
    bool: ("true or false", lambda v: type(v) is bool),
    Tuple[int, ...]: ("a list of integers >= 0", lambda v: type(v) is tuple and all(_is_count(x) for x in v)),
}
# Node ids are ints (the GME benchmarks) or instance ids (lock-guarded scaling, agent.protocol.guarded).
_SENDER = ("a node id (integer or non-empty string)", lambda v: type(v) is int or (type(v) is str and v != ""))
_FIELD_CHECKS: Dict[type, Dict[str, Tuple[str, Any]]] = {}


def _field_checks(cls: Type[GmeMessage]) -> Dict[str, Tuple[str, Any]]:
    """Per field of `cls`: (what is expected, predicate), from its type annotations (cached)."""
    checks = _FIELD_CHECKS.get(cls)
    if checks is None:
        hints = typing.get_type_hints(cls)
        checks = {f.name: _SENDER if f.name == "sender" else _CHECKS[hints[f.name]] for f in dataclasses.fields(cls)}
        _FIELD_CHECKS[cls] = checks
    return checks


class Send(NamedTuple):
    """Output: deliver `message` to node `to` over the FIFO channel from this node.

    A NamedTuple rather than a frozen dataclass: it is just as immutable, and it is created once
    per message on the checker's hot path (10,000 schedules of ~500 messages in the test suite),
    where a tuple is about three times cheaper to build.
    """

    to: NodeId
    message: GmeMessage


@dataclass(frozen=True)
class Entered:
    """Output: this node is now in the critical section (the driver starts the CS timer)."""


Output = Union[Send, Entered]


class GmeNode:
    """Interface shared by 2-FGME, RA1 and RA2 nodes.

    `groups` maps every node id (including this one) to its group (the operator, or Joung's forum).
    Subclasses implement `_on_request`, `_on_exit` and `receive`.
    """

    algorithm: ClassVar[str] = "?"

    def __init__(self, node_id: NodeId, groups: Mapping[NodeId, Group]) -> None:
        if node_id not in groups:
            raise LocalProtocolError(f"node {node_id} is not in the group map {dict(groups)}")
        self.id: NodeId = node_id
        self.groups: Dict[NodeId, Group] = dict(groups)
        self.group: Group = groups[node_id]
        self.state: GmeState = GmeState.IDLE
        self.entries: int = 0  # completed CS entries; used by checkers and by RA2's counters

    # -- driver API -------------------------------------------------------------------------------

    def request(self) -> List[Output]:
        if self.state is not GmeState.IDLE:
            raise LocalProtocolError(f"node {self.id}: request() in state {self.state.name}, expected IDLE")
        self.state = GmeState.REQUESTING
        return self._on_request()

    def exit(self) -> List[Output]:
        if self.state is not GmeState.IN_CS:
            raise LocalProtocolError(f"node {self.id}: exit() in state {self.state.name}, expected IN_CS")
        self.state = GmeState.IDLE
        return self._on_exit()

    def receive(self, message: GmeMessage) -> List[Output]:  # pragma: no cover - abstract
        raise NotImplementedError

    def snapshot(self) -> Tuple[Any, ...]:  # pragma: no cover - abstract
        """A hashable value equal for two nodes that behave the same from now on (checker)."""
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------------------

    def _enter(self) -> List[Output]:
        self.state = GmeState.IN_CS
        self.entries += 1
        return [Entered()]

    def _on_request(self) -> List[Output]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _on_exit(self) -> List[Output]:  # pragma: no cover - abstract
        raise NotImplementedError

    def others(self) -> List[NodeId]:
        return sorted(n for n in self.groups if n != self.id)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} group={self.group!r} {self.state.name}>"


def two_groups(sizes: Sequence[int]) -> Dict[NodeId, int]:
    """Group map for consecutive node ids: sizes (6, 6) -> nodes 0..5 in group 0, 6..11 in 1."""
    groups: Dict[NodeId, int] = {}
    n = 0
    for g, size in enumerate(sizes):
        for _ in range(size):
            groups[n] = g
            n += 1
    return groups
